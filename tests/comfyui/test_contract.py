"""The ComfyUI contract, against a real ComfyUI tree (COMFYUI_PATH, v0.29+).

For each family: build a small-config model with ComfyUI's own classes, save it in bf16, run our
CLI for every format, load the output with ``comfy.sd.load_diffusion_model`` and check that
ComfyUI detects the same architecture, that the planned layers are ComfyUI quantized modules of
the planned format (and nothing else is), and that a forward pass stays close to bf16.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # test_attention8
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # architectures.py
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI contract tests SKIPPED (point it at a ComfyUI "
                "v0.29+ tree to run them; see README, 'Tests')", allow_module_level=True)

models.setup_comfy()
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402
from comfy.quant_ops import QuantizedTensor  # noqa: E402

from comfy_modelopt import cli  # noqa: E402
from comfy_modelopt.comfyui import ownloader  # noqa: E402
from comfy_modelopt.formats import FORMATS  # noqa: E402
from comfy_modelopt.plan import make_plan  # noqa: E402
from comfy_modelopt.recipe import Recipe  # noqa: E402
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file  # noqa: E402

FAMILIES = ["sd15", "sdxl", "sd3", "flux", "wan", "qwen_image"]
VARIANTS = [(f, []) for f in sorted(FORMATS)] + [("int8_tensorwise", ["--convrot"])]
BIG = {"sdxl", "qwen_image"}  # hundreds of millions of parameters: absmax scales keep the test quick

# relative L2 error of the model output against the bf16 model, per format (random weights)
MAX_OUTPUT_ERROR = {"float8_e4m3fn": 0.05, "float8_e5m2": 0.1, "int8_tensorwise": 0.02, "mxfp8": 0.05,
                    "nvfp4": 0.15, "convrot_w4a4": 0.25}


def inputs(family: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "sd15": dict(x=r(1, 4, 16, 16), c_crossattn=r(1, 8, 768)),
        "sdxl": dict(x=r(1, 4, 16, 16), c_crossattn=r(1, 8, 2048), y=r(1, 2816)),
        "sd3": dict(x=r(1, 16, 16, 16), c_crossattn=r(1, 8, 4096), y=r(1, 2048)),
        "flux": dict(x=r(1, 16, 16, 16), c_crossattn=r(1, 8, 256), y=r(1, 256), guidance=torch.tensor([3.5])),
        "wan": dict(x=r(1, 16, 1, 8, 8), c_crossattn=r(1, 8, 4096)),
        "qwen_image": dict(x=r(1, 16, 1, 8, 8), c_crossattn=r(1, 8, 3584)),
        "hunyuan_video": dict(x=r(1, 16, 1, 8, 8), c_crossattn=r(1, 8, 4096), y=r(1, 768),
                              guidance=torch.tensor([3.5])),
        "kandinsky5": dict(x=r(1, 16, 1, 8, 8), c_concat=torch.zeros(1, 17, 1, 8, 8), c_crossattn=r(1, 8, 3584),
                           y=r(1, 768)),
        "cosmos_predict2": dict(x=r(1, 16, 1, 8, 8), c_crossattn=r(1, 8, 1024)),
    }[family]


def forward(patcher, family: str) -> torch.Tensor:
    comfy.model_management.load_models_gpu([patcher])
    dev = patcher.load_device
    kw = {k: v.to(dev) for k, v in inputs(family).items()}
    x = kw.pop("x")
    return patcher.model.apply_model(x, torch.tensor([0.7], device=dev), **kw).float().cpu()


def save(path: str, sd: dict) -> None:
    write_file(path, sd, overwrite=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            _, sd = models.build(family, "small", seed=1)
            path = str(folder / f"{family}-bf16.safetensors")
            save(path, sd)
            patcher = comfy.sd.load_diffusion_model(path)
            cache[family] = (path, folder, patcher.model.model_config, forward(patcher, family))
            del patcher
        return cache[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt,extra", VARIANTS, ids=[f + "".join(e) for f, e in VARIANTS])
def test_quantized_file_loads_in_comfyui(source, family, fmt, extra):
    src, folder, ref_config, ref_out = source(family)
    out = str(folder / f"{family}-{fmt}{''.join(extra)}.safetensors")
    args = ["quantize", src, "-o", out, "--format", fmt, "--overwrite", "-q"] + extra
    if family in BIG:
        args += ["--weight-scale", "absmax"]
    assert cli.main(args) == 0

    with SafetensorsFile(out) as f:
        planned = json.loads(f.metadata["_quantization_metadata"])["layers"]
    assert planned, "nothing was quantized"

    patcher = comfy.sd.load_diffusion_model(out)
    config = patcher.model.model_config
    assert type(config) is type(ref_config), "ComfyUI detected another model"
    assert {k: v for k, v in config.unet_config.items() if k != "dtype"} == \
        {k: v for k, v in ref_config.unet_config.items() if k != "dtype"}

    quantized = {}
    for name, module in patcher.model.diffusion_model.named_modules():
        w = getattr(module, "weight", None)
        if isinstance(w, QuantizedTensor):
            quantized[name] = module
    assert set(quantized) == set(planned), "ComfyUI's quantized modules differ from the plan"
    for name, module in quantized.items():
        assert module.quant_format == fmt, name
        assert tuple(module.weight.shape) == tuple(module._orig_shape)
        if "--convrot" in extra:  # the rotation group fitted to the layer, read per layer by ComfyUI
            assert module.weight._params.convrot
            assert module.weight._params.convrot_groupsize == planned[name]["convrot_groupsize"], name
        assert getattr(module, "input_scale", None) is None  # no statistics: none written

    out_t = forward(patcher, family)
    err = float((out_t - ref_out).norm() / ref_out.norm())
    print(f"{family} {fmt}{''.join(extra)}: output error vs bf16 {err:.4f}")
    assert torch.isfinite(out_t).all()
    assert err < MAX_OUTPUT_ERROR[fmt], f"{family}/{fmt}: output error {err:.4f}"


@pytest.mark.parametrize("family", sorted(models.UNKNOWN_CONFIGS))
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
def test_architectures_of_no_known_family_quantize_without_a_flag(source, family, fmt, capsys):
    """Diffusion models ComfyUI loads and comfy-modelopt has no family for (Kandinsky 5, Cosmos
    Predict2): the CLI recognises them by their structure and quantizes them with the generic rules,
    no flag; stock ComfyUI detects the same model in the file and runs it."""
    src, folder, ref_config, ref_out = source(family)
    out = str(folder / f"{family}-{fmt}.safetensors")
    assert cli.main(["quantize", src, "-o", out, "--format", fmt, "--overwrite", "-q",
                     "--weight-scale", "absmax"]) == 0
    assert "a diffusion model by its structure" in capsys.readouterr().out
    patcher = comfy.sd.load_diffusion_model(out)
    assert type(patcher.model.model_config) is type(ref_config)
    assert sum(isinstance(getattr(m, "weight", None), QuantizedTensor) for m in patcher.model.diffusion_model.modules()) > 10
    out_t = forward(patcher, family)
    err = float((out_t - ref_out).norm() / ref_out.norm())
    # the generic rules quantize layers a family's rules keep (e.g. Kandinsky's output layer): twice
    # the known families' bound
    assert torch.isfinite(out_t).all() and err < 2 * MAX_OUTPUT_ERROR[fmt], err


@pytest.mark.parametrize("family", sorted(models.CONFIGS))
def test_planned_layers_are_comfyui_linears(family):
    """At full size, every layer we would quantize is built by ComfyUI as operations.Linear."""
    import comfy.ops
    model, sd = models.build(family, "full", device="meta")
    linears = {n for n, m in model.diffusion_model.named_modules()
               if isinstance(m, torch.nn.Linear) and isinstance(m, comfy.ops.CastWeightBiasOp)}
    source = {k: ("BF16", tuple(v.shape)) for k, v in sd.items()}
    for fmt in ("float8_e4m3fn", "nvfp4"):
        plan = make_plan(source, Recipe(fmt))
        assert plan.family.name == family
        not_linear = [l.name for l in plan.quantized if l.name not in linears]
        assert not not_linear, f"{family}: planned layers that are not Linear: {not_linear[:5]}"


def test_demo_layout_matches_comfyui_flux():
    """The demo's Flux key layout is ComfyUI's Flux state dict (norm '.scale' as in BFL files)."""
    from comfy_modelopt.synthetic import flux_layout
    cfg = dict(models.FLUX_SMALL)
    _, sd = models.build("flux", "small", device="meta")
    ours = {k.replace(".scale", ".weight"): v for k, v in
            flux_layout(hidden=cfg["hidden_size"], depth=cfg["depth"], depth_single=cfg["depth_single_blocks"],
                        context_in=cfg["context_in_dim"], vec_in=cfg["vec_in_dim"]).items()}
    assert ours == {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_blocks_trace_every_family(source, family):
    """The compiled-blocks runtime traces each family's blocks with the quantized layers opaque,
    and the result matches eager (here on the CPU: Inductor's C++ backend; the same Dynamo graphs
    run as Triton kernels on a GPU)."""
    from comfy_modelopt.comfyui.compiled_blocks import CompiledBlocks, rounding_noise
    from comfy_modelopt.comfyui.lean import make_lean
    src, folder, _, _ = source(family)
    out = str(folder / f"{family}-fp8-compiled.safetensors")
    assert cli.main(["quantize", src, "-o", out, "--format", "float8_e4m3fn", "--weight-scale", "absmax",
                     "--overwrite", "-q"]) == 0
    patcher = ownloader.load_file(out)  # Load Quantized Model's loader: the layers of the lean class
    comfy.model_management.load_models_gpu([patcher])
    assert make_lean(patcher) > 0
    kw = inputs(family)
    x = kw.pop("x")
    t = torch.tensor([0.7])
    with torch.inference_mode():
        run = lambda: patcher.model.apply_model(x, t, **kw)  # noqa: E731
        ref = run()
        cb = CompiledBlocks(patcher.model.diffusion_model)
        assert cb.regions, "no blocks found to compile"
        ok = cb.validate(run, ref, lambda: patcher.model.apply_model(rounding_noise(x, torch.bfloat16), t, **kw))
    assert ok, cb.reason
    assert cb.checks[-1]["rel_l2"] < 1e-3  # CPU: fp8 computed dequantized, fusion changes little


def test_the_loader_has_comfyui_build_the_lean_layers(source):
    """Load Quantized Model's loader has ComfyUI build the model with ComfyUI's own mixed-precision
    operations under the pack's Linear class (``custom_operations``, ``lean.operations``): one class
    for every load on a device (compiled code guards on a layer's class), no forward set on any
    layer by ``make_lean``, and before it the model computes exactly what ComfyUI's stock loader's
    model computes from the same file."""
    from comfy_modelopt.comfyui.lean import LeanForward, make_lean
    src, folder, _, _ = source("flux")
    out = str(folder / "flux-fp8-lean-class.safetensors")
    assert cli.main(["quantize", src, "-o", out, "--format", "float8_e4m3fn", "--weight-scale", "absmax",
                     "--overwrite", "-q"]) == 0
    a, b, stock = ownloader.load_file(out), ownloader.load_file(out), comfy.sd.load_diffusion_model(out)
    quantized = [[m for m in p.model.diffusion_model.modules() if getattr(m, "quant_format", None)] for p in (a, b)]
    assert quantized[0] and all(isinstance(m, LeanForward) for m in quantized[0])
    assert len({type(m) for layers in quantized for m in layers}) == 1
    assert not any(isinstance(m, LeanForward) for m in stock.model.diffusion_model.modules())
    kw = inputs("flux")
    x = kw.pop("x")
    t = torch.tensor([0.7])
    with torch.inference_mode():
        assert torch.equal(b.model.apply_model(x, t, **kw), stock.model.apply_model(x, t, **kw))
    assert make_lean(a) == len(quantized[0])
    assert not any("forward" in m.__dict__ for m in quantized[0])
    said = []  # a model of ComfyUI's own loader: said, not silently left stock
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    try:
        assert make_lean(stock) == 0
    finally:
        logging.getLogger().removeHandler(handler)
    assert any(f"{len(quantized[0])} quantized layers were not built by this pack's loader" in m for m in said), said


def test_compiled_blocks_compile_per_shape_not_per_block():
    """ComfyUI hands every transformer block its own block / block_index / transformer_index
    (patch lookups); compiled code guards on such constants, so Dynamo used to keep one variant
    per block (70 for SDXL's transformer block) and scan them on every call.  The blocks are
    regions of their own, called without those keys: one variant per input shape.  With patches
    the eager forward runs and sees the keys."""
    import comfy.sd
    from comfy.ldm.modules.attention import BasicTransformerBlock
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from comfy_modelopt.comfyui.compiled_blocks import CompiledBlocks
    _, sd = models.build("sdxl", "small", seed=1, dtype=torch.float32)
    patcher = comfy.sd.load_diffusion_model_state_dict(sd)
    dm = patcher.model.diffusion_model
    blocks = [m for m in dm.modules() if isinstance(m, BasicTransformerBlock)]
    kw = inputs("sdxl")
    x, t = kw.pop("x"), torch.tensor([0.7])
    torch._dynamo.reset()
    with torch.inference_mode():
        ref = patcher.model.apply_model(x, t, **kw)
        cb = CompiledBlocks(dm)
        assert set(map(id, blocks)) <= set(map(id, cb.regions))
        with cb.installed():
            out = patcher.model.apply_model(x, t, **kw)
        assert float((out - ref).norm() / ref.norm()) < 1e-4
        variants = len(_debug_get_cache_entry_list(BasicTransformerBlock.forward.__code__))
        shapes = 2  # the small SDXL's transformer blocks run at two resolutions
        assert len(blocks) > shapes and 1 <= variants <= shapes, (variants, len(blocks))

        seen = []

        def patch(q, k, v, extra_options):  # an attn1 patch that records what the block was told
            seen.append(extra_options.get("block_index"))
            return q, k, v
        with cb.installed():
            patcher.model.apply_model(x, t, **kw, transformer_options={"patches": {"attn1_patch": [patch]}})
        assert len(seen) == len(blocks) and max(seen) > 0  # eager forward: the real indices

        indices = set()

        @torch.compiler.disable
        def override(func, *args, **kwargs):  # an attention override that reads the block index
            indices.add(kwargs["transformer_options"].get("block_index"))
            return func(*args, **kwargs)
        with cb.installed():
            out = patcher.model.apply_model(x, t, **kw, transformer_options={"optimized_attention_override": override})
        assert float((out - ref).norm() / ref.norm()) < 1e-4
        assert None not in indices and max(indices) > 0  # the options reached it with the real indices


def _w8a8_lean(family: str, fmt: str = "float8_e4m3fn"):
    """A small ``family`` model as a W8A8 file - fp8 with static input scales from three
    evaluations, or int8 + ConvRot - loaded by ComfyUI and made lean with the format's kernel
    (kitchen's fp8 quantizer and ``scaled_mm``, its ``int8_linear``), which also run on a CPU,
    where ComfyUI itself would compute the format dequantized."""
    import common  # benchmarks/common.py
    from comfy_modelopt.comfyui import lean
    _, sd = models.build(family, "small", seed=1)
    kw = inputs(family)
    x = kw.pop("x")
    if fmt == "float8_e4m3fn":
        base = comfy.sd.load_diffusion_model_state_dict(dict(sd))
        q_sd, meta = common.calibrated_fp8(base, sd, x, torch.tensor([1.0]), kw)
    else:
        q_sd, meta, _ = common.quantize_sd(sd, Recipe(fmt, weight_scale="absmax", convrot=True, convrot_groupsize=64,
                                                      sensitivity=False))
    patcher = common.load_stock(q_sd, meta)  # fully loaded, as the runtimes' MODEL is
    for m in patcher.model.diffusion_model.modules():
        if getattr(m, "quant_format", None):
            m._full_precision_mm = False  # as on a GPU computing the format
    native = lean.native_formats
    lean.native_formats = lambda _device: {fmt}
    try:
        assert lean.make_lean(patcher) > 0
    finally:
        lean.native_formats = native
    dev = patcher.load_device  # the sampler hands the model its inputs on its device
    return patcher, x.to(dev), {k: v.to(dev) for k, v in kw.items()}


@pytest.mark.parametrize("family,fmt", [("flux", "float8_e4m3fn"), ("wan", "float8_e4m3fn"), ("sdxl", "float8_e4m3fn"),
                                        ("flux", "int8_tensorwise")])
def test_compiled_blocks_trace_the_lean_layers(family, fmt):
    """Compiled blocks see a lean fp8 layer (and a 16-bit Linear) as one operator in the block's
    graph, not as a graph break - a break resumes inside the previous stretch's frame, which kept
    attention's tensors alive through the MLP (the H200's compiled Flux/Wan forwards held 5-25%
    more than eager).  No break names a Linear any more; the compiled model still matches eager
    within its rounding noise; the operator is bit-identical to the eager lean layer; a layer with
    a LoRA weight function, and any call made outside a compilation, takes its own forward."""
    from torch._dynamo.utils import counters

    from comfy_modelopt.comfyui.compiled_blocks import CompiledBlocks, rounding_noise
    from comfy_modelopt.comfyui.records import layer_record
    from comfy_modelopt.comfyui import traced_layers
    from comfy_modelopt.comfyui.traced_layers import traced_forward
    patcher, x, kw = _w8a8_lean(family, fmt)
    dm = patcher.model.diffusion_model
    t = torch.tensor([0.7], device=x.device)
    # a quantized file's 16-bit convolutions are ComfyUI's manual_cast class (cast flag set by it)
    convs = [m for m in dm.modules() if type(m).__name__ == "Conv2d"]
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        run = lambda: patcher.model.apply_model(x, t, **kw)  # noqa: E731
        ref = run()
        cb = CompiledBlocks(dm)
        ok = cb.validate(run, ref, lambda: patcher.model.apply_model(rounding_noise(x, torch.bfloat16), t, **kw))
        assert ok, cb.reason
        reasons = [r for r in counters["graph_break"] if "Linear" in r or "make_lean" in r or "Conv2d" in r]
        assert not reasons, reasons[0][:300]
        assert counters["stats"]["unique_graphs"] > 0
        for conv in convs[:2]:  # a 16-bit convolution (a UNet's) is an operator too: F.conv2d, as eager
            assert traced_forward(conv, conv.forward) is not None
            op, weight, bias, extra = layer_record(conv).traced
            h = torch.randn(1, conv.in_channels, 8, 8, dtype=weight.dtype, device=weight.device)
            assert op is traced_layers.conv2d and torch.equal(torch.nn.functional.conv2d(h, weight, bias, *extra), conv(h))
            conv.comfy_cast_weights = True  # as ComfyUI's lowvram loading flags a layer whose weight it moved
            try:
                assert traced_forward(conv, conv.forward) is None
            finally:
                del conv.comfy_cast_weights

        lin = next(m for m in dm.modules() if getattr(layer_record(m), "kernel", None) and layer_record(m).kernel.traced(m))
        h = torch.randn(3, lin.weight.shape[1], dtype=torch.bfloat16).to(lin.weight.device)
        eager = lin.forward(h)
        traced = traced_forward(lin, lin.forward)
        assert traced is not None and layer_record(lin).traced[1] is lin.weight._qdata
        kernel, qdata, bias, extra = layer_record(lin).traced
        bias = None if bias is None else bias.to(h.dtype)
        from comfy_modelopt.comfyui import kernels as lean
        if kernel is lean.fp8_traced:  # the input rounded in traced code (kitchen's formula: bit-exact eagerly), the GEMM an operator
            op = torch._scaled_mm(lean.fp8_round(h, (1.0 / extra[0]).to(h.dtype), qdata.dtype), qdata.t(),
                                  scale_a=extra[0], scale_b=extra[1], bias=bias, out_dtype=h.dtype, use_fast_accum=extra[2])
        else:
            assert kernel is lean.int8_traced and extra[1]  # ConvRot
            op = torch.ops.comfy_kitchen.int8_linear(h, qdata, extra[0], bias, lean.dtype_code(h.dtype), *extra[1:])
        assert torch.equal(op, eager)
        assert torch.equal(traced(h), eager)  # not compiling: the layer's own forward
        lin.weight_function.append(lambda w: w)
        try:
            assert traced_forward(lin, lin.forward) is None  # patched: stays opaque
        finally:
            lin.weight_function.clear()


MODULATION_FOLDS = {  # family -> (producer, consumer) kinds its blocks must fold
    "flux": {("img_mod.lin", "img_attn.qkv"), ("img_mod.lin", "img_mlp.0"), ("txt_mod.lin", "txt_attn.qkv"),
             ("txt_mod.lin", "txt_mlp.0"), ("modulation.lin", "linear1")},
    "hunyuan_video": {("img_mod.lin", "img_attn.qkv"), ("img_mod.lin", "img_mlp.0"),
                      ("txt_mod.lin", "txt_attn.qkv"), ("txt_mod.lin", "txt_mlp.0"), ("modulation.lin", "linear1")},
    "sd3": {("adaLN_modulation.1", "attn.qkv"), ("adaLN_modulation.1", "mlp.fc1")},
    "qwen_image": {("img_mod.1", "attn.to_q"), ("img_mod.1", "img_mlp.net.0.proj"), ("txt_mod.1", "attn.add_q_proj"),
                   ("txt_mod.1", "txt_mlp.net.0.proj")},
}


def _block_relative(name: str, family: str) -> str:
    parts = name.split(".")
    depth = {"sd3": 3}.get(family, 2)  # joint_blocks.N.x_block.<layer>
    return ".".join(parts[depth:])


@pytest.mark.parametrize("family", sorted(MODULATION_FOLDS))
def test_modulation_folds_are_exact(family):
    """Smoothing folded into an adaLN modulation Linear (its shift and scale rows and bias): with
    random per-channel scales, the folded float32 model computes what the original does, through
    ComfyUI's own classes; scaling the consumers without the fold changes the output completely."""
    from comfy_modelopt.folding import Folds, fold_groups, producer_rows, read_rows_scaled
    from comfy_modelopt.pipeline import DictSource
    from comfy_modelopt.plan import make_plan
    from comfy_modelopt.recipe import Recipe
    _, sd = models.build(family, "small", seed=2, dtype=torch.float32)
    plan = make_plan({k: ("F32", tuple(v.shape)) for k, v in sd.items()}, Recipe("int8_tensorwise"))
    assert plan.family.name == family
    rel = {l.rel: l for l in plan.layers}
    groups = fold_groups(family, rel, set(sd))
    kinds = {(_block_relative(g.producer, family), _block_relative(g.consumers[0], family)) for g in groups}
    assert kinds == MODULATION_FOLDS[family], kinds
    g = torch.Generator().manual_seed(0)
    folds = Folds()
    for grp in groups:
        s = torch.exp(torch.randn(rel[grp.consumers[0]].k, generator=g) * 0.7)
        for c in grp.consumers:
            folds.consumer[c] = s
        for rows, offset in producer_rows(grp, rel[grp.producer].n):
            folds.rows.setdefault(grp.producer + ".weight", []).append((rows, 1 / s, 0.0))
            folds.rows.setdefault(grp.producer + ".bias", []).append((rows, 1 / s, offset))
    source = DictSource.from_state_dict(sd)
    folded, consumers_only = {}, {}
    for k in sd:
        t = read_rows_scaled(source, k, folds)
        if k[:-7] in folds.consumer and k.endswith(".weight"):
            t = t * folds.consumer[k[:-7]]
            consumers_only[k] = sd[k] * folds.consumer[k[:-7]]
        folded[k] = t
    consumers_only = {**sd, **consumers_only}

    def run(state):
        patcher = comfy.sd.load_diffusion_model_state_dict(dict(state))
        return forward(patcher, family)
    ref = run(sd)
    err = float((run(folded) - ref).norm() / ref.norm())
    broken = float((run(consumers_only) - ref).norm() / ref.norm())
    print(f"{family}: folded {err:.2e}, consumers only {broken:.3f}")
    assert err < 1e-4, err
    assert broken > 0.1, broken


@pytest.mark.parametrize("name", list(FORMATS))
def test_native_compute_read_without_comfyui_agrees_with_comfyuis_gates(name):
    """One truth for "does ComfyUI compute this format natively here?": the core's reading
    (native_sm, torch version) equals ComfyUI's own supports_*_compute predicates on this device
    (a CPU here, the H200 on the GPU machine)."""
    dev = comfy.model_management.get_torch_device()
    fmt = FORMATS[name]
    assert fmt.native_on(dev) == fmt.native_on(dev, comfy.model_management), (name, dev)


@pytest.mark.parametrize("path", ["fp8", "16-bit"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fp8_attention_override_takes_every_familys_attention_calls(source, family, path, monkeypatch):
    """Each family calls ComfyUI's attention its own way (heads by position or keyword, [B, N, H*D]
    or [B, H, N, D] in and out): the override reads all of them, on its FP8 path and on its 16-bit
    FlashAttention-3 path (the shorter calls).  On the CPU, with a torch re-statement of
    FlashAttention-3 (tests/test_attention8.py), the override's own work - layouts, and on the FP8
    path centring and per-head scales - is checked against the model's 16-bit output; the kernel
    runs on the GPU machine."""
    from comfy_modelopt.comfyui import attention as att
    from test_attention8 import fp8_attention_on_cpu, reference_kernel
    src, _, _, base = source(family)
    ran = []

    def kernel(*args, **kwargs):
        ran.append((args[0].shape, args[0].dtype))
        return reference_kernel(*args, **kwargs)
    fp8_attention_on_cpu(monkeypatch, att, kernel)
    if path == "16-bit":  # every self-attention call shorter than the FP8 length, of any head width
        monkeypatch.setattr(att, "FP8_MIN_TOKENS", 1 << 30)
        monkeypatch.setattr(att, "FA3_16BIT_MIN_TOKENS", 1)
        monkeypatch.setattr(att, "FA3_16BIT_HEAD_DIMS", range(1, 513))
    seen = []

    def spy(func, *args, **kwargs):
        seen.append(tuple(a.shape for a in args[:3]) + (args[0].dtype,))
        if path == "16-bit":  # ComfyUI computes in float32 on a CPU: the call as a GPU makes it, in bf16
            dtype = args[0].dtype
            args = (*(a.to(torch.bfloat16) for a in args[:3]), *args[3:])
            return att.fp8_attention_override(func, *args, **kwargs).to(dtype)
        return att.fp8_attention_override(func, *args, **kwargs)
    patcher = att._with_override(comfy.sd.load_diffusion_model(src, model_options={"dtype": torch.bfloat16}), spy)
    comfy.model_management.load_models_gpu([patcher])
    kw = inputs(family)
    x = kw.pop("x")
    with torch.inference_mode():  # as the sampler calls it: with the patcher's transformer options
        out = patcher.model.apply_model(x, torch.tensor([0.7]), transformer_options=patcher.model_options[
            "transformer_options"], **kw).float()
    assert seen, "the model never called ComfyUI's attention"
    assert ran, f"no attention call took the {path} path: {seen[:3]}"
    assert all((dtype == torch.float8_e4m3fn) == (path == "fp8") for _, dtype in ran), ran
    rel = float((out - base).norm() / base.norm())
    # the 16-bit path: bf16 Q/K/V alone (2e-5 to 9e-4 of the output here; keys and values swapped 0.005-0.25)
    assert 0 < rel < (0.1 if path == "fp8" else 0.002), rel


def test_compiled_blocks_trace_through_the_fp8_attention(source, monkeypatch):
    """`lean + compiled blocks + cuda graphs + fp8 attention`: the compiled blocks trace through
    the FP8 attention override (on the GPU FlashAttention-3's kernel is a torch custom op; here
    the torch re-statement of it), keep the block's options callable, and match eager."""
    from comfy_modelopt.comfyui import attention as att
    from comfy_modelopt.comfyui.compiled_blocks import CompiledBlocks, rounding_noise
    from comfy_modelopt.comfyui.lean import make_lean
    from test_attention8 import fp8_attention_on_cpu, reference_kernel
    ran = []

    def kernel(*args, **kwargs):
        ran.append(torch.compiler.is_compiling())
        return reference_kernel(*args, **kwargs)
    fp8_attention_on_cpu(monkeypatch, att, kernel)
    src, folder, _, _ = source("wan")
    out = str(folder / "wan-fp8-compiled-attention.safetensors")
    assert cli.main(["quantize", src, "-o", out, "--format", "float8_e4m3fn", "--weight-scale", "absmax",
                     "--overwrite", "-q"]) == 0
    patcher = att._with_override(ownloader.load_file(out), att.fp8_attention_override)
    comfy.model_management.load_models_gpu([patcher])
    assert make_lean(patcher) > 0
    kw = inputs("wan")
    x = kw.pop("x")
    t, topts = torch.tensor([0.7]), patcher.model_options["transformer_options"]
    with torch.inference_mode():
        run = lambda: patcher.model.apply_model(x, t, transformer_options=topts, **kw)  # noqa: E731
        ref = run()
        assert ran, "no attention call took the fp8 path"
        ran.clear()
        cb = CompiledBlocks(patcher.model.diffusion_model)
        ok = cb.validate(run, ref, lambda: patcher.model.apply_model(rounding_noise(x, torch.bfloat16), t,
                                                                     transformer_options=topts, **kw))
    assert ok, cb.reason
    assert any(ran), "the compiler never traced the fp8 attention"  # inside the compiled blocks
    assert cb.checks[-1]["rel_l2"] <= cb.checks[-1]["limit"], cb.checks[-1]


def test_nvfp4_layers_run_w4a8_where_it_can(source):
    """Where W4A8 can run (fp8 tensor cores before native nvfp4; on a CPU Triton's interpreter
    stands for such a GPU: a process of its own, as the interpreter is chosen at import), a
    lean runtime gives every nvfp4 layer of the model Load Quantized Model builds the W4A8 forward,
    the runtime line counts them, and the model's output is ComfyUI's (the stock loader's,
    computed dequantized) within W4A8's roundings; compiled blocks leave those layers opaque and
    match eager."""
    pytest.importorskip("triton", reason="Triton is not installed")
    src, folder, _, _ = source("flux")
    out = str(folder / "flux-nvfp4-w4a8.safetensors")
    assert cli.main(["quantize", src, "-o", out, "--format", "nvfp4", "--weight-scale", "absmax",
                     "--overwrite", "-q"]) == 0
    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path[:0] = [{here!r}, {os.path.join(here, "..", "..", "benchmarks")!r}]
        import architectures as models
        models.setup_comfy()
        import comfy.model_management, comfy.sd
        from comfy_modelopt.comfyui import fourbit, kernels as lean, ownloader
        from comfy_modelopt.comfyui.runtime import apply_runtime
        from test_contract import inputs

        def args(patcher):
            comfy.model_management.load_models_gpu([patcher])
            kw = {{k: v.to(patcher.load_device) for k, v in inputs("flux").items()}}
            return kw.pop("x"), torch.tensor([0.7], device=patcher.load_device), kw

        def run(patcher):
            x, t, kw = args(patcher)
            with torch.inference_mode():
                return patcher.model.apply_model(x, t, **kw).float().cpu()

        ref = run(comfy.sd.load_diffusion_model({out!r}))
        patcher, note = apply_runtime(ownloader.load_file({out!r}), "lean")
        got = run(patcher)
        choices = list(fourbit._CHOICE.values())
        fourbit.MAX_ROWS, fourbit._CHOICE = 0, {{}}  # every call too many rows for the one-kernel way
        got_expanded = run(patcher)
        expanded_choices = list(fourbit._CHOICE.values())
        from comfy_modelopt import w4a8
        kind, w4a8.kind = w4a8.kind, lambda device: "int8"  # a GPU with int8 tensor cores only (Ampere)
        int8_calls, linear_int8 = [], w4a8.linear_int8
        w4a8.linear_int8 = lambda x, *a, **k: int8_calls.append(x.shape[0]) or linear_int8(x, *a, **k)
        fourbit._CHOICE = {{}}
        run(patcher)  # calls of fewer rows than INT8_MIN_ROWS (modulation, text tokens) stay dequantized
        per_sample_rows, int8_calls = int8_calls, []
        min_rows, w4a8.INT8_MIN_ROWS, fourbit._CHOICE = w4a8.INT8_MIN_ROWS, 1, {{}}
        got_int8 = run(patcher)
        int8_choices = list(fourbit._CHOICE.values())
        w4a8.kind, w4a8.INT8_MIN_ROWS, w4a8.linear_int8 = kind, min_rows, linear_int8
        layers = [m for m in patcher.model.diffusion_model.modules() if getattr(m, "quant_format", None)]
        # compiled blocks around the W4A8 layers (opaque), checked against eager
        from comfy_modelopt.comfyui import traced_layers
        from comfy_modelopt.comfyui.compiled_blocks import CompiledBlocks, rounding_noise
        kinds, trace = [], traced_layers.traced_forward

        def spy(m, untraced):
            f = trace(m, untraced)
            if f is not None:
                kinds.append(m._modelopt.traced[0].__name__)
            return f
        traced_layers.traced_forward = spy
        x, t, kw = args(patcher)
        with torch.inference_mode():
            eager = lambda: patcher.model.apply_model(x, t, **kw)
            cb = CompiledBlocks(patcher.model.diffusion_model)
            ok = cb.validate(eager, eager(), lambda: patcher.model.apply_model(rounding_noise(x, torch.bfloat16), t,
                                                                              **kw))
        traced = len(kinds) - kinds.count("linear") - kinds.count("conv2d")
        print(json.dumps({{"layers": len(layers), "w4a8": lean.W4A8Kernel.count(patcher.model.diffusion_model),
                          "note": note, "rel": float((got - ref).norm() / ref.norm()),
                          "rel_expanded": float((got_expanded - ref).norm() / ref.norm()),
                          "rel_int8": float((got_int8 - ref).norm() / ref.norm()), "int8_choices": int8_choices,
                          "int8_rows": sorted(set(per_sample_rows)), "int8_rows_all": sorted(set(int8_calls)),
                          "min_rows": min_rows,
                          "choices": choices, "expanded_choices": expanded_choices,
                          "compiled": bool(ok), "reason": cb.reason,
                          "traced": traced, "compiled_rel": cb.checks[-1]["rel_l2"] if cb.checks else None}}))
    """)
    env = dict(os.environ, **({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["layers"] > 0 and said["w4a8"] == said["layers"], said
    assert f"{said['layers']} 4-bit ones run W4A8" in said["note"], said["note"]
    if torch.cuda.is_available():  # each shape timed: any way may win at these small shapes
        assert said["choices"] and set(said["choices"]) <= {"one kernel", "expanded", "dequantized"}, said
        assert said["expanded_choices"] and set(said["expanded_choices"]) <= {"expanded", "dequantized"}, said
        assert said["int8_choices"] and set(said["int8_choices"]) <= {"int8", "dequantized"}, said
    else:  # the interpreter: nothing timed, the one-kernel way then (MAX_ROWS = 0) the expanded one
        assert said["choices"] == said["expanded_choices"] == said["int8_choices"] == [], said
        assert said["rel_int8"] > 0, said
        assert said["rel_expanded"] > 0, said  # 0 would be the dequantized path
    # the input's and the products' E4M3 roundings, nothing more (0 would be the dequantized path)
    assert 0 < said["rel"] < 0.05 and said["rel_expanded"] < 0.05 and said["rel_int8"] < 0.05, said
    # the int8 way only for calls of INT8_MIN_ROWS rows or more (the image tokens here), every call
    # when that is 1 (a modulation's one row too)
    assert said["int8_rows"] and min(said["int8_rows"]) >= said["min_rows"], said
    assert min(said["int8_rows_all"]) < said["min_rows"], said
    assert said["compiled"] and said["traced"] == 0, said  # opaque: their forward decides per call
