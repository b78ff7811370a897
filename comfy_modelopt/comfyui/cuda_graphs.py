"""CUDA-graph replay of whole model evaluations.  Design: docs/design.md, ``comfyui/cuda_graphs.py``."""
from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from comfy.patcher_extension import WrapperExecutor

from ..cuda_streams import (allocator_backend, end_failed_capture, install_raw_pointer_launches, keep_forever,
                            on_side_stream, raw_pointer_launches, trim_graph_memory, work_stream)
from ..calls import tree_map
from ..device_constants import ConstantsOnDevice, HostCopies
from ..graph_memory import (ROUND_LARGE, AllocationTrace, large_events, peak_in_use, pool_need, recorded_need,
                            release_blas_workspaces)
from .compile_cache import key_of, kept
from .background_compile import BACKGROUND, compile_later
from .compiled_blocks import CompiledBlocks, latent_shapes, rel_l2, rounding_noise
from .graph_inputs import (STEP, ModelCall, NotCapturable, PerStep, foreign, kept_state, listed, named,
                           state_changes, step_key, tensors_of)
from .graph_pool import GraphPool, pool_accounting
from .lean import dequant_cache_of


_RESIZE_MIN_SAVING = 32 << 20  # a first capture whose pool grew this much (and 5%) past its fitted segment is redone
# a replay of a graph holding other packs' callables may differ from eager on the same inputs by this much (the
# same kernels; Inductor's split reductions are not bit-deterministic) - over compiled blocks, which the eager
# run may leave for shapes they hold no code for, 3x the model's own rounding noise measured when they were
# checked (``CompiledBlocks.validate``) - before the signature runs eagerly
_CHECK_TOL = 1e-3


