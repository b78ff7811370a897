"""What a compiled block's own code looks up in ComfyUI's patches (``transformer_options``'
"patches" and "patches_replace"): learnt by running the block once with the patch dicts watched
(``watched``), then checked per call without recording (``hits``) - a block none of whose lookups
finds a patch runs compiled, blind to the patches (``compiled_blocks``)."""
from __future__ import annotations

PATCH_KEYS = ("patches", "patches_replace")
_ALL = object()  # a lookup that read every key (an iteration)


class _Lookups(dict):
    """A patch dict (or a nested one) that records which keys the code it is handed looks up:
    (its path, the key) into each of ``seens`` - ``_ALL`` for an iteration; nested dicts (and a
    dict default) are watched too.  A region called inside a region being learnt records into
    both (``watched``)."""

    def __init__(self, d, seens: tuple, path: tuple):
        super().__init__(dict.items(d))
        self._seens, self._path = seens, path

    def _saw(self, key):
        for seen in self._seens:
            seen.add((self._path, key))

    def _got(self, key, value):
        return _Lookups(value, self._seens, (*self._path, key)) if isinstance(value, dict) else value

    def __contains__(self, key):
        self._saw(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._saw(key)
        return self._got(key, super().__getitem__(key))

    def get(self, key, default=None):
        self._saw(key)
        return self._got(key, super().get(key, default))

    def __iter__(self):
        self._saw(_ALL)
        return super().__iter__()

    def keys(self):
        self._saw(_ALL)
        return super().keys()

    def items(self):
        self._saw(_ALL)
        return ((k, self._got(k, v)) for k, v in dict.items(self))

    def values(self):
        self._saw(_ALL)
        return (self._got(k, v) for k, v in dict.items(self))


def watched(topts: dict, seen: set) -> dict:
    """``topts`` with its patch dicts watched (``_Lookups``) into ``seen`` - and into whatever
    watched them already (an enclosing region being learnt)."""
    return {k: _Lookups(v, getattr(v, "_seens", ()) + (seen,), (k,))
            if k in PATCH_KEYS and isinstance(v, dict) else v for k, v in dict.items(topts)}


def leaves(seen: set) -> frozenset:
    """The lookups that decide: a key whose dict was looked into is decided by those lookups."""
    inner = {path for path, _ in seen}
    return frozenset((path, key) for path, key in seen if key is _ALL or (*path, key) not in inner)


def hits(lookups, topts: dict) -> bool:
    """Whether any of a region's ``lookups`` finds a patch in ``topts`` (read without recording)."""
    for path, key in lookups:
        d = topts
        for p in path:
            d = dict.get(d, p) if isinstance(d, dict) else None
        if not isinstance(d, dict):
            continue
        if nonempty(d) if key is _ALL else (dict.__contains__(d, key) and nonempty(dict.__getitem__(d, key))):
            return True
    return False


def call_with(fn, args_kwargs):
    args, kwargs = args_kwargs
    return fn(*args, **kwargs)


def carried_patches(topts: dict) -> str | None:
    """Which patch kind transformer_options carry, else None (read without recording)."""
    return next((key for key in PATCH_KEYS if nonempty(dict.get(topts, key))), None)


def nonempty(v) -> bool:
    if isinstance(v, dict):
        return any(nonempty(x) for x in dict.values(v))
    if isinstance(v, (list, tuple)):
        return any(nonempty(x) for x in v) if v and isinstance(v[0], (dict, list, tuple)) else bool(v)
    return bool(v)
