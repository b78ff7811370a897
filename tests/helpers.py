"""Small torch modules for calibration tests (plain torch; no ComfyUI)."""
import contextlib
import math
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn


def outlier_inputs(m: int, k: int, seed: int = 0, channels: int = 4, low: float = 20.0, high: float = 100.0):
    """[m, k] activations whose few channels are 20-100x the rest (as reported for real DiTs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    idx = torch.randperm(k, generator=g)[:channels]
    x[:, idx] *= low + (high - low) * torch.rand(channels, generator=g)
    return x


def gptq_problem(name: str, opts: dict, n: int, k: int, device: str = "cpu"):
    """A GPTQ rounding problem as the GPTQ step (steps/gptq.py) poses it: the format, the weight in its search
    space (rotated for ConvRot), the column rounder and the Hessian of outlier inputs."""
    from comfy_modelopt.formats import get_format
    from comfy_modelopt.gptq import gram
    fmt = get_format(name)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(n, k, generator=g) / 16).to(device)
    x = outlier_inputs(300, k, seed=6).to(device)
    ws = fmt.search_space(w, **opts)
    quantize_columns, _scale = fmt.gptq_rounding(ws, None, **opts)
    return fmt, ws, quantize_columns, gram(fmt.search_space(x, **opts))


class LinearTree(nn.Module):
    """nn.Linear modules at the names of a key layout, each fed its own synthetic inputs.

    Not a real network: a way to give every Linear layer of a checkpoint realistic activation
    statistics through real forward hooks."""

    def __init__(self, layout: dict, scale_amax: float = 1.0):
        super().__init__()
        self.names = []
        for key, shape in layout.items():
            if key.endswith(".weight") and len(shape) == 2:
                name = key[:-7]
                self._set(name, nn.Linear(shape[1], shape[0], bias=False))
                self.names.append(name)
        self.scale_amax = scale_amax

    def _set(self, name, module):
        parent = self
        parts = name.split(".")
        for p in parts[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, nn.Module())
            parent = getattr(parent, p)
        parent.add_module(parts[-1], module)

    def forward(self, seed: int):
        for i, name in enumerate(self.names):
            lin = self.get_submodule(name)
            x = outlier_inputs(32, lin.in_features, seed=seed * 1000 + i) * self.scale_amax
            lin(x)


class SDBlock(nn.Module):
    """The math of ComfyUI's BasicTransformerBlock (self-attn, cross-attn, GEGLU FF), with its
    parameter names, at small sizes."""

    def __init__(self, dim=64, ctx=48, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn1 = _Attn(dim, dim)
        self.attn2 = _Attn(dim, ctx)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([nn.Module(), nn.Identity(), nn.Linear(4 * dim, dim)])
        self.ff.net[0].proj = nn.Linear(dim, 8 * dim)

    def forward(self, x, context):
        x = self.attn1(self.norm1(x), None, self.heads) + x
        x = self.attn2(self.norm2(x), context, self.heads) + x
        h, gate = self.ff.net[0].proj(self.norm3(x)).chunk(2, dim=-1)
        return self.ff.net[2](h * F.gelu(gate)) + x


class _Attn(nn.Module):
    def __init__(self, dim, ctx):
        super().__init__()
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(ctx, dim, bias=False)
        self.to_v = nn.Linear(ctx, dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x, context, heads):
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        b, n, d = q.shape
        sh = lambda t: t.reshape(b, -1, heads, d // heads).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(sh(q), sh(k), sh(v)).transpose(1, 2).reshape(b, n, d)
        return self.to_out[0](o)


def init_sd_block(block: SDBlock, seed: int = 0, outlier_norm: bool = True):
    g = torch.Generator().manual_seed(seed)
    for name, p in block.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.data = 1 + 0.1 * torch.randn(p.shape, generator=g)
            if outlier_norm:  # LayerNorm gains that create outlier channels (as in real UNets)
                p.data[:3] *= 40.0
        elif name.endswith("bias"):
            p.data = 0.02 * torch.randn(p.shape, generator=g)
        else:
            p.data = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            if name.endswith(("to_q.weight", "to_k.weight")):
                p.data *= 0.05  # moderate attention logits, as in trained models
    return block


@contextlib.contextmanager
def gptq_without(kernel: bool = True, graph: bool = False):
    """GPTQ's column loop without its Triton kernel (``kernel``) and/or its CUDA graph (``graph``):
    the loops they replace."""
    from comfy_modelopt import gptq, gptq_kernel
    with contextlib.ExitStack() as stack:
        if kernel:
            stack.enter_context(mock.patch.object(gptq_kernel, "usable", lambda *_a: False))
        if graph:
            stack.enter_context(mock.patch.object(gptq._BlockGraph, "make", classmethod(lambda *_a: None)))
        yield
