"""Constants built on the device they are moved to, for CUDA-graph capture.
Design: docs/design.md, ``device_constants.py``.
"""
from __future__ import annotations

import numbers
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}


def _python_numbers(v, integers: bool) -> bool:
    if isinstance(v, (tuple, list, torch.Size)):
        return all(_python_numbers(x, integers) for x in v)
    if isinstance(v, bool):
        return not integers
    return isinstance(v, numbers.Integral) if integers else isinstance(v, numbers.Real)


class ConstantsOnDevice(TorchFunctionMode):
    """Inside: ``factory(numbers).to(device)`` builds on ``device`` (see the module docstring).
    ``rebuilt`` counts the tensors built so."""

    def __init__(self):
        super().__init__()
        self.recipes: dict = {}  # id(tensor) -> (weakref, factory, args, kwargs)
        self.rebuilt = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recipes:
            if func in _MOVES and args and id(args[0]) in self.recipes:
                moved = self._rebuild(func, args, kwargs)
                if moved is not None:
                    return moved
            # any other use may modify or alias the constant: it is no longer known
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    self.recipes.pop(id(a), None)
        if func is torch.tensor and kwargs.get("device") is not None and len(args) == 1 and \
                _python_numbers(args[0], False) and torch.device(kwargs["device"]).type != "cpu":
            host = func(*args, **{**kwargs, "device": "cpu"})
            if host.numel() <= 64:
                out = torch.empty(host.shape, dtype=host.dtype, device=kwargs["device"])
                for i, v in enumerate(host.flatten().tolist()):  # a kernel each, the number its argument
                    out.view(-1)[i].fill_(v)
                self.rebuilt += 1
                return out
        out = func(*args, **kwargs)
        if func in _FACTORIES and self._constant(func, args, kwargs, out):
            self.recipes[id(out)] = (weakref.ref(out), func, args, kwargs)
        return out

    @staticmethod
    def _constant(func, args, kwargs, out) -> bool:
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or "out" in kwargs:
            return False
        if set(kwargs) - {"dtype", "device", "layout", "requires_grad", "pin_memory"}:
            return False
        if func is torch.full:  # size, fill value: the value may be any number
            return len(args) == 2 and _python_numbers(args[0], True) and _python_numbers(args[1], False)
        # arange with integer bounds only: float steps round differently on other devices
        return _python_numbers(args, True)

    def _rebuild(self, func, args, kwargs):
        ref, factory, f_args, f_kwargs = self.recipes.pop(id(args[0]))
        if ref() is not args[0]:  # another tensor now lives at that id
            return None
        if func is torch.Tensor.cuda:  # .cuda(), .cuda(index) or .cuda(device)
            device = args[1] if len(args) > 1 else kwargs.get("device")
            if device is None:
                device = torch.cuda.current_device()
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            dtype = None
        else:
            try:
                device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            except (TypeError, RuntimeError):  # e.g. copy=True: a copy was asked for
                return None
            if memory_format is not None and memory_format != torch.preserve_format:
                return None
        if device is None or device.type == "cpu":
            return None
        out = factory(*f_args, **{**f_kwargs, "device": device, "pin_memory": False})
        if dtype is not None and dtype != out.dtype:
            out = out.to(dtype)
        self.rebuilt += 1
        return out


# factories of random numbers and in-place random fills (torch's names, overload-free)
_RANDOM = frozenset({"rand", "randn", "randint", "randperm", "random_", "uniform_", "normal_", "bernoulli",
                     "bernoulli_", "multinomial", "exponential_", "geometric_", "cauchy_", "log_normal_",
                     "rand_like", "randn_like", "randint_like", "normal", "poisson"})


_UNKNOWN = object()  # a host read whose values are not recorded
# ``.item()`` reaches a dispatch mode as aten.item (its decomposition into _local_scalar_dense
# then runs below the mode): Kohya deep shrink's sigma read was missed, and its capture failed
_SCALAR_READS = frozenset({torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default})


class HostCopies(TorchDispatchMode):
    """Records, over one forward, what a CUDA graph could not hold: the ops that take a CPU
    tensor (not a 0-dim one: those are read as numbers) and return a tensor on another device -
    the host-to-device copies a capture refuses (``ops``); the ops that bring a GPU tensor's
    values to the host - ``.item()``, ``.cpu()``, a data-dependent shape - which a capture refuses
    too and which mean the forward decides something from those values (``reads``); and random
    numbers drawn on the CPU (``random``), a decision a replay would freeze (``values``: what
    the reads brought to the host, which may be the step's sigma).  Run over a warm-up
    forward, it tells beforehand that a capture would fail (a capture that fails under
    cudaMallocAsync can take the process down when its allocations are freed) or would be wrong.
    0-dim copies are not flagged: the first warm-up is also where lazy initialisations run once,
    and only this rule was checked against real GPU captures (a copy inside the forward itself
    still fails its capture, logged)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.reads: list = []
        self.random: list = []
        self.values: list = []  # what the reads read (numbers; ``_UNKNOWN`` where not one)
        self.host = ("cpu", "meta")  # device types whose values a read does not bring over (tests: "meta")
        self.bytes = 0  # what the host copies copied

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if isinstance(out, torch.Tensor) and out.device.type != "cpu" and \
                any(a.device.type == "cpu" and a.dim() for a in tensors):
            self.ops.append(str(func))
            self.bytes += out.nbytes
        elif any(a.device.type not in self.host for a in tensors) and (
                func in _SCALAR_READS or func is torch.ops.aten.nonzero.default
                or (isinstance(out, torch.Tensor) and out.device.type == "cpu")):
            self.reads.append(str(func))
            if func in _SCALAR_READS:
                self.values.append(out)
            elif func is not torch.ops.aten.nonzero.default and out.numel() <= 64:
                self.values.extend(out.flatten().tolist())
            else:
                self.values.append(_UNKNOWN)
        if func._opname in _RANDOM and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self.random.append(str(func))
        return out
