"""Where the 16-bit model goes, the quantized one goes too: what users attach between a model and a
sampler (benchmarks/attachments.py: ControlNets in ComfyUI's layouts, the stock patch nodes,
regional conditioning, a hires-fix pass, another size, wrappers) on Quantize Model's output with
its default runtime, against the 16-bit model with the same attachment - in a real ComfyUI on the
CPU (the semantics: no exception, the attachment's effect on the final latent as on the 16-bit
model) and on a GPU (the runtime's paths: captured into the graphs, or eager with its reason)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402

if not models.COMFYUI_PATH:
    pytest.skip("COMFYUI_PATH is not set: ComfyUI attachment tests SKIPPED (point it at a ComfyUI v0.29+ tree)",
                allow_module_level=True)

models.setup_comfy()
import comfy.model_management as mm  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.sd  # noqa: E402

import attachments as att  # noqa: E402
from test_nodes import load_pack, pack_module, runner_of  # noqa: E402

from comfy_modelopt.calibrate import CalibrationOptions, calibrate  # noqa: E402

CUDA = torch.cuda.is_available()


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def conditioning(family: str):
    g = torch.Generator().manual_seed(5)
    if family == "flux":
        ctx, pooled = torch.randn(1, 16, 256, generator=g), torch.randn(1, 256, generator=g)
        extra = {"pooled_output": pooled, "guidance": 3.5}
        return [[ctx, dict(extra)]], [[ctx * 0, dict(extra)]], 1.0
    if family == "sd3":
        ctx, pooled = torch.randn(1, 77, 4096, generator=g), torch.randn(1, 2048, generator=g)
        return [[ctx, {"pooled_output": pooled}]], [[ctx * 0.3, {"pooled_output": pooled * 0.3}]], 5.0
    if family == "qwen_image":  # Qwen2.5-VL's hidden states
        ctx = torch.randn(1, 12, 3584, generator=g)
        return [[ctx, {}]], [[ctx * 0.3, {}]], 4.0
    ctx = torch.randn(1, 77, 768, generator=g)
    return [[ctx, {}]], [[ctx * 0.3, {}]], 5.0


def setups(family: str, runtime: str = "auto", seed: int = 2):
    """(the 16-bit Setup, the quantized Setup): the same conditioning and latent, the quantized
    model from Quantize Model (fp8, calibrated on the 16-bit model's sampling runs)."""
    dtype = torch.float16 if CUDA else torch.float32
    _, sd = models.build(family, "small", seed=seed, dtype=dtype)
    model = comfy.sd.load_diffusion_model_state_dict(sd)
    pos, neg, cfg = conditioning(family)
    latent = torch.zeros(1, 16 if family in ("flux", "sd3", "qwen_image") else 4, 12, 16)
    s16 = att.Setup(family, model, pos, neg, latent, cfg, steps=4)
    mm.load_models_gpu([model])
    stats = calibrate(model.model.diffusion_model, lambda _m: att.run(s16), CalibrationOptions())
    with torch.inference_mode():
        q, _report = load_pack().ModelOptQuantizeUNet.execute(
            model=model, format="float8_e4m3fn", weight_scale="absmax", input_scale="max", smoothing="none",
            gptq=False, convrot=False, static_nvfp4_input=False, keep="", runtime=runtime, calibration=stats).args[:2]
    return s16, s16.replace(model=q)


@pytest.fixture(scope="module", params=["sd15", "flux", "sd3", "sd15_inpaint", "qwen_image"])
def pair(request):
    return request.param, *setups(request.param)


def sampled(s) -> torch.Tensor:
    with torch.inference_mode():
        return att.run(s).float()


# cases stock ComfyUI gets wrong on every quantized model, its own files loaded by its own loader
# included (checked in test_comfyui_hook_loras_fail_on_quantized_models, which fails once ComfyUI mends it)
COMFYUI_BUGS = {"lora hook with keyframes": "ComfyUI's hook patching looks every state-dict name of a quantized layer "
                                            "up as an attribute ('weight_scale' is inside its QuantizedTensor), then "
                                            "sets its weight in place and copies float weights into it, which "
                                            "ComfyUI's quantized layers refuse"}


def test_every_attachment_moves_the_quantized_model_as_the_16bit_one(pair):
    """Every case of the family: samples without an exception, finite; where the case keeps the
    latent's shape its effect on the quantized model's final latent is the 16-bit model's within
    +-30% (or both negligible), and quantized-vs-16-bit under the case stays within 1.5x of the
    distance without it (+0.02, +10% of the case's own effect)."""
    family, s16, sq = pair
    base16, baseq = sampled(s16), sampled(sq)
    plain = rel(baseq, base16)
    rows, bad = [], []
    for name in att.cases_for(family, full_size=False):
        if name in COMFYUI_BUGS:
            continue
        c16, cq = att.apply(name, s16), att.apply(name, sq)
        out16, outq = sampled(c16), sampled(cq)
        assert torch.isfinite(outq).all(), name
        dist = rel(outq, out16)
        row = {"case": name, "dist": dist, "plain": plain}
        if out16.shape == base16.shape and c16.second_pass is None and c16.denoise == 1.0:
            e16, eq = rel(out16, base16), rel(outq, baseq)
            row.update(effect16=e16, effectq=eq)
            if e16 > 0.02 and not 0.7 <= eq / e16 <= 1.3:
                bad.append(row)
            elif e16 <= 0.02 and eq > 0.05:
                bad.append(row)
        # a case that moves the latent far (skipping a tiny model's only block) carries the
        # quantization error further too: 10% of its own effect is allowed on top
        if dist > 1.5 * plain + 0.02 + 0.1 * row.get("effect16", 0.0):
            bad.append(row)
        rows.append(row)
    print("\n".join(str(r) for r in rows))
    assert not bad, bad


def test_control_lora_gets_the_quantized_layers_real_weights(monkeypatch):
    """A Control-LoRA: ComfyUI builds its control copy from ``diffusion_model.state_dict()``, a
    quantized layer's codes without their scale.  On this pack's models the copies get the layers'
    real weights (``control_graphs.mend_control_loras``): its effect on the latent is the 16-bit
    model's.  The same weights loaded by ComfyUI's own loader still take the codes - its effect
    several times the 16-bit model's (this part fails once ComfyUI mends it)."""
    s16, sq = setups("sd15")
    effect = lambda s: rel(sampled(att.apply("control-lora", s)), sampled(s))  # noqa: E731
    control_graphs = pack_module("control_graphs")
    made = []

    class Recorded(control_graphs.CudaGraphs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)
    monkeypatch.setattr(control_graphs, "CudaGraphs", Recorded)
    e16, eq = effect(s16), effect(sq)
    assert e16 > 0.001 and 0.7 <= eq / e16 <= 1.3, (e16, eq)
    # its network (built for the run) went through a graph runner of its own (on the CPU: eagerly,
    # saying why), dropped with the run
    assert [type(r.patcher.model).__name__ for r in made] == ["ControlNet"] and not controls_of(sq.model).runners
    assert all(r.eager_calls and "not on a CUDA device" in r.warned for r in made) or CUDA
    with torch.inference_mode():
        sd = {k[len("diffusion_model."):]: v for k, v in sq.model.model_state_dict("diffusion_model.").items()}
    stock = sq.replace(model=comfy.sd.load_diffusion_model_state_dict(sd))
    assert runner_of(stock.model) is None
    assert effect(stock) > 3 * e16, (e16, effect(stock))


def test_comfyui_hook_loras_fail_on_quantized_models():
    """A LoRA as a hook with keyframes (Create Hook LoRA, Set Hook Keyframes) on a quantized model:
    ComfyUI's hook patching fails in its own code - on Quantize Model's output and on the same
    weights loaded by ComfyUI's own loader (its own quantized layers) alike, while the 16-bit model
    takes it.  This test fails once ComfyUI mends it, so the case joins the others."""
    s16, sq = setups("sd15")
    sampled(att.apply("lora hook with keyframes", s16))
    with torch.inference_mode():
        sd = {k[len("diffusion_model."):]: v for k, v in sq.model.model_state_dict("diffusion_model.").items()}
    assert any(k.endswith(".weight_scale") for k in sd)
    stock = sq.replace(model=comfy.sd.load_diffusion_model_state_dict(sd))  # (it takes the dict's keys)
    assert runner_of(stock.model) is None
    for case in (sq, stock):
        with pytest.raises((AttributeError, AssertionError, TypeError)):
            sampled(att.apply("lora hook with keyframes", case))


def test_two_quantized_models_in_one_workflow():
    """A base model and a refiner, both quantized (two KSamplerAdvanced: the first returns its
    leftover noise at step 2, the second finishes without adding noise): the final latent is the
    two 16-bit models' within the quantization's own distance."""
    base16, baseq = setups("sd15")
    ref16, refq = setups("sd15", seed=3)
    assert refq.model.model is not baseq.model.model

    out16, outq = (sampled(b.replace(refiner=(r.model, 2))) for b, r in ((base16, ref16), (baseq, refq)))
    alone16, aloneq = sampled(base16), sampled(baseq)  # the base model's 4 steps alone
    plain, e16, eq = rel(aloneq, alone16), rel(out16, alone16), rel(outq, aloneq)
    assert torch.isfinite(outq).all() and e16 > 2 * plain and 0.7 <= eq / e16 <= 1.3, (plain, e16, eq)
    assert rel(outq, out16) <= 1.5 * plain + 0.1 * e16, (rel(outq, out16), plain, e16)


def test_torch_compile_model_after_quantize_model():
    """TorchCompileModel after Quantize Model: the runtime leaves its whole-model compile out, said
    once in the log (it compiles the blocks itself), and samples as without it."""
    _, sq = setups("sd15")
    runner = runner_of(sq.model)
    out = sampled(att.apply("torchcompilemodel", sq))
    assert torch.equal(out, sampled(sq))
    assert any("TorchCompileModel's compile is left out" in w for w in runner.warned), runner.warned


def test_inpainting_keeps_what_the_mask_keeps(pair):
    """Set Latent Noise Mask on the quantized model: the unmasked half of the latent comes back as
    it went in (but for the latent format's scaling in and out), the masked half sampled as on the
    16-bit model."""
    family, s16, sq = pair
    c16, cq = att.apply("inpaint (latent noise mask)", s16), att.apply("inpaint (latent noise mask)", sq)
    out16, outq = (sampled(c).reshape(c.latent.shape) for c in (c16, cq))  # Qwen-Image's comes back with a frame axis
    half = outq.shape[-1] // 2
    assert rel(outq[..., half:], cq.latent[..., half:]) < 1e-5 and rel(out16[..., half:], c16.latent[..., half:]) < 1e-5
    assert rel(outq[..., :half], out16[..., :half]) <= 1.5 * rel(sampled(sq), sampled(s16)) + 0.02


def test_merging_another_model_patches_the_quantized_weights(pair):
    """ModelMergeSimple with another 16-bit model: weight patches on the quantized layers (ComfyUI
    re-quantizes them), the merge's effect as on the 16-bit model."""
    family, s16, sq = pair
    _, sd = models.build(family, "small", seed=9, dtype=torch.float16 if CUDA else torch.float32)
    other = comfy.sd.load_diffusion_model_state_dict(sd)
    base16, baseq = sampled(s16), sampled(sq)
    out16, outq = sampled(att.merge(s16, other)), sampled(att.merge(sq, other))
    e16, eq = rel(out16, base16), rel(outq, baseq)
    assert e16 > 0.005 and 0.7 <= eq / e16 <= 1.3, (e16, eq)
    assert rel(outq, out16) <= 1.5 * rel(baseq, base16) + 0.02


CUDA_ONLY = pytest.mark.skipif(not CUDA, reason="needs CUDA: the runtime's graph paths (capture, replay, fallback)")
# what each case does to the graphs: captured (replays, no eager call but a check), or eager with a
# reason; a diffusion-model wrapper that decides per call in Python (the cache wrapper: it keeps the
# last input in a dict and reads the GPU from its second call on) runs eagerly around a captured forward
KEEPS = "keeps tensors it made between calls"
EAGER = {"sag": (KEEPS,), "hypertile": ("draws random numbers on the host",)}
BENEATH = ("first-block cache wrapper",)
# patches that read the step's sigma on the host: one graph per step, every step replayed from the second image on
PER_STEP = ("deep shrink", "ip-adapter attn2 sigma range")


@CUDA_ONLY
@pytest.mark.parametrize("family", ["sd15", "flux"])
def test_attachments_take_the_graphs_or_say_why(family):
    """On a GPU every case runs through the default runtime's graphs - ControlNet residuals,
    patches, replaces and wrappers captured - and matches the quantized model's eager run (the
    lean runtime, the same attachment) within the compiled blocks' tolerance; a patch that reads
    the step's sigma gets a graph per step, replayed at the second image; a case the graphs
    cannot hold runs eagerly with its reason."""
    _, sq = setups(family)
    _, lean = setups(family, runtime="lean")
    runner, controls = runner_of(sq.model), controls_of(sq.model)
    assert runner is not None
    failures = []
    for name in ["plain"] + [n for n in att.cases_for(family, full_size=False) if n not in COMFYUI_BUGS]:
        case = sq if name == "plain" else att.apply(name, sq)
        replays, failed, steps = runner.replays, set(runner.failed.values()), len(runner.per_step)
        control_replays = sum(r.replays for r in controls.runners.values())
        out = sampled(case)
        if name.startswith("controlnet") or name == "control-lora":  # the ControlNets' networks replayed too
            nets = list(controls.runners.values())
            if sum(r.replays for r in nets) == control_replays or any(r.failed for r in nets):
                failures.append((name, "controlnet graphs", [(r.replays, r.failed, r.warned) for r in nets]))
        if name in PER_STEP:
            replays = runner.replays
            out = sampled(case)  # the second image: every step replayed
        ref = sampled(lean if name == "plain" else att.apply(name, lean))
        new = set(runner.failed.values()) - failed
        expected = EAGER.get(name)
        if name in BENEATH:
            if runner.replays == replays or not any("decide per call" in w and KEEPS in w for w in runner.warned) \
                    or not rel(out, ref) < 0.05:
                failures.append((name, runner.replays - replays, runner.warned, rel(out, ref)))
        elif expected is None:
            if runner.replays - replays < (sq.steps if name in PER_STEP else 1) or new or not rel(out, ref) < 0.05 \
                    or (len(runner.per_step) > steps) != (name in PER_STEP):
                failures.append((name, runner.replays - replays, new, rel(out, ref)))
        elif not any(e in r for e in expected for r in new | runner.warned):
            failures.append((name, new))
    print(runner.failed, runner.warned, runner.captures, runner.replays, runner.evictions)
    assert not failures, failures


def controls_of(patcher):
    """The runtime's ``ControlGraphs`` (its CALC_COND_BATCH wrapper) on a MODEL."""
    return next(iter(patcher.get_wrappers("calc_cond_batch", "comfy_modelopt_cuda_graphs")), None)


def test_controlnets_run_through_their_own_graph_runner():
    """Every ControlNet in the step's conditioning - both of a stacked pair - runs through a graph
    runner of its own for the call (on the CPU: eagerly, saying why), its network left as it was,
    the latent the lean runtime's with the same ControlNets."""
    _, sq = setups("sd15")
    _, lean = setups("sd15", runtime="lean")
    controls = controls_of(sq.model)
    out = sampled(att.apply("controlnet x2 start/end", sq))
    ref = sampled(att.apply("controlnet x2 start/end", lean))
    runners = [(r.patcher.model, r) for r in controls.runners.values()]
    assert len(runners) == 2 and all("forward" not in net.__dict__ for net, _ in runners)
    assert all(r.eager_calls and "not on a CUDA device" in r.warned for _, r in runners) or CUDA
    assert rel(out, ref) < (0.05 if CUDA else 1e-3)  # on a GPU: over compiled blocks, the lean run not
    sampled(att.apply("controlnet", sq))  # another ControlNet: the two before go, with their graphs
    assert len(controls.runners) == 1 and not {id(net) for net, _ in runners} & set(controls.runners)


def test_a_wrapper_that_decides_per_call_runs_around_the_captured_forward():
    """The pieces of capturing beneath other packs' DIFFUSION_MODEL wrappers, in real ComfyUI (the
    capture itself: test_attachments_take_the_graphs_or_say_why on a GPU): the cache wrapper's
    state kept in a dict is seen; the runtime's wrapper runs innermost, after the cache wrapper,
    and its call of the diffusion model's forward by name gives the forward's own output."""
    from comfy_modelopt.comfyui.graph_inputs import ModelCall, kept_state, state_changes
    _, sq = setups("sd15")
    case = att.apply("first-block cache wrapper", sq)
    cache = case.model.get_wrappers("diffusion_model", "first_block_cache")[0]
    order, outs = [], []

    def innermost(executor, *args, **kwargs):
        order.append("runtime")
        call, forward = ModelCall.of_forward(executor.original, args, kwargs)
        assert call.model_wrappers() == [outer] and call.args[0] is args[0]
        outs.append((call.run(forward), executor(*args, **kwargs)))
        return outs[-1][0]
    innermost.comfy_modelopt_own = True

    def outer(executor, *args, **kwargs):
        order.append("cache")
        return cache(executor, *args, **kwargs)
    state = kept_state([cache])
    patched = case.model.clone()
    patched.remove_wrappers_with_key("diffusion_model", "first_block_cache")
    patched.add_wrapper_with_key("diffusion_model", "cache", outer)
    # the runtime's outer call (an APPLY_MODEL wrapper) with its own wrapper made innermost
    patched.add_wrapper_with_key("apply_model", "beneath", lambda executor, *args, **kwargs: ModelCall(
        args, kwargs).with_innermost(innermost, "comfy_modelopt.cuda_graphs").run(executor))
    sampled(case.replace(model=patched))
    assert order[:2] == ["cache", "runtime"] and outs, order
    assert all(torch.equal(a, b) for a, b in outs)
    assert state_changes(state), "the cache's dict of tensors went unseen"


@CUDA_ONLY
def test_a_capture_failed_inside_leaves_the_next_captures_working():
    """A patch that synchronizes while captured fails its capture inside CUDA (the stream capture
    invalidated); that signature runs eagerly, and the next signatures are captured and replayed
    (before, torch left the pool marked as recording and every later capture failed)."""
    _, sq = setups("sd15")
    runner = runner_of(sq.model)

    def syncing(q, k, v, extra_options):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return q, k, v
    patched = sq.model.clone()
    patched.set_model_attn1_patch(syncing)
    sampled(sq.replace(model=patched))
    assert len(runner.failed) == 1 and "capture failed" in next(iter(runner.failed.values()))
    for case in (att.apply("batch 2", sq), sq):
        replays = runner.replays
        sampled(case)
        sampled(case)
        assert runner.replays - replays >= case.steps and len(runner.failed) == 1, runner.failed
