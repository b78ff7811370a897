"""Calibration engine and algorithms: statistics, input scales, clipping, smoothing, folds,
low-rank, GPTQ, sensitivity; and every bad input."""
import json

import pytest
import torch
from torch import nn

from comfy_modelopt.calibrate import CalibrationOptions, calibrate
from comfy_modelopt.formats import get_format
from comfy_modelopt.gptq import fp8_column_quantizer, gptq, hessian, int8_column_quantizer
from comfy_modelopt.lowrank import lowrank_split
from comfy_modelopt.pipeline import DictSink, DictSource, plan_folds, quantize_source
from comfy_modelopt.plan import make_plan
from comfy_modelopt.recipe import Recipe
from comfy_modelopt.scales import choose_input_scale, choose_weight_clip, squared_error
from comfy_modelopt.smoothing import output_error, search_smoothing
from comfy_modelopt.stats import ActivationStats, CalibrationError

from helpers import SDBlock, init_sd_block, outlier_inputs


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))


# ---------------------------------------------------------------- statistics
def test_streaming_equals_batch():
    m = mlp()
    xs = [torch.randn(3, 50, 64) * (1 + i) for i in range(5)]
    opts = CalibrationOptions(reservoir_bytes=64 * 2 * 120)
    many = calibrate(m, lambda mod: [mod(x) for x in xs], opts)
    one = calibrate(m, lambda mod: mod(torch.cat([x.reshape(-1, 64) for x in xs])), opts)
    assert many.forward_calls == 5 and one.forward_calls == 1
    for name in many.layers:
        a, b = many.layers[name], one.layers[name]
        assert a.rows == b.rows == 750
        assert torch.equal(a.amax, b.amax) and torch.equal(a.channel_absmax, b.channel_absmax)
        assert torch.allclose(a.channel_abssum, b.channel_abssum, rtol=1e-12)
        assert torch.equal(a.hist, b.hist) and int(a.hist.sum()) == 750 * a.k
        assert torch.equal(a.reservoir, b.reservoir)
        assert a.reservoir.shape[0] == min(750, a.capacity)


def test_reservoir_is_uniform():
    rows = torch.arange(20000, dtype=torch.float32).reshape(-1, 1).repeat(1, 8)
    seq = nn.Sequential(nn.Linear(8, 8))
    st = calibrate(seq, lambda mod: [mod(r) for r in rows.split(1000)], CalibrationOptions(reservoir_bytes=8 * 2 * 500))
    kept = st.layers["0"].sample()[:, 0]
    assert kept.numel() == 500
    # roughly uniform over the 20000 rows seen: mean near 10000, both halves represented
    assert 8500 < float(kept.mean()) < 11500 and 0.4 < float((kept < 10000).float().mean()) < 0.6


def test_reservoir_resumes_after_save_load(tmp_path):
    """Statistics saved and loaded keep accumulating as if never interrupted: the replacement
    chain is replayed from the seed up to the rows already seen."""
    m = mlp()
    xs = [torch.randn(40, 64) for _ in range(6)]
    opts = CalibrationOptions(reservoir_bytes=64 * 2 * 16)  # 16 rows of layer 0, 8 of layer 2
    whole = calibrate(m, lambda mod: [mod(x) for x in xs], opts)
    part = calibrate(m, lambda mod: [mod(x) for x in xs[:2]], opts)
    back = ActivationStats.load(part.save(str(tmp_path / "part.safetensors")))
    resumed = calibrate(m, lambda mod: [mod(x) for x in xs[2:]], opts, stats=back)
    for name in whole.layers:
        assert resumed.layers[name].rows == whole.layers[name].rows == 240
        assert torch.equal(resumed.layers[name].reservoir, whole.layers[name].reservoir), name
    assert not torch.equal(part.layers["0"].reservoir, whole.layers["0"].reservoir)  # rows were replaced


