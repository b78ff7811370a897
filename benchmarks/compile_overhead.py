"""Host (Python) overhead of compiled blocks: the cost every run's CUDA-graph recapture pays.

    python benchmarks/compile_overhead.py --out DIR            # CPU or GPU

Builds SDXL's UNet with ComfyUI's own classes at SDXL's full depth (70 transformer blocks, 11
spatial transformers) but tiny widths, so the GPU/CPU arithmetic is negligible and what is timed
is host work: one forward eagerly and with ``CompiledBlocks`` installed (after compiling).  Also
reports the compile time and how many compiled variants Dynamo keeps per function: the opaque
weight layers split every block into separately compiled frames, and before CompiledBlocks left
ComfyUI's per-block keys (``block_index``, ...) out of the compiled calls the transformer block's
frame got one variant per block (70), all scanned on every call; now one per input shape.  A
CUDA-graph replay runs none of this; a capture (once per sampling run, since the graphs are
released after every run) runs it twice (a warm-up, then the capture).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("COMFYUI_PATH"):
    # the attention ComfyUI uses on CUDA (PyTorch SDPA) everywhere: on a CPU it would pick
    # sub-quadratic attention, whose free-memory reads make Dynamo recompile on every call
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import torch as _torch
    from comfy.cli_args import args as _comfy_args
    _comfy_args.use_pytorch_cross_attention = True
    _comfy_args.cpu = not _torch.cuda.is_available()  # what architectures.setup_comfy() would set
import common  # noqa: E402
from common import DEVICE, torch  # noqa: E402

import comfy.ops  # noqa: E402
from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel  # noqa: E402

import architectures  # noqa: E402
from comfy_modelopt.comfyui.compiled_blocks import CompiledBlocks  # noqa: E402

# SDXL's depth (transformer_depth, heads of 8 channels) at widths where arithmetic costs nothing
TINY_SDXL = dict(architectures.SDXL_FULL, model_channels=32, context_dim=64, num_head_channels=8, adm_in_channels=64)


def dynamo_variants(model) -> dict:
    """Compiled variants Dynamo keeps per module forward (resume functions not included)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    counts = collections.Counter()
    for code in {type(m).forward.__code__ for m in model.modules()}:
        n = len(_debug_get_cache_entry_list(code))
        if n:
            counts[f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"] = n
    return dict(counts.most_common())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    dm = UNetModel(**TINY_SDXL, dtype=torch.float32, device=DEVICE, operations=comfy.ops.disable_weight_init)
    for p in dm.parameters():
        p.data.normal_(0, 0.02)
    x, t = torch.randn(2, 4, 16, 16, device=DEVICE), torch.tensor([500.0, 500.0], device=DEVICE)
    c, y = torch.randn(2, 8, 64, device=DEVICE), torch.randn(2, 64, device=DEVICE)

    def forward():
        return dm(x, t, context=c, y=y, transformer_options={"cond_or_uncond": [0, 1]})
    blocks = CompiledBlocks(dm)

    def compiled():
        with blocks.installed():
            return forward()

    def host_ms(fn):
        common.sync()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            fn()
        common.sync()
        return (time.perf_counter() - t0) / a.iters * 1000
    with torch.inference_mode():
        forward()
        eager_ms = host_ms(forward)
        t0 = time.perf_counter()
        ref, out = forward(), compiled()
        compile_s = time.perf_counter() - t0
        compiled_ms = min(host_ms(compiled), host_ms(compiled))
    variants = dynamo_variants(dm)
    results = {"env": common.env_info(), "model": "SDXL depth, tiny widths", "regions": len(blocks.regions),
               "eager_ms": round(eager_ms, 1), "compiled_ms": round(compiled_ms, 1),
               "compile_s": round(compile_s, 1), "rel_l2_vs_eager": float((out - ref).norm() / ref.norm()),
               "dynamo_variants": variants, "dynamo_variants_total": sum(variants.values())}
    common.write_json(os.path.join(a.out, "compile_overhead.json"), results)
    print("\n| model | eager ms | compiled ms | compile s | compiled variants (largest) |\n|---|---|---|---|---|")
    top = ", ".join(f"{k}: {v}" for k, v in list(variants.items())[:2])
    print(f"| {results['model']} ({results['regions']} regions) | {results['eager_ms']} | {results['compiled_ms']} "
          f"| {results['compile_s']} | {results['dynamo_variants_total']} ({top}) |")
    return results


if __name__ == "__main__":
    main()
