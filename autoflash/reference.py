"""The yardsticks: random inputs, the float64 reference, error measures, and torch SDPA.

Everything that says what the right answer is lives here, below both the public API (whose
fallback is `sdpa_attention`) and the tuning side (whose gate compares candidates with
`reference` and with SDPA's own error). It imports neither.
"""

from __future__ import annotations

import torch

from autoflash.problem import Shape


def make_inputs(shape: Shape, device, seed: int = 0, layout: str = "bhnd", draw_on_device: bool = False):
    """Random normal q, k, v in (B, H, N, D) form. layout='bnhd' returns (B,N,H,D)-strided views.

    Drawn by a CPU generator (the same values on any device) unless draw_on_device: then by the
    device's own generator (other values than the CPU's, the same on every call with that seed), for
    timing inputs, whose values do not matter: a host draw costs ~5 ns an element, seconds for a
    long training problem's q, k, v and output gradient, while the GPU waits."""
    on = torch.device(device) if draw_on_device else torch.device("cpu")
    g = torch.Generator(device=on).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def rand(b, n, h, d=shape.head_dim):
        t = torch.randn((b, n, h, d), generator=g, dtype=torch.float32, device=on).to(device=device, dtype=dtype)
        return t.transpose(1, 2) if layout == "bnhd" else t.transpose(1, 2).contiguous()

    q = rand(shape.batch, shape.seqlen_q, shape.heads_q)
    k = rand(shape.batch, shape.seqlen_k, shape.heads_kv)
    v = rand(shape.batch, shape.seqlen_k, shape.heads_kv, shape.value_dim)  # (MLA: V's head dim of its own)
    return q, k, v


def output_grad(shape: Shape, device, seed: int, draw_on_device: bool = False):
    """A random gradient of the output, (B, H_q, N_q, D_v): q's draw of that seed where V has q's head
    dim (the inputs the backward gate and timing always used)."""
    import dataclasses

    return make_inputs(dataclasses.replace(shape, head_dim=shape.value_dim, head_dim_v=None), device, seed=seed,
                       draw_on_device=draw_on_device)[0]


def paged_cache(k: torch.Tensor, v: torch.Tensor, page: int, generator: torch.Generator | None = None):
    """The tokens of contiguous caches k, v (B, N, H_kv, D) in a paged cache: (k_pages, v_pages,
    block_table), pages (B * ceil(N / page), page, H_kv, D) in a shuffled order (the last page of each
    sequence zero-padded), block_table (B, ceil(N / page)) int32."""
    batch, n, heads, d = k.shape
    per_seq = -(-n // page)
    perm = torch.randperm(batch * per_seq, generator=generator, device=k.device)
    pages = []
    for src in (k, v):
        dst = torch.zeros(batch * per_seq, page, heads, d, device=k.device, dtype=k.dtype)
        dst[perm] = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, per_seq * page - n)).reshape(-1, page, heads, d)
        pages.append(dst)
    return pages[0], pages[1], perm.view(batch, per_seq).to(torch.int32)


def causal_offset_for(shape: Shape, align: str) -> int:
    return shape.seqlen_k - shape.seqlen_q if align == "bottom_right" else 0


def reference(q, k, v, causal: bool, causal_offset: int, scale: float, dtype=torch.float64, score=None):
    """(out, lse) in `dtype` from the math definition. Rows with no visible key: out 0, lse +inf.
    score: the attention variants' values (`ScoreArgs`; None: plain), computed by `eager_attention`'s
    math (flash-attn's semantics) in `dtype`."""
    if score is not None:
        return variant_attention(q, k, v, causal, causal_offset, scale, score, dtype)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + causal_offset, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return p @ v, lse


def variant_attention(q, k, v, causal: bool, offset: int, scale: float, score, dtype):
    """(out, lse) of `eager_attention` with the variants of `score` (`ScoreArgs`), inputs cast to
    `dtype` (float64: the reference; float32: scores in float32, as eager computes half inputs),
    out in `dtype`. Differentiable in q, k, v."""
    from autoflash.eager import eager_attention

    q, k, v = (t.to(dtype) for t in (q, k, v))
    return eager_attention(q, k, v, scale=scale, causal=causal, offset=offset, window=tuple(score.window),
                           softcap=score.softcap, alibi_slopes=score.alibi_slopes, sinks=score.sinks)


def rel_error(x, ref) -> float:
    x = x.to(ref.dtype)
    if torch.isnan(x).any():
        return float("nan")
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)


def lse_error(lse, ref_lse) -> float:
    if torch.isnan(lse).any():
        return float("nan")
    ref_lse = ref_lse.to(lse.device)
    finite = torch.isfinite(ref_lse)
    if not bool((lse[~finite] == float("inf")).all()):
        return float("inf")
    if not finite.any():
        return 0.0
    return (lse.double()[finite] - ref_lse.double()[finite]).abs().max().item()


