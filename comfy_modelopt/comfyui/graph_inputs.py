"""One model evaluation's arguments as a CUDA graph keeps them (``ModelCall``): static copies of
its tensors on the model's device, the tensors in a fixed order (replays copy new values into
them), the call's signature that picks a captured graph, and fresh containers for every run.
Design: docs/design.md, ``comfyui/graph_inputs.py``.
"""
from __future__ import annotations

import functools
import inspect
import types

import torch

from comfy.patcher_extension import WrappersMP

from ..calls import tree_map

# transformer_options entries no model evaluation runs or reads, left out of the signature: new
# uuids for every sampling run would make every run capture again
_UNKEYED = frozenset({"uuids", "callbacks"})
# wrapper kinds that run outside BaseModel._apply_model (APPLY_MODEL ones run around the graph:
# ``CudaGraphs`` calls them eagerly)
_WRAPPERS_OUTSIDE = frozenset({WrappersMP.OUTER_SAMPLE, WrappersMP.PREPARE_SAMPLING, WrappersMP.SAMPLER_SAMPLE,
                               WrappersMP.PREDICT_NOISE, WrappersMP.CALC_COND_BATCH, WrappersMP.APPLY_MODEL})
POSITIONAL = ("x", "t", "c_concat", "c_crossattn", "control", "transformer_options")


class ModelCall:
    """``apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)``'s
    arguments."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = tuple(args) + (None,) * (len(POSITIONAL) - len(args)), kwargs
        if self.args[5] is None:
            self.args = (*self.args[:5], {})

    @property
    def options(self) -> dict:
        return self.args[5]

    def _keyed(self) -> tuple:
        topts = self.options
        keyed = {k: v for k, v in topts.items() if k not in _UNKEYED}
        if isinstance(keyed.get("wrappers"), dict):
            keyed["wrappers"] = {k: v for k, v in keyed["wrappers"].items() if k not in _WRAPPERS_OUTSIDE}
        return (self.args[:5], keyed, self.kwargs)

    def signature(self) -> tuple:
        """Shapes, dtypes and devices of the tensors, the other values, and the callables and
        objects by identity (``held`` keeps them alive with the graph)."""
        flat: list = []
        walk_signature(self._keyed(), flat)
        return tuple(flat)

    def tensors(self) -> list:
        out: list = []
        walk_leaves(self._keyed(), out)
        return out

    def objects(self) -> list:
        """The callables and other objects the signature holds by identity."""
        out: list = []
        walk_leaves(self._keyed(), out, objects=True)
        return out

    def static(self, device) -> "ModelCall":
        """A copy with every tensor copied to ``device``."""
        copy = lambda t: t.to(device, copy=True)  # noqa: E731
        return ModelCall(tree_map(self.args, copy), tree_map(self.kwargs, copy))

    def replace_input(self, x) -> "ModelCall":
        return ModelCall((x, *self.args[1:]), self.kwargs)

    def step_sigmas(self) -> tuple | None:
        """The step's sigmas (``transformer_options["sigmas"]``) read on the host, or None."""
        sigmas = self.options.get("sigmas")
        if not isinstance(sigmas, torch.Tensor) or not 0 < sigmas.numel() <= 64:
            return None
        return tuple(sigmas.flatten().tolist())

    def only_sigmas(self, values: list) -> bool:
        """Every value in ``values`` (what a forward read on the host) is one of the step's sigmas."""
        allowed = set(self.step_sigmas() or ())
        return bool(allowed and values) and all(isinstance(v, float) and v in allowed for v in values)

    def run(self, fn):
        """``fn(*args, **kwargs)`` with containers of its own (the tensors and objects shared)."""
        same = lambda t: t  # noqa: E731
        return fn(*tree_map(self.args, same), **tree_map(self.kwargs, same))

    def model_wrappers(self) -> list:
        """Other packs' DIFFUSION_MODEL wrappers in the options (run inside ``apply_model``)."""
        wrappers = self.options.get("wrappers")
        return foreign([w for ws in (wrappers.get(WrappersMP.DIFFUSION_MODEL, {}) if isinstance(wrappers, dict)
                                     else {}).values() for w in ws])

    def with_innermost(self, wrapper, key: str) -> "ModelCall":
        """The same call with ``wrapper`` the innermost DIFFUSION_MODEL wrapper (in copied options)."""
        topts = dict(self.options)
        wrappers = topts["wrappers"] = dict(topts.get("wrappers") or {})
        inner = wrappers[WrappersMP.DIFFUSION_MODEL] = dict(wrappers.get(WrappersMP.DIFFUSION_MODEL) or {})
        inner.pop(key, None)
        inner[key] = [wrapper]  # the last key's wrappers run innermost (``get_all_wrappers``)
        return ModelCall((*self.args[:5], topts), self.kwargs)

    @staticmethod
    def of_forward(forward, args: tuple, kwargs: dict) -> tuple:
        """A diffusion model's ``_forward(x, ...)`` arguments as a call of their own: (the call,
        the function ``run`` calls with it) - the input first, the options where ``apply_model``'s
        are, the rest by name."""
        sig = inspect.signature(forward)
        params, kinds = sig.bind(*args, **kwargs).arguments, sig.parameters
        first = next(iter(params))
        rest = {k: v for k, v in params.items() if k not in (first, "transformer_options")}
        for k in [k for k in rest if kinds[k].kind is inspect.Parameter.VAR_KEYWORD]:
            rest.update(rest.pop(k))
        call = ModelCall((params[first], None, None, None, None, params.get("transformer_options", {})), rest)
        return call, functools.partial(_forward_by_name, forward, first, "transformer_options" in params)


