"""The several-GPU calibration launcher (comfy_modelopt.comfyui.launch) against a real ComfyUI tree:
under torchrun with two gloo ranks on the CPU (the path NCCL takes between GPUs), ComfyUI's own
loaders and sampler in each rank; the merged file equals the one-rank run on every exact
statistic and matches what Calibrate Model collects in-process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI launcher tests SKIPPED (point it at a ComfyUI v0.29+ tree)",
                allow_module_level=True)

models.setup_comfy()
import comfy.sd  # noqa: E402

from comfy_modelopt.prompts import DEFAULT_NEGATIVE, DEFAULT_PROMPTS  # noqa: E402
from comfy_modelopt.safetensors_io import write_file  # noqa: E402
from comfy_modelopt.stats import ActivationStats  # noqa: E402
from test_nodes import load_pack  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS, STEPS = 4, 2


def launch(tmp, ranks: int, out: str, *extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, COMFYUI_PATH=models.COMFYUI_PATH, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "comfy_modelopt.comfyui.launch", "--unet", str(tmp / "sd15.safetensors"),
           "--clip", str(tmp / "clip_l.safetensors"), "--clip-type", "stable_diffusion",
           "--num-prompts", str(PROMPTS), "--steps", str(STEPS), "--cfg", "4", "--width", "64", "--height", "64",
           "--guidance", "0", "--samples-mib-per-layer", "0.5", "-o", out, *extra]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    write_file(str(tmp / "clip_l.safetensors"), models.clip_l_state_dict())
    _, sd = models.build("sd15", "small", seed=1)
    write_file(str(tmp / "sd15.safetensors"), sd)
    runs = {}
    for ranks in (1, 2):
        out = str(tmp / f"stats{ranks}.safetensors")
        p = launch(tmp, ranks, out)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[ranks] = ActivationStats.load(out)
    return tmp, runs


def test_two_ranks_equal_one_on_every_exact_statistic(files):
    _, runs = files
    one, two = runs[1], runs[2]
    assert one.forward_calls == two.forward_calls == PROMPTS * STEPS
    assert two.info["ranks"] == 2 and one.info["ranks"] == 1 and two.info["prompts"] == PROMPTS
    assert set(one.layers) == set(two.layers) and not two.never_ran()
    for name, a in one.layers.items():
        b = two.layers[name]
        assert (a.calls, a.rows, a.nonfinite) == (b.calls, b.rows, b.nonfinite), name
        assert torch.equal(a.channel_absmax, b.channel_absmax) and torch.equal(a.hist, b.hist), name
        assert torch.allclose(a.channel_abssum, b.channel_abssum, rtol=1e-12), name
        # a uniform sample of the same size, of rows of every prompt's calls
        assert a.reservoir.shape == b.reservoir.shape and set(b.groups) <= set(range(PROMPTS)), name


def test_launcher_samples_as_calibrate_model_does(files):
    """The node in this process on the same files and settings: the same calls, rows and ranges."""
    tmp, runs = files
    nodes = load_pack()
    model = comfy.sd.load_diffusion_model(str(tmp / "sd15.safetensors"))
    clip = comfy.sd.load_clip([str(tmp / "clip_l.safetensors")], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    with torch.inference_mode():
        stats, _ = nodes.ModelOptCalibrationHelper.execute(
            model=model, clip=clip, prompts="\n".join(DEFAULT_PROMPTS), negative_prompt=DEFAULT_NEGATIVE,
            num_prompts=PROMPTS, steps=STEPS, cfg=4.0, sampler_name="euler", scheduler="simple", width=64,
            height=64, seed=0, guidance=0.0, samples_mib_per_layer=0.5, save_name="").args
    two = runs[2]
    assert stats.forward_calls == two.forward_calls
    assert stats.info["sigmas"] == two.info["sigmas"] and stats.info["latent_shape"] == two.info["latent_shape"]
    for name, s in stats.layers.items():
        b = two.layers[name]
        assert (s.calls, s.rows) == (b.calls, b.rows), name
        # another process (thread count) may round a product differently: ranges agree closely
        assert torch.allclose(s.channel_absmax, b.channel_absmax, rtol=1e-3, atol=1e-5), name


def test_existing_output_is_refused_before_sampling(files):
    tmp, _ = files
    out = str(tmp / "stats1.safetensors")
    before = os.path.getmtime(out)
    p = launch(tmp, 1, out)
    assert p.returncode != 0 and "exists (pass --overwrite" in p.stderr and out in p.stderr
    assert os.path.getmtime(out) == before
