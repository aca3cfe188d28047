"""Attention variants the kernels do not compute yet, in plain torch: the right answer, slowly.

Sliding windows, logit softcaps, ALiBi slopes, attention sinks, additive biases and masks, dropout
and flash-attn's deterministic backward arrive through the drop-ins (flash-attn's arguments,
transformers' attention keywords). The forward and backward kernels compute windows, softcaps, ALiBi
and per-head sinks (`autoflash.variant_forward`); the calls the kernels do not serve (biases, masks
with a variant, dropout, decoding with a variant, per-query sinks)
run here, with one `FallbackWarning` per reason (`AUTOFLASH_STRICT=1`: a `FallbackError`): never the
answer without the argument.

Semantics (flash-attn's, which transformers' eager attention shares), on (B, H, N, D) tensors:
    s = q.k * scale;  s = softcap * tanh(s / softcap) if softcap;  s += bias + alibi
    query i sits at key position i + offset (offset = Nk - Nq for flash-attn: bottom-right);
    key j is visible iff j < key_length, j <= i + offset (causal), i + offset - left <= j (left >= 0),
    j <= i + offset + right (right >= 0) and the mask allows it;
    alibi adds -slope * |i + offset - j|;  a sink adds exp(sink) to the softmax's denominator.
Rows that see no key (and have no sink) give out = 0 and lse = +inf, as flash-attn.

Scores are computed in float32 (float64 for float64 inputs), a block of query rows at a time; with
autograd each block is recomputed in the backward (activation checkpointing), so memory stays
proportional to the block, not to Nq x Nk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SCORE_BLOCK_BYTES = 256 << 20  # the float32 scores of one block of query rows


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_batch(value, batch: int, device) -> torch.Tensor:
    """An int or a (B,) tensor as a (B, 1, 1, 1) int64 tensor."""
    t = torch.as_tensor(value, device=device, dtype=torch.int64).reshape(-1)
    return t.expand(batch).reshape(batch, 1, 1, 1)


def _rows(x, first: int, last: int, dim: int):
    """Rows [first, last) of a tensor broadcast along query rows at `dim` (size 1 there: as is)."""
    if x is None or x.shape[dim] == 1:
        return x
    return x.narrow(dim, first, last - first)


def _block(q, k, v, first: int, scale: float, causal: bool, offset, window, softcap: float, alibi, sinks,
           bias, mask, key_length, dropout_p: float):
    """Attention of query rows q (B, H, n, D) starting at row `first`: (out, lse) in the compute dtype."""
    n_q, n_k = q.shape[2], k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(first, first + n_q, device=q.device).view(1, 1, n_q, 1) + offset  # (B, 1, n, 1)
    j = torch.arange(n_k, device=q.device).view(1, 1, 1, n_k)
    if alibi is not None:
        s = s - alibi * (i - j).abs()
    if bias is not None:
        s = s + bias
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    visible = j < key_length if key_length is not None else torch.ones_like(j, dtype=torch.bool)
    if causal:
        visible = visible & (j <= i)
    left, right = window
    if left >= 0:
        visible = visible & (j >= i - left)
    if right >= 0:
        visible = visible & (j <= i + right)
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & mask
    s = s.masked_fill(~visible, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    p = torch.exp(s - row_max)
    total = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks - row_max)
    empty = total == 0
    p = p / torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("inf")), row_max + torch.log(total)).squeeze(-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v), lse


def eager_attention(q, k, v, *, scale: float, causal: bool = False, offset=0, window=(-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, sinks=None, bias=None, mask=None, key_length=None,
                    dropout_p: float = 0.0):
    """(out (B, H, Nq, Dv) in q's dtype, lse (B, H, Nq) float32) of the variants above.

    q: (B, H, Nq, D); k: (B, H_kv, Nk, D); v: (B, H_kv, Nk, Dv), H a multiple of H_kv.
    offset, key_length: ints or (B,) tensors; window: (left, right), -1 = unbounded;
    alibi_slopes: (H,) or (B, H); sinks: broadcastable to (B, H, Nq, 1) (a (H,) tensor is one logit
    per head); bias, mask: broadcastable to (B, H, Nq, Nk) (a bool mask: True = attend; a float mask
    is added to the scores). Differentiable in q, k, v, sinks, bias and a float mask.
    """
    batch, heads, n_q = q.shape[:3]
    in_dtype, dtype = q.dtype, _compute_dtype(q.dtype)
    group = heads // k.shape[1]
    k, v = (t.to(dtype).repeat_interleave(group, dim=1) if group > 1 else t.to(dtype) for t in (k, v))
    device = q.device
    offset = _per_batch(offset, batch, device)
    key_length = None if key_length is None else _per_batch(key_length, batch, device)
    if alibi_slopes is not None:
        alibi = alibi_slopes.to(device=device, dtype=dtype)
        alibi = alibi.reshape(-1, heads)[:, :, None, None]  # (1 or B, H, 1, 1)
    else:
        alibi = None
    if sinks is not None:
        sinks = sinks.to(dtype)
        sinks = sinks.reshape(1, heads, 1, 1) if sinks.dim() == 1 else sinks if sinks.dim() == 4 else sinks[..., None]
    bias = None if bias is None else bias.to(dtype)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    q = q.to(dtype)
    if n_q == 0 or k.shape[2] == 0:  # no query or no key: out 0, lse +inf (flash-attn's empty rows)
        out = q.new_zeros((*q.shape[:3], v.shape[-1])) + 0 * q.sum() + 0 * v.sum()  # (still in the graph)
        return out.to(in_dtype), torch.full(q.shape[:3], float("inf"), device=device)
    rows = max(1, SCORE_BLOCK_BYTES // max(1, batch * heads * k.shape[2] * 4))
    outs, lses = [], []
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sinks, bias, mask))
    for first in range(0, n_q, rows):
        last = min(n_q, first + rows)
        args = (q[:, :, first:last], k, v, first, scale, causal, offset, window, softcap, alibi,
                _rows(sinks, first, last, 2), _rows(bias, first, last, -2), _rows(mask, first, last, -2),
                key_length, dropout_p)
        if grad and n_q > rows:  # recompute the block in the backward: memory of one block, not Nq x Nk
            out, lse = checkpoint(_block, *args, use_reentrant=False)
        else:
            out, lse = _block(*args)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    return out.to(in_dtype), lse.float().detach()
