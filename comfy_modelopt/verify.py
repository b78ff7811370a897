"""What a model file holds, checked before anything builds a model from it.
Design: docs/design.md, ``verify.py``.
"""
from __future__ import annotations

import time
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .completeness import missing_layers, structure_problems
from .errors import CheckpointError, PlanError, Problem
from .fileformat import (COMFY_QUANT, CONV_FORMAT, INPUT_SCALE, LOWRANK_DOWN, LOWRANK_UP, QUANT_METADATA, QUANT_PARTS,
                         SMOOTH_SCALE, SUFFIX_KEYS, decode_comfy_quant, decode_quantization_metadata, own_base,
                         read_comfy_quant, stock_conf)
from .families import GENERIC, detect_family, diffusion_prefix
from .formats import FORMATS
from .formats.base import positive_problem
from .formats.conv_fp8 import CONV_FP8
from .safetensors_io import FLOAT_DTYPES, ST_DTYPES, SafetensorsFile, is_int

Entries = Mapping[str, tuple]          # key -> (safetensors dtype, shape)
Reader = Callable[[str], torch.Tensor]

# the kitchen suffix ("" weight, "_scale", "_scale_2") behind each stored key suffix
PARTS = {key: suffix for suffix, key in SUFFIX_KEYS.items()}
# a scale stored in one byte may be kept as its float8 type or as raw bytes (ComfyUI views both)
_BYTE_SCALES = {"F8_E4M3": {"F8_E4M3", "U8"}, "U8": {"U8", "F8_E8M0"}}
_LEGACY = ("scaled_fp8",)          # legacy scaled-fp8 files: ComfyUI converts them itself


@dataclass
class Verification:
    """What ``verify`` found: ``problems`` (empty: none), and what it read and how long it took."""
    problems: list = field(default_factory=list)
    layers: int = 0                # quantized layers checked
    tensors: int = 0               # tensors checked
    values_read: int = 0           # tensors whose values were read
    bytes_read: int = 0
    seconds: float = 0.0
    values: bool = False
    configs: dict = field(default_factory=dict)  # layer -> the config ComfyUI will use

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self, where: str) -> CheckpointError:
        more = len(self.problems) - 1
        tail = (f" (and {more} more problem{'s' if more > 1 else ''}; `comfy-modelopt inspect --verify` lists "
                f"them)") if more else ""
        return CheckpointError(f"{where}: {self.problems[0]}{tail}")

    def raise_for(self, where: str) -> None:
        if self.problems:
            raise self.error(where)

    def summary(self) -> str:
        read = (f"; values of {self.values_read} tensors read ({self.bytes_read / 2**20:.1f} MiB)" if self.values
                else "; values not read (--verify reads them)")
        verdict = "no problem" if self.ok else f"{len(self.problems)} problem{'s' * (len(self.problems) > 1)}"
        return (f"verified {self.layers} quantized layers and {self.tensors} tensors in {self.seconds:.2f}s"
                f"{read}: {verdict}")

    def to_dict(self) -> dict:
        return {"problems": [str(p) for p in self.problems], "layers": self.layers, "tensors": self.tensors,
                "values_read": self.values_read, "bytes_read": self.bytes_read, "seconds": round(self.seconds, 4),
                "values": self.values}


# ====================================================================== layer configs
def layer_configs(entries: Entries, metadata: Mapping[str, str], read_conf: Callable[[str], dict],
                  problems: list) -> dict[str, dict]:
    """layer -> the config ComfyUI will use: ``_quantization_metadata``'s entry where the header
    has one (ComfyUI writes it over the layer's ``.comfy_quant`` tensor), else the tensor's.
    ``read_conf(key)`` decodes a ``.comfy_quant`` tensor (raising CheckpointError)."""
    confs: dict[str, dict] = {}
    for key in entries:
        if key.endswith(COMFY_QUANT):
            try:
                confs[key[:-len(COMFY_QUANT)]] = read_conf(key)
            except CheckpointError as e:
                problems.append(Problem(key, _rule(e, key)))
    text = metadata.get(QUANT_METADATA)
    if text is None:
        return confs
    try:
        declared = decode_quantization_metadata(text, QUANT_METADATA)
    except CheckpointError as e:
        problems.append(Problem(QUANT_METADATA, _rule(e, QUANT_METADATA)))
        return confs
    for name, conf in declared.items():
        if name in confs and confs[name] != conf:
            problems.append(Problem(name + COMFY_QUANT, f"differs from the layer's entry in {QUANT_METADATA} "
                                    f"({_brief(conf)} there), which ComfyUI would use"))
        confs[name] = conf
    return confs


