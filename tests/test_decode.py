"""Decode (KV cache, paged or contiguous, Flash-Decoding splits) and varlen, against float64.

CPU: the kernels run in Triton's interpreter (fp32/fp16, tiny shapes). GPU tests (`-m gpu`):
bf16 numerics on realistic decode shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

from autoflash import api, codegen, decode, decode_kernels, flash_attn, kvcache_args
from autoflash.api import FallbackError, FallbackWarning
from autoflash.decode import flash_attn_with_kvcache
from autoflash.varlen import flash_attn_varlen_func
from autoflash.device import gpu_fingerprint
from autoflash.space import Variant

RAGGED = (0, 1, 17, 61)


# --------------------------------------------------------------------------- references and builders
def reference_decode(q, keys, values, causal, scale):
    """float64, one sequence at a time: keys[b], values[b] are (L_b, H_kv, D). Rows with no key: 0."""
    batch, q_len, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        k, v = keys[b].double(), values[b].double()
        n = k.shape[0]
        group = heads // k.shape[1]
        for h in range(heads):
            s = q[b, :, h].double() @ k[:, h // group].T * scale  # (Q, L)
            if causal:
                i = torch.arange(q_len)[:, None]
                s = s.masked_fill(torch.arange(n)[None, :] > i + n - q_len, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0)
            out[b, :, h] = p @ v[:, h // group]
    return out


def build_cache(seq_keys, capacity, layout, dtype, generator, table=None):
    """The same per-sequence keys as a contiguous cache (layout "contiguous") or a paged one with a
    shuffled block table (layout = page size; `table` reuses one). seq_keys: list of
    (capacity, H_kv, D) tensors. Returns (cache, block_table or None)."""
    batch = len(seq_keys)
    if layout == "contiguous":
        return torch.stack(seq_keys).to(dtype), None
    page = layout
    per_seq = math.ceil(capacity / page)
    num_blocks = batch * per_seq + 3  # a few pages nobody uses
    if table is None:
        table = torch.randperm(num_blocks, generator=generator)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    cache = torch.randn((num_blocks, page, *seq_keys[0].shape[1:]), generator=generator).to(dtype)
    for b in range(batch):
        padded = torch.zeros((per_seq * page, *seq_keys[b].shape[1:]))
        padded[:capacity] = seq_keys[b]
        for j in range(per_seq):
            cache[table[b, j]] = padded[j * page:(j + 1) * page].to(dtype)
    return cache, table


def make_problem(batch_lengths, q_len, heads, kv_heads, head_dim, capacity, layout, dtype, seed=0):
    """q (B, q_len, H, D), the caches, cache_seqlens, block table, and the per-sequence keys/values."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn((capacity, kv_heads, head_dim), generator=g) for _ in batch_lengths]
    values = [torch.randn((capacity, kv_heads, head_dim), generator=g) for _ in batch_lengths]
    q = torch.randn((len(batch_lengths), q_len, heads, head_dim), generator=g).to(dtype)
    k_cache, table = build_cache(keys, capacity, layout, dtype, g)
    v_cache, _ = build_cache(values, capacity, layout, dtype, g, table)
    seqlens = torch.tensor(batch_lengths, dtype=torch.int32)
    keys = [k.to(dtype) for k in keys]  # what the cache holds
    values = [v.to(dtype) for v in values]
    return q, k_cache, v_cache, seqlens, table, keys, values


def tol(dtype):
    return 2e-5 if dtype == torch.float32 else 3e-3


def check(out, ref, dtype):
    err = (out.double() - ref).norm().item() / max(ref.norm().item(), 1e-12)
    assert not torch.isnan(out).any()
    assert err < tol(dtype), err


