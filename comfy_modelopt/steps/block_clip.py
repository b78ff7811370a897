"""nvfp4's per-block scales (``scales.search_block_clip``: clipped or raised, weighted by the
fit prompts' input energy) instead of the per-tensor clip where their error is lower - on the
held-out prompts' outputs (the fit rows' without held-out prompts; the weight's without
statistics) - tried after the per-tensor clip, kept by error (docs/algorithms.md)."""
from __future__ import annotations

from ..heldout import rel
from ..scales import ClipChoice, search_block_clip
from . import Step, Work


class BlockClip(Step):
    name, order, fields = "block clip", 70, ("weight_scale",)

    def applies(self, work: Work) -> bool:
        return work.engine is None and work.fmt.free_scale == "tensor" and work.fmt.block_clip \
            and work.recipe.weight_scale == "mse" and work.w.shape[1] % 16 == 0

    def run(self, work: Work) -> None:
        fmt, w, split, x, clip = work.fmt, work.w, work.split, work.x, work.clip
        fit = split.fit if split is not None else x
        found = search_block_clip(fmt, w, fit.to(w.device) if fit is not None else None)
        if found is None:
            return
        blocks = found.fake
        tensor = found.fake_absmax if clip.alpha is None else fmt.fake_rows(w, clip.alpha)
        check = split.held if split is not None else x
        if check is not None:
            check = check.to(w.device)
            ref = check @ w.T
            block_err, tensor_err = rel(check @ (blocks - w).T, ref), rel(check @ (tensor - w).T, ref)
        else:
            block_err, tensor_err = rel(blocks - w, w), rel(tensor - w, w)
        if block_err >= tensor_err:
            if split is not None:
                work.notes.append("block clip worse on held-out prompts")
            return
        parts = [f"{share:.0%} {what}" for share, what in ((found.share - found.raised, "clipped"),
                                                            (found.raised, "raised")) if share > 0]
        work.notes.append(f"block scales ({', '.join(parts)})")
        work.clip = ClipChoice(None, 1.0, clip.objective, found.bound)


STEP = BlockClip()
