"""The streamed writer and the validating reader, against safetensors itself."""
import errno
import json
import os
import random
import struct

import pytest
import torch
from safetensors.torch import load_file, save

from comfy_modelopt.safetensors_io import CheckpointError, SafetensorsFile, StreamWriter, tensor_entry

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint8, torch.int8, torch.int32, torch.int64, torch.float64, torch.bool]


def sample_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        for j in range(3):
            shape = [(3, 5), (7,), (), (2, 0)][(i + j) % 4]
            t = torch.randn(shape, generator=g) * 10
            out[f"layer{j}.{dt}".replace("torch.", "")] = t.to(dt)
    out["model.scalar"] = torch.tensor(1.5)
    return out


def stream(path, tensors, metadata=None, order=None):
    entries = {k: tensor_entry(v) for k, v in tensors.items()}
    with StreamWriter(path, entries, metadata) as w:
        keys = list(tensors)
        if order == "shuffle":
            random.Random(0).shuffle(keys)
        for k in keys:
            w.write(k, tensors[k])
        return w.close()


@pytest.mark.parametrize("metadata", [None, {"only": "one entry, with \"quotes\" and é"}])
def test_bytes_equal_safetensors_serialization(tmp_path, metadata):
    tensors = sample_tensors()
    path = stream(str(tmp_path / "a.safetensors"), tensors, metadata, order="shuffle")
    assert open(path, "rb").read() == save(tensors, metadata=metadata)


def test_many_metadata_entries_round_trip(tmp_path):
    # safetensors orders __metadata__ from a hash map, so compare parsed, not bytes
    tensors = sample_tensors(1)
    meta = {f"k{i}": f"v{i}" for i in range(10)}
    path = stream(str(tmp_path / "b.safetensors"), tensors, meta)
    ref = save(tensors, metadata=meta)
    ours = open(path, "rb").read()
    n, m = struct.unpack("<Q", ours[:8])[0], struct.unpack("<Q", ref[:8])[0]
    assert n == m and json.loads(ours[8:8 + n]) == json.loads(ref[8:8 + m])
    assert ours[8 + n:] == ref[8 + m:]


def test_reader_round_trip(tmp_path):
    tensors = sample_tensors(2)
    path = stream(str(tmp_path / "c.safetensors"), tensors, {"x": "y"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"x": "y"}
        for k, v in tensors.items():
            got = f.read(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got,
                               v.reshape(-1).view(torch.uint8) if v.numel() else v)
    ref = load_file(path)
    assert set(ref) == set(tensors)


def test_interrupted_write_leaves_nothing(tmp_path):
    tensors = sample_tensors()
    out = tmp_path / "out.safetensors"
    entries = {k: tensor_entry(v) for k, v in tensors.items()}
    with pytest.raises(KeyboardInterrupt):
        with StreamWriter(str(out), entries) as w:
            w.write(next(iter(tensors)), next(iter(tensors.values())))
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_missing_tensor_fails_at_close_and_leaves_nothing(tmp_path):
    tensors = sample_tensors()
    out = tmp_path / "out.safetensors"
    w = StreamWriter(str(out), {k: tensor_entry(v) for k, v in tensors.items()})
    w.write("model.scalar", tensors["model.scalar"])
    with pytest.raises(RuntimeError, match="never written"):
        w.close()
    assert os.listdir(tmp_path) == []


def test_wrong_shape_is_named(tmp_path):
    w = StreamWriter(str(tmp_path / "o.safetensors"), {"a.weight": ("BF16", (2, 3))})
    with pytest.raises(ValueError, match=r"a.weight: planned BF16\[2, 3\], got F32\[2, 3\]"):
        w.write("a.weight", torch.zeros(2, 3))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_existing_output_refused(tmp_path):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        StreamWriter(str(out), {"a": ("F32", (1,))})
    assert out.read_bytes() == b"keep me"


def test_no_space_left_fails_before_work(tmp_path, monkeypatch):
    def full(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="no space left"):
        StreamWriter(str(tmp_path / "o.safetensors"), {"a": ("F32", (1024,))})
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- bad input
def write_raw(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def test_not_safetensors(tmp_path):
    p = tmp_path / "model.ckpt"
    p.write_bytes(b"PK\x03\x04" + os.urandom(100))
    with pytest.raises(CheckpointError, match="model.ckpt: not a safetensors file"):
        SafetensorsFile(str(p))
    p.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        SafetensorsFile(str(p))


def test_truncated_file(tmp_path):
    path = stream(str(tmp_path / "t.safetensors"), sample_tensors())
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(path)


def test_header_lies_about_sizes(tmp_path):
    p = write_raw(tmp_path / "lie.safetensors",
                  {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}, bytes(32))
    with pytest.raises(CheckpointError, match=r"lie.safetensors: w: header says F32\[4, 4\] \(64 bytes\)"):
        SafetensorsFile(p)


def test_overlapping_offsets(tmp_path):
    p = write_raw(tmp_path / "o.safetensors",
                  {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    with pytest.raises(CheckpointError, match="b: data_offsets overlap or leave a gap"):
        SafetensorsFile(p)


def test_unknown_dtype(tmp_path):
    p = write_raw(tmp_path / "d.safetensors",
                  {"w": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(CheckpointError, match="w: unsupported dtype 'Q4_K'"):
        SafetensorsFile(p)


def test_header_not_json(tmp_path):
    p = tmp_path / "j.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(CheckpointError, match="header is not JSON"):
        SafetensorsFile(str(p))


def test_failed_open_never_closes_another_files_descriptor(tmp_path):
    """A header that fails to parse closes its descriptor once; collecting the failed reader
    later must not close the same number again (by then another file may hold it)."""
    import gc
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 2) + b"[]")
    good = stream(str(tmp_path / "good.safetensors"), sample_tensors())
    with pytest.raises(CheckpointError) as failed:  # keeps the failed reader alive for now
        SafetensorsFile(str(bad))
    with SafetensorsFile(good) as f:  # takes the lowest free number: the one the failed reader had
        del failed                    # the failed reader goes now, while this file is open
        gc.collect()
        for k in f.keys():
            f.read(k)
