"""Edge cases at the API where an answer was missing, silently wrong or an unhelpful crash: zero
heads, scales outside the kernels' float32 range, a second derivative, a varlen batch whose query
sequences see no key, and where a fallback's warning points. Each compares with torch SDPA in
float64 (the kernels run in the interpreter here, tests/conftest.py)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import autoflash
from autoflash import api
from autoflash.problem import unsupported_scale


# The kernels' cases on the CPU (the interpreter) and on a GPU (float16 there: the GPU's float32
# dot is tf32).
DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]


def _qkv(shape=(1, 2, 20, 16), requires_grad=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if device == "cuda" else torch.float32
    return [torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(requires_grad) for _ in range(3)]


@pytest.fixture(autouse=True)
def _fresh():
    api.reset()
    yield
    api.reset()


def test_zero_heads_give_an_empty_output_as_sdpa():
    q = torch.randn(1, 0, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.FallbackWarning)
        out = autoflash.attention(q, q, q)
        out_fa = autoflash.flash_attn_func(*(torch.randn(1, 5, 0, 16),) * 3)
    assert out.shape == F.scaled_dot_product_attention(q, q, q).shape == (1, 0, 5, 16)
    assert out_fa.shape == (1, 5, 0, 16)


@pytest.mark.parametrize("scale", [1e-40, 1e-45, 1.0e-38, 2.4e38, 3e38])
def test_a_scale_outside_the_kernels_float32_range_falls_back_and_matches_sdpa(scale):
    assert unsupported_scale(scale) is not None
    q, k, v = _qkv()
    with pytest.warns(api.FallbackWarning, match="outside the kernels' float32 range"):
        out = autoflash.attention(q, k, v, scale=scale)
    # What torch SDPA gives in the same dtype (at 3e38 float32 scores overflow there too).
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=scale), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1e-30, 1e-6, 0.125, 1e4, 1e30])
def test_scales_inside_the_range_run_on_the_kernels(scale, device):
    assert unsupported_scale(scale) is None and unsupported_scale(-scale) is None
    q, k, v = _qkv(device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", api.FallbackWarning)
        out = autoflash.attention(q, k, v, scale=scale)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_kvcache_with_an_out_of_range_scale_falls_back_and_a_zero_head_dim_is_empty():
    q, cache = torch.randn(1, 1, 2, 16), torch.randn(1, 9, 2, 16)
    with pytest.warns(api.FallbackWarning, match="float32 range"):
        out = autoflash.flash_attn_with_kvcache(q, cache, cache, softmax_scale=1e-40)
    assert torch.isfinite(out).all() and out.shape == q.shape
    empty = autoflash.flash_attn_with_kvcache(torch.randn(1, 1, 2, 0), torch.randn(1, 4, 2, 0), torch.randn(1, 4, 2, 0))
    assert empty.shape == (1, 1, 2, 0)


# the own kernels' refusal, or torch's where an SDPA backend serves the call (cuDNN's backward has no derivative)
SECOND_DERIVATIVE_REFUSED = "not twice differentiable|derivative for .* is not implemented"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["attention", "flash_attn_func"])
def test_a_second_derivative_through_the_kernels_raises_instead_of_dropping_a_term(fn, device):
    """torch.autograd.grad(..., create_graph=True) then a gradient of that gradient: the answer
    needs attention's second derivative, which the kernels do not have. It must raise, not return
    the first-order part alone."""
    q, k, v = _qkv(requires_grad=True, device=device)
    out = autoflash.attention(q, k, v) if fn == "attention" else autoflash.flash_attn_func(q, k, v)
    gq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=SECOND_DERIVATIVE_REFUSED):
        torch.autograd.grad(out.sum() + gq.square().sum(), v)


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_derivative_through_the_incoming_gradient_raises_too(device):
    """The second derivative may reach its parameter only through the gradient that flowed into the
    attention's backward (here w): it must raise as well, not drop the attention's term."""
    q, k, v = _qkv(requires_grad=True, device=device)
    w = torch.randn_like(q).requires_grad_()
    dq, = torch.autograd.grad(((autoflash.attention(q, k, v) + q) * w).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=SECOND_DERIVATIVE_REFUSED):
        torch.autograd.grad(dq.square().sum(), w)


@pytest.mark.parametrize("device", DEVICES)
def test_create_graph_without_a_second_derivative_still_gives_the_first_order_gradients(device):
    q, k, v = _qkv(requires_grad=True, device=device)
    gq, gk, gv = torch.autograd.grad(autoflash.attention(q, k, v).sum(), (q, k, v), create_graph=True)
    ref = [t.double().detach().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(F.scaled_dot_product_attention(*ref).sum(), ref)
    for got, exp in zip((gq, gk, gv), want):
        torch.testing.assert_close(got.double(), exp, atol=5e-3, rtol=5e-3)


def test_varlen_whose_query_sequences_see_no_key_gives_zeros_with_zero_gradients():
    cu_q, cu_k = torch.tensor([0, 3, 3], dtype=torch.int32), torch.tensor([0, 0, 6], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 20, generator=g, requires_grad=True)  # (head dim 20: the per-sequence fallback)
    k, v = (torch.randn(6, 2, 20, generator=g, requires_grad=True) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.FallbackWarning)
        out = autoflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 6)
    assert out.shape == (3, 2, 20) and not out.detach().any()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and not t.grad.any()


def _caller_line_of_the_warning(call) -> tuple[str, int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = call()
    [w] = [w for w in caught if issubclass(w.category, api.FallbackWarning)]
    return (w.filename, w.lineno), line


@pytest.mark.parametrize("case", ["attention", "flash_attn_func", "varlen", "kvcache"])
def test_a_fallback_warning_points_at_the_callers_line(case):
    from inspect import currentframe as here

    q4 = torch.randn(1, 2, 5, 264)  # (head dim 264: a fallback)
    t3, cu = torch.randn(5, 2, 264), torch.tensor([0, 5], dtype=torch.int32)  # (packed: 5 tokens)

    def call():  # each call and the line number on one line
        if case == "attention":
            autoflash.attention(q4, q4, q4); return here().f_lineno  # noqa: E702
        if case == "flash_attn_func":
            autoflash.flash_attn_func(q4, q4, q4); return here().f_lineno  # noqa: E702
        if case == "varlen":
            autoflash.flash_attn_varlen_func(t3, t3, t3, cu, cu, 5, 5); return here().f_lineno  # noqa: E702
        autoflash.flash_attn_with_kvcache(q4[:, :1], q4, q4); return here().f_lineno  # noqa: E702

    (filename, lineno), line = _caller_line_of_the_warning(call)
    assert (filename, lineno) == (__file__, line)


def test_meta_tensors_fall_back_in_the_interpreter_too():
    q = torch.empty(1, 2, 20, 16, device="meta")
    with pytest.warns(api.FallbackWarning, match="meta tensors need a CUDA GPU"):
        out = autoflash.attention(q, q, q)
    assert out.shape == q.shape and out.device.type == "meta"
