"""ControlNets' networks replayed as CUDA graphs, beside the model's; Control-LoRAs' copies of the
model's quantized layers given their real weights.
Design: docs/design.md, ``comfyui/control_graphs.py``.
"""
from __future__ import annotations

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.utils

from ..formats.conv_fp8 import CONV_FP8
from ..lowrank import branched_weight
from .cuda_graphs import CudaGraphs
from .graph_inputs import ModelCall
from .lean import QuantizedTensor


class ControlGraphs:
    comfy_modelopt_own = True

    def __init__(self):
        self.runners: dict = {}  # id(network) -> its CudaGraphs runner (``patcher``: the ControlNet's, of the network)
        self.dropped = (0, 0, 0, frozenset())  # captures, replays, eager calls, what was said: of the runners gone

    def __call__(self, executor, model, conds, x_in, timestep, model_options):
        installed, nets = [], _networks(conds)
        # the graphs of networks no longer in the conditioning (another ControlNet chosen) go
        for gone in set(self.runners) - {id(net) for net, _ in nets}:
            self.runners.pop(gone).release()
        for net, patcher in nets:
            runner = self.runners.get(id(net))
            # (a network's id reused after it went)
            if runner is None or runner.patcher.model is not net or patcher not in (None, runner.patcher):
                runner = self.runners[id(net)] = CudaGraphs(patcher or _patcher_of(net))
                runner.run_only = patcher is None  # a network built for one run (a Control-LoRA's)
            installed.append((net, net.__dict__.get("forward")))
            net.forward = _graphed(runner, net.forward)
        try:
            return executor(model, conds, x_in, timestep, model_options)
        finally:
            for net, own in reversed(installed):
                if own is None:
                    del net.forward
                else:
                    net.forward = own

    def end_run(self, *_args) -> None:
        for key, runner in list(self.runners.items()):
            runner.end_run()
            if runner.run_only:  # a network built for the run (and freed after it): its graphs go too
                self.runners.pop(key).release()
                c, r, e, said = self.dropped
                self.dropped = (c + runner.captures, r + runner.replays, e + runner.eager_calls,
                                said | set(runner.failed.values()) | runner.warned)

    def release(self, *_args) -> None:
        for runner in self.runners.values():
            runner.release()
        self.runners.clear()


def _graphed(runner: CudaGraphs, forward):
    def forward_graphed(*args, **kwargs):
        call, fn = ModelCall.of_forward(forward, args, kwargs)
        return runner.evaluate(fn, call, outer=False)
    return forward_graphed


def _controls(conds):
    """Every control object in the conditioning, previous ones in a chain included, once each."""
    seen = set()
    for cond_list in conds or ():
        for c in cond_list or ():
            control = c.get("control") if isinstance(c, dict) else None
            while control is not None and id(control) not in seen:
                seen.add(id(control))
                yield control
                control = getattr(control, "previous_controlnet", None)


def _networks(conds) -> list:
    """(network, its patcher) of every ControlNet in the conditioning - a network ComfyUI loads
    through a patcher of its own (``control_model_wrapped``), or (network, None) for one it builds
    on the GPU itself (a Control-LoRA's, anew every run)."""
    out = []
    for control in _controls(conds):
        net, patcher = getattr(control, "control_model", None), getattr(control, "control_model_wrapped", None)
        if getattr(patcher, "model", None) is not net:
            patcher = None
            if not _is_control_lora(control):
                continue
        if isinstance(net, torch.nn.Module) and all(n is not net for n, _ in out):
            out.append((net, patcher))
    return out


def _is_control_lora(control) -> bool:
    """ComfyUI's ``ControlLora`` (or a subclass): it builds its network from the model's state dict
    at every run, with no patcher of its own."""
    return any(c.__name__ == "ControlLora" for c in type(control).__mro__)


def _patcher_of(net):
    """A patcher of a network ComfyUI holds without one, as ComfyUI makes a ControlNet's, for its
    graphs' checks (where its weights are, whether they moved)."""
    device = next(iter(net.parameters()), torch.empty(0)).device
    return comfy.model_patcher.ModelPatcher(net, load_device=device,
                                            offload_device=comfy.model_management.unet_offload_device())


MENDED = "_modelopt_real_weights"


def mend_control_loras(executor, model, conds, x_in, timestep, model_options):
    """A ``CALC_COND_BATCH`` wrapper.  ComfyUI's ``ControlLora`` builds its network (in ``pre_run``,
    anew for every sampling run) from ``diffusion_model.state_dict()``, which holds a quantized
    layer's stored values without their scale: its copies of those layers would compute with
    codes, not weights.  Before the network's first call each copy gets the layer's real weight
    (``real_weight``) in the network's dtype - what the 16-bit model's Control-LoRA shares."""
    for control in _controls(conds):
        net = getattr(control, "control_model", None)
        if _is_control_lora(control) and isinstance(net, torch.nn.Module) and \
                not getattr(net, MENDED, False):
            dtype = getattr(control, "manual_cast_dtype", None) or model.get_dtype_inference()
            for name, module in model.diffusion_model.named_modules():
                stored = _stored_weight(module)
                try:
                    copy = comfy.utils.get_attr(net, name + ".weight") if stored is not None else None
                except AttributeError:
                    continue
                if isinstance(copy, torch.Tensor) and \
                        copy.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
                    comfy.utils.set_attr_param(net, name + ".weight", real_weight(module).to(copy.device, dtype))
            setattr(net, MENDED, True)
    return executor(model, conds, x_in, timestep, model_options)


def _stored_weight(module) -> torch.Tensor | None:
    """What ``state_dict()`` gives as the weight of a layer that does not compute with it as it is
    (ComfyUI's quantized layers: the codes; the own loader's fp8 convolutions), else None."""
    w = getattr(module, "weight", None)
    if isinstance(w, QuantizedTensor):
        return w._qdata
    if isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn and getattr(module, "weight_scale", None) is not None:
        return w
    return None


def real_weight(module) -> torch.Tensor:
    """The float32 weight a quantized layer computes with: its stored weight dequantized, with the
    own loader's low-rank branch and input smoothing (``lowrank.branched_weight``)."""
    w = module.weight
    full = w.dequantize() if isinstance(w, QuantizedTensor) else CONV_FP8.decode(w, module.weight_scale)
    return branched_weight(full, *(getattr(module, n, None) for n in ("lowrank_down", "lowrank_up", "smooth_scale")))
