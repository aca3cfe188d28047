"""GPU tests (bf16 and fp16 on realistic shapes). Skipped without CUDA."""

import math
import random

import pytest
import torch

import autoflash
from autoflash import codegen
from autoflash.dispatch import get_dispatcher
from autoflash.measure import check, make_inputs, reference, rel_error, sdpa_error
from autoflash.problem import Shape, gpu_fingerprint
from autoflash.space import load_space

pytestmark = pytest.mark.gpu


def gpu_sample():
    """A seeded sample of valid variants per (head_dim, causal), with TMA and warp-specialized ones forced in."""
    if not torch.cuda.is_available():
        return []
    rng = random.Random(7)
    space, device = load_space("fwd"), gpu_fingerprint()
    picked = []
    for d in (64, 128):
        for causal in (False, True):
            shape = Shape(2, 8, 8, 1024, 1024, d, causal, "bfloat16")
            valid = space.valid_variants(shape.problem, device)
            tma = [v for v in valid if v["LOADS"] == "tma"]
            picked += [(v, d, causal) for v in rng.sample(valid, 3) + rng.sample(tma, 2)]
    return picked


SAMPLE = gpu_sample()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("variant, head_dim, causal", SAMPLE,
                         ids=[f"d{d}{'c' if c else ''}-{v.short()}" for v, d, c in SAMPLE])
def test_variant_passes_gate_on_gpu(variant, head_dim, causal, dtype):
    """Ragged lengths (1023, 113/203, 1), both layouts, both causal alignments, vs float64."""
    for hkv in (8, 2):  # MHA and GQA 4:1
        result = check(codegen.load(variant), Shape(2, 8, hkv, 1024, 1024, head_dim, causal, dtype), "cuda")
        assert result.passed, result.detail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_realistic_shapes(dtype, head_dim, causal, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    shape = Shape(2, 16, 4, 2047, 2047, head_dim, causal, str(dtype).split(".")[1])
    q, k, v = make_inputs(shape, "cuda", seed=3)
    out = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref, _ = reference(q, k, v, causal, 0, 1 / math.sqrt(head_dim), dtype=torch.float32)
    err, s_err = rel_error(out, ref), sdpa_error(q, k, v, causal, 0, 1 / math.sqrt(head_dim), ref)
    assert err <= max(2 * s_err, 1e-2 if dtype == torch.bfloat16 else 2e-3), (err, s_err)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_bnhd_no_copy(causal, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 1000, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 1537, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 1537, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    out = autoflash.flash_attn_func(q, k, v, causal=causal)
    ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, 537, 1 / math.sqrt(128),
                       dtype=torch.float32)
    assert rel_error(out.transpose(1, 2), ref) < 1e-2


def test_default_uses_tma_on_hopper_for_contiguous_inputs():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9")
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    module = get_dispatcher().module_for(q, q, q, torch.empty_like(q), causal=False)
    assert module.LOADS == "tma"
    base = torch.randn(q.numel() + 1, device="cuda", dtype=torch.bfloat16)
    odd = base[1:].view(q.shape)  # base address 2 bytes off a 16-byte boundary -> pointer loads
    assert get_dispatcher().module_for(odd, odd, odd, torch.empty_like(odd), causal=False).LOADS != "tma"
