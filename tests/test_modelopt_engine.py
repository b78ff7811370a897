"""NVIDIA ModelOpt as the calibration engine (modelopt_engine.py), on the CPU: its max
calibrator, INT8 SmoothQuant and SVDQuant's branch, exported into the files the own engine
writes."""
from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed "
                    "(pip install 'comfy-modelopt[modelopt]'); requirements-test.txt installs it")

from comfy_modelopt import Recipe, quantize  # noqa: E402
from comfy_modelopt.calibrate import calibrate  # noqa: E402
from comfy_modelopt.errors import ModelOptError, PlanError  # noqa: E402
from comfy_modelopt.formats import FORMATS  # noqa: E402
from comfy_modelopt.modelopt_engine import modelopt_calibrate, require_modelopt  # noqa: E402
from comfy_modelopt.pipeline import DictSink  # noqa: E402

from helpers import SDBlock, init_sd_block  # noqa: E402
from test_smoothing import PREFIX, _Root  # noqa: E402


def _setup():
    block = init_sd_block(SDBlock(), 0)
    root = _Root(block)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 16, 64, generator=g), torch.randn(2, 8, 48, generator=g)) for _ in range(6)]
    loop = lambda mod: [mod(x, c) for x, c in data]  # noqa: E731
    with torch.no_grad():
        stats = calibrate(root, loop)
    sd = {PREFIX + k: v.detach().clone() for k, v in block.state_dict().items()}
    sd["input_blocks.0.0.weight"] = torch.zeros(64, 4, 3, 3)  # an SD1.x UNet by its keys
    return root, loop, stats, sd


def test_max_calibration_gives_the_static_input_scales_of_the_max_rule():
    root, loop, stats, sd = _setup()
    before = {k: v.clone() for k, v in root.state_dict().items()}
    recipe = Recipe("float8_e4m3fn", sensitivity=False)
    with torch.no_grad():
        engine = modelopt_calibrate(root, loop, recipe, "max")
    assert all(torch.equal(before[k], v) for k, v in root.state_dict().items())  # the module is untouched
    out, _meta, report = quantize(sd, recipe, stats, engine=engine)
    assert any(n.startswith("calibration engine: NVIDIA ModelOpt") for n in report.notes)
    fmax = FORMATS["float8_e4m3fn"].input_fmax()
    for name, layer in engine.layers.items():
        key = PREFIX + name.split("transformer_blocks.0.", 1)[1] + ".input_scale"
        if key in out:  # ModelOpt's amax and ours saw the same inputs
            assert float(out[key]) == pytest.approx(layer.input_amax / fmax, rel=1e-6)
            assert layer.input_amax == pytest.approx(stats.layer(name).amax_value(), rel=1e-6)


def test_int8_smoothquant_folds_where_exact_and_says_where_not():
    root, loop, stats, sd = _setup()
    recipe = Recipe("int8_tensorwise", sensitivity=False)
    with torch.no_grad():
        engine = modelopt_calibrate(root, loop, recipe, "smoothquant")
    assert sum(1 for l in engine.layers.values() if l.smooth is not None) >= 6
    sink = DictSink()
    report = quantize(sd, recipe, stats, sink=sink, refuse_unknown=False, engine=engine).report
    notes = {l.name[len(PREFIX):]: l.notes for l in report.quantized}
    assert "ModelOpt smoothing folded into" in notes["attn1.to_q"] and "geometric mean" in notes["attn1.to_q"]
    assert "ModelOpt smoothing folded into" in notes["ff.net.2"]  # the GEGLU value rows
    assert not torch.equal(sink.tensors[PREFIX + "norm1.weight"], sd[PREFIX + "norm1.weight"])  # folded
    assert "dropped" in notes["attn2.to_v"]  # cross-attention values read the text context: no fold


def test_engine_needs_statistics_and_its_own_format():
    root, loop, stats, sd = _setup()
    with torch.no_grad():
        engine = modelopt_calibrate(root, loop, Recipe("int8_tensorwise"), "max")
    with pytest.raises(PlanError, match="statistics"):
        quantize(sd, Recipe("int8_tensorwise"), None, engine=engine)
    with pytest.raises(PlanError, match="made for int8_tensorwise"):
        quantize(sd, Recipe("nvfp4"), stats, engine=engine)


