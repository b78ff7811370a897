"""Experiment: compiled blocks compiled ahead twice - at the calibration's shapes (static code) and
at a latent 16 px larger each side, where Dynamo's automatic dynamic shapes compile a second
variant with the spatial dims symbolic (channels stay static).  Runs a script with that."""
import runpy
import sys

import torch

_orig = torch.compile


def compile_auto(fn=None, **kw):
    if kw.get("dynamic") is False:
        kw["dynamic"] = None  # automatic: static first, dims that change become dynamic
    return _orig(fn, **kw) if fn is not None else _orig(**kw)


torch.compile = compile_auto
from comfy_modelopt.comfyui import compiled_blocks as cb  # noqa: E402

_orig_cf = cb.CompiledBlocks.compile_for


def compile_for(self, call, diffusion_model, device, dtype=None, options=None, may_stream=None, check=True):
    ok = _orig_cf(self, call, diffusion_model, device, dtype, options, may_stream, check)
    if not ok:
        return ok
    R = type(call)
    orig_replay = R.replay

    def replay(self_, fn, device, first_tensor=None):
        def resized(x):
            x = first_tensor(x) if first_tensor is not None else x
            return torch.nn.functional.pad(x, (0, 16, 0, 16))
        return orig_replay(self_, fn, device, resized)
    R.replay = replay
    try:
        import time
        t0 = time.perf_counter()
        _orig_cf(self, call, diffusion_model, device, dtype, options, None, False)
        print(f"[dynamic2] second (dynamic) compile {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        R.replay = orig_replay
    return ok


cb.CompiledBlocks.compile_for = compile_for
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
