"""Nothing destroyed, nothing half-written that looks whole: kills, races, reports, modes, and
byte-identical repeated runs."""
import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from comfy_modelopt import cli
from comfy_modelopt.checkpoint import inspect_file
from comfy_modelopt.errors import CheckpointError, OutputExistsError
from comfy_modelopt.pipeline import quantize_file
from comfy_modelopt.recipe import Recipe
from comfy_modelopt.publish import partials_of, remove_stale_partials
from comfy_modelopt.safetensors_io import SafetensorsFile, StreamWriter, tensor_entry
from comfy_modelopt.statsfile import save_stats
from comfy_modelopt.synthetic import flux_layout, write_checkpoint


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _writer(path, overwrite=False):
    t = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    w = StreamWriter(str(path), {k: tensor_entry(v) for k, v in t.items()}, {"m": "x"}, overwrite=overwrite)
    for k, v in t.items():
        w.write(k, v)
    return w


# ============================================================== interrupted writes
def test_partial_is_no_safetensors_file_until_complete(tmp_path):
    w = _writer(tmp_path / "o.safetensors")
    assert os.path.basename(w.tmp_path).startswith(".o.safetensors.") and w.tmp_path.endswith(".partial")
    with pytest.raises(CheckpointError, match="incomplete file"):
        SafetensorsFile(w.tmp_path)  # every tensor written, still not a file anyone loads
    from safetensors import safe_open
    with pytest.raises(Exception):
        safe_open(w.tmp_path, "pt")  # nor for the safetensors library (stock ComfyUI's reader)
    w.close()
    with SafetensorsFile(str(tmp_path / "o.safetensors")) as f:
        assert torch.equal(f.read("a"), torch.arange(6, dtype=torch.float32))
    assert partials_of(str(tmp_path / "o.safetensors")) == []


def test_stale_partials_removed_live_ones_kept(tmp_path):
    out = tmp_path / "o.safetensors"
    live = _writer(out)
    # a dead writer's partial: same name pattern, zero length prefix, nobody holds its lock
    dead = tmp_path / ".o.safetensors.dead1234.partial"
    dead.write_bytes(bytes(8) + b"{}" + bytes(100))
    foreign = tmp_path / ".o.safetensors.other.partial"  # not ours: has a length prefix
    foreign.write_bytes(b"\x02" + bytes(7) + b"{}")
    removed = remove_stale_partials(str(out))
    assert removed == [str(dead)]
    assert os.path.exists(live.tmp_path) and foreign.exists()
    live.close()


def test_concurrent_writers_loser_gets_clear_error(tmp_path):
    out = tmp_path / "o.safetensors"
    first, second = _writer(out), _writer(out)  # both started before either finished
    first.close()
    before = sha(out)
    with pytest.raises(OutputExistsError, match="appeared while this run was writing"):
        second.close()
    assert sha(out) == before
    assert sorted(os.listdir(tmp_path)) == ["o.safetensors"]


