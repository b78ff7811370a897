"""Searches choose on some calibration prompts and are checked on others (heldout.py)."""
from __future__ import annotations

import pytest
import torch

from comfy_modelopt import Recipe, quantize
from comfy_modelopt.calibrate import calibrate
from comfy_modelopt.formats import FORMATS
from comfy_modelopt.statsfile import load_stats, save_stats


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))


def _calibrate(model, batches, group=None):
    with torch.no_grad():
        return calibrate(model, lambda m: [m(x) for x in batches], group=group)


def _sd(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_rows_remember_their_prompt_and_the_split_holds_out_whole_prompts(tmp_path):
    model = _model()
    stats = _calibrate(model, [torch.randn(4, 64) for _ in range(8)])
    s = stats.layer("0")
    assert sorted(set(s.groups)) == list(range(8)) and len(s.groups) == s.reservoir.shape[0]
    fit, held = s.held_out_split()
    held_groups = {g for g, h in zip(s.groups, held.tolist()) if h}
    assert held_groups == {3, 7} and not (fit & held).any() and bool((fit | held).all())
    save_stats(stats, str(tmp_path / "s.safetensors"))
    again = load_stats(str(tmp_path / "s.safetensors")).layer("0")
    assert again.groups == s.groups


def test_a_loop_names_its_prompts():
    model = _model()
    prompt = [0]

    def loop(m):
        for i in range(3):
            prompt[0] = i
            for _ in range(4):  # four steps of one prompt
                m(torch.randn(2, 64))
    with torch.no_grad():
        stats = calibrate(model, loop, group=lambda: prompt[0])
    assert sorted(set(stats.layer("0").groups)) == [0, 1, 2]


def test_one_prompt_means_no_split_and_no_held_out_error():
    model = _model()
    stats = _calibrate(model, [torch.randn(4, 64) for _ in range(3)], group=lambda: 0)
    assert stats.layer("0").held_out_split() is None
    _sd_out, _meta, report = quantize(_sd(model), Recipe(), stats, family="generic")
    assert all(l.held_err == -1.0 for l in report.quantized)


def test_input_clipping_that_only_fits_the_calibration_prompts_is_refused():
    """Held-out prompts carry an outlier channel 20x past anything the fit prompts had: a
    percentile clip chosen on the fit prompts would cut it; the check keeps the max, and the
    headroom the held-out prompts showed goes on top."""
    model = _model()
    batches = []
    for i in range(8):
        x = torch.randn(16, 64)
        if i % 4 == 3:
            x[:, 5] *= 20  # the held-out groups (3 and 7)
        batches.append(x)
    stats = _calibrate(model, batches)
    recipe = Recipe(input_scale="percentile", percentile=90.0)
    out, _meta, report = quantize(_sd(model), recipe, stats, family="generic")
    layer = next(l for l in report.quantized if l.name == "0")
    amax = stats.layer("0").amax_value()
    assert "worse on held-out prompts: max" in layer.notes and "input headroom" in layer.notes
    assert float(out["0.input_scale"]) >= amax / FORMATS["float8_e4m3fn"].input_fmax()
    assert layer.held_err >= 0


@pytest.mark.parametrize("fmt", ["int8_tensorwise", "mxfp8"])
def test_gptq_is_kept_only_where_held_out_prompts_agree(fmt):
    model = _model()
    stats = _calibrate(model, [torch.randn(8, 64) for _ in range(8)])
    _o, _m, plain = quantize(_sd(model), Recipe(format=fmt), stats, family="generic")
    _o, _m, rounded = quantize(_sd(model), Recipe(format=fmt, gptq=True), stats, family="generic")
    for a, b in zip(plain.quantized, rounded.quantized):
        assert "gptq" in b.notes and "held-out" in b.notes
        # the written layer is never worse on held-out prompts than plain rounding (the
        # activation error is the same dynamic per-row int8 in both)
        assert b.held_err <= a.held_err * (1 + 1e-3), (b.name, b.notes)


def test_gptq_is_one_pass_from_the_fit_rows_at_the_default_damping(monkeypatch):
    """One GPTQ pass per layer, at the default damping, from the Hessian of the fit prompts' rows
    alone: the held-out prompts then judge it against plain rounding, so they must not be in it."""
    from comfy_modelopt import gptq as gptq_mod
    model = _model()
    stats = _calibrate(model, [torch.randn(8, 64) * (1 + i % 3) for i in range(8)])
    seen = []
    real = gptq_mod.gptq
    monkeypatch.setattr(gptq_mod, "gptq", lambda w, h, *a, **k: (seen.append((h, k.get("damp"))),
                                                                 real(w, h, *a, **k))[1])
    _out, _m, report = quantize(_sd(model), Recipe(format="int8_tensorwise", gptq=True, convrot=False), stats,
                                family="generic")
    assert len(seen) == len(report.quantized) and all(d == gptq_mod.DAMPING for _h, d in seen)
    for layer in report.quantized:
        fit, _held = stats.layer(layer.name).held_out_split()
        want = gptq_mod.gram(stats.layer(layer.name).sample().float()[fit])
        assert any(h.shape == want.shape and torch.allclose(h, want) for h, _d in seen), layer.name
        assert "gptq" in layer.notes and "held-out" in layer.notes



def test_act_order_is_on_by_default_and_an_option_of_gptq():
    """act-order is on by default and means something only with GPTQ: without it the recipe is
    accepted and nothing changes; the layers of a GPTQ recipe say they used GPTQ."""
    assert Recipe().gptq_act_order and Recipe().gptq
    model = _model()
    sd = _sd(model)
    stats = _calibrate(model, [torch.randn(8, 64) for _ in range(8)])
    on, _m, _r = quantize(dict(sd), Recipe(format="nvfp4", gptq=False), stats, family="generic")
    off, _m, _r = quantize(dict(sd), Recipe(format="nvfp4", gptq=False, gptq_act_order=False), stats,
                           family="generic")
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)
    _o, _m, report = quantize(dict(sd), Recipe(format="nvfp4", gptq=True), stats, family="generic")
    assert all("gptq" in l.notes for l in report.quantized)


