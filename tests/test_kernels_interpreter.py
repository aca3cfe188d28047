"""Forward kernel variants under TRITON_INTERPRET=1 vs a float64 reference (O and LSE).

A seeded sample of the constrained space, each variant on a tiny ragged shape (lengths that
are no block multiple, GQA, causal with both alignments, Nq != Nk), in float32 and float16.
"""

import collections
import math
import random
import zlib

import pytest
import torch

from autoflash import codegen
from autoflash.reference import lse_error, make_inputs, reference, rel_error
from autoflash.tuning.gate import run_variant
from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.space import load_space

pytestmark = pytest.mark.interpreter

# (seqlen_q, seqlen_k, head_dim, heads_q, heads_kv, causal, causal alignment)
CASES = [
    (1, 17, 64, 2, 2, False, "top_left"),
    (37, 37, 80, 4, 2, True, "top_left"),
    (113, 64, 128, 2, 1, True, "bottom_right"),  # Nq > Nk: the first rows see no key
    (17, 113, 64, 2, 2, True, "bottom_right"),
    (64, 37, 80, 2, 2, False, "top_left"),
    (37, 113, 128, 4, 1, True, "top_left"),
    (113, 17, 64, 2, 2, True, "top_left"),
]
N_VARIANTS = 60
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def sample():
    rng = random.Random(20261130)
    space = load_space("fwd")
    device = gpu_fingerprint()
    picked = []
    for i in range(N_VARIANTS):
        case = CASES[i % len(CASES)]
        nq, nk, d, hq, hkv, causal, align = case
        shape = Shape(1, hq, hkv, nq, nk, d, causal, "float16")
        picked.append((rng.choice(space.valid_variants(shape.problem, device)), case))
    return picked


SAMPLE = sample()


def test_sample_covers_every_structural_choice():
    seen = collections.defaultdict(set)
    for variant, _ in SAMPLE:
        for knob in ("LOADS", "MASK_MODE", "KV_ORDER", "GRID_ORDER", "WARP_SPECIALIZE", "HEAD_SPLIT", "BLOCK_M", "BLOCK_N"):
            seen[knob].add(variant[knob])
    space = load_space("fwd")
    device = gpu_fingerprint()
    for knob, choices in seen.items():
        # every choice some problem allows on this device (block pointers are gone in Triton >= 3.9)
        offered = {c for c in space.knobs[knob] if any(
            not space.violations(v.replace(**{knob: c}), Shape(1, hq, hkv, nq, nk, d, causal, "float16").problem, device)
            for v, (nq, nk, d, hq, hkv, causal, _align) in SAMPLE)}
        assert choices == offered, f"sample misses {knob} choices"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("variant, case", SAMPLE, ids=[f"{i}-{v.short()}" for i, (v, _) in enumerate(SAMPLE)])
def test_variant_matches_float64_reference(variant, case, dtype):
    nq, nk, d, hq, hkv, causal, align = case
    shape = Shape(2 if nq < 64 else 1, hq, hkv, nq, nk, d, causal, dtype)
    module = codegen.load(variant)
    q, k, v = make_inputs(shape, "cpu", seed=zlib.crc32(variant.json().encode()) % 1000, layout="bnhd" if nq % 2 else "bhnd")
    offset = nk - nq if align == "bottom_right" else 0
    scale = 0.7 / math.sqrt(d)  # not the default: any scale must work
    out, lse = run_variant(module, q, k, v, causal, offset, scale)
    ref_out, ref_lse = reference(q, k, v, causal, offset, scale)
    assert not torch.isnan(out).any(), "unwritten (poisoned) output"
    assert rel_error(out, ref_out) <= TOLERANCE[dtype]
    assert lse_error(lse, ref_lse) <= 1e-4


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_a_batch_with_more_programs_than_a_grid_axis_runs_in_chunks(op, monkeypatch):
    """CUDA caps grid axes 1 and 2 at 65535 programs and a dense launch puts batch x heads on one of
    them: a larger call runs in batch chunks (views, no copies) with the results of one launch.
    (The cap lowered to 5 here: 3 x 2 heads = 6 rows of programs, in chunks of 2 batch entries.)"""
    from autoflash.api import forward_with_lse
    from autoflash.problem import Problem

    q, k, v, do = (torch.randn(3, 2, 37, 16) for _ in range(4))
    variant = load_space(op).default_for(Problem(op, "float32", 16, True, 1, 64, 64), gpu_fingerprint())
    kernel = codegen.load(load_space(op).nearest_valid(variant, Problem(op, "float32", 16, True, 1, 64, 64),
                                                       gpu_fingerprint()))
    out, lse = forward_with_lse(q, k, v, True, 0, 0.25)

    def run():
        if op == "fwd":
            o, l = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
            kernel.forward(q, k, v, o, l, 0.25, True, 0)
            return o, l
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        kernel.backward(q, k, v, out, lse, do, *grads, 0.25, True, 0)
        return grads

    whole = run()
    launches = []
    real = kernel.host.launch
    monkeypatch.setattr(kernel.host, "launch", lambda **kw: (launches.append(kw["q"].shape[0]), real(**kw)))
    monkeypatch.setattr(codegen, "GRID_AXIS_MAX", 5)
    chunked = run()
    assert launches == [2, 1]
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
