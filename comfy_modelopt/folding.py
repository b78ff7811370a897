"""Where smoothing scales fold exactly into a stock ComfyUI checkpoint.

Dividing a layer's input channel j by s_j is free when the input is produced by an op that is
linear in that channel: multiply the producer's output channel j by 1/s_j instead.  Exact folds:

- an affine LayerNorm feeding the layer (weight and bias divided by s);
- a Linear whose output channels reach the layer unchanged through attention (the V projection
  feeding the attention output projection: softmax(QK^T) mixes tokens, not channels);
- the value half of a GEGLU projection feeding the FF output (value * gelu(gate) is linear in value).

Everything else (adaLN-modulated norms without affine weights, GELU/SiLU MLPs, joint attention
across two streams) has no exact fold: smoothing there is reported as skipped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class FoldRule:
    consumers: tuple[str, ...]   # layers (relative to the block) that share one input
    producer: str                # what makes that input
    kind: str                    # "norm": weight+bias vectors; "linear": all output rows;
    #                              "linear_half0": first half of the output rows (GEGLU value)


@dataclass
class FoldGroup:
    consumers: tuple[str, ...]   # full layer names
    producer: str                # full name (norm module or Linear layer)
    kind: str


_UNET_RULES = (
    FoldRule(("attn1.to_out.0",), "attn1.to_v", "linear"),
    FoldRule(("attn2.to_out.0",), "attn2.to_v", "linear"),
    FoldRule(("ff.net.2",), "ff.net.0.proj", "linear_half0"),
    FoldRule(("attn1.to_q", "attn1.to_k", "attn1.to_v"), "norm1", "norm"),
    FoldRule(("attn2.to_q",), "norm2", "norm"),
    FoldRule(("ff.net.0.proj",), "norm3", "norm"),
)
_WAN_RULES = (
    FoldRule(("self_attn.o",), "self_attn.v", "linear"),
    FoldRule(("cross_attn.q",), "norm3", "norm"),
)
# block prefix pattern -> rules; linear-producer rules come first so that a layer that is both
# a producer (rows rescaled) and a consumer is searched with its final rows
RULES = {
    "sd15": (r"(.*\.transformer_blocks\.\d+)\.attn1\.to_q$", _UNET_RULES),
    "sdxl": (r"(.*\.transformer_blocks\.\d+)\.attn1\.to_q$", _UNET_RULES),
    "wan": (r"(blocks\.\d+)\.self_attn\.q$", _WAN_RULES),
}


def fold_groups(family: str, layers: dict, tensors: dict) -> list[FoldGroup]:
    """Fold groups present in a plan.

    ``layers`` maps relative layer names to their LayerPlan (quantized ones are consumers),
    ``tensors`` the relative keys of every tensor in the source (to find norm weights)."""
    if family not in RULES:
        return []
    pattern, rules = RULES[family]
    blocks = sorted({m.group(1) for n in layers if (m := re.match(pattern, n))})
    groups = []
    for block in blocks:
        for rule in rules:
            consumers = tuple(f"{block}.{c}" for c in rule.consumers)
            producer = f"{block}.{rule.producer}"
            if not all(c in layers and layers[c].quantized for c in consumers):
                continue
            if rule.kind == "norm":
                if f"{producer}.weight" not in tensors or f"{producer}.bias" not in tensors:
                    continue
            elif producer not in layers:
                continue
            groups.append(FoldGroup(consumers, producer, rule.kind))
    return groups


def producer_rows(kind: str, out_features: int) -> slice:
    """Which output rows of a Linear producer carry the consumer's input channels."""
    if kind == "linear_half0":
        return slice(0, out_features // 2)
    return slice(0, out_features)