def test_reservoir_chain_is_uniform_whatever_the_split():
    """Every row ends in the reservoir with probability capacity / rows, however the rows were
    split into calls (Algorithm L's chain depends on the row index and seed only)."""
    import random

    from comfy_modelopt.stats import _ReservoirChain
    rows, capacity, trials = 2000, 20, 1500
    deciles = [0] * 10
    for seed in range(trials):
        slots, chain, split, r = list(range(capacity)), _ReservoirChain(capacity, seed), random.Random(-seed), 0
        while r < rows:
            n = min(split.randint(1, 300), rows - r)
            for slot, row in chain.take(r, r + n).items():
                slots[slot] = row
            r += n
        assert len(set(slots)) == capacity
        for row in slots:
            deciles[row * 10 // rows] += 1
    expected = trials * capacity / 10
    assert all(abs(c / expected - 1) < 0.06 for c in deciles), deciles


def test_pinned_staging_never_hands_out_overlapping_or_empty_views():
    """The staging buffer's bookkeeping (on a CPU buffer: pinning and events need CUDA): every
    put returns its own values, across half switches and exact fills."""
    from comfy_modelopt.stats import _PinnedStaging
    staging = _PinnedStaging(torch.device("cpu"), n=16)
    sizes = [3, 5, 8, 1, 7, 8, 8, 2, 6, 9, 4]  # exact fills of a half (8), and one larger than a half
    for i, m in enumerate(sizes):
        values = list(range(100 * i, 100 * i + m))
        out = staging.put(values)
        assert out.tolist() == values, (i, m)
        assert staging.used <= staging.half


def test_hooks_removed_on_error_and_interrupt():
    m = mlp()

    def boom(mod):
        mod(torch.randn(2, 64))
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        calibrate(m, boom)
    assert all(not mod._forward_pre_hooks for mod in m.modules())


def test_empty_calibration_refused():
    with pytest.raises(CalibrationError, match="no forward calls"):
        calibrate(mlp(), lambda mod: None)


def test_nonfinite_activations_refused():
    m = mlp()
    x = torch.randn(4, 64)
    x[0, 0] = float("inf")
    with pytest.raises(CalibrationError, match=r"NaN/Inf activations in 2 layers \(e.g. 2: 128 values\)"):
        calibrate(m, lambda mod: mod(x))
    st = calibrate(m, lambda mod: mod(x), CalibrationOptions(nonfinite="ignore"))
    assert st.layers["0"].nonfinite >= 1 and torch.isfinite(st.layers["0"].amax)


def test_save_load_and_fingerprint(tmp_path):
    m = mlp()
    st = calibrate(m, lambda mod: mod(torch.randn(10, 64)), info={"steps": 3})
    path = st.save(str(tmp_path / "s.safetensors"))
    back = ActivationStats.load(path)
    assert back.fingerprint == st.fingerprint and back.info == {"steps": 3}
    for n in st.layers:
        assert torch.equal(back.layers[n].hist, st.layers[n].hist)
        assert torch.equal(back.layers[n].reservoir, st.layers[n].reservoir)
    back.check_model({"0": (128, 64), "2": (32, 128)})
    with pytest.raises(CalibrationError, match=r"layer 2 is \[32, 256\] here but \[32, 128\]"):
        back.check_model({"0": (128, 64), "2": (32, 256)})
    with pytest.raises(CalibrationError, match="only 0 of its 2 layers exist here"):
        back.check_model({"blocks.0.q": (64, 64)})
    bad = tmp_path / "not-stats.safetensors"
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(bad))
    with pytest.raises(CalibrationError, match="not a comfy-modelopt statistics file"):
        ActivationStats.load(str(bad))


def test_layer_that_never_ran_is_weight_only_and_reported():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.a(x)
    m = Branchy()
    st = calibrate(m, lambda mod: mod(torch.randn(4, 64)))
    assert st.never_ran() == ["b"]
    source = {"a.weight": ("BF16", (64, 64)), "b.weight": ("BF16", (64, 64))}
    plan = make_plan(source, Recipe("float8_e4m3fn"), stats=st)
    by = {l.name: l for l in plan.layers}
    assert by["a"].static_input and not by["a"].weight_only
    assert by["b"].weight_only and "never ran" in by["b"].reason


# ---------------------------------------------------------------- activation scales
def test_calibrated_fp8_input_scale_beats_default_by_10x():
    import comfy_kitchen as ck
    torch.manual_seed(0)
    k, n = 512, 256
    w = torch.randn(n, k) / k ** 0.5
    lin = nn.Sequential(nn.Linear(k, n, bias=False))
    lin[0].weight.data = w
    xs = [outlier_inputs(128, k, seed=i) * 30 for i in range(4)]  # activations far above 448
    assert float(torch.cat(xs).abs().max()) > 448
    st = calibrate(lin, lambda mod: [mod(x) for x in xs])
    fmt = get_format("float8_e4m3fn")
    x = outlier_inputs(256, k, seed=99) * 30
    ref = x @ w.T
    _, qw = fmt.encode(w)
    wq = qw.dequantize().float()

    def out_err(scale):
        s = torch.tensor(scale)
        xq = ck.dequantize_per_tensor_fp8(ck.quantize_per_tensor_fp8(x, s, torch.float8_e4m3fn), s, torch.float32)
        return float((xq @ wq.T - ref).norm() / ref.norm())
    default = out_err(1.0)  # what ComfyUI does without input_scale
    for method in ("max", "percentile", "mse"):
        calibrated = out_err(choose_input_scale(st.layers["0"], fmt, Recipe(input_scale=method, percentile=99.999)))
        assert calibrated * 10 <= default, (method, calibrated, default)


