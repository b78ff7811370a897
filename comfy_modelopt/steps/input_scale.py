"""The static input scale of W8A8 layers (fp8; nvfp4 with ``static_nvfp4_input``): searched on
the calibration (max, percentile or MSE) and kept only where the same search on the fit prompts
beats no clipping on the held-out ones."""
from __future__ import annotations

from ..heldout import rel
from ..scales import choose_input_scale
from ..stats import histogram
from . import Step, Work


def input_scale(layer_stats, fmt, method: str, percentile: float, smooth) -> float:
    """The scale ``method`` chooses from all the layer's statistics (after smoothing: its exact amax)."""
    if smooth is None:
        sample = layer_stats.sample() if method == "mse" and layer_stats.has_sample() else None
        return choose_input_scale(fmt, method, layer_stats.amax_value(), layer_stats.hist, sample, percentile)
    # the histogram describes the unsmoothed input: after smoothing use its exact amax
    amax = float((layer_stats.channel_absmax.float().cpu() / smooth.cpu()).max())
    return max(amax, 1e-12) / fmt.input_fmax()


class InputScale(Step):
    name, order, fields = "input scale", 50, ("input_scale", "percentile", "static_nvfp4_input")

    def applies(self, work: Work) -> bool:
        return work.layer.static_input and work.engine is None

    def run(self, work: Work) -> None:
        fmt, recipe, stats = work.fmt, work.recipe, work.layer_stats
        chosen = input_scale(stats, fmt, recipe.input_scale, recipe.percentile, work.smooth)
        work.input_scale = chosen if work.split is None else self._held_out(work, chosen)

    @staticmethod
    def _held_out(work: Work, chosen: float) -> float:
        """``chosen`` if the same search run on the fit prompts alone beats no clipping on the
        held-out prompts (activation rounding seen through the layer's weight).  Where it does
        not, clipping hurts inputs the search has not seen: no clip, and the headroom the
        held-out prompts showed past the fit prompts' max (``split.growth``), which new prompts
        may show past ours."""
        fmt, recipe, split = work.fmt, work.recipe, work.split
        no_clip = input_scale(work.layer_stats, fmt, "max", recipe.percentile, work.smooth)
        fit, held, fmax = split.fit, split.held, fmt.input_fmax()
        amax_fit = float(fit.abs().max())
        if amax_fit <= 0.0:
            return chosen
        searched = choose_input_scale(fmt, recipe.input_scale, amax_fit, histogram(fit).cpu(), fit, recipe.percentile)
        noop = amax_fit / fmax
        ref = held @ work.smoothed.T

        def err(scale: float) -> float:
            return rel(fmt.fake_act(held, scale) @ work.smoothed.T - ref, ref)
        if searched < noop and err(searched) < err(noop):
            return chosen
        if chosen < no_clip:
            work.notes.append(f"input clip {chosen / no_clip:.2f} worse on held-out prompts: max")
        if split.growth > 1.0:
            work.notes.append(f"input headroom x{split.growth:.2f} (held-out prompts past the calibration max)")
        return no_clip * split.growth


STEP = InputScale()
