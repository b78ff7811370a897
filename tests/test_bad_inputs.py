"""Wrong inputs and common mistakes on the command line: each case's exact exit code and the first
line the user reads, checked before any work (nothing is written on a refusal)."""
import pickle
import subprocess
import sys

import pytest
import torch

from comfy_modelopt import cli
from comfy_modelopt.calibrate import calibrate
from comfy_modelopt.safetensors_io import write_file
from comfy_modelopt.statsfile import save_stats


def _lora_kohya(path):
    write_file(path, {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(4, 64),
                      "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(192, 4),
                      "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0)})


def _lora_peft(path):
    write_file(path, {f"transformer.single_transformer_blocks.{i}.attn.to_q.lora_{ab}.weight": torch.randn(8, 8)
                      for i in range(8) for ab in "AB"})


def _t5(path):
    t = {"shared.weight": torch.randn(256, 64)}
    for i in range(4):
        t[f"encoder.block.{i}.layer.0.SelfAttention.q.weight"] = torch.randn(64, 64)
        t[f"encoder.block.{i}.layer.1.DenseReluDense.wi.weight"] = torch.randn(128, 64)
    write_file(path, t)


def _clip(path):
    write_file(path, {f"text_model.encoder.layers.{i}.self_attn.q_proj.weight": torch.randn(64, 64) for i in range(6)})


def _vae(path):
    write_file(path, {"encoder.conv_in.weight": torch.randn(32, 3, 3, 3), "decoder.conv_out.weight": torch.randn(3, 32, 3, 3),
                      "encoder.mid.attn_1.q.weight": torch.randn(32, 32), "decoder.mid.attn_1.q.weight": torch.randn(32, 32)})


def _unknown(path):
    write_file(path, {f"blocks.{i}.mlp.fc{j}.weight": torch.randn(64, 64) for i in range(4) for j in (1, 2)})


def _pickle(path):
    with open(path, "wb") as f:
        pickle.dump({"state_dict": {"a": 1}}, f)


def _other_stats(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with torch.inference_mode():
        st = calibrate(model, lambda m: m(torch.randn(4, 64)))
    return save_stats(st, str(tmp_path / "other-stats.safetensors"))


# (name, make the source (or None: the Flux file), CLI arguments after "quantize SRC", exit code,
#  the first line's text)
CASES = [
    ("lora kohya", _lora_kohya, [], 2,
     "this looks like a LoRA / LyCORIS adapter (e.g. key lora_unet_double_blocks_0_img_attn_qkv.alpha), not a "
     "diffusion model"),
    ("lora peft", _lora_peft, [], 2, "this looks like a LoRA / LyCORIS adapter"),
    ("t5 encoder", _t5, [], 2, "this looks like a T5 text encoder"),
    ("clip encoder", _clip, [], 2, "this looks like a CLIP text encoder"),
    ("vae", _vae, [], 2, "this looks like a VAE"),
    ("unknown architecture", _unknown, [], 2, "no diffusion-model architecture comfy-modelopt knows, and no "
                                             "diffusion-model structure (numbered attention + MLP blocks beside a "
                                             "timestep embedding): pass --family generic"),
    ("smoothing without stats", None, ["--smoothing", "awq", "--format", "nvfp4"], 2,
     "smoothing=awq needs activation statistics"),
    ("static nvfp4 input without stats", None, ["--format", "nvfp4", "--static-nvfp4-input"], 2,
     "static_nvfp4_input needs activation statistics"),
    ("keep everything", None, ["--keep", "*"], 2, "nothing was quantized: all 23 Linear layers would stay 16-bit "
                                                  "(--keep: 23)"),
    ("output not .safetensors", None, ["-o", "{tmp}/out.ckpt"], 2,
     "out.ckpt: the output is a safetensors file; give it the .safetensors extension"),
    ("output folder missing", None, ["-o", "{tmp}/nodir/out.safetensors"], 2, "nodir does not exist (create it first)"),
    ("output is a folder", None, ["-o", "{tmp}/adir.safetensors", "--overwrite"], 2,
     "adir.safetensors is a folder; give a file name"),
    ("input is a folder", "{tmp}", [], 2, "is a folder, not a .safetensors file"),
    ("input is a pickle", _pickle, [], 2, "it looks like a pickled PyTorch checkpoint (.ckpt/.pt), which this tool "
                                          "never unpickles"),
    ("input missing", "{tmp}/missing.safetensors", [], 2, "missing.safetensors: cannot open (No such file or "
                                                          "directory)"),
    ("device gpu", None, ["--device", "gpu"], 2, "--device gpu: not a device; use cpu, cuda, cuda:N or auto"),
    ("stats of another model", None, ["--stats", "{stats}"], 2,
     "statistics are from another model: only 0 of their 1 layers exist in this model (the statistics have e.g. "
     "0; this model has e.g. double_blocks.0.img_attn.proj"),
    ("unknown format", None, ["--format", "fp8"], 2, "invalid choice: 'fp8'"),
]


@pytest.mark.parametrize("name,make,args,code,first", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, flux_file, capsys, name, make, args, code, first):
    (tmp_path / "adir.safetensors").mkdir()
    if make is None:
        src = flux_file
    elif isinstance(make, str):
        src = make.format(tmp=tmp_path)
    else:
        src = str(tmp_path / f"{name.replace(' ', '-')}.safetensors")
        make(src)
    fill = {"tmp": tmp_path, "stats": _other_stats(tmp_path) if "{stats}" in args else ""}
    args = [a.format(**fill) for a in args]
    out = [] if "-o" in args else ["-o", str(tmp_path / "out.safetensors")]
    if first.startswith("invalid choice"):
        with pytest.raises(SystemExit) as e:
            cli.main(["quantize", src, *out, "-q", *args])
        rc = e.value.code
    else:
        rc = cli.main(["quantize", src, *out, "-q", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code, (rc, err)
    line = next(l for l in err if "error:" in l)
    assert first in line, line
    assert len(line) < 600 and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_generic_family_quantizes_an_unknown_architecture(tmp_path, capsys):
    src = str(tmp_path / "arch.safetensors")
    _unknown(src)
    assert cli.main(["quantize", src, "-o", str(tmp_path / "o.safetensors"), "-q", "--family", "generic"]) == 0
    assert "family: unknown" in capsys.readouterr().out


def test_unmatched_keep_patterns_warn_each(flux_file, tmp_path, capsys):
    rc = cli.main(["quantize", flux_file, "-o", str(tmp_path / "o.safetensors"), "-q",
                   "--keep", "img_in.weight", "--keep", "nomatch*", "--keep", "final_layer.*"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "warning: --keep img_in.weight matched no layer (layer names have no .weight suffix)" in out
    assert "warning: --keep nomatch* matched no layer" in out
    assert "--keep final_layer.* matched" not in out


def test_kept_summary_line_says_why(flux_file, tmp_path, capsys):
    assert cli.main(["quantize", flux_file, "-o", str(tmp_path / "o.safetensors"), "-q", "--format", "convrot_w4a4",
                     "--keep", "*.txt_mlp.*"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("kept 16-bit:"))
    assert "family rules:" in line and "--keep: 2" in line


def test_inspect_into_a_closed_pipe_exits_quietly(flux_file):
    code = (f"import sys; from comfy_modelopt import cli; sys.exit(cli.main(['inspect', {flux_file!r}]))")
    p = subprocess.run(f"{sys.executable} -c \"{code}\" | head -c 10", shell=True, capture_output=True, text=True)
    assert "Broken pipe" not in p.stderr and "Traceback" not in p.stderr


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["quantize", "--help"])
    text = capsys.readouterr().out
    for default in ("(default: float8_e4m3fn)", "(default: auto)", "(default: mse)", "(default: 99.99)",
                    "(default: auto)", "(default: 256)"):
        assert default in text.replace("\n", " ").replace("  ", " ") or default in " ".join(text.split()), default
