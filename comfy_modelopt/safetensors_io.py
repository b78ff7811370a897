"""Bounded-memory safetensors reading and atomic, streamed writing.

The reader validates the header against the file (offsets, sizes, dtypes) and reads one tensor
at a time with positioned reads, so memory never holds more than the tensor asked for (no mmap:
touched mmap pages would count as resident for the whole run).

The writer plans the whole header first (names, dtypes, shapes -> offsets), reserves the file,
then takes tensors in any order and writes each at its offset.  It writes to a temporary file in
the destination folder and renames it into place only after every tensor arrived and the data is
fsynced; on any error the temporary file is removed, so an interrupted run leaves no output.
Its bytes equal ``safetensors.torch.save`` of the same tensors and metadata (same ordering:
dtype rank descending then name, same JSON, same 8-byte padding).
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass

import torch

# safetensors' Dtype enum order (ascending); files order tensors by rank descending, then name.
DTYPE_ORDER = ("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
               "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64")
_RANK = {name: i for i, name in enumerate(DTYPE_ORDER)}

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "U64": torch.uint64,
}
ST_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in TORCH_DTYPES.items()}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")

MAX_HEADER = 100 * 1024 * 1024  # the limit safetensors itself enforces


class CheckpointError(ValueError):
    """A file that is not a readable safetensors checkpoint; the message names file and key."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str               # safetensors dtype name, e.g. "BF16"
    shape: tuple
    start: int               # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """Validated header plus positioned reads of single tensors."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        try:
            self.size = os.path.getsize(self.path)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.metadata, self.tensors, self.header_size = self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    # ------------------------------------------------------------------ header
    def _fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.name}: {msg}")

    def _parse(self):
        if self.size < 8:
            raise self._fail(f"not a safetensors file ({self.size} bytes, no header)")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > MAX_HEADER or n + 8 > self.size:
            raise self._fail(f"not a safetensors file, or truncated: header length {n} "
                             f"does not fit in {self.size} bytes")
        raw = os.pread(self._fd, n, 8)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"not a safetensors file: header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._fail("not a safetensors file: header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._fail("__metadata__ must map strings to strings")
        base = 8 + n
        tensors = {}
        for key, info in header.items():
            tensors[key] = self._tensor_info(key, info, base)
        self._check_layout(tensors, base)
        return metadata, tensors, n

    def _tensor_info(self, key, info, base) -> TensorInfo:
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise self._fail(f"{key}: malformed header entry {info!r}") from None
        if dtype not in TORCH_DTYPES:
            raise self._fail(f"{key}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise self._fail(f"{key}: bad shape {shape!r}")
        expected = math.prod(shape) * ITEMSIZE[dtype]
        if not (isinstance(start, int) and isinstance(end, int)) or end - start != expected:
            raise self._fail(f"{key}: header says {dtype}{shape} ({expected} bytes) but its "
                             f"data_offsets span [{start}, {end}]")
        return TensorInfo(key, dtype, tuple(shape), base + start, base + end)

    def _check_layout(self, tensors, base) -> None:
        pos = base
        for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
            if t.start != pos:
                raise self._fail(f"{t.name}: data_offsets overlap or leave a gap "
                                 f"(starts at {t.start - base}, expected {pos - base})")
            pos = t.end
        if pos != self.size:
            if pos > self.size:
                raise self._fail(f"truncated: header describes {pos} bytes, file has {self.size}")
            raise self._fail(f"{self.size - pos} trailing bytes after the last tensor")

    # ------------------------------------------------------------------ access
    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key) -> bool:
        return key in self.tensors

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``, freshly allocated (never a view of a file mapping)."""
        info = self.tensors[key]
        buf = bytearray(info.nbytes)
        view = memoryview(buf)
        got = 0
        while got < info.nbytes:
            n = os.preadv(self._fd, [view[got:]], info.start + got)
            if n <= 0:
                raise self._fail(f"{key}: unexpected end of file")
            got += n
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])
        return torch.frombuffer(buf, dtype=TORCH_DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ====================================================================== writing
def header_bytes(entries: dict[str, tuple[str, tuple]], metadata: dict[str, str] | None
                 ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """safetensors header (padded to 8 bytes) and each tensor's data offsets."""
    order = sorted(entries, key=lambda k: (-_RANK[entries[k][0]], k))
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offsets = {}
    pos = 0
    for key in order:
        dtype, shape = entries[key]
        size = math.prod(shape) * ITEMSIZE[dtype]
        offsets[key] = (pos, pos + size)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw, offsets


