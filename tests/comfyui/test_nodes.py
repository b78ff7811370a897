"""The nodes in-process against a real ComfyUI tree (COMFYUI_PATH): input MODEL untouched, LoRA
baked in, ComfyUI quantized modules of the chosen format, save -> reload identical, errors."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import statistics
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # architectures.py
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI node tests SKIPPED (point it at a ComfyUI v0.29+ tree)",
                allow_module_level=True)

models.setup_comfy()
import comfy.sd  # noqa: E402
import folder_paths  # noqa: E402
from comfy.quant_ops import QuantizedTensor  # noqa: E402

from comfy_modelopt.safetensors_io import SafetensorsFile, write_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


PACK = "comfy_modelopt_nodepack"


def load_pack():
    """Import the node pack the way ComfyUI's loader does (folder __init__.py as a package)."""
    name = PACK
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "__init__.py"),
                                                      submodule_search_locations=[ROOT])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name + ".comfy_modelopt.comfyui.nodes"]


def runner_of(model):
    """The pack's CUDA-graph runner on ``model`` (its APPLY_MODEL wrapper), or None."""
    from comfy.patcher_extension import WrappersMP
    return next(iter(model.get_wrappers(WrappersMP.APPLY_MODEL, "comfy_modelopt_cuda_graphs")), None)


def pack_module(name: str):
    """A module of the pack as ComfyUI loaded it (its own copy of comfy_modelopt.comfyui.*)."""
    load_pack()
    return sys.modules[PACK + ".comfy_modelopt.comfyui." + name]


def save(path, sd):
    return write_file(str(path), sd, overwrite=True)


def write_sd15_files(d) -> None:
    """A small SD1.x diffusion model and its CLIP-L text encoder as files in folder ``d``."""
    save(str(d / "clip_l.safetensors"), models.clip_l_state_dict())
    _, sd = models.build("sd15", "small", seed=1)
    save(str(d / "sd15.safetensors"), sd)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes")
    write_sd15_files(d)
    folder_paths.set_user_directory(str(d / "user"))  # what the pack keeps there (compiled code) stays here
    folder_paths.add_model_folder_path("diffusion_models", str(d / "diffusion_models"), is_default=True)
    os.makedirs(d / "diffusion_models", exist_ok=True)
    nodes = load_pack()
    clip = comfy.sd.load_clip([str(d / "clip_l.safetensors")], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    model = comfy.sd.load_diffusion_model(str(d / "sd15.safetensors"))
    with torch.inference_mode():
        stats, summary = nodes.ModelOptCalibrationHelper.execute(
            model=model, clip=clip, prompts="a red fox in snow\na city at night\na bowl of soup",
            negative_prompt="blurry", num_prompts=2, steps=3, cfg=4.0, sampler_name="euler", scheduler="simple",
            width=64, height=64, seed=0, guidance=0.0, samples_mib_per_layer=0.5, save_name="").args
    return {"dir": d, "nodes": nodes, "clip": clip, "model": model, "stats": stats, "summary": summary}


def quantize(env, model=None, chart=False, **kw):
    args = dict(model=model or env["model"], format="float8_e4m3fn", weight_scale="absmax", input_scale="mse",
                smoothing="none", gptq=False, convrot=False, static_nvfp4_input=False, keep="",
                calibration=env["stats"])
    args.update(kw)
    with torch.inference_mode():
        out = env["nodes"].ModelOptQuantizeUNet.execute(**args).args
    return out if chart else out[:2]


def test_quantize_node_offers_every_recipe_field():
    """One schema: each recipe field is one input of Quantize Model with the recipe's default
    (combo choices, bounds), in an order that only grows at the end (saved UI workflows store
    widget values by position); the node with only its required inputs builds Recipe()."""
    import dataclasses
    nodes = load_pack()
    Recipe = sys.modules[PACK + ".comfy_modelopt.recipe"].Recipe  # the pack's copy, as ComfyUI imported it
    schema = nodes.ModelOptQuantizeUNet.define_schema()
    ids = [i.id for i in schema.inputs]
    recipe_fields = [f.name for f in dataclasses.fields(Recipe)]
    assert sorted(i for i in ids if i in recipe_fields) == sorted(recipe_fields)
    assert ids[:14] == ["model", "format", "calibration", "weight_scale", "input_scale", "smoothing", "gptq",
                        "convrot", "lowrank", "conv", "static_nvfp4_input", "keep", "budget", "max_error"]
    assert ids[14:17] == ["runtime", "dequant_cache_gib", "gptq_act_order"]
    default = Recipe()
    for i in schema.inputs:
        if i.id in recipe_fields and not isinstance(default.__getattribute__(i.id), tuple):
            assert i.default == getattr(default, i.id), i.id
    required = {i.id: i.default for i in schema.inputs if i.id in recipe_fields and not i.optional}
    assert nodes.recipe_from_values(required) == default
    assert nodes.recipe_from_values({"keep": "a.*\nb.*, c.*", "candidates": "nvfp4,int8_tensorwise",
                                   "budget": 0.4, "format": "int8_tensorwise", "convrot": True}) == \
        Recipe(format="int8_tensorwise", convrot=True, keep=("a.*", "b.*", "c.*"), budget=0.4,
               candidates=("nvfp4", "int8_tensorwise"))


def test_every_input_explained_in_a_screenful_without_figures(env):
    """Every input of every node has a tooltip that says what to choose, fits on a screen (<= 300
    characters) and quotes no measured figure - ratios, timings, GPUs live in docs/benchmarks.md."""
    import re
    figure = re.compile(r"\d(\.\d+)?x\b|\bH[12]00\b|\d+(\.\d+)? ?(s|ms)\b|\d%")
    bad = []
    for cls in env["nodes"].NODES:
        schema = cls.define_schema()
        for i in schema.inputs:
            tip = getattr(i, "tooltip", None) or ""
            if not tip or len(tip) > 300 or figure.search(tip):
                bad.append(f"{schema.node_id}.{i.id}: {len(tip)} chars {figure.search(tip).group(0) if figure.search(tip) else ''}")
    assert not bad, bad


def test_compare_images_shows_where_the_picture_changed():
    """Compare Images: the 16-bit image, the quantized one and their amplified difference in one
    picture per batch item; the numbers are the images' (PSNR from their mean squared error); images
    of different sizes are refused naming both."""
    nodes = load_pack()
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(2, 40, 48, 3, generator=g)
    q = ref.clone()
    q[1, 10:20, 10:20] = (q[1, 10:20, 10:20] + 0.2).clamp(0, 1)
    pictures, summary = nodes.ModelOptCompareImages.execute(quantized=q, reference=ref).args
    assert pictures.shape[0] == 2 and pictures.shape[2] == 3 * 48 + 2 * 8 and pictures.shape[-1] == 3
    first, second = summary.splitlines()
    assert "PSNR inf dB" in first and "0.00% of pixels" in first
    psnr = 10 * torch.log10(1 / ((q[1].double() - ref[1].double()) ** 2).mean())
    assert f"PSNR {float(psnr):.2f} dB" in second
    # the difference panel (right) is dark outside the changed square and bright inside it
    head = pictures.shape[1] - 40  # the images sit under the header
    diff = pictures[1, head:, 2 * (48 + 8):]
    assert diff[10:20, 10:20].mean() > 0.3 and diff[25:, 25:].max() == 0
    with pytest.raises(nodes.NodeError, match=r"quantized \(1, 40, 48, 3\), 16-bit \(1, 32, 48, 3\)"):
        nodes.ModelOptCompareImages.execute(quantized=q[:1], reference=ref[:1, :32])


def test_calibration_covers_the_trajectory(env):
    st = env["stats"]
    assert st.forward_calls == 2 * 3  # prompts x steps (cond and uncond batched per call)
    assert len(st.info["sigmas"]) == 4 and st.info["prompts"] == 2
    assert not st.never_ran() and "calibrated 80/80" in env["summary"]
    # the summary says how many rows GPTQ would have per layer, and names a layer short of them
    rows = st.sampled_rows()
    assert f"sampled input rows per layer: {rows['sampled_rows_min']}-{rows['sampled_rows_max']}" in env["summary"]
    assert (f"fewest: {rows['fewest_rows_per_input']}" in env["summary"]) == bool(rows["layers_fewer_rows_than_inputs"])


def test_calibration_never_samples_through_cuda_graphs(env):
    """A MODEL with this pack's CUDA graphs (runtime + cuda graphs, or the CUDA Graphs node) is
    calibrated without them: a replay would skip the Python statistics hooks.  (Here on the CPU
    the graph runner would only run eagerly - its call count shows whether it was used.)"""
    graphed = env["nodes"].ModelOptCudaGraphs.execute(model=env["model"]).args[0]
    runner = runner_of(graphed)
    with torch.inference_mode():
        stats, _ = env["nodes"].ModelOptCalibrationHelper.execute(
            model=graphed, clip=env["clip"], prompts="a red fox in snow", negative_prompt="", num_prompts=1,
            steps=2, cfg=4.0, sampler_name="euler", scheduler="simple", width=64, height=64, seed=0,
            guidance=0.0, samples_mib_per_layer=0.5, save_name="").args
    assert runner.eager_calls == runner.replays == runner.captures == 0
    assert stats.forward_calls == 2 and not stats.never_ran()
    assert runner_of(graphed) is runner  # the input MODEL keeps its graphs


def _calibrate_with(env, **kw):
    args = dict(model=env["model"], clip=env["clip"], prompts="a red fox in snow\na city at night",
                negative_prompt="blurry", num_prompts=2, steps=2, cfg=4.0, sampler_name="euler", scheduler="simple",
                width=64, height=64, seed=0, guidance=0.0, samples_mib_per_layer=0.5, save_name="")
    args.update(kw)
    with torch.inference_mode():
        return env["nodes"].ModelOptCalibrationHelper.execute(**args).args


def test_modelopt_engine_through_the_nodes(env):
    """Calibrate Model with engine = modelopt: ModelOpt's INT8 SmoothQuant (it runs on a CPU)
    calibrates on the same sampling runs, on a copy of the diffusion model that stands in for the
    original only while its loop samples; Quantize Model writes its choices into a stock int8
    file (report names the engine; SD1.x folds the smoothing into the LayerNorms) that samples.
    The input MODEL is untouched; a format other than the calibrated one, and awq_lite without
    CUDA, are refused with the reason."""
    pytest.importorskip("modelopt.torch.quantization",
                        reason="NVIDIA ModelOpt is not installed here: pip install 'comfy-modelopt[modelopt]'")
    model = env["model"]
    dm = model.model.diffusion_model
    before = {k: v.clone() for k, v in dm.state_dict().items()}
    calib, summary = _calibrate_with(env, engine="modelopt", modelopt_algorithm="smoothquant",
                                     modelopt_format="int8_tensorwise")
    assert model.model.diffusion_model is dm  # the copy stood in only while ModelOpt's loop sampled
    assert all(torch.equal(v, before[k]) for k, v in dm.state_dict().items())
    engine = calib.engine
    assert engine.algorithm == "smoothquant" and engine.format == "int8_tensorwise"
    smoothed = [n for n, layer in engine.layers.items() if layer.smooth is not None]
    assert len(engine.layers) == len(calib.stats.layers) and smoothed, summary
    assert all(layer.input_amax and layer.input_amax > 0 for layer in engine.layers.values())
    assert calib.stats.forward_calls == 2 * 2 and "NVIDIA ModelOpt" in summary
    qmodel, report = quantize(env, format="int8_tensorwise", calibration=calib, smoothing="smoothquant")
    assert "calibration engine: NVIDIA ModelOpt" in report and "(smoothquant)" in report
    assert "folded" in report, report
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    with torch.inference_mode():
        ref = model.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
        out = qmodel.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
    assert torch.isfinite(out).all() and float((out - ref).norm() / ref.norm()) < 0.2
    with pytest.raises(Exception, match="made for int8_tensorwise"):
        quantize(env, format="float8_e4m3fn", calibration=calib)
    # refused before any sampling (clip=None would fail the sampling first)
    with pytest.raises(Exception, match="does not export to float8_e4m3fn"):
        _calibrate_with(env, clip=None, engine="modelopt", modelopt_algorithm="smoothquant",
                        modelopt_format="float8_e4m3fn")
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="needs CUDA"):
            _calibrate_with(env, clip=None, engine="modelopt", modelopt_algorithm="awq_lite", modelopt_format="nvfp4")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "nvfp4"])
