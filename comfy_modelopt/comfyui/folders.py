"""Where the nodes read and write files: ComfyUI's model folders, this pack's two of its own, and a
file name made safe and free there."""
from __future__ import annotations

import os

import folder_paths

from .model import NodeError

CALIBRATION_FOLDER = "modelopt_calibration"
OLD_UNET_FOLDER = "modelopt_unet"


def register_folders() -> None:
    for name in (CALIBRATION_FOLDER, OLD_UNET_FOLDER):
        if name not in folder_paths.folder_names_and_paths:
            folder_paths.folder_names_and_paths[name] = (
                [os.path.join(folder_paths.models_dir, name)], {".safetensors"})


def save_folder() -> str:
    """Where Save Quantized Model writes: the first configured diffusion_models folder that is not
    ComfyUI's legacy models/unet (which ComfyUI 0.29 lists first for the key)."""
    folders = folder_paths.get_folder_paths("diffusion_models")
    legacy = os.path.abspath(os.path.join(folder_paths.models_dir, "unet"))
    return next((f for f in folders if os.path.abspath(f) != legacy), folders[0])


def save_path(filename: str) -> str:
    folder = save_folder()
    name = filename.strip().lstrip("/\\")
    if not name:
        raise NodeError("filename is empty")
    path = os.path.abspath(os.path.join(folder, name if name.endswith(".safetensors") else name + ".safetensors"))
    if not path.startswith(os.path.abspath(folder) + os.sep):
        raise NodeError(f"filename must stay inside {folder}")
    if os.path.isdir(path):
        raise NodeError(f"{path} is a folder; give a file name")
    return path


def free_path(path: str) -> str:
    """``path``, or where it exists the first free ``<name>_00001.safetensors``, ... (the counter
    ComfyUI's savers add)."""
    stem, n = path[:-len(".safetensors")], 0
    while os.path.lexists(path):
        n += 1
        path = f"{stem}_{n:05d}.safetensors"
    return path


def unet_files() -> list[str]:
    register_folders()
    names = list(folder_paths.get_filename_list("diffusion_models"))
    names += [n for n in folder_paths.get_filename_list(OLD_UNET_FOLDER) if n not in names]
    return names
