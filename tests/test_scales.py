"""Scale choices (comfy_modelopt.scales): static input scales from the statistics, weight clip
factors by MSE search - each graded apart from the search that made it."""
import comfy_kitchen as ck
import pytest
import torch
from torch import nn

from comfy_modelopt.calibrate import calibrate
from comfy_modelopt.formats import get_format
from comfy_modelopt.scales import choose_input_scale, choose_weight_clip

from helpers import outlier_inputs


def _input_scale(ls, fmt, method, percentile=99.99):
    return choose_input_scale(fmt, method, ls.amax_value(), ls.hist, ls.sample(), percentile)


def _fp8_act_error(x, scale, fmt):
    """Squared error of kitchen's own static-scale fp8 activation rounding (what ComfyUI runs)."""
    s = torch.tensor(scale)
    xq = ck.dequantize_per_tensor_fp8(ck.quantize_per_tensor_fp8(x, s, fmt.dtype), s, torch.float32)
    return float((xq - x).square().sum())


def test_calibrated_fp8_input_scale_beats_default_by_10x():
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
        calibrated = out_err(_input_scale(st.layers["0"], fmt, method, percentile=99.999))
        assert calibrated * 10 <= default, (method, calibrated, default)


ACTIVATIONS = {
    "outlier channel": lambda s: outlier_inputs(256, 256, seed=s, channels=1, low=500, high=800),
    "channels over four decades": lambda s: torch.randn(256, 256, generator=torch.Generator().manual_seed(s))
    * torch.logspace(-4, 0, 256),
    "heavy tails": lambda s: torch.randn(256, 256, generator=torch.Generator().manual_seed(s)) ** 3 * 0.01,
}


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("acts", list(ACTIVATIONS))
def test_mse_input_clip_not_worse_than_max_on_the_real_activations(acts, name):
    """The MSE search runs on a 32-bins-per-octave histogram of |x| with a few candidate clips;
    it is graded here on the activations themselves, rounded by kitchen's fp8 quantizer, against
    the max scale and against the best of 200 clip values: within the histogram's resolution
    (3%) of max or better, and never far from the best clip.  A search that picked a poor
    candidate, or used another format's limit, fails."""
    fmt = get_format(name)
    rows = [ACTIVATIONS[acts](i) for i in range(4)]
    st = calibrate(nn.Sequential(nn.Linear(256, 16)), lambda mod: [mod(x) for x in rows])
    ls, x = st.layers["0"], torch.cat(rows)
    err = {m: _fp8_act_error(x, _input_scale(ls, fmt, m), fmt) for m in ("max", "mse")}
    amax = ls.amax_value()
    best = min(_fp8_act_error(x, amax * f / fmt.input_fmax(), fmt) for f in torch.linspace(0.02, 1, 200).tolist())
    assert err["mse"] <= 1.03 * err["max"], err
    assert err["mse"] <= 1.2 * best, (err, best)


# ---------------------------------------------------------------- weight clip
@pytest.mark.parametrize("name,clips", [("float8_e4m3fn", True), ("nvfp4", True), ("convrot_w4a4", True),
                                        ("int8_tensorwise", False)])
def test_clip_never_worse_than_absmax_as_kitchen_encodes_it(name, clips):
    """As production runs it: per-tensor formats searched on the layer's outputs, per-row formats
    on the weight (each row with its own absmax) - graded with kitchen's encoder, not the search's
    fake quantizer.  int8's 255 levels leave nothing to gain by clipping a 512-wide row: the
    search must keep absmax there."""
    fmt = get_format(name)
    w = outlier_inputs(256, 512, seed=1, channels=2, low=5, high=10) / 20
    x = outlier_inputs(128, 512, seed=2)
    per_tensor = fmt.free_scale == "tensor"
    choice = choose_weight_clip(w, fmt, "mse", xs=x if per_tensor else None)

    def err(alpha):
        d = fmt.encode(w, alpha)[1].dequantize().float() - w
        return float((x @ d.T).square().sum()) if per_tensor else float(d.square().sum())
    if not clips:
        assert choice.alpha is None
        return
    assert choice.alpha is not None and err(choice.alpha) < err(None)
    if not per_tensor:
        assert choice.alpha.shape == (256,)  # one factor per row