def test_quantized_model_is_stock_and_input_untouched(env, fmt):
    model = env["model"]
    before = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    qmodel, report = quantize(env, format=fmt, smoothing="smoothquant" if fmt != "float8_e4m3fn" else "none")
    after = model.model.diffusion_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the input MODEL changed"
    assert qmodel is not model and qmodel.model is not model.model
    mods = {n: m for n, m in qmodel.model.diffusion_model.named_modules()
            if isinstance(getattr(m, "weight", None), QuantizedTensor)}
    assert len(mods) == 71
    for name, m in mods.items():
        assert m.quant_format == fmt
        if fmt == "float8_e4m3fn":  # calibrated: true W8A8 with a static input scale
            assert getattr(m, "input_scale", None) is not None and float(m.input_scale) > 0
    assert "attn2.to_k" not in " ".join(mods)  # detection-critical layers stay 16-bit
    assert f"format: {fmt}" in report


def sample(env, model, steps, seed):
    import comfy.sample
    with torch.inference_mode():
        cond = env["clip"].encode_from_tokens_scheduled(env["clip"].tokenize("a cat"))
        latent = torch.zeros(1, 4, 8, 8)
        noise = comfy.sample.prepare_noise(latent, seed)
        return comfy.sample.sample(model, noise, steps, 4.0, "euler", "simple", cond, cond, latent, seed=seed)


def test_quantized_model_samples(env):
    qmodel, _ = quantize(env)
    out_q, out_f = sample(env, qmodel, 3, 3), sample(env, env["model"], 3, 3)
    assert torch.isfinite(out_q).all()
    assert float((out_q - out_f).norm() / out_f.norm()) < 0.05


def test_lora_applied_upstream_is_baked_in(env):
    model = env["model"].clone()
    key = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    w = model.model.diffusion_model.state_dict()[key[len("diffusion_model."):]].float()
    delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * float(w.abs().max()) * 0.5
    model.add_patches({key: ("diff", (delta,))}, strength_patch=1.0)
    qmodel, _ = quantize(env, model=model, format="int8_tensorwise", calibration=None)
    q = qmodel.model.diffusion_model.get_submodule(key[len("diffusion_model."):-7]).weight.dequantize().float()
    err_patched = float((q - (w + delta)).norm() / (w + delta).norm())
    err_base = float((q - w).norm() / w.norm())
    assert err_patched < 0.02 < err_base


def test_budget_plans_mixed_precision_and_samples(env):
    """Quantize Model with a budget: a stock MODEL whose layers hold several formats, each one
    ComfyUI's own quantized layer of its format, sampling like the others."""
    qmodel, report, chart = quantize(env, format="nvfp4", budget=0.4, runtime="stock", chart=True)
    assert "planner: budget 0.4" in report
    formats = {getattr(m, "quant_format", None) for m in qmodel.model.diffusion_model.modules()} - {None}
    assert len(formats) > 1 and formats <= {"nvfp4", "float8_e4m3fn", "int8_tensorwise"}, formats
    # the report as an IMAGE (Preview Image shows it): one bar per layer coloured by its format
    assert chart.shape == (1, 600, 1024, 3) and chart.dtype == torch.float32 and 0 <= chart.min() <= chart.max() <= 1
    colours = {tuple(int(round(float(v) * 255)) for v in px) for px in chart[0, 370, 64:1000]}
    from comfy_modelopt.formats import FORMATS
    assert len(colours & {FORMATS[f].colour for f in formats}) >= 2, colours
    out = sample(env, qmodel, 2, 0)
    assert torch.isfinite(out).all()
    _, report = quantize(env, format="nvfp4", max_error=0.5, runtime="stock")
    assert "planner: max summed error 0.5" in report
    with pytest.raises(Exception, match="not both"):
        quantize(env, format="nvfp4", budget=0.4, max_error=0.5)


def test_save_and_reload_identical(env):
    nodes = env["nodes"]
    qmodel, _ = quantize(env)
    with torch.inference_mode():
        path = nodes.ModelOptSaveQuantized.execute(model=qmodel, filename="test/sd15-fp8", overwrite=True).args[0]
    art = nodes.artifact_of(qmodel)
    assert len(art.state_dict) > 300
    with SafetensorsFile(path) as f:
        assert set(f.keys()) == set(art.state_dict)
        for k in f.keys():
            a, b = f.read(k), art.state_dict[k].cpu()
            assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k
        assert json.loads(f.metadata["comfy_modelopt.recipe"])["format"] == "float8_e4m3fn"
    # stock loader and our loader agree
    stock = comfy.sd.load_diffusion_model(path)
    ours, text = nodes.ModelOptUNetLoader.execute(unet_name="test/sd15-fp8.safetensors").args
    assert "comfy-modelopt checkpoint" in text
    assert re.search(r"verified 71 quantized layers and \d+ tensors .*; values of \d+ tensors read .*: no problem", text)
    # a damaged copy (a NaN scale) is refused before ComfyUI builds anything, naming the key and the rule
    with SafetensorsFile(path) as f:
        tensors, meta = {k: f.read(k) for k in f.keys()}, dict(f.metadata)
    key = sorted(k for k in tensors if k.endswith(".weight_scale"))[3]
    tensors[key] = torch.tensor(float("nan"))
    write_file(os.path.join(os.path.dirname(path), "sd15-nan.safetensors"), tensors, meta, overwrite=True)
    with pytest.raises(Exception, match=rf"^sd15-nan\.safetensors: {re.escape(key)}: must be finite and > 0, holds nan"):
        nodes.ModelOptUNetLoader.execute(unet_name="test/sd15-nan.safetensors")
    for m in (stock, ours):
        n = sum(isinstance(getattr(x, "weight", None), QuantizedTensor) for x in m.model.diffusion_model.modules())
        assert n == 71
    # a name that exists: saved under the next free counter, as ComfyUI's savers do (no work lost)
    before = open(path, "rb").read()
    for n in (1, 2):
        out = nodes.ModelOptSaveQuantized.execute(model=qmodel, filename="test/sd15-fp8", overwrite=False)
        assert out.args[0] == path[:-len(".safetensors")] + f"_{n:05d}.safetensors" and os.path.isfile(out.args[0])
        assert "sd15-fp8.safetensors exists, so the next free name was taken" in out.ui["text"][0]
        assert open(out.args[0], "rb").read() == before == open(path, "rb").read()
    # what cannot be written is refused when the prompt is queued, before Quantize Model runs;
    # written where the README says
    for overwrite in (False, True):
        assert nodes.ModelOptSaveQuantized.validate_inputs(filename="test/sd15-fp8", overwrite=overwrite) is True
    assert nodes.ModelOptSaveQuantized.validate_inputs(filename="test/new-name", overwrite=False) is True
    assert "inside" in nodes.ModelOptSaveQuantized.validate_inputs(filename="../../escape", overwrite=False)
    for n in (1, 2):
        os.remove(path[:-len(".safetensors")] + f"_{n:05d}.safetensors")
    assert os.path.dirname(os.path.dirname(path)) == nodes.save_folder() != os.path.join(folder_paths.models_dir, "unet")

    # the leftover of a killed save (header length never written) loads nowhere, with a clear word
    data = bytearray(open(path, "rb").read())
    data[:8] = bytes(8)
    broken = os.path.join(os.path.dirname(path), "sd15-incomplete.safetensors")
    with open(broken, "wb") as f:
        f.write(data)
    with pytest.raises(Exception, match=r"incomplete file \(interrupted write\)"):
        nodes.ModelOptUNetLoader.execute(unet_name="test/sd15-incomplete.safetensors")
    with pytest.raises(Exception):
        comfy.sd.load_diffusion_model(broken)


def test_save_folder_is_never_the_legacy_unet_folder(env):
    import folder_paths
    saved = folder_paths.folder_names_and_paths["diffusion_models"]
    legacy, modern = os.path.join(folder_paths.models_dir, "unet"), os.path.join(folder_paths.models_dir, "diffusion_models")
    try:
        folder_paths.folder_names_and_paths["diffusion_models"] = ([legacy, modern], saved[1])  # a stock tree
        assert env["nodes"].save_folder() == modern
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"] = saved


def test_interrupt_mid_save_and_mid_quantize_leave_nothing(env):
    """ComfyUI's Cancel during Save Quantized Model (checked after every tensor) or Quantize Model
    (checked before every layer): no file, no hidden partial, the input MODEL untouched."""
    import folder_paths
    mm = comfy.model_management
    nodes = env["nodes"]
    qmodel, _ = quantize(env, runtime="stock")
    before = {k: v.clone() for k, v in env["model"].model.diffusion_model.state_dict().items()}
    folder = os.path.join(folder_paths.get_folder_paths("diffusion_models")[0], "test")
    os.makedirs(folder, exist_ok=True)
    mm.interrupt_current_processing(True)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            nodes.ModelOptSaveQuantized.execute(model=qmodel, filename="test/interrupted", overwrite=False)
        assert [n for n in os.listdir(folder) if "interrupted" in n] == []  # neither file nor .partial
        mm.interrupt_current_processing(True)  # raising the exception cleared the flag
        with pytest.raises(mm.InterruptProcessingException):
            quantize(env, runtime="stock")
    finally:
        mm.interrupt_current_processing(False)
    after = env["model"].model.diffusion_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_errors_say_what_to_do(env):
    nodes = env["nodes"]
    with pytest.raises(nodes.NodeError, match="needs calibration"):
        quantize(env, smoothing="awq", calibration=None)
    # GPTQ (on by default) does not need to be refused without calibration: it is left off and said
    with pytest.raises(nodes.NodeError, match="^static_nvfp4_input needs calibration"):
        quantize(env, format="nvfp4", gptq=True, static_nvfp4_input=True, calibration=None)
    with pytest.raises(nodes.NodeError, match="nothing was quantized"):
        quantize(env, keep="*")
    with pytest.raises(nodes.NodeError, match="not made by Quantize Model"):
        nodes.ModelOptSaveQuantized.execute(model=env["model"], filename="x", overwrite=False)
    from comfy_modelopt.calibrate import calibrate
    other = calibrate(torch.nn.Sequential(torch.nn.Linear(8, 8)), lambda m: m(torch.randn(2, 8)))
    with pytest.raises(Exception, match="statistics are from another model"):
        quantize(env, calibration=other)
    qmodel, _ = quantize(env)
    with pytest.raises(nodes.NodeError, match="already quantized"):
        quantize(env, model=qmodel)


