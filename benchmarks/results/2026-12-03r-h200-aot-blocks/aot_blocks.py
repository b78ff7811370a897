"""What a fresh process pays to run ComfyUI's two Flux block kinds (full width, one of each, bf16,
1024x1024 with 512 text tokens) compiled - by torch.compile with torch's compile caches warm
(Dynamo traces both frames again, the compiled code comes from the caches), or as functions
compiled ahead of time (``torch.compile(fullgraph=True).aot_compile``, every guard dropped, saved
with ``serialize`` and loaded with ``torch.compiler.load_compiled_function``: no tracing at all).
The compiler's first import is timed apart.  A diagnostic for issue 39's first server prompt, not
a runtime the pack has (docs/benchmarks.md section 0, "Compiled blocks loaded without tracing").

    python aot_blocks.py dynamo|aot_save|aot_load FILE     (from the repository root; CPU: a small Flux)
"""
import os, sys, time, pickle, io, json
T0 = time.perf_counter()
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import architectures as models
import torch as _t
if not _t.cuda.is_available():
    sys.path.insert(0, models.COMFYUI_PATH)
    from comfy.cli_args import args as _a
    _a.cpu = True; _a.use_pytorch_cross_attention = True
models.setup_comfy()
import torch, comfy.sd
from torch._dynamo.utils import counters
mode, path = sys.argv[1], sys.argv[2]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
if DEV == "cpu":
    models.FLUX_FULL = dict(models.FLUX_SMALL)
res = {"mode": mode, "import_s": round(time.perf_counter() - T0, 2)}
cfg = dict(models.FLUX_FULL, depth=1, depth_single_blocks=1)
torch.manual_seed(0)
import comfy.ldm.flux.model as fm, comfy.ops
dm = fm.Flux(**{k: v for k, v in cfg.items() if k != "image_model"}, dtype=torch.bfloat16, device=DEV,
             operations=comfy.ops.disable_weight_init)
for p in dm.parameters():
    p.data.normal_(0, 0.02)
blocks = {"double": dm.double_blocks[0], "single": dm.single_blocks[0]}
captured = {}
hs = [b.register_forward_pre_hook((lambda n: lambda m, a, k: captured.setdefault(n, (a, k)))(n), with_kwargs=True) for n, b in blocks.items()]
S = 128 if DEV == "cuda" else 16; C = cfg["context_in_dim"]
x = torch.randn(1, 16, S, S, device=DEV, dtype=torch.bfloat16)
ctx = torch.randn(1, 512 if DEV == "cuda" else 8, C, device=DEV, dtype=torch.bfloat16); y = torch.randn(1, 768, device=DEV, dtype=torch.bfloat16)
with torch.inference_mode():
    dm(x, torch.tensor([0.5], device=DEV), ctx, y, guidance=torch.tensor([3.5], device=DEV))
for h in hs: h.remove()
SYNC()
res["setup_s"] = round(time.perf_counter() - T0, 2)
t = time.perf_counter()
import torch._inductor.compile_fx, torch._inductor.codecache  # noqa: E401,F401 - the compiler's import, timed apart
from torch._dynamo.backends.registry import lookup_backend
lookup_backend("inductor")
res["compiler_import_s"] = round(time.perf_counter() - t, 2)
none = lambda entries: [False] * len(entries)
def run(fns):
    outs = {}
    for n, b in blocks.items():
        a, k = captured[n]
        with torch.inference_mode():
            r = fns[n](b, *a, **k)
        outs[n] = r[0] if isinstance(r, tuple) else r
    SYNC()
    return outs
if mode == "dynamo":  # torch.compile as compiled blocks do (warm caches in a later process)
    t = time.perf_counter()
    fns = {n: (lambda c: (lambda b, *a, **k: c(*a, **k)))(torch.compile(b.forward, dynamic=False)) for n, b in blocks.items()}
    run(fns); res["first_call_s"] = round(time.perf_counter() - t, 2); res["frames"] = counters["frames"]["ok"]
elif mode == "aot_save":
    t = time.perf_counter(); data = {}
    for n, b in blocks.items():
        a, k = captured[n]
        flag = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
        with torch.inference_mode(), torch._dynamo.config.patch(**flag):
            f = torch.compile(type(b).forward, fullgraph=True, dynamic=False, options={"guard_filter_fn": none}).aot_compile(((b, *a), k))
        data[n] = type(f).serialize(f).serialized_data
    res["aot_compile_s"] = round(time.perf_counter() - t, 2)
    pickle.dump(data, open(path, "wb")); res["bytes"] = os.path.getsize(path)
elif mode == "aot_load":
    t = time.perf_counter()
    data = pickle.load(open(path, "rb"))
    fns = {n: torch.compiler.load_compiled_function(io.BytesIO(d)) for n, d in data.items()}
    res["load_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter(); outs = run(fns); res["first_call_s"] = round(time.perf_counter() - t, 2)
    eager = run({n: (lambda b, *a, **k: b(*a, **k)) for n in blocks})
    res["rel_err"] = {n: float((outs[n].float() - eager[n].float()).norm() / eager[n].float().norm()) for n in blocks}
    res["frames"] = counters["frames"]["ok"]
    t = time.perf_counter(); [run(fns) for _ in range(3)]; res["3_calls_s"] = round(time.perf_counter() - t, 3)
res["total_s"] = round(time.perf_counter() - T0, 2)
print("RESULT", json.dumps(res))
