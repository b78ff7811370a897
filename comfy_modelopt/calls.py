"""A model call's arguments kept beyond the call (``RecordedCall``): tensors copied to the host,
replayed on a device, described in JSON for a file and rebuilt from it - and ``tree_map``, the
one walk over a call's nested arguments (the CUDA-graph runtime's ``graph_inputs`` uses it too)."""
from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecordedCall:
    """A module's first call during calibration: its arguments, tensors copied to the CPU (each
    with the device it came from).  A runtime that compiles per input shape (compiled blocks)
    replays it before the first image, so the image does not pay the compilation; the non-tensor
    arguments are kept as they were (compiled code guards on the options a block reads, such as
    the keys of ComfyUI's transformer_options)."""
    args: tuple
    kwargs: dict

    @classmethod
    def of(cls, args, kwargs) -> "RecordedCall":
        return cls(tree_map(args, _to_host), tree_map(kwargs, _to_host))

    def replay(self, fn, device, first_tensor=None):
        """``fn(*args, **kwargs)``, the CUDA tensors moved to ``device`` (the CPU ones stay there);
        ``first_tensor(x)`` replaces the first positional argument (a perturbed input).

        It runs as the sampler that follows will run, not as the calibration did (compiled code
        guards on the grad mode and on whether its inputs are inference tensors): without grad -
        ComfyUI's samplers are decorated with ``torch.no_grad`` - and in the caller's inference
        mode, which is the process's: a ComfyUI server runs every node under inference mode, a
        script may not, and a file's calibration may have run elsewhere (a server loading a file
        calibrated in a script compiled every block twice; a script whose node ran with grad on
        failed to compile ahead at all)."""
        def back(stored):
            t, where = stored
            return t.to(device if where != "cpu" else "cpu", copy=True)
        with torch.no_grad():
            args, kwargs = tree_map(self.args, back, _Stored), tree_map(self.kwargs, back, _Stored)
            if first_tensor is not None:
                args = (first_tensor(args[0]), *args[1:])
            return fn(*args, **kwargs)

    def cast(self, dtype, positions=(0,), skip=()) -> "RecordedCall":
        """The call with the tensors of the positional arguments at ``positions`` and of every
        keyword argument not in ``skip`` (each, or each in a list) in ``dtype``, integer ones
        (int32, int64) kept - as a model computing in ``dtype`` is called.  A runtime that
        compiles ahead replays the calibration's call on a model of another compute dtype (ComfyUI
        runs a Wan fp8 file in fp16, the bf16 model it was calibrated on in bf16); compiled code
        guards on the dtypes, so a call left in the calibration's dtype compiles code the first
        image never uses (Wan 2.1 compiled again at its first image)."""
        def to(v):
            if isinstance(v, list):
                return [to(x) for x in v]
            if not isinstance(v, _Stored) or v[0].dtype in (torch.int32, torch.int64):
                return v
            return _Stored((v[0].to(dtype), v[1]))
        return RecordedCall(tuple(to(a) if i in positions else a for i, a in enumerate(self.args)),
                            {k: v if k in skip else to(v) for k, v in self.kwargs.items()})

    def signature(self) -> dict | None:
        """The call described in JSON (tensors by shape, dtype and device; the options as they
        are), for a file to carry: a loader in a fresh process compiles ahead from it
        (``from_signature``).  None where an argument is nothing JSON can describe (a function
        in the options, say): compiled code may guard on it."""
        try:
            return {"args": _describe(self.args), "kwargs": _describe(self.kwargs)}
        except TypeError:
            return None

    @classmethod
    def from_signature(cls, sig) -> "RecordedCall":
        """A call of ``signature``'s shapes and options with made-up tensor values (compiled code
        specialises on shapes, dtypes and options, not values).  ``sig`` comes from a file: every
        part is checked (ValueError names the first that is not what ``signature`` writes) and
        the tensors are bounded (``MAX_SIGNATURE_ELEMENTS``)."""
        if not isinstance(sig, dict) or not isinstance(sig.get("args"), dict) or \
                not isinstance(sig.get("kwargs"), dict):
            raise ValueError("not a call signature")
        budget = [MAX_SIGNATURE_ELEMENTS]
        args, kwargs = _build(sig["args"], budget), _build(sig["kwargs"], budget)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise ValueError("a call signature's args must be a tuple and its kwargs a dict")
        return cls(args, kwargs)

    @classmethod
    def read(cls, sig, where: str) -> "RecordedCall | None":
        """``from_signature`` of a description read from the file ``where``; None for one it
        refuses (logged: a runtime then compiles at the first image instead of ahead)."""
        try:
            return cls.from_signature(sig)
        except (ValueError, RecursionError) as e:
            logging.warning(f"[comfy-modelopt] {where}: the model call it describes is not usable ({e}); "
                            "compiled blocks are not compiled ahead from it")
            return None


