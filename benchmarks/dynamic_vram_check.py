"""ComfyUI's two ways of running the same quantized file through its stock loader, side by side:
dynamic VRAM (comfy-aimdo: a server's default on NVIDIA, each layer's weight paged in through
ComfyUI's cast path) and the classic ModelPatcher (weights resident).  Diagnostic: where the
test server's workflows found a file's images differ between the two, this names the layers.

What it found (H200, ComfyUI 0.29): the two agree bit for bit on every layer but those whose module
holds at most 16 KiB - dynamic VRAM force-loads such a module (model_patcher: "force the tinys
over") through ``patch_weight_to_device(force_cast=True)``, which dequantizes its weight and
quantizes it again (scales recalculated, stochastic rounding): the file's encoding is replaced.
Only tiny test models have such layers (the small SD3's 128x128 nvfp4 projections, 8 KiB);
``--size wide`` builds SD3 wide enough to have none.

``--loader own``: the same for files only comfy-modelopt's loader runs (nvfp4 with a rank-16
16-bit branch; on a UNet also fp8 convolutions), loaded by ``ownloader.load_file`` with dynamic
VRAM kept (as a model over half the GPU is) and with it off; every weight-holding layer compared.

Per file (small models of ComfyUI's own classes, random weights, quantized by comfy-modelopt
without statistics): one ``apply_model`` call on each load with the same inputs; every quantized
Linear's input and output recorded on the dynamic load; each classic layer run on the dynamic
layer's recorded input, and both held against a float32 reference from the stored tensors
(kitchen's dequantize of the layer's weight, the input as given).  Dynamic VRAM needs CUDA and
comfy-aimdo; without them the script says so and exits 0 (``--without-dynamic``: a control run,
both loads classic, that must agree on every layer - the CPU smoke test runs it).

    python benchmarks/dynamic_vram_check.py --families sd3,flux --formats nvfp4,float8_e4m3fn --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--families", default="sd3,flux", help="comma-separated, each FAMILY or FAMILY:SIZE")
ap.add_argument("--formats", default="nvfp4,float8_e4m3fn,mxfp8,int8_tensorwise")
ap.add_argument("--size", default="small", help="architectures size: small, or wide (SD3 only)")
ap.add_argument("--without-dynamic", action="store_true",
                help="control run: both loads classic (no CUDA or comfy-aimdo needed) - every layer must agree")
ap.add_argument("--loader", default="stock", choices=("stock", "own"),
                help="stock: ComfyUI's loader, --formats as given; own: the pack's loader on own-loader files")
ap.add_argument("--out", default=os.environ.get("OUT", "dynamic_vram_out"))
a = ap.parse_args()

# comfy-aimdo initialises before ComfyUI imports torch's allocator state (main.py's order)
try:
    if a.without_dynamic:
        raise ImportError("not asked for (--without-dynamic)")
    import comfy_aimdo.control
    comfy_aimdo.control.init()
except Exception as e:  # noqa: BLE001 - reported, not fatal: the script then has nothing to compare
    comfy_aimdo = None
    print(f"comfy-aimdo unavailable: {type(e).__name__}: {e}")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (imports ComfyUI)
import torch  # noqa: E402
import comfy.memory_management  # noqa: E402
import comfy.model_management as mm  # noqa: E402
import comfy.model_patcher as mp  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
from comfy_modelopt.errors import PlanError  # noqa: E402

if a.without_dynamic:
    print("control run: both loads classic")
elif not (common.CUDA and comfy_aimdo is not None
          and comfy_aimdo.control.init_devices(d.index for d in mm.get_all_torch_devices())):
    print("dynamic VRAM needs CUDA and comfy-aimdo: nothing to compare here (--without-dynamic: a control run)")
    sys.exit(0)
else:
    mp.CoreModelPatcher = mp.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
DEV = common.DEVICE


def inputs(family: str):
    g = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    sigma = torch.full((1,), 0.7, device=DEV)
    if family == "sd3":
        return r(1, 16, 32, 32), sigma, {"c_crossattn": r(1, 24, 4096), "y": r(1, 2048)}
    return common.inputs("flux_small" if family == "flux" else family, 1, 256, 24, torch.bfloat16)


# own-loader files: name -> the recipe's changes (nvfp4 + low-rank branch; fp8 + fp8 convolutions)
OWN = {"nvfp4+lowrank16": dict(format="nvfp4", lowrank=16), "fp8+conv_fp8": dict(format="float8_e4m3fn", conv="fp8")}


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compared_layers(patcher) -> dict:
    """The layers compared: the quantized ones (stock loader), or every layer holding a weight (own)."""
    if a.loader == "own":
        return {n: m for n, m in patcher.model.diffusion_model.named_modules()  # ComfyUI's mixed-precision
                if type(m).__name__ in ("Linear", "Conv2d")}                    # Linear is no nn.Linear
    return {n: m for n, m in patcher.model.diffusion_model.named_modules() if getattr(m, "quant_format", None)}


def check(spec: str, fmt: str, folder: str) -> dict:
    family, _, size = spec.partition(":")
    _, sd = common.architectures.build(family, size or a.size, seed=1)
    path = os.path.join(folder, f"{family}-{size or a.size}-{fmt}.safetensors")
    common.quantize(sd, common.Recipe(**OWN[fmt]) if a.loader == "own" else common.Recipe(fmt), out=path,
                    overwrite=True)
    x, sigma, kw = inputs(family)
    if a.loader == "own":
        from comfy_modelopt.comfyui import ownloader
        dyn = ownloader.load_file(path, disable_dynamic=False)  # kept dynamic, as a model over half the GPU
        cls = ownloader.load_file(path, disable_dynamic=True)
    else:
        stored, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
        dyn = comfy.sd.load_diffusion_model_state_dict(dict(stored), metadata=metadata)
        cls = comfy.sd.load_diffusion_model_state_dict(dict(stored), metadata=metadata, disable_dynamic=True)
    kinds = (type(dyn).__name__, type(cls).__name__)
    seen, before = {}, {}

    def record_input(name):
        def hook(_module, args):  # the input as the layer receives it
            before.setdefault(name, args[0].detach().clone())
        return hook

    def record(name):
        def hook(_module, args, output):  # the first call of each layer (returns None: output unchanged)
            seen.setdefault(name, (args[0].detach().clone(), output.detach().clone()))
        return hook
    hooks = [h for n, m in compared_layers(dyn).items()
             for h in (m.register_forward_pre_hook(record_input(n)), m.register_forward_hook(record(n)))]
    with torch.no_grad():
        mm.load_models_gpu([dyn])
        out_dyn = dyn.model.apply_model(x, sigma, **kw).float()
        for h in hooks:
            h.remove()
        mm.load_models_gpu([cls])
        out_cls = cls.model.apply_model(x, sigma, **kw).float()
        rows = []
        classic, dyn_layers = compared_layers(cls), compared_layers(dyn)
        for n, (xin, y_dyn) in seen.items():
            y_cls = classic[n](xin)
            row = {"layer": n, "format": getattr(classic[n], "quant_format", None) or type(classic[n]).__name__,
                   "dyn_vs_classic": rel(y_dyn, y_cls), "dtype": str(y_dyn.dtype),
                   # the input changed while the layer ran (its memory reused): then the recorded one is not what it used
                   "input_changed_in_forward": rel(xin, before[n]),
                   "module_bytes": mm.module_size(classic[n])}
            rows.append(row)
            if a.loader == "own":  # the own layers' math (branch, smoothing, fp8 convolution) is the loader's
                continue
            w = classic[n].weight
            w_ref = (w.dequantize() if hasattr(w, "dequantize") else w).float()
            b = classic[n].bias
            ref = torch.nn.functional.linear(xin.float(), w_ref, None if b is None else b.float())
            row.update(dyn_vs_ref=rel(y_dyn, ref), classic_vs_ref=rel(y_cls, ref))
            if row["dyn_vs_classic"]:  # which weight the dynamic load casts for it now, against the classic one's
                w_dyn, b_dyn, stream = comfy.ops.cast_bias_weight(dyn_layers[n], xin, offloadable=True)
                row["cast_weight_vs_classic"] = rel(w_dyn, w_ref)
                ratio = (w_dyn.float() / w_ref).flatten()
                ratio = ratio[torch.isfinite(ratio) & (w_ref.flatten().abs() > 1e-6)]
                row["cast_weight_ratio_min_max"] = [float(ratio.min()), float(ratio.max())] if ratio.numel() else None
                row["dyn_output_vs_input_before"] = rel(y_dyn, torch.nn.functional.linear(
                    before[n].float(), w_ref, None if b is None else b.float()))
                comfy.ops.uncast_bias_weight(dyn_layers[n], w_dyn, b_dyn, stream)
    mm.unload_all_models()
    worst = max(rows, key=lambda r: r["dyn_vs_classic"]) if rows else None
    return {"family": spec, "format": fmt, "patchers": kinds, "layers": len(rows),
            "bit_equal_layers": sum(r["dyn_vs_classic"] == 0 for r in rows),
            # ComfyUI force-loads (re-quantizes) modules up to 16 KiB under dynamic VRAM
            "differing_layers_over_16k": sum(r["dyn_vs_classic"] != 0 and r["module_bytes"] > 16 * 1024 for r in rows),
            "forward_dyn_vs_classic": rel(out_dyn, out_cls), "worst": worst, "rows": rows}


def main():
    os.makedirs(a.out, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for family in a.families.split(","):
            for fmt in (OWN if a.loader == "own" else a.formats.split(",")):
                try:
                    r = check(family, fmt, folder)
                except PlanError as e:  # e.g. fp8 convolutions asked of a model without any
                    r = {"family": family, "format": fmt, "error": f"n/a: {e}"}
                except Exception as e:  # noqa: BLE001 - one failing pair must not hide the others
                    r = {"family": family, "format": fmt, "error": f"{type(e).__name__}: {e}"}
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "rows"}), flush=True)
    print("\n| family | format | patchers | layers bit-equal | differing over 16 KiB | forward dyn vs classic | "
          "worst layer (dyn vs classic, dyn vs ref, classic vs ref) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['family']} | {r['format']} | error: {r['error']} | | | | |")
            continue
        w = r["worst"] or {}
        print(f"| {r['family']} | {r['format']} | {' / '.join(r['patchers'])} | {r['bit_equal_layers']} of "
              f"{r['layers']} | {r['differing_layers_over_16k']} | {r['forward_dyn_vs_classic']:.3g} | {w.get('layer')}: {w.get('dyn_vs_classic', 0):.3g}, "
              f"{w.get('dyn_vs_ref', float('nan')):.3g}, {w.get('classic_vs_ref', float('nan')):.3g} |")
    common.write_json(os.path.join(a.out, "dynamic_vram_check.json"),
                      {"env": common.env_info(), "args": vars(a), "results": results})


main()
