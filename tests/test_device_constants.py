"""ConstantsOnDevice: CPU-built constants moved to a device are built there instead (the mode
that lets CUDA graphs capture Wan 2.1's forward).  On a CPU machine the meta device stands in
for the GPU: what matters is whether a host-to-device copy happens, and the result's values."""
import pytest
import torch

from comfy_modelopt.device_constants import ConstantsOnDevice, HostCopies


def wan_timestep_embedding(dim, position):
    # the shape of ComfyUI's comfy/ldm/wan/model.py sinusoidal_embedding_1d
    half = dim // 2
    position = position.type(torch.float32)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def test_factory_constants_are_built_on_the_target_device():
    pos = torch.randn(3, device="meta")
    with HostCopies() as copies:
        out = wan_timestep_embedding(16, pos)
    assert len(copies.ops) == 1  # the copy a CUDA-graph capture refuses
    with HostCopies() as copies, ConstantsOnDevice() as mode:
        out2 = wan_timestep_embedding(16, pos)
        z = torch.zeros(2, 3).to("meta", torch.float16)
        f = torch.full((4,), 0.25).to(pos)
        i = torch.arange(2, 10, 3, dtype=torch.float64).to(device="meta")
        t = torch.tensor([[3, 1]], device="meta")
        big = torch.tensor(list(range(65)), device="meta")  # not a few numbers: built as torch builds it
    assert copies.ops == [] and mode.rebuilt == 5 and (t.shape, t.dtype, big.shape) == ((1, 2), torch.int64, (65,))
    assert out2.shape == out.shape and out2.device == out.device
    assert (z.dtype, f.dtype, i.dtype) == (torch.float16, torch.float32, torch.float64)


def test_rebuilt_values_are_the_eager_values():
    # on the CPU itself: the rebuilt path's factory call with the target device gives the same
    # numbers as the copy (device "cpu" is never rebuilt, so call the recipe directly)
    mode = ConstantsOnDevice()
    for factory, args, kwargs in ((torch.arange, (7,), {}), (torch.arange, (1, 20, 3), {"dtype": torch.float32}),
                                  (torch.full, ((3,), 0.1), {}), (torch.ones, (2, 2), {"dtype": torch.bfloat16})):
        t = factory(*args, **kwargs)
        assert mode._constant(factory, args, kwargs, t)
        assert torch.equal(factory(*args, **{**kwargs, "device": "cpu", "pin_memory": False}), t)


def test_anything_else_is_copied_as_before():
    with HostCopies() as copies, ConstantsOnDevice() as mode, torch.inference_mode():  # as ComfyUI samples
        torch.randn(3).to("meta")  # data from elsewhere
        z = torch.zeros(3)
        z[0] = 1.0  # modified in place after it was built
        z.to("meta")
        torch.arange(0.0, 1.0, 0.1).to("meta")  # float steps round differently per device
        torch.arange(4)[None].to("meta")  # derived by another op
        torch.arange(4).to("cpu")  # not moved to another device
        a = torch.arange(4)
        a.add_(1)  # modified in place (inference tensors keep no version counter)
        a.to("meta")
        b = torch.ones(3)
        b.to("meta", copy=True)  # a copy asked for
    assert mode.rebuilt == 0 and len(copies.ops) == 6


def test_compiled_regions_run_outside_the_mode():
    # Dynamo guards on the torch-function mode stack: a region compiled outside the capture mode (a warm-up)
    # (no mode) and called inside a capture (mode on) must see the same stack, else it recompiles
    from comfy_modelopt.comfyui.compiled_blocks import _without_capture_mode
    seen = []
    region = _without_capture_mode(lambda: seen.append(torch.overrides._get_current_function_mode()))
    with ConstantsOnDevice():
        region()
    region()
    assert seen == [None, None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph capture needs a GPU (the GPU machine runs "
                    "it; the meta-device tests above stand in for it on a CPU)")
def test_a_cuda_graph_captures_constants_moved_every_way():
    """On the GPU: ``.to(tensor)``, ``.to(device, dtype)``, ``.cuda()``, ``.cuda(index)`` and
    ``.cuda(device=...)`` of CPU-built constants inside a real capture, which replays what eager
    computes, bit for bit."""
    pos = torch.arange(5, device="cuda", dtype=torch.float32) * 0.37

    def forward():
        return (wan_timestep_embedding(16, pos), torch.arange(8).cuda() * 2, torch.ones(3).cuda(0) + pos[:3],
                torch.full((2,), 0.25).cuda(device=pos.device) * pos[:2],
                torch.zeros(4).to("cuda", torch.float16) + 1, torch.arange(1, 9, 2).to(pos) * pos[:4],
                torch.tensor([2, 0, 1], device=pos.device), torch.tensor([[0.5, 1e-3]], device="cuda") * pos[:2])

    with torch.inference_mode():
        eager = forward()
        graph = torch.cuda.CUDAGraph()
        with ConstantsOnDevice() as mode:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward()  # warm-up, as before any capture
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                captured = forward()
        graph.replay()
        torch.cuda.synchronize()
    assert mode.rebuilt == 16  # eight constants, warm-up and capture
    for got, want in zip(captured, eager):
        assert got.device.type == "cuda" and got.dtype == want.dtype and torch.equal(got, want)


def test_keep_forever_keeps_an_object_nobody_references():
    """cuda_streams.keep_forever: a failed capture's exception (and the tensors its frames hold)
    survives every reference to it - freeing that memory under cudaMallocAsync aborts."""
    import gc
    import weakref

    from comfy_modelopt.cuda_streams import keep_forever

    class Held:
        pass
    kept, dropped = Held(), Held()
    kept_ref, dropped_ref = weakref.ref(kept), weakref.ref(dropped)
    keep_forever(kept)
    del kept, dropped
    gc.collect()
    assert kept_ref() is not None and dropped_ref() is None


def test_host_reads_and_their_values_are_recorded():
    """``.item()`` of a device tensor is a read, recorded with the value it brought back - as a
    dispatch mode sees it (aten.item: deep shrink's sigma read was missed when only its
    decomposition, _local_scalar_dense, counted).  On a CPU machine the CPU stands in for the
    device."""
    sigmas = torch.tensor([14.5, 14.5])
    with torch.inference_mode(), HostCopies() as copies:
        copies.host = ("meta",)
        sigmas[0].item()  # Kohya deep shrink
        sigmas.max().item()  # ControlNet-LLLite's sigma range
        (sigmas > 1).any().item()  # a decision's bool
    # (with the CPU standing in, every op's CPU output counts as brought over too)
    assert copies.reads.count("aten.item.default") == 3
    assert copies.values[-1] is True and copies.values.count(14.5) >= 2
    with torch.inference_mode(), HostCopies() as copies:
        sigmas[0].item()  # a CPU tensor read on the CPU: nothing a capture refuses
    assert copies.reads == [] and copies.values == []
