"""How much memory a CUDA graph's private pool needs, and a pool sized to it.
Design: docs/design.md, ``graph_memory.py``.
"""
from __future__ import annotations

import bisect
import inspect
from dataclasses import dataclass, field

import torch

from .cuda_streams import allocator_backend

# the CUDA caching allocator's constants (c10/cuda/CUDACachingAllocator.cpp)
SMALL_SIZE = 1 << 20           # kSmallSize: requests up to it are packed into small segments
MIN_LARGE_ALLOC = 10 << 20     # kMinLargeAlloc: below it a new large segment is a 20 MiB buffer
LARGE_BUFFER = 20 << 20        # kLargeBuffer
ROUND_LARGE = 2 << 20          # kRoundLarge: larger segments are rounded up to 2 MiB
MIN_BLOCK = 512                # kMinBlockSize: every request is rounded up to it


def round_request(size: int) -> int:
    """The block size the allocator hands out for a request of ``size`` bytes."""
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment the allocator creates when no free block serves a large request."""
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class PoolNeed:
    """What a recorded capture asked of the pool's large segments, and the segments fitted to it."""
    peak: int      # bytes of large blocks in use at once, at most (rounded as the allocator does)
    grown: int     # the segments an empty pool grows to serving it (the allocator's behaviour)
    segments: list  # the fitted segments, bytes (the arena first; empty: nothing large, or no saving)
    requests: int  # large requests recorded
    events: list = field(default_factory=list, repr=False)  # what was recorded (large_events)

    @property
    def fitted(self) -> int:
        """Bytes of the fitted segments (0: none)."""
        return sum(self.segments)


def simulate_pool(events, seed: int = 0, grow: bool = True) -> int | None:
    """Replay ``events`` (``("alloc", key, size)`` / ``("free", key)``, large requests only, in
    order) through the caching allocator's placement on one stream and return the bytes of
    segments the pool ends with, given a first segment of ``seed`` bytes (0: none) or a list of
    them.  ``grow=False``: None at the first request the segments cannot serve (the question
    ``pool_need``'s searches ask; most candidates fail early).

    Placement as the allocator does it: the smallest free block that fits (lowest address on a
    tie), split when more than ``SMALL_SIZE`` would be left over (else the whole block is handed
    out), neighbours in a segment merged when freed, and a new segment (``segment_size``) when
    no free block fits.  Segments never merge with each other."""
    free: list = []   # sorted (size, segment, offset) of the free blocks
    blocks: dict = {}  # (segment, offset) -> size, every block
    free_end: dict = {}  # (segment, end offset) -> offset, the free blocks
    segments: list = []
    live: dict = {}

    def add_free(seg, off, size):
        blocks[(seg, off)] = size
        free_end[(seg, off + size)] = off
        bisect.insort(free, (size, seg, off))

    def take_free(seg, off):
        size = blocks.pop((seg, off))
        del free_end[(seg, off + size)]
        free.pop(bisect.bisect_left(free, (size, seg, off)))
        return size

    for size in ([seed] if isinstance(seed, int) else seed):
        if size:
            segments.append(size)
            add_free(len(segments) - 1, 0, size)
    for ev in events:
        if ev[0] == "alloc":
            size = round_request(ev[2])
            i = bisect.bisect_left(free, (size, -1, -1))
            if i == len(free):
                if not grow:
                    return None
                segments.append(segment_size(size))
                add_free(len(segments) - 1, 0, segments[-1])
                i = bisect.bisect_left(free, (size, -1, -1))
            bsize, seg, off = free[i]
            take_free(seg, off)
            if bsize - size > SMALL_SIZE:
                add_free(seg, off + size, bsize - size)
                bsize = size
            blocks[(seg, off)] = bsize
            live[ev[1]] = (seg, off)
        else:
            pos = live.pop(ev[1], None)
            if pos is None:  # allocated before the recording began
                continue
            seg, off = pos
            size = blocks.pop(pos)
            if (seg, off + size) in blocks and (seg, off + size + blocks[(seg, off + size)]) in free_end:
                size += take_free(seg, off + size)
            before = free_end.get((seg, off))
            if before is not None:
                size += take_free(seg, before)
                off = before
            add_free(seg, off, size)
    return sum(segments)


