"""Timing: medians from triton.testing.do_bench (CUDA events, L2 flush), SDPA backends in the same
process, TFLOP/s. In the interpreter, the wall clock of one call (not GPU performance)."""

from __future__ import annotations

import math
import time

import torch

from autoflash.codegen import Kernel
from autoflash.problem import Shape
from autoflash.reference import causal_offset_for, make_inputs, sdpa_backend
from autoflash.tuning.gate import forward_for_backward, require_supported


def bench_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of fn() with CUDA events and an L2 flush between runs."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_variant(kernel: Kernel, shape: Shape, device, rep_ms: float = 100, align: str = "top_left") -> float:
    q, k, v = make_inputs(shape, device, seed=1234)
    off = causal_offset_for(shape, align)
    return time_callable(launch_callable(kernel, shape, q, k, v, off), device, rep_ms)


def launch_callable(kernel: Kernel, shape: Shape, q, k, v, off: int):
    """A no-argument launch of a forward or backward variant on fixed inputs (outputs allocated
    once; a backward variant gets out/lse from the forward and a random dO)."""
    scale = 1.0 / math.sqrt(shape.head_dim)
    if kernel.op == "bwd":
        grad = make_inputs(shape, q.device, seed=4321)[0]
        out, lse = forward_for_backward(q, k, v, shape.causal, off, scale)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        require_supported(kernel, q, k, v, grad)
        return lambda: kernel.backward(q, k, v, out, lse, grad, *grads, scale, shape.causal, off)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    require_supported(kernel, q, k, v, out)
    return lambda: kernel.forward(q, k, v, out, lse, scale, shape.causal, off)


SDPA_BACKENDS = ("cudnn", "flash")


def tflops(shape: Shape, ms: float) -> float:
    return shape.flops() / (ms * 1e-3) / 1e12 if ms and math.isfinite(ms) and ms > 0 else float("nan")


def time_callable(fn, device, rep_ms: float) -> float:
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


def if_it_runs(fn):
    """fn if one call succeeds on the GPU, else None (a backend that refuses a shape raises)."""
    try:
        fn()
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return fn
