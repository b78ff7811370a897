"""graph_memory: the caching allocator's placement replayed on a recorded capture, and the single
segment fitted to it.  The replay is checked against the real allocator on a GPU (skipped on CPU);
the rest is plain arithmetic on CPU."""
import json
import os

import pytest
import torch

from comfy_modelopt.graph_memory import (LARGE_BUFFER, ROUND_LARGE, SMALL_SIZE, AllocationTrace, large_events,
                                         peak_in_use, pool_need, round_request, segment_size, simulate_pool,
                                         without_unfreed)

MiB = 1 << 20


def layers(sizes):
    """A forward's temporaries growing layer by layer: each one allocated, then freed."""
    events = []
    for i, size in enumerate(sizes):
        events += [("alloc", i, size), ("free", i)]
    return events


def test_rounding_and_segment_sizes():
    assert round_request(1) == 512 and round_request(513) == 1024 and round_request(4096) == 4096
    assert segment_size(2 * MiB) == LARGE_BUFFER  # 1-10 MiB requests get a 20 MiB buffer
    assert segment_size(11 * MiB + 1) == 12 * MiB  # larger ones are rounded up to 2 MiB


def test_growing_temporaries_fragment_the_pool_and_one_segment_serves_them():
    sizes = [12 * MiB, 14 * MiB, 16 * MiB, 18 * MiB]
    events = layers(sizes)
    # each request finds only smaller free segments: a new one each time, none ever merged
    assert simulate_pool(events) == sum(sizes)
    need = pool_need(events)
    assert need.peak == 18 * MiB and need.grown == sum(sizes) and need.requests == 4
    assert need.segments == [18 * MiB]
    assert simulate_pool(events, need.fitted) == need.fitted  # serves all: the pool stays one segment
    assert simulate_pool(events, need.fitted - ROUND_LARGE) > need.fitted  # any less grows it
    # the searches' question (does it serve all without growing?) answered without replaying on
    assert simulate_pool(events, need.fitted, grow=False) == need.fitted
    assert simulate_pool(events, need.fitted - ROUND_LARGE, grow=False) is None


def test_a_segment_for_a_big_request_packs_tighter_than_one_arena():
    # b (30) sits between a and the rest; once a is freed, c (12) fits only after b, and d (46)
    # only after c: one arena needs 98 MiB for a peak in use of 58.  With a 12 MiB segment of its
    # own, c leaves the arena whole for d: 46 + 12 MiB, the peak itself.
    events = [("alloc", "a", 10 * MiB), ("alloc", "b", 30 * MiB), ("free", "a"), ("alloc", "c", 12 * MiB),
              ("free", "b"), ("alloc", "d", 46 * MiB)]
    assert simulate_pool(events, 98 * MiB) == 98 * MiB and simulate_pool(events, 96 * MiB) > 96 * MiB
    need = pool_need(events)
    assert need.peak == 58 * MiB
    assert need.segments == [46 * MiB, 12 * MiB] and need.fitted == need.peak
    assert simulate_pool(events, need.segments) == need.fitted
    assert pool_need(events, max_extra=0).segments == [98 * MiB]


def test_freed_neighbours_merge():
    # A, B, C side by side in one segment; A and B freed: one block serves a request of A + B
    events = [("alloc", "a", 12 * MiB), ("alloc", "b", 12 * MiB), ("alloc", "c", 12 * MiB),
              ("free", "b"), ("free", "a"), ("alloc", "d", 24 * MiB)]
    assert simulate_pool(events, 36 * MiB) == 36 * MiB
    # freed in the other order: the merge must work from both sides
    events = events[:3] + [("free", "a"), ("free", "b"), ("alloc", "d", 24 * MiB)]
    assert simulate_pool(events, 36 * MiB) == 36 * MiB
    # without the merge d would not fit (c still holds the segment's end)
    assert simulate_pool(events[:3] + [("free", "a"), ("alloc", "d", 24 * MiB)], 36 * MiB) > 36 * MiB