def test_mse_input_clip_not_worse_than_max_on_histogram():
    from comfy_modelopt.scales import fp8_hist_error
    from comfy_modelopt.stats import hist_centers
    lin = nn.Sequential(nn.Linear(256, 16))
    st = calibrate(lin, lambda mod: [mod(outlier_inputs(256, 256, seed=i, channels=1, low=500, high=800))
                                     for i in range(4)])
    ls, fmt = st.layers["0"], get_format("float8_e4m3fn")
    counts = ls.hist.double()
    values = hist_centers().clamp(max=ls.amax_value())
    err = lambda s: fp8_hist_error(values, counts, s, 448.0)  # noqa: E731
    assert err(choose_input_scale(ls, fmt, Recipe(input_scale="mse"))) <= err(choose_input_scale(ls, fmt, Recipe(input_scale="max")))


# ---------------------------------------------------------------- weight-side algorithms
@pytest.mark.parametrize("name", ["float8_e4m3fn", "int8_tensorwise", "nvfp4", "convrot_w4a4"])
def test_activation_aware_clip_never_worse_than_absmax(name):
    fmt = get_format(name)
    w = outlier_inputs(256, 512, seed=1, channels=2, low=5, high=10) / 20
    x = outlier_inputs(128, 512, seed=2)
    choice = choose_weight_clip(w, fmt, "mse", xs=x)
    xr, wr = fmt.search_space(x), fmt.search_space(w)
    chosen = float(squared_error(fmt, wr, choice.alpha, wr.abs().amax(), xr).sum())
    absmax = float(squared_error(fmt, wr, None, wr.abs().amax(), xr).sum())
    assert chosen <= absmax * (1 + 1e-6)


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_smoothing_lowers_nvfp4_output_error_on_outlier_layers(method):
    fmt = get_format("nvfp4")
    gains = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        k, n = 1024, 512
        w = torch.randn(n, k, generator=g) / k ** 0.5
        x = outlier_inputs(256, k, seed=seed, channels=8)
        res = search_smoothing(w, x, x.abs().amax(0), x.abs().mean(0), fmt, method)
        plain = output_error(fmt, w, x, None)
        assert res.base_error == pytest.approx(plain)
        held_out = outlier_inputs(256, k, seed=seed)  # same outlier channels, new rows
        gains.append(1 - output_error(fmt, w, held_out, res.scales) / output_error(fmt, w, held_out, None))
    assert min(gains) >= 0.30, gains


def error_by_rank(w, fmt, ranks):
    """Relative error of (l1 @ l2 + Q(R)) against w, per rank."""
    out = {}
    for r in ranks:
        parts = lowrank_split(w, r)
        approx = parts.l1 @ parts.l2 + fmt.fake_quant(parts.residual)
        out[r] = float((approx - w).norm() / w.norm())
    return out


def test_lowrank_error_falls_with_rank():
    g = torch.Generator().manual_seed(0)
    n, k = 256, 512
    w = (torch.randn(n, 16, generator=g) @ torch.randn(16, k, generator=g)) / 8 + torch.randn(n, k, generator=g) * 0.02
    w[:, :4] *= 20  # smoothed-in outlier columns
    for name in ("nvfp4", "convrot_w4a4"):
        errs = error_by_rank(w, get_format(name), ranks=(0, 2, 4, 8, 16, 32))
        values = list(errs.values())
        assert all(b < a for a, b in zip(values, values[1:])), (name, errs)
        assert values[-1] < 0.5 * values[0]


