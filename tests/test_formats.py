"""Formats against comfy-kitchen's eager backend (the bit-layout oracle)."""
import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor

from comfy_modelopt.formats import FORMATS, get_format

SHAPES = [(256, 512), (3000, 1024), (200, 768), (64, 256)]
VARIANTS = [(name, {}) for name in FORMATS] + [("int8_tensorwise", {"convrot": True, "convrot_groupsize": 256})]


def weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:, 3] *= 40  # an outlier input channel
    return w


def kitchen_direct(fmt, w, opts):
    """What kitchen alone produces for this format (absmax scales)."""
    kw = fmt.layout_kwargs(**opts)
    if fmt.name.startswith("float8") or fmt.name == "nvfp4":
        kw["scale"] = None
    return QuantizedTensor.from_float(w, fmt.layout, **kw).state_dict("")


@pytest.mark.parametrize("name,opts", VARIANTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_encode_is_kitchen_bit_exact(name, opts, n, k):
    fmt = get_format(name)
    if fmt.shape_problem(n, k, **({"convrot": True} if opts.get("convrot") else {})):
        pytest.skip("shape not allowed for this format")
    w = weight(n, k)
    ours, _ = fmt.encode(w, None, **opts)
    ref = kitchen_direct(fmt, w, opts)
    assert set(ours) == set(ref)
    for suffix in ref:
        r = ref[suffix]
        if r.dtype == torch.float8_e8m0fnu:
            r = r.view(torch.uint8)
        assert ours[suffix].dtype == r.dtype, suffix
        assert torch.equal(ours[suffix].reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)), suffix


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_fake_quant_matches_kitchen_round_trip(name, opts):
    fmt = get_format(name)
    w = weight(512, 1024, seed=3)
    alphas = [None]
    if fmt.free_scale == "tensor":
        alphas.append(torch.tensor(0.8))
    if fmt.free_scale == "row":
        alphas += [torch.tensor(0.8), torch.linspace(0.5, 1.0, 512)]
    for alpha in alphas:
        _, qt = fmt.encode(w, alpha, **opts)
        deq = qt.dequantize().float()
        fake = fmt.fake_quant(w, alpha, **opts)
        if (opts.get("convrot") or name == "convrot_w4a4") and alpha is not None:
            # clipping in the rotated basis goes through one extra fp32 rotation, which can
            # move a few values across a rounding boundary; the search only needs it close
            assert (deq - fake).norm() / w.norm() < 2e-3
        else:
            assert torch.equal(deq, fake), f"alpha={alpha}"


@pytest.mark.parametrize("name,opts", VARIANTS)
@pytest.mark.parametrize("n,k", [(3000, 1024), (200, 768), (48, 512)])
def test_planned_shapes_match_encoding(name, opts, n, k):
    fmt = get_format(name)
    if fmt.shape_problem(n, k, **({"convrot": True} if opts.get("convrot") else {})):
        pytest.skip("shape not allowed")
    tensors, _ = fmt.encode(weight(n, k), None, **opts)
    planned = fmt.planned(n, k, **opts)
    assert planned == {s: (t.dtype, tuple(t.shape)) for s, t in tensors.items()}


def test_nvfp4_nibble_order_high_first():
    w = torch.zeros(16, 32)
    w[0, 0], w[0, 1] = 1.0, 6.0
    tensors, _ = get_format("nvfp4").encode(w)
    # even column in the HIGH nibble (ComfyUI/kitchen order): [1.0, 6.0] -> 0x27
    assert int(tensors[""][0, 0]) == 0x27


def test_mxfp8_scales_stored_as_uint8():
    tensors, _ = get_format("mxfp8").encode(weight(128, 256))
    assert tensors["_scale"].dtype == torch.uint8
    assert tensors[""].dtype == torch.float8_e4m3fn


