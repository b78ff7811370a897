"""Calibration and quantization across processes (distributed.py), on the CPU with gloo: two
real processes, the same code path NCCL takes between GPUs."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comfy_modelopt import Recipe, quantize_file
from comfy_modelopt.calibrate import CalibrationOptions, calibrate
from comfy_modelopt.distributed import (Shard, all_reduce_stats, calibrate_sharded, merge_layer_stats,
                                        shard_prompts)
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file
from comfy_modelopt.stats import LayerStats
from comfy_modelopt.statsfile import load_stats, save_stats

WORLD = 2


def _model():
    # widths that vary, so rank 0 collects the other rank's layers out of file order
    torch.manual_seed(0)
    widths = (64, 128, 64, 256, 64, 32, 192, 64)
    layers = []
    for k, n in zip(widths, widths[1:] + widths[:1]):
        layers += [torch.nn.Linear(k, n), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(24, 64, generator=g) * (1 + i % 3) for i in range(8)]


def _calibrate(model, prompts, indices, options):
    current = [0]

    def loop(m):
        for i, x in zip(indices, prompts):
            current[0] = i
            m(x)
    with torch.no_grad():
        return calibrate(model, loop, options, group=lambda: current[0])


def _worker(rank, tmp, src, results):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD)
    try:
        prompts = _prompts()
        options = CalibrationOptions(reservoir_bytes=4096)  # 16 rows of 128: the merge has to choose
        mine = shard_prompts(list(range(len(prompts))), rank, WORLD)
        stats = _calibrate(_model(), [prompts[i] for i in mine], mine, options)
        merged = all_reduce_stats(stats)
        import comfy_modelopt.distributed as distributed
        distributed.MERGE_CHUNK_BYTES, whole = 1, distributed.MERGE_CHUNK_BYTES  # one layer per collective
        try:
            apart = all_reduce_stats(stats)
        finally:
            distributed.MERGE_CHUNK_BYTES = whole
        for name, s in apart.layers.items():
            m = merged.layers[name]
            assert torch.equal(s.reservoir, m.reservoir) and torch.equal(s.hist, m.hist) and s.groups == m.groups
            assert torch.equal(s.channel_abssum, m.channel_abssum) and (s.calls, s.rows) == (m.calls, m.rows)
        save_stats(merged, os.path.join(tmp, f"merged{rank}.safetensors"))
        with torch.no_grad():  # the one-call helper gives the same statistics
            again = calibrate_sharded(_model(), prompts, lambda m, x: m(x), options)
        for name, s in again.layers.items():
            assert torch.equal(s.reservoir, merged.layers[name].reservoir) and s.groups == merged.layers[name].groups
        shard = Shard.current()
        quantize_file(src, os.path.join(tmp, "sharded.safetensors"), Recipe(format="int8_tensorwise", gptq=True),
                      merged, family="generic", shard=shard)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dist"))
    src = os.path.join(tmp, "model.safetensors")
    write_file(src, {k: v.contiguous() for k, v in _model().state_dict().items()})
    mp.start_processes(_worker, args=(tmp, src, None), nprocs=WORLD, start_method="spawn")
    return tmp, src


def test_merged_statistics_equal_one_process_on_every_exact_statistic(run):
    tmp, _ = run
    prompts = _prompts()
    single = _calibrate(_model(), prompts, list(range(len(prompts))), CalibrationOptions(reservoir_bytes=4096))
    merged = [load_stats(os.path.join(tmp, f"merged{r}.safetensors")) for r in range(WORLD)]
    for name, one in single.layers.items():
        a, b = merged[0].layers[name], merged[1].layers[name]
        assert (a.calls, a.rows, a.nonfinite) == (one.calls, one.rows, one.nonfinite)
        assert torch.equal(a.channel_absmax, one.channel_absmax) and float(a.amax) == float(one.amax)
        assert torch.equal(a.hist, one.hist)
        assert torch.allclose(a.channel_abssum, one.channel_abssum, rtol=1e-12)
        # every rank holds the same merged sample, of the single process's size, rows of the union
        assert torch.equal(a.reservoir, b.reservoir) and a.groups == b.groups
        assert a.reservoir.shape == one.reservoir.shape
        assert set(a.groups) <= set(range(len(prompts)))
    assert merged[0].forward_calls == single.forward_calls


def test_sharded_quantization_writes_the_one_process_file(run, tmp_path):
    tmp, src = run
    stats = load_stats(os.path.join(tmp, "merged0.safetensors"))
    quantize_file(src, tmp_path / "one.safetensors", Recipe(format="int8_tensorwise", gptq=True), stats,
                  family="generic")
    with SafetensorsFile(os.path.join(tmp, "sharded.safetensors")) as f, \
            SafetensorsFile(str(tmp_path / "one.safetensors")) as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for k in f.keys():
            assert torch.equal(f.read(k).view(-1).view(torch.uint8) if f.read(k).dim() else f.read(k).reshape(1),
                               g.read(k).view(-1).view(torch.uint8) if g.read(k).dim() else g.read(k).reshape(1)), k
        assert f.metadata == g.metadata


@pytest.mark.parametrize("first,second", [(30, 10), (6, 4)])
def test_reservoir_merge_is_uniform_over_the_union(first, second):
    """Two shares (reservoirs: their full rows) merged into 8: every row of the union is picked
    with probability 8 / rows (Monte Carlo over seeds) - where the union is much larger than the
    sample (drawn without a permutation of all rows) and where it is not."""
    total = first + second

    def share(lo, hi):
        s = LayerStats(1, 64, calls=1, rows=hi - lo)
        s.channel_absmax, s.channel_abssum = torch.ones(1), torch.ones(1, dtype=torch.float64)
        s.hist = torch.zeros(4, dtype=torch.int64)
        s.reservoir = torch.arange(lo, hi, dtype=torch.bfloat16).reshape(-1, 1)
        s.groups = list(range(lo, hi))
        return s
    counts = [0] * total
    trials = 4000
    for seed in range(trials):
        a, b = share(0, first), share(first, total)
        a.capacity = b.capacity = 8
        m = merge_layer_stats([a, b], seed=seed)
        assert m.reservoir.shape == (8, 1) and m.rows == total and len(set(m.groups)) == 8
        assert m.reservoir.reshape(-1).tolist() == [float(g) for g in m.groups]  # rows keep their groups
        for g in m.groups:
            counts[g] += 1
    p = 8 / total
    expected = trials * p
    sd = (trials * p * (1 - p)) ** 0.5
    assert all(abs(c - expected) < 5 * sd for c in counts), counts
    assert abs(sum(counts[:first]) / (trials * 8) - first / total) < 0.01


def test_cli_under_torchrun_writes_the_one_process_file(run, tmp_path):
    """`torchrun --nproc-per-node 2 -m comfy_modelopt.cli quantize ...` on CPUs (gloo): rank 0
    writes the file one process writes; the other rank prints nothing."""
    import subprocess
    import sys
    tmp, src = run
    stats = os.path.join(tmp, "merged0.safetensors")
    args = ["quantize", src, "--family", "generic", "--format", "nvfp4", "--gptq", "--stats", stats, "-q"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "comfy_modelopt.cli", *args, "-o", str(tmp_path / "one.safetensors")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "comfy_modelopt.cli", *args, "-o", str(tmp_path / "two.safetensors")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("wrote ") == 1
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()


def test_layers_are_assigned_to_balance_the_work():
    shard = Shard(0, 2, torch.device("cpu"))
    costs = [100.0, 1.0, 1.0, 100.0, 1.0, 1.0, 100.0, 100.0]  # a block pattern that i % 2 would split 4:0
    owners = shard.assign(costs)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert max(loads) <= 0.55 * sum(costs) and loads[0] <= loads[1]  # rank 0 also writes the file
    assert owners == Shard(1, 2, torch.device("cpu")).assign(costs)  # every rank agrees
    assert Shard(0, 1, torch.device("cpu")).assign(costs) == [0] * len(costs)


def test_rank0_collects_each_layer_when_it_should_be_ready():
    """Rank 0 encodes its own layers and takes another rank's as they should be done, not in file
    order (where it waited for each): a permutation, every rank's layers in their own order,
    and on a file whose costly layers come late rank 0 starts on its own work at once."""
    costs = [1.0, 1.0, 8.0, 1.0, 1.0, 8.0, 8.0, 1.0, 8.0, 1.0]
    for world in (2, 3):
        shard = Shard(0, world, torch.device("cpu"))
        owners = shard.assign(costs)
        order = shard.collect_order(costs, owners)
        assert sorted(order) == list(range(len(costs)))
        for r in range(world):
            assert [i for i in order if owners[i] == r] == [i for i in range(len(costs)) if owners[i] == r]
        assert owners[order[0]] == 0 and order != sorted(order)
    # its own items never wait behind one that is due later
    assert Shard(0, 2, torch.device("cpu")).collect_order([1.0, 1.0], [1, 0]) == [1, 0]
    assert Shard(0, 1, torch.device("cpu")).collect_order([3.0, 1.0], [0, 0]) == [0, 1]


def _quantize_worker(rank, world, tmp, src, stats_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous3", rank=rank, world_size=world)
    try:
        quantize_file(src, os.path.join(tmp, f"sharded{world}.safetensors"),
                      Recipe(format="int8_tensorwise", gptq=True), load_stats(stats_path),
                      family="generic", shard=Shard.current())
    finally:
        dist.destroy_process_group()


def test_three_ranks_write_the_one_process_file(run, tmp_path):
    """Rank 0 collects from two owners, interleaved as their layers should be ready: the same file."""
    tmp, src = run
    stats = os.path.join(tmp, "merged0.safetensors")
    mp.start_processes(_quantize_worker, args=(3, str(tmp_path), src, stats), nprocs=3, start_method="spawn")
    quantize_file(src, tmp_path / "one.safetensors", Recipe(format="int8_tensorwise", gptq=True),
                  load_stats(stats), family="generic")
    assert (tmp_path / "sharded3.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
