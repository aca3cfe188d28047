"""Shared test helpers (imported by test modules; fixtures live in conftest.py)."""

from __future__ import annotations

import dataclasses

from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
from autoflash.space import Variant, load_space


def default_for(op: str, dtype: str, head_dim: int, has_tma: bool = True, causal: bool = False) -> Variant:
    """The op's [[defaults]] variant for a problem, on this machine's device with or without TMA."""
    device = dataclasses.replace(gpu_fingerprint(), cc_major=9 if has_tma else 8, cc_minor=0)
    problem = Problem(op=op, dtype=dtype, head_dim=head_dim, causal=causal, gqa_group=1, seqlen_q=1024,
                      seqlen_k=1024)
    return load_space(op).default_for(problem, device)


def _triton_release() -> tuple[int, int]:
    import triton

    from autoflash.device import triton_release

    return triton_release(triton.__version__)


# A load strategy other than the default's that every supported Triton offers: block pointers
# where they exist (removed in Triton 3.9), else plain pointers.
OTHER_LOADS = "block_ptr" if _triton_release() < (3, 9) else "pointer"


def db_with_winners(path, n=2, ms=1.0, gpu_name=None):
    """A results DB at `path` with `n` forward winners (template hash 't') of this machine's device."""
    import dataclasses

    from autoflash.device import gpu_fingerprint

    from autoflash.problem import Problem
    from autoflash.space import load_space
    from autoflash.store import Store

    dev = gpu_fingerprint() if gpu_name is None else dataclasses.replace(gpu_fingerprint(), name=gpu_name)
    store = Store(path)
    store.add_gpu(dev)
    for i in range(n):
        prob = Problem("fwd", "float16", 64, False, 1, 64 << i, 64 << i)
        store.set_winner(gpu_key=dev.key, problem=prob, template_hash="t",
                         variant_json=load_space("fwd").valid_variants(prob, dev)[i].json(),
                         median_ms=ms, spread=0.0, tflops=1.0 / ms, trials=3)
    store.close()
    return path
