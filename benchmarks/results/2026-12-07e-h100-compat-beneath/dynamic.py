"""Runs a script with torch.compile's dynamic=False turned into dynamic=True (the experiment of dynamic/)."""
import runpy
import sys

import torch

_orig = torch.compile


def compile_dynamic(fn=None, **kw):
    if kw.get("dynamic") is False:
        kw["dynamic"] = True
    return _orig(fn, **kw) if fn is not None else _orig(**kw)


torch.compile = compile_dynamic
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