def _rule(e: Exception, key: str) -> str:
    """An error's message without the 'file: key:' it starts with."""
    text = str(e)
    at = text.find(key + ": ")
    text = text[at + len(key) + 2:] if at >= 0 else text
    return text[len(key) + 1:] if text.startswith(key + " ") else text


def _brief(conf: dict) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in conf.items())
    return text if len(text) <= 80 else text[:77] + "..."


# ====================================================================== one quantized layer
def layer_problems(name: str, conf: dict, entries: Entries, read: Reader | None, deep: bool = False,
                   runtime_formats: tuple = ()) -> tuple[list, list]:
    """The problems of quantized layer ``name`` (config ``conf``) and the tensors whose values
    were read (scales always when ``read`` is given; the weight's codes too when ``deep``).
    ``runtime_formats``: format names the runtime that will load the file knows beyond ours
    (their layers are left to it)."""
    fmt_name = conf["format"]
    cq = name + COMFY_QUANT
    if fmt_name == CONV_FORMAT:
        return _conv_problems(name, conf, entries, read, deep)
    base = own_base(fmt_name)
    fmt = FORMATS.get(base if base is not None else fmt_name)
    if fmt is None:
        if fmt_name in runtime_formats:
            return [], []
        known = ", ".join(FORMATS)
        return [Problem(cq, f"unknown format {fmt_name!r} (ComfyUI's formats: {known})")], []
    try:
        opts = fmt.stored_options(stock_conf(conf) or conf)
    except ValueError as e:
        return [Problem(cq, f"{fmt.name} config: {e}")], []
    weight = entries.get(name + ".weight")
    if weight is None:
        return [Problem(name + ".weight", f"missing: the layer's config says {fmt_name} but the file has no "
                                          f"weight for it")], []
    dtype, shape = weight
    if len(shape) != 2:
        return [Problem(name + ".weight", f"a {fmt.name} weight is 2-D, this one is {dtype}{list(shape)}")], []
    n, k = shape[0], shape[1] * fmt.values_per_element
    try:
        planned = _planned(fmt, n, k, tuple(sorted(opts.items())))
    except (ValueError, RuntimeError) as e:
        return [Problem(cq, f"{fmt.name} cannot lay out a [{n}, {k}] weight with {opts or 'its defaults'} "
                            f"({' '.join(str(e).split())[:120]})")], []
    problems = _stored_problems(name, fmt.name, planned, entries)
    problems += _stray_parts(name, fmt, planned, entries, lowrank=base is not None)
    problems += _bias_problems(name, n, lambda b: _planned(fmt, b, k, tuple(sorted(opts.items()))) == planned,
                               entries)
    if base is not None:
        problems += _lowrank_problems(name, conf, n, k, fmt, opts, entries)
    if problems or read is None:
        return problems, []
    checks = [(k, lambda t, s=PARTS[k]: fmt.value_problem(s, t)) for k in planned if deep or k != ".weight"]
    checks += [(p, positive_problem) for p in (INPUT_SCALE, SMOOTH_SCALE) if name + p in entries]
    checks += [(p, _finite_problem) for p in (LOWRANK_UP, LOWRANK_DOWN) if name + p in entries]
    problems, seen = _read_values(name, checks, read)
    if not problems:
        scales = {PARTS[k]: t for (k, _rule), t in zip(checks, seen) if k in planned and k != ".weight"}
        weight = []
        found = fmt.scales_problem(scales, lambda: weight.append(read(name + ".weight")) or weight[0])
        if found:
            problems.append(Problem(name + ".weight_scale", found))
        seen += weight
    return problems, seen