def test_convrot_w4a4_low_nibble_is_even_column():
    fmt = get_format("convrot_w4a4")
    tensors, qt = fmt.encode(weight(64, 256))
    packed = tensors[""].to(torch.int32) & 0xFF
    lo = packed & 0x0F
    lo = torch.where(lo >= 8, lo - 16, lo)
    # dequantized rotated values: code * row scale; even columns come from the low nibble
    rotated = fmt.search_space(qt.dequantize().float())
    expect = (rotated[:, 0::2] / tensors["_scale"].reshape(-1, 1)).round()
    assert torch.equal(lo.float(), expect)


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_from_stored_rebuilds_the_same_tensor(name, opts):
    fmt = get_format(name)
    w = weight(256, 512, seed=5)
    tensors, qt = fmt.encode(w, None, **opts)
    conf = fmt.conf(**opts)
    rebuilt = fmt.from_stored(tensors, conf, (256, 512))
    assert torch.equal(rebuilt.dequantize().float(), qt.dequantize().float())


def test_shape_rules():
    assert get_format("float8_e4m3fn").shape_problem(3072, 64) is None
    assert "in_features % 16" in get_format("float8_e4m3fn").shape_problem(3072, 40)
    assert "in_features % 32" in get_format("nvfp4").shape_problem(3072, 48)
    assert "256" in get_format("convrot_w4a4").shape_problem(3072, 320)
    assert get_format("int8_tensorwise").shape_problem(3072, 320) is None
    assert "ConvRot" in get_format("int8_tensorwise").shape_problem(3072, 320, convrot=True)


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="unknown format 'fp4'"):
        get_format("fp4")


def test_e2m1_rounding_matches_kitchen_on_ties():
    from comfy_kitchen.float_utils import _f32_to_floatx_unpacked

    from comfy_modelopt.formats.nvfp4 import _round_e2m1
    x = torch.arange(-48, 49, dtype=torch.float32) / 8  # includes every tie: .25 .75 1.25 1.75 2.5 3.5 5
    codes = _f32_to_floatx_unpacked(x, 2, 1).long()
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    kitchen = lut[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    ours = _round_e2m1(x)
    assert torch.equal(ours.abs(), kitchen.abs())
    nz = ours != 0
    assert torch.equal(ours[nz].sign(), x[nz].sign())


def test_encode_ignores_layouts_registered_by_name(monkeypatch):
    """ComfyUI re-registers kitchen layout names with its own subclasses; our encoder must still
    run kitchen's own classes (found when running inside ComfyUI)."""
    from comfy_kitchen.tensor import TensorCoreFP8Layout, base

    class Shadow(TensorCoreFP8Layout):
        @classmethod
        def quantize(cls, tensor, scale=None, stochastic_rounding=0, inplace_ops=False):
            raise AssertionError("used the registry's class")
    monkeypatch.setitem(base.LAYOUTS, "TensorCoreFP8Layout", Shadow)
    w = weight(64, 256)
    tensors, _ = get_format("float8_e5m2").encode(w)
    assert tensors[""].dtype == torch.float8_e5m2


@pytest.mark.parametrize("group", [16, 64, 256])
def test_hadamard_fallback_equals_kitchen(group):
    """formats/int8.py restates kitchen's private ConvRot helpers for when they move: same matrix,
    same rotation."""
    from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_weight

    from comfy_modelopt.formats import regular_hadamard, rotate_groups
    h = _build_hadamard(group)
    assert torch.equal(regular_hadamard(group), h)
    w = torch.randn(8, group * 3)
    assert torch.allclose(rotate_groups(w, h, group), _rotate_weight(w, h, group), atol=1e-6)


def test_convrot_group_fits_each_layer(tmp_path):
    """int8 + ConvRot on a 384-wide model: every layer takes the largest rotation group up to the
    recipe's that divides its in_features (64 here; 256 where it divides), written per layer into
    .comfy_quant (ComfyUI reads it per layer) and encoded with it; before, every 384-wide layer
    stayed 16-bit."""
    from comfy_modelopt.fileformat import read_comfy_quant
    from comfy_modelopt.pipeline import quantize_file
    from comfy_modelopt.recipe import Recipe
    from comfy_modelopt.safetensors_io import SafetensorsFile, write_file
    g = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{i}.attn.qkv.weight": torch.randn(1152, 384, generator=g) for i in range(2)}
    tensors.update({f"blocks.{i}.mlp.fc2.weight": torch.randn(384, 1536, generator=g) for i in range(2)})
    src, out = str(tmp_path / "m.safetensors"), str(tmp_path / "q.safetensors")
    write_file(src, tensors)
    rep = quantize_file(src, out, Recipe("int8_tensorwise", convrot=True), family="generic")
    assert len(rep.quantized) == 4 and not rep.kept
    with SafetensorsFile(out) as f:
        for name, t in tensors.items():
            layer = name[:-7]
            conf = read_comfy_quant(f, layer + ".comfy_quant")
            assert conf["convrot"] and conf["convrot_groupsize"] == (64 if t.shape[1] == 384 else 256), conf
            stored = {"": f.read(layer + ".weight"), "_scale": f.read(layer + ".weight_scale")}
            fmt = get_format("int8_tensorwise")
            deq = fmt.from_stored(stored, conf, tuple(t.shape)).dequantize().float()
            assert float((deq - t).norm() / t.norm()) < 0.02
    assert any("convrot_groupsize=64" in l.notes for l in rep.quantized)


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_a_transposed_weight_encodes_row_major(name, opts):
    """kitchen keeps its input's strides; a column-major qdata (a transposed view, as GPTQ's
    column-major loop held it) makes ComfyUI's fp8 scaled_mm fail on a GPU: every format encodes
    row-major whatever it is given, and the same bits as from a contiguous copy."""
    fmt = get_format(name)
    w = weight(512, 256).T  # a [256, 512] view with column-major strides
    tensors, qt = fmt.encode(w, **opts)
    want, _ = fmt.encode(w.contiguous(), **opts)
    assert qt._qdata.is_contiguous()
    assert tensors.keys() == want.keys() and all(torch.equal(tensors[k], want[k]) for k in tensors)


def test_no_module_outside_the_formats_package_names_a_format():
    """A format's knowledge lives in its file: outside ``formats/`` a format's name is written
    only as the recipe's default (every other use goes through ``FORMATS`` and the capabilities)."""
    import ast
    import pathlib

    from comfy_modelopt.formats import NAMES
    root = pathlib.Path(__file__).resolve().parent.parent / "comfy_modelopt"
    found = []
    for path in sorted(root.rglob("*.py")):
        if "formats" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in NAMES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.value}")
    assert [f.split(":")[0] for f in found] == ["recipe.py"], found  # DEFAULT_FORMAT


