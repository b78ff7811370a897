"""What users put between a model and a sampler, built from ComfyUI's own classes: ControlNets in
each layout ComfyUI loads (random weights, loaded through ComfyUI's own loader), the stock
model-patch nodes, conditioning that changes the batch, a second pass at another size, a
diffusion-model wrapper.  Support code for benchmarks/compat.py and tests/comfyui/test_attach.py,
not part of the package (it imports ComfyUI).

A case takes a ``Setup`` (model, conditioning, latent, sampling options) and returns the Setup a
user's workflow would hand the sampler; ``run`` samples it (every pass).  Each case applies to the
families in its ``families``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

import comfy.controlnet
import comfy.model_management
import comfy.model_patcher
import comfy.sample
import comfy.samplers
import comfy.utils
from comfy.ldm.modules.attention import optimized_attention
from comfy.patcher_extension import WrappersMP

UNET, DIT, MMDIT, QWEN = ("sd15", "sdxl"), ("flux",), ("sd3",), ("qwen_image",)


@dataclasses.dataclass
class Setup:
    family: str
    model: object               # ComfyUI's ModelPatcher
    positive: list
    negative: list
    latent: torch.Tensor
    cfg: float
    steps: int = 4
    seed: int = 7
    denoise: float = 1.0
    second_pass: tuple | None = None  # (scale, denoise): a hires-fix pass at scale x the size
    noise_mask: torch.Tensor | None = None  # Set Latent Noise Mask: only where it is 1 is sampled
    guider: object = None             # SamplerCustomAdvanced: Setup -> a guider (CFGGuider, DualCFG, PerpNeg)
    pixels: int = 8                   # latent -> image size factor (ControlNet hints)
    refiner: tuple | None = None      # (model, step): a second model finishes from that step (KSamplerAdvanced x2)

    def replace(self, **kw) -> "Setup":
        return dataclasses.replace(self, **kw)


def run(s: Setup) -> torch.Tensor:
    """Sample ``s`` as KSampler does (euler / simple); a second pass samples the first's result
    upscaled; a refiner finishes the base model's leftover noise (two KSamplerAdvanced: the first
    returns it at the switch step, the second adds none).  Returns the final latent."""
    if s.refiner is not None:
        refiner, step = s.refiner
        noise = comfy.sample.prepare_noise(s.latent, s.seed)
        args = (s.steps, s.cfg, "euler", "simple", s.positive, s.negative)
        mid = comfy.sample.sample(s.model, noise, *args, s.latent, start_step=0, last_step=step,
                                  force_full_denoise=False, seed=s.seed, disable_pbar=True)
        return comfy.sample.sample(refiner, torch.zeros_like(mid), *args, mid, disable_noise=True, start_step=step,
                                   last_step=s.steps, force_full_denoise=True, seed=s.seed, disable_pbar=True)
    out = _sample(s, s.latent, s.denoise)
    if s.second_pass is not None:
        scale, denoise = s.second_pass
        h, w = out.shape[-2:]
        up = comfy.utils.common_upscale(out, int(w * scale) // 8 * 8, int(h * scale) // 8 * 8, "nearest-exact",
                                        "disabled")
        out = _sample(s, up, denoise)
    return out


def _sample(s: Setup, latent, denoise):
    latent = comfy.sample.fix_empty_latent_channels(s.model, latent)
    noise = comfy.sample.prepare_noise(latent, s.seed)
    mask = s.noise_mask if s.noise_mask is not None and s.noise_mask.shape[-2:] == latent.shape[-2:] else None
    if s.guider is not None:  # SamplerCustomAdvanced: a guider, KSampler's sigmas for its denoise
        total = s.steps if denoise >= 1.0 else int(s.steps / denoise)
        sigmas = comfy.samplers.calculate_sigmas(s.model.get_model_object("model_sampling"), "simple", total)
        sigmas = sigmas[-(s.steps + 1):].cpu()
        out = s.guider(s).sample(noise, latent, comfy.samplers.sampler_object("euler"), sigmas, denoise_mask=mask,
                                 disable_pbar=True, seed=s.seed)
        return out.to(comfy.model_management.intermediate_device())
    return comfy.sample.sample(s.model, noise, s.steps, s.cfg, "euler", "simple", s.positive, s.negative, latent,
                               denoise=denoise, noise_mask=mask, seed=s.seed, disable_pbar=True)


def random_weights(module: torch.nn.Module, seed: int, scale: float = 1.0) -> dict:
    """A state dict for ``module`` (built on the meta device) with deterministic random values:
    weights ~ N(0, 1/fan_in) * scale, biases 0, norms 1."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in module.state_dict().items():
        if not v.is_floating_point():
            sd[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif k.endswith("bias"):
            sd[k] = torch.zeros(v.shape)
        elif v.ndim >= 2:
            sd[k] = torch.randn(v.shape, generator=g) * (scale / math.sqrt(v[0].numel()))
        else:
            sd[k] = torch.ones(v.shape)
    return sd


# --------------------------------------------------------------------------- control
def _cldm_weights(model, seed: int) -> dict:
    """Random weights of a ControlNet in the SD1.x/SDXL (cldm) layout of ``model``'s UNet."""
    import comfy.cldm.cldm
    config = dict(model.model.model_config.unet_config)
    config.pop("out_channels", None)
    with torch.device("meta"):
        net = comfy.cldm.cldm.ControlNet(hint_channels=3, operations=comfy.ops.disable_weight_init, **config)
    return random_weights(net, seed, scale=0.5)


def cldm_controlnet(model, seed: int = 11):
    """A cldm ControlNet for ``model``'s UNet, loaded through ComfyUI's own ``load_controlnet_state_dict``."""
    return comfy.controlnet.load_controlnet_state_dict(_cldm_weights(model, seed))


def flux_xlabs_controlnet(model, seed: int = 12):
    """An XLabs-layout Flux ControlNet for ``model``'s width, through ComfyUI's loader."""
    import comfy.ldm.flux.controlnet
    config = dict(model.model.model_config.unet_config, depth=2, depth_single_blocks=0)  # XLabs: 2 double blocks
    with torch.device("meta"):
        net = comfy.ldm.flux.controlnet.ControlNetFlux(operations=comfy.ops.disable_weight_init, **config)
    # the file's names: its RMSNorms' "scale" (ComfyUI's loader renames them)
    sd = {k[: -len("weight")] + "scale" if k.endswith("_norm.weight") else k: v
          for k, v in random_weights(net, seed, scale=0.5).items()}
    return comfy.controlnet.load_controlnet_state_dict(sd)


def sd3_controlnet(model, seed: int = 17):
    """An SD3/SD3.5 ControlNet (the diffusers layout: ``transformer_blocks``, ``pos_embed_input``,
    each ComfyUI name's slice by ComfyUI's own ``comfy.utils.mmdit_to_diffusers``) with as many
    blocks as ``model`` has, through ComfyUI's loader."""
    import comfy.cldm.mmdit
    config = dict(model.model.model_config.unet_config)
    config.pop("dtype", None)
    blocks = config["depth"]
    with torch.device("meta"):
        net = comfy.cldm.mmdit.ControlNet(num_blocks=blocks, control_latent_channels=config["in_channels"],
                                          operations=comfy.ops.disable_weight_init, **config)
    return comfy.controlnet.load_controlnet_state_dict(
        _diffusers_layout(random_weights(net, seed, scale=0.5), comfy.utils.mmdit_to_diffusers(dict(config, num_blocks=blocks))))


def _diffusers_layout(ours: dict, names: dict) -> dict:
    """``ours`` (ComfyUI's names) under the diffusers names of ``names`` (diffusers -> ComfyUI name,
    or (name, (dim, start, length), ...) for a slice of a fused tensor), the rest as it is."""
    sd, used = {}, set()
    for diffusers, to in names.items():
        name, where = (to, None) if isinstance(to, str) else to[:2]
        if name in ours:
            sd[diffusers] = ours[name] if where is None else ours[name].narrow(*where).clone()
            used.add(name)
    sd.update({k: v for k, v in ours.items() if k not in used})
    return sd


def t2i_adapter(model, seed: int = 13):
    """A T2I-Adapter (full-size SD1.5/SDXL layouts only: its widths are fixed)."""
    import comfy.t2i_adapter.adapter
    xl = model.model.model_config.unet_config.get("adm_in_channels") == 2816
    with torch.device("meta"):
        net = comfy.t2i_adapter.adapter.Adapter(cin=256 if xl else 192, channels=[320, 640, 1280, 1280], nums_rb=2,
                                                ksize=1, sk=True, use_conv=False, xl=xl)
    return comfy.controlnet.load_controlnet_state_dict(random_weights(net, seed, scale=0.5))


def control_lora(model, seed: int = 15, rank: int = 4):
    """A Control-LoRA (Stability's SDXL layout, made for SD1.x the same way): the cldm ControlNet's
    own layers (hint block, zero convolutions) in full, and a rank-``rank`` delta (``.up`` /
    ``.down``) for every weight the control copy takes from ``model``'s UNet - ComfyUI's
    ``ControlLora`` builds the copy from the model's own weights, quantized ones included."""
    unet = set(model.model.diffusion_model.state_dict())
    g = torch.Generator().manual_seed(seed)
    sd = {"lora_controlnet": torch.tensor([])}
    for k, v in _cldm_weights(model, seed).items():
        if k in unet and v.ndim >= 2:
            sd[k[:-len("weight")] + "up"] = torch.randn(v.shape[0], rank, generator=g) * 0.05
            sd[k[:-len("weight")] + "down"] = torch.randn(rank, v[0].numel(), generator=g) / math.sqrt(v[0].numel())
        else:
            sd[k] = v
    return comfy.controlnet.load_controlnet_state_dict(sd)


def flux_instantx_controlnet(model, seed: int = 16, union_modes: int = 10):
    """An InstantX / Union Flux ControlNet for ``model``'s width: the diffusers file layout ComfyUI
    reads (``controlnet_x_embedder``, the blocks under diffusers names - each ComfyUI name's slice
    by ComfyUI's own map, ``comfy.utils.flux_to_diffusers`` - and one ``controlnet_mode_embedder``
    row per union mode), through ComfyUI's loader."""
    import comfy.ldm.flux.controlnet
    config = dict(model.model.model_config.unet_config, depth=2, depth_single_blocks=1)
    with torch.device("meta"):
        net = comfy.ldm.flux.controlnet.ControlNetFlux(
            latent_input=True, num_union_modes=union_modes, control_latent_channels=config["in_channels"],
            operations=comfy.ops.disable_weight_init, **config)
    return comfy.controlnet.load_controlnet_state_dict(
        _diffusers_layout(random_weights(net, seed, scale=0.5), comfy.utils.flux_to_diffusers(config)))


def qwen_instantx_controlnet(model, seed: int = 18):
    """An InstantX Qwen-Image ControlNet as deep as ``model`` (``controlnet_x_embedder``, the blocks,
    ``controlnet_blocks``: its file's names are ComfyUI's), through ComfyUI's loader."""
    import comfy.ldm.qwen_image.controlnet
    config = {k: v for k, v in model.model.model_config.unet_config.items() if k not in ("dtype", "image_model")}
    with torch.device("meta"):
        net = comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel(operations=comfy.ops.disable_weight_init,
                                                                        **config)
    return comfy.controlnet.load_controlnet_state_dict(random_weights(net, seed, scale=0.5))


@functools.lru_cache(maxsize=1)  # 1.8B parameters, whatever the model (ControlNetApply copies it)
def qwen_fun_controlnet(seed: int = 19):
    """A Qwen-Image Fun ControlNet (its five control blocks, which call the model's own input
    layers as it runs), through ComfyUI's loader."""
    import comfy.ldm.qwen_image.controlnet
    with torch.device("meta"):
        net = comfy.ldm.qwen_image.controlnet.QwenImageFunControlNetModel(operations=comfy.ops.disable_weight_init)
    return comfy.controlnet.load_controlnet_state_dict(random_weights(net, seed, scale=0.5))


class LatentOfImage:
    """What Apply ControlNet's VAE input gives a ControlNet that takes latents (InstantX): the hint
    image as a latent of the model's channels, 8x smaller (a fixed random projection) - the
    ControlNet's path through the model, not a VAE's quality; ``video``: with a frame axis, as the
    Wan VAE of Qwen-Image encodes."""

    def __init__(self, channels: int, video: bool = False):
        self.channels, self.video = channels, video

    def spacial_compression_encode(self) -> int:
        return 8

    def encode(self, pixels):
        x = torch.nn.functional.avg_pool2d(pixels.movedim(-1, 1).float(), 8)
        x = torch.einsum("bchw,cd->bdhw", x, torch.randn(3, self.channels, generator=torch.Generator().manual_seed(3)))
        return x.unsqueeze(2) if self.video else x


def qwen_controlnet(kind: str):
    def case(s: Setup) -> Setup:
        net = qwen_instantx_controlnet(s.model) if kind == "instantx" else qwen_fun_controlnet()
        return with_control(s, net, vae=LatentOfImage(s.latent.shape[1], video=True))
    return case


def with_control(s: Setup, net, strength=0.8, start=0.0, end=1.0, vae=None) -> Setup:
    """Apply ControlNet (Advanced) with a random hint image (``vae``: what encodes it for a
    ControlNet that takes latents)."""
    import nodes
    h, w = s.latent.shape[-2:]
    g = torch.Generator().manual_seed(21)
    hint = torch.rand(1, h * s.pixels, w * s.pixels, 3, generator=g)
    pos, neg = nodes.ControlNetApplyAdvanced().apply_controlnet(s.positive, s.negative, net, hint, strength, start, end,
                                                                vae=vae)
    return s.replace(positive=pos, negative=neg)


def controlnet(s: Setup) -> Setup:
    if s.family in MMDIT:  # it takes latents: the hint through Apply ControlNet's VAE input
        return with_control(s, sd3_controlnet(s.model), vae=LatentOfImage(s.latent.shape[1]))
    net = flux_xlabs_controlnet(s.model) if s.family in DIT else cldm_controlnet(s.model)
    return with_control(s, net)


def control_lora_case(s: Setup) -> Setup:
    return with_control(s, control_lora(s.model))


def instantx_union(s: Setup) -> Setup:
    net = flux_instantx_controlnet(s.model)
    net.set_extra_arg("control_type", [1])  # a union mode, as Set Union ControlNet Type sets it
    return with_control(s, net, vae=LatentOfImage(s.latent.shape[1]))


def controlnet_stacked(s: Setup) -> Setup:
    """Two ControlNets, the second over part of the schedule (start/end percent)."""
    first = controlnet(s)
    net = flux_xlabs_controlnet(s.model, 14) if s.family in DIT else cldm_controlnet(s.model, 14)
    return with_control(first, net, strength=0.5, start=0.2, end=0.7)


def t2i(s: Setup) -> Setup:
    return with_control(s, t2i_adapter(s.model))


# --------------------------------------------------------------------------- model patches
def _node(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(module), name)


def _out(result):
    return result.args[0] if hasattr(result, "args") else result[0]


def freeu(s: Setup) -> Setup:
    return s.replace(model=_out(_node("comfy_extras.nodes_freelunch", "FreeU_V2").execute(s.model, 1.3, 1.4, 0.9, 0.2)))


def pag(s: Setup) -> Setup:
    return s.replace(model=_out(_node("comfy_extras.nodes_pag", "PerturbedAttentionGuidance").execute(s.model, 3.0)))


def sag(s: Setup) -> Setup:
    return s.replace(model=_out(_node("comfy_extras.nodes_sag", "SelfAttentionGuidance").execute(s.model, 0.5, 2.0)))


def tome(s: Setup) -> Setup:
    return s.replace(model=_out(_node("comfy_extras.nodes_tomesd", "TomePatchModel").execute(s.model, 0.3)))


def hypertile(s: Setup) -> Setup:
    tile = 256 if s.latent.shape[-1] * 8 >= 512 else 64
    return s.replace(model=_out(_node("comfy_extras.nodes_hypertile", "HyperTile").execute(s.model, tile, 2, 0, False)))


def deep_shrink(s: Setup) -> Setup:
    """Kohya deep shrink on the node's default block (3), or the deepest input block before it."""
    block = min(3, len(s.model.model.diffusion_model.input_blocks) - 1)
    return s.replace(model=_out(_node("comfy_extras.nodes_model_downscale", "PatchModelAddDownscale").execute(
        s.model, block, 2.0, 0.0, 0.35, True, "bicubic", "bicubic")))


def rescale_cfg(s: Setup) -> Setup:
    return s.replace(model=_out(_node("comfy_extras.nodes_model_advanced", "RescaleCFG")().patch(s.model, 0.7)))


def ip_adapter_attn2(s: Setup, sigma_range: bool = False) -> Setup:
    """An IP-Adapter-style cross-attention replace on every UNet transformer block: the block's
    attention plus attention over image tokens projected by the block's own to_k_ip / to_v_ip
    (random, as the IP-Adapter layout has them), computed per call.  ``sigma_range``: active
    only between two sigmas, read on the host per call as IP-Adapter Plus does
    (``sigmas.cpu().item()``)."""
    m = s.model.clone()
    dm = m.model.diffusion_model
    g = torch.Generator().manual_seed(31)
    device, dtype = comfy.model_management.get_torch_device(), m.model.get_dtype_inference()
    blocks = [(name, i, j, tb) for name, group in (("input", dm.input_blocks), ("middle", [dm.middle_block]),
                                                   ("output", dm.output_blocks))
              for i, block in enumerate(group) for layer in block
              for j, tb in enumerate(getattr(layer, "transformer_blocks", []))]
    width = blocks[0][3].attn2.to_k.weight.shape[1]  # the context's width
    tokens = torch.randn(1, 4, width, generator=g).to(device, dtype)
    projections = {}
    for name, i, j, tb in blocks:
        inner = tb.attn2.to_k.weight.shape[0]
        w = (torch.randn(width, inner, generator=g) / math.sqrt(width)).to(device, dtype)
        projections[(name, i, j)] = (w, w * 0.5)

    def attn2(q, k, v, extra):
        heads = extra["n_heads"]
        out = optimized_attention(q, k, v, heads)
        if sigma_range:
            sigma = extra["sigmas"].detach().cpu()[0].item()
            if not 0.2 <= sigma <= 100.0:
                return out
        wk, wv = projections[(*extra["block"], extra["block_index"])]
        b = q.shape[0]
        return out + 0.6 * optimized_attention(q, (tokens @ wk).expand(b, -1, -1), (tokens @ wv).expand(b, -1, -1),
                                               heads)
    for name, i, j, _tb in blocks:
        m.set_model_attn2_replace(attn2, name, i, j)
    return s.replace(model=m)


def ip_adapter_gated(s: Setup) -> Setup:
    return ip_adapter_attn2(s, sigma_range=True)


def first_block_cache(s: Setup) -> Setup:
    """A TeaCache / first-block-cache style diffusion-model wrapper: reuses the previous output's
    residual when the input moved little since the last full evaluation (a host-side decision
    per call)."""
    m = s.model.clone()
    state = {}

    def wrapper(executor, x, *args, **kwargs):
        prev = state.get("x")
        if prev is not None and prev.shape == x.shape:
            change = ((x - prev).abs().mean() / prev.abs().mean().clamp_min(1e-6)).item()
            if change < 0.05:
                return x + state["residual"]
        out = executor(x, *args, **kwargs)
        state["x"], state["residual"] = x, out - x
        return out
    m.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "first_block_cache", wrapper)
    return s.replace(model=m)


