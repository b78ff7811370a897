"""Deterministic random checkpoints in real families' key layouts (demo, tests, benchmarks).
Design: docs/design.md, ``synthetic.py``.
"""
from __future__ import annotations

import math
import zlib

import torch

from .safetensors_io import ST_DTYPES, StreamWriter


def flux_layout(hidden: int = 3072, depth: int = 19, depth_single: int = 38, mlp_ratio: float = 4.0,
                in_channels: int = 16, context_in: int = 4096, vec_in: int = 768,
                guidance: bool = True) -> dict[str, tuple]:
    """Flux.1 diffusion-model keys -> shapes (defaults: Flux.1-dev, ~11.9 B parameters)."""
    if hidden % 128:
        raise ValueError(f"Flux hidden size must be a multiple of 128 (head dim), got {hidden}")
    h, mlp, head = hidden, int(hidden * mlp_ratio), 128  # ComfyUI: num_heads = hidden / sum(axes_dim)
    patch_in = in_channels * 4
    s: dict[str, tuple] = {}

    def lin(name, out_f, in_f, bias=True):
        s[f"{name}.weight"] = (out_f, in_f)
        if bias:
            s[f"{name}.bias"] = (out_f,)

    lin("img_in", h, patch_in)
    for emb, fin in (("time_in", 256), ("vector_in", vec_in)) + ((("guidance_in", 256),) if guidance else ()):
        lin(f"{emb}.in_layer", h, fin)
        lin(f"{emb}.out_layer", h, h)
    lin("txt_in", h, context_in)
    for i in range(depth):
        for side in ("img", "txt"):
            p = f"double_blocks.{i}.{side}"
            lin(f"{p}_mod.lin", 6 * h, h)
            lin(f"{p}_attn.qkv", 3 * h, h)
            s[f"{p}_attn.norm.query_norm.scale"] = (head,)
            s[f"{p}_attn.norm.key_norm.scale"] = (head,)
            lin(f"{p}_attn.proj", h, h)
            lin(f"{p}_mlp.0", mlp, h)
            lin(f"{p}_mlp.2", h, mlp)
    for i in range(depth_single):
        p = f"single_blocks.{i}"
        lin(f"{p}.linear1", 3 * h + mlp, h)
        lin(f"{p}.linear2", h, h + mlp)
        s[f"{p}.norm.query_norm.scale"] = (head,)
        s[f"{p}.norm.key_norm.scale"] = (head,)
        lin(f"{p}.modulation.lin", 3 * h, h)
    lin("final_layer.linear", patch_in, h)
    lin("final_layer.adaLN_modulation.1", 2 * h, h)
    return s


def tensor_for(key: str, shape: tuple, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               outliers: bool = False, device="cpu") -> torch.Tensor:
    """Deterministic tensor for ``key``: N(0, 1/fan_in) weights, ones for norm scales, small biases.

    ``outliers`` scales a few input channels of each Linear weight 20-60x (the structure real
    DiTs show), for error and calibration experiments."""
    g = torch.Generator(device=device).manual_seed((zlib.crc32(key.encode()) + 7919 * seed) & 0x7FFFFFFF)
    rand = lambda *s: torch.randn(s, generator=g, device=device)  # noqa: E731
    if len(shape) == 1 and ("norm" in key or key.endswith(".scale")) and key.endswith((".weight", ".scale")):
        return (1.0 + 0.1 * rand(*shape)).to(dtype)
    if len(shape) == 1:
        return (0.02 * rand(*shape)).to(dtype)
    fan_in = math.prod(shape[1:])
    t = rand(*shape) / math.sqrt(fan_in)
    if outliers and len(shape) == 2 and shape[1] >= 64:
        cols = torch.randperm(shape[1], generator=g, device=device)[: max(1, shape[1] // 256)]
        t[:, cols] *= 20 + 40 * torch.rand(len(cols), generator=g, device=device)
    return t.to(dtype)


def write_checkpoint(path: str, layout: dict[str, tuple], seed: int = 0, prefix: str = "",
                     dtype: torch.dtype = torch.bfloat16, overwrite: bool = False,
                     metadata: dict | None = None, outliers: bool = False) -> str:
    """Write ``layout`` with deterministic weights, one tensor in memory at a time."""
    entries = {prefix + k: (ST_DTYPES[dtype], tuple(v)) for k, v in layout.items()}
    with StreamWriter(path, entries, metadata, overwrite=overwrite) as w:
        for k, shape in layout.items():
            w.write(prefix + k, tensor_for(k, shape, seed, dtype, outliers))
        return w.close()


def state_dict(layout: dict[str, tuple], seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               outliers: bool = False) -> dict[str, torch.Tensor]:
    return {k: tensor_for(k, v, seed, dtype, outliers) for k, v in layout.items()}