@pytest.mark.parametrize("fmt", ["int8_tensorwise", "nvfp4", "float8_e4m3fn"])
def test_lean_runtime_equals_stock(env, fmt):
    """Lean layers call the kernels the stock dispatch ends in: identical outputs."""
    lean_runtime = pack_module("lean")
    lean_mod = lean_runtime.make_lean
    stock, _ = quantize(env, format=fmt, runtime="stock", fp8_allowance=0.0)
    lean, _ = quantize(env, format=fmt, runtime="stock", fp8_allowance=0.0)
    assert lean_mod(lean) == 71
    ran = set()  # the layer class's forward takes each layer's direct kernel (records.LayerRecord.kernel)
    for name, m in lean.model.diffusion_model.named_modules():
        rec = getattr(m, "_modelopt", None)
        if rec is not None and rec.kernel is not None:
            kernel = rec.kernel
            rec.kernel = type("Spy", (), {"forward": lambda self, mod, x, f=kernel.forward, n=name: (ran.add(n), f(mod, x))[1]})()
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    with torch.inference_mode():
        a = stock.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
        b = lean.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
    assert torch.equal(a, b)
    assert len(ran) == 71
    if fmt == "float8_e4m3fn":  # force the W8A8 path on both (ComfyUI emulates fp8 on a CPU)
        for m in list(stock.model.diffusion_model.modules()) + list(lean.model.diffusion_model.modules()):
            if getattr(m, "quant_format", None) == fmt:
                m._full_precision_mm = False
        for m in lean.model.diffusion_model.modules():
            if getattr(m, "quant_format", None) == fmt:
                m._modelopt.kernel = None  # records.LayerRecord: no direct kernel yet
        orig = lean_runtime.native_formats
        lean_runtime.native_formats = lambda d: orig(d) | {"float8_e4m3fn"}
        try:
            lean2, _ = quantize(env, format=fmt, runtime="stock", fp8_allowance=0.0)
            for m in lean2.model.diffusion_model.modules():
                if getattr(m, "quant_format", None) == fmt:
                    m._full_precision_mm = False
            assert lean_mod(lean2) == 71
        finally:
            lean_runtime.native_formats = orig
        with torch.inference_mode():
            a = stock.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
            b = lean2.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
        # on a CPU ComfyUI dequantizes the weight inside cast_bias_weight, so its W8A8 is a float
        # matmul of the fp8-rounded operands while the lean layer runs _scaled_mm: same operands,
        # other summation order (bit-exactness is checked on the GPU by benchmarks/speed.py)
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-3) and not torch.equal(a, torch.zeros_like(a))
        # a 16-bit input is rounded by torch's operations only where they agree with kitchen's
        # kernel on every value of its dtype at the layer's scale; else by kitchen's
        m = next(m for m in lean2.model.diffusion_model.modules() if getattr(m, "quant_format", None) == fmt)
        w, scale = m.weight, m.input_scale
        h = torch.randn(5, w.shape[1], generator=g).to(torch.bfloat16) * 40
        bias = None if m.bias is None else m.bias.to(h.dtype)
        kernels = pack_module("kernels")
        kitchen = kernels.fp8_gemm(kernels._quantize_fp8(h, scale, w._qdata.dtype), w._qdata, scale,
                                        w._params.scale, bias, False, h.dtype)
        assert torch.equal(kernels._fp8_forward(m, h, False), kitchen)
        assert m._modelopt.inverse[(torch.bfloat16, h.device)] is not False
        m._modelopt.inverse, quantize_fp8 = None, kernels._quantize_fp8
        kernels._quantize_fp8 = lambda x, sc, q: quantize_fp8(x * 1.01, sc, q)  # a kernel rounding otherwise
        try:
            other = kernels.fp8_gemm(kernels._quantize_fp8(h, scale, w._qdata.dtype), w._qdata, scale,
                                          w._params.scale, bias, False, h.dtype)
            assert torch.equal(kernels._fp8_forward(m, h, False), other) and not torch.equal(other, kitchen)
            assert m._modelopt.inverse[(torch.bfloat16, h.device)] is False
        finally:
            kernels._quantize_fp8 = quantize_fp8


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback: this run has a GPU")
def test_nodes_replay_cuda_graphs_by_default(env):
    """Quantize Model and Load Quantized Model offer "auto" as their default runtime (what an API
    workflow without the input gets too): off a GPU that is lean + CUDA graphs, running eagerly
    with that reason, and it samples exactly what lean does."""
    from comfy_modelopt.comfyui.runtime import DEFAULT_RUNTIME
    assert DEFAULT_RUNTIME == "auto"
    for node in (env["nodes"].ModelOptQuantizeUNet, env["nodes"].ModelOptUNetLoader):
        runtime = next(i for i in node.define_schema().inputs if i.id == "runtime")
        assert runtime.default == DEFAULT_RUNTIME
    graphs, text = quantize(env)
    assert "runtime (auto): lean" in text and "CUDA graph replay: no CUDA GPU here" in text.split("\n\n")[0]
    assert runner_of(graphs).compiled is None  # nothing to compile ahead on
    lean, text = quantize(env, runtime="lean")
    assert "CUDA graph" not in text.split("\n\n")[0]
    assert torch.equal(sample(env, graphs, 2, 1), sample(env, lean, 2, 1))
    # the CUDA Graphs node after it (compile_blocks on) replaces that runner with its own
    from comfy.patcher_extension import CallbacksMP, WrappersMP
    CudaGraphs = sys.modules[env["nodes"].enable_cuda_graphs.__module__].CudaGraphs  # the pack as ComfyUI loaded it
    again = env["nodes"].ModelOptCudaGraphs.execute(graphs, compile_blocks=True).args[0]
    runner = runner_of(again)
    assert isinstance(runner, CudaGraphs) and runner is not runner_of(graphs)
    for kind in (WrappersMP.APPLY_MODEL, WrappersMP.CALC_COND_BATCH):  # the model's graphs, the ControlNets'
        assert len(again.get_wrappers(kind, "comfy_modelopt_cuda_graphs")) == 1
    assert runner.compiled is not None  # the node's option, not the first runner's
    for call_type in (CallbacksMP.ON_CLEANUP, CallbacksMP.ON_DETACH):
        assert len(again.callbacks[call_type]["comfy_modelopt_cuda_graphs"]) == 2
    assert torch.equal(sample(env, again, 2, 1), sample(env, lean, 2, 1))
    # another pack's model function wrapper (ComfyUI's single slot) keeps working around the graphs
    calls = []

    def foreign(apply_model, args):
        calls.append(1)
        return apply_model(args["input"], args["timestep"], **args["c"])
    both = lean.clone()
    both.set_model_unet_function_wrapper(foreign)
    both = env["nodes"].ModelOptCudaGraphs.execute(both).args[0]
    assert torch.equal(sample(env, both, 2, 1), sample(env, lean, 2, 1)) and len(calls) == 2
    assert runner_of(both).eager_calls == 2


