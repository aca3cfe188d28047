"""Packed variable-length sequences (`flash_attn_varlen_func`, the kernels' VARLEN mode): output,
log-sum-exp and gradients of every sequence against a float64 reference of that sequence alone,
for each structural variant of the forward and backward kernels, with outputs poisoned first.
Under the interpreter on tiny ragged batches; on the GPU (bfloat16) on the ragged lengths
(1, 37, 113, 1023, 4111) and a batch with empty sequences."""

from __future__ import annotations

import math
import random

import pytest
import torch

import autoflash
from autoflash import api, codegen
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import get_dispatcher
from autoflash.problem import Problem
from autoflash.reference import reference, rel_error
from autoflash.space import load_space

# (query lengths, key lengths, heads_q, heads_kv, head dim): sequences with no query, with no key,
# shorter and longer than one tile, Nq != Nk (the causal mask is bottom-right per sequence).
INTERPRETER_CASES = [
    ((1, 37, 0, 70, 5), (5, 37, 3, 70, 0), 2, 1, 32),
    ((40, 3, 17), (17, 90, 17), 3, 3, 16),
]


def cu(lengths, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_inputs(lens_q, lens_k, hq, hkv, d, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, do = (torch.randn(sum(lens_q), hq, d, generator=g, device=device).to(dtype) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g, device=device).to(dtype) for _ in range(2))
    return q, k, v, do


def per_sequence_reference(q, k, v, do, lens_q, lens_k, causal, scale):
    """float64 out (total_q, H, D), lse (H, total_q) and gradients, each sequence on its own."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    a_q = a_k = 0
    for nq, nk in zip(lens_q, lens_k):
        qs = leaves[0][a_q:a_q + nq].transpose(0, 1)[None]
        ks, vs = (t[a_k:a_k + nk].transpose(0, 1)[None] for t in leaves[1:])
        if nk == 0:  # no key: zero output, lse +inf (as the kernels)
            outs.append(qs[0].transpose(0, 1) * 0)
            lses.append(torch.full((q.shape[1], nq), float("inf"), dtype=torch.float64, device=q.device))
        else:
            out, lse = reference(qs, ks, vs, causal, nk - nq, scale)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        a_q, a_k = a_q + nq, a_k + nk
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, leaves, do.double(), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return out.detach(), torch.cat(lses, dim=1), grads


def run_varlen(fwd, bwd, q, k, v, do, lens_q, lens_k, causal, scale):
    """The kernels' results with every output poisoned first (each element must be written)."""
    cu_q, cu_k = cu(lens_q, q.device), cu(lens_k, q.device)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    fwd.forward_varlen(q, k, v, out, lse, cu_q, cu_k, max(lens_q), scale, causal)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    bwd.backward_varlen(q, k, v, out, lse, do, *grads, cu_q, cu_k, max(lens_q), max(lens_k), scale, causal)
    return out, lse, grads


def check_against_reference(got, want, tolerance):
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = want
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_error(out, ref_out) <= tolerance
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # rows with no key: +inf
    assert (lse[finite].double() - ref_lse[finite]).abs().max() <= 10 * tolerance
    for mine, ref in zip(grads, ref_grads):
        assert not torch.isnan(mine).any()
        assert rel_error(mine, ref) <= tolerance


STRUCTURE = {"fwd": ("LOADS", "MASK_MODE", "KV_ORDER", "GRID_ORDER"), "bwd": ("DQ_MODE", "GRID_ORDER", "LOADS", "GQA_SPLIT")}
GROUP = {"fwd": 1, "bwd": 4}  # a GQA group, so that every split of it is offered


def structural_sample(op: str, seed: int, dtype: str = "float16"):
    """One valid variant per structural choice of the op's default family (on a causal problem,
    so heavy-first orders are offered), with random tiles."""
    rng = random.Random(seed)
    space, device = load_space(op), gpu_fingerprint()
    valid = space.valid_variants(Problem(op, dtype, 32, True, GROUP[op], 64, 64), device)
    knobs = STRUCTURE[op]
    picked = []
    for knob in knobs:
        for choice in sorted({v[knob] for v in valid}, key=str):
            picked.append(rng.choice([v for v in valid if v[knob] == choice and not v.as_dict().get("WARP_SPECIALIZE")]))
    return picked


FWD_SAMPLE = structural_sample("fwd", 1)
BWD_SAMPLE = structural_sample("bwd", 2)


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=["ragged-gqa", "nq-ne-nk"])
@pytest.mark.parametrize("i", range(max(len(FWD_SAMPLE), len(BWD_SAMPLE))))
def test_varlen_variants_match_float64_per_sequence(i, case, causal):
    fwd, bwd = FWD_SAMPLE[i % len(FWD_SAMPLE)], BWD_SAMPLE[i % len(BWD_SAMPLE)]
    lens_q, lens_k, hq, hkv, d = case
    q, k, v, do = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.float32, "cpu", seed=i)
    scale = 0.7 / math.sqrt(d)
    got = run_varlen(codegen.load(fwd), codegen.load(bwd), q, k, v, do, lens_q, lens_k, causal, scale)
    check_against_reference(got, per_sequence_reference(q, k, v, do, lens_q, lens_k, causal, scale), 1e-5)


def test_the_sample_covers_every_structural_choice():
    for sample, op in ((FWD_SAMPLE, "fwd"), (BWD_SAMPLE, "bwd")):
        valid = load_space(op).valid_variants(Problem(op, "float16", 32, True, GROUP[op], 64, 64), gpu_fingerprint())
        for knob in STRUCTURE[op]:
            assert {v[knob] for v in sample} == {v[knob] for v in valid}, knob


