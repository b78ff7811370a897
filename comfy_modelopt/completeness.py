"""Completeness: layers evidently missing from a model's keys - a layer with some of its tensors
but no weight, a layer missing from one of a run of blocks that are otherwise the same - named
as ``errors.Problem`` lines (verify.py runs it on every file it checks)."""
from __future__ import annotations

import fnmatch
import re
from collections import Counter, defaultdict

from .errors import Problem

_PART_RE = re.compile(r"^(.*)\.(weight|bias|weight_scale|weight_scale_2|input_scale|comfy_quant|lowrank_up|"
                      r"lowrank_down|smooth_scale)$")
_BLOCK_RE = re.compile(r"^(.*?\.)?(\d+)\.(.+)$")


def missing_layers(keys, prefix: str = "", optional: tuple = ()) -> list:
    """Layers that are evidently missing from a model's keys (relative to ``prefix``):

    - a layer with a bias, a scale or a config but no weight;
    - a layer missing from one block of a run of blocks that are otherwise the same: block i of
      ``<run>.<i>.`` lacks layers that blocks i-1 and i+1 both have and holds nothing they do not
      (the first or last block: when it differs from its neighbour by that one layer alone);
    - a layer missing from one of the blocks of the same kind (the same name with the block
      numbers ignored, e.g. a UNet's ``input_blocks.#.1.transformer_blocks.#``): the only block
      of its kind with its set of layers, one layer short of a set two or more others have.
    Blocks that differ by design (a UNet's input blocks, SD3's last joint block, a ResBlock with
    or without its skip connection) hold layers their neighbours do not, differ by more than one
    layer, or share their set with another block, and pass: none of ComfyUI's model classes
    (tests/data/keysets) gives a false alarm.  Top-level layers (embedders, the final layer) are
    not covered: Load Quantized Model checks them against the model ComfyUI builds.  ``optional``:
    globs of layers the family's blocks have or not by design (``Family.optional``)."""
    keys = [k[len(prefix):] for k in keys if k.startswith(prefix)]
    parts = defaultdict(set)
    for k in keys:
        m = _PART_RE.match(k)
        if m:
            parts[m.group(1)].add(m.group(2))
    problems = [Problem(prefix + layer + ".weight", f"missing: the file has this layer's {', '.join(sorted(p))} "
                                                    f"but no weight")
                for layer, p in sorted(parts.items()) if "weight" not in p and p & {"bias", "comfy_quant",
                                                                                   "weight_scale", "lowrank_up"}]
    runs: dict = defaultdict(lambda: defaultdict(set))  # run prefix -> index -> layer suffixes
    kinds: dict = defaultdict(lambda: defaultdict(set))  # block kind -> innermost block -> layers
    for layer in parts:
        if any(fnmatch.fnmatchcase(layer, pat) for pat in optional):
            continue
        levels = list(_iter_blocks(layer))
        for head, i, rest in levels:
            runs[head][i].add(rest)
        if levels:
            head, i, rest = levels[-1]
            kinds[re.sub(r"\.\d+(?=\.|$)", ".#", f"{head}{i}")][f"{head}{i}"].add(rest)
    for run, blocks in runs.items():
        indices = sorted(blocks)
        if len(indices) < 3 or indices != list(range(indices[0], indices[-1] + 1)):
            continue
        for pos, i in enumerate(indices):
            problems += [Problem(f"{prefix}{run}{i}.{layer}.weight", f"missing: block {run}{i} has no layer {layer}, "
                                 f"which the blocks beside it in {run}{indices[0]}..{indices[-1]} have")
                         for layer in _hole(blocks, indices, pos)]
    named = {p.key for p in problems}
    return problems + [p for p in _odd_blocks_out(kinds, prefix) if p.key not in named]


def _odd_blocks_out(kinds: dict, prefix: str) -> list:
    problems = []
    for blocks in kinds.values():
        counts = Counter(frozenset(v) for v in blocks.values())
        for block, layers in blocks.items():
            layers = frozenset(layers)
            if counts[layers] != 1:
                continue
            for ref, c in counts.items():
                if c >= 2 and layers < ref and len(ref - layers) == 1:
                    layer = next(iter(ref - layers))
                    problems.append(Problem(f"{prefix}{block}.{layer}.weight", f"missing: block {block} has no layer "
                                            f"{layer}, which {c} other blocks of its kind have"))
    return problems


def _iter_blocks(layer: str):
    """(run prefix, block index, rest) for each numbered level of a layer name."""
    start = 0
    while True:
        m = _BLOCK_RE.match(layer[start:])
        if not m:
            return
        head = layer[:start] + (m.group(1) or "")
        yield head, int(m.group(2)), m.group(3)
        start = len(head) + len(m.group(2)) + 1


