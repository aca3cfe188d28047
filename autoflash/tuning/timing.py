"""Timing: device-time medians (CUDA events, L2 flush, the host kept ahead of the GPU: `device_ms`),
SDPA backends in the same process, TFLOP/s. In the interpreter, the wall clock of one call (not GPU
performance)."""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time

import torch

from autoflash.codegen import Kernel
from autoflash.device import launch_sm_count
from autoflash.problem import Shape
from autoflash.reference import causal_offset_for, make_inputs, output_grad, paged_cache, sdpa_backend
from autoflash.training import EagerAttention
from autoflash.tuning.gate import candidate_pair, require_supported


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of fn() by triton's do_bench (CUDA events, an L2 flush between runs): a
    call's time including any host time the GPU waits for (a whole model step, as its user sees it)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


# Repetitions a timing takes at least: a call of rep_ms / MIN_REPS or longer gets this many at any
# rep_ms up to its own, so a short timing of it is as precise as a full one (`sandbox.evaluate_variant`).
MIN_REPS = 10
FLUSH_BYTES = 256 << 20  # as do_bench: larger than any GPU's L2, so every timed call starts cold
SPIN_CYCLES_PER_US = 4000  # torch.cuda._sleep counts cycles: 2x an H200's 1.98 GHz, so a spin lasts long enough


def device_ms(fn, warmup_ms: float = 10, rep_ms: float = 100, max_reps: int = 1000, device=None) -> float:
    """Median GPU milliseconds of fn(), with the host out of the way.

    do_bench records an event, runs fn's host code, records another: when fn's host path (Python,
    autograd, a library's dispatch) takes longer than its kernels, the interval is the host's speed,
    and that moves with the machine's load (measured on an H200: cuDNN's 33 us forward timed 37 us
    in one process and 63-67 us in three others; every short training step timed 500-600 us, its
    kernels 120-290 us). Here the stream first spins (`torch.cuda._sleep`, counted in cycles of a
    4 GHz clock, so at least twice fn's host time on real clocks) while the host queues all of fn's
    work, then flushes L2, then reaches the events: the interval is the kernels' own time (gaps
    between them included). Host cost per call is measured on its own (`autoflash bench --overhead`).

    As do_bench: work fn leaves on a side stream it never joins is not timed, and an fn that
    synchronizes inside is timed with the host time after its sync. Wall time: up to ~3x rep_ms
    (the spins), more on a GPU clocked well under 2 GHz. device: the GPU fn runs on (default current)."""
    return device_ms_interleaved({"fn": fn}, warmup_ms, rep_ms, max_reps, device)["fn"]


def device_ms_interleaved(fns: dict, warmup_ms: float = 10, rep_ms: float = 100, max_reps: int = 1000,
                          device=None) -> dict:
    """`device_ms` of several calls at once, name -> median GPU ms, their repetitions interleaved:
    repetition i times every call once, starting with call i mod len(fns) (two calls: A B, B A, A B,
    ...). Clocks, temperature and power move over seconds, so calls timed in blocks one after the
    other see different GPUs (two bench columns that ran the very same cuDNN kernel, each timed in
    its own block, measured 0.967x to 1.01x of each other over three runs on an H200, B1 8k d128);
    interleaved per repetition, each call sees the same drift. Each call keeps its own spin
    (its host time) and the L2 flush; every call gets the same number of repetitions, the fewest any
    one of them would get alone."""
    with torch.cuda.device(device):
        return _device_ms_interleaved(fns, warmup_ms, rep_ms, max_reps)


def interleaved_order(names: list, repetition: int) -> list:
    """The order of one repetition of `device_ms_interleaved`: rotated by one each repetition, so
    every call is first (right after the previous repetition's calls) equally often."""
    k = repetition % len(names)
    return names[k:] + names[:k]


# A call at least this long (ms, the host's enqueue included) is estimated from one timed call. The
# estimate took nine calls for every timing; of a 22-problem tune's measuring worker on an H100 (132 s,
# profiled) it took 28 s, most of it on long calls, where one call says enough: the estimate only
# sets the repetitions (at least MIN_REPS), the warm-up and the spin.
LONG_CALL_MS = 2.0


