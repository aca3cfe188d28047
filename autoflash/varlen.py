"""`flash_attn_varlen_func`: attention over packed variable-length sequences, flash-attn's semantics.

The sequences of a batch are packed one after another in (total_tokens, H, D) tensors, with
cu_seqlens giving their offsets: no padding. One launch of the forward kernel (and of each backward
kernel) covers every sequence: its grid spans the longest sequence, each program reads its
sequence's bounds from cu_seqlens and exits when its tile starts past that sequence's end
(the triton_fwd and triton_bwd families, `VARLEN`). The kernel is the winner of the
dense problem of the longest sequence (its own family, else the default one: `Dispatcher.varlen_kernel_for`).

Windows, softcaps and ALiBi run in one launch of the forward kernel rendered with them
(`autoflash.variant_forward`), and with autograd in one launch of each backward kernel rendered with
them too (`VarlenAttention`). Calls the kernels do not take (a dtype, device or head dim they do not
support, a non-positive scale, dropout) run
sequence by sequence through `flash_attn_func`, which runs dropout (0 < p < 1, no variant) on the dense
dropout kernels, a seed per sequence (`autoflash.dropout`), and the rest in torch with one warning per reason
(`AUTOFLASH_STRICT=1`: an error). A deterministic backward runs on the packed kernels, in a variant
without float32 atomics. A paged K/V (`block_table`) is read in place by a forward kernel rendered to find
each key tile's page in the table (TMA, pages a multiple of the tile) or each key row's (pointer loads),
for inference without attention variants; other paged calls, and long ones on pages smaller than a
tile (`POINTER_PAGES_MAX_FLOPS`), gather the pages into packed tensors first.
"""

from __future__ import annotations


import torch

from autoflash import variant_forward
from autoflash.decode_validate import validate_varlen
from autoflash.dispatch import get_dispatcher
from autoflash.flash_attn import flash_attn_func
from autoflash.score_variant import PLAIN, ScoreArgs
from autoflash.training import first_order
from autoflash.validate import (check_alibi, check_flag, check_numbers, check_softcap, check_window,
                                deterministic_backward, needs_autograd, output_like, softmax_scale_or_default,
                                unsupported_reason)


def _packed_views(*tensors):
    """(total, H, D) -> (1, H, total, D) views: the dense kernels' layout, for kernel choice."""
    return [t.unsqueeze(0).transpose(1, 2) for t in tensors]


class VarlenAttention(torch.autograd.Function):
    """Forward and backward of packed sequences on autoflash's own kernels (one launch per kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, sm_scale: float, causal: bool,
                deterministic: bool = False, score: ScoreArgs | None = None):
        """score: the attention variants' values (windows, softcap, ALiBi; None: plain), rendered into
        both kernels (no gradient: slopes and softcap get none, as flash-attn's)."""
        variant = PLAIN if score is None else score.variant
        out = output_like(q, v)
        lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
        kernel = get_dispatcher().varlen_kernel_for(*_packed_views(q, k, v, out), causal, "fwd", max_q, max_k,
                                                    score=variant)
        kernel.forward_varlen(q, k, v, out, lse, cu_q, cu_k, max_q, sm_scale, causal,
                              **({} if score is None else {"score_args": score}))
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, sm_scale, causal, deterministic, score)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order
    def backward(ctx, grad_out, grad_lse):  # (the LSE is an output for the caller, not differentiable)
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, sm_scale, causal, deterministic, score = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernel = get_dispatcher().varlen_kernel_for(*_packed_views(q, k, v, grad_out), causal, "bwd", max_q, max_k,
                                                    deterministic, score=PLAIN if score is None else score.variant)
        kernel.backward_varlen(q, k, v, out, lse, grad_out, dq, dk, dv, cu_q, cu_k, max_q, max_k, sm_scale, causal,
                               **({} if score is None else {"score_args": score}))
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _kernels_take(q, k, v, softmax_scale) -> bool:
    """The packed kernels take this call (dtype, device, head dims, scale): else sequence by sequence."""
    return unsupported_reason(q[None], k[None], v[None], None, 0.0, softmax_scale,
                              training=needs_autograd(q, k, v)) is None


