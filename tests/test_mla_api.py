"""A value head dim different from the query/key one through the public functions, with
AUTOFLASH_STRICT=1 (served by the kernels, never the torch fallback): `autoflash.attention` against
torch SDPA in a hypothesis differential, flash-attn 2's `flash_attn_func` / `flash_attn_varlen_func`
and FlashAttention-3's forms against a float64 reference, forward and backward. CPU: Triton's
interpreter, float32."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoflash
from autoflash import flash_attn_interface as fa3
from autoflash.fallback import FallbackError
from autoflash.reference import reference, rel_error
from helpers import rand

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("fresh_api", "strict")]

HEAD_DIMS = [16, 32, 48, 64, 96]


def _grads(out, leaves, grad):
    return torch.autograd.grad(out, leaves, grad)


def _err(x, ref):
    """rel_error, but against at least unit-variance entries: a gradient that is exactly zero (one key:
    the softmax is constant) leaves its rounding measured against the inputs' scale."""
    return (x.double() - ref).norm().item() / max(ref.norm().item(), ref.numel() ** 0.5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=st.sampled_from(HEAD_DIMS), dv=st.sampled_from(HEAD_DIMS), n_q=st.integers(1, 40), n_k=st.integers(1, 40),
       heads_kv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2]), causal=st.booleans(),
       batch=st.integers(1, 2), seed=st.integers(0, 1000))
def test_attention_matches_torch_sdpa(d, dv, n_q, n_k, heads_kv, group, causal, batch, seed):
    """Forward and gradients as torch SDPA's (which takes V with its own head dim), within twice torch's
    own float32 error against float64."""
    if d == dv:
        dv = 8 if d != 8 else 16
    q = rand(batch, heads_kv * group, n_q, d, seed=seed).requires_grad_()
    k = rand(batch, heads_kv, n_k, d, seed=seed + 1).requires_grad_()
    v = rand(batch, heads_kv, n_k, dv, seed=seed + 2).requires_grad_()
    grad = rand(batch, heads_kv * group, n_q, dv, seed=seed + 3)
    gqa = group > 1
    mine = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=causal, enable_gqa=gqa)
    assert mine.shape == theirs.shape == (batch, heads_kv * group, n_q, dv)
    assert _err(mine, exact) <= max(2 * _err(theirs, exact), 1e-6)
    for g_mine, g_theirs, g_exact in zip(_grads(mine, (q, k, v), grad), _grads(theirs, (q, k, v), grad),
                                         _grads(exact, (q, k, v), grad.double())):
        # (the floor: with one key torch's dQ and dK are exactly zero, the kernels' the rounding of
        # dP - delta, two float32 sums over the value head dim that agree only to ~1e-6 of unit inputs)
        assert _err(g_mine, g_exact) <= max(3 * _err(g_theirs, g_exact), 1e-5)


def _reference_fa(q, k, v, causal):
    """flash-attn semantics in float64 on (B, N, H, D) tensors: bottom-right causal, GQA."""
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    out, lse = reference(qh, kh, vh, causal, k.shape[1] - q.shape[1], 1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("form", ["fa2", "fa3"])
@pytest.mark.parametrize("d, dv", [(192, 128), (96, 64), (32, 64)])
def test_flash_attn_func_forms_serve_a_value_head_dim(form, d, dv):
    q = rand(2, 37, 4, d, seed=1).requires_grad_()
    k = rand(2, 45, 2, d, seed=2).requires_grad_()
    v = rand(2, 45, 2, dv, seed=3).requires_grad_()
    call = autoflash.flash_attn_func if form == "fa2" else fa3.flash_attn_func
    out, lse = call(q, k, v, causal=True, return_attn_probs=True)[:2]
    ref, ref_lse = _reference_fa(q, k, v, True)
    assert out.shape == (2, 37, 4, dv) and out.is_contiguous()
    assert rel_error(out, ref) <= 1e-5
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4)
    grad = rand(2, 37, 4, dv, seed=4)
    out = call(q, k, v, causal=True)
    for mine, exact in zip(_grads(out, (q, k, v), grad), _grads(ref, (q, k, v), grad.double())):
        assert rel_error(mine, exact) <= 1e-5


