"""Calibration and quantization across processes with torch.distributed (NCCL between GPUs,
gloo between CPU processes), launched by ``torchrun``.  Design: docs/design.md, ``distributed.py``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from .stats import ActivationStats, LayerStats

SEND_WINDOW = 8  # encoded layers an owner may have in flight to rank 0
RANK0_HEAD = 0.05  # rank 0's share of the file I/O, as a fraction of a rank's even share of the work


# ====================================================================== merge rules (no processes)
def merge_layer_stats(parts: list[LayerStats], seed: int = 0) -> LayerStats:
    """One layer's statistics from several disjoint shares of the calibration rows."""
    live = [p for p in parts if p.hist is not None]
    first = parts[0]
    out = LayerStats(first.k, first.capacity, sum(p.calls for p in parts), sum(p.rows for p in parts),
                     sum(p.nonfinite for p in parts), seed=first.seed, sanitize=first.sanitize)
    if not live:
        return out
    out.channel_absmax = torch.stack([p.channel_absmax.float().cpu() for p in live]).amax(dim=0)
    out.channel_abssum = torch.stack([p.channel_abssum.double().cpu() for p in live]).sum(dim=0)
    out.hist = torch.stack([p.hist.long().cpu() for p in live]).sum(dim=0)
    out.amax = out.channel_absmax.max()
    with_rows = [p for p in live if p.has_sample()]
    if with_rows:
        out.reservoir, out.groups = _merge_reservoirs(with_rows, first.capacity, seed)
    return out


def _merge_reservoirs(parts: list[LayerStats], capacity: int, seed: int) -> tuple[torch.Tensor, list]:
    g = torch.Generator().manual_seed(seed)
    sizes = [p.rows for p in parts]
    # capacity positions drawn without replacement from all rows seen (the union, partitioned by
    # part): how many fall in each part is multivariate hypergeometric
    chosen = _distinct_uniform(sum(sizes), min(capacity, sum(sizes)), g)
    bounds = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    take = torch.bincount(torch.bucketize(chosen, bounds, right=True), minlength=len(parts)).tolist()
    rows, groups = [], []
    for p, n in zip(parts, take):
        if n == 0:
            continue
        have = p.reservoir.shape[0]
        if n > have:  # a reservoir holds min(rows, capacity) >= any draw from its rows
            raise ValueError(f"reservoir of {have} rows cannot give {n}")
        idx = torch.randperm(have, generator=g)[:n].sort().values
        rows.append(p.reservoir.cpu()[idx])
        pg = p.groups if p.groups is not None and len(p.groups) == have else [-1] * have
        groups.extend(pg[i] for i in idx.tolist())
    return torch.cat(rows), groups


def _distinct_uniform(total: int, m: int, g: torch.Generator) -> torch.Tensor:
    """``m`` distinct integers of [0, total), every m-subset equally likely.  Where ``total`` is
    much larger than ``m`` (rows seen vs rows kept), without a permutation of all of them: the
    distinct values of 2m + 16 uniform draws are a uniform subset of their size (exchangeable),
    and a random m of them a uniform m-subset (fewer than m distinct: drawn again)."""
    if total <= 4 * m:
        return torch.randperm(total, generator=g)[:m]
    while True:
        distinct = torch.unique(torch.randint(total, (2 * m + 16,), generator=g))
        if distinct.numel() >= m:
            return distinct[torch.randperm(distinct.numel(), generator=g)[:m]]


def merge_stats(parts: list[ActivationStats]) -> ActivationStats:
    """The statistics of several processes' shares of the calibration, as one (see module doc)."""
    first = parts[0]
    for p in parts[1:]:
        if p.fingerprint != first.fingerprint:
            raise ValueError("statistics of different models cannot be merged")
    out = ActivationStats(fingerprint=dict(first.fingerprint), forward_calls=sum(p.forward_calls for p in parts),
                          info=dict(first.info, ranks=len(parts)))
    for name in first.layers:
        out.layers[name] = merge_layer_stats([p.layers[name] for p in parts], seed=first.layers[name].seed)
    return out


