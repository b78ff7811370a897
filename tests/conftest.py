import os

import pytest
import torch

from comfy_modelopt.synthetic import flux_layout, write_checkpoint

TINY_FLUX = dict(hidden=256, depth=1, depth_single=1, context_in=256, vec_in=256)


@pytest.fixture(autouse=True)
def _inference_mode():
    # the CLI runs under inference mode; library calls in tests do the same
    with torch.inference_mode():
        yield


@pytest.fixture
def flux_file(tmp_path):
    path = tmp_path / "flux-bf16.safetensors"
    write_checkpoint(str(path), flux_layout(**TINY_FLUX), seed=1)
    return str(path)


def pytest_report_header(config):
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return ["COMFYUI_PATH is not set: the ComfyUI contract tests (tests/comfyui) will be SKIPPED"]
    return [f"ComfyUI contract tests against COMFYUI_PATH={path}"]
