"""The flash-attn drop-ins take flash-attn 2.8's arguments in its positional order: each called
positionally, every argument at a non-default value, gives a float64 reference's answer or a clear
error (never the answer of another argument's place). CPU: Triton's interpreter, float32."""

import inspect
import itertools
import math

import pytest
import torch

import autoflash
from autoflash.fallback import FallbackError
from helpers import quiet, rand

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("fresh_api")]

# flash-attn 2.8's public signatures (flash_attn_interface.py), in order.
FA_DENSE = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
            "return_attn_probs"]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", *FA_DENSE],
    "flash_attn_qkvpacked_func": ["qkv", *FA_DENSE],
    "flash_attn_kvpacked_func": ["q", "kv", *FA_DENSE],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                               *FA_DENSE, "block_table"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", *FA_DENSE],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                        *FA_DENSE],
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                                "return_softmax_lse"],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_positional_order_is_flash_attns(name):
    params = inspect.signature(getattr(autoflash, name)).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == SIGNATURES[name]


def test_sdpa_form_keeps_torchs_keyword_only_arguments():
    params = inspect.signature(autoflash.attention).parameters
    torch_kinds = {"scale": inspect.Parameter.KEYWORD_ONLY, "enable_gqa": inspect.Parameter.KEYWORD_ONLY}
    assert {name: params[name].kind for name in torch_kinds} == torch_kinds


# ----------------------------------------------------------------------------- the reference
def reference(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, alibi=None, key_length=None):
    """float64 flash-attn semantics on (B, N, H, D) inputs, written out index by index: query i sits
    at key position i + Nk - Nq. Returns (out (B, Nq, H, D) float64, lse (B, H, Nq))."""
    q, k, v = (t.double() for t in (q, k, v))
    b, n_q, h, _ = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    out = torch.zeros(b, n_q, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, h, n_q), math.inf, dtype=torch.float64)
    for z in range(b):
        length = n_k if key_length is None else int(key_length[z])
        for head in range(h):
            kh = head // (h // h_kv)
            for i in range(n_q):
                pos = i + length - n_q
                scores = []
                for j in range(length):
                    if (causal and j > pos) or (window[0] >= 0 and j < pos - window[0]) or (
                            window[1] >= 0 and j > pos + window[1]):
                        continue
                    s = float(q[z, i, head] @ k[z, j, kh]) * scale
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        slope = alibi[head] if alibi.dim() == 1 else alibi[z, head]
                        s -= float(slope) * abs(pos - j)
                    scores.append((j, s))
                if not scores:
                    continue
                top = max(s for _, s in scores)
                total = sum(math.exp(s - top) for _, s in scores)
                lse[z, head, i] = top + math.log(total)
                for j, s in scores:
                    out[z, i, head] += math.exp(s - top) / total * v[z, j, kh]
    return out, lse


def close(x, ref, tol=2e-5):
    return (x.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())





# ----------------------------------------------------------------------------- dense
def test_flash_attn_func_positional_every_argument():
    q, k, v = rand(2, 7, 4, 16, seed=1), rand(2, 11, 2, 16, seed=2), rand(2, 11, 2, 16, seed=3)
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out, lse, probs = quiet(autoflash.flash_attn_func, q, k, v, 0.0, 0.3, True, (3, 1), 2.0, alibi, True, True)
    ref, ref_lse = reference(q, k, v, 0.3, True, (3, 1), 2.0, alibi)
    assert close(out, ref) and close(lse, ref_lse) and probs is None


@pytest.mark.parametrize("window, causal", [((2, 2), False), ((5, -1), True), ((-1, 0), False), ((-1, 3), False),
                                            ((100, 100), False)])
def test_windows_against_the_reference(window, causal):
    q, k, v = rand(1, 9, 2, 16, seed=4), rand(1, 13, 2, 16, seed=5), rand(1, 13, 2, 16, seed=6)
    out = quiet(autoflash.flash_attn_func, q, k, v, 0.0, None, causal, window)
    assert close(out, reference(q, k, v, 16 ** -0.5, causal, window)[0])


def test_a_window_that_binds_is_never_dropped_silently(strict):
    q = rand(1, 9, 2, 16, seed=4)
    # Forward only: the kernel computes the window (no fallback, even under strict mode).
    out = autoflash.flash_attn_func(q, q, q, 0.0, None, False, (2, 2))
    assert close(out, reference(q, q, q, 16 ** -0.5, False, (2, 2))[0])
    # With a gradient to compute: the backward kernels compute the window too (no fallback either).
    from autoflash.eager import eager_attention

    mine, theirs = q.clone().requires_grad_(), q.clone().double().requires_grad_()
    autoflash.flash_attn_func(mine, q, q, 0.0, None, False, (2, 2)).sum().backward()
    eager_attention(theirs.transpose(1, 2), q.double().transpose(1, 2), q.double().transpose(1, 2), scale=16 ** -0.5,
                    window=(2, 2))[0].sum().backward()  # (float64 autograd)
    assert close(mine.grad, theirs.grad)
    # With a dropout the kernels do not take (p = 1; 0 < p < 1 runs on them): torch serves it, never silently.
    with pytest.raises(FallbackError, match="window_size"):
        autoflash.flash_attn_func(q.clone().requires_grad_(), q, q, 1.0, None, False, (2, 2))
    # A window that excludes no key, and right == 0 (causality), stay on the kernels even under strict mode.
    out = autoflash.flash_attn_func(q, q, q, 0.0, None, False, (100, -1))
    assert close(out, reference(q, q, q, 16 ** -0.5)[0])
    out = autoflash.flash_attn_func(q, q, q, 0.0, None, False, (-1, 0))
    assert close(out, reference(q, q, q, 16 ** -0.5, causal=True)[0])


