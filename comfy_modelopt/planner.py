"""Mixed precision under a size budget: each Linear layer gets the format that buys the most
output accuracy per byte, the whole file staying within ``Recipe.budget`` x its 16-bit bytes -
or, with ``Recipe.max_error``, the smallest file whose summed predicted error stays within it.
Design: docs/design.md, ``planner.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .errors import PlanError
from .formats import FORMATS, Format
from .plan import assign, lay_out
from .safetensors_io import ITEMSIZE, entries_nbytes
from .smoothing import output_error

# the formats a budget chooses from unless the recipe names others (``Format.candidate`` orders them)
DEFAULT_CANDIDATES = tuple(f.name for f in sorted((f for f in FORMATS.values() if f.candidate),
                                                  key=lambda f: f.candidate))
KEEP = "16-bit"
SAMPLE_ROWS = 256


@dataclass
class Option:
    fmt: str          # a format name, or KEEP
    bytes: int
    error: float


@dataclass
class Choice:
    layer: object     # LayerPlan
    options: list     # Option, on the lower convex hull, by bytes
    at: int = 0       # index of the chosen option

    @property
    def chosen(self) -> Option:
        return self.options[self.at]


def allowed(n: int, k: int, candidates: dict):
    """(name, format, layer options) of every candidate ``{name: (Format, recipe options)}`` an
    [n, k] layer's shape allows."""
    for name, (fmt, opts) in candidates.items():
        lopts = fmt.layer_options(n, k, opts)
        if not fmt.shape_problem(n, k, **lopts):
            yield name, fmt, lopts


def format_errors(w: torch.Tensor, x: torch.Tensor, amax: float | None, candidates: dict):
    """(name, format, layer options, relative output error on ``x``) of every candidate the
    layer's shape allows: absmax scales, the calibrated static input scale where the format has
    one.  The planner's options and the report's sensitivity column are both this."""
    for name, fmt, lopts in allowed(*w.shape, candidates):
        yield name, fmt, lopts, output_error(fmt, w, x, None, amax if fmt.needs_input_scale else None, **lopts)


def _kept(layer) -> Option:
    """Kept 16-bit: the layer costs its source dtype's bytes and no error."""
    return Option(KEEP, layer.n * layer.k * ITEMSIZE[layer.src_dtype], 0.0)


def measure(layer, w: torch.Tensor, layer_stats, candidates: dict, planned_bytes) -> list[Option]:
    """Every option of one layer: (format, bytes, relative output error on its sampled inputs),
    and kept 16-bit."""
    x = layer_stats.sample()[:SAMPLE_ROWS].to(w.device)
    return [_kept(layer)] + [Option(name, planned_bytes(layer, fmt, lopts), err)
                             for name, fmt, lopts, err in format_errors(w, x, layer_stats.amax_value(), candidates)]


def hull(options: list[Option]) -> list[Option]:
    """The lower convex hull of (bytes, error), by increasing bytes and decreasing error: the
    options a greedy upgrade path can stop at (dominated ones never pay)."""
    pts = sorted(options, key=lambda o: (o.bytes, o.error))
    out: list[Option] = []
    for o in pts:
        if out and o.error >= out[-1].error:
            continue  # more bytes, no less error
        while len(out) >= 2:
            a, b = out[-2], out[-1]
            # b lies on or above the segment a -> o: drop it
            if (b.error - a.error) * (o.bytes - a.bytes) >= (o.error - a.error) * (b.bytes - a.bytes):
                out.pop()
            else:
                break
        out.append(o)
    return out


def solve(choices: list[Choice], budget_bytes: int) -> int:
    """Greedy multiple-choice knapsack on convex hulls; returns the bytes used.  Raises
    PlanError when even the smallest option of every layer exceeds the budget."""
    used = sum(c.chosen.bytes for c in choices)
    if used > budget_bytes:
        raise PlanError(f"the smallest choice for every planned layer takes {used / 2**20:.1f} MiB, over the "
                        f"{max(budget_bytes, 0) / 2**20:.1f} MiB the budget leaves them: raise --budget or add a "
                        f"smaller candidate")
    while True:
        best, best_gain = None, 0.0
        for c in choices:
            if c.at + 1 >= len(c.options):
                continue
            cur, nxt = c.options[c.at], c.options[c.at + 1]
            extra = nxt.bytes - cur.bytes
            if used + extra > budget_bytes:
                continue
            gain = (cur.error - nxt.error) / max(extra, 1)
            if gain > best_gain:
                best, best_gain = c, gain
        if best is None:
            return used
        used += best.options[best.at + 1].bytes - best.chosen.bytes
        best.at += 1


def solve_error(choices: list[Choice], max_error: float) -> int:
    """The smallest file whose summed predicted error stays within ``max_error``: every layer
    starts at its most accurate option (the hull's last), and the step down that saves the most
    bytes per unit of error added is taken while the total allows it.  Returns the bytes used."""
    for c in choices:
        c.at = len(c.options) - 1
    err = sum(c.chosen.error for c in choices)
    while True:
        best, best_rate = None, -1.0
        for c in choices:
            if c.at == 0:
                continue
            cur, lower = c.options[c.at], c.options[c.at - 1]
            added = lower.error - cur.error
            if err + added > max_error:
                continue
            rate = (cur.bytes - lower.bytes) / max(added, 1e-12)
            if rate > best_rate:
                best, best_rate = c, rate
        if best is None:
            return sum(c.chosen.bytes for c in choices)
        err += best.options[best.at - 1].error - best.chosen.error
        best.at -= 1


