"""The CLI end to end on Flux-layout files: outputs, metadata, rules and every bad input."""
import json
import os

import pytest
import torch

from comfy_modelopt import cli
from comfy_modelopt.checkpoint import inspect_file
from comfy_modelopt.formats import FORMATS, get_format
from comfy_modelopt.errors import PlanError
from comfy_modelopt.pipeline import quantize_file
from comfy_modelopt import report as report_mod
from comfy_modelopt.recipe import Recipe
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file
from comfy_modelopt.synthetic import flux_layout, tensor_for

from conftest import TINY_FLUX


def run(*args):
    return cli.main([str(a) for a in args])


def read_all(path):
    with SafetensorsFile(path) as f:
        return {k: f.read(k) for k in f.keys()}, dict(f.metadata)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantize_every_format(flux_file, tmp_path, fmt, capsys):
    out = tmp_path / f"{fmt}.safetensors"
    assert run("quantize", flux_file, "-o", out, "--format", fmt, "-q") == 0
    tensors, meta = read_all(out)
    qmeta = json.loads(meta["_quantization_metadata"])
    marked = {k[:-12] for k in tensors if k.endswith(".comfy_quant")}
    assert marked == set(qmeta["layers"]) and marked
    for layer in marked:
        conf = json.loads(bytes(tensors[layer + ".comfy_quant"].tolist()))
        assert conf == qmeta["layers"][layer] and conf["format"] == fmt
        assert tensors[layer + ".weight"].dtype != torch.bfloat16
    # detection-critical and first/last layers stay bf16
    for kept in ("img_in", "txt_in", "time_in.in_layer", "vector_in.in_layer", "guidance_in.in_layer",
                 "final_layer.linear", "final_layer.adaLN_modulation.1"):
        assert kept not in marked and tensors[kept + ".weight"].dtype == torch.bfloat16
    assert meta["comfy_modelopt.family"] == "flux"
    assert json.loads(meta["comfy_modelopt.recipe"])["format"] == fmt
    report = json.loads(meta["comfy_modelopt.report"])
    assert set(report["layers"]) >= marked
    # every non-weight tensor passes through bit-exactly
    src, _ = read_all(flux_file)
    for k, v in src.items():
        if not k.endswith(".weight") or k[:-7] not in marked:
            assert torch.equal(tensors[k], v), k
    if FORMATS[fmt].needs_input_scale:
        assert all(qmeta["layers"][l].get("full_precision_matrix_mult") for l in marked)
        assert "weight-only" in capsys.readouterr().out


def test_errors_reported_per_layer(flux_file, tmp_path):
    out = tmp_path / "o.safetensors"
    report = quantize_file(flux_file, str(out), Recipe("nvfp4"))
    src, _ = read_all(flux_file)
    fmt = get_format("nvfp4")
    with SafetensorsFile(str(out)) as f:
        for l in report.quantized:
            stored = {"": f.read(l.name + ".weight"), "_scale": f.read(l.name + ".weight_scale"),
                      "_scale_2": f.read(l.name + ".weight_scale_2")}
            w = src[l.name + ".weight"].float()
            deq = fmt.from_stored(stored, {"format": "nvfp4"}, tuple(w.shape)).dequantize()
            assert abs(float((deq - w).norm() / w.norm()) - l.rel_err) < 1e-6
            assert 0 < l.rel_err < 0.2


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "nvfp4", "convrot_w4a4"])
def test_mse_never_worse_than_absmax(flux_file, tmp_path, fmt):
    mse = quantize_file(flux_file, str(tmp_path / "a.safetensors"), Recipe(fmt, weight_scale="mse"))
    ab = quantize_file(flux_file, str(tmp_path / "b.safetensors"), Recipe(fmt, weight_scale="absmax"))
    for m, a in zip(mse.quantized, ab.quantized):
        assert m.rel_err <= a.rel_err * (1 + 2e-3), m.name


