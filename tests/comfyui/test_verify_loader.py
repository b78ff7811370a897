"""Load Quantized Model (``ownloader.load_file``) against damaged files, on a real ComfyUI tree
(COMFYUI_PATH): every file we write in every format, put through seeded semantic mutations
(tests/mutations.py), is either refused with our own one-line error naming the file, or loads
into a model whose every parameter is finite and whose forward pass is finite - and no mutation
that damages the model loads.

More mutations: COMFY_MODELOPT_FUZZ=5000 COMFYUI_PATH=... python -m pytest tests/comfyui/test_verify_loader.py
"""
from __future__ import annotations

import collections
import os
import random
import struct
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # mutations.py, helpers.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: the loader's damaged-file tests SKIPPED (point it at a ComfyUI "
                "v0.29+ tree)", allow_module_level=True)

models.setup_comfy()
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402
from comfy.quant_ops import QuantizedTensor  # noqa: E402

from comfy_modelopt.comfyui import ownloader  # noqa: E402
from comfy_modelopt.errors import ModelOptError  # noqa: E402
from comfy_modelopt.pipeline import quantize_file  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file  # noqa: E402
from mutations import mutate  # noqa: E402

FUZZ_CASES = int(os.environ.get("COMFY_MODELOPT_FUZZ", "240"))
RECIPES = {
    "fp8-w8a8": ("flux", Recipe("float8_e4m3fn", weight_scale="absmax"), True),
    "int8-convrot": ("flux", Recipe("int8_tensorwise", convrot=True, weight_scale="absmax"), False),
    "nvfp4": ("flux", Recipe("nvfp4", weight_scale="absmax"), False),
    "mxfp8": ("flux", Recipe("mxfp8"), False),
    "convrot_w4a4": ("flux", Recipe("convrot_w4a4", weight_scale="absmax", convrot_groupsize=64), False),
    "nvfp4-lowrank": ("flux", Recipe("nvfp4", lowrank=16, smoothing="awq", weight_scale="absmax"), True),
    "fp8-conv": ("sd15", Recipe("float8_e4m3fn", conv="fp8", weight_scale="absmax"), False),
}
INPUTS = {
    "flux": lambda g: dict(x=torch.randn(1, 16, 16, 16, generator=g), c_crossattn=torch.randn(1, 8, 256, generator=g),
                           y=torch.randn(1, 256, generator=g), guidance=torch.tensor([3.5])),
    "sd15": lambda g: dict(x=torch.randn(1, 4, 16, 16, generator=g), c_crossattn=torch.randn(1, 8, 768, generator=g)),
}