def test_auto_runtime_takes_the_fp8_attention_where_it_runs(env, monkeypatch):
    """The default runtime installs the FP8 attention override where its kernel runs (Hopper with
    fa3-fwd; here the CPU with the torch re-statement of the kernel) - the override itself keeps
    every call under its token threshold on ComfyUI's attention - and says why where it cannot;
    a MODEL that already overrides attention keeps its own."""
    from test_attention8 import fp8_attention_on_cpu
    att, runtime = pack_module("attention"), pack_module("runtime")
    plain = quantize(env, runtime="lean")[0]
    device = torch.device(plain.load_device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:  # the kernel's own gate
        _, note = runtime.apply_runtime(plain, "auto")
        assert "FP8 attention left out: FlashAttention-3's FP8 forward runs on Hopper GPUs" in note, note
        if device.type == "cuda":
            pytest.skip("a GPU other than a Hopper: the FP8 attention is left out here (checked above)")
    fp8_attention_on_cpu(monkeypatch, att)
    model, note = runtime.apply_runtime(plain, "auto")
    assert "+ FP8 attention on self-attention of" in note, note
    assert model.model_options["transformer_options"]["optimized_attention_override"] is att.fp8_attention_override
    assert "optimized_attention_override" not in plain.model_options.get("transformer_options", {})
    own = att._with_override(plain, att.int8_attention_override)
    model, note = runtime.apply_runtime(own, "auto")
    assert "FP8 attention left out: this MODEL already overrides attention" in note, note
    assert model.model_options["transformer_options"]["optimized_attention_override"] is att.int8_attention_override


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback: this run has a GPU")
def test_cuda_graphs_fall_back_off_gpu(env):
    clone, runner = env["nodes"].enable_cuda_graphs(env["model"])
    a, b = sample(env, clone, 2, 1), sample(env, env["model"], 2, 1)
    assert torch.equal(a, b)
    # a real sampling run: the device is the only reason not to capture.  ComfyUI's sampler copies
    # the patcher's callbacks (our own release callbacks among them) into transformer_options; an
    # H200 whole-run check once found them blocking every capture
    assert runner.eager_calls == 2 and runner.captures == 0 and runner.warned == {"not on a CUDA device"}


def test_cuda_graphs_compose_with_other_wrappers(env):
    """Other packs' wrappers are not reasons to leave the graphs: APPLY_MODEL wrappers added after
    the runner still run around every evaluation (the runner innermost), diffusion-model wrappers
    run inside it (captured with it on a GPU), and the only reason to run eagerly here is the
    device."""
    from comfy.patcher_extension import WrappersMP
    seen = []

    def wrapper(executor, *args, **kwargs):
        seen.append("wrapper")
        return executor(*args, **kwargs)
    for kind in (WrappersMP.PREDICT_NOISE, WrappersMP.DIFFUSION_MODEL, WrappersMP.APPLY_MODEL):
        clone, runner = env["nodes"].enable_cuda_graphs(env["model"])
        clone.add_wrapper_with_key(kind, "test", wrapper)
        runner.evaluate = lambda apply_model, call, inner=runner.evaluate: (seen.append("graphs"),
                                                                             inner(apply_model, call))[1]
        seen.clear()
        out = sample(env, clone, 1, 0)
        assert "graphs" in seen and len(seen) >= 2, kind  # both ran
        if kind == WrappersMP.APPLY_MODEL:  # registered after the runner, run outside it
            assert seen[:2] == ["wrapper", "graphs"], seen
        if kind == WrappersMP.DIFFUSION_MODEL:
            assert seen[0] == "graphs", seen
        other = set() if env["model"].load_device.type == "cuda" else {"not on a CUDA device"}
        assert runner.warned == other, kind
        assert torch.equal(out, sample(env, env["model"], 1, 0))


def test_cuda_graphs_failed_capture_is_not_retried(env):
    """A forward that cannot be captured runs eagerly after the first failure, logged once,
    instead of paying a failed capture on every call."""
    clone, runner = env["nodes"].enable_cuda_graphs(env["model"])
    attempts = []

    def capture(*_args):
        attempts.append(1)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    runner._blocker = lambda call: None  # as on a GPU
    runner._capture = capture
    sample(env, clone, 3, 0)
    assert len(attempts) == 1 and runner.eager_calls == 3
    assert runner.warned == {"capture failed: RuntimeError: CUDA error: operation not permitted when stream is "
                             "capturing"}


def test_cuda_graph_replays_leave_no_tensor_to_the_garbage_collector(env):
    """Replays hand every step's conditioning to the graph and let it go at once: no reference
    cycle keeps it (the runtime's recursive walks were closures, each one a cycle holding the
    tensors it collected - on Flux 80 MiB more at a run's peak, found on the H200)."""
    import gc
    # models earlier tests left loaded may be let go while this test samples (ComfyUI's model
    # management drops them as it needs): unloaded and collected first, so that the window below
    # sees only what the replays leave (a full suite run saw three of another model's tensors)
    comfy.model_management.unload_all_models()
    gc.collect()
    clone, runner = env["nodes"].enable_cuda_graphs(env["model"])
    runner._blocker = lambda call: None  # as on a GPU

    def capture(apply_model, call, weights, sig, key):  # a graph that replays nothing
        static = call.static(call.args[0].device)
        return {"graph": types.SimpleNamespace(replay=lambda: None), "weights": weights, "compiled": False,
                "call": static, "static": static.tensors(), "out": call.run(apply_model)}
    runner._capture = capture
    sample(env, clone, 2, 0)  # captured at its first evaluation
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        sample(env, clone, 4, 0)  # replays only
        assert runner.replays >= 4
        gc.collect()
        leaked = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leaked == [], leaked


def test_cuda_graph_capture_builds_cpu_constants_on_the_device(env):
    """What a capture runs: the model evaluation with CPU-built constants built on the GPU (Wan
    2.1's timestep embedding; on a CPU run the meta device stands in for the GPU); a signature's
    first warm-up fails, before any capture, on a host copy that is left."""
    from comfy_modelopt.comfyui.graph_inputs import ModelCall
    clone, runner = env["nodes"].enable_cuda_graphs(env["model"])
    call = ModelCall((torch.randn(2, device="meta"), None), {})
    graphs = sys.modules[type(runner).__module__]
    out = runner._model_call(lambda x, t, *a, **c: torch.arange(8).to(x), call, check=[])
    assert out.device.type == "meta" and runner.constants_rebuilt == 1
    with pytest.raises(graphs.NotCapturable, match="copies tensors from the CPU to the GPU"):
        runner._model_call(lambda x, t, *a, **c: torch.randn(8).to(x), call, check=[])
    runner._model_call(lambda x, t, *a, **c: torch.randn(8).to(x), call)  # only the first warm-up checks


def test_cuda_graphs_per_step_keys(env):
    """A forward whose host reads are all the step's sigmas gets one graph per step, keyed by the
    sigmas; any other value read (a decision from the latent, a comparison's bool) does not; a
    signature's per-step graphs and its plain graphs are evicted by kinds of their own."""
    from comfy_modelopt.comfyui.graph_inputs import ModelCall
    sigmas = torch.tensor([14.6146, 14.6146])
    call = ModelCall((torch.randn(2, 4, 8, 8), sigmas, None, None, None, {"sigmas": sigmas}), {})
    assert call.step_sigmas() == tuple(sigmas.tolist())
    assert call.only_sigmas([sigmas[0].item()]) and call.only_sigmas(sigmas.tolist())
    for values in ([], [0.5], [True], [sigmas[0].item(), 0.5], [object()]):
        assert not call.only_sigmas(values), values
    assert not ModelCall((torch.randn(2), sigmas), {}).only_sigmas([sigmas[0].item()])  # no sigmas in the options
    _, runner = env["nodes"].enable_cuda_graphs(env["model"])
    graphs = sys.modules[type(runner).__module__]
    runner.max_graphs, runner.max_step_graphs = 2, 3
    for i in range(3):
        runner.graphs[(graphs.STEP, ("sig",), (float(i),))] = {}
    runner.graphs[("sig",)] = runner.graphs[("other",)] = {}
    runner._evict(step=True)
    assert (graphs.STEP, ("sig",), (0.0,)) not in runner.graphs and len(runner.graphs) == 4
    runner._evict(step=False)
    assert ("sig",) not in runner.graphs and ("other",) in runner.graphs and len(runner.graphs) == 3
    runner.graphs.clear()


FAKE_POOL = types.SimpleNamespace(vacate=lambda: None, accounting="mempool")  # stands in for a GraphPool off a GPU


def test_cuda_graphs_kept_between_runs_and_released_when_unloaded(env):
    """Where the graphs' memory can be accounted (a CUDA MemPool) they stay between sampling runs
    and go back when ComfyUI detaches the model or unloads part of it; elsewhere they go back
    after every run (ComfyUI calls cleanup())."""
    for persistent in (False, True):
        clone, runner = env["nodes"].enable_cuda_graphs(env["model"])
        runner.persistent = persistent
        runner.graphs["fake signature"], runner.pool = {"graph": None}, FAKE_POOL
        sample(env, clone, 1, 0)  # ComfyUI's sampler ends with model_patcher.cleanup()
        if persistent:
            assert runner.graphs and runner.pool is not None and runner.releases == 0
        else:
            assert runner.graphs == {} and runner.pool is None and runner.releases == 1
        runner.graphs["fake signature"], runner.pool = {"graph": None}, FAKE_POOL
        clone.clone().detach(unpatch_all=False)  # a clone dropped (its __del__), weights stay
        assert runner.graphs and runner.pool is not None
        clone.clone().detach()  # clones share the runner and its callbacks; the weights leave
        assert runner.graphs == {} and runner.pool is None
        runner.graphs["fake signature"], runner.pool = {"graph": None}, FAKE_POOL
        comfy.model_management.load_models_gpu([clone])
        clone.partially_unload(clone.offload_device, 1)  # what ComfyUI does to make room
        assert runner.graphs == {} and runner.pool is None
        comfy.model_management.unload_all_models()


def test_compiled_blocks_validated_against_eager(env):
    """Inductor-compiled blocks: same output as eager within eager's own rounding noise, model
    restored afterwards; a compiled output that differs turns compilation off with the reason."""
    blocks = pack_module("compiled_blocks")
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    dm = model.model.diffusion_model
    before = {id(m): m.__dict__.get("forward") for m in dm.modules()}
    cb = blocks.CompiledBlocks(dm)
    assert len(cb.regions) >= 6 and not any(isinstance(m, torch.nn.Linear) for m in cb.regions)
    # ComfyUI's quantized Linear derives from nn.Module only: opaque all the same (traced into,
    # its fp8 kernel call broke the graph and was compiled once per layer shape)
    quantized = {id(m) for m in dm.modules() if getattr(m, "quant_format", None)}
    assert quantized and quantized <= {id(m) for m in cb.opaque}
    g = torch.Generator().manual_seed(0)
    # on a GPU the model is loaded there, as the sampler loads it, and gets its inputs there
    comfy.model_management.load_models_gpu([model])
    dev = model.load_device
    x, c = torch.randn(1, 4, 8, 8, generator=g).to(dev), torch.randn(1, 8, 768, generator=g).to(dev)
    t = torch.tensor([0.5], device=dev)
    with torch.inference_mode():
        run = lambda: model.model.apply_model(x, t, c_crossattn=c)  # noqa: E731
        ref = run()
        ok = cb.validate(run, ref, lambda: model.model.apply_model(blocks.rounding_noise(x, torch.bfloat16),
                                                                   t, c_crossattn=c))
        assert ok, cb.reason
        check = cb.checks[-1]
        assert 0 < check["eager_rounding_noise"] and check["rel_l2"] <= check["limit"] <= cb.max_tol
        # what the compilation cost, as torch's timers and compile caches tell it (logged with it)
        assert check["frames_compiled"] == 0 or check["compile"]["compiling"] > 0
        assert {"aot_hits", "aot_misses", "inductor_hits", "inductor_misses"} <= set(check["compile"])
        assert {id(m): m.__dict__.get("forward") for m in dm.modules()} == before  # nothing left installed
        assert torch.equal(run(), ref)
        bad = blocks.CompiledBlocks(dm)
        assert not bad.validate(run, ref * 1.5) and not bad.enabled
        assert "differs from eager by 0.333" in bad.reason


def test_compiled_blocks_not_compiled_for_a_streamed_model(env, monkeypatch):
    """A model whose evaluation copies weights from the CPU at every call (dynamic VRAM on a GPU
    it does not fit: ComfyUI streams them) is not compiled ahead: no CUDA graph could capture it.
    Found by the second eager evaluation, before anything compiles, where the model may stream
    (``may_stream``); a resident model's is clean, and one that is wholly loaded is not checked.
    (A CPU->meta copy in one layer stands for ComfyUI's host-to-GPU weight copy.)"""
    blocks = pack_module("compiled_blocks")
    calibrate_mod = sys.modules[PACK + ".comfy_modelopt.calibrate"]
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    dm = model.model.diffusion_model
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    call = calibrate_mod.RecordedCall.of((x, torch.tensor([0.5])), {"context": c})
    compiled = []
    monkeypatch.setattr(blocks.CompiledBlocks, "validate", lambda self, *a, **k: compiled.append(a) or True)
    with torch.inference_mode():
        assert blocks.CompiledBlocks(dm).compile_for(call, dm, torch.device("cpu"), may_stream=lambda: True)
        assert len(compiled) == 1  # resident: on to compiling
        layer = next(m for m in dm.modules() if getattr(m, "quant_format", None))
        calls, weight = [], torch.ones(blocks.STREAMED_BYTES // 4)  # made before the evaluation, as weights are
        hook = layer.register_forward_pre_hook(lambda m, a: calls.append(weight.to("meta")))
        try:
            cb = blocks.CompiledBlocks(dm)
            ok = cb.compile_for(call, dm, torch.device("cpu"), may_stream=lambda: True)
            assert not ok and len(compiled) == 1 and len(calls) == 2 and not cb.enabled, (ok, len(calls))
            assert "copied from the CPU at every evaluation" in cb.reason, cb.reason
            assert blocks.CompiledBlocks(dm).compile_for(call, dm, torch.device("cpu"))  # not asked: compiles
            # wholly loaded, says ComfyUI: not checked (no second evaluation here), compiled
            assert blocks.CompiledBlocks(dm).compile_for(call, dm, torch.device("cpu"), may_stream=lambda: False)
            assert len(calls) == 4 and len(compiled) == 3  # one evaluation each (validate is stubbed)
            weight = torch.ones(blocks.STREAMED_BYTES // 8)  # a copy of less: on to compiling
            assert blocks.CompiledBlocks(dm).compile_for(call, dm, torch.device("cpu"), may_stream=lambda: True)
        finally:
            hook.remove()


def test_not_all_loaded_reads_comfyui(env):
    """What compiling ahead asks before its streaming check: ComfyUI's own account of how much of
    the model is on its device (``model_size() - loaded_size()``) - all of it once ComfyUI loaded it."""
    runtime = pack_module("runtime")
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    comfy.model_management.unload_all_models()
    if model.model_size() >= runtime.STREAMED_BYTES:
        assert runtime._not_all_loaded(model)()
    comfy.model_management.load_models_gpu([model])
    assert not runtime._not_all_loaded(model)()
    comfy.model_management.unload_all_models()


def test_compiled_blocks_installed_for_one_thread(env):
    """Installed in one thread, the regions run eagerly for any other thread (another sampler in
    the process): nothing is compiled or run compiled there, and the output is eager's
    bit for bit."""
    import threading

    import torch._dynamo.utils
    blocks = pack_module("compiled_blocks")
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    dm = model.model.diffusion_model
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    run = lambda: model.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)  # noqa: E731
    with torch.inference_mode():
        ref = run()
    cb = blocks.CompiledBlocks(dm)
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with cb.installed():
            entered.set()
            leave.wait(60)
    th = threading.Thread(target=hold)
    th.start()
    try:
        assert entered.wait(60)
        frames = torch._dynamo.utils.counters["frames"]["total"]
        with torch.inference_mode():
            out = run()
        assert torch._dynamo.utils.counters["frames"]["total"] == frames  # no frame compiled here
        assert torch.equal(out, ref)
    finally:
        leave.set()
        th.join()
    assert cb._owner is None and not cb._lock.locked()


def cpu_free_memory(monkeypatch):
    """8 GiB free on the CPU device, whatever this machine has: the CPU's sub-quadratic attention
    sizes its chunks by the free memory, which compiled code guards on (a GPU runs SDPA)."""
    import comfy.model_management as mm
    free = mm.get_free_memory
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (
        (8 << 30, 8 << 30) if torch_free_too else 8 << 30) if mm.is_device_cpu(dev) else free(dev, torch_free_too))


def compile_ahead_and_sample(env, patcher, call, steps=3) -> tuple:
    """Compile ``patcher``'s blocks ahead from ``call`` (the runtime's own path), then sample
    ``steps`` with them installed; returns the frames that run compiled (0 expected), the
    sampled latent and the compiled blocks."""
    import torch._dynamo.utils
    runtime = pack_module("runtime")
    torch._dynamo.reset()
    clone, runner = runtime.enable_cuda_graphs(patcher, compile_blocks=True)
    note = runtime._compile_ahead(clone, runner, call)
    assert "blocks compiled for the calibration's shapes" in note, note
    cb = runner.compiled

    def compiled(apply_model, args):
        with cb.installed():
            return apply_model(args["input"], args["timestep"], **args["c"])
    clone.model_options["model_function_wrapper"] = compiled
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    out = sample(env, clone, steps, 3)
    return torch._dynamo.utils.counters["frames"]["ok"] - frames, out, cb


def test_compiled_blocks_compile_ahead_from_the_calibration(env, monkeypatch):
    """Calibrate Model keeps the diffusion model's first call; the graph runtime's blocks are
    compiled from it (what Quantize Model does on a GPU before it returns) and serve a later
    KSampler run at the calibration's size: nothing is compiled during that run (the node path's
    first image paid the compilation: Flux +11 s with a cold cache on an H200), and its output is
    eager's within the compiled tolerance."""
    runtime = pack_module("runtime")
    call = env["stats"].first_call
    assert call is not None and call.args[0][0].shape == (2, 4, 8, 8)
    cpu_free_memory(monkeypatch)
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    frames, out, cb = compile_ahead_and_sample(env, model, call)
    assert cb.checks[-1]["frames_compiled"] > 0
    assert frames == 0, "the sampling run compiled frames the calibration's call had not"
    ref = sample(env, model, 3, 3)
    assert float((out - ref).norm() / ref.norm()) < cb.checks[-1]["limit"]

    def fails(*_args, **_kwargs):  # e.g. out of memory while compiling: the node's model still comes back, uncompiled
        raise RuntimeError("no room")
    clone, runner = runtime.enable_cuda_graphs(model, compile_blocks=True)
    assert "no calibration to compile ahead from" in runtime._compile_ahead(clone, runner, None)
    monkeypatch.setattr(runner.compiled, "compile_for", fails)
    assert runtime._compile_ahead(clone, runner, call).endswith("compiling ahead failed: RuntimeError: no room)")
    assert not runner.compiled.enabled


def test_compiled_blocks_keep_patches_where_they_apply(env, monkeypatch):
    """Patches do not turn compiled blocks off: each region learns, at its first call with
    patches, which of them its own code looks up.  FreeU's output-block patch acts between
    regions - every region stays compiled; an attention replace on the middle block runs that
    block's transformer eagerly with the patch, the other regions compiled.  Either way nothing
    compiles during the run and the output is the patched model's eager one within the compiled
    tolerance; a region compiled without the patches never drops one."""
    import comfy.ldm.modules.attention as attention
    import torch._dynamo.utils
    from comfy_extras.nodes_freelunch import FreeU_V2
    runtime = pack_module("runtime")
    cpu_free_memory(monkeypatch)
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    torch._dynamo.reset()
    clone, runner = runtime.enable_cuda_graphs(model, compile_blocks=True)
    assert "blocks compiled for the calibration's shapes" in runtime._compile_ahead(clone, runner,
                                                                                   env["stats"].first_call)
    cb = runner.compiled
    cb.compile_new_shapes = False  # as auto runs them: a region without code for its inputs runs eagerly

    def compiled(apply_model, args):
        with cb.installed():
            return apply_model(args["input"], args["timestep"], **args["c"])

    def halved(q, k, v, extra):
        return attention.optimized_attention(q, k, v, extra["n_heads"]) * 0.5
    freeu = lambda m: FreeU_V2.execute(m, 3.0, 3.0, 0.2, 0.2).args[0]  # noqa: E731
    replace = lambda m: (lambda c: (c.set_model_attn1_replace(halved, "middle", 0), c)[1])(m.clone())  # noqa: E731
    for patch, eager_regions in ((freeu, False), (replace, True)):
        fast = patch(clone)
        fast.model_options["model_function_wrapper"] = compiled
        frames, calls = torch._dynamo.utils.counters["frames"]["ok"], cb.patched_calls
        out = sample(env, fast, 3, 3)
        assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "the patched run compiled"
        assert (cb.patched_calls > calls) == eager_regions
        ref = sample(env, patch(model), 3, 3)
        plain = sample(env, model, 3, 3)
        err, effect = float((out - ref).norm() / ref.norm()), float((ref - plain).norm() / plain.norm())
        assert err < cb.checks[-1]["limit"] and err < effect / 5, (err, effect)  # the patch applied
    assert cb.enabled


def test_another_size_compiles_in_the_background_and_is_captured_again(env, monkeypatch):
    """``auto`` compiles the blocks ahead only: a signature at another size is captured over the
    uncompiled blocks, and after its run (ComfyUI's cleanup) they compile for its shapes in a
    thread - checked against eager - while the caller goes on; nothing is captured meanwhile (a
    new signature runs eagerly).  Once they are in, the graph captured before is captured again
    at its next replay, and the blocks run compiled at those shapes, compiling nothing more."""
    import time
    import torch._dynamo.utils
    runtime, bg = pack_module("runtime"), pack_module("background_compile")
    ModelCall, latent_shapes = pack_module("graph_inputs").ModelCall, pack_module("compiled_blocks").latent_shapes
    cpu_free_memory(monkeypatch)
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    torch._dynamo.reset()
    clone, runner = runtime.enable_cuda_graphs(model, compile_blocks=True)
    assert "blocks compiled" in runtime._compile_ahead(clone, runner, env["stats"].first_call)
    cb = runner.compiled
    cb.compile_new_shapes = False  # as auto runs them
    comfy.model_management.load_models_gpu([clone])
    dev, g = clone.load_device, torch.Generator().manual_seed(0)
    apply_model = clone.model._apply_model  # what the runner's APPLY_MODEL wrapper is handed
    with torch.inference_mode():
        call = ModelCall((torch.randn(2, 4, 12, 8, generator=g).to(dev), torch.tensor([0.5, 0.5], device=dev), None,
                          torch.randn(2, 77, 768, generator=g).to(dev)), {})  # as ComfyUI passes them, by position
        shapes = latent_shapes((call.args[:4], call.kwargs))
        assert cb.shapes and shapes not in cb.shapes  # the calibration's 8x8 latent was compiled ahead, not this
        captured = []

        def capture(apply_model, call, weights, sig, key):  # what _capture leaves (a graph replaying nothing)
            captured.append(key)
            static = call.static(dev)
            return {"graph": types.SimpleNamespace(replay=lambda: None), "weights": weights, "compiled": True,
                    "call": static, "static": [], "out": call.run(apply_model), "apply": apply_model,
                    "shapes": shapes, "awaits_code": shapes not in cb.shapes}
        runner._blocker, runner._capture, runner.pool = (lambda c: None), capture, FAKE_POOL
        bg.BACKGROUND.set()  # another thread compiling: nothing is captured, the call runs eagerly
        runner.evaluate(apply_model, call)
        bg.BACKGROUND.clear()
        assert captured == [] and runner.eager_calls == 1
        runner.evaluate(apply_model, call)
        sig = call.signature()
        assert captured == [sig]
        runner.uncompiled[sig] = sig  # as _capture registers it
        runner.pool = types.SimpleNamespace(reserved_bytes=lambda kind: 0, vacate=lambda: None, accounting="mempool")
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        interval, seen = sys.getswitchinterval(), set()
        assert bg.compile_later(runner)
        deadline = time.monotonic() + 600
        while bg.BACKGROUND.is_set() and time.monotonic() < deadline:
            seen.add(sys.getswitchinterval())  # the sampler's thread takes the GIL back quickly meanwhile
            time.sleep(0.2)
        assert min(seen) == pytest.approx(bg.SWITCH_INTERVAL) and sys.getswitchinterval() == interval, (seen, interval)
        check = cb.checks[-1]
        assert cb.enabled and cb.landed == 1 and shapes in cb.shapes, cb.reason
        assert torch._dynamo.utils.counters["frames"]["ok"] > frames and check["frames_compiled"] > 0
        assert check["rel_l2"] <= check["limit"]
        assert not bg.compile_later(runner)  # nothing left to compile
        runner.evaluate(apply_model, call)  # captured again over the compiled blocks
        assert captured == [sig, sig]
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        with cb.installed():  # as a capture runs them: code for these shapes, nothing compiled
            out = call.run(apply_model)
        assert torch._dynamo.utils.counters["frames"]["ok"] == frames
        ref = call.run(apply_model)
        assert float((out - ref).norm() / ref.norm()) <= check["limit"]
    runner.release()
    comfy.model_management.unload_all_models()


def test_compiling_ahead_borrows_the_weights_and_leaves_the_load_to_the_sampler(env, monkeypatch):
    """Compiling ahead runs on copies of the weights that ComfyUI does not know of (moved as its
    load moves them - new parameters even on the CPU): afterwards ComfyUI holds no load of the
    model, the module holds its very own tensors again, and a KSampler run - which loads the model
    itself, as it would with a LoRA connected after the node - compiles nothing.  (A model ComfyUI
    had loaded for compiling was unloaded to the CPU when a LoRA came after the node: Flux's first
    image 16.2 s on an H200 against stock's 9.3 s.)"""
    import comfy.model_management as mm
    runtime = pack_module("runtime")
    cpu_free_memory(monkeypatch)
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    mm.unload_all_models()

    def tensors():
        return {(id(m), k): t for m in model.model.diffusion_model.modules()
                for store in (m._parameters, m._buffers) for k, t in store.items() if t is not None}
    before = {k: (v, v.data_ptr()) for k, v in tensors().items()}
    seen = []
    real = runtime.borrowed_on

    def own():
        now = tensors()
        return sum(now[k] is v and v.data_ptr() == p for k, (v, p) in before.items())

    @contextlib.contextmanager
    def borrowing(patcher, device):
        with real(patcher, device):
            seen.append(own())
            assert not any(getattr(m.model, "model", None) is patcher.model for m in mm.current_loaded_models)
            yield
        seen.append(own())
    monkeypatch.setattr(runtime, "borrowed_on", borrowing)
    frames, _out, cb = compile_ahead_and_sample(env, model, env["stats"].first_call)
    assert cb.checks[-1]["frames_compiled"] > 0
    assert seen[0] < len(before) // 2 and seen[1] == len(before), seen  # ComfyUI's quantized layers re-wrap
    assert frames == 0, "the sampling run compiled again on the model's own weights"


def test_compiled_ahead_on_placeholder_weights_serve_the_real_ones(env, monkeypatch):
    """Compiling ahead needs the weights' metadata, not their values: on a GPU the blocks compile
    on zero placeholders (``runtime.placeholder_like``, made where a weight is not on the device
    instead of copying it there - Flux fp8 2.3 s on an H200), not checked then; a sampling run on
    the real weights compiles nothing more and equals the run compiled on the real weights.  A
    placeholder has its weight's type (ComfyUI's QuantizedTensor included), shape, dtype and
    layout; the model gets its own tensors back."""
    runtime = pack_module("runtime")
    cpu_free_memory(monkeypatch)
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    dm = model.model.diffusion_model
    w = next(m.weight for m in dm.modules() if hasattr(getattr(m, "weight", None), "_qdata"))
    p = runtime.placeholder_like(w, w.device)
    assert type(p) is type(w) and p.shape == w.shape and p.dtype == w.dtype and p._layout_cls is w._layout_cls
    assert p._qdata.dtype == w._qdata.dtype and p._qdata.shape == w._qdata.shape and not p._qdata.float().any()
    assert p._qdata.data_ptr() != w._qdata.data_ptr()

    def storage():  # (ComfyUI's load re-wraps its quantized layers' parameters: the storage is what stays)
        return [(t._qdata if hasattr(t, "_qdata") else t).data_ptr() for m in dm.modules()
                for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None]
    before = storage()

    @contextlib.contextmanager
    def placeholders(patcher, device):  # a CPU has no other device: make every weight a placeholder
        runtime.as_fully_loaded(patcher)
        with runtime.applied(patcher.model.diffusion_model, lambda t: runtime.placeholder_like(t, device)):
            assert next(iter(patcher.model.diffusion_model.state_dict().values())).abs().sum() == 0
            yield True
    with monkeypatch.context() as mp:
        mp.setattr(runtime, "borrowed_on", placeholders)
        frames, out, cb = compile_ahead_and_sample(env, model, env["stats"].first_call)
    assert cb.checks[-1]["rel_l2"] is None and cb.checks[-1]["frames_compiled"] > 0  # compiled, not checked
    assert frames == 0, "the run on the real weights compiled again"
    assert storage() == before
    frames_real, out_real, cb_real = compile_ahead_and_sample(env, model, env["stats"].first_call)
    assert cb_real.checks[-1]["rel_l2"] is not None  # on the CPU the weights are there: checked
    assert float((out - out_real).norm() / out_real.norm()) < 1e-5


def test_compiled_code_is_kept_for_the_next_process(env, monkeypatch, tmp_path):
    """What compiling ahead compiled is kept under ComfyUI's user directory (``compile_cache``) and
    serves a process whose own compile caches are empty (torch keeps them in a temporary folder, which
    a reboot or a fresh container empties): its compilation hits the caches, misses nothing, and the
    run after it compiles nothing.  A bundle holds what its compilation used, whatever else the
    process compiled and saved before (torch's own record keeps one group per kind of what it saved
    last).  Without the kept code the same empty caches miss."""
    cc = pack_module("compile_cache")
    cpu_free_memory(monkeypatch)
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    call = env["stats"].first_call
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path / "user"))

    def compiled(torch_caches, keep=True):  # each as a new process would
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / torch_caches))
        monkeypatch.setenv("COMFY_MODELOPT_COMPILE_CACHE", "1" if keep else "0")
        cc._SEEN.clear()
        frames, out, cb = compile_ahead_and_sample(env, model, call)
        assert frames == 0
        return cb.checks[0]["compile"], out
    cold, out = compiled("a", keep=False)
    assert cold["aot_misses"] > 0 and not os.path.exists(cc.folder()), cold
    torch.compiler.save_cache_artifacts()  # what torch recorded saved by another tool, then another compilation's
    torch.compile(lambda x: torch.nn.functional.gelu(x) * 3)(torch.randn(4, 4))
    torch.compiler.save_cache_artifacts()
    warm, _ = compiled("a")  # served by torch's own (temporary) caches: kept all the same
    assert warm["aot_hits"] > 0 and warm["aot_misses"] == 0, warm
    bundles = os.listdir(cc.folder())
    assert len(bundles) == 1 and bundles[0].endswith(".bin"), bundles
    assert cc.folder().startswith(folder_paths.get_user_directory())
    again, out_again = compiled("b")  # torch's caches empty: the kept code serves the compilation
    assert again["aot_hits"] > 0 and again["aot_misses"] == 0 and again["inductor_misses"] == 0, again
    assert torch.equal(out, out_again)
    assert os.listdir(cc.folder()) == bundles  # nothing missed: nothing more kept
    os.remove(os.path.join(cc.folder(), bundles[0]))
    without, _ = compiled("c", keep=False)  # off: nothing loaded, nothing kept
    assert without["aot_misses"] > 0 and not os.listdir(cc.folder()), without


