"""A value head dim different from the query/key one (DeepSeek-V3 MLA prefill: 192/128) in the Triton
forward and backward kernels, under TRITON_INTERPRET=1 vs a float64 reference: O, LSE, dQ, dK, dV on
ragged lengths (1, 37, 113, Nq != Nk), causal (both alignments) and not, GQA, float32 and float16.
Outputs live inside wider buffers whose extra columns hold a sentinel: no kernel writes past either
head dim. Also the problem key, the render flag and who takes such calls (never the Gluon forward)."""

import dataclasses
import math

import pytest
import torch

from autoflash import codegen
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
from autoflash.reference import lse_error, reference, reference_grads, rel_error
from autoflash.rendering import render, source_path, variant_hash
from autoflash.space import load_space

# (seqlen_q, seqlen_k, head_dim qk, head_dim v, heads_q, heads_kv, causal, alignment)
CASES = [
    (1, 37, 192, 128, 2, 2, True, "bottom_right"),
    (37, 37, 96, 64, 4, 2, True, "top_left"),
    (113, 37, 64, 32, 2, 1, True, "bottom_right"),  # Nq > Nk: the first rows see no key
    (37, 113, 32, 64, 2, 2, False, "top_left"),
    (113, 113, 192, 128, 2, 1, False, "top_left"),
    (37, 113, 96, 64, 3, 1, True, "top_left"),
]
TOLERANCE = {"float32": 1e-5, "float16": 3e-3}
GRAD_TOLERANCE = {"float32": 1e-5, "float16": 6e-3}
SENTINEL = 1234.5
# Knobs each case runs with (the forward's, the backward's): every load kind and dQ mode of the
# CPU-runnable ones, and the forward's two column blocks of a head dim that is no power of two.
FORWARD_KNOBS = [dict(LOADS="pointer"), dict(LOADS="tma", MASK_MODE="single_loop"), dict(LOADS="pointer", HEAD_SPLIT=True),
                 dict(LOADS="tma"), dict(LOADS="pointer", KV_ORDER="diagonal_first"), dict(LOADS="tma", HEAD_SPLIT=True)]
BACKWARD_KNOBS = [dict(DQ_MODE="separate", LOADS="pointer"), dict(DQ_MODE="atomic", LOADS="tma"),
                  dict(DQ_MODE="separate", LOADS="tma"), dict(DQ_MODE="atomic", LOADS="pointer"),
                  dict(DQ_MODE="separate", LOADS="pointer", GRID_ORDER="heavy_first"), dict(DQ_MODE="separate", LOADS="tma")]


def _device():
    return dataclasses.replace(gpu_fingerprint(), cc_major=9, cc_minor=0)  # (TMA variants in the interpreter)


