"""`flash_attn_combine`: FlashAttention-3's merge of attention computed over splits of the keys.

Attention over keys split into parts K_1 .. K_s (each part's output O_i normalized over its own keys,
with its log-sum-exp L_i) is attention over all the keys: L = logsumexp_i L_i, O = sum_i exp(L_i - L) O_i.
FA3's `flash_attn_combine` runs this as a CUDA kernel; here it is a few torch ops (float32, on any
device), differentiable, for code that splits the keys itself (across devices, pages, a ring).

Layouts are FA3's (hopper/flash_api.cpp, `mha_combine`): out_partial (num_splits, batch, seqlen, nheads,
headdim) float32, lse_partial (num_splits, batch, seqlen, nheads) float32 (FA3's tests pass a transposed
view of (num_splits, batch, nheads, seqlen): any strides are fine here). Returns out (batch, seqlen,
nheads, headdim) in out_dtype and lse (batch, seqlen, nheads) float32 (a transposed view of a (batch,
nheads, seqlen) tensor, as FA3's).
"""

from __future__ import annotations

import torch

OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merge per-split attention outputs by their log-sum-exps (FlashAttention-3's signature).

    Args:
        out_partial: (num_splits, batch_size, seqlen, nheads, headdim) float32: each split's output,
            normalized over that split's keys
        lse_partial: (num_splits, batch_size, seqlen, nheads) float32: each split's log-sum-exp (natural
            log); -inf for a row that saw no key in that split (FA3's convention). +inf, which
            flash-attn 2 and autoflash's flash-attn 2 forms give such rows, is read the same way.
        out: optional (batch_size, seqlen, nheads, headdim) tensor of dtype out_dtype, written in place
        out_dtype: float32 (default: out_partial's), float16 or bfloat16
    Returns:
        (out (batch_size, seqlen, nheads, headdim), lse (batch_size, seqlen, nheads) float32). A row that
        no split saw any key for gives out 0 and lse -inf.
    """
    _check(out_partial, lse_partial)
    out_dtype = out_partial.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of float32, float16, bfloat16, got {out_dtype}")
    lse_partial = lse_partial.masked_fill(lse_partial == float("inf"), float("-inf"))  # (empty rows, FA2's way)
    lse = torch.logsumexp(lse_partial, dim=0)  # (-inf where every split is empty)
    # exp(L_i - L) with a row that no split saw giving 0 for every split (not exp(-inf - -inf) = NaN)
    weights = torch.exp(lse_partial - lse.masked_fill(lse == float("-inf"), 0.0))
    merged = (weights.unsqueeze(-1) * out_partial).sum(dim=0)
    lse = lse.transpose(1, 2).contiguous().transpose(1, 2)  # FA3's layout: (batch, seqlen, nheads) of (b, h, s)
    if out is None:
        return merged.to(out_dtype), lse
    if not isinstance(out, torch.Tensor) or out.shape != merged.shape or out.dtype != out_dtype:
        got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a {out_dtype} tensor (batch_size, seqlen, nheads, headdim) = "
                         f"{tuple(merged.shape)}, got {got}")
    if out.device != out_partial.device:
        raise ValueError(f"out must be on out_partial's device {out_partial.device}, got {out.device}")
    out.copy_(merged)  # (in place, as FA3 writes it: through autograd too when the partials need gradients)
    return out, lse


def _check(out_partial, lse_partial) -> None:
    """ValueError where FA3's combine refuses its inputs: ranks, float32, shapes, devices."""
    for t, name, layout in ((out_partial, "out_partial", "(num_splits, batch_size, seqlen, nheads, headdim)"),
                            (lse_partial, "lse_partial", "(num_splits, batch_size, seqlen, nheads)")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a float32 tensor {layout}, got {type(t).__name__}")
        if t.dim() != len(layout.split(",")):
            raise ValueError(f"{name} must be {len(layout.split(','))}-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (FlashAttention-3's combine takes float32 only), got {t.dtype}")
    if lse_partial.shape != out_partial.shape[:4]:
        raise ValueError(f"lse_partial must be (num_splits, batch_size, seqlen, nheads) = "
                         f"{tuple(out_partial.shape[:4])} for out_partial {tuple(out_partial.shape)}, "
                         f"got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"out_partial and lse_partial must be on one device, got {out_partial.device} and "
                         f"{lse_partial.device}")
