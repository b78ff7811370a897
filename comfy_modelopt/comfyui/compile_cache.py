"""What compiling the blocks produced - ahead (``runtime``) or at a new input signature's first
capture (``cuda_graphs``) - kept for the next process: torch's own portable form of its compile
caches (``torch.compiler.save_cache_artifacts``) saved after a compilation that missed them, and
loaded into them before the next compilation of the same model at the same shapes, in any process.
Design: docs/design.md, ``comfyui/compile_cache.py``.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os

import torch

import folder_paths

from ..publish import atomic_write_bytes
from .compiled_blocks import compile_account

KEEP = 32                 # bundles kept in all (the least recently used go first)
PER_KEY = 4               # ... and per model and call
MAX_BYTES = 1 << 30       # a larger file is not read


def folder() -> str:
    system_user = getattr(folder_paths, "get_system_user_directory", None)  # ComfyUI 0.29's; "__" + name
    root = system_user("comfy_modelopt") if system_user else os.path.join(folder_paths.get_user_directory(),
                                                                          "__comfy_modelopt")
    return os.path.join(root, "compile_cache")


def enabled() -> bool:
    return os.environ.get("COMFY_MODELOPT_COMPILE_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def key_of(model: torch.nn.Module, signature, dtype, device) -> str | None:
    """What names a bundle: the model's layers (class, tensor types, dtypes, shapes), the call's
    ``signature`` (its shapes and options, as JSON or a string), the compute dtype, the GPU and the
    torch and Triton builds.  None for no signature.  A key that meets other code than its
    bundles hold costs nothing but a compilation, after which one more bundle is kept."""
    if signature is None or not enabled():
        return None
    try:
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        device = torch.device(device)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        h = hashlib.sha256(json.dumps([torch.__version__, triton_version, gpu, str(dtype), signature],
                                      sort_keys=True, default=str).encode())
        for name, m in model.named_modules():
            h.update(f"{name}:{type(m).__qualname__}".encode())
            for pname, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None:
                    inner = getattr(t, "_qdata", t)
                    h.update(f"{pname}:{type(t).__name__}:{t.dtype}:{tuple(t.shape)}:{inner.dtype}".encode())
        return h.hexdigest()[:32]
    except Exception as e:  # nothing here may stop a compilation
        logging.warning(f"[comfy-modelopt] no compiled code kept for this model ({type(e).__name__}: {str(e)[:200]})")
        return None


@contextlib.contextmanager
def kept(key: str | None, where: str = "the model"):
    """Around a compilation of ``where``: the bundles kept for ``key`` loaded into torch's compile
    caches first (each once per process), and one more saved after when the compilation missed
    them - or compiled with none kept yet.  A key may hold several: the same model's blocks built
    by Quantize Model and loaded from its file trace to graphs the caches tell apart, so each way
    keeps its own (at most ``PER_KEY``, the newest).  Nothing here stops the compilation: a
    problem is logged and it compiles as without."""
    used = Kept()
    try:
        d = folder() if key is not None and enabled() else None
        mine = sorted(glob.glob(os.path.join(glob.escape(d), key + "-*.bin"))) if d else []
    except Exception as e:  # no user directory, ...: compiled as without
        logging.warning(f"[comfy-modelopt] {where}: no compiled code kept ({type(e).__name__}: {str(e)[:200]})")
        d = None
    if d is None:
        yield used
        return
    used.loaded = sum([_load(p, where) for p in mine if p not in _SEEN])
    known = any(_SEEN[p] for p in mine)  # a bundle that did not load is none: one more is kept
    with _own_record():  # a bundle holds what this compilation used, not all the process compiled
        before = compile_account()
        yield used
        spent = compile_account(before)
        if spent["aot_misses"] + spent["inductor_misses"] > 0 or (not known and spent["frames"] > 0):
            used.saved = _save(d, key, where)


class Kept:
    """What ``kept`` did: bundles ``loaded`` into torch's caches, the one ``saved`` (its path) - none
    when the compilation missed nothing, so ``loaded`` without ``saved``: the kept code served it."""
    loaded: int = 0
    saved: str | None = None


def _own_record():
    """torch records every cache artifact a process compiles or hits, and saves them all: SDXL's
    bundle for a second image size held the first's too.  Its record is
    swapped for a fresh one around a compilation (torch's own ``with_fresh_cache``; without
    it - another torch - bundles hold everything so far)."""
    try:
        from torch.compiler._cache import CacheArtifactManager
        return CacheArtifactManager.with_fresh_cache()
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


_SEEN: dict = {}  # bundle -> whether torch's caches hold it (loaded or saved here); each is tried once


def _load(path: str, where: str) -> bool:
    _SEEN[path] = False
    try:
        if os.path.getsize(path) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES >> 20} MiB")
        with open(path, "rb") as f:
            info = torch.compiler.load_cache_artifacts(f.read())
        if info is None:
            raise ValueError("torch could not read it (another torch build's?)")
        os.utime(path)  # recently used: pruned last
        logging.info(f"[comfy-modelopt] {where}: compiled code loaded from {path} ({_count(info)} artifacts)")
        _SEEN[path] = True
        return True
    except Exception as e:  # a bundle that does not load is compiled anew and saved again
        logging.warning(f"[comfy-modelopt] {where}: the kept compiled code {path} is not used "
                        f"({type(e).__name__}: {str(e)[:200]}); compiling as without it")
        return False


def _save(d: str, key: str, where: str) -> str | None:
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return None
        data, info = saved
        path = os.path.join(d, f"{key}-{hashlib.sha256(data).hexdigest()[:12]}.bin")
        os.makedirs(d, exist_ok=True)
        atomic_write_bytes(path, data, overwrite=True)
        _SEEN[path] = True
        _prune(d, key)
        logging.info(f"[comfy-modelopt] {where}: compiled code kept in {path} ({len(data) / 2**20:.1f} MiB, "
                     f"{_count(info)} artifacts) - a later process compiles these blocks from it")
        return path
    except Exception as e:
        logging.warning(f"[comfy-modelopt] {where}: could not keep the compiled code in {d} "
                        f"({type(e).__name__}: {str(e)[:200]})")
        return None


def _prune(d: str, key: str) -> None:
    """The newest ``PER_KEY`` bundles of ``key`` and ``KEEP`` in all stay."""
    bundles = sorted((e for e in os.scandir(d) if e.name.endswith(".bin")), key=lambda e: -e.stat().st_mtime)
    mine = [e for e in bundles if e.name.startswith(key + "-")]
    for e in mine[PER_KEY:] + bundles[KEEP:]:
        with contextlib.suppress(OSError):
            os.remove(e.path)


def _count(info) -> int:
    artifacts = getattr(info, "artifacts", None)
    return sum(len(v) for v in artifacts.values()) if isinstance(artifacts, dict) else 0
