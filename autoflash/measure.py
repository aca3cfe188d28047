"""Correctness gate and timing of one variant, and the sandboxed worker process that runs them.

Correct first: every candidate's output is poisoned (NaN) before the run and compared with a
float64 reference on random, ragged inputs; it passes when its error is at most 2x torch SDPA's
own error in the same dtype (never NaN). Only then is it timed (triton.testing.do_bench: CUDA
events, L2 flush, median).

The sandbox: candidates run in a separate process (started with `spawn`; it owns the CUDA
context), so a compile error, an illegal address or a hang costs one recorded trial, not the run.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import queue
import time
import traceback

import torch

from autoflash.problem import Shape, interpreter_enabled
from autoflash.space import Variant

GATE_FACTOR = 2.0  # candidate error <= GATE_FACTOR * SDPA's error (DESIGN.md §4)
GATE_FLOOR = {"float32": 1e-5, "float16": 5e-4, "bfloat16": 4e-3}  # relative L2: binds only when SDPA is ~exact
LSE_TOL = 1e-3  # absolute, natural-log units: LSE is accumulated in fp32 from the same inputs


# --------------------------------------------------------------------------- reference
def make_inputs(shape: Shape, device, seed: int = 0, layout: str = "bhnd"):
    """Random normal q, k, v in (B, H, N, D) form. layout='bnhd' returns (B,N,H,D)-strided views."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def rand(b, n, h):
        t = torch.randn((b, n, h, shape.head_dim), generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        return t.transpose(1, 2) if layout == "bnhd" else t.transpose(1, 2).contiguous()

    q = rand(shape.batch, shape.seqlen_q, shape.heads_q)
    k = rand(shape.batch, shape.seqlen_k, shape.heads_kv)
    v = rand(shape.batch, shape.seqlen_k, shape.heads_kv)
    return q, k, v


def causal_offset_for(shape: Shape, align: str) -> int:
    return shape.seqlen_k - shape.seqlen_q if align == "bottom_right" else 0


def reference(q, k, v, causal: bool, causal_offset: int, scale: float, dtype=torch.float64):
    """(out, lse) in `dtype` from the math definition. Rows with no visible key: out 0, lse +inf."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + causal_offset, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return p @ v, lse


def rel_error(x, ref) -> float:
    x = x.to(ref.dtype)
    if torch.isnan(x).any():
        return float("nan")
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)


def lse_error(lse, ref_lse) -> float:
    if torch.isnan(lse).any():
        return float("nan")
    ref_lse = ref_lse.to(lse.device)
    finite = torch.isfinite(ref_lse)
    if not bool((lse[~finite] == float("inf")).all()):
        return float("inf")
    if not finite.any():
        return 0.0
    return (lse.double()[finite] - ref_lse.double()[finite]).abs().max().item()


def sdpa_error(q, k, v, causal: bool, causal_offset: int, scale: float, ref_out) -> float:
    """torch SDPA's own error in the input dtype (the yardstick for the gate)."""
    from autoflash.api import _sdpa_fallback

    out = _sdpa_fallback(q, k, v, None, 0.0, causal, causal_offset, scale)
    return rel_error(out, ref_out)


@dataclasses.dataclass
class GateResult:
    passed: bool
    err: float  # worst relative L2 error of O over the gate's shapes
    sdpa_err: float  # SDPA's error on the same shapes
    lse_err: float
    detail: str = ""


def gate_shapes(shape: Shape) -> list[Shape]:
    """Ragged shapes for the correctness gate of a problem (small; the kernel is length-agnostic)."""
    hk = 2 if shape.heads_q >= 2 * (shape.heads_q // shape.heads_kv) else 1
    hq = hk * (shape.heads_q // shape.heads_kv)
    base = dict(heads_q=hq, heads_kv=hk, head_dim=shape.head_dim, causal=shape.causal, dtype=shape.dtype,
                op=shape.op)
    # (batch, seqlen_q, seqlen_k): the short ragged shapes use 2 sequences to cover batch strides.
    if torch.cuda.is_available() and not interpreter_enabled():
        sizes = [(1, 1023, 1023), (2, 113, 203), (2, 203, 113), (1, 1, 37)]
    else:
        sizes = [(1, 37, 37), (2, 17, 64), (2, 64, 17)]
    return [Shape(batch=b, seqlen_q=nq, seqlen_k=nk, **base) for b, nq, nk in sizes]


def prepare_tma(module, *tensors) -> None:
    """A TMA variant needs TMA-compatible tensors and Triton's descriptor scratch allocator."""
    from autoflash.dispatch import prepare_launch, tma_compatible

    if module.LOADS == "tma" and not tma_compatible(*tensors):
        raise ValueError("inputs are not TMA-compatible for a TMA variant")
    prepare_launch(module)


def run_variant(module, q, k, v, causal: bool, causal_offset: int, scale: float):
    """Launch one compiled variant on (B,H,N,D) inputs; returns (out, lse) (poisoned first)."""
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
    prepare_tma(module, q, k, v, out)
    module.launch(q, k, v, out, lse, scale, causal, causal_offset)
    return out, lse


def check(module, shape: Shape, device, seed: int = 0) -> GateResult:
    """The correctness gate of a forward or backward variant (by `module.OP`)."""
    return (check_backward if module.OP == "bwd" else check_forward)(module, shape, device, seed)


def check_forward(module, shape: Shape, device, seed: int = 0) -> GateResult:
    """The correctness gate over the ragged gate shapes of `shape`'s problem.

    Alternate shapes use (B,N,H,D)-strided inputs and bottom-right causal alignment, so one
    gate covers both layouts and both alignments the public API produces.
    """
    worst = GateResult(True, 0.0, 0.0, 0.0)
    for i, gs in enumerate(gate_shapes(shape)):
        q, k, v = make_inputs(gs, device, seed=seed + i, layout="bnhd" if i % 2 else "bhnd")
        off = causal_offset_for(gs, "bottom_right" if i % 2 else "top_left")
        scale = 1.0 / math.sqrt(gs.head_dim)
        out, lse = run_variant(module, q, k, v, gs.causal, off, scale)
        ref_out, ref_lse = reference(q, k, v, gs.causal, off, scale)
        err = rel_error(out, ref_out)
        s_err = sdpa_error(q, k, v, gs.causal, off, scale, ref_out)
        l_err = lse_error(lse, ref_lse)
        bound = max(GATE_FACTOR * s_err, GATE_FLOOR[gs.dtype])
        ok = math.isfinite(err) and err <= bound and l_err <= LSE_TOL
        worst = GateResult(worst.passed and ok, max(worst.err, err if math.isfinite(err) else math.inf),
                           max(worst.sdpa_err, s_err), max(worst.lse_err, l_err), worst.detail)
        if not ok:
            worst.detail = (f"wrong result on {gs.label()}: rel err {err:.3g} (bound {bound:.3g}, "
                            f"SDPA {s_err:.3g}), lse err {l_err:.3g}")
            return worst
    return worst


GRAD_GATE_FACTOR = 3.0  # gradients: error <= 3x SDPA's own gradient error (DESIGN.md §4)


def _forward_for_backward(q, k, v, causal, offset, scale):
    """out and lse from the dispatcher's forward kernel: what a backward variant consumes."""
    from autoflash.api import forward_with_lse

    return forward_with_lse(q, k, v, causal=causal, causal_offset=offset, scale=scale)


def _sdpa_grads(q, k, v, grad, causal, offset, scale):
    from autoflash.api import _sdpa_fallback

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _sdpa_fallback(*leaves, None, 0.0, causal, offset, scale).backward(grad)
    return [t.grad for t in leaves]


def reference_grads(q, k, v, grad, causal, offset, scale, dtype=torch.float64):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = reference(*leaves, causal, offset, scale, dtype=dtype)
    out.backward(grad.to(dtype))
    return [t.grad for t in leaves]


def check_backward(module, shape: Shape, device, seed: int = 0) -> GateResult:
    """Gradient gate: dQ, dK, dV (poisoned first) vs float64 autograd, each within 3x SDPA's error."""
    worst = GateResult(True, 0.0, 0.0, 0.0)
    for i, gs in enumerate(gate_shapes(shape)):
        q, k, v = make_inputs(gs, device, seed=seed + i, layout="bnhd" if i % 2 else "bhnd")
        grad = make_inputs(gs, device, seed=seed + 100 + i)[0]
        off = causal_offset_for(gs, "bottom_right" if i % 2 else "top_left")
        scale = 1.0 / math.sqrt(gs.head_dim)
        out, lse = _forward_for_backward(q, k, v, gs.causal, off, scale)
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        prepare_tma(module, q, k, v, grad)
        module.launch(q, k, v, out, lse, grad, *grads, scale, gs.causal, off)
        refs = reference_grads(q, k, v, grad, gs.causal, off, scale)
        theirs = _sdpa_grads(q, k, v, grad, gs.causal, off, scale)
        for name, mine, ref, sd in zip(("dq", "dk", "dv"), grads, refs, theirs):
            err, s_err = rel_error(mine, ref), rel_error(sd, ref)
            bound = max(GRAD_GATE_FACTOR * s_err, GATE_FLOOR[gs.dtype])
            ok = math.isfinite(err) and err <= bound
            worst = GateResult(worst.passed and ok, max(worst.err, err if math.isfinite(err) else math.inf),
                               max(worst.sdpa_err, s_err), 0.0, worst.detail)
            if not ok:
                worst.detail = (f"wrong {name} on {gs.label()}: rel err {err:.3g} (bound {bound:.3g}, "
                                f"SDPA {s_err:.3g})")
                return worst
    return worst


# --------------------------------------------------------------------------- timing
def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of fn() with CUDA events and an L2 flush between runs."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_variant(module, shape: Shape, device, rep_ms: float = 100, align: str = "top_left") -> float:
    q, k, v = make_inputs(shape, device, seed=1234)
    off = causal_offset_for(shape, align)
    return _time_callable(launch_callable(module, shape, q, k, v, off), device, rep_ms)


def launch_callable(module, shape: Shape, q, k, v, off: int):
    """A no-argument launch of a forward or backward variant on fixed inputs (outputs allocated
    once; a backward variant gets out/lse from the forward and a random dO)."""
    scale = 1.0 / math.sqrt(shape.head_dim)
    if module.OP == "bwd":
        grad = make_inputs(shape, q.device, seed=4321)[0]
        out, lse = _forward_for_backward(q, k, v, shape.causal, off, scale)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        prepare_tma(module, q, k, v, grad)
        return lambda: module.launch(q, k, v, out, lse, grad, *grads, scale, shape.causal, off)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    prepare_tma(module, q, k, v, out)
    return lambda: module.launch(q, k, v, out, lse, scale, shape.causal, off)


SDPA_BACKENDS = ("cudnn", "flash")


def tflops(shape: Shape, ms: float) -> float:
    return shape.flops() / (ms * 1e-3) / 1e12 if ms and math.isfinite(ms) and ms > 0 else float("nan")


# --------------------------------------------------------------------------- the sandbox
@dataclasses.dataclass
class Outcome:
    """What one candidate did. status: ok | wrong | compile_error | runtime_error | timeout | crashed | invalid."""

    status: str
    ms: float = float("nan")
    err: float = float("nan")
    sdpa_err: float = float("nan")
    message: str = ""
    seconds: float = 0.0


_gate_cache: dict = {}


def _declared_variant(op: str, variant_json: str) -> Variant:
    """A variant sent to a worker as JSON, checked against the declared space before rendering."""
    from autoflash.space import load_space, parse_variant_json

    return load_space(op).check_declared(parse_variant_json(op, variant_json))


def ping() -> dict:
    """A no-op task that makes a fresh worker import torch and create its CUDA context."""
    if torch.cuda.is_available() and not interpreter_enabled():
        torch.zeros(1, device="cuda")
    return {"status": "ok", "samples": {}}


def evaluate_variant(variant_json: str, op: str, shape: Shape, rep_ms: float, device_str: str) -> Outcome:
    """Compile, gate and time one variant in this process (the worker's body)."""
    from autoflash import codegen
    t0 = time.perf_counter()
    variant = _declared_variant(op, variant_json)
    device = torch.device(device_str)
    # The gate's inputs depend only on these, not on the timing shape's lengths: problems that
    # differ only in seqlen bucket share one gate result per variant within a worker.
    gate_key = (variant.json(), shape.dtype, shape.head_dim, shape.causal, shape.heads_q // shape.heads_kv)
    try:
        module = codegen.load(variant)
        gate = _gate_cache.get(gate_key)
        if gate is None:
            gate = _gate_cache[gate_key] = check(module, shape, device)
    except Exception as e:  # noqa: BLE001 - classify and record, never propagate
        text = f"{type(e).__name__}: {e}"
        status = "compile_error" if _is_compile_error(e, text) else "runtime_error"
        return Outcome(status, message=_short(text), seconds=time.perf_counter() - t0)
    if not gate.passed:
        return Outcome("wrong", err=gate.err, sdpa_err=gate.sdpa_err, message=gate.detail,
                       seconds=time.perf_counter() - t0)
    ms = time_variant(module, shape, device, rep_ms=rep_ms)
    return Outcome("ok", ms=ms, err=gate.err, sdpa_err=gate.sdpa_err, seconds=time.perf_counter() - t0)


def _gate_and_timing_inputs(shape: Shape, device):
    """(q, k, v, causal_offset) for every argument configuration the gate and timing launch."""
    configs = []
    for i, gs in enumerate(gate_shapes(shape)):
        q, k, v = make_inputs(gs, device, seed=i, layout="bnhd" if i % 2 else "bhnd")
        configs.append((q, k, v, causal_offset_for(gs, "bottom_right" if i % 2 else "top_left")))
    q, k, v = make_inputs(shape, device, seed=1234)
    configs.append((q, k, v, 0))
    return configs


def compile_variant(variant_json: str, op: str, shape: Shape, rep_ms: float, device_str: str) -> Outcome:
    """Build a variant's binaries for the gate's and the timing's argument types, without launching
    (run in parallel on the CPU cores while another process measures on the GPU)."""
    from autoflash import codegen
    t0 = time.perf_counter()
    variant = _declared_variant(op, variant_json)
    try:
        module = codegen.load(variant)
        if device_str != "cpu":  # the interpreter has nothing to compile
            from autoflash.dispatch import ensure_allocator

            ensure_allocator()
            for q, k, v, off in _gate_and_timing_inputs(shape, torch.device(device_str)):
                out = torch.empty_like(q) if module.OP == "bwd" else torch.empty_like(q, memory_format=torch.contiguous_format)
                lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
                if module.OP == "bwd":
                    grads = [torch.empty_like(t) for t in (q, k, v)]
                    module.launch(q, k, v, out, lse, torch.empty_like(q, memory_format=torch.contiguous_format),
                                  *grads, 1.0, shape.causal, off, compile_only=True)
                else:
                    module.launch(q, k, v, out, lse, 1.0, shape.causal, off, compile_only=True)
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
        return Outcome("compile_error" if _is_compile_error(e, text) else "runtime_error",
                       message=_short(text), seconds=time.perf_counter() - t0)
    return Outcome("ok", seconds=time.perf_counter() - t0)


def remeasure(methods: list[str], op: str, shape: Shape, rounds: int, rep_ms: float, device_str: str) -> dict:
    """Interleaved re-measurement: each round times every method once. A method is a variant JSON
    or 'sdpa_cudnn' / 'sdpa_flash'. Returns {method: [ms per round]} (NaN where a method refused)."""
    from autoflash import codegen
    device = torch.device(device_str)
    q, k, v = make_inputs(shape, device, seed=99)
    fns = {}
    for m in methods:
        if m.startswith("sdpa_"):
            if device.type == "cuda":
                fns[m] = sdpa_callable(m[5:], shape, q, k, v, backward=(op == "bwd"))
            continue
        fns[m] = launch_callable(codegen.load(_declared_variant(op, m)), shape, q, k, v, 0)
    samples = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            fn = fns.get(m)
            samples[m].append(_time_callable(fn, device, rep_ms) if fn else float("nan"))
    return {"status": "ok", "samples": samples}


def _time_callable(fn, device, rep_ms: float) -> float:
    """Median ms by do_bench on a GPU; in the interpreter, the wall clock of one call."""
    if torch.device(device).type == "cuda":
        return bench_ms(fn, warmup_ms=10, rep_ms=rep_ms)
    t0 = time.perf_counter()  # the interpreter: wall clock of one call, not GPU performance
    fn()
    return (time.perf_counter() - t0) * 1e3


def sdpa_callable(backend: str, shape: Shape, q, k, v, backward: bool = False):
    """A no-argument call of torch SDPA with one backend forced (its backward only, when asked),
    or None when that backend refuses the shape."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    which = sdpa_backend(backend)
    gqa = shape.heads_q != shape.heads_kv
    if backward:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        try:
            with sdpa_kernel([which]):
                out = F.scaled_dot_product_attention(*leaves, is_causal=shape.causal, enable_gqa=gqa)
        except RuntimeError:
            return None
        grad = torch.randn_like(out)

        def fn():
            torch.autograd.grad(out, leaves, grad, retain_graph=True)
    else:
        def fn():
            with sdpa_kernel([which]):
                F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)
    return if_it_runs(fn)


def sdpa_backend(name: str):
    """'cudnn' / 'flash' (optionally 'sdpa_'-prefixed) -> torch's SDPBackend member."""
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name.removeprefix("sdpa_")]


def if_it_runs(fn):
    """fn if one call succeeds on the GPU, else None (a backend that refuses a shape raises)."""
    try:
        fn()
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return fn


def _is_compile_error(exc: BaseException, text: str) -> bool:
    names = {type(exc).__name__, *(c.__name__ for c in type(exc).__mro__)}
    return bool(names & {"CompilationError", "CompileTimeAssertionFailure", "OutOfResources", "PTXASError"}) \
        or "out of resource" in text.lower()


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


def _worker_main(tasks, results, env: dict) -> None:
    os.environ.update(env)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the tuner died (e.g. kill -9): do not linger
                return
            continue
        if task is None:
            return
        fn, args = task
        try:
            outcome = fn(*args)
        except BaseException as e:  # noqa: BLE001
            outcome = Outcome("runtime_error", message=_short(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
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

    def _start(self):
        self._tasks = self._ctx.Queue()
        self._results = self._ctx.Queue()
        self._proc = self._ctx.Process(target=_worker_main, args=(self._tasks, self._results, self.env), daemon=True)
        self._proc.start()

    def close(self):
        if self._proc is not None and self._proc.is_alive():
            self._tasks.put(None)
            self._proc.join(timeout=5)
        self._kill()

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
        return self.call(fn or evaluate_variant, (variant.json(), variant.op, shape, rep_ms, self.device), timeout_s)

    def call(self, fn, args: tuple, timeout_s: float) -> Outcome:
        if self._proc is None or not self._proc.is_alive():
            self._kill()  # reap a worker that exited after its last answer
            self._start()
        t0 = time.perf_counter()
        self._tasks.put((fn, args))
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
