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
    return _link_all(g, g.add("KSampler", (x, y), title=title, size=(300, 262), seed=42, steps=steps, cfg=7.0,
                              sampler_name="euler", scheduler="normal", denoise=1.0),
                     model=model, positive=pos, negative=neg, latent_image=latent)


def _link_all(g: Graph, node: int, **inputs) -> int:
    for name, (src, out) in inputs.items():
        g.link(src, out, node, name)
    return node


def _prompts(g: Graph, ckpt: int, size: int, x: int = 20, y: int = 170):
    """The prompts and the empty latent, stacked in the first column under the checkpoint."""
    pos = _link_all(g, g.add("CLIPTextEncode", (x, y), title="Positive prompt", size=(340, 130), text=POSITIVE),
                    clip=(ckpt, "CLIP"))
    neg = _link_all(g, g.add("CLIPTextEncode", (x, y + 170), title="Negative prompt", size=(340, 90), text=NEGATIVE),
                    clip=(ckpt, "CLIP"))
    latent = g.add("EmptyLatentImage", (x, y + 300), size=(340, 106), width=size, height=size, batch_size=1)
    return (pos, 0), (neg, 0), (latent, 0)


def _decoded(g: Graph, samples, vae, x, y):
    return _link_all(g, g.add("VAEDecode", (x, y), size=(150, 46)), samples=samples, vae=vae)


def _saved(g: Graph, images, x, y, prefix, title, size=(260, 300)):
    return _link_all(g, g.add("SaveImage", (x, y), title=title, size=size, filename_prefix=prefix), images=images)


# The layouts leave room for each node at the size ComfyUI's frontend draws it (every widget,
# advanced ones included) and fit a 1920x1080 window at a zoom where node text is drawn
# (tests/comfyui/test_frontend.py opens each as the template browser does and checks both).
def quantize_and_compare(info: dict, variant: str, planner: bool = False) -> dict:
    s = SIZES[variant]
    g = Graph(info)
    ckpt = g.add("CheckpointLoaderSimple", (20, 40), size=(340, 98), ckpt_name=CHECKPOINT)
    pos, neg, latent = _prompts(g, ckpt, s["size"])
    calib = _link_all(g, g.add(
        "ModelOptCalibrationHelper", (400, 40), title="Calibrate Model", size=(300, 542),
        num_prompts=s["prompts"], steps=s["calib_steps"], cfg=7.0, sampler_name="euler", scheduler="normal",
        width=s["size"], height=s["size"], seed=0, save_name=""), model=(ckpt, "MODEL"), clip=(ckpt, "CLIP"))
    recipe = dict(format="nvfp4", budget=BUDGET) if planner else dict(format="float8_e4m3fn")
    quant = _link_all(g, g.add("ModelOptQuantizeUNet", (740, 40), title="Quantize Model", size=(300, 770), **recipe),
                      model=(ckpt, "MODEL"), calibration=(calib, 0))
    name = f"quantized/sd15-{'mixed' if planner else 'fp8'}{'-quick' if variant == 'quick' else ''}"
    _link_all(g, g.add("ModelOptSaveQuantized", (400, 640), title="Save Quantized Model", size=(300, 82),
                       filename=name, overwrite=False), model=(quant, 0))
    quantized = _sampler(g, (quant, 0), pos, neg, latent, 1080, 40, "KSampler - quantized", s["steps"])
    reference = _sampler(g, (ckpt, "MODEL"), pos, neg, latent, 1080, 350, "KSampler - 16-bit (same seed)",
                         s["steps"])
    q_img, r_img = (_decoded(g, (quantized, 0), (ckpt, "VAE"), 1080, 660),
                    _decoded(g, (reference, 0), (ckpt, "VAE"), 1230, 660))
    compared = _link_all(g, g.add("ModelOptCompareImages", (1080, 750), title="Compare Images", size=(300, 78)),
                         quantized=(q_img, 0), reference=(r_img, 0))
    _link_all(g, g.add("PreviewImage", (1420, 40), title="16-bit | quantized | difference", size=(600, 300)),
              images=(compared, 0))
    _saved(g, (q_img, 0), 1420, 380, "modelopt/quantized", "Quantized")
    _saved(g, (r_img, 0), 1720, 380, "modelopt/16bit", "16-bit")
    _link_all(g, g.add("PreviewImage", (1420, 720), title="Report (chart)", size=(600, 380)), images=(quant, 2))
    _link_all(g, g.add("PreviewAny", (740, 860), title="Report", size=(300, 270)), source=(quant, 1))
    what = ("Quantize under a size budget: nvfp4, fp8 and int8 per layer (planner)" if planner else
            "Quantize a model (fp8) and compare it with the 16-bit one")
    does = (f"gives each Linear layer the format that buys the most accuracy per byte, within {BUDGET}x the 16-bit "
            "Linear bytes" if planner else "writes fp8 W8A8 with static input scales")
    steps = (f"Calibrate Model samples {s['prompts']} prompts x {s['calib_steps']} steps at {s['size']} px; "
             f"Quantize Model {does}; both KSamplers use the same seed, so the two images differ only by the "
             "quantization: Compare Images shows where (the difference, amplified).")
    g.note(f"## {_title(variant, what)}\n\n{FILES}\n**What it does**: {steps}\n\n**Where the file goes**: "
           f"`models/diffusion_models/{name}.safetensors` (a name that exists gets the next free counter, `_00001`; "
           "overwrite replaces it instead); ComfyUI's own Load Diffusion Model loads it."
           + ("\n\nOn a CPU or a GPU without fp8 tensor cores (before Ada) the file is smaller, not faster."
              if not planner else "\n\nnvfp4 runs natively on Blackwell, and on 8-bit tensor cores from its 4-bit "
              "weights on Turing to Hopper (this pack's runtimes: W4A8); on a CPU it is smaller, not faster."),
           (20, 640), size=(340, 460))
    return g.ui()


