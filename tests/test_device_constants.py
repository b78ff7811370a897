"""ConstantsOnDevice: CPU-built constants moved to a device are built there instead (the mode
that lets CUDA graphs capture Wan 2.1's forward).  On a CPU machine the meta device stands in
for the GPU: what matters is whether a host-to-device copy happens, and the result's values."""
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
    assert copies.ops == [] and mode.rebuilt == 4
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
    # Dynamo guards on the torch-function mode stack: a region compiled in the background thread
    # (no mode) and called inside a capture (mode on) must see the same stack, else it recompiles
    from comfy_modelopt.comfyui.compiled_blocks import _without_capture_mode
    seen = []
    region = _without_capture_mode(lambda: seen.append(torch.overrides._get_current_function_mode()))
    with ConstantsOnDevice():
        region()
    region()
    assert seen == [None, None]