def test_positional_dropout_is_dropout_not_a_scale():
    q, k, v = rand(1, 8, 2, 16, seed=7), rand(1, 8, 2, 16, seed=8), rand(1, 8, 2, 16, seed=9)
    # dropout_p = 1 drops every probability: zeros. Taken as a softmax scale it would not be.
    assert quiet(autoflash.flash_attn_func, q, k, v, 1.0).abs().max().item() == 0.0
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = quiet(autoflash.flash_attn_varlen_func, q[0], k[0], v[0], cu, cu, 5, 5, 1.0)
    assert packed.abs().max().item() == 0.0


def test_return_attn_probs_gives_the_lse_with_and_without_autograd():
    q, k, v = rand(1, 37, 2, 16, seed=10), rand(1, 45, 1, 16, seed=11), rand(1, 45, 1, 16, seed=12)
    ref, ref_lse = reference(q, k, v, 0.25, True)
    out, lse, _ = autoflash.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True, return_attn_probs=True)
    assert close(out, ref) and close(lse, ref_lse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = autoflash.flash_attn_func(*leaves, softmax_scale=0.25, causal=True, return_attn_probs=True)
    assert close(out.detach(), ref) and close(lse, ref_lse) and not lse.requires_grad
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v = rand(1, 29, 2, 16, seed=13), rand(1, 29, 2, 16, seed=14), rand(1, 29, 2, 16, seed=15)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        quiet(autoflash.flash_attn_func, *leaves, 0.0, None, True, (-1, -1), 0.0, None, True).sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_packed_forms_equal_the_unpacked_ones():
    qkv = rand(2, 9, 3, 2, 16, seed=16)
    want = autoflash.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], 0.0, 0.2, True)
    assert torch.equal(autoflash.flash_attn_qkvpacked_func(qkv, 0.0, 0.2, True), want)
    assert torch.equal(autoflash.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], 0.0, 0.2, True), want)
    flat = qkv[1]
    cu = torch.tensor([0, 9], dtype=torch.int32)
    assert close(autoflash.flash_attn_varlen_qkvpacked_func(flat, cu, 9, 0.0, 0.2, True), want[1].double(), 1e-6)
    assert close(autoflash.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 9, 9, 0.0, 0.2, True),
                 want[1].double(), 1e-6)


# ----------------------------------------------------------------------------- varlen
def test_varlen_positional_every_argument():
    lengths_q, lengths_k = [5, 1, 9], [7, 4, 9]
    cu_q = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11, 20], dtype=torch.int32)
    q, k, v = rand(15, 4, 16, seed=17), rand(20, 2, 16, seed=18), rand(20, 2, 16, seed=19)
    alibi = rand(3, 4, seed=20).abs()
    out, lse, _ = quiet(autoflash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 9, 9, 0.0, 0.35, True, (2, 0), 1.5,
                         alibi, False, True, None)
    for i in range(3):
        a, b, c, d = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        ref, ref_lse = reference(q[None, a:b], k[None, c:d], v[None, c:d], 0.35, True, (2, 0), 1.5, alibi[i])
        assert close(out[a:b], ref[0]) and close(lse[:, a:b], ref_lse[0])
    assert lengths_q and lengths_k


