"""No silent wrong answers: gradients at every scale (kernel-served and right, or handed to torch),
torch's refusals of `scaled_dot_product_attention` reproduced by `autoflash.attention` (a
differential test over random argument kinds), and every keyword transformers passes to an
attention function served or refused, never dropped. CPU: Triton's interpreter, float32."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import autoflash
from autoflash.fallback import FallbackError, FallbackWarning
from autoflash.integrations.transformers import HARMLESS, attention_forward
from autoflash.reference import reference_grads, rel_error, sdpa_grads
from helpers import rand

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("fresh_api")]




# ----------------------------------------------------------------------------- gradients at any scale
@pytest.mark.parametrize("shape, causal", [((1, 2, 37, 16), False), ((2, 2, 56, 64), True)])
@pytest.mark.parametrize("scale", [1e-3, 0.125, 1.0, 4.0, 30.0, 1e3, 1e6, 1e30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradients_are_right_or_torchs_at_every_scale(shape, causal, scale, dtype):
    q, k, v, grad = (rand(*shape, seed=s, dtype=dtype) for s in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoflash.attention(*leaves, is_causal=causal, scale=scale).backward(grad)
    served_by_torch = any(issubclass(w.category, FallbackWarning) for w in caught)
    torch_grads = sdpa_grads(q, k, v, grad, causal, 0, scale)
    if served_by_torch:  # torch's own answer, whatever its precision
        assert "scale" in str(caught[0].message)
        for mine, theirs in zip((t.grad for t in leaves), torch_grads):
            assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6, equal_nan=True)
        return
    for mine, theirs, ref in zip((t.grad for t in leaves), torch_grads, reference_grads(q, k, v, grad, causal, 0,
                                                                                        scale)):
        assert rel_error(mine, ref) <= 3 * rel_error(theirs, ref) + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [0.02, 0.125, 1.0, 8.0, 1e3, 1e30])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gradients_at_every_scale_on_the_gpu(causal, scale, dtype):
    q, k, v, grad = (rand(2, 4, 300, 64, seed=s, dtype=dtype).cuda() for s in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        autoflash.attention(*leaves, is_causal=causal, scale=scale).backward(grad)
    ref = reference_grads(q, k, v, grad, causal, 0, scale)
    for mine, theirs, want in zip((t.grad for t in leaves), sdpa_grads(q, k, v, grad, causal, 0, scale), ref):
        if torch.isfinite(want).all():
            assert rel_error(mine, want) <= 3 * rel_error(theirs, want) + 1e-6


def test_forward_only_calls_stay_on_the_kernels_at_large_scales(strict):
    q = rand(1, 1, 4, 16, seed=5)
    out = autoflash.attention(q, q, q, scale=1e30)  # (strict: a fallback would raise)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, q, q, scale=1e30), atol=1e-6)


# ----------------------------------------------------------------------------- torch's refusals
def torch_kinds_cases():
    q = rand(1, 2, 5, 8, seed=1)
    k2, v2 = rand(1, 1, 5, 8, seed=2), rand(1, 1, 5, 8, seed=3)
    kt = rand(1, 1, 5, 16, seed=4)[..., ::2]  # K/V with a gap between elements: torch's math backend
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    return {
        "positional scale": ((q, q, q, None, 0.0, False, 0.5), {}),
        "positional enable_gqa": ((q, q, q, None, 0.0, False, None, True), {}),
        "is_causal=1": ((q, q, q), {"is_causal": 1}),
        "is_causal=None": ((q, q, q), {"is_causal": None}),
        "enable_gqa=1": ((q, k2, v2), {"enable_gqa": 1}),
        "scale=tensor([0.5])": ((q, q, q), {"scale": torch.tensor([0.5])}),
        "scale='a'": ((q, q, q), {"scale": "a"}),
        "dropout_p=None": ((q, q, q), {"dropout_p": None}),
        "mask=list": ((q, q, q, [[0.0]]), {}),
        "mask int64": ((q, q, q, torch.ones(5, 5, dtype=torch.int64)), {}),
        "mask+causal GQA strided": ((q, kt, kt, mask), {"is_causal": True, "enable_gqa": True}),
        "query=list": (([1.0], q, q), {}),
        "mixed dtypes": ((q, q.double(), q), {}),
        "extra positional": ((q, q, q, None, 0.0, False, None, False, 1), {}),
    }


@pytest.mark.parametrize("case", sorted(torch_kinds_cases()))
def test_each_torch_refusal_is_reproduced(case):
    args, kwargs = torch_kinds_cases()[case]
    with pytest.raises(Exception):
        F.scaled_dot_product_attention(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            autoflash.attention(*args, **kwargs)


ARG_VALUES = st.sampled_from([None, True, False, 0, 1, 0.0, 0.5, 2, -1.0, float("nan"), "x", [0.5],
                              torch.tensor(0.5), torch.tensor([0.5]), torch.tensor(True)])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(is_causal=ARG_VALUES, enable_gqa=ARG_VALUES, scale=ARG_VALUES, dropout_p=ARG_VALUES,
       heads_kv=st.sampled_from([1, 2]), with_mask=st.booleans(), strided=st.booleans())
# (a scale <= 0 runs torch's math backend, which took a negative dropout that torch's default refuses)
@example(is_causal=True, enable_gqa=True, scale=False, dropout_p=-1.0, heads_kv=1, with_mask=False, strided=False)
@example(is_causal=True, enable_gqa=True, scale=False, dropout_p=0.0, heads_kv=1, with_mask=False, strided=False)
# (the default backend takes an explicit mask with is_causal for a scale <= 0; the math backend refuses it)
@example(is_causal=True, enable_gqa=True, scale=False, dropout_p=False, heads_kv=1, with_mask=True, strided=False)
# (a NaN scale: torch's default backend answers 0, its math backend NaN: torch's answer)
@example(is_causal=True, enable_gqa=True, scale=float("nan"), dropout_p=False, heads_kv=1, with_mask=False, strided=False)
def test_what_torch_refuses_autoflash_refuses(is_causal, enable_gqa, scale, dropout_p, heads_kv, with_mask, strided):
    """A differential test: any call torch refuses is refused here too; any call torch answers gets its answer."""
    q = rand(1, 2, 6, 8, seed=7)
    k = rand(1, heads_kv, 6, 16, seed=8)[..., ::2]  # (a gap between elements: torch's math backend)
    k = k if strided else k.contiguous()
    mask = torch.ones(6, 6, dtype=torch.bool).tril() if with_mask else None
    kwargs = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    try:
        theirs = F.scaled_dot_product_attention(q, k, k, **kwargs)
    except Exception:  # noqa: BLE001 (any refusal)
        theirs = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        try:
            mine = autoflash.attention(q, k, k, **kwargs)
        except (TypeError, ValueError, RuntimeError):
            mine = None
    assert (mine is None) == (theirs is None)
    if theirs is not None and not torch.as_tensor(dropout_p).item() > 0:  # (dropout: a random answer)
        if theirs.isnan().any():
            # torch's fused CPU kernel returns NaN for a zero scale with is_causal (torch 2.13), where
            # every score is 0 and the softmax uniform: its math backend, the definition, is the answer
            # (unless the math backend refuses what the default one took: an explicit mask with is_causal)
            try:
                with sdpa_kernel(SDPBackend.MATH):
                    theirs = F.scaled_dot_product_attention(q, k, k, **kwargs)
            except RuntimeError:
                pass
        assert torch.allclose(mine, theirs, atol=1e-5, equal_nan=True)


# ----------------------------------------------------------------------------- transformers' keywords
class Layer(torch.nn.Module):
    is_causal = True


def transformers_eager(query, key, value, mask=None, scaling=None, softcap=None, sinks=None, window=None, causal=True):
    """transformers' eager attention (Gemma-2's softcap, gpt-oss's sinks, a sliding window as the
    mask transformers builds for it) in float64: the reference."""
    q, k, v = (t.double() for t in (query, key, value))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(2, 3) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    n_q, n_k = q.shape[2], k.shape[2]
    i = torch.arange(n_q)[:, None] + n_k - n_q
    j = torch.arange(n_k)[None, :]
    allowed = j <= i if causal else torch.ones_like(j <= i)
    if window is not None:
        allowed &= j > i - window
    if mask is not None:
        allowed = mask
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
        return (torch.softmax(s, -1)[..., :-1] @ v).transpose(1, 2)
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def _qkv():
    return rand(2, 4, 9, 16, seed=11), rand(2, 2, 9, 16, seed=12), rand(2, 2, 9, 16, seed=13)


def _sliding_mask(n, window):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return ((j <= i) & (j > i - window))[None, None].expand(2, 1, n, n)


KEYWORD_CASES = {
    "softcap": (dict(softcap=2.0, scaling=1.0), dict(softcap=2.0, scaling=1.0)),
    "sliding_window without a mask": (dict(sliding_window=3), dict(window=3)),
    "sliding_window with its mask": (dict(sliding_window=3, mask=True), dict(window=3)),
    "softcap with a sliding mask": (dict(softcap=2.0, sliding_window=3, mask=True), dict(softcap=2.0, window=3)),
    "s_aux": (dict(s_aux=torch.tensor([0.5, -1.0, 2.0, 0.0])), dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))),
    "s_aux with a mask": (dict(s_aux=torch.tensor([0.5, -1.0, 2.0, 0.0]), sliding_window=3, mask=True),
                          dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), window=3)),
    "scaling": (dict(scaling=0.7), dict(scaling=0.7)),
    "is_causal=False": (dict(is_causal=False), dict(causal=False)),
}


@pytest.mark.parametrize("case", sorted(KEYWORD_CASES))
@pytest.mark.parametrize("strict_mode", [False, True])
def test_transformers_keywords_give_the_eager_answer_or_refuse(case, strict_mode, monkeypatch):
    if strict_mode:
        monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    ours, theirs = KEYWORD_CASES[case]
    ours = dict(ours)
    q, k, v = _qkv()
    mask = _sliding_mask(9, ours["sliding_window"]) if ours.pop("mask", False) else None
    want = transformers_eager(q, k, v, mask=mask, **theirs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            out, weights = attention_forward(Layer(), q, k, v, mask, **ours)
    except FallbackError:
        assert strict_mode, "only strict mode refuses"
        return
    assert weights is None
    assert (out.double() - want).abs().max().item() < 2e-5


def test_transformers_dropout_in_training_is_applied():
    layer = Layer().train()
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        out, _ = attention_forward(layer, q, k, v, None, dropout=1.0)
    assert out.abs().max().item() == 0.0  # every probability dropped
    out, _ = attention_forward(layer.eval(), q, k, v, None, dropout=1.0)  # evaluation: no dropout
    assert (out.double() - transformers_eager(q, k, v)).abs().max().item() < 2e-5


def test_packed_documents_without_a_mask_attend_within_their_document():
    q, k, v = (t[:1] for t in _qkv())
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, _ = attention_forward(Layer(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5,
                               max_length_k=5)
    for a, b in ((0, 4), (4, 9)):
        want = transformers_eager(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        assert (out[:, a:b].double() - want).abs().max().item() < 2e-5
    with warnings.catch_warnings():  # with sinks: the documents become a mask for the torch path
        warnings.simplefilter("ignore", FallbackWarning)
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
        out, _ = attention_forward(Layer(), q, k, v, None, s_aux=sinks, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    for a, b in ((0, 4), (4, 9)):
        want = transformers_eager(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], sinks=sinks)
        assert (out[:, a:b].double() - want).abs().max().item() < 2e-5


def test_an_unknown_keyword_warns_once_and_strict_refuses(monkeypatch):
    q, k, v = _qkv()
    with pytest.warns(FallbackWarning, match="mystery_bias"):
        attention_forward(Layer(), q, k, v, None, mystery_bias=torch.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # once: the second call is quiet
        attention_forward(Layer(), q, k, v, None, mystery_bias=torch.ones(1))
        attention_forward(Layer(), q, k, v, None, position_ids=torch.arange(9)[None], output_attentions=False)
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    with pytest.raises(FallbackError, match="mystery_bias"):
        attention_forward(Layer(), q, k, v, None, mystery_bias=torch.ones(1))


def test_every_keyword_transformers_models_pass_is_known():
    """The keywords of transformers' `attention_interface(...)` calls across its models are served by
    `attention_forward`'s own parameters or listed as harmless (a new one fails here first)."""
    import ast
    import inspect
    import pathlib

    import transformers

    served = set(inspect.signature(attention_forward).parameters) - {"kwargs"}
    passed = set()
    for path in pathlib.Path(transformers.__file__).parent.glob("models/*/modeling_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "attention_interface":
                passed |= {kw.arg for kw in node.keywords if kw.arg}
    # Model-specific extras (sparse-attention indices, cross-attention's own q/k/v names) warn once.
    model_specific = {"indices", "block_indices", "query", "key", "value"}
    assert passed - served - HARMLESS - model_specific == set()
    assert {"softcap", "sliding_window", "s_aux", "scaling", "dropout", "is_causal"} <= served


def test_an_empty_static_cache_prefill_never_sees_the_empty_slots():
    """transformers skips the mask for a prefill into an empty static cache (keys past the queries are
    empty slots): causality is top-left there, on every path (kernels, softcap, sinks)."""
    q, k, v = _qkv()
    k_cache = torch.cat([k, torch.zeros(2, 2, 7, 16)], dim=2)  # 9 real tokens, 7 empty slots
    v_cache = torch.cat([v, torch.zeros(2, 2, 7, 16)], dim=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for ours, theirs in ((dict(), dict()), (dict(softcap=2.0), dict(softcap=2.0)), (dict(s_aux=sinks), dict(sinks=sinks))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            out, _ = attention_forward(Layer(), q, k_cache, v_cache, None, **ours)
        assert (out.double() - transformers_eager(q, k, v, **theirs)).abs().max().item() < 2e-5


def test_packing_offsets_that_do_not_fit_the_batch_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cu_seq_lens"):
        attention_forward(Layer(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens"):
        attention_forward(Layer(), q[:1], k[:1], v[:1], None, cu_seq_lens_q=torch.tensor([0, 4, 7], dtype=torch.int32))


def test_empty_sequences_in_the_torch_path_give_zeros_and_infinite_lse():
    q, k = rand(1, 0, 2, 16, seed=1), rand(1, 5, 2, 16, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        out = autoflash.flash_attn_func(q, k, k, softcap=5.0)
        assert out.shape == (1, 0, 2, 16)
        q2 = rand(1, 3, 2, 16, seed=3)
        out, lse, _ = autoflash.flash_attn_func(q2, k[:, :0], k[:, :0], softcap=5.0, return_attn_probs=True)
    assert out.abs().max().item() == 0 and torch.isinf(lse).all()
