"""The comfy-modelopt nodes (ComfyUI V3 node API).  Thin: inputs -> Recipe -> core -> output.

Node ids are those of the older comfy-modelopt pack, so its saved workflows still open.
"""
from __future__ import annotations

import os

import torch
from typing_extensions import override

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.latest import ComfyExtension, io

from ..calibrate import CalibrationOptions
from ..checkpoint import inspect_file
from ..errors import ModelOptError, OutputExistsError, PlanError
from ..modelopt_engine import ALGORITHMS as MODELOPT_ALGORITHMS, ENGINE_FORMATS, check_request
from ..pipeline import DictSink, quantize
from ..progress import Progress
from ..prompts import DEFAULT_NEGATIVE, DEFAULT_PROMPTS, SAMPLING_OPTIONS, Sampling
from ..recipe import recipe_from_values
from ..safetensors_io import write_file
from ..stats import ActivationStats
from ..statsfile import load_stats, save_stats
from .compat import check_kitchen
from .runtime import enable_cuda_graphs
from .recipe_inputs import (QUANTIZE_INPUTS, QUANTIZE_INPUTS_AFTER_RUNTIME, QUANTIZE_INPUTS_BEFORE_CALIBRATION,
                            recipe_input, sampling_input)
from .runtime import (DEFAULT_RUNTIME, DEQUANT_CACHE_TOOLTIP, RUNTIMES, apply_runtime, first_call_of, gpu_note,
                      runtime_tooltip)
from . import ownloader
from .report_image import compare as compare_images, render as render_report
from .folders import (CALIBRATION_FOLDER, OLD_UNET_FOLDER, free_path, register_folders, save_folder,  # noqa: F401
                      save_path, unet_files)
from .model import NodeError, PatcherSource, artifact_of, build_quantized_model, compute_device, log
from .sampling import calibrate_by_sampling, empty_latent, modelopt_by_sampling

CALIBRATION = io.Custom("MODELOPT_CALIBRATION")
CATEGORY = "modelopt"
def _node_id(cls) -> str | None:
    return getattr(cls.hidden, "unique_id", None) if cls.hidden is not None else None


class EngineCalibration:
    """What Calibrate Model hands over with ``engine = modelopt``: this pack's activation statistics
    (held-out searches, GPTQ, the planner, the report) and NVIDIA ModelOpt's calibration choices
    (input ranges, smoothing scales) for one format."""

    def __init__(self, stats: ActivationStats, engine):
        self.stats, self.engine = stats, engine


def _calibration_parts(calibration):
    """(statistics, ModelOpt engine result or None) of a CALIBRATION input."""
    if isinstance(calibration, EngineCalibration):
        return calibration.stats, calibration.engine
    return calibration, None


