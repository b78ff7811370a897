"""How rank 0's order of work shapes a sharded quantization's wall time - a simulation, no GPU.

    python benchmarks/shard_schedule.py [--out DIR]

The layers of ``distributed_scaling.py``'s model (Flux.1-dev's width, 4 double + 8 single
blocks: 64 quantized layers in file order), each costing what GPTQ with the per-layer damping
cost on an H200 (a fixed 0.4 s plus a part growing like k (n + k), 7.3 s for a single block's
down-projection: ``benchmarks/results/2026-11-30-h200x2-distributed/gptq-per-layer-damping``),
times a random factor in [0.8, 1.25] per layer and seed (what the cost model does not know).
Owners encode their layers back to back in file order and keep at most ``SEND_WINDOW`` sent
layers unreceived; rank 0 encodes its own and receives the others', either in file order (as
before ``Shard.collect_order``) or in that order.  Printed and written: the makespan of each
against an even split of the work (total / ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from comfy_modelopt.distributed import SEND_WINDOW, Shard  # noqa: E402

WIDTH, HIDDEN = 3072, 12288


def layers() -> list[tuple[str, int, int]]:
    """(name, k, n) of the quantized layers in file order."""
    out = []
    for b in range(4):
        for s in ("img", "txt"):
            out += [(f"double_blocks.{b}.{s}_mod.lin", WIDTH, 6 * WIDTH),
                    (f"double_blocks.{b}.{s}_attn.qkv", WIDTH, 3 * WIDTH),
                    (f"double_blocks.{b}.{s}_attn.proj", WIDTH, WIDTH),
                    (f"double_blocks.{b}.{s}_mlp.0", WIDTH, HIDDEN), (f"double_blocks.{b}.{s}_mlp.2", HIDDEN, WIDTH)]
    for b in range(8):
        out += [(f"single_blocks.{b}.linear1", WIDTH, 3 * WIDTH + HIDDEN),
                (f"single_blocks.{b}.linear2", WIDTH + HIDDEN, WIDTH)]
    return out


def makespan(owners: list[int], rank0_order: list[int], seconds: list[float], world: int) -> float:
    """Wall time until every rank is done (the fixed point of owners and rank 0 waiting on
    each other: an owner waits for rank 0 to receive its layer SEND_WINDOW + 1 back)."""
    received: dict[int, float] = {}
    for _ in range(len(owners) + 1):
        clock, done = [0.0] * world, {}
        sent = {r: [] for r in range(world)}
        for i, r in enumerate(owners):
            if r == 0:
                continue
            start = clock[r]
            if len(sent[r]) > SEND_WINDOW:
                start = max(start, received.get(sent[r][-SEND_WINDOW - 1], 0.0))
            clock[r] = done[i] = start + seconds[i]
            sent[r].append(i)
        t, new = 0.0, {}
        for i in rank0_order:
            if owners[i] == 0:
                t += seconds[i]
            else:
                t = new[i] = max(t, done[i])
        if new == received:
            break
        received = new
    return max([t] + clock[1:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seeds", type=int, default=5)
    a = ap.parse_args(argv)
    ls = layers()
    costs = [k * (n + k) for _, k, n in ls]
    base = [0.4 + 7.3 * c / max(costs) for c in costs]
    rows = []
    print(f"{'ranks':>5} {'seed':>4} {'even split s':>12} {'file order':>16} {'collect_order':>16}")
    for world in (2, 4):
        shard = Shard(0, world, torch.device("cpu"))
        owners = shard.assign(costs)
        for seed in range(a.seeds):
            rnd = random.Random(seed)
            seconds = [b * rnd.uniform(0.8, 1.25) for b in base]
            even = sum(seconds) / world
            file_order = makespan(owners, list(range(len(ls))), seconds, world)
            scheduled = makespan(owners, shard.collect_order(costs, owners), seconds, world)
            rows.append({"ranks": world, "seed": seed, "even_split_s": round(even, 2),
                         "file_order_s": round(file_order, 2), "collect_order_s": round(scheduled, 2),
                         "file_order_over_even": round(file_order / even, 3),
                         "collect_order_over_even": round(scheduled / even, 3)})
            r = rows[-1]
            print(f"{world:5d} {seed:4d} {even:12.1f} {file_order:9.1f} ({r['file_order_over_even']:.2f}x) "
                  f"{scheduled:9.1f} ({r['collect_order_over_even']:.2f}x)")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "shard_schedule.json")
        with open(path + ".part", "w") as f:
            json.dump({"layers": len(ls), "send_window": SEND_WINDOW, "rows": rows}, f, indent=1)
        os.replace(path + ".part", path)
        print("wrote", path)


if __name__ == "__main__":
    main()
