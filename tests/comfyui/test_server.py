"""Workflows through a real ComfyUI server (COMFYUI_PATH), as a user's client does.

Starts ``main.py --cpu`` with this repository in custom_nodes and a temporary models folder
(--extra-model-paths-config).  The shipped UI workflows (example_workflows/) are checked equal to
what tests/comfyui/make_workflows.py writes, converted to the API format the way the frontend
does when Queue is pressed, and queued as shipped with the file their notes name in place.  The
API workflows in tests/comfyui/workflows/ (sizes shrunk for the CPU) cover the own-loader files:
calibrate -> quantize -> KSampler -> save -> reload -> KSampler.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # architectures.py
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI server tests SKIPPED (point it at a ComfyUI v0.29+ tree)",
                allow_module_level=True)

from comfy_modelopt.checkpoint import inspect_file  # noqa: E402
from comfy_server import GPU, Server  # noqa: E402
import make_workflows  # noqa: E402
from workflow_ui import to_api  # noqa: E402
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKFLOWS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workflows")
SMALL = {"width": 64, "height": 64, "steps": 3, "num_prompts": 2}


def save(path, sd):
    return write_file(str(path), sd, overwrite=True)


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
    for sub in ("diffusion_models", "text_encoders", "modelopt_calibration", "checkpoints"):
        (models_dir / sub).mkdir(parents=True)
    # the one file the shipped workflows' notes name (a small UNet, the real CLIP-L, a small VAE decoder)
    save(models_dir / "checkpoints" / make_workflows.CHECKPOINT, models.sd15_checkpoint())
    save(models_dir / "text_encoders" / "clip_l.safetensors", models.clip_l_state_dict())
    # on a GPU server (dynamic VRAM) SD3 as wide as keeps every quantized module over the 16 KiB
    # below which ComfyUI re-quantizes a module at load (architectures.SD3_WIDE)
    for family, name, size in (("sd15", "sd15-bf16", "small"), ("sd3", "sd3-bf16", "wide" if GPU else "small")):
        _, sd = models.build(family, size, seed=1)
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
                    "ModelOptUNetLoader", "ModelOptLoadCalibration", "ModelOptCudaGraphs",
                    "ModelOptCompareImages"}, sorted(ours)
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


# ============================================================== the shipped UI workflows
def test_shipped_workflows_are_what_the_builder_writes(server):
    made = make_workflows.render(server.get("/object_info"))
    shipped = sorted(f for f in os.listdir(make_workflows.FOLDER) if f.endswith(".json"))
    assert shipped == sorted(made), "example_workflows/ differs from make_workflows.WORKFLOWS"
    for name, text in made.items():
        with open(os.path.join(make_workflows.FOLDER, name)) as f:
            assert f.read() == text, f"{name}: regenerate with tests/comfyui/make_workflows.py"


def _images(entry: dict) -> dict:
    """node id -> the images a run's output nodes wrote (SaveImage and PreviewImage)."""
    return {k: v["images"] for k, v in entry["outputs"].items() if v.get("images")}


QUICK = [n for n in make_workflows.WORKFLOWS if "(quick)" in n]
REAL_SIZE = [n for n in make_workflows.WORKFLOWS if n not in QUICK]
RUN_REAL_SIZE = bool(os.environ.get("COMFY_MODELOPT_REAL_SIZE_WORKFLOWS")) or torch.cuda.is_available()


@pytest.mark.parametrize("name", QUICK + REAL_SIZE)
def test_shipped_workflow_runs_as_shipped(server, name):
    """Each example workflow as a user queues it (the frontend's conversion, nothing changed), in the
    order a user runs them: images come out, the report is shown as text and as a chart, the model
    is saved where the note says, and the saved file loads back.  The real-size ones (512 px, 16
    prompts x 20 steps: over an hour each on a 2-core CPU) run to the end on a GPU or with
    COMFY_MODELOPT_REAL_SIZE_WORKFLOWS=1; on a CPU the server takes them as shipped (its input
    validation passes: every model file and value they name is there) and they are then cancelled
    - the quick variants run the same graphs to the end."""
    with open(os.path.join(make_workflows.FOLDER, name)) as f:
        ui = json.load(f)
    object_info = server.get("/object_info")
    if name in REAL_SIZE and not RUN_REAL_SIZE:
        models_dir = server.models_dir / "diffusion_models"
        for n in ui["nodes"]:
            if n["type"] == "ModelOptUNetLoader":  # the file the real-size quantize run saves: the quick one's
                loaded = models_dir / n["widgets_values"][0]
                if not loaded.exists():
                    os.link(models_dir / n["widgets_values"][0].replace(".safetensors", "-quick.safetensors"), loaded)
        server.cancel(server.queue(to_api(ui, object_info)))
        return
    entry = server.run(to_api(ui, object_info))
    images = _images(entry)
    by_type = {str(n["id"]): n["type"] for n in ui["nodes"]}
    saved = [i for k, v in images.items() if by_type[k] == "SaveImage" for i in v]
    assert saved and all((server.base / "output" / i["subfolder"] / i["filename"]).exists() for i in saved)
    texts = [v["text"] for k, v in entry["outputs"].items() if by_type[k] == "PreviewAny"]
    assert texts and any("comfy-modelopt" in "".join(t) or "family:" in "".join(t) for t in texts), texts
    save_node = next((n for n in ui["nodes"] if n["type"] == "ModelOptSaveQuantized"), None)
    if save_node is None:  # the loading workflow: the report says the file was verified
        assert "no problem" in "".join(texts[0])
        return
    charts = [i for k, v in images.items() if by_type[k] == "PreviewImage" for i in v]
    assert len(charts) == 2  # the comparison (16-bit | quantized | difference) and the report as a picture
    path = server.models_dir / "diffusion_models" / (save_node["widgets_values"][0] + ".safetensors")
    info = inspect_file(str(path), verify_values=True)
    assert info.kind == "comfy_modelopt" and not info.problems
    planner = "budget" in name
    assert (len(info.layers_by_format) > 2) if planner else info.layers_by_format.get("float8_e4m3fn", 0) > 0
    # queued again with the same name: nothing refused, nothing replaced (ComfyUI's cache may run
    # nothing; a Save that runs takes the next free counter - test_nodes holds that)
    before = path.stat().st_mtime_ns
    server.run(to_api(ui, object_info))
    assert path.stat().st_mtime_ns == before
