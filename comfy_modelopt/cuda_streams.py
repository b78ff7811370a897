"""CUDA-graph helpers shared by the calibration statistics' graphs and the ComfyUI adapter's model
graphs: warm-ups ordered off the stream about to be captured, the memory pool argument the
process's allocator accepts, and what cudaMallocAsync needs (graph memory trimmed on release, a
failed capture's memory never freed)."""
from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch


_STREAMS: dict = {}


def work_stream(device=None):
    """One stream per device for graph captures and the warm-ups before them, kept for the life
    of the process.  cuBLAS and cuBLASLt each keep a workspace per stream a matmul ever ran on,
    never freed: a fresh stream per warm-up or capture left two behind each time, and a capture
    stream's first workspace, made inside a capture, pinned a segment of a graph pool that was
    meant to go."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(index)
    return _STREAMS[index]


def on_side_stream(fn, device=None):
    """``fn()`` on ``work_stream``'s capture stream, ordered after the current stream, and the
    current stream after it."""
    stream = work_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        result = fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return result


def allocator_backend() -> str:
    """``native`` (PyTorch's caching allocator) or ``cudaMallocAsync`` - ComfyUI's default on
    CUDA 13 builds of torch (its ``cuda_malloc.py`` sets ``PYTORCH_CUDA_ALLOC_CONF``)."""
    try:
        return torch.cuda.get_allocator_backend()
    except Exception:  # pragma: no cover - no CUDA build
        return "native"


def shared_graph_pool():
    """A memory pool several graphs can share (``torch.cuda.graph(..., pool=...)``), or None
    where the allocator has none: cudaMallocAsync refuses shared pools ("does not yet support
    createOrIncrefPool") - every capture failed so inside a real ComfyUI server - and gives each graph the driver's graph memory instead, which the device counts as
    used (``torch.cuda.mem_get_info``, what ComfyUI reads)."""
    return None if allocator_backend() == "cudaMallocAsync" else torch.cuda.graph_pool_handle()


def trim_graph_memory(device=None) -> bool:
    """Hand the memory of destroyed graphs back to the device (``cudaDeviceGraphMemTrim``): under
    cudaMallocAsync a graph's allocations are driver graph memory, which stays reserved for
    future graphs after the graph is gone - ComfyUI, reading ``mem_get_info``, would see it used
    for good.  Torch has no binding; the CUDA runtime torch loaded is found by its soname.
    True when it ran."""
    import ctypes
    index = None if device is None else torch.device(device).index
    if index is None:  # "cuda" or none given: the current device
        index = torch.cuda.current_device()
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        torch.cuda.synchronize(index)
        return lib.cudaDeviceGraphMemTrim(ctypes.c_int(index)) == 0
    return False


def keep_forever(obj) -> None:
    """Never free ``obj`` nor what it references, not even when the interpreter exits (one more
    reference that nobody holds).  Under cudaMallocAsync, freeing memory a failed CUDA-graph
    capture had allocated aborts the process (cudaFreeAsync "invalid argument"): the exception of
    a failed capture is kept so, its traceback's frames holding those tensors."""
    import ctypes
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


_RAW_POINTERS = threading.local()


def install_raw_pointer_launches() -> bool:
    """Let Inductor's Triton kernels be captured under cudaMallocAsync (``raw_pointer_launches``).

    Both launchers Inductor uses - its static CUDA launcher and Triton's own - check every tensor
    argument with ``cuPointerGetAttribute``.  Under cudaMallocAsync, memory allocated during a
    capture is a graph allocation whose address is not mapped until the graph is launched, so
    that check fails ("invalid argument") for the first intermediate buffer, the capture is
    lost, and freeing what it had allocated then aborted the process (cudaFreeAsync "invalid
    argument" with torch 2.11).  Both launchers take a plain integer as a
    pointer without the check, so while ``raw_pointer_launches`` is on (this thread only) the
    CUDA tensor arguments of ``CachingAutotuner.run`` are handed over as their addresses - the
    same kernel on the same memory.  Installed once per process; False where this torch has no
    such class (compiled blocks then stay off under cudaMallocAsync)."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except Exception:  # pragma: no cover - a torch without Inductor's runtime
        return False
    original = CachingAutotuner.run
    if getattr(original, "_comfy_modelopt_raw_pointers", False):
        return True

    @functools.wraps(original)
    def run(self, *args, **kwargs):
        if getattr(_RAW_POINTERS, "on", False):
            args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) and a.device.type == "cuda" else a
                         for a in args)
        return original(self, *args, **kwargs)
    run._comfy_modelopt_raw_pointers = True
    CachingAutotuner.run = run
    return True


@contextlib.contextmanager
def raw_pointer_launches():
    """Inductor kernels launched by this thread get their CUDA tensors as raw addresses
    (``install_raw_pointer_launches``, which must have succeeded)."""
    previous = getattr(_RAW_POINTERS, "on", False)
    _RAW_POINTERS.on = True
    try:
        yield
    finally:
        _RAW_POINTERS.on = previous


def end_failed_capture(pool, device, stream) -> bool:
    """What a capture that failed inside leaves behind, undone; True where the allocator's routing
    into ``pool`` was ended here or had been.  torch's ``capture_end`` raises on the invalidated
    capture (``cudaStreamEndCapture``) before it ends that routing and before the graph context
    gives the stream back: every later capture into the pool then fails ("beginAllocateToPool:
    already recording to mempool_id") and work stays on the capture stream."""
    torch.cuda.set_stream(stream)
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    said, ended = [], False
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):  # torch's names over versions
        end = getattr(torch._C, name, None)
        if end is None:
            continue
        try:
            end(index, pool)
            said.append(f"{name}: ended")
            ended = True
            break
        except RuntimeError as e:  # "not currently recording": capture_end got that far
            said.append(f"{name}: {str(e).splitlines()[0][:120]}")
            ended = ended or "not currently recording" in str(e)
        except TypeError as e:  # another signature in this torch
            said.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
    logging.info(f"[comfy-modelopt] CUDA graphs: after a failed capture into pool {pool}: "
                 f"{'; '.join(said) or 'no end call in this torch'}")
    return ended