def test_full_checkpoint_passes_vae_and_text_encoder_through(tmp_path):
    layout = flux_layout(**TINY_FLUX)
    extra = {"first_stage_model.decoder.conv_in.weight": (64, 16, 3, 3),
             "first_stage_model.decoder.mid.attn_1.q.weight": (64, 64),
             "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight": (1000, 64),
             "text_encoders.clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight": (256, 64)}
    tensors = {"model.diffusion_model." + k: tensor_for(k, v) for k, v in layout.items()}
    tensors.update({k: tensor_for(k, v) for k, v in extra.items()})
    src = tmp_path / "full.safetensors"
    write_file(str(src), tensors)
    out = tmp_path / "full-fp8.safetensors"
    assert run("quantize", src, "-o", out, "--format", "int8_tensorwise", "-q") == 0
    got, meta = read_all(out)
    for k in extra:
        assert torch.equal(got[k], tensors[k])
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    assert layers and all(n.startswith("model.diffusion_model.") for n in layers)
    assert "model.diffusion_model.double_blocks.0.img_attn.qkv" in layers
    assert inspect_file(str(out)).prefix == "model.diffusion_model."


def test_keep_pattern(flux_file, tmp_path):
    out = tmp_path / "o.safetensors"
    assert run("quantize", flux_file, "-o", out, "--format", "int8_tensorwise", "--keep", "single_blocks.*",
               "--keep", "*.img_mlp.*", "-q") == 0
    layers = json.loads(read_all(out)[1]["_quantization_metadata"])["layers"]
    assert not any(n.startswith("single_blocks.") or ".img_mlp." in n for n in layers)
    assert "double_blocks.0.txt_mlp.0" in layers


def test_output_exists_and_overwrite(flux_file, tmp_path, capsys):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    assert run("quantize", flux_file, "-o", out, "-q") == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == b"precious"
    assert run("quantize", flux_file, "-o", out, "--overwrite", "-q") == 0
    assert inspect_file(str(out)).kind == "comfy_modelopt"


def test_output_equals_source_refused(flux_file, capsys):
    before = open(flux_file, "rb").read()
    assert run("quantize", flux_file, "-o", flux_file, "--overwrite", "-q") == 2
    assert "overwrite the input model" in capsys.readouterr().err
    assert open(flux_file, "rb").read() == before


def test_nan_weight_refused_with_layer_name(tmp_path, capsys):
    layout = flux_layout(**TINY_FLUX)
    tensors = {k: tensor_for(k, v) for k, v in layout.items()}
    tensors["double_blocks.0.img_mlp.0.weight"][3, 7] = float("nan")
    src = tmp_path / "nan.safetensors"
    write_file(str(src), tensors)
    out = tmp_path / "o.safetensors"
    assert run("quantize", src, "-o", out, "-q") == 2
    err = capsys.readouterr().err
    assert "double_blocks.0.img_mlp.0: 1 NaN/Inf values" in err
    assert sorted(os.listdir(tmp_path)) == ["nan.safetensors"]


def test_interrupted_run_leaves_no_output(flux_file, tmp_path):
    out = tmp_path / "o.safetensors"

    def progress(done, total, name):
        if done == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        quantize_file(flux_file, str(out), Recipe("nvfp4"), progress=progress)
    assert os.listdir(tmp_path) == [os.path.basename(flux_file)]


def test_bad_source_files(tmp_path, capsys):
    bad = tmp_path / "model.ckpt"
    bad.write_bytes(b"\x80\x02}q\x00(X" + b"\x00" * 64)  # a pickle, never loaded
    assert run("quantize", bad, "-o", tmp_path / "o.safetensors", "-q") == 2
    assert "model.ckpt: not a safetensors file" in capsys.readouterr().err
    assert run("quantize", tmp_path / "missing.safetensors", "-o", tmp_path / "o.safetensors") == 2
    assert "cannot open" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_already_quantized_source_refused(flux_file, tmp_path, capsys):
    q = tmp_path / "q.safetensors"
    assert run("quantize", flux_file, "-o", q, "--format", "int8_tensorwise", "-q") == 0
    assert run("quantize", q, "-o", tmp_path / "qq.safetensors", "-q") == 2
    assert "already quantized" in capsys.readouterr().err