def skip_layer_guidance(s: Setup) -> Setup:
    return s.replace(model=_out(_node("comfy_extras.nodes_slg", "SkipLayerGuidanceDiT").execute(
        s.model, 3.0, 0.01, 0.9, "0", "0")))


def dit_replace(s: Setup) -> Setup:
    """A PuLID-style DiT block replace: the original block, then an identity-feature term added
    to the image tokens (random, fixed), on every other double block."""
    m = s.model.clone()
    dm = m.model.diffusion_model
    g = torch.Generator().manual_seed(41)
    width = dm.hidden_size
    feature = (torch.randn(1, 1, width, generator=g) * 0.05).to(comfy.model_management.get_torch_device(),
                                                                m.model.get_dtype_inference())

    def replace(args, extra):
        out = extra["original_block"](args)
        out["img"] = out["img"] + feature
        return out
    for i in range(0, len(dm.double_blocks), 2):
        m.set_model_patch_replace(replace, "dit", "double_block", i)
    return s.replace(model=m)


def model_sampling_flux(s: Setup) -> Setup:
    """A larger shift than Flux.1-dev's own (its defaults, 1.15 at 1024x1024, are the model's: no effect)."""
    h, w = s.latent.shape[-2:]
    return s.replace(model=_out(_node("comfy_extras.nodes_model_advanced", "ModelSamplingFlux")().patch(
        s.model, 2.0, 0.5, w * 8, h * 8)))