def test_kept_compiled_code_never_stops_a_compilation(tmp_path, monkeypatch):
    """A user directory that cannot be written (here a file stands where its folder would be), a
    damaged bundle or a ComfyUI without system users: the compilation runs as without kept code,
    the problem logged - and a damaged bundle does not stand in for a good one."""
    cc = pack_module("compile_cache")
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path / "file" / "user"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    cc._SEEN.clear()
    with cc.kept("k" * 32, "a test") as used:
        assert torch.compile(lambda x: x * 2 + 1)(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert used.loaded == 0 and used.saved is None
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path / "user"))
    os.makedirs(cc.folder())
    with open(os.path.join(cc.folder(), "k" * 32 + "-damaged.bin"), "wb") as f:
        f.write(b"not torch's")
    with cc.kept("k" * 32, "a test") as used:  # served by torch's own caches; the damaged bundle is none
        assert torch.compile(lambda x: x * 2 + 1)(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert used.loaded == 0 and used.saved is not None and os.path.isfile(used.saved)
    monkeypatch.delattr(folder_paths, "get_system_user_directory")
    assert cc.folder() == os.path.join(str(tmp_path / "user"), "__comfy_modelopt", "compile_cache")


def test_kept_compiled_code_is_bounded(tmp_path):
    """The newest ``PER_KEY`` bundles of a model stay, and the newest ``KEEP`` in all."""
    cc = pack_module("compile_cache")
    names = [f"k{i % 3}-{i:03d}.bin" for i in range(3 * cc.PER_KEY + cc.KEEP)]
    for age, name in enumerate(names):  # names[0] the newest
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))
    cc._prune(str(tmp_path), "k0")
    newest_k0 = [n for n in names if n.startswith("k0-")][:cc.PER_KEY]
    assert set(os.listdir(tmp_path)) == {n for n in names[:cc.KEEP] if not n.startswith("k0-") or n in newest_k0}


