"""FlashAttention-3's forms (`autoflash.flash_attn_interface`): FA3's signatures in FA3's positional order,
each called positionally against a float64 reference; return_attn_probs' (out, lse) with -inf for rows
that see no key; seqused_q/k; flash_attn_combine against attention over the concatenated key splits.
CPU: Triton's interpreter, float32."""

import inspect

import pytest
import torch

import autoflash
from autoflash import flash_attn_interface as fa3
from autoflash.fallback import FallbackError
from helpers import quiet, rand

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("fresh_api")]

# FlashAttention-3's public signatures (hopper/flash_attn_interface.py), in order.
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", "softmax_scale", "causal", "qv", "q_descale", "k_descale", "v_descale",
                        "window_size", "attention_chunk", "softcap", "num_splits", "pack_gqa", "deterministic",
                        "sm_margin", "return_attn_probs"],
    "flash_attn_qkvpacked_func": ["qkv", "softmax_scale", "causal", "q_descale", "k_descale", "v_descale",
                                  "window_size", "attention_chunk", "softcap", "deterministic", "num_heads_q",
                                  "sm_margin", "return_attn_probs"],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                               "seqused_q", "seqused_k", "softmax_scale", "causal", "qv", "q_descale", "k_descale",
                               "v_descale", "window_size", "attention_chunk", "softcap", "num_splits", "pack_gqa",
                               "deterministic", "sm_margin", "return_attn_probs"],
    "flash_attn_combine": ["out_partial", "lse_partial", "out", "out_dtype"],
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin",
                                "cache_seqlens", "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q",
                                "cu_seqlens_k_new", "max_seqlen_q", "rotary_seqlens", "q_descale", "k_descale",
                                "v_descale", "softmax_scale", "causal", "window_size", "attention_chunk", "softcap",
                                "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin",
                                "return_softmax_lse"],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_positional_order_is_flash_attention_3s(name):
    params = inspect.signature(getattr(fa3, name)).parameters.values()
    assert [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD] == SIGNATURES[name]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)


def test_the_fa2_forms_keep_their_own_signatures_and_combine_is_exported_at_the_top():
    assert autoflash.flash_attn_func is not fa3.flash_attn_func
    assert list(inspect.signature(autoflash.flash_attn_func).parameters)[3] == "dropout_p"
    assert autoflash.flash_attn_combine is fa3.flash_attn_combine and "flash_attn_combine" in autoflash.__all__


