"""Where smoothing scales fold exactly into a stock ComfyUI checkpoint.
Design: docs/design.md, ``folding.py``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .smoothing import choose_smoothing


@dataclass(frozen=True)
class FoldRule:
    consumers: tuple[str, ...]   # layers (relative to the block) that share one input
    producer: str                # what makes that input
    kind: str                    # "norm": weight+bias vectors; "linear": all output rows;
    #                              "linear_half0": first half of the output rows (GEGLU value);
    #                              "modulation": the shift and scale chunks of an adaLN Linear
    chunks: int = 0              # modulation: how many equal chunks the Linear's output has
    shift: int = 0               # modulation: the shift chunk's index (the scale chunk follows it)


@dataclass
class FoldGroup:
    consumers: tuple[str, ...]   # full layer names
    producer: str                # full name (norm module or Linear layer)
    rule: FoldRule               # the rule it was found by

    @property
    def kind(self) -> str:
        return self.rule.kind


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
_FLUX_DOUBLE_RULES = (
    FoldRule(("img_attn.qkv",), "img_mod.lin", "modulation", chunks=6, shift=0),
    FoldRule(("img_mlp.0",), "img_mod.lin", "modulation", chunks=6, shift=3),
    FoldRule(("txt_attn.qkv",), "txt_mod.lin", "modulation", chunks=6, shift=0),
    FoldRule(("txt_mlp.0",), "txt_mod.lin", "modulation", chunks=6, shift=3),
)
_FLUX_SINGLE_RULES = (FoldRule(("linear1",), "modulation.lin", "modulation", chunks=3, shift=0),)
_FLUX_RULES = ((r"(double_blocks\.\d+)\.img_attn\.qkv$", _FLUX_DOUBLE_RULES),
               (r"(single_blocks\.\d+)\.linear1$", _FLUX_SINGLE_RULES))
# SD3/SD3.5 joint blocks (mmdit.py DismantledBlock): adaLN_modulation.1 holds 6 chunks (shift,
# scale, gate for attention, then for the MLP), 2 in the last context block (pre_only), 9 where
# the block has a second self-attention (SD3.5 Medium: its shift/scale are chunks 6 and 7); the
# chunk count is told apart by the Linear's width (fold_groups)
_SD3_RULES = (
    FoldRule(("attn.qkv",), "adaLN_modulation.1", "modulation", chunks=6, shift=0),
    FoldRule(("mlp.fc1",), "adaLN_modulation.1", "modulation", chunks=6, shift=3),
    FoldRule(("attn.qkv",), "adaLN_modulation.1", "modulation", chunks=2, shift=0),
    FoldRule(("attn.qkv",), "adaLN_modulation.1", "modulation", chunks=9, shift=0),
    FoldRule(("mlp.fc1",), "adaLN_modulation.1", "modulation", chunks=9, shift=3),
    FoldRule(("attn2.qkv",), "adaLN_modulation.1", "modulation", chunks=9, shift=6),
)
# Qwen-Image blocks: img_mod.1 / txt_mod.1 hold (shift, scale, gate) for attention, then for the MLP
_QWEN_RULES = (
    FoldRule(("attn.to_q", "attn.to_k", "attn.to_v"), "img_mod.1", "modulation", chunks=6, shift=0),
    FoldRule(("img_mlp.net.0.proj",), "img_mod.1", "modulation", chunks=6, shift=3),
    FoldRule(("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_mod.1", "modulation", chunks=6,
             shift=0),
    FoldRule(("txt_mlp.net.0.proj",), "txt_mod.1", "modulation", chunks=6, shift=3),
)
# family -> (block prefix pattern, rules) pairs; linear-producer rules come first so that a layer
# that is both a producer (rows rescaled) and a consumer is searched with its final rows
RULES = {
    "sd15": ((r"(.*\.transformer_blocks\.\d+)\.attn1\.to_q$", _UNET_RULES),),
    "sdxl": ((r"(.*\.transformer_blocks\.\d+)\.attn1\.to_q$", _UNET_RULES),),
    "wan": ((r"(blocks\.\d+)\.self_attn\.q$", _WAN_RULES),),
    "flux": _FLUX_RULES,
    "hunyuan_video": _FLUX_RULES,   # Flux's DoubleStreamBlock / SingleStreamBlock (hunyuan_video/model.py)
    "sd3": ((r"(joint_blocks\.\d+\.(?:x_block|context_block))\.attn\.qkv$", _SD3_RULES),),
    "qwen_image": ((r"(transformer_blocks\.\d+)\.attn\.to_q$", _QWEN_RULES),),
}


def fold_groups(family: str, layers: dict, tensors: dict) -> list[FoldGroup]:
    """Fold groups present in a plan.

    ``layers`` maps relative layer names to their LayerPlan (quantized ones are consumers),
    ``tensors`` the relative keys of every tensor in the source (to find norm weights)."""
    groups = []
    for pattern, rules in RULES.get(family, ()):
        blocks = sorted({m.group(1) for n in layers if (m := re.match(pattern, n))})
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
                elif rule.kind == "modulation" and (layers[producer].n % rule.chunks
                                                    or layers[producer].n // rule.chunks != layers[consumers[0]].k):
                    continue
                groups.append(FoldGroup(consumers, producer, rule))
    return groups


def producer_rows(group: FoldGroup, out_features: int) -> list[tuple[slice, float]]:
    """Which output rows of a Linear producer carry the consumer's input channels, each with the
    offset of its transform ``(t + offset) / s - offset`` (1 for a modulation's scale chunk,
    whose ``1 + scale`` is what multiplies the input)."""
    if group.kind == "linear_half0":
        return [(slice(0, out_features // 2), 0.0)]
    if group.kind == "modulation":
        d, i = out_features // group.rule.chunks, group.rule.shift
        shift, scale = slice(i * d, (i + 1) * d), slice((i + 1) * d, (i + 2) * d)
        return [(shift, 0.0), (scale, 1.0)]
    return [(slice(0, out_features), 0.0)]


# ====================================================================== the fold search
@dataclass
class Folds:
    consumer: dict = field(default_factory=dict)   # layer name -> s [K]
    rows: dict = field(default_factory=dict)       # tensor key -> [(row slice, 1/s, offset)]: producer outputs
    notes: dict = field(default_factory=dict)      # layer name -> note


def plan_folds(plan, source, stats, recipe, progress=None, given=None) -> Folds:
    """Search smoothing scales for every exact fold group of ``plan`` (whose weights ``source``
    reads) on the calibration ``stats``, and record what to rescale.  ``progress(i, n, what)``.
    ``given``: layer -> scales chosen elsewhere (the ModelOpt engine) instead of the search; a
    group takes the geometric mean of its layers' scales, and layers in no group lose theirs."""
    folds = Folds()
    p = plan.prefix
    rel_layers = {l.rel: l for l in plan.layers}
    rel_tensors = {k[len(p):] for k in source.tensors if k.startswith(p)}
    groups = fold_groups(plan.family.name, rel_layers, rel_tensors)
    fmt = plan.fmt
    for i, g in enumerate(groups):
        if progress:
            progress(i, len(groups), "smoothing " + g.consumers[0])
        first = g.consumers[0]
        # dividing a quantized producer's rows by s shrinks some rows far below the one
        # per-tensor fp8 scale they share, and the consumer's search cannot see that error
        # (an SD block had more error with these folds than unsmoothed, less without them:
        # tests/test_smoothing.py; full SDXL in docs/benchmarks.md)
        fp8_producer = g.kind != "norm" and fmt.one_weight_scale and rel_layers[g.producer].quantized
        if given is not None:
            if not all(c in given for c in g.consumers) or fp8_producer:
                continue
            s = torch.exp(torch.stack([torch.log(given[c].float().clamp(min=1e-12)) for c in g.consumers]).mean(0))
            note = f"ModelOpt smoothing folded into {g.producer}" + (
                f" (one scale for {len(g.consumers)} layers: their geometric mean)" if len(g.consumers) > 1 else "")
        else:
            if not stats.has(first) or not stats.layer(first).has_sample():
                continue
            if fp8_producer:
                for c in g.consumers:
                    folds.notes[p + c] = (f"{recipe.smoothing}: not folded into {g.producer} (quantized with one "
                                          f"per-tensor fp8 scale)")
                continue
            w = torch.cat([read_rows_scaled(source, p + c + ".weight", folds) for c in g.consumers])
            res = choose_smoothing(w, stats.layer(first), fmt, recipe.smoothing,
                                   static_input=rel_layers[first].static_input, **rel_layers[first].opts)
            if res.scales is None:
                held = f" (held-out {res.held_base:.4f})" if res.held_base >= 0 else ""
                for c in g.consumers:
                    folds.notes[p + c] = f"{recipe.smoothing}: no gain{held}"
                continue
            s = res.scales
            note = (f"{recipe.smoothing} a={res.alpha:.1f} folded into {g.producer} "
                    f"(out err {res.base_error:.4f}->{res.error:.4f}"
                    + (f", held-out {res.held_base:.4f}->{res.held_error:.4f})" if res.held_error >= 0 else ")"))
        for c in g.consumers:
            folds.consumer[p + c] = s
            folds.notes[p + c] = note
        _record(folds, g, 1.0 / s, p, rel_layers, source)
    for name in given or ():
        if p + name not in folds.consumer and name in rel_layers:
            folds.notes[p + name] = "ModelOpt smoothing dropped: no exact fold into a stock ComfyUI file for this layer"
    return folds


def _record(folds: Folds, g: FoldGroup, inv: torch.Tensor, p: str, rel_layers: dict, source) -> None:
    """The producer rows (and bias) a group's scales 1/s fold into."""
    if g.kind == "norm":
        for suffix in (".weight", ".bias"):
            folds.rows.setdefault(p + g.producer + suffix, []).append((slice(None), inv, 0.0))
        return
    for rows, offset in producer_rows(g, rel_layers[g.producer].n):
        # the weight rows scale alone; the offset moves only the bias
        folds.rows.setdefault(p + g.producer + ".weight", []).append((rows, inv, 0.0))
        if p + g.producer + ".bias" in source.tensors:
            folds.rows.setdefault(p + g.producer + ".bias", []).append((rows, inv, offset))


def read_rows_scaled(source, key: str, folds: Folds) -> torch.Tensor:
    """Tensor ``key`` of ``source`` with the rows a fold rescales already rescaled."""
    t = source.read(key).float()
    if key in folds.rows:
        t = t.clone()
        for rows, inv, offset in folds.rows[key]:
            inv = inv.to(t.device)
            if t.dim() == 2:
                t[rows] = t[rows] * inv.reshape(-1, 1)
            else:
                t[rows] = (t[rows] + offset) * inv - offset
    return t
