"""The low-rank branch (comfy_modelopt.lowrank) and GPTQ rounding (comfy_modelopt.gptq)."""
import pytest
import torch

from comfy_modelopt.formats import get_format
from comfy_modelopt.formats import kitchen_reference
from comfy_modelopt.gptq import damped, gptq, gram
from comfy_modelopt.lowrank import lowrank_split

from helpers import gptq_problem, outlier_inputs


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


GPTQ_CASES = [("float8_e4m3fn", {}), ("float8_e5m2", {}), ("int8_tensorwise", {}), ("nvfp4", {}), ("mxfp8", {}),
              ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 64}),
              ("convrot_w4a4", {"convrot_groupsize": 64})]


@pytest.mark.parametrize("act_order", [False, True], ids=["", "act-order"])
@pytest.mark.parametrize("name,opts", GPTQ_CASES, ids=[n + "".join(f"-{k}" for k in o) for n, o in GPTQ_CASES])
def test_gptq_lowers_output_error_and_kitchen_reencodes_exactly(name, opts, act_order):
    """In the format's search space (rotated for ConvRot), as the GPTQ step runs it; block and
    row scales the encoder derives itself (nvfp4, mxfp8, convrot_w4a4) survive through the anchors."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(0)
    n, k = 128, 256
    w = torch.randn(n, k, generator=g) / 16
    x = outlier_inputs(512, k, seed=3) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / 16)  # correlated
    ws, xs = fmt.search_space(w, **opts), fmt.search_space(x, **opts)
    quantize_columns, scale = fmt.gptq_rounding(ws, None, **opts)
    qs = gptq(ws, damped(gram(xs), 0.01), quantize_columns, act_order=act_order)
    assert qs.is_contiguous()  # row-major, as the encoder's kernels (fp8 scaled_mm) need its qdata
    q = fmt.search_space(qs, **opts)
    _, qt = fmt.encode(q, scale=scale, **opts)
    assert qt._qdata.is_contiguous()
    _, rtn = fmt.encode(w, **opts)
    with kitchen_reference():
        deq, plain = qt.dequantize().float(), rtn.dequantize().float()
    if fmt.search_space(w, **opts) is w:
        assert torch.equal(deq, q)  # kitchen keeps every GPTQ value
    else:  # rotated back and forth in float32
        assert torch.allclose(fmt.search_space(deq, **opts), qs, atol=1e-5, rtol=0)
    err = lambda wq: float((x @ (wq - w).T).norm() / (x @ w.T).norm())  # noqa: E731
    assert err(deq) < 0.85 * err(plain), (err(deq), err(plain))


def test_mxfp8_gptq_keeps_kitchens_block_scales_at_the_binade_edge():
    """kitchen's mxfp8 block scale is 2^ceil(log2(amax / 448)): a block whose largest value sits
    just above 224 scales (225) would get half the scale if that value rounded to the nearest
    e4m3 (224); the anchor rounds up (240), so kitchen re-derives every scale and keeps every value."""
    fmt = get_format("mxfp8")
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 256, generator=g) * 0.1).clamp(-0.8, 0.8)
    w.view(64, 8, 32)[..., 5] = 225.0 / 256  # scale 2^-8: the maximum is 225 scales
    assert float(torch.tensor(225.0).to(torch.float8_e4m3fn).float()) == 224.0  # nearest goes down
    x = outlier_inputs(512, 256, seed=4)
    quantize_columns, scale = fmt.gptq_rounding(w, None)
    q = gptq(w, damped(gram(x), 0.01), quantize_columns)
    assert torch.equal(q.view(64, 8, 32)[..., 5].abs(), torch.full((64, 8), 240.0 / 256))
    _, qt = fmt.encode(q, scale=scale)
    with kitchen_reference():
        assert torch.equal(qt.dequantize().float(), q)
    assert fmt.gptq_rounding(torch.randn(64, 48), None) is None  # K not a multiple of the block


def test_act_order_puts_every_column_back_in_place():
    """With uncorrelated inputs (diagonal H) GPTQ spreads no error, so any column order gives
    plain rounding: act-order (columns by decreasing H diagonal) must return the same weight -
    a column rounded with another column's block scale, or left permuted, would not."""
    fmt = get_format("nvfp4")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 64, generator=g)
    h = torch.diag(torch.rand(64, generator=g, dtype=torch.float64) * 10 + 0.1)
    quantize_columns, _ = fmt.gptq_rounding(w, None)
    natural = gptq(w, h, quantize_columns)
    assert torch.equal(gptq(w, h, quantize_columns, act_order=True), natural)
    x = torch.randn(256, 64, generator=g) * torch.linspace(0.1, 4, 64)  # correlated through w's rounding only
    hx = damped(gram(x @ (torch.eye(64) + 0.2 * torch.randn(64, 64, generator=g))), 0.01)
    assert not torch.equal(gptq(w, hx, quantize_columns, act_order=True), gptq(w, hx, quantize_columns))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("n", [96, 37])  # 37 rows: kitchen pads the packed weight to 48
