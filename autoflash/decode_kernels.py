"""The decode family's kernels as the runtime uses them: the problem key of a decode call, the
served knobs (a tuned winner or the space's default), and launching them, directly after a call
signature's first launch (`replay`). Below the public functions (`decode`, `api`): both call it.
"""

from __future__ import annotations

import torch

from autoflash import codegen
from autoflash.device import gpu_fingerprint, launch_sm_count
from autoflash.dispatch import get_dispatcher
from autoflash.problem import Problem, dtype_name, seqlen_bucket, shape_work_bucket
from autoflash.space import Variant, default_variant, load_space

FAMILY = "triton_decode"


def decode_space():
    """The decode family's search space."""
    return load_space(FAMILY)


def decode_problem(dtype: torch.dtype, head_dim: int, batch: int, kv_heads: int, group: int, q_len: int,
                   capacity: int, causal: bool, sm_count: int, page: int | None = None) -> Problem:
    """The tuning and dispatch key of a decode call (the cache's capacity is its length bucket;
    page: the block size of a paged cache, None for a contiguous one)."""
    return Problem(op="decode", dtype=dtype_name(dtype), head_dim=head_dim, causal=causal, gqa_group=group,
                   seqlen_q=seqlen_bucket(q_len), seqlen_k=seqlen_bucket(max(capacity, 1)),
                   work=shape_work_bucket("decode", batch, kv_heads * group, kv_heads, q_len, capacity, sm_count),
                   page=page)


def default_knobs(dtype: torch.dtype, head_dim: int, group: int, q_len: int, seqlen_k: int, causal: bool) -> tuple:
    """The space's [[defaults]] for this problem made valid here (fewest knobs changed), as sorted
    (knob, value) items: what runs where no tuned winner applies."""
    problem = decode_problem(dtype, head_dim, 1, 1, group, q_len, seqlen_k, causal, 1)
    return tuple(sorted(default_variant("decode", problem, gpu_fingerprint()).as_dict().items()))


def load_kernel(knobs: dict, score=None):
    """The decode family's compiled `codegen.Kernel` for these knobs (validated against the space),
    rendered with the attention variants `score` (a `ScoreVariant`; None: plain)."""
    return codegen.load(Variant.of(FAMILY, knobs), **({} if score is None or score.plain else {"score": score}))


def _served_knobs(q, k_cache, capacity: int, causal: bool, page: int | None, variant) -> dict:
    """The tuned winner of this call's decode problem (exact or nearest bucket), else the default;
    a caller's `variant` overrides knobs (checked against the space)."""
    batch, q_len, heads, head_dim = q.shape
    device = gpu_fingerprint(q.device.index if q.is_cuda else None)
    problem = decode_problem(q.dtype, head_dim, batch, k_cache.shape[2], heads // k_cache.shape[2], q_len,
                             capacity, causal, device.sm_count, page)
    knobs = get_dispatcher().serving_variant(problem, device).as_dict()
    if variant:
        knobs = decode_space().check_declared({**knobs, **variant}).as_dict()
    return knobs


DECODE_MAX_QUERY = 16  # query lengths up to this (decoding, speculative decoding) take the decode kernels


def decode_shaped(n_q: int, n_k: int, causal: bool, causal_offset: int) -> bool:
    """A decoding step: a few query tokens against a longer cache. The decode kernels hold all the
    query heads of a KV head in one tile and split the cache across programs (a forward kernel
    would pad each head's few rows to a 64-128-row tile and stream the cache once per query head).
    Their causal mask is bottom-right: taken only where the call's mask is the same."""
    return n_q <= DECODE_MAX_QUERY and n_k > n_q and (not causal or causal_offset == n_k - n_q)


def short_query_attention(q, k, v, sm_scale: float, causal: bool, score_args=None, with_lse: bool = False):
    """`autoflash.attention`'s decoding steps: q (B, H, N_q, D) with a few query tokens, k, v
    (B, H_kv, N_k, D) the whole cache (any strides); causal bottom-right (query i at key position
    i + N_k - N_q, for a window and ALiBi too: `score_args`, the call's attention variants). Output in
    q's memory layout (with its LSE (B, H, N_q) float32 when `with_lse`). The decode kernels see
    (B, N, H, D) views: nothing is copied."""
    qd, kd, vd = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = torch.empty_like(qd)
    lse = torch.empty((q.shape[0], q.shape[1], q.shape[2]), device=q.device, dtype=torch.float32)
    launch(qd, kd, vd, out, lse, sm_scale, causal, _full_lengths(q.shape[0], k.shape[2], q.device), None, 0, None,
           score_args)
    return (out.transpose(1, 2), lse) if with_lse else out.transpose(1, 2)


_FULL_LENGTHS: dict[tuple, torch.Tensor] = {}


def _full_lengths(batch: int, n: int, device) -> torch.Tensor:
    """cache_seqlens of caches used whole, (batch,) int32, kept per (batch, length, device): never
    written (the kernels only read them), so one tensor serves every call."""
    key = (batch, n, device)
    lengths = _FULL_LENGTHS.get(key)
    if lengths is None:
        lengths = torch.full((batch,), n, dtype=torch.int32, device=device)
        if len(_FULL_LENGTHS) < 1024:  # (kept, never freed: a kernel in flight may still read one)
            _FULL_LENGTHS[key] = lengths
    return lengths


# A decode call's signature -> its direct launcher (or False: launch through the kernel module).
# Decoding repeats one signature per layer and step: the dispatcher lookup and Triton's per-launch
# host path would otherwise cost more than the kernel takes on short caches.
decode_plans: dict[tuple, tuple] = {}


def launch(q, k_cache, v_cache, out, lse, scale, causal, seqlens, block_table, num_splits, variant,
           score_args=None) -> None:
    """score_args: the call's attention variants (`score_variant.ScoreArgs`), rendered into the plain
    problem's served knobs; such a call is never planned (a bound launch would replay its values)."""
    paged = block_table is not None
    signature = plan = None
    if variant is None and q.is_cuda and score_args is None:
        signature = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.stride(),
                     block_table.shape if paged else None, block_table.stride() if paged else None,
                     causal, scale, num_splits,
                     *(not t.data_ptr() & 15 for t in (q, k_cache, v_cache, seqlens, block_table) if t is not None))
        plan = decode_plans.get(signature)
        if plan is not None and plan[1]:
            plan[1](q, k_cache, v_cache, out, lse, seqlens, *((block_table,) if paged else ()))
            return
    if plan is not None:
        kernel = plan[0]  # (planned, but not bound: through the kernel module)
    else:
        capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
        kernel = load_kernel(_served_knobs(q, k_cache, capacity, causal, k_cache.shape[1] if paged else None, variant),
                             score_args.variant if score_args is not None else None)
    args = (q, k_cache, v_cache, out, lse, scale, causal, seqlens, block_table)
    options = dict(sm_count=launch_sm_count(q.device), num_splits=num_splits or None)
    if score_args is not None:
        options["score_args"] = score_args
    if signature is None or plan is not None:
        kernel.decode(*args, **options)
        return
    if len(decode_plans) > 1024:
        decode_plans.clear()
    decode_plans[signature] = (kernel, kernel.bind_decode(*args, **options) or False)  # (runs this call)
