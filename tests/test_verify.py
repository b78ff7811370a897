"""The verifier of what a file holds (verify.py), as inspect and quantize use it: every format's
stored contract from files we write, each rule refusing what it must, and a seeded run of
semantic mutations (tests/mutations.py) in which every damaging one is reported.

More mutations: COMFY_MODELOPT_FUZZ=5000 scripts/test.sh tests/test_verify.py
(the loader's own run, against a real ComfyUI: tests/comfyui/test_verify_loader.py)
"""
import collections
import os
import random

import pytest
import torch

from comfy_modelopt import cli
from comfy_modelopt.checkpoint import inspect_file
from comfy_modelopt.errors import ModelOptError, PlanError
from comfy_modelopt.pipeline import quantize_file
from comfy_modelopt.recipe import Recipe
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file
from comfy_modelopt.statsfile import save_stats
from comfy_modelopt.completeness import missing_layers
from comfy_modelopt.verify import verify_file
from mutations import mutate

FUZZ_CASES = int(os.environ.get("COMFY_MODELOPT_FUZZ", "400"))
RECIPES = {
    "fp8-w8a8": Recipe("float8_e4m3fn", weight_scale="absmax"),
    "int8-convrot": Recipe("int8_tensorwise", convrot=True, weight_scale="absmax"),
    "nvfp4": Recipe("nvfp4", weight_scale="absmax"),
    "mxfp8": Recipe("mxfp8"),
    "convrot_w4a4": Recipe("convrot_w4a4", weight_scale="absmax"),
    "nvfp4-lowrank": Recipe("nvfp4", lowrank=16, smoothing="awq", weight_scale="absmax"),
}