# --------------------------------------------------------------------------- decode vs float64
CASES = [  # (q_len, heads, kv_heads, layout, num_splits, causal, dtype)
    (1, 4, 4, "contiguous", 1, False, torch.float32),
    (1, 4, 1, "contiguous", 3, False, torch.float16),
    (4, 4, 1, "contiguous", 0, True, torch.float32),
    (4, 2, 2, "contiguous", 8, True, torch.float16),
    (1, 4, 1, 16, 1, False, torch.float32),
    (1, 2, 2, 16, 4, True, torch.float16),
    (4, 4, 1, 16, 0, True, torch.float16),
    (4, 4, 4, 32, 2, False, torch.float32),
    (1, 4, 1, 32, 8, True, torch.float32),
    (4, 4, 1, 32, 1, True, torch.float16),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("q_len,heads,kv_heads,layout,num_splits,causal,dtype", CASES)
def test_decode_matches_float64(q_len, heads, kv_heads, layout, num_splits, causal, dtype):
    q, kc, vc, seqlens, table, keys, values = make_problem(RAGGED, q_len, heads, kv_heads, 32, 64, layout, dtype)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=causal,
                                       num_splits=num_splits, return_softmax_lse=True)
    scale = 1 / math.sqrt(32)
    ref = reference_decode(q, [k[:n] for k, n in zip(keys, RAGGED)], [v[:n] for v, n in zip(values, RAGGED)],
                           causal, scale)
    check(out, ref, dtype)
    assert out.shape == q.shape and out.dtype == dtype
    assert (out[0] == 0).all()  # cache_seqlens 0: no key, out 0
    assert torch.isinf(lse[0]).all() and lse.shape == (4, heads, q_len)
    _, ref_lse = decode.torch_decode(q.double(), kc.double(), vc.double(), seqlens, table, scale, causal)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite].double() - ref_lse[finite].double()).abs().max() < 1e-3


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["contiguous", "strided", 16])
@pytest.mark.parametrize("causal", [False, True])
def test_tma_loads_match_float64(layout, causal):
    """LOADS "tma": a contiguous cache through tensor descriptors (rows past each sequence's length,
    including a sequence of none, read as zeros); a paged cache, or a cache whose strides TMA cannot
    take, through pointers. Every case against float64."""
    q, kc, vc, seqlens, table, keys, values = make_problem(RAGGED, 2, 4, 2, 32, 64, 16 if layout == 16 else "contiguous",
                                                           torch.float32, seed=5)
    if layout == "strided":  # a (B, N, H_kv, D) view with a row stride of 17 floats: not TMA-aligned
        kc, vc = (torch.nn.functional.pad(t, (0, 1))[..., :32] for t in (kc, vc))
        assert not codegen.tma_compatible(kc)
    kernel = decode_kernels.load_kernel({**dict(decode_kernels.default_knobs(torch.float32, 32, 2, 2, 64, causal)),
                                         "LOADS": "tma", "NUM_SPLITS": 2})
    assert kernel.uses_tma
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"))
    kernel.decode(q, kc, vc, out, lse, 1 / math.sqrt(32), causal, seqlens, table)
    ref = reference_decode(q, [k[:n] for k, n in zip(keys, RAGGED)], [v[:n] for v, n in zip(values, RAGGED)],
                           causal, 1 / math.sqrt(32))
    check(out, ref, torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("page,knobs", [(8, {"BLOCK_N": 16}), (16, {"BLOCK_N": 32, "COMBINE": "loop"}),
                                        (48, {"BLOCK_N": 32, "NUM_SPLITS": 2}),
                                        (32, {"BLOCK_N": 16, "NUM_SPLITS": 4, "COMBINE": "loop"})])
def test_page_and_tile_sizes(page, knobs):
    """Pages smaller than a KV tile (or not a multiple of it) take the per-row page lookup."""
    q, kc, vc, seqlens, table, keys, values = make_problem(RAGGED, 2, 4, 2, 32, 64, page, torch.float32, seed=3)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=True, variant=knobs)
    ref = reference_decode(q, [k[:n] for k, n in zip(keys, RAGGED)], [v[:n] for v, n in zip(values, RAGGED)],
                           True, 1 / math.sqrt(32))
    check(out, ref, torch.float32)


@pytest.mark.interpreter
def test_strided_q_and_scale():
    q, kc, vc, seqlens, table, keys, values = make_problem((5, 40), 2, 4, 2, 24, 48, "contiguous", torch.float32)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    out = flash_attn_with_kvcache(qt, kc, vc, cache_seqlens=seqlens, softmax_scale=0.3, causal=True)
    ref = reference_decode(q, [k[:n] for k, n in zip(keys, (5, 40))], [v[:n] for v, n in zip(values, (5, 40))],
                           True, 0.3)
    check(out, ref, torch.float32)


