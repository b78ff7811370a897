"""The CPU benchmarks run in their reduced modes, so they cannot rot (numbers are not checked)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], check=True,
                   capture_output=True, text=True, timeout=900)


def test_algorithms_quick(tmp_path):
    run("algorithms.py", "--quick", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "algorithms.json"))["rows"]
    algos = {r["algorithm"].split(" (")[0] for r in rows}
    assert {"absmax", "mse clip", "smoothquant", "awq", "awq + low-rank r=32"} <= algos
    assert {r["format"] for r in rows} == {"float8_e4m3fn", "int8_tensorwise", "mxfp8", "nvfp4", "convrot_w4a4"}


def test_quantize_cost_reduced(tmp_path):
    run("quantize_cost.py", "--reduced", "--workdir", str(tmp_path), "--formats", "float8_e4m3fn", "nvfp4")
    doc = json.load(open(tmp_path / "quantize_cost.json"))
    assert [r["format"] for r in doc["rows"]] == ["float8_e4m3fn", "nvfp4"]
    assert all(r["peak_rss_gib"] > 0 for r in doc["rows"])


def test_shard_schedule(tmp_path):
    run("shard_schedule.py", "--seeds", "1", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "shard_schedule.json"))["rows"]
    assert [r["ranks"] for r in rows] == [2, 4]
    assert all(r["even_split_s"] <= r["collect_order_s"] and r["even_split_s"] <= r["file_order_s"] for r in rows)


def test_gptq_cost_reduced(tmp_path):
    run("gptq_cost.py", "--reduced", "--device", "cpu", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "gptq_cost.json"))["rows"]
    assert len(rows) == 4 and all(r["equal"] for r in rows)  # batched dampings round as single calls


def test_block_clip_cost_reduced(tmp_path):
    run("block_clip_cost.py", "--reduced", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "block_clip_cost.json"))["rows"]
    assert len(rows) == 2 and all(r["weight_clip_s"] > 0 for r in rows)
    assert any(r["block_clip_chosen"] for r in rows)  # outlier columns: some block gains


def test_graph_pool_replays_the_recorded_captures(tmp_path):
    run("graph_pool.py", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "graph_pool.json"))["rows"]
    assert {r["capture"] for r in rows} == {"flux_lean_graphs", "wan_lean_graphs"}
    for r in rows:
        assert r["peak_mib"] <= r["fitted_mib"] <= r["single_mib"] <= r["grown_mib"]
