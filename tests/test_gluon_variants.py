"""The Gluon Hopper forward with attention variants (sliding window, softcap, ALiBi, sinks;
autoflash/families/gluon_sm90_fwd/, the same semantics as the Triton forward's).

CPU (no marker, runs in CI): each of the family's structures (one 8-warp consumer with intra-warpgroup
overlap; two ping-pong consumers, persistent; three d64 consumers) compiles for sm90a with the variants,
the plain kernel renders as before (its winners stay its own), and a variant problem nothing was tuned
for on an sm90 GPU gets the Gluon default. GPU (`gpu` marker): bf16 against the float64 reference built
from the materialized mask and bias (test_score_variants.reference), ragged lengths, Nq != Nk both ways,
GQA, (B, N, H, D) strided inputs, outputs poisoned first."""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

import triton  # noqa: E402

from autoflash import codegen  # noqa: E402
from autoflash.device import gpu_fingerprint, triton_release  # noqa: E402
from autoflash.problem import Problem  # noqa: E402
from autoflash.reference import lse_error, rel_error  # noqa: E402
from autoflash.score_variant import PLAIN, ScoreVariant  # noqa: E402
from autoflash.space import Variant, load_space  # noqa: E402

if triton_release(triton.__version__) != (3, 6):
    pytest.skip(f"the Gluon family is written for Triton 3.6's Gluon API (installed: {triton.__version__})",
                allow_module_level=True)

from test_score_variants import VARIANTS, reference, score_args  # noqa: E402

_COMMON = dict(HEAVY_FIRST=True, PRODUCER_REGS=24)
STRUCTURES = {
    "overlap": dict(_COMMON, BLOCK_M=128, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=1, CONSUMER_WARPGROUPS=2,
                    PINGPONG=False, INTRA_OVERLAP=True, PERSISTENT=False, CONSUMER_REGS=240),
    "pingpong": dict(_COMMON, BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1,
                     PINGPONG=True, INTRA_OVERLAP=False, PERSISTENT=True, CONSUMER_REGS=200, PRODUCER_REGS=40),
    "three": dict(_COMMON, BLOCK_M=64, BLOCK_N=64, NUM_STAGES=3, NUM_CONSUMERS=3, CONSUMER_WARPGROUPS=1,
                  PINGPONG=False, INTRA_OVERLAP=False, PERSISTENT=True, CONSUMER_REGS=160),
}
HEAD_DIMS = {"overlap": (128, 256), "pingpong": (128, 96), "three": (64,)}


def variant_of(structure: str, head_dim: int) -> Variant:
    knobs = dict(STRUCTURES[structure])
    if head_dim > 128:
        knobs["BLOCK_N"] = 64  # (K/V slots of 128 keys do not fit beside a 256 tile)
    return Variant.of("gluon_sm90_fwd", knobs)


def host_of(variant: Variant, score: ScoreVariant):
    with codegen.interpreter_off():  # (Gluon modules import with the interpreter off)
        return codegen.load(variant, score=score).host


# ----------------------------------------------------------------------------------------------
# CPU: compiled for sm90a, the plain kernel unchanged, which default serves a variant problem
# ----------------------------------------------------------------------------------------------

COMPILE_SAMPLE = [("overlap", 128, "window", True), ("overlap", 256, "softcap", True),
                  ("pingpong", 128, "all four", False), ("pingpong", 96, "window+sinks (gpt-oss)", True),
                  ("three", 64, "window+softcap (gemma-2)", True), ("three", 64, "alibi per batch", False)]


@pytest.mark.parametrize("structure, head_dim, name, causal", COMPILE_SAMPLE,
                         ids=[f"{s}-d{d}-{n.split()[0]}" for s, d, n, _ in COMPILE_SAMPLE])
def test_variant_kernels_compile_for_sm90(structure, head_dim, name, causal):
    from helpers import compile_gluon_for_sm90

    values = VARIANTS[name][1]
    score = score_args(values, batch=2, heads=4)
    host = host_of(variant_of(structure, head_dim), score.variant)
    q, k = torch.empty(2, 4, 333, head_dim, dtype=torch.bfloat16), torch.empty(2, 2, 517, head_dim, dtype=torch.bfloat16)
    args, constexprs, _, options = host.kernel_args(q, k, k, torch.empty_like(q), torch.empty(2, 4, 333), 0.125, causal,
                                                    517 - 333, score_args=score)
    ptx = compile_gluon_for_sm90(host.kernels._attn_fwd_sm90, args, constexprs, options).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    source = codegen.render(variant_of(structure, head_dim), score=score.variant)
    if score.variant.window:  # only the band's blocks: the producer's loop starts at the band's first block
        assert "for j in range(first_blk, n_blocks):" in source
    if score.variant.softcap:
        assert "softcap_log2 * (1.0 - 2.0 / (gl.exp2(s * softcap_in) + 1.0))" in source


def test_a_user_score_mod_stays_the_triton_forwards():
    from autoflash.families import host_class

    family = host_class("gluon_sm90_fwd")
    assert family.computes(ScoreVariant(window=True, softcap=True, alibi=True, sinks=True))
    assert not family.computes(ScoreVariant(score_mod="score-0123456789"))
    assert host_class("triton_fwd").computes(ScoreVariant(score_mod="score-0123456789"))
    with pytest.raises(ValueError, match="computes no attention variants"):
        codegen.load(variant_of("overlap", 128), score=ScoreVariant(mask_mod="mask-0123456789"))


