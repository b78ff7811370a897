"""ActivationStats: what the inputs of every Linear layer looked like during calibration.
Design: docs/design.md, ``stats.py``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from .cuda_streams import on_side_stream, shared_graph_pool
from .reservoir import ReservoirChain

HIST_MANTISSA_BITS = 5                       # 32 bins per octave
HIST_BINS = 1 << (8 + HIST_MANTISSA_BITS)    # bf16 exponent x top mantissa bits (incl. inf/nan)
INF_NAN_BIN = HIST_BINS - (1 << HIST_MANTISSA_BITS)  # bf16 exponent 255 and up: inf and nan
FORMAT_VERSION = 2  # 2: bf16-bit-pattern histogram (the statistics file's, statsfile.py)

from .errors import CalibrationError


def _bin_value(index: torch.Tensor, offset: float) -> torch.Tensor:
    """|x| at ``offset`` (0 = lower edge, 1 = upper edge) inside histogram bin ``index``."""
    e = (index >> HIST_MANTISSA_BITS).double()
    m = (index & ((1 << HIST_MANTISSA_BITS) - 1)).double() + offset
    step = 1.0 / (1 << HIST_MANTISSA_BITS)
    normal = torch.exp2(e - 127) * (1 + m * step)
    subnormal = torch.exp2(torch.tensor(-126.0, dtype=torch.float64)) * (m * step)
    return torch.where(e > 0, normal, subnormal)


def hist_edges() -> torch.Tensor:
    """Upper edge of every histogram bin."""
    return _bin_value(torch.arange(HIST_BINS), 1.0)


def hist_centers() -> torch.Tensor:
    """Middle of every histogram bin (bin 0 holds zeros and the smallest subnormals)."""
    return _bin_value(torch.arange(HIST_BINS), 0.5)


def hist_percentile(hist: torch.Tensor, amax: float, p: float) -> float:
    """Upper edge of the bin of histogram ``hist`` holding the p-th percentile of |x|, never
    above ``amax``."""
    cum = torch.cumsum(hist.double().cpu(), 0)
    target = cum[-1] * (p / 100.0)
    i = int(torch.searchsorted(cum, target.reshape(1)).clamp(max=HIST_BINS - 1))
    return min(float(hist_edges()[i]), amax)


@dataclass
class LayerStats:
    """Streaming statistics of one Linear layer's input (in_features = K)."""

    k: int
    capacity: int                        # reservoir rows
    calls: int = 0
    rows: int = 0
    nonfinite: int = 0
    amax: torch.Tensor | None = None
    channel_absmax: torch.Tensor | None = None
    channel_abssum: torch.Tensor | None = None
    hist: torch.Tensor | None = None
    reservoir: torch.Tensor | None = None  # [min(rows, capacity), K] bf16
    seed: int = 0
    sanitize: bool = False                 # zero non-finite inputs before the other statistics
    # the calibration group (prompt, or forward call) of each reservoir row; -1: unknown (older
    # files).  Searches choose on some groups and check on others (``held_out_split``).
    groups: list | None = None
    _chain: "ReservoirChain | None" = field(default=None, repr=False, compare=False)

    def update(self, x: torch.Tensor, graphs: "UpdateGraphs | None" = None, group: int = -1) -> None:
        """Fold a [..., K] input into the statistics (no host synchronisation; a handful of
        passes over the activation, in its own dtype).  With ``graphs`` the per-call partial
        statistics of a CUDA input run as one graph replay (same kernels, same values)."""
        x = x.detach().reshape(-1, self.k)
        self.calls += 1
        if x.shape[0] == 0:
            return
        if self.hist is None:
            dev = x.device
            self.channel_absmax = torch.zeros(self.k, device=dev)
            self.channel_abssum = torch.zeros(self.k, dtype=torch.float64, device=dev)
            self.hist = torch.zeros(HIST_BINS, dtype=torch.int64, device=dev)
        parts = graphs.partials(x, self.sanitize) if graphs is not None else None
        absmax, abssum, hist = parts if parts is not None else _partials(x, self.sanitize)
        self.hist += hist
        torch.maximum(self.channel_absmax, absmax, out=self.channel_absmax)
        self.channel_abssum += abssum
        self._sample(x, group)
        self.rows += x.shape[0]

    def _sample(self, x: torch.Tensor, group: int = -1) -> None:
        """Reservoir sampling of input rows: the first ``capacity`` rows fill the slots in order,
        later ones replace a slot where ``ReservoirChain`` says so (a handful per call once the
        reservoir is full).  Only those few indices travel to the GPU, through reused pinned
        memory: per-row random draws and a freshly pinned index tensor per call cost more than
        the rest of the update (docs/benchmarks.md, section 2)."""
        if self.capacity <= 0:
            return
        start, n = self.rows, x.shape[0]
        if self.reservoir is None:
            self.reservoir = torch.zeros(0, self.k, dtype=torch.bfloat16, device=x.device)
        if self.groups is None:
            self.groups = [-1] * self.reservoir.shape[0]
        fill_end = min(start + n, self.capacity)
        if fill_end > start:  # filling: row r goes to slot r
            grow = fill_end - self.reservoir.shape[0]
            self.reservoir = torch.cat([self.reservoir, x[:grow].to(torch.bfloat16)])
            self.groups.extend([group] * grow)
        if self._chain is None:
            self._chain = ReservoirChain(self.capacity, self.seed)
        chosen = self._chain.take(start, start + n)  # {slot: row}, the last row per slot
        if not chosen:
            return
        for slot in chosen:
            self.groups[slot] = group
        index = _to_device(list(chosen.keys()) + [r - start for r in chosen.values()], x.device)
        slots, rows = index[:len(chosen)], index[len(chosen):]
        self.reservoir.index_copy_(0, slots, x.index_select(0, rows).to(torch.bfloat16))

    def finish(self) -> None:
        """Settle what update() defers: non-finite counts out of the histogram, the amax."""
        if self.hist is not None:
            self.nonfinite += int(self.hist[INF_NAN_BIN:].sum())
            self.hist[INF_NAN_BIN:] = 0
            self.amax = self.channel_absmax.max()

    # ------------------------------------------------------------------ queries
    def has_sample(self) -> bool:
        return self.reservoir is not None and self.reservoir.shape[0] > 0

    def sample(self) -> torch.Tensor:
        """Sampled input rows [m, K], float32, on the CPU."""
        return self.reservoir.float().cpu()

    def held_out_split(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Boolean masks (fit, held-out) over the sampled rows, split by calibration group
        (prompt): every fourth group - at least one - is held out, so a search chosen on the fit
        rows is checked on prompts it never saw.  None with fewer than two known groups."""
        if not self.has_sample() or not self.groups:
            return None
        known = sorted(set(self.groups) - {-1})
        if len(known) < 2:
            return None
        held_groups = set(known[3::4] or known[-1:])
        held = torch.tensor([g in held_groups for g in self.groups], dtype=torch.bool)
        fit = torch.tensor([g != -1 and g not in held_groups for g in self.groups], dtype=torch.bool)
        if not bool(fit.any()) or not bool(held.any()):
            return None
        return fit, held

    def amax_value(self) -> float:
        return float(self.amax) if self.amax is not None else 0.0

    def channel_mean_abs(self) -> torch.Tensor:
        return (self.channel_abssum / max(self.rows, 1)).float().cpu()

    def to(self, device) -> "LayerStats":
        for name in ("amax", "channel_absmax", "channel_abssum", "hist", "reservoir"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.amax, self.channel_absmax, self.channel_abssum, self.hist, self.reservoir)
                   if t is not None)


def _bincount(index: torch.Tensor) -> torch.Tensor:
    """int64 counts per histogram bin of an integer bin index tensor.

    On CUDA neither ``bincount`` (it sizes its output from max(input): a host synchronisation
    per call that stalls the forward pass) nor ``scatter_add_`` (millions of atomic adds on the
    few bins real activations fall into) but ``histc`` on unit-wide bins, which counts in shared
    memory, an order of magnitude faster.  Its float32 counts
    are exact up to 2**24, hence the chunks."""
    index = index.reshape(-1)
    if index.device.type == "cpu":
        return torch.bincount(index.long(), minlength=HIST_BINS)
    counts = torch.zeros(HIST_BINS, dtype=torch.int64, device=index.device)
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return counts.scatter_add_(0, index.long(), torch.ones(1, dtype=torch.int64, device=index.device)
                                   .expand(index.numel()))  # histc has no deterministic CUDA kernel
    for chunk in index.split(1 << 24):
        counts += torch.histc(chunk.float(), HIST_BINS, 0, HIST_BINS).long()
    return counts


def _partials(x: torch.Tensor, sanitize: bool) -> tuple:
    """One call's per-channel max and sum of |x| and histogram counts of a [rows, K] input.

    Few kernels (on a GPU each costs a launch on every Linear of every forward): the inf/nan
    bins stay in the histogram and the global amax comes from the per-channel one, both settled
    in ``LayerStats.finish()``."""
    a = x.abs()
    bins = _hist_index(a)
    hist = _bincount(bins)
    if sanitize:  # keep the other statistics finite too (costs one more pass)
        a = torch.where(bins >= INF_NAN_BIN, torch.zeros_like(a), a)
    return a.amax(dim=0), a.sum(dim=0, dtype=torch.float64), hist


def histogram(x: torch.Tensor) -> torch.Tensor:
    """|x| histogram counts (``HIST_BINS``) of some rows, as the statistics keep them."""
    return _partials(x, False)[2]


class UpdateGraphs:
    """CUDA graphs of ``_partials`` per input shape, shared by every layer whose input has it.

    Calibrating SDXL is bound by the host: ~700 Linear inputs per forward, each update a dozen
    small kernel launches of Python and dispatch for little GPU work.  A replay is one
    launch after one copy into the shape's static input.  Captured on the first input of a shape
    (a capture synchronises once); only inputs up to ``max_input_bytes`` (large ones are bound by
    the GPU anyway) and static inputs up to ``budget_bytes`` in all (at most a 16th of the GPU's
    memory); a failed capture leaves that shape eager.  ``release()`` gives all memory back
    (calibrate() calls it when it ends)."""

    def __init__(self, max_input_bytes: int = 64 << 20, budget_bytes: int = 512 << 20):
        self.max_input_bytes, self.budget_bytes = max_input_bytes, budget_bytes
        self.entries: dict = {}
        self.skipped: dict = {}  # shape key -> why it stays eager
        self.static_bytes = 0
        self.pool = None
        self.captures = self.replays = 0

    def partials(self, x: torch.Tensor, sanitize: bool):
        """``_partials(x, sanitize)`` by replay, or None (run it eagerly)."""
        if x.device.type != "cuda":
            return None
        key = (tuple(x.shape), x.dtype, x.device, sanitize, torch.are_deterministic_algorithms_enabled())
        entry = self.entries.get(key)
        if entry is None:
            if key in self.skipped:
                return None
            nbytes = x.numel() * x.element_size()
            if nbytes > self.max_input_bytes:
                self.skipped[key] = "large input: bound by the GPU"
                return None
            # never more than a 16th of the GPU (small cards calibrate near their limit)
            budget = min(self.budget_bytes, torch.cuda.get_device_properties(x.device).total_memory // 16)
            if self.static_bytes + nbytes > budget:
                self.skipped[key] = "budget for static inputs spent"
                return None
            try:
                entry = self._capture(x, sanitize)
            except Exception as e:  # an op that cannot be captured: this shape stays eager
                self.skipped[key] = f"capture failed: {type(e).__name__}: {e}"
                return None
            self.entries[key] = entry
            self.static_bytes += nbytes
        static, graph, outs = entry
        static.copy_(x)
        graph.replay()
        self.replays += 1
        return outs

    def _capture(self, x: torch.Tensor, sanitize: bool):
        static = x.clone()
        on_side_stream(lambda: _partials(static, sanitize), x.device)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = shared_graph_pool()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outs = _partials(static, sanitize)
        self.captures += 1
        return static, graph, outs

    def release(self) -> None:
        if self.entries:  # the last replays' outputs must be consumed before their memory goes
            torch.cuda.synchronize()
        self.entries.clear()
        self.pool = None
        self.static_bytes = 0


def _hist_index(a: torch.Tensor) -> torch.Tensor:
    """Histogram bin of each |x| (int16): its bf16 bit pattern without the sign, top mantissa
    bits kept.  (Rounding to bf16 first moves values by at most half a bf16 step: within their
    bin or to its neighbour.)"""
    bits = (a if a.dtype == torch.bfloat16 else a.to(torch.bfloat16)).view(torch.int16)
    return (bits & 0x7FFF) >> (7 - HIST_MANTISSA_BITS)


class _PinnedStaging:
    """Reused pinned host memory for small index copies to one GPU: pinning a new tensor per
    call was the costliest step of a statistics update.  Two halves: before writing into a
    half again, wait until the copies that last read it have run (practically never waits)."""

    def __init__(self, device: torch.device, n: int = 1 << 18):
        self.device, self.half = device, n // 2
        self.buf = torch.empty(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.current, self.used, self.events = 0, 0, [None, None]

    def put(self, values: list) -> torch.Tensor:
        m = len(values)
        if m > self.half:
            src = torch.tensor(values, dtype=torch.int64)
            return (src.pin_memory() if self.device.type == "cuda" else src).to(self.device, non_blocking=True)
        if self.used + m > self.half:  # this half is full: move on to the other one
            if self.device.type == "cuda":
                self.events[self.current] = torch.cuda.Event()
                self.events[self.current].record(torch.cuda.current_stream(self.device))
            self.current, self.used = self.current ^ 1, 0
            if self.events[self.current] is not None:
                self.events[self.current].synchronize()
        start = self.current * self.half + self.used
        view = self.buf[start:start + m]
        view.copy_(torch.tensor(values, dtype=torch.int64))
        self.used += m
        return view.to(self.device, non_blocking=True)


_STAGING: dict = {}


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``, without a host synchronisation on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    key = (device.index if device.index is not None else torch.cuda.current_device())
    staging = _STAGING.get(key)
    if staging is None:
        staging = _STAGING[key] = _PinnedStaging(torch.device("cuda", key))
    return staging.put(values)


@dataclass
class ActivationStats:
    """Statistics for every calibrated Linear layer, keyed by module name."""

    layers: dict[str, LayerStats] = field(default_factory=dict)
    fingerprint: dict[str, list] = field(default_factory=dict)   # layer -> [out_features, in_features]
    forward_calls: int = 0
    info: dict = field(default_factory=dict)   # timesteps/sigmas seen, prompts, steps, sampler...
    # the calibrated module's first call (calls.RecordedCall): in memory only, never saved -
    # a runtime compiles for the shapes sampling will use from it before the first image
    first_call: object = field(default=None, repr=False, compare=False)
    # a few of the module's calls (calls.RecordedCall), drawn evenly at random over the whole
    # calibration: in memory only - quantize_module checks a model-wide choice on them
    check_calls: list = field(default_factory=list, repr=False, compare=False)

    # ------------------------------------------------------------------ queries used by the planner
    def has(self, name: str) -> bool:
        s = self.layers.get(name)
        return s is not None and s.rows > 0

    def layer(self, name: str) -> LayerStats:
        return self.layers[name]

    def never_ran(self) -> list[str]:
        return sorted(n for n in self.fingerprint if not self.has(n))

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers.values())

    def fingerprint_hash(self) -> str:
        text = json.dumps(sorted((k, list(v)) for k, v in self.fingerprint.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def check_model(self, layers: dict[str, tuple]) -> None:
        """Refuse statistics of another model: ``layers`` maps Linear names to (out, in)."""
        mine = {k: tuple(v) for k, v in self.fingerprint.items()}
        common = set(mine) & set(layers)
        bad = sorted(n for n in common if tuple(layers[n]) != mine[n])
        if bad:
            n = bad[0]
            raise CalibrationError(
                f"statistics are from another model: layer {n} is {list(layers[n])} here but "
                f"{list(mine[n])} in the statistics ({len(bad)} layers differ)")
        if len(common) < 0.5 * max(len(mine), 1):
            here = sorted(set(layers) - set(mine))[:2]
            there = sorted(set(mine) - set(layers))[:2]
            raise CalibrationError(
                f"statistics are from another model: only {len(common)} of their {len(mine)} layers exist "
                f"in this model (the statistics have e.g. {', '.join(there) or '-'}; this model has e.g. "
                f"{', '.join(here) or '-'}); calibrate this model")

    def summary(self) -> dict:
        return {"forward_calls": self.forward_calls, "layers": len(self.fingerprint),
                "layers_with_data": sum(1 for n in self.fingerprint if self.has(n)),
                "never_ran": self.never_ran()[:20], "bytes": self.nbytes(),
                "fingerprint": self.fingerprint_hash(), **self.sampled_rows(), **self.info}

    def sampled_rows(self) -> dict:
        """The sampled rows per layer (fewest, most) and how many layers hold fewer rows than
        they have inputs - where GPTQ's Hessian from them is rank-deficient - with one of them;
        empty without samples."""
        held = [(s.reservoir.shape[0], s.k, n) for n, s in self.layers.items() if s.has_sample()]
        if not held:
            return {}
        few = sorted((r / k, n, r, k) for r, k, n in held if r < k)
        out = {"sampled_rows_min": min(r for r, _k, _n in held), "sampled_rows_max": max(r for r, _k, _n in held),
               "layers_fewer_rows_than_inputs": len(few)}
        if few:
            _ratio, name, r, k = few[0]
            out["fewest_rows_per_input"] = f"{name}: {r} rows for {k} inputs"
        return out

    def summary_json(self) -> str:
        """The summary a quantized file carries; with the calibration's first model call described
        (``RecordedCall.signature``) so that a loader compiles ahead for its shapes."""
        out = self.summary()
        signature = self.first_call_signature()
        if signature is not None:
            out["first_call"] = signature
        return json.dumps(out, sort_keys=True)

    def first_call_signature(self) -> dict | None:
        """The recorded first model call described for a file (``RecordedCall.signature``), or None."""
        return self.first_call.signature() if self.first_call is not None else None


def rows_for_budget(k: int, budget_bytes: int) -> int:
    """Reservoir rows of K bf16 values that fit in ``budget_bytes``."""
    return max(0, budget_bytes // (2 * k))