@pytest.mark.parametrize("inference", [True, False], ids=["server", "script"])
def test_compiled_ahead_blocks_serve_another_step_count_in_either_mode(env, monkeypatch, inference):
    """The blocks compiled ahead from the calibration (3 steps) serve a KSampler run of another
    step count, whether the process runs its nodes under inference mode (a ComfyUI server) or
    with grad on (a script): nothing is compiled during the run.  On an H200 the sampler's sigma
    schedule in the options made a 20-step image compile again, a server compiled every block
    twice for a file calibrated in a script, and a script's node failed to compile ahead."""
    import comfy.sample
    import torch._dynamo.utils
    runtime = pack_module("runtime")
    cpu_free_memory(monkeypatch)
    model, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    torch._dynamo.reset()
    with torch.inference_mode(inference), torch.enable_grad():
        clone, runner = runtime.enable_cuda_graphs(model, compile_blocks=True)
        note = runtime._compile_ahead(clone, runner, env["stats"].first_call)
        assert "blocks compiled for the calibration's shapes" in note, note
        cb = runner.compiled

        def compiled(apply_model, args):  # the blocks installed around each evaluation, as a capture does
            with cb.installed():
                return apply_model(args["input"], args["timestep"], **args["c"])
        clone.model_options["model_function_wrapper"] = compiled
        cond = env["clip"].encode_from_tokens_scheduled(env["clip"].tokenize("a cat"))
        latent = torch.zeros(1, 4, 8, 8)
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        out = comfy.sample.sample(clone, comfy.sample.prepare_noise(latent, 3), 4, 4.0, "euler", "simple", cond,
                                  cond, latent, seed=3)
        assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "the run compiled again"
        assert torch.isfinite(out).all() and cb.enabled


def test_load_quantized_model_compiles_ahead_from_the_call_its_file_describes(env, monkeypatch):
    """A calibrated file carries the calibration's first model call as shapes, dtypes and options
    (no values); Load Quantized Model in a fresh process hands it to the runtime, which compiles
    the blocks for it before the first image as Quantize Model does from the calibration: a
    KSampler run at those shapes then compiles nothing.  A described call this loader refuses
    (too large, not a description) leaves the model loading, uncompiled ahead."""
    nodes = env["nodes"]
    runtime = pack_module("runtime")
    calibrate_mod = sys.modules[PACK + ".comfy_modelopt.calibrate"]
    cpu_free_memory(monkeypatch)
    qmodel, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    with torch.inference_mode():
        path = nodes.ModelOptSaveQuantized.execute(model=qmodel, filename="test/sd15-call", overwrite=True).args[0]
    with SafetensorsFile(path) as f:
        signature = json.loads(f.metadata["comfy_modelopt.calibration"])["first_call"]
    want = env["stats"].first_call
    assert signature == want.signature()
    handed = {}
    real = nodes.apply_runtime
    monkeypatch.setattr(nodes, "apply_runtime", lambda *a, **k: (handed.update(k), real(*a, **k))[1])
    loaded, _text = nodes.ModelOptUNetLoader.execute(unet_name="test/sd15-call.safetensors", runtime="lean").args
    call = handed["first_call"]
    assert isinstance(call, calibrate_mod.RecordedCall) and call.signature() == signature
    assert [t.shape for t, _ in call.args] == [t.shape for t, _ in want.args]
    # ComfyUI loops over the options' keys and compiled code guards on their order: kept through JSON
    assert list(call.kwargs["transformer_options"]) == list(want.kwargs["transformer_options"])
    assert compile_ahead_and_sample(env, loaded, call)[0] == 0, "the sampling run compiled frames the file's call had not"

    class Info:  # what inspect_file says of a file whose description was tampered with
        ours = {"calibration": {"first_call": {**signature, "args": {"tuple": [
            {"tensor": [1 << 20, 1 << 20], "dtype": "torch.float32", "device": "cpu"}]}}}}
    assert runtime.first_call_of(Info, "x.safetensors") is None
    Info.ours = {"calibration": {"first_call": {"args": {"eval": "os.system"}, "kwargs": {"dict": []}}}}
    assert runtime.first_call_of(Info, "x.safetensors") is None
    Info.ours = {"calibration": {"forward_calls": 3}}  # a file from before, or quantized without a calibration
    assert runtime.first_call_of(Info, "x.safetensors") is None


def test_compiling_ahead_replays_the_call_in_the_models_compute_dtype(env, monkeypatch):
    """The model calibrated and the model quantized may compute in different dtypes (ComfyUI runs
    a Wan fp8 file in fp16, the bf16 model it was calibrated on in bf16): the calibration's call is
    replayed in the quantized model's dtype, as the sampler will call it, so the first image at
    those shapes compiles nothing (on an H200 a Wan first image compiled again, 9 s)."""
    cpu_free_memory(monkeypatch)
    qmodel, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    dtype = qmodel.model.get_dtype_inference()
    other = torch.bfloat16 if dtype != torch.bfloat16 else torch.float16
    # the call as a calibration of the model in the other dtype recorded it
    recorded = env["stats"].first_call.cast(other, skip=("control", "transformer_options"))
    assert recorded.args[0][0].dtype == recorded.kwargs["context"][0].dtype == other
    assert compile_ahead_and_sample(env, qmodel, recorded)[0] == 0, "the first image compiled again"


def test_compiling_ahead_with_an_attention_override_holds_at_another_step_count(env, monkeypatch):
    """The fp8 attention runtime: its override lives in the quantized MODEL's options, not in the
    calibration's call, and the image samples more steps than the calibration did.  Compiling
    ahead merges the MODEL's options in as the sampler does, and the override (which reads no
    per-block key) lets the regions drop the sigma schedule: the first image compiles nothing
    (on an H100 the Wan first image compiled again, 10 s, for both reasons)."""
    from test_attention8 import fp8_attention_on_cpu, reference_kernel
    att = pack_module("attention")
    ran = []
    count = torch.compiler.disable(lambda: ran.append(1))  # a list's length in traced code is a guard

    def kernel(*args, **kwargs):
        count()
        return reference_kernel(*args, **kwargs)
    fp8_attention_on_cpu(monkeypatch, att, kernel)
    cpu_free_memory(monkeypatch)
    qmodel, _ = quantize(env, format="float8_e4m3fn", runtime="lean")
    withatt = att._with_override(qmodel, att.fp8_attention_override)
    # calibrated with 3 steps, sampled with 5
    assert compile_ahead_and_sample(env, withatt, env["stats"].first_call, steps=5)[0] == 0, \
        "the first image compiled again"
    assert ran, "the override never ran"


def save_and_reload(env, qmodel, plain, filename, refusal):
    """Save ``qmodel``, check stock ComfyUI refuses the file (``refusal``: pytest.raises args),
    reload it with Load Quantized Model; outputs of the 16-bit model, ``qmodel``, the reloaded
    one and ``plain`` on the same inputs; the reloaded model must equal ``qmodel`` bit for bit."""
    nodes = env["nodes"]
    with torch.inference_mode():
        path = nodes.ModelOptSaveQuantized.execute(model=qmodel, filename=filename, overwrite=True).args[0]
    with pytest.raises(*refusal[:1], **refusal[1]):
        comfy.sd.load_diffusion_model(path)
    reloaded, text = nodes.ModelOptUNetLoader.execute(unet_name=filename + ".safetensors", runtime="lean").args
    assert "comfy-modelopt's loader" in text
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    with torch.inference_mode():
        ref, a, b, p = (m.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c).float()
                        for m in (env["model"], qmodel, reloaded, plain))
    assert torch.equal(a, b)  # the file holds exactly what the in-memory model runs
    err = lambda t: float((t - ref).norm() / ref.norm())  # noqa: E731
    return reloaded, (x, c), err(a), err(p), b


def assert_real_weights(env, qmodel, max_err: float) -> None:
    """What a Control-LoRA's copy of each quantized layer gets (``control_graphs.real_weight``: the
    weight the layer computes with) is the source model's weight within the format's error, and
    closer than the stored part alone (its codes dequantized)."""
    from comfy_modelopt.comfyui.control_graphs import _stored_weight, real_weight
    src = env["model"].model.diffusion_model
    errs = []
    for name, m in qmodel.model.diffusion_model.named_modules():
        if _stored_weight(m) is not None:
            w = src.get_submodule(name).weight.float()
            real = real_weight(m)
            errs.append(float((real - w).norm() / w.norm()))
            alone = m.weight.dequantize().float() if hasattr(m.weight, "dequantize") else m.weight.float()
            assert errs[-1] <= float((alone - w).norm() / w.norm()) + 1e-6, name
    assert errs and max(errs) < max_err, max(errs)


