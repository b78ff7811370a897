"""ControlNets' networks replayed as CUDA graphs, beside the model's.
Design: docs/design.md, ``comfyui/control_graphs.py``.
"""
from __future__ import annotations

import torch

from .cuda_graphs import CudaGraphs
from .graph_inputs import ModelCall


class ControlGraphs:
    comfy_modelopt_own = True

    def __init__(self):
        self.runners: dict = {}  # id(network) -> its CudaGraphs runner (``patcher``: the ControlNet's, of the network)

    def __call__(self, executor, model, conds, x_in, timestep, model_options):
        installed, nets = [], _networks(conds)
        # the graphs of networks no longer in the conditioning (another ControlNet chosen) go
        for gone in set(self.runners) - {id(net) for net, _ in nets}:
            self.runners.pop(gone).release()
        for net, patcher in nets:
            runner = self.runners.get(id(net))
            if runner is None or runner.patcher is not patcher:  # (a network's id reused after it went)
                runner = self.runners[id(net)] = CudaGraphs(patcher)
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
        for runner in self.runners.values():
            runner.end_run()

    def release(self, *_args) -> None:
        for runner in self.runners.values():
            runner.release()
        self.runners.clear()


def _graphed(runner: CudaGraphs, forward):
    def forward_graphed(*args, **kwargs):
        call, fn = ModelCall.of_forward(forward, args, kwargs)
        return runner.evaluate(fn, call, outer=False)
    return forward_graphed


def _networks(conds) -> list:
    """(network, its patcher) of every ControlNet in the conditioning, previous ones in a chain
    included - a network ComfyUI loads through a patcher of its own (``control_model_wrapped``)."""
    out, seen = [], set()
    for cond_list in conds or ():
        for c in cond_list or ():
            control = c.get("control") if isinstance(c, dict) else None
            while control is not None and id(control) not in seen:
                seen.add(id(control))
                net, patcher = getattr(control, "control_model", None), getattr(control, "control_model_wrapped", None)
                if isinstance(net, torch.nn.Module) and getattr(patcher, "model", None) is net and \
                        all(n is not net for n, _ in out):
                    out.append((net, patcher))
                control = getattr(control, "previous_controlnet", None)
    return out