def calibrate_sharded(module: torch.nn.Module, prompts: list, run, options=None, info: dict | None = None,
                      shard: "Shard | None" = None) -> ActivationStats:
    """Data-parallel calibration: this rank runs ``run(module, prompt)`` for its share of
    ``prompts`` (each prompt its calibration group, by its index in ``prompts``), then the
    statistics of all ranks are merged on every rank (``all_reduce_stats``).  Without a
    distributed job it is ``calibrate`` over all prompts.  Collective: every rank calls it with
    the same ``prompts``."""
    from .calibrate import CalibrationOptions, calibrate
    shard = shard or Shard.current()
    rank, world = (shard.rank, shard.world) if shard is not None else (0, 1)
    mine = shard_prompts(list(range(len(prompts))), rank, world)
    current = [0]

    def loop(m):
        for i in mine:
            current[0] = i
            run(m, prompts[i])
    stats = calibrate(module, loop, options or CalibrationOptions(), info=info, group=lambda: current[0])
    return all_reduce_stats(stats, shard) if shard is not None else stats


def shard_prompts(prompts: list, rank: int, world: int) -> list:
    """This rank's share: prompts ``rank, rank + world, ...`` (keep each prompt's global index as its
    calibration group: ``calibrate(..., group=...)``)."""
    return list(prompts)[rank::world]


