"""GPTQ: error-compensated rounding on the sampled inputs' Hessian (act-order where asked),
in the format's search space (rotated for ConvRot); kept only where prompts it did not see agree."""
from __future__ import annotations

from .. import gptq
from ..formats import kitchen_reference
from ..heldout import rel
from ..report import FEW_ROWS
from . import Step, Work


class Gptq(Step):
    name, order, fields = "gptq", 100, ("gptq", "gptq_act_order")

    def applies(self, work: Work) -> bool:
        return work.recipe.gptq and work.x is not None and work.encoded is None

    def run(self, work: Work) -> None:
        fmt, opts, w, bound = work.fmt, work.opts, work.w, work.bound()
        ws = fmt.search_space(w, **opts)  # where the format rounds (rotated for ConvRot)
        rounding = fmt.gptq_rounding(ws, work.clip.alpha, **bound, **opts)
        if rounding is None:
            work.notes.append(f"gptq n/a for {fmt.name}{'+convrot' if opts.get('convrot') else ''}")
            return
        quantize_columns, scale = rounding
        split = work.split
        xs = fmt.search_space((split.fit if split else work.x).to(w.device), **opts)
        q = gptq.gptq(ws, gptq.gram(xs), quantize_columns, act_order=work.recipe.gptq_act_order, damp=gptq.DAMPING)
        q = fmt.encode(fmt.search_space(q, **opts), scale=scale, **bound, **opts)  # rotated back
        if split is None:
            work.notes.append("gptq" + _few_rows(xs))
            work.encoded = q
            return
        plain = work.encode_plain()
        err, base = _out_err(q[1], w, split.held), _out_err(plain[1], w, split.held)
        if err < base:
            work.notes.append(f"gptq (held-out {base:.4f}->{err:.4f})" + _few_rows(xs))
            work.encoded = q
        else:
            work.notes.append(f"gptq worse on held-out prompts ({err:.4f} vs {base:.4f}): plain rounding")
            work.encoded = plain


def _few_rows(x) -> str:
    return f" [{FEW_ROWS}: {x.shape[0]} < {x.shape[1]}]" if x.shape[0] < x.shape[1] else ""


def _out_err(qt, w, x) -> float:
    with kitchen_reference():
        deq = qt.dequantize().float()
    return rel(x @ (deq - w).T, x @ w.T)


STEP = Gptq()
