"""What a recorded allocator history (``graph_memory.AllocationTrace(stacks=True)``) held at its
peak: a diagnostic for the benchmarks (sampling_check.py ``--trace-peak``)."""
import os


def live_at_peak(entries, top: int = 12, where: str = "comfy") -> dict:
    """What was allocated at the moment the recorded history held the most (every pool and
    stream): the peak's bytes and its ``top`` largest live allocations, each with the innermost
    frames of its Python stack whose file path contains ``where`` (recorded with ``stacks``)."""
    live, current, peak, at_peak = {}, 0, 0, {}
    for e in entries:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = e
            current += e.get("size", 0)
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action == "free_completed" and addr in live:
            current -= live.pop(addr).get("size", 0)
    biggest = sorted(at_peak.values(), key=lambda e: -e.get("size", 0))[:top]
    return {"peak_bytes": peak, "allocations": [
        {"bytes": e.get("size", 0), "stream": e.get("stream"),
         "frames": [f"{os.path.basename(f.get('filename', ''))}:{f.get('line')} {f.get('name')}"
                    for f in e.get("frames", []) if where in f.get("filename", "")][:3]}
        for e in biggest]}
