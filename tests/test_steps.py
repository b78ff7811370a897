"""A layer's algorithms are steps (comfy_modelopt/steps): each a file, found and ordered by the
package, adding one needs no other change."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from comfy_modelopt import Recipe, quantize
from comfy_modelopt import steps
from comfy_modelopt.calibrate import calibrate
from comfy_modelopt.scales import ClipChoice


def _model_and_stats():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    xs = [torch.randn(8, 64) for _ in range(6)]
    for x in xs:
        x[:, 5] *= 20  # an outlier channel: the searches have something to choose
    with torch.no_grad():
        stats = calibrate(model, lambda m: [m(x) for x in xs])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats


def test_every_step_of_the_package_is_found_in_order_and_reads_real_recipe_fields():
    names = [s.name for s in steps.STEPS]
    for expected in ("smoothing", "basis", "lowrank", "modelopt", "input scale", "weight clip", "block clip", "gptq"):
        assert expected in names, names
    assert [s.order for s in steps.STEPS] == sorted(s.order for s in steps.STEPS)
    assert names.index("basis") < names.index("lowrank") < names.index("input scale") < names.index("gptq")
    recipe_fields = {f.name for f in dataclasses.fields(Recipe)}
    for s in steps.STEPS:
        assert set(s.fields) <= recipe_fields, (s.name, s.fields)


class _Note(steps.Step):
    """A step that changes nothing but the report."""
    name, order = "note", 65

    def run(self, work):
        work.notes.append("note step was here")


class _Absmax(steps.Step):
    """A step that overrides the clip the searches chose: every weight at absmax."""
    name, order = "absmax", 90

    def applies(self, work):
        return work.fmt.name == "float8_e4m3fn"

    def run(self, work):
        work.clip = ClipChoice(None, 1.0, "weight")


def test_a_new_step_is_registered_without_touching_the_pipeline():
    sd, stats = _model_and_stats()
    base_sd, _meta, base = quantize(sd, Recipe(gptq=False), stats, family="generic")
    absmax_sd, _meta, _r = quantize(sd, Recipe(gptq=False, weight_scale="absmax"), stats, family="generic")
    assert any(not torch.equal(base_sd[k], absmax_sd[k]) for k in base_sd), "the search chose nothing: no test"
    note = steps.register(_Note())
    try:
        out, _meta, report = quantize(sd, Recipe(gptq=False), stats, family="generic")
    finally:
        steps.unregister(note)
    assert all("note step was here" in l.notes for l in report.quantized)
    assert all(torch.equal(out[k], base_sd[k]) for k in base_sd)  # a no-op step: byte-identical tensors
    absmax = steps.register(_Absmax())
    try:
        out, _meta, _r = quantize(sd, Recipe(gptq=False), stats, family="generic")
    finally:
        steps.unregister(absmax)
    assert all(torch.equal(out[k], absmax_sd[k]) for k in absmax_sd)  # its choice is what is encoded
    assert absmax not in steps.STEPS and note not in steps.STEPS


def test_a_step_that_encodes_replaces_the_plain_encoding_and_gptq():
    """GPTQ applies only where no earlier step encoded; a step before it that encodes wins."""
    sd, stats = _model_and_stats()
    plain_sd, _meta, _r = quantize(sd, Recipe(gptq=False), stats, family="generic")

    class Plain(steps.Step):
        name, order = "plain", 95

        def run(self, work):
            work.encoded = work.encode_plain()
    step = steps.register(Plain())
    try:
        out, _meta, report = quantize(sd, Recipe(), stats, family="generic")
    finally:
        steps.unregister(step)
    assert all(torch.equal(out[k], plain_sd[k]) for k in plain_sd)
    assert not any("gptq" in l.notes for l in report.quantized)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "nvfp4"])
def test_the_default_steps_leave_their_notes(fmt):
    sd, stats = _model_and_stats()
    _out, _meta, report = quantize(sd, Recipe(fmt), stats, family="generic")
    assert all("gptq" in l.notes for l in report.quantized)


def test_the_plan_the_steps_read_is_frozen():
    """Once planned (the planner included), a plan and its layers refuse changes: a step that
    wrote into the plan instead of its Work fails loudly, naming the field."""
    from comfy_modelopt.plan import make_plan
    sd, stats = _model_and_stats()
    plan = make_plan({k: ("F32", tuple(v.shape)) for k, v in sd.items()}, Recipe(budget=0.5), stats=stats,
                     planner=lambda p: {"planned": len(p.layers)})
    assert plan.planner == {"planned": 2}
    with pytest.raises(AttributeError, match="LayerPlan.fmt: the plan is frozen"):
        plan.layers[0].fmt = None
    with pytest.raises(AttributeError, match="Plan.engine: the plan is frozen"):
        plan.engine = object()

    class Meddles(steps.Step):
        name, order = "meddles", 66

        def run(self, work):
            work.layer.static_input = False
    step = steps.register(Meddles())
    try:
        with pytest.raises(AttributeError, match="static_input"):
            quantize(sd, Recipe(), stats, family="generic")
    finally:
        steps.unregister(step)