class _NoAttention(torch.autograd.Function):
    """No query or no key in the whole batch: out = 0, and zero gradients (not a missing graph)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.like = [(t.shape, t.dtype, t.device) for t in (q, k, v)]  # (not the tensors: their memory)
        return q.new_zeros((*q.shape[:2], v.shape[2]))

    @staticmethod
    def backward(ctx, grad_out):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)


def _per_sequence(q, k, v, cu_q, cu_k, softmax_scale, causal, extras: dict, return_lse: bool):
    """Sequence by sequence through `flash_attn_func` (its fallbacks included), on views: (out, lse
    (H, total_q) or None). `extras`: flash-attn's dropout_p, window_size, softcap, alibi_slopes (a
    (batch, H) one is sliced per sequence) and deterministic."""
    outs, lses = [], []
    alibi = extras.get("alibi_slopes")
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # (zeros with zero gradients, not a piece cut off from the graph)
            outs.append(_NoAttention.apply(q[q0:q1], k[k0:k1], v[k0:k1]))
            lses.append(q.new_full((q.shape[1], q1 - q0), float("inf"), dtype=torch.float32))
            continue
        seq_extras = {**extras, "alibi_slopes": alibi[i] if alibi is not None and alibi.dim() == 2 else alibi}
        result = flash_attn_func(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
                                 softmax_scale=softmax_scale, causal=causal, return_attn_probs=return_lse, **seq_extras)
        out, lse = (result[0], result[1]) if return_lse else (result, None)
        outs.append(out[0])
        lses.append(None if lse is None else lse[0])
    lse = None
    if return_lse:
        lse = torch.cat(lses, dim=1) if lses else q.new_full((q.shape[1], 0), float("inf"), dtype=torch.float32)
    if not outs:
        return _NoAttention.apply(q, k, v), lse
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)), lse


def _check_pages(k_cache, v_cache, block_table, cu_seqlens_k) -> int:
    """The tokens the paged caches hold for the batch (cu_seqlens_k[-1]), after checking the caches,
    the table and the offsets: sequence b's tokens are the first cu_seqlens_k[b+1] - cu_seqlens_k[b]
    rows of its pages block_table[b]. One host read checks the offsets, the lengths against the
    table's width and the page indices each sequence uses (entries past a sequence's pages are never
    read, so never checked)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4 or not isinstance(v_cache, torch.Tensor) \
            or v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError("with block_table, k and v must be paged caches (num_blocks, page_block_size, nheads_k, "
                         "headdim) agreeing in their first three dims")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError("block_table must be an int32 tensor (batch_size, max_num_blocks_per_seq)")
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.shape != (block_table.shape[0] + 1,):
        raise ValueError(f"cu_seqlens_k must have batch_size + 1 = {block_table.shape[0] + 1} entries with block_table")
    if cu_seqlens_k.device != block_table.device or block_table.device != k_cache.device:
        raise ValueError(f"block_table ({block_table.device}), cu_seqlens_k ({cu_seqlens_k.device}) and the caches "
                         f"({k_cache.device}) must be on one device")
    page, lengths = k_cache.shape[1], cu_seqlens_k.diff().long()
    width = block_table.shape[1]
    used = torch.arange(width, device=block_table.device)[None, :] < ((lengths + page - 1) // page)[:, None]
    table = block_table.long()
    none = torch.zeros(1, dtype=torch.long, device=lengths.device)
    first, total, low, longest, least_page, most_page = torch.cat([
        cu_seqlens_k[:1].long(), cu_seqlens_k[-1:].long(), torch.cat([lengths, none]).min()[None],
        torch.cat([lengths, none]).max()[None], torch.cat([torch.where(used, table, 0).flatten(), none]).min()[None],
        torch.cat([torch.where(used, table, -1).flatten(), none - 1]).max()[None]]).tolist()
    if first != 0 or low < 0 or longest > page * width:
        raise ValueError(f"cu_seqlens_k must be offsets from 0 asking no more tokens than block_table's "
                         f"{width} pages of {page} hold: lengths {lengths.tolist()[:8]}")
    if least_page < 0 or most_page >= k_cache.shape[0]:
        raise ValueError(f"block_table holds page indices outside [0, {k_cache.shape[0]})")
    return total


def _gather_pages(k_cache, v_cache, block_table, cu_seqlens_k, total: int):
    """Packed (total_k, H_kv, D) keys and values of checked paged caches (`_check_pages`): a copy, for
    the calls the paged kernel does not serve (gradients reach the pages through it)."""
    # One gather of every token's row, computed on the device: (sequence, position) -> page, row in it.
    # (A slice and a concatenation per page cost ~10 us of host time each.)
    page, lengths = k_cache.shape[1], cu_seqlens_k.diff().long()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    pos = torch.arange(total, device=seq.device) - cu_seqlens_k[seq].long()
    pages = block_table[seq, pos // page].long()
    # (indexing the page and the row in it: no copy of a cache whose first two dims are no view's)
    return k_cache[pages, pos % page], v_cache[pages, pos % page]


def _packed_stand_ins(k_cache, v_cache, total: int):
    """(total, H_kv, D) tensors of the caches' dtype and device holding no memory (stride 0): the
    packed keys and values a paged call stands for, for validation and kernel choice."""
    return [c.new_empty(1).expand(total, *c.shape[2:]) for c in (k_cache, v_cache)]


# Pages smaller than a TMA key tile are read a row at a time by pointer loads, a kernel that ran at
# ~0.66x the contiguous call's TMA kernel on an H100 (2026-12-06, 32/8 heads d128, 16-token pages): on
# long calls a gathered copy (host reads and small kernels of fixed cost, then the TMA kernel) costs
# less (0.906x at 2048 new queries against 16k cached keys, where pointer loads gave 0.656x), on short
# ones more (0.519x and 0.535x at 512 x 4k and 1024 x 1k, where pointer loads gave 0.614x and 0.676x).
# The attention work (4 x D x H x sum of Nq x Nk) above which such pages are gathered:
POINTER_PAGES_MAX_FLOPS = 5e11


def _paged_forward(q, k_cache, v_cache, k, v, block_table, cu_seqlens_q, cu_seqlens_k, cu_q: list, cu_k: list,
                   sm_scale: float, causal: bool):
    """(out, lse (H, total_q)) of packed queries against paged caches, one launch of the forward kernel
    rendered to find each key tile's (or row's) page in the block table (no gathered copy); None where
    that kernel reads a row at a time and a gathered copy costs less (`POINTER_PAGES_MAX_FLOPS`). k, v:
    the packed stand-ins (`_packed_stand_ins`); cu_q, cu_k: the offsets as read on the host."""
    lengths = [(b - a, d - c) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    longest_q, longest_k = max(n for n, _ in lengths), max(n for _, n in lengths)
    out = output_like(q, v)
    kernel = get_dispatcher().varlen_kernel_for(*_packed_views(q, k, v, out), causal, "fwd", longest_q, longest_k,
                                                pages=(k_cache.transpose(1, 2), v_cache.transpose(1, 2)))
    work = 4 * q.shape[1] * q.shape[2] * sum(nq * nk for nq, nk in lengths)
    if kernel.variant.as_dict().get("LOADS") == "pointer" and work > POINTER_PAGES_MAX_FLOPS:
        return None
    lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
    kernel.forward_varlen(q, k_cache, v_cache, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                          longest_q, sm_scale, causal, block_table=block_table)
    return out, lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Drop-in for flash-attn's `flash_attn_varlen_func` (flash-attn 2.8's signature and positional order).

    Args:
        q: (total_q, nheads, headdim), the batch's sequences packed one after another
        k, v: (total_k, nheads_k, headdim); nheads_k divides nheads (MQA/GQA); with block_table,
            paged caches (num_blocks, page_block_size, nheads_k, headdim)
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,): offsets, starting at 0, non-decreasing,
            ending at total_q / total_k
        max_seqlen_q, max_seqlen_k: ints >= the longest query / key sequence
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic: as
            `flash_attn_func`, per sequence (bottom-right aligned per sequence)
        return_attn_probs: also return the log-sum-exp, (nheads, total_q) float32
        block_table: optional int32 (batch_size, max_num_blocks_per_seq): k, v are pages
    Returns:
        out: (total_q, nheads, headdim); (out, softmax_lse, None) with return_attn_probs.
        Differentiable w.r.t. q, k, v. A query sequence with no key gives 0 (and zero gradients).

    Validation reads cu_seqlens on the host (one sync per call): offsets that do not match the
    tensors are a ValueError, never an out-of-bounds read.
    """
    caches = None
    if block_table is not None:
        total_k = _check_pages(k, v, block_table, cu_seqlens_k)
        caches, (k, v) = (k, v), _packed_stand_ins(k, v, total_k)
    cu_q, cu_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal)
    return_lse = check_flag("return_attn_probs", return_attn_probs)
    # (a deterministic backward matters only where there is one: the forward kernels are deterministic)
    training = needs_autograd(q, *(caches or (k, v)))
    deterministic = deterministic_backward(check_flag("deterministic", deterministic)) and training
    extras = _extras(q, cu_q, dropout_p, window_size, softcap, alibi_slopes)
    if caches is not None:
        if not (training or extras) and q.shape[0] and total_k and _kernels_take(q, k, v, softmax_scale):
            served = _paged_forward(q, *caches, k, v, block_table, cu_seqlens_q, cu_seqlens_k, cu_q, cu_k,
                                    softmax_scale_or_default(softmax_scale, q.shape[-1]), causal)
            if served is not None:
                return (*served, None) if return_lse else served[0]
        # (gradients, attention variants, dropout, what the kernels refuse, long calls on small pages: a copy)
        k, v = _gather_pages(*caches, block_table, cu_seqlens_k, total_k)
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, softmax_scale, causal, extras, return_lse,
                       deterministic)
    return (out, lse, None) if return_lse else out


def _extras(q, cu_q, dropout_p, window_size, softcap, alibi_slopes) -> dict:
    """flash-attn's arguments beyond the kernels', checked: {} when every one is at its default."""
    check_numbers(dropout_p, None, "softmax_scale")
    extras = {"dropout_p": dropout_p, "window_size": check_window(window_size), "softcap": check_softcap(softcap),
              "alibi_slopes": alibi_slopes}
    check_alibi(alibi_slopes, len(cu_q) - 1, q.shape[1], q.device)
    default = {"dropout_p": 0, "window_size": (-1, -1), "softcap": 0.0, "alibi_slopes": None}
    return {} if all(extras[name] is value or extras[name] == value for name, value in default.items()) else extras


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_q, cu_k, softmax_scale, causal, extras: dict, return_lse: bool,
            deterministic: bool = False):
    """(out, lse (H, total_q) or None) of a validated call. deterministic: a bitwise repeatable backward."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        lse = q.new_full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32) if return_lse else None
        return _NoAttention.apply(q, k, v), lse
    longest_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    longest_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    if extras and not extras["dropout_p"]:
        score = ScoreArgs(extras["window_size"], extras["softcap"], extras["alibi_slopes"])
        if not needs_autograd(q, k, v):
            served, _why = variant_forward.serve_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, longest_q, longest_k,
                                                        softmax_scale, causal, score)
            if served is not None:  # (else sequence by sequence: flash_attn_func says why, once per reason)
                return served[0], (served[1] if return_lse else None)
        elif variant_forward.unsupported(*_packed_views(q, k, v), 0.0, softmax_scale, score, training=True) is None:
            sm_scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
            out, lse = VarlenAttention.apply(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), longest_q,
                                             longest_k, sm_scale, causal, deterministic, score)
            return out, (lse if return_lse else None)
    if extras or not _kernels_take(q, k, v, softmax_scale):
        return _per_sequence(q, k, v, cu_q, cu_k, softmax_scale, causal, {**extras, "deterministic": deterministic},
                             return_lse)
    sm_scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    # The grid spans the longest sequences actually present (max_seqlen_* may be larger).
    out, lse = VarlenAttention.apply(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), longest_q,
                                     longest_k, sm_scale, causal, deterministic)
    return out, (lse if return_lse else None)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn's `flash_attn_varlen_qkvpacked_func`: qkv (total, 3, nheads, headdim); the rest as
    `flash_attn_varlen_func` with the same offsets for queries and keys."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be a tensor (total, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's `flash_attn_varlen_kvpacked_func`: kv (total_k, 2, nheads_k, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must be a tensor (total_k, 2, nheads_k, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