@pytest.mark.interpreter
def test_split_heuristic():
    module = decode_kernels.load_kernel(dict(decode_kernels.default_knobs(torch.float16, 128, 4, 1, 4096, False))).host
    assert module.num_splits_for(64, 8, 1, 4096, 132) == 1  # 512 programs fill 132 SMs
    s = module.num_splits_for(1, 8, 1, 4096, 132)
    assert 2 <= s <= 64
    assert module.num_splits_for(1, 1, 1, 10, 132) == 1  # one KV tile: nothing to split
    assert module.num_splits_for(1, 1, 1, 4096, 132, requested=3) == 3
    # a paged cache: at least 6 programs per SM, a power-of-two split count (16 x 8 programs -> 8
    # splits; 64 x 8 -> 2), never more splits than tiles
    assert module.num_splits_for(16, 8, 1, 32768, 132, paged=True) == 8
    assert module.num_splits_for(64, 8, 1, 32768, 132, paged=True) == 2
    assert module.num_splits_for(16, 8, 1, 32768, 132) == 1
    assert module.num_splits_for(1, 1, 1, 100, 132, paged=True) == -(-100 // module.knobs["BLOCK_N"])


# --------------------------------------------------------------------------- appending k/v
@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["contiguous", 16])
def test_append_then_attend(layout):
    lengths, new, heads, kv_heads, d, cap = (0, 1, 17, 44), 4, 4, 2, 32, 64
    q, kc, vc, seqlens, table, keys, values = make_problem(lengths, new, heads, kv_heads, d, cap, layout, torch.float32)
    g = torch.Generator().manual_seed(7)
    k = torch.randn((4, new, kv_heads, d), generator=g)
    v = torch.randn((4, new, kv_heads, d), generator=g)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
                                  num_splits=2)
    full_k = [torch.cat([keys[b][:n], k[b]]) for b, n in enumerate(lengths)]
    full_v = [torch.cat([values[b][:n], v[b]]) for b, n in enumerate(lengths)]
    for b, n in enumerate(lengths):  # the cache holds the new tokens at cache_seqlens[b] + t
        for t in range(new):
            pos = n + t
            if table is None:
                got_k, got_v = kc[b, pos], vc[b, pos]
            else:
                page = table[b, pos // layout]
                got_k, got_v = kc[page, pos % layout], vc[page, pos % layout]
            assert torch.equal(got_k, k[b, t]) and torch.equal(got_v, v[b, t])
        if table is None:  # the tokens before stay untouched
            assert torch.equal(kc[b, :n], keys[b][:n])
    check(out, reference_decode(q, full_k, full_v, True, 1 / math.sqrt(d)), torch.float32)


# --------------------------------------------------------------------------- varlen
@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_and_grads(causal):
    lens_q, lens_k = (1, 17, 30, 64), (1, 17, 30, 64) if not causal else (3, 17, 40, 64)
    heads, kv_heads, d = 2, 1, 32
    g = torch.Generator().manual_seed(1)
    q = torch.randn((sum(lens_q), heads, d), generator=g, requires_grad=True)
    k = torch.randn((sum(lens_k), kv_heads, d), generator=g, requires_grad=True)
    v = torch.randn((sum(lens_k), kv_heads, d), generator=g, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    grad = torch.randn(out.shape, generator=g)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    refs = []
    for i in range(len(lens_q)):
        qs = leaves[0][cu_q[i]:cu_q[i + 1]].unsqueeze(0)
        ks, vs = (t[cu_k[i]:cu_k[i + 1]] for t in leaves[1:])
        refs.append(_reference_dense(qs, ks, vs, causal)[0])
    ref = torch.cat(refs)
    ref_grads = torch.autograd.grad(ref, leaves, grad.double())
    check(out.detach(), ref.detach(), torch.float32)
    for got, want in zip((dq, dk, dv), ref_grads):
        check(got, want, torch.float32)


def _reference_dense(q, k, v, causal):
    """Differentiable float64 attention on (1, Nq, H, D) q and (Nk, H_kv, D) k, v, bottom-right causal."""
    group = q.shape[2] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("bqhd,khd->bhqk", q, kk) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = q.shape[1], k.shape[0]
        s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + nk - nq, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,khd->bqhd", p, vv)


@pytest.mark.interpreter
def test_varlen_empty_sequences():
    q = torch.randn(5, 2, 16)
    k = torch.randn(3, 2, 16)
    cu_q = torch.tensor([0, 0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 1, 3], dtype=torch.int32)  # sequence 1 has queries but no key
    out = flash_attn_varlen_func(q, k, k.clone(), cu_q, cu_k, 3, 2)
    assert out.shape == q.shape and (out[:2] == 0).all()
    ref = _reference_dense(q[2:].unsqueeze(0).double(), k[1:].double(), k[1:].double(), False)[0]
    check(out[2:], ref, torch.float32)


# --------------------------------------------------------------------------- bad input
def _kv(**over):
    q, kc, vc, seqlens, table, *_ = make_problem((3, 20), 1, 4, 2, 16, 32, 16, torch.float32)
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens, block_table=table)
    args.update(over)
    return args


def _bad_kvcache_cases():
    a = _kv()
    nb = a["k_cache"].shape[0]
    new_k = torch.randn(2, 2, 2, 16)
    cases = {
        "block_table": dict(block_table=torch.tensor([[0, 0], [1, nb]], dtype=torch.int32)),  # used by row 1
        "block_table ": dict(block_table=torch.tensor([[-1, 0], [1, 2]], dtype=torch.int32)),
        "block_table  ": dict(block_table=a["block_table"].long()),
        "cache_seqlens": dict(cache_seqlens=torch.tensor([3, 33], dtype=torch.int32)),
        "cache_seqlens ": dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)),
        "cache_seqlens  ": dict(cache_seqlens=torch.tensor([3, 20], dtype=torch.int64)),
        "cache_seqlens   ": dict(cache_seqlens=torch.tensor([3, 31], dtype=torch.int32), k=new_k, v=new_k),
        "k_cache": dict(k_cache=a["k_cache"].half()),
        "k_cache ": dict(k_cache=a["k_cache"][..., :8]),
        "q heads": dict(q=torch.randn(2, 1, 3, 16)),
        "v": dict(k=new_k, v=None),
        "k ": dict(k=torch.randn(2, 2, 1, 16), v=torch.randn(2, 2, 1, 16)),
        "q ": dict(q=torch.randn(2, 4, 16)),
    }
    return cases


