"""Default calibration prompts: varied subjects, styles, compositions and lighting, so the
activation statistics cover what users actually generate (portraits, text, scenes, styles) - and
how calibration samples them, declared once for Calibrate Model and the launcher."""
from __future__ import annotations

import dataclasses

DEFAULT_PROMPTS = (
    "a portrait photo of an elderly woman with silver hair, soft window light, 85mm lens, shallow depth of field",
    "a red fox sitting in fresh snow at dawn, wildlife photography, highly detailed fur",
    "a bustling night market in Taipei, neon signs, steam rising from food stalls, cinematic",
    "an isometric illustration of a tiny cozy library inside a tree, warm colors",
    "a sports car drifting on a wet race track at night, motion blur, reflections",
    "a bowl of ramen with a soft-boiled egg, chopsticks, overhead food photography",
    "an astronaut floating inside a space station, earth visible through the window",
    "a watercolor painting of a lighthouse on a rocky coast during a storm",
    "a close-up macro photo of a dragonfly wing covered in dew drops",
    "a medieval castle on a cliff above a misty valley, fantasy concept art",
    "a minimalist poster with the words \"OPEN LATE\" in bold white letters on a blue background",
    "two children laughing while running through a sprinkler in a backyard, summer afternoon",
    "a cyberpunk city street in the rain, holographic advertisements, people with umbrellas",
    "an oil painting of a vase of sunflowers in the style of post-impressionism",
    "a snowy mountain landscape under the northern lights, long exposure",
    "a product photo of a white sneaker on a pastel pink background, studio lighting",
    "a golden retriever puppy wearing a tiny knitted hat, studio portrait",
    "an ancient temple overgrown with jungle vines, sunbeams through the canopy",
    "a chef plating a dessert in a busy restaurant kitchen, documentary photo",
    "a pixel art scene of a knight fighting a dragon, 16-bit video game style",
    "a glass of iced coffee on a marble table next to an open book, morning light",
    "a black and white street photo of a man reading a newspaper on a Paris bench",
    "a futuristic electric train crossing a desert bridge at sunset, wide angle",
    "a hand-drawn anime character with blue hair standing on a school rooftop, wind blowing",
    "an underwater coral reef with a sea turtle and schools of tropical fish",
    "a 3D render of a cute robot made of brass gears, octane render, soft shadows",
    "a foggy forest path in autumn with orange leaves on the ground",
    "an architectural photo of a modern concrete house with large glass windows by a lake",
    "a jazz band playing in a dim smoky club, warm spotlight, film grain",
    "a detailed pencil sketch of an old man's hands holding a pocket watch",
    "a field of lavender in Provence with a stone farmhouse, golden hour",
    "a still life of fruit, a wine bottle and bread on a wooden table, baroque painting",
)

DEFAULT_NEGATIVE = "blurry, low quality, distorted, watermark"


# ------------------------------------------------------------------ how calibration samples them
@dataclasses.dataclass(frozen=True)
class SamplingOption:
    """One option of how calibration samples the prompts, declared once for Calibrate Model's input
    (``name``; its tooltip ``help``) and the launcher's flag (``--flag``)."""
    name: str
    flag: str
    default: object
    help: str
    bounds: tuple = ()  # (min, max, step) for numbers
    choices: str = ""  # "samplers" / "schedulers": ComfyUI's lists (the node); free text for the flag
    advanced: bool = False  # the node shows it among the advanced inputs


SAMPLING_OPTIONS = (  # Calibrate Model's widget order: saved workflows keep their values
    SamplingOption("num_prompts", "num-prompts", 16, "How many prompts to sample (more = better statistics, slower).",
                   (1, 1024, 1)),
    SamplingOption("steps", "steps", 20, "Sampling steps per prompt.", (1, 200, 1)),
    SamplingOption("cfg", "cfg", 4.0, "CFG used while sampling (1.0 for guidance-distilled models like Flux-dev).",
                   (0.0, 30.0, 0.1)),
    SamplingOption("sampler_name", "sampler", "euler", "The sampler calibration samples with: the one your workflows "
                   "use.", choices="samplers"),
    SamplingOption("scheduler", "scheduler", "simple", "The scheduler calibration samples with: the one your "
                   "workflows use.", choices="schedulers"),
    SamplingOption("width", "width", 1024, "Image width while calibrating: the size you will generate at (the "
                   "default runtime compiles for it).", (64, 8192, 8)),
    SamplingOption("height", "height", 1024, "Image height while calibrating: the size you will generate at.",
                   (64, 8192, 8)),
    SamplingOption("seed", "seed", 0, "Noise seed of the first prompt (the next ones add 1 each).",
                   (0, 0xFFFFFFFF, 1)),
    SamplingOption("guidance", "guidance", 3.5, "Embedded guidance for guidance-distilled models (Flux); others "
                   "ignore it. 0: none.", (0.0, 100.0, 0.1)),
    SamplingOption("samples_mib_per_layer", "samples-mib-per-layer", 2.0,
                   "Input rows kept per layer for the activation-aware searches and GPTQ (bf16: rows = MiB * 2^20 / "
                   "(2 * the layer's inputs)). With fewer rows than a layer has inputs its GPTQ Hessian is "
                   "rank-deficient: the report names such layers.", (0.0, 256.0, 0.5), advanced=True),
)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each calibration prompt is sampled (ComfyUI's sampler, as KSampler): prompt ``i`` with
    noise seed ``seed + i``; ``guidance`` None for models without embedded guidance.  Its values
    come from SAMPLING_OPTIONS (their defaults are declared there only)."""
    steps: int
    cfg: float
    sampler_name: str
    scheduler: str
    seed: int
    guidance: float | None

    @classmethod
    def of(cls, values: dict) -> "Sampling":
        """From the options' values by name (Calibrate Model's inputs, the launcher's arguments)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        out = {k: v for k, v in values.items() if k in fields}
        if out.get("guidance") is not None and out["guidance"] <= 0:
            out["guidance"] = None
        return cls(**out)
