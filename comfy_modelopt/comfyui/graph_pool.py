"""The memory pool a model's CUDA graphs share, and how it stays counted as memory in use.
Design: docs/design.md, ``comfyui/graph_pool.py``.
"""
from __future__ import annotations

import torch

from ..cuda_streams import allocator_backend, shared_graph_pool
from ..graph_memory import SMALL_SIZE, seed_pool


def pool_accounting() -> str | None:
    """How graphs kept between runs stay counted as memory in use, or None (they go back after
    every run): ``mempool`` - the caching allocator, a MemPool whose idle blocks are held
    (``GraphPool``); ``device`` - cudaMallocAsync (ComfyUI's default on CUDA 13 torch), whose
    graph memory the driver holds and ``mem_get_info`` reports as used."""
    if not torch.cuda.is_available():
        return None
    if allocator_backend() == "cudaMallocAsync":
        return "device"
    return "mempool" if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool") else None


class GraphPool:
    """The memory pool a model's graphs share.  ``accounted`` under the caching allocator: a
    MemPool whose idle blocks are held by placeholder tensors (``occupy``) between captures, so
    they count as memory in use; else a plain graph pool (given back after every run) - or, under
    cudaMallocAsync, no shared pool at all (``handle`` None: each graph holds driver memory the
    device counts as used) - on which ``occupy``/``vacate`` do nothing."""

    def __init__(self, accounted: bool = True):
        self.accounting = pool_accounting() if accounted else None
        self.pool = torch.cuda.MemPool() if self.accounting == "mempool" else None
        self.handle = self.pool.id if self.pool is not None else shared_graph_pool()
        self.fillers: list = []

    def _segments(self) -> list:
        if self.handle is None:
            return []
        return [seg for seg in torch.cuda.memory_snapshot()
                if tuple(seg.get("segment_pool_id", ())) == tuple(self.handle)]

    def reserved_bytes(self, kind: str | None = None) -> int:
        """Bytes of the pool's segments (``kind``: only "large" or "small" ones)."""
        return sum(seg["total_size"] for seg in self._segments() if kind in (None, seg.get("segment_type")))

    def seed(self, segments: list, stream, device) -> None:
        """Free segments of these sizes for the captures on ``stream`` to split (``graph_memory``)."""
        if self.pool is not None and segments:
            seed_pool(self.pool, segments, stream, device)

    def vacate(self) -> None:
        """Free the placeholders (before a capture: the new graph reuses those blocks)."""
        self.fillers.clear()

    def occupy(self) -> None:
        """Hold the pool's idle blocks with placeholders of their exact sizes.  The caching
        allocator keeps free blocks per stream, and the graphs were captured on a stream of their
        own: each placeholder is allocated on its block's stream.  Only blocks of large segments
        above the small-request size (1 MiB) are held (a request is served from the segment kind
        its size picks); the rest (a few MiB at most) stays idle.  An allocation that would need
        new memory is given back and ends the filling: placeholders never grow the pool."""
        self.vacate()
        if self.pool is None:
            return
        by_stream: dict = {}
        for seg in self._segments():
            if seg.get("segment_type") != "large":
                continue
            for b in seg["blocks"]:
                if b["state"] == "inactive" and b["size"] > SMALL_SIZE:
                    by_stream.setdefault((seg["device"], seg["stream"]), []).append(b["size"])
        with torch.cuda.use_mem_pool(self.pool):
            for (device, stream), sizes in by_stream.items():
                with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                    for size in sorted(sizes, reverse=True):
                        before = torch.cuda.memory_reserved(device)
                        filler = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
                        if torch.cuda.memory_reserved(device) > before:
                            del filler
                            return
                        self.fillers.append(filler)
