"""flash-attn's dense forms: `flash_attn_func`, `flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`
(flash-attn 2.8's signatures, argument for argument and in its positional order: code calls them
positionally), and `flash_attn_heads_first` for layers that hold (B, H, N, D) views.

Semantics are flash-attn's: causal and windows aligned bottom-right (query i sits at key position
i + seqlen_k - seqlen_q), GQA/MQA by head groups. What the kernels compute runs on them: plain attention
always, windows, softcaps and ALiBi, with autograd too (`autoflash.variant_forward`), dropout with
0 < p < 1, with those variants too (`autoflash.dropout`); the rest (p = 1, ...) runs in torch (`autoflash.eager`,
or torch SDPA) with one `FallbackWarning` per reason, never without the argument.
"""

from __future__ import annotations


import torch

from autoflash import api, variant_forward
from autoflash.eager import eager_attention
from autoflash.fallback import fall_back
from autoflash.kernel_cache import KernelCacheError
from autoflash.reference import sdpa_attention
from autoflash.score_variant import ScoreArgs, binding_window
from autoflash.validate import (check_alibi, check_flag, check_heads, check_numbers, check_softcap, check_tensors,
                                check_window, deterministic_backward, needs_autograd, softmax_scale_or_default,
                                unsupported_reason)

LAYOUT = "(batch, seqlen, heads, head_dim)"


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Drop-in for flash-attn's `flash_attn_func` (forward and backward).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim)
        k: (batch_size, seqlen_k, nheads_k, headdim); nheads_k divides nheads (MQA/GQA)
        v: (batch_size, seqlen_k, nheads_k, headdim)
        dropout_p: dropout on the attention probabilities, as flash-attn's (the LSE of the undropped
            scores): the kernels draw the mask (a fresh seed from torch's generator per call, drawn again
            in the backward: `autoflash.dropout`), with a window, softcap or ALiBi too; p = 1 runs in torch
        softmax_scale: default 1/sqrt(headdim)
        causal: causal mask aligned bottom-right, as flash-attn: query i sees keys
            j <= i + seqlen_k - seqlen_q; a query row that sees no key returns 0
        window_size: (left, right): query i sees keys in [i + seqlen_k - seqlen_q - left,
            i + seqlen_k - seqlen_q + right], -1 unbounded
        softcap: > 0 caps the scaled scores as softcap * tanh(s / softcap)
        alibi_slopes: (nheads,) or (batch_size, nheads) float32: adds -slope * |i + seqlen_k - seqlen_q - j|
            to the scores
            (window, softcap and ALiBi run on the kernels, their backward too, with dropout as well)
        deterministic: a bitwise repeatable backward (a backward variant without float32 atomics;
            torch.use_deterministic_algorithms(True) asks for it too)
        return_attn_probs: also return the log-sum-exp (flash-attn's testing output)
    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), contiguous; with return_attn_probs
        (out, softmax_lse (batch_size, nheads, seqlen_q) float32, natural log, +inf for rows that see
        no key, None): autoflash never materializes the probabilities, the third element is None.
    """
    if (return_attn_probs is False and type(deterministic) is bool and _plain(window_size, softcap, alibi_slopes)
            and _may_be_planned(q, k, v, dropout_p)):
        # (B, N, H, D) -> (B, H, N, D) views: the kernels take any strides, nothing is copied.
        out = _planned_heads_first(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, causal,
                                   deterministic)
        if out is not None:
            return out
    check_tensors(q, k, v, ("q", "k", "v"), LAYOUT)
    check_heads(q.shape[2], k.shape[2], True, "q", "k")
    check_numbers(dropout_p, softmax_scale, "softmax_scale")
    causal = check_flag("causal", causal)
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    check_alibi(alibi_slopes, q.shape[0], q.shape[2], q.device)
    deterministic = check_flag("deterministic", deterministic)
    return_lse = check_flag("return_attn_probs", return_attn_probs)
    out, lse = _heads_first(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p, softmax_scale,
                            causal, window, softcap, alibi_slopes, deterministic, return_lse)
    out = out.transpose(1, 2).contiguous()
    return (out, lse, None) if return_lse else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's `flash_attn_qkvpacked_func`: qkv (batch_size, seqlen, 3, nheads, headdim); the
    rest as `flash_attn_func`. Gradients reach qkv through its views."""
    _check_packed(qkv, "qkv", 5, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's `flash_attn_kvpacked_func`: q (batch_size, seqlen_q, nheads, headdim), kv
    (batch_size, seqlen_k, 2, nheads_k, headdim); the rest as `flash_attn_func`."""
    _check_packed(kv, "kv", 5, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def _check_packed(t, name: str, rank: int, dim: int, size: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != rank or t.shape[dim] != size:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor {layout}, got {got}")


def flash_attn_heads_first(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """`flash_attn_func` on (batch, heads, seqlen, headdim) views, the layout attention layers hold
    (transformers' attention functions receive them): the same semantics and result, (batch, seqlen_q,
    heads, headdim) contiguous. A repeated call goes straight to its plan: the six transposes of a
    round trip through `flash_attn_func` cost a model microseconds of host time per layer."""
    if _may_be_planned(q, k, v, dropout_p):
        out = _planned_heads_first(q, k, v, softmax_scale, causal)
        if out is not None:
            return out
    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                           softmax_scale=softmax_scale, causal=causal)


def _plain(window_size, softcap, alibi_slopes) -> bool:
    """No window, softcap or ALiBi (checked cheaply: the repeated-call path)."""
    return type(window_size) is tuple and window_size == (-1, -1) and softcap == 0 and alibi_slopes is None


def _may_be_planned(q, k, v, dropout_p) -> bool:
    """A flash-attn-form call the repeated-signature memo may hold: 4-D tensors, no dropout."""
    return type(dropout_p) in (int, float) and not dropout_p and all(
        isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))


def _planned_heads_first(q, k, v, softmax_scale, causal, deterministic: bool = False):
    """flash-attn semantics (bottom-right causal, GQA) on (B, H, N, D) views of a call planned
    before: its output (B, N, H, D) contiguous; None for a new call."""
    if type(causal) is not bool:
        return None
    out = api.repeat_call(q, k, v, causal, softmax_scale, True, k.shape[2] - q.shape[2], deterministic)
    return None if out is None else out.transpose(1, 2).contiguous()


def _heads_first(q, k, v, dropout_p, scale, causal, window, softcap, alibi_slopes, deterministic, return_lse):
    """The flash-attn form on (B, H, N, D) views: (out (B, H, Nq, D), lse (B, H, Nq) or None)."""
    n_q, n_k = q.shape[2], k.shape[2]
    offset = n_k - n_q
    window, causal = binding_window(window, causal, n_q, n_k)
    training = needs_autograd(q, k, v)
    variants = [name for name, used in (("window_size", window != (-1, -1)), ("softcap", softcap > 0),
                                        ("alibi_slopes", alibi_slopes is not None))
                if used]
    sm_scale = softmax_scale_or_default(scale, q.shape[-1])
    if variants:
        score, why = ScoreArgs(window, softcap, alibi_slopes), "not served by the kernels yet"
        if not score.variant.plain and dropout_p > 0:  # rendered with the dropout too (autoflash.dropout)
            from autoflash import dropout

            served, why = dropout.serve(q, k, v, dropout_p, scale, causal, offset, training,
                                        deterministic_backward(deterministic), score=score)
            if served is not None:
                return served
        elif not score.variant.plain:  # the generated kernels compute them (and their backward)
            served, why = variant_forward.serve(q, k, v, dropout_p, scale, causal, offset, score, training,
                                                  deterministic_backward(deterministic))
            if served is not None:
                return served
        fall_back(f"{', '.join(variants)} ({why})", to="torch (autoflash.eager)")
        return eager_attention(q, k, v, scale=sm_scale, causal=causal, offset=offset, window=window, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    if dropout_p > 0:  # (the kernels draw the mask: flash-attn's semantics, the LSE of the undropped scores)
        from autoflash import dropout

        served, why = dropout.serve(q, k, v, dropout_p, scale, causal, offset, training,
                                    deterministic_backward(deterministic))
        if served is not None:
            return served if return_lse else (served[0], None)
        reason = why
    else:
        reason = unsupported_reason(q, k, v, None, dropout_p, scale, training=training)
    if reason is None:
        try:
            if return_lse and not training:
                return api.forward_with_lse(q, k, v, causal, offset, scale)
            # The kernels write the output in q's memory layout: (B, N, H, D) inputs, no copy.
            out = api.run_planned(q, k, v, causal, offset, scale, True, deterministic)
            if not return_lse:
                return out, None
            with torch.no_grad():  # (the differentiable path keeps its LSE inside: one more forward)
                return out, api.forward_with_lse(q.detach(), k.detach(), v.detach(), causal, offset, scale)[1]
        except KernelCacheError as e:  # nowhere to write kernels: the call still gets its answer
            reason = f"no usable kernel cache ({e})"
    fall_back(reason)
    if return_lse or (training and deterministic_backward(deterministic)):
        # (torch's SDPA backends on the GPU may add gradients with atomics: the eager path's are matmuls)
        return eager_attention(q, k, v, scale=sm_scale, causal=causal, offset=offset, dropout_p=dropout_p)
    return sdpa_attention(q, k, v, None, dropout_p, causal, offset, sm_scale), None
