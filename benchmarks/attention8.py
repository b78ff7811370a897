"""8-bit attention on this GPU against torch's 16-bit SDPA, per attention call, at the shapes the
whole-run benchmark's models attend over (CUDA only).

    python benchmarks/attention8.py --out DIR

For each shape (batch, heads, tokens, head dim) it times, as CUDA-graph replays (the way the
runtime's graphs run them: no Python, no launch gaps), and compares with an fp32 reference:

- ``bf16 sdpa``: ``F.scaled_dot_product_attention`` in bf16 (cuDNN / flash attention);
- ``fp8 cudnn, kernel``: cuDNN's FP8 SDPA forward alone (``nvidia-cudnn-frontend``'s
  ``sdpa_fp8``), on Q/K/V already in e4m3 - the ceiling of any fp8 attention path with this
  kernel; per-tensor scales, P quantized by cuDNN, O in e4m3 (Hopper has no 16-bit output);
- ``fp8 cudnn, whole``: what a model needs around it - Q/K/V's amax, scale and cast (compiled
  by TorchInductor, as compiled blocks would fuse it), the kernel, O back to bf16;
- ``int8 kitchen``: comfy-kitchen's SageAttention-style INT8 attention (``ck.int8_attention``);
- ``fp8 fa3``: the runtime's FP8 attention (``comfyui.attention.fp8_attention``): keys and values
  centred, per-head e4m3 scales, FlashAttention-3's FP8 forward (``pip install fa3-fwd``), its
  output 16-bit - everything it does per call; ``compiled``: the same through TorchInductor (as
  compiled blocks run it); ``kernel``: FlashAttention-3's FP8 forward alone, on Q/K/V in e4m3;
- ``fa3 bf16``: FlashAttention-3's forward on the 16-bit Q/K/V as they are (no 8-bit rounding;
  the runtime's ``attention.fa3_forward``) - what another 16-bit kernel gives against torch's choice.

Prints a markdown table and writes ``attention8.json``.  Needs a CUDA GPU; the fp8 rows need
``pip install nvidia-cudnn-frontend`` (left out with the reason where it is missing).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tables  # noqa: E402

# (batch, heads, tokens, head dim): what one attention call of each model sees
SHAPES = {
    "Flux.1-dev 1024x1024 (4,096 image + 512 text tokens)": (1, 24, 4608, 128),
    "Flux.1-dev 2048x2048": (1, 24, 16896, 128),
    "SDXL 1024x1024, first level, cfg batch 2": (2, 10, 4096, 64),
    "Wan 2.1 1.3B 512x512, 17 frames (whole-run benchmark)": (1, 12, 5120, 128),
    "Wan 2.1 1.3B 832x480, 81 frames": (1, 12, 32760, 128),
    "Wan 2.1 1.3B 832x480, 81 frames, cfg batch 2": (2, 12, 32760, 128),
    "Wan 2.1 14B 832x480, 33 frames, cfg batch 2": (2, 40, 14040, 128),
}
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def graph_ms(fn, replays: int = 20) -> float:
    """Milliseconds per replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def quantize(x: torch.Tensor):
    """(x in e4m3 scaled to its amax, the descale as a [1,1,1,1] float32 tensor): no host sync."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    return (x.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), (amax / E4M3_MAX).view(1, 1, 1, 1)


class CudnnFp8Attention:
    """cuDNN's FP8 SDPA forward for one shape: Q/K/V (b, h, s, d) contiguous in e4m3, O written
    (b, s, h, d) in e4m3 so that O.reshape(b, s, h*d) is free.  O's scale is V's: every output
    row is a convex combination of V's rows, so |O| <= amax(V) and nothing saturates."""

    def __init__(self, b, h, s, d, device):
        import cudnn
        self.cudnn, self.shape = cudnn, (b, h, s, d)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        dt = cudnn.data_type
        g = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                          handle=self.handle)
        stride, ostride = (h * s * d, s * d, d, 1), (s * h * d, d, h * d, 1)
        self.t = {n: g.tensor(name=n, dim=self.shape, stride=stride, data_type=dt.FP8_E4M3) for n in "qkv"}
        self.sc = {n: g.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt.FLOAT)
                   for n in ("dq", "dk", "dv", "ds", "ss", "so")}
        self.o, _, self.amax_s, self.amax_o = g.sdpa_fp8(
            q=self.t["q"], k=self.t["k"], v=self.t["v"], descale_q=self.sc["dq"], descale_k=self.sc["dk"],
            descale_v=self.sc["dv"], descale_s=self.sc["ds"], scale_s=self.sc["ss"], scale_o=self.sc["so"],
            generate_stats=False, attn_scale=1.0 / math.sqrt(d), use_causal_mask=False, name="sdpa")
        self.o.set_output(True).set_dim(self.shape).set_stride(ostride).set_data_type(dt.FP8_E4M3)
        for a in (self.amax_s, self.amax_o):
            a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(dt.FLOAT)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(max(g.get_workspace_size(), 1), device=device, dtype=torch.uint8)
        self.scale_s = torch.full((1, 1, 1, 1), E4M3_MAX, device=device)  # P in [0, 1] onto e4m3's range
        self.descale_s = 1.0 / self.scale_s
        self.amax = torch.empty(2, 1, 1, 1, 1, device=device)

    def kernel(self, q8, k8, v8, dq, dk, dv):
        b, h, s, d = self.shape
        out = torch.empty((b, s, h, d), device=q8.device, dtype=E4M3)
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute({self.t["q"]: q8, self.t["k"]: k8, self.t["v"]: v8, self.sc["dq"]: dq,
                            self.sc["dk"]: dk, self.sc["dv"]: dv, self.sc["ds"]: self.descale_s,
                            self.sc["ss"]: self.scale_s, self.sc["so"]: 1.0 / dv, self.o: out.transpose(1, 2),
                            self.amax_s: self.amax[0], self.amax_o: self.amax[1]}, self.workspace, handle=self.handle)
        return out  # (b, s, h, d) in e4m3, descaled by dv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="*", default=None, help=f"only these of {list(SHAPES)}")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attention8.py times attention kernels on a CUDA GPU; none here")
    import comfy_kitchen as ck
    device = torch.device("cuda")
    try:
        import cudnn
        fp8_reason = None if torch.cuda.get_device_capability()[0] >= 9 else "cuDNN's FP8 SDPA needs SM 9.0+"
    except ImportError as e:
        cudnn, fp8_reason = None, f"nvidia-cudnn-frontend not installed ({e})"
    try:
        int8_ok = bool(ck.int8_attention_is_available(device))
    except (AttributeError, RuntimeError):
        int8_ok = False
    from comfy_modelopt.comfyui.attention import e4m3_heads, fa3_forward, fa3_kernel, fp8_attention
    fp8_attention_compiled = torch.compile(fp8_attention, dynamic=False)  # as compiled blocks fuse it
    fa3, fa3_reason = fa3_kernel() if torch.cuda.get_device_capability()[0] == 9 else (None, "FA3's FP8 forward is SM 9.0 only")
    quantize_compiled = torch.compile(quantize, dynamic=False)
    rows = []
    for label in a.shapes or SHAPES:
        b, h, s, d = SHAPES[label]
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, h, s, d, device=device, generator=gen) * 1.5
        # keys partly aligned with queries (peaked softmax rows, as trained attention has), values
        # with a few outlier channels
        k = torch.randn(b, h, s, d, device=device, generator=gen) * 1.5 + 0.75 * q[:, :, torch.randperm(s, device=device)]
        v = torch.randn(b, h, s, d, device=device, generator=gen) * (1 + 4 * (torch.rand(d, device=device) > 0.97))
        ref = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h * d)
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))

        def rel(out):
            return round(float((out.float() - ref).norm() / ref.norm()), 4)
        bf16 = lambda: F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h * d)  # noqa: E731
        row = {"shape": label, "bhsd": [b, h, s, d], "bf16_ms": round(graph_ms(bf16), 3), "bf16_rel_err": rel(bf16())}
        if fp8_reason is None:
            try:
                attn = CudnnFp8Attention(b, h, s, d, device)
                (q8, dq), (k8, dk), (v8, dv) = (quantize(t) for t in (q, k, v))

                def whole():
                    (q8_, dq_), (k8_, dk_), (v8_, dv_) = (quantize_compiled(t) for t in (q, k, v))
                    return (attn.kernel(q8_, k8_, v8_, dq_, dk_, dv_).float() * dv_.view(())).to(torch.bfloat16) \
                        .reshape(b, s, h * d)
                row["fp8_kernel_ms"] = round(graph_ms(lambda: attn.kernel(q8, k8, v8, dq, dk, dv)), 3)
                row["fp8_whole_ms"] = round(graph_ms(whole), 3)
                row["fp8_rel_err"] = rel(whole())
                row["fp8_kernel_speedup"] = round(row["bf16_ms"] / row["fp8_kernel_ms"], 2)
                row["fp8_whole_speedup"] = round(row["bf16_ms"] / row["fp8_whole_ms"], 2)
            except Exception as e:  # a shape or GPU cuDNN declines
                row["fp8_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            row["fp8_error"] = fp8_reason
        if int8_ok and d in (64, 128, 256):
            int8 = lambda: ck.int8_attention(q, k, v).transpose(1, 2).reshape(b, s, h * d)  # noqa: E731
            row["int8_ms"] = round(graph_ms(int8), 3)
            row["int8_rel_err"] = rel(int8())
            row["int8_speedup"] = round(row["bf16_ms"] / row["int8_ms"], 2)
        if fa3 is not None:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, H, D], as ComfyUI's layouts give it
            fa3_whole = lambda: fp8_attention(qt, kt, vt).reshape(b, s, h * d)  # noqa: E731
            row["fa3_ms"] = round(graph_ms(fa3_whole), 3)
            (q8, dq), (k8, dk), (v8, dv) = (e4m3_heads(t) for t in (qt, kt, vt))
            row["fa3_kernel_ms"] = round(graph_ms(lambda: fa3(q8, k8, v8, causal=False, q_descale=dq, k_descale=dk,
                                                             v_descale=dv)), 3)
            row["fa3_compiled_ms"] = round(graph_ms(lambda: fp8_attention_compiled(qt, kt, vt)), 3)
            row["fa3_rel_err"] = rel(fa3_whole())
            row["fa3_speedup"] = round(row["bf16_ms"] / row["fa3_ms"], 2)
            fa3_bf16 = lambda: fa3_forward(qt, kt, vt, kernel=fa3).reshape(b, s, h * d)  # noqa: E731 - the runtime's
            try:
                row["fa3_bf16_ms"] = round(graph_ms(fa3_bf16), 3)
                row["fa3_bf16_rel_err"] = rel(fa3_bf16())
                row["fa3_bf16_speedup"] = round(row["bf16_ms"] / row["fa3_bf16_ms"], 2)
            except Exception as e:  # a build without the 16-bit kernel
                row["fa3_bf16_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            row["fa3_error"] = fa3_reason
        rows.append(row)
        print(row, flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn_frontend": getattr(cudnn, "__version__", None) if cudnn else None,
           "cudnn_backend": cudnn.backend_version() if cudnn else None,
           "comfy_kitchen": getattr(ck, "__version__", None), "rows": rows}
    tables.print_markdown([("shape", "shape"), ("bf16 ms", "bf16_ms"), ("fp8 kernel ms", "fp8_kernel_ms"),
                           ("x", "fp8_kernel_speedup"), ("fp8 whole ms", "fp8_whole_ms"), ("x", "fp8_whole_speedup"),
                           ("int8 ms", "int8_ms"), ("x", "int8_speedup"), ("fp8 fa3 ms", "fa3_ms"),
                           ("x", "fa3_speedup"), ("fa3 compiled ms", "fa3_compiled_ms"),
                           ("fa3 kernel ms", "fa3_kernel_ms"), ("fa3 bf16 ms", "fa3_bf16_ms"),
                           ("x", "fa3_bf16_speedup"), ("rel err bf16", "bf16_rel_err"), ("fp8", "fp8_rel_err"),
                           ("int8", "int8_rel_err"), ("fa3", "fa3_rel_err"), ("fa3 bf16", "fa3_bf16_rel_err")], rows)
    tables.write_json(os.path.join(a.out, "attention8.json"), doc)
    return doc


if __name__ == "__main__":
    main()
