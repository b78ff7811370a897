"""Blocks compiled in the background for the shapes a run replayed uncompiled.
Design: docs/design.md, ``comfyui/background_compile.py``.
"""
from __future__ import annotations

import logging
import sys
import threading

import torch

import comfy.model_management as mm

from .compile_cache import key_of, kept
from .compiled_blocks import rounding_noise

BACKGROUND = threading.Event()
# While a compilation runs, a thread that asks for the GIL gets it within this many seconds
# (``sys.setswitchinterval``).  Every torch call of the sampler's step releases the GIL and asks for
# it back; at Python's default (5 ms) each such call waited behind Dynamo's and Inductor's Python,
# and images ran several times slower until the compilation ended.  Lower, the sampler's thread
# comes first; the compilation slows only while the sampler runs.
SWITCH_INTERVAL = 0.0002


def compile_later(runner) -> bool:
    """Start compiling the blocks for the next signature of ``runner`` (``CudaGraphs``) captured
    over regions that may hold no code for its shapes, where the GPU has memory to spare for one
    more evaluation beside ComfyUI's reserve; True if a thread started."""
    blocks = runner.compiled
    while runner.uncompiled and blocks.enabled and not BACKGROUND.is_set():
        sig, key = runner.uncompiled.popitem()
        entry = runner.graphs.get(key)
        if entry is None or entry["shapes"] in blocks.shapes:  # evicted or released since, or compiled
            continue
        device = entry["call"].args[0].device
        need = runner.pool_needs.get((key, True))
        need = need.peak if need is not None else runner.pool.reserved_bytes("large")
        if mm.get_free_memory(device) < 2 * need + mm.minimum_inference_memory():
            runner._say_once("compiled blocks: another size stays uncompiled (no GPU memory to spare for compiling "
                             "it in the background)")
            return False
        call, apply_model, dtype = entry["call"].static(device), entry["apply"], runner.compute_dtype()
        weights, modes = runner._weights_key(), (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # None: no-op context
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))

        def run():
            return call.run(apply_model)

        def perturbed():
            return call.replace_input(rounding_noise(call.args[0], dtype)).run(apply_model)

        def fail(reason: str) -> bool:
            if runner._weights_key() == weights:
                return blocks.disable(reason)
            logging.info(f"[comfy-modelopt] compiled blocks: a check in the background dropped (the weights changed "
                         f"under it): {reason}")
            return False

        def job():  # compiled code guards on the grad and inference modes: the sampler's
            interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
            try:
                with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]), torch.cuda.stream(stream), \
                        kept(key_of(runner.patcher.model.diffusion_model, repr(sig), dtype, device), "compiled blocks"):
                    if blocks.validate(run, run(), perturbed, compile_new_shapes=True, fail=fail) and \
                            blocks.checks[-1]["frames_compiled"]:
                        blocks.landed += 1
                        blocks.shapes.add(entry["shapes"])  # its graphs are captured again (CudaGraphs.evaluate)
            except Exception as e:  # out of memory in the eager reference: these shapes stay uncompiled
                logging.warning(f"[comfy-modelopt] compiling blocks in the background failed: {type(e).__name__}: "
                                f"{str(e)[:200]}")
            finally:
                sys.setswitchinterval(interval)
                if stream is not None:
                    stream.synchronize()
                BACKGROUND.clear()
        logging.info("[comfy-modelopt] compiled blocks: compiling in the background for shapes the last run replayed "
                     "uncompiled")
        BACKGROUND.set()
        threading.Thread(target=job, name="comfy-modelopt compiled blocks", daemon=True).start()
        return True
    return False
