"""Calibrate a ComfyUI model on several GPUs: ComfyUI's own loaders and sampler in every rank of
a ``torchrun`` job, each rank sampling its share of the prompts, the statistics merged exactly
(``distributed.calibrate_sharded``) and written by rank 0 - the file Calibrate Model saves, for
Load Calibration -> Quantize Model, or the CLI's ``--stats``.  ComfyUI itself stays one process;
this runs beside it on the same model files.  Design: docs/design.md, ``comfyui/launch.py``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m comfy_modelopt.comfyui.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"),
                   help="the ComfyUI tree (default: $COMFYUI_PATH)")
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--unet", help="diffusion model: a path, or a name in ComfyUI's diffusion_models folder")
    m.add_argument("--checkpoint", help="a full checkpoint (model + text encoder): path or name in checkpoints")
    p.add_argument("--clip", action="append", default=[],
                   help="text encoder file (path or name in text_encoders); repeat for several (with --unet)")
    p.add_argument("--clip-type", default="stable_diffusion",
                   help="ComfyUI's CLIPType for --clip, e.g. stable_diffusion, sd3, flux, wan, qwen_image")
    p.add_argument("--weight-dtype", default="default", choices=["default", "bf16", "fp16", "fp32"],
                   help="dtype of the diffusion model's weights while sampling")
    p.add_argument("--prompts", help="text file, one prompt per line (default: the built-in varied set)")
    p.add_argument("--negative", default=None, help="negative prompt (default: the built-in one)")
    from ..prompts import SAMPLING_OPTIONS
    for o in SAMPLING_OPTIONS:  # Calibrate Model's inputs, as flags
        p.add_argument(f"--{o.flag}", dest=o.name, type=type(o.default), default=o.default, help=o.help)
    p.add_argument("--frames", type=int, default=0,
                   help="video models (Wan 2.1, HunyuanVideo): frames of the empty video latent")
    p.add_argument("-o", "--output", required=True,
                   help="statistics file; a bare name goes to ComfyUI's models/modelopt_calibration")
    p.add_argument("--overwrite", action="store_true", help="replace the output file(s) if they exist")
    q = p.add_argument_group("quantize (optional): the model from these statistics")
    q.add_argument("--model-out", help="also write the quantized diffusion model here; a bare name goes to "
                                       "ComfyUI's models/diffusion_models (Load Diffusion Model lists it)")
    q.add_argument("--engine", default="own", choices=["own", "modelopt"],
                   help="modelopt: NVIDIA ModelOpt's calibration too (pip install 'comfy-modelopt[modelopt]'; "
                        "one process), its choices written into --model-out")
    from ..cli import add_recipe_arguments
    from ..modelopt_engine import ALGORITHMS
    q.add_argument("--modelopt-algorithm", default=ALGORITHMS[0], choices=ALGORITHMS,
                   help="with --engine modelopt: ModelOpt's calibration algorithm (Calibrate Model's "
                        "modelopt_algorithm)")
    add_recipe_arguments(q)
    return p


def _setup_comfy(path: str | None) -> None:
    """ComfyUI importable, on this rank's GPU (or the CPU where there is none)."""
    import torch
    if not path or not os.path.isdir(os.path.join(path, "comfy")):
        raise SystemExit(f"error: no ComfyUI tree at {path!r}: pass --comfyui or set COMFYUI_PATH")
    if torch.cuda.is_available():  # before ComfyUI picks its device (the current one)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if path not in sys.path:
        sys.path.insert(0, path)
    from comfy.cli_args import args
    if not torch.cuda.is_available():
        args.cpu = True
    import comfy.model_management  # noqa: F401  (initialises ComfyUI's device state)


def _find(folder: str, name: str) -> str:
    import folder_paths
    if os.path.isfile(name):
        return name
    found = folder_paths.get_full_path(folder, name)
    if found is None:
        raise SystemExit(f"error: {name!r} is neither a file nor a name in ComfyUI's {folder} folder")
    return found


