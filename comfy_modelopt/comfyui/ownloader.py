"""comfy-modelopt's own loader, for the layers stock ComfyUI cannot run.
Design: docs/design.md, ``comfyui/ownloader.py``.
"""
from __future__ import annotations

import logging
import os

import torch

import comfy.model_detection
import comfy.model_management
import comfy.model_patcher
from comfy.patcher_extension import CallbacksMP
import comfy.quant_ops
import comfy.sd
import comfy.utils

from ..errors import CheckpointError, one_line
from ..families import diffusion_prefix
from ..formats import FORMATS
from ..formats.conv_fp8 import CONV_FP8
from ..lowrank import branch_dtype, branched
from ..sources import available_memory
from ..safetensors_io import SafetensorsFile
from ..verify import Verification, read_conf_of, state_dict_entries, verify
from ..fileformat import (COMFY_QUANT, CONV_FORMAT, LOWRANK_PREFIX, LOWRANK_SUFFIXES, QUANT_METADATA,
                          comfy_quant_tensor, decode_comfy_quant, decode_quantization_metadata,
                          encode_quantization_metadata, needs_own_loader, stock_conf)
from . import lean
from .records import layer_record, model_record

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# what ComfyUI's loader raises on a state dict it cannot build a model from
_COMFY_ERRORS = (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError, ArithmeticError)


def split_state_dict(sd: dict, metadata: dict | None) -> tuple[dict, dict, dict]:
    """(stock state dict, stock metadata, extras by layer name relative to the diffusion model).

    An fp8 convolution's extras are ``conv_weight`` (fp8, 4-D view), ``conv_scale`` [O];
    ComfyUI's loader gets a zero-stride placeholder of the real shape in its place."""
    sd = dict(sd)
    extras = {}
    placeholder = _placeholder_dtype(sd)
    for key in [k for k in sd if k.endswith(COMFY_QUANT)]:
        conf = decode_comfy_quant(sd[key], key)
        layer = key[: -len(COMFY_QUANT)]
        if conf.get("format") == CONV_FORMAT:
            shape = CONV_FP8.stored_options(conf)
            del sd[key]
            try:
                q, scale = sd.pop(layer + ".weight"), sd.pop(layer + ".weight_scale")
                q = q.view(shape)
            except (KeyError, RuntimeError) as e:
                raise CheckpointError(f"{layer}: broken {CONV_FORMAT} layer ({type(e).__name__}: {e})") from None
            sd[layer + ".weight"] = torch.zeros((), dtype=placeholder).expand(shape)
            extras[_relative(layer)] = {"conv_weight": q, "conv_scale": scale.float()}
            continue
        stock = stock_conf(conf)
        if stock is None:
            continue
        sd[key] = comfy_quant_tensor(stock)
        extras[_relative(layer)] = {s[1:]: sd.pop(layer + s) for s in LOWRANK_SUFFIXES if layer + s in sd}
    meta = dict(metadata or {})
    if QUANT_METADATA in meta:
        layers = decode_quantization_metadata(meta[QUANT_METADATA], QUANT_METADATA)
        meta[QUANT_METADATA] = encode_quantization_metadata(
            {name: stock_conf(conf) or conf for name, conf in layers.items() if conf["format"] != CONV_FORMAT})
    return sd, meta, extras


