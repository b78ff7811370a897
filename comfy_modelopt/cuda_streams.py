"""Ordering helper for work that must not land on a stream about to be captured in a CUDA graph
(the calibration statistics' graphs and the ComfyUI adapter's model graphs both warm up so)."""
from __future__ import annotations

import torch


def on_side_stream(fn, device=None):
    """``fn()`` on a fresh stream ordered after the current one (and the current one after it)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        result = fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return result
