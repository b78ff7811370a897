"""Choosing scales (never encoding them): weight clip factors by MSE search.
Design: docs/design.md, ``scales.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import Format
from .stats import hist_centers, hist_percentile

# Per-tensor searches look at a row subset of at most this many elements, then confirm on all.
SEARCH_ELEMENTS = 1 << 22
# A candidate's passes run over row blocks of this many elements: on a CPU small enough to stay in
# cache (the search is memory bound there); on a GPU large, since there every block is a dozen
# kernel launches (small blocks made a third of Flux's quantize time: docs/benchmarks.md, section 0)
ROW_CHUNK_ELEMENTS = 1 << 18
GPU_CHUNK_ELEMENTS = 1 << 24
SEARCH_COLUMNS = 4096


@dataclass
class ClipChoice:
    alpha: torch.Tensor | None   # None = absmax (alpha 1 everywhere)
    mean_alpha: float
    objective: str               # "weight" or "output"
    block_bound: torch.Tensor | None = None  # nvfp4: each 16-block scaled from this |w| [N, K/16] (search_block_clip)


def squared_error(fmt: Format, x: torch.Tensor, alpha, amax=None, xs: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Per-row squared error of fake-quantized x; on the outputs ``xs @ x.T`` when xs is given."""
    d = fmt.fake_rows(x, alpha, amax) - x
    if xs is None:
        return d.square().sum(dim=1)
    return (xs @ d.T).square().sum(dim=0)


def choose_weight_clip(w: torch.Tensor, fmt: Format, method: str = "mse",
                       xs: torch.Tensor | None = None, **opts) -> ClipChoice:
    """Clip factor minimising weight MSE (or output MSE on sampled inputs ``xs`` [m, K]).

    ``w`` is float32 [N, K]; ``xs`` holds input rows in the same basis as ``w``.
    """
    objective = "output" if xs is not None else "weight"
    if method == "absmax" or not fmt.free_scale:
        return ClipChoice(None, 1.0, objective)
    if method != "mse":
        raise ValueError(f"unknown weight scale method {method!r} (absmax or mse)")
    x = fmt.search_space(w, **opts)
    if xs is not None:
        xs = fmt.search_space(xs.to(w.device), **opts)
    grid = fmt.clip_candidates()
    if fmt.free_scale == "row":
        return _search_rows(fmt, x, xs, grid, objective)
    return _search_tensor(fmt, x, xs, grid, objective)