def _placeholder_dtype(sd: dict):
    """The 16-bit dtype of the file's unquantized weights (ComfyUI infers the model dtype from
    them, so a placeholder must not change the vote)."""
    counts: dict = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.dtype in (torch.float16, torch.bfloat16, torch.float32):
            counts[v.dtype] = counts.get(v.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else torch.bfloat16


def _relative(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def load_state_dict(sd: dict, metadata: dict | None = None, rebuildable: bool = False, where: str = "state dict",
                    **load_options):
    """A MODEL from a diffusion-model state dict: ComfyUI's own loader, which our layers then
    join when the file has any (options go to ComfyUI's loader; ``sd`` itself is not changed).
    Returns None when ComfyUI cannot detect the model.  An error inside ComfyUI's loader, a
    parameter of the built model that ``sd`` does not hold, or a layer of ``sd`` the model does
    not have is a ``CheckpointError`` naming ``where`` (``verify_state_dict`` checks the tensors
    themselves before this).

    ``rebuildable``: register this call as the patcher's ``cached_patcher_init`` - ComfyUI
    rebuilds a model through it when it needs a non-dynamic copy (hooks in the conditioning on
    a dynamic-VRAM model) or one per GPU (multi-GPU); without it ComfyUI refuses those, and
    through its own loader it would rebuild our layers without their extras.  Keeps ``sd``
    alive as long as the patcher."""
    patcher = _load(dict(sd), metadata, where, **load_options)
    if patcher is not None and rebuildable:
        patcher.cached_patcher_init = (load_state_dict, (sd, metadata, True, where))  # rebuildable again
    return patcher


def _comfy_load(sd: dict, metadata: dict | None, where: str, model_options: dict | None = None,
                own_layers: bool = False, **load_options):
    """ComfyUI's loader on ``sd`` (which it consumes), with the layers of this pack's class
    (``lean.operations``); its errors and a model that does not match the tensors become
    one-line CheckpointErrors naming ``where``."""
    model_options = dict(model_options or {})
    try:
        sd, metadata, ops = lean.operations(sd, metadata, model_options, own_layers)
    except _COMFY_ERRORS as e:
        raise CheckpointError(f"{where}: ComfyUI could not read the model's layout: {one_line(e)[:300]}") from None
    if ops is not None:
        model_options["custom_operations"] = ops
    prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
    given = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)} or dict(sd)
    if "disable_dynamic" not in load_options and dynamic_vram_on():
        # (a placeholder of an fp8 convolution is one expanded zero: no memory)
        load_options["disable_dynamic"] = resident_fits(sum(t.nbytes for t in sd.values() if 0 not in t.stride()),
                                                        where, model_options.get("load_device"))
    try:
        patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options=model_options, metadata=metadata,
                                                           **load_options)
    except _COMFY_ERRORS as e:
        raise CheckpointError(f"{where}: ComfyUI could not build the model from it: {one_line(e)[:300]}") from None
    if patcher is not None:
        _check_matches(patcher, given, where)
    return patcher


def dynamic_vram_on() -> bool:
    """Whether ComfyUI builds models for its dynamic VRAM (its default on NVIDIA: main.py swaps
    ``CoreModelPatcher`` for ``ModelPatcherDynamic``)."""
    return comfy.model_patcher.CoreModelPatcher is getattr(comfy.model_patcher, "ModelPatcherDynamic", None)


def resident_fits(nbytes: int, where: str = "the model", device=None) -> bool:
    """Whether a model of ``nbytes`` weights is loaded the classic way (ComfyUI's ``ModelPatcher``,
    the weights resident on the GPU while it is loaded) instead of with dynamic VRAM: when it takes
    at most half the GPU (``device``, default ComfyUI's) next to ComfyUI's inference reserve.

    Why: dynamic VRAM pages every layer's weights in through ComfyUI's cast path at call time, so
    none of this pack's direct kernels can run (lean, and the layers compiled blocks trace as
    operators): Flux fp8 in a server compiled 16 frames where the resident model compiles 2, and
    no compile cache was shared between them (slower per prompt in a server than through the nodes
    in one process: docs/benchmarks.md, section 0).  A model that fits gains nothing from
    paging; a larger one keeps dynamic VRAM, which streams it where it does not fit (a classic
    load would leave part of it on the CPU, run by the cast path anyway).  Half, because a
    resident model is moved to the CPU when another model needs its room (switching models then
    costs about twice what it costs where both fit) - the other half is
    for the workflow's text encoder, swapped in whenever the prompt changes, and the activations.
    ComfyUI's ``--disable-dynamic-vram`` makes every model resident; a rebuild that asks for a
    kind (``cached_patcher_init``) gets it."""
    mm = comfy.model_management
    device = device if device is not None else mm.get_torch_device()
    total = mm.get_total_memory(device)
    fits = 2 * nbytes + mm.minimum_inference_memory() <= total
    logging.info(f"[comfy-modelopt] {where}: {nbytes / 2**30:.1f} GiB of weights, {total / 2**30:.1f} GiB on "
                 f"{device}: " + ("loaded resident (ComfyUI's classic load), where this pack's kernels run" if fits
                                  else "loaded with ComfyUI's dynamic VRAM (over half the GPU: paged in as ComfyUI needs, "
                                  "where this pack's lean kernels do not run)"))
    return fits


