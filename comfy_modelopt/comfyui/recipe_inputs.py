"""Node inputs made from declarations: Quantize Model's recipe inputs from the recipe's fields
(``recipe.Option``: choices, default, bounds, help), so that a new recipe field is a new input
without code here, and the order the node shows them in; Calibrate Model's sampling inputs from
``prompts.SAMPLING_OPTIONS`` (which the launcher's flags are made from too).
"""
from __future__ import annotations

import comfy.samplers
from comfy_api.latest import io

from ..prompts import SamplingOption
from ..recipe import node_order, recipe_default, recipe_options

_RECIPE_OPTIONS = {f.name: (f, o) for f, o in recipe_options()}


def recipe_input(name: str):
    """The Quantize node's input for recipe field ``name``, made from the field (``recipe.Option``):
    a combo for choices, a toggle, a number with its bounds, or text for a list of names."""
    f, o = _RECIPE_OPTIONS[name]
    default = recipe_default(f)
    kw = {"tooltip": o.text(stats="needs calibration", with_stats="a calibration", list="one per line")}
    if o.advanced:
        kw["advanced"] = True
    if o.optional:
        kw["optional"] = True
    if o.choices:
        return io.Combo.Input(name, options=list(o.choices), default=default, **kw)
    if isinstance(default, bool):
        return io.Boolean.Input(name, default=default, **kw)
    if isinstance(default, tuple):
        return io.String.Input(name, multiline=True, default="", **kw)
    lo, hi, step = o.bounds
    return (io.Int if isinstance(default, int) else io.Float).Input(name, default=default, min=lo, max=hi, step=step, **kw)


# The Quantize node's recipe inputs in the order its widgets were added (``recipe.node_order``): a
# saved UI workflow stores widget values by position, so a new field only ever goes at the end
QUANTIZE_INPUTS_BEFORE_CALIBRATION, QUANTIZE_INPUTS, QUANTIZE_INPUTS_AFTER_RUNTIME = node_order()


def sampling_input(o: SamplingOption):
    """Calibrate Model's input for one of the calibration's sampling options (prompts.SAMPLING_OPTIONS)."""
    if o.choices:
        lists = {"samplers": comfy.samplers.KSampler.SAMPLERS, "schedulers": comfy.samplers.KSampler.SCHEDULERS}
        return io.Combo.Input(o.name, options=lists[o.choices], default=o.default, tooltip=o.help)
    lo, hi, step = o.bounds
    kw = {"default": o.default, "min": lo, "max": hi, "tooltip": o.help, "advanced": o.advanced}
    if isinstance(o.default, float):
        return io.Float.Input(o.name, step=step, **kw)
    if o.name == "seed":  # as KSampler's: fixed, or changed after each run
        kw["control_after_generate"] = True
    elif step > 1:
        kw["step"] = step
    return io.Int.Input(o.name, **kw)
