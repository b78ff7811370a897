"""Calibration and GPTQ quantization on 1 vs N GPUs (torch.distributed, NCCL).

    torchrun --nproc-per-node 1 benchmarks/distributed_scaling.py --out DIR
    torchrun --nproc-per-node 2 benchmarks/distributed_scaling.py --out DIR   # then compares

Model: Flux.1-dev's width (3072, 24 heads) with 4 double + 8 single blocks, built with ComfyUI's
own classes (random weights), replicated on every GPU.  Calibration: ``--prompts`` synthetic
prompts (latent and text conditioning drawn per prompt index) x ``--steps`` noise levels at
1024x1024, through ``distributed.calibrate_sharded`` (each rank samples its share, statistics
all-reduced).  Quantization: fp8 W8A8 with GPTQ from those statistics, layers sharded across the
ranks (``quantize(shard=...)``), rank 0 collecting the file.  Times are wall clock from a
barrier to a barrier (the slowest rank).  With N > 1 and the 1-GPU run's files in DIR, the exact
statistics are compared with it (the reservoir is another uniform sample, so GPTQ's and the
searches' results differ within sampling; tests/test_distributed.py holds the sharded file equal
to the one-process file for the same statistics).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

LOCAL = int(os.environ.get("LOCAL_RANK", "0"))
if torch.cuda.is_available():
    torch.cuda.set_device(LOCAL)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets up ComfyUI)
import architectures  # noqa: E402
from quality import FLUX_REDUCED_DEPTH  # noqa: E402

from comfy_modelopt.calibrate import CalibrationOptions  # noqa: E402
from comfy_modelopt.distributed import Shard, calibrate_sharded  # noqa: E402
from comfy_modelopt.pipeline import DictSink, NullSink, quantize  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402
from comfy_modelopt.statsfile import load_stats, save_stats  # noqa: E402


def barrier_time(shard) -> float:
    if shard is not None:
        dist.barrier()
    torch.cuda.synchronize()
    return time.perf_counter()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--calibrate-only", action="store_true", help="no GPTQ quantization (its row reads 0)")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl")
    shard = Shard.current()
    rank = shard.rank if shard else 0
    os.makedirs(a.out, exist_ok=True)
    architectures.CONFIGS["flux_quality"] = {"full": FLUX_REDUCED_DEPTH}
    _, sd = architectures.build("flux_quality", "full", dtype=torch.bfloat16, weights_device=common.DEVICE)
    base = common.load_stock(sd)
    dm = base.model.diffusion_model
    sigmas = torch.linspace(1.0, 0.05, a.steps)

    def run(_module, i):
        g = torch.Generator(device=common.DEVICE).manual_seed(i)
        x = torch.randn(1, 16, 128, 128, generator=g, device=common.DEVICE, dtype=torch.bfloat16)
        ctx = torch.randn(1, 512, 4096, generator=g, device=common.DEVICE, dtype=torch.bfloat16)
        y = torch.randn(1, 768, generator=g, device=common.DEVICE, dtype=torch.bfloat16)
        for s in sigmas:
            base.model.apply_model(x, torch.full((1,), float(s), device=common.DEVICE), c_crossattn=ctx, y=y,
                                   guidance=torch.full((1,), 3.5, device=common.DEVICE))
        torch.cuda.synchronize()
        prompt_ends.append(time.perf_counter())
    prompt_ends = []

    with torch.inference_mode():
        run(dm, 10_000)  # warm-up (kernels, allocator), not a calibration prompt
        t0 = barrier_time(shard)
        prompt_ends.clear()
        stats = calibrate_sharded(dm, list(range(a.prompts)), run, CalibrationOptions(), shard=shard)
        t1 = barrier_time(shard)
        # where calibration's time goes on this rank: its first prompt (the statistics' first
        # calls: CUDA-graph captures), the later ones, and the merge after its last prompt
        ends = [t0] + prompt_ends
        per_prompt = [b - a_ for a_, b in zip(ends, ends[1:])]
        calib_parts = {"first_prompt_s": round(per_prompt[0], 3),
                       "later_prompt_mean_s": round(sum(per_prompt[1:]) / max(len(per_prompt) - 1, 1), 3),
                       "merge_s": round(t1 - ends[-1], 3)}
        recipe = Recipe(format="float8_e4m3fn", gptq=True, sensitivity=False)
        sink = DictSink("cpu") if rank == 0 else NullSink()
        marks = []

        def progress(done, total, name):  # per rank: when each layer's turn ended (its busy time)
            marks.append((name, time.perf_counter()))
        t2 = barrier_time(shard)
        report = None if a.calibrate_only else quantize(
            sd, recipe, stats, sink=sink, progress=progress, family="flux", refuse_unknown=False, shard=shard).report
        t3 = barrier_time(shard)
    steps = sorted(((b[1] - a[1], a[0]) for a, b in zip(marks, marks[1:])), reverse=True)
    with open(os.path.join(a.out, f"timing_{world}gpu_rank{rank}.json"), "w") as f:
        json.dump({"calibration": calib_parts, "total_s": round(t3 - t2, 2), "first_layer_after_s": round(marks[0][1] - t2, 2) if marks else None,
                   "slowest_steps": [[round(d, 3), n] for d, n in steps[:12]]}, f, indent=1)
    if rank == 0:
        row = {"gpus": world, "prompts": a.prompts, "steps": a.steps, "calibrate_s": round(t1 - t0, 2),
               "quantize_gptq_s": round(t3 - t2, 2), "layers": len(report.quantized) if report else 0, **calib_parts,
               "env": common.env_info()}
        save_stats(stats, os.path.join(a.out, f"stats_{world}gpu.safetensors"), overwrite=True)
        if world > 1 and os.path.exists(os.path.join(a.out, "scaling_1gpu.json")):
            one = json.load(open(os.path.join(a.out, "scaling_1gpu.json")))
            row["calibrate_speedup"] = round(one["calibrate_s"] / row["calibrate_s"], 2)
            if report:
                row["quantize_speedup"] = round(one["quantize_gptq_s"] / row["quantize_gptq_s"], 2)
            s1 = load_stats(os.path.join(a.out, "stats_1gpu.safetensors"))
            row["exact_stats_equal"] = all(
                torch.equal(s1.layers[n].channel_absmax, stats.layers[n].channel_absmax.cpu())
                and torch.equal(s1.layers[n].hist, stats.layers[n].hist.cpu())
                and s1.layers[n].rows == stats.layers[n].rows for n in s1.layers)
            row["abssum_max_rel_diff"] = max(
                float(((s1.layers[n].channel_abssum - stats.layers[n].channel_abssum.cpu()).abs()
                       / s1.layers[n].channel_abssum.clamp(min=1e-30)).max()) for n in s1.layers)
        with open(os.path.join(a.out, f"scaling_{world}gpu.json"), "w") as f:
            json.dump(row, f, indent=1)
        print(json.dumps({k: v for k, v in row.items() if k != "env"}))
    if shard is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
