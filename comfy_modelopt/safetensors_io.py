"""Bounded-memory safetensors reading and atomic, streamed writing.
Design: docs/design.md, ``safetensors_io.py``.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import math
import os
import struct
import tempfile
from dataclasses import dataclass

import torch

from .errors import CheckpointError, one_line
from .publish import (check_output_path, fsync_dir, partial_prefix, publish, pwrite_all, remove_stale_partials, reserve,
                      target_mode)

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

# Bounds on what a header may make us parse or allocate.  safetensors itself allows a 100 MB
# header; parsing one of tiny entries costs ~16x its size in memory and tens of seconds, while
# the largest real diffusion checkpoints (video models, with our report) need ~2 MB.
MAX_HEADER = 16 * 1024 * 1024
MAX_TENSORS = 200_000
MAX_DIM = 1 << 40                # no real tensor has a dimension near this
MAX_NUMEL = 1 << 62              # what an int64 element count can hold
INCOMPLETE = ("incomplete file (interrupted write): its header length was never written, so no "
              "reader will load it; delete it and run the job again")


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
        self._fd = -1
        if os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: is a folder, not a .safetensors file")
        try:
            self.size = os.path.getsize(self.path)
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self.metadata, self.tensors, self.header_size = self._parse()
        except BaseException:
            # close() marks the descriptor closed: __del__ must not close its number again
            # later, when it may belong to another open file
            self.close()
            raise

    # ------------------------------------------------------------------ header
    def _fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.name}: {msg}")

    def _parse(self):
        if self.size < 8:
            raise self._fail(f"not a safetensors file ({self.size} bytes, no header)")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n == 0 and self.size > 8:
            raise self._fail(INCOMPLETE)
        if n + 8 > self.size:
            raise self._fail(f"not a safetensors file, or truncated: header length {n} does not fit in "
                             f"{self.size} bytes" + _pickle_hint(self._fd))
        if n > MAX_HEADER:
            raise self._fail(f"header of {n / 2**20:.1f} MiB is larger than the {MAX_HEADER >> 20} MiB "
                             f"this tool reads (a diffusion model's header is a few MiB at most)")
        raw = os.pread(self._fd, n, 8)
        if raw.count(b'"data_offsets"') > MAX_TENSORS:
            raise self._fail(f"more than {MAX_TENSORS} tensors in the header: not a model this tool reads")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except _DuplicateKey as e:
            raise self._fail(f"header names {str(e)[:200]!r} twice (safetensors forbids duplicate keys)") from None
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise self._fail(f"not a safetensors file: header is not JSON ({one_line(e)[:200]})") from None
        if not isinstance(header, dict):
            raise self._fail("not a safetensors file: header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._fail("__metadata__ must map strings to strings")
        for k, v in metadata.items():
            if not (_encodable(k) and _encodable(v)):
                raise self._fail(f"__metadata__ entry {k[:80]!r} is not valid UTF-8 text")
        base = 8 + n
        tensors = {}
        for key, info in header.items():
            if not _encodable(key):
                raise self._fail(f"tensor name {key[:80]!r} is not valid UTF-8 text")
            tensors[key] = self._tensor_info(key, info, base)
        self._check_layout(tensors, base)
        return metadata, tensors, n

    def _tensor_info(self, key, info, base) -> TensorInfo:
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise self._fail(f"{key}: malformed header entry {one_line(repr(info))[:200]}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in TORCH_DTYPES:
            raise self._fail(f"{key}: unsupported dtype {one_line(repr(dtype))[:80]}")
        if not isinstance(shape, list) or not all(is_int(d) and 0 <= d < MAX_DIM for d in shape):
            raise self._fail(f"{key}: bad shape {one_line(repr(shape))[:200]}")
        if math.prod(d for d in shape if d) >= MAX_NUMEL:
            raise self._fail(f"{key}: shape {shape} has more elements than any tensor can")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
            raise self._fail(f"{key}: bad data_offsets {one_line(repr(offsets))[:200]}")
        start, end = offsets
        expected = math.prod(shape) * ITEMSIZE[dtype]
        if start < 0 or end - start != expected:
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
        try:
            info = self.tensors[key]
        except KeyError:
            raise self._fail(f"no tensor {key!r}") from None
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
        if getattr(self, "_fd", -1) >= 0:
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


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes
        return False


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _pickle_hint(fd: int) -> str:
    """A hint when the file starts like a pickle or zip (.ckpt/.pt/.bin): never unpickled here."""
    head = os.pread(fd, 4, 0)
    if head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05") or head == b"PK\x03\x04":
        return (" - it looks like a pickled PyTorch checkpoint (.ckpt/.pt), which this tool never "
                "unpickles (unsafe); convert it to .safetensors with a tool you trust")
    return ""


# ====================================================================== writing
def entries_nbytes(entries: dict[str, tuple[str, tuple]]) -> int:
    """Data bytes of planned entries (key -> (safetensors dtype, shape))."""
    return sum(math.prod(shape) * ITEMSIZE[dtype] for dtype, shape in entries.values())


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
    ``__metadata__``.  ``close(metadata)`` may replace metadata values whose serialized length
    does not change (fixed-width numbers filled in after the run).

    What no interruption can break:
    - the data goes to a hidden ``.<name>.<random>.partial`` in the destination folder, renamed
      into place only after every tensor arrived and was fsynced;
    - until then its 8-byte header length is zero, so a partial left by ``kill -9`` or a power
      cut is no safetensors file to any reader (``inspect`` calls it an incomplete file) even
      when all its tensors happen to be written;
    - the writer holds an exclusive ``flock`` on its partial; a later writer to the same target
      removes partials whose lock it can take (their owner died), never a live run's;
    - without ``overwrite`` the final step is link-or-fail: of two runs racing for one output
      the later gets ``OutputExistsError`` instead of silently replacing the earlier's file;
    - the file gets the mode a new file gets under the umask (an overwritten file keeps its own).
    """

    def __init__(self, path: str, entries: dict[str, tuple[str, tuple]],
                 metadata: dict[str, str] | None = None, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.overwrite = overwrite
        folder = check_output_path(self.path, overwrite)
        self.entries = dict(entries)
        self.metadata = dict(metadata or {})
        self._header, self.offsets = header_bytes(self.entries, self.metadata)
        self._data_start = 8 + len(self._header)
        self.total_size = self._data_start + (max((e for _, e in self.offsets.values()), default=0))
        self._pending = set(self.entries)
        remove_stale_partials(self.path)
        self._fd = -1
        fd, self.tmp_path = tempfile.mkstemp(prefix=partial_prefix(self.path), suffix=".partial", dir=folder)
        self._fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, target_mode(self.path))
            reserve(fd, self.total_size, self.path)
            # the length prefix stays zero until close(): see the class docstring
            os.pwrite(fd, self._header, 8)
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
        pwrite_all(self._fd, data, self._data_start + start)
        self._pending.discard(key)

    def close(self, metadata: dict[str, str] | None = None) -> str:
        """Check completeness, fill final metadata, fsync, mark complete and move into place."""
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
            os.fsync(self._fd)                       # every tensor is on disk ...
            os.pwrite(self._fd, struct.pack("<Q", len(self._header)), 0)
            os.fsync(self._fd)                       # ... before the file says it is whole
            publish(self.tmp_path, self.path, self.overwrite)
            fsync_dir(os.path.dirname(self.path))
            os.close(self._fd)
            self._fd = -1
            return self.path
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        try:
            os.unlink(self.tmp_path)
        except (FileNotFoundError, AttributeError):
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a CPU tensor (valid while the returned view's owner lives)."""
    t = t.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    buf._owner = t  # keep the tensor alive as long as the buffer
    return memoryview(buf).cast("B")


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