def test_varlen_block_table_reads_the_pages():
    page, cu = 4, torch.tensor([0, 6, 13], dtype=torch.int32)
    q, k, v = rand(13, 2, 16, seed=21), rand(13, 1, 16, seed=22), rand(13, 1, 16, seed=23)
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    k_pages, v_pages = torch.zeros(5, page, 1, 16), torch.zeros(5, page, 1, 16)
    for b, (start, end) in enumerate([(0, 6), (6, 13)]):
        for t in range(end - start):
            k_pages[table[b, t // page], t % page] = k[start + t]
            v_pages[table[b, t // page], t % page] = v[start + t]
    paged = autoflash.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 7, 7, 0.0, None, True, block_table=table)
    assert close(paged, autoflash.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True).double(), 1e-6)
    with pytest.raises(ValueError, match="block_table"):
        autoflash.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 7, 7, block_table=table.long())


@pytest.mark.parametrize("page", [1, 4, 16])
def test_varlen_block_table_gathers_shuffled_pages_of_ragged_sequences(page):
    """Pages in a shuffled order, ragged lengths (an empty sequence, one of a single token, one ending
    mid-page), a table wider than needed with junk past each sequence's pages: the same output and
    gradients as the packed K/V they hold, and the gradients land in the pages used (zero elsewhere)."""
    lengths = [5, 0, 1, 2 * page + 3]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    total, width = int(cu[-1]), -(-max(lengths) // page) + 1
    q, k, v = rand(total, 2, 16, seed=31), rand(total, 1, 16, seed=32), rand(total, 1, 16, seed=33)
    order = torch.randperm(len(lengths) * width, generator=torch.Generator().manual_seed(page))
    table = order.view(len(lengths), width).to(torch.int32)
    k_pages = torch.zeros(len(lengths) * width, page, 1, 16, requires_grad=True)
    v_pages = torch.zeros_like(k_pages, requires_grad=True)
    with torch.no_grad():
        for b, n in enumerate(lengths):
            for t in range(n):
                k_pages[table[b, t // page], t % page] = k[cu[b] + t]
                v_pages[table[b, t // page], t % page] = v[cu[b] + t]
    longest = max(lengths)
    paged = autoflash.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, longest, longest, causal=True,
                                             block_table=table)
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    packed = autoflash.flash_attn_varlen_func(q, kk, vv, cu, cu, longest, longest, causal=True)
    assert close(paged, packed.double(), 1e-6)
    grad = rand(*paged.shape, seed=34)
    paged.backward(grad)
    packed.backward(grad)
    used = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            used[table[b, t // page], t % page] = True
            assert close(k_pages.grad[table[b, t // page], t % page], kk.grad[cu[b] + t].double(), 1e-6)
    assert not k_pages.grad[~used].any() and not v_pages.grad[~used].any()


@pytest.mark.parametrize("table, cu, match", [
    ([[0, 9], [1, 2]], [0, 3, 6], r"page indices outside \[0, 3\)"),  # row 0's second page is used: 9
    ([[0, -1], [1, 2]], [0, 3, 6], r"page indices outside"),
    ([[0, 1], [1, 2]], [0, 3, 9], "asking no more tokens"),  # 6 tokens in 2 pages of 2
    ([[0, 1], [1, 2]], [1, 3, 6], "offsets from 0"),
])
def test_varlen_block_table_errors_name_the_cause(table, cu, match):
    q, pages = rand(6, 2, 16, seed=35), rand(3, 2, 1, 16, seed=36)
    cu = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        autoflash.flash_attn_varlen_func(q[:int(cu[-1]) - int(cu[0])], pages, pages, cu, cu, 6, 6,
                                         block_table=torch.tensor(table, dtype=torch.int32))
    # a table entry past a sequence's pages is never read, so never checked (junk there is fine)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = autoflash.flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4, causal=True,
                                           block_table=torch.tensor([[0, -7], [1, 2]], dtype=torch.int32))
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- kvcache
def test_kvcache_positional_every_served_argument():
    q, k_cache, v_cache = rand(2, 2, 4, 16, seed=24), rand(2, 12, 2, 16, seed=25), rand(2, 12, 2, 16, seed=26)
    k_new, v_new = rand(2, 2, 2, 16, seed=27), rand(2, 2, 2, 16, seed=28)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    alibi = torch.tensor([0.3, 0.2, 0.1, 0.05])
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = quiet(autoflash.flash_attn_with_kvcache, q, kc, vc, k_new, v_new, None, None, lens, None, None, None,
                      0.3, True, (3, -1), 1.5, True, alibi, 0, True)
    for b in range(2):
        n = int(lens[b]) + 2
        keys = torch.cat([k_cache[b, :lens[b]], k_new[b]])
        values = torch.cat([v_cache[b, :lens[b]], v_new[b]])
        assert torch.equal(kc[b, :n], keys) and torch.equal(vc[b, :n], values)
        ref, ref_lse = reference(q[b:b + 1], keys[None], values[None], 0.3, True, (3, -1), 1.5, alibi)
        assert close(out[b], ref[0]) and close(lse[b], ref_lse[0])


@pytest.mark.parametrize("arguments, match", [
    (dict(rotary_cos=torch.ones(8, 4)), "rotary_cos and rotary_sin"),
    (dict(rotary_cos=torch.ones(8, 4), rotary_sin=torch.zeros(8, 4)), "need k and v"),
    (dict(cache_batch_idx=torch.zeros(1, dtype=torch.int64)), "cache_batch_idx must be an int32"),
    (dict(cache_batch_idx=torch.tensor([1], dtype=torch.int32)), r"cache_batch_idx entries must be in \[0, 1\)"),
    (dict(cache_leftpad=torch.tensor([9], dtype=torch.int32)), "cache_leftpad must be in"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), "cache_leftpad must have q's batch size"),
])
def test_kvcache_rotary_batch_index_and_leftpad_are_checked(arguments, match):
    """Served now (tests/test_kvcache_args.py): malformed values are a ValueError naming them."""
    q, cache = rand(1, 1, 2, 16, seed=29), rand(1, 8, 2, 16, seed=30)
    with pytest.raises(ValueError, match=match):
        autoflash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=4, **arguments)