@pytest.mark.parametrize("shape,rank", [((384, 1024), 16), ((1024, 640), 32), ((96, 200), 8)])
def test_lowrank_split_reaches_the_svd_optimum(shape, rank):
    """Large layers take randomized subspace iteration: its residual must match the exact SVD's
    (Eckart-Young) optimum, on a trained-like decaying spectrum with outlier columns."""
    from comfy_modelopt.lowrank import lowrank_split
    g = torch.Generator().manual_seed(1)
    n, k = shape
    w = (torch.randn(n, 96, generator=g) * torch.logspace(0, -2, 96)) @ torch.randn(96, k, generator=g)
    w = w + 0.02 * torch.randn(n, k, generator=g)
    w[:, :3] *= 20
    parts = lowrank_split(w, rank)
    assert parts.l1.shape == (n, rank) and parts.l2.shape == (rank, k)
    assert torch.allclose(parts.l1 @ parts.l2 + parts.residual, w, atol=1e-5)
    s = torch.linalg.svd(w.double())[1]
    optimum = float(s[rank:].norm())
    assert float(parts.residual.double().norm()) <= optimum * (1 + 1e-3)
    assert torch.equal(lowrank_split(w, rank).l2, parts.l2)  # deterministic


@pytest.mark.parametrize("name", ["float8_e4m3fn", "int8_tensorwise"])
def test_gptq_lowers_output_error_and_kitchen_reencodes_exactly(name):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(0)
    n, k = 128, 256
    w = torch.randn(n, k, generator=g) / 16
    x = outlier_inputs(512, k, seed=3) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / 16)  # correlated
    h = hessian(x)
    if name.startswith("float8"):
        scale = float(fmt.weight_scale(w, None))
        q = gptq(w, h, fp8_column_quantizer(scale, torch.float8_e4m3fn))
        _, qt = fmt.encode(q, scale=torch.tensor(scale))
        _, rtn = fmt.encode(w, scale=torch.tensor(scale))
    else:
        rs = (w.abs().amax(1) / 127)
        q = gptq(w, h, int8_column_quantizer(rs))
        _, qt = fmt.encode(q, scale=rs)
        _, rtn = fmt.encode(w, scale=rs)
    assert torch.equal(qt.dequantize().float(), q)  # kitchen keeps every GPTQ value
    err = lambda wq: float((x @ (wq - w).T).norm() / (x @ w.T).norm())  # noqa: E731
    assert err(q) < 0.8 * err(rtn.dequantize().float())


# ---------------------------------------------------------------- folds (exact smoothing)
PREFIX = "input_blocks.1.1.transformer_blocks.0."


class _Root(nn.Module):
    def __init__(self, block):
        super().__init__()
        inner = nn.ModuleList([nn.Identity(), block])
        self.input_blocks = nn.ModuleList([nn.Identity(), inner])
        block_holder = nn.Module()
        block_holder.transformer_blocks = nn.ModuleList([block])
        self.input_blocks[1][1] = block_holder

    def forward(self, x, ctx):
        return self.input_blocks[1][1].transformer_blocks[0](x, ctx)


def _sd_setup(seed=0):
    block = init_sd_block(SDBlock(), seed)
    root = _Root(block)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(2, 16, 64, generator=g), torch.randn(2, 8, 48, generator=g)) for _ in range(6)]
    stats = calibrate(root, lambda mod: [mod(x, c) for x, c in data])
    sd = {PREFIX + k: v.detach().clone() for k, v in block.state_dict().items()}
    sd["input_blocks.0.0.weight"] = torch.zeros(64, 4, 3, 3)  # makes it an SD1.x UNet by its keys
    return block, sd, stats, data


class _QuantLinear(nn.Module):
    """Dequantized weight, with the activation rounding ComfyUI applies at run time."""

    def __init__(self, weight, bias, fmt, input_scale, opts):
        super().__init__()
        self.weight, self.bias, self.fmt, self.input_scale, self.opts = weight, bias, fmt, input_scale, opts

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        act = self.fmt.fake_act(x2, self.input_scale, **self.opts)
        out = act @ self.fmt.search_space(self.weight, **self.opts).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], -1)