def test_a_block_is_split_only_when_more_than_a_small_request_is_left():
    # 12.5 MiB of a 13 MiB block: the 0.5 MiB left goes with it, so the next 2 MiB needs a segment
    events = [("alloc", "a", 12 * MiB + MiB // 2), ("alloc", "b", 2 * MiB)]
    assert simulate_pool(events, 13 * MiB) == 13 * MiB + LARGE_BUFFER
    # 12 MiB of a 16 MiB block leaves 4 MiB: split, and the 2 MiB request fits in it
    events = [("alloc", "a", 12 * MiB), ("alloc", "b", 2 * MiB)]
    assert simulate_pool(events, 16 * MiB) == 16 * MiB


def test_best_fit_takes_the_smallest_free_block():
    # free blocks of 14 and 30 MiB: a 13 MiB request takes the 14 (so a later 28 MiB still fits)
    events = [("alloc", "a", 14 * MiB), ("alloc", "b", 12 * MiB), ("alloc", "c", 30 * MiB),
              ("free", "a"), ("free", "c"), ("alloc", "d", 13 * MiB), ("alloc", "e", 28 * MiB)]
    assert simulate_pool(events, 56 * MiB) == 56 * MiB


def test_large_events_filters_the_history():
    entries = [
        {"action": "alloc", "addr": 1, "size": 4 * MiB, "stream": 7},
        {"action": "alloc", "addr": 2, "size": SMALL_SIZE, "stream": 7},  # small: its own segments
        {"action": "alloc", "addr": 3, "size": 8 * MiB, "stream": 9},  # another stream
        {"action": "free_requested", "addr": 1, "size": 4 * MiB, "stream": 7},
        {"action": "free_completed", "addr": 1, "size": 4 * MiB, "stream": 7},
        {"action": "free_completed", "addr": 2, "size": SMALL_SIZE, "stream": 7},
        {"action": "free_completed", "addr": 5, "size": 4 * MiB, "stream": 7},  # allocated before
        {"action": "segment_alloc", "addr": 6, "size": 20 * MiB, "stream": 7},
    ]
    assert large_events(entries, stream=7) == [("alloc", 1, 4 * MiB), ("free", 1)]
    assert len(large_events(entries)) == 3
    # a free of something allocated before the recording is ignored by the replay
    assert simulate_pool([("free", 99), ("alloc", 1, 12 * MiB)]) == 12 * MiB


def test_a_warm_up_stands_for_its_capture_less_what_it_keeps_for_good():
    """An eager warm-up's record: what it allocates and never frees (a workspace, a cache) is
    gone from it but for its output; an address freed and allocated again counts by its last
    allocation; what the capture would ask is left."""
    warm = [("alloc", 1, 32 * MiB),            # a new stream's workspace: kept for good
            ("alloc", 2, 8 * MiB), ("free", 2),
            ("alloc", 2, 6 * MiB),             # the same address again: the output
            ("alloc", 3, 10 * MiB), ("free", 3),
            ("alloc", 4, 4 * MiB),             # a cache filled once
            ("free", 77)]                      # allocated before the record
    capture = [("alloc", 2, 8 * MiB), ("free", 2), ("alloc", 2, 6 * MiB), ("alloc", 3, 10 * MiB), ("free", 3)]
    assert without_unfreed(warm, keep={2}) == capture + [("free", 77)]
    assert peak_in_use(without_unfreed(warm, keep={2})) == peak_in_use(capture) == (16 * MiB, 3)
    assert pool_need(without_unfreed(warm, keep={2})).segments == pool_need(capture).segments
    assert without_unfreed(warm) == [("alloc", 2, 8 * MiB), ("free", 2), ("alloc", 3, 10 * MiB), ("free", 3),
                                     ("free", 77)]


def test_nothing_large_needs_no_segment():
    need = pool_need([("alloc", 1, 3 * MiB)][:0])
    assert need.fitted == 0 and need.requests == 0


def large_reserved(pool):
    """Bytes of the large segments a MemPool holds (the allocator's own snapshot)."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s["segment_pool_id"]) == tuple(pool.id) and s["segment_type"] == "large")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the real allocator is the oracle")
def test_replay_matches_the_real_allocator_and_a_sized_pool_stays_one_segment():
    """A capture of growing temporaries: the pool the real allocator grows is what the replay of
    its recorded history says, and a capture into a pool seeded with the fitted segment keeps it
    at exactly that segment."""
    from comfy_modelopt.graph_memory import seed_pool

    device = torch.device("cuda")
    x = torch.randn(1024, 1024, device=device)

    def forward():
        y = x
        for n in (3, 4, 5, 6, 7, 8):  # 12-32 MiB temporaries, each bigger than the last
            y = torch.cat([y] * n, 0)[:1024].clone() + torch.ones(n * 1024, 1024, device=device)[:1024]
        return y

    forward()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()

    def capture(pool):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool.id, stream=stream):
            out = forward()
        return g, out

    ref = forward()
    pool = torch.cuda.MemPool()
    with AllocationTrace() as trace:
        g, out = capture(pool)
    assert trace.entries is not None
    need = pool_need(large_events(trace.entries, stream=stream.cuda_stream))
    grown = large_reserved(pool)
    assert need.requests > 0 and need.grown == grown, (need, grown)
    assert 0 < need.fitted < grown
    del g, out
    sized = torch.cuda.MemPool()
    seed_pool(sized, need.segments, stream, device)
    g, out = capture(sized)
    assert large_reserved(sized) == need.fitted
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    # the same segments from an eager warm-up's record (what the runtime seeds a first capture
    # with): a tensor it keeps for good (a lazy cache) is left out, its output stays
    cache = []

    def warm_up():
        cache.append(torch.empty(24 * MiB, dtype=torch.uint8, device=device))
        return forward()
    with torch.cuda.stream(stream), AllocationTrace() as trace:
        wout = warm_up()
    stream.synchronize()
    wneed = pool_need(without_unfreed(large_events(trace.entries, stream=stream.cuda_stream),
                                      {wout.untyped_storage().data_ptr()}))
    assert wneed.peak == need.peak and wneed.segments == need.segments, (wneed, need)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: cuBLAS's workspaces are the subject")
def test_blas_workspace_is_recorded_as_the_capture_holds_it():
    """cuBLAS's workspace, freed before a recorded warm-up and at its end, is in the record as a
    capture made after freeing every workspace holds it - inside its pool: the capture's peak in
    use is the warm-up's, its seeded segments serve it, and freeing every workspace after the
    capture (new ones made meanwhile on other streams) leaves the replay exact.  Left unfreed, the
    warm-up's workspace would be dropped from the record, which would then ask for less."""
    from comfy_modelopt.graph_memory import release_blas_workspaces, seed_pool

    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)

    def forward():
        h = torch.relu(a @ a) @ a
        return h.float().sum(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        forward()  # lazy inits
    torch.cuda.synchronize()

    def recorded(free_at_end: bool):
        release_blas_workspaces()
        with torch.cuda.stream(stream), AllocationTrace() as trace:
            out = forward()
            if free_at_end:
                release_blas_workspaces()
        stream.synchronize()
        events = large_events(trace.entries, stream=stream.cuda_stream)
        return pool_need(without_unfreed(events, {out.untyped_storage().data_ptr()}))
    kept_out, need = recorded(False), recorded(True)
    assert need.peak > kept_out.peak  # the workspace is in the record

    pool = torch.cuda.MemPool()
    seed_pool(pool, need.segments, stream, device)
    release_blas_workspaces()
    g = torch.cuda.CUDAGraph()
    with AllocationTrace() as trace:
        with torch.cuda.graph(g, pool=pool.id, stream=stream):
            out = forward()
        release_blas_workspaces()
    assert peak_in_use(large_events(trace.entries, stream=stream.cuda_stream))[0] == need.peak
    if need.fitted:
        assert large_reserved(pool) == need.fitted
    ref = forward()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        (a @ a).sum()  # a workspace of another stream, then every one freed again
    torch.cuda.synchronize()
    release_blas_workspaces()
    filler = [torch.full((64 * MiB // 4,), 7.0, device=device) for _ in range(4)]  # whatever was freed, reused
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-2) and all(bool((f == 7).all()) for f in filler)


RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "results",
                        "2026-11-30-h200-wholerun")


@pytest.mark.parametrize("model", ["flux", "wan"])
def test_replay_of_a_recorded_capture_matches_the_pool_the_h200_grew(model):
    """The large requests of a real capture (full-size Flux.1-dev / Wan 2.1 fp8, lean + graphs,
    recorded on the H200) replayed here grow the pool the real allocator grew there, byte for
    byte, and the fitted segments are what that run captured into (its sampling JSON)."""
    with open(os.path.join(RECORDED, f"pool_events_{model}_lean_graphs.json")) as f:
        events = [tuple(e) for e in json.load(f)[0]["events"]]
    with open(os.path.join(RECORDED, f"sampling_{model}_sized_pool.json")) as f:
        row = next(r for r in json.load(f)["rows"] if r["variant"] == "lean + cuda graphs")
    measured = row["graph"]["pool_sizing_mib"][0]  # the real pool: as grown, then as captured into
    need = pool_need(events)
    assert round(need.grown / MiB, 1) == measured["grown"]
    assert round(need.fitted / MiB, 1) == measured["sized"]
    assert need.peak < need.fitted <= 1.16 * need.peak < need.grown
