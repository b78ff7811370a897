"""comfy-modelopt command line: quantize | inspect | demo."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from . import __version__
from .errors import ModelOptError, OutputError, one_line
from .families import FAMILY_CHOICES
from .progress import Progress


STATS_HOW = ("needs --stats: statistics come from Calibrate Model in ComfyUI (save_name), or without "
             "the UI from `python -m comfy_modelopt.comfyui.launch --comfyui PATH --unet MODEL --clip ... -o NAME`")


def add_recipe_arguments(q: argparse.ArgumentParser) -> None:
    """A flag per recipe field (``recipe.Recipe``: its default, choices and help), shared by
    ``quantize`` and the ComfyUI launcher; ``recipe_of`` reads them back."""
    from .recipe import recipe_default, recipe_options
    for f, o in recipe_options():
        default = recipe_default(f)
        flag = "--" + f.name.replace("_", "-")
        text = o.text(stats=STATS_HOW, with_stats="--stats", list="repeatable or comma-separated")
        if isinstance(default, bool):
            # --x and --no-x both, whatever the default: a script keeps working when a default turns
            q.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif isinstance(default, tuple):  # repeatable, each value comma-separated; "%(default).0s": no "(default: [])"
            q.add_argument(flag, action="append", default=[], metavar=o.metavar, help=text + "%(default).0s")
        else:
            q.add_argument(flag, type=type(default), default=default, choices=o.choices or None,
                           metavar=o.metavar, help=text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="comfy-modelopt", description=__doc__)
    p.add_argument("--version", action="version", version=f"comfy-modelopt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a diffusion-model checkpoint into ComfyUI's native format",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    q.add_argument("src", help="source .safetensors (diffusion model, or full checkpoint)")
    q.add_argument("-o", "--output", required=True, help="output .safetensors (written atomically)")
    q.add_argument("--family", default="auto", choices=FAMILY_CHOICES,
                   help="model family: auto detects it and refuses files of none it knows (LoRA, text "
                        "encoder, VAE); generic applies generic rules to an unknown architecture")
    q.add_argument("--stats", help="activation statistics (.safetensors from calibration): static input scales "
                                   "(fp8 W8A8) and activation-aware searches. Made by Calibrate Model in ComfyUI "
                                   "(save_name: models/modelopt_calibration/NAME.safetensors), or without the UI by "
                                   "`python -m comfy_modelopt.comfyui.launch --comfyui PATH --unet MODEL --clip "
                                   "ENCODER -o NAME` (its --help)")
    add_recipe_arguments(q)
    q.add_argument("--device", default="auto",
                   help="where the quantization math runs: auto (the default: a CUDA GPU if there is one, else "
                        "the CPU), cpu, cuda or cuda:N; weights travel there one layer at a time")
    q.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    q.add_argument("--hash", action="store_true", help="record the source file's sha256 (reads it once more)")
    q.add_argument("--report", help="also write the per-layer report as JSON here")
    q.add_argument("--table", action="store_true", help="print the per-layer table")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    i = sub.add_parser("inspect", help="describe a checkpoint: kind, family, formats, sizes, and check every "
                                       "layer against its format (exit 1 when a problem is found)")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true",
                   help="also read every scale and 16-bit tensor and check its values (finite, scales > 0)")
    i.add_argument("--deep", action="store_true",
                   help="with --verify: also read every quantized weight and check for NaN codes (reads the "
                        "whole file)")

    d = sub.add_parser("demo", help="build a small Flux-layout model, quantize it to every format, verify")
    d.add_argument("--out", help="folder for the files (default: a temporary folder, removed after)")
    d.add_argument("--json", help="write the result table as JSON here")
    return p


def recipe_of(a):
    """The recipe the recipe flags (``add_recipe_arguments``) of parsed arguments ``a`` give."""
    from .recipe import recipe_from_values, recipe_options
    return recipe_from_values({f.name: getattr(a, f.name) for f, _ in recipe_options()})


def _device(name: str):
    """The compute device for ``--device`` (None: the CPU, no copies)."""
    import torch
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else None
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cpu":
        return None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch build or machine has no CUDA GPU (use --device cpu)")
    return dev


def _torchrun_shard(device):
    """Under ``torchrun`` (WORLD_SIZE > 1): join the job - NCCL with a CUDA --device, one GPU per
    local rank; gloo on CPUs - and return this rank's Shard; else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, device
    import torch
    import torch.distributed as dist
    from .distributed import Shard
    if device is not None and torch.device(device).type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return Shard.current(), device


