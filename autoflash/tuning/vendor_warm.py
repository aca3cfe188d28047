"""cuDNN's attention, built ahead in the measuring worker before a tuning run's vendor pass.

The first cuDNN call of a configuration in a process builds its kernels on the host: on an H100 the
first cuDNN candidate of each new problem took 1.4-5.2 s (forward) and 2-11 s (backward) where the
next problem of the same head dim, dtype and causality took 0.3-1 s; 65 of a 22-problem run's 80-s
vendor pass. The measuring worker makes these calls itself, on every gate shape and timing shape
of the run's problems (the same inputs, layouts and arguments the gate and the timing use, so
cuDNN meets the same configurations), from several threads at once, before anything is timed:
nothing else runs on the GPU then. Nothing here decides a result: a call that fails here fails
again, and is recorded, where the candidate is gated or timed.

torch keeps its cuDNN graphs per thread; what the threads build ahead is cuDNN's own kernels for a
configuration, which the measuring thread's first call then finds.
"""

from __future__ import annotations

import concurrent.futures
import math
import time

import torch

from autoflash.problem import Shape
from autoflash.reference import make_inputs, output_grad, sdpa_backend
from autoflash.space import Variant

THREADS = 8


def cudnn_variants(valid: dict, vendor: list[str]) -> list[Variant]:
    """The cuDNN candidates among a problem's valid vendor variants (family -> variants)."""
    return [v for family in vendor for v in valid.get(family, ()) if v.as_dict().get("BACKEND") == "cudnn"]


def warm_cudnn(jobs: list[tuple[Shape, list[Variant]]], device_str: str, threads: int = THREADS) -> dict:
    """A worker task: every cuDNN candidate of each (shape, variants) called once on the shape's gate
    and timing inputs, `threads` at a time. Returns {"status", "samples": {"seconds", "calls",
    "failed"}}: nothing on a CPU (no cuDNN)."""
    from autoflash.vendor import only_backend

    device = torch.device(device_str)
    if device.type != "cuda" or not jobs:
        return {"status": "ok", "samples": {"seconds": [0.0], "calls": [0], "failed": [0]}}
    calls = [(shape, variant, inputs) for shape, variants in jobs for variant in variants
             for inputs in _input_sets(shape)]
    t0 = time.perf_counter()
    # The backend switches are process-wide: set once here, around every thread's calls (a kernel's
    # own `only_backend` inside a thread then saves and restores this same setting).
    with only_backend(sdpa_backend("cudnn")):
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            failed = sum(not ok for ok in pool.map(lambda call: _call(*call, device), calls))
    return {"status": "ok", "samples": {"seconds": [time.perf_counter() - t0], "calls": [len(calls)],
                                        "failed": [failed]}}


def _input_sets(shape: Shape) -> list:
    """What the gate and the timing draw for `shape`: (gate shape, index) per gate shape, then None
    (the timing shape's)."""
    from autoflash.tuning.gate import gate_shapes

    return [(gs, i) for i, gs in enumerate(gate_shapes(shape))] + [None]


def _call(shape: Shape, variant: Variant, inputs, device) -> bool:
    from autoflash import codegen
    from autoflash.tuning.timing import timing_grad, timing_inputs

    try:
        if inputs is None:
            q, k, v = timing_inputs(shape, device)
            grad = timing_grad(shape, device) if shape.op == "bwd" else None
        else:
            gs, i = inputs  # (the gate's seed 0: see gate.check_forward / check_backward)
            q, k, v = make_inputs(gs, device, seed=i, layout="bnhd" if i % 2 else "bhnd")
            grad = output_grad(gs, device, seed=100 + i) if shape.op == "bwd" else None
        kernel = codegen.load_for(variant, shape.head_dim_v, shape.score_variant)
        scale = 1.0 / math.sqrt(shape.head_dim)
        if kernel.unsupported(q, k, v, q if grad is None else grad):
            return True
        with torch.no_grad():
            if grad is None:
                kernel.attention(q, k, v, scale, shape.causal)
            elif kernel.whole_pair:
                kernel.gradients(q, k, v, grad, scale, shape.causal)
            else:  # a pair with an own half: cuDNN's forward with its log-sum-exp, or its backward from one
                out, lse = kernel.attention_with_lse(q, k, v, scale, shape.causal)
                kernel.gradients_from(q, k, v, out, lse, grad, scale, shape.causal)
        if q.is_cuda:  # (a failure shows here, in its own call)
            torch.cuda.synchronize(q.device)
        return True
    except Exception:  # noqa: BLE001 - refused or failed: the gate and the timing say so, where it counts
        return False