def resolve_candidates(recipe) -> dict[str, tuple[Format, dict]]:
    names = recipe.candidates or DEFAULT_CANDIDATES
    return {n: (FORMATS[n], recipe.format_options(FORMATS[n])) for n in names}


def speed_note(chosen: dict[str, int]) -> str:
    """Which chosen formats need which GPU to run faster, not only smaller."""
    parts = []
    for name in sorted(chosen):
        if name == KEEP:
            continue
        fmt = FORMATS[name]
        where = f"SM {fmt.native_sm[0]}.{fmt.native_sm[1]}+" if fmt.native_gate else "every GPU ComfyUI supports"
        parts.append(f"{name} computed natively on {where}")
    return "; ".join(parts) + " (elsewhere dequantized: smaller, not faster)" if parts else ""


def _planned_bytes(layer, fmt: Format, opts: dict) -> int:
    total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in fmt.planned(layer.n, layer.k, **opts).values())
    return total + (4 if fmt.needs_input_scale or fmt.static_input_scale else 0)


def priced(layer, prices: dict, candidates: dict, planned_bytes) -> list[Option]:
    """Every option of one layer with its error given in ``prices`` (format -> error; a format
    the layer's shape refuses, or that has no price, is no option); kept 16-bit: no error."""
    return [_kept(layer)] + [Option(name, planned_bytes(layer, fmt, lopts), max(float(prices[name]), 0.0))
                             for name, fmt, lopts in allowed(layer.n, layer.k, candidates) if name in prices]


def _bytes16(plan) -> int:
    """The plan's Linear weights at 16 bits: what ``Recipe.budget`` is a share of."""
    return sum(l.n * l.k * 2 for l in plan.layers)


def allowance_recipe(plan, recipe):
    """The planner's recipe for a 4-bit file's ``fp8_allowance`` (0 without statistics:
    ``Recipe.without_statistics``): the plan's bytes plus the allowance as its budget, the format
    and its 8-bit partner as candidates; None without one."""
    total16 = _bytes16(plan)
    if not recipe.fp8_allowance or not total16:
        return None
    fmt = FORMATS[recipe.format]
    used = sum(entries_nbytes(l.tensors) for l in plan.layers)
    return replace(recipe, budget=min(used / total16 + recipe.fp8_allowance, 1.0), candidates=(fmt.name, fmt.eight_bit))


def plan_budget(plan, source, stats, recipe, progress=None, prices: dict | None = None) -> dict:
    """Reassign formats of ``plan``'s eligible, calibrated layers under ``recipe.budget``
    (reads each weight once from ``source``); returns the summary the report shows.

    ``prices`` ({layer name as in the file: {format: error}}, e.g. from
    ``modules.quantize_module(..., evaluate=...)``): the options' errors are these instead of
    each layer's own output error, and no weight is read; the layers priced are the ones planned."""
    candidates = resolve_candidates(recipe)
    if prices is not None:
        chosen_layers = [l for l in plan.layers if l.eligible and l.name in prices]
    else:
        chosen_layers = [l for l in plan.layers if l.eligible and stats is not None and stats.has(l.rel)
                         and stats.layer(l.rel).has_sample()]
    ids = {id(l) for l in chosen_layers}
    fixed = sum(entries_nbytes(l.tensors) for l in plan.layers if id(l) not in ids)
    total16 = _bytes16(plan)
    choices = []
    for i, layer in enumerate(chosen_layers):
        if prices is not None:
            choices.append(Choice(layer, hull(priced(layer, prices[layer.name], candidates, _planned_bytes))))
            continue
        if progress:
            progress(i, len(chosen_layers), "planning " + layer.rel)
        w = source.read(layer.name + ".weight").float()
        choices.append(Choice(layer, hull(measure(layer, w, stats.layer(layer.rel), candidates, _planned_bytes))))
        del w
    if recipe.max_error:
        used = solve_error(choices, recipe.max_error)
    else:
        if fixed >= recipe.budget * total16:
            raise PlanError(f"the Linear layers the planner cannot change (kept 16-bit by rules or --keep, not "
                            f"calibrated) already take {fixed / total16:.3f} of the 16-bit Linear bytes, more "
                            f"than --budget {recipe.budget:g}: raise it")
        used = solve(choices, int(recipe.budget * total16) - fixed)
    counts: dict = {}
    for c in choices:
        o, layer = c.chosen, c.layer
        counts[o.fmt] = counts.get(o.fmt, 0) + 1
        if o.fmt == KEEP:
            layer.fmt, layer.conf, layer.weight_only, layer.static_input = None, None, False, False
            layer.reason = "planner: kept 16-bit (budget)"
            layer.tensors = {layer.name + ".weight": (layer.src_dtype, (layer.n, layer.k))}
        else:
            fmt, opts = candidates[o.fmt]
            assign(layer, fmt, recipe, opts, stats)
            lay_out(layer, fmt, recipe)
        layer.predicted = o.error
    return {"budget": recipe.budget, "max_error": recipe.max_error, "allowance": recipe.fp8_allowance, "fraction": (used + fixed) / total16 if total16 else 0.0,
            "counts": counts, "predicted": sum(c.chosen.error for c in choices), "layers": len(choices),
            "speed": speed_note(counts), "priced": "end to end" if prices is not None else "per layer"}