def test_unknown_family_refused_unless_generic_then_lists_kept(tmp_path):
    tensors = {"blocks.0.attn.qkv.weight": torch.randn(384, 128), "blocks.0.attn.out.weight": torch.randn(128, 128),
               "patch_embed.weight": torch.randn(128, 64), "final_proj.weight": torch.randn(64, 128)}
    src = tmp_path / "odd.safetensors"
    write_file(str(src), tensors)
    with pytest.raises(PlanError, match="odd.safetensors: no diffusion-model architecture .* --family generic"):
        quantize_file(str(src), str(tmp_path / "o.safetensors"), Recipe("int8_tensorwise"))
    assert not (tmp_path / "o.safetensors").exists()
    rep = quantize_file(str(src), str(tmp_path / "o.safetensors"), Recipe("int8_tensorwise"), family="generic")
    assert rep.family == "unknown"
    assert any("patch_embed" in n and "final_proj" in n for n in rep.notes)
    assert {l.name for l in rep.quantized} == {"blocks.0.attn.qkv", "blocks.0.attn.out"}


def test_report_json_and_table(flux_file, tmp_path, capsys):
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    assert run("quantize", flux_file, "-o", out, "--format", "nvfp4", "--report", rep, "--table", "-q") == 0
    d = json.loads(rep.read_text())
    assert d["recipe"]["format"] == "nvfp4" and d["layers"]
    assert "double_blocks.0.img_attn.qkv" in capsys.readouterr().out


def test_hash_flag_records_sha256(flux_file, tmp_path):
    import hashlib
    out = tmp_path / "o.safetensors"
    assert run("quantize", flux_file, "-o", out, "--hash", "-q") == 0
    src = json.loads(read_all(out)[1]["comfy_modelopt.source"])
    assert src["sha256"] == hashlib.sha256(open(flux_file, "rb").read()).hexdigest()
    assert src["bytes"] == os.path.getsize(flux_file)


def test_demo_runs(capsys):
    from comfy_modelopt.demo import run_demo
    rows = run_demo()
    assert {r["format"] for r in rows} == set(FORMATS) | {"int8_tensorwise+convrot"}
    assert all(r["verified"] for r in rows)
    by = {r["format"]: r for r in rows}
    assert by["nvfp4"]["ratio_vs_bf16"] < 0.45 and by["float8_e4m3fn"]["ratio_vs_bf16"] < 0.65


def test_lowrank_files_are_marked_for_our_loader(flux_file, tmp_path):
    # absmax scales on both sides: the comparison below is the branch's alone (nvfp4's block
    # clipping gains about as much as a rank-16 branch of these random weights)
    plain = quantize_file(flux_file, str(tmp_path / "p.safetensors"), Recipe("nvfp4", weight_scale="absmax"))
    out = tmp_path / "lr.safetensors"
    assert run("quantize", flux_file, "-o", out, "--format", "nvfp4", "--lowrank", "16", "--weight-scale", "absmax",
               "-q") == 0
    tensors, meta = read_all(out)
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    assert meta["comfy_modelopt.loader"] == "comfy-modelopt"
    for name, conf in layers.items():
        # not a ComfyUI QUANT_ALGOS key: stock ComfyUI refuses the file instead of dropping the branch
        assert conf["format"] == "modelopt_lowrank_nvfp4" and conf["rank"] == 16
        n, k = tensors[name + ".lowrank_up"].shape[0], tensors[name + ".lowrank_down"].shape[1]
        assert tensors[name + ".lowrank_up"].shape == (n, 16) and tensors[name + ".lowrank_down"].shape == (16, k)
        assert tensors[name + ".lowrank_up"].dtype == torch.bfloat16
    report = json.loads(meta["comfy_modelopt.report"])["layers"]
    for l in plain.quantized:  # the branch takes the largest singular directions out of the 4-bit part
        assert report[l.name]["rel_err"] < l.rel_err
    info = inspect_file(str(out))
    assert info.layers_by_format["modelopt_lowrank_nvfp4"] == 13 and info.kind == "comfy_modelopt_own"
    assert "Load Quantized Model" in info.description and "stock ComfyUI refuses" in info.description
    with pytest.raises(ValueError, match="low-rank branch is for 4-bit formats"):
        Recipe("float8_e4m3fn", lowrank=8)


