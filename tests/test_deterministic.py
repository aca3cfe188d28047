"""A deterministic backward: flash-attn's `deterministic=True` (dense and packed forms) and torch's
`torch.use_deterministic_algorithms(True)` (every form) serve the backward with a variant whose
gradients are bitwise repeatable: no float32 atomics adding dQ tiles in whatever order programs reach
them (the backward family's DQ_MODE "atomic" and "tma_reduce"). CPU: Triton's interpreter, float32;
the 100-repeat check runs on the GPU, where atomics do reorder."""

import dataclasses
import warnings

import pytest
import torch

import autoflash
from autoflash import api, dispatch
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import DETERMINISTIC_KNOBS, deterministic_variant, get_dispatcher
from autoflash.fallback import FallbackWarning
from autoflash.problem import Problem
from autoflash.reference import reference_grads, rel_error, sdpa_grads
from autoflash.space import FAMILIES, load_space

HOPPER = dataclasses.replace(gpu_fingerprint(), name="H100-like", cc_major=9, cc_minor=0, smem_per_block=232448)


@pytest.fixture(autouse=True)
def _fresh():
    api.reset()
    yield
    api.reset()


@pytest.fixture
def deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def rand(*shape, seed, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def problem(head_dim=64, causal=True, dtype="float16", group=1):
    return Problem(op="bwd", dtype=dtype, head_dim=head_dim, causal=causal, gqa_group=group, seqlen_q=2048,
                   seqlen_k=2048)


# ----------------------------------------------------------------------------- the variant
def test_every_own_backward_family_declares_its_deterministic_knobs():
    own = [f for f in FAMILIES if load_space(f).op == "bwd" and not load_space(f).vendor]
    assert own and all(f in DETERMINISTIC_KNOBS for f in own)
    for family, pins in DETERMINISTIC_KNOBS.items():
        space = load_space(family)
        assert all(value in space.knobs[knob] for knob, value in pins.items())


@pytest.mark.parametrize("dq_mode", ["atomic", "tma_reduce"])
def test_an_atomic_dq_variant_becomes_the_separate_one_with_its_other_knobs(dq_mode):
    space = load_space("triton_bwd")
    prob = problem()
    atomic = [v for v in space.valid_variants(prob, HOPPER) if v["DQ_MODE"] == dq_mode]
    assert atomic
    for variant in atomic[:20]:
        fixed = deterministic_variant(variant, prob, HOPPER)
        assert fixed["DQ_MODE"] == "separate" and not space.violations(fixed, prob, HOPPER)
        wanted = variant.replace(DQ_MODE="separate")
        if not space.violations(wanted, prob, HOPPER):  # (else another knob had to change too)
            assert fixed == wanted


def test_the_hopper_default_for_d64_causal_is_atomic_and_deterministic_calls_leave_it():
    """The untuned backward of d64 causal problems on Hopper adds dQ by bulk reduce-add: exactly the
    variant a deterministic call must not get."""
    default = load_space("bwd").default_for(problem(), HOPPER)
    assert default["DQ_MODE"] == "tma_reduce"
    assert deterministic_variant(default, problem(), HOPPER)["DQ_MODE"] == "separate"
    separate = load_space("bwd").default_for(problem(head_dim=128), HOPPER)
    assert deterministic_variant(separate, problem(head_dim=128), HOPPER) is separate


@pytest.fixture
def atomic_winner(monkeypatch):
    """Every backward problem's winner is an atomic-dQ variant (as a tuned one may be)."""
    served = dispatch.Dispatcher.variant_for

    def variant_for(self, prob, device, device_index=None, own_only=False):
        variant = served(self, prob, device, device_index, own_only)
        if prob.op == "bwd":
            space = load_space(variant.family)
            variant = space.nearest_valid(variant.replace(DQ_MODE="atomic", BLOCK_M2=64, BLOCK_N2=32), prob, device)
            assert variant["DQ_MODE"] == "atomic"
        return variant

    monkeypatch.setattr(dispatch.Dispatcher, "variant_for", variant_for)
    api.reset()


def served_dq_modes():
    return {kernel.variant["DQ_MODE"] for kernel in get_dispatcher().kernels.values()
            if not kernel.vendor and kernel.op == "bwd"}


def _backward(fn, tensors, *args, **kwargs):
    """The gradients of q, k, v (`tensors`) through fn(q, k, v, *args, **kwargs)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves, *args, **kwargs)
    out.backward(torch.ones_like(out) if out.dim() < 3 else rand(*out.shape, seed=99))
    return [t.grad for t in leaves]


@pytest.mark.interpreter
def test_deterministic_calls_are_served_without_atomics_and_the_others_keep_the_winner(atomic_winner):
    q, k, v = rand(1, 29, 4, 16, seed=1), rand(1, 29, 2, 16, seed=2), rand(1, 29, 2, 16, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # served by the kernels, not by torch
        _backward(autoflash.flash_attn_func, (q, k, v), causal=True)
        assert served_dq_modes() == {"atomic"}
        api.reset()
        _backward(autoflash.flash_attn_func, (q, k, v), causal=True, deterministic=True)
        assert served_dq_modes() == {"separate"}
        api.reset()
        cu = torch.tensor([0, 11, 29], dtype=torch.int32)
        _backward(autoflash.flash_attn_varlen_func, (q[0], k[0], v[0]), cu, cu, 18, 18, causal=True,
                  deterministic=True)
        assert served_dq_modes() == {"separate"}


@pytest.mark.interpreter
def test_torchs_deterministic_setting_is_honoured_by_attention(atomic_winner, deterministic_algorithms):
    q, k, v = rand(1, 2, 23, 16, seed=4), rand(1, 1, 23, 16, seed=5), rand(1, 1, 23, 16, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        _backward(autoflash.attention, (q, k, v), is_causal=True)
    assert served_dq_modes() == {"separate"}


@pytest.mark.interpreter
def test_the_plan_memo_keeps_deterministic_and_other_calls_apart(atomic_winner):
    q, k, v = rand(1, 17, 2, 16, seed=7), rand(1, 17, 2, 16, seed=8), rand(1, 17, 2, 16, seed=9)
    _backward(autoflash.flash_attn_func, (q, k, v))  # plans an atomic backward for this signature
    _backward(autoflash.flash_attn_func, (q, k, v), deterministic=True)
    assert served_dq_modes() == {"atomic", "separate"}
    assert sorted(key[16] for key in api.training_plans) == [False, True]


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["flash_attn_func", "varlen", "attention"])
def test_two_deterministic_backward_passes_are_bitwise_equal(form, atomic_winner, deterministic_algorithms):
    q, k, v = rand(2, 21, 4, 16, seed=10), rand(2, 21, 2, 16, seed=11), rand(2, 21, 2, 16, seed=12)
    cu = torch.tensor([0, 21, 42], dtype=torch.int32)
    call = {"flash_attn_func": lambda *t: autoflash.flash_attn_func(*t, causal=True, deterministic=True),
            "varlen": lambda *t: autoflash.flash_attn_varlen_func(*(x.flatten(0, 1) for x in t), cu, cu, 21, 21,
                                                                  causal=True, deterministic=True),
            "attention": lambda *t: autoflash.attention(*(x.transpose(1, 2) for x in t), is_causal=True,
                                                        enable_gqa=True)}[form]
    first, second = _backward(call, (q, k, v)), _backward(call, (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert served_dq_modes() == {"separate"}


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, causal, heads", [(64, True, (16, 16)), (128, False, (16, 4)), (64, True, (8, 1))])
def test_a_hundred_deterministic_backward_passes_are_bitwise_equal_on_the_gpu(head_dim, causal, heads, own_kernels):
    """d64 causal is where the untuned Hopper backward adds dQ by bulk reduce-add: its gradients differ in
    their last bits from run to run, unless deterministic=True serves the separate dQ kernel."""
    hq, hkv = heads
    q = rand(2, 1024, hq, head_dim, seed=13, device="cuda", dtype=torch.bfloat16)
    k, v = (rand(2, 1024, hkv, head_dim, seed=s, device="cuda", dtype=torch.bfloat16) for s in (14, 15))
    grad = rand(2, 1024, hq, head_dim, seed=16, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def grads():
        for t in leaves:
            t.grad = None
        autoflash.flash_attn_func(*leaves, causal=causal, deterministic=True).backward(grad)
        return [t.grad.clone() for t in leaves]

    first = grads()
    for _ in range(99):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    assert served_dq_modes() == {"separate"}
    heads_first = [t.transpose(1, 2) for t in (q, k, v, grad)]
    exact = reference_grads(*heads_first, causal, 0, head_dim ** -0.5)
    theirs = sdpa_grads(*heads_first, causal, 0, head_dim ** -0.5)
    for mine, want, sdpa in zip(first, exact, theirs):
        assert rel_error(mine.transpose(1, 2), want) <= 3 * rel_error(sdpa, want) + 1e-6
