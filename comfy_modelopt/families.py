"""Model families: how to recognise them from state-dict keys, and which layers stay 16-bit.
Design: docs/design.md, ``families.py``.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Callable, Mapping

Shapes = Mapping[str, tuple]

# Prefixes under which a full checkpoint stores its diffusion model (ComfyUI's
# model_detection.unet_prefix_from_state_dict candidates).
DIFFUSION_PREFIXES = ("model.diffusion_model.", "model.model.", "net.")


@dataclass(frozen=True)
class Family:
    name: str
    comfy_model: str                     # what ComfyUI calls it (image_model / class)
    detect: Callable[[Shapes], bool]
    keep: tuple[str, ...]                # layers kept 16-bit (globs)
    not_linear: tuple[str, ...] = ()     # 2-D weights that are not Linear (embeddings)
    notes: str = ""
    prefix: str | None = None            # the state dict's key prefix (None: detected)
    optional: tuple[str, ...] = ()       # layers some blocks have by design and others not (globs)

    def keep_reason(self, layer: str) -> str | None:
        for pat in self.keep:
            if fnmatch.fnmatchcase(layer, pat):
                return f"{self.name} rule {pat}"
        return None

    def is_linear(self, layer: str) -> bool:
        return not any(fnmatch.fnmatchcase(layer, p) for p in self.not_linear)


def literal_glob(name: str) -> str:
    """A glob matching exactly ``name`` (its glob characters bracketed)."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _has(*keys):
    return lambda s: all(k in s for k in keys)


def _unet(adm: bool):
    def detect(s):
        if "input_blocks.0.0.weight" not in s:
            return False
        return ("label_emb.0.0.weight" in s) == adm
    return detect


def _flux(variant: str):
    def detect(s):
        is_flux = ("double_blocks.0.img_attn.norm.key_norm.scale" in s
                   or "double_blocks.0.img_attn.norm.key_norm.weight" in s)
        if not is_flux:
            return False
        chroma = any(k.startswith("distilled_guidance_layer.") for k in s)
        flux2 = "double_stream_modulation_img.lin.weight" in s
        return {"flux": not chroma and not flux2, "flux2": flux2, "chroma": chroma}[variant]
    return detect


_UNET_KEEP = ("time_embed.*", "label_emb.*", "*.attn2.to_k")
_UNET_OPTIONAL = ("*.skip_connection",)  # a ResBlock has one where its channel count changes
_FLUX_KEEP = ("img_in", "txt_in", "vector_in.*", "time_in.*", "guidance_in.*", "final_layer.*")

FAMILIES: tuple[Family, ...] = (
    Family("sd3", "SD3 / SD3.5 (MMDiT)", _has("joint_blocks.0.context_block.attn.qkv.weight"),
           ("x_embedder.*", "context_embedder", "y_embedder.*", "t_embedder.*", "final_layer.*")),
    Family("hunyuan_video", "HunyuanVideo",
           _has("txt_in.individual_token_refiner.blocks.0.norm1.weight"),
           ("img_in.*", "txt_in.input_embedder", "txt_in.t_embedder.*", "txt_in.c_embedder.*",
            "time_in.*", "time_r_in.*", "vector_in.*", "guidance_in.*", "byt5_in.*",
            "vision_in.*", "final_layer.*"),
           not_linear=("cond_type_embedding",)),
    Family("flux2", "Flux.2", _flux("flux2"), _FLUX_KEEP),
    Family("chroma", "Chroma", _flux("chroma"), _FLUX_KEEP + ("distilled_guidance_layer.*",)),
    Family("flux", "Flux.1", _flux("flux"), _FLUX_KEEP),
    Family("ltxv", "LTX-Video", _has("adaln_single.emb.timestep_embedder.linear_1.bias"),
           ("patchify_proj", "adaln_single.*", "caption_projection.*", "proj_out",
            "*.attn2.to_k", "audio_*")),
    Family("lumina2", "Lumina 2 / Z-Image",
           _has("cap_embedder.1.weight", "noise_refiner.0.attention.k_norm.weight"),
           ("x_embedder", "t_embedder.*", "cap_embedder.*", "final_layer.*")),
    Family("wan", "Wan 2.x", _has("head.modulation", "patch_embedding.weight"),
           ("patch_embedding", "text_embedding.*", "time_embedding.*", "time_projection.*",
            "img_emb.*", "head.*")),
    Family("qwen_image", "Qwen-Image", _has("txt_norm.weight", "img_in.weight"),
           ("img_in", "txt_in", "time_text_embed.*", "norm_out.*", "proj_out")),
    Family("sdxl", "SDXL (UNet)", _unet(adm=True), _UNET_KEEP, optional=_UNET_OPTIONAL),
    Family("sd15", "SD1.x / SD2.x (UNet)", _unet(adm=False), _UNET_KEEP, optional=_UNET_OPTIONAL),
)