# ----------------------------------------------------------------------------- the reference
def reference(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """float64 flash-attn semantics on (B, N, H, D): query i at key position i + Nk - Nq. Returns out
    (B, Nq, H, D) and lse (B, H, Nq), -inf for a row that sees no key (FA3's convention)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(q.shape[1])[:, None] + k.shape[1] - q.shape[1]
    j = torch.arange(k.shape[1])[None, :]
    visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window[0] >= 0:
        visible &= j >= i - window[0]
    if window[1] >= 0:
        visible &= j <= i + window[1]
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), v)
    return out, torch.logsumexp(s, -1)


def close(x, ref, tol=2e-5):
    x, ref = x.double(), ref.double()
    inf = torch.isinf(ref)
    if not torch.equal(inf, torch.isinf(x)) or not torch.equal(x[inf], ref[inf]):
        return False
    if not (~inf).any():
        return True
    return (x[~inf] - ref[~inf]).abs().max().item() <= tol * max(1.0, ref[~inf].abs().max().item())





# ----------------------------------------------------------------------------- dense
def test_flash_attn_func_positional_every_argument():
    q, k, v = rand(2, 9, 4, 16, seed=1), rand(2, 6, 2, 16, seed=2), rand(2, 6, 2, 16, seed=3)
    # causal with more queries than keys: the first rows see no key (out 0, lse -inf)
    out, lse = quiet(fa3.flash_attn_func, q, k, v, 0.3, True, None, None, None, None, (3, 1), 0, 2.0, 4, True,
                      True, 8, True)
    ref, ref_lse = reference(q, k, v, 0.3, True, (3, 1), 2.0)
    assert close(out, ref) and close(lse, ref_lse) and (lse == float("-inf")).any()


def test_flash_attn_func_without_lse_and_its_hints_change_nothing(strict):
    q, k, v = rand(1, 37, 2, 16, seed=4), rand(1, 45, 1, 16, seed=5), rand(1, 45, 1, 16, seed=6)
    plain = fa3.flash_attn_func(q, k, v, causal=True)
    hinted = fa3.flash_attn_func(q, k, v, None, True, num_splits=3, pack_gqa=False, sm_margin=4)
    assert torch.equal(plain, hinted) and close(plain, reference(q, k, v, 16 ** -0.5, True)[0])


def test_gradients_and_a_deterministic_backward():
    q, k, v = rand(1, 21, 4, 16, seed=7), rand(1, 21, 2, 16, seed=8), rand(1, 21, 2, 16, seed=9)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fa3.flash_attn_func(*leaves, 0.25, True, deterministic=True, return_attn_probs=True)
        assert not lse.requires_grad
        out.backward(rand(*out.shape, seed=10))
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference(*ref_leaves, 0.25, True)[0].backward(rand(1, 21, 4, 16, seed=10).double())
    assert all(close(mine, t.grad, 1e-4) for mine, t in zip(grads[0], ref_leaves))


@pytest.mark.parametrize("name, value", [("qv", torch.zeros(1)), ("q_descale", torch.ones(1)),
                                         ("k_descale", torch.ones(1)), ("v_descale", torch.ones(1))])
def test_what_is_not_served_is_refused_by_name(name, value):
    q = rand(1, 5, 2, 16, seed=11)
    with pytest.raises(FallbackError, match=name):
        fa3.flash_attn_func(q, q, q, **{name: value})
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(FallbackError, match=name):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, **{name: value})
    with pytest.raises(FallbackError, match="attention_chunk"):
        fa3.flash_attn_func(q, q, q, attention_chunk=4)
    with pytest.raises(ValueError, match="num_splits"):
        fa3.flash_attn_func(q, q, q, num_splits=-1)


def test_qkvpacked_in_both_layouts_equals_the_unpacked_call():
    qkv = rand(2, 11, 3, 2, 16, seed=12)
    want = fa3.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], 0.2, True)
    assert torch.equal(fa3.flash_attn_qkvpacked_func(qkv, 0.2, True), want)
    gqa = rand(2, 11, 4 + 2 * 2, 16, seed=13)  # 4 query heads, then 2 key heads, then 2 value heads
    out, lse = fa3.flash_attn_qkvpacked_func(gqa, 0.2, True, num_heads_q=4, return_attn_probs=True)
    ref, ref_lse = reference(gqa[:, :, :4], gqa[:, :, 4:6], gqa[:, :, 6:], 0.2, True)
    assert close(out, ref) and close(lse, ref_lse)
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(gqa)


# ----------------------------------------------------------------------------- varlen, seqused
SLOTS_Q, SLOTS_K = [7, 4, 9], [9, 3, 12]


def _packed(seed):
    q, k, v = rand(sum(SLOTS_Q), 4, 16, seed=seed), rand(sum(SLOTS_K), 2, 16, seed=seed + 1), \
        rand(sum(SLOTS_K), 2, 16, seed=seed + 2)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(s).cumsum(0).tolist()], dtype=torch.int32) for s in (SLOTS_Q, SLOTS_K))
    return q, k, v, cu_q, cu_k


def test_varlen_positional_every_argument_with_seqused():
    q, k, v, cu_q, cu_k = _packed(20)
    used_q, used_k = torch.tensor([5, 0, 9], dtype=torch.int32), torch.tensor([9, 2, 0], dtype=torch.int32)
    out, lse = quiet(fa3.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 9, 12, used_q, used_k, 0.35, True, None, None,
                      None, None, (4, 0), 0, 1.5, 2, None, False, 0, True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for b in range(3):
        q0, k0, nq, nk = int(cu_q[b]), int(cu_k[b]), int(used_q[b]), int(used_k[b])
        ref, ref_lse = reference(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], 0.35, True, (4, 0), 1.5)
        assert close(out[q0:q0 + nq], ref[0]) and close(lse[:, q0:q0 + nq], ref_lse[0])
        slot_end = int(cu_q[b + 1])
        assert (out[q0 + nq:slot_end] == 0).all() and (lse[:, q0 + nq:slot_end] == float("-inf")).all()


def test_rows_past_seqused_get_no_gradient_and_keys_past_it_are_not_attended():
    q, k, v, cu_q, cu_k = _packed(30)
    used_q, used_k = torch.tensor([3, 4, 6], dtype=torch.int32), torch.tensor([5, 3, 7], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa3.flash_attn_varlen_func(*leaves, cu_q, cu_k, 9, 12, used_q, used_k, causal=True)
    out.backward(torch.ones_like(out))
    for b in range(3):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        assert (leaves[0].grad[q0 + int(used_q[b]):int(cu_q[b + 1])] == 0).all()
        assert (leaves[1].grad[k0 + int(used_k[b]):int(cu_k[b + 1])] == 0).all()
        assert (leaves[2].grad[k0 + int(used_k[b]):int(cu_k[b + 1])] == 0).all()
    changed = k.clone()
    changed[int(cu_k[0]) + 5:int(cu_k[1])] = 1e3  # unused keys: the answer must not move
    again = fa3.flash_attn_varlen_func(q, changed, v, cu_q, cu_k, 9, 12, used_q, used_k, causal=True)
    assert torch.equal(again, out.detach())


def test_varlen_with_a_batch_dim_and_no_cu_seqlens_equals_the_packed_call():
    q, k, v = rand(3, 9, 4, 16, seed=40), rand(3, 12, 2, 16, seed=41), rand(3, 12, 2, 16, seed=42)
    used_q, used_k = torch.tensor([9, 2, 5], dtype=torch.int32), torch.tensor([12, 0, 7], dtype=torch.int32)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, used_q, used_k, causal=True,
                                          return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (3, 4, 9)
    cu_q = torch.tensor([0, 9, 18, 27], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 24, 36], dtype=torch.int32)
    packed, packed_lse = fa3.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                                    9, 12, used_q, used_k, causal=True, return_attn_probs=True)
    assert torch.equal(out.flatten(0, 1), packed)
    assert torch.equal(lse.transpose(0, 1).flatten(1), packed_lse)
    plain = fa3.flash_attn_varlen_func(q, k, v, None, None, None, None, causal=True)
    assert close(plain, reference(q, k, v, 16 ** -0.5, True)[0])


@pytest.mark.parametrize("used, match", [([10, 0, 0], "between 0 and"), ([1, 2], r"\(batch_size,\)"),
                                         ([-1, 0, 0], "between 0 and")])
def test_seqused_outside_its_slots_is_a_value_error(used, match):
    q, k, v, cu_q, cu_k = _packed(50)
    with pytest.raises(ValueError, match=match):
        fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 12, torch.tensor(used, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 12, torch.tensor([5, 1, 4], dtype=torch.int32))


# ----------------------------------------------------------------------------- combine
def _splits(q, k, v, bounds, scale):
    """Each key split's (out, lse) from the FA3 form, in combine's layouts: (splits, B, N, H, D) float32 and
    (splits, B, N, H) (a transposed view, as FA3's tests pass it)."""
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        out, lse = fa3.flash_attn_func(q, k[:, a:b], v[:, a:b], scale, return_attn_probs=True)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses).transpose(-1, -2)


def test_combine_equals_attention_over_the_concatenated_splits():
    q, k, v = rand(2, 7, 4, 16, seed=60), rand(2, 29, 2, 16, seed=61), rand(2, 29, 2, 16, seed=62)
    out_partial, lse_partial = _splits(q, k, v, [0, 5, 6, 20, 29], 0.3)
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    ref, ref_lse = reference(q, k, v, 0.3)
    assert out.shape == (2, 7, 4, 16) and lse.shape == (2, 7, 4) and lse.stride(1) == 1
    assert close(out, ref) and close(lse, ref_lse.transpose(1, 2))
    into = torch.empty(2, 7, 4, 16, dtype=torch.float16)
    result, _ = fa3.flash_attn_combine(out_partial, lse_partial, into, torch.float16)
    assert result is into and torch.equal(into, out.half())


def test_combine_of_splits_some_rows_never_see():
    """Causal splits: the last split is invisible to the first queries (a -inf partial lse), and a row
    that no split sees gives out 0 and lse -inf; flash-attn 2's +inf for an empty row reads the same."""
    q, k, v = rand(1, 12, 2, 16, seed=70), rand(1, 8, 2, 16, seed=71), rand(1, 8, 2, 16, seed=72)
    s = _scores(q, k, 0.3, causal=True)  # bottom-right: the first 4 queries see no key
    parts = [(0, 3), (3, 8)]
    out_partial = torch.stack([torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s[..., a:b], -1).nan_to_num(0.0),
                                            v[:, a:b].double()) for a, b in parts]).float()
    lse_partial = torch.stack([torch.logsumexp(s[..., a:b], -1) for a, b in parts]).float().transpose(-1, -2)
    assert (lse_partial[1] == float("-inf")).any() and (lse_partial == float("-inf")).all(0).any()
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    ref, ref_lse = reference(q, k, v, 0.3, True)
    assert close(out, ref) and close(lse, ref_lse.transpose(1, 2))
    fa2_style = lse_partial.masked_fill(lse_partial == float("-inf"), float("inf"))
    assert torch.equal(fa3.flash_attn_combine(out_partial, fa2_style)[0], out)


