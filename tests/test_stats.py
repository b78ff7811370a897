"""Activation statistics and calibration (comfy_modelopt.stats, calibrate): streaming, the
reservoir, hooks, files, CUDA-graphed updates; quantizing with a statistics file."""
import json

import pytest
import torch
from torch import nn

from comfy_modelopt.calibrate import CalibrationOptions, calibrate
from comfy_modelopt.plan import make_plan
from comfy_modelopt.recipe import Recipe
from comfy_modelopt.stats import ActivationStats, CalibrationError
from comfy_modelopt.statsfile import load_stats, save_stats


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))


def test_streaming_equals_batch():
    m = mlp()
    xs = [torch.randn(3, 50, 64) * (1 + i) for i in range(5)]
    opts = CalibrationOptions(reservoir_bytes=64 * 2 * 120)
    many = calibrate(m, lambda mod: [mod(x) for x in xs], opts)
    one = calibrate(m, lambda mod: mod(torch.cat([x.reshape(-1, 64) for x in xs])), opts)
    assert many.forward_calls == 5 and one.forward_calls == 1
    for name in many.layers:
        a, b = many.layers[name], one.layers[name]
        assert a.rows == b.rows == 750
        assert torch.equal(a.amax, b.amax) and torch.equal(a.channel_absmax, b.channel_absmax)
        assert torch.allclose(a.channel_abssum, b.channel_abssum, rtol=1e-12)
        assert torch.equal(a.hist, b.hist) and int(a.hist.sum()) == 750 * a.k
        assert torch.equal(a.reservoir, b.reservoir)
        assert a.reservoir.shape[0] == min(750, a.capacity)


def test_reservoir_is_uniform():
    rows = torch.arange(20000, dtype=torch.float32).reshape(-1, 1).repeat(1, 8)
    seq = nn.Sequential(nn.Linear(8, 8))
    st = calibrate(seq, lambda mod: [mod(r) for r in rows.split(1000)], CalibrationOptions(reservoir_bytes=8 * 2 * 500))
    kept = st.layers["0"].sample()[:, 0]
    assert kept.numel() == 500
    # roughly uniform over the 20000 rows seen: mean near 10000, both halves represented
    assert 8500 < float(kept.mean()) < 11500 and 0.4 < float((kept < 10000).float().mean()) < 0.6


def test_reservoir_resumes_after_save_load(tmp_path):
    """Statistics saved and loaded keep accumulating as if never interrupted: the replacement
    chain is replayed from the seed up to the rows already seen."""
    m = mlp()
    xs = [torch.randn(40, 64) for _ in range(6)]
    opts = CalibrationOptions(reservoir_bytes=64 * 2 * 16)  # 16 rows of layer 0, 8 of layer 2
    whole = calibrate(m, lambda mod: [mod(x) for x in xs], opts)
    part = calibrate(m, lambda mod: [mod(x) for x in xs[:2]], opts)
    back = load_stats(save_stats(part, str(tmp_path / "part.safetensors")))
    resumed = calibrate(m, lambda mod: [mod(x) for x in xs[2:]], opts, stats=back)
    for name in whole.layers:
        assert resumed.layers[name].rows == whole.layers[name].rows == 240
        assert torch.equal(resumed.layers[name].reservoir, whole.layers[name].reservoir), name
    assert not torch.equal(part.layers["0"].reservoir, whole.layers["0"].reservoir)  # rows were replaced


