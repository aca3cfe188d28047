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
                      causal, window, interleaved, rotary_start=None):
    """(out float64 (B, Q, H, D), lse (B, H, Q), the caches flash-attn leaves) step by step.
    rotary_start: FA3's rotary_seqlens (the first new token's rotary position; default cache_seqlens)."""
    batch, q_len, heads, _ = q.shape
    k_after, v_after = k_cache.clone(), v_cache.clone()
    new = 0 if k is None else k.shape[1]
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    qd = q.double()
    if cos is not None:  # positions: cache_seqlens[b] + t for the keys; q's as flash-attn's kernel picks them
        start = (seqlens if rotary_start is None else rotary_start).long()[:, None]
        k = rotary_reference(k, cos, sin, start + torch.arange(new), interleaved).to(k.dtype)
        local = causal or any(0 <= w < capacity for w in window)
        q_steps = torch.arange(q_len) if local else torch.zeros(q_len, dtype=torch.long)
        qd = rotary_reference(q, cos, sin, start + q_steps, interleaved)
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


# --------------------------------------------------------------------------- FA3's forms
def test_fa3_batched_form_with_rotary_serves_as_flash_attn_2():
    q, k_cache, v_cache, args = random_call(3, torch.float32)
    assert "rotary_cos" in args
    k2, v2 = k_cache.clone(), v_cache.clone()
    want, want_lse = call_fa2(q, k2, v2, args, positional=False)
    fa3_args = {("page_table" if name == "block_table" else name): value for name, value in args.items()}
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, **fa3_args)
    assert torch.equal(out, want) and torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    assert torch.equal(lse, want_lse.masked_fill(want_lse == float("inf"), float("-inf")))


def random_packed_call(seed, dtype):
    """A random FA3 call with cu_seqlens_q / cu_seqlens_k_new / rotary_seqlens (packed q and k, v
    with ragged lengths), and the per-entry flash-attn 2 arguments its reference runs one at a time."""
    q, k_cache, v_cache, args = random_call(seed, dtype)
    g = torch.Generator().manual_seed(1000 + seed)
    batch, heads, head_dim = q.shape[0], q.shape[2], q.shape[3]
    kv_heads, capacity = k_cache.shape[2], 24
    q_lens = torch.randint(0, 4, (batch,), generator=g).tolist()
    new_lens = torch.randint(0, 3, (batch,), generator=g).tolist() if "k" in args else [0] * batch
    if "rotary_cos" in args:
        new_lens = [max(n, 1) for n in new_lens]
    seqlens = torch.tensor([int(torch.randint(0, capacity - n + 1, (1,), generator=g)) for n in new_lens],
                           dtype=torch.int32)
    args["cache_seqlens"] = seqlens
    if "cache_leftpad" in args:
        args["cache_leftpad"] = torch.minimum(args["cache_leftpad"], seqlens)
    rand = lambda *shape: torch.randn(shape, generator=g).to(dtype)  # noqa: E731
    q = rand(sum(q_lens), heads, head_dim)
    cu = lambda lens: torch.tensor([0, *lens]).cumsum(0).to(torch.int32)  # noqa: E731
    args.update(cu_seqlens_q=cu(q_lens), max_seqlen_q=max(q_lens) + 1)
    if "k" in args:
        args.update(k=rand(sum(new_lens), kv_heads, head_dim), v=rand(sum(new_lens), kv_heads, head_dim),
                    cu_seqlens_k_new=cu(new_lens))
    if "rotary_cos" in args:
        args["rotary_cos"], args["rotary_sin"] = (t.repeat(2, 1) for t in (args["rotary_cos"], args["rotary_sin"]))
        args["rotary_seqlens"] = torch.randint(0, capacity, (batch,), generator=g).to(torch.int32)
    return q, k_cache, v_cache, args, q_lens, new_lens


