"""quantize_module / export_state_dict: a plain torch module quantized with the file pipeline.

What ComfyUI computes for each layer is proven against real ComfyUI in
tests/comfyui/test_modules.py; here: the export is the file quantize_file writes, the input
module is never changed, every Linear (and only Linear) is swapped, and the result runs under
no_grad and inference_mode.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from comfy_modelopt import Recipe, quantize_file
from comfy_modelopt.calibrate import CalibrationOptions, calibrate
from comfy_modelopt.errors import QuantizeError
from comfy_modelopt.formats.conv_fp8 import CONV_FP8
from comfy_modelopt.modules import (QuantConv2d, QuantLinear, export_file, export_state_dict, module_family,
                                    module_report, quantize_module, quantized_layers)
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(32, 128)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(128), "up": torch.nn.Linear(128, 256),
                                 "down": torch.nn.Linear(256, 128)}) for _ in range(2))
        self.out = torch.nn.Linear(128, 64)

    def forward(self, ids, img=None):
        h = self.tok(ids)
        for b in self.blocks:
            h = h + b["down"](torch.nn.functional.gelu(b["up"](b["norm"](h))))
        y = self.out(h)
        return y if img is None else (y, self.conv(img))


@pytest.fixture(scope="module")
def net_and_stats():
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    ids = [torch.randint(0, 32, (2, 16)) for _ in range(6)]
    with torch.no_grad():
        stats = calibrate(net, lambda m: [m(i) for i in ids])
    return net, stats, ids


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_every_linear_is_swapped_and_nothing_else(net_and_stats):
    net, stats, ids = net_and_stats
    q = quantize_module(net, Recipe(), stats)
    assert set(quantized_layers(q)) == {"blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "out"}
    assert isinstance(q.tok, torch.nn.Embedding) and isinstance(q.conv, torch.nn.Conv2d)
    assert all(layer.input_scale is not None for layer in quantized_layers(q).values())  # calibrated: W8A8
    with torch.no_grad():
        assert _rel(q(ids[0]), net(ids[0])) < 0.05
    assert module_report(q).layers and module_report(q).family == "module"


def test_input_module_is_untouched(net_and_stats):
    net, stats, _ = net_and_stats
    before = {k: v.clone() for k, v in net.state_dict().items()}
    quantize_module(net, Recipe(format="nvfp4"), stats)
    after = net.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert type(net.out) is torch.nn.Linear


def test_inplace_swaps_the_given_module():
    net = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert quantize_module(net, Recipe(format="int8_tensorwise"), inplace=True) is net
    assert isinstance(net[0], QuantLinear)


def test_export_is_the_file_quantize_file_writes(tmp_path, net_and_stats):
    net, stats, _ = net_and_stats
    recipe = Recipe(format="float8_e4m3fn", keep=("blocks.1.*",))
    src = tmp_path / "net.safetensors"
    write_file(str(src), {k: v.contiguous() for k, v in net.state_dict().items()})
    quantize_file(src, tmp_path / "q.safetensors", recipe, stats, family=module_family(net))
    q = quantize_module(net, recipe, stats)
    sd, meta = export_state_dict(q)
    export_file(q, str(tmp_path / "exported.safetensors"))
    with SafetensorsFile(str(tmp_path / "q.safetensors")) as f, \
            SafetensorsFile(str(tmp_path / "exported.safetensors")) as g:
        assert sorted(f.keys()) == sorted(sd) == sorted(g.keys())
        for k in f.keys():
            a, b, c = f.read(k), sd[k], g.read(k)
            assert a.dtype == b.dtype == c.dtype and a.shape == b.shape, k
            assert _bytes(a) == _bytes(b) == _bytes(c), k
        for key in ("_quantization_metadata", "comfy_modelopt.recipe"):
            assert json.loads(f.metadata[key]) == json.loads(meta[key]) == json.loads(g.metadata[key]), key
        assert f.metadata["comfy_modelopt.family"] == meta["comfy_modelopt.family"] == "module"
    kept = [k for k in sd if k.startswith("blocks.1.") and k.endswith("comfy_quant")]
    assert not kept  # the keep pattern held


def test_an_fp32_source_is_written_16bit_where_unquantized(tmp_path):
    """From an fp32 model the tensors left unquantized (norms, biases, embeddings, layers kept)
    are written 16-bit by default - bf16 where the source has no 16-bit tensor - so the file is
    smaller than the 16-bit model; ``fp32_tensors="keep"`` keeps them fp32.  quantize_module's
    module keeps fp32 and computes with the written values; its export is the file."""
    torch.manual_seed(0)
    net = Net()  # fp32
    src = tmp_path / "net.safetensors"
    write_file(str(src), {k: v.contiguous() for k, v in net.state_dict().items()})
    sixteen = sum(v.numel() * 2 for v in net.state_dict().values())
    for choice, expected in (("16-bit", torch.bfloat16), ("keep", torch.float32)):
        recipe = Recipe(format="float8_e4m3fn", keep=("blocks.1.up",), fp32_tensors=choice)
        out = tmp_path / f"q-{choice}.safetensors"
        quantize_file(src, out, recipe, family=module_family(net))
        with SafetensorsFile(str(out)) as f:
            for k in ("tok.weight", "blocks.0.norm.weight", "blocks.0.up.bias", "blocks.1.up.weight", "conv.weight"):
                assert f.read(k).dtype == expected, (choice, k)
        if choice == "16-bit":
            assert out.stat().st_size < sixteen
            q = quantize_module(net, recipe)
            assert q.tok.weight.dtype == torch.float32  # the module keeps its dtype, with the file's values
            assert torch.equal(q.tok.weight, net.tok.weight.to(torch.bfloat16).float())
            sd, _ = export_state_dict(q)
            with SafetensorsFile(str(out)) as f:
                assert all(f.read(k).dtype == sd[k].dtype and _bytes(f.read(k)) == _bytes(sd[k]) for k in f.keys())


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_runs_under_inference_mode_and_no_grad(net_and_stats):
    net, stats, ids = net_and_stats
    q = quantize_module(net, Recipe(format="int8_tensorwise", convrot=True), stats)
    with torch.inference_mode():
        a = q(ids[1])
    with torch.no_grad():
        b = q(ids[1])
    assert torch.equal(a, b)


def test_fp8_convolutions(net_and_stats):
    net, _, ids = net_and_stats
    q = quantize_module(net, Recipe(format="int8_tensorwise", conv="fp8"))
    assert isinstance(q.conv, QuantConv2d) and q.conv.weight.dtype == torch.float8_e4m3fn
    img = torch.randn(1, 4, 8, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert _rel(q(ids[0], img)[1], net(ids[0], img)[1]) < 0.05
    sd, _ = export_state_dict(q)
    assert sd["conv.weight"].shape == (8, 36) and sd["conv.weight_scale"].shape == (8,)


def test_the_networks_input_and_output_convolutions_stay_16bit_whatever_their_names():
    """The convolutions with the fewest input channels (the image's) and the fewest output channels
    are the network's ends: kept 16-bit by structure, the report naming them; the rest fp8."""
    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("stem", torch.nn.Conv2d(3, 32, 3, padding=1))
    net.add_module("body", torch.nn.Sequential(torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.SiLU(),
                                               torch.nn.Conv2d(32, 32, 3, padding=1)))
    net.add_module("head", torch.nn.Conv2d(32, 3, 3, padding=1))
    net.add_module("fc", torch.nn.Linear(16, 16))
    q = quantize_module(net, Recipe(format="int8_tensorwise", conv="fp8"))
    assert type(q.stem) is torch.nn.Conv2d and type(q.head) is torch.nn.Conv2d
    assert isinstance(q.body[0], QuantConv2d) and isinstance(q.body[2], QuantConv2d)
    assert any(n.endswith("input and output (fewest channels): head, stem") for n in module_report(q).notes)


class _ConvNet(torch.nn.Module):
    def __init__(self, channel_gain: float = 1.0):
        super().__init__()
        self.stem, self.head = torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.Conv2d(32, 3, 3, padding=1)
        self.body = torch.nn.ModuleList(torch.nn.Conv2d(32, 32, 3, padding=1) for _ in range(3))
        self.norm = torch.nn.InstanceNorm2d(32)  # each channel scaled back to unit norm
        self.fc = torch.nn.Linear(32, 32)
        with torch.no_grad():  # output channels whose norms differ by ``channel_gain`` overall
            for c in self.body:
                c.weight.mul_(torch.logspace(0, math.log10(channel_gain), 32).view(-1, 1, 1, 1))

    def forward(self, x):
        x = self.stem(x)
        for c in self.body:
            x = x + torch.nn.functional.silu(self.norm(c(x)))
        return self.head(x + self.fc(x.mean(dim=(2, 3)))[:, :, None, None])


def _model_error(q, net, calls) -> float:
    with torch.no_grad():
        outs = [(q(x), net(x)) for x in calls]
    return math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in outs) / sum(float(b.pow(2).sum()) for _, b in outs))


