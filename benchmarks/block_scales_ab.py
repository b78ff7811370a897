"""nvfp4's per-block scale search, side by side in whole sampling runs (a diagnostic).

    python benchmarks/block_scales_ab.py --model sdxl --runs 1 \\
        --runtimes "16-bit, stock ComfyUI" "other 16-bit dtype, stock" --quality \\
        --quality-recipes "nvfp4 (absmax)" "nvfp4 (mse)" "nvfp4 (mse, blocks clipped only)" \\
            "nvfp4 (mse, blocks clipped and raised)" --out DIR

``sampling_check.py --quality`` (same model, calibration, sampling and JSON) with three more
recipes: nvfp4 without any scale search (absmax), and the per-block search
(``scales.search_block_clip``) with bounds below a block's max (clipping only, as on 2026-11-30)
or below and above it (clipping and raises); "nvfp4 (mse)" is the default (raises only,
``scales.BLOCK_CLIP_GRIDS``).  The grid is set when each recipe is built, so one process compares
them on one calibration.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sampling_check  # noqa: E402

from comfy_modelopt import recipe as recipe_module, scales  # noqa: E402

DEFAULT = scales.BLOCK_CLIP_GRID
sampling_check.QUALITY_RECIPES.update({
    "nvfp4 (absmax)": dict(format="nvfp4", weight_scale="absmax"),
    "nvfp4 (mse, blocks clipped only)": dict(format="nvfp4", _grid="clip"),
    "nvfp4 (mse, blocks clipped and raised)": dict(format="nvfp4", _grid="both"),
})
_Recipe = recipe_module.Recipe


def _recipe(*args, _grid: str | None = None, **fields):
    """The Recipe, and the block grid its quantization will search (sampling_check quantizes
    right after building it)."""
    scales.BLOCK_CLIP_GRID = scales.BLOCK_CLIP_GRIDS[_grid] if _grid else DEFAULT
    return _Recipe(*args, **fields)


if __name__ == "__main__":
    recipe_module.Recipe = _recipe  # sampling_check imports Recipe inside main()
    sampling_check.main()