def _spin_and_estimate(fn) -> tuple[int, float, float]:
    """fn's spin (cycles: twice its host time, +20 us), device ms per call, host seconds per call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    if (one_ms := start.elapsed_time(end)) >= LONG_CALL_MS:
        return int(SPIN_CYCLES_PER_US * (2 * host_s * 1e6 + 20)), one_ms, host_s
    # Host time of one call (enqueue only) and device time of one call, from a few of each.
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    host_s = (time.perf_counter() - t0) / 3
    torch.cuda.synchronize()
    spin = int(SPIN_CYCLES_PER_US * (2 * host_s * 1e6 + 20))
    torch.cuda._sleep(5 * spin)  # (the five calls' host work)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    return spin, max(start.elapsed_time(end) / 5, 1e-3), host_s


def _device_ms_interleaved(fns: dict, warmup_ms: float, rep_ms: float, max_reps: int) -> dict:
    names = list(fns)
    if not names:
        return {}
    est = {name: _spin_and_estimate(fns[name]) for name in names}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    counts = []
    for spin, estimate_ms, _ in est.values():
        # Wall time of one repetition: the call, the spin (up to 2x its nominal length), the flush.
        per_rep_ms = estimate_ms + spin / SPIN_CYCLES_PER_US * 2e-3 + 0.1
        counts.append(int(max(MIN_REPS, min(max_reps, rep_ms / estimate_ms, 3 * rep_ms / per_rep_ms))))
    reps = min(counts)
    for name in names:
        _, estimate_ms, host_s = est[name]
        for _ in range(max(1, int(warmup_ms / max(estimate_ms, host_s * 1e3)))):  # (host-bound: by host time)
            fns[name]()
    events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(reps)] for name in names}
    for i in range(reps):
        for name in interleaved_order(names, i):
            start, end = events[name][i]
            torch.cuda._sleep(est[name][0])
            flush.zero_()
            start.record()
            fns[name]()
            end.record()
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in events[name]) for name in names}


# Timing inputs, kept on the device between the candidates of a problem (`timing_inputs`), drawn
# there by the device's generator. Drawn on the host (a CPU generator, for the same values on any
# device), they cost ~5 ns an element on an H100's host: a 4k-token GQA training problem's q, k, v and
# output gradient (84 M elements) ~0.4 s, a 16k one's ~1 s, while the GPU waited (part of the 1.5-4.5 s
# the first candidate of each problem took in a 22-problem run on an H100; the later ones took 0.1-0.4).
# Bounded in bytes (the least recently used go): an eighth of the device's memory, so that the rounds,
# which visit every problem in turn, keep every problem's inputs on an 80-GB GPU instead of drawing
# them again at each visit; at least 2 GiB.
TIMING_SEED, GRAD_SEED = 1234, 4321
MIN_CACHED_INPUT_BYTES = 2 << 30
CACHED_INPUT_BYTES: int | None = None  # (None: from the device, `_input_bound`)
_inputs: collections.OrderedDict = collections.OrderedDict()  # key -> tensors (q, k, v) or (grad,)


def timing_inputs(shape: Shape, device) -> tuple:
    """(q, k, v) of a problem's timings, as `make_inputs(shape, device, seed=TIMING_SEED, draw_on_device=True)`,
    drawn once and shared by every timing of the problem in this process: callers never write them."""
    key = ("qkv", _input_dims(shape), _device_key(device))
    elements = (shape.batch * (shape.heads_q * shape.seqlen_q * shape.head_dim
                               + shape.heads_kv * shape.seqlen_k * (shape.head_dim + shape.value_dim)))
    return _cached(key, elements * _itemsize(shape.dtype), lambda: make_inputs(shape, device, seed=TIMING_SEED,
                                                                           draw_on_device=True))


def timing_grad(shape: Shape, device) -> torch.Tensor:
    """The output gradient a backward problem's timings use (`output_grad`, seed GRAD_SEED), shared too."""
    key = ("grad", _input_dims(shape), _device_key(device))
    elements = shape.batch * shape.heads_q * shape.seqlen_q * shape.value_dim
    return _cached(key, elements * _itemsize(shape.dtype), lambda: (output_grad(shape, device, seed=GRAD_SEED,
                                                                                  draw_on_device=True),))[0]


