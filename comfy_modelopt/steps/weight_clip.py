"""The weight's clip: an MSE search over scales (on the layer's outputs when there are sampled
inputs), absmax otherwise."""
from __future__ import annotations

from ..scales import ClipChoice, choose_weight_clip, squared_error
from . import Step, Work


class WeightClip(Step):
    name, order, fields = "weight clip", 60, ("weight_scale",)

    def applies(self, work: Work) -> bool:
        return work.engine is None

    def run(self, work: Work) -> None:
        """Output-aware clipping for per-tensor scales (chosen on the fit prompts, kept only if it
        beats absmax on the held-out ones); per-row scales chosen on a few hundred sampled rows
        overfit them (measured: worse on fresh inputs), so rows use the weight objective."""
        fmt, w, opts, split, method = work.fmt, work.w, work.opts, work.split, work.recipe.weight_scale
        if fmt.free_scale != "tensor":
            work.clip = choose_weight_clip(w, fmt, method, **opts)
            return
        clip = choose_weight_clip(w, fmt, method, xs=split.fit if split else work.x, **opts)
        if split is not None and clip.alpha is not None:
            ws, held = fmt.search_space(w, **opts), fmt.search_space(split.held.to(w.device), **opts)
            if float(squared_error(fmt, ws, clip.alpha, xs=held).sum()) >= \
                    float(squared_error(fmt, ws, None, xs=held).sum()):
                work.notes.append(f"weight clip {clip.mean_alpha:.2f} worse on held-out prompts: absmax")
                clip = ClipChoice(None, 1.0, clip.objective)
        work.clip = clip


STEP = WeightClip()