class StreamWriter:
    """Write a planned safetensors file tensor by tensor, atomically.

    ``entries`` maps every output key to (safetensors dtype, shape); ``metadata`` is the header
    ``__metadata__``.  ``finalize_metadata`` (called at close) may replace metadata values whose
    serialized length does not change (fixed-width numbers filled in after the run).
    """

    def __init__(self, path: str, entries: dict[str, tuple[str, tuple]],
                 metadata: dict[str, str] | None = None, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        if os.path.exists(self.path) and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass overwrite to replace it")
        self.entries = dict(entries)
        self.metadata = dict(metadata or {})
        self._header, self.offsets = header_bytes(self.entries, self.metadata)
        self._data_start = 8 + len(self._header)
        self.total_size = self._data_start + (max((e for _, e in self.offsets.values()), default=0))
        self._pending = set(self.entries)
        folder = os.path.dirname(self.path)
        fd, self.tmp_path = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.",
                                             suffix=".partial", dir=folder)
        self._fd = fd
        try:
            _reserve(fd, self.total_size, self.path)
            os.pwrite(fd, struct.pack("<Q", len(self._header)) + self._header, 0)
        except BaseException:
            self.abort()
            raise

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if key not in self.entries:
            raise KeyError(f"{key}: not in the planned output")
        if key not in self._pending:
            raise ValueError(f"{key}: written twice")
        dtype, shape = self.entries[key]
        got = (ST_DTYPES.get(tensor.dtype), tuple(tensor.shape))
        if got != (dtype, tuple(shape)):
            raise ValueError(f"{key}: planned {dtype}{list(shape)}, got {got[0]}{list(got[1])}")
        start, end = self.offsets[key]
        data = _as_bytes(tensor)
        _pwrite_all(self._fd, data, self._data_start + start)
        self._pending.discard(key)

    def close(self, metadata: dict[str, str] | None = None) -> str:
        """Check completeness, fill final metadata, fsync and rename into place."""
        try:
            if self._pending:
                missing = sorted(self._pending)
                raise RuntimeError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
            if metadata is not None:
                header, offsets = header_bytes(self.entries, metadata)
                if len(header) != len(self._header) or offsets != self.offsets:
                    raise RuntimeError("final metadata changed the header length")
                os.pwrite(self._fd, header, 8)
                self.metadata = dict(metadata)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.tmp_path, self.path)
            _fsync_dir(os.path.dirname(self.path))
            return self.path
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the whole file up front: a full disk fails here, before any work."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        import errno
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left for {path} ({size / 2**30:.2f} GiB needed)") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
            raise
        os.ftruncate(fd, size)  # filesystems without fallocate


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a CPU tensor (valid while the returned view's owner lives)."""
    t = t.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    buf._owner = t  # keep the tensor alive as long as the buffer
    return memoryview(buf).cast("B")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _fsync_dir(folder: str) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def tensor_entry(t: torch.Tensor) -> tuple[str, tuple]:
    return ST_DTYPES[t.dtype], tuple(t.shape)


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
               overwrite: bool = False, on_tensor=None) -> str:
    """Atomically write ``tensors`` (same bytes as ``safetensors.torch.save``).  ``on_tensor(i)``
    runs after each tensor (progress, interruption)."""
    with StreamWriter(path, {k: tensor_entry(v) for k, v in tensors.items()}, metadata, overwrite) as w:
        for i, (k, v) in enumerate(tensors.items()):
            w.write(k, v)
            if on_tensor is not None:
                on_tensor(i)
        return w.close()
