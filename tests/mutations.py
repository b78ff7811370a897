"""Seeded semantic mutations of the files comfy-modelopt writes: the damage a bad download, a
hand edit or another tool does to a valid file (a scale set to NaN, a key dropped or renamed, a
dtype relabelled over the same bytes, a layer config edited, a layer left out), each with what
a reader must do about it.

``mutate(tensors, metadata, rng)`` returns a ``Mutation``: the changed tensors and metadata, a
label, and whether a reader must refuse it - ``"all"`` (inspect reports it from the file alone;
the loader refuses it), ``"loader"`` (only the model ComfyUI builds shows it: a bias or a
top-level layer left out, a 16-bit weight transposed), or ``""`` (a file that stays valid: a
benign edit such as a scale stored as [1] instead of [], or one no reader can tell from a real
model, such as convrot switched off on a rotated weight - the loaded model must still be finite).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

QUANT_CONF = ".comfy_quant"
SCALES = (".weight_scale", ".weight_scale_2", ".input_scale", ".smooth_scale")


@dataclass
class Mutation:
    tensors: dict
    metadata: dict
    label: str
    refuse: str          # "all", "loader" or ""


def _layers(tensors):
    return sorted(k[:-len(QUANT_CONF)] for k in tensors if k.endswith(QUANT_CONF))


def _sixteen_bit(tensors, quantized):
    return sorted(k for k, v in tensors.items() if v.is_floating_point() and v.dtype.itemsize >= 2
                  and k.rpartition(".")[0] not in quantized and k.endswith((".weight", ".bias", ".scale")))


def _repeated(key: str, tensors: dict) -> bool:
    """Whether ``key`` sits in a numbered block beside another that holds the same key
    (``<run>.<i>.<rest>`` with i-1 or i+1): the file itself then tells what it should hold."""
    parts = key.split(".")
    for j, part in enumerate(parts):
        if part.isdigit():
            for d in (-1, 1):
                alt = parts[:j] + [str(int(part) + d)] + parts[j + 1:]
                if ".".join(alt) in tensors:
                    return True
    return False


def _conf_text(conf) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(conf).encode()), dtype=torch.uint8)


def _set_conf(tensors, metadata, layer, conf, where):
    """Put ``conf`` (a dict, or raw bytes) in the layer's tensor, the header, or both."""
    if where in ("tensor", "both"):
        tensors[layer + QUANT_CONF] = conf if isinstance(conf, torch.Tensor) else _conf_text(conf)
    if where in ("header", "both") and "_quantization_metadata" in metadata:
        doc = json.loads(metadata["_quantization_metadata"])
        doc["layers"][layer] = conf if not isinstance(conf, torch.Tensor) else "broken"
        metadata["_quantization_metadata"] = json.dumps(doc)


def _conf_of(tensors, layer):
    return json.loads(tensors[layer + QUANT_CONF].numpy().tobytes())


BAD_CONF_VALUES = [
    ("format", ""), ("format", "bogus"), ("format", 7), ("group_size", "x"), ("group_size", -1),
    ("group_size", 7), ("orig_dtype", 2 ** 40), ("orig_dtype", "int8"), ("convrot_groupsize", 7),
    ("convrot_groupsize", "x"), ("convrot_groupsize", 0), ("full_precision_matrix_mult", "yes"),
    ("linear_dtype", "fp4"), ("params", 3), ("shape", [1, 2]), ("rank", "r")]


def _reads(fmt: str, conf: dict, field: str, value) -> bool:
    """Whether a layer of format ``fmt`` reads config ``field`` (so a bad ``value`` breaks it)."""
    base = fmt.replace("modelopt_lowrank_", "")
    if field == "group_size":
        block = {"nvfp4": 16, "mxfp8": 32}.get(base)
        return not (isinstance(value, int) and value > 0 and value == (block or value))
    return {"convrot_groupsize": base == "convrot_w4a4" or bool(conf.get("convrot")),
            "linear_dtype": base == "convrot_w4a4", "shape": fmt == "modelopt_conv_fp8",
            "rank": fmt.startswith("modelopt_lowrank_")}.get(field, True)