def test_refusals_are_clear(monkeypatch):
    root, loop, _stats, _sd = _setup()
    with pytest.raises(ModelOptError, match="needs CUDA"):
        modelopt_calibrate(root, loop, Recipe("nvfp4"), "awq_lite")
    with pytest.raises(ModelOptError, match="does not export to nvfp4"):
        modelopt_calibrate(root, loop, Recipe("nvfp4"), "smoothquant")
    with pytest.raises(ModelOptError, match="needs CUDA"):
        modelopt_calibrate(root, loop, Recipe("nvfp4"), "svdquant")
    with pytest.raises(ModelOptError, match="unknown ModelOpt algorithm"):
        modelopt_calibrate(root, loop, Recipe("nvfp4"), "gptq")
    monkeypatch.setitem(sys.modules, "modelopt", None)
    with pytest.raises(ModelOptError, match=r"pip install 'comfy-modelopt\[modelopt\]'"):
        require_modelopt()


def test_linear_subclasses_with_their_own_forward_are_calibrated():
    """ModelOpt converts nn.Linear and subclasses that keep its forward; a subclass with its own
    forward (every ComfyUI Linear) used to get no quantizer at all.  Registered by the engine: the
    subclass's forward runs, and its layers are calibrated like plain Linears."""
    class CastLinear(torch.nn.Linear):  # like comfy.ops: its own forward around F.linear
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)

    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(CastLinear(32, 64), torch.nn.GELU(), CastLinear(64, 16))
    data = [torch.randn(8, 32, generator=g) * (i + 1) for i in range(4)]
    with torch.no_grad():
        engine = modelopt_calibrate(model, lambda m: [m(x) for x in data], Recipe("int8_tensorwise"), "max")
    assert set(engine.layers) == {"0", "2"}
    assert engine.layers["0"].input_amax == pytest.approx(float(max(x.abs().max() for x in data)), rel=1e-6)
    assert type(model[0]) is CastLinear and type(model[2]) is CastLinear  # the caller's module: not converted


def test_svdquant_branch_is_the_best_rank_r_of_the_smoothed_weight(monkeypatch):
    """ModelOpt's SVDQuant: AWQ-lite smoothing, then a 16-bit rank-r branch of the smoothed weight
    whose residual is quantized.  It runs for nvfp4 on CUDA only; on a CPU its int8 variant runs
    the same algorithm, which is enough to check what is read back per layer."""
    from comfy_modelopt import modelopt_engine
    monkeypatch.setitem(modelopt_engine._ALGORITHM_FORMATS, "svdquant", ("nvfp4", "int8_tensorwise"))
    monkeypatch.setattr(modelopt_engine, "_NEEDS_CUDA", set())
    root, loop, _stats, _sd = _setup()
    with torch.no_grad():
        engine = modelopt_calibrate(root, loop, Recipe("int8_tensorwise"), "svdquant")
    assert engine.rank == modelopt_engine.SVDQUANT_RANK
    checked = 0
    for name, layer in engine.layers.items():
        if layer.lowrank is None:
            continue
        w = root.get_submodule(name).weight.detach().double()
        s = layer.smooth.double() if layer.smooth is not None else torch.ones(w.shape[1], dtype=torch.float64)
        up, down = (t.double() for t in layer.lowrank)
        r = engine.rank
        assert up.shape == (w.shape[0], r) and down.shape == (r, w.shape[1])
        ws = w * s
        best = torch.linalg.svdvals(ws)[r:].norm()  # Eckart-Young: the optimal residual
        assert float((ws - up @ down).norm()) == pytest.approx(float(best), rel=1e-3, abs=1e-6), name
        checked += 1
    assert checked >= 6