def _input_dims(shape: Shape) -> tuple:
    return (shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q, shape.seqlen_k, shape.head_dim,
            shape.value_dim, shape.dtype)


def _device_key(device) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _input_bound(device_key: str) -> int:
    """Bytes of timing inputs kept: `CACHED_INPUT_BYTES` where set, else an eighth of the device's memory."""
    if CACHED_INPUT_BYTES is not None:
        return CACHED_INPUT_BYTES
    d = torch.device(device_key)
    total = torch.cuda.get_device_properties(d).total_memory if d.type == "cuda" else 0
    return max(MIN_CACHED_INPUT_BYTES, total // 8)


def _cached(key: tuple, nbytes: int, make) -> tuple:
    if key in _inputs:
        _inputs.move_to_end(key)
        return _inputs[key]
    bound = _input_bound(key[-1])
    while _inputs and sum(_bytes(t) for t in _inputs.values()) + nbytes > bound:
        _inputs.popitem(last=False)  # (before drawing: the old and the new never need the memory together)
    _inputs[key] = tuple(make())
    return _inputs[key]


def _bytes(tensors: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def time_variant(kernel: Kernel, shape: Shape, device, rep_ms: float = 100, align: str = "top_left") -> float:
    q, k, v = timing_inputs(shape, device)
    off = causal_offset_for(shape, align)
    return time_callable(launch_callable(kernel, shape, q, k, v, off), device, rep_ms)


def launch_callable(kernel: Kernel, shape: Shape, q, k, v, off: int):
    """A no-argument call of a forward or backward variant on fixed inputs (outputs allocated once).

    A backward problem is timed as a training step's attention, forward + backward, for every
    family: the pair the candidate stands for (`gate.candidate_pair`: an own backward after
    `gate.training_forward`, the problem's own forward winner where one is stored, else the forward
    family's default; a vendor pair with its own halves the same way), SDPA's whole pair through
    torch autograd. So every pair competes on the same quantity."""
    scale = 1.0 / math.sqrt(shape.head_dim)
    if kernel.op == "decode":  # the (B, H, N, D) inputs seen as N_q new tokens against a full cache
        # (B, N, H_kv, D) caches, as a model keeps them (rows H_kv * D apart)
        qd, kd, vd = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        table = None
        if shape.page is not None:  # a paged problem: the same tokens behind a shuffled block table
            kd, vd, table = paged_cache(kd, vd, shape.page, torch.Generator(device=q.device).manual_seed(1))
        tables = (table,) if table is not None else ()
        out, lse = torch.empty_like(qd), torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        seqlens = torch.full((q.shape[0],), k.shape[2], device=q.device, dtype=torch.int32)
        sm_count = launch_sm_count(q.device)
        # (launched as a decode step launches it: directly, after the first call)
        launch = kernel.bind_decode(qd, kd, vd, out, lse, scale, shape.causal, seqlens, table, sm_count=sm_count)
        if launch:
            return lambda: launch(qd, kd, vd, out, lse, seqlens, *tables)
        return lambda: kernel.decode(qd, kd, vd, out, lse, scale, shape.causal, seqlens, table, sm_count=sm_count)
    if not kernel.takes_causal_offset(shape.causal, off):
        raise ValueError(f"{kernel.family} cannot take causal offset {off}")
    # (an output's shape for the check: q where V has its head dim, as always)
    require_supported(kernel, q, k, v, q if v.shape[3] == q.shape[3] else q.new_empty((*q.shape[:3], v.shape[3])))
    if shape.score is not None:  # (own kernels only: no vendor kernel computes the variants)
        return variant_callable(kernel, shape, q, k, v, off, scale)
    if kernel.op == "bwd":
        grad = timing_grad(shape, q.device)  # (B, H, N, D_v)
        require_supported(kernel, q, k, v, grad)
        pair = candidate_pair(kernel, q, k, v, shape.causal, off, scale)
        if pair is None:  # SDPA's whole pair, through torch autograd
            return lambda: kernel.gradients(q, k, v, grad, scale, shape.causal, off)
        # What a training step runs: the served path's autograd.Function and direct launches.
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def step():
            with torch.enable_grad():
                torch.autograd.grad(EagerAttention.apply(*leaves, pair), leaves, grad)
        return step
    if kernel.vendor:
        return lambda: kernel.attention(q, k, v, scale, shape.causal, off)
    out = torch.empty((*q.shape[:3], v.shape[3]), device=q.device, dtype=q.dtype)  # (B, H, N, D_v)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    require_supported(kernel, q, k, v, out)
    launch = kernel.bind_forward(q, k, v, out, lse, scale, shape.causal, off)  # (as inference launches it)
    if launch:
        return lambda: launch(q, k, v, out, lse)
    return lambda: kernel.forward(q, k, v, out, lse, scale, shape.causal, off)


def variant_callable(kernel: Kernel, shape: Shape, q, k, v, off: int, scale: float):
    """`launch_callable` of a shape with attention variants: the kernel launched with the shape's variant
    values (`ScoreValues.args`), as `variant_forward` serves inference (no bound launcher: the binder
    knows no variant arguments). A backward candidate is timed as `variant_training`'s training step:
    the forward kernel rendered with the same variants (the stored forward winner, else the default),
    then the candidate; the sinks' gradient on the host is left out (the same for every candidate)."""
    from autoflash.tuning import gate

    if (reason := gate.variant_mismatch(kernel, shape)) is not None:
        raise ValueError(reason)
    score = shape.score.args(q.shape[1], q.device)
    out = torch.empty((*q.shape[:3], v.shape[3]), device=q.device, dtype=q.dtype)  # (B, H, N, D_v)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    if kernel.op == "fwd":
        return lambda: kernel.forward(q, k, v, out, lse, scale, shape.causal, off, score_args=score)
    grad = timing_grad(shape, q.device)
    require_supported(kernel, q, k, v, grad)
    forward = gate.forward_kernel_for_backward(q, k, v, shape.causal, gate.training_forward, score.variant)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))

    def step():
        forward.forward(q, k, v, out, lse, scale, shape.causal, off, score_args=score)
        kernel.backward(q, k, v, out, lse, grad, dq, dk, dv, scale, shape.causal, off, score_args=score)
    return step