@pytest.mark.parametrize("name", list(_bad_kvcache_cases()))
def test_kvcache_bad_input(name):
    """Each case raises one ValueError naming the argument (the name before any padding space)."""
    args = _kv(**_bad_kvcache_cases()[name])
    with pytest.raises(ValueError, match=name.strip().split()[0]):
        flash_attn_with_kvcache(**args)


def test_kvcache_contiguous_bad_input():
    q = torch.randn(2, 1, 4, 16)
    kc = torch.randn(3, 8, 2, 16)
    with pytest.raises(ValueError, match="k_cache"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))
    kc = torch.randn(2, 8, 2, 16)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([1, 9], dtype=torch.int32))


def _varlen_args(**over):
    q, k = torch.randn(6, 2, 16), torch.randn(7, 1, 16)
    args = dict(q=q, k=k, v=k.clone(), cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=4)
    args.update(over)
    return args


@pytest.mark.parametrize("name,over", [
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 2, 6], dtype=torch.int32))),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 4, 2, 6], dtype=torch.int32))),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32))),
    ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int64))),
    ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 2, 5, 7], dtype=torch.int32))),
    ("max_seqlen_q", dict(max_seqlen_q=3)),
    ("heads", dict(q=torch.randn(6, 3, 16), k=torch.randn(7, 2, 16), v=torch.randn(7, 2, 16))),
    ("v", dict(v=torch.randn(7, 1, 16).half())),
    ("q", dict(q=torch.randn(1, 6, 2, 16))),
])
def test_varlen_bad_input(name, over):
    with pytest.raises(ValueError, match=name):
        flash_attn_varlen_func(**_varlen_args(**over))


