"""ComfyUI's own model classes at real (or small) configurations, with deterministic random
weights: the models of the benchmarks, the ComfyUI contract tests and the key-set fixtures.

Support code for those, not part of the package: the benchmark scripts import it from their own
folder, and tests/comfyui/conftest.py puts that folder on the import path.

Each family is described by the config ComfyUI's detection produces for it
(``detect_unet_config``); ``build`` turns it into the model ComfyUI would construct.  Outside a
ComfyUI process, ``setup_comfy`` puts the tree named by COMFYUI_PATH on the import path.
"""
from __future__ import annotations

import os
import sys

import torch

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")


def setup_comfy():
    """Import ComfyUI (CPU mode without a GPU); from a plain process COMFYUI_PATH names the tree."""
    if "comfy" in sys.modules:
        return
    if not COMFYUI_PATH:
        raise RuntimeError("COMFYUI_PATH is not set")
    if COMFYUI_PATH not in sys.path:
        sys.path.insert(0, COMFYUI_PATH)
    from comfy.cli_args import args
    if not torch.cuda.is_available():
        args.cpu = True
    import comfy.model_management  # noqa: F401  (initialises ComfyUI's device state)


_UNET = {'use_checkpoint': False, 'image_size': 32, 'out_channels': 4, 'use_spatial_transformer': True,
         'legacy': False, 'in_channels': 4, 'model_channels': 320, 'use_temporal_attention': False,
         'use_temporal_resblock': False}
SD15_FULL = dict(_UNET, adm_in_channels=None, num_res_blocks=[2, 2, 2, 2], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                 channel_mult=[1, 2, 4, 4], transformer_depth_middle=1, use_linear_in_transformer=False,
                 context_dim=768, num_heads=8, transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
SD15_SMALL = dict(SD15_FULL, num_res_blocks=[1, 1], transformer_depth=[1, 1], channel_mult=[1, 2],
                  transformer_depth_output=[1, 1, 1, 1])
SDXL_FULL = dict(_UNET, num_classes='sequential', adm_in_channels=2816, num_res_blocks=[2, 2, 2],
                 transformer_depth=[0, 0, 2, 2, 10, 10], channel_mult=[1, 2, 4], transformer_depth_middle=10,
                 use_linear_in_transformer=True, context_dim=2048, num_head_channels=64,
                 transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10])
# ComfyUI matches SDXL-family models by transformer_depth, so the smallest one it knows stands in
SDXL_SMALL = dict(SDXL_FULL, num_res_blocks=[1, 1, 1], transformer_depth=[0, 2, 5],
                  transformer_depth_output=[0, 0, 2, 2, 5, 5], transformer_depth_middle=-2)   # KOALA-700M

SD3_FULL = {"in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 38, "input_size": None,
            "adm_in_channels": 2048, "context_embedder_config": {"target": "torch.nn.Linear",
                                                                  "params": {"in_features": 4096, "out_features": 2432}},
            "num_patches": 36864, "pos_embed_max_size": 192, "qk_norm": "rms", "pos_embed_scaling_factor": None,
            "x_block_self_attn_layers": []}                                            # SD3.5 Large
SD3_SMALL = dict(SD3_FULL, depth=2, context_embedder_config={"target": "torch.nn.Linear",
                 "params": {"in_features": 4096, "out_features": 128}}, num_patches=4096, pos_embed_max_size=64)
# the smallest SD3 whose every quantized module holds over 16 KiB even in nvfp4 (width 64 x depth):
# under dynamic VRAM ComfyUI force-loads smaller modules by re-quantizing them (stochastic rounding,
# scales recalculated), so only a model this wide loads what the file holds, bit for bit
SD3_WIDE = dict(SD3_SMALL, depth=4, context_embedder_config={"target": "torch.nn.Linear",
                "params": {"in_features": 4096, "out_features": 256}})

FLUX_FULL = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
             "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
             "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "guidance_embed": True, "patch_size": 2,
             "txt_ids_dims": [], "yak_mlp": False, "txt_norm": False}                  # Flux.1-dev
FLUX_SMALL = dict(FLUX_FULL, hidden_size=256, num_heads=2, depth=1, depth_single_blocks=1, context_in_dim=256,
                  vec_in_dim=256)

