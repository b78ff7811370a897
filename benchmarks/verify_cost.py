"""What verifying a file costs next to loading it: a full-size Flux.1-dev fp8 file (the layout and
tensors comfy-modelopt writes; deterministic random weights), loaded the stock way and through
Load Quantized Model's path, in one process, alternating so neither gets a warmer page cache.

Rows (seconds, best of --repeats): ComfyUI's stock load call (``comfy.sd.load_diffusion_model``;
it maps the file and reads little), the same plus reading every weight once (a copy of each
tensor: what the first sampling step pays to bring the model in), our read
(``comfy.utils.load_torch_file``), verify (every layer's contract, every scale and 16-bit value:
what Load Quantized Model runs by default), deep (plus every fp8 weight's NaN codes), our build
(ComfyUI's loader + the completeness check against the built model), and ``inspect --verify``
from the file.  ``--cold`` drops the page cache before each load (root only), so every read comes
from the disk.  Target (issue 37): verify <= 10% of the load.

    COMFYUI_PATH=... python benchmarks/verify_cost.py --out /tmp/verify   # writes ~12 GB once
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import architectures  # noqa: E402
import tables  # noqa: E402

architectures.setup_comfy()

import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402

from comfy_modelopt.checkpoint import inspect_file  # noqa: E402
from comfy_modelopt.comfyui import ownloader  # noqa: E402
from comfy_modelopt.pipeline import DeviceSource, DictSource, FileSink, quantize  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402
from comfy_modelopt.safetensors_io import ST_DTYPES  # noqa: E402
from comfy_modelopt.synthetic import flux_layout, tensor_for  # noqa: E402


def write_fp8(path: str, layout: dict, device: str) -> float:
    """Quantize the deterministic Flux weights to fp8 (absmax; what `quantize --format
    float8_e4m3fn` writes without statistics) straight into ``path``."""
    shapes = {k: (ST_DTYPES[torch.bfloat16], tuple(v)) for k, v in layout.items()}
    source = DictSource(shapes, lambda k: tensor_for(k, layout[k], 1, torch.bfloat16))
    if device != "cpu":
        source = DeviceSource(source, device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        quantize(source, Recipe("float8_e4m3fn", weight_scale="absmax"), sink=FileSink(path), family="flux",
                 refuse_unknown=False)
    return time.perf_counter() - t0


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def materialize(patcher) -> None:
    """Read every weight of the model once (a copy of each stored tensor, then dropped)."""
    for p in patcher.model.diffusion_model.parameters():
        t = getattr(p, "_qdata", p)
        torch.empty_like(t).copy_(t)


def one_round(path: str, name: str, cold: bool) -> dict:
    row = {}
    if cold:
        drop_caches()
    stock, row["stock load"] = timed(lambda: comfy.sd.load_diffusion_model(path))
    row["stock load + read every weight"] = row["stock load"] + timed(lambda: materialize(stock))[1]
    stock = None
    if cold:
        drop_caches()
    (sd, meta), row["our read"] = timed(lambda: comfy.utils.load_torch_file(path, safe_load=True,
                                                                             return_metadata=True))
    checked, row["verify"] = timed(lambda: ownloader.verify_state_dict(sd, meta, name))
    row["verify deep"] = timed(lambda: ownloader.verify_state_dict(sd, meta, name, deep=True))[1]
    row["our build"] = timed(lambda: ownloader.load_state_dict(sd, meta, where=name))[1]
    _, row["inspect --verify"] = timed(lambda: inspect_file(path, verify_values=True))
    row["layers"], row["values MiB"] = checked.layers, checked.bytes_read / 2**20
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the fp8 file (reused when present)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=19, help="double blocks (Flux.1-dev: 19)")
    ap.add_argument("--depth-single", type=int, default=38, help="single blocks (Flux.1-dev: 38)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the file is quantized")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    layout = flux_layout(depth=a.depth, depth_single=a.depth_single)
    path = os.path.join(a.out, f"flux-fp8-{a.depth}-{a.depth_single}.safetensors")
    made = None
    if not os.path.exists(path):
        made = write_fp8(path, layout, a.device)
        print(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB) in {made:.0f}s")
    rounds = [one_round(path, os.path.basename(path), a.cold) for _ in range(a.repeats)]
    best = {k: min(r[k] for r in rounds) for k in rounds[0]}
    load = best["stock load + read every weight"]
    best["verify / (load + read)"] = best["verify"] / load
    best["verify deep / (load + read)"] = best["verify deep"] / load
    best["verify / stock load call"] = best["verify"] / best["stock load"]
    tables.print_markdown([("step", "step"), (f"best of {a.repeats}", "value")],
                          [{"step": k, "value": f"{v:.3f}" if isinstance(v, float) else v} for k, v in best.items()])
    result = {"env": env_info(), "file": path, "file_gib": os.path.getsize(path) / 2**30, "cold": a.cold,
              "rounds": rounds, "best": best, "write_s": made}
    if a.json:
        tables.write_json(a.json, result)


def env_info() -> dict:
    import platform
    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


if __name__ == "__main__":
    main()
