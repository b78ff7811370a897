"""The on-disk format, in one place: ComfyUI's native quantized layout and comfy-modelopt's keys.
Design: docs/design.md, ``fileformat.py``.
"""
from __future__ import annotations

import json

import torch

from .errors import CheckpointError, one_line

# ---------------------------------------------------------------- ComfyUI's layer layout
# kitchen's QuantizedTensor.state_dict suffix -> the key suffix ComfyUI loads it from
SUFFIX_KEYS = {"": ".weight", "_scale": ".weight_scale", "_scale_2": ".weight_scale_2"}
COMFY_QUANT = ".comfy_quant"
INPUT_SCALE = ".input_scale"
QUANT_METADATA = "_quantization_metadata"
QUANT_METADATA_VERSION = "1.0"
LOWRANK_UP, LOWRANK_DOWN, SMOOTH_SCALE = ".lowrank_up", ".lowrank_down", ".smooth_scale"
# the key suffixes only a quantized layer (ComfyUI's or this pack's own loader's) carries, its
# config last
QUANT_PARTS = (".weight_scale", ".weight_scale_2", INPUT_SCALE, ".pre_quant_scale", LOWRANK_UP, LOWRANK_DOWN,
               SMOOTH_SCALE, COMFY_QUANT)
# every per-layer key suffix (without the dot) a quantized layer may carry
LAYER_SUFFIXES = ("weight",) + tuple(p[1:] for p in QUANT_PARTS)
# keys that mark a file as already quantized (ComfyUI native, legacy scaled fp8, old node pack)
QUANT_MARKERS = QUANT_PARTS + (".scale_weight", ".weight_q")
# a .comfy_quant config is a few dozen bytes; anything near this is not a config
MAX_COMFY_QUANT_BYTES = 64 * 1024

# ---------------------------------------------------------------- comfy-modelopt's own layers
# Formats only comfy-modelopt's loader runs.  Their names are not ComfyUI QUANT_ALGOS keys, so
# stock ComfyUI refuses such a file instead of silently dropping the extra tensors.
LOWRANK_PREFIX = "modelopt_lowrank_"
LOWRANK_SUFFIXES = (LOWRANK_UP, LOWRANK_DOWN, SMOOTH_SCALE)
# fp8 Conv2d weights (ComfyUI 0.29 quantizes only Linear layers): [O, I*kh*kw] float8_e4m3fn with
# one float32 scale per output channel.  Stored 2-D on purpose: stock ComfyUI's load_state_dict
# then fails on the shape ("size mismatch for <layer>.weight") instead of copying raw fp8 values
# into a 16-bit convolution; our loader restores the 4-D shape from the layer config.
CONV_FORMAT = "modelopt_conv_fp8"

# ---------------------------------------------------------------- comfy-modelopt's header keys
META_PREFIX = "comfy_modelopt."
META_VERSION = META_PREFIX + "version"
META_RECIPE = META_PREFIX + "recipe"            # Recipe JSON
META_FAMILY = META_PREFIX + "family"
META_LOADER = META_PREFIX + "loader"            # present: the file needs our loader
META_SOURCE = META_PREFIX + "source"            # JSON: source file name, bytes, sha256
META_CALIBRATION = META_PREFIX + "calibration"  # JSON: statistics summary
META_REPORT = META_PREFIX + "report"            # JSON: QuantReport.header_json()
META_STATS = META_PREFIX + "stats"              # statistics files: their JSON description
OWN_LOADER = "comfy-modelopt"


def own_base(fmt: str) -> str | None:
    """The stock base format of a low-rank format only our loader runs, else None (also for
    ``CONV_FORMAT``, which has no stock counterpart)."""
    return fmt[len(LOWRANK_PREFIX):] if fmt.startswith(LOWRANK_PREFIX) else None


def own_format(base: str) -> str:
    """The own-loader name of a low-rank layer whose residual is stored as ``base``."""
    return LOWRANK_PREFIX + base


def stock_conf(conf: dict) -> dict | None:
    """The stock ComfyUI layer config of an own-loader low-rank layer, else None."""
    base = own_base(conf.get("format", ""))
    if base is None:
        return None
    return dict({k: v for k, v in conf.items() if k != "rank"}, format=base)


# ---------------------------------------------------------------- .comfy_quant
def encode_comfy_quant(conf: dict) -> bytes:
    """What ComfyUI writes for .comfy_quant (ops._quantized_weight_state_dict)."""
    return json.dumps(conf).encode("utf-8")


def comfy_quant_tensor(conf: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(encode_comfy_quant(conf)), dtype=torch.uint8)


def decode_comfy_quant(data, where: str) -> dict:
    """The layer config in a .comfy_quant payload (uint8 tensor or bytes); ``where`` names it
    in errors ("file.safetensors: layer.comfy_quant")."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise CheckpointError(f"{where}: must be a 1-D uint8 tensor, got {data.dtype} "
                                  f"{list(data.shape)}")
        data = data.cpu().numpy().tobytes()
    if len(data) > MAX_COMFY_QUANT_BYTES:
        raise CheckpointError(f"{where}: {len(data)} bytes, too large for a layer config")
    try:
        conf = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: not a JSON layer config ({one_line(e)})") from None
    return check_conf(conf, where)


def check_conf(conf, where: str) -> dict:
    """A layer config as ComfyUI needs it: an object with a string ``format``."""
    if not isinstance(conf, dict):
        raise CheckpointError(f"{where}: layer config must be a JSON object, got {type(conf).__name__}")
    if not isinstance(conf.get("format"), str):
        raise CheckpointError(f"{where}: layer config has no string 'format' ({one_line(repr(conf))[:120]})")
    return conf


def read_comfy_quant(f, key: str) -> dict:
    """Decode ``key`` (a .comfy_quant tensor) of an open SafetensorsFile, checking its size
    in the header before reading a byte."""
    info = f.tensors[key]
    where = f"{f.name}: {key}"
    if info.dtype != "U8" or len(info.shape) != 1:
        raise CheckpointError(f"{where}: must be a 1-D U8 tensor, got {info.dtype}{list(info.shape)}")
    if info.nbytes > MAX_COMFY_QUANT_BYTES:
        raise CheckpointError(f"{where}: {info.nbytes} bytes, too large for a layer config")
    return decode_comfy_quant(f.read(key), where)


# ---------------------------------------------------------------- _quantization_metadata
def encode_quantization_metadata(layers: dict[str, dict]) -> str:
    return json.dumps({"format_version": QUANT_METADATA_VERSION, "layers": layers})


def decode_quantization_metadata(text: str, where: str) -> dict[str, dict]:
    """layer -> config from a ``_quantization_metadata`` header entry (errors name ``where``)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: {QUANT_METADATA} is not JSON ({one_line(e)})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layers", {}), dict):
        raise CheckpointError(f"{where}: {QUANT_METADATA} must be an object with a 'layers' object")
    return {name: check_conf(conf, f"{where}: {QUANT_METADATA} layer {name}")
            for name, conf in doc.get("layers", {}).items()}


# ---------------------------------------------------------------- comfy_modelopt.* entries
def json_meta(metadata: dict, key: str, where: str):
    """The parsed JSON of header entry ``key`` (None when absent)."""
    if key not in metadata:
        return None
    try:
        return json.loads(metadata[key])
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: header entry {key} is not JSON ({one_line(e)})") from None


def is_ours(metadata: dict) -> bool:
    return META_VERSION in metadata


def needs_own_loader(metadata: dict | None, keys) -> bool:
    if metadata and metadata.get(META_LOADER):
        return True
    return any(k.endswith(LOWRANK_UP) for k in keys)
