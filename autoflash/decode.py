"""Decode and serving: `flash_attn_with_kvcache` (paged or contiguous KV cache, Flash-Decoding) and
`flash_attn_varlen_func` (packed variable-length sequences), with flash-attn's semantics.

`flash_attn_with_kvcache` runs the `triton_decode` family (templates/attn_decode.py.jinja,
search_spaces/attn_decode.toml): one program per (KV split, batch, KV head) holds every query
head of that GQA group (and every new query token), a second kernel combines the splits by their
log-sum-exp. It is an inference function (not differentiable, as flash-attn's).

`flash_attn_varlen_func` is, for now, a loop over the sequences calling the forward/backward
kernels of `flash_attn_func` on views of the packed tensors (no padding, no copies in; one
concatenation out; one host sync to read cu_seqlens). Differentiable.

Bad input raises one `ValueError` naming the argument (`decode_validate`: checking the values of
cache_seqlens and block_table costs one host sync, paid once per tensor state; cu_seqlens are
read on the host; the value checks of the KV-cache call are skipped while a CUDA graph is being
captured). Valid calls the kernels do not cover fall back to a torch
implementation with one `FallbackWarning` per reason (`AUTOFLASH_STRICT=1`: `FallbackError`).
"""

from __future__ import annotations

import math
import warnings

import torch

from autoflash import api, codegen
from autoflash.api import FallbackError, FallbackWarning  # noqa: F401 (re-exported for callers)
from autoflash.device import gpu_fingerprint, interpreter_enabled, launch_sm_count
from autoflash.decode_validate import validate_kvcache, validate_varlen
from autoflash.dispatch import get_dispatcher
from autoflash.problem import Problem, dtype_name, seqlen_bucket, shape_work_bucket
from autoflash.reference import decode_reference as torch_decode  # noqa: F401 (the fallback; tests use it)
from autoflash.space import Variant, default_variant, load_space

FAMILY = "triton_decode"


# --------------------------------------------------------------------------- kernels
def decode_space():
    """The decode family's search space."""
    return load_space(FAMILY)


def decode_problem(dtype: torch.dtype, head_dim: int, batch: int, kv_heads: int, group: int, q_len: int,
                   capacity: int, causal: bool, sm_count: int) -> Problem:
    """The tuning and dispatch key of a decode call (the cache's capacity is its length bucket)."""
    return Problem(op="decode", dtype=dtype_name(dtype), head_dim=head_dim, causal=causal, gqa_group=group,
                   seqlen_q=seqlen_bucket(q_len), seqlen_k=seqlen_bucket(max(capacity, 1)),
                   work=shape_work_bucket("decode", batch, kv_heads * group, kv_heads, q_len, capacity, sm_count))


def default_knobs(dtype: torch.dtype, head_dim: int, group: int, q_len: int, seqlen_k: int, causal: bool) -> tuple:
    """The space's [[defaults]] for this problem made valid here (fewest knobs changed), as sorted
    (knob, value) items: what runs where no tuned winner applies."""
    problem = decode_problem(dtype, head_dim, 1, 1, group, q_len, seqlen_k, causal, 1)
    return tuple(sorted(default_variant("decode", problem, gpu_fingerprint()).as_dict().items()))


def load_kernel(knobs: dict):
    """The decode family's compiled `codegen.Kernel` for these knobs (validated against the space)."""
    return codegen.load(Variant.of(FAMILY, knobs))


def _served_knobs(q, k_cache, capacity: int, causal: bool, variant) -> dict:
    """The tuned winner of this call's decode problem (exact or nearest bucket), else the default;
    a caller's `variant` overrides knobs (checked against the space)."""
    batch, q_len, heads, head_dim = q.shape
    device = gpu_fingerprint(q.device.index if q.is_cuda else None)
    problem = decode_problem(q.dtype, head_dim, batch, k_cache.shape[2], heads // k_cache.shape[2], q_len,
                             capacity, causal, device.sm_count)
    knobs = get_dispatcher().serving_variant(problem, device).as_dict()
    if variant:
        knobs = decode_space().check_declared({**knobs, **variant}).as_dict()
    return knobs