@pytest.mark.parametrize("gain", [1.0, 1e6])
def test_the_convolutions_scale_layout_is_the_one_the_models_output_prefers(gain):
    """With calibration calls kept (CalibrationOptions.check_calls), quantize_module runs the
    model with its fp8 convolutions scaled per output channel and per weight tensor and keeps the
    layout with the smaller output error there; the report says which and both errors, and the
    exported file stores the kept scales.  Channels 10^6 apart, each normalised after the
    convolution, lose the small ones to e4m3's subnormals under one shared scale: per channel
    must win there."""
    torch.manual_seed(0)
    net = _ConvNet(gain).eval()
    calls = [torch.randn(1, 3, 12, 12) for _ in range(6)]
    with torch.no_grad():
        stats = calibrate(net, lambda m: [m(x) for x in calls])
    assert len(stats.check_calls) == 4
    q = quantize_module(net, Recipe(format="float8_e4m3fn", conv="fp8"), stats)
    note = [n for n in module_report(q).notes if n.startswith("fp8 convolutions: ")]
    assert len(note) == 1 and "4 calibration calls" in note[0]
    per_tensor = note[0].startswith("fp8 convolutions: one scale per weight tensor, chosen")
    scales = [c.weight_scale for c in q.body]
    assert all(bool((s == s[0]).all()) == per_tensor for s in scales)
    sd, _ = export_state_dict(q)
    assert torch.equal(sd["body.0.weight_scale"], q.body[0].weight_scale)
    # the layout kept is the better one on the checked calls
    checked = [c.args[0][0] for c in stats.check_calls]  # (host copy, device it came from)
    kept = _model_error(q, net, checked)
    for c, src in zip(q.body, net.body):
        w, sc = CONV_FP8.encode(src.weight.detach(), per_tensor=not per_tensor)
        c.weight, c.weight_scale = torch.nn.Parameter(w.view(c.weight.shape), requires_grad=False), sc
    assert kept <= _model_error(q, net, checked)
    if gain > 1e5:
        assert not per_tensor


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "nvfp4"])
def test_per_sample_layers_are_computed_weight_only_where_the_models_output_says_so(fmt):
    """A Linear layer with one input row per sample (an embedding path: ``fc`` here) is checked
    on the model's output: quantized inputs or weight-only (full_precision_matrix_mult, the
    stored weight unchanged) - the better one kept, the layer's config, the header's
    quantization map and the report agreeing; a model without such layers runs no check, nor
    a format whose layout quantizes the activations itself (int8)."""
    torch.manual_seed(0)
    net = _ConvNet().eval()
    calls = [torch.randn(1, 3, 12, 12) for _ in range(6)]
    with torch.no_grad():
        stats = calibrate(net, lambda m: [m(x) for x in calls])
    q = quantize_module(net, Recipe(format=fmt), stats, native=True)
    note = [n for n in module_report(q).notes if "per-sample layers: " in n]
    if fmt == "int8_tensorwise":  # its layout quantizes the activations inside its linear: no such choice
        assert note == [] and not q.fc.full_precision
        return
    assert len(note) == 1 and note[0].startswith("1 per-sample layers: ")
    weight_only = note[0].startswith("1 per-sample layers: weight-only (16-bit inputs), chosen")
    assert q.fc.full_precision == weight_only and (q.fc.input_scale is None or not weight_only)
    sd, meta = export_state_dict(q)
    stored = json.loads(bytes(sd["fc.comfy_quant"].tolist()))
    assert stored.get("full_precision_matrix_mult", False) == weight_only
    assert json.loads(meta["_quantization_metadata"])["layers"]["fc"] == stored
    assert [l.weight_only for l in module_report(q).layers if l.name == "fc"] == [weight_only]
    checked = [c.args[0][0] for c in stats.check_calls]
    kept = _model_error(q, net, checked)
    q.fc.full_precision = not weight_only
    assert kept <= _model_error(q, net, checked)

    tokens = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    with torch.no_grad():
        stats = calibrate(tokens, lambda m: [m(torch.randn(64, 32)) for _ in range(4)])
    assert not [n for n in module_report(quantize_module(tokens, Recipe(format=fmt), stats)).notes if "chosen by" in n]