def _stats(sd: dict, folder: str):
    from comfy_modelopt.calibrate import calibrate
    from helpers import LinearTree
    tree = LinearTree({k: tuple(v.shape) for k, v in sd.items()}, scale_amax=10.0)
    return calibrate(tree, lambda mod: [mod(i) for i in range(2)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loader")
    out = {}
    with torch.inference_mode():
        for family in ("flux", "sd15"):
            _, sd = models.build(family, "small", seed=1)
            src = str(folder / f"{family}-bf16.safetensors")
            write_file(src, sd)
            stats = _stats(sd, str(folder)) if family == "flux" else None
            for name, (fam, recipe, with_stats) in RECIPES.items():
                if fam == family:
                    out[name] = (family, str(folder / f"{name}.safetensors"))
                    quantize_file(src, out[name][1], recipe, stats=stats if with_stats else None)
    return out


def load(path):
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f.keys()}, dict(f.metadata)


def sane(patcher, family: str) -> str | None:
    """Why a loaded model is not one a sampler may run (non-finite parameter or output), or None."""
    for name, p in patcher.model.diffusion_model.named_parameters():
        v = p.dequantize() if isinstance(p, QuantizedTensor) else p
        if v.is_floating_point() and not bool(torch.isfinite(v.float()).all()):  # fp8 convolutions: raw fp8
            return f"{name} is not finite"
    comfy.model_management.load_models_gpu([patcher])
    kw = INPUTS[family](torch.Generator().manual_seed(0))
    x = kw.pop("x")
    with torch.inference_mode():
        out = patcher.model.apply_model(x, torch.tensor([0.7]), **kw)
    return None if bool(torch.isfinite(out).all()) else "the forward pass is not finite"


@pytest.mark.parametrize("name", list(RECIPES))
def test_files_we_write_load_verified(files, name):
    family, path = files[name]
    patcher = ownloader.load_file(path)
    checked = patcher.modelopt_verification
    assert checked.ok and checked.values and checked.layers > 0 and checked.values_read > 0
    assert sane(patcher, family) is None


def _write(tmp_path, tensors, meta, name="bad.safetensors"):
    path = str(tmp_path / name)
    write_file(path, tensors, meta, overwrite=True)
    return path


def _refused(path, match):
    with pytest.raises(ModelOptError, match=match) as e:
        ownloader.load_file(path)
    text = str(e.value)
    assert "\n" not in text and text.startswith(os.path.basename(path) + ": "), text


def test_dropped_scale_named(files, tmp_path):
    tensors, meta = load(files["fp8-w8a8"][1])
    key = next(k for k in tensors if k.endswith("img_attn.qkv.weight_scale"))
    del tensors[key]
    _refused(_write(tmp_path, tensors, meta), rf"{key}: missing \(float8_e4m3fn layers store it\)")


def test_dropped_16bit_layer_named_by_the_model(files, tmp_path):
    tensors, meta = load(files["nvfp4"][1])
    for k in [k for k in tensors if k.startswith("final_layer.linear.")]:
        del tensors[k]  # not in a block: only the model ComfyUI builds knows it is missing
    _refused(_write(tmp_path, tensors, meta), r"final_layer\.linear\.(weight|bias): missing - the model ComfyUI "
                                              r"detected needs it")


def test_extra_layer_named(files, tmp_path):
    tensors, meta = load(files["int8-convrot"][1])
    # of the model's widths (a [4, 4] one the file's own structure already refuses)
    tensors["final_layer.extra.weight"] = torch.zeros_like(tensors["final_layer.linear.weight"])
    _refused(_write(tmp_path, tensors, meta), r"final_layer\.extra\.weight: a layer the model ComfyUI detected does not have")


def test_comfyui_errors_come_back_as_ours(files, tmp_path):
    tensors, meta = load(files["fp8-w8a8"][1])
    # a 16-bit layer resized consistently (its bias with it: the file's own structure holds), which
    # ComfyUI's load_state_dict fails on
    for key in ("final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias"):
        tensors[key] = tensors[key][:-2].clone()
    _refused(_write(tmp_path, tensors, meta), r"ComfyUI could not build the model from it: .*size mismatch")


def test_conv_config_without_shape_named(files, tmp_path):
    import json
    tensors, meta = load(files["fp8-conv"][1])
    key = next(k for k in tensors if k.endswith(".comfy_quant") and b"modelopt_conv_fp8" in tensors[k].numpy().tobytes())
    tensors[key] = torch.frombuffer(bytearray(json.dumps({"format": "modelopt_conv_fp8"}).encode()), dtype=torch.uint8)
    doc = json.loads(meta["_quantization_metadata"])
    doc["layers"][key[:-len(".comfy_quant")]] = {"format": "modelopt_conv_fp8"}
    meta["_quantization_metadata"] = json.dumps(doc)
    _refused(_write(tmp_path, tensors, meta), r"comfy_quant: modelopt_conv_fp8 config: 'shape' must be")


def test_oversized_config_refused(files, tmp_path):
    tensors, meta = load(files["nvfp4"][1])
    key = next(k for k in tensors if k.endswith(".comfy_quant"))
    tensors[key] = torch.full((1 << 20,), ord(" "), dtype=torch.uint8)
    meta.pop("_quantization_metadata")
    _refused(_write(tmp_path, tensors, meta), r"comfy_quant: 1048576 bytes, too large for a layer config")


def test_huge_claimed_tensor_refused_before_reading(tmp_path):
    """A sparse file as large as its header claims (a 10^12-element tensor): refused from the header."""
    import json
    n = 10 ** 12
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * n)
    _refused(str(path), r"w: F32\[1000000000000\] needs 3725\.3 GiB of memory")