def test_lowrank_own_loader(env):
    """Low-rank branch + 4-bit residual: our loader runs it, stock ComfyUI refuses the file."""
    nodes = env["nodes"]
    plain, _ = quantize(env, format="nvfp4", runtime="stock", fp8_allowance=0.0)
    qmodel, report = quantize(env, format="nvfp4", lowrank=16, smoothing="awq", runtime="lean")
    assert "modelopt_lowrank_nvfp4" in report
    branched = [m for m in qmodel.model.diffusion_model.modules()
                if getattr(getattr(m, "_modelopt", None), "own_forward", None) is pack_module("ownloader")._branch_forward]
    assert len(branched) == 71 and all(m.lowrank_up.shape[1] == 16 for m in branched)
    assert_real_weights(env, qmodel, max_err=0.2)  # the branch and the smoothing in them
    # not a QUANT_ALGOS key: the stock loader refuses, it never drops the branch
    reloaded, _, err_a, err_p, _ = save_and_reload(env, qmodel, plain, "test/sd15-lowrank", (Exception, {}))
    assert err_a < 0.01 and err_p < 0.01, (err_a, err_p)
    # this tiny random UNet's output hardly moves under either; the layers' own output error on
    # the calibration inputs (measured by the quantizer) shows the gain: ~10% here, as random
    # weights have a flat spectrum (the layer-level benchmark shows the gain on outlier layers)
    mean_out = lambda m: statistics.fmean(  # noqa: E731
        l.out_err for l in nodes.artifact_of(m).report.quantized)
    assert mean_out(qmodel) < 0.95 * mean_out(plain), (mean_out(qmodel), mean_out(plain))

    # a LoRA-style patch (delta in the original basis) changes a smoothed layer by x @ delta^T.
    # The searched smoothing may be mild (held out by prompt on this tiny calibration), so the
    # mapping is checked on a copy of the file whose layer carries a strong smooth_scale
    name = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    import folder_paths
    from comfy_modelopt.comfyui import ownloader
    from comfy_modelopt.safetensors_io import SafetensorsFile, write_file
    with SafetensorsFile(folder_paths.get_full_path_or_raise("diffusion_models", "test/sd15-lowrank.safetensors")) as f:
        tensors, metadata = {k: f.read(k) for k in f.keys()}, dict(f.metadata)
    key = next(k for k in tensors if k.endswith(name + ".smooth_scale"))
    tensors[key] = torch.exp(torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    strong = os.path.join(folder_paths.get_output_directory(), "sd15-lowrank-strong.safetensors")
    write_file(strong, tensors, metadata, overwrite=True)
    reloaded = ownloader.load_file(strong)
    layer = reloaded.model.diffusion_model.get_submodule(name)
    assert layer.smooth_scale is not None and float((layer.smooth_scale.float().log()).abs().mean()) > 0.3
    w = env["model"].model.diffusion_model.get_submodule(name).weight.float()
    delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * float(w.abs().max())
    patched = reloaded.clone()
    # the patcher keeps ComfyUI's class; its stored-basis map of patches survives clone()
    assert type(patched).__module__ == "comfy.model_patcher" and type(patched.patches).__name__ == "_StoredBasisPatches"
    patched.add_patches({"diffusion_model." + name + ".weight": ("diff", (delta,))}, strength_patch=1.0)
    w0 = layer.weight.dequantize().float().clone()
    with torch.inference_mode():
        comfy.model_management.load_models_gpu([patched], force_full_load=True)
    applied = layer.weight.dequantize().float() - w0
    # per input column j, how much of delta[:, j] the stored weight took: 1 / smooth_scale[j] is
    # right (the stored weight is in the smoothed basis), 1 is what a plain patch would do;
    # re-quantization noise averages out over the rows
    took = (applied * delta).sum(0) / (delta * delta).sum(0)
    ss = layer.smooth_scale.float()
    ours, plain_patch = float((took * ss - 1).abs().mean()), float((took - 1).abs().mean())
    assert ours < 0.05 and ours < 0.25 * plain_patch, (ours, plain_patch)


def test_conv_fp8_own_loader(env):
    """fp8 convolutions: stock ComfyUI refuses the file, our loader runs it; LoRA on a conv lands
    in the stored (scaled) basis."""
    plain, _ = quantize(env, runtime="lean")
    qmodel, report = quantize(env, conv="fp8", runtime="lean")
    assert "convolutions:" in report and "fp8 (per output channel" in report
    dm = qmodel.model.diffusion_model
    convs = {n: m for n, m in dm.named_modules()
             if getattr(getattr(m, "_modelopt", None), "own_forward", None) is pack_module("ownloader")._conv_fp8_forward}
    assert len(convs) >= 4
    for m in convs.values():
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight.dim() == 4 and m.weight_scale.shape == (m.out_channels,)
    assert dm.input_blocks[0][0].weight.dtype != torch.float8_e4m3fn  # first conv: detection reads it
    assert_real_weights(env, qmodel, max_err=0.05)
    # never raw fp8 values in a 16-bit conv: stock ComfyUI stops at the shape
    reloaded, (x, c), err_a, err_p, b = save_and_reload(env, qmodel, plain, "test/sd15-conv",
                                                        (RuntimeError, {"match": "size mismatch"}))
    assert err_a < 0.02 and err_a != err_p, (err_a, err_p)
    assert torch.isfinite(sample(env, reloaded, 2, 1)).all()
    sd_bytes = lambda m: sum(t.numel() * t.element_size() for t in m.model.diffusion_model.state_dict().values()  # noqa: E731
                             if not hasattr(t, "_qdata"))
    assert sd_bytes(reloaded) < sd_bytes(plain)

    # a LoRA-style delta (real units) on an fp8 conv: the effective weight moves by delta
    name = next(iter(convs))
    layer = reloaded.model.diffusion_model.get_submodule(name)
    w0 = (layer.weight.float() * layer.weight_scale.view(-1, 1, 1, 1)).clone()
    delta = torch.randn(w0.shape, generator=torch.Generator().manual_seed(1)) * float(w0.abs().max()) * 0.5
    patched = reloaded.clone()
    patched.add_patches({"diffusion_model." + name + ".weight": ("diff", (delta,))}, strength_patch=1.0)
    with torch.inference_mode():
        comfy.model_management.load_models_gpu([patched], force_full_load=True)
    applied = layer.weight.float() * layer.weight_scale.view(-1, 1, 1, 1) - w0
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert float((applied - delta).norm() / delta.norm()) < 0.1  # fp8 re-rounding of the sum
    with torch.inference_mode():
        y = patched.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c).float()
    assert not torch.equal(y, b)


def rank4_lora(dm, suffixes, g, up_scale=1.0, fmt=None) -> dict:
    """A random rank-4 LoRA (ComfyUI's lora_up/lora_down keys) on the layers ending in ``suffixes``
    (of quant format ``fmt`` when given)."""
    lora = {}
    for name, m in dm.named_modules():
        if name.endswith(suffixes) and (fmt is None or getattr(m, "quant_format", None) == fmt):
            n, k = m.weight.shape
            lora[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(4, k, generator=g)
            lora[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(n, 4, generator=g) * up_scale
    return lora


def test_bypass_lora_with_lean_layers_in_either_order(env):
    """ComfyUI's bypass LoRA wraps a layer's forward; the lean runtime must stay underneath it,
    whether the LoRA was injected before or after the layers were made lean."""
    dm = env["model"].model.diffusion_model
    g = torch.Generator().manual_seed(3)
    lora = rank4_lora(dm, ("attn1.to_q", "attn1.to_v", "ff.net.2"), g)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    run = lambda p: p.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c).float()  # noqa: E731
    effects = {}
    for order in ("stock", "lora-then-lean", "lean-then-lora"):
        q, _ = quantize(env, runtime="lean" if order == "lean-then-lora" else "stock")
        with torch.inference_mode():
            plain = run(q)
        lq, _ = comfy.sd.load_bypass_lora_for_models(q, None, lora, 1.0, 0)
        comfy.model_management.load_models_gpu([lq], force_full_load=True)  # injects the bypass hooks
        if order == "lora-then-lean":
            assert pack_module("lean").make_lean(lq) == 71
        with torch.inference_mode():
            effects[order] = run(lq) - plain  # what the LoRA does to the output
        comfy.model_management.unload_all_models()
    ref = effects["stock"]
    assert float(ref.norm()) > 1e-3 * float(plain.norm())
    for order in ("lora-then-lean", "lean-then-lora"):  # dropping the LoRA would give 1.0
        assert float((effects[order] - ref).norm() / ref.norm()) < 0.1, order


def test_own_loader_models_can_be_rebuilt_by_comfyui(env):
    """ComfyUI rebuilds a model through ``cached_patcher_init`` for a non-dynamic copy (hooks in
    the conditioning) or one per GPU; for our models that must run our loader again (extras
    attached, LoRA mapping kept), whether the model came from a file or from Quantize Model."""
    nodes = env["nodes"]
    qmodel, _ = quantize(env, conv="fp8", runtime="stock")
    with torch.inference_mode():
        nodes.ModelOptSaveQuantized.execute(model=qmodel, filename="test/sd15-conv-rebuild", overwrite=True)
    loaded, _ = nodes.ModelOptUNetLoader.execute(unet_name="test/sd15-conv-rebuild.safetensors", runtime="stock").args
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    for original in (qmodel, loaded):
        assert original.cached_patcher_init is not None
        copy = original.clone(force_deepcopy=True)  # the path ComfyUI takes through cached_patcher_init
        assert copy.model is not original.model
        assert type(copy.patches).__name__ == "_StoredBasisPatches" and copy.model._modelopt.stored_basis
        assert type(copy).__module__ == "comfy.model_patcher"
        convs = [m for m in copy.model.diffusion_model.modules()
                 if getattr(getattr(m, "_modelopt", None), "own_forward", None) is pack_module("ownloader")._conv_fp8_forward]
        assert convs and all(m.weight.dtype == torch.float8_e4m3fn for m in convs)
        with torch.inference_mode():
            a = original.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
            b = copy.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)
        assert torch.equal(a, b)


def _sdxl_small_runs():
    """An SDXL-family state dict and a KSampler run function (ComfyUI builds its ADM vector on the
    CPU, so every call hands over CPU conditioning)."""
    import comfy.sample
    _, sd = models.build("sdxl", "small", seed=3, dtype=torch.float16)
    g = torch.Generator().manual_seed(0)

    def cond(seed):
        g.manual_seed(seed)
        ctx, pooled = torch.randn(1, 77, 2048, generator=g), torch.randn(1, 1280, generator=g)
        return [[ctx.half(), {"pooled_output": pooled.half(), "width": 512, "height": 512}]]
    latent = torch.zeros(1, 4, 32, 32)
    noise = comfy.sample.prepare_noise(latent, 0)

    def run(m, seed):
        with torch.inference_mode():
            return comfy.sample.sample(m, noise, 4, 4.0, "euler", "simple", cond(seed), cond(99), latent, seed=0,
                                       disable_pbar=True)
    return sd, run


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA-graph capture inside "
                                                                      "real sampling runs")


