"""What every benchmark script does with its rows, ComfyUI-free: a markdown table on stdout and
the JSON written atomically (a temp file renamed over the target)."""
from __future__ import annotations

import json
import os


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def print_markdown(columns: list[tuple[str, str]], rows: list[dict]) -> None:
    """``columns``: (header, row key) pairs; booleans and numbers printed as they are."""
    print("\n| " + " | ".join(h for h, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for _, k in columns) + " |")