def test_svdquant_export_into_the_own_loader_file():
    """ModelOpt SVDQuant's choices (per-layer smoothing, branch) written as the own loader's
    low-rank layers: the branch and smooth_scale as given, the residual W * s - up @ down
    quantized (a forgotten subtraction would leave a weight error of ~1); the rank must match."""
    from comfy_modelopt.fileformat import LOWRANK_DOWN, LOWRANK_UP, SMOOTH_SCALE
    from comfy_modelopt.modelopt_engine import EngineLayer, EngineResult
    root, loop, stats, sd = _setup()
    with torch.no_grad():
        names = modelopt_calibrate(root, loop, Recipe("int8_tensorwise"), "max").layers
    g = torch.Generator().manual_seed(3)
    rank, engine = 4, EngineResult("svdquant", "nvfp4", rank=4)
    for name in names:
        w = root.get_submodule(name).weight.detach()
        s = torch.rand(w.shape[1], generator=g) + 0.5
        up = torch.randn(w.shape[0], rank, generator=g) * float(w.abs().mean())
        down = torch.randn(rank, w.shape[1], generator=g)
        engine.layers[name] = EngineLayer(smooth=s, lowrank=(up, down))
    sink = DictSink()
    report = quantize(sd, Recipe("nvfp4", lowrank=rank, sensitivity=False, gptq=False), stats, sink=sink,
                      refuse_unknown=False, engine=engine).report
    assert report.quantized
    for layer in report.quantized:
        rel = [n for n in names if n.endswith(layer.name[len(PREFIX):])][0]
        given = engine.layers[rel]
        assert torch.equal(sink.tensors[layer.name + LOWRANK_UP], given.lowrank[0].to(torch.bfloat16))
        assert torch.equal(sink.tensors[layer.name + LOWRANK_DOWN], given.lowrank[1].to(torch.bfloat16))
        assert torch.allclose(sink.tensors[layer.name + SMOOTH_SCALE], 1.0 / given.smooth)
        assert "ModelOpt SVDQuant low-rank r=4" in layer.notes and "smooth_scale" in layer.notes
        # the weight error of branch + dequantized residual against W * s: nvfp4's rounding of a
        # residual as large as the weight (~0.2 here), where a forgotten subtraction would leave
        # the whole branch (||up @ down|| / ||W * s||, above 1 here) as error
        ws = root.get_submodule(rel).weight.detach() * given.smooth
        forgotten = float((given.lowrank[0] @ given.lowrank[1]).norm() / ws.norm())
        assert layer.rel_err < min(0.25, forgotten / 4), (layer.name, layer.rel_err, forgotten)
    with pytest.raises(PlanError, match="lowrank 4"):
        quantize(sd, Recipe("nvfp4", sensitivity=False), stats, sink=DictSink(), refuse_unknown=False, engine=engine)


def _clip_case(sd, stats, names, smooths, family="auto"):
    """The files of awq_lite and awq_full choices (the same smoothing; awq_full with a 0.7 clip)."""
    from comfy_modelopt.modelopt_engine import EngineLayer, EngineResult
    out = {}
    for algorithm in ("awq_lite", "awq_full"):
        engine = EngineResult(algorithm, "nvfp4")
        for name in names:
            engine.layers[name] = EngineLayer(smooth=smooths[name], input_amax=1.0,
                                              weight_clip=0.7 if algorithm == "awq_full" else None)
        sink = DictSink()
        report = quantize(sd, Recipe("nvfp4", sensitivity=False), stats, sink=sink, refuse_unknown=False,
                          engine=engine, family=family).report
        out[algorithm] = (sink.tensors, {l.name: l.notes for l in report.quantized})
    (lite, _), (full, notes) = out["awq_lite"], out["awq_full"]
    return {name: (float(full[name + ".weight_scale_2"] / lite[name + ".weight_scale_2"]), note)
            for name, note in notes.items()}


def test_awq_full_clip_ratio_written_where_its_smoothing_is():
    """ModelOpt's awq_full: AWQ-lite's smoothing plus awq_clip's shrunk per-tensor amax (nvfp4).
    The shrink becomes the weight's clip factor - the file's global scale x 0.7 against the same
    calibration without it - where the layer is smoothed as ModelOpt asked (folded into its
    producer) or not smoothed at all; where the smoothing has no exact fold (a plain MLP), the
    ratio - chosen for the smoothed weight - is dropped with it, with a note."""
    from comfy_modelopt.modelopt_engine import _clip_ratio
    assert _clip_ratio(0.7 * 3.0 * (1 + 2 ** -9), 3.0) == 0.7 and _clip_ratio(3.0, 3.0) is None  # grid, 16-bit amax
    root, _loop, stats, sd = _setup()
    g = torch.Generator().manual_seed(5)
    names = [n for n, m in root.named_modules() if isinstance(m, torch.nn.Linear)]
    smooths = {n: None if n.endswith("attn2.to_out.0") else
               torch.rand(root.get_submodule(n).weight.shape[1], generator=g) + 0.5 for n in names}
    found = _clip_case(sd, stats, names, smooths)
    assert len(found) >= 7
    for name, (ratio, note) in found.items():
        assert "awq_clip ratio 0.70" in note and "dropped" not in note, (name, note)
        assert ratio == pytest.approx(0.7, rel=1e-6), (name, ratio)
        assert ("ModelOpt smoothing folded" in note) == (not name.endswith("attn2.to_out.0")), (name, note)
    model, data = _outlier_mlp("cpu")
    with torch.no_grad():
        stats = calibrate(model, lambda m: [m(x) for x in data])
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    found = _clip_case(sd, stats, ["0", "2"], {"0": torch.rand(256, generator=g) + 0.5,
                                               "2": torch.rand(512, generator=g) + 0.5}, family="generic")
    assert len(found) == 2
    for name, (ratio, note) in found.items():
        assert "ModelOpt smoothing dropped" in note and "awq_clip ratio 0.70 dropped" in note, (name, note)
        assert ratio == pytest.approx(1.0), (name, ratio)