WAN_FULL = {"image_model": "wan2.1", "dim": 1536, "out_dim": 16, "num_heads": 12, "ffn_dim": 8960, "num_layers": 30,
            "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
            "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "model_type": "t2v"}    # Wan 2.1 1.3B
WAN_SMALL = dict(WAN_FULL, dim=256, num_heads=2, ffn_dim=512, num_layers=2)
WAN_14B = dict(WAN_FULL, dim=5120, num_heads=40, ffn_dim=13824, num_layers=40)                # Wan 2.1 14B

QWEN_FULL = {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60}
QWEN_SMALL = dict(QWEN_FULL, num_layers=1)  # width is fixed by ComfyUI's class (3072)

HUNYUAN_FULL = {"image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2], "out_channels": 16,
                "vec_in_dim": 768, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 4096,
                "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 20, "depth_single_blocks": 40,
                "theta": 256, "qkv_bias": True, "byt5": False, "guidance_embed": True,
                "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}
HUNYUAN_SMALL = dict(HUNYUAN_FULL, hidden_size=256, num_heads=2, depth=1, depth_single_blocks=1)
LTXV_FULL = {"image_model": "ltxv", "num_layers": 28, "attention_head_dim": 64, "cross_attention_dim": 2048}  # LTX-Video 2B: T5 4096 -> 2048
LUMINA2_FULL = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 2304, "cap_feat_dim": 2304,
                "n_layers": 26, "qk_norm": True, "n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32],
                "axes_lens": [300, 512, 512], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0}

# Flux.2 [dev] and Chroma as ComfyUI's model detection describes them (comfy/model_detection.py)
FLUX2_FULL = {"image_model": "flux2", "axes_dim": [32, 32, 32, 32], "num_heads": 48, "mlp_ratio": 3.0, "theta": 2000,
              "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False,
              "ops_bias": False, "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3],
              "patch_size": 1, "in_channels": 128, "hidden_size": 6144, "context_in_dim": 15360, "vec_in_dim": None,
              "depth": 8, "depth_single_blocks": 48, "guidance_embed": True}
CHROMA_FULL = {"image_model": "chroma", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
               "qkv_bias": True, "txt_ids_dims": [], "patch_size": 2, "hidden_size": 3072, "context_in_dim": 4096,
               "vec_in_dim": None, "depth": 19, "depth_single_blocks": 38, "in_channels": 64, "out_channels": 64,
               "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120, "n_layers": 5}

CONFIGS = {
    "sd15": {"full": SD15_FULL, "small": SD15_SMALL},
    "sdxl": {"full": SDXL_FULL, "small": SDXL_SMALL},
    "sd3": {"full": SD3_FULL, "small": SD3_SMALL, "wide": SD3_WIDE},
    "flux": {"full": FLUX_FULL, "small": FLUX_SMALL},
    "wan": {"full": WAN_FULL, "small": WAN_SMALL, "14b": WAN_14B},
    "qwen_image": {"full": QWEN_FULL, "small": QWEN_SMALL},
    "hunyuan_video": {"full": HUNYUAN_FULL, "small": HUNYUAN_SMALL},
    "ltxv": {"full": LTXV_FULL},
    "lumina2": {"full": LUMINA2_FULL},
    "flux2": {"full": FLUX2_FULL},
    "chroma": {"full": CHROMA_FULL},
}


# Architectures ComfyUI loads that comfy-modelopt has no family for: recognised as diffusion
# models by their structure (families.diffusion_structure) and quantized with the generic rules.
KANDINSKY5_FULL = {"image_model": "kandinsky5", "model_dim": 1792, "axes_dims": (16, 24, 24), "time_dim": 512,
                   "ff_dim": 7168, "visual_embed_dim": 132, "num_text_blocks": 2, "num_visual_blocks": 32}
KANDINSKY5_SMALL = dict(KANDINSKY5_FULL, model_dim=256, ff_dim=1024, time_dim=128, num_text_blocks=1,
                        num_visual_blocks=2)
COSMOS_PREDICT2_FULL = {"image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128,
                        "in_channels": 16, "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1,
                        "model_channels": 2048, "num_blocks": 28, "num_heads": 16, "concat_padding_mask": True,
                        "crossattn_emb_channels": 1024, "pos_emb_cls": "rope3d", "pos_emb_learnable": True,
                        "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30, "use_adaln_lora": True,
                        "adaln_lora_dim": 256}
# ComfyUI's detection sets the block and head counts only for its real widths (2048, 5120): a
# narrower model keeps the class defaults, 10 blocks of 16 heads
COSMOS_PREDICT2_SMALL = dict(COSMOS_PREDICT2_FULL, model_channels=256, num_blocks=10)
UNKNOWN_CONFIGS = {
    "kandinsky5": {"full": KANDINSKY5_FULL, "small": KANDINSKY5_SMALL},
    "cosmos_predict2": {"full": COSMOS_PREDICT2_FULL, "small": COSMOS_PREDICT2_SMALL},
}


# Other layouts of a family above (its family name stays the family's): an inpainting model takes
# the latent, the masked image's latent and the mask concatenated (9 channels)
VARIANT_CONFIGS = {"sd15_inpaint": {"full": dict(SD15_FULL, in_channels=9), "small": dict(SD15_SMALL, in_channels=9)}}


def model_config(family: str, size: str = "small"):
    setup_comfy()
    import comfy.model_detection as md
    cfg = dict({**CONFIGS, **UNKNOWN_CONFIGS, **VARIANT_CONFIGS}[family][size])
    mc = md.model_config_from_unet_config(cfg)
    if mc is None:
        raise RuntimeError(f"ComfyUI matched no model for the {family}/{size} config")
    return mc


def build(family: str, size: str = "small", device: str = "cpu", seed: int = 0,
          dtype=torch.bfloat16, weights_device: str = "cpu"):
    """(ComfyUI BaseModel, diffusion-model state dict with deterministic weights on
    ``weights_device``)."""
    from comfy_modelopt.synthetic import tensor_for
    mc = model_config(family, size)
    mc.set_inference_dtype(dtype, None)
    if device == "meta":
        with torch.device("meta"):
            model = mc.get_model({}, "", device="meta")
        sd = model.diffusion_model.state_dict()
        return model, {k: v for k, v in sd.items()}
    with torch.device("meta"):
        model = mc.get_model({}, "", device="meta")
    sd = {}
    for k, v in model.diffusion_model.state_dict().items():
        if v.is_floating_point():
            sd[k] = tensor_for(k, tuple(v.shape), seed, dtype, device=weights_device)
        else:
            sd[k] = torch.zeros(v.shape, dtype=v.dtype, device=weights_device)
    return model, sd


def sd_vae_state_dict(seed: int = 0, dtype=torch.bfloat16, decoder_ch: int = 32) -> dict:
    """The SD1.x/SDXL VAE (ComfyUI's AutoencoderKL: full-size encoder, a decoder of ``decoder_ch``
    base channels - ComfyUI reads the width from ``decoder.conv_in``; 128 is the real one) with
    deterministic random weights, keyed as in a checkpoint's first_stage_model."""
    setup_comfy()
    from comfy.ldm.models.autoencoder import AutoencoderKL
    from comfy_modelopt.synthetic import tensor_for
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    with torch.device("meta"):
        vae = AutoencoderKL(ddconfig=ddconfig, embed_dim=4, decoder_ddconfig=dict(ddconfig, ch=decoder_ch))
    return {k: tensor_for(k, tuple(v.shape), seed, dtype) for k, v in vae.state_dict().items()}


def sd15_checkpoint(seed: int = 0, dtype=torch.float16) -> dict:
    """An SD1.x all-in-one checkpoint as users download it (the small UNet config, the real CLIP-L,
    the VAE above): what CheckpointLoaderSimple loads."""
    _, unet = build("sd15", "small", seed=seed, dtype=dtype)
    out = {"model.diffusion_model." + k: v for k, v in unet.items()}
    out.update({"cond_stage_model.transformer." + k: v.to(dtype) for k, v in clip_l_state_dict(seed).items()})
    out.update({"first_stage_model." + k: v for k, v in sd_vae_state_dict(seed, dtype).items()})
    return out


def clip_l_state_dict(seed: int = 0, dtype=torch.bfloat16) -> dict:
    """A CLIP-L text encoder (ComfyUI's own class) with deterministic random weights, keyed like
    the text_encoders/clip_l.safetensors files users download."""
    setup_comfy()
    import comfy.sd1_clip
    from comfy_modelopt.synthetic import tensor_for
    with torch.device("meta"):
        model = comfy.sd1_clip.SDClipModel(device="meta", dtype=dtype)
    sd = {}
    for k, v in model.state_dict().items():
        if not k.startswith("transformer."):
            continue
        key = k[len("transformer."):]
        if v.is_floating_point():
            t = tensor_for(key, tuple(v.shape), seed, dtype)
            if key.endswith("position_embedding.weight") or key.endswith("token_embedding.weight"):
                t = t * 0.02 * (v.shape[-1] ** 0.5)
            sd[key] = t
        else:
            sd[key] = torch.zeros(v.shape, dtype=v.dtype)
    return sd
