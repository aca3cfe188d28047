"""Decode and serving: `flash_attn_with_kvcache` (paged or contiguous KV cache, Flash-Decoding) and
`flash_attn_varlen_func` (packed variable-length sequences), with flash-attn's semantics.

`flash_attn_with_kvcache` runs the `triton_decode` family (templates/attn_decode.py.jinja,
search_spaces/attn_decode.toml): one program per (KV split, batch, KV head) holds every query
head of that GQA group (and every new query token), a second kernel combines the splits by their
log-sum-exp. It is an inference function (not differentiable, as flash-attn's).

`flash_attn_varlen_func` is, for now, a loop over the sequences calling the forward/backward
kernels of `flash_attn_func` on views of the packed tensors (no padding, no copies in; one
concatenation out; one host sync to read cu_seqlens). Differentiable.

Bad input raises one `ValueError` naming the argument (checking the values of cache_seqlens,
block_table and cu_seqlens costs one host sync; the value checks of the KV-cache call are skipped
while a CUDA graph is being captured). Valid calls the kernels do not cover fall back to a torch
implementation with one `FallbackWarning` per reason (`AUTOFLASH_STRICT=1`: `FallbackError`).
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from autoflash import api, codegen
from autoflash.api import FallbackError, FallbackWarning  # noqa: F401 (re-exported for callers)
from autoflash.device import gpu_fingerprint, interpreter_enabled, launch_sm_count
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


# --------------------------------------------------------------------------- validation
def _tensor(t, name: str, dim: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {layout}, got shape {tuple(t.shape)}")
    return t


def _same(ref: torch.Tensor, t: torch.Tensor, name: str, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def _index_tensor(t, name: str, dim: int, layout: str, device) -> torch.Tensor:
    _tensor(t, name, dim, layout)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor {layout}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    return t


def _check_values(checks: list) -> None:
    """checks: (bool tensor that must be all true, message). One host transfer for all of them."""
    if not checks or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    ok = torch.stack([c.all() for c, _ in checks]).tolist()
    for good, (_, message) in zip(ok, checks):
        if not good:
            raise ValueError(message)


def _validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits):
    """Raise ValueError for malformed input; returns (seqlens int32 (B,) before the append, new tokens)."""
    qlay = "(batch, seqlen_q, nheads, headdim)"
    _tensor(q, "q", 4, qlay)
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    paged = block_table is not None
    clay = "(num_blocks, page_block_size, nheads_k, headdim)" if paged else "(batch, seqlen_cache, nheads_k, headdim)"
    _tensor(k_cache, "k_cache", 4, clay)
    _tensor(v_cache, "v_cache", 4, clay)
    _same(q, k_cache, "k_cache", "q")
    _same(q, v_cache, "v_cache", "q")
    batch, q_len, heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape {clay}, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache must have q's head dim {head_dim}, got shape {tuple(k_cache.shape)}")
    kv_heads = k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of k_cache heads ({kv_heads}) for grouped-query attention")
    if paged:
        _index_tensor(block_table, "block_table", 2, "(batch, max_num_blocks_per_seq)", q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have q's batch size {batch} rows, got shape {tuple(block_table.shape)}")
        if k_cache.shape[1] == 0:
            raise ValueError("k_cache must have a page_block_size >= 1")
        capacity = k_cache.shape[1] * block_table.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have q's batch size {batch}, got shape {tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
    new = _validate_new_tokens(q, k_cache, k, v)
    if cache_seqlens is None:
        if new:
            raise ValueError("cache_seqlens is required to append k/v (the lengths before the append)")
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    else:
        seqlens = _index_tensor(cache_seqlens, "cache_seqlens", 1, "(batch,)", q.device)
        if seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have q's batch size {batch}, got shape {tuple(seqlens.shape)}")
    api._check_numbers(0.0, softmax_scale, "softmax_scale")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the heuristic), got {num_splits!r}")
    checks = [(seqlens >= 0, "cache_seqlens must be >= 0"),
              (seqlens.long() + new <= capacity,
               f"cache_seqlens + seqlen_new ({new}) must be <= the cache capacity ({capacity} tokens)")]
    if paged and block_table.numel():
        used = torch.arange(block_table.shape[1], device=q.device) * k_cache.shape[1] < (seqlens.long() + new)[:, None]
        bad = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        checks.append((~bad, f"block_table entries for the cached and new tokens must be in [0, {k_cache.shape[0]}) "
                             "(num_blocks of k_cache)"))
    _check_values(checks)
    return seqlens, new


def _validate_new_tokens(q, k_cache, k, v) -> int:
    """The number of new tokens to append (0 without k/v); ValueError for malformed k/v."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append), or neither")
    if k is None:
        return 0
    batch, kv_heads, head_dim = q.shape[0], k_cache.shape[2], q.shape[3]
    nlay = "(batch, seqlen_new, nheads_k, headdim)"
    for t, name in ((k, "k"), (v, "v")):
        _tensor(t, name, 4, nlay)
        _same(q, t, name, "q")
        if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"{name} must be {nlay} = ({batch}, seqlen_new, {kv_heads}, {head_dim}), got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    return k.shape[1]


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
    seqlens, new = _validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale,
                                     causal, num_splits)
    batch, q_len, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    with torch.no_grad():
        if new:
            _append(k_cache, v_cache, k, v, seqlens, block_table)
        total = (seqlens + new).to(torch.int32).contiguous()
        reason = _unsupported_reason(q) if q.numel() else None
        if reason is not None:
            _fallback(reason)
            out, lse = torch_decode(q, k_cache, v_cache, total, block_table, scale, causal)
            return (out, lse) if return_softmax_lse else out
        out = torch.empty_like(q)
        lse = torch.empty((batch, heads, q_len), device=q.device, dtype=torch.float32)
        if q.numel():
            capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
            knobs = _served_knobs(q, k_cache, capacity, causal, variant)
            load_kernel(knobs).decode(q, k_cache, v_cache, out, lse, scale, causal, total, block_table,
                                      sm_count=launch_sm_count(q.device), num_splits=num_splits or None)
    return (out, lse) if return_softmax_lse else out


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    lay = "(total_tokens, nheads, headdim)"
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _tensor(t, name, 3, lay)
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    _same(q, k, "k", "q")
    _same(q, v, "v", "q")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in total_tokens and heads {lay}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]}) for grouped-query attention")
    cus = []
    for cu, name, total in ((cu_seqlens_q, "cu_seqlens_q", q.shape[0]), (cu_seqlens_k, "cu_seqlens_k", k.shape[0])):
        _index_tensor(cu, name, 1, "(batch_size + 1,)", q.device)
        values = cu.tolist()
        if not values or values[0] != 0:
            raise ValueError(f"{name} must start at 0 (batch_size + 1 offsets), got {values[:4]}")
        if any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if values[-1] != total:
            raise ValueError(f"{name}[-1] ({values[-1]}) must equal the total tokens of its tensor ({total})")
        cus.append(values)
    if len(cus[0]) != len(cus[1]):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch_size + 1), "
                         f"got {len(cus[0])} and {len(cus[1])}")
    for m, name, values in ((max_seqlen_q, "max_seqlen_q", cus[0]), (max_seqlen_k, "max_seqlen_k", cus[1])):
        longest = max((b - a for a, b in zip(values, values[1:])), default=0)
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < longest:
            raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), got {m!r}")
    api._check_numbers(0.0, softmax_scale, "softmax_scale")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    return cus


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
    cu_q, cu_k = _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
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