# what a call signature read from a file may make: a Flux 1024^2 call holds 2.4M elements, Wan
# 2.1 at 81 frames of 832x480 about 9M
MAX_SIGNATURE_ELEMENTS = 1 << 28
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.bool)}


def _describe(v):
    if isinstance(v, _Stored):
        t, where = v
        if str(t.dtype) not in _DTYPES:
            raise TypeError(t.dtype)
        return {"tensor": list(t.shape), "dtype": str(t.dtype), "device": where}
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError("key")
        # pairs, not an object: the file's JSON sorts object keys, and compiled code guards on the
        # order of the options' keys (ComfyUI loops over them)
        return {"dict": [[k, _describe(x)] for k, x in v.items()]}
    if type(v) in (list, tuple):
        return {type(v).__name__: [_describe(x) for x in v]}
    if isinstance(v, uuid.UUID):
        return {"uuid": True}
    if v is None or type(v) in (bool, int, float, str):
        return {"value": v}
    raise TypeError(type(v).__name__)


def _build(d, budget: list):
    if isinstance(d, dict) and set(d) == {"tensor", "dtype", "device"}:
        shape, dtype, where = d["tensor"], _DTYPES.get(d["dtype"]), d["device"]
        if dtype is None or not (isinstance(where, str) and where.isalpha()) or not isinstance(shape, list) \
                or len(shape) > 8 or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"not a described tensor: {str(d)[:80]}")
        budget[0] -= math.prod(shape)
        if budget[0] < 0:
            raise ValueError(f"a call signature's tensors hold more than {MAX_SIGNATURE_ELEMENTS} elements")
        t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype) if dtype.is_floating_point \
            else torch.zeros(shape, dtype=dtype)
        return _Stored((t, where))
    if not isinstance(d, dict) or len(d) != 1:
        raise ValueError(f"not a described value: {str(d)[:80]}")
    (kind, v), = d.items()
    if kind == "value" and (v is None or type(v) in (bool, int, float, str)):
        return v
    if kind == "uuid":
        return uuid.uuid4()
    if kind in ("list", "tuple") and isinstance(v, list):
        items = [_build(x, budget) for x in v]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                      for p in v):
        return {k: _build(x, budget) for k, x in v}
    raise ValueError(f"not a described value: {str(d)[:80]}")


class _Stored(tuple):
    """(a CPU copy of a tensor, the device type it came from)."""


def _to_host(t: torch.Tensor):
    return _Stored((t.detach().to("cpu", copy=True), t.device.type))


def tree_map(v, fn, kind=torch.Tensor):
    """``v`` with every ``kind`` leaf mapped by ``fn``; dicts, lists and tuples copied, anything
    else kept as it is (also how the CUDA-graph runtime copies a model call, ``graph_inputs``)."""
    if isinstance(v, kind):
        return fn(v)
    if isinstance(v, dict):
        return {k: tree_map(x, fn, kind) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and not isinstance(v, _Stored):
        return type(v)(tree_map(x, fn, kind) for x in v) if type(v) in (list, tuple) else v
    return v
