"""The 16-bit low-rank branch (SVDQuant-style, or ModelOpt SVDQuant's own) of own-loader files:
the residual is what gets quantized."""
from __future__ import annotations

import torch

from ..errors import QuantizeError
from ..lowrank import LowRank, lowrank_split
from . import Step, Work


class LowRankBranch(Step):
    name, order, fields = "lowrank", 30, ("lowrank",)

    def applies(self, work: Work) -> bool:
        return bool(work.layer.rank)

    def run(self, work: Work) -> None:
        layer, w = work.layer, work.w
        if work.engine is not None and work.engine.lowrank is not None:
            up, down = (t.to(w.device, torch.float32) for t in work.engine.lowrank)
            if up.shape != (layer.n, layer.rank) or down.shape != (layer.rank, layer.k):
                raise QuantizeError(f"{layer.name}: ModelOpt's SVDQuant branch is {tuple(up.shape)} x "
                                    f"{tuple(down.shape)}, the file plans rank {layer.rank} of {layer.n}x{layer.k}")
            parts = LowRank(up, down, w - up @ down)
            work.notes.append(f"ModelOpt SVDQuant low-rank r={layer.rank}")
        else:
            parts = lowrank_split(w, layer.rank)
            work.notes.append(f"low-rank r={parts.l1.shape[1]}")
        # contiguous, as a reloaded file holds them: the same strides give bit-identical matmuls
        work.branch = (parts.l1.to(torch.bfloat16).contiguous(), parts.l2.to(torch.bfloat16).contiguous())
        work.w = parts.residual


STEP = LowRankBranch()