class CudaGraphs:
    """ComfyUI's APPLY_MODEL wrapper: capture each input signature's evaluation once, then replay.

    A signature is the shapes/dtypes of the tensor arguments, the other values, and the callables
    in transformer_options by identity (``graph_inputs.ModelCall``): ControlNet residuals, patches,
    replaces and wrappers are inputs of the graph.  APPLY_MODEL wrappers registered after this one,
    and DIFFUSION_MODEL wrappers that decide per call in Python (``_beneath``), run eagerly around
    it; the weights' addresses are checked before each replay.  Patches that read the step's sigma
    on the host get one graph per step.  What a graph cannot hold runs eagerly, the reason logged
    once: a partially loaded model, a forward that reads GPU values on the host or draws random
    numbers there, patches that keep tensors between calls (Self-Attention Guidance), a replay
    that differs from eager at its first replay (checked where other packs' callables are held),
    a failed capture."""

    replays_skip_hooks = True  # module hooks (calibration statistics) run only while capturing

    def __init__(self, patcher, max_graphs: int = 8, compile_blocks: bool = False, persistent: bool | None = None,
                 max_step_graphs: int = 64):
        self.patcher, self.max_graphs = patcher, max_graphs
        self.compile_seconds: list = []  # wall time of each compilation + check
        self.compiled = CompiledBlocks(patcher.model.diffusion_model) if compile_blocks else None
        # cudaMallocAsync (ComfyUI's default on CUDA 13 torch): captures need a quiet process,
        # Inductor's kernels raw pointers, and a failed capture's memory is never freed
        self.malloc_async = allocator_backend() == "cudaMallocAsync"
        if self.compiled is not None and self.compiled.enabled and self.malloc_async and not install_raw_pointer_launches():
            self.compiled.disable("this torch's Inductor kernels cannot be captured under cudaMallocAsync; "
                                   "start ComfyUI with --disable-cuda-malloc to use compiled blocks")
        self.graphs: dict = {}  # signature -> entry, least recently used first
        self.pool = None
        # graphs kept between sampling runs where their memory can be accounted
        self.persistent = pool_accounting() is not None if persistent is None else persistent
        self.warned: set = set()
        self.eager_calls = self.replays = self.captures = self.releases = self.evictions = 0
        self.capture_seconds: list = []  # wall time of each capture (with its warm-up / compilation)
        self.warmed: set = set()  # signatures whose lazy inits/compilation already ran
        self.failed: dict = {}  # signature -> why it runs eagerly (not retried)
        # signature -> what reads the step's sigma on the host: its graphs are one per step, keyed
        # by the sigmas (``step_key``), up to ``max_step_graphs`` of them
        self.per_step: dict = {}
        self.max_step_graphs = max_step_graphs
        self.step_checked: set = set()  # per-step signatures whose first replay was checked
        self.validated: set = set()  # signatures whose compiled blocks matched eager
        self.uncompiled: dict = {}  # signature -> key: captured over blocks without code for its shapes
        self.graph_memory_trimmed = None  # cudaMallocAsync: whether the last release trimmed
        self.pool_needs: dict = {}  # (signature, compiled) -> its forward's graph_memory.PoolNeed
        self.pool_sizing: list = []  # per sized first capture: seeded from its warm-up, or grown vs fitted
        self.constants_rebuilt = 0  # CPU-built constants the last capture built on the GPU instead
        self.beneath = self._beneath  # one object: the graphs beneath other wrappers key it by identity

    def release(self, *_args) -> None:
        """Drop every captured graph and the memory pool they share: when ComfyUI detaches the model
        or unloads part of it, and when the weights change.  The next evaluation captures again
        (compilation and validation are not repeated)."""
        if self.graphs or self.pool is not None:
            self.graphs.clear()
            if self.pool is not None:
                self.pool.vacate()
                if self.pool.accounting == "device":  # the driver keeps graph memory until trimmed
                    self.graph_memory_trimmed = trim_graph_memory(self.patcher.load_device)
            self.pool = None
            self.releases += 1

    def end_run(self, *_args) -> None:
        """ComfyUI's cleanup after a sampling run: blocks for a signature that ran uncompiled in it
        compile in the background (one per run); the graphs stay (persistent) or go."""
        if self.compiled is not None:
            compile_later(self)
        if not self.persistent:
            self.release()

    def _eager(self, apply_model, call: ModelCall, reason: str, compiled: bool = False):
        """``apply_model`` on ``call``, logging ``reason`` once; ``compiled``: over the compiled
        blocks where they were checked on this GPU and hold code for these shapes (nothing is
        compiled here)."""
        self._say_once(f"CUDA graphs: running eagerly ({reason})", reason)
        self.eager_calls += 1
        if compiled and self.compiled is not None and self.compiled.enabled and self.validated \
                and not BACKGROUND.is_set():
            with self.compiled.installed(compile_new_shapes=False):
                return call.run(apply_model)
        return call.run(apply_model)

    def _say_once(self, text: str, key: str | None = None) -> None:
        if (key or text) not in self.warned:
            self.warned.add(key or text)
            logging.info(f"[comfy-modelopt] {text}")

    def compute_dtype(self):
        dtype = self.patcher.model.get_dtype_inference()
        return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else None

    def _weights_key(self):
        m = self.patcher.model
        return (getattr(m, "current_weight_patches_uuid", None),
                tuple(p.data_ptr() for p in getattr(m, "diffusion_model", m).parameters()))

    def _blocker(self, call: ModelCall) -> str | None:
        """Why no evaluation of this model can replay now (the device last: a CPU test then sees
        every other reason)."""
        model = self.patcher.model
        if getattr(model, "model_lowvram", False) or getattr(model, "lowvram_patch_counter", 0):
            self.release()  # captured over weights that have moved: give their memory back
            return "model partially loaded (offloading)"
        if call.args[0].device.type != "cuda":
            return "not on a CUDA device"
        return None

    def __call__(self, executor, *args, **kwargs):
        """The wrapper: the APPLY_MODEL wrappers after this one run around the evaluation (this
        one innermost, whatever the order they were added in)."""
        apply_model, inner = executor.original, executor.wrappers[executor.idx + 1:]
        if not inner:
            return self.evaluate(apply_model, ModelCall(args, kwargs))
        model = executor.class_obj
        evaluate = lambda *a, **k: self._uncompiled(model, apply_model, ModelCall(a, k))  # noqa: E731
        return WrapperExecutor.new_class_executor(evaluate, model, inner).execute(*args, **kwargs)

    def _beneath(self, executor, *args, **kwargs):
        """The innermost DIFFUSION_MODEL wrapper of a call whose other wrappers decide per call in
        Python (a first-block / TeaCache-style cache): the diffusion model's forward, captured."""
        call, forward = ModelCall.of_forward(executor.original, args, kwargs)
        return self.evaluate(forward, call, outer=False)
    _beneath.comfy_modelopt_own = True

    def _uncompiled(self, model, apply_model, call: ModelCall):
        """``evaluate``, with the diffusion model a wrapper swapped for a ``torch.compile`` of it
        (ComfyUI's TorchCompileModel node) put back for the call: this runtime compiles the model's
        blocks itself, and a whole-model compile inside a graph's warm-up would compile the
        quantized layers' kernel calls again."""
        dm = getattr(model, "diffusion_model", None)
        original = getattr(dm, "_orig_mod", None)
        if original is None:
            return self.evaluate(apply_model, call)
        reason = ("TorchCompileModel's compile is left out: this runtime compiles the model's blocks itself "
                  "(compiled blocks + CUDA graphs)")
        self._say_once(reason)
        model.diffusion_model = original
        try:
            return self.evaluate(apply_model, call)
        finally:
            model.diffusion_model = dm

    def evaluate(self, apply_model, call: ModelCall, outer: bool = True):
        reason = self._blocker(call)
        if reason:
            return self._eager(apply_model, call, reason)
        try:
            sig = call.signature()
        except TypeError as e:  # pragma: no cover - every value has a signature entry
            return self._eager(apply_model, call, f"unsupported argument type {e}")
        if sig in self.failed:  # a forward that cannot be captured: no retry per call
            if outer and (wrappers := call.model_wrappers()):  # other packs' model wrappers decide per call
                self._say_once(f"CUDA graphs: {named(wrappers)} decide per call ({self.failed[sig]}): "
                               "they run eagerly around the diffusion model's forward, which is captured")
                return call.with_innermost(self.beneath, "comfy_modelopt.cuda_graphs").run(apply_model)
            return self._eager(apply_model, call, self.failed[sig], compiled=True)
        key = step_key(sig, call) if sig in self.per_step else sig
        weights = self._weights_key()
        entry = self.graphs.pop(key, None)
        if entry is not None and entry["weights"] != weights:
            self.graphs.clear()
            entry = None
        elif entry is not None and entry.get("awaits_code") and entry["shapes"] in self.compiled.shapes \
                and not BACKGROUND.is_set():  # its blocks compiled since (in the background): captured again
            self.pool_needs.pop((key, True), None)
            entry = None
        if entry is None:
            if BACKGROUND.is_set():
                return self._eager(apply_model, call, "blocks compiling in the background: nothing is captured "
                                   "until they are in")
            self._evict(key is not sig)
            try:
                entry = self._capture(apply_model, call, weights, sig, key)
            except PerStep as e:  # this step's graph is the first one
                self.per_step[sig] = e.readers
                self._say_once(f"CUDA graphs: {e.readers} read the step's sigma on the host: one graph per step, "
                               "captured at the step's first evaluation, replayed from the next image on")
                return self.evaluate(apply_model, call, outer)
            except NotCapturable as e:
                self.failed[sig] = str(e)
                return self.evaluate(apply_model, call, outer)
            except Exception as e:  # capture can fail on host syncs or unsupported ops
                if self.malloc_async:
                    keep_forever(e)  # cudaMallocAsync: what the capture allocated is never freed
                self.failed[sig] = f"capture failed: {type(e).__name__}: {str(e)[:300]}"
                return self.evaluate(apply_model, call, outer)
            self.graphs[key] = entry
            return tree_map(entry["out"], torch.Tensor.clone)
        self.graphs[key] = entry  # most recently used
        check = entry.pop("check", None)
        rng = torch.cuda.get_rng_state(call.args[0].device) if check else None
        for dst, src in zip(entry["static"], call.tensors()):
            if dst.device.type != "cpu":  # not a step's sigmas, handed to the forward on the host
                dst.copy_(src, non_blocking=True)
        entry["graph"].replay()
        self.replays += 1
        out = tree_map(entry["out"], torch.Tensor.clone)
        if check:  # the first replay of a graph holding other packs' callables, against eager
            torch.cuda.set_rng_state(rng, call.args[0].device)  # the same random numbers as the replay drew
            ref = self._eager(apply_model, call, "checking a replay against eager", compiled=entry["compiled"])
            err = max(map(rel_l2, tensors_of(out), tensors_of(ref)))  # a ControlNet's: its residuals
            checks = self.compiled.checks if entry["compiled"] else []
            if not err <= max([_CHECK_TOL] + [3 * (c.get("eager_rounding_noise") or 0) for c in checks]):
                del self.graphs[key]
                self.failed[sig] = (f"its replay differs from eager by {err:.3g} (relative L2): {check} decide "
                                    "per call in Python")
                logging.info(f"[comfy-modelopt] CUDA graphs: running eagerly ({self.failed[sig]})")
                return ref
        return out

    def _evict(self, step: bool) -> None:
        """Room for one more graph: the least recently used one of its kind (per-step or not) goes."""
        same = [k for k in self.graphs if (k[0] is STEP) == step]
        if len(same) >= (self.max_step_graphs if step else self.max_graphs):
            del self.graphs[same[0]]
            self.evictions += 1

    def _capture(self, apply_model, call: ModelCall, weights, sig, key):
        """A graph of ``call``'s evaluation (``key``: its signature ``sig``, or a step of a per-step
        signature - warmed up, compiled and checked once per signature)."""
        t0 = time.perf_counter()
        # conditioning built on the CPU (SDXL's ADM vector, Flux's guidance) would be copied to the
        # GPU in every call, which a capture refuses: the static copies live on the input's device
        device = call.args[0].device
        static = call.static(device)
        shapes = latent_shapes((static.args[:4], static.kwargs))
        step = key is not sig
        if step:  # read on the host by the forward (no sync, nothing a capture refuses); fixed by the key
            sigmas = call.options["sigmas"]
            static.options["sigmas"] = torch.tensor(key[2], dtype=sigmas.dtype).reshape(sigmas.shape)
        others = foreign(static.objects())
        use_compiled = self.compiled is not None and self.compiled.enabled and sig in self.validated
        run = lambda: self._model_call(apply_model, static)  # noqa: E731
        first = lambda: self._model_call(apply_model, static, check=others, step=step)  # noqa: E731
        cache = dequant_cache_of(self.patcher.model)
        # a graph that will get a pool of its own, not sized yet: its warm-up is recorded and the
        # pool seeded from it (no second take into a fitted pool); the capture checks the seeding
        fresh = not self.graphs or self.pool is None
        warm = {}  # (key, compiled) -> the PoolNeed of that warm-up

        def sized_warm_up(fn, compiled: bool):
            if not fresh or (key, compiled) in self.pool_needs:
                return fn()
            out, warm[(key, compiled)] = recorded_need(fn, device, tensors_of)
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
                        lambda: static.replace_input(rounding_noise(static.args[0], dtype)).run(apply_model))
            use_compiled = on_side_stream(warm_up, device)
            self.warmed.add(sig)
            if use_compiled and not self.compiled.compile_new_shapes and not others and \
                    shapes not in self.compiled.shapes:
                self.uncompiled[sig] = key  # compiled after the run (``background_compile``)
            if self.compiled is not None:
                self.compile_seconds.append(round(time.perf_counter() - t_compile, 3))
            if use_compiled:
                self.validated.add(sig)
        elif use_compiled and not (step and not self.compiled.compile_new_shapes):
            # (a step of a per-step signature is captured without one where nothing compiles)
            # a new run's transformer_options may fail a compiled guard: any recompilation (and
            # Inductor's autotuning) must happen here, never inside the capture
            def warm_up_compiled():
                with self.compiled.installed():
                    sized_warm_up(run, True)
            on_side_stream(warm_up_compiled, device)
        elif cache is not None and cache.needs_fill():
            on_side_stream(run, device)  # refill the dequant cache (released on detach, or weights changed)
        self._quiet_for_capture()
        # captured on the warm-ups' stream (cuda_streams.work_stream): the allocator serves a request
        # only from its own stream's free blocks, and a sized pool's segments are made on it
        stream = work_stream(device)
        need_key = (key, use_compiled)
        need = self.pool_needs.get(need_key)
        warm_need = warm.get(need_key) if need is None else None
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
                self.pool_needs[need_key] = warm_need
                self.pool_sizing.append({"from_warm_up": True, "fitted": warm_need.fitted, "peak": warm_need.peak,
                                         "simulated_grown": warm_need.grown, "sized": grown})
            else:
                need = self.pool_needs[need_key] = pool_need(events)
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
        entry = {"graph": graph, "call": static, "static": static.tensors(), "out": out, "weights": weights,
                 "compiled": use_compiled, "apply": apply_model, "shapes": shapes,
                 "awaits_code": use_compiled and shapes not in self.compiled.shapes}  # replayed over uncompiled blocks
        if others and sig not in self.step_checked:  # checked against eager at its first replay (evaluate)
            entry["check"] = named(others)
            if step:  # once per signature, not per step
                self.step_checked.add(sig)
        return entry

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
            before = torch.cuda.current_stream(stream.device)
            # the pool's id, named here: a failed capture's own (graph.pool()) cannot be asked for
            handle = self.pool.handle if self.pool.handle is not None else torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.graph(graph, pool=handle, stream=stream, capture_error_mode="thread_local"):
                    out = run()
            except BaseException:
                if not end_failed_capture(handle, stream.device, before):
                    # the allocator may still route through this graph (its filter reads the
                    # graph object): it must outlive the process's allocations
                    keep_forever(graph)
                # the pool's id may still be marked as recording: the next capture takes a new
                # pool, and the graphs in this one go with it (captured again when needed)
                self.release()
                raise
            release_blas_workspaces()
        return graph, out

    def _quiet_for_capture(self) -> None:
        """Under cudaMallocAsync no garbage is freed during a capture: another thread's free would
        join its stream into the capture, and freeing a failed capture's memory aborts the process."""
        if self.malloc_async:
            gc.collect()
            torch.cuda.synchronize()

    def _model_call(self, apply_model, call: ModelCall, check: list | None = None, step: bool = False):
        """The evaluation a capture and its warm-ups run, CPU-built constants built on the GPU
        (``device_constants``).  ``check`` (a signature's first warm-up: the foreign callables
        held): what a graph cannot hold fails the signature here, before any capture - a copy
        from the CPU, a GPU value read on the host, random numbers drawn there, a callable keeping
        a tensor it made; where only the step's sigmas are read, one graph per step (``PerStep``;
        ``step``: a step's warm-up)."""
        mode = ConstantsOnDevice()
        state = kept_state(check) if check else []
        with HostCopies() if check is not None else contextlib.nullcontext() as host, mode:
            out = call.run(apply_model)
        self.constants_rebuilt = mode.rebuilt
        if host is not None:
            if host.ops:
                raise NotCapturable(f"the forward copies tensors from the CPU to the GPU ({listed(host.ops)}), "
                                     "which a CUDA graph cannot capture")
            kept = state_changes(state)
            if kept:
                raise NotCapturable(f"{', '.join(kept)} keeps tensors it made between calls, which a replay would "
                                     "not update")
            if check and (host.reads or host.random):  # the model's own code: a capture tells
                if not host.random and not step and call.only_sigmas(host.values):
                    raise PerStep(named(check))
                what = " and ".join(w for w, ops in (("reads GPU values on the host", host.reads),
                                                     ("draws random numbers on the host", host.random)) if ops)
                raise NotCapturable(f"the forward {what} ({listed(host.reads + host.random)}): "
                                     f"{named(check)} decide per call in Python")
        return out
