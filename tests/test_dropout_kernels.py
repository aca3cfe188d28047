"""Attention dropout in the own Triton kernels (rendered with DROPOUT, autoflash/dropout.py), under
TRITON_INTERPRET=1: a test-only kernel draws the same keep mask Z from the same (seed, offset) and
index formula, and the forward's O and LSE and the backward's dQ, dK, dV are compared with a float64
reference computed with that Z on ragged shapes (1, 37, 113; Nq != Nk), causal (both alignments) and
not, GQA, every loop order and dQ mode the interpreter runs. Also: the same seed gives bitwise the
same output, another seed another one, the keep fraction is 1 - p within a few standard deviations,
and the plain renders (DROPOUT off) are byte for byte those of the branch's base."""

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

from autoflash import codegen
from autoflash.device import gpu_fingerprint
from autoflash.dropout import DropoutArgs
from autoflash.families._shared.device_modules import triton_device  # (the setting of this process, as the kernels')
from autoflash.problem import Problem
from autoflash.reference import rel_error
from autoflash.rendering import render, source_path, variant_hash
from autoflash.score_variant import PLAIN, ScoreVariant
from autoflash.space import FAMILIES, load_space



# --------------------------------------------------------------------------- Z, drawn apart
@triton.jit
def _draw_keep(Z, seed, offset, H, N_Q, N_K, p, BLOCK: tl.constexpr):
    """keep[b, h, i, j] drawn by the kernels' own device function, in 16 x 16 tiles."""
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    for start in range(0, N_K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = triton_device.dropout_keep(seed, offset, bh * N_Q + rows, start, N_K, p, BLOCK)
        mask = (rows[:, None] < N_Q) & (cols[None, :] < N_K)
        tl.store(Z + (bh * N_Q + rows[:, None]) * N_K + cols[None, :], keep.to(tl.int8), mask=mask)


def keep_mask(args: DropoutArgs, b, h, n_q, n_k) -> torch.Tensor:
    z = torch.empty((b, h, n_q, n_k), dtype=torch.int8)
    _draw_keep[(b * h, triton.cdiv(n_q, 16))](z, args.seed, args.offset, h, n_q, n_k, args.p, BLOCK=16)
    return z.bool()


def reference_with(q, k, v, z, p, causal, offset, scale):
    """O (B, H, Nq, Dv) and LSE of flash-attn's dropout with the keep mask z, in float64 (autograd)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    lse = torch.logsumexp(s, -1)
    prob = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # (rows that see no key: 0, as the kernels)
    out = (prob * z.double() / (1.0 - p)) @ vv
    return out, lse, (q, k, v)


# --------------------------------------------------------------------------- kernels vs reference
# (seqlen_q, seqlen_k, head_dim, heads_q, heads_kv, causal, alignment)
CASES = [
    (1, 37, 64, 2, 2, True, "bottom_right"),
    (37, 37, 32, 4, 2, True, "top_left"),
    (113, 37, 64, 2, 1, True, "bottom_right"),  # Nq > Nk: the first rows see no key
    (37, 113, 32, 2, 2, False, "top_left"),
    (113, 113, 16, 2, 1, False, "top_left"),
    (37, 113, 48, 3, 1, True, "top_left"),
]
FORWARD_KNOBS = [dict(LOADS="pointer"), dict(LOADS="tma", MASK_MODE="single_loop"), dict(LOADS="block_ptr"),
                 dict(LOADS="tma"), dict(LOADS="pointer", KV_ORDER="diagonal_first"), dict(LOADS="pointer", HEAD_SPLIT=True)]
BACKWARD_KNOBS = [dict(DQ_MODE="separate", LOADS="pointer"), dict(DQ_MODE="atomic", LOADS="tma"),
                  dict(DQ_MODE="separate", LOADS="tma", GQA_SPLIT=2), dict(DQ_MODE="atomic", LOADS="pointer"),
                  dict(DQ_MODE="separate", LOADS="pointer", GRID_ORDER="heavy_first"), dict(DQ_MODE="separate", LOADS="tma")]
P = 0.3


def _device():
    return dataclasses.replace(gpu_fingerprint(), cc_major=9, cc_minor=0)  # (TMA variants in the interpreter)


def _variant(op, case, dtype, knobs):
    nq, nk, d, hq, hkv, causal, _ = case
    problem = Problem(op, dtype, d, causal, hq // hkv, 64, 64)
    space = load_space(op)
    want = {k: v for k, v in knobs.items() if k != "HEAD_SPLIT" or d & (d - 1)}
    return space.nearest_valid(space.default_for(problem, _device()).replace(**want), problem, _device())


def _inputs(case, dtype):
    nq, nk, d, hq, hkv, causal, align = case
    g = torch.Generator().manual_seed(nq * 1000 + nk + d)
    dt = getattr(torch, dtype)

    def rand(b, n, h, width):  # (B, N, H, D) storage seen as (B, H, N, D), as flash_attn_func passes it
        return torch.randn(b, n, h, width, generator=g).to(dt).transpose(1, 2)
    b = 2
    q, k, v, do = rand(b, nq, hq, d), rand(b, nk, hkv, d), rand(b, nk, hkv, d), rand(b, nq, hq, d)
    return q, k, v, do, (nk - nq if align == "bottom_right" else 0), 0.8 / math.sqrt(d)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"d{c[2]}-q{c[0]}-k{c[1]}-h{c[3]}/{c[4]}" for c in CASES])
def test_forward_and_backward_match_float64_with_the_same_mask(i, dtype):
    case = CASES[i]
    nq, nk, d, hq, hkv, causal, _ = case
    q, k, v, do, offset, scale = _inputs(case, dtype)
    args = DropoutArgs(P, (1 << 40) + 7 * i, 1000 * i)
    z = keep_mask(args, q.shape[0], hq, nq, nk)
    out = torch.empty_like(q)
    lse = torch.full(q.shape[:3], float("nan"))
    forward = codegen.load(_variant("fwd", case, dtype, FORWARD_KNOBS[i]), dropout=True)
    assert forward.unsupported(q, k, v, out) is None and not forward.supports_varlen
    forward.forward(q, k, v, out, lse, scale, causal, offset, dropout=args)
    ref_out, ref_lse, leaves = reference_with(q, k, v, z, P, causal, offset, scale)
    tol = {"float32": 1e-5, "float16": 3e-3}[dtype]
    assert rel_error(out, ref_out) <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)  # (of the undropped P)

    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    backward = codegen.load(_variant("bwd", case, dtype, BACKWARD_KNOBS[i]), dropout=True)
    assert backward.unsupported(q, k, v, do) is None
    backward.backward(q, k, v, out, lse, do, dq, dk, dv, scale, causal, offset, dropout=args)
    refs = torch.autograd.grad(ref_out, leaves, do.double())
    for mine, ref in zip((dq, dk, dv), refs):
        assert not torch.isnan(mine).any()
        assert rel_error(mine, ref) <= {"float32": 1e-5, "float16": 6e-3}[dtype]


def _run_forward(q, k, v, args, knobs=None, causal=False):
    case = (q.shape[2], k.shape[2], q.shape[3], q.shape[1], k.shape[1], causal, "top_left")
    kernel = codegen.load(_variant("fwd", case, "float32", knobs or {}), dropout=True)
    out = torch.empty_like(q)
    kernel.forward(q, k, v, out, torch.empty(q.shape[:3]), 0.125, causal, 0, dropout=args)
    return out


@pytest.mark.interpreter
def test_same_seed_same_output_other_seed_other_output_any_tiles():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 45, 32, generator=g) for _ in range(3))
    a = DropoutArgs(0.5, 1 << 41)
    first, again = _run_forward(q, k, v, a), _run_forward(q, k, v, a)
    assert torch.equal(first, again)
    assert not torch.equal(first, _run_forward(q, k, v, dataclasses.replace(a, seed=a.seed + 1)))
    assert not torch.equal(first, _run_forward(q, k, v, a.shifted_rows(1, 45)))
    # Other tiles and loop orders draw the same mask: the same output up to the sums' order.
    other = _run_forward(q, k, v, a, dict(BLOCK_M=16, BLOCK_N=16, KV_ORDER="diagonal_first", MASK_MODE="single_loop"))
    assert rel_error(other, first) <= 1e-5


def test_keep_fraction_is_one_minus_p_at_each_of_a_draws_eight_keys():
    """Each Philox draw serves 8 keys (16 bits each): every key position within the group keeps 1 - p."""
    for p in (0.1, 0.5, 0.9):
        z = keep_mask(DropoutArgs(p, 12345 + (1 << 40)), 2, 3, 200, 304) if not _interpreting() else \
            keep_mask(DropoutArgs(p, 12345 + (1 << 40)), 1, 2, 100, 208)
        for lane in range(8):
            kept = z[..., lane::8]
            n = kept.numel()
            assert abs(kept.sum().item() - n * (1 - p)) <= 5 * math.sqrt(n * p * (1 - p)), (p, lane)


def test_a_batch_slice_draws_the_slice_of_the_whole_mask():
    """A launch over batch entries 1.. (a chunked call) continues the whole call's counters."""
    a = DropoutArgs(0.3, 777 + (1 << 40), 5)
    whole = keep_mask(a, 3, 2, 21, 37)
    assert torch.equal(keep_mask(a.shifted_rows(1 * 2 * 21, 37), 2, 2, 21, 37), whole[1:])


def _interpreting():
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.mark.interpreter
def test_p_zero_keeps_everything_and_matches_the_plain_kernel():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 29, 16, generator=g) for _ in range(3))
    dropped = _run_forward(q, k, v, DropoutArgs(0.0, 1 << 40), causal=True)
    case = (29, 29, 16, 2, 2, True, "top_left")
    plain = codegen.load(_variant("fwd", case, "float32", {}))
    out = torch.empty_like(q)
    plain.forward(q, k, v, out, torch.empty(q.shape[:3]), 0.125, True, 0)
    assert torch.equal(dropped, out)
    with pytest.raises(ValueError, match="dropout"):
        plain.forward(q, k, v, out, torch.empty(q.shape[:3]), 0.125, True, 0, dropout=DropoutArgs(0.1, 1))
    with pytest.raises(ValueError, match="dropout"):
        codegen.load(_variant("fwd", case, "float32", {}), dropout=True).forward(
            q, k, v, out, torch.empty(q.shape[:3]), 0.125, True, 0)