def torch_compile(s: Setup) -> Setup:
    return s.replace(model=_out(_node("comfy_extras.nodes_torch_compile", "TorchCompileModel").execute(
        s.model, "inductor")))


def merge(s: Setup, other) -> Setup:
    """ModelMergeSimple with another (16-bit) model of the same layout: weight patches."""
    return s.replace(model=_node("comfy_extras.nodes_model_merging", "ModelMergeSimple")().merge(s.model, other, 0.7)[0])


# --------------------------------------------------------------------------- conditioning
def area(s: Setup) -> Setup:
    """Regional prompts: a second prompt over the right half (ConditioningSetArea + Combine)."""
    import nodes
    h, w = s.latent.shape[-2:]
    g = torch.Generator().manual_seed(51)
    other = [[torch.randn(s.positive[0][0].shape, generator=g).to(s.positive[0][0].dtype), dict(s.positive[0][1])]]
    region = nodes.ConditioningSetArea().append(other, w * 4, h * 8, w * 4, 0, 1.0)[0]
    return s.replace(positive=nodes.ConditioningCombine().combine(s.positive, region)[0])


def mask(s: Setup) -> Setup:
    import nodes
    h, w = s.latent.shape[-2:]
    m = torch.zeros(1, h * 8, w * 8)
    m[:, : h * 4] = 1.0
    g = torch.Generator().manual_seed(52)
    other = [[torch.randn(s.positive[0][0].shape, generator=g).to(s.positive[0][0].dtype), dict(s.positive[0][1])]]
    masked = nodes.ConditioningSetMask().append(other, m, "default", 1.0)[0]
    return s.replace(positive=nodes.ConditioningCombine().combine(s.positive, masked)[0])


