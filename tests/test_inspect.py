"""inspect recognises every kind of file it meets."""
import json

import torch

from comfy_modelopt import cli
from comfy_modelopt.checkpoint import inspect_file
from comfy_modelopt.pipeline import quantize_file
from comfy_modelopt.recipe import Recipe
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file


def write(path, tensors, metadata=None):
    return write_file(str(path), tensors, metadata)


def load(path):
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f.keys()}, dict(f.metadata)


def test_ours(flux_file, tmp_path, capsys):
    out = tmp_path / "q.safetensors"
    quantize_file(flux_file, str(out), Recipe("nvfp4"))
    r = inspect_file(str(out))
    assert r.kind == "comfy_modelopt" and r.family == "flux"
    assert r.layers_by_format["nvfp4"] == 13 and r.layers_by_format["bf16"] == 10
    assert 0.2 < r.ratio < 0.6
    assert r.ours["recipe"]["format"] == "nvfp4" and "weight error" in r.ours["summary"]
    assert cli.main(["inspect", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "comfy_modelopt" and d["comfy_modelopt"]["source"]["name"] == "flux-bf16.safetensors"


def test_inspect_agrees_with_the_report(flux_file, tmp_path, capsys):
    """One computation, one number: the size ratio and the 16-bit layer count inspect prints equal
    the quantization report's, also for a full checkpoint whose VAE/text encoder pass through."""
    src = tmp_path / "full.safetensors"
    tensors, _ = load(flux_file)
    tensors = {"model.diffusion_model." + k: v for k, v in tensors.items()}
    tensors["first_stage_model.decoder.mid.attn_1.q.weight"] = torch.randn(64, 64)  # a 2-D VAE weight
    tensors["text_encoders.t5xxl.transformer.shared.weight"] = torch.randn(128, 64)
    write(src, tensors)
    for fmt in ("convrot_w4a4", "nvfp4", "float8_e4m3fn"):
        out = tmp_path / f"q-{fmt}.safetensors"
        rep = quantize_file(str(src), str(out), Recipe(fmt), overwrite=True)
        r = inspect_file(str(out))
        assert r.layers_by_format["bf16"] == len(rep.kept), fmt
        assert sum(n for label, n in r.layers_by_format.items() if label.startswith(fmt)) == len(rep.quantized)
        assert r.tensor_bytes == rep.total_bytes() and r.bytes_16bit == rep.total_bytes_16bit(), fmt
        assert f"({r.ratio:.3f}x)" in rep.summary(), (fmt, r.ratio, rep.summary())
        assert f"({r.ratio:.3f}x)" in r.text()


def test_stock_native_files(flux_file, tmp_path):
    out = tmp_path / "q.safetensors"
    quantize_file(flux_file, str(out), Recipe("int8_tensorwise", convrot=True))
    tensors, meta = load(str(out))
    stock_meta = {"_quantization_metadata": meta["_quantization_metadata"]}
    # .comfy_quant tensors and the header entry (what ComfyUI's own save writes)
    write(tmp_path / "a.safetensors", tensors, stock_meta)
    r = inspect_file(str(tmp_path / "a.safetensors"))
    assert r.kind == "comfyui_native" and r.layers_by_format["int8_tensorwise+convrot"] == 13
    # .comfy_quant only
    write(tmp_path / "b.safetensors", tensors)
    assert inspect_file(str(tmp_path / "b.safetensors")).layers_by_format["int8_tensorwise+convrot"] == 13
    # header entry only
    write(tmp_path / "c.safetensors", {k: v for k, v in tensors.items() if not k.endswith(".comfy_quant")},
          stock_meta)
    r = inspect_file(str(tmp_path / "c.safetensors"))
    assert r.kind == "comfyui_native" and r.layers_by_format["int8_tensorwise+convrot"] == 13


def test_legacy_scaled_fp8(tmp_path):
    w = (torch.randn(64, 64) * 10).to(torch.float8_e4m3fn)
    tensors = {"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn),
               "model.diffusion_model.double_blocks.0.img_attn.qkv.weight": w,
               "model.diffusion_model.double_blocks.0.img_attn.qkv.scale_weight": torch.tensor(0.01),
               "model.diffusion_model.double_blocks.0.img_attn.qkv.bias": torch.zeros(64, dtype=torch.bfloat16)}
    r = inspect_file(write(tmp_path / "s.safetensors", tensors))
    assert r.kind == "scaled_fp8" and r.layers_by_format == {"scaled_fp8": 1}
    assert "legacy" in r.text()


def test_old_node_pack_file(tmp_path):
    tensors = {"input_blocks.1.1.proj_in.weight_q": torch.zeros(320, 320, dtype=torch.float8_e4m3fn),
               "input_blocks.1.1.proj_in.weight_scale": torch.tensor(0.01),
               "input_blocks.1.1.proj_in.block_scale": torch.ones(320, 10),
               "input_blocks.1.1.proj_in.tensor_scale": torch.tensor(1.0),
               "input_blocks.1.1.proj_in.svd_u": torch.zeros(320, 3, dtype=torch.float16),
               "input_blocks.1.1.proj_in.use_svd": torch.tensor(True),
               "input_blocks.0.0.weight": torch.zeros(320, 4, 3, 3, dtype=torch.float16)}
    meta = {"_model_config": json.dumps({"precision": "nvfp4", "unet_config": {}}), "model_type": "EPS"}
    r = inspect_file(write(tmp_path / "old.safetensors", tensors, meta))
    assert r.kind == "old_modelopt_pack"
    assert r.layers_by_format == {"old:nvfp4": 1}
    assert "cannot load" in r.description


def test_unquantized(flux_file):
    r = inspect_file(flux_file)
    assert r.kind == "unquantized" and r.family == "flux"
    assert abs(r.ratio - 1.0) < 0.01