def test_gptq_is_off_without_statistics_and_the_file_says_so():
    """GPTQ is on by default but needs statistics: without them the layers are rounded to nearest,
    the report says why and the recipe the file records has gptq off (what was done)."""
    model = _model()
    sd = _sd(model)
    out, meta, report = quantize(dict(sd), Recipe(format="float8_e4m3fn"), None, family="generic")
    plain, _m, _r = quantize(dict(sd), Recipe(format="float8_e4m3fn", gptq=False), None, family="generic")
    assert out.keys() == plain.keys() and all(torch.equal(out[k], plain[k]) for k in out)
    assert any("gptq: off" in n and "statistics" in n for n in report.notes)
    assert report.recipe["gptq"] is False and not any("gptq" in l.notes for l in report.quantized)


def test_activation_rounding_cost_reported_and_weight_only_by_pattern():
    """fp8 W8A8 layers report what rounding their activations adds on held-out prompts (W8A8
    error less the same rounded weight computed on 16-bit inputs), the summary names the
    costliest; a weight_only pattern writes the layer it names without an input scale (16-bit
    compute: its held-out error is then the weight's alone), the others unchanged."""
    model = _model()
    batches = [torch.randn(8, 64) * (1 + 10 * (torch.rand(64) < 0.05)) for _ in range(8)]  # outlier channels
    stats = _calibrate(model, batches)
    out, _m, report = quantize(_sd(model), Recipe(gptq=False), stats, family="generic")
    by = {l.name: l for l in report.quantized}
    assert all(l.act_err > 0 and not l.weight_only for l in by.values())
    assert "activation rounding (inputs rounded" in report.summary() and "0 +" in report.summary()
    out2, _m, report2 = quantize(_sd(model), Recipe(gptq=False, weight_only=("2",)), stats, family="generic")
    by2 = {l.name: l for l in report2.quantized}
    assert "2.input_scale" not in out2 and "0.input_scale" in out2 and "2.input_scale" in out
    assert by2["2"].weight_only and by2["2"].reason == "--weight-only 2" and by2["2"].act_err == -1.0
    assert abs(by2["2"].held_err - (by["2"].held_err - by["2"].act_err)) < 1e-6
    assert torch.equal(out2["2.weight"], out["2.weight"]) and torch.equal(out2["0.weight"], out["0.weight"])
    assert by2["0"].act_err == by["0"].act_err
    assert "weight-only: 1 layers (--weight-only: 1)" in report2.summary()


def test_layers_named_weight_only_are_not_reported_as_never_calibrated():
    """The report's note on layers calibration never reached counts those layers only, not the
    ones the recipe's weight_only patterns chose (it once counted every weight-only layer)."""
    model = _model()
    stats = _calibrate(model, [torch.randn(4, 64) for _ in range(4)])
    _sd_out, _meta, report = quantize(_sd(model), Recipe(weight_only=("0",)), stats, family="generic")
    assert [l.weight_only for l in report.quantized] == [True, False]
    assert not any("never ran" in n for n in report.notes), report.notes

    class Skips(torch.nn.Module):  # its second layer never runs
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.a(x)
    skips = Skips()
    stats = _calibrate(skips, [torch.randn(4, 64) for _ in range(4)])
    _sd_out, _meta, report = quantize(_sd(skips), Recipe(), stats, family="generic")
    assert [n for n in report.notes if "never ran" in n] == [
        "1 layers never ran during calibration (written weight-only), e.g. b"], report.notes


def test_four_bit_activation_rounding_reported_with_the_allowance_that_keeps_it_8_bit():
    """4-bit layers report what rounding their inputs to 4 bits costs on held-out prompts (as a GPU
    computing nvfp4 natively does); without an fp8 allowance the summary names it, with one the
    planner's note says what it bought."""
    model = _model()
    batches = [torch.randn(8, 64) * (1 + 10 * (torch.rand(64) < 0.05)) for _ in range(8)]
    stats = _calibrate(model, batches)
    _out, _m, report = quantize(_sd(model), Recipe("nvfp4", gptq=False, fp8_allowance=0), stats, family="generic")
    assert all(l.act_err > 0 for l in report.quantized)
    assert "4-bit: fp8_allowance stores the costliest at 8-bit" in report.summary(), report.summary()
    # convrot_w4a4 has no 8-bit partner: no allowance to name
    _out, _m, w4a4 = quantize(_sd(model), Recipe("convrot_w4a4", gptq=False), stats, family="generic")
    assert "4-bit: fp8_allowance" not in w4a4.summary() and w4a4.recipe["fp8_allowance"] == 0.0
    _out, _m, guarded = quantize(_sd(model), Recipe("nvfp4", gptq=False, fp8_allowance=0.3), stats, family="generic")
    assert "4-bit: fp8_allowance" not in guarded.summary()
    assert any(n.startswith("planner: fp8_allowance 0.3") for n in guarded.notes), guarded.notes
    assert "float8_e4m3fn" in {l.format for l in guarded.quantized}
    assert guarded.total_bytes() <= report.total_bytes() + 0.3 * report.total_bytes_16bit()