@pytest.mark.parametrize("form", ["fa2", "fa3"])
def test_varlen_serves_a_value_head_dim(form):
    lengths_q, lengths_k = [1, 37, 13], [13, 45, 13]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = rand(int(cu_q[-1]), 4, 96, seed=5).requires_grad_()
    k = rand(int(cu_k[-1]), 2, 96, seed=6).requires_grad_()
    v = rand(int(cu_k[-1]), 2, 64, seed=7).requires_grad_()
    call = autoflash.flash_attn_varlen_func if form == "fa2" else fa3.flash_attn_varlen_func
    out = call(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    assert out.shape == (q.shape[0], 4, 64)
    grad = rand(*out.shape, seed=8)
    mine = _grads(out, (q, k, v), grad)
    exact_grads = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    for z in range(len(lengths_q)):
        rows_q, rows_k = slice(int(cu_q[z]), int(cu_q[z + 1])), slice(int(cu_k[z]), int(cu_k[z + 1]))
        ref, _ = _reference_fa(q[None, rows_q], k[None, rows_k], v[None, rows_k], True)
        assert rel_error(out[rows_q], ref[0]) <= 1e-5
        for acc, g, rows in zip(exact_grads, _grads(ref[0], (q, k, v), grad[rows_q].double()), (rows_q, rows_k, rows_k)):
            acc[rows] += g[rows]
    for m, e in zip(mine, exact_grads):
        assert rel_error(m, e) <= 1e-5


def test_a_decoding_shaped_call_is_served_by_the_forward_kernel():
    """A few queries against more keys: the decode kernels take one head dim, the forward serves it."""
    q, k, v = rand(1, 4, 1, 64, seed=9), rand(1, 2, 37, 64, seed=10), rand(1, 2, 37, 32, seed=11)
    out = autoflash.attention(q, k, v, enable_gqa=True)
    assert rel_error(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)) <= 1e-5


def test_a_value_head_dim_the_kernels_cannot_take_is_named():
    q, k, v = rand(1, 2, 5, 32, seed=12), rand(1, 2, 7, 32, seed=13), rand(1, 2, 7, 264, seed=14)
    with pytest.raises(FallbackError, match="value head dim 264"):
        autoflash.attention(q, k, v)


def test_a_value_of_head_dim_zero_gets_an_empty_answer_not_an_internal_error():
    """flash-attn's form: V of head dim 0 is an empty tensor, handed to torch like every other one (an
    empty answer; a FallbackError naming it under AUTOFLASH_STRICT=1), not a ValueError from inside."""
    q, k, v = rand(1, 5, 2, 64, seed=15), rand(1, 7, 2, 64, seed=16), rand(1, 7, 2, 0, seed=17)
    with pytest.raises(FallbackError, match="empty tensor"):
        autoflash.flash_attn_func(q, k, v)


def test_attention_variants_with_a_value_head_dim():
    """A window, a softcap and ALiBi rendered together with the value head dim: forward and backward."""
    from autoflash.eager import eager_attention

    q = rand(1, 37, 4, 96, seed=15).requires_grad_()
    k = rand(1, 45, 2, 96, seed=16).requires_grad_()
    v = rand(1, 45, 2, 64, seed=17).requires_grad_()
    slopes = rand(4, seed=18).abs()
    out = autoflash.flash_attn_func(q, k, v, causal=True, window_size=(7, -1), softcap=3.0, alibi_slopes=slopes)
    ref = eager_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), scale=1 / math.sqrt(96), causal=True,
                          offset=8, window=(7, -1), softcap=3.0, alibi_slopes=slopes.double())[0].transpose(1, 2)
    assert out.shape == (1, 37, 4, 64) and rel_error(out, ref) <= 1e-5
    grad = rand(*out.shape, seed=19)
    for mine, exact in zip(_grads(out, (q, k, v), grad), _grads(ref, (q, k, v), grad.double())):
        assert rel_error(mine, exact) <= 1e-5