# ====================================================================== collectives
@dataclass
class Shard:
    """This process's place in a torch.distributed job (``current()`` reads the initialised one)."""
    rank: int
    world: int
    device: torch.device          # where collective buffers live (CUDA for NCCL)
    group: object = None
    _pending: list = field(default_factory=list, repr=False, compare=False)  # layers sent, not yet received

    @classmethod
    def current(cls, group=None) -> "Shard | None":
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(dist.get_rank(group), dist.get_world_size(group), device, group)

    def assign(self, costs: list[float]) -> list[int]:
        """An owner rank for each of ``costs`` (work items): the costliest first, each to the rank
        with the least work so far (rank 0 also reads and writes the file: it starts a little
        loaded).  Deterministic, so every rank computes the same assignment."""
        load = [0.0] * self.world
        load[0] = RANK0_HEAD * sum(costs) / self.world
        owners = [0] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            owners[i] = r
            load[r] += costs[i]
        return owners

    def collect_order(self, costs: list[float], owners: list[int]) -> list[int]:
        """The order in which rank 0 handles the work items (indices): its own in their order,
        each other rank's when it should be ready - every owner encodes its share back to back,
        in order, at ``costs`` (as in ``assign``).  Rank 0 so keeps encoding while the others
        work instead of waiting for each of their items in file order, which left both ranks
        waiting on each other (a simulation of both: docs/benchmarks.md,
        section 5).
        The writer takes tensors in any order; each owner's items keep their order (a pair's
        messages are matched in order)."""
        clock = [0.0] * self.world
        clock[0] = RANK0_HEAD * sum(costs) / self.world
        ready = []
        for i, (cost, r) in enumerate(zip(costs, owners)):
            if r != 0:
                clock[r] += cost
                ready.append((clock[r], i))
        ready.sort()
        order, t, j = [], clock[0], 0
        for i in (i for i, r in enumerate(owners) if r == 0):
            while j < len(ready) and ready[j][0] <= t:
                order.append(ready[j][1])
                j += 1
            order.append(i)
            t += costs[i]
        return order + [i for _, i in ready[j:]]

    def schedule(self, plan) -> tuple[list, dict]:
        """(the plan's layers and convolutions in the order this rank handles them, the owner rank
        of each quantized layer): rank 0 the copies first, then the quantized layers as they
        should be ready (``collect_order``)."""
        # GPTQ at Flux widths: a layer's time grows like k (n + k) - GPTQ's
        # column loop, launch-bound, runs k steps over n rows - not like its k^3 Cholesky
        quantized = plan.quantized
        costs = [l.k * (l.n + l.k) for l in quantized]
        owners = self.assign(costs)
        items = plan.layers + plan.convs
        if self.rank == 0:
            items = [l for l in plan.layers if not l.quantized] + plan.convs + \
                [quantized[i] for i in self.collect_order(costs, owners)]
        return items, dict(zip((l.name for l in quantized), owners))

    # ---------------------------------------------------------------- point to point
    def send_layer(self, tensors: dict, report_json: str, dst: int = 0) -> None:
        """Send one encoded layer without waiting for the receiver (at most ``SEND_WINDOW`` layers
        in flight, so an owner keeps encoding while rank 0 is behind)."""
        import torch.distributed as dist
        data = torch.frombuffer(bytearray(report_json.encode()), dtype=torch.uint8)
        bufs = [_as_bytes(tensors[key]).to(self.device) for key in sorted(tensors)]
        bufs += [torch.tensor([data.numel()], dtype=torch.int64, device=self.device), data.to(self.device)]
        self._pending.append((bufs, [dist.isend(b, dst, group=self.group) for b in bufs]))
        while len(self._pending) > SEND_WINDOW:
            self._wait(self._pending.pop(0))

    def flush(self) -> None:
        """Wait until every sent layer was received."""
        while self._pending:
            self._wait(self._pending.pop(0))

    @staticmethod
    def _wait(item) -> None:
        for work in item[1]:
            work.wait()

    def recv_layer(self, planned: dict, src: int) -> tuple[dict, str]:
        """``planned``: key -> (torch dtype, shape) of the tensors the sender encodes."""
        import torch.distributed as dist
        out = {}
        for key in sorted(planned):
            dtype, shape = planned[key]
            buf = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=self.device)
            dist.recv(buf, src, group=self.group)
            out[key] = buf.cpu().view(dtype).reshape(shape)
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(data, src, group=self.group)
        return out, bytes(data.cpu().numpy()).decode()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def all_reduce_stats(stats: ActivationStats, shard: Shard | None = None) -> ActivationStats:
    """Every rank's statistics merged (``merge_stats``), on every rank; ``stats`` as it is when
    not in a distributed job.  Collective: every rank calls it with statistics of the same model.

    The layers travel packed as bytes, many per collective (up to ``MERGE_CHUNK_BYTES`` a rank):
    one all-gather per layer and field (hundreds of collectives, each waited on) was a tenth of a
    16-prompt calibration on two GPUs (docs/benchmarks.md, section 5)."""
    import torch.distributed as dist
    shard = shard or Shard.current()
    if shard is None or shard.world == 1:
        return stats
    dev, group = shard.device, shard.group
    fp = json.dumps(sorted(stats.fingerprint.items())).encode()
    _check_same(fp, shard)
    parts = [ActivationStats(fingerprint=dict(stats.fingerprint), info=dict(stats.info)) for _ in range(shard.world)]
    calls = torch.tensor([stats.forward_calls], dtype=torch.int64, device=dev)
    gathered = [torch.empty_like(calls) for _ in range(shard.world)]
    dist.all_gather(gathered, calls, group=group)
    for p, c in zip(parts, gathered):
        p.forward_calls = int(c.item())
    for chunk in _chunks(list(stats.layers.items())):
        mine, off = torch.zeros(sum(_packed_bytes(s) for _n, s in chunk), dtype=torch.uint8, device=dev), 0
        for _name, s in chunk:
            _pack_layer(s, mine, off)
            off += _packed_bytes(s)
        bufs = [torch.empty_like(mine) for _ in range(shard.world)]
        dist.all_gather(bufs, mine, group=group)
        for r, buf in enumerate(bufs):
            buf, off = buf.cpu(), 0
            for name, s in chunk:
                parts[r].layers[name], off = _unpack_layer(s, buf, off)
        del mine, bufs
    return merge_stats(parts)


