"""Recipe: what to do to a model, as a frozen dataclass that round-trips through JSON.

The same object is parsed by the CLI, built by the ComfyUI nodes and stored in the checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from .formats import CONVROT_GROUPS, NAMES

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
DEFAULT_CONVROT_GROUPSIZE = 256


def lowrank_formats() -> tuple:
    """The formats that can carry a 16-bit low-rank branch."""
    from .formats import FORMATS
    return tuple(name for name, f in FORMATS.items() if f.lowrank)


def convrot_formats() -> tuple:
    """The formats with a ConvRot option."""
    from .formats import FORMATS
    return tuple(name for name, f in FORMATS.items() if "convrot" in f.options)


@dataclass(frozen=True)
class Recipe:
    format: str = DEFAULT_FORMAT
    weight_scale: str = "mse"          # absmax | mse (clip search on the weight, or on outputs with stats)
    input_scale: str = "mse"           # with activation statistics: max | percentile | mse
    percentile: float = 99.99          # for input_scale="percentile"
    static_nvfp4_input: bool = False   # nvfp4: store a calibrated input_scale instead of dynamic amax
    smoothing: str = "none"            # none | smoothquant | awq (needs statistics)
    smooth_alpha: float = 0.5          # SmoothQuant migration strength
    lowrank: int = 0                   # rank of the 16-bit low-rank branch (needs comfy-modelopt's loader)
    conv: str = "none"                 # none | fp8: Conv2d weights fp8 per out-channel (needs our loader)
    gptq: bool = False                 # error-compensated rounding (needs statistics)
    gptq_act_order: bool = False       # GPTQ rounds the columns by decreasing input energy
    sensitivity: bool = True           # with statistics: per-layer output error of every format
    convrot: bool = False              # formats with a "convrot" option (int8): Hadamard rotation
    convrot_groupsize: int = DEFAULT_CONVROT_GROUPSIZE
    linear_dtype: str = "int4"         # convrot_w4a4 activations: int4 or int8
    keep: tuple[str, ...] = field(default_factory=tuple)  # glob patterns forced to 16-bit
    budget: float = 0.0                # > 0: mixed precision, Linear bytes <= budget x 16-bit (planner.py)
    candidates: tuple[str, ...] = field(default_factory=tuple)  # the planner's formats (empty: default)
    max_error: float = 0.0             # > 0: the planner's smallest file with summed predicted error <= this
    allow_nonfinite: bool = False      # copy source tensors holding NaN/Inf (noted) instead of refusing them

    def __post_init__(self):
        if self.format not in NAMES:
            raise ValueError(f"unknown format {self.format!r}; choose one of: {', '.join(NAMES)}")
        _check("weight_scale", self.weight_scale, WEIGHT_SCALE_METHODS)
        _check("input_scale", self.input_scale, INPUT_SCALE_METHODS)
        _check("smoothing", self.smoothing, SMOOTHING_METHODS)
        _check("linear_dtype", self.linear_dtype, LINEAR_DTYPES)
        if self.convrot and self.format not in convrot_formats():
            raise ValueError(f"convrot applies to {', '.join(convrot_formats())} only, not {self.format}")
        if self.convrot_groupsize not in CONVROT_GROUPSIZES:
            raise ValueError(f"convrot_groupsize must be a power of 4 (16..1024), got {self.convrot_groupsize}")
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.lowrank < 0:
            raise ValueError(f"lowrank must be >= 0, got {self.lowrank}")
        if self.lowrank and self.format not in lowrank_formats():
            raise ValueError(f"the low-rank branch is for 4-bit formats ({', '.join(lowrank_formats())}), "
                             f"not {self.format}")
        _check("conv", self.conv, CONV_CHOICES)
        if self.gptq_act_order and not self.gptq:
            raise ValueError("gptq_act_order is an option of gptq: set gptq too")
        object.__setattr__(self, "keep", tuple(self.keep))
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

    def format_options(self, fmt: str | None = None) -> dict:
        """The fields a Format (this recipe's, or ``fmt``) reads (``Format.options``), passed to
        its encode/plan/conf."""
        from .formats import FORMATS
        return {name: getattr(self, name) for name in FORMATS[fmt or self.format].options}

    def needs_statistics(self) -> list[str]:
        """The options set here that mean nothing without activation statistics (refused then)."""
        return [name for name, on in ((f"smoothing={self.smoothing}", self.smoothing != "none"),
                                      ("gptq", self.gptq), ("static_nvfp4_input", self.static_nvfp4_input),
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
        d["candidates"] = list(self.candidates)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown recipe fields: {', '.join(sorted(unknown))}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "Recipe":
        return cls.from_dict(json.loads(s))


def _check(name: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