def _check_matches(patcher, given: dict, where: str) -> None:
    """The model ComfyUI built holds every parameter from ``given`` (its loader leaves a missing
    one uninitialised, or a quantized Linear without a weight) and ``given`` holds no layer the
    model lacks (its tensors would be dropped)."""
    model = patcher.model.diffusion_model
    keys = set(patcher.model.model_config.process_unet_state_dict(dict(given)))
    missing = [n for n, _ in model.named_parameters() if n not in keys]
    missing += [n + ".weight" for n, m in model.named_modules() if hasattr(m, "in_features")
                and getattr(m, "weight", 0) is None]
    if missing:
        raise CheckpointError(f"{where}: {missing[0]}: missing - the model ComfyUI detected needs it "
                              f"({len(missing)} tensors missing in all; ComfyUI would run them uninitialised)")
    modules = dict(model.named_modules())
    for name, m in modules.items():  # ComfyUI's mixed-precision Linear takes any weight shape it is given
        w = getattr(m, "weight", None)
        if w is None or not hasattr(m, "in_features"):
            continue
        q = getattr(w, "_qdata", None)
        if q is None:
            fits = tuple(w.shape) == (m.out_features, m.in_features)
        else:  # kitchen pads the rows of some formats (to 16 or 32)
            fmt = FORMATS.get(getattr(m, "quant_format", None))
            per = fmt.values_per_element if fmt is not None else 1
            fits = q.dim() == 2 and q.shape[1] * per == m.in_features and m.out_features <= q.shape[0] < m.out_features + 32
        if not fits:
            stored = list((w if q is None else q).shape)
            raise CheckpointError(f"{where}: {name}.weight: stored {stored} does not fit the "
                                  f"[{m.out_features}, {m.in_features}] layer of the model ComfyUI detected")
    _check_shapes(patcher, given, where)
    extra = sorted(k for k in keys if k.endswith(".weight") and k[:-7] not in modules)
    if extra:
        raise CheckpointError(f"{where}: {extra[0]}: a layer the model ComfyUI detected does not have "
                              f"({len(extra)} such tensors; a file of another model variant, or damaged)")


def _check_shapes(patcher, given: dict, where: str) -> None:
    """Every 16-bit tensor of ``given`` has the shape the model ComfyUI detected has there - read
    from that model built again on the meta device (ComfyUI's own loader may take a parameter of
    another shape as it is: a final convolution of 2 outputs instead of 4 loaded and sampled)."""
    config = patcher.model.model_config
    # ComfyUI reads a UNet's output channels off its final convolution, so a resized one builds
    # a model of that width: its output must be the latent it denoises
    unet, latent = config.unet_config, getattr(config.latent_format, "latent_channels", None)
    if "model_channels" in unet and latent and unet.get("out_channels") not in (None, latent, 2 * latent):
        raise CheckpointError(f"{where}: out.2.weight: {unet['out_channels']} output channels, the "
                              f"{type(config).__name__} latent it denoises has {latent}")
    try:
        with torch.device("meta"):
            reference = config.get_model({}, "", device="meta").diffusion_model.state_dict()
    except Exception:  # pragma: no cover - a model class that cannot be built on meta: the load checks stand
        return
    processed = config.process_unet_state_dict(dict(given))
    quantized = {k[:-len(COMFY_QUANT)] for k in processed if k.endswith(COMFY_QUANT)}
    for key, want in reference.items():
        got = processed.get(key)
        if got is None or key.rpartition(".")[0] in quantized or not hasattr(got, "shape"):
            continue
        if tuple(got.shape) != tuple(want.shape) and not got.numel() == want.numel() == 1:
            raise CheckpointError(f"{where}: {key}: stored {list(got.shape)} does not fit the {list(want.shape)} "
                                  f"tensor of the model ComfyUI detected")


