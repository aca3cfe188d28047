"""Differentiable calls with attention variants (sliding window, softcap, ALiBi, sinks) on the generated
kernels: the forward family's kernel and the backward family's, both rendered with the call's variants
(`score_variant`), each served under its own problem key with the variants (`Problem.score_variant`).

The backward recomputes the scores with the forward's hooks (softcap, ALiBi, the window's band only)
and differentiates through the softcap. Sinks change nothing in dQ, dK, dV (the forward's LSE includes
them); their own gradient is computed here, exactly, from the LSE and delta = rowsum(dO * O):
    d sink_h = -sum over the batch and the head's query rows of exp(sink_h - lse) * delta.
ALiBi slopes and the softcap get no gradient (as flash-attn); a window has none.
"""

from __future__ import annotations

import dataclasses

import torch

from autoflash.dispatch import get_dispatcher
from autoflash.score_variant import ScoreArgs
from autoflash.training import first_order
from autoflash.validate import output_like


def sinks_gradient(sinks: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks ((H,), sinks' dtype) from the forward's lse (B, H, Nq) float32, its output and the
    output's gradient (B, H, Nq, D). Rows with lse = +inf (none: a sink makes every lse finite) add 0."""
    delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, Nq)
    p_sink = torch.exp(sinks.detach().float()[None, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


class VariantAttention(torch.autograd.Function):
    """Forward and backward of (B, H, N, D) views with attention variants on the generated kernels.
    sinks: score.sinks as an input of the graph (its gradient), or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, score: ScoreArgs, sm_scale: float, causal: bool, offset: int,
                deterministic: bool):
        out = output_like(q, v)  # q's memory layout
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        kernel = get_dispatcher().kernel_for(q, k, v, out, causal, own_only=True, score=score.variant)
        kernel.forward(q, k, v, out, lse, sm_scale, causal, offset, score_args=score)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (score, sm_scale, causal, offset, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order  # (the backward kernels are not differentiable themselves)
    def backward(ctx, grad_out, grad_lse):  # (the LSE is an output for the caller, not differentiable)
        q, k, v, out, lse, sinks = ctx.saved_tensors
        score, sm_scale, causal, offset, deterministic = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernel = get_dispatcher().kernel_for(q, k, v, grad_out, causal, "bwd", own_only=True,
                                             deterministic=deterministic, score=score.variant)
        kernel.backward(q, k, v, out, lse, grad_out, dq, dk, dv, sm_scale, causal, offset, score_args=score)
        dsinks = sinks_gradient(sinks, lse, out, grad_out) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None


def attention(q, k, v, sm_scale: float, causal: bool, offset: int, score: ScoreArgs, deterministic: bool = False):
    """(out (B, H, Nq, D) in q's memory layout, differentiable in q, k, v and the sinks; lse (B, H, Nq)
    float32). offset: query i sits at key position i + offset (causal mask, window and ALiBi alike)."""
    sinks = score.sinks
    if sinks is not None and sinks.requires_grad:  # (the kernels read the values; the graph holds the tensor)
        score = dataclasses.replace(score, sinks=sinks.detach())
    return VariantAttention.apply(q, k, v, sinks, score, sm_scale, causal, offset, deterministic)
