"""The several-GPU calibration launcher (comfy_modelopt.comfyui.launch) against a real ComfyUI tree:
under torchrun with two gloo ranks on the CPU (the path NCCL takes between GPUs), ComfyUI's own
loaders and sampler in each rank; the merged file equals the one-rank run on every exact
statistic and matches what Calibrate Model collects in-process; the quantized model it writes
(--model-out) is the same file from one or two ranks and loads in stock ComfyUI; --engine
modelopt writes ModelOpt's calibration into it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402
import test_nodes  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI launcher tests SKIPPED (point it at a ComfyUI v0.29+ tree)",
                allow_module_level=True)

models.setup_comfy()
import comfy.sd  # noqa: E402

from comfy_modelopt import Recipe, quantize_file  # noqa: E402
from comfy_modelopt.prompts import DEFAULT_NEGATIVE, DEFAULT_PROMPTS  # noqa: E402
from comfy_modelopt.safetensors_io import SafetensorsFile  # noqa: E402
from comfy_modelopt.statsfile import load_stats  # noqa: E402
from comfy.quant_ops import QuantizedTensor  # noqa: E402

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
    test_nodes.write_sd15_files(tmp)
    runs = {}
    for ranks in (1, 2):
        out = str(tmp / f"stats{ranks}.safetensors")
        # a recipe read from exact statistics only (absmax weights, max input ranges, plain rounding):
        # the same file.  GPTQ (on by default) is left out: its float32 products sum in an order that
        # follows the process's CPU thread count, so a rank with fewer threads than the test process
        # may round a few weights the other way
        p = launch(tmp, ranks, out, "--model-out", str(tmp / f"model{ranks}.safetensors"), "--format",
                   "float8_e4m3fn", "--weight-scale", "absmax", "--input-scale", "max", "--no-gptq")
        assert p.returncode == 0, p.stderr[-3000:]
        runs[ranks] = load_stats(out)
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
    nodes = test_nodes.load_pack()
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


def test_quantized_model_from_two_ranks_is_the_cli_file_and_stock(files):
    """--model-out under two ranks (layers encoded across them from the loaded ComfyUI model) holds
    the tensors the one-process CLI writes from the source file with the same statistics; stock
    ComfyUI loads it."""
    tmp, _ = files
    two, cli = str(tmp / "model2.safetensors"), str(tmp / "cli.safetensors")
    quantize_file(str(tmp / "sd15.safetensors"), cli, Recipe("float8_e4m3fn", weight_scale="absmax",
                                                            input_scale="max", gptq=False),
                  str(tmp / "stats2.safetensors"))
    with SafetensorsFile(cli) as f, SafetensorsFile(two) as g:
        assert sorted(f.keys()) == sorted(g.keys())
        layers = json.loads(g.metadata["_quantization_metadata"])["layers"]
        assert json.loads(f.metadata["_quantization_metadata"])["layers"] == layers
        for k in f.keys():
            layer, _, suffix = k.rpartition(".")
            if layer in layers and suffix != "bias":  # the quantized tensors: byte for byte
                assert f.read(k).reshape(-1).view(torch.uint8).equal(g.read(k).reshape(-1).view(torch.uint8)), k
            else:  # 16-bit tensors in the family's dtype from a loaded MODEL (SD1.x: fp16), the file's in the CLI
                assert torch.allclose(f.read(k).float(), g.read(k).float(), rtol=1e-2, atol=1e-4), k
        assert '"ranks": 2' in g.metadata["comfy_modelopt.calibration"]
        assert '"name": "sd15.safetensors"' in g.metadata["comfy_modelopt.source"]
    model = comfy.sd.load_diffusion_model(two)  # stock Load Diffusion Model
    assert sum(isinstance(getattr(m, "weight", None), QuantizedTensor)
               for m in model.model.diffusion_model.modules()) == len(layers)


def test_modelopt_engine_writes_its_calibration_into_the_model(files):
    pytest.importorskip("modelopt.torch.quantization",
                        reason="NVIDIA ModelOpt is not installed here: pip install 'comfy-modelopt[modelopt]'")
    tmp, _ = files
    out = str(tmp / "model-mo.safetensors")
    p = launch(tmp, 1, str(tmp / "stats-mo.safetensors"), "--model-out", out, "--format", "int8_tensorwise",
               "--engine", "modelopt", "--modelopt-algorithm", "smoothquant")
    assert p.returncode == 0, p.stderr[-3000:]
    with SafetensorsFile(out) as f:
        report = f.metadata["comfy_modelopt.report"]
    assert "calibration engine: NVIDIA ModelOpt" in report and "(smoothquant)" in report
    assert "folded" in report  # SD1.x: SmoothQuant's scales folded into the LayerNorms
    model = comfy.sd.load_diffusion_model(out)
    assert any(isinstance(getattr(m, "weight", None), QuantizedTensor) for m in model.model.diffusion_model.modules())
    # ModelOpt's calibrators do not merge across ranks: refused before loading anything
    p = launch(tmp, 2, str(tmp / "stats-mo2.safetensors"), "--model-out", str(tmp / "m2.safetensors"),
               "--format", "int8_tensorwise", "--engine", "modelopt")
    assert p.returncode != 0 and "run it without torchrun" in p.stderr
