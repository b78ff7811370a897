"""quantize_module's layers compute what real ComfyUI computes for the same stored layer.

For every ComfyUI format (and the variants a recipe can make of it: static or dynamic input
scale, weight-only, ConvRot): quantize a small module with calibration, export it, load each
exported layer into ComfyUI's own mixed-precision Linear (the ops ComfyUI picks for this device)
and run both on the same input.  They run the same kitchen calls, so the outputs are equal.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI contract tests SKIPPED (point it at a ComfyUI "
                "v0.29+ tree to run them; see README, 'Tests')", allow_module_level=True)

models.setup_comfy()
import comfy.model_management  # noqa: E402
import comfy.ops  # noqa: E402
from comfy.quant_ops import QUANT_ALGOS  # noqa: E402

from comfy_modelopt import Recipe  # noqa: E402
from comfy_modelopt.calibrate import calibrate  # noqa: E402
from comfy_modelopt.formats import FORMATS  # noqa: E402
from comfy_modelopt.model_checks import compute_weight_only  # noqa: E402
from comfy_modelopt.modules import export_state_dict, quantize_module, quantized_layers  # noqa: E402

DEVICE = comfy.model_management.get_torch_device()
VARIANTS = {
    "float8_e4m3fn": Recipe(format="float8_e4m3fn"),
    "float8_e4m3fn-weight-only": Recipe(format="float8_e4m3fn"),   # no statistics
    "float8_e5m2": Recipe(format="float8_e5m2"),
    "int8_tensorwise": Recipe(format="int8_tensorwise"),
    "int8_tensorwise-convrot": Recipe(format="int8_tensorwise", convrot=True, convrot_groupsize=64),
    "mxfp8": Recipe(format="mxfp8"),
    "nvfp4": Recipe(format="nvfp4"),
    "nvfp4-static-input": Recipe(format="nvfp4", static_nvfp4_input=True),
    "convrot_w4a4": Recipe(format="convrot_w4a4", convrot_groupsize=64),
    "convrot_w4a4-int8-activations": Recipe(format="convrot_w4a4", convrot_groupsize=64, linear_dtype="int8"),
    # group 1024 divides none of these widths: each layer takes the largest group that does
    "convrot_w4a4-fitted-group": Recipe(format="convrot_w4a4", convrot_groupsize=1024),
    # quantize_module's per-sample layers (model_checks.compute_weight_only): every layer here
    "float8_e4m3fn-full-precision": Recipe(format="float8_e4m3fn"),
    "mxfp8-full-precision": Recipe(format="mxfp8"),
    "nvfp4-full-precision": Recipe(format="nvfp4"),
}


def comfy_ops(dtype: torch.dtype):
    """The mixed-precision ops ComfyUI picks for a quantized model on this device."""
    class Config:
        quant_config = {"mixed_ops": True}
    return comfy.ops.pick_operations(dtype, dtype, load_device=DEVICE, model_config=Config())


@pytest.fixture(scope="module")
def model_and_stats():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                                torch.nn.SiLU(), torch.nn.Linear(256, 128, bias=False))
    with torch.no_grad():
        model[0].weight[:, 3] *= 8  # an outlier input channel
    model = model.to(DEVICE, torch.bfloat16)
    batches = [torch.randn(2, 24, 256, device=DEVICE, dtype=torch.bfloat16) * (1 + i % 3) for i in range(6)]
    with torch.no_grad():
        stats = calibrate(model, lambda m: [m(x) for x in batches])
    return model, stats


def test_formats_agree_with_comfyui_on_quantize_input():
    for name, fmt in FORMATS.items():
        assert fmt.quantize_input == QUANT_ALGOS[name].get("quantize_input", True), name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_quantized_module_computes_what_comfyui_computes(model_and_stats, variant):
    model, stats = model_and_stats
    recipe = VARIANTS[variant]
    q = quantize_module(model, recipe, None if variant.endswith("weight-only") else stats)
    layers = quantized_layers(q)
    assert set(layers) == {"0", "2", "4"}, layers
    if variant.endswith("full-precision"):
        for layer in layers.values():
            compute_weight_only(layer)
    sd, _meta = export_state_dict(q)
    ops = comfy_ops(torch.bfloat16)
    x = torch.randn(3, 5, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        for name in ("0", "2", "4"):
            ours = layers[name]
            theirs = ops.Linear(ours.in_features, ours.out_features, bias=ours.bias is not None,
                                device=DEVICE, dtype=torch.bfloat16)
            prefix = name + "."
            # as ComfyUI's loader hands them over: CPU tensors, moved to the device by the layer
            theirs.load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)},
                                   strict=False)
            assert theirs.quant_format == recipe.format
            assert (getattr(theirs, "input_scale", None) is not None) == (ours.input_scale is not None)
            xi = x if name == "0" else torch.randn(3, 5, ours.in_features, device=DEVICE, dtype=torch.bfloat16)
            a, b = ours(xi), theirs(xi)
            assert a.shape == b.shape and a.dtype == b.dtype
            assert torch.equal(a, b), (variant, name, float((a.float() - b.float()).abs().max()))
    # and the module as a whole stays close to the 16-bit one
    with torch.no_grad():
        ref, out = model(x).float(), q(x).float()
    bound = 0.4 if FORMATS[recipe.format].values_per_element == 2 else 0.12  # 4-bit weights: looser
    assert float((out - ref).norm() / ref.norm()) < bound


def test_mixed_precision_plan_runs_in_comfyui_layer_by_layer(model_and_stats):
    """A planner file holds several formats; ComfyUI reads each layer's own .comfy_quant."""
    model, stats = model_and_stats
    q = quantize_module(model, Recipe(format="nvfp4", budget=0.45), stats)
    sd, _meta = export_state_dict(q)
    layers = quantized_layers(q)
    formats = {name: layer.conf["format"] for name, layer in layers.items()}
    assert len(set(formats.values()) | ({"16-bit"} if len(layers) < 3 else set())) > 1, formats
    ops = comfy_ops(torch.bfloat16)
    with torch.no_grad():
        for name, ours in layers.items():
            theirs = ops.Linear(ours.in_features, ours.out_features, bias=ours.bias is not None,
                                device=DEVICE, dtype=torch.bfloat16)
            theirs.load_state_dict({k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")},
                                   strict=False)
            assert theirs.quant_format == formats[name]
            xi = torch.randn(3, 5, ours.in_features, device=DEVICE, dtype=torch.bfloat16)
            assert torch.equal(ours(xi), theirs(xi)), name
