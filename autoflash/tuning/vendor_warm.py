"""cuDNN's attention, built ahead in the measuring worker before a tuning run's vendor pass.

The first cuDNN call of a configuration in a process builds its kernels on the host: on an H100 the
first cuDNN candidate of each new problem took 1.4-5.2 s (forward) and 2-11 s (backward) where the
next problem of the same head dim, dtype and causality took 0.3-1 s; 65 of a 22-problem run's 80-s
vendor pass. The measuring worker makes these calls first, on each problem's gate shapes and timing
shape (the inputs, layouts and arguments the gate and the timing use, so cuDNN meets the same
configurations), before anything is timed (six problems on an H100: 18.8 s of first candidates
before, 5-7 s of build-ahead and 3 s of candidates after). In the worker's own thread: torch keeps
its cuDNN graphs per thread, and eight threads built no faster than one.

Nothing here decides a result: a call that fails here fails again, and is recorded, where the
candidate is gated or timed. A CUDA error that would outlive its call restarts the worker.
"""

from __future__ import annotations

import math
import time

import torch

from autoflash.problem import Shape
from autoflash.reference import make_inputs, output_grad, sdpa_backend
from autoflash.space import Variant


def cudnn_variants(valid: dict, vendor: list[str]) -> list[Variant]:
    """The cuDNN candidates among a problem's valid vendor variants (family -> variants)."""
    return [v for family in vendor for v in valid.get(family, ()) if v.as_dict().get("BACKEND") == "cudnn"]


def warm(shape: Shape, variants: list[Variant], device_str: str, backend: str = "cudnn"):
    """A worker task: each of `variants` (one SDPA backend's candidates of `shape`'s problem) called
    once on the gate's and the timing's inputs. Returns {"status", "samples": {"seconds", "calls",
    "failed"}}, or a runtime_error Outcome that restarts the worker where the device is left in error.
    Nothing runs for cuDNN off a GPU."""
    from autoflash.tuning.sandbox import Outcome
    from autoflash.vendor import only_backend, quiet_refusals

    device = torch.device(device_str)
    t0, calls, failed = time.perf_counter(), 0, 0
    if device.type == "cuda" or backend != "cudnn":
        with quiet_refusals(), only_backend(sdpa_backend(backend)):
            for variant in variants:
                for inputs in _input_sets(shape):
                    calls += 1
                    failed += not _call(shape, variant, inputs, device)
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except RuntimeError as e:  # (the worker exits on "illegal" and is started afresh)
                return Outcome("runtime_error", message=f"illegal device state after the cuDNN build-ahead: {e}")
    return {"status": "ok", "samples": {"seconds": [time.perf_counter() - t0], "calls": [calls], "failed": [failed]}}


def _input_sets(shape: Shape) -> list:
    """What the gate and the timing draw for `shape`: (gate shape, index) per gate shape, then None
    (the timing shape's)."""
    from autoflash.tuning.gate import gate_shapes

    return [(gs, i) for i, gs in enumerate(gate_shapes(shape))] + [None]


def _call(shape: Shape, variant: Variant, inputs, device) -> bool:
    from autoflash import codegen
    from autoflash.tuning.timing import timing_grad, timing_inputs
    from autoflash.validate import output_like

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
            elif kernel.forward_from == "sdpa":  # cuDNN's forward, with its log-sum-exp, before an own backward
                kernel.attention_with_lse(q, k, v, scale, shape.causal)
            else:  # cuDNN's backward after an own forward: from an O laid out as the own forward writes it
                out, lse = kernel.attention_with_lse(q, k, v, scale, shape.causal)
                kernel.gradients_from(q, k, v, output_like(q, v).copy_(out), lse, grad, scale, shape.causal)
        return True
    except Exception:  # noqa: BLE001 - refused or failed: the gate and the timing say so, where it counts
        return False