SDPA_BACKENDS = ("cudnn", "flash")


def tflops(shape: Shape, ms: float) -> float:
    """TFLOP/s of what was timed: a backward problem's time is forward + backward (see launch_callable)."""
    flops = dataclasses.replace(shape, op="fwdbwd").flops() if shape.op == "bwd" else shape.flops()
    return flops / (ms * 1e-3) / 1e12 if ms and math.isfinite(ms) and ms > 0 else float("nan")


def time_callable(fn, device, rep_ms: float) -> float:
    """Median device ms on a GPU (`device_ms`); in the interpreter, the wall clock of one call."""
    if torch.device(device).type == "cuda":
        return device_ms(fn, warmup_ms=10, rep_ms=rep_ms, device=device)
    t0 = time.perf_counter()  # the interpreter: wall clock of one call, not GPU performance
    fn()
    return (time.perf_counter() - t0) * 1e3


def sdpa_callable(backend: str, shape: Shape, q, k, v, backward: bool = False):
    """A no-argument call of torch SDPA with one backend forced (forward + backward through
    autograd when `backward`: how a backward problem is timed), or None when that backend refuses
    the shape."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    which = sdpa_backend(backend)
    gqa = shape.heads_q != shape.heads_kv
    if backward:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        grad = torch.randn((*q.shape[:3], v.shape[3]), device=q.device, dtype=q.dtype)  # (the output's: D_v)

        def fn():
            with sdpa_kernel([which]):
                out = F.scaled_dot_product_attention(*leaves, is_causal=shape.causal, enable_gqa=gqa)
            torch.autograd.grad(out, leaves, grad)
    else:
        def fn():
            with sdpa_kernel([which]):
                F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)
    return if_it_runs(fn)


def if_it_runs(fn):
    """fn if one call succeeds on the GPU, else None (a backend that refuses a shape raises)."""
    try:
        fn()
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return fn