def load_and_sample(info: dict, variant: str, quantize_title: str) -> dict:
    s = SIZES[variant]
    name = f"quantized/sd15-fp8{'-quick' if variant == 'quick' else ''}.safetensors"
    g = Graph(info)
    ckpt = g.add("CheckpointLoaderSimple", (20, 40), title="Text encoder and VAE", size=(340, 98),
                 ckpt_name=CHECKPOINT)
    pos, neg, latent = _prompts(g, ckpt, s["size"])
    unet = g.add("ModelOptUNetLoader", (400, 40), title="Load Quantized Model", size=(300, 126), unet_name=name)
    sampled = _sampler(g, (unet, 0), pos, neg, latent, 400, 210, "KSampler", s["steps"])
    _saved(g, (_decoded(g, (sampled, 0), (ckpt, "VAE"), 400, 520), 0), 740, 40, "modelopt/reloaded", "Image",
           size=(400, 440))
    _link_all(g, g.add("PreviewAny", (740, 520), title="Report (checked when loading)", size=(400, 300)),
              source=(unet, 1))
    g.note(f"## {_title(variant, 'Load a quantized model and sample')}\n\n{FILES}"
           f"- `models/diffusion_models/{name}` - written by the workflow *{quantize_title}*: run that one "
           "first\n\n**What it does**: Load Quantized Model checks the file (every layer against its format, every "
           "scale finite, no layer missing) and loads it with ComfyUI's own loader on the fast runtime; the report "
           "shows its recipe and per-layer errors.  The CLIP text encoder and the VAE come from the SD1.5 checkpoint.",
           (1180, 40), size=(360, 520))
    return g.ui()


# file name -> builder.  The template browser lists a pack's workflows in the order the file system
# returns them and titles each by its file name: the number says which to run first.
QUICK, FULL = "1 Quantize and compare (quick)", "4 Quantize and compare"
WORKFLOWS = {
    f"{QUICK}.json": lambda info: quantize_and_compare(info, "quick"),
    "2 Load a quantized model (quick).json": lambda info: load_and_sample(info, "quick", QUICK),
    "3 Mixed precision under a budget (quick).json": lambda info: quantize_and_compare(info, "quick", planner=True),
    f"{FULL}.json": lambda info: quantize_and_compare(info, "full"),
    "5 Load a quantized model.json": lambda info: load_and_sample(info, "full", FULL),
    "6 Mixed precision under a budget.json": lambda info: quantize_and_compare(info, "full", planner=True),
}


def render(info: dict) -> dict[str, str]:
    """file name -> the JSON text to ship."""
    return {name: json.dumps(build(info), indent=1) + "\n" for name, build in WORKFLOWS.items()}


def main():
    """Write the workflows; with --thumbnails also their template-browser pictures (needs
    Playwright and Chromium: tests/comfyui/frontend.py)."""
    import pathlib
    from comfy_server import Server
    thumbnails = "--thumbnails" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp)
        models_dir = base / "models"
        for sub, name in (("checkpoints", CHECKPOINT), ("diffusion_models", "quantized/sd15-fp8-quick.safetensors"),
                          ("diffusion_models", "quantized/sd15-fp8.safetensors")):
            (models_dir / sub / name).parent.mkdir(parents=True, exist_ok=True)
            (models_dir / sub / name).touch()  # listed, so no "missing model" notice covers the picture
        server = Server(base, models_dir)
        try:
            info = server.get("/object_info")
            os.makedirs(FOLDER, exist_ok=True)
            for name, text in render(info).items():
                with open(os.path.join(FOLDER, name), "w") as f:
                    f.write(text)
                print(os.path.join(FOLDER, name))
            if thumbnails:
                import frontend
                with frontend.page_on(server.url) as page:
                    for name in WORKFLOWS:
                        frontend.open_template(page, name[:-len(".json")])
                        path = os.path.join(FOLDER, name[:-len(".json")] + ".jpg")
                        frontend.thumbnail(page, path)
                        print(path)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