def test_semantic_mutations_never_load_damaged(files, tmp_path):
    originals = {name: (files[name][0], load(files[name][1])) for name in RECIPES}
    rng = random.Random(37)
    outcomes, silent, insane = collections.Counter(), [], []
    t0 = time.perf_counter()
    for i in range(FUZZ_CASES):
        name = list(RECIPES)[i % len(RECIPES)]
        family, (tensors, meta) = originals[name]
        mut = mutate(tensors, meta, rng)
        path = _write(tmp_path, mut.tensors, mut.metadata, f"m{i % 4}.safetensors")
        try:
            patcher = ownloader.load_file(path)
        except ModelOptError as e:
            text = str(e)
            assert "\n" not in text and text.startswith(os.path.basename(path) + ": "), text
            outcomes["refused"] += 1
            continue
        # anything else escaping is a traceback that is not ours: the test fails on it
        outcomes["loaded"] += 1
        if mut.refuse:
            silent.append(f"{name}: {mut.label}")
        elif (why := sane(patcher, family)) is not None:
            insane.append(f"{name}: {mut.label}: {why}")
        del patcher
    print(f"\n{FUZZ_CASES} mutations in {time.perf_counter() - t0:.0f}s: {dict(outcomes)}")
    assert not silent, f"{len(silent)} damaging mutations loaded, e.g. {silent[:5]}"
    assert not insane, f"{len(insane)} loaded models a sampler must not run, e.g. {insane[:5]}"
    assert outcomes["refused"] > FUZZ_CASES // 2, outcomes


def test_dynamic_vram_server_loads_a_model_that_fits_resident(files, monkeypatch):
    """Under ComfyUI's dynamic VRAM (a server's default on NVIDIA: main.py makes CoreModelPatcher
    the dynamic kind) a model that takes at most half the GPU next to ComfyUI's reserve is built the
    classic way - the kind this pack's kernels run on - and a larger one keeps dynamic VRAM; a
    rebuild that asks for a kind gets it."""
    import comfy.model_patcher as mp
    asked = []
    real = comfy.sd.load_diffusion_model_state_dict

    def spy(sd, **kwargs):
        asked.append(kwargs.get("disable_dynamic"))
        return real(sd, **{**kwargs, "disable_dynamic": True})  # a dynamic patcher needs a CUDA device
    monkeypatch.setattr(comfy.sd, "load_diffusion_model_state_dict", spy)
    assert not ownloader.dynamic_vram_on()
    ownloader.load_file(files["fp8-w8a8"][1])
    assert asked == [None]  # not a dynamic server: ComfyUI's own default, untouched
    monkeypatch.setattr(mp, "CoreModelPatcher", mp.ModelPatcherDynamic)
    assert ownloader.dynamic_vram_on()
    patcher = ownloader.load_file(files["fp8-w8a8"][1])
    assert asked[-1] is True and not patcher.is_dynamic()
    size = os.path.getsize(files["fp8-w8a8"][1])
    # the GPU's memory as ComfyUI reads it, too small for the model next to its inference reserve
    monkeypatch.setattr(comfy.model_management, "get_total_memory",
                        lambda *a, **k: comfy.model_management.minimum_inference_memory() + size)
    ownloader.load_file(files["fp8-w8a8"][1])
    assert asked[-1] is False
    ownloader.load_file(files["fp8-w8a8"][1], disable_dynamic=True)  # ComfyUI's non-dynamic rebuild
    assert asked[-1] is True