# --------------------------------------------------------------------------- fallback
def _fallback(reason: str) -> None:
    """One FallbackWarning per reason (shared with the API's set: `api.reset()` clears it)."""
    if api.strict_mode():
        raise FallbackError(f"autoflash cannot run this call on its kernels: {reason} "
                            "(AUTOFLASH_STRICT=1 turns fallbacks into errors)")
    key = f"decode: {reason}"
    if key not in api._warned_reasons:
        api._warned_reasons.add(key)
        warnings.warn(f"autoflash: falling back to torch (flash_attn_with_kvcache): {reason}", FallbackWarning,
                      stacklevel=3)


def _unsupported_reason(q: torch.Tensor) -> str | None:
    if q.dtype not in api.KERNEL_DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32 are)"
    if q.device.type != "cuda" and not interpreter_enabled():
        return f"{q.device.type} tensors need a CUDA GPU (or TRITON_INTERPRET=1 for the interpreter)"
    if interpreter_enabled() and q.dtype == torch.bfloat16:
        return "bfloat16 is not computed correctly by Triton's CPU interpreter"
    d = q.shape[-1]
    if d > api.MAX_HEAD_DIM or d % 8:
        return f"head dim {d} is not supported (multiples of 8 up to {api.MAX_HEAD_DIM} are)"
    return None


def _append(k_cache, v_cache, k, v, seqlens, block_table) -> None:
    """Write k, v (B, S_new, H_kv, D) into the caches at positions seqlens[b] + t (torch indexing)."""
    batch, new = k.shape[:2]
    pos = seqlens.long()[:, None] + torch.arange(new, device=k.device)  # (B, S_new)
    if block_table is None:
        rows = torch.arange(batch, device=k.device)[:, None].expand(batch, new)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        page = k_cache.shape[1]
        blocks = torch.gather(block_table.long(), 1, pos // page)
        k_cache[blocks, pos % page] = k
        v_cache[blocks, pos % page] = v


# --------------------------------------------------------------------------- public functions
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False, *, num_splits=0, return_softmax_lse=False,
                            variant=None):
    """Drop-in for flash-attn's `flash_attn_with_kvcache` (no rotary, no alibi, no window).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); seqlen_q 1 for decoding, a few for speculative decoding
        k_cache, v_cache: (batch_size, seqlen_cache, nheads_k, headdim) without block_table, or
            (num_blocks, page_block_size, nheads_k, headdim) with it (a paged cache; any page size);
            nheads_k divides nheads (MQA/GQA). Updated in place when k, v are given.
        k, v: optional (batch_size, seqlen_new, nheads_k, headdim): written into the caches at
            positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attending.
        cache_seqlens: int32 (batch_size,) or an int: tokens in the cache before the append
            (default: the whole cache). Ragged lengths and 0 are fine (a row with no key returns 0).
        block_table: optional int32 (batch_size, max_num_blocks_per_seq): page indices into the caches.
        softmax_scale: default 1/sqrt(headdim)
        causal: bottom-right aligned, as flash-attn: query i sees keys j <= i + seqlen_k - seqlen_q,
            seqlen_k = cache_seqlens + seqlen_new.
        num_splits: KV splits (0: the variant's choice, by default the SM-count heuristic).
        return_softmax_lse: also return the log-sum-exp, (batch_size, nheads, seqlen_q) float32.
        variant: knob overrides for tests and tuning (see search_spaces/attn_decode.toml).
    Returns:
        out (batch_size, seqlen_q, nheads, headdim), in q's memory layout; (out, lse) with
        return_softmax_lse. Not differentiable (as flash-attn's).
    """
    seqlens, new = validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale,
                                    causal, num_splits)
    batch, q_len, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    with torch.no_grad():
        if new:
            _append(k_cache, v_cache, k, v, seqlens, block_table)
        total = seqlens if not new and seqlens.is_contiguous() else (seqlens + new).to(torch.int32).contiguous()
        reason = _unsupported_reason(q) if q.numel() else None
        if reason is not None:
            _fallback(reason)
            out, lse = torch_decode(q, k_cache, v_cache, total, block_table, scale, causal)
            return (out, lse) if return_softmax_lse else out
        out = torch.empty_like(q)
        lse = torch.empty((batch, heads, q_len), device=q.device, dtype=torch.float32)
        if q.numel():
            _launch(q, k_cache, v_cache, out, lse, scale, causal, total, block_table, num_splits, variant)
    return (out, lse) if return_softmax_lse else out


