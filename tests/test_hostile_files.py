"""Hostile and damaged files: every reader fails with our own one-line error naming the file
(and the key where there is one) - no traceback, no hang, no unbounded allocation - or reads
the file correctly.  Hand-made cases first, then a seeded fuzz run over real outputs.

More fuzz cases: COMFY_MODELOPT_FUZZ=20000 scripts/test.sh tests/test_hostile_files.py
"""
import json
import os
import random
import re
import resource
import struct
import time

import pytest
import torch

from comfy_modelopt import cli
from comfy_modelopt.checkpoint import inspect_file
from comfy_modelopt.errors import CalibrationError, CheckpointError, ModelOptError, PlanError
from comfy_modelopt.pipeline import quantize_file
from comfy_modelopt.recipe import Recipe
from comfy_modelopt.safetensors_io import SafetensorsFile, write_file
from comfy_modelopt.statsfile import load_stats, save_stats
from comfy_modelopt.verify import verify_file

FUZZ_CASES = int(os.environ.get("COMFY_MODELOPT_FUZZ", "2000"))
CASE_SECONDS = 2.0


def raw_file(path, header: bytes, data: bytes = b"", length=None):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return str(path)


def entry(dtype="F32", shape=(1,), start=0, end=4):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}


def header(d, meta=None) -> bytes:
    if meta is not None:
        d = dict(d, __metadata__=meta)
    return json.dumps(d).encode()


def assert_our_error(exc: BaseException, path):
    """One line, our type, naming the file."""
    assert isinstance(exc, ModelOptError), f"{type(exc).__name__}: {exc}"
    text = str(exc)
    assert "\n" not in text, text
    assert os.path.basename(str(path)) in text, text