def mutate(tensors: dict, metadata: dict, rng: random.Random) -> Mutation:
    t, m = dict(tensors), dict(metadata)
    quantized = _layers(t)
    layer = rng.choice(quantized)
    conf = _conf_of(t, layer)
    fmt = conf["format"]
    parts = sorted(k for k in t if k.startswith(layer + ".") and k.rpartition(".")[0] == layer)
    sixteen = _sixteen_bit(t, set(quantized))
    kind = rng.randrange(16)

    if kind == 0:  # a scale's values
        keys = [k for k in parts if k.endswith(SCALES)]
        key = rng.choice(keys)
        v = t[key].clone()
        flat = v.view(-1)
        i = rng.randrange(flat.numel())
        if v.is_floating_point() and v.dtype.itemsize >= 2:
            bad = rng.choice([float("nan"), float("inf"), -float("inf"), -1.0, 0.0])
            flat[i] = bad
            t[key] = v
            return Mutation(t, m, f"{key} [{i}] = {bad}", "all")
        raw = flat.view(torch.uint8)  # block scales: E4M3 (nvfp4) or E8M0 (mxfp8) bytes
        byte = 0xFF if fmt.endswith("mxfp8") else rng.choice([0x7F, 0xFF, 0x80 | rng.randrange(1, 0x7F)])
        raw[i] = byte
        t[key] = v
        return Mutation(t, m, f"{key} byte [{i}] = {byte:#x}", "all")
    if kind == 1:  # a quantized layer's tensor dropped
        key = rng.choice(parts)
        del t[key]
        benign = key.endswith((QUANT_CONF, ".input_scale", ".smooth_scale"))  # the header restates the config;
        refuse = "" if benign else "loader" if key.endswith(".bias") else "all"  # the others are optional
        return Mutation(t, m, f"drop {key}", refuse)
    if kind == 2:  # a key renamed (a typo, or a key of another layer)
        key = rng.choice(parts)
        other = rng.choice([key[:-1], key + "x", key.replace(layer, rng.choice(quantized))])
        if other in t or other == key:
            other = key + "_old"
        t[other] = t.pop(key)
        # an optional scale renamed leaves a valid layer (and a float tensor ComfyUI ignores); a
        # bias renamed leaves a parameter only the model knows of; anything else is missing, and
        # a renamed byte tensor is a non-float tensor without a config
        refuse = "" if key.endswith((".input_scale", ".smooth_scale")) else \
            "loader" if key.endswith(".bias") else "all"
        return Mutation(t, m, f"rename {key} -> {other}", refuse)
    if kind == 3:  # a dtype relabelled over the same bytes
        key = rng.choice(parts + [rng.choice(sixteen)])
        v = t[key]
        same = {1: [torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2],
                2: [torch.int16, torch.float16, torch.bfloat16], 4: [torch.int32, torch.float32]}[v.dtype.itemsize]
        new = rng.choice([d for d in same if d != v.dtype])
        if new == torch.bool:
            t[key] = (v.view(torch.uint8) & 1).bool()
        else:
            t[key] = v.view(new)
        floats16 = {torch.float16, torch.bfloat16}
        quiet = v.dtype in floats16 and new in floats16 or \
            key.endswith(".weight_scale") and {v.dtype, new} <= {torch.uint8, torch.float8_e4m3fn} and fmt.endswith("nvfp4")
        return Mutation(t, m, f"relabel {key} {v.dtype} -> {new}", "" if quiet else "all")
    if kind == 4:  # a reshape over the same elements, or one element fewer
        key = rng.choice([k for k in parts if t[k].dim() >= 1] + [rng.choice(sixteen)])
        v = t[key]
        if rng.random() < 0.5 and v.dim() == 2 and v.shape[0] != v.shape[1]:
            t[key] = v.t().contiguous()
            label = f"transpose {key}"
        elif rng.random() < 0.5 or v.numel() < 2:
            t[key] = v.reshape(1, -1) if v.dim() == 1 else v.reshape(-1)
            label = f"reshape {key} {list(v.shape)} -> {list(t[key].shape)}"
        else:
            t[key] = v.reshape(-1)[:-1].clone() if v.dim() == 1 else v[:-1].clone()
            label = f"shrink {key} {list(v.shape)} -> {list(t[key].shape)}"
        # a bias or a low-rank branch one output shorter can belong to the same padded weight
        # (nvfp4, mxfp8 pad rows): only the model knows the layer's outputs
        in_layer = key in parts and not (label.startswith("shrink") and key.endswith((".bias", ".lowrank_up")))
        return Mutation(t, m, label, "all" if in_layer else "loader")
    if kind == 5:  # a config field outside its domain, in the tensor, the header or both
        field, value = rng.choice(BAD_CONF_VALUES)
        where = rng.choice(["tensor", "header", "both"])
        _set_conf(t, m, layer, dict(conf, **{field: value}), where)
        # where tensor and header differ the file is refused; the same field in both is refused
        # where the format reads it
        refuse = "all" if where != "both" or _reads(fmt, conf, field, value) else ""
        return Mutation(t, m, f"{layer} config {field}={value!r} in {where}", refuse)
    if kind == 6:  # a config that names another (valid) format
        other = rng.choice([f for f in ("float8_e4m3fn", "int8_tensorwise", "nvfp4", "mxfp8", "convrot_w4a4")
                            if f != fmt.replace("modelopt_lowrank_", "")])
        _set_conf(t, m, layer, dict(conf, format=other), rng.choice(["tensor", "header", "both"]))
        return Mutation(t, m, f"{layer} config format {fmt} -> {other}", "all")
    if kind == 7:  # a broken config payload
        payload = rng.choice([b"", b"{", b"[]", b'{"format": null}', b"\xff\xfe", b"x" * 70000])
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
        shaped = rng.choice(["u8", "i8", "2d"])
        if shaped == "i8":
            raw = _conf_text(conf).view(torch.int8)
        elif shaped == "2d":
            raw = _conf_text(conf).reshape(1, -1)
        _set_conf(t, m, layer, raw, "tensor")
        return Mutation(t, m, f"{layer}.comfy_quant payload {shaped} {payload[:12]!r}", "all")
    if kind == 8:  # the header's layer table
        choice = rng.randrange(4)
        if choice == 0:
            m["_quantization_metadata"] = rng.choice(["{not json", "[]", '{"layers": 3}'])
            return Mutation(t, m, "_quantization_metadata broken", "all")
        doc = json.loads(m["_quantization_metadata"])
        if choice == 1:  # a 16-bit layer declared quantized
            weight = rng.choice([k for k in sixteen if k.endswith(".weight") and t[k].dim() == 2])
            doc["layers"][weight[:-7]] = {"format": rng.choice(["float8_e4m3fn", "nvfp4"])}
            label, refuse = f"{weight[:-7]} declared quantized in the header", "all"
        elif choice == 2:  # a layer left out of the header: its tensor config still holds
            doc["layers"].pop(layer)
            label, refuse = f"{layer} left out of the header", ""
        else:
            del t[layer + QUANT_CONF]
            doc["layers"].pop(layer)
            label, refuse = f"{layer} config gone from tensor and header", "all"
        m["_quantization_metadata"] = json.dumps(doc)
        return Mutation(t, m, label, refuse)
    if kind == 9:  # 16-bit values
        key = rng.choice(sixteen)
        v = t[key].clone()
        v.view(-1)[rng.randrange(v.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
        t[key] = v
        return Mutation(t, m, f"{key} holds NaN/Inf", "all")
    if kind == 10:  # a layer left out: its weight only, a bias, or all of it
        victim = rng.choice([k[:-7] for k in sixteen if k.endswith(".weight") and t[k].dim() == 2] + quantized)
        what = rng.choice(["weight", "bias", "layer"])
        keys = [k for k in t if k.rpartition(".")[0] == victim]
        if what == "weight" and victim + ".weight" in t:
            keys = [victim + ".weight"]
        elif what == "bias" and victim + ".bias" in t:
            keys = [victim + ".bias"]
        for k in keys:
            del t[k]
        if victim in quantized and not keys[0].endswith(".bias"):
            doc = json.loads(m["_quantization_metadata"])
            doc["layers"].pop(victim, None)
            m["_quantization_metadata"] = json.dumps(doc)
        return Mutation(t, m, f"drop {', '.join(keys)}", "loader")
    if kind == 12:  # any tensor of the model left out: a norm, a bias, an embedding, a final layer
        key = rng.choice([k for k in t if not k.endswith(QUANT_CONF)])
        del t[key]
        layer = key.rpartition(".")[0]
        if layer in quantized and key.endswith(".weight"):
            doc = json.loads(m["_quantization_metadata"])
            doc["layers"].pop(layer, None)
            m["_quantization_metadata"] = json.dumps(doc)
            t.pop(layer + QUANT_CONF, None)
        optional = key.endswith((".input_scale", ".smooth_scale"))  # a layer is valid without them
        return Mutation(t, m, f"drop {key}", "" if optional else "all" if _repeated(key, t) else "loader")
    if kind == 13:  # a quantized layer's config gone from its tensor and from the header
        t.pop(layer + QUANT_CONF, None)
        doc = json.loads(m["_quantization_metadata"])
        doc["layers"].pop(layer, None)
        m["_quantization_metadata"] = json.dumps(doc)
        return Mutation(t, m, f"{layer} config gone", "all")
    if kind == 14:  # a 16-bit tensor resized consistently: its own rows and its bias shrunk alike
        key = rng.choice([k for k in sixteen if t[k].shape[0] > 2])
        keep = rng.choice([1, t[key].shape[0] - 1, t[key].shape[0] // 2])
        layer = key.rpartition(".")[0]
        for k in [k for k in t if k.rpartition(".")[0] == layer and t[k].dim() and t[k].shape[0] == t[key].shape[0]]:
            t[k] = t[k][:keep].clone()
        return Mutation(t, m, f"resize {layer} to {keep} outputs", "all" if _repeated(key, t) else "loader")
    if kind == 15:  # a scale no quantizer writes: negative, negative zero, a zero block scale over codes
        keys = [k for k in parts if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))]
        key = rng.choice(keys)
        v = t[key].clone()
        flat = v.view(-1)
        i = rng.randrange(flat.numel())
        if v.is_floating_point() and v.dtype.itemsize >= 2:
            bad = rng.choice([-0.0, -abs(float(flat[i])) or -1.0, 0.0])
            flat[i] = bad
            label, refuse = f"{key} [{i}] = {bad}", "all"
        elif fmt.endswith("mxfp8"):  # E8M0 has neither sign nor zero: its one bad byte is NaN
            flat.view(torch.uint8)[i] = 0xFF
            label, refuse = f"{key} byte [{i}] = 0xff", "all"
        elif rng.random() < 0.5:  # an E4M3 block scale with its sign set (-0.0 where it was 0)
            raw = flat.view(torch.uint8)
            raw[i] = raw[i] | 0x80
            label, refuse = f"{key} byte [{i}] = {int(raw[i]):#x}", "all"
        else:  # every block scale of the layer zero over its codes: the layer's output is zero
            flat.view(torch.uint8).zero_()
            label, refuse = f"{key} all zero", "all"
        t[key] = v
        return Mutation(t, m, label, refuse)
    # kind 11: an extra layer (another layer's tensors under a new name)
    source = rng.choice(quantized + [k[:-7] for k in sixteen if k.endswith(".weight") and t[k].dim() == 2])
    for k in [k for k in t if k.rpartition(".")[0] == source]:
        t[k.replace(source, source + "_extra", 1)] = t[k]
    if source in quantized:
        doc = json.loads(m["_quantization_metadata"])
        doc["layers"][source + "_extra"] = doc["layers"][source]
        m["_quantization_metadata"] = json.dumps(doc)
    return Mutation(t, m, f"extra layer {source}_extra", "loader")