def sdpa_error(q, k, v, causal: bool, causal_offset: int, scale: float, ref_out, score=None) -> float:
    """torch SDPA's own error in the input dtype (the yardstick for the gate). With variants (`score`)
    SDPA has no equivalent but a float mask per call (softcap has none at all): the yardstick is then
    the same math in torch as a model's eager attention runs it (`eager_attention`: float32 scores
    for half inputs, the output rounded to the input dtype), as the decode gate's is."""
    if score is not None:
        return rel_error(variant_attention(q, k, v, causal, causal_offset, scale, score, q.dtype)[0], ref_out)
    out = sdpa_attention(q, k, v, None, 0.0, causal, causal_offset, scale)
    return rel_error(out, ref_out)


def sdpa_attention(q, k, v, attn_mask, dropout_p, causal, causal_offset, scale):
    """torch SDPA on (B, H, N, D) tensors, with bottom-right causal expressed as a mask."""
    import torch.nn.functional as F

    group = q.shape[1] // k.shape[1] if k.shape[1] else 1  # (zero heads: an empty output, as SDPA)
    if group > 1:  # portable GQA (enable_gqa is not supported by every backend)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if causal and causal_offset != 0:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        mask = j <= i + causal_offset
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        return out.masked_fill(~mask.any(dim=1)[:, None], 0.0)  # rows with no visible key: 0, as flash-attn
    if scale is not None and not float(scale) > 0:
        # Seen with torch 2.11 on CPU: the default SDPA backend returns NaN for a causal mask with
        # a scale <= 0; the math backend does not.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=causal, scale=scale)


def torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's SDPA with exactly these arguments (`autoflash.attention`'s fallback): its answer and
    its refusals are torch's, whatever backend torch picks for them."""
    import torch.nn.functional as F

    def call():
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)

    out = call()
    # torch's CPU flash kernel answers NaN where the definition does not (a scale <= 0 with a causal
    # mask, +inf; torch 2.11-2.13): where it answers NaN, the math backend's answer, the definition.
    # Only with a dropout in [0, 1] (the math backend takes a negative or NaN dropout as none, where the
    # default one refuses it), and torch's own answer stands where the math backend refuses what the
    # default one took (an explicit mask with is_causal). On the CPU only: looking at the answer is free
    # there (on a GPU it would sync, and CUDA graphs capture torch's path as it is).
    if query.device.type == "cpu" and _in_unit_interval(dropout_p) and out.isnan().any():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel(SDPBackend.MATH):
                return call()  # (a dropout draws again: its first answer was NaN)
        except RuntimeError:
            pass
    return out


def _in_unit_interval(p) -> bool:
    try:
        return 0.0 <= float(p) <= 1.0
    except (TypeError, ValueError, RuntimeError):
        return False


def sdpa_grads(q, k, v, grad, causal, offset, scale, score=None):
    """SDPA's gradients in the input dtype; with variants (`score`), eager's (see `sdpa_error`)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if score is not None:
        variant_attention(*leaves, causal, offset, scale, score, q.dtype)[0].backward(grad)
    else:
        sdpa_attention(*leaves, None, 0.0, causal, offset, scale).backward(grad)
    return [t.grad for t in leaves]


def reference_grads(q, k, v, grad, causal, offset, scale, dtype=torch.float64, score=None):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = reference(*leaves, causal, offset, scale, dtype=dtype, score=score)
    out.backward(grad.to(dtype))
    return [t.grad for t in leaves]


def sdpa_backend(name: str):
    """'cudnn' / 'flash' / 'efficient' / 'math' (optionally 'sdpa_'-prefixed) -> torch's SDPBackend member."""
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name.removeprefix("sdpa_")]


def dense_cache(k_cache, v_cache, block_table):
    """(k, v) (B, N, H_kv, D) of a contiguous cache (as it is) or a paged one (its pages gathered in
    order; entries past a sequence's pages are clamped to a valid page, to be masked by length)."""
    if block_table is None:
        return k_cache, v_cache
    page = k_cache.shape[1]
    pos = torch.arange(page * block_table.shape[1], device=k_cache.device)
    pages = block_table[:, pos // page].long().clamp(0, k_cache.shape[0] - 1)
    return k_cache[pages, pos % page], v_cache[pages, pos % page]


def decode_reference(q, k_cache, v_cache, seqlens, block_table, scale: float, causal: bool):
    """Decode attention in torch (the fallback of `flash_attn_with_kvcache`, and in float64 the
    decode gate's reference): (out (B, Q, H, D), lse (B, H, Q) float32, +inf for rows with no key).
    q (B, Q, H, D); caches (B, N, H_kv, D), or pages with a block table; seqlens: keys per sequence;
    causal: bottom-right (query i sees keys j <= i + seqlen - Q)."""
    batch, q_len, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = dense_cache(k_cache, v_cache, block_table)
    qf = q.to(dtype).reshape(batch, q_len, kv_heads, heads // kv_heads, head_dim)
    s = torch.einsum("bqhgd,bnhd->bhgqn", qf, k.to(dtype)) * scale
    j = torch.arange(k.shape[1], device=q.device)
    length = seqlens.long().view(batch, 1, 1, 1, 1)
    visible = j < length
    if causal:
        visible = visible & (j <= torch.arange(q_len, device=q.device)[:, None] + length - q_len)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgqn,bnhd->bqhgd", p, v.to(dtype)).reshape(batch, q_len, heads, head_dim)
    lse = lse.masked_fill(lse == float("-inf"), float("inf")).reshape(batch, heads, q_len).float()
    return out.to(q.dtype), lse