def _variant(op, case, dtype, knobs):
    nq, nk, d, dv, hq, hkv, causal, _ = case
    problem = Problem(op, dtype, d, causal, hq // hkv, 64, 64, head_dim_v=dv)
    space = load_space(op)
    want = {k: v for k, v in knobs.items() if k != "HEAD_SPLIT" or d & (d - 1)}
    return space.nearest_valid(space.default_for(problem, _device()).replace(**want), problem, _device())


def _inside(shape, dtype, layout_bnhd=True):
    """A (B, H, N, D) view of a (B, N, H, D + 8) buffer of sentinels: the last 8 columns must stay so."""
    b, h, n, d = shape
    buf = torch.full((b, n, h, d + 8), SENTINEL, dtype=dtype)
    return buf, buf[..., :d].transpose(1, 2)


def _inputs(case, dtype):
    nq, nk, d, dv, hq, hkv, causal, align = case
    g = torch.Generator().manual_seed(nq * 1000 + nk + d)
    dt = getattr(torch, dtype)

    def rand(n, h, width):  # (B, N, H, D) storage seen as (B, H, N, D), as flash_attn_func passes it
        return torch.randn(1, n, h, width, generator=g).to(dt).transpose(1, 2)
    q, k, v, do = rand(nq, hq, d), rand(nk, hkv, d), rand(nk, hkv, dv), rand(nq, hq, dv)
    return q, k, v, do, (nk - nq if align == "bottom_right" else 0), 0.8 / math.sqrt(d)


def _untouched(buf, width):
    return bool((buf[..., width:] == SENTINEL).all())


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[2]}-{c[3]}-q{c[0]}-k{c[1]}" for c in CASES])
def test_forward_and_backward_match_float64(i, dtype):
    case = CASES[i]
    nq, nk, d, dv, hq, hkv, causal, _ = case
    q, k, v, do, offset, scale = _inputs(case, dtype)
    out_buf, out = _inside((1, hq, nq, dv), q.dtype)
    lse = torch.full((1, hq, nq), float("nan"))
    forward = codegen.load(_variant("fwd", case, dtype, FORWARD_KNOBS[i]), value_dim=True)
    assert forward.unsupported(q, k, v, out) is None
    forward.forward(q, k, v, out, lse, scale, causal, offset)
    ref_out, ref_lse = reference(q, k, v, causal, offset, scale)
    assert out.shape[-1] == dv and _untouched(out_buf, dv)
    assert rel_error(out, ref_out) <= TOLERANCE[dtype]
    assert lse_error(lse, ref_lse) <= 1e-5

    grads = [_inside(t.shape, q.dtype) for t in (q, k, v)]
    backward = codegen.load(_variant("bwd", case, dtype, BACKWARD_KNOBS[i]), value_dim=True)
    assert backward.unsupported(q, k, v, do) is None
    backward.backward(q, k, v, out, lse, do, *(view for _, view in grads), scale, causal, offset)
    for (buf, mine), ref, width in zip(grads, reference_grads(q, k, v, do, causal, offset, scale), (d, d, dv)):
        assert _untouched(buf, width)
        assert not torch.isnan(mine).any()
        assert rel_error(mine, ref) <= GRAD_TOLERANCE[dtype]


def test_problem_key_has_the_value_head_dim_only_when_it_differs():
    plain = Problem("fwd", "float16", 128, True, 1, 4096, 4096, work=3)
    assert plain.key == "fwd/float16/d128/causal/g1/q4096/k4096/w3"  # old keys unchanged
    mla = dataclasses.replace(plain, head_dim=192, head_dim_v=128, score_variant="window")
    assert mla.key == "fwd/float16/d192/causal/g1/q4096/k4096/w3/dv128/window"
    assert Problem.from_key(mla.key) == mla
    with pytest.raises(ValueError, match="head_dim_v is None when it equals"):
        Problem("fwd", "float16", 128, True, 1, 64, 64, head_dim_v=128)
    with pytest.raises(ValueError, match="forward or backward"):
        Problem("decode", "float16", 128, True, 1, 64, 64, head_dim_v=64)


def test_the_flag_renders_only_when_asked():
    problem = Problem("fwd", "float16", 192, True, 1, 1024, 1024, head_dim_v=128)
    for op in ("fwd", "bwd"):
        variant = load_space(op).default_for(dataclasses.replace(problem, op=op), _device())
        plain, mla = render(variant), render(variant, value_dim=True)
        assert "HEAD_DIM_V" not in plain and "HEAD_DIM_V" in mla
        assert variant_hash(variant) != variant_hash(variant, value_dim=True)
        assert source_path(variant, value_dim=True).stem.split("-")[-2] == "dv"


def test_gluon_forward_never_takes_a_value_head_dim():
    from autoflash.families.gluon_sm90_fwd.host import GluonSm90Forward

    problem = Problem("fwd", "float16", 192, True, 1, 4096, 4096, head_dim_v=128)
    on_gpu = dataclasses.replace(_device(), name="NVIDIA H100 80GB HBM3", smem_per_block=232448,
                                 triton_version="3.6.0")  # (the Triton the Gluon space is written for)
    assert not load_space("gluon_sm90_fwd").valid_variants(problem, on_gpu)
    assert load_space("gluon_sm90_fwd").valid_variants(dataclasses.replace(problem, head_dim=128, head_dim_v=None),
                                                        on_gpu)
    with pytest.raises(ValueError, match="value head dim"):
        GluonSm90Forward({}, None, value_dim=True)