def test_a_format_is_its_file_and_its_line(tmp_path, monkeypatch):
    """A new format is its file and its line in ``formats.TABLE`` (name -> file, in the order the
    command line and the node list them; ``NAMES`` is read from it without torch).  Every format
    the package's files define is in the table, under its file; a line whose file defines no such
    format is refused, naming the file."""
    import importlib
    import pkgutil
    import sys

    import comfy_modelopt.formats as formats
    from comfy_modelopt.formats.base import Format

    defined = {}
    for info in pkgutil.iter_modules(formats.__path__):
        module = importlib.import_module(f"comfy_modelopt.formats.{info.name}")
        defined.update({v.name: info.name for v in vars(module).values() if isinstance(v, Format)})
    assert defined == formats.TABLE and formats.NAMES == tuple(formats.FORMATS)
    (tmp_path / "e4m3_copy.py").write_text(
        "from comfy_modelopt.formats.fp8 import _FP8_KW, Fp8Format\n"
        "E4M3_COPY = Fp8Format(name='e4m3_copy', **_FP8_KW)\n")
    monkeypatch.setattr(formats, "__path__", [*formats.__path__, str(tmp_path)])
    monkeypatch.setattr(formats, "TABLE", {**formats.TABLE, "e4m3_copy": "e4m3_copy", "e4m3_other": "e4m3_copy"})
    with pytest.raises(ImportError, match=r"formats/e4m3_copy.py: defines no format named 'e4m3_other'"):
        formats._discover()
    del formats.TABLE["e4m3_other"]
    table = formats._discover()
    assert list(table) == [*formats.NAMES, "e4m3_copy"] and table["e4m3_copy"].layout == "TensorCoreFP8Layout"
    assert table["float8_e4m3fn"] is formats.FORMATS["float8_e4m3fn"]
    sys.modules.pop("comfy_modelopt.formats.e4m3_copy", None)