def _rebuild(block, out, recipe):
    """A float SDBlock holding the pipeline's output: dequantized weights, rescaled norms, and
    the runtime activation rounding of every quantized layer."""
    import copy
    fmt = get_format(recipe.format)
    new = copy.deepcopy(block)
    state, quantized = {}, {}
    for name, p in new.state_dict().items():
        key = PREFIX + name
        if name.endswith(".weight") and key[:-7] + ".comfy_quant" in out:
            layer = key[:-7]
            conf = json.loads(bytes(out[layer + ".comfy_quant"].tolist()))
            stored = {s: out[layer + k] for s, k in (("", ".weight"), ("_scale", ".weight_scale"),
                                                      ("_scale_2", ".weight_scale_2")) if layer + k in out}
            state[name] = fmt.from_stored(stored, conf, tuple(p.shape)).dequantize().float()
            scale = out.get(layer + ".input_scale")
            quantized[name[:-7]] = None if scale is None else float(scale)
        else:
            state[name] = out[key].float()
    new.load_state_dict(state)
    for name, scale in quantized.items():
        lin = new.get_submodule(name)
        parent = new.get_submodule(name.rsplit(".", 1)[0]) if "." in name else new
        child = name.rsplit(".", 1)[-1]
        q = _QuantLinear(lin.weight.data, None if lin.bias is None else lin.bias.data, fmt, scale,
                         recipe.format_options())
        if isinstance(parent, nn.ModuleList):
            parent[int(child)] = q
        else:
            setattr(parent, child, q)
    return new


class _NoRounding:
    def fake_act(self, x, *a, **k):
        return x

    def search_space(self, w, **k):
        return w


