"""Attention variants in the generated backward kernels (sliding window, softcap, ALiBi, sinks): dQ, dK,
dV (and the sinks' gradient) against float64 autograd over the materialized mask and bias, for a sample
of the backward family's structural knobs, ragged lengths, Nq != Nk, GQA, float32 and float16; the
window's band-only loops of both backward kernels; the public drop-ins that now train on the kernels;
and bf16 on the GPU."""

import math
import random

import pytest
import torch

import autoflash
from autoflash import api, codegen, variant_training
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
from autoflash.reference import rel_error
from autoflash.score_variant import ScoreArgs
from autoflash.space import load_space
from test_score_variants import VARIANTS, _inputs, reference, score_args

LENGTHS = [(1, 37), (37, 113), (113, 37), (113, 113), (200, 61)]
TOLERANCE = {"float32": 2e-5, "float16": 5e-3}


def _forward_kernel(score):
    space = load_space("triton_fwd")
    knobs = {**{k: c[0] for k, c in space.knobs.items()}, "BLOCK_M": 64, "BLOCK_N": 32, "LOADS": "pointer"}
    return codegen.load(space.check_declared(knobs), score=score.variant)


def _sample():
    """Two lengths per variant, each with a seeded backward variant: the dQ modes, GQA splits, loads and
    grid orders rotate across the cases."""
    rng = random.Random(38)
    space, device = load_space("triton_bwd"), gpu_fingerprint()
    cases = []
    for n, (name, (causal, _values)) in enumerate(VARIANTS.items()):
        for m in range(2):
            n_q, n_k = LENGTHS[(2 * n + m) % len(LENGTHS)]
            d = (32, 48, 64)[(n + m) % 3]
            i = 2 * n + m
            valid = space.valid_variants(Problem("bwd", "float16", d, causal, 2, 128, 128), device)
            want = dict(DQ_MODE=("separate", "atomic")[i % 2], GQA_SPLIT=(1, 2)[(i // 2) % 2],
                        LOADS=("pointer", "tma")[(i // 4) % 2], DKDV_KERNEL="triton")
            pick = [v for v in valid if all(v[k] == w for k, w in want.items())]
            cases.append((name, n_q, n_k, d, rng.choice(pick)))
    return cases


CASES = _sample()


def reference_grads(q, k, v, do, scale, causal, offset, score: ScoreArgs):
    """float64 autograd of the reference: (dq, dk, dv, d sinks or None)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sinks = None if score.sinks is None else score.sinks.detach().double().requires_grad_()
    out, _ = reference(*leaves, scale, causal, offset, ScoreArgs(score.window, score.softcap, score.alibi_slopes, sinks))
    out.backward(do.double())
    return [t.grad for t in leaves] + [None if sinks is None else sinks.grad]


def _error(mine, ref, scale_of) -> float:
    """rel_error, against the gradients' scale (dV's) where the reference is ~0: one key per query (a
    window of (0, 0)) has p = 1 and dS = p (dP - delta) = 0 up to rounding."""
    return (mine.double() - ref).norm().item() / max(ref.norm().item(), 0.1 * scale_of.norm().item(), 1e-30)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name, n_q, n_k, d, variant", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}" for c in CASES])
def test_variant_gradients_match_float64_autograd(name, n_q, n_k, d, variant, dtype):
    if dtype == "float16" and not name.startswith(("window+", "softcap", "alibi per batch", "all four")):
        pytest.skip("float16 on the combinations, softcap and ALiBi (interpreter time)")
    causal, values = VARIANTS[name]
    score = score_args(values, seed=n_q + n_k)
    dt = getattr(torch, dtype)
    q, k, v = _inputs(n_q, n_k, d, dt, seed=n_q * 7 + d, layout="bnhd" if n_q % 2 else "bhnd")
    do = _inputs(n_q, n_k, d, dt, seed=d)[0]
    offset, scale = n_k - n_q, 0.8 / math.sqrt(d)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    _forward_kernel(score).forward(q, k, v, out, lse, scale, causal, offset, score_args=score)
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))  # poisoned: every element must be written
    codegen.load(variant, score=score.variant).backward(q, k, v, out, lse, do, dq, dk, dv, scale, causal, offset,
                                                        score_args=score)
    want = reference_grads(q, k, v, do, scale, causal, offset, score)
    for what, mine, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert not torch.isnan(mine).any(), what
        assert _error(mine, ref, want[2]) <= TOLERANCE[dtype], (what, variant.short())
    if score.sinks is not None:
        dsinks = variant_training.sinks_gradient(score.sinks, lse, out, do)
        assert rel_error(dsinks, want[3]) <= TOLERANCE[dtype]


def test_the_sample_covers_the_structural_choices():
    for knob, values in (("DQ_MODE", {"separate", "atomic"}), ("GQA_SPLIT", {1, 2}), ("LOADS", {"pointer", "tma"})):
        assert {c[4][knob] for c in CASES} == values
    assert {(c[1], c[2]) for c in CASES} == set(LENGTHS)


@pytest.mark.interpreter
@pytest.mark.parametrize("n_q, n_k, causal, window, poison", [
    # keys outside every band: the dQ programs never load them, their dK/dV programs visit no query block
    (37, 300, False, (4, 8), ("kv", [(96, 300)])),  # top-left: rows <= 63 see keys <= 71
    (37, 300, False, (4, 8), ("kv", [(0, 192), (288, 300)])),  # offset 200 (set below): keys [196, 280]
    # query rows outside every band: the dK/dV programs never load them, their dQ programs visit no key
    (300, 37, True, (16, -1), ("q", [(0, 256)])),  # bottom-right: rows >= 263 - 0 see the keys
])
def test_the_backward_visits_only_the_band(n_q, n_k, causal, window, poison):
    """Tiles outside the band are NaN (K and V, or Q and dO): a kernel that loaded them, even masked
    (0 * NaN), would poison its gradients. Their own gradients are exactly zero (they see nothing)."""
    which, ranges = poison
    offset = 200 if ranges[0] == (0, 192) else (0 if which == "kv" else n_k - n_q)
    space = load_space("triton_bwd")
    knobs = {**{k: c[0] for k, c in space.knobs.items()}, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 64,
             "BLOCK_N2": 32, "LOADS": "pointer", "DKDV_KERNEL": "triton", "DQ_MODE": "separate", "GQA_SPLIT": 1}
    score = ScoreArgs(window)
    q, k, v = _inputs(n_q, n_k, 32, torch.float32, seed=5)
    do = _inputs(n_q, n_k, 32, torch.float32, seed=6)[0]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    _forward_kernel(score).forward(q, k, v, out, lse, 0.2, causal, offset, score_args=score)
    want = reference_grads(q, k, v, do, 0.2, causal, offset, score)
    for first, last in ranges:
        for t in ((k, v) if which == "kv" else (q, do, out)):
            t[:, :, first:last] = math.nan
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    codegen.load(space.check_declared(knobs), score=score.variant).backward(
        q, k, v, out, lse, do, dq, dk, dv, 0.2, causal, offset, score_args=score)
    for what, mine, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert not torch.isnan(mine).any(), what
        assert rel_error(mine, ref) <= 1e-5, what
    for first, last in ranges:
        for mine in ((dk, dv) if which == "kv" else (dq,)):
            assert (mine[:, :, first:last] == 0).all()


# ----------------------------------------------------------------------------- the public drop-ins
@pytest.fixture
def fresh():
    api.reset()
    yield
    api.reset()


def _grads(fn, tensors, do):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    fn(*leaves).backward(do)
    return [t.grad for t in leaves]


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["causal+window", "softcap", "alibi per batch", "window+softcap (gemma-2)"])
def test_flash_attn_func_trains_variants_on_the_kernels(name, strict, fresh):
    """Under AUTOFLASH_STRICT=1 a fallback is an error: forward and backward run on the kernels, right."""
    causal, values = VARIANTS[name]
    score = score_args(values, seed=3)
    q, k, v = _inputs(37, 61, 32, torch.float32, seed=9)
    do = torch.randn(2, 37, 4, 32, generator=torch.Generator().manual_seed(1))
    mine = _grads(lambda q, k, v: autoflash.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=0.3, causal=causal,
        window_size=score.window, softcap=score.softcap, alibi_slopes=score.alibi_slopes), (q, k, v), do)
    want = reference_grads(q, k, v, do.transpose(1, 2), 0.3, causal, 61 - 37, score)
    for a, b in zip(mine, want):
        assert rel_error(a, b) <= 1e-5


@pytest.mark.interpreter
def test_flash_attn_varlen_func_trains_variants_in_one_launch(strict, fresh):
    cu_q = torch.tensor([0, 5, 6, 46], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 37, 77], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(46, 4, 16, generator=g), torch.randn(77, 2, 16, generator=g), torch.randn(77, 2, 16, generator=g)
    do = torch.randn(46, 4, 16, generator=g)
    score = ScoreArgs((6, -1), 1.5, torch.rand(3, 4, generator=g))
    mine = _grads(lambda q, k, v: autoflash.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 40, 40, 0.0, 0.35, True, score.window, score.softcap, score.alibi_slopes), (q, k, v), do)
    for b in range(3):
        a, z, c, e = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        seq = ScoreArgs(score.window, score.softcap, score.alibi_slopes[b])
        want = reference_grads(q[None, a:z].transpose(1, 2), k[None, c:e].transpose(1, 2), v[None, c:e].transpose(1, 2),
                               do[None, a:z].transpose(1, 2), 0.35, True, int(e - c) - int(z - a), seq)
        for mine_, (lo, hi), ref in zip(mine, ((a, z), (c, e), (c, e)), want):
            assert rel_error(mine_[lo:hi], ref[0].transpose(0, 1)) <= 1e-5


@pytest.mark.interpreter
def test_transformers_gpt_oss_sinks_train_on_the_kernels(strict, fresh):
    """gpt-oss's learned per-head sinks with its sliding window: dQ, dK, dV and the sinks' gradient."""
    from autoflash.integrations.transformers import attention_forward

    class Layer(torch.nn.Module):
        is_causal = True
        training = True

    q, k, v = _inputs(45, 45, 16, torch.float32, seed=6)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    do = torch.randn(2, 45, 4, 16, generator=torch.Generator().manual_seed(2))
    mine = _grads(lambda q, k, v, s: attention_forward(Layer(), q, k, v, None, scaling=0.4, sliding_window=8,
                                                      s_aux=s)[0], (q, k, v, sinks), do)
    want = reference_grads(q, k, v, do.transpose(1, 2), 0.4, True, 0, ScoreArgs((7, -1), 0.0, None, sinks))
    for a, b in zip(mine, want):
        assert rel_error(a, b) <= 1e-5


# ----------------------------------------------------------------------------- bf16 on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n_q, n_k", [(1023, 1023), (1023, 4111), (4111, 4111)])
@pytest.mark.parametrize("name", ["causal+window", "window", "softcap", "alibi per batch", "sinks",
                                  "window+softcap (gemma-2)", "window+sinks (gpt-oss)", "all four"])
def test_bf16_variant_gradients_on_the_gpu_against_float64(name, n_q, n_k, fresh):
    """The variants' gradients in bfloat16 at larger ragged lengths through the kernels: within 2x the
    error of the float32-score torch path (autoflash.eager) in bfloat16, or a bf16-sized bound."""
    from autoflash.eager import eager_attention

    causal, values = VARIANTS[name]
    values = {**values, "window": tuple(w * 16 if w > 0 else w for w in values.get("window", (-1, -1)))}
    score = score_args(values, seed=1, device="cuda")
    q, k, v = _inputs(n_q, n_k, 128, torch.bfloat16, seed=n_q, layout="bnhd", device="cuda", spread=1.0)
    do = _inputs(n_q, n_k, 128, torch.bfloat16, seed=7, device="cuda", spread=1.0)[0]
    scale, offset = 128 ** -0.5, n_k - n_q
    sinks = None if score.sinks is None else score.sinks.clone().requires_grad_()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    served, why = autoflash.variant_forward.serve(*leaves, 0.0, scale, causal, offset,
                                                  ScoreArgs(score.window, score.softcap, score.alibi_slopes, sinks), True)
    assert served is not None, why
    served[0].backward(do)
    mine = [t.grad for t in leaves] + ([] if sinks is None else [sinks.grad])
    torch_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_sinks = None if sinks is None else score.sinks.clone().requires_grad_()
    eager_attention(*torch_leaves, scale=scale, causal=causal, offset=offset, window=score.window,
                    softcap=score.softcap, alibi_slopes=score.alibi_slopes, sinks=torch_sinks)[0].backward(do)
    theirs = [t.grad for t in torch_leaves] + ([] if sinks is None else [torch_sinks.grad])
    want = reference_grads(q, k, v, do, scale, causal, offset, score)
    for a, t, ref in zip(mine, theirs, want):
        err, torch_err = rel_error(a, ref), rel_error(t, ref)
        assert err <= max(2 * torch_err, 2e-2), (err, torch_err)