# --------------------------------------------------------------------------- fallbacks and the space
@pytest.mark.interpreter
def test_bf16_falls_back_once_and_strict(monkeypatch):
    api.reset()
    q, kc, vc, seqlens, table, keys, values = make_problem(RAGGED, 1, 4, 2, 32, 64, 16, torch.bfloat16)
    with pytest.warns(FallbackWarning, match="bfloat16"):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
    ref = reference_decode(q, [k[:n] for k, n in zip(keys, RAGGED)], [v[:n] for v, n in zip(values, RAGGED)],
                           False, 1 / math.sqrt(32))
    assert (out.double() - ref).norm() / ref.norm() < 2e-2
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # one warning per reason
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    with pytest.raises(FallbackError):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)


def test_space_parses_and_defaults_are_valid():
    space = decode_kernels.decode_space()
    assert space.op == "decode" and space.family == "triton_decode"
    for d in (64, 128, 256):
        for dtype in (torch.float16, torch.float32):
            knobs = dict(decode_kernels.default_knobs(dtype, d, 4, 1, 4096, False))
            problem = decode_kernels.decode_problem(dtype, d, 1, 1, 4, 1, 4096, False, 1)
            assert not space.violations(Variant.of(decode_kernels.FAMILY, knobs), problem, gpu_fingerprint())
    assert all("measured" not in m or m for _w, _v, m in space.defaults)


def test_every_knob_value_renders():
    space = decode_kernels.decode_space()
    base = dict(space.defaults[0][1])
    for knob, choices in space.knobs.items():
        for choice in choices:
            kernel = decode_kernels.load_kernel({**base, knob: choice})
            assert kernel.host.op == "decode" and kernel.host.uses_tma == ({**base, knob: choice}["LOADS"] == "tma")
            assert callable(kernel.module._decode_split.run) and callable(kernel.module._decode_combine.run)


# --------------------------------------------------------------------------- GPU (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 16])
def test_gpu_bf16_decode(q_len, paged, num_splits):
    batch, heads, kv_heads, d, cap = 16, 32, 8, 128, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(1, cap - q_len, (batch,), generator=g, device="cuda").to(torch.int32)
    lengths[0], lengths[1] = 0, cap - q_len
    q = torch.randn((batch, q_len, heads, d), generator=g, device="cuda", dtype=torch.bfloat16)
    if paged:
        page = 256
        per_seq = cap // page
        table = torch.randperm(batch * per_seq, generator=g, device="cuda").view(batch, per_seq).to(torch.int32)
        kc = torch.randn((batch * per_seq, page, kv_heads, d), generator=g, device="cuda", dtype=torch.bfloat16)
    else:
        table = None
        kc = torch.randn((batch, cap, kv_heads, d), generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    k = torch.randn((batch, q_len, kv_heads, d), generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kc0, vc0 = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, block_table=table, causal=True,
                                  num_splits=num_splits)
    kvcache_args.append(kc0, vc0, k, v, lengths, table, None)
    assert torch.equal(kc0, kc) and torch.equal(vc0, vc)
    total = lengths + q_len
    ref, _ = decode.torch_decode(q.double(), kc.double(), vc.double(), total, table, 1 / math.sqrt(d), True)
    bf16, _ = decode.torch_decode(q, kc, vc, total, table, 1 / math.sqrt(d), True)  # fp32 math, bf16 out
    err = (out.double() - ref).norm() / ref.norm()
    yardstick = (bf16.double() - ref).norm() / ref.norm()
    assert err <= 2 * yardstick + 1e-3, (err, yardstick)


def test_unused_block_table_entries_are_not_checked():
    """Pages past a sequence's length may hold anything (e.g. -1 padding), as in serving engines."""
    a = _kv(block_table=torch.tensor([[0, -1], [1, 2]], dtype=torch.int32))  # row 0: 3 tokens, one page
    a.update(q=a["q"].double(), k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double())
    api.reset()
    with pytest.warns(FallbackWarning, match="float64"):  # float64: the torch path, on any machine
        out = flash_attn_with_kvcache(**a)
    ref, _ = decode.torch_decode(a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"],
                                 a["block_table"].clamp(min=0), 0.25, False)
    torch.testing.assert_close(out, ref)


# --------------------------------------------------------------------------- routing from the API
@pytest.mark.interpreter
@pytest.mark.parametrize("q_len, causal", [(1, False), (3, True), (16, False)])
def test_short_queries_through_the_api_run_the_decode_kernels(q_len, causal, monkeypatch):
    """`flash_attn_func` / `attention` calls with a few query tokens against a longer cache (what a
    model's generate() makes) are served by the decode family, with the call's own semantics."""
    from autoflash.reference import reference

    api.reset()
    launched = []
    real = decode_kernels.launch
    monkeypatch.setattr(decode_kernels, "launch", lambda *a, **kw: launched.append(a[0].shape) or real(*a, **kw))
    g = torch.Generator().manual_seed(q_len)
    q = torch.randn(2, q_len, 8, 32, generator=g)
    k, v = (torch.randn(2, 77, 2, 32, generator=g) for _ in range(2))
    out = flash_attn.flash_attn_func(q, k, v, causal=causal)  # bottom-right causal, GQA 8/2, (B, N, H, D)
    ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, 77 - q_len, 32 ** -0.5)
    assert launched and (out.transpose(1, 2) - ref).abs().max() < 1e-4
    if not causal:  # the SDPA form (top-left causal never routes here: it differs from bottom-right)
        out = api.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
        assert len(launched) == 2 and (out - ref).abs().max() < 1e-4
    launched.clear()
    api.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
    assert not launched  # top-left causal with N_q < N_k: the forward kernel, which has that mask