def _load(sd: dict, metadata: dict | None, where: str, **load_options):
    if not needs_own_loader(metadata, sd):
        return _comfy_load(sd, metadata, where, **load_options)
    stock_sd, meta, extras = split_state_dict(sd, metadata)
    patcher = _comfy_load(stock_sd, meta, where, own_layers=True, **load_options)
    if patcher is None:
        return None
    try:
        attach(patcher, extras)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    # what a weight delta is divided by to land in the stored basis, shaped to broadcast
    divisors = {}
    for name, ex in extras.items():
        if ex.get("smooth_scale") is not None:
            divisors["diffusion_model." + name + ".weight"] = ex["smooth_scale"].float()  # per input column
        if ex.get("conv_scale") is not None:
            divisors["diffusion_model." + name + ".weight"] = ex["conv_scale"].float().view(-1, 1, 1, 1)
    model_record(patcher.model, create=True).stored_basis = divisors
    if divisors:
        _map_patches(None, patcher)
        patcher.add_callback_with_key(CallbacksMP.ON_CLONE, "comfy_modelopt_stored_basis", _map_patches)
    return patcher


def load_file(path: str, deep: bool = False, **load_options):
    """A MODEL from a file, verified first (``verify_state_dict``; ``deep``: the quantized
    weights' codes too); ComfyUI rebuilds copies by reading the file again.  The verification
    is on ``patcher.modelopt_verification``; a file ComfyUI detects no model in is a
    CheckpointError."""
    where = os.path.basename(path)
    with SafetensorsFile(path) as f:  # header and layout checked first: names an interrupted write, a bad key
        _check_fits_memory(f)
    sd, metadata = comfy.utils.load_torch_file(path, safe_load=True, return_metadata=True)
    checked = verify_state_dict(sd, metadata, where, deep)
    patcher = load_state_dict(sd, metadata, where=where, **load_options)
    if patcher is None:
        raise CheckpointError(f"{where}: ComfyUI detects no diffusion model in it (a layer its detection reads is "
                              f"missing or has another shape, or it is no diffusion model)")
    patcher.cached_patcher_init = (load_file, (path, deep))
    patcher.modelopt_verification = checked
    return patcher


def verify_state_dict(sd: dict, metadata: dict | None, where: str, deep: bool = False) -> Verification:
    """Every layer of ``sd`` against its format's contract, every scale and 16-bit value of the
    diffusion model read (verify.py); formats ComfyUI knows beyond comfy-modelopt's are left to
    ComfyUI.  Raises the first problem as a CheckpointError naming ``where``."""
    checked = verify(state_dict_entries(sd), metadata or {}, sd.__getitem__, read_conf_of(sd, where),
                     diffusion_prefix(sd), values=True, deep=deep,
                     runtime_formats=tuple(comfy.quant_ops.QUANT_ALGOS))
    checked.raise_for(where)
    return checked


def _check_fits_memory(f: SafetensorsFile) -> None:
    """A tensor larger than the memory left is refused before anything is read (a header may
    claim a 10^12-element tensor in a sparse file as large as it says)."""
    have = available_memory()
    if have is None:
        return
    big = max(f.tensors.values(), key=lambda t: t.nbytes, default=None)
    if big is not None and big.nbytes > have:
        raise CheckpointError(f"{f.name}: {big.name}: {big.dtype}{list(big.shape)} needs "
                              f"{big.nbytes / 2**30:.1f} GiB of memory, only {have / 2**30:.1f} GiB is available")