UNET_CONVS = {"input_blocks.0.0.weight": (64, 4, 3, 3), "input_blocks.0.0.bias": (64,),
              "input_blocks.1.0.in_layers.2.weight": (64, 64, 3, 3),
              "input_blocks.1.0.out_layers.3.weight": (128, 64, 3, 3),
              "input_blocks.1.0.skip_connection.weight": (128, 64, 1, 1),
              "input_blocks.1.1.proj_in.weight": (128, 128, 1, 1),
              "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight": (128, 128),
              "input_blocks.1.1.transformer_blocks.0.ff.net.2.weight": (128, 512),
              "input_blocks.2.0.op.weight": (128, 128, 3, 3),
              "time_embed.0.weight": (256, 64), "out.2.weight": (4, 128, 3, 3)}


def test_conv_fp8_per_output_channel_for_our_loader(flux_file, tmp_path, capsys):
    src = tmp_path / "unet.safetensors"
    from comfy_modelopt.synthetic import write_checkpoint
    write_checkpoint(str(src), UNET_CONVS, seed=2)
    source, _ = read_all(src)
    out = tmp_path / "conv.safetensors"
    assert run("quantize", src, "-o", out, "--format", "float8_e4m3fn", "--conv", "fp8", "-q") == 0
    tensors, meta = read_all(out)
    layers = json.loads(meta["_quantization_metadata"])["layers"]
    convs = {n: c for n, c in layers.items() if c["format"] == "modelopt_conv_fp8"}
    # 3x3 convolutions only: the first/last conv and 1x1 ones (proj_in: ComfyUI's detection reads it) stay
    assert set(convs) == {"input_blocks.1.0.in_layers.2", "input_blocks.1.0.out_layers.3", "input_blocks.2.0.op"}
    for name, conf in convs.items():
        q, s, w = tensors[name + ".weight"], tensors[name + ".weight_scale"], source[name + ".weight"].float()
        o, i, kh, kw = conf["shape"]
        assert list(w.shape) == conf["shape"]
        # 2-D on disk: stock ComfyUI's load_state_dict fails on the shape instead of misreading it
        assert q.dtype == torch.float8_e4m3fn and q.shape == (o, i * kh * kw) and s.shape == (o,)
        # absmax per output channel, stored at 224: headroom for LoRA deltas (fp8 saturates at 448)
        assert torch.equal(q.float().abs().amax(dim=1), torch.full((o,), 224.0))
        deq = (q.float() * s[:, None]).view(o, i, kh, kw)
        assert float((deq - w).norm() / w.norm()) < 0.04
    for kept in ("input_blocks.0.0", "out.2", "input_blocks.1.1.proj_in", "input_blocks.1.0.skip_connection"):
        assert tensors[kept + ".weight"].dtype == torch.bfloat16 and tensors[kept + ".weight"].dim() == 4
    assert layers["input_blocks.1.1.transformer_blocks.0.attn1.to_q"]["format"] == "float8_e4m3fn"
    assert meta["comfy_modelopt.loader"] == "comfy-modelopt"
    report = json.loads(meta["comfy_modelopt.report"])["layers"]
    assert report["input_blocks.2.0.op"]["format"] == "modelopt_conv_fp8" and report["input_blocks.2.0.op"]["rel_err"] > 0
    info = inspect_file(str(out))
    assert info.kind == "comfy_modelopt_own" and info.layers_by_format["modelopt_conv_fp8"] == 3
    assert "convolutions: 3 fp8" in info.ours["summary"]
    # the progress bar counts the convolutions: it climbs monotonically and reaches its total only at the end
    calls = []
    quantize_file(str(src), str(tmp_path / "p.safetensors"), Recipe("float8_e4m3fn", conv="fp8"),
                  progress=lambda done, total, name: calls.append((done, total, name)))
    totals = {t for _, t, _ in calls}
    assert len(totals) == 1 and [d for d, _, _ in calls] == sorted(d for d, _, _ in calls)
    assert [c for c in calls if c[0] == c[1]] == [calls[-1]] and calls[-1][2] == ""
    assert {n for _, _, n in calls} >= set(convs)
    # a model without convolutions says so instead of writing a file that needs our loader for nothing
    capsys.readouterr()
    assert run("quantize", flux_file, "-o", tmp_path / "f.safetensors", "--conv", "fp8", "-q") == 2
    assert "no convolution to quantize" in capsys.readouterr().err
    assert not (tmp_path / "f.safetensors").exists()