def stats_file(folder, flux_file):
    from comfy_modelopt.calibrate import calibrate
    from comfy_modelopt.synthetic import flux_layout
    from conftest import TINY_FLUX
    from helpers import LinearTree
    tree = LinearTree(flux_layout(**TINY_FLUX), scale_amax=10.0)
    return save_stats(calibrate(tree, lambda mod: [mod(i) for i in range(2)]), os.path.join(folder, "stats.safetensors"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every format's file (fp8 with static input scales, nvfp4 with a low-rank branch and AWQ)."""
    from comfy_modelopt.synthetic import flux_layout, write_checkpoint
    from conftest import TINY_FLUX
    folder = tmp_path_factory.mktemp("verify")
    src = str(folder / "flux-bf16.safetensors")
    # three blocks of each kind: a block's neighbours tell what it should hold (completeness)
    write_checkpoint(src, flux_layout(**dict(TINY_FLUX, depth=3, depth_single=3)), seed=1)
    stats = stats_file(str(folder), src)
    out = {"bf16": src}
    with torch.inference_mode():
        for name, recipe in RECIPES.items():
            out[name] = str(folder / f"{name}.safetensors")
            quantize_file(src, out[name], recipe, stats=stats if name in ("fp8-w8a8", "nvfp4-lowrank") else None)
    return out


def load(path):
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f.keys()}, dict(f.metadata)


@pytest.mark.parametrize("name", ["bf16"] + list(RECIPES))
def test_files_we_write_verify_clean(written, name):
    res = inspect_file(written[name], verify_values=True, deep=True)
    assert res.verification is not None and res.problems == [], res.problems
    assert res.verification.values_read > 0
    if name != "bf16":
        assert res.verification.layers > 0
    assert cli.main(["inspect", written[name], "--verify"]) == 0


def _edit(written, tmp_path, name, change):
    tensors, meta = load(written[name])
    change(tensors, meta)
    path = str(tmp_path / f"edited-{name}.safetensors")
    write_file(path, tensors, meta)
    return path


def _layer(tensors, part="img_attn.qkv"):
    return next(k[:-len(".comfy_quant")] for k in tensors if k.endswith(part + ".comfy_quant"))


def _set(key, value):
    def change(t, m):
        v = t[key(t)].clone()
        v.view(-1)[0] = value
        t[key(t)] = v
    return change


@pytest.mark.parametrize("name, change, rule", [
    ("fp8-w8a8", _set(lambda t: _layer(t) + ".weight_scale", float("nan")), r"weight_scale: must be finite and > 0, holds nan"),
    ("fp8-w8a8", _set(lambda t: _layer(t) + ".input_scale", -1.0), r"input_scale: must be finite and > 0, holds -1"),
    ("int8-convrot", _set(lambda t: _layer(t) + ".weight_scale", 0.0), r"weight_scale: must be finite and > 0, holds 0"),
    ("nvfp4", lambda t, m: t[_layer(t) + ".weight_scale"].view(torch.uint8).view(-1).__setitem__(3, 0xBC),
     r"weight_scale: holds 1 NaN or negative block-scale codes"),
    ("nvfp4", _set(lambda t: _layer(t) + ".weight_scale_2", float("inf")), r"weight_scale_2: must be finite"),
    ("mxfp8", lambda t, m: t[_layer(t) + ".weight_scale"].view(-1).__setitem__(0, 255), r"NaN \(E8M0 0xFF\)"),
    ("nvfp4-lowrank", _set(lambda t: _layer(t) + ".lowrank_up", float("nan")), r"lowrank_up: holds 1 NaN/Inf"),
    ("nvfp4-lowrank", _set(lambda t: _layer(t) + ".smooth_scale", 0.0), r"smooth_scale: must be finite and > 0"),
    ("fp8-w8a8", _set(lambda t: next(k for k in t if k.endswith("final_layer.linear.bias")), float("nan")),
     r"final_layer\.linear\.bias: holds 1 NaN/Inf"),
])
def test_values_refused_by_key_and_rule(written, tmp_path, name, change, rule):
    path = _edit(written, tmp_path, name, change)
    assert inspect_file(path).problems == []          # the header alone cannot tell
    problems = [str(p) for p in inspect_file(path, verify_values=True).problems]
    assert len(problems) == 1 and __import__("re").search(rule, problems[0]), problems
    with pytest.raises(ModelOptError, match=rule) as e:
        verify_file(path).raise_for(os.path.basename(path))
    assert str(e.value).startswith(os.path.basename(path) + ": ") and "\n" not in str(e.value)
    assert cli.main(["inspect", path, "--verify"]) == 1


def _drop(part):
    return lambda t, m: t.pop(_layer(t) + part)


def _conf(**fields):
    def change(t, m):
        import json
        layer = _layer(t)
        conf = dict(json.loads(t[layer + ".comfy_quant"].numpy().tobytes()), **fields)
        t[layer + ".comfy_quant"] = torch.frombuffer(bytearray(json.dumps(conf).encode()), dtype=torch.uint8)
        doc = json.loads(m["_quantization_metadata"])
        doc["layers"][layer] = conf
        m["_quantization_metadata"] = json.dumps(doc)
    return change


@pytest.mark.parametrize("name, change, rule", [
    ("fp8-w8a8", _drop(".weight_scale"), r"weight_scale: missing \(float8_e4m3fn layers store it\)"),
    ("nvfp4", _drop(".weight_scale_2"), r"weight_scale_2: missing"),
    ("nvfp4", _drop(".weight"), r"\.weight: missing: the layer's config says nvfp4"),
    ("fp8-w8a8", lambda t, m: t.__setitem__(_layer(t) + ".weight", t[_layer(t) + ".weight"].view(torch.uint8)),
     r"\.weight: is U8, a float8_e4m3fn layer stores F8_E4M3"),
    ("int8-convrot", lambda t, m: t.__setitem__(_layer(t) + ".weight_scale", t[_layer(t) + ".weight_scale"].reshape(1, -1)),
     r"weight_scale: has shape \[1, \d+\]"),
    ("fp8-w8a8", _conf(format=""), r"comfy_quant: unknown format ''"),
    ("fp8-w8a8", _conf(format="bogus"), r"unknown format 'bogus'"),
    ("nvfp4", _conf(group_size="x"), r"'group_size' must be 16 for nvfp4, got 'x'"),
    ("fp8-w8a8", _conf(orig_dtype=2 ** 40), r"'orig_dtype' must be the name of a float dtype"),
    ("int8-convrot", _conf(convrot_groupsize=7), r"'convrot_groupsize' must be a power of 4"),
    ("fp8-w8a8", _conf(format="int8_tensorwise"), r"is F8_E4M3, a int8_tensorwise layer stores I8"),
    ("nvfp4-lowrank", _conf(rank=3), r"lowrank_up: branch up .* does not fit"),
    ("nvfp4", lambda t, m: t.__setitem__(_layer(t) + ".smooth_scale", torch.ones(4)), r"smooth_scale: not part of a nvfp4 layer"),
    ("fp8-w8a8", lambda t, m: t.__setitem__("double_blocks.0.img_attn.proj.weight_scale_2", torch.ones(())),
     r"weight_scale_2: (not part of a|a quantization tensor)"),
    ("bf16", lambda t, m: t.__setitem__("double_blocks.0.img_mlp.0.weight", t["double_blocks.0.img_mlp.0.weight"].view(torch.int16)),
     r"img_mlp\.0\.weight: is I16"),
    ("bf16", lambda t, m: t.pop("double_blocks.0.img_mlp.0.weight"), r"img_mlp\.0\.weight: missing: the file has this layer's bias"),
])
def test_structure_refused_from_the_header(written, tmp_path, name, change, rule):
    path = _edit(written, tmp_path, name, change)
    problems = [str(p) for p in inspect_file(path).problems]
    assert any(__import__("re").search(rule, p) for p in problems), problems
    assert cli.main(["inspect", path]) == 1


def test_header_and_tensor_configs_must_agree(written, tmp_path):
    def change(t, m):
        import json
        doc = json.loads(m["_quantization_metadata"])
        doc["layers"][_layer(t)]["full_precision_matrix_mult"] = True
        m["_quantization_metadata"] = json.dumps(doc)
    problems = [str(p) for p in inspect_file(_edit(written, tmp_path, "fp8-w8a8", change)).problems]
    assert problems and "differs from the layer's entry in _quantization_metadata" in problems[0], problems


def test_missing_layers_in_blocks(written):
    keys = load(written["bf16"])[0]
    assert missing_layers(keys) == []
    from comfy_modelopt.synthetic import flux_layout
    full = flux_layout(hidden=256, depth=4, depth_single=3, context_in=256, vec_in=256)
    for drop in ("double_blocks.2.txt_mlp.2", "double_blocks.0.img_attn.qkv", "single_blocks.1.linear1"):
        left = {k: v for k, v in full.items() if not k.startswith(drop + ".")}
        assert [p.key for p in missing_layers(left)] == [drop + ".weight"], drop


def test_quantize_refuses_an_incomplete_source(written, tmp_path):
    from comfy_modelopt.synthetic import flux_layout, write_checkpoint
    src = str(tmp_path / "four-blocks.safetensors")
    write_checkpoint(src, flux_layout(hidden=256, depth=4, depth_single=3, context_in=256, vec_in=256), seed=1)
    tensors, meta = load(src)
    for k in [k for k in tensors if k.startswith("double_blocks.2.img_mlp.0.")]:
        del tensors[k]
    bad = str(tmp_path / "incomplete.safetensors")
    write_file(bad, tensors, meta)
    out = str(tmp_path / "o.safetensors")
    with pytest.raises(PlanError, match=r"incomplete\.safetensors: double_blocks\.2\.img_mlp\.0\.weight: missing.*"
                                        r"--family generic") as e:
        quantize_file(bad, out, Recipe("float8_e4m3fn", weight_scale="absmax"))
    assert "\n" not in str(e.value) and not os.path.exists(out)
    quantize_file(bad, out, Recipe("float8_e4m3fn", weight_scale="absmax"), family="generic")  # the way past


def test_quantize_refuses_a_relabelled_weight(written, tmp_path):
    tensors, meta = load(written["bf16"])
    key = "double_blocks.0.img_mlp.0.weight"
    tensors[key] = tensors[key].view(torch.int16)
    bad = str(tmp_path / "relabelled.safetensors")
    write_file(bad, tensors, meta)
    with pytest.raises(PlanError, match=r"relabelled\.safetensors: double_blocks\.0\.img_mlp\.0\.weight: is I16"):
        quantize_file(bad, str(tmp_path / "o.safetensors"), Recipe("float8_e4m3fn"))


def test_statistics_with_nonfinite_activations_warned_by_layer(written, tmp_path):
    from comfy_modelopt.statsfile import load_stats
    stats = load_stats(stats_file(str(tmp_path), written["bf16"]))
    name = sorted(stats.layers)[0]
    stats.layers[name].nonfinite = 7
    rep = quantize_file(written["bf16"], str(tmp_path / "o.safetensors"), Recipe("float8_e4m3fn", weight_scale="absmax"),
                        stats=stats)
    assert any(f"NaN/Inf activations in 1 layers (e.g. {name}: 7 values" in n for n in rep.notes), rep.notes


def test_output_errors_name_the_output(written, tmp_path, monkeypatch):
    import comfy_modelopt.safetensors_io as io
    from comfy_modelopt.errors import OutputError

    def full(fd, size, path):
        raise OutputError(28, f"no space left for {path} (0.01 GiB needed)")
    monkeypatch.setattr(io, "reserve", full)
    with pytest.raises(OutputError) as e:
        quantize_file(written["bf16"], str(tmp_path / "out.safetensors"), Recipe("float8_e4m3fn"))
    assert not str(e.value).startswith("flux-bf16") and "out.safetensors" in str(e.value).split(":")[0] + str(e.value)


# ============================================================== the seeded semantic fuzz
def test_semantic_mutations_are_reported(written, tmp_path):
    originals = {name: load(written[name]) for name in RECIPES}
    rng = random.Random(2026)
    outcomes = collections.Counter()
    silent = []
    for i in range(FUZZ_CASES):
        name = list(RECIPES)[i % len(RECIPES)]
        mut = mutate(*originals[name], rng)
        path = str(tmp_path / f"m{i % 8}.safetensors")
        write_file(path, mut.tensors, mut.metadata, overwrite=True)
        try:
            found = inspect_file(path, verify_values=True).problems
        except ModelOptError as e:  # only our errors, one line, naming the file
            assert "\n" not in str(e) and os.path.basename(path) in str(e), str(e)
            outcomes["refused (unreadable)"] += 1
            continue
        outcomes["reported" if found else "clean"] += 1
        if mut.refuse == "all" and not found:
            silent.append(f"{name}: {mut.label}")
        if found:
            with pytest.raises(ModelOptError) as e:
                verify_file(path).raise_for(os.path.basename(path))
            assert "\n" not in str(e.value) and str(e.value).startswith(os.path.basename(path) + ": ")
    print(f"\n{FUZZ_CASES} mutations: {dict(outcomes)}; damaging ones reported as clean: {len(silent)}")
    assert not silent, f"{len(silent)} damaging mutations reported as a clean file, e.g. {silent[:5]}"
    assert outcomes["reported"] > FUZZ_CASES // 2, outcomes


@pytest.mark.parametrize("codes", ["E4M3_NAN", "E5M2_NAN", "E4M3_NAN_OR_NEGATIVE", "E8M0_NAN"])
def test_byte_code_bounds_agree_with_the_codes(codes):
    """The two-reduction fast path of nan_code_problem finds exactly the bytes the codes name:
    every byte value, alone among clean ones."""
    import comfy_modelopt.formats.base as base
    forbidden = getattr(base, codes)
    for v in range(256):
        t = torch.tensor([0, 1, 0x10, v], dtype=torch.uint8)
        assert (base.nan_code_problem(t, forbidden, "x") is not None) == any((v & m) == c for m, c in forbidden), v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_finite_check_finds_every_nonfinite(dtype):
    from comfy_modelopt.verify import _finite_problem
    x = torch.randn(4097).to(dtype)
    assert _finite_problem(x) is None
    assert _finite_problem(torch.full((8,), 6e4 if dtype == torch.float16 else 3e38, dtype=dtype)) is None  # sums overflow
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[4000] = bad
        assert _finite_problem(y) == "holds 1 NaN/Inf values (of 4097)"


def test_formats_only_the_runtime_knows_are_left_to_it(written):
    from comfy_modelopt.fileformat import decode_comfy_quant
    from comfy_modelopt.verify import state_dict_entries, verify
    tensors, meta = load(written["fp8-w8a8"])
    layer = _layer(tensors)
    conf = torch.frombuffer(bytearray(b'{"format": "awq_w4a16"}'), dtype=torch.uint8)
    tensors[layer + ".comfy_quant"] = conf
    meta.pop("_quantization_metadata")
    run = lambda formats: verify(state_dict_entries(tensors), meta, tensors.__getitem__,  # noqa: E731
                                 lambda k: decode_comfy_quant(tensors[k], k), runtime_formats=formats).problems
    assert [p.key for p in run(())] == [layer + ".comfy_quant"]
    assert run(("awq_w4a16",)) == []


def test_nvfp4_zero_block_scale_only_over_zero_codes():
    """kitchen writes a block scale of zero for a block of zeros, and only there: a zero scale over
    codes that are not zero (a zeroed or damaged scale) silences the block and is refused, found
    through kitchen's own unswizzle of the stored scales."""
    from comfy_kitchen.tensor import QuantizedTensor
    from comfy_modelopt.formats import FORMATS
    from comfy_modelopt.formats.base import kitchen_reference
    fmt = FORMATS["nvfp4"]
    w = torch.randn(300, 128, generator=torch.Generator().manual_seed(0))
    w[7, 32:48] = 0  # one block of zeros: kitchen gives it a zero scale
    with kitchen_reference():
        q = QuantizedTensor.from_float(w, fmt.layout)
    weight, scale = q._qdata, q._params.block_scale
    assert fmt.scales_problem({"_scale": scale}, lambda: weight) is None
    flat = scale.clone().view(torch.uint8).reshape(-1)
    assert int((flat == 0).sum()) > 0  # the zero block (and the padding) hold zero scales
    flat[int((flat != 0).nonzero()[0, 0])] = 0
    found = fmt.scales_problem({"_scale": flat.view(scale.dtype).reshape(scale.shape)}, lambda: weight)
    assert found is not None and found.startswith("1 block scales of zero over blocks whose codes are not zero")


def test_lowrank_smoothing_with_statistics_of_some_layers(written, tmp_path):
    """Statistics that cover only some layers (here block 0 of three): a low-rank file with
    smoothing writes every planned smooth_scale - ones where no statistics ran (it raised "26
    planned tensors were never written") - and verifies clean."""
    tensors, _ = load(written["nvfp4-lowrank"])
    lowrank = [k[:-len(".lowrank_up")] for k in tensors if k.endswith(".lowrank_up")]
    assert lowrank and all(layer + ".smooth_scale" in tensors for layer in lowrank)
    assert torch.equal(tensors["double_blocks.2.img_attn.qkv.smooth_scale"], torch.ones(256))
    assert not verify_file(written["nvfp4-lowrank"]).problems


def _source_mutation(t: dict, rng: random.Random):
    """A damaged 16-bit source: (tensors, label, whether quantize must refuse it from the file alone)."""
    from mutations import _repeated
    t = dict(t)
    key = rng.choice(sorted(t))
    kind = rng.randrange(4)
    if kind == 0:  # a tensor left out
        del t[key]
        return t, f"drop {key}", _repeated(key, t)
    if kind == 1:  # a layer resized consistently (its bias with it)
        layer = key.rpartition(".")[0]
        n = t[key].shape[0]
        keep = max(1, n // 2)
        for k in [k for k in t if k.rpartition(".")[0] == layer and t[k].dim() and t[k].shape[0] == n]:
            t[k] = t[k][:keep].clone()
        return t, f"resize {layer} to {keep}", _repeated(key, t)
    if kind == 2:  # a bias (or any 1-D tensor) of one value
        ones = [k for k in t if k.endswith(".bias")]
        key = rng.choice(ones)
        t[key] = t[key][:1].clone()
        return t, f"{key} of one value", True
    # a weight outside the blocks resized to widths the model has nowhere
    top = [k for k in t if t[k].dim() == 2 and not any(p.isdigit() for p in k.split("."))]
    key = rng.choice(top)
    t[key] = torch.zeros(17, 3, dtype=t[key].dtype)
    layer = key.rpartition(".")[0]
    if layer + ".bias" in t:
        t[layer + ".bias"] = torch.zeros(17, dtype=t[key].dtype)
    return t, f"{key} as [17, 3]", True


def test_semantic_source_mutations_refused_by_quantize(written, tmp_path):
    """quantize on a damaged 16-bit source: a tensor left out of a block, a layer resized in a
    block, a bias of one value, a final or embedding layer of widths the model has nowhere - each
    refused before any work, one line naming the file and the key (none written)."""
    tensors, meta = load(written["bf16"])
    rng = random.Random(64)
    silent, outcomes = [], collections.Counter()
    for i in range(max(50, FUZZ_CASES // 8)):
        t, label, must = _source_mutation(tensors, rng)
        src, out = str(tmp_path / "src.safetensors"), str(tmp_path / "out.safetensors")
        write_file(src, t, meta, overwrite=True)
        try:
            quantize_file(src, out, Recipe("float8_e4m3fn", weight_scale="absmax"), overwrite=True)
            outcomes["quantized"] += 1
            if must:
                silent.append(label)
        except ModelOptError as e:
            assert "\n" not in str(e) and str(e).startswith("src.safetensors: "), str(e)
            outcomes["refused"] += 1
    print(f"\n{dict(outcomes)}")
    assert not silent, f"{len(silent)} damaged sources quantized, e.g. {silent[:5]}"