def test_dropout_args_are_checked():
    with pytest.raises(ValueError):
        DropoutArgs(1.0, 1)
    with pytest.raises(ValueError):
        DropoutArgs(0.5, -1)
    assert DropoutArgs(0.5, 3, 10).shifted_rows(5, 17).offset == 10 + 5 * 3  # (3 draws of 8 keys a row)


# --------------------------------------------------------------------------- plain renders
def _renders_to_compare():
    """Per own family: the default variant with each knob at its first and at its last choice, plain,
    with every attention variant (families that serve them) and with a value head dim of its own."""
    from autoflash import families

    device = _device()
    for family, (where, _) in FAMILIES.items():
        space = load_space(family)
        if space.vendor:
            continue
        host = families.host_class(family)
        base = space.default_for(Problem(space.op, "float16", 128, True, 1, 1024, 1024), device)
        scores = [PLAIN] + ([ScoreVariant(True, True, True, True), ScoreVariant(window=True)]
                            if host.serves_score_variants else [])
        for knob, choices in space.knobs.items():
            for choice in {choices[0], choices[-1]}:
                variant = base.replace(**{knob: choice})
                for score in scores:
                    for value_dim in (False, True) if host.serves_value_dim else (False,):
                        yield variant, score, value_dim


def test_a_render_without_dropout_has_no_dropout_code():
    """DROPOUT off renders the plain kernel (whose identity to earlier templates is
    benchmarks/family_identity.py's to show): no dropout parameter or draw in any family's render."""
    count = 0
    for variant, score, value_dim in _renders_to_compare():
        source = render(variant, score=score, value_dim=value_dim)
        assert render(variant, score=score, value_dim=value_dim, dropout=False) == source
        assert "dropout" not in source.lower() and "tl.rand" not in source, (variant.short(), score, value_dim)  # (nor dropout_keep)
        count += 1
    assert count > 50