def _output_path(name: str, folder: str) -> str:
    """``name``, or for a bare name that file in ComfyUI's ``folder`` (models/<folder>)."""
    path = name if os.path.dirname(name) else os.path.join(_folder(folder), name)
    return path if path.endswith(".safetensors") else path + ".safetensors"


def _folder(name: str) -> str:
    import folder_paths
    if name in folder_paths.folder_names_and_paths:
        return folder_paths.get_folder_paths(name)[0]
    return os.path.join(folder_paths.models_dir, name)


def _load(a):
    import torch

    import comfy.sd
    import folder_paths
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    options = {"dtype": dtypes[a.weight_dtype]} if a.weight_dtype in dtypes else {}
    embeddings = folder_paths.get_folder_paths("embeddings")
    if a.checkpoint:
        model, clip, _vae, _ = comfy.sd.load_checkpoint_guess_config(
            _find("checkpoints", a.checkpoint), output_vae=False, output_clip=True, embedding_directory=embeddings,
            model_options=options)
        if clip is None:
            raise SystemExit(f"error: {a.checkpoint} holds no text encoder: use --unet with --clip")
        return model, clip
    if not a.clip:
        raise SystemExit("error: --unet needs its text encoder(s): --clip FILE (repeat for several)")
    try:
        clip_type = comfy.sd.CLIPType[a.clip_type.upper()]
    except KeyError:
        raise SystemExit(f"error: unknown --clip-type {a.clip_type!r}; one of "
                         f"{', '.join(t.name.lower() for t in comfy.sd.CLIPType)}") from None
    model = comfy.sd.load_diffusion_model(_find("diffusion_models", a.unet), model_options=options)
    clip = comfy.sd.load_clip([_find("text_encoders", c) for c in a.clip], embedding_directory=embeddings,
                              clip_type=clip_type)
    return model, clip


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    # rank 0 tells (ComfyUI's device lines, progress); the others only warn
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(message)s", force=True)
    _setup_comfy(a.comfyui)
    import torch
    import torch.distributed as dist

    from ..calibrate import CalibrationOptions
    from ..statsfile import save_stats
    from ..distributed import Shard, calibrate_sharded, shard_prompts
    from ..prompts import DEFAULT_NEGATIVE, Sampling
    from .sampling import empty_latent, encode, sample_prompt, sampling_info, without_cuda_graphs

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    shard = Shard.current()
    rank, world = (shard.rank, shard.world) if shard else (0, 1)
    from .folders import CALIBRATION_FOLDER  # the folder Load Calibration lists
    out = _output_path(a.output, CALIBRATION_FOLDER)
    model_out = _output_path(a.model_out, "diffusion_models") if a.model_out else None
    for path in filter(None, (out, model_out)):  # every rank checks: none samples for nothing
        if os.path.exists(path) and not a.overwrite:
            raise SystemExit(f"error: {path} exists (pass --overwrite to replace it)")
    if a.engine == "modelopt" and not model_out:
        raise SystemExit("error: --engine modelopt writes ModelOpt's choices into the quantized model: give "
                         "--model-out (a statistics file cannot hold them)")
    recipe = _request(a, world) if model_out else None
    prompts = _prompts(a)
    negative = DEFAULT_NEGATIVE if a.negative is None else a.negative
    how = Sampling.of(vars(a))

    model, clip = _load(a)
    if a.engine == "modelopt":
        _check_modelopt(a, recipe, model)
    model = without_cuda_graphs(model)
    latent = empty_latent(model, a.width, a.height, a.frames)
    mine = shard_prompts(list(range(len(prompts))), rank, world)
    with torch.inference_mode():
        # encoded before any statistics: the text encoder and the diffusion model may take turns in VRAM
        negative_cond = encode(clip, negative, None)
        conds = {i: encode(clip, prompts[i], how.guidance) for i in mine}
        if shard is not None:  # every rank loaded: the times below are sampling and merging alone
            dist.barrier()
        t0, done, sampled = time.perf_counter(), [0], [0.0]

        def run(_module, i):
            sample_prompt(model, conds[i], negative_cond, latent, i, how)
            done[0] += 1
            sampled[0] = spent = time.perf_counter() - t0
            if rank == 0:
                logging.info(f"[comfy-modelopt] rank 0/{world}: prompt {done[0]}/{len(mine)} sampled "
                             f"({spent:.1f} s, ~{spent / done[0] * (len(mine) - done[0]):.0f} s left)")
        info = sampling_info(model, len(prompts), how, latent)
        info["ranks"] = world
        options = CalibrationOptions(reservoir_bytes=int(a.samples_mib_per_layer * 2**20), seed=a.seed, check_calls=0)
        stats = calibrate_sharded(model.model.diffusion_model, list(range(len(prompts))), run, options, info=info,
                                  shard=shard)
        merged = time.perf_counter() - t0
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        save_stats(stats, out, overwrite=a.overwrite)
        s = stats.summary()
        logging.info(f"[comfy-modelopt] calibrated {s['layers_with_data']}/{s['layers']} Linear layers over "
                     f"{s['forward_calls']} model calls ({len(prompts)} prompts x {a.steps} steps, {world} "
                     f"rank(s): sampling {sampled[0]:.1f} s, then {merged - sampled[0]:.1f} s waiting for the "
                     f"other ranks and merging): {out}")
    if model_out:
        engine = None
        if a.engine == "modelopt":
            from .sampling import modelopt_by_sampling
            with torch.inference_mode():
                engine = modelopt_by_sampling(model, clip, prompts, negative, how, latent, recipe.format,
                                              a.modelopt_algorithm)
            logging.info(f"[comfy-modelopt] {engine.note()}: {len(engine.layers)} Linear layers")
        _quantize(model, recipe, stats, engine, model_out, a.overwrite, shard, rank,
                  os.path.basename(a.unet or a.checkpoint))
    if shard is not None:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _prompts(a) -> list[str]:
    """The calibration prompts: the first --num-prompts lines of --prompts, or of the built-in set."""
    if a.prompts:
        try:
            with open(a.prompts, encoding="utf-8") as f:
                lines = [p.strip() for p in f if p.strip()]
        except OSError as e:
            raise SystemExit(f"error: cannot read the prompts file {a.prompts} ({e.strerror})") from None
    else:
        from ..prompts import DEFAULT_PROMPTS
        lines = list(DEFAULT_PROMPTS)
    prompts = lines[:a.num_prompts]
    if not prompts:
        raise SystemExit("error: no calibration prompts")
    return prompts


