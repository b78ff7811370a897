"""Every family's forward is capturable as far as host copies go: at full size, on the meta
device (no compute), ComfyUI's own model code moves nothing from the CPU to the model's device
inside the forward once ``ConstantsOnDevice`` is on - the mode a CUDA-graph capture falls back
to after "Cannot copy between CPU and CUDA tensors during CUDA graph capture".  Without it Wan
2.1 copies its timestep embedding's ``torch.arange`` (so the check can fail)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI capture tests SKIPPED (point it at a ComfyUI "
                "v0.29+ tree to run them; see README 'Testing against ComfyUI')", allow_module_level=True)

models.setup_comfy()
import comfy.ldm.modules.attention as attention  # noqa: E402

from comfy_modelopt.device_constants import ConstantsOnDevice, HostCopies  # noqa: E402

# full-size inputs per family: latent and conditioning shapes ComfyUI hands apply_model
INPUTS = {
    "sd15": dict(x=(1, 4, 32, 32), c_crossattn=(1, 77, 768)),
    "sdxl": dict(x=(1, 4, 32, 32), c_crossattn=(1, 77, 2048), y=(1, 2816)),
    "sd3": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 4096), y=(1, 2048)),
    "flux": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 4096), y=(1, 768), guidance=(1,)),
    "wan": dict(x=(1, 16, 2, 32, 32), c_crossattn=(1, 77, 4096)),
    "qwen_image": dict(x=(1, 16, 1, 32, 32), c_crossattn=(1, 77, 3584)),
    "hunyuan_video": dict(x=(1, 16, 2, 32, 32), c_crossattn=(1, 77, 4096), y=(1, 768), guidance=(1,)),
    "lumina2": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 2304), num_tokens=77),
    "flux2": dict(x=(1, 128, 32, 32), c_crossattn=(1, 77, 15360), guidance=(1,)),
    "chroma": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 4096), guidance=(1,)),
}


def host_copies(family: str, constants_on_device: bool) -> list:
    model, _ = models.build(family, "full", device="meta")
    kw = {k: torch.randn(*v, device="meta", dtype=torch.bfloat16) if isinstance(v, tuple) else v
          for k, v in INPUTS[family].items()}
    x = kw.pop("x")
    # the CPU picks sub-quadratic attention, which asks the device for free memory: SDPA instead
    kw["transformer_options"] = {"optimized_attention_override":
                                 lambda func, *a, **k: attention.attention_pytorch(*a, **k)}
    with HostCopies() as copies, torch.inference_mode():
        with ConstantsOnDevice() if constants_on_device else torch.overrides.BaseTorchFunctionMode():
            out = model.apply_model(x, torch.tensor([0.7], device="meta"), **kw)
    assert out.shape == x.shape
    return copies.ops


@pytest.mark.parametrize("family", sorted(INPUTS))
def test_forward_copies_nothing_from_the_host(family):
    assert host_copies(family, True) == []


def test_wan_copies_a_constant_without_the_mode():
    assert len(host_copies("wan", False)) == 1
