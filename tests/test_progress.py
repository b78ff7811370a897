"""The console progress reporter (progress.py) the CLI and the nodes share."""
from comfy_modelopt.progress import Progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_line_per_tenth_and_an_eta_per_phase():
    lines, clock = [], Clock()
    p = Progress("quantizing", write=lines.append, clock=clock)
    for i in range(11):                       # the planner's pass: 1 s an item
        clock.t = float(i)
        p(i, 10, f"planning layer{i}")
    assert lines[0] == "planning: 0/10 layers, 0s (layer0)"
    assert lines[5] == "planning: 5/10 layers, 5s, ETA 5s (layer5)"
    assert len(lines) == 11
    for i in range(0, 101, 5):                # quantizing: a new clock, 0.1 s an item
        clock.t = 10.0 + i / 10
        p(i, 100, f"layer{i}")
    q = [line for line in lines if line.startswith("quantizing")]
    assert q[0] == "quantizing: 0/100 layers, 0s (layer0)" and "ETA 5s" in q[5], q  # not the planner's pace
    assert q[-1] == "quantizing: 100/100 layers, 10s"


def test_a_slow_phase_still_speaks_every_30_seconds():
    lines, clock = [], Clock()
    p = Progress("saving", write=lines.append, unit="tensors", clock=clock)
    for i in range(5):
        clock.t = 31.0 * i
        p(i, 1000, "")
    assert len(lines) == 5  # every call 31 s after the last: each one speaks, though no tenth passed
    assert lines[1] == "saving: 1/1000 tensors, 31s, ETA 8h36m"


def test_library_quantize_speaks_in_a_terminal_and_only_there(flux_file, tmp_path, monkeypatch, capsys):
    """``quantize()`` from Python shows its progress when stderr is a terminal (it said nothing for
    minutes), stays silent elsewhere and with ``progress=False``."""
    import sys
    from comfy_modelopt import Recipe, quantize
    for tty, progress, speaks in ((True, None, True), (False, None, False), (True, False, False)):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty)
        quantize(flux_file, Recipe("float8_e4m3fn"), progress=progress)
        err = capsys.readouterr().err
        assert ("quantizing" in err) == speaks, (tty, progress, err[-200:])