def test_the_flag_renders_only_when_asked():
    for op in ("fwd", "bwd"):
        variant = load_space(op).default_for(Problem(op, "float16", 64, True, 1, 1024, 1024), _device())
        plain, dropped = render(variant), render(variant, dropout=True)
        assert "dropout_keep" not in plain and "dropout_seed" not in plain and "dropout_keep(" in dropped
        assert variant_hash(variant) != variant_hash(variant, dropout=True)
        assert source_path(variant, dropout=True).stem.split("-")[-2] == "drop"
    with pytest.raises(ValueError, match="dropout"):
        codegen.load(load_space("triton_decode").default_for(Problem("decode", "float16", 64, True, 1, 1, 1024),
                                                             _device()), dropout=True)


# --------------------------------------------------------------------------- the API
def _strict(monkeypatch):
    from autoflash import api

    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    api.reset()


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["sdpa", "flash_attn"])
def test_the_drop_ins_serve_dropout_on_the_kernels_with_its_gradient(form, monkeypatch):
    """Strict mode: no fallback. The output and gradients are those of the float64 reference with the
    kernels' own mask, drawn again from the seed the call took from torch's generator."""
    import autoflash
    from autoflash import dropout

    _strict(monkeypatch)
    monkeypatch.setenv("AUTOFLASH_DROPOUT_KERNELS", "1")  # (on the GPU, dropout runs in torch by default)
    seeds = []
    real_draw = dropout.draw
    monkeypatch.setattr(dropout, "draw", lambda p, device=None: seeds.append(real_draw(p, device)) or seeds[-1])
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, nq, nk, d = 2, 4, 2, 37, 45, 32
    q = torch.randn(b, nq, hq, d, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(b, nk, hkv, d, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(b, nk, hkv, d, generator=g).transpose(1, 2).requires_grad_()
    grad = torch.randn(b, hq, nq, d, generator=g)
    p = 0.25
    if form == "sdpa":
        out = autoflash.attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)
        offset = 0
    else:
        out = autoflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p,
                                        causal=True).transpose(1, 2)
        offset = nk - nq
    assert len(seeds) == 1
    z = keep_mask(seeds[0], b, hq, nq, nk)
    ref, _, leaves = reference_with(q, k, v, z, p, True, offset, d ** -0.5)
    assert rel_error(out, ref) <= 1e-5
    for mine, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, leaves, grad.double())):
        assert rel_error(mine, want) <= 1e-5