def _outlier_mlp(device):
    """Two Linear layers whose inputs have a few large channels (as diffusion activations do)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    with torch.no_grad():
        for lin in (model[0], model[2]):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
    gain = torch.ones(256)
    gain[torch.randperm(256, generator=g)[:6]] = 20.0
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # a GPU computes in 16 bits, as ComfyUI does
    data = [(torch.randn(32, 256, generator=g) * gain).to(device, dtype) for _ in range(8)]
    return model.to(device, dtype).eval(), data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="ModelOpt's fp8 / nvfp4 fake quantization needs CUDA: "
                    "these run on the GPU machine (the export is tested on the CPU with its int8 path above)")
@pytest.mark.parametrize("fmt,algorithm", [("float8_e4m3fn", "max"), ("nvfp4", "max"), ("nvfp4", "awq_lite"),
                                           ("nvfp4", "awq_full"), ("nvfp4", "svdquant")])
def test_cuda_export_computes_what_modelopt_simulates(fmt, algorithm, monkeypatch):
    """On CUDA, ModelOpt's fp8 / nvfp4 calibration exported into our files: the module built from
    the file (ComfyUI's computation, activations quantized as a GPU that runs the format does) has
    the output error of ModelOpt's own fake-quantized model (H200: equal to 3 digits; a lost
    smoothing scale, a branch not subtracted or a wrong input scale costs a multiple of it).
    AWQ-lite's scales have no exact fold in a stock file here (no producer: the model's input
    and a GELU): dropped with a note, the file is the plain (absmax) one, not a corrupted one."""
    from comfy_modelopt import modelopt_engine
    from comfy_modelopt.modules import module_report, quantize_module
    model, data = _outlier_mlp("cuda")
    loop = lambda m: [m(x) for x in data]  # noqa: E731
    with torch.no_grad():
        stats = calibrate(model, loop)
    simulated = []
    read_back = modelopt_engine.read_back
    monkeypatch.setattr(modelopt_engine, "read_back",
                        lambda work, names, result: (simulated.append(work), read_back(work, names, result))[1])
    recipe = Recipe(fmt, sensitivity=False, lowrank=32 if algorithm == "svdquant" else 0)
    with torch.no_grad():
        engine = modelopt_calibrate(model, loop, recipe, algorithm)
    assert set(engine.layers) == {"0", "2"}
    if algorithm == "max":
        for name, layer in engine.layers.items():
            assert layer.input_amax == pytest.approx(stats.layer(name).amax_value(), rel=1e-5)
    else:
        assert all(layer.smooth is not None for layer in engine.layers.values())
    if algorithm == "awq_full":  # awq_clip's per-tensor shrink, read back on its grid (or None: kept)
        clips = [layer.weight_clip for layer in engine.layers.values()]
        print(f"awq_full clip ratios {clips}")
        assert all(c is None or 0.5 <= c < 1.0 for c in clips)
    if algorithm == "svdquant":
        assert engine.layers["0"].lowrank[0].shape == (512, 32) and engine.layers["0"].lowrank[1].shape == (32, 256)
    q = quantize_module(model, recipe, stats, native=True, engine=engine)
    x = torch.cat(data)
    with torch.no_grad():
        ref = model(x).float()
        err = lambda out: float((out.float() - ref).norm() / ref.norm())  # noqa: E731
        ours, theirs = err(q(x)), err(simulated[0](x))
        print(f"{fmt} {algorithm}: exported {ours:.4f}, ModelOpt's simulation {theirs:.4f}")
        if algorithm in ("awq_lite", "awq_full"):  # awq_full's clip ratio goes with its smoothing
            assert all("ModelOpt smoothing dropped" in l.notes for l in module_report(q).quantized)
            plain = quantize_module(model, Recipe(fmt, weight_scale="absmax", input_scale="max", sensitivity=False),
                                    stats, native=True)
            assert ours == pytest.approx(err(plain(x)), rel=1e-4)
        else:
            assert ours <= 1.05 * theirs + 1e-4, (ours, theirs)
