"""The recipe: one vocabulary for the CLI, the nodes and the file, round-tripping through JSON."""
import dataclasses
import json

import pytest

from comfy_modelopt import cli
from comfy_modelopt.recipe import (CONV_CHOICES, FORMAT_CHOICES, INPUT_SCALE_METHODS, LINEAR_DTYPES,
                                   SMOOTHING_METHODS, WEIGHT_SCALE_METHODS, Recipe, _opt, node_order)

NON_DEFAULT = Recipe(format="convrot_w4a4", weight_scale="absmax", input_scale="percentile", percentile=99.9,
                     smoothing="awq", smooth_alpha=0.7, lowrank=16, gptq=False, gptq_act_order=False,
                     sensitivity=True,
                     convrot_groupsize=64, linear_dtype="int8", keep=("*.img_mlp.*", "final_layer.*"),
                     weight_only=("*.proj",))


@pytest.mark.parametrize("recipe", [Recipe(), NON_DEFAULT, Recipe("int8_tensorwise", convrot=True),
                                    Recipe("float8_e4m3fn", conv="fp8", static_nvfp4_input=True)])
def test_json_round_trip(recipe):
    text = recipe.to_json()
    back = Recipe(**json.loads(text))  # what a file's stored recipe reads back as
    assert back == recipe and back.to_json() == text
    assert isinstance(back.keep, tuple)


# the planner's fields (they do not combine with smoothing or the low-rank branch)
PLANNED = Recipe(format="int8_tensorwise", convrot=True, gptq=True, budget=0.35,
                 candidates=("nvfp4", "int8_tensorwise"))


@pytest.mark.parametrize("recipe", [NON_DEFAULT, PLANNED])
def test_every_field_survives(recipe):  # a new field that to_dict forgets fails here
    d = json.loads(recipe.to_json())
    assert set(d) == {f.name for f in dataclasses.fields(Recipe)}
    assert all(getattr(recipe, k) == (tuple(v) if isinstance(getattr(recipe, k), tuple) else v) for k, v in d.items())
    assert Recipe(**json.loads(recipe.to_json())) == recipe
    default = Recipe()
    changed = {k for k in d if getattr(default, k) != getattr(recipe, k)}
    assert changed, "the test recipe sets something"


def test_cli_builds_an_error_budget_recipe():
    a = cli._parser().parse_args(["quantize", "s.safetensors", "-o", "o.safetensors", "--max-error", "0.5"])
    assert cli.recipe_of(a) == Recipe(max_error=0.5)


def test_cli_builds_a_planned_recipe():
    a = cli._parser().parse_args(["quantize", "s.safetensors", "-o", "o.safetensors", "--format", "int8_tensorwise",
                                  "--convrot", "--gptq", "--budget", "0.35", "--candidates", "nvfp4, int8_tensorwise"])
    assert cli.recipe_of(a) == PLANNED


def test_unknown_fields_and_values_refused():
    with pytest.raises(TypeError, match="colour"):
        Recipe(**json.loads('{"colour": "red"}'))
    with pytest.raises(ValueError, match="smoothing must be one of"):
        Recipe(**json.loads('{"smoothing": "magic"}'))


def _choices(option):
    sub = next(a for a in cli._parser()._actions if a.dest == "command").choices["quantize"]
    return tuple(next(a for a in sub._actions if option in a.option_strings).choices)


def test_cli_choices_are_the_recipes():
    assert _choices("--format") == FORMAT_CHOICES
    assert _choices("--weight-scale") == WEIGHT_SCALE_METHODS
    assert _choices("--input-scale") == INPUT_SCALE_METHODS
    assert _choices("--smoothing") == SMOOTHING_METHODS
    assert _choices("--conv") == CONV_CHOICES
    assert _choices("--linear-dtype") == LINEAR_DTYPES


def test_cli_builds_the_recipe_it_was_given():
    a = cli._parser().parse_args(["quantize", "s.safetensors", "-o", "o.safetensors", "--format", "convrot_w4a4",
                                  "--weight-scale", "absmax", "--input-scale", "percentile", "--percentile", "99.9",
                                  "--smoothing", "awq", "--smooth-alpha", "0.7", "--lowrank", "16", "--no-gptq",
                                  "--no-gptq-act-order", "--sensitivity",
                                  "--convrot-groupsize", "64", "--linear-dtype", "int8", "--keep", "*.img_mlp.*",
                                  "--keep", "final_layer.*", "--weight-only", "*.proj"])
    assert cli.recipe_of(a) == NON_DEFAULT


def test_cli_offers_every_recipe_field_with_the_recipes_default():
    """One schema: a new recipe field is a CLI flag without another line here or in cli.py."""
    a = cli._parser().parse_args(["quantize", "s.safetensors", "-o", "o.safetensors"])
    assert cli.recipe_of(a) == Recipe()
    sub = next(x for x in cli._parser()._actions if x.dest == "command").choices["quantize"]
    flags = {o for x in sub._actions for o in x.option_strings}
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(Recipe)} <= flags
    a = cli._parser().parse_args(["quantize", "s.safetensors", "-o", "o.safetensors", "--no-sensitivity",
                                  "--allow-nonfinite", "--keep", "a.*,b.*", "--keep", "c.*"])
    assert cli.recipe_of(a) == Recipe(sensitivity=False, allow_nonfinite=True, keep=("a.*", "b.*", "c.*"))


def test_a_new_field_is_the_node_s_last_input_without_an_edit():
    """The Quantize node's widget order: every field placed once, the placed ones where saved
    workflows have them, and a field declared after them (a new algorithm's) appended - read
    from the dataclass, not listed anywhere."""
    names = [f.name for f in dataclasses.fields(Recipe)]
    order = node_order()
    assert sorted(n for part in order for n in part) == sorted(names)
    Wider = dataclasses.make_dataclass("Wider", [("tiny_step", bool, _opt(False, help="a no-op step"))],
                                       bases=(Recipe,), frozen=True)
    wider = node_order(f.name for f in dataclasses.fields(Wider))
    assert wider[:2] == order[:2] and wider[2] == order[2] + ("tiny_step",)
    with pytest.raises(ValueError, match="gptq_act_order"):  # a position given up would shift old workflows
        node_order(n for n in names if n != "gptq_act_order")


def test_defaults_are_the_measured_ones():
    """The defaults docs/algorithms.md ('Defaults') measured: ConvRot on for int8_tensorwise
    (ignored by formats without it: their options never see it), GPTQ on with act-order where
    there are statistics (off without them: the recipe a file records is what was done)."""
    r = Recipe()
    assert r.convrot and r.gptq and r.gptq_act_order
    assert not r.without_statistics().gptq and r.without_statistics().convrot
    assert "gptq" not in " ".join(r.needs_statistics())
    assert Recipe("int8_tensorwise").format_options()["convrot"] is True
    for name in ("float8_e4m3fn", "nvfp4", "mxfp8"):
        assert "convrot" not in Recipe(name).format_options()
    assert Recipe("float8_e4m3fn", convrot=True) == Recipe("float8_e4m3fn")
