"""Decode and serving: `flash_attn_with_kvcache` (paged or contiguous KV cache, Flash-Decoding), with
flash-attn's semantics (packed variable-length sequences: `autoflash.varlen`).

`flash_attn_with_kvcache` runs the `triton_decode` family (templates/attn_decode.py.jinja,
search_spaces/attn_decode.toml): one program per (KV split, batch, KV head) holds every query
head of that GQA group (and every new query token), a second kernel combines the splits by their
log-sum-exp. It is an inference function (not differentiable, as flash-attn's).

Bad input raises one `ValueError` naming the argument (`decode_validate`: checking the values of
cache_seqlens and block_table costs one host sync, paid once per tensor state, and is skipped
while a CUDA graph is being captured). Valid calls the kernels do not cover fall back to a torch
implementation with one `FallbackWarning` per reason (`AUTOFLASH_STRICT=1`: `FallbackError`).
"""

from __future__ import annotations

import collections.abc
import math

import torch

from autoflash.fallback import FallbackError, FallbackWarning, fall_back  # noqa: F401 (re-exported for callers)
from autoflash.decode_kernels import launch
from autoflash.decode_validate import validate_kvcache
from autoflash import kvcache_args
from autoflash.eager import eager_attention
from autoflash.problem import unsupported_head_dim, unsupported_scale
from autoflash.reference import decode_reference as torch_decode  # noqa: F401 (the fallback; tests use it)
from autoflash.reference import dense_cache
from autoflash.score_variant import ScoreArgs
from autoflash.validate import (check_alibi, check_flag, check_softcap, check_window, odd_head_dim_on_gpu,
                                softcap_out_of_range, unsupported_tensors)


# --------------------------------------------------------------------------- fallback
def _fallback(reason: str) -> None:
    fall_back(reason, to="torch (flash_attn_with_kvcache)")


def _unsupported_reason(q: torch.Tensor, scale: float) -> str | None:
    return (unsupported_scale(scale) or unsupported_tensors(q) or unsupported_head_dim(q.shape[-1])
            or odd_head_dim_on_gpu(q, q.shape[-1]))


