"""The mixed-precision planner (planner.py): budget honoured, error spent where it is cheapest."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from comfy_modelopt import Recipe, quantize
from comfy_modelopt.calibrate import calibrate
from comfy_modelopt.errors import PlanError, QuantizeError
from comfy_modelopt.fileformat import decode_comfy_quant
from comfy_modelopt.planner import Choice, Option, hull, solve, solve_error


def test_hull_drops_dominated_and_concave_options():
    opts = [Option("a", 100, 1.0), Option("b", 200, 0.2), Option("c", 150, 0.9), Option("d", 300, 0.3),
            Option("e", 400, 0.0)]
    assert [o.fmt for o in hull(opts)] == ["a", "b", "e"]  # c above the a-b segment, d dominated


def _random_layers(rnd: random.Random, n: int = 6) -> list[list[Option]]:
    """Six layers, each with a 4-bit, an 8-bit and a 16-bit option (error falling with bytes)."""
    layers = []
    for _ in range(n):
        size = rnd.randint(1, 8) * 100
        errs = sorted((rnd.random() for _ in range(3)), reverse=True)
        layers.append([Option("q4", size, errs[0]), Option("q8", 2 * size, errs[1] * 0.3),
                       Option("16", 4 * size, 0.0)])
    return layers


def test_greedy_stays_within_budget_and_beats_every_uniform_choice():
    rnd = random.Random(0)
    for _ in range(50):
        layers = _random_layers(rnd)
        budget = rnd.randint(sum(l[0].bytes for l in layers), sum(l[2].bytes for l in layers))
        choices = [Choice(None, hull(l)) for l in layers]
        used = solve(choices, budget)
        assert used <= budget and used == sum(c.chosen.bytes for c in choices)
        total = sum(c.chosen.error for c in choices)
        for pick in range(3):  # every uniform assignment that fits is no better
            if sum(l[pick].bytes for l in layers) <= budget:
                assert total <= sum(l[pick].error for l in layers) + 1e-12
        # and within the best integer assignment's reach (greedy on hulls: near-optimal)
        best = min(sum(o.error for o in combo) for combo in itertools.product(*layers)
                   if sum(o.bytes for o in combo) <= budget)
        assert total <= best + max(l[0].error for l in layers)


def test_infeasible_budget_is_refused():
    with pytest.raises(PlanError, match="raise --budget"):
        solve([Choice(None, [Option("q4", 100, 1.0)])], 50)


def _model_and_stats():
    torch.manual_seed(0)
    dims = [256, 512, 256, 512, 256]
    layers = [torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    with torch.no_grad():
        layers[1].weight[:, :4] *= 30  # one layer with outlier columns: costly in 4 bits
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        stats = calibrate(model, lambda m: [m(torch.randn(16, 256)) for _ in range(6)])
    sd = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    return sd, stats


def _linear_bytes(out: dict, names) -> int:
    return sum(t.numel() * t.element_size() for k, t in out.items()
               if any(k.startswith(n + ".") for n in names) and not k.endswith((".bias", ".comfy_quant")))


def test_budget_is_honoured_and_mixes_formats():
    sd, stats = _model_and_stats()
    names = ["0", "1", "2", "3"]
    total16 = sum(sd[n + ".weight"].numel() * 2 for n in names)
    errs = {}
    for budget in (0.3, 0.4, 0.6):
        out, _meta, report = quantize(sd, Recipe(format="nvfp4", budget=budget), stats, family="generic")
        assert _linear_bytes(out, names) <= budget * total16
        formats = {decode_comfy_quant(out[n + ".comfy_quant"], n)["format"] if n + ".comfy_quant" in out else "16-bit"
                   for n in names}
        note = next(n for n in report.notes if n.startswith("planner:"))
        assert "predicted" in note and "measured" in note
        errs[budget] = sum(l.out_err for l in report.quantized) + 0.0
        if budget == 0.4:
            assert len(formats) > 1, formats  # more bytes than nvfp4 everywhere, less than 8-bit: a mix
    _o, _m, uniform = quantize(sd, Recipe(format="nvfp4", fp8_allowance=0), stats, family="generic")
    nvfp4_err = sum(l.out_err for l in uniform.quantized)
    assert errs[0.4] < nvfp4_err and errs[0.6] < errs[0.4]


def test_fp8_allowance_stores_the_costliest_4bit_layers_fp8_within_it():
    """nvfp4's default: the layers whose 4-bit rounding costs most per byte go fp8 within the
    allowance (a share of the 16-bit Linear bytes), chosen on the calibration inputs; 0 turns it off;
    a file records the allowance only where it acted."""
    sd, stats = _model_and_stats()
    names = ["0", "1", "2", "3"]
    total16 = sum(sd[n + ".weight"].numel() * 2 for n in names)

    def run(recipe, st=stats):
        out, meta, report = quantize(sd, recipe, st, family="generic")
        fmts = {n: decode_comfy_quant(out[n + ".comfy_quant"], n)["format"] for n in names}
        return out, report, fmts
    out0, plain, f0 = run(Recipe(format="nvfp4", fp8_allowance=0))
    assert set(f0.values()) == {"nvfp4"} and not any(n.startswith("planner:") for n in plain.notes)
    out1, guarded, f1 = run(Recipe(format="nvfp4", fp8_allowance=0.06))  # room for one layer's 8 bits
    assert sorted(f1.values()) == ["float8_e4m3fn", "nvfp4", "nvfp4", "nvfp4"], f1
    assert _linear_bytes(out1, names) <= _linear_bytes(out0, names) + 0.06 * total16
    assert sum(l.out_err for l in guarded.quantized) < sum(l.out_err for l in plain.quantized)
    note = next(n for n in guarded.notes if n.startswith("planner:"))
    assert "fp8_allowance 0.06" in note and "1 float8_e4m3fn" in note
    assert guarded.recipe["fp8_allowance"] == 0.06
    # the default (0.02) has no room for a whole layer of this small model: every layer nvfp4
    assert set(run(Recipe(format="nvfp4"))[2].values()) == {"nvfp4"}
    # where it cannot act the file says 0: another format, no statistics, a budget of the user's
    assert run(Recipe(format="float8_e4m3fn"))[1].recipe["fp8_allowance"] == 0.0
    assert run(Recipe(format="nvfp4"), None)[1].recipe["fp8_allowance"] == 0.0
    assert run(Recipe(format="nvfp4", budget=0.4))[1].recipe["fp8_allowance"] == 0.0
    with pytest.raises(ValueError, match="fp8_allowance"):
        Recipe(fp8_allowance=0.6)


def test_planner_needs_statistics_and_a_plain_recipe():
    sd, _stats = _model_and_stats()
    with pytest.raises(PlanError, match="budget=0.4 needs activation statistics"):
        quantize(sd, Recipe(format="nvfp4", budget=0.4), None, family="generic")
    with pytest.raises(ValueError, match="does not combine with smoothing"):
        Recipe(format="nvfp4", budget=0.4, smoothing="awq")
    with pytest.raises(ValueError, match="give a budget"):
        Recipe(format="nvfp4", candidates=("nvfp4",))
    with pytest.raises(ValueError, match="unknown candidate"):
        Recipe(format="nvfp4", budget=0.4, candidates=("fp4",))
    with pytest.raises(ValueError, match="fraction"):
        Recipe(budget=1.5)


def test_error_budget_gives_the_smallest_file_within_it():
    rnd = random.Random(1)
    for _ in range(50):
        layers = _random_layers(rnd)
        max_error = rnd.random() * sum(l[0].error for l in layers)
        choices = [Choice(None, hull(l)) for l in layers]
        used = solve_error(choices, max_error)
        assert sum(c.chosen.error for c in choices) <= max_error + 1e-12
        assert used == sum(c.chosen.bytes for c in choices)
        best = min(sum(o.bytes for o in combo) for combo in itertools.product(*layers)
                   if sum(o.error for o in combo) <= max_error)
        assert used <= best + max(l[2].bytes - l[0].bytes for l in layers)  # within one layer's step
    choices = [Choice(None, hull(l)) for l in layers]
    assert solve_error(choices, 0.0) == sum(l[2].bytes for l in layers)        # nothing may err: 16-bit
    assert solve_error(choices, 1e9) == sum(l[0].bytes for l in layers)        # anything goes: smallest


def test_error_budget_end_to_end():
    sd, stats = _model_and_stats()
    sizes, predicted = [], []
    for max_error in (0.05, 0.2, 0.6):
        out, _meta, report = quantize(sd, Recipe(format="nvfp4", max_error=max_error), stats, family="generic")
        note = next(n for n in report.notes if n.startswith("planner: max summed error"))
        predicted.append(float(note.split("predicted ")[1].split(" ")[0]))
        sizes.append(_linear_bytes(out, ["0", "1", "2", "3"]))
        assert predicted[-1] <= max_error
    assert sizes[0] >= sizes[1] >= sizes[2] and sizes[0] > sizes[2]
    with pytest.raises(ValueError, match="not both"):
        Recipe(format="nvfp4", budget=0.4, max_error=0.1)


class _TwoBranches(torch.nn.Module):
    """Two same-shaped layers; ``loud`` has an outlier input in every 16-block that its weight
    ignores (4-bit activations lose the rest of the block: a large error of its own) but reaches
    the output scaled by 1e-3, ``quiet`` has plain inputs and reaches it whole."""

    def __init__(self):
        super().__init__()
        self.quiet, self.loud = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.head_q, self.head_l = torch.nn.Linear(64, 8), torch.nn.Linear(64, 8)
        self.register_buffer("outliers", 1 + 40 * (torch.arange(64) % 16 == 0).float())
        with torch.no_grad():
            self.loud.weight[:, ::16] = 0

    def forward(self, x):
        return self.head_q(self.quiet(x)) + 1e-3 * self.head_l(self.loud(x * self.outliers))


def test_end_to_end_prices_spend_the_budget_where_the_model_output_moves():
    """With room for one 8-bit layer, the per-layer planner upgrades the layer whose own output
    errs most; priced by the whole model (``quantize_module(..., evaluate=)``) it upgrades the one
    the model's output depends on, and the model's error is lower for it."""
    from comfy_modelopt.modules import (export_state_dict, module_report, price_end_to_end, quantize_module,
                                        quantized_layers)
    torch.manual_seed(0)
    model = _TwoBranches()
    calib, check = torch.randn(256, 64), torch.randn(256, 64)
    with torch.no_grad():
        stats = calibrate(model, lambda m: [m(x) for x in calib.split(32)])
        ref_c, ref_h = model(calib), model(check)

    def evaluate(m):
        return float((m(calib) - ref_c).norm() / ref_c.norm())
    # the fp32 heads kept at fp32 take their share of the budget: room for one 8-bit layer
    recipe = Recipe(format="int8_tensorwise", budget=0.6, keep=("head_*",), candidates=("nvfp4", "int8_tensorwise"),
                    fp32_tensors="keep")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    per_layer = quantize_module(model, recipe, stats, native=True)
    end_to_end = quantize_module(model, recipe, stats, native=True, evaluate=evaluate)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model untouched
    assert all(type(m) is torch.nn.Linear for m in (model.quiet, model.loud))

    def formats(m):
        return {n: q.conf["format"] for n, q in quantized_layers(m).items()}
    assert formats(per_layer) == {"quiet": "nvfp4", "loud": "int8_tensorwise"}  # the loud layer's own error
    assert formats(end_to_end) == {"quiet": "int8_tensorwise", "loud": "nvfp4"}
    names = ["quiet", "loud", "head_q", "head_l"]
    for m in (per_layer, end_to_end):  # both within the budget (of the 16-bit Linear weights' bytes)
        assert _linear_bytes(export_state_dict(m)[0], names) <= 0.6 * sum(
            getattr(model, n).weight.numel() * 2 for n in names)
    with torch.no_grad():
        err = {k: float((m(check) - ref_h).norm() / ref_h.norm()) for k, m in
               (("per_layer", per_layer), ("end_to_end", end_to_end))}
    assert err["end_to_end"] < 0.5 * err["per_layer"], err
    note = next(n for n in module_report(end_to_end).notes if n.startswith("planner:"))
    assert "priced end to end" in note
    # a layer the planner keeps in a format is the layer that format's own file holds
    uniform = quantized_layers(quantize_module(model, Recipe(format="int8_tensorwise", keep=("head_*",)), stats))
    assert torch.equal(quantized_layers(end_to_end)["quiet"].weight.dequantize(), uniform["quiet"].weight.dequantize())
    prices = price_end_to_end(model, recipe, stats, evaluate, native=True)
    assert set(prices) == {"quiet", "loud"} and prices["quiet"]["nvfp4"] > prices["quiet"]["int8_tensorwise"] >= 0
    with pytest.raises(QuantizeError, match="budget or max_error"):
        quantize_module(model, Recipe(format="nvfp4"), stats, evaluate=evaluate)
    with pytest.raises(QuantizeError, match="evaluate returned nan with loud kept 16-bit"):
        quantize_module(model, recipe, stats, evaluate=lambda m: float("nan") if type(m.loud) is torch.nn.Linear
                        else 0.0)