def test_folds_are_exact_in_float():
    block, sd, stats, data = _sd_setup()
    recipe = Recipe("int8_tensorwise", smoothing="smoothquant")
    source = DictSource.from_state_dict(sd)
    plan = make_plan(source.tensors, recipe, stats=stats)
    folds = plan_folds(plan, source, stats, recipe)
    assert {n.split(".", 5)[-1] for n in folds.consumer} >= {"attn1.to_q", "attn1.to_out.0", "ff.net.2"}
    folded = {}
    for key, t in sd.items():
        t = t.float().clone()
        if key in folds.rows:
            rows, inv = folds.rows[key]
            t[rows] = t[rows] * (inv.reshape(-1, 1) if t.dim() == 2 else inv)
        if key.endswith(".weight") and key[:-7] in folds.consumer:
            t = t * folds.consumer[key[:-7]]
        folded[key] = t
    new = _rebuild(block, folded, recipe)
    for m in new.modules():  # exactness of the fold itself: no rounding anywhere
        if isinstance(m, _QuantLinear):
            m.fmt = _NoRounding()
    x, c = data[0]
    assert torch.allclose(new(x, c), block(x, c), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int8_tensorwise", "nvfp4", "float8_e4m3fn"])
def test_folded_smoothing_lowers_block_error(fmt):
    """End to end on an SD transformer block with outlier LayerNorm gains: quantized with
    folded smoothing, the block's output (runtime activation rounding included) is closer to
    the float block than without.  fp8: never folded into a quantized producer (V projection,
    GEGLU value rows), whose single per-tensor scale those divided rows would fall under -
    with those folds this block measured 1.28x the unsmoothed error (the SDXL fp8 regression)."""
    block, sd, stats, data = _sd_setup()
    errs = {}
    for smoothing in ("none", "smoothquant", "awq"):
        recipe = Recipe(fmt, smoothing=smoothing, sensitivity=False)
        sink = DictSink()
        rep = quantize_source(DictSource.from_state_dict(sd), sink, recipe, stats)
        q = _rebuild(block, sink.tensors, recipe)
        g = torch.Generator().manual_seed(11)
        x, c = torch.randn(4, 16, 64, generator=g), torch.randn(4, 8, 48, generator=g)
        ref = block(x, c)
        errs[smoothing] = float((q(x, c) - ref).norm() / ref.norm())
        if smoothing != "none":
            assert any("folded into" in l.notes for l in rep.quantized)
            if fmt.startswith("float8"):
                assert any("not folded into" in l.notes and "to_v" in l.notes for l in rep.quantized)
    assert errs["smoothquant"] < errs["none"] and errs["awq"] < errs["none"], errs


def test_smoothing_without_stats_refused():
    sd = {"a.weight": torch.randn(64, 64)}
    with pytest.raises(ValueError, match="needs activation statistics"):
        quantize_source(DictSource.from_state_dict(sd), DictSink(), Recipe("nvfp4", smoothing="awq"))


# ---------------------------------------------------------------- CLI with statistics
def test_cli_with_stats_writes_w8a8_and_sensitivity(flux_file, tmp_path):
    from comfy_modelopt import cli
    from comfy_modelopt.safetensors_io import SafetensorsFile
    from comfy_modelopt.synthetic import flux_layout

    from conftest import TINY_FLUX
    from helpers import LinearTree
    tree = LinearTree(flux_layout(**TINY_FLUX), scale_amax=10.0)
    st = calibrate(tree, lambda mod: [mod(i) for i in range(3)], info={"source": "synthetic"})
    stats_path = st.save(str(tmp_path / "stats.safetensors"))
    out = tmp_path / "w8a8.safetensors"
    assert cli.main(["quantize", flux_file, "-o", str(out), "--stats", stats_path, "-q"]) == 0
    with SafetensorsFile(str(out)) as f:
        layers = json.loads(f.metadata["_quantization_metadata"])["layers"]
        report = json.loads(f.metadata["comfy_modelopt.report"])["layers"]
        calib = json.loads(f.metadata["comfy_modelopt.calibration"])
        assert calib["forward_calls"] == 3 and calib["source"] == "synthetic"
        for name, conf in layers.items():
            assert "full_precision_matrix_mult" not in conf  # true W8A8
            scale = float(f.read(name + ".input_scale"))
            assert scale == pytest.approx(report[name]["input_scale"], rel=1e-4) and scale > 1.0 / 448
            assert set(report[name]["sensitivity"]) >= {"float8_e4m3fn", "nvfp4", "int8_tensorwise"}
            assert report[name]["out_err"] > 0


def test_cli_refuses_stats_of_another_model(flux_file, tmp_path, capsys):
    from comfy_modelopt import cli
    st = calibrate(mlp(), lambda mod: mod(torch.randn(4, 64)))
    path = st.save(str(tmp_path / "other.safetensors"))
    assert cli.main(["quantize", flux_file, "-o", str(tmp_path / "o.safetensors"), "--stats", path, "-q"]) == 2
    assert "statistics are from another model" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph replay of the statistics")
def test_graphed_statistics_equal_eager():
    """The per-call statistics replayed from CUDA graphs equal the eager ones exactly, with
    nonfinite inputs sanitized too; inputs over the size limit stay eager."""
    from comfy_modelopt.stats import LayerStats, UpdateGraphs
    g = torch.Generator(device="cuda").manual_seed(0)
    for sanitize in (False, True):
        graphs = UpdateGraphs(max_input_bytes=64 * 96 * 2)
        eager, graphed = LayerStats(96, 32, seed=1, sanitize=sanitize), LayerStats(96, 32, seed=1, sanitize=sanitize)
        for i in range(4):
            x = torch.randn(64 if i < 3 else 65, 96, generator=g, device="cuda", dtype=torch.float16) * (i + 1)
            x[i, i] = float("inf") if sanitize else x[i, i]
            eager.update(x)
            graphed.update(x, graphs)
        for s in (eager, graphed):
            s.finish()
        assert graphs.captures == 1 and graphs.replays == 3 and len(graphs.skipped) == 1  # 65 rows: too large
        for name in ("amax", "channel_absmax", "channel_abssum", "hist", "reservoir"):
            assert torch.equal(getattr(eager, name), getattr(graphed, name)), (sanitize, name)
        assert eager.nonfinite == graphed.nonfinite == (4 if sanitize else 0)
        graphs.release()
    m = mlp().cuda()
    xs = [torch.randn(3, 50, 64, device="cuda") for _ in range(3)]
    a = calibrate(m, lambda mod: [mod(x) for x in xs], CalibrationOptions(cuda_graphs=False))
    b = calibrate(m, lambda mod: [mod(x) for x in xs])
    for name in a.layers:
        assert torch.equal(a.layers[name].hist, b.layers[name].hist)
        assert torch.equal(a.layers[name].channel_abssum, b.layers[name].channel_abssum)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the hooks never wait for the GPU")
def test_hooks_do_not_synchronise_on_cuda():
    m = mlp().cuda()
    xs = [torch.randn(64, 64, device="cuda") for _ in range(3)]
    small = CalibrationOptions(reservoir_bytes=64 * 2 * 16)  # full after one call: rows get replaced
    calibrate(m, lambda mod: mod(xs[0]), small)  # first call allocates (pinned staging too)

    def loop(mod):  # only the forward passes: finish() reads counts back once, after the loop
        mod(xs[0])  # the first input of a shape captures its statistics graph (one synchronisation)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return [mod(x) for x in xs[1:]]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    st = calibrate(m, loop, small)
    assert st.layers["0"].rows == 192
    cpu = calibrate(mlp(), lambda mod: [mod(x.cpu()) for x in xs], small)  # same rows sampled on the CPU
    assert torch.equal(st.layers["0"].reservoir.cpu(), cpu.layers["0"].reservoir)