# ====================================================================== calibrate
class ModelOptCalibrationHelper(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ModelOptCalibrationHelper",
            display_name="Calibrate Model (ModelOpt)",
            category=CATEGORY,
            description="Samples real prompts through ComfyUI's own sampler over the whole denoising "
                        "trajectory and records what every Linear layer's input looks like. Feed the "
                        "result to Quantize Model for W8A8 fp8 with static input scales, smoothing, "
                        "activation-aware clipping and GPTQ.",
            inputs=[
                io.Model.Input("model", tooltip="The 16-bit model to calibrate (LoRAs applied upstream count)."),
                io.Clip.Input("clip", tooltip="The text encoder of this model."),
                io.String.Input("prompts", multiline=True, default="\n".join(DEFAULT_PROMPTS),
                                tooltip="One prompt per line; the first num_prompts are used."),
                io.String.Input("negative_prompt", multiline=True, default=DEFAULT_NEGATIVE,
                                tooltip="The negative prompt every calibration sample uses (as in your workflows)."),
                *map(sampling_input, SAMPLING_OPTIONS),
                io.String.Input("save_name", default="", tooltip="If set, also save the statistics as "
                                "models/modelopt_calibration/<save_name>.safetensors (for the CLI's --stats)."),
                io.Latent.Input("latent", optional=True, tooltip="Sample this latent instead of an empty "
                                "width x height image (video models need their own latent)."),
                # optional: workflows saved before these inputs existed still validate
                io.Combo.Input("engine", options=["own", "modelopt"], default="own", advanced=True, optional=True,
                               tooltip="modelopt: also calibrate with NVIDIA ModelOpt (pip install "
                                       "'comfy-modelopt[modelopt]') for one format (modelopt_format); Quantize "
                                       "Model writes its scales into the same stock file. Samples the prompts "
                                       "twice, on a copy of the model (twice its VRAM)."),
                io.Combo.Input("modelopt_algorithm", options=list(MODELOPT_ALGORITHMS), default="max", advanced=True,
                               optional=True, tooltip="max: ModelOpt's amax calibrators (fp8, int8, nvfp4); "
                                                      "smoothquant: int8; awq_lite: nvfp4, needs CUDA; awq_full: "
                                                      "awq_lite plus ModelOpt's weight clip search; svdquant: nvfp4 "
                                                      "with a rank-32 16-bit branch per layer, needs CUDA - "
                                                      "then Quantize Model with lowrank 32 (a file for this "
                                                      "pack's loader)."),
                io.Combo.Input("modelopt_format", options=list(ENGINE_FORMATS), default=ENGINE_FORMATS[0],
                               advanced=True, optional=True,
                               tooltip="The format Quantize Model will write (ModelOpt calibrates for one)."),
            ],
            outputs=[CALIBRATION.Output(display_name="calibration"), io.String.Output(display_name="summary")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, clip, prompts, negative_prompt, save_name, latent=None, engine="own",
                modelopt_algorithm="max", modelopt_format=ENGINE_FORMATS[0], **sampling) -> io.NodeOutput:
        lines = [p.strip() for p in prompts.splitlines() if p.strip()][:sampling["num_prompts"]]
        how = Sampling.of(sampling)
        if engine == "modelopt":  # what ModelOpt cannot do is refused before any sampling
            try:
                check_request(modelopt_format, modelopt_algorithm, model.load_device)
            except ModelOptError as e:
                raise NodeError(str(e)) from None
        if latent is not None:
            samples = _latent_samples(model, latent)
        else:
            samples = empty_latent(model, sampling["width"], sampling["height"])
        opts = CalibrationOptions(reservoir_bytes=int(sampling["samples_mib_per_layer"] * 2**20), seed=how.seed,
                                  check_calls=0)  # only quantize_module reads them
        stats = calibrate_by_sampling(model, clip, lines, negative_prompt, how, samples, opts, node_id=_node_id(cls))
        summary = _stats_text(stats)
        result = stats
        if engine == "modelopt":
            try:
                found = modelopt_by_sampling(model, clip, lines, negative_prompt, how, samples, modelopt_format,
                                             modelopt_algorithm, node_id=_node_id(cls))
            except ModelOptError as e:
                raise NodeError(str(e)) from None
            result = EngineCalibration(stats, found)
            summary += (f"\n{found.note()} for {found.format}: {len(found.layers)} Linear layers, "
                        f"{sum(l.smooth is not None for l in found.layers.values())} with smoothing scales")
            if save_name.strip():
                summary += "\n(the saved file holds this pack's statistics only, not ModelOpt's choices)"
        if save_name.strip():
            register_folders()
            folder = folder_paths.get_folder_paths(CALIBRATION_FOLDER)[0]
            os.makedirs(folder, exist_ok=True)
            name = save_name.strip()
            path = os.path.join(folder, name if name.endswith(".safetensors") else name + ".safetensors")
            save_stats(stats, path, overwrite=True)
            summary += f"\nsaved: {path}"
        log(summary)
        return io.NodeOutput(result, summary)


def _latent_samples(model, latent: dict) -> torch.Tensor:
    import comfy.sample
    return comfy.sample.fix_empty_latent_channels(model, latent["samples"][:1],
                                                  latent.get("downscale_ratio_spacial", None),
                                                  latent.get("downscale_ratio_temporal", None))


def _stats_text(stats: ActivationStats) -> str:
    s = stats.summary()
    text = (f"calibrated {s['layers_with_data']}/{s['layers']} Linear layers over {s['forward_calls']} model "
            f"calls ({s.get('prompts')} prompts x {s.get('steps')} steps), statistics {s['bytes'] / 2**20:.1f} MiB")
    if "sampled_rows_min" in s:
        text += f"\nsampled input rows per layer: {s['sampled_rows_min']}-{s['sampled_rows_max']}"
        if s["layers_fewer_rows_than_inputs"]:
            text += (f"; {s['layers_fewer_rows_than_inputs']} layers hold fewer rows than they have inputs (GPTQ "
                     f"would round them from a rank-deficient Hessian; fewest: {s['fewest_rows_per_input']}) - "
                     "raise samples_mib_per_layer for GPTQ")
    if s["never_ran"]:
        text += f"\nlayers that never ran: {', '.join(s['never_ran'][:5])}"
    return text


class ModelOptLoadCalibration(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        register_folders()
        return io.Schema(
            node_id="ModelOptLoadCalibration",
            display_name="Load Calibration (ModelOpt)",
            category=CATEGORY,
            description="Load statistics saved by Calibrate Model (models/modelopt_calibration).",
            inputs=[io.Combo.Input("calibration_name", options=folder_paths.get_filename_list(CALIBRATION_FOLDER),
                                   tooltip="Statistics saved by Calibrate Model (its save_name) in "
                                           "models/modelopt_calibration/. Empty: run Calibrate Model with a "
                                           "save_name first, then refresh.")],
            outputs=[CALIBRATION.Output(display_name="calibration"), io.String.Output(display_name="summary")],
        )

    @classmethod
    def execute(cls, calibration_name) -> io.NodeOutput:
        stats = load_stats(folder_paths.get_full_path_or_raise(CALIBRATION_FOLDER, calibration_name))
        return io.NodeOutput(stats, _stats_text(stats))


# ====================================================================== quantize
class ModelOptQuantizeUNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ModelOptQuantizeUNet",
            display_name="Quantize Model (ModelOpt)",
            category=CATEGORY,
            description="Quantizes the diffusion model into ComfyUI's native format and returns a stock "
                        "quantized MODEL that samples right away (ComfyUI's mixed-precision ops and "
                        "comfy-kitchen kernels). The input MODEL is not changed; LoRAs applied upstream "
                        "are baked in.",
            inputs=[
                io.Model.Input("model", tooltip="The 16-bit model to quantize (LoRAs applied upstream are baked in; "
                                                "it is left unchanged)."),
                *map(recipe_input, QUANTIZE_INPUTS_BEFORE_CALIBRATION),
                CALIBRATION.Input("calibration", optional=True,
                                  tooltip="From Calibrate Model: static input scales (true fp8 W8A8), smoothing, "
                                          "activation-aware clipping, GPTQ, per-layer sensitivity."),
                *map(recipe_input, QUANTIZE_INPUTS),
                io.Combo.Input("runtime", options=list(RUNTIMES), default=DEFAULT_RUNTIME, tooltip=runtime_tooltip()),
                io.Float.Input("dequant_cache_gib", default=0.0, min=0.0, max=1024.0, step=0.5, advanced=True,
                               optional=True, tooltip=DEQUANT_CACHE_TOOLTIP),
                *map(recipe_input, QUANTIZE_INPUTS_AFTER_RUNTIME),
            ],
            outputs=[io.Model.Output(display_name="model"), io.String.Output(display_name="report"),
                     io.Image.Output(display_name="report_image",
                                     tooltip="The report as a chart (connect Preview Image): each Linear layer's "
                                             "measured error coloured by its format, the layers kept 16-bit, the "
                                             "file's bytes by format against the 16-bit model")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, runtime=DEFAULT_RUNTIME, calibration=None, dequant_cache_gib=0.0,
                **options) -> io.NodeOutput:
        try:
            recipe = recipe_from_values(options)
        except (ValueError, TypeError) as e:
            raise NodeError(str(e)) from None
        calibration, engine = _calibration_parts(calibration)
        if recipe.needs_statistics() and calibration is None:
            raise NodeError(f"{', '.join(recipe.needs_statistics())} needs calibration: connect Calibrate Model "
                            "(or Load Calibration) to the calibration input")
        source = PatcherSource(model, compute_device())
        pbar = comfy.utils.ProgressBar(1, node_id=_node_id(cls))
        console = Progress("quantizing", write=log)

        def progress(done, total, name):
            pbar.update_absolute(done, total)
            console(done, total, name)

        sink = DictSink("cpu")
        try:  # a MODEL ComfyUI loaded is a diffusion model: an unknown family gets the generic rules
            report = quantize(source, recipe, calibration, sink=sink, refuse_unknown=False, engine=engine,
                              progress=progress, source_info={"name": "ComfyUI MODEL"},
                              check_interrupt=comfy.model_management.throw_exception_if_processing_interrupted).report
        except PlanError as e:
            raise NodeError(str(e)) from None
        qmodel = build_quantized_model(sink.tensors, sink.metadata, report, model)
        qmodel, runtime_note = apply_runtime(qmodel, runtime, dequant_cache_gib,
                                             first_call=getattr(calibration, "first_call", None))
        text = "\n".join([report.summary(), gpu_note(recipe.format), runtime_note])
        log(text)
        chart = torch.from_numpy(render_report(report, recipe.budget)).float().div(255.0).unsqueeze(0)
        return io.NodeOutput(qmodel, text + "\n\n" + report.table(), chart)


# ====================================================================== save / load
class ModelOptSaveQuantized(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ModelOptSaveQuantized",
            display_name="Save Quantized Model (ModelOpt)",
            category=CATEGORY,
            description="Writes the quantized model into models/diffusion_models (atomically, with its "
                        "report and recipe), where ComfyUI's own Load Diffusion Model lists it.",
            inputs=[
                io.Model.Input("model", tooltip="The MODEL output of Quantize Model."),
                io.String.Input("filename", default="quantized/model-fp8",
                                tooltip="Relative to models/diffusion_models; .safetensors is added. A name "
                                        "that exists gets the next free counter (model-fp8_00001), as "
                                        "ComfyUI's own savers do."),
                io.Boolean.Input("overwrite", default=False,
                                 tooltip="Replace a file of the same name instead of adding a counter."),
            ],
            outputs=[io.String.Output(display_name="path")],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, filename=None, overwrite=None):
        # before the graph runs: a name that cannot be written would otherwise be refused after
        # Quantize Model (one that exists is saved under the next free counter)
        if not isinstance(filename, str):  # linked from another node: checked when it runs
            return True
        try:
            save_path(filename)
        except NodeError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, model, filename, overwrite) -> io.NodeOutput:
        art = artifact_of(model)
        if art is None:
            raise NodeError("this MODEL was not made by Quantize Model: connect its MODEL output "
                            "(stock files from disk are already saved)")
        asked = save_path(filename)
        os.makedirs(os.path.dirname(asked), exist_ok=True)
        pbar = comfy.utils.ProgressBar(len(art.state_dict))
        console = Progress("saving", write=log, unit="tensors")

        def each(i):
            pbar.update_absolute(i + 1)
            console(i + 1, len(art.state_dict), "")
            comfy.model_management.throw_exception_if_processing_interrupted()
        for attempt in range(3):
            path = asked if overwrite else free_path(asked)
            log(f"saving {path}")
            try:
                write_file(path, art.state_dict, art.metadata, overwrite=overwrite, on_tensor=each)
                break
            except OutputExistsError:  # another run took that name while this one wrote
                if attempt == 2:
                    raise
        size = os.path.getsize(path)
        text = f"saved {path} ({size / 2**20:.1f} MiB)"
        if path != asked:
            text += f"; {os.path.basename(asked)} exists, so the next free name was taken (overwrite replaces it)"
        log(text)
        return io.NodeOutput(path, ui={"text": [text]})


class ModelOptUNetLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ModelOptUNetLoader",
            display_name="Load Quantized Model (ModelOpt)",
            category=CATEGORY,
            description="Loads a quantized diffusion model (diffusion_models or the older modelopt_unet "
                        "folder) after checking it: every layer against its format (tensors, dtypes, "
                        "shapes, scales finite and > 0), every 16-bit value finite, no layer missing; "
                        "a damaged file is refused naming the key at fault. Shows its report.",
            inputs=[io.Combo.Input("unet_name", options=unet_files(),
                                   tooltip="A quantized file in models/diffusion_models/ (any maker's); "
                                           "checked layer by layer before ComfyUI sees it."),
                    io.Combo.Input("runtime", options=list(RUNTIMES), default=DEFAULT_RUNTIME, tooltip=runtime_tooltip()),
                    io.Float.Input("dequant_cache_gib", default=0.0, min=0.0, max=1024.0, step=0.5, advanced=True,
                                   optional=True, tooltip=DEQUANT_CACHE_TOOLTIP)],
            outputs=[io.Model.Output(display_name="model"), io.String.Output(display_name="report")],
        )

    @classmethod
    def execute(cls, unet_name, runtime=DEFAULT_RUNTIME, dequant_cache_gib=0.0) -> io.NodeOutput:
        try:
            path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        except FileNotFoundError:
            path = folder_paths.get_full_path_or_raise(OLD_UNET_FOLDER, unet_name)
        info = inspect_file(path)
        if info.kind == "old_modelopt_pack":
            raise NodeError(f"{unet_name}: {info.description}")
        patcher = ownloader.load_file(path)  # verifies every layer and value first (refuses a damaged file)
        if patcher is None:
            raise NodeError(f"{unet_name}: ComfyUI could not detect the model in this file")
        info.verification = patcher.modelopt_verification  # what the loader checked, values included
        patcher, note = apply_runtime(patcher, runtime, dequant_cache_gib, first_call=first_call_of(info, unet_name))
        return io.NodeOutput(patcher, info.text() + "\n" + note)