def packed_reference(q, k_cache, v_cache, args, q_lens, new_lens):
    """Entry by entry through the float64 reference (each entry writes its own cache slots)."""
    k_after, v_after = k_cache.clone(), v_cache.clone()
    outs, lses = [], []
    q_cu, k_cu = [0], [0]
    for b, (n_q, n_new) in enumerate(zip(q_lens, new_lens)):
        q_cu.append(q_cu[-1] + n_q)
        k_cu.append(k_cu[-1] + n_new)
        one = lambda name: None if args.get(name) is None else args[name][b:b + 1]  # noqa: E731
        # (entry b alone: its cache row named, where a contiguous cache has one row per entry)
        rows = one("cache_batch_idx") if "block_table" in args or "cache_batch_idx" in args else torch.tensor([b])
        new_k = None if "k" not in args else args["k"][k_cu[b]:k_cu[b + 1]][None]
        new_v = None if "v" not in args else args["v"][k_cu[b]:k_cu[b + 1]][None]
        ref, ref_lse, k_after, v_after = kvcache_reference(
            q[q_cu[b]:q_cu[b + 1]][None], k_after, v_after, new_k, new_v, args.get("rotary_cos"),
            args.get("rotary_sin"), args["cache_seqlens"][b:b + 1], rows, one("cache_leftpad"),
            one("block_table"), args.get("softmax_scale") or 1 / math.sqrt(q.shape[-1]), args["causal"],
            args["window_size"], args.get("rotary_interleaved", True), one("rotary_seqlens"))
        outs.append(ref[0])
        lses.append(ref_lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1), k_after, v_after


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(24))
def test_fa3_packed_kvcache_calls_match_float64(seed):
    dtype = torch.float32 if seed % 2 else torch.float16
    q, k_cache, v_cache, args, q_lens, new_lens = random_packed_call(seed, dtype)
    ref, ref_lse, k_after, v_after = packed_reference(q, k_cache, v_cache, args, q_lens, new_lens)
    fa3_args = {("page_table" if name == "block_table" else name): value for name, value in args.items()}
    out, lse, _, _ = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, **fa3_args)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    ref_lse = ref_lse.masked_fill(ref_lse == float("inf"), float("-inf"))  # (FA3: -inf where no key)
    check_against_reference(out, lse.masked_fill(lse == float("-inf"), float("inf")), k_cache, v_cache,
                            (ref, ref_lse.masked_fill(ref_lse == float("-inf"), float("inf")), k_after, v_after),
                            dtype, "rotary_cos" in args)


# --------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(12))
def test_kvcache_arguments_on_the_gpu_bf16(seed, own_kernels):
    """bf16 on the GPU: flash-attn 2's form (rotary, cache_batch_idx, cache_leftpad) and FA3's packed
    form, against the float64 reference, caches included."""
    q, k_cache, v_cache, args = random_call(seed, torch.bfloat16)
    reference = reference_for(q, k_cache, v_cache, args)
    on_gpu = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
    q, k_cache, v_cache = q.cuda(), k_cache.cuda(), v_cache.cuda()
    out, lse = call_fa2(q, k_cache, v_cache, {n: on_gpu(a) for n, a in args.items()}, positional=seed % 2 == 0)
    ref, ref_lse, k_after, v_after = reference
    assert (out.cpu().double() - ref).norm() / max(ref.norm(), 1e-12) < 2e-2
    assert torch.equal(v_cache.cpu(), v_after)
    assert torch.allclose(k_cache.cpu().double(), k_after.double(), rtol=1e-2, atol=1e-2)
    q, k_cache, v_cache, args, q_lens, new_lens = random_packed_call(seed, torch.bfloat16)
    ref, _, k_after, v_after = packed_reference(q, k_cache, v_cache, args, q_lens, new_lens)
    fa3_args = {("page_table" if name == "block_table" else name): on_gpu(a) for name, a in args.items()}
    q, k_cache, v_cache = q.cuda(), k_cache.cuda(), v_cache.cuda()
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, **{**fa3_args, "return_softmax_lse": False})
    assert (out.cpu().double() - ref).norm() / max(ref.norm(), 1e-12) < 2e-2
    assert torch.equal(v_cache.cpu(), v_after)
    assert torch.allclose(k_cache.cpu().double(), k_after.double(), rtol=1e-2, atol=1e-2)
