"""`autoflash.attention` takes every call torch SDPA takes, with torch's answer, and refuses every call torch
refuses: any rank >= 2 (3-D (B*H, N, D) calls, 5-D ones), batch dims that broadcast (K/V with one head
or a batch of one, without copies), enable_gqa's head groups, numpy and 0-d tensor scales, masks that
broadcast. A differential test over random calls against torch on the CPU (Triton's interpreter, float32)."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import autoflash
from autoflash.fallback import FallbackWarning
from autoflash.sdpa_args import kernel_views, sdpa_batch
from helpers import rand

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("fresh_api")]




def both(*args, **kwargs):
    """(autoflash's answer or None if it raised, torch's answer or None if it raised)."""
    try:
        theirs = F.scaled_dot_product_attention(*args, **kwargs)
    except Exception:  # noqa: BLE001 (any refusal)
        theirs = None
    scale = kwargs.get("scale")
    if theirs is not None and theirs.isnan().any() and scale is not None and not float(scale) > 0:
        # torch's CPU flash kernel returns NaN for a causal mask with a scale <= 0 where its math backend
        # answers: autoflash gives the math backend's answer (reference.torch_sdpa)
        with sdpa_kernel(SDPBackend.MATH):
            theirs = F.scaled_dot_product_attention(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        try:
            mine = autoflash.attention(*args, **kwargs)
        except (TypeError, ValueError, RuntimeError):
            mine = None
    return mine, theirs


def assert_same(mine, theirs):
    assert (mine is None) == (theirs is None), "one refused, the other answered"
    if theirs is not None:
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=2e-4, equal_nan=True)


# ----------------------------------------------------------------------------- the shapes, one by one
SHAPES = {  # name: (query, key, value shapes, enable_gqa)
    "3-D (B*H, N, D)": ((6, 9, 16), (6, 11, 16), (6, 11, 16), False),
    "2-D": ((9, 16), (11, 16), (11, 16), False),
    "5-D": ((2, 3, 2, 9, 16), (2, 3, 2, 11, 16), (2, 3, 2, 11, 16), False),
    "K/V one head": ((2, 4, 9, 16), (2, 1, 11, 16), (2, 1, 11, 16), False),
    "K/V batch of one": ((2, 4, 9, 16), (1, 4, 11, 16), (1, 4, 11, 16), False),
    "K/V batch and head of one": ((2, 4, 9, 16), (1, 1, 11, 16), (1, 1, 11, 16), False),
    "K/V 3-D against a 4-D query": ((2, 4, 9, 16), (4, 11, 16), (4, 11, 16), False),
    "K/V 2-D against a 4-D query": ((2, 4, 9, 16), (11, 16), (11, 16), False),
    "query broadcast": ((1, 1, 9, 16), (2, 4, 11, 16), (2, 4, 11, 16), False),
    "K one head, V four": ((2, 4, 9, 16), (2, 1, 11, 16), (2, 4, 11, 16), False),
    "5-D broadcast": ((2, 3, 2, 9, 16), (1, 3, 1, 11, 16), (1, 3, 1, 11, 16), False),
    "GQA 5-D": ((2, 3, 4, 9, 16), (2, 1, 2, 11, 16), (2, 1, 2, 11, 16), True),
    "GQA K two heads, V four": ((2, 4, 9, 16), (2, 2, 11, 16), (2, 4, 11, 16), True),
    "GQA 3-D": ((4, 9, 16), (2, 11, 16), (2, 11, 16), True),
    "decode step, K/V batch of one": ((3, 4, 1, 16), (1, 1, 40, 16), (1, 1, 40, 16), False),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("causal", [False, True])
def test_each_new_shape_is_served_by_the_kernels_with_sdpas_answer(name, causal, strict):
    q_shape, k_shape, v_shape, gqa = SHAPES[name]
    q, k, v = rand(*q_shape, seed=1), rand(*k_shape, seed=2), rand(*v_shape, seed=3)
    out = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=gqa)  # (strict: a fallback would raise)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
                               atol=2e-5, rtol=2e-4)
    assert autoflash.attention(q, k, v, is_causal=causal, enable_gqa=gqa).shape == out.shape  # (the planned call)


@pytest.mark.parametrize("name", ["3-D (B*H, N, D)", "5-D", "K/V one head", "K/V batch of one", "5-D broadcast",
                                  "query broadcast", "GQA 5-D"])
def test_gradients_of_the_new_shapes_are_sdpas(name, strict):
    q_shape, k_shape, v_shape, gqa = SHAPES[name]
    tensors = rand(*q_shape, seed=4), rand(*k_shape, seed=5), rand(*v_shape, seed=6)
    mine, theirs = ([t.clone().requires_grad_() for t in tensors] for _ in range(2))
    grad = None
    for fn, leaves in ((autoflash.attention, mine), (F.scaled_dot_product_attention, theirs)):
        out = fn(*leaves, is_causal=True, enable_gqa=gqa)
        grad = rand(*out.shape, seed=7) if grad is None else grad
        out.backward(grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_one_head_and_a_batch_of_one_are_served_as_views_not_copies():
    q, k = rand(2, 4, 9, 16, seed=8), rand(1, 1, 11, 16, seed=9)
    q4, k4, v4 = kernel_views(q, k, k, sdpa_batch(q, k, k, False))
    assert k4.shape == (2, 1, 11, 16) and k4.stride(0) == 0 and k4.data_ptr() == k.data_ptr()
    assert q4 is q or q4.data_ptr() == q.data_ptr()
    flat = rand(6, 9, 16, seed=10)  # (B*H, N, D): a (1, B*H, N, D) view
    q4 = kernel_views(flat, flat, flat, sdpa_batch(flat, flat, flat, False))[0]
    assert q4.shape == (1, 6, 9, 16) and q4.data_ptr() == flat.data_ptr()


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), np.int64(1), np.float16(0.5), torch.tensor(0.3),
                                   torch.tensor(1, dtype=torch.int32), 1, True])
def test_numpy_and_tensor_scales_are_read_as_torch_reads_them(scale, strict):
    q, k, v = rand(2, 2, 9, 16, seed=11), rand(2, 2, 9, 16, seed=12), rand(2, 2, 9, 16, seed=13)
    out = autoflash.attention(q, k, v, scale=scale)  # (strict: on the kernels)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=scale), atol=2e-5, rtol=2e-4)


def test_the_flash_attn_forms_take_numpy_numbers_too(strict):
    q = rand(1, 9, 2, 16, seed=16)
    want = autoflash.flash_attn_func(q, q, q, 0.0, float(np.float32(0.3)), True)
    assert torch.equal(autoflash.flash_attn_func(q, q, q, np.float32(0.0), np.float32(0.3), True), want)


@pytest.mark.parametrize("q_shape, k_shape, gqa", [
    ((2, 4, 9, 16), (2, 2, 11, 16), False),  # heads that do not broadcast: enable_gqa is missing
    ((2, 4, 9, 16), (2, 3, 11, 16), True),  # 3 does not divide 4
    ((9, 16), (11, 16), True),  # enable_gqa needs a heads dim
    ((3, 4, 9, 16), (2, 4, 11, 16), False),  # batch 3 against 2
    ((16,), (11, 16), False),  # 1-D
])
def test_shapes_torch_refuses_are_refused(q_shape, k_shape, gqa):
    q, k = rand(*q_shape, seed=14), rand(*k_shape, seed=15)
    with pytest.raises(Exception):
        F.scaled_dot_product_attention(q, k, k, enable_gqa=gqa)
    with pytest.raises(ValueError):
        autoflash.attention(q, k, k, enable_gqa=gqa)


# ----------------------------------------------------------------------------- random calls
def _tensor_shape(draw, batch, rank_cap):
    """Batch dims that broadcast to `batch`: some leading dims dropped, some set to 1."""
    rank = draw(st.integers(0, min(len(batch), rank_cap)))
    return [1 if draw(st.integers(0, 3)) == 0 else d for d in batch[len(batch) - rank:]]


@st.composite
def calls(draw):
    batch = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=0, max_size=3))
    heads = batch[-1] if batch else 1
    gqa = draw(st.booleans()) and len(batch) >= 1
    n_q, n_k = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    e = 16
    ev = draw(st.sampled_from([16, 16, 16, 8]))
    q_batch = _tensor_shape(draw, batch, 3)
    if gqa:  # all three 3-D at least, K/V heads dividing the query's
        q_batch = _tensor_shape(draw, batch[:-1], 2) + [heads]
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        k_batch = _tensor_shape(draw, batch[:-1], 2) + [draw(st.sampled_from(divisors))]
        v_batch = _tensor_shape(draw, batch[:-1], 2) + [draw(st.sampled_from(divisors))]
    else:
        k_batch, v_batch = _tensor_shape(draw, batch, 3), _tensor_shape(draw, batch, 3)
    if draw(st.integers(0, 9)) == 0 and k_batch:  # now and then a shape torch refuses
        k_batch[draw(st.integers(0, len(k_batch) - 1))] = 5
    q = rand(*q_batch, n_q, e, seed=draw(st.integers(0, 99)))
    k = rand(*k_batch, n_k, e, seed=draw(st.integers(0, 99)))
    v = rand(*v_batch, n_k, ev, seed=draw(st.integers(0, 99)))
    scale = draw(st.sampled_from([None, 0.2, np.float32(0.7), np.float64(0.1), torch.tensor(0.4), 2, True,
                                  -0.5, float("nan")]))
    mask = None
    if draw(st.integers(0, 3)) == 0:  # a mask that broadcasts to the scores (or, now and then, does not)
        scores = [*batch, n_q, n_k]  # (larger than the output's batch when every tensor broadcasts a dim: refused)
        mask_shape = [1 if draw(st.booleans()) else d for d in scores[len(scores) - draw(st.integers(2, len(scores))):]]
        if draw(st.integers(0, 9)) == 0:
            mask_shape[-1] += 1
        mask = rand(*mask_shape, seed=1) > 0 if draw(st.booleans()) else rand(*mask_shape, seed=2)
    causal = draw(st.booleans())
    dropout = draw(st.sampled_from([0.0] * 6 + [0, np.float32(0.0), -0.5, float("nan"), 0.3, 1.5]))
    return (q, k, v), dict(attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=gqa)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(calls())
def test_random_calls_give_sdpas_answer_or_its_refusal(call):
    args, kwargs = call
    mine, theirs = both(*args, **kwargs)
    if kwargs["dropout_p"] > 0 and theirs is not None:  # (a random answer: its shape is what compares)
        assert mine is not None and mine.shape == theirs.shape
        return
    assert_same(mine, theirs)


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("served_by", ["policy", "own"])
def test_new_shapes_on_the_gpu(name, served_by, request):
    """bf16, longer sequences: the SDPA-cuDNN serving policy and the own kernels (stride-0 views, TMA
    descriptors per head) both give SDPA's float32 answer within bf16's error, forward and backward."""
    if served_by == "own":
        request.getfixturevalue("own_kernels")
    q_shape, k_shape, v_shape, gqa = SHAPES[name]
    grow = {9: 300, 11: 517, 40: 2000, 16: 128}  # (sequence and head dims at GPU sizes)
    shapes = [tuple(grow.get(d, d) if i >= len(s) - 2 else d for i, d in enumerate(s)) for s in (q_shape, k_shape,
                                                                                                 v_shape)]
    tensors = [rand(*s, seed=20 + i).cuda().bfloat16().requires_grad_() for i, s in enumerate(shapes)]
    out = autoflash.attention(*tensors, is_causal=True, enable_gqa=gqa)
    exact = [t.detach().float().requires_grad_() for t in tensors]
    want = F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=gqa)
    sdpa = F.scaled_dot_product_attention(*(t.detach().requires_grad_() for t in tensors), is_causal=True,
                                          enable_gqa=gqa)
    assert out.shape == want.shape
    assert (out.float() - want).abs().max() <= 3 * (sdpa.float() - want).abs().max() + 1e-3
    grad = torch.randn_like(want)
    out.backward(grad.bfloat16())
    want.backward(grad)
    for mine, exact_leaf in zip(tensors, exact):
        err = (mine.grad.float() - exact_leaf.grad).norm() / exact_leaf.grad.norm()
        assert err < 2e-2
