"""Backward kernels under TRITON_INTERPRET=1: dQ, dK, dV vs float64 autograd of the reference,
for each structural variant (separate dQ kernel, atomic dQ; pointer and TMA loads), fp32 and fp16, on ragged, GQA,
causal (both alignments), Nq != Nk shapes."""

import math
import random

import re

import pytest
import torch

from autoflash import codegen
from autoflash.api import forward_with_lse
from autoflash.reference import reference, rel_error
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
from autoflash.space import load_space

pytestmark = pytest.mark.interpreter

# (seqlen_q, seqlen_k, head_dim, heads_q, heads_kv, causal, alignment)
CASES = [
    (37, 37, 64, 2, 2, True, "top_left"),
    (113, 17, 80, 4, 2, True, "bottom_right"),  # Nq > Nk: rows with no key get zero gradients
    (17, 113, 64, 4, 1, False, "top_left"),
    (64, 37, 128, 2, 1, True, "bottom_right"),
    (1, 45, 32, 2, 2, True, "bottom_right"),
    (45, 64, 96, 3, 3, True, "top_left"),
]
TOLERANCE = {"float32": 1e-5, "float16": 5e-3}


def sample():
    rng = random.Random(5)
    space, device = load_space("bwd"), gpu_fingerprint()
    picked = []
    for i, case in enumerate(CASES * 2):
        nq, nk, d, hq, hkv, causal, align = case
        valid = space.valid_variants(Problem("bwd", "float16", d, causal, hq // hkv, 64, 64), device)
        mode = "separate" if i % 2 == 0 else "atomic"
        order = "heavy_first" if causal and i % 4 < 2 else "kv_major"
        loads = "tma" if i % 3 == 0 else "pointer"
        split = 1 if hq == hkv else (2 if i % 2 == 0 else hq // hkv)  # GQA: slices of the group too
        picked.append((rng.choice([v for v in valid if v["DQ_MODE"] == mode and v["GRID_ORDER"] == order
                                   and v["LOADS"] == loads and v["GQA_SPLIT"] == split]), case))
    return picked


SAMPLE = sample()


def reference_grads(q, k, v, grad, causal, offset, scale):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = reference(*leaves, causal, offset, scale)
    out.backward(grad.double())
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("variant, case", SAMPLE, ids=[f"{i}-{v['DQ_MODE']}" for i, (v, _) in enumerate(SAMPLE)])
def test_backward_variant_matches_float64_autograd(variant, case, dtype):
    nq, nk, d, hq, hkv, causal, align = case
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(nq * 1000 + nk)
    # (B, N, H, D) storage viewed as (B, H, N, D): arbitrary strides, as flash_attn_func passes them.
    q, do = (torch.randn(1, nq, hq, d, generator=g).to(dt).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, nk, hkv, d, generator=g).to(dt).transpose(1, 2) for _ in range(2))
    offset = nk - nq if align == "bottom_right" else 0
    scale = 0.8 / math.sqrt(d)
    out, lse = forward_with_lse(q, k, v, causal, offset, scale)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))  # poisoned: every element must be written
    codegen.load(variant).backward(q, k, v, out, lse, do, dq, dk, dv, scale, causal, offset)
    for mine, ref in zip((dq, dk, dv), reference_grads(q, k, v, do, causal, offset, scale)):
        assert not torch.isnan(mine).any()
        assert rel_error(mine, ref) <= TOLERANCE[dtype]


def test_sample_covers_every_structural_choice():
    assert {v["DQ_MODE"] for v, _ in SAMPLE} == {"separate", "atomic"}
    assert {(v["DQ_MODE"], v["GRID_ORDER"]) for v, _ in SAMPLE} == {
        (m, o) for m in ("separate", "atomic") for o in ("kv_major", "heavy_first")}
    assert {(v["DQ_MODE"], v["LOADS"]) for v, _ in SAMPLE} == {
        (m, l) for m in ("separate", "atomic") for l in ("pointer", "tma")}
    assert {(v["DQ_MODE"], v["GQA_SPLIT"] > 1) for v, _ in SAMPLE} == {
        (m, s) for m in ("separate", "atomic") for s in (False, True)}