@pytest.mark.interpreter
def test_a_fresh_seed_per_call_from_torchs_generator(monkeypatch):
    import autoflash

    _strict(monkeypatch)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=g) for _ in range(3))
    torch.manual_seed(123)
    first, second = autoflash.attention(q, k, v, dropout_p=0.5), autoflash.attention(q, k, v, dropout_p=0.5)
    assert not torch.equal(first, second)  # (a new mask per call)
    torch.manual_seed(123)
    assert torch.equal(autoflash.attention(q, k, v, dropout_p=0.5), first)  # (torch's seed repeats the run)
    assert torch.equal(autoflash.attention(q, k, v), autoflash.attention(q, k, v, dropout_p=0.0))  # (p = 0: plain)


def test_what_the_kernels_do_not_take_still_falls_back():
    from autoflash import dropout

    q = torch.zeros(1, 2, 8, 16)
    assert "0 < dropout_p < 1" in dropout.unsupported(q, q, q, 1.0, None, False)


@pytest.mark.interpreter
def test_packed_sequences_drop_sequence_by_sequence_on_the_kernels(monkeypatch):
    """flash_attn_varlen_func with dropout: each sequence through the dense dropout kernels, with a seed
    of its own (strict mode: no fallback); each sequence's output and gradients match the reference."""
    import autoflash
    from autoflash import dropout

    _strict(monkeypatch)
    monkeypatch.setenv("AUTOFLASH_DROPOUT_KERNELS", "1")  # (on the GPU, dropout runs in torch by default)
    seeds = []
    real_draw = dropout.draw
    monkeypatch.setattr(dropout, "draw", lambda p, device=None: seeds.append(real_draw(p, device)) or seeds[-1])
    g = torch.Generator().manual_seed(5)
    lengths_q, lengths_k, h, d, p = [5, 19], [7, 19], 2, 16, 0.4
    q = torch.randn(sum(lengths_q), h, d, generator=g).requires_grad_()
    k = torch.randn(sum(lengths_k), h, d, generator=g).requires_grad_()
    v = torch.randn(sum(lengths_k), h, d, generator=g).requires_grad_()
    cu_q = torch.tensor([0, 5, 24], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 26], dtype=torch.int32)
    out = autoflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 19, p, causal=True)
    assert len(seeds) == 2
    out.sum().backward()
    for i, args in enumerate(seeds):
        q0, q1, k0, k1 = (int(c) for c in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        qs, ks, vs = (t.detach()[a:b].transpose(0, 1)[None] for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        z = keep_mask(args, 1, h, q1 - q0, k1 - k0)
        ref, _, leaves = reference_with(qs, ks, vs, z, p, True, (k1 - k0) - (q1 - q0), d ** -0.5)
        assert rel_error(out.detach()[q0:q1], ref[0].transpose(0, 1)) <= 1e-5
        grads = torch.autograd.grad(ref.sum(), leaves)
        for mine, want, a, b in zip((q.grad, k.grad, v.grad), grads, (q0, k0, k0), (q1, k1, k1)):
            assert rel_error(mine[a:b], want[0].transpose(0, 1)) <= 1e-5


@pytest.mark.interpreter
def test_counters_past_32_bits_and_batch_chunks_draw_the_whole_calls_mask(monkeypatch):
    """The counter is int64 (B x H x Nq x Nk passes 2**32 at long sequences): an offset past 2**32 draws
    another mask than its low 32 bits would, and the kernel agrees with the test's draw there. A call
    launched in batch chunks (more programs than a grid axis holds) continues the counters chunk after
    chunk: the same output as one launch."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 2, 21, 16, generator=g) for _ in range(3))
    high = DropoutArgs(0.5, 1 << 40, (1 << 35) + 17)
    assert not torch.equal(keep_mask(high, 3, 2, 21, 21), keep_mask(dataclasses.replace(high, offset=17), 3, 2, 21, 21))
    ref, _, _ = reference_with(q, k, v, keep_mask(high, 3, 2, 21, 21), 0.5, False, 0, 0.125)
    whole = _run_forward(q, k, v, high)
    assert rel_error(whole, ref) <= 1e-5
    monkeypatch.setattr(codegen, "GRID_AXIS_MAX", 2)  # (2 heads: one batch entry per launch)
    assert len(codegen.batch_chunks(3, 2, q)) == 3
    assert torch.equal(_run_forward(q, k, v, high), whole)


@pytest.mark.interpreter
def test_a_winner_without_dropout_is_served_by_the_default_family_and_no_warp_specialization(monkeypatch):
    """A Gluon forward winner (no dropout there) gives the Triton forward's default variant; a
    warp-specialized Triton winner its twin without warp specialization (not yet compiled with Philox)."""
    from autoflash import dropout
    from autoflash.dispatch import get_dispatcher

    q = torch.zeros(1, 2, 64, 64)
    problem = Problem("fwd", "float32", 64, False, 1, 64, 64)
    gluon = load_space("gluon_sm90_fwd").default_for(problem, _device())
    ws = load_space("fwd").default_for(problem, _device()).replace(LOADS="tma", WARP_SPECIALIZE=True)
    for winner in (gluon, ws):
        monkeypatch.setattr(get_dispatcher(), "kernel_for",
                            lambda *a, _w=winner, **kw: type("K", (), {"variant": _w})())
        get_dispatcher().derived.clear()  # (a signature's dropout kernels are remembered)
        kernel = dropout.kernels_for(q, q, q, q, False, "fwd")
        assert kernel.family == "triton_fwd" and kernel.dropout and not kernel.variant["WARP_SPECIALIZE"]


# --------------------------------------------------------------------------- the GPU compiler
def test_dropout_kernels_compile_for_sm90(tmp_path):
    """The interpreter cannot see a kernel the GPU compiler refuses: the dropout kernels compile for
    Hopper on any machine (forward: pointer, TMA, TMA warp-specialized; backward: every dQ mode, TMA
    loads, a GQA split; both with window + softcap + ALiBi too), bf16 d128 causal, in a clean child process (helpers.run_in_clean_process)."""
    from helpers import run_in_clean_process

    done = run_in_clean_process("from tests.test_dropout_kernels import compile_for_sm90; compile_for_sm90()", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 9


def compile_for_sm90() -> None:
    """(Run by the test above in a clean process.) Capture each dropout kernel's launch and compile it."""
    from helpers import capture_launches, compile_for_sm90 as compile_one

    q = torch.empty(2, 8, 333, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 517, 128, dtype=torch.bfloat16)
    args = DropoutArgs(0.1, 1 << 40, 0)
    fwd = load_space("triton_fwd")
    base = {**{n: c[0] for n, c in fwd.knobs.items()}, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    from autoflash.score_variant import ScoreArgs

    variants = ScoreArgs((63, -1), 30.0, torch.empty(2, 8))  # (window, softcap, ALiBi per batch)
    for knobs, score in ((dict(LOADS="pointer"), None), (dict(LOADS="tma"), None),
                         (dict(LOADS="tma", WARP_SPECIALIZE=True), None), (dict(LOADS="tma"), variants)):
        kernel = codegen.load(fwd.check_declared({**base, **knobs}), score=score.variant if score else PLAIN,
                              dropout=True)
        launches = capture_launches([kernel.module._attn_fwd])
        kernel.host.launch(q=q, k=k, v=k, o=torch.empty_like(q), lse=torch.empty(2, 8, 333), sm_scale=0.1, causal=True,
                           causal_offset=184, compile_only=True, dropout_args=args, score_args=score)
        for jit, a, kw in launches:
            defaults = {p.name: p.default for p in jit.params if p.is_constexpr and p.has_default}
            compile_one(jit, a, {**defaults, **kw})
        print("fwd", knobs)
    bwd = load_space("triton_bwd")
    base = {**{n: c[0] for n, c in bwd.knobs.items()}, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64,
            "num_warps": 4, "num_stages": 2}
    for knobs, score in ((dict(DQ_MODE="separate", LOADS="pointer"), None),
                         (dict(DQ_MODE="separate", LOADS="tma", GQA_SPLIT=2), None),
                         (dict(DQ_MODE="atomic", LOADS="pointer"), None), (dict(DQ_MODE="tma_reduce", LOADS="tma"), None),
                         (dict(DQ_MODE="separate", LOADS="tma"), variants)):
        kernel = codegen.load(bwd.check_declared({**base, **knobs}), score=score.variant if score else PLAIN,
                              dropout=True)
        m = kernel.module
        launches = capture_launches([m._bwd_dkdv, m._bwd_dq, m._bwd_preprocess]
                                    + ([m._bwd_gqa_reduce] if knobs.get("GQA_SPLIT") else []))
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        kernel.host.launch(q=q, k=k, v=k, o=torch.empty_like(q), lse=torch.empty(2, 8, 333), do=torch.empty_like(q),
                           dq=dq, dk=dk, dv=torch.empty_like(k), sm_scale=0.1, causal=True, causal_offset=184,
                           compile_only=True, dropout_args=args, score_args=score)
        for jit, a, kw in launches:
            if jit in (m._bwd_dkdv, m._bwd_dq):
                compile_one(jit, a, kw)
        print("bwd", knobs)


# --------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_dropout_on_the_gpu_against_float64_with_the_same_mask(causal, monkeypatch):
    """The drop-in served by the kernels (AUTOFLASH_STRICT=1) in bf16 on ragged lengths, GQA: O and the
    gradients within a bf16 bound of the float64 reference that uses the kernels' own mask, drawn
    again by the test's kernel from the seed the call took."""
    import autoflash
    from autoflash import dropout

    _strict(monkeypatch)
    monkeypatch.setenv("AUTOFLASH_DROPOUT_KERNELS", "1")  # (on the GPU, dropout runs in torch by default)
    seeds = []
    real_draw = dropout.draw
    monkeypatch.setattr(dropout, "draw", lambda p, device=None: seeds.append(real_draw(p, device)) or seeds[-1])
    g = torch.Generator("cuda").manual_seed(7)
    b, hq, hkv, nq, nk, d, p = 2, 8, 2, 1023, 1111, 128, 0.1

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    q, k, v = rand(b, hq, nq, d), rand(b, hkv, nk, d), rand(b, hkv, nk, d)
    grad = torch.randn(b, hq, nq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    out = autoflash.attention(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=True)
    z = torch.empty((b, hq, nq, nk), dtype=torch.int8, device="cuda")
    _draw_keep[(b * hq, triton.cdiv(nq, 16))](z, seeds[0].seed, seeds[0].offset, hq, nq, nk, p, BLOCK=16)
    keep = z.bool()
    assert abs(keep.float().mean().item() - (1 - p)) < 1e-3
    ref, _, leaves = reference_with(q, k, v, keep, p, causal, 0, d ** -0.5)
    assert rel_error(out, ref) <= 2e-2
    for mine, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, leaves, grad.double())):
        assert rel_error(mine, want) <= 3e-2


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["window", "softcap+alibi", "all three, alibi per batch"])
def test_flash_attn_func_drops_with_a_window_softcap_or_alibi_on_the_kernels(name, monkeypatch):
    """Dropout with the attention variants: the kernels rendered with both (strict mode: no fallback),
    against autoflash.eager in float64 with the call's own mask in place of torch's dropout."""
    import autoflash
    from autoflash import dropout, eager

    _strict(monkeypatch)
    monkeypatch.setenv("AUTOFLASH_DROPOUT_KERNELS", "1")  # (on the GPU, dropout runs in torch by default)
    seeds = []
    real_draw = dropout.draw
    monkeypatch.setattr(dropout, "draw", lambda p, device=None: seeds.append(real_draw(p, device)) or seeds[-1])
    g = torch.Generator().manual_seed(8)
    b, hq, hkv, nq, nk, d, p = 2, 4, 2, 37, 53, 16, 0.3
    values = {"window": dict(window_size=(9, 4)), "softcap+alibi": dict(softcap=3.0, alibi_slopes=torch.rand(hq, generator=g)),
              "all three, alibi per batch": dict(window_size=(20, -1), softcap=2.0,
                                                 alibi_slopes=torch.rand(b, hq, generator=g))}[name]
    q = torch.randn(b, nq, hq, d, generator=g).requires_grad_()
    k = torch.randn(b, nk, hkv, d, generator=g).requires_grad_()
    v = torch.randn(b, nk, hkv, d, generator=g).requires_grad_()
    out = autoflash.flash_attn_func(q, k, v, p, causal=True, **values)
    assert len(seeds) == 1
    z = keep_mask(seeds[0], b, hq, nq, nk).double()

    class _Dropped:  # (eager's torch.nn.functional, its dropout the kernels' mask)
        def __getattr__(self, attr):
            return getattr(torch.nn.functional, attr)

        @staticmethod
        def dropout(prob, rate):
            return prob * z / (1 - rate)
    monkeypatch.setattr(eager, "F", _Dropped())
    leaves = [t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref, _ = eager.eager_attention(*leaves, scale=d ** -0.5, causal=True, offset=nk - nq,
                                   window=values.get("window_size", (-1, -1)), softcap=values.get("softcap", 0.0),
                                   alibi_slopes=values.get("alibi_slopes"), dropout_p=p)
    assert rel_error(out, ref.transpose(1, 2)) <= 1e-5
    grad = torch.randn(out.shape, generator=g)
    for mine, want in zip(torch.autograd.grad(out, (q, k, v), grad),
                          torch.autograd.grad(ref, leaves, grad.double().transpose(1, 2))):
        assert rel_error(mine, want.transpose(1, 2)) <= 1e-5


class _CudaLike:
    """Just enough of a CUDA tensor for the dropout policy (it reads `is_cuda` first)."""

    is_cuda = True


def test_dropout_on_the_gpu_runs_in_torch_unless_the_kernels_are_asked_for(monkeypatch):
    """On a GPU the own dropout kernels measured 0.32-0.34x SDPA-cuDNN's training pair: torch keeps
    those calls (a reason the fallback says), AUTOFLASH_DROPOUT_KERNELS=1 serves the kernels."""
    from autoflash import dropout

    monkeypatch.delenv("AUTOFLASH_DROPOUT_KERNELS", raising=False)
    why = dropout.unsupported(_CudaLike(), None, None, 0.1, None, training=True)
    assert "runs in torch" in why and "AUTOFLASH_DROPOUT_KERNELS=1" in why
    monkeypatch.setenv("AUTOFLASH_DROPOUT_KERNELS", "1")  # past the policy: the next check speaks (p = 1)
    assert "dropout_p=1.0" in dropout.unsupported(_CudaLike(), None, None, 1.0, None, training=True)


@pytest.mark.interpreter
def test_a_signatures_dropout_kernels_are_resolved_once_and_forgotten_with_the_winners(monkeypatch):
    """A training step asks for its dropout kernels three times (the early refusal check, the forward,
    the backward), each resolution ~150 us of host time: resolved once per call signature, resolved
    again after the dispatcher forgets its winners, and a refusal is remembered as a refusal."""
    import autoflash
    from autoflash import api, dropout

    _strict(monkeypatch)
    monkeypatch.setenv("AUTOFLASH_DROPOUT_KERNELS", "1")
    resolved = []
    real = dropout._resolve
    monkeypatch.setattr(dropout, "_resolve", lambda *a: resolved.append(a[6]) or real(*a))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g).requires_grad_() for _ in range(3))
    for _ in range(3):
        autoflash.attention(q, k, v, dropout_p=0.2).sum().backward()
    assert sorted(resolved) == ["bwd", "bwd", "fwd"]  # (the backward's dO has its own strides: its own key)
    api.reset()
    autoflash.attention(q, k, v, dropout_p=0.2).sum().backward()
    assert len(resolved) == 6

    def refuse(*a):
        resolved.append("refused")
        raise dropout._Unservable("no bwd family with dropout")

    monkeypatch.setattr(dropout, "_resolve", refuse)
    api.reset()
    for _ in range(2):
        with pytest.raises(dropout._Unservable, match="no bwd family"):
            dropout.kernels_for(q, k, v, q, False, "bwd")
    assert resolved.count("refused") == 1


def test_the_dropout_forward_takes_the_tiles_measured_fastest_with_the_draw(monkeypatch):
    """Whatever forward serves the plain problem (its default: 128-row tiles), the forward rendered with
    dropout runs the 64x64 tiles, 4 warps and 2 stages measured fastest with the Philox draw, its other
    knobs kept."""
    from autoflash import dropout
    from autoflash.dispatch import get_dispatcher

    q = torch.zeros(1, 2, 64, 64)
    problem = Problem("fwd", "float32", 64, False, 1, 64, 64)
    plain = load_space("fwd").default_for(problem, _device()).replace(BLOCK_M=128, num_warps=8, LOADS="pointer",
                                                                      WARP_SPECIALIZE=False)
    monkeypatch.setattr(get_dispatcher(), "kernel_for", lambda *a, **kw: type("K", (), {"variant": plain})())
    get_dispatcher().derived.clear()
    kernel = dropout.kernels_for(q, q, q, q, False, "fwd")
    assert {k: kernel.variant[k] for k in dropout.DROPOUT_FORWARD_TILES} == dropout.DROPOUT_FORWARD_TILES
    assert kernel.variant["LOADS"] == "pointer"
    get_dispatcher().derived.clear()