def _request(a, world: int):
    """The recipe --model-out asks for (refused before any sampling when it cannot be done)."""
    from ..cli import recipe_of
    try:
        recipe = recipe_of(a)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if a.engine == "modelopt" and world > 1:
        raise SystemExit("error: --engine modelopt calibrates in one process (ModelOpt's calibrators do not "
                         "merge across ranks here): run it without torchrun")
    return recipe


def _check_modelopt(a, recipe, model) -> None:
    from ..errors import ModelOptError
    from ..modelopt_engine import check_request
    try:
        check_request(recipe.format, a.modelopt_algorithm, model.load_device)
    except ModelOptError as e:
        raise SystemExit(f"error: {e}") from None


def _quantize(model, recipe, stats, engine, path: str, overwrite: bool, shard, rank: int, source: str) -> None:
    """Quantize Model + Save Quantized Model: the loaded model's weights, layer by layer, into
    ``path`` (atomically; rank 0 writes, every rank encodes its share of the layers)."""
    from ..progress import Progress
    from ..pipeline import quantize
    from .model import PatcherSource, compute_device
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    report = quantize(PatcherSource(model, compute_device()), recipe, stats, out=path, overwrite=overwrite,
                      refuse_unknown=False, engine=engine, shard=shard, source_info={"name": source},
                      progress=Progress("quantizing") if rank == 0 else False).report
    if rank == 0:
        logging.info(report.summary())
        logging.info(f"[comfy-modelopt] wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