def reference_latent(s: Setup) -> Setup:
    """Kontext-style reference latents (the ReferenceLatent node) on positive and negative."""
    node = _node("comfy_extras.nodes_edit_model", "ReferenceLatent")
    g = torch.Generator().manual_seed(53)
    ref = {"samples": torch.randn(s.latent.shape[:1] + (16,) + s.latent.shape[2:], generator=g)}
    return s.replace(positive=_out(node.execute(s.positive, ref)), negative=_out(node.execute(s.negative, ref)))


def reference_latents_multi(s: Setup) -> Setup:
    """Two reference latents, as Kontext's multi-image edits chain ReferenceLatent, placed by index
    (Edit Model Reference Method "index": each reference its own position index; the stock
    "index_timestep_zero" fails inside Flux.1's blocks on the 16-bit model too)."""
    node = _node("comfy_extras.nodes_edit_model", "ReferenceLatent")
    method = _node("comfy_extras.nodes_flux", "FluxKontextMultiReferenceLatentMethod")
    g = torch.Generator().manual_seed(57)
    refs = [{"samples": torch.randn(s.latent.shape[:1] + (16,) + s.latent.shape[2:], generator=g)} for _ in range(2)]

    def referenced(cond):
        for ref in refs:
            cond = _out(node.execute(cond, ref))
        return _out(method.execute(cond, "index"))
    return s.replace(positive=referenced(s.positive), negative=referenced(s.negative))


