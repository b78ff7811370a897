"""The GPU benchmark scripts run in their reduced (CPU) modes against a real ComfyUI tree."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # architectures.py
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: benchmark smoke runs SKIPPED", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("script,args,out", [
    ("speed.py", ["--reduced", "--models", "flux", "--formats", "float8_e4m3fn", "nvfp4", "--dequant-cache-gib", "1"],
     "speed.json"),
    ("cost.py", ["--reduced", "--models", "flux", "--prompts", "2", "--steps", "2"], "cost.json"),
    ("sampling_check.py", ["--reduced", "--steps", "2", "--runs", "2"], "sampling_sdxl.json"),
    ("sampling_check.py", ["--reduced", "--model", "wan", "--steps", "2", "--runs", "2", "--runtimes", "lean",
                           "lean + cuda graphs"], "sampling_wan.json"),
    ("user_path.py", ["--model", "flux", "--cpu-tiny", "--runs", "2", "--steps", "2", "--yardstick"],
     "verify_flux_float8_e4m3fn.json"),
    ("compat.py", ["--model", "sd15", "--cpu-tiny", "--runs", "2", "--steps", "2",
                   "--cases", "plain,controlnet,control-lora,freeu_v2,hires fix 1.5x,merge,refiner"], "compat_sd15.json"),
])
def test_reduced(tmp_path, script, args, out):
    result = _run(tmp_path, script, args, out)
    if script == "compat.py":  # every case ran on both models; off a GPU the quantized one runs eagerly
        cases = ["plain", "controlnet", "control-lora", "freeu_v2", "hires fix 1.5x", "merge", "refiner"]
        assert [r["case"] for r in result["rows"]] == cases
        assert all("error" not in r and "not on a CUDA device" in result["rows"][0]["ran"] for r in result["rows"])
        # the ControlNets' own networks, a Control-LoRA's (built for each run) included, went through their runners
        nets = {r["case"]: r.get("controlnets_ran", "") for r in result["rows"]}
        assert all("eager" in nets[c] and not nets[c].startswith("0 captures, 0 replays, 0 eager")
                   for c in ("controlnet", "control-lora")), nets
        return
    assert result["env"]["torch"]
    if script == "user_path.py":  # on a CPU the bare --yardstick is the other dtype (no SDPA kernel to swap)
        assert result["yardstick_mode"] == "dtype" and "yardstick" in result
        assert any(r["variant"].endswith("(yardstick)") for r in result["rows"]), result["rows"]


def _run(tmp_path, script, args, out) -> dict:
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--out", str(tmp_path), *args],
                   check=True, capture_output=True, text=True, timeout=1800)
    return json.load(open(tmp_path / out))
