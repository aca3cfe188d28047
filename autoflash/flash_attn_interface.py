"""FlashAttention-3's forms, as flash-attn ships them in `hopper/flash_attn_interface.py` (imported there
as `flash_attn_interface`): the same function names as flash-attn 2's with other signatures, so they
live in a module of their own, as in flash-attn, never behind the same function:

    from autoflash.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_combine

How they differ from the flash-attn 2 forms (`autoflash.flash_attn_func`, ...), as FA3 does:
- positional order: softmax_scale is the 4th argument (there is no dropout_p), then causal, qv, the FP8
  descales, window_size, attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin,
  return_attn_probs (flash_attn_varlen_func: seqused_q, seqused_k after max_seqlen_k);
- return_attn_probs=True returns (out, softmax_lse): two values, not flash-attn 2's three;
- softmax_lse of a row that sees no key is -inf (flash-attn 2: +inf);
- flash_attn_varlen_func takes seqused_q / seqused_k, and a cu_seqlens of None for a tensor with a
  batch dim; flash_attn_combine merges attention over key splits (`autoflash.combine`).
What runs where: these forms call the flash-attn 2 forms, so the kernels serve what they serve there
(window_size and softcap run in torch with one warning). Refused by name with a `FallbackError`: qv,
q/k/v_descale (FP8), attention_chunk > 0 and, in flash_attn_with_kvcache, scheduler_metadata
(flash_attn_with_kvcache serves cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q and rotary_seqlens on the
host ahead of the decode kernels: `autoflash.kvcache_varlen`).
Accepted, without effect on the answer (FA3's scheduling hints): num_splits (but in
flash_attn_with_kvcache, where it is the decode kernels' split count), pack_gqa, sm_margin.
"""

from __future__ import annotations

import numbers

import torch