@pytest.mark.parametrize("split", [2, 4, 8])
def test_gqa_split_sums_every_slice_of_the_group(split):
    """A group of 3 query heads in 2 (uneven: 2 + 1), 4 or 8 slices (a slice with no head adds
    zeros); a causal bottom-right problem with more keys than queries and ragged tiles."""
    nq, nk, d, hq, hkv = 29, 70, 32, 6, 2
    prob = Problem("bwd", "float32", d, True, hq // hkv, 64, 64)
    space = load_space("bwd")
    base = space.default_for(prob, gpu_fingerprint()).replace(GQA_SPLIT=1)
    variant = base.replace(GQA_SPLIT=split)  # 4, 8 > the group: not offered by the space, but must stay exact
    g = torch.Generator().manual_seed(split)
    q, do = (torch.randn(2, nq, hq, d, generator=g).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(2, nk, hkv, d, generator=g).transpose(1, 2) for _ in range(2))
    scale, offset = 0.5, nk - nq
    out, lse = forward_with_lse(q, k, v, True, offset, scale)
    grads = {}
    for var in (base, variant):
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        codegen.load(var).backward(q, k, v, out, lse, do, dq, dk, dv, scale, True, offset)
        grads[var["GQA_SPLIT"]] = (dq, dk, dv)
    for mine, one, ref in zip(grads[split], grads[1], reference_grads(q, k, v, do, True, offset, scale)):
        assert not torch.isnan(mine).any()
        assert rel_error(mine, ref) <= TOLERANCE["float32"]
        assert rel_error(mine, one) <= TOLERANCE["float32"]


# Masked-out keys overflow exp2 before the mask zeroes them: that is the case under test.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("mode", ["separate", "atomic"])
def test_backward_stays_finite_when_every_score_is_very_negative(mode):
    """Rows whose scores are all about -160 have lse about -160; a zero-filled padding key would
    score 0 and give p = exp(160) = inf, so the key tail must be masked even without causality."""
    nq, nk, d = 40, 45, 32  # neither a multiple of any tile
    prob = Problem("bwd", "float32", d, False, 1, 64, 64)
    variant = [v for v in load_space("bwd").valid_variants(prob, gpu_fingerprint()) if v["DQ_MODE"] == mode][0]
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, nq, d, generator=g), torch.randn(1, 1, nk, d, generator=g)
    q[..., 0], k[..., 0] = -13.0, 13.0  # q.k about -169 +- 6: far below a padding key's 0
    v, do = torch.randn(1, 1, nk, d, generator=g), torch.randn(1, 1, nq, d, generator=g)
    scale = 1.0
    out, lse = forward_with_lse(q, k, v, False, 0, scale)
    assert lse.max() < -100
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    codegen.load(variant).backward(q, k, v, out, lse, do, dq, dk, dv, scale, False, 0)
    for mine, ref in zip((dq, dk, dv), reference_grads(q, k, v, do, False, 0, scale)):
        assert torch.isfinite(mine).all()
        assert rel_error(mine, ref) <= 1e-4


# Variants the GPU compiler must take: a split GQA group (TMA, separate dQ; pointer loads, atomic dQ,
# heavy-first) and the d256 default (8 warps, 64x64 / 128x32 tiles).
SM90_VARIANTS = {
    "split4-tma": (128, dict(GQA_SPLIT=4, LOADS="tma", DQ_MODE="separate")),
    "split2-atomic": (64, dict(GQA_SPLIT=2, LOADS="pointer", DQ_MODE="atomic", BLOCK_M2=64, BLOCK_N2=32,
                               GRID_ORDER="heavy_first", DQ_OVERLAP="serial")),
    "d256-default": (256, dict(GQA_SPLIT=1)),
    # dQ added by the copy engine (no interpreter support: compiled here, run on the GPU only)
    "d256-tma-reduce": (256, dict(GQA_SPLIT=1, DQ_MODE="tma_reduce", BLOCK_M2=64, BLOCK_N2=32, num_stages=1,
                                  DKDV_KERNEL="triton", DQ_OVERLAP="serial")),
    "split2-tma-reduce": (64, dict(GQA_SPLIT=2, LOADS="pointer", DQ_MODE="tma_reduce", BLOCK_M2=64, BLOCK_N2=32,
                                   DQ_OVERLAP="serial")),
}