@lru_cache(maxsize=1024)
def _planned(fmt, n: int, k: int, opts: tuple) -> dict:
    """The stored tensors of a [n, k] weight by key suffix: (safetensors dtype, shape), as kitchen
    lays them out (``Format.planned``; kitchen run on a meta tensor, so cached)."""
    return {SUFFIX_KEYS[s]: (ST_DTYPES[d], tuple(sh)) for s, (d, sh) in fmt.planned(n, k, **dict(opts)).items()}


def _read_values(name: str, checks: list, read: Reader) -> tuple[list, list]:
    """Run each (key suffix, rule) on the stored values; the problems and the tensors read."""
    problems, seen = [], []
    for key_suffix, rule in checks:
        t = read(name + key_suffix)
        seen.append(t)
        found = rule(t)
        if found:
            problems.append(Problem(name + key_suffix, found))
    return problems, seen


def _finite_problem(t: torch.Tensor) -> str | None:
    if not t.is_floating_point() or not t.numel():
        return None
    # the least and the greatest value are finite when every value is (a NaN or an Inf becomes
    # one of them), found in one pass at memory speed; only then are the bad ones counted
    if bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()):
        return None
    bad = int((~torch.isfinite(t)).sum())
    return f"holds {bad} NaN/Inf values (of {t.numel()})" if bad else None


def _stored_problems(name: str, fmt_name: str, planned: dict, entries: Entries) -> list:
    """Each planned tensor present with the dtype and shape kitchen lays out for the weight."""
    problems = []
    for key_suffix, (dtype, shape) in planned.items():
        key = name + key_suffix
        if key not in entries:
            problems.append(Problem(key, f"missing ({fmt_name} layers store it)"))
            continue
        got_dtype, got_shape = entries[key][0], tuple(entries[key][1])
        allowed = _BYTE_SCALES.get(dtype, {dtype}) if key_suffix != ".weight" else {dtype}
        if got_dtype not in allowed:
            problems.append(Problem(key, f"is {got_dtype}, a {fmt_name} layer stores {dtype} here"))
        elif got_shape != shape and not (shape == () and got_shape == (1,)):
            problems.append(Problem(key, f"has shape {list(got_shape)}, a {fmt_name} layer of this weight stores "
                                         f"{list(shape)}"))
    return problems


def _bias_problems(name: str, n: int, fits, entries: Entries) -> list:
    """A quantized layer's bias: one value per output (``fits(b)``: b outputs lay out as the
    stored weight does - kitchen pads some formats' rows)."""
    if name + ".bias" not in entries:
        return []
    dtype, shape = entries[name + ".bias"]
    if dtype not in FLOAT_DTYPES or len(shape) != 1 or not (0 < shape[0] <= n and (shape[0] == n or fits(shape[0]))):
        return [Problem(name + ".bias", f"is {dtype}{list(shape)}, the layer's weight has {n} outputs")]
    return []


def _stray_parts(name: str, fmt, planned: dict, entries: Entries, lowrank: bool) -> list:
    """Quantization tensors a layer of this format does not carry (ComfyUI would ignore them)."""
    allowed = set(planned) | {COMFY_QUANT}
    if fmt.static_input_scale:
        allowed.add(INPUT_SCALE)
    if lowrank:
        allowed |= {LOWRANK_UP, LOWRANK_DOWN, SMOOTH_SCALE}
    problems = []
    for part in QUANT_PARTS:
        if part not in allowed and name + part in entries:
            problems.append(Problem(name + part, f"not part of a {fmt.name} layer{' with a low-rank branch' * lowrank}"))
    if INPUT_SCALE in allowed and name + INPUT_SCALE in entries:
        dtype, shape = entries[name + INPUT_SCALE]
        if dtype not in FLOAT_DTYPES or tuple(shape) not in ((), (1,)):
            problems.append(Problem(name + INPUT_SCALE, f"must be one float scale, is {dtype}{list(shape)}"))
    return problems