from autoflash import decode, flash_attn, kvcache_varlen, varlen
from autoflash.combine import flash_attn_combine
from autoflash.fallback import FallbackError
from autoflash.validate import check_flag

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_combine",
           "flash_attn_with_kvcache"]


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's `flash_attn_func` (forward and backward).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim); k, v: (batch_size, seqlen_k, nheads_k, headdim),
            nheads_k dividing nheads (MQA/GQA)
        softmax_scale: default 1/sqrt(headdim); causal: aligned bottom-right (query i sees keys
            j <= i + seqlen_k - seqlen_q); window_size (left, right), softcap: as flash-attn 2's
        qv, q_descale, k_descale, v_descale, attention_chunk: not served (a FallbackError names them)
        num_splits, pack_gqa, sm_margin: scheduling hints, accepted and unused
        deterministic: a bitwise repeatable backward
        return_attn_probs: also return softmax_lse (batch_size, nheads, seqlen_q) float32
    Returns:
        out (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse) with return_attn_probs.
    """
    _refuse("flash_attn_func", qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    _check_hints(attention_chunk, num_splits, pack_gqa, sm_margin)
    return_lse = check_flag("return_attn_probs", return_attn_probs)
    result = flash_attn.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None,
                                        deterministic, return_lse)
    return (result[0], _fa3_lse(result[1])) if return_lse else result


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's `flash_attn_qkvpacked_func`: qkv (batch_size, seqlen, 3, nheads, headdim), or
    (batch_size, seqlen, nheads + 2 * nheads_k, headdim) with num_heads_q = nheads (GQA, q's heads
    first, then k's, then v's); the rest as `flash_attn_func`."""
    if isinstance(qkv, torch.Tensor) and qkv.dim() == 5 and qkv.shape[-3] == 3:
        q, k, v = qkv.unbind(dim=-3)
    elif (isinstance(qkv, torch.Tensor) and qkv.dim() == 4 and _int(num_heads_q)
          and 0 < num_heads_q < qkv.shape[2] and (qkv.shape[2] - num_heads_q) % 2 == 0):
        heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, heads_k, heads_k], dim=-2)
    else:
        got = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be a tensor (batch_size, seqlen, 3, nheads, headdim), or (batch_size, seqlen, "
                         f"nheads + 2 * nheads_k, headdim) with num_heads_q = nheads; got {got} and "
                         f"num_heads_q={num_heads_q!r}")
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's `flash_attn_varlen_func`: packed variable-length sequences.

    Args:
        q: (total_q, nheads, headdim) with cu_seqlens_q, or (batch_size, seqlen_q, nheads, headdim) with
            cu_seqlens_q=None; k, v: likewise with cu_seqlens_k (nheads_k dividing nheads)
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,) offsets from 0 to total, non-decreasing;
            sequence b's slot is rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence used (None with cu_seqlens None)
        seqused_q, seqused_k: optional int32 (batch_size,): only the first seqused[b] tokens of sequence
            b's slot are used (at most its slot's length). Query rows past them are not computed: their
            output is 0 (and their gradient 0), their softmax_lse -inf; keys past them are not attended.
            Causal and windows align bottom-right within the used lengths.
        the rest: as `flash_attn_func`, per sequence
    Returns:
        out shaped as q (headdim of v), or (out, softmax_lse) with return_attn_probs: (nheads, total_q)
        float32 for packed q, (batch_size, nheads, seqlen_q) for q with a batch dim.
    """
    _refuse("flash_attn_varlen_func", qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    _check_hints(attention_chunk, num_splits, pack_gqa, sm_margin)
    return_lse = check_flag("return_attn_probs", return_attn_probs)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor (total, nheads, headdim), got {type(t).__name__}")
    q_rows, cu_q, max_q, batched = _packed(q, cu_seqlens_q, max_seqlen_q, "q", "cu_seqlens_q")
    total_q = q_rows.shape[0]
    k_rows, cu_k, max_k, _ = _packed(k, cu_seqlens_k, max_seqlen_k, "k", "cu_seqlens_k")
    v_rows = _packed(v, cu_seqlens_k, max_seqlen_k, "v", "cu_seqlens_k")[0]
    if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) and cu_q.shape != cu_k.shape:
        raise ValueError(f"q and k must hold the same number of sequences, got {cu_q.numel() - 1} and "
                         f"{cu_k.numel() - 1}")
    used_q = _used_rows(seqused_q, cu_q, q_rows, "seqused_q", "cu_seqlens_q")
    used_k = _used_rows(seqused_k, cu_k, k_rows, "seqused_k", "cu_seqlens_k")
    if used_q is not None:
        q_rows, cu_q, max_q = q_rows.index_select(0, used_q[0]), used_q[1], _at_least(max_q, used_q[2], "max_seqlen_q")
    if used_k is not None:
        k_rows, v_rows = k_rows.index_select(0, used_k[0]), v_rows.index_select(0, used_k[0])
        cu_k, max_k = used_k[1], _at_least(max_k, used_k[2], "max_seqlen_k")
    result = varlen.flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k, 0.0, softmax_scale,
                                           causal, window_size, softcap, None, deterministic, return_lse)
    out, lse = (result[0], result[1]) if return_lse else (result, None)
    if used_q is not None:  # the used rows back in their slots; the others 0 (and -inf)
        rows = used_q[0]
        out = out.new_zeros((total_q, *out.shape[1:])).index_copy(0, rows, out)
        if lse is not None:
            lse = lse.new_full((lse.shape[0], out.shape[0]), float("-inf")).index_copy(1, rows, lse)
    if batched:
        out = out.view(q.shape[0], q.shape[1], *out.shape[1:])
        if lse is not None:
            lse = lse.view(lse.shape[0], q.shape[0], q.shape[1]).transpose(0, 1).contiguous()
    return (out, _fa3_lse(lse)) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FlashAttention-3's `flash_attn_with_kvcache`: `autoflash.flash_attn_with_kvcache` (flash-attn 2's
    form, its kernels and refusals) with FA3's names and positional order (page_table is flash-attn
    2's block_table), plus FA3's packed forms (`autoflash.kvcache_varlen`): cu_seqlens_q with
    max_seqlen_q (q (total_q, nheads, headdim)), cu_seqlens_k_new (k, v (total_new, nheads_k,
    headdim)), rotary_seqlens (int32 (batch_size,): the rotary position of each entry's first new
    token, in place of cache_seqlens). Returns out shaped as q, or with return_softmax_lse FA3's
    (out, softmax_lse, out_accum, softmax_lse_accum): softmax_lse (batch_size, nheads, seqlen_q), or
    (nheads, total_q) for packed q, -inf for a row with no key; the split accumulators are empty
    tensors (autoflash keeps its splits inside the decode kernels)."""
    _refuse("flash_attn_with_kvcache", qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            scheduler_metadata=scheduler_metadata)
    _check_hints(attention_chunk, 1, pack_gqa, sm_margin)
    return_lse = check_flag("return_softmax_lse", return_softmax_lse)
    if cu_seqlens_q is None and cu_seqlens_k_new is None and rotary_seqlens is None and max_seqlen_q is None:
        result = decode.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                                cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                                window_size, softcap, rotary_interleaved, None, num_splits, return_lse)
    else:  # packed q or new tokens, or rotary positions of their own (`autoflash.kvcache_varlen`)
        check_flag("rotary_interleaved", rotary_interleaved)
        result = kvcache_varlen.packed_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_seqlens, softmax_scale, causal,
            window_size, softcap, rotary_interleaved, num_splits, return_lse)
    if not return_lse:
        return result
    empty = torch.empty(0, device=result[0].device)
    return result[0], _fa3_lse(result[1]), empty, empty