@pytest.mark.parametrize("name", list(SM90_VARIANTS))
def test_backward_kernels_compile_for_sm90(name, tmp_path):
    """Every kernel a backward launch makes (preprocess, dK/dV, dQ, the GQA reduce) compiles for
    Hopper on any machine: the interpreter runs code the GPU compiler may refuse (a plain global
    read inside a kernel, for one)."""
    from helpers import run_in_clean_process

    code = f"from tests.test_backward_interpreter import compile_backward_for_sm90; compile_backward_for_sm90({name!r})"
    done = run_in_clean_process(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    head_dim, knobs = SM90_VARIANTS[name]
    lines = [line.split() for line in done.stdout.splitlines()]
    kernels = {name: flag for name, flag, _ in lines}
    for name, _, compiled_name in lines:  # what a profiler lists: the family, head dim, causality, knobs
        causal = "_causal" if name in ("_bwd_dkdv", "_bwd_dq") else ""  # (the others have no mask)
        assert compiled_name.startswith(f"{name.strip('_')}__triton_bwd_d{head_dim}{causal}_bm1_"), compiled_name
    assert list(kernels)[0] == "_bwd_preprocess" and "_bwd_dkdv" in kernels
    assert ("_bwd_gqa_reduce" in kernels) == (knobs["GQA_SPLIT"] > 1)
    dq_mode = knobs.get("DQ_MODE", "separate")  # (the d256 default's)
    assert ("_bwd_dq" in kernels) == (dq_mode == "separate")
    # the copy engine's reduce-add is what "tma_reduce" adds dQ with, and nothing else uses it
    assert (kernels["_bwd_dkdv"] == "bulk-reduce") == (dq_mode == "tma_reduce")


def compile_backward_for_sm90(name: str) -> None:
    """(Run by the test above in a clean process.) Capture a backward launch's kernels and compile
    each for sm90; print their names, each with whether its PTX has a bulk tensor reduce."""
    import dataclasses

    from helpers import capture_launches, compile_for_sm90

    head_dim, knobs = SM90_VARIANTS[name]
    device = dataclasses.replace(gpu_fingerprint(), name="NVIDIA H200", cc_major=9, cc_minor=0, smem_per_block=232448)
    problem = Problem("bwd", "bfloat16", head_dim, True, 4, 4096, 4096, work=2)
    space = load_space("bwd")
    variant = space.validate({**space.default_for(problem, device).as_dict(), **knobs}, problem, device)
    kernel = codegen.load(variant)
    module = kernel.module
    jits = [getattr(module, n) for n in ("_bwd_preprocess", "_bwd_dkdv", "_bwd_dq", "_bwd_gqa_reduce") if hasattr(module, n)]
    launches = capture_launches(jits)
    q = torch.empty(2, 8, 300, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 300, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(2, 8, 300)
    kernel.host.launch(q=q, k=k, v=k.clone(), o=q.clone(), lse=lse, do=q.clone(), dq=q.clone(), dk=k.clone(),
                       dv=k.clone(), sm_scale=0.1, causal=True, causal_offset=0, compile_only=True)
    for jit, args, kwargs in launches:
        ptx = compile_for_sm90(jit, args, kwargs)
        entry = re.search(r"\.entry (\w+)", ptx).group(1)
        print(jit.fn.__name__, "bulk-reduce" if "cp.reduce.async.bulk.tensor" in ptx else "-", entry)


@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_a_launch_on_a_fresh_thread_has_the_scratch_allocator(loads, monkeypatch):
    """Autograd runs a backward on a thread of its own, where Triton's allocator (a ContextVar) is
    unset: every launch sets it, not only those of kernels reading through TMA (a dQ reduce-add
    builds a descriptor on the device with pointer loads too, and asked for scratch with none set)."""
    import threading

    from triton.runtime import _allocation

    problem = Problem("bwd", "float32", 32, True, 2, 64, 64, work=2)
    space = load_space("bwd")
    device = gpu_fingerprint()
    variant = space.validate({**space.default_for(problem, device).as_dict(), "LOADS": loads}, problem, device)
    kernel = codegen.load(variant)
    seen = []

    class Recording:
        def launch(self, **kwargs):
            seen.append(not isinstance(_allocation._allocator.get(), _allocation.NullAllocator))

    monkeypatch.setattr(kernel, "host", Recording())  # (the process's cached kernel: put back after)
    t = torch.zeros(1, 2, 64, 32)
    thread = threading.Thread(target=lambda: (kernel.backward(t, t, t, t, t[..., 0], t, t, t, t, 0.1, True, 0),
                                              kernel.forward(t, t, t, t, t[..., 0], 0.1, True, 0)))
    thread.start()
    thread.join()
    assert seen == [True, True]
