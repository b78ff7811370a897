"""Regenerate tests/data/keysets/*.json.gz: the full-size state-dict key sets (names and shapes)
of ComfyUI's own model classes, used by the CPU family-detection tests - and
tests/data/keysets_unknown/: those of architectures ComfyUI loads that comfy-modelopt has no
family for (recognised by their structure).

    COMFYUI_PATH=/path/to/ComfyUI python tests/comfyui/make_keysets.py
"""
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import architectures as models  # noqa: E402


def main():
    models.setup_comfy()
    for folder, configs in (("keysets", models.CONFIGS), ("keysets_unknown", models.UNKNOWN_CONFIGS)):
        write(os.path.join(os.path.dirname(__file__), "..", "data", folder), configs)


def write(out_dir, configs):
    os.makedirs(out_dir, exist_ok=True)
    for family, sizes in configs.items():
        model, sd = models.build(family, "full", device="meta")
        shapes = {k: list(v.shape) for k, v in sd.items()}
        doc = {"family": family, "comfy_class": type(models.model_config(family, "full")).__name__,
               "comfyui_version": _version(), "shapes": shapes}
        path = os.path.join(out_dir, f"{family}.json.gz")
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(json.dumps(doc, sort_keys=True).encode())
        print(f"{path}: {len(shapes)} keys ({doc['comfy_class']})")


def _version():
    ns = {}
    exec(open(os.path.join(models.COMFYUI_PATH, "comfyui_version.py")).read(), ns)
    return ns["__version__"]


if __name__ == "__main__":
    main()