def test_a_variant_problem_without_a_winner_gets_the_gluon_default_where_measured_faster():
    """On an sm90 GPU the Gluon forward's default serves the variant problems its host names (a causal
    window at d65-128, GQA >= 4: measured 1.23x the Triton forward's default there; a causal window or
    softcap at d256, GQA >= 2: 1.13-1.19x); other variants, a user's score_mod, and machines where the
    Gluon space has no valid variant (this CPU) get the Triton forward's default."""
    from autoflash.families import score_variant_default as variant_default
    from autoflash.space import default_variant

    hopper = dataclasses.replace(gpu_fingerprint(), name="NVIDIA H200", cc_major=9, cc_minor=0, smem_per_block=232448,
                                 triton_version=triton.__version__)
    assert hopper.on_gpu
    windowed = Problem("fwd", "bfloat16", 128, True, 4, 16384, 16384, score_variant="window")
    served = variant_default(windowed, hopper)
    assert served.family == "gluon_sm90_fwd" and not load_space("gluon_sm90_fwd").violations(served, windowed, hopper)
    gemma = Problem("fwd", "bfloat16", 256, True, 2, 16384, 16384, score_variant="window+softcap")
    for served_too in (gemma, dataclasses.replace(gemma, score_variant="softcap"),
                       dataclasses.replace(windowed, head_dim=256)):
        assert variant_default(served_too, hopper).family == "gluon_sm90_fwd", served_too.key
    for other in (dataclasses.replace(windowed, score_variant="score-0123456789"),
                  dataclasses.replace(windowed, score_variant="softcap"), dataclasses.replace(windowed, head_dim=64),
                  dataclasses.replace(gemma, gqa_group=1), dataclasses.replace(gemma, head_dim=160),
                  dataclasses.replace(gemma, score_variant="softcap+sinks"),
                  dataclasses.replace(gemma, seqlen_q=1024, seqlen_k=1024), dataclasses.replace(windowed, causal=False)):
        assert variant_default(other, hopper) == default_variant("fwd", other, hopper), other.key
    cpu = gpu_fingerprint()
    assert variant_default(windowed, cpu) == default_variant("fwd", windowed, cpu)


# ----------------------------------------------------------------------------------------------
# GPU: numerics against float64
# ----------------------------------------------------------------------------------------------

GPU_LENGTHS = [(37, 113), (113, 37), (1023, 1023), (1023, 4111), (4111, 1023)]
GPU_CASES = [(name, n_q, n_k, structure, head_dim)
             for i, name in enumerate(VARIANTS) for j, (n_q, n_k) in enumerate(GPU_LENGTHS)
             for structure in [tuple(STRUCTURES)[(i + j) % 3]]
             for head_dim in [HEAD_DIMS[structure][(i + j) % len(HEAD_DIMS[structure])]]]


@pytest.mark.gpu
@pytest.mark.parametrize("name, n_q, n_k, structure, head_dim", GPU_CASES,
                         ids=[f"{c[0].split()[0]}-{c[1]}x{c[2]}-{c[3]}-d{c[4]}" for c in GPU_CASES])
def test_bf16_gluon_variants_against_float64(name, n_q, n_k, structure, head_dim):
    """Within 2x the error of torch's own float32-score path in bf16 (autoflash.eager), and a bf16-sized
    bound; every element of O and the LSE written (poisoned first), (B, N, H, D) strided inputs."""
    from autoflash.eager import eager_attention

    causal, values = VARIANTS[name]
    if min(n_q, n_k) > 1000:  # windows over several KV blocks at the longer lengths
        values = {**values, "window": tuple(w * 16 if w > 0 else w for w in values.get("window", (-1, -1)))}
    batch, heads, kv_heads = 2, 4, 2
    score = score_args(values, batch=batch, heads=heads, seed=n_q + n_k, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(n_q * 3 + head_dim)
    q, k, v = (torch.randn(batch, n, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for n, h in ((n_q, heads), (n_k, kv_heads), (n_k, kv_heads)))
    out = torch.full((batch, n_q, heads, head_dim), math.nan, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.full((batch, heads, n_q), math.nan, device="cuda")
    scale, offset = head_dim ** -0.5, n_k - n_q
    kernel = codegen.load(variant_of(structure, head_dim), score=score.variant)
    assert kernel.unsupported(q, k, v, out) is None
    kernel.forward(q, k, v, out, lse, scale, causal, offset, score_args=score)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an element of O or the LSE was not written"
    ref_out, ref_lse = reference(q, k, v, scale, causal, offset, score)
    torch_out, _ = eager_attention(q, k, v, scale=scale, causal=causal, offset=offset, window=score.window,
                                   softcap=score.softcap, alibi_slopes=score.alibi_slopes, sinks=score.sinks)
    err, torch_err = rel_error(out, ref_out), rel_error(torch_out, ref_out)
    assert err <= max(2 * torch_err, 1e-2), (err, torch_err)
    assert lse_error(lse, ref_lse) <= 2e-2


def test_plain_kernel_renders_as_without_variants():
    """The plain render takes no variant argument and imports nothing the variants need."""
    source = codegen.render(variant_of("overlap", 128), score=PLAIN)
    assert "window_left" not in source and "triton_device" not in source and "softcap" not in source
