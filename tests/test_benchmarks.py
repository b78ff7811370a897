"""The CPU benchmarks run in their reduced modes, so they cannot rot (numbers are not checked)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], check=True,
                   capture_output=True, text=True, timeout=900)


def _benchmark_module(name):
    """benchmarks/<name>.py imported as a module (the folder is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cost_of_the_cli_reduced(tmp_path):
    run("cost.py", "cli", "--reduced", "--workdir", str(tmp_path), "--formats", "float8_e4m3fn", "nvfp4")
    doc = json.load(open(tmp_path / "quantize_cost.json"))
    assert [r["format"] for r in doc["rows"]] == ["float8_e4m3fn", "nvfp4"]
    assert all(r["peak_rss_gib"] > 0 for r in doc["rows"])


def test_cost_of_gptq_reduced(tmp_path):
    run("cost.py", "gptq", "--reduced", "--device", "cpu", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "gptq_cost.json"))["rows"]
    assert len(rows) == 8 and all(r["eager_s"] > 0 for r in rows)
    # without a GPU the kernel and the graph stand aside: every pass is the eager loop's
    assert all(r["kernel_s"] is None and r["graph_s"] is None and r["differ"] == 0 for r in rows)


def test_attention8_needs_a_gpu_and_its_quantizer_saturates_nothing(tmp_path):
    """attention8.py times kernels on a CUDA GPU: elsewhere it says so and fails; its Q/K/V
    quantizer (run on any device) maps each tensor's amax onto e4m3's largest value without a
    host sync and never overflows to NaN."""
    import torch
    mod = _benchmark_module("attention8")
    x = torch.randn(2, 3, 64, 16, dtype=torch.bfloat16) * 5
    x[0, 0, 0, 0] = -37.0
    q8, descale = mod.quantize(x)
    assert q8.dtype == torch.float8_e4m3fn and descale.shape == (1, 1, 1, 1)
    back = q8.float() * descale
    assert torch.isfinite(back).all() and back.abs().max() == x.abs().max().float()
    assert float((back - x.float()).norm() / x.float().norm()) < 0.05
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "attention8.py"), "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "CUDA" in r.stderr
    else:
        run("attention8.py", "--out", str(tmp_path), "--shapes", "SDXL 1024x1024, first level, cfg batch 2")
        row = json.load(open(tmp_path / "attention8.json"))["rows"][0]
        assert row["bf16_ms"] > 0 and row["bf16_rel_err"] < 0.01


def test_quality_real_floors_round_only_what_they_say():
    """quality_real's floors: every Linear computes with its input rounded (weights exact); a
    full-rank 16-bit branch leaves nothing to the rounded residual (exact output), smoothing and
    a rotation that round nothing change nothing, and restoring gives the layers back."""
    import torch

    from comfy_modelopt.calibrate import calibrate
    mod = _benchmark_module("quality_real")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
    x = torch.randn(4, 6, 32) * (1 + 8 * (torch.rand(32) > 0.9))  # a few outlier channels
    with torch.no_grad():
        ref = model(x)
        stats = calibrate(model, lambda m: [m(x)])

        def err(**how):
            restore = mod.activations_only(model, stats, "nvfp4", **how)
            try:
                return float((model(x) - ref).norm() / ref.norm())
            finally:
                restore()
        plain = err()
        assert plain > 1e-3                      # the activations are rounded
        assert err(rank=32) < 1e-5               # full rank: the branch computes it all, exactly
        assert 1e-3 < err(rank=8) < plain        # part of it: less than without the branch
        assert err(rotate=16) != plain and err(alpha=0.5) != plain
        assert torch.equal(model(x), ref)        # restored
        assert all("forward" not in m.__dict__ for m in model)


def test_quality_real_more_calibration_is_fixed_and_never_held_out():
    """--more-calibration's captions: the same for a seed, distinct enough to add rows, and never
    one of the held-out prompts the errors are measured on."""
    mod = _benchmark_module("quality_real")
    more = mod.more_calibration(144)
    assert more == mod.more_calibration(144) and more[:10] == mod.more_calibration(10)
    assert more != mod.more_calibration(144, seed=1)
    assert len(set(more)) > 130 and not set(more) & set(mod.HELD_OUT) and not set(more) & set(mod.CALIB)


def test_quality_real_planner_floor_honours_its_budget():
    """The planner's floor (weights exact, activations rounded per chosen format): no nvfp4 and
    next to no error with room for everything, nothing but nvfp4 at nvfp4's own bytes, in between
    a mix within the budget whose error lies between the two; the model's layers restored."""
    import torch

    from comfy_modelopt.calibrate import calibrate
    mod = _benchmark_module("quality_real")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    inputs = {f"p{i}": torch.randn(8, 64) * (1 + 8 * (torch.rand(64) > 0.9)) for i in range(6)}

    class Subject:  # as quality_real's Text and UNet: a "prompt" names its input rows
        calib, held_out, kinds = list(inputs)[:3], list(inputs)[3:], {}

        def __init__(self):
            self.model = model

        def out(self, m, names):
            return m(torch.cat([inputs[t] for t in names]))
    with torch.no_grad():
        stats = calibrate(model, lambda m: [m(x) for x in inputs.values()])
        full = mod.planner_floor(Subject(), stats, budget=1.0)
        low = mod.planner_floor(Subject(), stats, budget=0.28125)
        mid = mod.planner_floor(Subject(), stats, budget=0.4)
    assert low["layers_by_format"] == {"nvfp4": 2} and low["rel_err"] > 0.05
    assert full["rel_err"] < 0.1 * low["rel_err"] and "nvfp4" not in full["layers_by_format"]
    assert mid["bytes"] <= 0.4 and mid["layers_by_format"] == {"nvfp4": 1, "int8_tensorwise": 1}
    assert full["rel_err"] < mid["rel_err"] < low["rel_err"]
    assert all(type(m).forward is torch.nn.Linear.forward and "forward" not in m.__dict__ for m in model[::2])


def test_live_at_peak_lists_what_the_peak_held():
    live_at_peak = _benchmark_module("allocations").live_at_peak
    frame = lambda name: [{"filename": "/x/ComfyUI/comfy/ldm/flux/layers.py", "line": 7, "name": name},  # noqa: E731
                          {"filename": "/usr/lib/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
    entries = [{"action": "alloc", "addr": 1, "size": 10, "frames": frame("a")},
               {"action": "alloc", "addr": 2, "size": 30, "frames": frame("b")},
               {"action": "free_completed", "addr": 1, "size": 10},
               {"action": "alloc", "addr": 3, "size": 15, "frames": frame("c")},  # 45: the peak
               {"action": "free_completed", "addr": 2, "size": 30},
               {"action": "alloc", "addr": 4, "size": 20, "frames": frame("d")}]
    got = live_at_peak(entries)
    assert got["peak_bytes"] == 45
    assert [a["bytes"] for a in got["allocations"]] == [30, 15]
    assert got["allocations"][0]["frames"] == ["layers.py:7 b"]
