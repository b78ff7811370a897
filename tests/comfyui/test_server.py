"""The shipped workflows through a real ComfyUI server (COMFYUI_PATH), as a user's client does.

Starts ``main.py --cpu`` with this repository in custom_nodes and a temporary models folder
(--extra-model-paths-config), submits workflows/*.json through POST /prompt (sizes, steps and
prompt counts shrunk for the CPU), waits on /history and checks what they wrote:
calibrate -> quantize -> KSampler -> save -> reload with the stock UNETLoader -> KSampler.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # architectures.py
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI server tests SKIPPED (point it at a ComfyUI v0.29+ tree)",
                allow_module_level=True)

from comfy_modelopt.checkpoint import inspect_file  # noqa: E402
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKFLOWS = os.path.join(ROOT, "workflows")
SMALL = {"width": 64, "height": 64, "steps": 3, "num_prompts": 2}


def save(path, sd):
    return write_file(str(path), sd, overwrite=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base, models_dir):
        self.port = free_port()
        cfg = base / "extra_model_paths.yaml"
        cfg.write_text(f"modelopt_test:\n  base_path: {models_dir}\n  is_default: true\n"
                       f"  diffusion_models: diffusion_models\n  text_encoders: text_encoders\n"
                       f"  modelopt_calibration: modelopt_calibration\n")
        (base / "custom_nodes").mkdir()
        os.symlink(ROOT, base / "custom_nodes" / "comfy-modelopt")
        self.log = open(base / "server.log", "w")
        env = dict(os.environ, PYTHONPATH="")  # the pack must import on its own
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(models.COMFYUI_PATH, "main.py"), "--cpu", "--listen", "127.0.0.1",
             "--port", str(self.port), "--base-directory", str(base), "--extra-model-paths-config", str(cfg)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(base))
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = base
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("ComfyUI exited:\n" + (base / "server.log").read_text()[-4000:])
            try:
                self.get("/object_info/KSampler")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
        raise RuntimeError("ComfyUI did not start in time")

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def run(self, workflow: dict, timeout: float = 1800) -> dict:
        req = urllib.request.Request(self.url + "/prompt", data=json.dumps({"prompt": workflow}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"ComfyUI refused the workflow: {e.read().decode()[:2000]}") from None
        # ComfyUI queues what validates and drops outputs whose nodes do not: fail on any of it
        if answer.get("node_errors"):
            raise AssertionError(f"ComfyUI dropped outputs: {json.dumps(answer['node_errors'])[:2000]}")
        prompt_id = answer["prompt_id"]
        deadline = time.time() + timeout
        while time.time() < deadline:
            hist = self.get(f"/history/{prompt_id}")
            if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                entry = hist[prompt_id]
                if entry["status"].get("status_str") != "success":
                    msgs = json.dumps(entry["status"].get("messages"), indent=1)[-4000:]
                    raise AssertionError(f"workflow failed:\n{msgs}")
                return entry
            time.sleep(2)
        raise AssertionError("workflow timed out")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def shrink(workflow: dict) -> dict:
    wf = json.loads(json.dumps(workflow))
    for node in wf.values():
        for k, v in SMALL.items():
            if k in node["inputs"] and not isinstance(node["inputs"][k], list):
                node["inputs"][k] = v
    return wf


def load_workflow(name: str) -> dict:
    with open(os.path.join(WORKFLOWS, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy")
    models_dir = base / "test-models"
    for sub in ("diffusion_models", "text_encoders", "modelopt_calibration"):
        (models_dir / sub).mkdir(parents=True)
    save(models_dir / "text_encoders" / "clip_l.safetensors", models.clip_l_state_dict())
    for family, name in (("sd15", "sd15-bf16"), ("sd3", "sd3-bf16")):
        _, sd = models.build(family, "small", seed=1)
        save(models_dir / "diffusion_models" / f"{name}.safetensors", sd)
    srv = Server(base, models_dir)
    srv.models_dir = models_dir
    yield srv
    srv.stop()


def latest_latent(server, prefix: str) -> torch.Tensor:
    folder = server.base / "output" / "modelopt"
    files = sorted(p for p in folder.iterdir() if p.name.startswith(prefix))
    with SafetensorsFile(str(files[-1])) as f:
        return f.read("latent_tensor").float()


def test_nodes_registered(server):
    info = server.get("/object_info")
    ours = {name for name, node in info.items() if node.get("category", "").startswith("modelopt")}
    # the old pack's ids (workflows built with it still open) plus ours, and nothing unlisted
    assert ours == {"ModelOptCalibrationHelper", "ModelOptQuantizeUNet", "ModelOptSaveQuantized",
                    "ModelOptUNetLoader", "ModelOptLoadCalibration", "ModelOptCudaGraphs"}, sorted(ours)
    q = info["ModelOptQuantizeUNet"]["input"]
    assert "float8_e4m3fn" in json.dumps(q) and "calibration" in q.get("optional", {})


@pytest.mark.parametrize("family,fmt,calibrate,load,max_err", [
    ("sd15", "float8_e4m3fn", "sd15_calibrate_quantize_fp8.json", "sd15_load_quantized_sample.json", 0.05),
    ("sd3", "nvfp4", "sd3_calibrate_quantize_nvfp4.json", "sd3_load_quantized_sample.json", 0.25),
    # low-rank branch + AWQ smoothing: only comfy-modelopt's loader runs the file
    ("sd15", "modelopt_lowrank_nvfp4", "sd15_calibrate_quantize_nvfp4_lowrank.json", "sd15_load_lowrank_sample.json",
     0.25),
    # fp8 Linear + fp8 convolutions (own loader), fastest runtime (graphs fall back to eager on a CPU)
    ("sd15", "modelopt_conv_fp8", "sd15_calibrate_quantize_fp8_conv.json", "sd15_load_conv_sample.json", 0.05),
])
def test_workflows(server, family, fmt, calibrate, load, max_err):
    server.run(shrink(load_workflow(calibrate)))
    wf = load_workflow(calibrate)
    out_name = wf["10"]["inputs"]["filename"]
    saved = server.models_dir / "diffusion_models" / f"{out_name}.safetensors"
    info = inspect_file(str(saved))
    own = fmt.startswith("modelopt_")
    assert info.kind == ("comfy_modelopt_own" if own else "comfy_modelopt") and info.layers_by_format.get(fmt, 0) > 0
    assert info.ours["calibration"]["prompts"] == SMALL["num_prompts"]
    calib = server.models_dir / "modelopt_calibration" / f"{out_name}-calibration.safetensors"
    assert calib.exists()
    if fmt == "float8_e4m3fn":  # calibrated: W8A8 with static input scales
        with SafetensorsFile(str(saved)) as f:
            layers = json.loads(f.metadata["_quantization_metadata"])["layers"]
            assert all(not c.get("full_precision_matrix_mult") for c in layers.values())
            assert all(l + ".input_scale" in f for l in layers)
    quantized, reference = latest_latent(server, "quantized"), latest_latent(server, "reference")

    server.run(shrink(load_workflow(load)))
    reloaded = latest_latent(server, "reloaded")
    # the loader's model (stock, or ours for own-loader files) is the MODEL the nodes returned, bit for bit
    assert torch.equal(reloaded, quantized)
    err = float((quantized - reference).norm() / reference.norm())
    assert err < max_err, f"{family}/{fmt}: latent differs from bf16 by {err:.4f}"
