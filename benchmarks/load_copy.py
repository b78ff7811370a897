#!/usr/bin/env python3
"""What moving a page-cached safetensors file's tensors onto the GPU costs, by the ways a load can
move them: each tensor's ``.to("cuda")`` from the memory-mapped file (what ``module.to`` does in
ComfyUI's classic load, and what compiling ahead paid when it copied the weights), the same from a
fresh mapping, ComfyUI's ``load_torch_file`` then ``.to``, and a double-buffered copy through two
pinned 256 MiB buffers.  Why compiling ahead now puts placeholders on the GPU instead of copies
(docs/benchmarks.md, "Compiling ahead on placeholder weights").  Needs CUDA.
Usage: python benchmarks/load_copy.py FILE.safetensors [--out DIR]   (COMFYUI_PATH for ComfyUI's reader)
"""
import argparse, json, os, sys, time

import safetensors
import torch

ap = argparse.ArgumentParser()
ap.add_argument("file")
ap.add_argument("--out", default=os.environ.get("OUT", "load_copy_out"))
ap.add_argument("--reps", type=int, default=2)
A = ap.parse_args()
dev = torch.device("cuda")


def mapped():
    with safetensors.safe_open(A.file, framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def staged(sd, chunk=256 << 20):
    bufs = [torch.empty(chunk, dtype=torch.uint8).pin_memory() for _ in range(2)]
    done, out, stream, i = [None, None], {}, torch.cuda.Stream(), 0
    for k, v in sd.items():
        src = v.reshape(-1).view(torch.uint8)
        dst = torch.empty(v.shape, dtype=v.dtype, device=dev)
        flat, o = dst.reshape(-1).view(torch.uint8), 0
        while o < src.numel():
            n, b = min(chunk, src.numel() - o), bufs[i % 2]
            if done[i % 2] is not None:
                done[i % 2].synchronize()  # the buffer's previous copy has left it
            b[:n].copy_(src[o:o + n])
            with torch.cuda.stream(stream):
                flat[o:o + n].copy_(b[:n], non_blocking=True)
                done[i % 2] = torch.cuda.Event()
                done[i % 2].record(stream)
            o, i = o + n, i + 1
        out[k] = dst
    stream.synchronize()
    return out


sd = mapped()
gib = sum(v.nbytes for v in sd.values()) / 2**30
ways = {"per-tensor .to(cuda) from the mapping": lambda: {k: v.to(dev) for k, v in sd.items()},
        "per-tensor .to(cuda) from a fresh mapping": lambda: {k: v.to(dev) for k, v in mapped().items()},
        "two pinned 256 MiB buffers, double-buffered": lambda: staged(sd)}
if os.environ.get("COMFYUI_PATH"):
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.utils
    ways["ComfyUI load_torch_file, then .to(cuda)"] = lambda: {
        k: v.to(dev) for k, v in comfy.utils.load_torch_file(A.file, safe_load=True).items()}
torch.ones(1, device=dev)
rows = []
for label, fn in ways.items():
    times = []
    for _ in range(A.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 3))
        del out
        torch.cuda.empty_cache()
    rows.append({"way": label, "seconds": times, "gib_per_s": round(gib / min(times), 1)})
print(f"{len(sd)} tensors, {gib:.2f} GiB, {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
print("| way | seconds | GiB/s (best) |\n|---|---|---|")
for r in rows:
    print(f"| {r['way']} | {', '.join(map(str, r['seconds']))} | {r['gib_per_s']} |")
os.makedirs(A.out, exist_ok=True)
with open(os.path.join(A.out, "load_copy.json"), "w") as f:
    json.dump({"file": A.file, "tensors": len(sd), "gib": round(gib, 3), "device": torch.cuda.get_device_name(dev),
               "torch": torch.__version__, "rows": rows}, f, indent=1)
