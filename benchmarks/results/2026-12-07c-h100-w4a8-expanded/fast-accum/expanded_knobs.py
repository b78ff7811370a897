# the expanded way's knobs on Flux's 4608-row shapes: expansion tiles, fast accumulation, row rounding
import sys, json, torch
sys.path.insert(0, "benchmarks")
import common
import comfy_kitchen as ck
from comfy_modelopt import w4a8
out = []
for n, k in ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360)):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    g = (w.abs().amax().float() / (448 * 6)).reshape(1)
    q, bs = ck.quantize_nvfp4(w, g)
    dense = ck.dequantize_nvfp4(q, g, bs, torch.bfloat16)
    x = torch.randn(4608, k, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ dense.float().t())
    row = {"n": n, "k": k}
    for cfg in ((64, 128, 4), (64, 256, 4), (128, 128, 4), (128, 256, 8), (32, 512, 4), (16, 1024, 4), (256, 128, 8)):
        row[f"expand {cfg}"] = round(common.time_ms(lambda: w4a8.expand(q, bs, cfg), 5, 30)[0], 4)
    xq, sx = w4a8.quantize_rows(x)
    row["rows"] = round(common.time_ms(lambda: w4a8.quantize_rows(x), 5, 30)[0], 4)
    sx1 = (x.abs().amax().float() / 448).reshape(1)
    row["kitchen per-tensor"] = round(common.time_ms(lambda: ck.quantize_per_tensor_fp8(x, sx1, torch.float8_e4m3fn), 5, 30)[0], 4)
    we = w4a8.expand(q, bs)
    sb = (g.float().reshape(1, 1) * 8).expand(1, n).contiguous()
    for fa in (False, True):
        f = lambda: torch._scaled_mm(xq, we.t(), scale_a=sx.reshape(-1, 1), scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fa)
        row[f"gemm rowwise fa={fa}"] = round(common.time_ms(f, 5, 30)[0], 4)
        row[f"err fa={fa}"] = round(float((f().float() - ref).norm() / ref.norm()), 5)
        f1 = lambda: torch._scaled_mm(xq, we.t(), scale_a=sx1, scale_b=g.float() * 8, out_dtype=torch.bfloat16, use_fast_accum=fa)
        row[f"gemm tensorwise fa={fa}"] = round(common.time_ms(f1, 5, 30)[0], 4)
    row["16-bit"] = round(common.time_ms(lambda: x @ w.t(), 5, 30)[0], 4)
    row["expanded (default)"] = round(common.time_ms(lambda: w4a8.linear_expanded(*w4a8.quantize_rows(x), q, g, bs), 5, 30)[0], 4)
    print(json.dumps(row), flush=True)
