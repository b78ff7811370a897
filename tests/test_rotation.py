"""ConvRot per layer (rotation.py): kept on a layer only where it lowers that layer's output error on
the calibration rows - off on a layer fed a smooth sinusoidal embedding (the rotation makes its
rows spikier), on where the input has outlier channels - recorded per layer in the file."""
from __future__ import annotations

import json
import math

import torch

from comfy_modelopt import Recipe, quantize
from comfy_modelopt.calibrate import calibrate
from comfy_modelopt.checkpoint import inspect_file
from comfy_modelopt.fileformat import decode_comfy_quant
from comfy_modelopt.formats import FORMATS
from comfy_modelopt.rotation import output_error
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file


class Net(torch.nn.Module):
    """A timestep embedding's first Linear (input: a sinusoidal embedding) and a projection whose
    input has a few outlier channels, as in a diffusion model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.cond = torch.nn.Linear(128, 256)
        self.proj = torch.nn.Linear(256, 256)

    def forward(self, emb, h):
        return self.cond(emb) + self.proj(h)


def embedding(t: torch.Tensor) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000) * torch.arange(64) / 64)
    args = t[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], -1)


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(32, 256, generator=g)
    h[:, :4] *= 30
    return embedding(torch.rand(32, generator=g) * 1000), h


def calibrated(net):
    with torch.no_grad():
        return calibrate(net, lambda m: [m(*inputs(i)) for i in range(8)])


def sd(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def confs(tensors: dict) -> dict:
    return {k[:-len(".comfy_quant")]: decode_comfy_quant(v, k) for k, v in tensors.items() if k.endswith(".comfy_quant")}


def test_the_rotation_stays_only_where_it_lowers_the_layers_output_error():
    net = Net()
    stats = calibrated(net)
    out, _meta, report = quantize(sd(net), Recipe(format="int8_tensorwise"), stats, family="generic")
    conf = confs(out)
    assert not conf["cond"].get("convrot") and conf["proj"]["convrot"] is True, conf
    fmt = FORMATS["int8_tensorwise"]
    for name, layer in (("cond", net.cond), ("proj", net.proj)):
        w, x = layer.weight.detach(), stats.layer(name).sample().float()
        on = output_error(fmt, w, x, fmt.layer_options(*w.shape, Recipe(format="int8_tensorwise").format_options()))
        off = output_error(fmt, w, x, {})
        assert (off < on) == (name == "cond"), (name, on, off)
    note = next(n for n in report.notes if n.startswith("ConvRot per layer"))
    assert "kept on 1, off on 1" in note and "cond" in note
    assert "convrot=False" in next(l for l in report.layers if l.name == "cond").notes


def test_without_statistics_or_with_convrot_off_nothing_is_measured():
    net = Net()
    out, _meta, report = quantize(sd(net), Recipe(format="int8_tensorwise"), None, family="generic")
    assert all(c.get("convrot") for c in confs(out).values())
    assert not any(n.startswith("ConvRot per layer") for n in report.notes)
    out, _meta, report = quantize(sd(net), Recipe(format="int8_tensorwise", convrot=False), calibrated(net),
                                  family="generic")
    assert not any(c.get("convrot") for c in confs(out).values())
    assert not any(n.startswith("ConvRot per layer") for n in report.notes)


def test_the_file_records_the_choice_and_a_rerun_writes_the_same_bytes(tmp_path):
    net = Net()
    stats = calibrated(net)
    src = tmp_path / "src.safetensors"
    write_file(str(src), sd(net))
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"q{i}.safetensors")
        quantize(str(src), Recipe(format="int8_tensorwise"), stats, out=str(paths[-1]), family="generic")
    assert paths[0].read_bytes() == paths[1].read_bytes()
    info = inspect_file(str(paths[0]), verify_values=True)
    assert not info.problems, info.problems
    with SafetensorsFile(str(paths[0])) as f:
        assert not decode_comfy_quant(f.read("cond.comfy_quant"), "cond").get("convrot")
        # the header's per-layer map (what ComfyUI reads over .comfy_quant) says the same
        layers = json.loads(f.metadata["_quantization_metadata"])["layers"]
        assert not layers["cond"].get("convrot") and layers["proj"]["convrot"] is True