@pytest.mark.interpreter
def test_the_api_runs_one_packed_launch_and_its_gradients():
    """flash_attn_varlen_func goes through the packed kernels (not a loop over sequences)."""
    lens = (3, 50, 1)
    q, k, v, do = packed_inputs(lens, lens, 4, 2, 16, torch.float32, "cpu", seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    launched = []
    original = codegen.Kernel.forward_varlen

    def spy(self, *args):
        launched.append(self)
        return original(self, *args)

    codegen.Kernel.forward_varlen = spy
    try:
        out = autoflash.flash_attn_varlen_func(q, k, v, cu(lens), cu(lens), 64, 64, causal=True)
    finally:
        codegen.Kernel.forward_varlen = original
    assert len(launched) == 1
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_out, _, ref_grads = per_sequence_reference(q, k, v, do, lens, lens, True, 1 / 4)
    assert rel_error(out.detach(), ref_out) <= 1e-5
    for mine, ref in zip(grads, ref_grads):
        assert rel_error(mine, ref) <= 1e-5


@pytest.mark.interpreter
def test_a_gluon_or_vendor_winner_is_replaced_by_a_family_that_takes_packed_sequences():
    q = torch.randn(1, 4, 100, 64)
    k = torch.randn(1, 2, 100, 64)
    for op in ("fwd", "bwd"):
        kernel = get_dispatcher().varlen_kernel_for(q, k, k, q, True, op, 60, 60)
        assert kernel.supports_varlen and not kernel.vendor


# --------------------------------------------------------------------------- GPU
GPU_LENGTHS = (1, 37, 113, 1023, 4111)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("i", range(len(BWD_SAMPLE)))
def test_gpu_varlen_variants_on_ragged_lengths(i, causal):
    """bfloat16 on the GPU (the interpreter cannot see miscompiles), every structural variant."""
    fwd = structural_sample("fwd", 11, "bfloat16")[i % len(FWD_SAMPLE)]
    bwd = structural_sample("bwd", 12, "bfloat16")[i]
    fwd = load_space("fwd").nearest_valid(fwd.replace(BLOCK_N=64), Problem("fwd", "bfloat16", 128, causal, 4, 4096, 4096),
                                          gpu_fingerprint(0))
    bwd = load_space("bwd").nearest_valid(bwd, Problem("bwd", "bfloat16", 128, causal, 4, 4096, 4096), gpu_fingerprint(0))
    lens_q = GPU_LENGTHS
    lens_k = GPU_LENGTHS if i % 2 == 0 else (0, 64, 113, 2000, 4111)  # an empty key sequence, Nq != Nk
    q, k, v, do = packed_inputs(lens_q, lens_k, 8, 2, 128, torch.bfloat16, "cuda", seed=i)
    scale = 1 / math.sqrt(128)
    got = run_varlen(codegen.load(fwd), codegen.load(bwd), q, k, v, do, lens_q, lens_k, causal, scale)
    check_against_reference(got, per_sequence_reference(q, k, v, do, lens_q, lens_k, causal, scale), 2e-2)


@pytest.mark.interpreter
def test_many_sequences_run_in_windows_of_the_grid_limit(monkeypatch):
    """batch x heads programs on one grid axis: past CUDA's 65535 the packed launch runs in windows
    of cu_seqlens. Shrunk here to 4 programs per axis: 7 sequences x 2 heads in 4 windows."""
    fwd = codegen.load(FWD_SAMPLE[0])
    bwd = codegen.load(next(v for v in BWD_SAMPLE if v["DQ_MODE"] == "separate"))
    atomic = codegen.load(next(v for v in BWD_SAMPLE if v["DQ_MODE"] == "atomic"))
    for kernel in (fwd, bwd, atomic):
        monkeypatch.setattr(kernel.host, "max_grid_axis", 4)
    lens_q, lens_k = (3, 0, 20, 1, 9, 17, 2), (5, 4, 20, 0, 9, 30, 1)
    q, k, v, do = packed_inputs(lens_q, lens_k, 2, 1, 16, torch.float32, "cpu", seed=3)
    want = per_sequence_reference(q, k, v, do, lens_q, lens_k, True, 0.25)
    for backward in (bwd, atomic):
        check_against_reference(run_varlen(fwd, backward, q, k, v, do, lens_q, lens_k, True, 0.25), want, 1e-5)


@pytest.mark.interpreter
def test_no_query_or_no_key_at_all_gives_zeros_and_zero_gradients():
    for total_q, total_k in ((4, 0), (0, 6)):
        q = torch.randn(total_q, 2, 16, requires_grad=True)
        k, v = (torch.randn(total_k, 2, 16, requires_grad=True) for _ in range(2))
        out = autoflash.flash_attn_varlen_func(q, k, v, cu([total_q]), cu([total_k]), max(total_q, 1), max(total_k, 1))
        assert out.shape == q.shape and not out.any()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v)))


@pytest.mark.interpreter
def test_a_value_head_dim_other_than_the_query_one_is_served_packed(monkeypatch):
    """The packed kernels take v of its own head dim (MLA-like; no fallback under AUTOFLASH_STRICT=1):
    the right shape and values."""
    lens = (3, 5)
    q, k = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    v = torch.randn(8, 2, 8)
    api.reset()
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    out = autoflash.flash_attn_varlen_func(q, k, v, cu(lens), cu(lens), 5, 5)
    assert out.shape == (8, 2, 8)
    for a, b in ((0, 3), (3, 8)):
        ref = torch.nn.functional.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)))
        assert torch.allclose(out[a:b], ref.transpose(0, 1), atol=1e-5)
