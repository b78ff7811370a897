"""What a CUDA-graph capture keeps of a model call: static copies of its tensors (on the model's
device), the tensors in a fixed order (replays copy new values into them), and the call's
signature (shapes, dtypes, devices and the non-tensor values) that picks a captured graph.
"""
from __future__ import annotations

import torch


def clone_tree(v, device):
    """Static copies of every tensor in ``v``, on ``device``."""
    if isinstance(v, torch.Tensor):
        return v.to(device, copy=True)
    if isinstance(v, dict):
        return {k: clone_tree(x, device) for k, x in v.items()}
    if isinstance(v, list):
        return [clone_tree(x, device) for x in v]
    if isinstance(v, tuple):
        return tuple(clone_tree(x, device) for x in v)
    return v


def tensors_of(*trees) -> list:
    out: list = []
    for t in trees:
        walk_tensors(t, out)
    return out


# The walks are module functions, not closures: a closure that calls itself is a reference cycle
# (function -> cell -> function) holding whatever it collected.  The tensors of every model
# evaluation (ComfyUI's conditioning, a fresh 4 MiB Flux context per step) then lived until the
# garbage collector ran: 80 MiB more at the peak of a Flux run (measured on the H200, allocator
# history of a steady run).
def walk_tensors(v, out: list) -> None:
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, dict):
        for k in sorted(v, key=str):
            walk_tensors(v[k], out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            walk_tensors(x, out)


def walk_signature(v, flat: list) -> None:
    if isinstance(v, torch.Tensor):
        flat.append(("T", tuple(v.shape), v.dtype, str(v.device)))
    elif isinstance(v, dict):
        for k in sorted(v, key=str):
            flat.append(("K", str(k)))
            walk_signature(v[k], flat)
    elif isinstance(v, (list, tuple)):
        flat.append(("L", len(v)))
        for x in v:
            walk_signature(x, flat)
    elif isinstance(v, (int, float, str, bool, type(None))):
        flat.append(("V", v))
    else:
        raise TypeError(type(v).__name__)