def _hole(blocks: dict, indices: list, pos: int) -> list:
    mine = blocks[indices[pos]]
    if 0 < pos < len(indices) - 1:
        before, after = blocks[indices[pos - 1]], blocks[indices[pos + 1]]
        if before == after and mine < before:
            return sorted(before - mine)
        return []
    near, far = (1, 2) if pos == 0 else (-2, -3)
    a, b = blocks[indices[pos + near]], blocks[indices[pos + far]]
    if a == b and mine < a and len(a - mine) == 1:
        return sorted(a - mine)
    return []


# what sibling blocks are compared on: not a quantized layer's own parts (formats and scales may
# differ block to block in a mixed-precision file)
_QUANT_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale", ".comfy_quant",
                   ".lowrank_up", ".lowrank_down", ".smooth_scale")


def structure_problems(entries, prefix: str = "", optional: tuple = (), quantized=frozenset(),
                       widths: bool = True) -> list:
    """Tensors whose shapes the model's own structure contradicts (``entries``: key -> (dtype,
    shape); ``quantized``: layer names, relative to ``prefix``, stored quantized - their weights'
    shapes are the format's):

    - a 16-bit layer's bias that is not one value per output of its weight, a norm whose weight
      and bias differ;
    - a tensor of a block in a run (``<run>.<i>.``) that is missing, or of another shape, where
      the blocks on both sides agree (the first or last block: where the next two agree);
    - with ``widths`` (a model of a known family): a weight outside the blocks that shares no width
      with them (each layer outside a diffusion model's blocks - embedders, the final layer - reads
      or writes the blocks' widths; any module need not).
    A family's by-design differences (``optional`` globs) pass."""
    shapes = {k[len(prefix):]: tuple(s) for k, (_d, s) in entries.items()
              if k.startswith(prefix) and not k.endswith(_QUANT_SUFFIXES)}
    shapes = {k: s for k, s in shapes.items() if not any(fnmatch.fnmatchcase(k.rpartition(".")[0], p) for p in optional)}
    problems = []
    for key, shape in sorted(shapes.items()):
        layer, _, part = key.rpartition(".")
        weight = shapes.get(layer + ".weight")
        if part != "bias" or weight is None or layer in quantized:
            continue
        want = weight if len(weight) == 1 else weight[:1]
        if shape != want:
            problems.append(Problem(prefix + key, f"has shape {list(shape)}, its layer's weight {list(weight)} "
                                                  f"needs {list(want)}"))
    runs: dict = defaultdict(lambda: defaultdict(dict))  # run prefix -> index -> rest -> shape (None: quantized)
    inside = set()
    for key, shape in shapes.items():
        for head, i, rest in _iter_blocks(key):
            runs[head][i][rest] = None if key.rpartition(".")[0] in quantized and key.endswith(".weight") else shape
            inside.add(key)
    for run, blocks in runs.items():
        indices = sorted(blocks)
        if len(indices) < 3 or indices != list(range(indices[0], indices[-1] + 1)):
            continue
        for pos, i in enumerate(indices):
            if 0 < pos < len(indices) - 1:
                a, b = blocks[indices[pos - 1]], blocks[indices[pos + 1]]
            else:  # the first or last block: the next two
                step = 1 if pos == 0 else -1
                a, b = blocks[indices[pos + step]], blocks[indices[pos + 2 * step]]
            if not _same_block(a, b):
                continue
            mine, found = blocks[i], []
            for rest, shape in sorted(a.items()):
                key = f"{prefix}{run}{i}.{rest}"
                if rest not in mine:
                    found.append(Problem(key, f"missing: the blocks beside {run}{i} in the run hold it"))
                elif shape is not None and mine[rest] is not None and mine[rest] != shape:
                    found.append(Problem(key, f"has shape {list(mine[rest])}, the blocks beside {run}{i} in the "
                                              f"run hold {list(shape)}"))
            if len(found) <= 2:  # one tensor, or a layer's weight and bias; a block of another design differs more
                problems += found
    block_widths = {d for k in inside for d in shapes[k]} if widths else set()
    for key, shape in sorted(shapes.items()):
        if key in inside or len(shape) < 2 or not block_widths or key.rpartition(".")[0] in quantized:
            continue
        if not block_widths.intersection(shape):
            problems.append(Problem(prefix + key, f"has shape {list(shape)}: no width of the model's blocks "
                                                  f"(a layer outside them reads or writes one)"))
    return problems


def _same_block(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[r] is None or b[r] is None or a[r] == b[r] for r in a)