GENERIC = Family(
    "unknown", "unknown", lambda s: True,
    ("*embed*", "*_in", "*_in.*", "*time*", "*final*", "*head*", "*proj_out", "*norm_out*",
     "*adaln_single*", "*patchify*"),
    notes="generic rules: embedders, input/output projections and final layers stay 16-bit")


# What a file that is no diffusion model usually is, by its keys (checked in this order).
_NOT_A_DIFFUSION_MODEL = (
    ("a LoRA / LyCORIS adapter", ("lora_down", "lora_up", "lora_A.", "lora_B.", ".lora.", "hada_w1", "lokr_w1",
                                  "lora_te", "lora_unet")),
    ("a ControlNet", ("controlnet_", "input_hint_block", "zero_convs", "controlnet_blocks")),
    ("a T5 text encoder", ("encoder.block.0.layer.0.SelfAttention", "shared.weight")),
    ("a CLIP text encoder", ("text_model.encoder.layers", "transformer.text_model", "text_projection")),
    ("a CLIP vision encoder", ("vision_model.encoder.layers",)),
    ("a language-model text encoder", ("model.layers.0.self_attn", "embed_tokens.weight", "model.embed_tokens")),
    ("a VAE", ("encoder.down.0.block", "decoder.up.0.block", "encoder.down_blocks.0", "decoder.up_blocks.0",
               "post_quant_conv", "decoder.conv_out", "encoder.conv_in")),
)


_BLOCK_LEVEL = re.compile(r"^(.*?)(\d+)\.(.+)$")


def _tokens(name: str) -> list[str]:
    return re.split(r"[._]", name.lower())


def _is_attention(name: str) -> bool:
    return any("attn" in t or "attention" in t for t in _tokens(name))


def _is_mlp(name: str) -> bool:
    return any(t in ("mlp", "ff", "ffn", "feed", "forward", "mlps") or t.startswith("mlp") for t in _tokens(name))


def _is_timestep(key: str) -> bool:
    t = _tokens(key)
    return any(x.startswith("time") or x == "temb" for x in t) or \
        any(a == "t" and b.startswith("embed") for a, b in zip(t, t[1:]))  # t_embedder, t_embedding


def diffusion_structure(keys) -> str | None:
    """Why keys of no known family look like a diffusion model, or None: a run of numbered blocks
    (two or more) each holding attention and MLP layers, beside a timestep embedding - what every
    diffusion transformer and UNet ComfyUI loads has, and text encoders (no timestep), VAEs (no MLP
    blocks) and LoRAs (refused by ``looks_like`` first) do not."""
    runs: dict = {}
    for key in keys:
        m = _BLOCK_LEVEL.match(key)
        if m:
            flags = runs.setdefault(m.group(1), {}).setdefault(int(m.group(2)), [False, False])
            flags[0] |= _is_attention(m.group(3))
            flags[1] |= _is_mlp(m.group(3))
    time = next((k for k in keys if _is_timestep(k)), None)
    found = [(sum(a and b for a, b in blocks.values()), run) for run, blocks in runs.items()]
    n, run = max(found, default=(0, ""))
    if time is None or n < 2:
        return None
    return (f"{n} numbered blocks ({run}#) with attention and MLP layers, and a timestep embedding "
            f"({time.rsplit('.', 1)[0]})")


def looks_like(keys) -> str | None:
    """What a file whose family is unknown looks like (LoRA, text encoder, VAE, ...), or None."""
    for what, marks in _NOT_A_DIFFUSION_MODEL:
        hit = next((k for k in keys if any(m in k for m in marks)), None)
        if hit is not None:
            return f"{what} (e.g. key {hit})"
    return None


def family_named(name: str) -> Family:
    """A family by name ("generic": the generic rules), for an explicit override."""
    if name in ("generic", GENERIC.name):
        return GENERIC
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise ValueError(f"unknown family {name!r}; choose one of: generic, {', '.join(f.name for f in FAMILIES)}")


FAMILY_CHOICES = ("auto", "generic") + tuple(f.name for f in FAMILIES)


def detect_family(shapes: Shapes) -> Family:
    """The first family (most specific first) whose signature matches, else GENERIC."""
    for fam in FAMILIES:
        if fam.detect(shapes):
            return fam
    return GENERIC


def diffusion_prefix(keys) -> str:
    """The diffusion-model prefix of a full checkpoint, or '' for a bare diffusion model."""
    counts = {p: 0 for p in DIFFUSION_PREFIXES}
    for k in keys:
        for p in DIFFUSION_PREFIXES:
            if k.startswith(p):
                counts[p] += 1
                break
    best = max(counts, key=counts.get)
    return best if counts[best] > 5 else ""