@pytest.mark.interpreter
def test_kernel_clamps_lengths_and_pages_it_was_not_checked_for():
    """Values the host checks are skipped for (a write torch did not see) cannot make the kernel
    read outside the cache: lengths beyond the capacity and table entries outside the pages are
    clamped (the answer is then the clamped one; the host check is what reports such input)."""
    torch.manual_seed(0)
    kernel = decode_kernels.load_kernel(dict(decode_kernels.default_knobs(torch.float32, 32, 2, 1, 64, False)))
    q = torch.randn(2, 1, 4, 32)
    pages = torch.randn(6, 16, 2, 32), torch.randn(6, 16, 2, 32)
    table = torch.tensor([[0, 1, 2, 3], [-7, 4, 10 ** 6, 5]], dtype=torch.int32)
    seqlens = torch.tensor([10 ** 6, -3], dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 1)
    kernel.decode(q, *pages, out, lse, 32 ** -0.5, False, seqlens, table)
    clamped = torch.tensor([64, 0], dtype=torch.int32)  # capacity 4 pages x 16; no key
    ref, _ = decode.torch_decode(q.double(), pages[0].double(), pages[1].double(), clamped, table.clamp(0, 5),
                                 32 ** -0.5, False)
    assert torch.allclose(out.double(), ref, atol=1e-4) and torch.isfinite(out).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["contiguous", 16])
def test_a_batch_past_a_grid_axis_decodes_in_chunks(layout, monkeypatch):
    """The decode grid puts batch x KV heads on CUDA's axis 1 (at most 65535 programs): a larger
    batch runs in chunks of the batch (views; a paged cache's pages are shared, its table sliced)
    with the results of one launch. (The cap lowered to 5: 4 x 2 KV heads = 8 rows, chunks of 2.)"""
    q, kc, vc, seqlens, table, _, _ = make_problem(RAGGED, 1, 4, 2, 32, 64, layout, torch.float32, seed=3)
    kernel = decode_kernels.load_kernel(dict(decode_kernels.default_knobs(torch.float32, 32, 2, 1, 64, False)))

    def run():
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"))
        kernel.decode(q, kc, vc, out, lse, 32 ** -0.5, False, seqlens, table)
        return out, lse

    whole = run()
    launches = []
    real = kernel.host.launch
    monkeypatch.setattr(kernel.host, "launch", lambda **kw: (launches.append(kw["q"].shape[0]), real(**kw))[1])
    monkeypatch.setattr(codegen, "GRID_AXIS_MAX", 5)
    chunked = run()
    assert launches == [2, 2]
    # (a chunk's split count follows its own batch: the same sums, maybe in other partitions)
    (out_w, lse_w), (out_c, lse_c) = whole, chunked
    assert torch.allclose(out_w, out_c, atol=1e-5, rtol=1e-5)
    assert torch.equal(lse_w.isinf(), lse_c.isinf())  # (a sequence with no key: +inf)
    assert torch.allclose(lse_w.nan_to_num(posinf=0.0), lse_c.nan_to_num(posinf=0.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged, loads, scored", [(False, "pointer", False), (True, "pointer", False),
                                                   (False, "tma", False), (False, "tma", True), (True, "pointer", True)])
