"""Public API: correctness through autoflash.attention / flash_attn_func, validation, fallbacks."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import autoflash
from autoflash import api, flash_attn
from autoflash.reference import reference, rel_error

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    api.reset()
    yield


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal)
SHAPES = [
    (2, 2, 2, 37, 37, 64, False),
    (1, 4, 2, 113, 17, 80, True),
    (1, 4, 1, 17, 113, 128, True),
    (2, 2, 2, 1, 64, 64, True),
    (1, 2, 2, 64, 1, 32, False),
    (1, 3, 3, 61, 61, 96, True),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attention_matches_reference(shape, dtype, strict):
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v = rand(b, hq, nq, d, dtype=dtype, seed=1), rand(b, hkv, nk, d, dtype=dtype, seed=2), rand(b, hkv, nk, d, dtype=dtype, seed=3)
    out = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype and out.is_contiguous()
    ref, _ = reference(q, k, v, causal, 0, 1 / math.sqrt(d))
    assert rel_error(out, ref) <= TOL[dtype]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_flash_attn_func_matches_reference(shape, dtype, strict):
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v = rand(b, nq, hq, d, dtype=dtype, seed=4), rand(b, nk, hkv, d, dtype=dtype, seed=5), rand(b, nk, hkv, d, dtype=dtype, seed=6)
    out = autoflash.flash_attn_func(q, k, v, causal=causal, softmax_scale=0.3)
    assert out.shape == (b, nq, hq, d) and out.is_contiguous()
    # flash-attn aligns causal bottom-right: query i sees keys j <= i + nk - nq; empty rows are 0.
    ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, nk - nq, 0.3)
    assert rel_error(out.transpose(1, 2), ref) <= TOL[dtype]


@pytest.mark.interpreter
def test_forward_with_lse_returns_log_sum_exp(strict):
    q, k, v = rand(1, 2, 37, 64, seed=7), rand(1, 2, 53, 64, seed=8), rand(1, 2, 53, 64, seed=9)
    out, lse = api.forward_with_lse(q, k, v, causal=True, causal_offset=53 - 37)
    ref, ref_lse = reference(q, k, v, True, 53 - 37, 1 / 8)
    assert lse.shape == (1, 2, 37) and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max() < 1e-5


@pytest.mark.interpreter
def test_attention_matches_torch_sdpa(strict):
    q, k, v = rand(2, 4, 45, 64, seed=10), rand(2, 4, 45, 64, seed=11), rand(2, 4, 45, 64, seed=12)
    for causal in (False, True):
        ours = autoflash.attention(q, k, v, is_causal=causal, scale=0.2)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.2)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.interpreter
def test_attention_output_keeps_an_attention_layers_layout(strict):
    """q/k/v as attention layers make them, (B, N, H, D) seen through transpose(1, 2): the output
    comes back in that layout (the kernels write it there; no copy to contiguous), on the first
    call, on the repeated-call fast path and through autograd, and the values are right."""
    api.inference_plans.clear()
    b, n, hq, hkv, d = 2, 37, 4, 2, 32
    q, k, v = (rand(b, n, h, d, dtype=torch.float16, seed=s).transpose(1, 2) for h, s in ((hq, 30), (hkv, 31), (hkv, 32)))
    ref, _ = reference(q, k, v, True, 0, 1 / math.sqrt(d))
    for _ in range(2):  # the second call takes the fast path
        out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
        assert out.shape == q.shape and out.stride() == q.stride() and not out.is_contiguous()
        assert out.transpose(1, 2).is_contiguous()  # so the usual reshape to (B, N, H * D) is a view
        assert rel_error(out, ref) <= TOL[torch.float16]
    from autoflash.reference import reference_grads

    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    out = autoflash.attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    assert out.stride() == q32.stride()
    grad = rand(b, n, hq, d, seed=33).transpose(1, 2)  # dO arrives in the same layout
    out.backward(grad)
    for mine, ref in zip((q32.grad, k32.grad, v32.grad), reference_grads(q32, k32, v32, grad, True, 0, d ** -0.5)):
        assert rel_error(mine, ref) < 1e-4


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, match", [
    (dict(q=rand(8), k=rand(2, 2, 8, 4), v=rand(2, 2, 8, 4)), "query must be at least 2-D"),
    (dict(q=rand(2, 2, 8, 4), k=rand(2, 2, 8, 4, dtype=torch.float16), v=rand(2, 2, 8, 4)), "one dtype"),
    (dict(q=rand(2, 2, 8, 4), k=rand(2, 2, 8, 4), v=rand(2, 2, 9, 4)), "key and value must agree"),
    (dict(q=rand(2, 2, 8, 4), k=rand(3, 2, 8, 4), v=rand(3, 2, 8, 4)), "batch dims .* do not broadcast"),
    (dict(q=rand(2, 2, 8, 4), k=rand(2, 2, 8, 8), v=rand(2, 2, 8, 8)), "head dim"),
    (dict(q=rand(2, 4, 8, 8), k=rand(2, 2, 8, 8), v=rand(2, 2, 8, 8)), "enable_gqa=True"),
])
def test_attention_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        autoflash.attention(kwargs["q"], kwargs["k"], kwargs["v"])


def test_gqa_heads_must_divide():
    with pytest.raises(ValueError, match="multiple of"):
        autoflash.attention(rand(1, 6, 8, 8), rand(1, 4, 8, 8), rand(1, 4, 8, 8), enable_gqa=True)
    with pytest.raises(ValueError, match="multiple of"):
        autoflash.flash_attn_func(rand(1, 8, 6, 8), rand(1, 8, 4, 8), rand(1, 8, 4, 8))


def test_flash_attn_func_names_its_layout():
    with pytest.raises(ValueError, match=r"\(batch, seqlen, heads, head_dim\)"):
        autoflash.flash_attn_func(rand(8, 2, 8), rand(8, 2, 8), rand(8, 2, 8))


# ----------------------------------------------------------------------------- fallbacks
def test_attn_mask_falls_back_once_with_a_warning():
    q, k, v = rand(1, 2, 16, 32, seed=1), rand(1, 2, 16, 32, seed=2), rand(1, 2, 16, 32, seed=3)
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(0)) > 0.3
    with pytest.warns(api.FallbackWarning, match="attn_mask"):
        out = autoflash.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason warns only once
        autoflash.attention(q, k, v, attn_mask=mask)


def test_strict_mode_turns_fallback_into_error(strict):
    q = rand(1, 2, 16, 32)
    with pytest.raises(api.FallbackError, match="dropout"):
        autoflash.attention(q, q, q, dropout_p=1.0)  # (0 < dropout_p < 1 runs on the kernels: autoflash.dropout)
    with pytest.raises(api.FallbackError, match="head dim"):
        autoflash.attention(rand(1, 2, 16, 264), rand(1, 2, 16, 264), rand(1, 2, 16, 264))


@pytest.mark.interpreter
def test_non_positive_scale_falls_back_and_stays_right():
    q, k, v = rand(1, 2, 37, 32, seed=1), rand(1, 2, 37, 32, seed=2), rand(1, 2, 37, 32, seed=3)
    for scale in (-0.3, 0.0):
        with pytest.warns(api.FallbackWarning, match="scale"):
            out = autoflash.attention(q, k, v, is_causal=True, scale=scale)
        ref, _ = reference(q, k, v, True, 0, scale)
        assert rel_error(out, ref) < 1e-5
        api.reset()
    with pytest.warns(api.FallbackWarning, match="scale"):
        autoflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=-1.0)


def test_cpu_tensors_without_interpreter_fall_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = rand(1, 2, 16, 32, seed=1), rand(1, 2, 16, 32, seed=2), rand(1, 2, 16, 32, seed=3)
    with pytest.warns(api.FallbackWarning, match="need a CUDA GPU"):
        out = autoflash.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_fallback_keeps_flash_attn_causal_alignment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = rand(1, 7, 2, 32, seed=1), rand(1, 4, 2, 32, seed=2), rand(1, 4, 2, 32, seed=3)
    with pytest.warns(api.FallbackWarning):
        out = autoflash.flash_attn_func(q, k, v, causal=True)
    ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 4 - 7, 1 / math.sqrt(32))
    assert rel_error(out.transpose(1, 2), ref) < 1e-5
    assert (out[:, :3] == 0).all()  # rows that see no key


@pytest.mark.interpreter
def test_bf16_in_interpreter_falls_back_never_wrong():
    q = rand(1, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.warns(api.FallbackWarning, match="bfloat16"):
        out = autoflash.attention(q, q, q)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES[:4], ids=str)
def test_gradients_through_both_apis(shape, strict):
    """fp32 gradients of attention and flash_attn_func vs float64 autograd of the reference."""
    b, hq, hkv, nq, nk, d, causal = shape
    q, k, v = rand(b, hq, nq, d, seed=1), rand(b, hkv, nk, d, seed=2), rand(b, hkv, nk, d, seed=3)
    grad = rand(b, hq, nq, d, seed=4)
    for api_form in ("sdpa", "flash"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if api_form == "sdpa":
            out = autoflash.attention(*leaves, is_causal=causal, enable_gqa=hq != hkv)
            out.backward(grad)
            offset = 0
        else:
            out = autoflash.flash_attn_func(*(t.transpose(1, 2) for t in leaves), causal=causal)
            out.backward(grad.transpose(1, 2))
            offset = nk - nq
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = reference(*ref_leaves, causal, offset, 1 / math.sqrt(d))
        ref.backward(grad.double())
        for mine, theirs in zip(leaves, ref_leaves):
            assert rel_error(mine.grad, theirs.grad) <= 1e-5, api_form


def test_no_grad_inference_skips_autograd():
    q = rand(1, 2, 16, 32).requires_grad_()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = autoflash.attention(q, q, q)
    assert not out.requires_grad


@pytest.mark.interpreter
def test_torch_compile_fullgraph_forward_and_backward(strict):
    """The kernels are torch.library custom ops: no graph break, gradients flow through; and
    tracing autoflash raises no warning of torch's (it warned about an lru_cache-wrapped helper,
    "Silent incorrectness is only a potential risk", attributed to autoflash/api.py)."""
    def model(q, k, v):
        return autoflash.attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    q = rand(1, 4, 37, 64, seed=1).requires_grad_()
    k, v = rand(1, 2, 37, 64, seed=2), rand(1, 2, 37, 64, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(q, k, v)
    assert not [str(w.message) for w in caught if "autoflash" in str(w.message) or "autoflash" in w.filename]
    ref, _ = reference(q.detach(), k, v, True, 0, 1 / 8)
    assert rel_error(out.detach() / 2, ref) <= 1e-5
    out.sum().backward()
    q_eager = q.detach().clone().requires_grad_()
    model(q_eager, k, v).sum().backward()
    torch.testing.assert_close(q.grad, q_eager.grad)


def test_empty_sequence_falls_back_with_sdpa_semantics():
    q, k = rand(1, 2, 0, 32), rand(1, 2, 5, 32)
    with pytest.warns(api.FallbackWarning, match="empty tensor"):
        out = autoflash.attention(q, k, k)
    assert out.shape == (1, 2, 0, 32)


@pytest.mark.interpreter
def test_repeated_inference_calls_take_the_fast_path_and_stay_correct(strict):
    calls = api.inference_plans
    calls.clear()
    shape = (1, 4, 2, 45, 45, 64)
    for seed in range(3):  # same signature, new data each time
        q, k, v = (rand(*shape[:2], shape[3], shape[5], dtype=torch.float16, seed=seed),
                   rand(shape[0], shape[2], shape[4], shape[5], dtype=torch.float16, seed=seed + 10),
                   rand(shape[0], shape[2], shape[4], shape[5], dtype=torch.float16, seed=seed + 20))
        out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
        assert len(calls) == 1  # first call stored the signature, the next ones reused it
        ref, _ = reference(q, k, v, True, 0, 1 / math.sqrt(shape[5]))
        assert rel_error(out, ref) <= TOL[torch.float16]
    # Another scale is another signature, with its own validated entry.
    out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    assert len(calls) == 2 and rel_error(out, reference(q, k, v, True, 0, 0.3)[0]) <= TOL[torch.float16]


@pytest.mark.interpreter
def test_flash_attn_func_repeats_take_the_fast_path_with_bottom_right_causality(strict):
    calls = api.inference_plans
    calls.clear()
    for seed in range(3):  # Nq < Nk, GQA 4/2, (B, N, H, D): same signature, new data each time
        q = rand(2, 29, 4, 32, dtype=torch.float16, seed=seed)
        k, v = (rand(2, 45, 2, 32, dtype=torch.float16, seed=seed + s) for s in (10, 20))
        out = autoflash.flash_attn_func(q, k, v, causal=True)
        assert len(calls) == 1 and out.shape == q.shape and out.is_contiguous()
        ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True, 45 - 29, 1 / math.sqrt(32))
        assert rel_error(out.transpose(1, 2), ref) <= TOL[torch.float16]
    # The same (B, H, N, D) views through `attention` mean top-left causality: their own entry.
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = autoflash.attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    assert len(calls) == 2
    assert rel_error(out, reference(qt, kt, vt, True, 0, 1 / math.sqrt(32))[0]) <= TOL[torch.float16]
    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        autoflash.flash_attn_func([1.0], k, v, causal=True)


@pytest.mark.interpreter
def test_fast_path_never_skips_validation_autograd_or_fallbacks(strict):
    api.inference_plans.clear()
    q, k, v = (rand(1, 2, 33, 32, seed=s) for s in (1, 2, 3))
    autoflash.attention(q, k, v)
    # Same query, a key whose heads neither match nor broadcast: a new signature, so validation runs and raises.
    with pytest.raises(ValueError, match="enable_gqa"):
        autoflash.attention(rand(1, 4, 33, 32), rand(1, 2, 33, 32), rand(1, 2, 33, 32))
    # Differentiable calls go through the custom op (an autograd graph), never the fast path.
    qg = q.clone().requires_grad_()
    assert autoflash.attention(qg, k, v).grad_fn is not None
    # A mask is not a signature the kernels took: it still reaches the (strict) fallback.
    with pytest.raises(api.FallbackError):
        autoflash.attention(q, k, v, attn_mask=torch.ones(33, 33, dtype=torch.bool))


@pytest.mark.interpreter
def test_a_tensor_scale_is_planned_as_its_float_and_interpreter_off_bypasses_the_fast_path(strict, monkeypatch):
    api.inference_plans.clear()
    q, k, v = (rand(1, 2, 20, 32, seed=s) for s in (4, 5, 6))
    out = autoflash.attention(q, k, v, scale=torch.tensor(0.2))  # served, and planned as the float torch reads
    assert rel_error(out, reference(q, k, v, False, 0, 0.2)[0]) <= TOL[torch.float32]
    assert [key[13] for key in api.inference_plans] == [float(torch.tensor(0.2))]
    api.inference_plans.clear()
    autoflash.attention(q, k, v)
    assert len(api.inference_plans) == 1
    # Same signature with the interpreter off: CPU tensors are a fallback again, never the cached kernel.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(api.FallbackError, match="CUDA GPU"):
        autoflash.attention(q, k, v)


@pytest.mark.parametrize("bad", ["query", "key"])
def test_non_tensor_input_is_a_value_error_even_after_a_fast_path_call(bad):
    q = rand(1, 2, 8, 32)
    autoflash.attention(q, q, q)  # fills the fast path for this signature
    args = {"query": q, "key": q, "value": q, bad: [1.0]}
    with pytest.raises(ValueError, match=f"{bad} must be a torch.Tensor"):
        autoflash.attention(**args)


@pytest.mark.interpreter
@pytest.mark.parametrize("nq, nk, hq, hkv, causal", [(37, 37, 2, 2, True), (23, 61, 4, 2, True), (61, 23, 2, 1, False)])
def test_flash_attn_heads_first_is_flash_attn_func_on_heads_first_views(nq, nk, hq, hkv, causal):
    """What the transformers integration calls with the (B, H, N, D) views a layer holds: the same
    output as flash_attn_func (bottom-right causal), on the first call and on the repeated one that
    goes straight to the plan, with gradients."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, nq, hq, 32, generator=g).requires_grad_()
    k, v = (torch.randn(2, nk, hkv, 32, generator=g).requires_grad_() for _ in range(2))
    want = autoflash.flash_attn_func(q, k, v, causal=causal)
    grads_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for _ in range(2):
        got = flash_attn.flash_attn_heads_first(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads_want):
            torch.testing.assert_close(a, b)