def _forward_by_name(forward, first, with_options, x, _t, _c_concat, _c_crossattn, _control, transformer_options,
                     **kwargs):
    """``forward`` called by name - with ``transformer_options`` where its caller passed them."""
    return forward(**{first: x}, **({"transformer_options": transformer_options} if with_options else {}), **kwargs)


def tensors_of(*trees) -> list:
    out: list = []
    for t in trees:
        walk_leaves(t, out)
    return out


# The walks are module functions, not closures: a closure that calls itself is a reference cycle
# (function -> cell -> function) holding whatever it collected.  The tensors of every model
# evaluation (ComfyUI's conditioning, a fresh Flux context per step) then lived until the
# garbage collector ran, raising a Flux run's peak.
def walk_leaves(v, out: list, objects: bool = False) -> None:
    """The tensors (``objects``: the callables and other objects instead) of ``v``, in order."""
    if isinstance(v, dict):
        for k in sorted(v, key=str):
            walk_leaves(v[k], out, objects)
    elif isinstance(v, (list, tuple)):
        for x in v:
            walk_leaves(x, out, objects)
    elif isinstance(v, torch.Tensor):
        if not objects:
            out.append(v)
    elif objects and not isinstance(v, (int, float, str, bool, type(None))):
        out.append(v)


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
    else:  # a patch, a wrapper, an object a patch left in the options
        flat.append(("O", type(v).__qualname__, id(v)))


def foreign(objects: list) -> list:
    """The callables and objects not of this pack (``compiled_blocks.own``)."""
    return [o for o in objects if not getattr(o, "comfy_modelopt_own", False)]


def kept_state(objects: list) -> list:
    """What the callables among ``objects`` can keep between calls: (the callable, the name of a
    closure cell or attribute, the id of its value) - a snapshot to compare after a call
    (``state_changes``)."""
    return [(o, name, _ident(value), value) for o in objects for name, value in _state_slots(o)]


def _ident(v):
    """A value's identity, and a dict's items' too (a callable's state kept in a dict it fills)."""
    return (id(v), tuple((k, id(x)) for k, x in v.items())) if isinstance(v, dict) else id(v)


def state_changes(before: list) -> list:
    """The callables (qualified names) whose closure cells or attributes now hold another tensor
    than in the snapshot ``before``: a patch that records what it computed (Self-Attention
    Guidance keeps the middle block's attention maps for its next call) - a replayed graph would
    leave it holding what the capture made."""
    changed = []
    for o, name, ident, _old in before:
        now = dict(_state_slots(o)).get(name)
        if _ident(now) != ident and _holds_tensor(now):
            changed.append(f"{getattr(o, '__qualname__', type(o).__qualname__)} ({name})")
    return sorted(set(changed))


def _state_slots(o):
    fn = o.func if isinstance(o, functools.partial) else o
    if inspect.ismethod(fn):
        yield from ((f"self.{k}", v) for k, v in vars(fn.__self__).items())
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                yield name, cell.cell_contents
            except ValueError:  # an empty cell
                yield name, None
    elif hasattr(fn, "__dict__") and not isinstance(fn, type):
        yield from vars(fn).items()


def _holds_tensor(v, depth: int = 2) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if depth and isinstance(v, (list, tuple)):
        return any(_holds_tensor(x, depth - 1) for x in v)
    if depth and isinstance(v, dict):
        return any(_holds_tensor(x, depth - 1) for x in v.values())
    return False


class NotCapturable(Exception):
    """Why a signature's forward cannot be held by a graph (found before any capture)."""


class PerStep(NotCapturable):
    """A signature's forward reads the step's sigmas on the host, and nothing else a graph cannot
    hold: ``readers`` decide per step (active over part of the schedule - IP-Adapter's and
    ControlNet-like patches' start/end, Kohya deep shrink), the same way at the same sigma."""

    def __init__(self, readers: str):
        super().__init__(readers)
        self.readers = readers


STEP = "per-step"  # first item of a per-step graph's key (a signature's first item is a tuple)


def step_key(sig, call: ModelCall) -> tuple:
    """The graph key of a per-step signature's call: its step's sigmas, read on the host (one sync
    per evaluation)."""
    return (STEP, sig, call.step_sigmas())


def listed(ops) -> str:
    return ", ".join(sorted(set(ops))[:4])


def named(objects) -> str:
    names = sorted({getattr(o, "__qualname__", type(o).__qualname__) for o in objects})
    return ("the callables " if len(names) > 1 else "") + ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