def test_calibration_keeps_calls_drawn_over_the_whole_run():
    """check_calls is a reservoir over every call (not the first few), seeded; 0 keeps none."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    calls = [torch.full((1, 4), float(i)) for i in range(200)]
    with torch.no_grad():
        kept = calibrate(net, lambda m: [m(x) for x in calls]).check_calls
        again = calibrate(net, lambda m: [m(x) for x in calls]).check_calls
        none = calibrate(net, lambda m: [m(x) for x in calls], CalibrationOptions(check_calls=0)).check_calls
    index = [int(c.args[0][0][0, 0]) for c in kept]
    assert len(index) == 4 and max(index) >= 50 and index == [int(c.args[0][0][0, 0]) for c in again] and none == []


def test_quantized_layer_refuses_load_state_dict(net_and_stats):
    net, stats, _ = net_and_stats
    q = quantize_module(net, Recipe(), stats)
    with pytest.raises(QuantizeError, match="from_stored"):
        q.load_state_dict(q.state_dict())


def test_integer_buffers_are_kept_as_they_are():
    """A module as loaded: a BatchNorm's num_batches_tracked and an index table (integer and
    boolean buffers) are the module's own, kept unchanged, not a reason to refuse it."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 32))
    net[1].num_batches_tracked.fill_(7)
    net.register_buffer("order", torch.arange(64).flip(0))
    net.register_buffer("mask", torch.arange(64) % 2 == 0)
    net.eval()
    x = torch.randn(8, 64)
    q = quantize_module(net, Recipe(format="int8_tensorwise"))
    assert isinstance(q[0], QuantLinear) and isinstance(q[2], QuantLinear)
    assert q[1].num_batches_tracked.item() == 7 and torch.equal(q.order, net.order) and torch.equal(q.mask, net.mask)
    with torch.no_grad():
        assert _rel(q(x), net(x)) < 0.05


def test_export_needs_a_quantized_module():
    with pytest.raises(QuantizeError, match="quantize_module"):
        export_state_dict(torch.nn.Linear(4, 4))


def test_glob_characters_in_module_names_are_literal():
    net = torch.nn.Module()
    net.add_module("emb[0]", torch.nn.Embedding(4, 64))
    net.add_module("lin", torch.nn.Linear(64, 64))
    fam = module_family(net)
    assert not fam.is_linear("emb[0]") and fam.is_linear("emb0") and fam.is_linear("lin")
