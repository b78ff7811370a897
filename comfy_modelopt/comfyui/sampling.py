"""Calibration through ComfyUI's own sampler: every prompt sampled over the whole denoising
trajectory with the model's own sampling settings, while the core collects statistics."""
from __future__ import annotations

import logging

import torch

import comfy.model_management
import comfy.sample
import comfy.samplers
import comfy.utils
import node_helpers
from comfy.patcher_extension import WrappersMP

from ..calibrate import CalibrationOptions, calibrate
from ..modelopt_engine import modelopt_calibrate
from ..progress import Progress
from ..prompts import Sampling
from ..recipe import Recipe
from ..stats import ActivationStats
from .model import log


def encode(clip, text: str, guidance: float | None):
    cond = clip.encode_from_tokens_scheduled(clip.tokenize(text))
    if guidance is not None:  # guidance-distilled models (Flux) read it; others ignore the key
        cond = node_helpers.conditioning_set_values(cond, {"guidance": guidance})
    return cond


def empty_latent(model, width: int, height: int, frames: int = 0) -> torch.Tensor:
    """The empty latent sampling starts from; ``frames`` > 0: a video model's (Wan 2.1,
    HunyuanVideo: 16 channels, (frames - 1) / 4 + 1 latent frames)."""
    device = comfy.model_management.intermediate_device()
    if frames > 0:
        latent = torch.zeros([1, 16, (frames - 1) // 4 + 1, height // 8, width // 8], device=device)
    else:
        latent = torch.zeros([1, 4, height // 8, width // 8], device=device)
    return comfy.sample.fix_empty_latent_channels(model, latent)


def without_cuda_graphs(model):
    """``model``, or a clone without this pack's CUDA-graph runtime: the statistics hooks run in
    Python, and a graph replay would skip them (only the captured call of each input shape
    would be counted)."""
    from .runtime import KEY, graph_runner
    # by marker, not class: the pack may be imported under more than one module name
    if not getattr(graph_runner(model), "replays_skip_hooks", False):
        return model
    logging.info("[comfy-modelopt] calibration samples this MODEL without its CUDA graphs "
                 "(a replay would skip the statistics hooks)")
    clone = model.clone()
    for kind in (WrappersMP.APPLY_MODEL, WrappersMP.CALC_COND_BATCH):
        clone.remove_wrappers_with_key(kind, KEY)
    return clone


def _sampling_loop(model, clip, prompts: list[str], negative: str, how: Sampling, latent: torch.Tensor,
                   node_id: str | None, prompt: list | None = None):
    """A forward loop sampling each prompt (``how``) through ComfyUI's sampler, with a progress
    bar; ``prompt[0]``, when given, holds the index of the prompt being sampled."""
    if not prompts:
        raise ValueError("no calibration prompts: give at least one prompt (one per line)")
    if clip is None:
        raise ValueError("the CLIP input is empty: connect the text encoder that belongs to this model")
    negative_cond = encode(clip, negative, None)
    conds = [encode(clip, p, how.guidance) for p in prompts]
    total = len(prompts) * how.steps
    pbar = comfy.utils.ProgressBar(total, node_id=node_id)
    console = Progress("calibrating", write=log, unit="sampling steps")

    def forward_loop(_module):
        done = 0
        for i, cond in enumerate(conds):
            if prompt is not None:
                prompt[0] = i
            comfy.model_management.throw_exception_if_processing_interrupted()
            sample_prompt(model, cond, negative_cond, latent, i, how,
                          callback=lambda step, x0, x, n, d=done, i=i: (
                              comfy.model_management.throw_exception_if_processing_interrupted(),  # Cancel: now
                              pbar.update_absolute(d + step + 1, total),
                              console(d + step + 1, total, f"prompt {i + 1}/{len(conds)}")))
            done += how.steps
            pbar.update_absolute(done, total)
    return forward_loop


def sample_prompt(model, cond, negative_cond, latent: torch.Tensor, index: int, how: Sampling, callback=None):
    """Calibration prompt ``index``: its noise from ``how.seed + index``, sampled by ComfyUI's sampler
    (as KSampler)."""
    seed = how.seed + index
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, how.steps, how.cfg, how.sampler_name, how.scheduler, cond,
                               negative_cond, latent, seed=seed, disable_pbar=True, callback=callback)


def sampling_info(model, prompts: int, how: Sampling, latent: torch.Tensor) -> dict:
    """What the statistics were sampled with (stored with them; the quantized file's report shows it)."""
    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), how.scheduler, how.steps)
    return {"prompts": prompts, "steps": how.steps, "cfg": how.cfg, "sampler": how.sampler_name,
            "scheduler": how.scheduler, "latent_shape": list(latent.shape), "seed": how.seed,
            "sigmas": [round(float(s), 5) for s in sigmas], "model": type(model.model).__name__,
            "guidance": how.guidance}


def calibrate_by_sampling(model, clip, prompts: list[str], negative: str, how: Sampling, latent: torch.Tensor,
                          options: CalibrationOptions, node_id: str | None = None) -> ActivationStats:
    """Sample each prompt with statistics hooks on the diffusion model's Linears."""
    model = without_cuda_graphs(model)
    prompt = [0]
    forward_loop = _sampling_loop(model, clip, prompts, negative, how, latent, node_id, prompt)
    info = sampling_info(model, len(prompts), how, latent)
    # a prompt is one calibration group: searches are checked on prompts they were not fitted on
    return calibrate(model.model.diffusion_model, forward_loop, options, info=info, group=lambda: prompt[0])


def modelopt_by_sampling(model, clip, prompts: list[str], negative: str, how: Sampling, latent: torch.Tensor,
                         fmt: str, algorithm: str, node_id: str | None = None):
    """NVIDIA ModelOpt's calibration (``modelopt_engine.modelopt_calibrate``) of the diffusion
    model, its forward loop the same sampling runs as ours: ModelOpt quantizes a copy of the
    diffusion model, and while its loop runs the copy stands in for the original inside the
    model ComfyUI samples (put back afterwards, also on error or interruption)."""
    model = without_cuda_graphs(model)
    # loaded (and LoRA-patched) in place first: ModelOpt copies the weights as they are, and
    # sampling then finds the model loaded and does not patch the copy again
    comfy.model_management.load_models_gpu([model], force_full_load=True)
    base = model.model
    original = base.diffusion_model
    loop = _sampling_loop(model, clip, prompts, negative, how, latent, node_id)

    def forward_loop(work):
        base.diffusion_model = work
        try:
            loop(work)
        finally:
            base.diffusion_model = original
    return modelopt_calibrate(original, forward_loop, Recipe(format=fmt), algorithm)
