"""`flash_attn_varlen_func`: attention over packed variable-length sequences, flash-attn's semantics.

The sequences of a batch are packed one after another in (total_tokens, H, D) tensors, with
cu_seqlens giving their offsets: no padding. One launch of the forward kernel (and of each backward
kernel) covers every sequence: its grid spans the longest sequence, each program reads its
sequence's bounds from cu_seqlens and exits when its tile starts past that sequence's end
(templates/attn_fwd.py.jinja and attn_bwd.py.jinja, `VARLEN`). The kernel is the winner of the
dense problem of the longest sequence (its own family, else the default one: `Dispatcher.varlen_kernel_for`).

Calls the kernels do not take (a dtype, device or head dim they do not support, a non-positive
scale) run sequence by sequence through `flash_attn_func`, which falls back to torch SDPA with one
warning per reason (`AUTOFLASH_STRICT=1`: an error).
"""

from __future__ import annotations

import math

import torch

from autoflash import api
from autoflash.decode_validate import validate_varlen
from autoflash.dispatch import get_dispatcher
from autoflash.training import first_order


def _packed_views(*tensors):
    """(total, H, D) -> (1, H, total, D) views: the dense kernels' layout, for kernel choice."""
    return [t.unsqueeze(0).transpose(1, 2) for t in tensors]


class VarlenAttention(torch.autograd.Function):
    """Forward and backward of packed sequences on autoflash's own kernels (one launch per kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, sm_scale: float, causal: bool):
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
        kernel = get_dispatcher().varlen_kernel_for(*_packed_views(q, k, v, out), causal, "fwd", max_q, max_k)
        kernel.forward_varlen(q, k, v, out, lse, cu_q, cu_k, max_q, sm_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, sm_scale, causal)
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, sm_scale, causal = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernel = get_dispatcher().varlen_kernel_for(*_packed_views(q, k, v, grad_out), causal, "bwd", max_q, max_k)
        kernel.backward_varlen(q, k, v, out, lse, grad_out, dq, dk, dv, cu_q, cu_k, max_q, max_k, sm_scale, causal)
        return dq, dk, dv, None, None, None, None, None, None


def _kernels_take(q, k, v, softmax_scale) -> bool:
    """The packed kernels take this call (dtype, device, head dims, scale): else sequence by sequence."""
    return api._unsupported_reason(q[None], k[None], v[None], None, 0.0, softmax_scale) is None


class _NoAttention(torch.autograd.Function):
    """No query or no key in the whole batch: out = 0, and zero gradients (not a missing graph)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.like = [(t.shape, t.dtype, t.device) for t in (q, k, v)]  # (not the tensors: their memory)
        return q.new_zeros((*q.shape[:2], v.shape[2]))

    @staticmethod
    def backward(ctx, grad_out):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)


def _per_sequence(q, k, v, cu_q, cu_k, softmax_scale, causal):
    """Sequence by sequence through `flash_attn_func` (its fallbacks included), on views."""
    outs = []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # (zeros with zero gradients, not a piece cut off from the graph)
            outs.append(_NoAttention.apply(q[q0:q1], k[k0:k1], v[k0:k1]))
            continue
        outs.append(api.flash_attn_func(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
                                        softmax_scale=softmax_scale, causal=causal)[0])
    if not outs:
        return _NoAttention.apply(q, k, v)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


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
        out: (total_q, nheads, headdim). Differentiable w.r.t. q, k, v. A query sequence with no
        key gives 0 (and zero gradients).

    Validation reads cu_seqlens on the host (one sync per call): offsets that do not match the
    tensors are a ValueError, never an out-of-bounds read.
    """
    cu_q, cu_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _NoAttention.apply(q, k, v)
    if not _kernels_take(q, k, v, softmax_scale):
        return _per_sequence(q, k, v, cu_q, cu_k, softmax_scale, causal)
    longest_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    longest_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    # The grid spans the longest sequences actually present (max_seqlen_* may be larger).
    return VarlenAttention.apply(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), longest_q, longest_k,
                                 sm_scale, causal)
