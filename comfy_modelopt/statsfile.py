"""The statistics file: ``ActivationStats`` as safetensors - per layer ``NAME::amax``,
``::channel_absmax``, ``::channel_abssum``, ``::hist``, optionally ``::reservoir`` (bf16 rows) and
``::groups`` (each row's prompt), and a JSON header (format version, forward calls, what the
calibration saw, the model fingerprint).  Reading distrusts the file: every value is checked and
a bad one is a CalibrationError naming the file and the layer."""
from __future__ import annotations

import json

import torch

from .calls import RecordedCall
from .errors import CalibrationError, one_line
from .fileformat import META_STATS
from .safetensors_io import SafetensorsFile, is_int, write_file
from .stats import FORMAT_VERSION, HIST_BINS, ActivationStats, LayerStats


def save_stats(stats: ActivationStats, path: str, overwrite: bool = False) -> str:
    """Write ``stats`` as a safetensors file (atomic)."""
    tensors = {}
    per_layer = {}
    for name, s in stats.layers.items():
        s.to("cpu")
        per_layer[name] = {"k": s.k, "capacity": s.capacity, "calls": s.calls, "rows": s.rows,
                           "nonfinite": s.nonfinite, "seed": s.seed}
        if s.amax is None:
            continue
        tensors[f"{name}::amax"] = s.amax.reshape(1).float()
        tensors[f"{name}::channel_absmax"] = s.channel_absmax.float()
        tensors[f"{name}::channel_abssum"] = s.channel_abssum.double()
        tensors[f"{name}::hist"] = s.hist.long()
        if s.reservoir is not None:
            tensors[f"{name}::reservoir"] = s.reservoir.contiguous()
            if s.groups is not None and len(s.groups) == s.reservoir.shape[0]:
                tensors[f"{name}::groups"] = torch.tensor(s.groups, dtype=torch.int64)
    doc = {"format_version": FORMAT_VERSION, "forward_calls": stats.forward_calls, "info": stats.info,
           "fingerprint": stats.fingerprint, "layers": per_layer}
    signature = stats.first_call_signature()
    if signature is not None:  # the first model call described: what a runtime compiles ahead for
        doc["first_call"] = signature
    return write_file(path, tensors, {META_STATS: json.dumps(doc, sort_keys=True)}, overwrite=overwrite)


def load_stats(path: str) -> ActivationStats:
    """Read statistics saved by ``save_stats``; every value is checked (types, shapes against the
    layer's width and the fingerprint, finite non-negative statistics), and a bad one is a
    CalibrationError naming the file and the layer."""
    with SafetensorsFile(path) as f:
        raw = f.metadata.get(META_STATS)
        if raw is None:
            raise CalibrationError(f"{f.name}: not a comfy-modelopt statistics file "
                                   f"(no {META_STATS} header)")
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CalibrationError(f"{f.name}: {META_STATS} is not JSON ({one_line(e)[:120]})") from None
        if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION:
            version = doc.get("format_version") if isinstance(doc, dict) else None
            raise CalibrationError(f"{f.name}: statistics format {version!r} "
                                   f"is not supported (expected {FORMAT_VERSION})")
        stats = _load_doc(f, doc)
        if "first_call" in doc:  # a call of the described shapes, made-up values (refused: none)
            stats.first_call = RecordedCall.read(doc["first_call"], f.name)
    if stats.forward_calls == 0:
        raise CalibrationError(f"{f.name}: the calibration recorded no forward calls")
    return stats


_LAYER_FIELDS = ("k", "capacity", "calls", "rows", "nonfinite", "seed")