def test_a_winner_of_a_family_without_value_dims_is_served_by_the_triton_forward():
    from autoflash.dispatch import Dispatcher

    problem = Problem("fwd", "float32", 64, False, 1, 64, 64, head_dim_v=32)
    gluon = load_space("gluon_sm90_fwd").default_for(dataclasses.replace(problem, head_dim_v=None), _device())
    kernel = Dispatcher._load(gluon, problem, _device())
    assert kernel.family == "triton_fwd" and kernel.value_dim
    q, k = torch.zeros(1, 2, 5, 64), torch.zeros(1, 2, 7, 64)
    assert kernel.unsupported(q, k, torch.zeros(1, 2, 7, 32), torch.zeros(1, 2, 5, 32)) is None
    assert "rendered with" in kernel.unsupported(q, k, k, q)  # (one head dim: the plain kernel's call)


def test_winners_of_one_value_head_dim_never_serve_another():
    from autoflash.winners import WinnerTable

    table = WinnerTable.__new__(WinnerTable)
    variant = load_space("fwd").default_for(Problem("fwd", "float16", 192, True, 1, 64, 64), _device())
    stored = Problem("fwd", "float16", 192, True, 1, 4096, 4096, head_dim_v=128)
    table.rows, table.origins = {stored.key: variant}, {stored.key: "test"}
    table.own_rows, table.own_origins = table.rows, table.origins
    assert table.lookup(dataclasses.replace(stored, seqlen_q=2048))[1].startswith("nearest")
    for other in (dataclasses.replace(stored, head_dim_v=None), dataclasses.replace(stored, head_dim_v=64)):
        assert table.lookup(other) == (None, "default")



def test_tune_on_miss_claims_a_value_head_dim_problem_of_its_own(tmp_path, monkeypatch):
    """The tuner measures V's head dim now (`Shape.head_dim_v`): a call with V of its own is tuned as
    itself (tests/test_mla_tuning.py runs it), claimed apart from the plain problem of the same Q/K."""
    from autoflash.dispatch import Dispatcher

    monkeypatch.setenv("AUTOFLASH_TUNE_ON_MISS", "1")
    d = Dispatcher(winner_paths=[tmp_path / "user.db"])
    problem = Problem("fwd", "float16", 64, False, 1, 64, 64, head_dim_v=32)
    assert d._claim_tune_on_miss(problem, torch.zeros(1))
    assert d._claim_tune_on_miss(dataclasses.replace(problem, head_dim_v=None), torch.zeros(1))
    assert not d._claim_tune_on_miss(problem, torch.zeros(1))  # (claimed once)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64)])
def test_mla_prefill_in_bf16_on_the_gpu(d, dv, causal, own_kernels, monkeypatch):
    """DeepSeek-V3's MLA prefill head dims on ragged lengths: O and the gradients within 2x (3x) of torch
    SDPA's own bf16 error against float64, served by the kernels (AUTOFLASH_STRICT=1)."""
    import torch.nn.functional as F

    import autoflash

    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    g = torch.Generator("cuda").manual_seed(d + dv)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    q, k, v = rand(2, 8, 1023, d), rand(2, 8, 1111, d), rand(2, 8, 1111, dv)
    grad = torch.randn(2, 8, 1023, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=causal)
    mine = autoflash.attention(q, k, v, is_causal=causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert rel_error(mine, exact) <= 2 * rel_error(theirs, exact)
    for g_mine, g_theirs, g_exact in zip(torch.autograd.grad(mine, (q, k, v), grad),
                                         torch.autograd.grad(theirs, (q, k, v), grad),
                                         torch.autograd.grad(exact, (q, k, v), grad.double())):
        assert rel_error(g_mine, g_exact) <= 3 * rel_error(g_theirs, g_exact)