def cmd_quantize(a) -> int:
    device = _device(a.device)
    shard, device = _torchrun_shard(device)
    try:
        return _quantize(a, device, shard)
    finally:
        if shard is not None:
            import torch.distributed as dist
            dist.destroy_process_group()


def _quantize(a, device, shard) -> int:
    from .pipeline import quantize
    from .publish import atomic_write_bytes, check_not_input, check_output_path
    lead = shard is None or shard.rank == 0  # under torchrun: rank 0 writes and speaks
    if lead:
        check_output_path(a.output, a.overwrite)  # a folder, a missing folder: said first
    if not a.output.endswith(".safetensors"):
        raise OutputError(f"{a.output}: the output is a safetensors file; give it the .safetensors extension "
                          f"(ComfyUI lists diffusion models by it)")
    recipe = recipe_of(a)
    if a.report and lead:  # the report is a user's file like the model: checked before any work
        check_not_input(a.report, a.src, "report")
        if os.path.abspath(a.report) == os.path.abspath(a.output):
            raise OutputError(f"{a.report}: the report and the model cannot be the same file")
        check_output_path(a.report, a.overwrite)
    stats = None
    if a.stats:
        from .statsfile import load_stats
        stats = load_stats(a.stats)
    where = f"{device or 'cpu'}" + (f", {shard.world} processes" if shard is not None else "")
    report = quantize(a.src, recipe, stats, out=a.output, overwrite=a.overwrite, hash_source=a.hash,
                      progress=False if a.quiet or not lead else Progress(f"quantizing on {where}"),
                      device=device, family=a.family, shard=shard).report
    if not lead:
        return 0
    if a.table:
        print(report.table())
    print(report.summary())
    print(f"wrote {a.output} in {report.seconds:.1f}s")
    if a.report:
        try:
            atomic_write_bytes(a.report, json.dumps(report.to_dict(), indent=1).encode(), a.overwrite)
        except OSError as e:
            print(f"error: the model {a.output} was written and is complete, but the report {a.report} "
                  f"was not ({e}); nothing half-written was left", file=sys.stderr)
            return 1
    return 0


def cmd_inspect(a) -> int:
    from .checkpoint import inspect_file
    res = inspect_file(a.file, verify_values=a.verify or a.deep, deep=a.deep)
    print(json.dumps(res.to_dict(), indent=1) if a.json else res.text())
    return 1 if res.problems else 0


def cmd_demo(a) -> int:
    from .demo import run_demo
    rows = run_demo(a.out, keep_files=a.out is not None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so partial outputs are removed the same way."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    raise Terminated(signum)


def _install_signal_handlers() -> dict:
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, _on_signal)
    return old


def main(argv=None) -> int:
    """Exit codes: 0 done; 1 the model was written but the report was not; 2 an error (nothing
    written); 130 / 128+N interrupted by Ctrl-C / signal N (nothing written)."""
    args = _parser().parse_args(argv)
    import torch

    command = {"quantize": cmd_quantize, "inspect": cmd_inspect, "demo": cmd_demo}[args.command]
    old = _install_signal_handlers()
    try:
        with torch.inference_mode():
            return command(args)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"\ninterrupted ({signal.Signals(signum).name}): nothing was written", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `inspect ... | head`: the reader left, as with any CLI tool
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (ModelOptError, ValueError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