def test_decode_kernels_compile_for_sm90(paged, loads, scored, tmp_path):
    """The decode family's default compiles for Hopper on any machine (the CPU interpreter cannot see
    a kernel that the GPU compiler refuses): split and combine kernels, contiguous and paged, pointer
    and TMA loads, plain and with every attention variant it computes (window, softcap, ALiBi, sinks),
    in a clean child process (helpers.run_in_clean_process)."""
    from helpers import run_in_clean_process

    code = (f"from tests.test_decode import compile_decode_for_sm90; "
            f"compile_decode_for_sm90({paged!r}, {loads!r}, {scored!r})")
    done = run_in_clean_process(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["_decode_split", "_decode_combine"]


def compile_decode_for_sm90(paged: bool, loads: str, scored: bool = False) -> None:
    """(Run by the test above in a clean process.) Capture the launches `launch` would make and
    compile each for sm90; print the kernels' names."""
    from helpers import capture_launches, compile_for_sm90

    from autoflash import codegen
    from autoflash.score_variant import ScoreArgs

    variant = Variant.of(decode_kernels.FAMILY, {**dict(decode_kernels.default_knobs(torch.bfloat16, 128, 4, 1, 4096, False)),
                                                 "LOADS": loads})
    score_args = ScoreArgs(window=(255, 0), softcap=30.0, alibi_slopes=torch.rand(32),
                           sinks=torch.rand(32)) if scored else None
    kernel = codegen.load(variant, **({"score": score_args.variant} if scored else {}))
    module = kernel.module
    launches = capture_launches((module._decode_split, module._decode_combine))
    q = torch.empty(3, 1, 32, 128, dtype=torch.bfloat16)
    cache = torch.empty(40, 16, 8, 128, dtype=torch.bfloat16) if paged else torch.empty(3, 640, 8, 128, dtype=torch.bfloat16)
    kernel.host.launch(q=q, k_cache=cache, v_cache=cache.clone(), o=torch.empty_like(q), lse=torch.empty(3, 32, 1),
                       sm_scale=0.1, causal=False, seqlens=torch.zeros(3, dtype=torch.int32),
                       block_table=torch.zeros(3, 40, dtype=torch.int32) if paged else None,
                       sm_count=132, compile_only=True, tma_ok=True, score_args=score_args)
    assert launches[0][2]["USE_TMA"] == (loads == "tma" and not paged)
    for jit, args, kwargs in launches:
        compile_for_sm90(jit, args, kwargs)
        print(jit.fn.__name__)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len, causal", [(1, False), (4, True)])
def test_gpu_tma_decode_passes_the_gate(q_len, causal):
    """TMA loads of the decode kernel on the GPU, through the tuner's gate: ragged lengths 0 ... 4111
    in one batch, contiguous and paged (shuffled) caches, against float64."""
    from autoflash.problem import Shape
    from autoflash.tuning.gate import check_decode

    shape = Shape(16, 32, 8, q_len, 4096, 128, causal, "bfloat16", op="decode")
    kernel = decode_kernels.load_kernel({**dict(decode_kernels.default_knobs(torch.bfloat16, 128, 4, q_len, 4096, causal)),
                                         "LOADS": "tma"})
    result = check_decode(kernel, shape, "cuda")
    assert result.passed, result.detail