def _scores(q, k, scale, causal):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    i = torch.arange(q.shape[1])[:, None] + k.shape[1] - q.shape[1]
    return s.masked_fill(causal & (torch.arange(k.shape[1])[None, :] > i), float("-inf"))


@pytest.mark.parametrize("change, match", [
    (lambda o, lse: (o.half(), lse), "out_partial must be float32"),
    (lambda o, lse: (o, lse[:, :, :, :1]), "lse_partial must be"),
    (lambda o, lse: (o[0], lse), "out_partial must be 5-D"),
])
def test_combine_refuses_what_fa3_refuses(change, match):
    out_partial, lse_partial = rand(2, 1, 3, 2, 8, seed=80), rand(2, 1, 3, 2, seed=81)
    with pytest.raises(ValueError, match=match):
        fa3.flash_attn_combine(*change(out_partial, lse_partial))
    with pytest.raises(ValueError, match="out_dtype"):
        fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float64)


# ----------------------------------------------------------------------------- kvcache
def test_kvcache_fa3_form_is_the_fa2_one_with_fa3s_names():
    q, k_cache, v_cache = rand(2, 1, 4, 16, seed=90), rand(2, 12, 2, 16, seed=91), rand(2, 12, 2, 16, seed=92)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    out, lse, out_accum, lse_accum = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, None, None, None, None, None, lens, None, None, None, None, None, None, None, None, None,
        None, 0.3, True, (-1, -1), 0, 0.0, True, None, 0, None, 0, True)
    want, want_lse = autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, softmax_scale=0.3,
                                                        causal=True, return_softmax_lse=True)
    assert torch.equal(out, want) and out_accum.numel() == 0 == lse_accum.numel()
    assert torch.equal(lse[0], want_lse[0]) and (lse[1] == float("-inf")).all()  # (no key: -inf, FA3's way)
    with pytest.raises(ValueError, match="cu_seqlens_q"):  # (served: tests/test_kvcache_args.py; malformed here)
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cu_seqlens_q=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(FallbackError, match="scheduler_metadata"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, scheduler_metadata=torch.zeros(3, dtype=torch.int32))


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa3_forms_on_the_gpu(dtype, own_kernels):
    q, k, v = (rand(2, n, h, 128, seed=s).to("cuda", dtype)
               for s, n, h in ((100, 300, 8), (101, 517, 2), (102, 517, 2)))
    out, lse = fa3.flash_attn_func(q, k, v, None, True, return_attn_probs=True)
    ref, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), 128 ** -0.5, True)
    assert (out.cpu().double() - ref).abs().max() < 2e-2 and close(lse.cpu(), ref_lse, 1e-3)
    bounds = [0, 100, 101, 517]
    out_partial, lse_partial = _splits(q, k, v, bounds, 128 ** -0.5)
    merged, merged_lse = fa3.flash_attn_combine(out_partial.float(), lse_partial, out_dtype=dtype)
    full, full_lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True)
    assert merged.dtype == dtype and (merged.float() - full.float()).abs().max() < 2e-2
    assert (merged_lse - full_lse.transpose(1, 2)).abs().max() < 1e-3