def test_nvfp4_block_clip_encodes_as_searched_and_through_gptq(act_order, n, monkeypatch):
    """nvfp4's per-block scale search (scales.search_block_clip) on its widest grid ("both"):
    never worse than the unclipped blocks on its energy-weighted objective; it clips some blocks
    and raises others; kitchen,
    given the bounds (NvFp4Format.quantize), stores exactly the block scales the search assumed
    - for raised blocks too, whose largest value kitchen alone would put at 6; GPTQ with those
    scales (clipped blocks anchored at their bound) is re-encoded by kitchen value for value,
    and beats plain rounding."""
    from comfy_modelopt import scales
    from comfy_modelopt.formats import clamp_blocks
    from comfy_modelopt.scales import search_block_clip
    monkeypatch.setattr(scales, "BLOCK_CLIP_GRID", scales.BLOCK_CLIP_GRIDS["both"])
    fmt = get_format("nvfp4")
    g = torch.Generator().manual_seed(1)
    k = 256
    w = torch.randn(n, k, generator=g) / 16
    w[:, ::37] *= 6.0  # a few large weights: blocks worth clipping
    x = outlier_inputs(512, k, seed=4)
    found = search_block_clip(fmt, w, x)
    bmax = w.abs().reshape(n, k // 16, 16).amax(-1)
    bound = found.bound
    assert bool((bound < bmax).any()) and bool((bound > bmax).any()) and found.raised > 0
    h = (x ** 2).mean(0)
    werr = lambda wq: float((((wq - w) ** 2) * h).sum())  # noqa: E731
    amax = w.abs().max()
    searched = fmt.fake_blocks(w, bound, amax=amax)
    assert torch.equal(searched, found.fake)
    assert werr(searched) < werr(fmt.fake_rows(w))
    # where no block is raised, the bounds are a clamp kitchen derives the scales from
    clip_only = torch.minimum(bound, bmax)
    assert torch.equal(fmt.fake_blocks(w, clip_only, amax=amax), fmt.fake_rows(clamp_blocks(w, clip_only), amax=amax))
    stored, qt = fmt.encode(w, block_bound=bound)
    with kitchen_reference():
        assert torch.equal(qt.dequantize().float(), searched)  # kitchen's scales are the searched ones
        # a raised block's largest value is below 6 x its stored scale: kitchen alone, given the
        # dequantized weight, derives a smaller scale for it
        again = fmt.encode(qt.dequantize().float())[0]
    assert not torch.equal(again["_scale"].view(torch.uint8), stored["_scale"].view(torch.uint8))
    quantize_columns, scale = fmt.gptq_rounding(w, None, block_bound=bound)
    q = gptq(w, damped(gram(x), 0.01), quantize_columns, act_order=act_order)
    rounded, qt = fmt.encode(q, scale=scale, block_bound=bound)
    with kitchen_reference():
        deq = qt.dequantize().float()
    assert torch.equal(deq, q)
    # GPTQ rounded on the searched blocks' scales (the weight's own would differ where bound != max)
    assert torch.equal(rounded["_scale"].view(torch.uint8), stored["_scale"].view(torch.uint8))
    err = lambda wq: float((x @ (wq - w).T).norm() / (x @ w.T).norm())  # noqa: E731
    assert err(deq) < 0.95 * err(searched), (err(deq), err(searched))


def test_nvfp4_raised_block_scales_lower_the_error(monkeypatch):
    """Raising a block's scale (bound above its max) is a choice the search takes where it lowers
    the energy-weighted error: the default grid (raises only) beats absmax and never clips, the
    grid with clips and raises ends lower than the clip-only one, kitchen stores exactly what the
    search assumed, and raised blocks keep their largest value below 6 on the E2M1 grid (kitchen's
    own encoding puts it at 6)."""
    from comfy_modelopt import scales
    fmt = get_format("nvfp4")
    g = torch.Generator().manual_seed(5)
    n, k = 64, 128
    w = torch.randn(n, k, generator=g) * (torch.rand(1, k, generator=g) + 0.2)
    x = torch.randn(300, k, generator=g) * (torch.rand(k, generator=g) * 2 + 0.1)
    h = (x ** 2).mean(0)
    werr = lambda wq: float((((wq - w) ** 2) * h).sum())  # noqa: E731
    assert scales.BLOCK_CLIP_GRID == scales.BLOCK_CLIP_GRIDS["raise"]
    default = scales.search_block_clip(fmt, w, x)
    bmax = w.abs().reshape(n, k // 16, 16).amax(-1)
    assert default.raised > 0.05 and bool((default.bound >= bmax).all())  # nothing clipped
    assert werr(default.fake) < 0.97 * werr(fmt.fake_rows(w))
    monkeypatch.setattr(scales, "BLOCK_CLIP_GRID", scales.BLOCK_CLIP_GRIDS["clip"])
    clip_only = scales.search_block_clip(fmt, w, x)
    monkeypatch.setattr(scales, "BLOCK_CLIP_GRID", scales.BLOCK_CLIP_GRIDS["both"])
    full = scales.search_block_clip(fmt, w, x)
    assert clip_only.raised == 0 and full.raised > 0.05
    assert werr(full.fake) < 0.97 * werr(clip_only.fake), (werr(full.fake), werr(clip_only.fake))
    stored, qt = fmt.encode(w, block_bound=full.bound)
    with kitchen_reference():
        deq = qt.dequantize().float()
    assert torch.equal(deq, full.fake)
    from comfy_modelopt.formats.nvfp4 import _nvfp4_block_scales
    g2 = stored["_scale_2"].float()
    raised = full.bound > w.abs().reshape(n, k // 16, 16).amax(-1)
    scale = _nvfp4_block_scales(full.bound, g2) * g2
    top = deq.reshape(n, k // 16, 16).abs().amax(-1)
    # most raised blocks store their largest value below 6 x their scale (some round up to 6)
    assert float((top[raised] < 6 * scale[raised]).float().mean()) > 0.5


def test_block_clip_search_returns_the_weights_it_made():
    """search_block_clip hands back the fake-quantized weights of its chosen bounds and of the
    unclipped blocks, equal to quantizing again (the block-clip step chooses with them instead
    of two more passes)."""
    from comfy_modelopt import scales
    from comfy_modelopt.formats import FORMATS
    fmt = FORMATS["nvfp4"]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g) * (torch.rand(1, 256, generator=g) * 3)
    x = torch.randn(40, 256, generator=g)
    chunk = scales.BLOCK_CLIP_CHUNK
    try:
        scales.BLOCK_CLIP_CHUNK = 256 * 40  # three chunks of rows
        found = scales.search_block_clip(fmt, w, x)
    finally:
        scales.BLOCK_CLIP_CHUNK = chunk
    assert found is not None
    assert torch.equal(found.fake, fmt.fake_blocks(w, found.bound, amax=w.abs().max()))
    assert torch.equal(found.fake_absmax, fmt.fake_rows(w))


def test_gptq_says_which_layers_it_rounded_from_fewer_rows_than_inputs():
    # 6 calls x 16 rows = 96 sampled rows: enough for the 64-wide layer's Hessian, not for the
    # 256-wide one's (rank-deficient) - that layer's note and the report's line say so
    from comfy_modelopt import Recipe, quantize_module
    from comfy_modelopt.calibrate import calibrate
    from comfy_modelopt.modules import module_report
    from comfy_modelopt.report import FEW_ROWS
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    xs = [torch.randn(16, 64) for _ in range(6)]
    with torch.no_grad():
        stats = calibrate(net, lambda m: [m(x) for x in xs])
    report = module_report(quantize_module(net, Recipe(format="nvfp4", gptq=True, sensitivity=False), stats))
    notes = {l.name: l.notes for l in report.layers}
    assert FEW_ROWS not in notes["0"] and "gptq" in notes["0"]
    assert f"{FEW_ROWS}: " in notes["2"] and "< 256]" in notes["2"], notes["2"]
    line = [n for n in report.notes if n.startswith("GPTQ rounded")]
    assert len(line) == 1 and "1 layers" in line[0] and "2: " in line[0] and "samples_mib_per_layer" in line[0]
    # with every layer's rows at least its inputs there is no such line
    with torch.no_grad():
        stats = calibrate(net, lambda m: [m(torch.randn(64, 64)) for _ in range(6)])
    report = module_report(quantize_module(net, Recipe(format="nvfp4", gptq=True, sensitivity=False), stats))
    assert not any(FEW_ROWS in l.notes for l in report.layers)
    assert not any(n.startswith("GPTQ rounded") for n in report.notes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU (the GPU machine runs this)")
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("name,opts", [("float8_e4m3fn", {}), ("int8_tensorwise", {"convrot": False})])
def test_block_graph_rounds_as_the_eager_loop(name, opts, act_order):
    """On a GPU the column loop of every full block is one CUDA-graph replay (fp8's and int8's
    column rounders ignore the column index): the rounded weights are the eager loop's but where
    cuBLAS, captured, summed a block's products in another order and a value on a rounding
    boundary went the other way (measured on an H200: none for fp8, a few int8 steps)."""
    from comfy_modelopt import gptq as gptq_mod
    _fmt, ws, quantize_columns, h = gptq_problem(name, opts, 96, 512, "cuda")
    assert quantize_columns.index_free
    from helpers import gptq_without
    with gptq_without():  # the graph is what runs where Triton is missing
        graphed = [gptq(ws, h, quantize_columns, act_order=act_order, damp=d) for d in (0.01, 1.0)]
    with gptq_without(graph=True):
        eager = [gptq(ws, h, quantize_columns, act_order=act_order, damp=d) for d in (0.01, 1.0)]
    for a, b in zip(graphed, eager):
        differ = a != b
        assert float(differ.float().mean()) < 2e-3, float(differ.float().mean())
        assert float((a - b).norm() / a.norm()) < 5e-3
    assert gptq_mod._BlockGraph.make(torch.zeros(3, 512, 96, device="cuda"), 128, quantize_columns) is not None


def test_gptq_rounds_the_same_on_any_number_of_cpu_threads():
    """The same model, statistics and recipe give the same bytes with 1 and 2 CPU threads: LAPACK's
    float32 Cholesky rounded differently with the thread count, and GPTQ's rounding followed it
    (gptq._upper_inverse_factor factors in float64 on a CPU)."""
    from comfy_modelopt import Recipe, quantize
    from comfy_modelopt.calibrate import CalibrationOptions, calibrate
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(32, 128, generator=g) for _ in range(8)]
    for x in xs:
        x[:, [3, 77]] *= 30
    stats = calibrate(model, lambda m: [m(x) for x in xs], CalibrationOptions(reservoir_bytes=128 * 2 * 400))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(quantize(sd, Recipe(), stats, family="generic").tensors)
    finally:
        torch.set_num_threads(before)
    assert outs[0].keys() == outs[1].keys()
    def raw(t):  # bytes: fp8 tensors compare as their codes
        return t.reshape(-1).view(torch.uint8)
    assert all(torch.equal(raw(outs[0][k]), raw(outs[1][k])) for k in outs[0])
