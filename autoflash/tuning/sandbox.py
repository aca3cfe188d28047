"""The sandbox: candidates run in a separate process (started with `spawn`; it owns the CUDA
context), so a compile error, an illegal address or a hang costs one recorded trial, not the run.
The worker tasks (`evaluate_variant`, `compile_variant`, `remeasure`, `ping`, and
`vendor_warm.warm`) are top-level functions, so they pickle by name.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import queue
import time
import traceback

import torch

from autoflash.device import interpreter_enabled
from autoflash.problem import Shape
from autoflash.reference import causal_offset_for, make_inputs
from autoflash.space import Variant
from autoflash.tuning.gate import check, gate_score_args, gate_shapes
from autoflash.tuning.timing import (MIN_REPS, SDPA_BACKENDS, launch_callable, sdpa_callable, time_callable,
                                     time_variant, timing_inputs)
from autoflash.vendor import quiet_refusals


@dataclasses.dataclass
class Outcome:
    """What one candidate did. status: ok | slower | wrong | unsupported | compile_error | runtime_error |
    timeout | crashed. `unsupported`: a vendor backend that has no kernel for any of the problem's gate
    shapes (torch's memory-efficient backend and GQA): not offered here, which is not a failure.
    `slower`: one of torch's whole SDPA backends that a short timing showed clearly slower than the
    problem's best, stopped before its gate (`_quick_before_gate`): never a candidate for the pick."""

    status: str
    ms: float = float("nan")
    err: float = float("nan")
    sdpa_err: float = float("nan")
    message: str = ""
    seconds: float = 0.0


# The statuses of a candidate that was tried and failed (counted and reported as failures).
FAILED_STATUSES = ("wrong", "compile_error", "runtime_error", "timeout", "crashed")

_gate_cache: dict = {}
# The best median of the candidate's problem so far (the tuner's `bar_ms`, sent with each task):
# a candidate a short timing shows clearly slower is stopped there (successive halving's first rung;
# Optuna's pruners would need the intermediate value in the tuner's process, and this is the one).
_bar_ms: float | None = None
QUICK_TIMING = 0.25  # of rep_ms: the short timing every candidate gets first
CLEARLY_SLOWER = 1.3  # x the best: stopped there (short timings spread by ~10% on an H200)


def _declared_variant(family: str, variant_json: str) -> Variant:
    """A variant sent to a worker as JSON, checked against its family's declared space before rendering."""
    from autoflash.space import load_space, parse_variant_json

    return load_space(family).check_declared(parse_variant_json(family, variant_json))


def ping() -> dict:
    """A no-op task that makes a fresh worker import torch and create its CUDA context."""
    if torch.cuda.is_available() and not interpreter_enabled():
        torch.zeros(1, device="cuda")
    return {"status": "ok", "samples": {}}


def _own_halves(variant: Variant) -> tuple:
    """What else a vendor pair's gate result depends on: the own kernels it is paired with."""
    from autoflash.tuning import gate

    if variant.as_dict().get("FORWARD", "sdpa") == variant.as_dict().get("BACKWARD", "sdpa"):
        return ()  # an own kernel, or SDPA's whole pair
    return tuple(v and v.json() for v in (gate.training_forward, gate.training_backward))


def evaluate_variant(variant_json: str, family: str, shape: Shape, rep_ms: float, device_str: str) -> Outcome:
    """Compile, gate and time one variant in this process (the worker's body)."""
    from autoflash import codegen
    t0 = time.perf_counter()
    variant = _declared_variant(family, variant_json)
    device = torch.device(device_str)
    # The gate's inputs depend only on these, not on the timing shape's lengths: problems that
    # differ only in seqlen bucket share one gate result per variant within a worker.
    gate_key = (variant.family, variant.json(), shape.dtype, shape.head_dim, shape.head_dim_v, shape.causal,
                shape.heads_q // shape.heads_kv, shape.score, *_own_halves(variant))
    try:
        kernel = codegen.load_for(variant, shape.head_dim_v, shape.score_variant)
        quick = _quick_before_gate(kernel, shape, device, rep_ms)
        if quick is not None and quick > _bar_ms * CLEARLY_SLOWER:
            return Outcome("slower", ms=quick, seconds=time.perf_counter() - t0, message=(
                f"stopped before its gate: {quick / _bar_ms:.2f}x the best so far after a short timing"))
        gate = _gate_cache.get(gate_key)
        if gate is None:
            gate = _gate_cache[gate_key] = check(kernel, shape, device)
    except Exception as e:  # noqa: BLE001 - classify and record, never propagate
        text = f"{type(e).__name__}: {e}"
        status = "compile_error" if _is_compile_error(e, text) else "runtime_error"
        return Outcome(status, message=_short(text), seconds=time.perf_counter() - t0)
    if gate.refused:
        return Outcome("unsupported", message=gate.detail, seconds=time.perf_counter() - t0)
    if not gate.passed:
        return Outcome("wrong", err=gate.err, sdpa_err=gate.sdpa_err, message=gate.detail,
                       seconds=time.perf_counter() - t0)
    if _bar_ms:
        if quick is None:  # (a whole SDPA backend had it before its gate)
            quick = time_variant(kernel, shape, device, rep_ms=rep_ms * QUICK_TIMING)
        if quick > _bar_ms * CLEARLY_SLOWER:
            return Outcome("ok", ms=quick, err=gate.err, sdpa_err=gate.sdpa_err, seconds=time.perf_counter() - t0,
                           message=f"stopped early: {quick / _bar_ms:.2f}x the best so far after a short timing")
        if quick * MIN_REPS >= rep_ms:  # a call this long gets MIN_REPS repetitions in either timing: the
            return Outcome("ok", ms=quick, err=gate.err, sdpa_err=gate.sdpa_err,  # full one would repeat it
                           seconds=time.perf_counter() - t0)
    ms = time_variant(kernel, shape, device, rep_ms=rep_ms)
    return Outcome("ok", ms=ms, err=gate.err, sdpa_err=gate.sdpa_err, seconds=time.perf_counter() - t0)


def _quick_before_gate(kernel, shape: Shape, device, rep_ms: float) -> float | None:
    """The short timing of one of torch's whole SDPA backends (no half of autoflash's), taken before
    its gate where there is a best so far to stop it at; None for every other candidate (gated first).

    Such a backend is the vendor's own code, and what its gate is for is to let it be served: one
    clearly slower than the best never is (`Outcome` 'slower': no candidate for the pick), so it is
    stopped without its gate (22 problems on an H100: the flash and efficient backends, every one
    stopped early, took ~17 s of a 105-s vendor pass; their gates ~4 s of it, the rest drawing
    inputs, `timing.timing_inputs`, and the short timing). One that refuses the timing shape is gated
    as before (the gate says what it takes)."""
    if not (_bar_ms and getattr(kernel, "vendor", False) and getattr(kernel, "whole_pair", False)):
        return None
    try:
        with quiet_refusals():
            return time_variant(kernel, shape, device, rep_ms=rep_ms * QUICK_TIMING)
    except (RuntimeError, ValueError):  # (refused: "No available kernel", or inputs it cannot take)
        return None


def _gate_and_timing_inputs(shape: Shape, device):
    """(q, k, v, causal_offset, score_args) for every argument configuration the gate and timing launch."""
    configs = []
    for i, gs in enumerate(gate_shapes(shape)):
        q, k, v = make_inputs(gs, device, seed=i, layout="bnhd" if i % 2 else "bhnd")
        configs.append((q, k, v, causal_offset_for(gs, "bottom_right" if i % 2 else "top_left"),
                        gate_score_args(shape, gs, device)))
    # The timing shape's: only their types, layout and sizes make the binaries (drawn at full size, as
    # `timing.timing_inputs` draws them, they cost each compile up to a second of the pool's CPU time).
    q, k, v = (torch.empty((shape.batch, heads, n, d), device=device, dtype=getattr(torch, shape.dtype))
               for heads, n, d in ((shape.heads_q, shape.seqlen_q, shape.head_dim),
                                   (shape.heads_kv, shape.seqlen_k, shape.head_dim),
                                   (shape.heads_kv, shape.seqlen_k, shape.value_dim)))
    configs.append((q, k, v, 0, None if shape.score is None else shape.score.args(q.shape[1], device)))
    return configs


def compile_variant(variant_json: str, family: str, shape: Shape, rep_ms: float, device_str: str) -> Outcome:
    """Build a variant's binaries for the gate's and the timing's argument types, without launching
    (run in parallel on the CPU cores while another process measures on the GPU)."""
    from autoflash import codegen
    t0 = time.perf_counter()
    variant = _declared_variant(family, variant_json)
    try:
        kernel = codegen.load_for(variant, shape.head_dim_v, shape.score_variant)
        if device_str != "cpu":  # the interpreter has nothing to compile
            for q, k, v, off, score in _gate_and_timing_inputs(shape, torch.device(device_str)):
                kernel.compile_for(q, k, v, shape.causal, off, page=shape.page, score_args=score)
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
        return Outcome("compile_error" if _is_compile_error(e, text) else "runtime_error",
                       message=_short(text), seconds=time.perf_counter() - t0)
    return Outcome("ok", seconds=time.perf_counter() - t0)


SDPA_COLUMNS = tuple(f"sdpa_{b}" for b in SDPA_BACKENDS)  # torch SDPA, one backend forced: the yardstick


def remeasure(methods: list[str], op: str, shape: Shape, rounds: int, rep_ms: float, device_str: str) -> dict:
    """Interleaved re-measurement: each round times every method once. A method is
    'family:variant JSON' (or a bare variant JSON of the op's default family) or 'sdpa_cudnn' /
    'sdpa_flash'. Returns {method: [ms per round]} (NaN where a method refused)."""
    from autoflash import codegen
    device = torch.device(device_str)
    q, k, v = timing_inputs(shape, device)  # (the trials' own, where this worker still holds them)
    fns = {}
    for m in methods:
        if m in SDPA_COLUMNS:  # the yardstick columns ("sdpa_fwd:{...}" is a vendor family's candidate)
            if device.type == "cuda" and shape.score is None:  # (SDPA computes no variants: no column)
                fns[m] = sdpa_callable(m[5:], shape, q, k, v, backward=(op == "bwd"))
            continue
        family, _, variant_json = m.partition(":") if not m.startswith("{") else ("", "", m)
        kernel = codegen.load_for(_declared_variant(family or op, variant_json), shape.head_dim_v, shape.score_variant)
        fns[m] = launch_callable(kernel, shape, q, k, v, 0)
    samples = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            fn = fns.get(m)
            samples[m].append(time_callable(fn, device, rep_ms) if fn else float("nan"))
    return {"status": "ok", "samples": samples}


def _is_compile_error(exc: BaseException, text: str) -> bool:
    names = {type(exc).__name__, *(c.__name__ for c in type(exc).__mro__)}
    return bool(names & {"CompilationError", "CompileTimeAssertionFailure", "OutOfResources", "PTXASError"}) \
        or "out of resource" in text.lower()


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


def _apply_context(context: dict) -> None:
    """The tuner's per-problem settings, in this worker (see `Sandbox.context`)."""
    from autoflash.tuning import gate

    global _bar_ms
    _bar_ms = context.get("bar_ms")
    forward, backward = context.get("training_forward"), context.get("training_backward")
    gate.training_forward = _declared_variant(*forward) if forward else None
    gate.training_backward = _declared_variant(*backward) if backward else None


# Where a worker writes its profile (`cProfile`, every task it ran, rewritten after each task as
# PROFILE_DIR/worker-PID.prof): set to find what a tuning run's GPU worker spends its time on
# (`python -m pstats`). Unset: no profiling.
PROFILE_ENV = "AUTOFLASH_PROFILE_WORKERS"


def _worker_main(tasks, results, env: dict) -> None:
    os.environ.update(env)
    parent = os.getppid()
    profile_dir = os.environ.get(PROFILE_ENV)
    profiler = None
    if profile_dir:
        import cProfile

        os.makedirs(profile_dir, exist_ok=True)
        profiler = cProfile.Profile()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the tuner died (e.g. kill -9): do not linger
                return
            continue
        if task is None:
            return
        fn, args, context = task
        _apply_context(context)
        try:
            outcome = profiler.runcall(fn, *args) if profiler else fn(*args)
        except BaseException as e:  # noqa: BLE001
            outcome = Outcome("runtime_error", message=_short(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        if profiler:
            profiler.dump_stats(os.path.join(profile_dir, f"worker-{os.getpid()}.prof"))
        results.put(outcome if isinstance(outcome, dict) else dataclasses.asdict(outcome))
        if isinstance(outcome, Outcome) and outcome.status == "runtime_error" and "illegal" in outcome.message.lower():
            return  # a CUDA context after an illegal access is unusable: let the parent restart us


class Sandbox:
    """One worker process that owns the device; restarted after a crash, a hang or a fatal error."""

    def __init__(self, device: str = "cuda", env: dict | None = None):
        self.device = device
        self.env = dict(env or {})
        self._ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        self._proc = None
        # Sent with every task (so a restarted worker has it too): "training_forward" and
        # "training_backward", the own forward and backward (family, variant JSON) that backward
        # candidates are paired with (`gate.candidate_pair`).
        self.context: dict = {}
        self._stopped = False  # `stop_now` was called: no call starts a worker again

    def start(self) -> None:
        """Spawn the worker, not waiting for it (the first call does): a no-op while one runs."""
        if self._stopped or (self._proc is not None and self._proc.is_alive()):
            return
        self._kill()  # (reap one that exited after its last answer)
        self._tasks, self._results = self._ctx.Queue(), self._ctx.Queue()
        self._proc = self._ctx.Process(target=_worker_main, args=(self._tasks, self._results, self.env), daemon=True)
        self._proc.start()

    def close(self, now: bool = False):
        """Stop the worker: asked to finish its task and exit (up to 5 s), or (now) killed at once."""
        if now:
            self.stop_now()
        elif self._proc is not None and self._proc.is_alive():
            self._tasks.put(None)
            self._proc.join(timeout=5)
        self._kill()

    def stop_now(self):
        """Kill the worker process at once and refuse further calls; safe while another thread is in
        `call` (it then returns a 'crashed' outcome, which nobody records: the run is stopping)."""
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()

    def _kill(self):
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
            for q in (self._tasks, self._results):  # release their pipes and semaphores now
                q.close()
                q.cancel_join_thread()
        self._proc = None

    def evaluate(self, variant: Variant, shape: Shape, rep_ms: float = 100, timeout_s: float = 120,
                 fn=None) -> Outcome:
        """Run fn (default `evaluate_variant`, any picklable top-level function with its signature)
        in the worker; a hang past timeout_s or a dead worker becomes an Outcome too."""
        return self.call(fn or evaluate_variant, (variant.json(), variant.family, shape, rep_ms, self.device), timeout_s)

    def call(self, fn, args: tuple, timeout_s: float) -> Outcome:
        if self._stopped:
            return Outcome("crashed", message="the sandbox was stopped")
        self.start()
        t0 = time.perf_counter()
        self._tasks.put((fn, args, dict(self.context)))
        deadline = t0 + timeout_s
        while True:
            try:
                result = self._results.get(timeout=0.2)
                return result if "samples" in result else Outcome(**result)
            except queue.Empty:
                pass
            if not self._proc.is_alive():
                try:  # it may have answered just before exiting
                    return Outcome(**self._results.get(timeout=0.5))
                except queue.Empty:
                    pass
                code = self._proc.exitcode
                self._kill()
                return Outcome("crashed", message=f"worker process died (exit code {code})",
                               seconds=time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                self._kill()
                return Outcome("timeout", message=f"no result within {timeout_s:.0f} s (hang?)",
                               seconds=time.perf_counter() - t0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WorkerPool:
    """N sandboxes used from threads: each thread takes a free sandbox, uses it, gives it back."""

    def __init__(self, n: int, device: str, env: dict):
        self._free: queue.Queue = queue.Queue()
        self._all = [Sandbox(device, env) for _ in range(n)]
        for sb in self._all:
            self._free.put(sb)
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=n)
        # Batches run side by side: their compiles queue in the order asked (the batch being measured
        # before one compiled ahead for later), and none waits for an earlier batch's slowest compile.
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def start(self, timeout_s: float, wait: bool = True) -> list:
        """Start every worker (torch import, CUDA context); wait=False: in the background, tasks
        submitted after it queue behind the start (a run's measuring worker starts meanwhile)."""
        futures = self.submit_each(ping, [()] * len(self._all), timeout_s)
        if wait:
            concurrent.futures.wait(futures)
        return futures

    def map_async(self, fn, args_list: list[tuple], timeout_s: float) -> concurrent.futures.Future:
        return self._background.submit(self.map, fn, args_list, timeout_s)

    def submit_each(self, fn, args_list: list[tuple], timeout_s: float) -> list[concurrent.futures.Future]:
        """One future per task, taken in the order submitted (behind those submitted before): a
        caller waits for the task it needs, not for a whole batch."""
        return [self._threads.submit(self._one, fn, args, timeout_s) for args in args_list]

    def map(self, fn, args_list: list[tuple], timeout_s: float) -> list:
        return list(self._threads.map(lambda args: self._one(fn, args, timeout_s), args_list))

    def _one(self, fn, args: tuple, timeout_s: float):
        sb = self._free.get()
        try:
            return sb.call(fn, args, timeout_s)
        finally:
            self._free.put(sb)

    def close(self, now: bool = False):
        """Stop every worker; now (a stopped run): kill them first, so that a compile batch in flight
        is abandoned rather than waited for (it can take minutes; a scheduler's SIGKILL comes sooner)."""
        if now:
            for sb in self._all:
                sb.stop_now()
        self._background.shutdown(wait=True, cancel_futures=True)
        self._threads.shutdown(wait=True, cancel_futures=True)
        for sb in self._all:
            sb.close(now=now)
