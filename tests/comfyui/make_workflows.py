"""Write example_workflows/*.json: the UI-format workflows the pack ships (drag one onto ComfyUI's
canvas, or open it from the template browser).  Their source is here; tests/comfyui/test_server.py
checks the shipped files equal what this writes and queues every one as shipped through a real
server.

    COMFYUI_PATH=/path/to/ComfyUI python tests/comfyui/make_workflows.py

Each workflow needs only what its note names: the SD1.5 checkpoint ComfyUI's own default workflow
uses, in models/checkpoints.  "quick" variants finish on a CPU in minutes (256 px, a few steps);
the others are sized for real use (512 px, 16 calibration prompts x 20 steps; a GPU).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workflow_ui import Graph  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(ROOT, "example_workflows")
CHECKPOINT = "v1-5-pruned-emaonly-fp16.safetensors"
POSITIVE = "a photo of a red fox sitting in fresh snow at dawn, wildlife photography, highly detailed"
NEGATIVE = "blurry, low quality, watermark"
# the planner's size budget: SD1.5's smallest file (every layer nvfp4 but those its family keeps
# 16-bit) is 0.31x the 16-bit Linear bytes; 0.45x leaves it room to give sensitive layers 8 bits
BUDGET = 0.45
SIZES = {"quick": dict(size=256, steps=8, prompts=2, calib_steps=4),
         "full": dict(size=512, steps=20, prompts=16, calib_steps=20)}
FILES = ("**Files it needs** (nothing else):\n\n"
         f"- `models/checkpoints/{CHECKPOINT}` - Stable Diffusion 1.5, the checkpoint ComfyUI's own default "
         "workflow uses (download it from the Comfy-Org/stable-diffusion-v1-5-archive repository on Hugging Face)\n")


def _title(variant: str, what: str) -> str:
    return f"{what} ({'quick: CPU, minutes' if variant == 'quick' else 'real size: GPU'})"


def _sampler(g: Graph, model, pos, neg, latent, x, y, title, steps):
    return _link_all(g, g.add("KSampler", (x, y), title=title, size=(320, 270), seed=42, steps=steps, cfg=7.0,
                              sampler_name="euler", scheduler="normal", denoise=1.0),
                     model=model, positive=pos, negative=neg, latent_image=latent)


def _link_all(g: Graph, node: int, **inputs) -> int:
    for name, (src, out) in inputs.items():
        g.link(src, out, node, name)
    return node


def _prompts(g: Graph, ckpt: int, size: int, x: int = 420):
    pos = _link_all(g, g.add("CLIPTextEncode", (x, 40), title="Positive prompt", size=(400, 160), text=POSITIVE),
                    clip=(ckpt, "CLIP"))
    neg = _link_all(g, g.add("CLIPTextEncode", (x, 240), title="Negative prompt", size=(400, 120), text=NEGATIVE),
                    clip=(ckpt, "CLIP"))
    latent = g.add("EmptyLatentImage", (x, 400), width=size, height=size, batch_size=1)
    return (pos, 0), (neg, 0), (latent, 0)


def _images(g: Graph, samples, vae, x, y, prefix, title):
    decoded = _link_all(g, g.add("VAEDecode", (x, y), size=(220, 50)), samples=samples, vae=vae)
    return _link_all(g, g.add("SaveImage", (x, y + 90), title=title, size=(360, 400), filename_prefix=prefix),
                     images=(decoded, 0))


def quantize_and_compare(info: dict, variant: str, planner: bool = False) -> dict:
    s = SIZES[variant]
    g = Graph(info)
    ckpt = g.add("CheckpointLoaderSimple", (20, 40), size=(360, 100), ckpt_name=CHECKPOINT)
    pos, neg, latent = _prompts(g, ckpt, s["size"])
    calib = _link_all(g, g.add(
        "ModelOptCalibrationHelper", (20, 560), title="Calibrate Model", size=(380, 560),
        num_prompts=s["prompts"], steps=s["calib_steps"], cfg=7.0, sampler_name="euler", scheduler="normal",
        width=s["size"], height=s["size"], seed=0, save_name=""), model=(ckpt, "MODEL"), clip=(ckpt, "CLIP"))
    recipe = dict(format="nvfp4", budget=BUDGET) if planner else dict(format="float8_e4m3fn")
    quant = _link_all(g, g.add("ModelOptQuantizeUNet", (420, 560), title="Quantize Model", size=(400, 470), **recipe),
                      model=(ckpt, "MODEL"), calibration=(calib, 0))
    quantized = _sampler(g, (quant, 0), pos, neg, latent, 880, 40, "KSampler - quantized", s["steps"])
    reference = _sampler(g, (ckpt, "MODEL"), pos, neg, latent, 1260, 40, "KSampler - 16-bit (same seed)", s["steps"])
    _images(g, (quantized, 0), (ckpt, "VAE"), 880, 340, "modelopt/quantized", "Quantized")
    _images(g, (reference, 0), (ckpt, "VAE"), 1260, 340, "modelopt/16bit", "16-bit")
    _link_all(g, g.add("PreviewImage", (880, 860), title="Report (chart)", size=(740, 420)), images=(quant, 2))
    _link_all(g, g.add("PreviewAny", (1640, 40), title="Report", size=(520, 800)), source=(quant, 1))
    name = f"quantized/sd15-{'mixed' if planner else 'fp8'}{'-quick' if variant == 'quick' else ''}"
    _link_all(g, g.add("ModelOptSaveQuantized", (420, 1060), title="Save Quantized Model", size=(400, 130),
                       filename=name, overwrite=False), model=(quant, 0))
    what = ("Quantize under a size budget: nvfp4, fp8 and int8 per layer (planner)" if planner else
            "Quantize a model (fp8) and compare it with the 16-bit one")
    does = (f"gives each Linear layer the format that buys the most accuracy per byte, within {BUDGET}x the 16-bit "
            "Linear bytes" if planner else "writes fp8 W8A8 with static input scales")
    steps = (f"Calibrate Model samples {s['prompts']} prompts x {s['calib_steps']} steps at {s['size']} px; "
             f"Quantize Model {does}; both KSamplers use the same seed, so the two images differ only by the "
             "quantization.  The chart and the text are the per-layer report.")
    g.note(f"## {_title(variant, what)}\n\n{FILES}\n**What it does**: {steps}\n\n**Where the file goes**: Save "
           f"Quantized Model writes `models/diffusion_models/{name}.safetensors` (a name that exists gets the next free "
           "counter, `_00001`; overwrite replaces it instead); ComfyUI's own Load Diffusion Model loads it."
           + ("\n\nOn a CPU or a GPU without fp8 tensor cores (before Ada) the file is smaller, not faster."
              if not planner else "\n\nnvfp4 runs natively on Blackwell; elsewhere it is smaller, not faster."),
           (20, 1140), size=(780, 330))
    return g.ui()


def load_and_sample(info: dict, variant: str) -> dict:
    s = SIZES[variant]
    name = f"quantized/sd15-fp8{'-quick' if variant == 'quick' else ''}.safetensors"
    g = Graph(info)
    unet = g.add("ModelOptUNetLoader", (20, 40), title="Load Quantized Model", size=(360, 110), unet_name=name)
    ckpt = g.add("CheckpointLoaderSimple", (20, 200), title="Text encoder and VAE", size=(360, 100),
                 ckpt_name=CHECKPOINT)
    pos, neg, latent = _prompts(g, ckpt, s["size"])
    sampled = _sampler(g, (unet, 0), pos, neg, latent, 880, 40, "KSampler", s["steps"])
    _images(g, (sampled, 0), (ckpt, "VAE"), 880, 340, "modelopt/reloaded", "Image")
    _link_all(g, g.add("PreviewAny", (1260, 40), title="Report (checked when loading)", size=(520, 700)),
              source=(unet, 1))
    g.note(f"## {_title(variant, 'Load a quantized model and sample')}\n\n{FILES}"
           f"- `models/diffusion_models/{name}` - written by *Quantize a model (fp8) and compare it* "
           f"({'quick' if variant == 'quick' else 'real size'}); run that one first\n\n"
           "**What it does**: Load Quantized Model checks the file (every layer against its format, every scale "
           "finite, no layer missing) and loads it with ComfyUI's own loader on the fast runtime; the report shows "
           "its recipe and per-layer errors.  The CLIP text encoder and the VAE come from the SD1.5 checkpoint.",
           (20, 360), size=(380, 360))
    return g.ui()


WORKFLOWS = {  # file name -> builder; the order is the one a user (and the test) runs them in
    "Quantize and compare (quick).json": lambda info: quantize_and_compare(info, "quick"),
    "Load a quantized model (quick).json": lambda info: load_and_sample(info, "quick"),
    "Mixed precision under a budget (quick).json": lambda info: quantize_and_compare(info, "quick", planner=True),
    "Quantize and compare.json": lambda info: quantize_and_compare(info, "full"),
    "Load a quantized model.json": lambda info: load_and_sample(info, "full"),
    "Mixed precision under a budget.json": lambda info: quantize_and_compare(info, "full", planner=True),
}


def render(info: dict) -> dict[str, str]:
    """file name -> the JSON text to ship."""
    return {name: json.dumps(build(info), indent=1) + "\n" for name, build in WORKFLOWS.items()}


def main():
    import pathlib
    from comfy_server import Server
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp)
        (base / "models").mkdir()
        server = Server(base, base / "models")
        try:
            info = server.get("/object_info")
        finally:
            server.stop()
    os.makedirs(FOLDER, exist_ok=True)
    for name, text in render(info).items():
        with open(os.path.join(FOLDER, name), "w") as f:
            f.write(text)
        print(os.path.join(FOLDER, name))


if __name__ == "__main__":
    main()
