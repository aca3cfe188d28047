"""flash_attn_with_kvcache's rotary_cos/rotary_sin/rotary_interleaved, cache_batch_idx and cache_leftpad
(flash-attn 2's and FA3's forms) against a float64 reference written step by step from flash-attn's
semantics (tests/test_flash_attn.py::test_flash_attn_kvcache there): rotate q and the new keys,
append into the cache in place, pick cache rows, mask the left padding, attend bottom-right aligned.
The caches after the call are checked too (the in-place update is part of the contract).

CPU: the decode kernels in Triton's interpreter (fp32/fp16, small shapes); GPU (`-m gpu`): bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

import autoflash
from autoflash import flash_attn_interface as fa3

# The positional order of the flash-attn 2 form (all arguments given positionally in half the calls).
FA2_ORDER = ["k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
             "block_table", "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved",
             "alibi_slopes", "num_splits", "return_softmax_lse"]
FA2_DEFAULTS = dict(k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                    cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                    return_softmax_lse=False)


# --------------------------------------------------------------------------- the float64 reference
def rotary_reference(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb_torch, in float64: x (B, T, H, D), positions (B, T)."""
    x = x.double()
    r = 2 * cos.shape[1]
    c, s = cos.double()[positions][:, :, None], sin.double()[positions][:, :, None]  # (B, T, 1, r / 2)
    part = x[..., :r]
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        x1, x2 = part[..., 0::2], part[..., 1::2]
        half_turn = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        x1, x2 = part[..., :r // 2], part[..., r // 2:]
        half_turn = torch.cat((-x2, x1), dim=-1)
    return torch.cat((part * c + half_turn * s, x[..., r:]), dim=-1)


def logical(cache, block_table, row, entry):
    """Entry `entry`'s whole logical sequence (capacity, H_kv, D): cache row `row`, or its pages."""
    if block_table is None:
        return cache[row]
    return cache[block_table[entry].long()].flatten(0, 1)


def kvcache_reference(q, k_cache, v_cache, k, v, cos, sin, seqlens, batch_idx, leftpad, block_table, scale,
                      causal, window, interleaved):
    """(out float64 (B, Q, H, D), lse (B, H, Q), the caches flash-attn leaves) step by step."""
    batch, q_len, heads, _ = q.shape
    k_after, v_after = k_cache.clone(), v_cache.clone()
    new = 0 if k is None else k.shape[1]
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    qd = q.double()
    if cos is not None:  # positions: cache_seqlens[b] + t for the keys; q's as flash-attn's kernel picks them
        steps = torch.arange(new)
        k = rotary_reference(k, cos, sin, seqlens.long()[:, None] + steps, interleaved).to(k.dtype)
        local = causal or any(0 <= w < capacity for w in window)
        q_steps = torch.arange(q_len) if local else torch.zeros(q_len, dtype=torch.long)
        qd = rotary_reference(q, cos, sin, seqlens.long()[:, None] + q_steps, interleaved)
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((batch, heads, q_len), float("inf"), dtype=torch.float64)
    for b in range(batch):
        row = int(batch_idx[b]) if batch_idx is not None else b
        n0 = int(seqlens[b])
        for t in range(new):  # the append, written into the cache itself
            pos = n0 + t
            if block_table is None:
                k_after[row, pos], v_after[row, pos] = k[b, t], v[b, t]
            else:
                page = k_cache.shape[1]
                block = int(block_table[b, pos // page])
                k_after[block, pos % page], v_after[block, pos % page] = k[b, t], v[b, t]
        start, end = (int(leftpad[b]) if leftpad is not None else 0), n0 + new
        keys = logical(k_after, block_table, row, b)[start:end].double()
        values = logical(v_after, block_table, row, b)[start:end].double()
        n = end - start  # keys counted from the left padding: bottom-right alignment within them
        group = heads // k_cache.shape[2]
        for h in range(heads):
            s = qd[b, :, h] @ keys[:, h // group].T * scale
            i, j = torch.arange(q_len)[:, None], torch.arange(n)[None, :]
            visible = torch.ones(q_len, n, dtype=torch.bool)
            if causal:
                visible &= j <= i + n - q_len
            if window[0] >= 0:
                visible &= j >= i + n - q_len - window[0]
            if window[1] >= 0:
                visible &= j <= i + n - q_len + window[1]
            s = s.masked_fill(~visible, float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)
            lse[b, h] = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))
            out[b, :, h] = torch.softmax(s, dim=-1).nan_to_num(0.0) @ values[:, h // group]
    return out, lse, k_after, v_after


# --------------------------------------------------------------------------- random calls
def random_call(seed, dtype):
    """A random valid call: (q, k_cache, v_cache, arguments by name, reference inputs)."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa: E731
    batch, q_len, new = pick([1, 2, 3]), pick([1, 1, 3]), pick([0, 1, 2])
    heads, kv_heads = pick([(4, 2), (2, 2), (4, 1)])
    head_dim = pick([16, 32])
    paged = pick([False, False, True])
    rotary = new > 0 and pick([True, True, False])
    use_batch_idx = not paged and pick([True, False])
    use_leftpad = pick([True, False])
    causal = pick([True, False])
    window = pick([(-1, -1), (-1, -1), (3, 0), (2, 100)])
    rand = lambda *shape: torch.randn(shape, generator=g).to(dtype)  # noqa: E731
    capacity, page = 24, 8
    seqlens = torch.randint(0, capacity - new + 1, (batch,), generator=g).to(torch.int32)
    seqlens[0] = capacity - new  # (one full cache after the append: the last slot is written)
    args = dict(cache_seqlens=seqlens, causal=causal, window_size=window, softmax_scale=pick([None, 0.3]),
                return_softmax_lse=True, num_splits=pick([0, 1, 3]))
    if paged:
        blocks = batch * (capacity // page) + 2
        k_cache, v_cache = rand(blocks, page, kv_heads, head_dim), rand(blocks, page, kv_heads, head_dim)
        args["block_table"] = torch.randperm(blocks, generator=g)[:batch * (capacity // page)].view(
            batch, -1).to(torch.int32)
    else:
        rows = batch + (2 if use_batch_idx else 0)
        k_cache, v_cache = rand(rows, capacity, kv_heads, head_dim), rand(rows, capacity, kv_heads, head_dim)
        if use_batch_idx:
            args["cache_batch_idx"] = torch.randperm(rows, generator=g)[:batch].to(torch.int32)
    if use_leftpad:
        args["cache_leftpad"] = (torch.rand(batch, generator=g) * (seqlens.float() + 1)).long().clamp(
            max=seqlens.long()).to(torch.int32)
    if new:
        args["k"], args["v"] = rand(batch, new, kv_heads, head_dim), rand(batch, new, kv_heads, head_dim)
    if rotary:
        rotary_dim = pick([head_dim, head_dim // 2])
        # (q's tokens past the new keys rotate at positions past the cache: rows for them too)
        seqlen_ro = capacity + max(0, q_len - new) + pick([0, 5])
        angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=g) * 2 * math.pi
        args["rotary_cos"], args["rotary_sin"] = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
        args["rotary_interleaved"] = pick([True, False])
    q = rand(batch, q_len, heads, head_dim)
    return q, k_cache, v_cache, args


def call_fa2(q, k_cache, v_cache, args, positional: bool):
    if positional:
        values = {**FA2_DEFAULTS, **args}
        return autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, *(values[name] for name in FA2_ORDER))
    return autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, **args)


def reference_for(q, k_cache, v_cache, args):
    scale = args.get("softmax_scale") or 1 / math.sqrt(q.shape[-1])
    return kvcache_reference(q, k_cache, v_cache, args.get("k"), args.get("v"), args.get("rotary_cos"),
                             args.get("rotary_sin"), args["cache_seqlens"], args.get("cache_batch_idx"),
                             args.get("cache_leftpad"), args.get("block_table"), scale, args["causal"],
                             args["window_size"], args.get("rotary_interleaved", True))


def check_against_reference(out, lse, k_cache, v_cache, reference, dtype, rotary: bool):
    ref, ref_lse, k_after, v_after = reference
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    err = (out.double() - ref).norm().item() / max(ref.norm().item(), 1e-12)
    assert not torch.isnan(out).any() and err < tol, err
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite].double(), ref_lse[finite], rtol=0, atol=1e-3)
    assert torch.equal(v_cache, v_after)  # values are appended as they are, nothing else written
    if rotary:  # rotated keys: float32 products vs float64, each rounded once to the cache's dtype
        assert torch.allclose(k_cache.double(), k_after.double(), rtol=1e-3 if dtype == torch.float16 else 1e-6,
                              atol=1e-3 if dtype == torch.float16 else 1e-6)
    else:
        assert torch.equal(k_cache, k_after)


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(48))
def test_random_kvcache_calls_match_float64(seed):
    dtype = torch.float32 if seed % 2 else torch.float16
    q, k_cache, v_cache, args = random_call(seed, dtype)
    reference = reference_for(q, k_cache, v_cache, args)
    out, lse = call_fa2(q, k_cache, v_cache, args, positional=seed % 4 < 2)
    assert out.shape == q.shape and out.dtype == dtype
    check_against_reference(out, lse, k_cache, v_cache, reference, dtype, "rotary_cos" in args)