def _load_doc(f, doc: dict) -> "ActivationStats":
    where = f.name
    fingerprint, layers, info = doc.get("fingerprint"), doc.get("layers"), doc.get("info", {})
    calls = doc.get("forward_calls")
    if not (isinstance(fingerprint, dict) and isinstance(layers, dict) and isinstance(info, dict)
            and _count(calls)):
        raise CalibrationError(f"{where}: statistics header lacks fingerprint/layers/forward_calls")
    for name, nk in fingerprint.items():
        if not (isinstance(nk, list) and len(nk) == 2 and all(_count(d) for d in nk)):
            raise CalibrationError(f"{where}: fingerprint of layer {name} must be [out, in], got {nk!r:.80}")
    stats = ActivationStats(fingerprint=fingerprint, forward_calls=calls, info=info)
    for name, d in layers.items():
        if not (isinstance(d, dict) and all(_count(d.get(k)) for k in _LAYER_FIELDS)):
            raise CalibrationError(f"{where}: layer {name}: malformed entry {one_line(repr(d))[:120]}")
        if name in fingerprint and fingerprint[name][1] != d["k"]:
            raise CalibrationError(f"{where}: layer {name}: k={d['k']} but the fingerprint says "
                                   f"in_features={fingerprint[name][1]}")
        s = LayerStats(d["k"], d["capacity"], d["calls"], d["rows"], d["nonfinite"], seed=d["seed"])
        if f"{name}::amax" in f:
            _read_layer(f, name, s)
        elif d["rows"]:
            raise CalibrationError(f"{where}: layer {name}: saw {d['rows']} rows but has no statistics")
        stats.layers[name] = s
    return stats


def _read_layer(f, name: str, s: LayerStats) -> None:
    where = f"{f.name}: layer {name}"
    want = {"amax": ("F32", (1,)), "channel_absmax": ("F32", (s.k,)), "channel_abssum": ("F64", (s.k,)),
            "hist": ("I64", (HIST_BINS,))}
    for part, (dtype, shape) in want.items():
        key = f"{name}::{part}"
        info = f.tensors.get(key)
        if info is None or (info.dtype, info.shape) != (dtype, shape):
            got = "missing" if info is None else f"{info.dtype}{list(info.shape)}"
            raise CalibrationError(f"{where}: {part} must be {dtype}{list(shape)}, got {got}")
    s.amax = f.read(f"{name}::amax").reshape(())
    s.channel_absmax = f.read(f"{name}::channel_absmax")
    s.channel_abssum = f.read(f"{name}::channel_abssum")
    s.hist = f.read(f"{name}::hist")
    for part, t in (("amax", s.amax), ("channel_absmax", s.channel_absmax), ("channel_abssum", s.channel_abssum),
                    ("hist", s.hist)):
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise CalibrationError(f"{where}: {part} holds NaN, Inf or negative values (a corrupted "
                                   f"statistics file); calibrate again")
    if s.k and float(s.amax) != float(s.channel_absmax.max()):
        raise CalibrationError(f"{where}: amax {float(s.amax):g} disagrees with its channels' max "
                               f"{float(s.channel_absmax.max()):g}")
    key = f"{name}::reservoir"
    if key in f:
        info = f.tensors[key]
        rows = min(s.rows, s.capacity)
        if info.dtype != "BF16" or info.shape != (rows, s.k):
            raise CalibrationError(f"{where}: reservoir must be BF16{[rows, s.k]}, got "
                                   f"{info.dtype}{list(info.shape)}")
        s.reservoir = f.read(key)
        gkey = f"{name}::groups"
        if gkey in f:  # absent in files from before the held-out split: rows of unknown group
            info = f.tensors[gkey]
            if info.dtype != "I64" or info.shape != (rows,):
                raise CalibrationError(f"{where}: groups must be I64{[rows]}, got {info.dtype}{list(info.shape)}")
            s.groups = f.read(gkey).tolist()
            if any(g < -1 for g in s.groups):
                raise CalibrationError(f"{where}: groups hold negative ids; calibrate again")
        finite = torch.isfinite(s.reservoir)
        if not bool(finite.all()):
            if not s.nonfinite:  # the calibration saw none: the file was damaged since
                raise CalibrationError(f"{where}: reservoir holds NaN/Inf values; calibrate again")
            # calibrated with nonfinite="ignore": zero them like the other statistics did
            s.reservoir = torch.where(finite, s.reservoir, torch.zeros_like(s.reservoir))


def _count(x) -> bool:
    return is_int(x) and x >= 0
