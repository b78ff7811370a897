"""CUDA-graph replay of whole model evaluations.

``CudaGraphs`` (installed as a model-function wrapper on a clone, so it works for 16-bit models
too) captures each distinct input signature once and replays it; anything it cannot capture runs
eagerly with the reason logged.  With ``compile_blocks`` the graphs are captured over
TorchInductor-compiled blocks (``compiled_blocks``), checked against eager at a signature's first
capture, before anything is replayed - and compiled there unless ``runtime`` compiled them ahead
for the calibration's shapes (Quantize Model); else the first run pays the compilation once per
input shape (H200: Flux ~11 s with a cold Inductor cache, ~3.4 s warm; SDXL ~47 s / ~9 s; what it
compiles is kept for the next process, ``compile_cache``) and every later evaluation replays the
compiled graph.  (Compiling in a
background thread while the first runs replayed the uncompiled graph was tried: in the node path
the compile thread, starved of the interpreter by the sampler's, had not landed after 9 runs,
slowed runs 2-3 by up to 90%, and died with the process - "SubprocPool closed".)

The graphs stay while the model stays loaded: a second sampling run with the same shapes
captures nothing.  Their memory is accounted the way ComfyUI counts memory in use (``GraphPool``:
under the caching allocator the pool's idle blocks are held by placeholders (``graph_pool``), so ComfyUI's
free-memory estimate - reserved minus active - does not count memory only the graphs can use;
under cudaMallocAsync, ComfyUI's default on CUDA 13 torch, the graphs hold driver memory the
device reports as used), and it goes back when ComfyUI
unloads the model, partly or wholly, to make room: the graphs are owned by the model's patcher
and die with its residency.  A change of weights or weight patches (a LoRA) recaptures.

Under the caching allocator the pool is sized to the forward (``graph_memory``): the eager
warm-up before a signature's first capture is recorded, the allocator's placement replayed on
it, and the graph captured into a few segments fitted to it (the capture, recorded too, checks
the fit; captured once more into its own fit where it asked for more) - left alone the pool grew
to 2x what the forward uses at once (Flux.1-dev: 0.82 GiB of segments for 0.39 GiB in use;
fitted 0.44 GiB).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from comfy.patcher_extension import CallbacksMP, WrappersMP

from ..cuda_streams import allocator_backend, keep_forever, on_side_stream, trim_graph_memory, work_stream
from ..device_constants import ConstantsOnDevice, HostCopies
from ..graph_memory import (ROUND_LARGE, AllocationTrace, large_events, peak_in_use, pool_need, release_blas_workspaces,
                            without_unfreed)
from .compile_cache import key_of, kept
from .compiled_blocks import (CompiledBlocks, carried_patches, install_raw_pointer_launches, nonempty,
                              raw_pointer_launches, rounding_noise)
from .graph_inputs import clone_tree, tensors_of, walk_signature
from .graph_pool import GraphPool, pool_accounting
from .lean import dequant_cache_of, release_on_detach


# wrapper kinds that run around the model evaluation, never inside the captured region
_WRAPPERS_OUTSIDE_MODEL = frozenset({WrappersMP.OUTER_SAMPLE, WrappersMP.PREPARE_SAMPLING, WrappersMP.SAMPLER_SAMPLE,
                                     WrappersMP.PREDICT_NOISE, WrappersMP.CALC_COND_BATCH})
# every ModelPatcher callback kind ComfyUI defines: lifecycle events, none runs inside a forward
_PATCHER_LIFECYCLE_CALLBACKS = frozenset(v for k, v in vars(CallbacksMP).items() if k.startswith("ON_"))


_RESIZE_MIN_SAVING = 32 << 20  # a first capture whose pool grew this much (and 5%) past its fitted segment is redone


class CudaGraphs:
    """Model-function wrapper: capture ``apply_model`` per input signature, then replay.

    A signature is the shapes/dtypes of every tensor argument plus the non-tensor values; the
    weights' storage addresses are checked before each replay (a model unloaded and reloaded
    elsewhere is captured again).  Runs eagerly, logging why, when the model is partially
    loaded, when transformer options carry patches, or when capture fails."""

    replays_skip_hooks = True  # module hooks (calibration statistics) run only while capturing

    def __init__(self, patcher, max_graphs: int = 8, compile_blocks: bool = False, persistent: bool | None = None):
        self.patcher, self.max_graphs = patcher, max_graphs
        self.compile_seconds: list = []  # wall time of each compilation + check
        self.compiled = CompiledBlocks(patcher.model.diffusion_model) if compile_blocks else None
        # cudaMallocAsync (ComfyUI's default allocator on CUDA 13 torch): captures need a quiet
        # process (_quiet_for_capture), Inductor's kernels their pointers raw, and a failed
        # capture's memory must never be freed
        self.malloc_async = allocator_backend() == "cudaMallocAsync"
        if self.compiled is not None and self.compiled.enabled and self.malloc_async and not install_raw_pointer_launches():
            self.compiled.disable("this torch's Inductor kernels cannot be captured under cudaMallocAsync; "
                                   "start ComfyUI with --disable-cuda-malloc to use compiled blocks")
        self.graphs: dict = {}
        self.pool = None
        # keep the graphs between sampling runs where their memory can be accounted (else they go
        # back after every run, and each run captures again)
        self.persistent = pool_accounting() is not None if persistent is None else persistent
        self.warned: set = set()
        self.eager_calls = self.replays = self.captures = self.releases = 0
        self.capture_seconds: list = []  # wall time of each capture (with its warm-up / compilation)
        self.warmed: set = set()  # signatures whose lazy inits/compilation already ran
        self.failed: dict = {}  # signature -> why its capture failed (runs eagerly, not retried)
        self.validated: set = set()  # signatures whose compiled blocks matched eager
        self.graph_memory_trimmed = None  # cudaMallocAsync: whether the last release trimmed
        # (signature, compiled) -> what its forward asks of the pool (graph_memory.PoolNeed),
        # recorded at its first warm-up / capture into an empty pool
        self.pool_needs: dict = {}
        # per sized first capture, bytes: seeded from its warm-up (from_warm_up), or grown vs
        # fitted where it was captured again
        self.pool_sizing: list = []
        self.constants_rebuilt = 0  # CPU-built constants the last capture built on the GPU instead

    def release(self, *_args) -> None:
        """Drop every captured graph and the memory pool they share.

        Called when ComfyUI detaches the model from the GPU or unloads part of it (to make room
        for another model, the VAE, ...), and when the weights change.  The next evaluation
        captures again (about one forward per input signature; compilation and validation are not
        repeated).  ComfyUI empties the allocator's cache after unloading, which returns the
        pool's memory to the device."""
        if self.graphs or self.pool is not None:
            self.graphs.clear()
            if self.pool is not None:
                self.pool.vacate()
                if self.pool.accounting == "device":  # the driver keeps graph memory until trimmed
                    self.graph_memory_trimmed = trim_graph_memory(self.patcher.load_device)
            self.pool = None
            self.releases += 1

    def end_run(self, *_args) -> None:
        """ComfyUI's cleanup after a sampling run: the graphs stay (persistent) or go."""
        if not self.persistent:
            self.release()

    # --------------------------------------------------------------- helpers
    def _eager(self, apply_model, args, reason: str):
        if reason not in self.warned:
            self.warned.add(reason)
            logging.info(f"[comfy-modelopt] CUDA graphs: running eagerly ({reason})")
        self.eager_calls += 1
        return apply_model(args["input"], args["timestep"], **args["c"])

    def _signature(self, args):
        flat: list = []
        walk_signature({"input": args["input"], "timestep": args["timestep"], "c": args["c"]}, flat)
        return tuple(flat)

    def compute_dtype(self):
        model = self.patcher.model
        try:
            dtype = model.get_dtype_inference()
        except Exception:  # pragma: no cover - older ComfyUI
            return None
        return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else None

    def _weights_key(self):
        model = self.patcher.model
        return (getattr(model, "current_weight_patches_uuid", None),
                tuple(p.data_ptr() for p in model.diffusion_model.parameters()))

    def _blocker(self, args) -> str | None:
        # what the model carries first, the device last: a CPU test then sees every other reason
        topts = args["c"].get("transformer_options", {})
        patched = carried_patches(topts)
        if patched:
            return f"transformer_options carries {patched}"
        # ComfyUI's sampler copies the patcher's wrappers and callbacks into transformer_options
        # (sampler_helpers.prepare_model_patcher) - our own release callbacks too.  Only wrappers
        # that run inside the model evaluation would be frozen into a graph; patcher callbacks
        # are lifecycle events (load, detach, cleanup, ...) that never run during it.
        for kind, per_key in (topts.get("wrappers") or {}).items():
            if kind not in _WRAPPERS_OUTSIDE_MODEL and nonempty(per_key):
                return f"transformer_options carries {kind} wrappers"
        for kind, per_key in (topts.get("callbacks") or {}).items():
            if kind not in _PATCHER_LIFECYCLE_CALLBACKS and nonempty(per_key):
                return f"transformer_options carries {kind} callbacks"
        model = self.patcher.model
        if getattr(model, "model_lowvram", False) or getattr(model, "lowvram_patch_counter", 0):
            self.release()  # captured over weights that have moved: give their memory back
            return "model partially loaded (offloading)"
        if args["input"].device.type != "cuda":
            return "not on a CUDA device"
        return None

    # --------------------------------------------------------------- wrapper
    def __call__(self, apply_model, args):
        reason = self._blocker(args)
        if reason:
            return self._eager(apply_model, args, reason)
        c = dict(args["c"])
        topts = c.pop("transformer_options", {})
        try:
            sig = self._signature({"input": args["input"], "timestep": args["timestep"], "c": c})
        except TypeError as e:
            return self._eager(apply_model, args, f"unsupported argument type {e}")
        weights = self._weights_key()
        entry = self.graphs.get(sig)
        if entry is not None and entry["weights"] != weights:
            self.graphs.clear()
            entry = None
        if entry is None:
            if sig in self.failed:  # a model whose forward cannot be captured: no retry per call
                return self._eager(apply_model, args, self.failed[sig])
            if len(self.graphs) >= self.max_graphs:
                return self._eager(apply_model, args, f"more than {self.max_graphs} input signatures")
            try:
                entry = self._capture(apply_model, args, c, topts, weights, sig)
            except Exception as e:  # capture can fail on host syncs or unsupported ops
                if self.malloc_async:
                    keep_forever(e)  # cudaMallocAsync: what the capture allocated is never freed
                self.graphs.pop(sig, None)
                self.failed[sig] = f"capture failed: {type(e).__name__}: {str(e)[:300]}"
                return self._eager(apply_model, args, self.failed[sig])
            self.graphs[sig] = entry
            return entry["out"].clone()
        for dst, src in zip(entry["static"], tensors_of(args["input"], args["timestep"], c)):
            dst.copy_(src, non_blocking=True)
        entry["graph"].replay()
        self.replays += 1
        return entry["out"].clone()

    def _capture(self, apply_model, args, c, topts, weights, sig):
        t0 = time.perf_counter()
        # Conditioning can arrive on the CPU (SDXL's ADM vector and Flux's guidance are built
        # there); apply_model would copy it to the GPU on every call, and a host-to-device copy
        # cannot be captured.  apply_model moves every conditioning tensor to the input's device
        # anyway, so the static copies live there; replays copy new values into them.
        device = args["input"].device
        static_x = args["input"].clone()
        static_t = clone_tree(args["timestep"], device)
        static_c = clone_tree(c, device)
        static_c["transformer_options"] = topts
        use_compiled = self.compiled is not None and self.compiled.enabled and sig in self.validated
        run = lambda: self._model_call(apply_model, static_x, static_t, static_c)  # noqa: E731
        first = lambda: self._model_call(apply_model, static_x, static_t, static_c, check_host_copies=True)  # noqa: E731
        cache = dequant_cache_of(self.patcher.model)
        # a graph that will get a pool of its own, not sized yet: its warm-up is recorded, and the
        # pool seeded from that record, so the capture needs no second take into a fitted pool
        # (H200: the first capture 0.94 -> 0.75 s SDXL, 0.85 -> 0.65 s Flux).  The capture is
        # recorded too and checks the seeding
        fresh = not self.graphs or self.pool is None
        warm = {}  # (sig, compiled) -> the PoolNeed of that warm-up

        def sized_warm_up(fn, compiled: bool):
            if not fresh or (sig, compiled) in self.pool_needs:
                return fn()
            out, warm[(sig, compiled)] = self._recorded(fn, device)
            return out
        if sig not in self.warmed:
            t_compile = time.perf_counter()

            def warm_up():  # outside the capture: lazy inits, autotuning, compilation, dequant cache
                if self.compiled is None or not self.compiled.enabled:
                    sized_warm_up(first, False)
                    return False
                # the compiled forward is the one captured (unless it fails its check): its run is
                # the recorded warm-up that sizes the pool, the eager reference is not
                dtype = self.compute_dtype()
                with kept(key_of(self.patcher.model.diffusion_model, repr(sig), dtype, device), "compiled blocks"):
                    return self.compiled.validate(
                        lambda: sized_warm_up(run, True), first(),
                        lambda: apply_model(rounding_noise(static_x, dtype), static_t, **static_c))
            use_compiled = on_side_stream(warm_up, device)
            self.warmed.add(sig)
            if self.compiled is not None:
                self.compile_seconds.append(round(time.perf_counter() - t_compile, 3))
            if use_compiled:
                self.validated.add(sig)
        elif use_compiled:
            # a new run's transformer_options may fail a compiled guard: any recompilation (and
            # Inductor's autotuning) must happen here, never inside the capture
            def warm_up_compiled():
                with self.compiled.installed():
                    sized_warm_up(run, True)
            on_side_stream(warm_up_compiled, device)
        elif cache is not None and cache.needs_fill():
            on_side_stream(run, device)  # refill the dequant cache (released on detach, or weights changed)
        self._quiet_for_capture()
        # every capture runs on the stream its warm-ups above ran on (cuda_streams.work_stream):
        # the allocator serves a request only from free blocks of its own stream, and a sized
        # pool's segments are made on it
        stream = work_stream(device)
        key = (sig, use_compiled)
        need = self.pool_needs.get(key)
        warm_need = warm.get(key) if need is None else None
        # no graph lives in the pool (none yet, or the uncompiled graph this capture replaces is
        # gone): a pool of its own for this one, seeded where its need is known (or its warm-up's)
        if fresh:
            seed = need if need is not None else warm_need
            self._new_pool(seed.segments if seed is not None else [], stream, device)
        self.pool.vacate()
        measure = fresh and need is None and self.pool.pool is not None
        with AllocationTrace(device) if measure else contextlib.nullcontext() as trace:
            graph, out = self._capture_graph(run, use_compiled, stream)
        if trace is not None and trace.entries is not None:
            events = large_events(trace.entries, stream=stream.cuda_stream)
            grown = self.pool.reserved_bytes("large")
            if warm_need is not None and warm_need.fitted and grown <= warm_need.fitted and \
                    abs(peak_in_use(events)[0] - warm_need.peak) <= ROUND_LARGE:
                # the capture asked what its warm-up did and the seeded segments served it
                self.pool_needs[key] = warm_need
                self.pool_sizing.append({"from_warm_up": True, "fitted": warm_need.fitted, "peak": warm_need.peak,
                                         "simulated_grown": warm_need.grown, "sized": grown})
            else:
                need = self.pool_needs[key] = pool_need(events)
                if need.fitted and grown - need.fitted > max(_RESIZE_MIN_SAVING, need.fitted // 20):
                    # the pool grew segment by segment to far more than the graph uses at once:
                    # capture again into the fitted segments (the same forward, once more)
                    del graph, out
                    self._new_pool(need.segments, stream, device)
                    graph, out = self._capture_graph(run, use_compiled, stream)
                    self.pool_sizing.append({"grown": grown, "fitted": need.fitted, "peak": need.peak,
                                             "simulated_grown": need.grown,
                                             "sized": self.pool.reserved_bytes("large")})
        self.captures += 1  # a capture made again into fitted segments counts once (pool_sizing has it)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        self.pool.occupy()
        self.capture_seconds.append(round(time.perf_counter() - t0, 3))
        static_c.pop("transformer_options")
        return {"graph": graph, "static": tensors_of(static_x, static_t, static_c), "out": out, "weights": weights,
                "compiled": use_compiled}

    @staticmethod
    def _recorded(fn, device):
        """``fn()`` (a warm-up, on the work stream) with its large allocations recorded: (its
        output, the pool a capture of the same forward needs, or None where the allocator keeps
        no history).  What the warm-up allocates for good but its output lives outside the pool
        by the time the forward is captured (``without_unfreed``)."""
        # its cuBLAS workspace is made where the capture's will be (at the first matmul) and
        # freed at the end, as after a capture: the fit holds it, as the graph's pool will
        release_blas_workspaces()
        with AllocationTrace(device) as trace:
            out = fn()
            release_blas_workspaces()
        if trace.entries is None:
            return out, None
        keep = {t.untyped_storage().data_ptr() for t in tensors_of(out)}
        events = large_events(trace.entries, stream=torch.cuda.current_stream(device).cuda_stream)
        return out, pool_need(without_unfreed(events, keep))

    def _new_pool(self, segments: list, stream, device) -> None:
        """Replace the pool (its segments go back at the next capture's empty_cache, once no graph
        uses them) by a new one seeded with ``segments`` on ``stream``."""
        if self.pool is not None:
            self.pool.vacate()
        self.pool = GraphPool(accounted=self.persistent)
        self.pool.seed(segments, stream, device)

    def _capture_graph(self, run, use_compiled: bool, stream):
        """One capture of ``run`` into the pool, on ``stream``."""
        graph = torch.cuda.CUDAGraph()
        with contextlib.ExitStack() as stack:
            if use_compiled:
                stack.enter_context(self.compiled.installed())
                if self.malloc_async:
                    stack.enter_context(raw_pointer_launches())
            # the workspace cuBLAS uses inside the graph is allocated in its pool, and stays there
            # (release_blas_workspaces); every other one goes back to the allocator
            release_blas_workspaces()
            # thread_local: other threads of the process (ComfyUI's) may use the GPU meanwhile
            with torch.cuda.graph(graph, pool=self.pool.handle, stream=stream,
                                  capture_error_mode="thread_local"):
                out = run()
            release_blas_workspaces()
        return graph, out

    def _quiet_for_capture(self) -> None:
        """Nothing else runs while a graph is captured: under cudaMallocAsync no garbage of
        earlier runs is freed during the capture.  torch's allocator there keeps one process-wide
        "capture underway" flag, so an allocation by another thread meanwhile is taken for a
        graph allocation and its free joins that thread's stream into the capture - which
        invalidates it - and freeing what a failed capture allocated aborts the process
        (cudaFreeAsync "invalid argument")."""
        if self.malloc_async:
            gc.collect()
            torch.cuda.synchronize()

    def _model_call(self, apply_model, x, t, c, check_host_copies: bool = False):
        """The model evaluation a capture and its warm-ups run: constants the forward builds on the
        CPU and moves to the GPU are built on the GPU (``device_constants``: Wan 2.1's timestep
        embedding - without it every Wan capture failed; compiled regions leave that mode, see
        ``compiled_blocks``).  ``check_host_copies`` (a signature's first warm-up): a host copy
        left over fails the signature here, before any capture is tried."""
        mode = ConstantsOnDevice()
        with HostCopies() if check_host_copies else contextlib.nullcontext() as copies, mode:
            out = apply_model(x, t, **c)
        self.constants_rebuilt = mode.rebuilt
        if copies is not None and copies.ops:
            raise RuntimeError(f"the forward copies tensors from the CPU to the GPU ({', '.join(sorted(set(copies.ops)))}),"
                               " which a CUDA graph cannot capture")
        return out


_CALLBACK_KEY = "comfy_modelopt_cuda_graphs"  # the patcher callbacks a runner installs


def enable_cuda_graphs(patcher, compile_blocks: bool = False):
    """A clone of ``patcher`` whose model evaluations are captured and replayed (over
    Inductor-compiled blocks with ``compile_blocks``, validated against eager).  A MODEL that
    already replays through this runtime (Quantize Model's default) gets a fresh runner with
    these options in place of its own; any other model function wrapper is refused."""
    clone = patcher.clone()
    existing = clone.model_options.get("model_function_wrapper")
    if isinstance(existing, CudaGraphs):
        del clone.model_options["model_function_wrapper"]
        for call_type in (CallbacksMP.ON_CLEANUP, CallbacksMP.ON_DETACH):
            clone.remove_callbacks_with_key(call_type, _CALLBACK_KEY)
    elif existing is not None:
        raise ValueError("this MODEL already has a model function wrapper; CUDA graphs would bypass it")
    runner = CudaGraphs(clone, compile_blocks=compile_blocks)
    clone.set_model_unet_function_wrapper(runner)
    clone.add_callback_with_key(CallbacksMP.ON_CLEANUP, _CALLBACK_KEY, runner.end_run)
    # a clone's detach without unpatching keeps the graphs: the weights' addresses and patches are
    # checked before every replay anyway
    clone.add_callback_with_key(CallbacksMP.ON_DETACH, _CALLBACK_KEY, release_on_detach(runner.release))
    _release_on_partial_unload(clone, runner)
    return clone, runner


def _release_on_partial_unload(patcher, runner) -> None:
    """ComfyUI frees VRAM for another model by unloading part of this one
    (``LoadedModel.model_unload`` -> ``partially_unload``), with no callback for it: the graphs
    (captured over the weights' addresses, useless once they move) go first, so their pool is
    what is freed.  A clone made later from this patcher has no such hook: its evaluations find
    the model partially loaded and release the graphs then."""
    unload = patcher.partially_unload

    def partially_unload(*args, **kwargs):
        runner.release()
        return unload(*args, **kwargs)
    patcher.partially_unload = partially_unload