def short_query_attention(q, k, v, sm_scale: float, causal: bool):
    """`autoflash.attention`'s decoding steps: q (B, H, N_q, D) with a few query tokens, k, v
    (B, H_kv, N_k, D) the whole cache (any strides); causal bottom-right. Output in q's memory
    layout. The decode kernels see (B, N, H, D) views: nothing is copied."""
    qd, kd, vd = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = torch.empty_like(qd)
    lse = torch.empty((q.shape[0], q.shape[1], q.shape[2]), device=q.device, dtype=torch.float32)
    _launch(qd, kd, vd, out, lse, sm_scale, causal, _full_lengths(q.shape[0], k.shape[2], q.device), None, 0, None)
    return out.transpose(1, 2)


_FULL_LENGTHS: dict[tuple, torch.Tensor] = {}


def _full_lengths(batch: int, n: int, device) -> torch.Tensor:
    """cache_seqlens of caches used whole, (batch,) int32, kept per (batch, length, device): never
    written (the kernels only read them), so one tensor serves every call."""
    key = (batch, n, device)
    lengths = _FULL_LENGTHS.get(key)
    if lengths is None:
        if len(_FULL_LENGTHS) > 256:
            _FULL_LENGTHS.clear()
        lengths = _FULL_LENGTHS[key] = torch.full((batch,), n, dtype=torch.int32, device=device)
    return lengths


# A decode call's signature -> its direct launcher (or False: launch through the kernel module).
# Decoding repeats one signature per layer and step: the dispatcher lookup and Triton's per-launch
# host path would otherwise cost more than the kernel takes on short caches.
_decode_plans: dict[tuple, tuple] = {}
api.PLAN_MEMOS.append(_decode_plans)  # (forgotten with the API's plans: `autoflash.reset()`)


def _launch(q, k_cache, v_cache, out, lse, scale, causal, seqlens, block_table, num_splits, variant) -> None:
    paged = block_table is not None
    signature = None
    if variant is None and q.is_cuda:
        signature = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.stride(),
                     block_table.shape if paged else None, block_table.stride() if paged else None,
                     causal, scale, num_splits,
                     *(not t.data_ptr() & 15 for t in (q, k_cache, v_cache, seqlens, block_table) if t is not None))
        plan = _decode_plans.get(signature)
        if plan is not None and plan[1]:
            plan[1](q, k_cache, v_cache, out, lse, seqlens, *((block_table,) if paged else ()))
            return
    if signature is not None and signature in _decode_plans:
        kernel = _decode_plans[signature][0]  # (planned, but not bound: through the kernel module)
    else:
        capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)
        kernel = load_kernel(_served_knobs(q, k_cache, capacity, causal, variant))
    args = (q, k_cache, v_cache, out, lse, scale, causal, seqlens, block_table)
    options = dict(sm_count=launch_sm_count(q.device), num_splits=num_splits or None)
    if signature is None or signature in _decode_plans:
        kernel.decode(*args, **options)
        return
    if len(_decode_plans) > 1024:
        _decode_plans.clear()
    _decode_plans[signature] = (kernel, kernel.bind_decode(*args, **options) or False)  # (runs this call)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False):
    """Drop-in for flash-attn's `flash_attn_varlen_func` (forward and backward; no dropout/window).

    Args:
        q: (total_q, nheads, headdim), the batch's sequences packed one after another
        k, v: (total_k, nheads_k, headdim); nheads_k divides nheads (MQA/GQA)
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,): offsets, starting at 0, non-decreasing,
            ending at total_q / total_k
        max_seqlen_q, max_seqlen_k: ints >= the longest query / key sequence
        softmax_scale: default 1/sqrt(headdim)
        causal: bottom-right aligned per sequence, as flash-attn
    Returns:
        out: (total_q, nheads, headdim). Differentiable w.r.t. q, k, v.

    Implementation: a loop over the sequences, each through `flash_attn_func`'s kernels on views
    (no padding copies); sequences with no key give 0. One host sync reads cu_seqlens.
    """
    cu_q, cu_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal)
    outs = []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            outs.append(q.new_zeros((q1 - q0, *q.shape[1:])))
            continue
        outs.append(api.flash_attn_func(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
                                        softmax_scale=softmax_scale, causal=causal)[0])
    if not outs:
        return q.new_zeros(q.shape)  # no query token at all
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