def test_concurrent_cli_runs_to_one_output(tmp_path, flux_file):
    out = tmp_path / "o.safetensors"
    cmd = [sys.executable, "-m", "comfy_modelopt.cli", "quantize", flux_file, "-o", str(out), "-q",
           "--weight-scale", "absmax"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "already exists" in loser or "appeared while this run was writing" in loser
    inspect_file(str(out))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


@pytest.fixture
def mid_size_model(tmp_path):
    """A model whose quantization takes a few seconds on a CPU: long enough to kill mid-run."""
    path = tmp_path / "src.safetensors"
    write_checkpoint(str(path), flux_layout(hidden=512, depth=2, depth_single=4, context_in=512, vec_in=256))
    return str(path)


def _default_signals():
    # a test run started in the background (`cmd &` in a script) inherits SIGINT ignored, and a
    # process keeps an ignored SIGINT (as it should: nohup semantics); the run under test gets
    # the default disposition a terminal gives it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_wait_for_partial(src, out):
    proc = subprocess.Popen([sys.executable, "-m", "comfy_modelopt.cli", "quantize", src, "-o", str(out), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    deadline = time.monotonic() + 120
    while not partials_of(str(out)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)  # into the layers
    assert proc.poll() is None, "finished before it could be interrupted: use a larger model"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_cleans_up(tmp_path, mid_size_model, sig):
    out = tmp_path / "o.safetensors"
    before = sha(mid_size_model)
    proc = _start_and_wait_for_partial(mid_size_model, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "nothing was written" in err
    assert not out.exists() and partials_of(str(out)) == []
    assert sha(mid_size_model) == before


def test_kill_9_leaves_an_incomplete_file_that_never_passes(tmp_path, mid_size_model, capsys):
    out = tmp_path / "o.safetensors"
    before = sha(mid_size_model)
    proc = _start_and_wait_for_partial(mid_size_model, out)
    proc.kill()
    proc.wait(timeout=60)
    assert not out.exists()
    assert sha(mid_size_model) == before
    (leftover,) = partials_of(str(out))
    assert cli.main(["inspect", leftover]) == 2
    assert "incomplete file (interrupted write)" in capsys.readouterr().err
    # the next run to the same output removes the dead run's partial and succeeds
    assert cli.main(["quantize", mid_size_model, "-o", str(out), "-q", "--weight-scale", "absmax"]) == 0
    assert partials_of(str(out)) == []
    inspect_file(str(out))


# ============================================================== --report
def test_report_never_replaces_the_input_or_the_output(tmp_path, flux_file, capsys):
    before = sha(flux_file)
    out = tmp_path / "o.safetensors"
    assert cli.main(["quantize", flux_file, "-o", str(out), "--report", flux_file, "-q"]) == 2
    assert "would overwrite the input model" in capsys.readouterr().err
    assert cli.main(["quantize", flux_file, "-o", str(out), "--report", flux_file, "--overwrite", "-q"]) == 2
    assert sha(flux_file) == before and not out.exists()
    link = tmp_path / "link.safetensors"
    os.symlink(flux_file, link)
    assert cli.main(["quantize", flux_file, "-o", str(out), "--report", str(link), "-q"]) == 2
    assert cli.main(["quantize", flux_file, "-o", str(out), "--report", str(out), "-q"]) == 2
    assert "cannot be the same file" in capsys.readouterr().err
    assert sha(flux_file) == before and not out.exists()


def test_existing_report_needs_overwrite_before_any_work(tmp_path, flux_file, capsys):
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    rep.write_text("keep me")
    assert cli.main(["quantize", flux_file, "-o", str(out), "--report", str(rep), "-q"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert rep.read_text() == "keep me" and not out.exists()  # refused before quantizing
    assert cli.main(["quantize", flux_file, "-o", str(out), "--report", str(rep), "--overwrite", "-q"]) == 0
    assert rep.read_text().startswith("{")


def test_report_on_full_disk_leaves_no_half_report(tmp_path, flux_file, monkeypatch, capsys):
    import errno

    import comfy_modelopt.publish as pub
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    real = pub.pwrite_all

    def full(fd, data, offset):
        if len(data) > 1000 and "/.r.json." in os.readlink(f"/proc/self/fd/{fd}"):
            real(fd, data[:100], offset)  # some bytes made it, then the disk filled
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)
    monkeypatch.setattr(pub, "pwrite_all", full)
    assert cli.main(["quantize", flux_file, "-o", str(out), "--report", str(rep), "-q"]) == 1
    err = capsys.readouterr().err
    assert "was written and is complete" in err and "No space left" in err
    assert not rep.exists()
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(flux_file), "o.safetensors"])
    inspect_file(str(out))


# ============================================================== determinism and mode
def test_same_input_same_options_same_bytes(tmp_path, flux_file):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for p in (a, b):
        assert cli.main(["quantize", flux_file, "-o", str(p), "-q", "--format", "nvfp4"]) == 0
    assert sha(a) == sha(b)


def test_same_bytes_with_statistics(tmp_path, flux_file):
    from comfy_modelopt.calibrate import calibrate
    from conftest import TINY_FLUX
    from helpers import LinearTree
    tree = LinearTree(flux_layout(**TINY_FLUX), scale_amax=10.0)
    stats = save_stats(calibrate(tree, lambda mod: [mod(i) for i in range(2)]), str(tmp_path / "s.safetensors"))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for p in (a, b):
        assert cli.main(["quantize", flux_file, "-o", str(p), "-q", "--stats", stats, "--smoothing", "smoothquant"]) == 0
    assert sha(a) == sha(b)


def test_mode_follows_umask_and_overwrite_keeps_mode(tmp_path, flux_file):
    out = tmp_path / "o.safetensors"
    old = os.umask(0o022)
    try:
        quantize_file(flux_file, str(out), Recipe("float8_e4m3fn", weight_scale="absmax"))
        assert os.stat(out).st_mode & 0o777 == 0o644
        os.chmod(out, 0o640)
        quantize_file(flux_file, str(out), Recipe("float8_e4m3fn", weight_scale="absmax"), overwrite=True)
        assert os.stat(out).st_mode & 0o777 == 0o640
        os.umask(0o077)
        other = tmp_path / "p.safetensors"
        quantize_file(flux_file, str(other), Recipe("float8_e4m3fn", weight_scale="absmax"))
        assert os.stat(other).st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_output_checks_before_work(tmp_path, flux_file, capsys):
    assert cli.main(["quantize", flux_file, "-o", str(tmp_path / "missing" / "o.safetensors")]) == 2
    assert "does not exist (create it first)" in capsys.readouterr().err
    folder = tmp_path / "d"
    folder.mkdir()
    assert cli.main(["quantize", flux_file, "-o", str(folder), "--overwrite"]) == 2
    assert "is a folder" in capsys.readouterr().err