def test_reservoir_chain_is_uniform_whatever_the_split():
    """Every row ends in the reservoir with probability capacity / rows, however the rows were
    split into calls (Algorithm L's chain depends on the row index and seed only)."""
    import random

    from comfy_modelopt.reservoir import ReservoirChain
    rows, capacity, trials = 2000, 20, 1500
    deciles = [0] * 10
    for seed in range(trials):
        slots, chain, split, r = list(range(capacity)), ReservoirChain(capacity, seed), random.Random(-seed), 0
        while r < rows:
            n = min(split.randint(1, 300), rows - r)
            for slot, row in chain.take(r, r + n).items():
                slots[slot] = row
            r += n
        assert len(set(slots)) == capacity
        for row in slots:
            deciles[row * 10 // rows] += 1
    expected = trials * capacity / 10
    assert all(abs(c / expected - 1) < 0.06 for c in deciles), deciles


def test_pinned_staging_never_hands_out_overlapping_or_empty_views():
    """The staging buffer's bookkeeping (on a CPU buffer: pinning and events need CUDA): every
    put returns its own values, across half switches and exact fills."""
    from comfy_modelopt.stats import _PinnedStaging
    staging = _PinnedStaging(torch.device("cpu"), n=16)
    sizes = [3, 5, 8, 1, 7, 8, 8, 2, 6, 9, 4]  # exact fills of a half (8), and one larger than a half
    for i, m in enumerate(sizes):
        values = list(range(100 * i, 100 * i + m))
        out = staging.put(values)
        assert out.tolist() == values, (i, m)
        assert staging.used <= staging.half


def test_hooks_removed_on_error_and_interrupt():
    m = mlp()

    def boom(mod):
        mod(torch.randn(2, 64))
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        calibrate(m, boom)
    assert all(not mod._forward_pre_hooks for mod in m.modules())


def test_first_call_recorded_and_replayed(tmp_path):
    """calibrate keeps the module's first call (what a runtime compiles ahead from): its tensors
    copied to the CPU - later in-place changes by the caller do not reach it -, the non-tensor
    arguments as they were; replayed (in the caller's grad/inference mode), the module gives that
    call's output again, and a replacement first argument (a perturbed input) goes in instead.  A saved and
    loaded statistics file has it described (shapes and options; made-up values)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale, options=None):
            assert options["key"] == "v" and isinstance(options["t"], torch.Tensor)
            return self.lin(x) * scale + options["t"]
    m = Model()
    xs = [torch.randn(2, 8) for _ in range(3)]
    t = torch.ones(1)
    with torch.inference_mode():
        want = m(xs[0], 2.0, options={"key": "v", "t": t})
        st = calibrate(m, lambda mod: [mod(x, 2.0, options={"key": "v", "t": t}) for x in xs])
    xs[0].add_(1.0)
    t.add_(1.0)
    call = st.first_call
    assert call.args[1] == 2.0 and call.kwargs["options"]["key"] == "v"
    # replayed in the caller's mode (the sampler's in its process), whatever the calibration's
    out = call.replay(m, "cpu")
    assert out.is_inference() and torch.equal(out, want)
    with torch.inference_mode(False):
        assert not call.replay(m, "cpu").is_inference()
    assert torch.equal(call.replay(m, "cpu", lambda x: x * 0), m.lin(xs[0] * 0).detach() * 2.0 + 1.0)
    assert calibrate(m, lambda mod: mod(xs[1], 1.0, options={"key": "v", "t": t}), stats=st).first_call is call
    # a statistics file carries it described: loaded, a call of the same shapes and options
    back = load_stats(save_stats(st, str(tmp_path / "s.safetensors"))).first_call
    assert back.signature() == call.signature() and back.args[0][0].shape == call.args[0][0].shape


def test_first_call_described_for_a_file_and_rebuilt():
    """A quantized file carries the first call described (shapes, dtypes, devices, the options in
    their order) in its calibration summary; a loader rebuilds a call of those shapes from it with
    made-up values.  The description is untrusted input there: oversized or malformed ones are
    refused (ValueError), an argument JSON cannot describe leaves no description."""
    import json
    import uuid
    from comfy_modelopt.calls import MAX_SIGNATURE_ELEMENTS, RecordedCall
    options = {"wrappers": {}, "cond_or_uncond": [1, 0], "uuids": [uuid.uuid4()], "sigmas": torch.ones(1),
               "a_flag": True}
    call = RecordedCall.of((torch.randn(2, 4, 8, 8), torch.tensor([1.0, 2.0])),
                           {"context": torch.randn(2, 7, 16, dtype=torch.bfloat16), "control": None,
                            "transformer_options": options})
    st = ActivationStats()
    st.first_call = call
    sig = json.loads(st.summary_json())["first_call"]  # sorted JSON keys, as the file stores it
    assert sig == call.signature()
    again = RecordedCall.from_signature(sig)
    assert list(again.kwargs["transformer_options"]) == list(options)  # the options' order kept
    assert [(t.shape, t.dtype) for t, _ in again.args] == [(t.shape, t.dtype) for t, _ in call.args]
    assert again.kwargs["context"][0].dtype == torch.bfloat16 and again.kwargs["control"] is None
    assert isinstance(again.kwargs["transformer_options"]["uuids"][0], uuid.UUID)
    big = json.loads(json.dumps(sig))
    big["args"]["tuple"][0]["tensor"] = [MAX_SIGNATURE_ELEMENTS, 2]
    for bad in (big, {"args": {"value": 1}, "kwargs": {"dict": []}}, {"args": {"tuple": [{"eval": "x"}]}},
                {"args": {"tuple": [{"tensor": [-1], "dtype": "torch.float32", "device": "cpu"}]},
                 "kwargs": {"dict": []}}, "nonsense"):
        with pytest.raises(ValueError):
            RecordedCall.from_signature(bad)
    assert RecordedCall.of((torch.zeros(1),), {"hook": print}).signature() is None
    assert "first_call" not in json.loads(ActivationStats().summary_json())


def test_empty_calibration_refused():
    with pytest.raises(CalibrationError, match="no forward calls"):
        calibrate(mlp(), lambda mod: None)


def test_nonfinite_activations_refused():
    m = mlp()
    x = torch.randn(4, 64)
    x[0, 0] = float("inf")
    with pytest.raises(CalibrationError, match=r"NaN/Inf activations in 2 layers \(e.g. 2: 128 values\)"):
        calibrate(m, lambda mod: mod(x))
    st = calibrate(m, lambda mod: mod(x), CalibrationOptions(nonfinite="ignore"))
    assert st.layers["0"].nonfinite >= 1 and torch.isfinite(st.layers["0"].amax)


def test_nonfinite_activations_stop_calibration_at_the_first_evaluation():
    """NaN/Inf in the first evaluation stops calibration before the second (not after every
    prompt and step), naming the first layer that saw them and the likely sources."""
    m = mlp()
    x = torch.randn(4, 64)
    x[0, 0] = float("nan")
    calls = []

    def loop(mod):
        for _ in range(10):
            calls.append(1)
            mod(x)
    with pytest.raises(CalibrationError, match=r"at the model's first evaluation, first in 0 \(1 values\): .*conditioning"):
        calibrate(m, loop)
    assert len(calls) == 2


def test_save_load_and_fingerprint(tmp_path):
    m = mlp()
    st = calibrate(m, lambda mod: mod(torch.randn(10, 64)), info={"steps": 3})
    path = save_stats(st, str(tmp_path / "s.safetensors"))
    back = load_stats(path)
    assert back.fingerprint == st.fingerprint and back.info == {"steps": 3}
    for n in st.layers:
        assert torch.equal(back.layers[n].hist, st.layers[n].hist)
        assert torch.equal(back.layers[n].reservoir, st.layers[n].reservoir)
    back.check_model({"0": (128, 64), "2": (32, 128)})
    with pytest.raises(CalibrationError, match=r"layer 2 is \[32, 256\] here but \[32, 128\]"):
        back.check_model({"0": (128, 64), "2": (32, 256)})
    with pytest.raises(CalibrationError, match="only 0 of their 2 layers exist in this model "
                       r"\(the statistics have e.g. 0, 2; this model has e.g. blocks.0.q\)"):
        back.check_model({"blocks.0.q": (64, 64)})
    bad = tmp_path / "not-stats.safetensors"
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(bad))
    with pytest.raises(CalibrationError, match="not a comfy-modelopt statistics file"):
        load_stats(str(bad))


def test_layer_that_never_ran_is_weight_only_and_reported():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.a(x)
    m = Branchy()
    st = calibrate(m, lambda mod: mod(torch.randn(4, 64)))
    assert st.never_ran() == ["b"]
    source = {"a.weight": ("BF16", (64, 64)), "b.weight": ("BF16", (64, 64))}
    plan = make_plan(source, Recipe("float8_e4m3fn"), stats=st)
    by = {l.name: l for l in plan.layers}
    assert by["a"].static_input and not by["a"].weight_only
    assert by["b"].weight_only and "never ran" in by["b"].reason


# ---------------------------------------------------------------- CLI with statistics
def test_cli_with_stats_writes_w8a8_and_sensitivity(flux_file, tmp_path):
    from comfy_modelopt import cli
    from comfy_modelopt.safetensors_io import SafetensorsFile
    from comfy_modelopt.synthetic import flux_layout

    from conftest import TINY_FLUX
    from helpers import LinearTree
    tree = LinearTree(flux_layout(**TINY_FLUX), scale_amax=10.0)
    st = calibrate(tree, lambda mod: [mod(i) for i in range(3)], info={"source": "synthetic"})
    stats_path = save_stats(st, str(tmp_path / "stats.safetensors"))
    out = tmp_path / "w8a8.safetensors"
    assert cli.main(["quantize", flux_file, "-o", str(out), "--stats", stats_path, "-q", "--sensitivity"]) == 0
    with SafetensorsFile(str(out)) as f:
        layers = json.loads(f.metadata["_quantization_metadata"])["layers"]
        report = json.loads(f.metadata["comfy_modelopt.report"])["layers"]
        calib = json.loads(f.metadata["comfy_modelopt.calibration"])
        assert calib["forward_calls"] == 3 and calib["source"] == "synthetic"
        for name, conf in layers.items():
            assert "full_precision_matrix_mult" not in conf  # true W8A8
            scale = float(f.read(name + ".input_scale"))
            assert scale == pytest.approx(report[name]["input_scale"], rel=1e-4) and scale > 1.0 / 448
            assert set(report[name]["sensitivity"]) >= {"float8_e4m3fn", "nvfp4", "int8_tensorwise"}
            assert report[name]["out_err"] > 0


def test_cli_refuses_stats_of_another_model(flux_file, tmp_path, capsys):
    from comfy_modelopt import cli
    st = calibrate(mlp(), lambda mod: mod(torch.randn(4, 64)))
    path = save_stats(st, str(tmp_path / "other.safetensors"))
    assert cli.main(["quantize", flux_file, "-o", str(tmp_path / "o.safetensors"), "--stats", path, "-q"]) == 2
    assert "statistics are from another model" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph replay of the statistics")
def test_graphed_statistics_equal_eager():
    """The per-call statistics replayed from CUDA graphs equal the eager ones exactly, with
    nonfinite inputs sanitized too; inputs over the size limit stay eager."""
    from comfy_modelopt.stats import LayerStats, UpdateGraphs
    g = torch.Generator(device="cuda").manual_seed(0)
    for sanitize in (False, True):
        graphs = UpdateGraphs(max_input_bytes=64 * 96 * 2)
        eager, graphed = LayerStats(96, 32, seed=1, sanitize=sanitize), LayerStats(96, 32, seed=1, sanitize=sanitize)
        for i in range(4):
            x = torch.randn(64 if i < 3 else 65, 96, generator=g, device="cuda", dtype=torch.float16) * (i + 1)
            x[i, i] = float("inf") if sanitize else x[i, i]
            eager.update(x)
            graphed.update(x, graphs)
        for s in (eager, graphed):
            s.finish()
        assert graphs.captures == 1 and graphs.replays == 3 and len(graphs.skipped) == 1  # 65 rows: too large
        for name in ("amax", "channel_absmax", "channel_abssum", "hist", "reservoir"):
            assert torch.equal(getattr(eager, name), getattr(graphed, name)), (sanitize, name)
        assert eager.nonfinite == graphed.nonfinite == (4 if sanitize else 0)
        graphs.release()
    m = mlp().cuda()
    xs = [torch.randn(3, 50, 64, device="cuda") for _ in range(3)]
    a = calibrate(m, lambda mod: [mod(x) for x in xs], CalibrationOptions(cuda_graphs=False))
    b = calibrate(m, lambda mod: [mod(x) for x in xs])
    for name in a.layers:
        assert torch.equal(a.layers[name].hist, b.layers[name].hist)
        assert torch.equal(a.layers[name].channel_abssum, b.layers[name].channel_abssum)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the hooks never wait for the GPU")
def test_hooks_do_not_synchronise_on_cuda():
    m = mlp().cuda()
    xs = [torch.randn(64, 64, device="cuda") for _ in range(3)]
    small = CalibrationOptions(reservoir_bytes=64 * 2 * 16)  # full after one call: rows get replaced
    calibrate(m, lambda mod: mod(xs[0]), small)  # first call allocates (pinned staging too)

    def loop(mod):  # only the forward passes: finish() reads counts back once, after the loop
        mod(xs[0])  # the first input of a shape captures its statistics graph (one synchronisation)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return [mod(x) for x in xs[1:]]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    st = calibrate(m, loop, small)
    assert st.layers["0"].rows == 192
    cpu = calibrate(mlp(), lambda mod: [mod(x.cpu()) for x in xs], small)  # same rows sampled on the CPU
    assert torch.equal(st.layers["0"].reservoir.cpu(), cpu.layers["0"].reservoir)


@pytest.mark.parametrize("outer,inner", [(False, True), (True, False), (False, False)])
def test_calibrate_in_either_mode(outer, inner):
    """calibrate() outside inference mode with a loop that enters it (and the other ways round),
    then more calibration in the other mode: same statistics as all in one mode."""
    m = mlp()
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def loop(mod, part):
        with torch.inference_mode(inner):
            for x in part:
                mod(x)
    with torch.inference_mode(outer):
        st = calibrate(m, lambda mod: loop(mod, xs[:2]))
    with torch.inference_mode(not outer):
        st = calibrate(m, lambda mod: loop(mod, xs[2:]), stats=st)
    with torch.inference_mode():
        ref = calibrate(m, lambda mod: [mod(x) for x in xs])
    for name in ref.layers:
        assert torch.equal(st.layers[name].hist, ref.layers[name].hist)
        assert torch.equal(st.layers[name].channel_absmax, ref.layers[name].channel_absmax)
        assert st.layers[name].rows == ref.layers[name].rows


def test_summary_names_layers_with_fewer_sampled_rows_than_inputs():
    # 40 rows reach both layers; the reservoir keeps them all: the 64-wide input is short of rows
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    with torch.no_grad():
        stats = calibrate(net, lambda m: [m(torch.randn(10, 16)) for _ in range(4)])
    s = stats.summary()
    assert (s["sampled_rows_min"], s["sampled_rows_max"]) == (40, 40)
    assert s["layers_fewer_rows_than_inputs"] == 1 and s["fewest_rows_per_input"] == "2: 40 rows for 64 inputs"
    with torch.no_grad():
        stats = calibrate(net, lambda m: [m(torch.randn(80, 16)) for _ in range(2)])
    s = stats.summary()
    assert s["layers_fewer_rows_than_inputs"] == 0 and "fewest_rows_per_input" not in s
    with torch.no_grad():  # no rows kept: nothing to say
        stats = calibrate(net, lambda m: [m(torch.randn(10, 16))], CalibrationOptions(reservoir_bytes=0))
    assert stats.sampled_rows() == {} and "sampled_rows_min" not in stats.summary()
