"""The ComfyUI adapter: the only package that imports ComfyUI (comfy, folder_paths, comfy_api)."""
