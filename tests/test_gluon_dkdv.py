"""The backward's Gluon dK/dV kernel (DKDV_KERNEL = "gluon_sm90", autoflash/families/triton_bwd/gluon_dkdv.*).

On any machine: it compiles for Hopper (wgmma, TMA, warp specialization) at every head-dim tile;
the space offers it only where it runs (Hopper GPU, 16-bit, separate dQ, whole GQA group) and the
defaults pick it at d256 and d128 MHA there; a variant that carries it computes the right
gradients off Hopper (packed sequences, float32, CPU tensors) through its Triton dK/dV kernel.
Its numerics on the GPU: tests/test_gpu.py (gate sample, defaults), tests/test_replay.py."""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
import triton  # noqa: E402

from autoflash.device import triton_release  # noqa: E402

if triton_release(triton.__version__) != (3, 6):  # (the space offers it with 3.6 only: its rule says why)
    pytest.skip(f"the Gluon dK/dV kernel is written for Triton 3.6's Gluon API (installed: {triton.__version__})",
                allow_module_level=True)

from autoflash import codegen  # noqa: E402
from autoflash.api import forward_with_lse  # noqa: E402
from autoflash.device import gpu_fingerprint  # noqa: E402
from autoflash.problem import Problem  # noqa: E402
from autoflash.reference import reference_grads, rel_error  # noqa: E402
from autoflash.space import InvalidVariant, load_space  # noqa: E402
from autoflash.families._shared.gluon_tma import head_tile  # noqa: E402
from autoflash.families.triton_bwd import gluon_dkdv  # noqa: E402

H200 = dataclasses.replace(gpu_fingerprint(), name="NVIDIA H200", cc_major=9, cc_minor=0, smem_per_block=232448)


def gluon_variant(head_dim: int, causal: bool = True, gqa_group: int = 1, dtype: str = "bfloat16"):
    """The H200 default for the problem with the Gluon dK/dV kernel (validated for an H200)."""
    problem = Problem("bwd", dtype, head_dim, causal, gqa_group, 4096, 4096, work=2)
    space = load_space("bwd")
    tiles = dict(BLOCK_M1=64, BLOCK_N1=64 if head_dim > 128 else 128)
    knobs = {**space.default_for(problem, H200).as_dict(), **tiles, "DKDV_KERNEL": "gluon_sm90", "GQA_SPLIT": 1,
             "DQ_MODE": "separate"}
    if head_dim > 128:
        knobs["num_warps"] = 8  # (the Triton fallback's 64-row tiles at d256)
    return space.validate(knobs, problem, H200)


def compile_gluon_dkdv(kernel, head_dim: int, causal: bool):
    from helpers import compile_gluon_for_sm90

    q = torch.empty(2, 4, 333, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 517, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 333, dtype=torch.float32)
    args, constexprs, grid, options = gluon_dkdv.launch_args(kernel.host.knobs, q, k, k.clone(), q.clone(), k.clone(),
                                                             k.clone(), lse, lse.clone(), 0.125, causal, 517 - 333)
    return compile_gluon_for_sm90(kernel.module._gl_bwd_dkdv, args, constexprs, options)


@pytest.mark.parametrize("head_dim, causal", [(256, True), (200, False), (128, True), (96, True), (64, False)])
def test_gluon_dkdv_compiles_for_sm90(head_dim, causal):
    kernel = codegen.load(gluon_variant(head_dim, causal))
    assert kernel.host.knobs["DKDV_KERNEL"] == "gluon_sm90"
    compiled = compile_gluon_dkdv(kernel, head_dim, causal)
    ptx = compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0 and ".target sm_90a" in ptx
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx  # TMA producer, warp-specialized registers
    tile = head_tile(head_dim)
    # dV += P^T dO and dK += dS^T Q span the head-dim tile: split over the two warpgroups at 64
    # keys (d256), whole per warpgroup at 128 keys
    per_warpgroup = tile // 2 if kernel.host.knobs["BLOCK_N1"] == 64 else tile
    assert f"wgmma.mma_async.sync.aligned.m64n{per_warpgroup}k16" in ptx


def test_space_offers_the_gluon_kernel_only_where_it_runs():
    space = load_space("bwd")
    d256 = Problem("bwd", "bfloat16", 256, True, 2, 4096, 4096, work=2)
    assert space.default_for(d256, H200)["DKDV_KERNEL"] == "gluon_sm90"
    # at d128 the tuned Triton pairs measured faster end to end (the kernel stays a tuning choice there)
    assert space.default_for(Problem("bwd", "bfloat16", 128, True, 1, 4096, 4096, work=2), H200)["DKDV_KERNEL"] == "triton"
    # GQA at d128 stays with Triton's kernel (and its GQA split); the CPU never gets it
    assert space.default_for(Problem("bwd", "bfloat16", 128, True, 4, 4096, 4096, work=2), H200)["DKDV_KERNEL"] == "triton"
    assert space.default_for(d256, gpu_fingerprint())["DKDV_KERNEL"] == "triton"
    good = gluon_variant(256).as_dict()
    for change, problem in [(dict(GQA_SPLIT=2), d256), (dict(DQ_MODE="atomic", BLOCK_M2=64, BLOCK_N2=32), d256),
                            (dict(BLOCK_N1=128), d256), ({}, dataclasses.replace(d256, dtype="float32")),
                            ({}, dataclasses.replace(d256, head_dim=100))]:
        with pytest.raises(InvalidVariant):
            space.validate({**good, **change}, problem, H200)
    with pytest.raises(InvalidVariant):
        space.validate(good, d256, gpu_fingerprint())  # no GPU (the interpreter): not offered


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gluon_variant_computes_gradients_through_triton_off_hopper(dtype):
    """CPU tensors (and float32) are refused by the Gluon kernel: the variant's Triton dK/dV kernel
    runs with its knobs, and the gradients are right (GQA, causal bottom-right, ragged lengths)."""
    nq, nk, d, hq, hkv = 45, 70, 96, 4, 2
    dt = getattr(torch, dtype)
    kernel = codegen.load(gluon_variant(d, True, gqa_group=2))
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, nq, hq, d, generator=g).to(dt).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, nk, hkv, d, generator=g).to(dt).transpose(1, 2) for _ in range(2))
    assert gluon_dkdv.refusal(q, k, v, do, k, v) is not None
    scale, offset = 0.7 / math.sqrt(d), nk - nq
    out, lse = forward_with_lse(q, k, v, True, offset, scale)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernel.host.launch(q=q, k=k, v=v, o=out, lse=lse, do=do, dq=grads[0], dk=grads[1], dv=grads[2], sm_scale=scale,
                       causal=True, causal_offset=offset)
    for mine, ref in zip(grads, reference_grads(q, k, v, do, True, offset, scale)):
        assert rel_error(mine, ref) <= (1e-5 if dtype == "float32" else 5e-3)


def test_gluon_refusal_names_what_tma_cannot_take():
    q = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16)
    assert "dtype" in gluon_dkdv.refusal(q.float(), q.float())
    assert "head dim" in gluon_dkdv.refusal(torch.empty(1, 2, 64, 100, dtype=torch.bfloat16))
    assert "not CUDA" in gluon_dkdv.refusal(q)  # (a CUDA tensor with a broadcast stride: refused too)
