"""How tightly a CUDA graph's memory pool can be packed, replayed from recorded captures (CPU).

    python benchmarks/graph_pool.py --out DIR [EVENTS.json ...]

Each events file is what ``sampling_check.py`` writes beside its JSON (``pool_events_*.json``: the
large alloc/free requests of a graph's first capture, recorded from the caching allocator's
history).  For each recorded capture, ``graph_memory`` replays the allocator's placement and
prints: the peak of what is in use at once, the pool an empty pool grows to (what the allocator
does; on the H200 this matched the real pool to the byte), the single segment fitted to it, and
the fitted segments (an arena plus a few sized to the largest requests) the runtime captures
into, with the seconds the search took.  With no files given: the recorded Flux.1-dev and
Wan 2.1 captures in ``benchmarks/results/2026-11-30-h200-wholerun``.  Writes ``graph_pool.json``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tables  # noqa: E402

from comfy_modelopt.graph_memory import pool_need  # noqa: E402

RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "2026-11-30-h200-wholerun",
                        "pool_events_*.json")
MiB = 1 << 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("events", nargs="*", help="pool_events_*.json files (default: the recorded ones)")
    a = ap.parse_args(argv)
    files = a.events or sorted(glob.glob(RECORDED))
    rows = []
    for path in files:
        with open(path) as f:
            records = json.load(f)
        for rec in records:
            events = [tuple(e) for e in rec["events"]]
            t0 = time.perf_counter()
            need = pool_need(events)
            seconds = time.perf_counter() - t0
            single = pool_need(events, max_extra=0)
            rows.append({"capture": os.path.basename(path).removeprefix("pool_events_").removesuffix(".json")
                         + (" (compiled)" if rec.get("compiled") else ""),
                         "requests": need.requests, "peak_mib": round(need.peak / MiB, 1),
                         "grown_mib": round(need.grown / MiB, 1), "single_mib": round(single.fitted / MiB, 1),
                         "fitted_mib": round(need.fitted / MiB, 1),
                         "segments_mib": [round(s / MiB, 1) for s in need.segments],
                         "fitted_vs_peak": round(need.fitted / need.peak, 3) if need.peak else None,
                         "grown_vs_peak": round(need.grown / need.peak, 3) if need.peak else None,
                         "search_s": round(seconds, 3)})
    tables.print_markdown([("capture", "capture"), ("large requests", "requests"), ("peak in use MiB", "peak_mib"),
                           ("pool grown MiB", "grown_mib"), ("one segment MiB", "single_mib"),
                           ("fitted MiB", "fitted_mib"), ("segments MiB", "segments_mib"),
                           ("fitted / peak", "fitted_vs_peak"), ("grown / peak", "grown_vs_peak"),
                           ("search s", "search_s")], rows)
    env = {"python": platform.python_version(), "machine": platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    tables.write_json(os.path.join(a.out, "graph_pool.json"), {"env": env, "files": files, "rows": rows})


if __name__ == "__main__":
    main()