# ----------------------------------------------------------------------------- argument checks and layouts
def _refuse(where: str, **arguments) -> None:
    """FA3 arguments autoflash does not serve: accepted at None, refused by name otherwise (never ignored)."""
    for name, value in arguments.items():
        if value is not None:
            raise FallbackError(f"{where}: {name} is not served by autoflash (FlashAttention-3's {name}); pass None")


def _int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_hints(attention_chunk, num_splits, pack_gqa, sm_margin) -> None:
    """attention_chunk changes the answer (refused unless 0); the others are FA3's scheduling hints: of the
    right kind, they are accepted and leave the answer as it is."""
    if not _int(attention_chunk) or attention_chunk < 0:
        raise ValueError(f"attention_chunk must be an int >= 0, got {attention_chunk!r}")
    if attention_chunk:
        raise FallbackError("attention_chunk > 0 (chunked attention) is not served by autoflash; pass 0")
    if not _int(num_splits) or not _int(sm_margin) or num_splits < 0 or sm_margin < 0:
        raise ValueError(f"num_splits and sm_margin must be ints >= 0, got {num_splits!r} and {sm_margin!r}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be None or a bool, got {pack_gqa!r}")


def _fa3_lse(lse):
    """FA3's log-sum-exp of a row with no key is -inf (autoflash's flash-attn 2 forms give +inf)."""
    return None if lse is None else lse.masked_fill(lse == float("inf"), float("-inf"))


def _packed(t, cu_seqlens, max_seqlen, name: str, cu_name: str):
    """(rows (total, nheads, headdim), cu_seqlens, max_seqlen, batched): a tensor with a batch dim
    (cu_seqlens None) as packed rows with even offsets; a packed one as it is (checked downstream)."""
    if cu_seqlens is not None:
        return t, cu_seqlens, max_seqlen, False
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"with {cu_name}=None, {name} must be a tensor (batch_size, seqlen, nheads, headdim), "
                         f"got {got}")
    batch, seqlen = t.shape[:2]
    if max_seqlen is not None and not (_int(max_seqlen) and max_seqlen >= seqlen):
        raise ValueError(f"max_seqlen for {name} must be None or an int >= its seqlen ({seqlen}), got {max_seqlen!r}")
    cu = torch.arange(batch + 1, device=t.device, dtype=torch.int32) * seqlen
    return t.reshape(batch * seqlen, *t.shape[2:]), cu, seqlen, True


def _used_rows(seqused, cu, rows, name: str, cu_name: str):
    """None without seqused; else (the used rows' indices, their cu_seqlens, the longest used length),
    after checking seqused (int32 (batch,), 0 <= seqused[b] <= the slot's length) and the offsets."""
    if seqused is None:
        return None
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{cu_name} must be an int32 tensor (batch_size + 1,)")
    offsets = cu.tolist()
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])) or offsets[-1] != rows.shape[0]:
        raise ValueError(f"{cu_name} must go from 0 to the total tokens ({rows.shape[0]}), non-decreasing, got "
                         f"{offsets[:8]}")
    batch = len(offsets) - 1
    if (not isinstance(seqused, torch.Tensor) or seqused.dtype != torch.int32 or seqused.shape != (batch,)
            or seqused.device != rows.device):
        got = (tuple(seqused.shape), seqused.dtype) if isinstance(seqused, torch.Tensor) else type(seqused).__name__
        raise ValueError(f"{name} must be an int32 tensor (batch_size,) = ({batch},) on {rows.device}, got {got}")
    used = seqused.tolist()
    slots = [b - a for a, b in zip(offsets, offsets[1:])]
    if any(not 0 <= u <= s for u, s in zip(used, slots)):
        raise ValueError(f"{name} must be between 0 and each sequence's length {slots}, got {used}")
    compact = torch.tensor([0, *used], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(rows.device)
    # row r of the compacted tensor is row offsets[b] + (r - compact[b]) of sequence b's slot
    counts = seqused.long()
    shift = torch.tensor(offsets[:-1], dtype=torch.long, device=rows.device) - compact[:-1].long()
    index = torch.arange(int(compact[-1]), device=rows.device) + shift.repeat_interleave(counts)
    return index, compact, max(used, default=0)


def _at_least(max_seqlen, longest: int, name: str) -> int:
    """The grid bound of the used sequences: FA3's max_seqlen, checked to cover them."""
    if not _int(max_seqlen) or max_seqlen < longest:
        raise ValueError(f"{name} must be an int >= the longest used sequence ({longest}), got {max_seqlen!r}")
    return longest
