"""NVIDIA ModelOpt as an optional calibration engine (``pip install comfy-modelopt[modelopt]``).
Design: docs/design.md, ``modelopt_engine.py``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .calibrate import linear_layers
from .errors import ModelOptError, PlanError
from .families import literal_glob
from .formats import FORMATS

ALGORITHMS = ("max", "smoothquant", "awq_lite", "awq_full", "svdquant")
# the formats ModelOpt calibrates for (``Format.modelopt``: its quantizer configs and algorithms)
_QUANTIZERS = {name: f.modelopt for name, f in FORMATS.items() if f.modelopt is not None}
ENGINE_FORMATS = tuple(_QUANTIZERS)
_ALGORITHM_FORMATS = {a: tuple(n for n, q in _QUANTIZERS.items() if a in q.algorithms) for a in ALGORITHMS}
_NEEDS_CUDA = {"awq_lite", "awq_full", "svdquant"}
AWQ_CLIP_STEP = 0.05  # ModelOpt's awq_clip tries amax x 0.5, 0.55, ..., 1.0
SVDQUANT_RANK = 32  # ModelOpt's default rank


@dataclass
class EngineLayer:
    input_amax: float | None = None
    weight_amax: torch.Tensor | None = None    # scalar (per tensor) or [N] (per row), of W * smooth
    smooth: torch.Tensor | None = None         # s [K]: x / s, W * s
    lowrank: tuple | None = None               # SVDQuant's (up [N, r], down [r, K]) of W * s
    weight_clip: float | None = None           # awq_clip: its per-tensor amax / the absmax of the weight it quantized


@dataclass
class EngineResult:
    algorithm: str
    format: str
    layers: dict[str, EngineLayer] = field(default_factory=dict)
    version: str = ""
    rank: int = 0  # SVDQuant's branch rank (0: no branch)

    def note(self) -> str:
        return f"calibration engine: NVIDIA ModelOpt {self.version} ({self.algorithm})"

    def check(self, recipe, stats) -> None:
        """Refuse (PlanError) a recipe or a calibration these choices were not made for."""
        if stats is None:
            raise PlanError("the ModelOpt engine's choices go with activation statistics of the same model: "
                            "calibrate it too (the same forward loop) and pass both")
        if self.format != recipe.format:
            raise PlanError(f"the ModelOpt calibration was made for {self.format}, the recipe asks {recipe.format}")
        if self.rank and recipe.lowrank != self.rank:
            raise PlanError(f"ModelOpt's SVDQuant calibration has a rank-{self.rank} 16-bit branch per layer: "
                            f"quantize with lowrank {self.rank} (a file for comfy-modelopt's loader), not "
                            f"{recipe.lowrank}")

    def smoothing(self) -> dict:
        """The per-layer smoothing scales ModelOpt chose (layer name -> scale)."""
        return {n: l.smooth for n, l in self.layers.items() if l.smooth is not None}


def require_modelopt():
    try:
        import modelopt
        import modelopt.torch.quantization as mtq
    except ImportError as e:
        raise ModelOptError(f"the ModelOpt engine needs NVIDIA ModelOpt: pip install 'comfy-modelopt[modelopt]' "
                            f"({type(e).__name__}: {e})") from None
    return mtq, modelopt.__version__


def check_request(fmt: str, algorithm: str, device) -> tuple:
    """Refuse, before any work, what the engine cannot do: an unknown algorithm, a format it does
    not export to, a CUDA-only algorithm on another device, ModelOpt not installed.  Returns
    (``mtq``, ModelOpt's version)."""
    if algorithm not in ALGORITHMS:
        raise ModelOptError(f"unknown ModelOpt algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if fmt not in _ALGORITHM_FORMATS[algorithm]:
        raise ModelOptError(f"ModelOpt {algorithm} does not export to {fmt} here; it does to "
                            f"{', '.join(_ALGORITHM_FORMATS[algorithm])}")
    if algorithm in _NEEDS_CUDA and torch.device(device).type != "cuda":
        raise ModelOptError(f"ModelOpt {algorithm} runs fake {fmt} quantization, which needs CUDA: put "
                            f"the model on a GPU (the module is on {device})")
    return require_modelopt()


def _register_linear_subclasses(classes) -> None:
    """ModelOpt converts the module types in its registry, nn.Linear and subclasses that keep its
    forward; a subclass with a forward of its own - every ComfyUI Linear (``comfy.ops``: weight
    casting, LoRA weight functions) - was left unconverted ("Inserted 0 quantizers").  Registered
    here with ModelOpt's own Linear quantization: its input quantizer wraps the forward's input and
    its weight quantizer the ``weight`` the forward reads, so the subclass's forward runs as is."""
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from modelopt.torch.quantization.nn.modules.quant_linear import _QuantLinear
    for cls in classes:
        if issubclass(cls, torch.nn.Linear) and cls not in QuantModuleRegistry:
            QuantModuleRegistry.register({cls: f"comfy_modelopt.{cls.__module__}.{cls.__qualname__}"})(_QuantLinear)


def modelopt_calibrate(module: torch.nn.Module, forward_loop, recipe, algorithm: str = "max") -> EngineResult:
    """ModelOpt's calibration of ``module``'s Linear layers (on a copy) for ``recipe.format``."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    mtq, version = check_request(recipe.format, algorithm, device)
    work = copy.deepcopy(module)
    names = list(linear_layers(work))
    _register_linear_subclasses({type(work.get_submodule(n)) for n in names})
    wcfg, icfg = _QUANTIZERS[recipe.format].weight, _QUANTIZERS[recipe.format].input
    quant_cfg = [{"quantizer_name": "*", "enable": False}]
    for n in names:
        quant_cfg.append({"quantizer_name": literal_glob(n) + ".weight_quantizer", "cfg": wcfg})
        quant_cfg.append({"quantizer_name": literal_glob(n) + ".input_quantizer", "cfg": icfg})
    rank = (recipe.lowrank or SVDQUANT_RANK) if algorithm == "svdquant" else 0
    algo = {"method": "smoothquant", "alpha": recipe.smooth_alpha} if algorithm == "smoothquant" else \
        {"method": "svdquant", "lowrank": rank} if algorithm == "svdquant" else algorithm
    mtq.quantize(work, {"quant_cfg": quant_cfg, "algorithm": algo}, forward_loop)
    return read_back(work, names, EngineResult(algorithm, recipe.format, version=version, rank=rank))


def read_back(work: torch.nn.Module, names, result: EngineResult) -> EngineResult:
    """Per Linear layer of ModelOpt-quantized ``work``: what its calibration chose."""
    for n in names:
        m = work.get_submodule(n)
        wq, iq = getattr(m, "weight_quantizer", None), getattr(m, "input_quantizer", None)
        if wq is None:
            continue
        layer = EngineLayer()
        if iq is not None and getattr(iq, "amax", None) is not None:
            layer.input_amax = float(iq.amax.float().max())
        if getattr(wq, "amax", None) is not None:
            layer.weight_amax = wq.amax.detach().float().reshape(-1).cpu()
            if result.algorithm == "awq_full" and layer.weight_amax.numel() == 1:
                layer.weight_clip = _clip_ratio(float(layer.weight_amax), float(m.weight.detach().abs().max()))
        pqs = getattr(iq, "pre_quant_scale", None) if iq is not None else None
        if pqs is not None:
            layer.smooth = (1.0 / pqs.detach().float().reshape(-1)).cpu()
        # buffers of ModelOpt's SVDQuant quantizer (its properties assert when they are unset)
        down, up = getattr(wq, "_svdquant_lora_a", None), getattr(wq, "_svdquant_lora_b", None)
        if down is not None and up is not None:
            layer.lowrank = (up.detach().float().cpu(), down.detach().float().cpu())
        result.layers[n] = layer
    return result


def _clip_ratio(amax: float, absmax: float) -> float | None:
    """awq_clip's shrink of the per-tensor amax (None: it kept the absmax); snapped to its search
    grid, the amax having been rounded to 16 bits."""
    if absmax <= 0.0:
        return None
    r = amax / absmax
    snapped = round(round(r / AWQ_CLIP_STEP) * AWQ_CLIP_STEP, 2)
    r = snapped if abs(r - snapped) < 0.01 else r
    return r if r < 0.999 else None