def test_device_source_writes_the_same_file(flux_file, tmp_path):
    """Quantizing through DeviceSource (here onto the CPU itself) writes the same tensors, and
    tensors copied unchanged never take the trip to the device."""
    from comfy_modelopt import pipeline
    moved = []

    class Spy(pipeline.DeviceSource):
        def read(self, key):
            moved.append(key)
            return super().read(key)
    for recipe in (Recipe("nvfp4"), Recipe("int8_tensorwise", convrot=True)):
        a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
        quantize_file(flux_file, str(a), recipe, overwrite=True)
        with SafetensorsFile(flux_file) as f:
            pipeline.quantize(Spy(pipeline.FileSource(f), "cpu"), recipe, out=str(b), overwrite=True, refuse_unknown=False)
        ta, tb = read_all(a)[0], read_all(b)[0]
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
        quantized = {k[:-len(".comfy_quant")] + ".weight" for k in ta if k.endswith(".comfy_quant")}
        assert set(moved) == quantized, set(moved) ^ quantized
        moved.clear()


def test_cli_device_option(flux_file, tmp_path, capsys):
    out = tmp_path / "o.safetensors"
    assert run("quantize", flux_file, "-o", out, "--device", "cpu", "-q") == 0
    assert run("quantize", flux_file, "-o", out, "--device", "bogus", "--overwrite", "-q") == 2
    assert "--device bogus" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert run("quantize", flux_file, "-o", out, "--device", "cuda", "--overwrite", "-q") == 2
        assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: quantizing on the GPU")
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "nvfp4"])
def test_quantize_on_cuda_matches_cpu(flux_file, tmp_path, fmt):
    """The same file layout from the GPU, and per-layer errors as the CPU's (the clipping
    searches may break near-ties differently: within 2%)."""
    a, b = tmp_path / "cpu.safetensors", tmp_path / "cuda.safetensors"
    ra = quantize_file(flux_file, str(a), Recipe(fmt))
    rb = quantize_file(flux_file, str(b), Recipe(fmt), device="cuda")
    ta, tb = read_all(a)[0], read_all(b)[0]
    assert {k: (v.dtype, v.shape) for k, v in ta.items()} == {k: (v.dtype, v.shape) for k, v in tb.items()}
    ea = {l.name: l.rel_err for l in ra.layers if l.rel_err >= 0}
    eb = {l.name: l.rel_err for l in rb.layers if l.rel_err >= 0}
    assert ea.keys() == eb.keys() and ea
    assert all(abs(ea[n] - eb[n]) <= 0.02 * ea[n] + 1e-6 for n in ea), [(n, ea[n], eb[n]) for n in ea]


def test_long_layer_notes_are_cut_in_the_header_not_fatal(flux_file, tmp_path, monkeypatch):
    """The header's room for the report is reserved before the run from a per-layer estimate;
    layers whose notes outgrow it (long GPTQ / block-clip notes on every layer) are cut in the
    header - the run still writes its file, the whole notes stay in --report's JSON."""
    from comfy_modelopt import pipeline
    long = "x" * 2000
    real = pipeline.quantize_layer

    def noisy(*args, **kwargs):
        tensors, rep = real(*args, **kwargs)
        rep.notes = (rep.notes + "; " if rep.notes else "") + long
        return tensors, rep
    monkeypatch.setattr(pipeline, "quantize_layer", noisy)
    out, rep = tmp_path / "o.safetensors", tmp_path / "r.json"
    assert run("quantize", flux_file, "-o", out, "--format", "float8_e4m3fn", "--report", rep, "-q") == 0
    header = json.loads(read_all(out)[1]["comfy_modelopt.report"])
    whole = json.loads(rep.read_text())
    assert sum(long in l["notes"] for l in whole["layers"].values()) == 13  # every quantized layer
    cut = [l["notes"] for l in header["layers"].values() if l["notes"]]
    assert cut and all(len(n) <= max(report_mod.NOTES_CUTS) for n in cut) and any(n.endswith("...") for n in cut)
    assert inspect_file(str(out)).text()
