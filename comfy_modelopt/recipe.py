"""Recipe: what to do to a model, as a frozen dataclass that round-trips through JSON.

The same object is parsed by the CLI, built by the ComfyUI nodes and stored in the checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from .formats import CONVROT_GROUP_DEFAULT, CONVROT_GROUPS, NAMES

# The one vocabulary of options: the CLI's choices and the nodes' combos come from here
# (default first, as the nodes show them).  Plain values: the command line's help needs no torch.
FORMAT_CHOICES = NAMES
DEFAULT_FORMAT = "float8_e4m3fn"
WEIGHT_SCALE_METHODS = ("mse", "absmax")
INPUT_SCALE_METHODS = ("mse", "percentile", "max")
SMOOTHING_METHODS = ("none", "smoothquant", "awq")
CONV_CHOICES = ("none", "fp8")
LINEAR_DTYPES = ("int4", "int8")
CONVROT_GROUPSIZES = tuple(sorted(CONVROT_GROUPS))
DEFAULT_CONVROT_GROUPSIZE = CONVROT_GROUP_DEFAULT


def lowrank_formats() -> tuple:
    """The formats that can carry a 16-bit low-rank branch."""
    from .formats import FORMATS
    return tuple(name for name, f in FORMATS.items() if f.lowrank)


def convrot_formats() -> tuple:
    """The formats with a ConvRot option."""
    from .formats import FORMATS
    return tuple(name for name, f in FORMATS.items() if "convrot" in f.options)


@dataclass(frozen=True)
class Option:
    """How one recipe field is offered: a flag of the CLI (``--field-name``) and an input of the
    Quantize Model node, both made from this and the field's default (``cli.add_recipe_arguments``,
    ``comfyui.recipe_inputs.recipe_input``), so that a new option is one field here.  ``help`` is
    its one text, in each audience's words (``text``): ``{stats}`` where the option needs activation
    statistics (the CLI says how to make them, the node to connect a calibration), ``{with_stats}``
    for having them, ``{list}`` for how several patterns are given."""
    help: str
    choices: tuple = ()
    metavar: str | None = None
    advanced: bool = True        # node: under the advanced inputs
    optional: bool = True        # node: optional, so workflows saved before the input existed still validate
    bounds: tuple = ()           # node: (min, max, step) of a number

    def text(self, stats: str, with_stats: str, list: str) -> str:  # noqa: A002 - the placeholder's name
        out = self.help.replace("{stats}", stats).replace("{with_stats}", with_stats).replace("{list}", list)
        return out if out.endswith(".") else out + "."


FP32_TENSORS = ("16-bit", "keep")


def _opt(default, **kw):
    if isinstance(default, tuple):
        return field(default_factory=tuple, metadata={"option": Option(**kw)})
    return field(default=default, metadata={"option": Option(**kw)})


@dataclass(frozen=True)
class Recipe:
    format: str = _opt(DEFAULT_FORMAT, choices=FORMAT_CHOICES, advanced=False, optional=False,
                       help="fp8: Ada/Hopper+ (W8A8 with {with_stats}, weight-only without); int8_tensorwise: "
                            "Turing+; nvfp4/mxfp8: native on Blackwell, stored smaller everywhere; convrot_w4a4: "
                            "4-bit int4 MMA")
    weight_scale: str = _opt("mse", choices=WEIGHT_SCALE_METHODS, advanced=False, optional=False,
                             help="mse (default): search the clipping that minimises the error (on the layer's "
                                  "outputs when calibrated) - the lower error on real weights; absmax: naive. "
                                  "Figures: docs/algorithms.md#defaults")
    input_scale: str = _opt("max", choices=INPUT_SCALE_METHODS, optional=False,
                            help="How static activation scales are chosen with {with_stats} (fp8; nvfp4 with "
                                 "static_nvfp4_input): max (default; with GPTQ never worse than the mse clip "
                                 "search, and quicker), a percentile, or the mse clip search. "
                                 "Figures: docs/algorithms.md#defaults")
    percentile: float = _opt(99.99, bounds=(0.01, 100.0, 0.001),
                             help="with input_scale percentile: which percentile of the activations")
    static_nvfp4_input: bool = _opt(False, optional=False,
                                    help="nvfp4: store a calibrated input_scale instead of dynamic activation "
                                         "amax ({stats})")
    smoothing: str = _opt("none", choices=SMOOTHING_METHODS, advanced=False, optional=False,
                          help="SmoothQuant/AWQ ({stats}), applied where it folds exactly into the stock file "
                               "(SD1.x/SDXL/Wan attention and FF layers; Flux, HunyuanVideo, SD3 and Qwen-Image "
                               "through their adaLN modulation; fp8: only into LayerNorm or 16-bit producers), else "
                               "skipped and reported")
    smooth_alpha: float = _opt(0.5, bounds=(0.0, 1.0, 0.05), help="SmoothQuant migration strength")
    lowrank: int = _opt(0, metavar="R", bounds=(0, 1024, 1),
                        help="nvfp4/convrot_w4a4: keep a rank-R 16-bit branch (SVDQuant-style) and quantize the "
                             "residual. Files need this pack's loader (stock ComfyUI refuses them); smoothing then "
                             "applies to every layer")
    conv: str = _opt("none", choices=CONV_CHOICES,
                     help="fp8: also store UNet convolutions (3x3 and larger, not the network's first and last) as "
                          "fp8 with one scale per output channel, dequantized at run time (SDXL: about a fifth of "
                          "the weights). Files need this pack's loader (stock ComfyUI refuses them)")
    gptq: bool = _opt(True, optional=False,
                      help="Error-compensated rounding (every format; {stats}, else rounded to nearest and "
                           "reported), kept per layer where it beats plain rounding on held-out prompts. On: lower "
                           "error at the same speed. Figures: docs/algorithms.md#defaults")
    gptq_act_order: bool = _opt(True, help="with gptq: round each layer's columns by decreasing input energy "
                                           "(act-order) instead of in order (on by default: it won for fp8 and "
                                           "nvfp4 on real weights, at the same cost); ignored without gptq")
    sensitivity: bool = _opt(False, help="with statistics: also measure every layer's output error in every "
                                         "format (the file report's per-layer sensitivity; off by default: a large "
                                         "part of quantizing's time, and the planner measures it anyway)")
    convrot: bool = _opt(True, optional=False,
                         help="int8_tensorwise only (other formats ignore it): Hadamard-rotate weights and "
                              "activations so outlier channels spread over a group. With {with_stats} each layer "
                              "keeps it only where it lowers that layer's output error. "
                              "Figures: docs/algorithms.md#defaults")
    convrot_groupsize: int = _opt(DEFAULT_CONVROT_GROUPSIZE, choices=CONVROT_GROUPSIZES, bounds=(16, 1024, 1),
                                  help="ConvRot rotation group: int8_tensorwise takes the largest of "
                                       "1024/256/64/16 up to this that divides each layer's in_features; "
                                       "convrot_w4a4 needs in_features a multiple of it")
    linear_dtype: str = _opt("int4", choices=LINEAR_DTYPES,
                             help="convrot_w4a4: what its GEMM quantizes the (rotated) activations to - int4 "
                                  "(W4A4, the int4 tensor-core kernel) or int8 (W4A8: finer activations, int8 kernel)")
    keep: tuple[str, ...] = _opt((), metavar="PATTERN", advanced=False, optional=False,
                                 help="Layer-name patterns (globs, no .weight suffix) to keep in 16-bit, {list}, "
                                      "e.g. *.img_mlp.*")
    weight_only: tuple[str, ...] = _opt((), metavar="PATTERN",
                                        help="Layer-name patterns (globs) to store weight-only - no input scale, "
                                             "computed in 16-bit, slower than W8A8 - {list}: e.g. the layers the "
                                             "report names as costing most in activation rounding")
    budget: float = _opt(0.0, metavar="FRACTION", bounds=(0.0, 1.0, 0.01),
                         help="Mixed precision ({stats}): each Linear layer gets one of the candidates or 16-bit - "
                              "whichever buys the most accuracy per byte - with all Linear weights within this "
                              "fraction of their 16-bit size (e.g. 0.35). 0: one format for every layer")
    candidates: tuple[str, ...] = _opt((), metavar="FMT,FMT",
                                       help="with budget / max_error: the formats to choose from (default: "
                                            "nvfp4,float8_e4m3fn,int8_tensorwise; convrot and gptq apply to each)")
    max_error: float = _opt(0.0, metavar="E", bounds=(0.0, 1000.0, 0.01),
                            help="Mixed precision the other way round ({stats}; instead of budget): the smallest "
                                 "model whose summed predicted relative output error over its Linear layers stays "
                                 "within this. 0: off")
    allow_nonfinite: bool = _opt(False, help="copy source tensors that hold NaN/Inf values as they are (noted in "
                                             "the report) instead of refusing the model")
    fp32_tensors: str = _opt("16-bit", choices=FP32_TENSORS,
                             help="From an fp32 model: the tensors that stay unquantized (norms, biases, layers "
                                  "kept) in 16-bit (default: the source's 16-bit dtype, else bf16 - a quantized file "
                                  "is never larger than the 16-bit one) or keep them fp32")
    fp8_allowance: float = _opt(0.02, metavar="FRACTION", bounds=(0.0, 0.5, 0.01),
                                help="nvfp4 ({stats}): the layers whose 4-bit rounding (inputs included) costs most "
                                     "per byte are stored fp8 instead, within this share of the 16-bit Linear bytes "
                                     "- the planner's choice, on every layer's calibration inputs, reported. 0: every "
                                     "layer nvfp4")

    def __post_init__(self):
        if self.format not in NAMES:
            raise ValueError(f"unknown format {self.format!r}; choose one of: {', '.join(NAMES)}")
        _check("weight_scale", self.weight_scale, WEIGHT_SCALE_METHODS)
        _check("input_scale", self.input_scale, INPUT_SCALE_METHODS)
        _check("smoothing", self.smoothing, SMOOTHING_METHODS)
        _check("linear_dtype", self.linear_dtype, LINEAR_DTYPES)
        _check("fp32_tensors", self.fp32_tensors, FP32_TENSORS)
        if self.convrot_groupsize not in CONVROT_GROUPSIZES:
            raise ValueError(f"convrot_groupsize must be a power of 4 (16..1024), got {self.convrot_groupsize}")
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if not 0.0 <= self.fp8_allowance <= 0.5:
            raise ValueError(f"fp8_allowance is a share of the 16-bit Linear bytes in [0, 0.5], got {self.fp8_allowance}")
        if self.lowrank < 0:
            raise ValueError(f"lowrank must be >= 0, got {self.lowrank}")
        if self.lowrank and self.format not in lowrank_formats():
            raise ValueError(f"the low-rank branch is for 4-bit formats ({', '.join(lowrank_formats())}), "
                             f"not {self.format}")
        _check("conv", self.conv, CONV_CHOICES)
        object.__setattr__(self, "keep", tuple(self.keep))
        object.__setattr__(self, "weight_only", tuple(self.weight_only))
        object.__setattr__(self, "candidates", tuple(self.candidates))
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"budget is a fraction of the 16-bit bytes in (0, 1], got {self.budget}")
        for name in self.candidates:
            if name not in NAMES:
                raise ValueError(f"unknown candidate format {name!r}; choose from: {', '.join(NAMES)}")
        if self.max_error < 0:
            raise ValueError(f"max_error must be >= 0, got {self.max_error}")
        if self.budget and self.max_error:
            raise ValueError("give the planner a size budget or an error budget, not both")
        if self.candidates and not self.planned:
            raise ValueError("candidates are the planner's formats: give a budget (or max_error) too")
        if self.planned and (self.smoothing != "none" or self.lowrank):
            raise ValueError("the mixed-precision planner (budget) does not combine with smoothing or the "
                             "low-rank branch yet: quantize with one of them, or without them")

    def format_options(self, fmt=None) -> dict:
        """The fields a Format (``fmt``, a ``Format``; else this recipe's) reads (``Format.options``),
        passed to its encode/plan/conf."""
        from .formats import FORMATS
        return {name: getattr(self, name) for name in (fmt or FORMATS[self.format]).options}

    def without_statistics(self) -> "Recipe":
        """This recipe as it runs without activation statistics: GPTQ (on by default) needs them,
        so it is off - a file records what was done to it."""
        return replace(self, gptq=False, fp8_allowance=0.0) if self.gptq or self.fp8_allowance else self

    def effective(self) -> "Recipe":
        """This recipe as it runs: no fp8 allowance where it cannot act - a format without an 8-bit
        partner, a budget of the user's, smoothing or the low-rank branch (the planner takes neither)."""
        from .formats import FORMATS
        acts = FORMATS[self.format].eight_bit and not self.planned and self.smoothing == "none" and not self.lowrank
        return self if acts or not self.fp8_allowance else replace(self, fp8_allowance=0.0)

    def needs_statistics(self) -> list[str]:
        """The options set here that mean nothing without activation statistics (refused then)."""
        return [name for name, on in ((f"smoothing={self.smoothing}", self.smoothing != "none"),
                                      ("static_nvfp4_input", self.static_nvfp4_input),
                                      (f"budget={self.budget:g}", self.budget > 0),
                                      (f"max_error={self.max_error:g}", self.max_error > 0)) if on]

    @property
    def planned(self) -> bool:
        """The mixed-precision planner chooses each layer's format (planner.py)."""
        return self.budget > 0 or self.max_error > 0

    @property
    def own_loader(self) -> bool:
        """Files made with this recipe need comfy-modelopt's loader (stock ComfyUI refuses them)."""
        return self.lowrank > 0 or self.conv != "none"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["keep"] = list(self.keep)
        d["weight_only"] = list(self.weight_only)
        d["candidates"] = list(self.candidates)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def recipe_options() -> list:
    """(field, Option) of every recipe field, in the dataclass's order."""
    return [(f, f.metadata["option"]) for f in fields(Recipe)]


def recipe_default(f):
    """The default of a recipe field (a tuple field's is empty)."""
    return () if f.default_factory is not MISSING else f.default


# Where the Quantize node shows each field (``node_order``), fixed for the fields it had: saved UI
# workflows store widget values by position
_NODE_BEFORE_CALIBRATION = ("format",)
_NODE_BEFORE_RUNTIME = ("weight_scale", "input_scale", "smoothing", "gptq", "convrot", "lowrank", "conv",
                        "static_nvfp4_input", "keep", "budget", "max_error")
_NODE_AFTER_RUNTIME = ("gptq_act_order", "percentile", "smooth_alpha", "sensitivity", "convrot_groupsize",
                       "linear_dtype", "candidates", "allow_nonfinite", "weight_only")


def node_order(names=None) -> tuple:
    """The Quantize node's recipe inputs as (before its calibration input, before its runtime
    input, after it): the positions its widgets have had, then every field of ``names`` (default:
    the recipe's fields) not placed yet, in their order - a new field is a new last input, with
    no edit here (declare it after the fields there are)."""
    names = [f.name for f in fields(Recipe)] if names is None else list(names)
    placed = _NODE_BEFORE_CALIBRATION + _NODE_BEFORE_RUNTIME + _NODE_AFTER_RUNTIME
    gone = [n for n in placed if n not in names]
    if gone:  # a widget position cannot be given up: old workflows would shift
        raise ValueError(f"recipe fields the node places are missing: {', '.join(gone)}")
    return (_NODE_BEFORE_CALIBRATION, _NODE_BEFORE_RUNTIME,
            _NODE_AFTER_RUNTIME + tuple(n for n in names if n not in placed))


def split_names(values) -> tuple[str, ...]:
    """A tuple field's value from text: one or several strings, each split on commas and lines."""
    if isinstance(values, str):
        values = [values]
    return tuple(p.strip() for v in values for p in v.replace(",", "\n").splitlines() if p.strip())


def recipe_from_values(values: dict) -> Recipe:
    """The recipe of option values as the CLI's flags and the node's inputs give them (a list
    field as text, ``split_names``); fields not given keep their defaults, an unknown name is a
    TypeError."""
    tuples = {f.name for f in fields(Recipe) if isinstance(recipe_default(f), tuple)}
    return Recipe(**{k: split_names(v) if k in tuples else v for k, v in values.items()})


def _check(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