# ============================================================== hand-made headers
HOSTILE = {
    "deep nesting": lambda: b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "dtype is a list": lambda: header({"w": entry(dtype=["F32"])}),
    "dtype is a dict": lambda: header({"w": entry(dtype={"x": 1})}),
    "5000-digit integer": lambda: b'{"w":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}',
    "shape [0, 2**63]": lambda: header({"w": entry(shape=(0, 2 ** 63), end=0)}),
    "shape [true, 4]": lambda: header({"w": entry(shape=(True, 1), end=4)}),
    "negative offsets": lambda: header({"w": entry(start=-4, end=0)}),
    "offsets as strings": lambda: json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}).encode(),
    "extra entry field": lambda: header({"w": dict(entry(), extra=1)}),
    "entry is a list": lambda: header({"w": [1, 2]}),
    "metadata not strings": lambda: header({"w": entry()}, {"a": 1}),
    "lone surrogate in metadata": lambda: b'{"__metadata__":{"a":"\\ud800"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "lone surrogate in a key": lambda: b'{"\\udfff":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    "duplicate key (F32 -> I32 swap)": lambda: (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                                b'"w":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}'),
    "header is a list": lambda: b"[1,2,3]",
    "not utf-8": lambda: b'{"\xff\xfe":1}',
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_is_one_clear_error(tmp_path, case, capsys):
    path = raw_file(tmp_path / "bad.safetensors", HOSTILE[case](), b"\0" * 4)
    with pytest.raises(ModelOptError) as e:
        SafetensorsFile(path)
    assert_our_error(e.value, path)
    assert cli.main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad.safetensors") and err.count("\n") == 1, err


def test_duplicate_keys_refused_like_safetensors(tmp_path):
    path = raw_file(tmp_path / "dup.safetensors", HOSTILE["duplicate key (F32 -> I32 swap)"](), b"\0" * 4)
    with pytest.raises(CheckpointError, match="twice"):
        SafetensorsFile(path)


def test_huge_header_refused_before_parsing(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:  # sparse: 40 MiB claimed, nothing allocated
        f.write(struct.pack("<Q", 40 << 20))
        f.truncate(8 + (40 << 20))
    with pytest.raises(CheckpointError, match="larger than"):
        SafetensorsFile(str(path))


def test_pickle_checkpoint_named(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"\x80\x02" + os.urandom(4000))
    with pytest.raises(CheckpointError, match="never unpickles"):
        SafetensorsFile(str(path))


def test_folder_as_input(tmp_path, capsys):
    assert cli.main(["quantize", str(tmp_path), "-o", str(tmp_path / "o.safetensors")]) == 2
    assert "is a folder" in capsys.readouterr().err


# ============================================================== hostile payloads in valid files
def _q_file(tmp_path, flux_file, fmt="float8_e4m3fn"):
    out = tmp_path / f"{fmt}.safetensors"
    quantize_file(flux_file, str(out), Recipe(fmt, weight_scale="absmax"))
    return out


def _rewrite(src, dst, change_tensors=None, change_meta=None):
    with SafetensorsFile(str(src)) as f:
        tensors = {k: f.read(k) for k in f.keys()}
        meta = dict(f.metadata)
    if change_tensors:
        change_tensors(tensors)
    if change_meta:
        change_meta(meta)
    write_file(str(dst), tensors, meta)
    return str(dst)


def _set_conf(value):
    def change(tensors):
        key = next(k for k in tensors if k.endswith(".comfy_quant"))
        tensors[key] = value
    return change


@pytest.mark.parametrize("payload, match", [
    (torch.zeros(4), "1-D U8"),
    (torch.frombuffer(bytearray(b"[]"), dtype=torch.uint8), "JSON object"),
    (torch.frombuffer(bytearray(b'{"format":[1]}'), dtype=torch.uint8), "string 'format'"),
    (torch.frombuffer(bytearray(b"\xff\xfe"), dtype=torch.uint8), "not a JSON layer config"),
    (torch.zeros(1 << 20, dtype=torch.uint8), "too large"),
])
def test_bad_comfy_quant_named(tmp_path, flux_file, payload, match):
    bad = _rewrite(_q_file(tmp_path, flux_file), tmp_path / "bad.safetensors", _set_conf(payload))
    problems = [str(p) for p in inspect_file(bad).problems]  # reported, with the rest of the file
    assert any(".comfy_quant: " in p and re.search(match, p) for p in problems), problems
    with pytest.raises(CheckpointError, match=match) as e:
        verify_file(bad).raise_for(os.path.basename(bad))
    assert_our_error(e.value, bad)
    assert ".comfy_quant" in str(e.value)


def test_malformed_quantization_metadata_is_a_problem(tmp_path, flux_file):
    def change(meta):
        meta["_quantization_metadata"] = "{not json"
    bad = _rewrite(_q_file(tmp_path, flux_file), tmp_path / "bad.safetensors", change_meta=change)
    r = inspect_file(bad)  # ComfyUI parses it before the layers' own configs: a problem, not a note
    assert [str(p) for p in r.problems][0].startswith("_quantization_metadata: is not JSON"), r.problems


@pytest.mark.parametrize("key, value", [
    ("comfy_modelopt.report", "{}"), ("comfy_modelopt.report", '{"family":1,"layers":[]}'),
    ("comfy_modelopt.report", "[" * 50_000), ("comfy_modelopt.recipe", "{bad"),
])
def test_malformed_own_metadata_named(tmp_path, flux_file, key, value):
    bad = _rewrite(_q_file(tmp_path, flux_file), tmp_path / "bad.safetensors",
                   change_meta=lambda m: m.__setitem__(key, value))
    with pytest.raises(CheckpointError, match=key) as e:
        inspect_file(bad)
    assert_our_error(e.value, bad)


# ============================================================== hostile sources for quantize
def _source(tmp_path, flux_file, change):
    return _rewrite(flux_file, tmp_path / "src.safetensors", change)


@pytest.mark.parametrize("part", ["weight_scale", "weight_scale_2", "smooth_scale", "input_scale", "lowrank_up"])
def test_stray_quantization_tensor_in_source_named(tmp_path, flux_file, part):
    def change(t):
        name = next(k for k in t if k.endswith("img_attn.qkv.weight"))[:-7]
        t[f"{name}.{part}"] = torch.ones(16, dtype=torch.bfloat16)
    src = _source(tmp_path, flux_file, change)
    with pytest.raises(PlanError, match=rf"img_attn\.qkv\.{part}: a quantization tensor") as e:
        quantize_file(src, str(tmp_path / "o.safetensors"), Recipe("float8_e4m3fn"))
    assert_our_error(e.value, src)
    assert not (tmp_path / "o.safetensors").exists()


def test_empty_linear_weight_refused_by_key(tmp_path, flux_file):
    """An empty Linear weight beside its bias: a model ComfyUI would not build, refused before
    any work, naming the tensor and the rule."""
    def change(t):
        key = next(k for k in t if k.endswith("img_mlp.0.weight"))
        t[key] = torch.zeros(0, t[key].shape[1], dtype=torch.bfloat16)
    with pytest.raises(PlanError, match=r"src\.safetensors: double_blocks\.0\.img_mlp\.0\.bias: has shape \[1024\], "
                                        r"its layer's weight \[0, 256\] needs \[0\]"):
        quantize_file(_source(tmp_path, flux_file, change), str(tmp_path / "o.safetensors"), Recipe("nvfp4"))


def test_nonfinite_source_tensors_refused_or_copied_by_key(tmp_path, flux_file):
    def change(t):
        bias = next(k for k in t if k.endswith("img_attn.qkv.bias"))
        t[bias] = t[bias].clone()
        t[bias][3] = float("inf")
        kept = next(k for k in t if k.endswith("final_layer.linear.weight"))
        t[kept] = t[kept].clone()
        t[kept][0, :2] = float("nan")
    src = _source(tmp_path, flux_file, change)
    with pytest.raises(ModelOptError, match=r"img_attn\.qkv\.bias: holds 1 NaN/Inf values.*--allow-nonfinite") as e:
        quantize_file(src, str(tmp_path / "o.safetensors"), Recipe("float8_e4m3fn"))  # refused by default
    assert_our_error(e.value, src)
    assert not (tmp_path / "o.safetensors").exists() and not any(p.endswith(".partial") for p in os.listdir(tmp_path))
    rep = quantize_file(src, str(tmp_path / "o.safetensors"), Recipe("float8_e4m3fn", allow_nonfinite=True))
    note = next(n for n in rep.notes if "NaN/Inf" in n)
    assert "img_attn.qkv.bias (1)" in note and "final_layer.linear.weight (2)" in note
    with SafetensorsFile(str(tmp_path / "o.safetensors")) as f:  # the note is in the file too
        assert "NaN/Inf" in f.metadata["comfy_modelopt.report"]


def test_non_2d_linear_weights_reported(tmp_path):
    from comfy_modelopt.synthetic import flux_layout, write_checkpoint
    flux2 = str(tmp_path / "flux2.safetensors")  # two blocks: the other one shows what is a Linear
    write_checkpoint(flux2, flux_layout(hidden=256, depth=2, depth_single=1, context_in=256, vec_in=256))

    def change(t):
        key = next(k for k in t if k.endswith("double_blocks.0.img_mlp.2.weight"))
        t[key] = t[key].reshape(t[key].shape[0], 2, -1)
    rep = quantize_file(_source(tmp_path, flux2, change), str(tmp_path / "o.safetensors"),
                        Recipe("float8_e4m3fn"))
    note = next(n for n in rep.notes if "not 2-D" in n)
    assert "double_blocks.0.img_mlp.2.weight" in note


def test_layer_too_large_for_memory_refused_before_reading(tmp_path, flux_file, monkeypatch):
    import comfy_modelopt.sources as sources
    monkeypatch.setattr(sources, "available_memory", lambda: 1 << 20)  # 1 MiB left
    with pytest.raises(ModelOptError, match="GiB of memory") as e:
        quantize_file(flux_file, str(tmp_path / "o.safetensors"), Recipe("float8_e4m3fn"))
    assert_our_error(e.value, flux_file)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(flux_file)]  # the source, nothing else


# ============================================================== statistics files
def _stats_file(tmp_path, flux_file):
    from comfy_modelopt.calibrate import calibrate
    from comfy_modelopt.synthetic import flux_layout
    from conftest import TINY_FLUX
    from helpers import LinearTree
    tree = LinearTree(flux_layout(**TINY_FLUX), scale_amax=10.0)
    st = calibrate(tree, lambda mod: [mod(i) for i in range(2)])
    return save_stats(st, str(tmp_path / "stats.safetensors"))


def _edit_stats(path, out, fn):
    with SafetensorsFile(path) as f:
        tensors = {k: f.read(k) for k in f.keys()}
        meta = dict(f.metadata)
    fn(tensors, meta)
    return write_file(str(out), tensors, meta)


def _first(tensors, part):
    return next(k for k in tensors if k.endswith("::" + part))


@pytest.mark.parametrize("case, match", [
    ("nan amax", "NaN, Inf or negative"),
    ("negative channel", "NaN, Inf or negative"),
    ("wrong-K reservoir", "reservoir must be"),
    ("short channel_absmax", "channel_absmax must be"),
    ("header k disagrees", "fingerprint says"),
    ("header not json", "not JSON"),
    ("rows as string", "malformed entry"),
])
def test_corrupted_statistics_named(tmp_path, flux_file, case, match):
    path = _stats_file(tmp_path, flux_file)

    def change(t, meta):
        doc = json.loads(meta["comfy_modelopt.stats"])
        name = next(iter(doc["layers"]))
        if case == "nan amax":
            t[_first(t, "amax")] = torch.tensor([float("nan")])
        elif case == "negative channel":
            k = _first(t, "channel_absmax")
            t[k] = t[k].clone()
            t[k][0] = -1.0
        elif case == "wrong-K reservoir":
            k = _first(t, "reservoir")
            t[k] = t[k][:, :-1].contiguous()
        elif case == "short channel_absmax":
            k = _first(t, "channel_absmax")
            t[k] = t[k][:-1].contiguous()
        elif case == "header k disagrees":
            doc["layers"][name]["k"] += 1
        elif case == "rows as string":
            doc["layers"][name]["rows"] = "12"
        if case == "header not json":
            meta["comfy_modelopt.stats"] = "{"
        else:
            meta["comfy_modelopt.stats"] = json.dumps(doc)
    bad = _edit_stats(path, tmp_path / "bad-stats.safetensors", change)
    with pytest.raises(CalibrationError, match=match) as e:
        load_stats(bad)
    assert_our_error(e.value, bad)


# ============================================================== the fuzz run
def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    n_header = struct.unpack("<Q", bytes(b[:8]))[0]
    hdr_end = min(len(b), 8 + n_header)
    kind = rng.randrange(9)
    if kind == 0:    # flip bytes in the header
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(8, hdr_end)] = rng.randrange(256)
    elif kind == 1:  # flip bytes anywhere
        for _ in range(rng.randint(1, 16)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 2:  # truncate
        del b[rng.randrange(len(b)):]
    elif kind == 3:  # append junk
        b += os.urandom(rng.randint(1, 64))
    elif kind == 4:  # a new length prefix
        b[:8] = struct.pack("<Q", rng.choice([0, 1, n_header - 1, n_header + 1, rng.randrange(1 << 63)]))
    elif kind == 5:  # swap a JSON token in the header
        text = bytes(b[8:hdr_end])
        tokens = [b'"F32"', b'"BF16"', b'"U8"', b'"F8_E4M3"', b"[", b"]", b"{", b"}", b",", b":", b"0",
                  b"-1", b"true", b"null", b'"format"', b'"layers"', b"1e308", b"9" * 30]
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice(tokens) + text[at + rng.randint(0, 4):]
        b = bytearray(struct.pack("<Q", len(text)) + text + bytes(b[hdr_end:]))
    elif kind == 6:  # change a digit in the header (shapes, offsets, numbers)
        digits = [i for i in range(8, hdr_end) if 48 <= b[i] <= 57]
        if digits:
            b[rng.choice(digits)] = rng.randrange(48, 58)
    elif kind == 7:  # corrupt a stored JSON string inside metadata (escapes, quotes)
        text = bytes(b[8:hdr_end])
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice([b'\\"', b"\\\\", b"\\u00", b'\\"{', b"}", b'\\"format\\":7']) + text[at:]
        b = bytearray(struct.pack("<Q", len(text)) + text + bytes(b[hdr_end:]))
    else:            # scribble over tensor data (comfy_quant payloads live there)
        for _ in range(rng.randint(1, 32)):
            if hdr_end < len(b):
                b[rng.randrange(hdr_end, len(b))] = rng.randrange(256)
    return bytes(b)


def _fuzz(tmp_path, originals, n, run, seed, limit=CASE_SECONDS):
    rng = random.Random(seed)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    slow, outcomes = [], {"ok": 0, "error": 0}
    for i in range(n):
        name, data = originals[i % len(originals)]
        path = tmp_path / f"fz-{name}"
        path.write_bytes(_mutate(data, rng))
        t0 = time.perf_counter()
        try:
            run(str(path))
            outcomes["ok"] += 1
        except Exception as e:  # noqa: BLE001 - the point: only our errors may come out
            assert_our_error(e, path)
            outcomes["error"] += 1
        took = time.perf_counter() - t0
        if took > limit:
            slow.append((i, took))
    assert not slow, f"cases over {limit:.1f}s: {slow[:5]}"
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    assert grown < 512 << 20, f"peak memory grew by {grown >> 20} MiB"
    assert outcomes["error"] > n // 10  # the mutations do break files
    return outcomes


def _inspect_and_read(path):
    inspect_file(path)
    with SafetensorsFile(path) as f:
        for k in f.keys():
            f.read(k)


def test_fuzz_readers(tmp_path, flux_file):
    originals = [("bf16.safetensors", open(flux_file, "rb").read())]
    for fmt in ("float8_e4m3fn", "nvfp4"):
        originals.append((f"{fmt}.safetensors", _q_file(tmp_path, flux_file, fmt).read_bytes()))
    _fuzz(tmp_path, originals, FUZZ_CASES, _inspect_and_read, seed=1234)


def test_fuzz_statistics(tmp_path, flux_file):
    data = open(_stats_file(tmp_path, flux_file), "rb").read()
    _fuzz(tmp_path, [("stats.safetensors", data)], max(200, FUZZ_CASES // 10), load_stats, seed=99)


def test_fuzz_quantize(tmp_path, flux_file):
    data = open(flux_file, "rb").read()
    out = tmp_path / "out.safetensors"

    def run(path):
        try:
            quantize_file(path, str(out), Recipe("float8_e4m3fn", weight_scale="absmax"), overwrite=True)
        finally:
            leftovers = [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
            assert not leftovers, leftovers
    t0 = time.perf_counter()
    run(flux_file)
    # a whole quantize is not instant: no mutated file may take much longer than the valid one
    limit = max(5.0, 4 * (time.perf_counter() - t0))
    _fuzz(tmp_path, [("src.safetensors", data)], max(40, FUZZ_CASES // 50), run, seed=7, limit=limit)