# --------------------------------------------------------------------------- public functions
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, variant=None):
    """Drop-in for flash-attn's `flash_attn_with_kvcache` (flash-attn 2.8's signature and positional
    order). Rotary embeddings, the append, cache_batch_idx and cache_leftpad run on the host in torch
    (`autoflash.kvcache_args`), then the decode kernels, a window, softcap or ALiBi slopes rendered
    into them.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); seqlen_q 1 for decoding, a few for speculative decoding
        k_cache, v_cache: (batch_size, seqlen_cache, nheads_k, headdim) without block_table, or
            (num_blocks, page_block_size, nheads_k, headdim) with it (a paged cache; any page size);
            nheads_k divides nheads (MQA/GQA). Updated in place when k, v are given.
        k, v: optional (batch_size, seqlen_new, nheads_k, headdim): written into the caches at
            positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 before attending.
        cache_seqlens: int32 (batch_size,) or an int: tokens in the cache before the append
            (default: the whole cache). Ragged lengths and 0 are fine (a row with no key returns 0).
        rotary_cos, rotary_sin: optional (seqlen_ro >= the cache capacity, rotary_dim / 2), rotary_dim
            <= headdim: rotary embeddings of k (new token t at position cache_seqlens[b] + t) and of q
            (token i at cache_seqlens[b] + i if causal or local, else all at cache_seqlens[b]), before
            the append; they need k, v. rotary_interleaved: GPT-J pairs (0, 1), (2, 3), ... (True) or
            GPT-NeoX pairs (d, d + rotary_dim / 2).
        cache_batch_idx: optional int32 (batch_size,): the row of a contiguous cache (of any number
            of rows) each entry reads and appends to (not with block_table, as flash-attn).
        cache_leftpad: optional int32 (batch_size,), 0 <= cache_leftpad[b] <= cache_seqlens[b]: entry
            b's sequence starts at that cache position (keys before it are not attended).
        block_table: optional int32 (batch_size, max_num_blocks_per_seq): page indices into the caches.
        softmax_scale: default 1/sqrt(headdim)
        causal: bottom-right aligned, as flash-attn: query i sees keys j <= i + seqlen_k - seqlen_q,
            seqlen_k = cache_seqlens + seqlen_new.
        window_size, softcap, alibi_slopes: as `flash_attn_func`, positions aligned as causal
        num_splits: KV splits (0: the variant's choice, by default the SM-count heuristic).
        return_softmax_lse: also return the log-sum-exp, (batch_size, nheads, seqlen_q) float32.
        variant: knob overrides for tests and tuning (see search_spaces/attn_decode.toml).
    Returns:
        out (batch_size, seqlen_q, nheads, headdim), in q's memory layout; (out, lse) with
        return_softmax_lse. Not differentiable (as flash-attn's).
    """
    check_flag("rotary_interleaved", rotary_interleaved)
    kvcache_args.check_batch_idx(cache_batch_idx, q, k_cache, block_table)
    kvcache_args.check_leftpad(cache_leftpad, q)
    seqlens, new = validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale,
                                    causal, num_splits, cache_batch_idx)
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    rotary_dim = kvcache_args.check_rotary(rotary_cos, rotary_sin, q, new, capacity)
    window, softcap = check_window(window_size), check_softcap(softcap)
    q_positional = rotary_dim and kvcache_args.q_is_positional(causal, window, capacity)
    # q's tokens past the new keys (seqlen_q > seqlen_new) rotate at positions past the append
    rotary_span = q.shape[1] if q_positional and q.shape[1] > new else 0
    kvcache_args.check_values(cache_batch_idx, cache_leftpad, seqlens, k_cache.shape[0], rotary_span,
                              rotary_cos.shape[0] if rotary_dim else 0)
    check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    variants = [name for name, used in (("window_size", window != (-1, -1)), ("softcap", softcap > 0),
                                        ("alibi_slopes", alibi_slopes is not None)) if used]
    if variant is not None and not isinstance(variant, collections.abc.Mapping):
        raise ValueError(f"variant must be a mapping of knob -> value (see search_spaces/attn_decode.toml), "
                         f"got {variant!r}")
    batch, q_len, heads, head_dim = q.shape
    # (head dim 0: nothing to scale; the empty output is returned as it is)
    scale = (1.0 / math.sqrt(head_dim) if head_dim else 1.0) if softmax_scale is None else float(softmax_scale)
    q_given = q  # (the output takes its memory layout; a rotated q is a new tensor)
    with torch.no_grad():
        if rotary_dim:
            q = kvcache_args.rotate(q, rotary_cos, rotary_sin, kvcache_args.rotary_positions(
                seqlens, q_len, q_positional), rotary_interleaved)
            k = kvcache_args.rotate(k, rotary_cos, rotary_sin, kvcache_args.rotary_positions(seqlens, new, True),
                                    rotary_interleaved)
        if new:
            kvcache_args.append(k_cache, v_cache, k, v, seqlens, block_table, cache_batch_idx)
        total = seqlens if not new and seqlens.is_contiguous() else (seqlens + new).to(torch.int32).contiguous()
        # the keys each entry sees, as the kernels read them: keys 0 .. total - 1 of a (block-)table
        k_cache, v_cache, block_table, total = kvcache_args.visible_keys(k_cache, v_cache, block_table,
                                                                         cache_batch_idx, cache_leftpad, total)
        reason = (_unsupported_reason(q, scale) or softcap_out_of_range(softcap, scale)) if q.numel() else None
        if reason is not None and variants:
            fall_back(reason, to="torch (autoflash.eager)")
            out, lse = _eager_decode(q, k_cache, v_cache, total, block_table, scale, causal, window, softcap,
                                     alibi_slopes)
            return (out, lse) if return_softmax_lse else out
        if reason is not None:
            _fallback(reason)
            out, lse = torch_decode(q, k_cache, v_cache, total, block_table, scale, causal)
            return (out, lse) if return_softmax_lse else out
        out = torch.empty_like(q_given)
        lse = torch.empty((batch, heads, q_len), device=q.device, dtype=torch.float32)
        score = ScoreArgs(window=window, softcap=softcap, alibi_slopes=alibi_slopes) if variants else None
        if q.numel():
            launch(q, k_cache, v_cache, out, lse, scale, causal, total, block_table, num_splits, variant, score)
    return (out, lse) if return_softmax_lse else out


def _eager_decode(q, k_cache, v_cache, total, block_table, scale, causal, window, softcap, alibi_slopes):
    """The variants in torch on the caches' dense view: (out (B, Q, H, D), lse (B, H, Q))."""
    k, v = dense_cache(k_cache, v_cache, block_table)
    out, lse = eager_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal=causal,
                               offset=total.long() - q.shape[1], window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, key_length=total)
    return out.transpose(1, 2), lse
