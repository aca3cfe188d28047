"""Head dims that are not a multiple of 8 (and V head dims of their own such) run on the kernels,
padded to the kernels' power-of-two tile and masked inside them, where they used to fall back to torch
SDPA: forward and gradients through `autoflash.attention`, packed sequences, decoding against a KV
cache, against float64 (the CPU interpreter; the same calls in bf16 on a GPU, `gpu` marker). In 16-bit
types their rows are not 16-byte multiples: the pointer-load variants serve them (TMA needs 16-byte
rows), which the spaces say (tma_alignment). On a GPU these calls stay torch's
until the bf16 check has run there (AUTOFLASH_ODD_HEAD_DIMS=1 serves them on the kernels)."""

import pytest
import torch
import torch.nn.functional as F

import autoflash
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem, unsupported_head_dim
from autoflash.reference import rel_error
from autoflash.space import load_space

ODD = [12, 20, 36, 100, 130, 250]


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")  # a fall back to torch raises: the kernels must serve


def _reference_grads(q, k, v, causal, grad):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(grad.double())
    return out, (qd.grad, kd.grad, vd.grad)


def test_every_head_dim_up_to_256_is_the_kernels():
    assert all(unsupported_head_dim(d) is None for d in range(1, 257))
    assert "257" in unsupported_head_dim(257)


def test_on_a_gpu_odd_head_dims_stay_torchs_until_asked(monkeypatch):
    from autoflash.validate import odd_head_dim_on_gpu

    class Cuda:  # (the check reads only where the tensor lives)
        is_cuda = True

    monkeypatch.delenv("AUTOFLASH_ODD_HEAD_DIMS", raising=False)
    assert "head dim 100" in odd_head_dim_on_gpu(Cuda(), 128, 100)
    assert odd_head_dim_on_gpu(Cuda(), 128, 64) is None
    assert odd_head_dim_on_gpu(torch.empty(1), 100) is None  # (the interpreter: the kernels serve them)
    monkeypatch.setenv("AUTOFLASH_ODD_HEAD_DIMS", "1")
    assert odd_head_dim_on_gpu(Cuda(), 100) is None


@pytest.mark.interpreter
@pytest.mark.parametrize("d", ODD)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients_on_the_kernels(d, causal, strict):
    g = torch.Generator().manual_seed(d)
    q = torch.randn(1, 4, 37, d, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 113, d, generator=g).requires_grad_() for _ in range(2))
    out = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=True)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    ref, ref_grads = _reference_grads(q, k, v, causal, grad)
    assert rel_error(out, ref) <= 1e-5
    for mine, exact in zip((q.grad, k.grad, v.grad), ref_grads):
        assert rel_error(mine, exact) <= 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("d, dv", [(36, 20), (20, 100)])
def test_a_value_head_dim_of_its_own_that_is_odd_too(d, dv, strict):
    g = torch.Generator().manual_seed(d + dv)
    q, k = (torch.randn(1, 2, n, d, generator=g).requires_grad_() for n in (37, 113))
    v = torch.randn(1, 2, 113, dv, generator=g).requires_grad_()
    out = autoflash.attention(q, k, v)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    ref, ref_grads = _reference_grads(q, k, v, False, grad)
    assert out.shape[-1] == dv and rel_error(out, ref) <= 1e-5
    for mine, exact in zip((q.grad, k.grad, v.grad), ref_grads):
        assert rel_error(mine, exact) <= 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [20, 100])
def test_packed_sequences_and_decoding(d, strict):
    g = torch.Generator().manual_seed(d)
    cu = torch.tensor([0, 37, 150], dtype=torch.int32)
    q, k, v = torch.randn(150, 4, d, generator=g), torch.randn(150, 2, d, generator=g), torch.randn(150, 2, d, generator=g)
    out = autoflash.flash_attn_varlen_func(q, k, v, cu, cu, 113, 113, causal=True)
    ref = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None].double() for t in (q, k, v)),
                                                    is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                     for a, b in ((0, 37), (37, 150))])
    assert rel_error(out, ref) <= 1e-5
    k_cache, v_cache = torch.randn(2, 128, 2, d, generator=g), torch.randn(2, 128, 2, d, generator=g)
    q1, seqlens = torch.randn(2, 1, 4, d, generator=g), torch.tensor([77, 40], dtype=torch.int32)
    out = autoflash.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens)
    ref = torch.cat([F.scaled_dot_product_attention(q1[b:b + 1].transpose(1, 2).double(),
                                                    k_cache[b:b + 1, :n].transpose(1, 2).double(),
                                                    v_cache[b:b + 1, :n].transpose(1, 2).double(),
                                                    enable_gqa=True).transpose(1, 2)
                     for b, n in enumerate(seqlens.tolist())])
    assert rel_error(out, ref) <= 1e-5


@pytest.mark.parametrize("family", ["triton_fwd", "triton_bwd", "gluon_sm90_fwd"])
def test_no_tma_variant_for_rows_tma_cannot_read(family):
    """In bf16 an odd head dim's rows are not 16-byte multiples: the spaces offer no TMA loads there (the
    backward's TMA reduce-add of dQ stays: its float32 buffer has rows of the padded BLOCK_D)."""
    hopper = gpu_fingerprint()
    import dataclasses

    hopper = dataclasses.replace(hopper, name="NVIDIA H200", cc_major=9, cc_minor=0, smem_per_block=232448)
    space = load_space(family)
    for d in (20, 100, 130):
        problem = Problem("bwd" if family == "triton_bwd" else "fwd", "bfloat16", d, True, 2, 2048, 2048)
        valid = space.valid_variants(problem, hopper)
        knobs = [v.as_dict() for v in valid]
        if family == "gluon_sm90_fwd":
            assert not valid  # (its TMA reads every tensor)
            continue
        assert knobs and not any(k.get("LOADS") == "tma" for k in knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [20, 100, 130])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_odd_head_dims_on_the_gpu(d, causal, strict, monkeypatch):
    """bf16 at ragged lengths against float64: within 2x the error of torch's own bf16 attention (math)."""
    monkeypatch.setenv("AUTOFLASH_ODD_HEAD_DIMS", "1")  # (on a GPU they run in torch by default so far)
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(2, 8, 1023, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 2, 4111, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    out = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=True)
    grad = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    out.backward(grad)
    ref, ref_grads = _reference_grads(q, k, v, causal, grad)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        torch_out = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=causal, enable_gqa=True)
    torch_err = rel_error(torch_out, ref)
    assert rel_error(out, ref) <= max(2 * torch_err, 1e-2)
    for mine, exact in zip((q.grad, k.grad, v.grad), ref_grads):
        assert rel_error(mine, exact) <= max(6 * torch_err, 3e-2)
