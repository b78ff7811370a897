"""What a whole-model run reads from and writes to.  A source has ``tensors`` (key ->
(safetensors dtype, shape)), ``metadata``, ``nbytes`` and ``read(key)``; a sink has
``open(entries, metadata)``, ``write(key, tensor)``, ``close(metadata)`` and ``abort()``."""
from __future__ import annotations

import hashlib
from typing import Callable

import torch

from .errors import QuantizeError
from .safetensors_io import ITEMSIZE, ST_DTYPES, SafetensorsFile, StreamWriter


class FileSource:
    def __init__(self, f: SafetensorsFile):
        self.f = f
        self.tensors = {k: (t.dtype, t.shape) for k, t in f.tensors.items()}
        self.metadata = dict(f.metadata)
        self.nbytes = {k: t.nbytes for k, t in f.tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.f.read(key)


class DictSource:
    """An in-memory state dict (tensors may be lazy: ``read`` calls ``loader(key)``)."""

    def __init__(self, shapes: dict, loader: Callable[[str], torch.Tensor], metadata: dict | None = None):
        self.tensors = dict(shapes)
        self.metadata = dict(metadata or {})
        self.nbytes = {k: ITEMSIZE[d] * numel(s) for k, (d, s) in self.tensors.items()}
        self.read = loader

    @classmethod
    def from_state_dict(cls, sd: dict, metadata: dict | None = None) -> "DictSource":
        return cls({k: (ST_DTYPES[v.dtype], tuple(v.shape)) for k, v in sd.items()}, sd.__getitem__, metadata)


class DeviceSource:
    """``source`` read onto ``device``: the quantization math (clipping and smoothing searches,
    GPTQ, low-rank splits) runs there - on a GPU a Flux-size model takes about a minute instead
    of 6-30 on a CPU - while the sink writes from the CPU.  Tensors copied unchanged skip the
    round trip (``base``)."""

    def __init__(self, source, device):
        self.base, self.device = source, torch.device(device)
        self.tensors, self.metadata, self.nbytes = source.tensors, source.metadata, source.nbytes

    def read(self, key: str) -> torch.Tensor:
        return self.base.read(key).to(self.device)


class FileSink:
    def __init__(self, path: str, overwrite: bool = False):
        self.path, self.overwrite, self.writer = path, overwrite, None

    def open(self, entries, metadata):
        self.writer = StreamWriter(self.path, entries, metadata, overwrite=self.overwrite)

    def write(self, key, tensor):
        self.writer.write(key, tensor)

    def close(self, metadata):
        return self.writer.close(metadata)

    def abort(self):
        if self.writer is not None:
            self.writer.abort()


class NullSink:
    """What a rank other than 0 writes in a sharded run: nothing (rank 0 writes the file)."""

    def open(self, entries, metadata):
        pass

    def write(self, key, tensor):
        pass

    def close(self, metadata):
        return None

    def abort(self):
        pass


class DictSink:
    """Collects the output state dict (on ``device``, CPU by default)."""

    def __init__(self, device="cpu"):
        self.tensors, self.metadata, self.device = {}, {}, device

    def open(self, entries, metadata):
        self.entries, self.metadata = entries, metadata

    def write(self, key, tensor):
        self.tensors[key] = tensor.to(self.device)

    def close(self, metadata):
        missing = set(self.entries) - set(self.tensors)
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors were never produced, e.g. {sorted(missing)[:3]}")
        self.metadata = metadata
        return self.tensors

    def abort(self):
        self.tensors.clear()


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def available_memory() -> int | None:
    """Bytes of memory the system can still give (Linux MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(source, key: str, float32_copies: int = 0) -> None:
    """Refuse a tensor whose read (plus ``float32_copies`` float32 working copies) would not fit
    in memory, before allocating it: a clear error instead of the OOM killer or a traceback."""
    dtype, shape = source.tensors[key]
    need = ITEMSIZE[dtype] * numel(shape) + 4 * numel(shape) * float32_copies
    have = available_memory()
    if have is not None and need > have:
        raise QuantizeError(f"{key}: {dtype}{list(shape)} needs about {need / 2**30:.1f} GiB of memory, "
                            f"only {have / 2**30:.1f} GiB is available (free memory, or --keep this layer)")


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