@CUDA_ONLY
def test_cuda_graphs_capture_in_real_sampling():
    """Whole KSampler runs: captured once and replayed, equal to eager bit for bit, new
    conditioning values honoured; a second run with the same shapes captures nothing, with the
    pool's idle memory held (counted as in use); a weight patch (LoRA) recaptures; unloading the
    model, partly or wholly, gives the pool back."""
    import comfy.model_management as mm

    from comfy_modelopt.comfyui.runtime import enable_cuda_graphs  # not the pack: its import needs PyAV
    sd, run = _sdxl_small_runs()
    model = comfy.sd.load_diffusion_model_state_dict(sd)
    eager = {seed: run(model, seed) for seed in (1, 2)}
    key = next(k for k in model.get_key_patches() if k.endswith("attn1.to_q.weight"))
    delta = torch.randn(model.model.state_dict()[key].shape, generator=torch.Generator().manual_seed(4)) * 0.05
    patched = model.clone()
    patched.add_patches({key: (delta.half(),)}, 1.0)
    eager_patched = run(patched, 1)
    mm.unload_all_models()
    clone, runner = enable_cuda_graphs(model)
    assert runner.persistent
    for seed in (1, 2):
        assert torch.equal(run(clone, seed), eager[seed]), seed
        assert runner.warned == set(), runner.warned
    assert runner.captures == 1 and runner.replays == 2 * 4 - 1 and runner.releases == 0
    if runner.pool.accounting == "mempool":
        # the pool's idle memory is held (ComfyUI counts it in use), but for a few small blocks
        assert runner.pool.reserved_bytes() > 0
        idle = sum(b["size"] for seg in torch.cuda.memory_snapshot()  # the pool's free blocks
                   if tuple(seg.get("segment_pool_id", ())) == tuple(runner.pool.handle)
                   for b in seg["blocks"] if b["state"] == "inactive")
        assert idle <= max(16 << 20, runner.pool.reserved_bytes() // 20), idle
    else:  # cudaMallocAsync (ComfyUI's default on CUDA 13 torch): driver memory, no shared pool
        assert runner.pool.accounting == "device" and runner.pool.handle is None
    # a LoRA-style weight patch on a clone sharing the runner: captured again, patched output
    lclone = clone.clone()
    lclone.add_patches({key: (delta.half(),)}, 1.0)
    assert torch.equal(run(lclone, 1), eager_patched) and runner.captures == 2
    assert torch.equal(run(clone, 1), eager[1]) and runner.captures == 3
    # ComfyUI makes room for a model by unloading part of this one: the pool goes first
    loaded = next(m for m in mm.current_loaded_models if m.model is clone)
    reserved, used = torch.cuda.memory_reserved(), _device_used()
    loaded.model_unload(memory_to_free=1 << 20)
    mm.soft_empty_cache()
    assert runner.pool is None and runner.graphs == {}
    if runner.graph_memory_trimmed is None:  # the caching allocator: the pool went back to it
        assert torch.cuda.memory_reserved() < reserved
    else:  # cudaMallocAsync: the graphs' driver memory went back to the device
        assert runner.graph_memory_trimmed
    assert _device_used() < used, (reserved, used, _device_used())
    assert torch.equal(run(clone, 2), eager[2]) and runner.captures == 4
    mm.free_memory(1e30, mm.get_torch_device())  # a model that needs the whole GPU: ours is unloaded
    assert runner.pool is None and runner.graphs == {}
    mm.unload_all_models()


@CUDA_ONLY
def test_cuda_graphs_capture_wan():
    """Wan 2.1 copies a CPU-built torch.arange to the GPU inside its forward (every capture failed
    on that copy): the capture builds the constant on the GPU; replays equal eager bit for bit
    over a real sampling run."""
    import comfy.model_management as mm
    import comfy.sample

    from comfy_modelopt.comfyui.runtime import enable_cuda_graphs
    _, sd = models.build("wan", "small", seed=3)
    model = comfy.sd.load_diffusion_model_state_dict({k: v.half() for k, v in sd.items()})
    latent = torch.zeros(1, 16, 2, 16, 16)
    noise = comfy.sample.prepare_noise(latent, 0)
    ctx = torch.randn(1, 8, 4096, generator=torch.Generator().manual_seed(5)).half()

    def run(m):
        with torch.inference_mode():
            return comfy.sample.sample(m, noise, 4, 5.0, "euler", "simple", [[ctx, {}]], [[ctx * 0, {}]], latent,
                                       seed=0, disable_pbar=True)
    eager = run(model)
    mm.unload_all_models()
    clone, runner = enable_cuda_graphs(model)
    assert torch.equal(run(clone), eager)
    assert runner.constants_rebuilt >= 1 and runner.failed == {}
    assert runner.captures == 1 and runner.replays == 3 and runner.eager_calls == 0
    assert torch.equal(run(clone), eager) and runner.captures == 1
    mm.unload_all_models()


@CUDA_ONLY
def test_compiled_blocks_compile_before_the_first_capture():
    """Compiled blocks + graphs: the first evaluation of a signature compiles the blocks, checks
    them against eager and captures the compiled graph, so the first run already replays it (in
    the node path a background compilation, starved by the sampler's thread, never landed); the
    output matches eager within the compiled tolerance and later runs capture nothing."""
    import comfy.model_management as mm

    from comfy_modelopt.comfyui.runtime import enable_cuda_graphs
    from comfy_modelopt.cuda_streams import allocator_backend
    sd, run = _sdxl_small_runs()
    model = comfy.sd.load_diffusion_model_state_dict(sd)
    eager = run(model, 1)
    mm.unload_all_models()
    clone, runner = enable_cuda_graphs(model, compile_blocks=True)
    # the same under cudaMallocAsync, ComfyUI's default allocator on CUDA 13 torch (compiled
    # captures failed there, and freeing what they had allocated aborted the process)
    assert runner.compiled.enabled
    assert runner.malloc_async == (allocator_backend() == "cudaMallocAsync")
    out = run(clone, 1)
    assert runner.compiled.enabled, runner.compiled.reason
    assert runner.captures == 1 and len(runner.validated) == 1 and len(runner.compile_seconds) == 1
    assert all(e["compiled"] for e in runner.graphs.values()) and runner.replays > 0
    rel = float((out.float() - eager.float()).norm() / eager.float().norm())
    assert rel < runner.compiled.checks[-1]["limit"], rel
    assert torch.equal(run(clone, 1), out) and runner.captures == 1
    mm.unload_all_models()


@CUDA_ONLY
def test_auto_runtime_compiles_ahead_only_from_a_calibration(env):
    """On a GPU the default runtime compiles the blocks in Quantize Model for the calibration's
    shapes and a KSampler run at that size compiles nothing; Load Quantized Model (no calibration)
    replays graphs without compiled blocks and says why."""
    import torch._dynamo.utils
    model, text = quantize(env)
    runner = runner_of(model)
    assert runner.compiled is not None and runner.compiled.enabled, text
    assert "blocks compiled for the calibration's shapes" in text
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    sample(env, model, 3, 3)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames
    assert runner.captures == 1 and all(e["compiled"] for e in runner.graphs.values())
    plain = quantize(env, runtime="lean")[0]
    _, note = pack_module("runtime").apply_runtime(plain, "auto")
    assert "compiled blocks left out: no calibration to compile them ahead from" in note


@CUDA_ONLY
def test_cuda_graphs_refill_the_dequant_cache():
    """nvfp4 computed dequantized (Hopper and older): the graph runtime fills the dequant cache
    eagerly before capturing (a capture cannot), and again after ComfyUI unloaded the model and the
    cache was released; output bit-exact with the same model without a cache."""
    import comfy.model_management

    from comfy_modelopt.comfyui import lean, ownloader, runtime
    from comfy_modelopt.pipeline import DictSink, quantize
    from comfy_modelopt.recipe import Recipe
    if "nvfp4" in lean.native_formats(comfy.model_management.get_torch_device()):
        pytest.skip("nvfp4 runs natively on this GPU: nothing is computed dequantized")
    sd, run = _sdxl_small_runs()
    sink = DictSink()  # quantized on the GPU: kitchen's CPU nvfp4 encoder takes about a minute here
    quantize({k: v.cuda() for k, v in sd.items()}, Recipe("nvfp4", sensitivity=False), sink=sink, refuse_unknown=False)
    plain, cached = (ownloader.load_state_dict(dict(sink.tensors), dict(sink.metadata)) for _ in range(2))
    lean.make_lean(plain)
    lean.make_lean(cached, dequant_cache_bytes=1 << 40)
    cache = cached.model._modelopt.dequant_cache
    n = sum(getattr(m, "quant_format", None) == "nvfp4" for m in cached.model.diffusion_model.modules())
    (gp, rp), (gc, rc) = runtime.enable_cuda_graphs(plain), runtime.enable_cuda_graphs(cached)
    ref = run(gp, 1)
    assert torch.equal(run(gc, 1), ref) and cache.fills == n and rc.captures == 1 and rc.warned == set()
    comfy.model_management.unload_all_models()  # detach: the cache goes with the weights
    assert cache.entries == {} and cache.needs_fill()
    assert torch.equal(run(gc, 1), ref) and cache.fills == 2 * n and rc.captures == 2 and rc.warned == set()
    assert rp.warned == set()
    comfy.model_management.unload_all_models()


def test_dequant_cache_bit_exact_budgeted_and_invalidated(env):
    """nvfp4 is computed dequantized here (no native kernel on a CPU, as on Hopper): the cache keeps
    16-bit copies within the budget - same outputs, never over budget, ComfyUI told to keep the
    unallocated rest free, entries refreshed when a LoRA is merged, dropped on detach."""
    import comfy.model_management
    g = torch.Generator().manual_seed(5)
    x, c = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 8, 768, generator=g)
    run = lambda p: p.model.apply_model(x, torch.tensor([0.5]), c_crossattn=c)  # noqa: E731
    plain, _ = quantize(env, format="nvfp4", runtime="lean", fp8_allowance=0.0)
    full, note = quantize(env, format="nvfp4", runtime="lean", dequant_cache_gib=64.0, fp8_allowance=0.0)
    cache = full.model._modelopt.dequant_cache
    layers = [m for m in full.model.diffusion_model.modules() if getattr(m, "quant_format", None) == "nvfp4"]
    itemsize = torch.empty((), dtype=full.model.get_dtype_inference()).element_size()
    total = sum(m.weight.numel() for m in layers) * itemsize
    assert cache.budget == total and "dequantized-weight cache" in note  # capped at what the layers can use
    shape = [2, 4, 8, 8]
    assert full.model.memory_required(shape) == plain.model.memory_required(shape) + total
    with torch.inference_mode():
        ref, out = run(plain), run(full)
        assert torch.equal(ref, out) and cache.fills == len(layers) and cache.used == total
        assert full.model.memory_required(shape) == plain.model.memory_required(shape)  # all allocated now
        assert torch.equal(run(full), ref) and cache.hits == len(layers)
    # a budget for about half the layers: never exceeded, the rest dequantize per call, same output
    half, _ = quantize(env, format="nvfp4", runtime="lean", dequant_cache_gib=total / 2 / 2**30,
                        fp8_allowance=0.0)
    hc = half.model._modelopt.dequant_cache
    with torch.inference_mode():
        assert torch.equal(run(half), ref)
    assert 0 < hc.fills < len(layers) and hc.used <= hc.budget == total // 2
    # a merged LoRA changes the weights: cached copies must follow (stale ones would ignore it)
    dm = full.model.diffusion_model
    lora = rank4_lora(dm, ("to_q", "ff.net.2"), g, up_scale=0.1, fmt="nvfp4")
    merged = {}
    assert not cache.needs_fill()
    for key, p in (("plain", plain), ("cached", full)):
        lp, _ = comfy.sd.load_lora_for_models(p, None, lora, 1.0, 0)
        comfy.model_management.load_models_gpu([lp], force_full_load=True)
        if key == "cached":  # stale copies: the graph runtime refills eagerly before a capture
            assert cache.needs_fill()
        with torch.inference_mode():
            merged[key] = run(lp)
        if key == "cached":
            assert not cache.needs_fill()
        comfy.model_management.unload_all_models()
    assert not torch.equal(merged["plain"], ref)
    assert torch.equal(merged["cached"], merged["plain"])
    full.detach()
    assert cache.entries == {} and cache.used == 0 and cache.needs_fill()


def test_runtime_note_says_when_dynamic_vram_keeps_the_lean_kernels_out(env, monkeypatch):
    """A model ComfyUI loads with dynamic VRAM (too large to keep resident) runs its layers through
    ComfyUI's cast path whatever lean set on them: the runtime line says so instead of promising
    direct kernel calls."""
    runtime = pack_module("runtime")
    plain = quantize(env, runtime="lean")[0]
    _, note = runtime.apply_runtime(plain, "lean")
    assert note.startswith("runtime: lean (") and "dynamic VRAM" not in note, note
    monkeypatch.setattr(plain, "is_dynamic", lambda: True)
    _, note = runtime.apply_runtime(plain, "lean")
    assert "ComfyUI loads this model with dynamic VRAM" in note and "direct kernel calls" not in note, note