class ModelOptCudaGraphs(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ModelOptCudaGraphs",
            display_name="CUDA Graphs (ModelOpt)",
            category=CATEGORY,
            description="Captures each model evaluation once per input shape and replays it: removes "
                        "the per-layer Python overhead of any MODEL, 16-bit or quantized - ControlNets, "
                        "patches and wrappers included. Falls back to normal execution (logged) when the "
                        "model is offloaded or a patch decides per step in Python.",
            inputs=[io.Model.Input("model", tooltip="any MODEL: 16-bit, quantized, patched"),
                    io.Boolean.Input("compile_blocks", default=False, optional=True,
                                     tooltip="capture over TorchInductor-compiled blocks (fused norms, "
                                             "modulation, activations; needs Triton). Compiles on the "
                                             "first step; the result is checked against eager and the "
                                             "option turns itself off, logged, if they differ.")],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, compile_blocks=False) -> io.NodeOutput:
        return io.NodeOutput(enable_cuda_graphs(model, compile_blocks=compile_blocks)[0])


class ModelOptCompareImages(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="ModelOptCompareImages",
            display_name="Compare Images (ModelOpt)",
            category=CATEGORY,
            description="The 16-bit model's image, the quantized model's and their difference side by side, "
                        "with the error as numbers: where the quantization changed the picture.",
            inputs=[io.Image.Input("quantized", tooltip="The quantized model's image (VAE Decode)."),
                    io.Image.Input("reference", tooltip="The 16-bit model's image: same prompt, seed and size."),
                    io.Float.Input("gain", default=0.0, min=0.0, max=256.0, step=1.0, optional=True,
                                   tooltip="How much the difference is amplified. 0 picks it per image so the "
                                           "largest differences show at full brightness.")],
            outputs=[io.Image.Output(display_name="comparison", tooltip="Connect Preview Image or Save Image."),
                     io.String.Output(display_name="summary")],
        )

    @classmethod
    def execute(cls, quantized, reference, gain=0.0) -> io.NodeOutput:
        if quantized.shape != reference.shape:
            raise NodeError(f"Compare Images: the images differ in size or batch - quantized "
                            f"{tuple(quantized.shape)}, 16-bit {tuple(reference.shape)}; sample both the same way")
        pictures, lines = [], []
        for i in range(quantized.shape[0]):
            pic, n = compare_images(quantized[i].float().cpu().numpy(), reference[i].float().cpu().numpy(), gain)
            pictures.append(torch.from_numpy(pic).float().div(255.0))
            lines.append(f"image {i + 1}: PSNR {n['psnr_db']:.2f} dB, mean |diff| {n['mean_abs'] * 255:.2f}/255, "
                         f"largest {n['max_abs'] * 255:.0f}/255, {n['changed']:.2%} of pixels changed by > 4/255")
        return io.NodeOutput(torch.stack(pictures), "\n".join(lines))


NODES = [ModelOptCalibrationHelper, ModelOptLoadCalibration, ModelOptQuantizeUNet, ModelOptSaveQuantized,
         ModelOptUNetLoader, ModelOptCudaGraphs, ModelOptCompareImages]


class ModelOptExtension(ComfyExtension):
    @override
    async def on_load(self) -> None:
        register_folders()

    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> ModelOptExtension:
    check_kitchen()
    register_folders()
    return ModelOptExtension()