def attach(patcher, extras: dict) -> int:
    """Give every own-loader layer its low-rank branch and input smoothing, or its fp8 weight."""
    model = patcher.model.diffusion_model
    dtype = patcher.model.get_dtype() or torch.bfloat16
    for name, ex in extras.items():
        module = model.get_submodule(name)
        if not isinstance(module, lean.LeanForward):  # lean.operations gave none: ComfyUI built another model
            raise CheckpointError(f"{name}: {type(module).__name__} is not a layer this loader can extend")
        if "conv_weight" in ex:
            if not isinstance(module, torch.nn.Conv2d):
                raise CheckpointError(f"{name}: {CONV_FORMAT} needs a Conv2d, the model has {type(module).__name__}")
            if tuple(ex["conv_weight"].shape) != tuple(module.weight.shape):
                raise CheckpointError(f"{name}.weight: fp8 weight {list(ex['conv_weight'].shape)} does not fit the "
                                      f"model's {list(module.weight.shape)}")
            module.weight = torch.nn.Parameter(ex["conv_weight"], requires_grad=False)
            module.register_buffer("weight_scale", ex["conv_scale"])
            layer_record(module, create=True).own_forward = _conv_fp8_forward
            continue
        if not hasattr(module, "in_features"):
            raise CheckpointError(f"{name}: a low-rank layer needs a Linear, the model has {type(module).__name__}")
        want = {"lowrank_up": (module.out_features, None), "lowrank_down": (None, module.in_features),
                "smooth_scale": (module.in_features,)}
        for buf, shape in want.items():  # the verifier saw the file's shapes; this is the model's
            t = ex.get(buf)
            if t is not None and any(w is not None and w != d for w, d in zip(shape, t.shape)):
                raise CheckpointError(f"{name}.{buf}: {list(t.shape)} does not fit the [{module.out_features}, "
                                      f"{module.in_features}] layer of the model ComfyUI detected")
        for buf in ("lowrank_up", "lowrank_down", "smooth_scale"):
            t = ex.get(buf)
            if t is not None and buf != "smooth_scale":
                t = t.to(dtype=branch_dtype(dtype))
            module.register_buffer(buf, t)
        layer_record(module, create=True).own_forward = _branch_forward
    return len(extras)


class _IntoStoredBasis:
    """A patch's function: its delta (after the patch's own function) divided into the stored basis."""

    def __init__(self, divisor: torch.Tensor, inner=None):
        self.divisor, self.inner = divisor, inner

    def __call__(self, delta):
        delta = self.inner(delta) if self.inner is not None else delta
        return delta / self.divisor.to(delta.device, delta.dtype)


class _StoredBasisPatches(dict):
    """``ModelPatcher.patches`` whose entries on a layer stored in another basis (weight key ->
    divisor, ``ModelRecord.stored_basis``) are mapped into it as ``add_patches`` files them; entries
    with an offset (a slice of the weight) are left as they are."""

    def __init__(self, patches: dict, divisors: dict):
        super().__init__()
        self.divisors = divisors
        for key, entries in patches.items():
            self[key] = entries

    def __setitem__(self, key, entries):
        divisor = self.divisors.get(key)
        if divisor is not None:  # (strength_patch, value, strength_model, offset, function)
            entries[:] = [e if e[3] is not None or isinstance(e[4], _IntoStoredBasis)
                          else (*e[:4], _IntoStoredBasis(divisor, e[4])) for e in entries]
        super().__setitem__(key, entries)


def _map_patches(_, patcher):
    """Give ``patcher`` (a model of this loader, or its clone: an ``ON_CLONE`` callback) the
    stored-basis map of patches."""
    rec = model_record(patcher.model)
    if rec is not None and rec.stored_basis and not isinstance(patcher.patches, _StoredBasisPatches):
        patcher.patches = _StoredBasisPatches(patcher.patches, rec.stored_basis)


def _conv_fp8_forward(self, x, _inner):
    """Dequantize (fp32, per output channel) and convolve; weight functions (ComfyUI's lowvram
    patches) act on the stored basis, where their deltas were mapped to."""
    cast = comfy.model_management.cast_to_device
    w = cast(self.weight, x.device, torch.float32)
    for f in self.weight_function:
        w = f(w)
    w = CONV_FP8.decode(w, self.weight_scale).to(x.dtype)
    b = None if self.bias is None else cast(self.bias, x.device, x.dtype)
    for f in self.bias_function:
        b = f(b)
    return self._conv_forward(x, w, b)


def _branch_forward(self, x, inner):
    """The smoothed input through the layer's class forward (``inner``) plus the low-rank branch."""
    return branched(x, inner, self.lowrank_down, self.lowrank_up, self.smooth_scale,
                    to=lambda t, x: comfy.model_management.cast_to_device(t, x.device, x.dtype))


__all__ = ["LOWRANK_PREFIX", "attach", "load_file", "load_state_dict", "needs_own_loader", "split_state_dict"]
