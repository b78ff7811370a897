"""Every family's forward is capturable as far as host copies go: at full size, on the meta
device (no compute), ComfyUI's own model code moves nothing from the CPU to the model's device
inside the forward once ``ConstantsOnDevice`` is on - the mode a CUDA-graph capture falls back
to after "Cannot copy between CPU and CUDA tensors during CUDA graph capture".  Without it Wan
2.1 copies its timestep embedding's ``torch.arange`` (so the check can fail)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI capture tests SKIPPED (point it at a ComfyUI "
                "v0.29+ tree to run them; see README, 'Tests')", allow_module_level=True)

models.setup_comfy()
import comfy.ldm.modules.attention as attention  # noqa: E402

from comfy_modelopt.device_constants import ConstantsOnDevice, HostCopies  # noqa: E402

# full-size inputs per family: latent and conditioning shapes ComfyUI hands apply_model
INPUTS = {
    "sd15": dict(x=(1, 4, 32, 32), c_crossattn=(1, 77, 768)),
    "sdxl": dict(x=(1, 4, 32, 32), c_crossattn=(1, 77, 2048), y=(1, 2816)),
    "sd3": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 4096), y=(1, 2048)),
    "flux": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 4096), y=(1, 768), guidance=(1,)),
    "wan": dict(x=(1, 16, 2, 32, 32), c_crossattn=(1, 77, 4096)),
    "qwen_image": dict(x=(1, 16, 1, 32, 32), c_crossattn=(1, 77, 3584)),
    "hunyuan_video": dict(x=(1, 16, 2, 32, 32), c_crossattn=(1, 77, 4096), y=(1, 768), guidance=(1,)),
    "lumina2": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 2304), num_tokens=77),
    "flux2": dict(x=(1, 128, 32, 32), c_crossattn=(1, 77, 15360), guidance=(1,)),
    "chroma": dict(x=(1, 16, 32, 32), c_crossattn=(1, 77, 4096), guidance=(1,)),
    "ltxv": dict(x=(1, 128, 2, 16, 16), c_crossattn=(1, 77, 4096), attention_mask=None, frame_rate=25),
}


def host_copies(family: str, constants_on_device: bool) -> list:
    model, _ = models.build(family, "full", device="meta")
    kw = {k: torch.randn(*v, device="meta", dtype=torch.bfloat16) if isinstance(v, tuple) else v
          for k, v in INPUTS[family].items()}
    x = kw.pop("x")
    # the CPU picks sub-quadratic attention, which asks the device for free memory: SDPA instead
    kw["transformer_options"] = {"optimized_attention_override":
                                 lambda func, *a, **k: attention.attention_pytorch(*a, **k)}
    with HostCopies() as copies, torch.inference_mode():
        with ConstantsOnDevice() if constants_on_device else torch.overrides.BaseTorchFunctionMode():
            out = model.apply_model(x, torch.tensor([0.7], device="meta"), **kw)
    assert out.shape == x.shape
    return copies.ops


@pytest.mark.parametrize("family", sorted(INPUTS))
def test_forward_copies_nothing_from_the_host(family):
    assert host_copies(family, True) == []


def test_wan_copies_a_constant_without_the_mode():
    assert len(host_copies("wan", False)) == 1


# An Inductor-compiled block captured in a CUDA graph under cudaMallocAsync (ComfyUI's default
# allocator on CUDA 13 torch): a process of its own, since the allocator is chosen at CUDA init
# and a failed capture there can abort the process.
_ASYNC_CAPTURE = r"""
import contextlib, sys
import torch
from comfy_modelopt.cuda_streams import install_raw_pointer_launches, raw_pointer_launches
from comfy_modelopt.cuda_streams import keep_forever
assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
raw = sys.argv[1] == "raw"
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 1024), torch.nn.GELU(),
                        torch.nn.Linear(1024, 256)).cuda().half().requires_grad_(False)
f = torch.compile(lambda x: x + m(x) * torch.sigmoid(x.mean(-1, keepdim=True)), dynamic=False)
if raw:
    assert install_raw_pointer_launches()
x = torch.randn(4, 64, 256, device="cuda", dtype=torch.half)
with torch.inference_mode():
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ref = f(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode="thread_local"), \
                (raw_pointer_launches() if raw else contextlib.nullcontext()):
            out = f(x)
    except Exception as e:
        print("CAPTURE FAILED", type(e).__name__, e, flush=True)
        if sys.argv[2] == "keep":
            keep_forever(e)  # else freeing what the failed capture allocated aborts the process
        sys.exit(3)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        ref = f(x)
        assert torch.equal(out, ref), float((out - ref).abs().max())
    g.reset(); del g, out
    torch.cuda.synchronize()
print("REPLAYED EQUAL", flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph capture needs a GPU (the GPU machine runs it)")
def test_compiled_block_captures_under_cuda_malloc_async():
    import subprocess
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
               PYTHONPATH=os.pathsep.join([os.path.abspath(root), os.environ.get("PYTHONPATH", "")]))

    def run(*mode):
        return subprocess.run([sys.executable, "-c", _ASYNC_CAPTURE, *mode], env=env, capture_output=True,
                              text=True, timeout=300)
    done = run("raw", "keep")
    assert done.returncode == 0 and "REPLAYED EQUAL" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    # without raw pointers the launcher's pointer check fails on the capture's graph allocations;
    # the failed capture's memory kept, the process ends normally - freed, it aborts (SIGABRT)
    kept = run("plain", "keep")
    assert kept.returncode == 3 and "CAPTURE FAILED" in kept.stdout, kept.stdout[-2000:] + kept.stderr[-3000:]
    freed = run("plain", "free")
    assert freed.returncode == -6 and "CAPTURE FAILED" in freed.stdout, freed.stdout[-2000:] + freed.stderr[-3000:]


def test_raw_pointer_launches_install_once_and_per_thread():
    """The wrap compiled blocks need under cudaMallocAsync finds Inductor's CachingAutotuner in
    this torch (where it moves, compiled blocks turn themselves off there - this test says so
    first), wraps it once, and turns on for the calling thread only."""
    import threading

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from comfy_modelopt import cuda_streams as cb
    assert cb.install_raw_pointer_launches()
    wrapped = CachingAutotuner.run
    assert getattr(wrapped, "_comfy_modelopt_raw_pointers", False)
    assert cb.install_raw_pointer_launches() and CachingAutotuner.run is wrapped  # not wrapped twice
    seen = {}
    with cb.raw_pointer_launches():
        seen["here"] = cb._RAW_POINTERS.on
        other = threading.Thread(target=lambda: seen.setdefault("other", getattr(cb._RAW_POINTERS, "on", False)))
        other.start()
        other.join()
    assert seen == {"here": True, "other": False} and not cb._RAW_POINTERS.on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph captures need a GPU (the GPU machine runs it)")
def test_real_sampling_captures_under_cuda_malloc_async():
    """The graph runtime's real-sampling tests again in a process whose allocator is cudaMallocAsync,
    as a ComfyUI server's is: freeing the cuBLAS workspace a capture had made aborted such a
    server at its first capture (a C++ exception in a destructor kills the process, so only a
    process of its own can see it)."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           os.path.join(here, "test_nodes.py"), "-k",
                           "capture_in_real_sampling or compile_before_the_first_capture or refill_the_dequant"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout[-1000:]