def _row_chunks(x: torch.Tensor):
    """Row blocks a candidate's passes run over (``ROW_CHUNK_ELEMENTS``, ``GPU_CHUNK_ELEMENTS``)."""
    step = max(1, (GPU_CHUNK_ELEMENTS if x.is_cuda else ROW_CHUNK_ELEMENTS) // max(1, x.shape[1]))
    for r0 in range(0, x.shape[0], step):
        yield x[r0:r0 + step]


def _search_rows(fmt, x, xs, grid, objective) -> ClipChoice:
    best = torch.ones(x.shape[0], device=x.device)
    rowmax = x.abs().amax(dim=-1, keepdim=True)
    if xs is None and x.shape[1] > SEARCH_COLUMNS:
        # the weight objective of a wide row is estimated on evenly spaced columns; the clip
        # bound still comes from the whole row
        x = x[:, ::x.shape[1] // SEARCH_COLUMNS].contiguous()
    r0 = 0
    for rows in _row_chunks(x):
        best_err = torch.full((rows.shape[0],), float("inf"), device=x.device)
        chunk_best = best[r0:r0 + rows.shape[0]]
        chunk_max = rowmax[r0:r0 + rows.shape[0]]
        r0 += rows.shape[0]
        for a in grid.tolist():
            err = squared_error(fmt, rows, torch.tensor(a), chunk_max, xs=xs)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            chunk_best.masked_fill_(better, a)
    if bool((best == 1.0).all()):
        return ClipChoice(None, 1.0, objective)
    return ClipChoice(best, float(best.mean()), objective)


def _search_tensor(fmt, x, xs, grid, objective) -> ClipChoice:
    amax = x.abs().amax()
    rows = x
    step = max(1, (x.numel() + SEARCH_ELEMENTS - 1) // SEARCH_ELEMENTS)
    if step > 1:
        rows = x[::step]
    # each block's float32 sum added in float64, on the search's device: read once at the end
    errs = torch.zeros(len(grid), dtype=torch.float64, device=x.device)
    for chunk in _row_chunks(rows):
        for i, a in enumerate(grid.tolist()):
            errs[i] += squared_error(fmt, chunk, torch.tensor(a), amax, xs).sum().double()
    a_best = float(grid[int(errs.argmin())])
    if a_best == 1.0:
        return ClipChoice(None, 1.0, objective)
    if step > 1:  # confirm on every row that the subset's choice beats absmax
        def total(a):
            out = torch.zeros((), dtype=torch.float64, device=x.device)
            for c in _row_chunks(x):
                out += squared_error(fmt, c, a, amax, xs).sum().double()
            return out
        if bool(total(torch.tensor(a_best)) >= total(None)):
            return ClipChoice(None, 1.0, objective)
    return ClipChoice(torch.tensor(a_best), a_best, objective)


# ====================================================================== activation (input) scales
ACT_CLIP_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
ACT_CLIP_PERCENTILES = (99.0, 99.9, 99.99, 99.999)


def choose_input_scale(fmt: Format, method: str, amax: float, hist: torch.Tensor | None = None,
                       sample: torch.Tensor | None = None, percentile: float = 99.99) -> float:
    """Static input_scale of a layer whose inputs reached ``amax``, from their |x| histogram
    ``hist`` (``stats.HIST_BINS`` counts) and sampled rows ``sample`` [m, K]: the clip value is
    the max, a percentile, or the MSE-optimal one (searched the format's way)."""
    if amax <= 0.0:
        return 1.0  # the layer only ever saw zeros: any scale is exact
    fmax = fmt.input_fmax()
    if method == "max":
        clip = amax
    elif method == "percentile":
        clip = hist_percentile(hist, amax, percentile)
    elif method == "mse":
        clip = _mse_activation_clip(fmt, amax, hist, sample)
    else:
        raise ValueError(f"unknown input scale method {method!r} (max, percentile or mse)")
    return max(clip, 1e-12) / fmax


def activation_clip_candidates(hist: torch.Tensor, amax: float) -> list[float]:
    cands = {amax * f for f in ACT_CLIP_FRACTIONS}
    cands |= {hist_percentile(hist, amax, p) for p in ACT_CLIP_PERCENTILES}
    return sorted(c for c in cands if c > 0)


def histogram_errors(fmt: Format, cands: list, amax: float, hist, sample) -> list[float] | None:
    """Clip errors on the histogram (per-tensor fp8: the error of a value depends on it alone) - an
    ``input_search`` a format may name."""
    counts = hist.double().cpu()
    values = hist_centers().clamp(max=amax)
    used = counts > 0
    counts, values = counts[used], values[used]
    fmax = fmt.input_fmax()
    return [fp8_hist_error(values, counts, c / fmax, fmax, fmt.dtype) for c in cands]


def sample_errors(fmt: Format, cands: list, amax: float, hist, sample) -> list[float] | None:
    """Clip errors on the sampled rows (block-scaled: a value's error depends on its block) - an
    ``input_search`` a format may name."""
    if sample is None:
        return None
    return [float(squared_error(fmt, sample, None, torch.tensor(c)).sum()) for c in cands]


def _mse_activation_clip(fmt: Format, amax: float, hist, sample) -> float:
    cands = activation_clip_candidates(hist, amax)
    errs = fmt.input_search(fmt, cands, amax, hist, sample)
    if errs is None:
        return amax
    return cands[min(range(len(cands)), key=errs.__getitem__)]


def fp8_hist_error(values: torch.Tensor, counts: torch.Tensor, scale: float, fmax: float,
                   dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """Sum over histogram bins of count * (fp8(v / scale) * scale - v)^2 (ComfyUI clamps at fmax)."""
    q = (values.float() / scale).clamp(-fmax, fmax).to(dtype).double() * scale
    return float((counts * (q - values) ** 2).sum())


# ====================================================================== nvfp4 block clipping
# A block's bound x its max: below 1 the block is clipped (its scale set by a bound under its max),
# above 1 its scale is raised (its max lands below 6 on the E2M1 grid, where the grid is finer).
# On the real-weights model both together measured best, but in whole sampling runs of Flux and
# SDXL raises alone (docs/benchmarks.md 3a, "Raised nvfp4 block scales"): a clipped block's error
# shrinks its largest weights, which adds up over layers and steps.  So the default searches raises only; "both" and "clip" stay for
# the benchmarks (quality_real.py --block-search).
_CLIPS, _RAISES = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7), (1.05, 1.1, 1.2, 1.3, 1.4, 1.5)
BLOCK_CLIP_GRIDS = {"raise": (1.0,) + _RAISES, "both": (1.0,) + _CLIPS + _RAISES, "clip": (1.0,) + _CLIPS}
BLOCK_CLIP_GRID = BLOCK_CLIP_GRIDS["raise"]
BLOCK_CLIP_CHUNK = 1 << 22  # weight elements searched at once


@dataclass
class BlockClip:
    """``search_block_clip``'s result: the bound of every block [N, K/16], the shares of blocks it
    clips and raises, and the fake-quantized weights the search made anyway - with those
    bounds, and unclipped (absmax, as ``fmt.fake_rows(w)``) - so that choosing between them costs
    no further pass."""
    bound: torch.Tensor
    share: float          # blocks clipped or raised
    fake: torch.Tensor
    fake_absmax: torch.Tensor
    raised: float = 0.0   # blocks raised


def search_block_clip(fmt: Format, w: torch.Tensor, xs: torch.Tensor | None) -> BlockClip | None:
    """nvfp4: a scale bound for every 16-value block of float ``w`` [N, K] (K % 16 == 0), the one of
    ``BLOCK_CLIP_GRID`` x the block's max (raises only by default: see above) that minimises the
    block's squared error weighted by the energy of its input channels (mean x^2 over the sampled rows ``xs`` [m, K]; plain weight
    MSE without them).  The block's scale is bound / 6 (E4M3-rounded, as kitchen derives it):
    a bound under the max clips the block (``fmt.quantize`` clamps it), so the E2M1 grid's coarse
    top (4 -> 6) falls on fewer values; a bound over it raises the scale, so the largest values
    land on the finer grid below 6 (``NvFp4Format.quantize`` encodes those blocks).  The block
    holding the tensor's max is never changed, so the global scale - and every other block's
    scale grid - stays.  Chosen per layer over the per-tensor clip by the block-clip step (steps/block_clip.py).
    None where no block gains."""
    n, k = w.shape
    h = (xs.float() ** 2).mean(dim=0) if xs is not None and xs.shape[0] else torch.ones(k, device=w.device)
    hb = h.to(w.device).reshape(k // 16, 16)
    amax = w.abs().max()
    out = torch.empty(n, k // 16, device=w.device)
    fake, fake_absmax = torch.empty(n, k, device=w.device), torch.empty(n, k, device=w.device)
    step = max(1, BLOCK_CLIP_CHUNK // k)
    assert BLOCK_CLIP_GRID[0] == 1.0  # the first candidate is the unclipped weight
    for r0 in range(0, n, step):  # bounded memory on wide layers
        rows = w[r0:r0 + step]
        blocks = rows.reshape(rows.shape[0], k // 16, 16)
        bmax = blocks.abs().amax(dim=-1)
        keep = bmax == amax
        best_err, best, best_q = None, bmax, None
        for c in BLOCK_CLIP_GRID:
            bound = torch.where(keep, bmax, bmax * c)
            q = fmt.fake_blocks(rows, bound, amax=amax).reshape(blocks.shape)
            err = ((blocks - q) ** 2 * hb).sum(dim=-1)
            if best_err is None:
                best_err, best_q = err, q
                fake_absmax[r0:r0 + rows.shape[0]] = q.reshape(rows.shape)
            else:
                better = err < best_err
                best_err, best = torch.where(better, err, best_err), torch.where(better, bound, best)
                best_q = torch.where(better.unsqueeze(-1), q, best_q)
        out[r0:r0 + rows.shape[0]] = best
        fake[r0:r0 + rows.shape[0]] = best_q.reshape(rows.shape)
    bmax = w.abs().reshape(n, k // 16, 16).amax(dim=-1)
    share, raised = float((out != bmax).float().mean()), float((out > bmax).float().mean())
    return BlockClip(out, share, fake, fake_absmax, raised) if share > 0 else None