def img2img(s: Setup) -> Setup:
    g = torch.Generator().manual_seed(54)
    return s.replace(latent=torch.randn(s.latent.shape, generator=g) * 0.5, denoise=0.6)


def inpaint_mask(s: Setup) -> Setup:
    """Set Latent Noise Mask over an image's latent: the left half sampled again, the rest kept
    (ComfyUI's inpainting on a regular model: the sampler's denoise mask)."""
    g = torch.Generator().manual_seed(55)
    h, w = s.latent.shape[-2:]
    mask = torch.zeros(1, 1, h, w)
    mask[..., : w // 2] = 1.0
    return s.replace(latent=torch.randn(s.latent.shape, generator=g) * 0.5, noise_mask=mask)


def inpaint_model(s: Setup) -> Setup:
    """InpaintModelConditioning on an inpainting model (9 input channels): the image's latent with
    the masked part blanked and the mask go into every call as concat conditioning (``c_concat``),
    and only the masked part is sampled again."""
    import node_helpers
    g = torch.Generator().manual_seed(56)
    h, w = s.latent.shape[-2:]
    mask = torch.zeros(1, 1, h, w)
    mask[..., : w // 2] = 1.0
    image = torch.randn(s.latent.shape, generator=g) * 0.5
    values = {"concat_latent_image": image * (1 - mask), "concat_mask": mask}
    return s.replace(positive=node_helpers.conditioning_set_values(s.positive, values),
                     negative=node_helpers.conditioning_set_values(s.negative, values), latent=image, noise_mask=mask)


def _guided(kind: str):
    def case(s: Setup) -> Setup:
        from comfy_extras import nodes_custom_sampler, nodes_perpneg

        def guider(s: Setup):
            if kind == "cfg":
                g = comfy.samplers.CFGGuider(s.model)
                g.set_conds(s.positive, s.negative)
                g.set_cfg(s.cfg)
            elif kind == "dual":  # a second prompt between the first and the negative
                g = nodes_custom_sampler.Guider_DualCFG(s.model)
                middle = [[c * 0.6, dict(extra)] for c, extra in s.positive]
                g.set_conds(s.positive, middle, s.negative)
                g.set_cfg(s.cfg, 2.0)
            else:  # Perp-Neg: the negative projected against an empty prompt
                g = nodes_perpneg.Guider_PerpNeg(s.model)
                empty = [[c * 0, dict(extra)] for c, extra in s.negative]
                g.set_conds(s.positive, s.negative, empty)
                g.set_cfg(s.cfg, 1.0)
            return g
        return s.replace(guider=guider)
    return case


def lora_hook_keyframes(s: Setup) -> Setup:
    """Create Hook LoRA + Set Hook Keyframes on the positive prompt: a rank-4 LoRA on every
    attention projection, at full strength over the first half of the steps and none after
    (ComfyUI patches the weights per keyframe while sampling)."""
    import comfy.hooks
    g, lora = torch.Generator().manual_seed(57), {}
    for name, m in s.model.model.diffusion_model.named_modules():
        if name.endswith(("to_q", "to_k", "to_v", "to_out.0", "img_attn.qkv", "txt_attn.qkv", "linear1")):
            n, k = m.weight.shape
            lora[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(4, k, generator=g) / math.sqrt(k)
            lora[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(n, 4, generator=g) * 0.1
    hooks = comfy.hooks.create_hook_lora(lora, 1.0, 0.0)
    keyframes = comfy.hooks.HookKeyframeGroup()
    keyframes.add(comfy.hooks.HookKeyframe(strength=1.0, start_percent=0.0))
    keyframes.add(comfy.hooks.HookKeyframe(strength=0.0, start_percent=0.5))
    hooks.set_keyframes_on_hooks(keyframes)
    return s.replace(positive=comfy.hooks.set_hooks_for_conditioning(s.positive, hooks))


def hires_fix(s: Setup) -> Setup:
    return s.replace(second_pass=(1.5, 0.5))


def batch2(s: Setup) -> Setup:
    return s.replace(latent=torch.cat([s.latent, s.latent]))


def new_size(s: Setup) -> Setup:
    """Another image size than the calibration's (768x1344 at full size: 0.75 x 1.31 of a square)."""
    h, w = s.latent.shape[-2:]
    return s.replace(latent=torch.zeros(*s.latent.shape[:-2], int(h * 1.3125) // 2 * 2, int(w * 0.75) // 2 * 2))


# name -> (case, the families it applies to, needs a full-size model)
CASES = {
    "controlnet": (controlnet, UNET + DIT + MMDIT, False),
    "controlnet x2 start/end": (controlnet_stacked, UNET + DIT, False),
    "control-lora": (control_lora_case, UNET, False),
    "controlnet instantx union": (instantx_union, DIT, False),
    "controlnet qwen instantx": (qwen_controlnet("instantx"), QWEN, False),
    "controlnet qwen fun": (qwen_controlnet("fun"), QWEN, False),
    "t2i-adapter": (t2i, UNET, True),
    "freeu_v2": (freeu, UNET, False),
    "pag": (pag, UNET, False),
    "sag": (sag, UNET, False),
    "tome": (tome, UNET, False),
    "hypertile": (hypertile, UNET, False),
    "deep shrink": (deep_shrink, UNET, False),
    "ip-adapter attn2": (ip_adapter_attn2, UNET, False),
    "ip-adapter attn2 sigma range": (ip_adapter_gated, UNET, False),
    "rescale_cfg": (rescale_cfg, UNET + DIT + MMDIT, False),
    "first-block cache wrapper": (first_block_cache, UNET + DIT, False),
    "skip layer guidance": (skip_layer_guidance, DIT + MMDIT, False),
    "dit replace (pulid-style)": (dit_replace, DIT, False),
    "modelsamplingflux": (model_sampling_flux, DIT, False),
    "reference latents": (reference_latent, DIT, False),
    "reference latents x2 (index)": (reference_latents_multi, DIT, False),
    "area prompts": (area, UNET + DIT + MMDIT + QWEN, False),
    "mask prompts": (mask, UNET + DIT + MMDIT, False),
    "img2img 0.6": (img2img, UNET + DIT + MMDIT + QWEN, False),
    "inpaint (latent noise mask)": (inpaint_mask, UNET + DIT + MMDIT, False),
    "inpainting model (concat)": (inpaint_model, ("sd15_inpaint",), False),
    "cfg guider (SamplerCustomAdvanced)": (_guided("cfg"), UNET + DIT + MMDIT, False),
    "dual cfg guider": (_guided("dual"), UNET + DIT + MMDIT, False),
    "perp-neg guider": (_guided("perpneg"), UNET + MMDIT, False),
    "lora hook with keyframes": (lora_hook_keyframes, UNET + DIT + MMDIT, False),
    "hires fix 1.5x": (hires_fix, UNET + DIT + MMDIT, False),
    "batch 2": (batch2, UNET + DIT + MMDIT + QWEN, False),
    "new size": (new_size, UNET + DIT + MMDIT + QWEN, False),
}
# by name only (compat.py --cases): the 16-bit model's whole-model compile takes minutes
EXTRA = {"torchcompilemodel": torch_compile}


def cases_for(family: str, full_size: bool = True) -> list:
    return [name for name, (_f, families, full) in CASES.items() if family in families and (full_size or not full)]


def apply(name: str, s: Setup) -> Setup:
    return EXTRA[name](s) if name in EXTRA else CASES[name][0](s)