MERGE_CHUNK_BYTES = 256 << 20  # packed statistics a rank sends per all-gather


def _chunks(layers: list) -> list[list]:
    out, cur, size = [], [], 0
    for item in layers:
        n = _packed_bytes(item[1])
        if cur and size + n > MERGE_CHUNK_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += n
    return out + [cur] if cur else out


def _fields(s: LayerStats) -> list[tuple[str, torch.dtype, tuple]]:
    """One layer's packed fields, widest element first (every offset stays aligned)."""
    from .stats import HIST_BINS
    return [("meta", torch.int64, (5,)), ("abssum", torch.float64, (s.k,)), ("hist", torch.int64, (HIST_BINS,)),
            ("groups", torch.int64, (s.capacity,)), ("absmax", torch.float32, (s.k,)),
            ("reservoir", torch.bfloat16, (s.capacity, s.k))]


def _field_bytes(dtype: torch.dtype, shape: tuple) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _packed_bytes(s: LayerStats) -> int:
    n = sum(_field_bytes(d, sh) for _f, d, sh in _fields(s))
    return -(-n // 8) * 8  # the next layer starts 8-aligned


def _views(like: LayerStats, buf: torch.Tensor, off: int) -> dict:
    """The fields of the layer packed at byte ``off`` of ``buf`` (uint8), as typed views."""
    t = {}
    for f, d, sh in _fields(like):
        n = _field_bytes(d, sh)
        t[f] = buf[off:off + n].view(d).reshape(sh)
        off += n
    return t


def _pack_layer(s: LayerStats, buf: torch.Tensor, off: int) -> None:
    """Write one layer's statistics at byte ``off`` of ``buf`` (zeroed; a fixed size: the reservoir
    padded to capacity, in bf16 as sampled - exact)."""
    has = s.hist is not None
    m = s.reservoir.shape[0] if (has and s.reservoir is not None) else 0
    t = _views(s, buf, off)
    t["meta"].copy_(torch.tensor([int(has), s.calls, s.rows, s.nonfinite, m], dtype=torch.int64))
    t["groups"].fill_(-1)
    if has:
        t["abssum"].copy_(s.channel_abssum)
        t["hist"].copy_(s.hist)
        t["absmax"].copy_(s.channel_absmax)
    if m:
        t["reservoir"][:m].copy_(s.reservoir)
        if s.groups is not None and len(s.groups) == m:
            t["groups"][:m].copy_(torch.tensor(s.groups, dtype=torch.int64))


def _unpack_layer(like: LayerStats, buf: torch.Tensor, off: int) -> tuple[LayerStats, int]:
    """The LayerStats packed at byte ``off`` of ``buf`` (a CPU uint8 tensor), and the next offset."""
    t = _views(like, buf, off)
    has, calls, rows, nonfinite, m = (int(v) for v in t["meta"].tolist())
    s = LayerStats(like.k, like.capacity, calls, rows, nonfinite, seed=like.seed, sanitize=like.sanitize)
    if has:
        s.channel_absmax, s.channel_abssum, s.hist = t["absmax"], t["abssum"], t["hist"]
        s.amax = s.channel_absmax.max()
        if m:
            s.reservoir = t["reservoir"][:m]
            s.groups = t["groups"][:m].tolist()
    return s, off + _packed_bytes(like)


def _check_same(fingerprint: bytes, shard: Shard) -> None:
    import hashlib

    import torch.distributed as dist
    h = torch.tensor(list(hashlib.sha256(fingerprint).digest()[:8]), dtype=torch.int64, device=shard.device)
    hs = [torch.empty_like(h) for _ in range(shard.world)]
    dist.all_gather(hs, h, group=shard.group)
    if any(not torch.equal(x, h) for x in hs):
        raise ValueError("ranks calibrated different models: their statistics cannot be merged")
