"""`flex_attention`: attention with a user's own score and mask functions, FlexAttention's signatures,
on the generated kernels.

    def relative(score, b, h, q_idx, kv_idx):
        return score - 0.1 * abs(q_idx - kv_idx)
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    out = autoflash.flex_attention(q, k, v, score_mod=relative, mask_mod=causal)   # (B, H, N, D)

Each function is traced once into Triton statements (`autoflash.score_mods`: what it may use, and the
error naming its line for what it may not) and rendered into the forward kernel, and where the call
needs gradients into the backward kernels too, with the score_mod's derivative in the score (traced from
the same function: `Traced.derivative`), a kernel per distinct function (its code's hash is in the
kernel's name and problem key). Gradients reach q, k and v; a score_mod's own tensors get none (it
reads no tensors: the tracer refuses them). What the kernels do not run goes to torch with a
`FallbackWarning` naming the reason (an error under AUTOFLASH_STRICT=1), computing the same functions
on the materialized scores: a function with a construct the tracer refuses (its line named: a Python
branch on a traced value, a tensor indexed by one, ...), more than 65535 batch x heads.
Every KV tile of such a kernel is masked (no block skipping for a mask_mod yet: the cost is that of full
attention, whatever the mask leaves out).
"""

from __future__ import annotations

import torch

from autoflash import fallback, score_mods, variant_forward
from autoflash.codegen import GRID_AXIS_MAX
from autoflash.score_variant import ScoreArgs
from autoflash.validate import softmax_scale_or_default


def flex_attention(query, key, value, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False,
                   return_lse=False):
    """softmax(score_mod(q k^T * scale) where mask_mod) v for (B, H, N, D) tensors (K/V with fewer
    heads under `enable_gqa`). score_mod(score, b, h, q_idx, kv_idx) -> score; mask_mod(b, h, q_idx,
    kv_idx) -> bool. A row that sees no key gives 0 (and an LSE of -inf). return_lse: also the
    natural-log log-sum-exp (B, H, Nq) float32."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("flex_attention takes (batch, heads, seqlen, head_dim) tensors")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"{query.shape[1]} query heads and {key.shape[1]} key heads: pass enable_gqa=True")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{key.shape[1]} key heads do not divide {query.shape[1]} query heads")
    why = None
    try:
        args = ScoreArgs(score_mod=score_mods.trace_score_mod(score_mod) if score_mod is not None else None,
                         mask_mod=score_mods.trace_mask_mod(mask_mod) if mask_mod is not None else None)
    except score_mods.ScoreModError as e:  # (what the kernels cannot run, named by its line: torch runs it)
        why = str(e)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if why is None and query.shape[0] * query.shape[1] > GRID_AXIS_MAX:
        # (such a call is launched in batch slices, whose kernels count b from 0 again)
        why = f"batch x heads above {GRID_AXIS_MAX} with a user's score or mask function"
    if why is None:
        served, why = variant_forward.serve(query, key, value, 0.0, scale, False, 0, args, training=training)
        if served is not None:
            out, lse = served  # (a row that sees no key: LSE +inf from the kernels, -inf as FlexAttention's)
            return (out, lse.masked_fill(lse == float("inf"), float("-inf"))) if return_lse else out
    fallback.fall_back(why, to="torch (materialized scores)")
    out, lse = eager(query, key, value, score_mod, mask_mod, softmax_scale_or_default(scale, query.shape[-1]))
    return (out, lse.float()) if return_lse else out


def eager(query, key, value, score_mod, mask_mod, scale: float):
    """The same attention on the materialized scores, in float32 (float64 for float64 inputs): the
    user's functions called on whole tensors, as FlexAttention's reference does. Differentiable.
    Returns (out in query's dtype, the natural-log LSE in the working dtype)."""
    group = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(group, 1) if group > 1 else t for t in (key, value))
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = (query.to(work) @ k.to(work).transpose(-1, -2)) * scale
    b, h, nq, nk = scores.shape
    device = scores.device
    index = (torch.arange(b, device=device).view(b, 1, 1, 1), torch.arange(h, device=device).view(1, h, 1, 1),
             torch.arange(nq, device=device).view(1, 1, nq, 1), torch.arange(nk, device=device).view(1, 1, 1, nk))
    if score_mod is not None:
        scores = score_mod(scores, *index)
    if mask_mod is not None:
        scores = scores.masked_fill(~torch.broadcast_to(mask_mod(*index), scores.shape), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # a row seeing no key: 0
    return (probs @ v.to(work)).to(query.dtype), lse
