"""Calls with attention variants (sliding window, softcap, ALiBi, sinks) on the generated kernels: what
the drop-ins (`flash_attn_func`, `flash_attn_varlen_func`, the transformers integration) call.

The kernel is the forward family's, rendered with the call's variants (`score_variant`): the
dispatcher looks its winner up under the problem key with the variants (`Problem.score_variant`),
else serves the family's default variant for the shape. A call that needs a gradient runs the
backward family's kernel rendered with the same variants (`autoflash.variant_training`).
"""

from __future__ import annotations


import torch

from autoflash import decode_kernels
from autoflash.dispatch import get_dispatcher
from autoflash.kernel_cache import KernelCacheError
from autoflash.score_variant import ScoreArgs
from autoflash.validate import output_like, softcap_out_of_range, softmax_scale_or_default, unsupported_reason


def unsupported(q, k, v, dropout_p, scale, score: ScoreArgs, training: bool) -> str | None:
    """Why the kernels cannot compute this call's variants, or None. q, k, v: (B, H, N, D) views
    (or the (1, H, total, D) views of packed tensors). training: the backward kernel too."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile: attention variants have no registered op yet"
    if reason := unsupported_reason(q, k, v, None, dropout_p, scale, training=training):
        return reason
    heads = q.shape[1]
    sinks = score.sinks
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,)
                              or not sinks.dtype.is_floating_point or sinks.device != q.device):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        return f"sinks of shape {shape} (the kernels take one float logit per query head, ({heads},), on q's device)"
    if score.alibi_slopes is not None and not score.alibi_slopes.dtype.is_floating_point:
        return f"alibi_slopes of dtype {score.alibi_slopes.dtype} (the kernels take float slopes)"
    return softcap_out_of_range(score.softcap, softmax_scale_or_default(scale, q.shape[-1]))


def serve(q, k, v, dropout_p, scale, causal: bool, offset: int, score: ScoreArgs, training: bool,
          deterministic: bool = False):
    """((out (B, H, Nq, D) in q's memory layout, lse (B, H, Nq) float32), None) when the kernels compute
    this call, else (None, why). offset: query i sits at key position i + offset (flash-attn:
    Nk - Nq), for the causal mask, the window and ALiBi alike. training: the output is differentiable
    (in q, k, v and the sinks) through the backward kernel; deterministic: a bitwise repeatable one."""
    why = unsupported(q, k, v, dropout_p, scale, score, training)
    if why is not None:
        return None, why
    sm_scale = softmax_scale_or_default(scale, q.shape[-1])
    if training:
        from autoflash import variant_training

        try:
            return variant_training.attention(q, k, v, sm_scale, causal, offset, score, deterministic), None
        except KernelCacheError as e:
            return None, f"no usable kernel cache ({e})"
    if _decoding_step(q, k, v, offset, score):
        try:
            return decode_kernels.short_query_attention(q, k, v, sm_scale, causal, score, with_lse=True), None
        except KernelCacheError as e:
            return None, f"no usable kernel cache ({e})"
    out = output_like(q, v)  # q's memory layout: (B, N, H, D) inputs, no copy
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    try:
        kernel = get_dispatcher().kernel_for(q, k, v, out, causal, own_only=True, score=score.variant)
    except KernelCacheError as e:  # nowhere to write kernels: the call still gets its answer
        return None, f"no usable kernel cache ({e})"
    kernel.forward(q, k, v, out, lse, sm_scale, causal, offset, score_args=score)
    return (out, lse), None


def _decoding_step(q, k, v, offset: int, score: ScoreArgs) -> bool:
    """A decoding step the decode kernels compute with its variants: a few queries at the end of the
    keys (query i at key position i + N_k - N_q: the decode kernels' alignment, for the causal mask,
    the window and ALiBi alike), one head dim, no user score_mod or mask_mod."""
    n_q, n_k = q.shape[2], k.shape[2]
    return (decode_kernels.decode_shaped(n_q, n_k, False, 0) and offset == n_k - n_q
            and v.shape[-1] == q.shape[-1] and not score.variant.user)


def serve_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, longest_q: int, longest_k: int, scale, causal: bool,
                 score: ScoreArgs):
    """Packed sequences, validated, forward only: ((out (total_q, H, D), lse (H, total_q)), None) or
    (None, why). Windows, ALiBi and causality are bottom-right per sequence; (B, H) slopes per sequence."""
    views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)]
    why = unsupported(*views, 0.0, scale, score, training=False)
    if why is not None:
        return None, why
    sm_scale = softmax_scale_or_default(scale, q.shape[-1])
    out = output_like(q, v)
    lse = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
    try:
        kernel = get_dispatcher().varlen_kernel_for(*views, out.unsqueeze(0).transpose(1, 2), causal, "fwd",
                                                    longest_q, longest_k, score=score.variant)
    except KernelCacheError as e:
        return None, f"no usable kernel cache ({e})"
    kernel.forward_varlen(q, k, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), longest_q,
                          sm_scale, causal, score_args=score)
    return (out, lse), None