def _lowrank_problems(name: str, conf: dict, n: int, k: int, fmt, opts: dict, entries: Entries) -> list:
    """A low-rank layer's branch: up [n, r], down [r, k] (16-bit), r the config's rank; an optional
    smooth_scale [k]."""
    up, down = entries.get(name + LOWRANK_UP), entries.get(name + LOWRANK_DOWN)
    missing = [name + p for p, e in ((LOWRANK_UP, up), (LOWRANK_DOWN, down)) if e is None]
    if missing:
        return [Problem(missing[0], "missing (a low-rank layer stores its branch)")]
    rank = conf.get("rank")
    problems = []
    for key, (dtype, shape) in ((name + LOWRANK_UP, up), (name + LOWRANK_DOWN, down)):
        if dtype not in FLOAT_DTYPES or len(shape) != 2:
            problems.append(Problem(key, f"must be a 2-D 16-bit matrix, is {dtype}{list(shape)}"))
    if problems:
        return problems
    (_, (n_up, r_up)), (_, (r_down, k_down)) = up, down
    key = tuple(sorted(opts.items()))
    try:
        logical_ok = 0 < n_up <= n and _planned(fmt, n_up, k, key) == _planned(fmt, n, k, key)
    except (ValueError, RuntimeError):
        logical_ok = False
    if not (is_int(rank) and rank == r_up == r_down and k_down == k and logical_ok):
        problems.append(Problem(name + LOWRANK_UP, f"branch up {list(up[1])} / down {list(down[1])} does not fit a "
                                                   f"[{n}, {k}] weight with rank {rank!r}"))
    if name + SMOOTH_SCALE in entries:
        dtype, shape = entries[name + SMOOTH_SCALE]
        if dtype not in FLOAT_DTYPES or tuple(shape) != (k,):
            problems.append(Problem(name + SMOOTH_SCALE, f"must be {k} float scales, is {dtype}{list(shape)}"))
    return problems


def _conv_problems(name: str, conf: dict, entries: Entries, read: Reader | None, deep: bool) -> tuple[list, list]:
    cq = name + COMFY_QUANT
    try:
        shape = CONV_FP8.stored_options(conf)
    except ValueError as e:
        return [Problem(cq, f"{CONV_FORMAT} config: {e}")], []
    planned = CONV_FP8.planned(shape)
    problems = _stored_problems(name, CONV_FORMAT, planned, entries)
    problems += _bias_problems(name, shape[0], lambda b: b == shape[0], entries)
    problems += [Problem(name + p, f"not part of a {CONV_FORMAT} layer") for p in QUANT_PARTS
                 if p not in planned and p != COMFY_QUANT and name + p in entries]
    if problems or read is None:
        return problems, []
    return _read_values(name, [(k, lambda t, s=k: CONV_FP8.value_problem(s, t)) for k in planned
                               if deep or k != ".weight"], read)


