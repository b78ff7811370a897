"""CUDA-graph helpers shared by the calibration statistics' graphs and the ComfyUI adapter's model
graphs: warm-ups ordered off the stream about to be captured, the memory pool argument the
process's allocator accepts, and what cudaMallocAsync needs (graph memory trimmed on release, a
failed capture's memory never freed)."""
from __future__ import annotations

import torch


_STREAMS: dict = {}


def work_stream(device=None):
    """One stream per device for graph captures and the warm-ups before them, kept for the life
    of the process.  cuBLAS and cuBLASLt each keep a workspace (32 MiB on Hopper) per stream a
    matmul ever ran on, never freed: a fresh stream per warm-up or capture left 64 MiB behind
    each time, and a capture stream's first workspace, made inside a
    capture, pinned a segment of a graph pool that was meant to go."""
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