def peak_in_use(events) -> tuple:
    """(bytes of large blocks in use at once at most, large requests) of recorded ``events``."""
    live, current, peak, requests = {}, 0, 0, 0
    for ev in events:
        if ev[0] == "alloc":
            size = round_request(ev[2])
            live[ev[1]] = size
            current += size
            peak = max(peak, current)
            requests += 1
        else:
            current -= live.pop(ev[1], 0)
    return peak, requests


def release_blas_workspaces() -> None:
    """Free the cuBLAS/cuBLASLt workspaces torch keeps, one per (thread's handle, stream) a matmul
    ever ran on (32 MiB each on Hopper), never freed otherwise.

    The graph runtime calls it before and after every capture and around a warm-up it records,
    as torch's own CUDA-graph trees do (``torch._inductor.cudagraph_trees.clear_cublas_manager``):
    a capture then allocates its workspace inside its graph's pool, where it stays for as long as
    the graph does - so freeing the workspaces later can never pull memory from under a graph -
    and the workspaces left behind by a compilation, the warm-ups and eager runs go back to the
    allocator at the next capture.  No-op where torch lacks it.

    No-op under cudaMallocAsync (ComfyUI's default allocator on CUDA 13 torch): there a workspace
    made during a capture is a graph allocation, and freeing it outside the graph before the graph
    has run is invalid - cudaFreeAsync "invalid argument", raised in a destructor, aborted a
    ComfyUI server at its first capture (comfy-aimdo on).  There the workspace the warm-ups
    made on the capture's stream stays, and the capture uses it rather than making one."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available() and allocator_backend() != "cudaMallocAsync":
        clear()


def without_unfreed(events, keep=()) -> list:
    """``events`` less the allocations never freed, but for those at the addresses in ``keep``.

    An eager forward recorded as a stand-in for its capture: what it allocates for good (lazy
    inits, a dequantized-weight cache) lives outside the pool by the time the forward is
    captured, so only its outputs (``keep``) stay in the pool.  (cuBLAS's workspace is freed at
    the end of a recorded warm-up, ``release_blas_workspaces``: it stays in the record, as it
    stays in the capture's pool.)"""
    last, freed = {}, set()
    for i, ev in enumerate(events):
        if ev[0] == "alloc":
            last[ev[1]] = i
            freed.discard(i)
        elif ev[1] in last:
            freed.add(last[ev[1]])
    keep = set(keep)
    drop = {i for addr, i in last.items() if i not in freed and addr not in keep}
    return [ev for i, ev in enumerate(events) if i not in drop]


def pool_need(events, extra_candidates: int = 10, max_extra: int = 3) -> PoolNeed:
    """The peak, the grown pool and the fitted segments of a recorded capture's large requests.

    First the smallest single segment that serves every request (searched in 2 MiB steps between
    the peak and what the pool grows to).  Then, greedily, up to ``max_extra`` more segments,
    each the size of one of the ``extra_candidates`` largest requests, kept when the arena they
    leave plus themselves is smaller: a few big tensors that live across layers otherwise split
    the arena where the others need it whole.  The searches stop a replay at the first request the
    segments cannot serve.  A set of segments that serves
    everything leaves the pool at exactly those segments."""
    peak, requests = peak_in_use(events)
    grown = simulate_pool(events)
    if not requests:
        return PoolNeed(0, grown, [], 0, events)

    def arena(extra: list, below: int) -> int | None:
        """The smallest arena that, with ``extra``, serves everything, if one below ``below``
        bytes (in total) does."""
        fixed = sum(extra)
        lo, hi = max(1, -(-(peak - fixed) // ROUND_LARGE)), (below - fixed) // ROUND_LARGE
        if hi < lo or simulate_pool(events, [hi * ROUND_LARGE] + extra, grow=False) is None:
            return None
        while lo < hi:  # best-fit placement is near enough monotone in the arena's size
            mid = (lo + hi) // 2
            if simulate_pool(events, [mid * ROUND_LARGE] + extra, grow=False) is not None:
                hi = mid
            else:
                lo = mid + 1
        return hi * ROUND_LARGE

    single = arena([], -(-grown // ROUND_LARGE) * ROUND_LARGE)
    if single is None:  # pathological: one segment of the grown size is not enough
        return PoolNeed(peak, grown, [], requests, events)
    best = [single]
    sizes = sorted({-(-round_request(ev[2]) // ROUND_LARGE) * ROUND_LARGE for ev in events if ev[0] == "alloc"},
                   reverse=True)[:extra_candidates]
    for _ in range(max_extra):
        extra, found = best[1:], None
        for size in sizes:
            a = arena(extra + [size], (sum(found) if found else sum(best)) - ROUND_LARGE)
            if a is not None:
                found = [a] + extra + [size]
        if found is None:
            break
        best = found
    return PoolNeed(peak, grown, best, requests, events)


def large_events(entries, stream: int | None = None) -> list:
    """The large alloc/free events of an allocator history (``torch.cuda.memory._snapshot()``'s
    ``device_traces`` entries), optionally only those of one stream.  A free counts
    when it completes (the block is reusable from then on); the address is the key."""
    events, large = [], set()
    for e in entries:
        if stream is not None and e.get("stream") != stream:
            continue
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc" and e.get("size", 0) > SMALL_SIZE:
            events.append(("alloc", addr, e["size"]))
            large.add(addr)
        elif action == "free_completed" and addr in large:
            events.append(("free", addr))
            large.discard(addr)
    return events


class AllocationTrace:
    """Record the caching allocator's alloc/free history while the block runs (no stack traces:
    cheap).  ``entries`` stays None where it cannot record: another user of the process is already
    recording (their history is left alone), or the allocator has no history (cudaMallocAsync)."""

    def __init__(self, device=None, max_entries: int = 1_000_000, stacks: bool = False):
        self.device, self.max_entries, self.entries = device, max_entries, None
        self.stacks = stacks  # also the Python stack of each allocation (a diagnosis; slower)
        self._recording = False

    def __enter__(self):
        try:
            if torch._C._cuda_isHistoryEnabled():
                return self
            kwargs = {"context": "alloc" if self.stacks else None, "stacks": "python", "max_entries": self.max_entries}
            if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
                kwargs["clear_history"] = True
            torch.cuda.memory._record_memory_history("all", **kwargs)
            self._recording = True
        except Exception:  # no history in this allocator or torch
            self._recording = False
        return self

    def __exit__(self, *exc):
        if not self._recording:
            return False
        try:
            index = torch.cuda.current_device() if self.device is None else torch.device(self.device).index
            traces = torch.cuda.memory._snapshot()["device_traces"]
            self.entries = list(traces[index or 0]) if exc[0] is None else None
        finally:
            torch.cuda.memory._record_memory_history(None)
        return False


def seed_pool(pool, segments, stream, device) -> None:
    """Give the MemPool ``pool`` free segments of the given sizes (bytes; one int or a list) on
    ``stream`` - the stream a graph will be captured on: the allocator serves a request only from
    blocks of its own stream.  All are held until the last is made, so each is a segment of its
    own."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    held = []
    with torch.cuda.use_mem_pool(pool, device), torch.cuda.stream(stream):
        for size in ([segments] if isinstance(segments, int) else segments):
            held.append(torch.empty(size, dtype=torch.uint8, device=device))
    del held


def recorded_need(fn, device, tensors_of):
    """``fn()`` (a warm-up, on the work stream) with its large allocations recorded: (its output,
    the pool a capture of the same forward needs, or None where the allocator keeps no history).
    What the warm-up allocates for good but its output (``tensors_of(out)``) lives outside the
    pool by the time the forward is captured (``without_unfreed``)."""
    # its cuBLAS workspace is made where the capture's will be (at the first matmul) and freed
    # at the end, as after a capture: the fit holds it, as the graph's pool will
    release_blas_workspaces()
    with AllocationTrace(device) as trace:
        out = fn()
        release_blas_workspaces()
    if trace.entries is None:
        return out, None
    keep = {t.untyped_storage().data_ptr() for t in tensors_of(out)}
    events = large_events(trace.entries, stream=torch.cuda.current_stream(device).cuda_stream)
    return out, pool_need(without_unfreed(events, keep))