# ====================================================================== the whole file
def verify(entries: Entries, metadata: Mapping[str, str], read: Reader | None, read_conf: Callable[[str], dict],
           prefix: str = "", values: bool = True, deep: bool = False, complete: bool = True,
           runtime_formats: tuple = ()) -> Verification:
    """Check a model's tensors (``entries``: key -> (safetensors dtype, shape)); with ``values``
    read scales and 16-bit tensors through ``read`` (``deep``: the quantized weights' codes too).
    ``prefix``: the diffusion model's key prefix (its 16-bit tensors are the ones checked);
    ``complete``: name missing layers (``completeness.missing_layers``)."""
    t0 = time.perf_counter()
    result = Verification(values=values)
    problems = result.problems
    confs = result.configs = layer_configs(entries, metadata, read_conf, problems)
    reader = read if values else None
    for name, conf in confs.items():
        found, seen = layer_problems(name, conf, entries, reader, deep, runtime_formats)
        problems += found
        result.layers += 1
        result.values_read += len(seen)
        result.bytes_read += sum(t.numel() * t.element_size() for t in seen)
    layer_keys = {name + part for name in confs for part in QUANT_PARTS + (".weight",)}
    legacy = any(k.endswith(m) for k in entries for m in _LEGACY)
    for key, (dtype, shape) in entries.items():
        if key in layer_keys:
            continue
        layer, dot, part = key.rpartition(".")
        if "." + part in QUANT_PARTS[:-1] and not legacy:
            problems.append(Problem(key, f"a quantization tensor, but layer {layer} has no quantization config"))
            continue
        if not key.startswith(prefix):
            continue
        if dtype not in FLOAT_DTYPES and not legacy:
            problems.append(Problem(key, f"is {dtype}: a diffusion model's tensors are 16/32-bit float unless a "
                                         f"quantization config says otherwise (ComfyUI would cast the raw values)"))
        elif values and read is not None and dtype in FLOAT_DTYPES:
            t = read(key)
            result.values_read += 1
            result.bytes_read += t.numel() * t.element_size()
            found = _finite_problem(t)
            if found:
                problems.append(Problem(key, found))
    if complete:
        family = detect_family({k[len(prefix):]: tuple(s) for k, (_, s) in entries.items() if k.startswith(prefix)})
        problems += missing_layers(entries, prefix, family.optional)
        named = {p.key for p in problems}
        quantized = {n[len(prefix):] for n in confs if n.startswith(prefix)}
        problems += [p for p in structure_problems(entries, prefix, family.optional, quantized,
                                                   widths=family is not GENERIC) if p.key not in named]
    result.tensors = len(entries)
    result.seconds = time.perf_counter() - t0
    return result


def verify_file(path: str, values: bool = True, deep: bool = False, complete: bool = True) -> Verification:
    """``verify`` a .safetensors file, reading one tensor at a time (bounded memory)."""
    with SafetensorsFile(path) as f:
        entries = {k: (t.dtype, t.shape) for k, t in f.tensors.items()}
        return verify(entries, f.metadata, f.read, lambda key: read_comfy_quant(f, key), diffusion_prefix(entries),
                      values, deep, complete)


def state_dict_entries(sd: Mapping[str, torch.Tensor]) -> dict:
    """``verify``'s entries for an in-memory state dict."""
    return {k: (ST_DTYPES.get(v.dtype, str(v.dtype)), tuple(v.shape)) for k, v in sd.items()}


def read_conf_of(sd: Mapping[str, torch.Tensor], where: str) -> Callable[[str], dict]:
    """``verify``'s config decoder for an in-memory state dict (the same caps as a file's)."""
    return lambda key: decode_comfy_quant(sd[key], f"{where}: {key}")


def check_source(source, prefix: str, complete: bool) -> None:
    """The 16-bit source through the verifier every reader uses (verify.py), from its header: a
    quantization tensor (a stray scale, a partly converted file), a weight that is not a float (a
    relabelled dtype), a layer missing from the model (``complete``; ``--family generic`` skips
    it) are refused by key.  Its values are checked as they are copied (``pipeline._stream``)."""
    def no_config(key):
        raise PlanError(f"{key}: a quantization config in a 16-bit source")
    problems = verify(source.tensors, {}, None, no_config, prefix, values=False, complete=complete).problems
    if problems:
        hint = (" (--family generic quantizes it without this check)" if "missing" in problems[0].rule else "")
        more = f" ({len(problems) - 1} more like it)" if len(problems) > 1 else ""
        raise PlanError(f"{problems[0]}{more}: quantize from an undamaged 16-bit model{hint}")


__all__ = ["Problem", "Verification", "verify", "verify_file", "layer_problems", "layer_configs",
           "state_dict_entries", "read_conf_of", "check_source"]
