"""The Gluon Hopper forward family (autoflash/families/gluon_sm90_fwd/).

CPU (no marker, runs in CI): a sample of variants compiles for sm90a through Triton's Gluon
front end, with the exact signature launch() passes. GPU (`gpu` marker): numerics against a
float64 reference on ragged lengths, Nq != Nk with both causal alignments, GQA, (B, N, H, D)
strided inputs, LSE, and rows that see no key.
"""

import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from autoflash import codegen  # noqa: E402

import triton  # noqa: E402

from autoflash.device import triton_release  # noqa: E402

if triton_release(triton.__version__) != (3, 6):
    # The family's search space offers it on Triton 3.6 only (constraint gluon_api_of_triton_3_6):
    # later releases renamed parts of the Gluon API it is written in.
    pytest.skip(f"the Gluon family is written for Triton 3.6's Gluon API (installed: {triton.__version__})",
                allow_module_level=True)


from autoflash.families._shared.gluon_tma import head_tile  # noqa: E402

# The variant the GPU numerics run on, and every knob named once: one consumer partition of two
# warpgroups (128 query rows), intra-warpgroup overlap, a 2-deep K/V ring.
DEFAULT = dict(BLOCK_M=128, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=1, CONSUMER_WARPGROUPS=2, PINGPONG=False,
               INTRA_OVERLAP=True, PERSISTENT=False, HEAVY_FIRST=True, CONSUMER_REGS=240, PRODUCER_REGS=24)


def knobs(**over):
    out = dict(DEFAULT)
    out.update(over)
    return out


def render_module(knob_values, folder):
    """The family's host object for these knobs (its kernels rendered, imported for the GPU compiler)."""
    from autoflash.space import Variant

    with codegen.interpreter_off():
        return codegen.load(Variant.of("gluon_sm90_fwd", knob_values)).host


@pytest.fixture(scope="session")
def module_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gluon_sm90")


_MODULES = {}


def get_module(knob_values, folder):
    key = tuple(sorted(knob_values.items()))
    if key not in _MODULES:
        _MODULES[key] = render_module(knob_values, folder)
    return _MODULES[key]


# ----------------------------------------------------------------------------------------------
# CPU: compile for sm90a
# ----------------------------------------------------------------------------------------------

# Every value of every knob at least once; d64 and d128; causal and not; bf16 and fp16.
COMPILE_SAMPLE = [
    (knobs(), 128, torch.bfloat16, False),
    (knobs(PERSISTENT=True, HEAVY_FIRST=False), 128, torch.float16, True),
    (knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, PINGPONG=True, INTRA_OVERLAP=False, NUM_STAGES=3,
           BLOCK_N=64, CONSUMER_REGS=232), 64, torch.float16, False),
    (knobs(CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, PRODUCER_REGS=40), 64, torch.bfloat16, True),
    (knobs(NUM_CONSUMERS=3, CONSUMER_WARPGROUPS=1, BLOCK_M=64, CONSUMER_REGS=160, INTRA_OVERLAP=False,
           PERSISTENT=True), 64, torch.bfloat16, False),
    # ... and causal: the default of d64 causal problems at 2k tokens and up.
    (knobs(NUM_CONSUMERS=3, CONSUMER_WARPGROUPS=1, BLOCK_M=64, CONSUMER_REGS=160, INTRA_OVERLAP=False,
           PERSISTENT=True), 64, torch.bfloat16, True),
    (knobs(BLOCK_N=64, NUM_STAGES=4), 64, torch.float16, True),
    (knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, CONSUMER_REGS=200),
     128, torch.bfloat16, True),
    # The default (and the shipped winner) of d128 causal GQA problems at 2k tokens and up.
    (knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, PERSISTENT=True, PINGPONG=True,
           CONSUMER_REGS=200, PRODUCER_REGS=40), 128, torch.bfloat16, True),
    # Head dims under their tile (TMA pads): 96 in a 128 tile; and the 256 tile.
    (knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, BLOCK_N=64), 96,
     torch.bfloat16, True),
    (knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, BLOCK_N=64, PINGPONG=True), 256,
     torch.bfloat16, True),
]


def compile_for_sm90(module, head_dim, dtype, causal):
    from helpers import compile_gluon_for_sm90

    q = torch.empty(2, 4, 333, head_dim, dtype=dtype)
    k = torch.empty(2, 2, 517, head_dim, dtype=dtype)
    v, o = torch.empty_like(k), torch.empty_like(q)
    lse = torch.empty(2, 4, 333, dtype=torch.float32)
    args, constexprs, grid, options = module.kernel_args(q, k, v, o, lse, 0.125, causal, 517 - 333)
    return compile_gluon_for_sm90(module.kernels._attn_fwd_sm90, args, constexprs, options)


@pytest.mark.parametrize("knob_values, head_dim, dtype, causal", COMPILE_SAMPLE,
                         ids=[f"{i}-d{d}-{str(t)[6:]}{'-causal' if c else ''}" for i, (_, d, t, c) in
                              enumerate(COMPILE_SAMPLE)])
def test_compiles_for_sm90(knob_values, head_dim, dtype, causal, module_dir):
    module = get_module(knob_values, module_dir)
    assert module.op == "fwd" and module.name == "gluon_sm90_fwd" and module.uses_tma
    assert module.knobs == knob_values
    kernel = compile_for_sm90(module, head_dim, dtype, causal)
    ptx = kernel.asm["ptx"]
    assert len(kernel.asm["cubin"]) > 0
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx  # tensor cores through wgmma, not mma.sync
    assert "cp.async.bulk.tensor" in ptx  # TMA
    assert "setmaxnreg" in ptx  # warp-specialized register split
    tile = head_tile(head_dim)
    assert f"wgmma.mma_async.sync.aligned.m64n{tile}k16" in ptx  # O += P V spans the whole head-dim tile


def test_head_tile_pads_to_64_128_256():
    assert [head_tile(d) for d in (8, 64, 72, 96, 128, 136, 256)] == [64, 64, 128, 128, 128, 256, 256]


def test_supports_rejects_what_tma_cannot_take():
    module = render_module(knobs(), Path(os.environ.get("TMPDIR", "/tmp")))
    q = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16)
    assert module.supports(q.float(), q.float(), q.float(), q.float()) is not None  # dtype
    for d in (100, 264):  # TMA rows need 16-byte multiples; the largest tile is 256
        qd = torch.empty(1, 2, 64, d, dtype=torch.bfloat16)
        assert "head dim" in module.supports(qd, qd, qd, qd)
    # CPU tensors are refused (the kernel runs on CUDA devices only)
    assert module.supports(q, q, q, q) is not None


# ----------------------------------------------------------------------------------------------
# GPU: numerics
# ----------------------------------------------------------------------------------------------

def reference(q, k, v, causal, causal_offset, scale):
    """float64 O and natural-log LSE; rows with no visible key: O = 0, LSE = +inf."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    n_q, n_k = q.shape[2], k.shape[2]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        visible = j <= i + causal_offset
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p @ vd
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    return out, lse, visible.any(-1)


def sdpa_error(q, k, v, causal, causal_offset, scale, ref, rows):
    """PyTorch's own error in the same dtype (math backend, boolean mask), on rows that see a key."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = None
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = j <= i + causal_offset
    out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale)
    return rel_error(out[:, :, rows], ref[:, :, rows])


def rel_error(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_case(module, B, H, HK, NQ, NK, D, causal, offset, dtype, layout="bhnd", seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(h, n):
        if layout == "bnhd":  # (B, N, H, D) memory seen as (B, H, N, D)
            return torch.randn(B, n, h, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
        return torch.randn(B, h, n, D, device="cuda", dtype=dtype, generator=gen)

    q, k, v = make(H, NQ), make(HK, NK), make(HK, NK)
    o = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    if layout == "bnhd":
        o = torch.full((B, NQ, H, D), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
    lse = torch.full((B, H, NQ), float("nan"), device="cuda", dtype=torch.float32)
    scale = 1 / math.sqrt(D)
    assert module.supports(q, k, v, o) is None
    module.launch(q=q, k=k, v=v, o=o, lse=lse, sm_scale=scale, causal=causal, causal_offset=offset)
    torch.cuda.synchronize()
    ref, ref_lse, rows = reference(q, k, v, causal, offset, scale)
    assert not torch.isnan(o).any(), "NaN (or an unwritten element) in O"
    assert not torch.isnan(lse).any(), "NaN (or an unwritten element) in LSE"
    empty = ~rows
    if empty.any():
        assert (o[:, :, empty] == 0).all(), "rows that see no key must give O = 0"
        assert torch.isposinf(lse[:, :, empty]).all(), "rows that see no key must give LSE = +inf"
    if rows.any():
        err = rel_error(o[:, :, rows], ref[:, :, rows])
        s_err = sdpa_error(q, k, v, causal, offset, scale, ref, rows)
        assert err <= 2 * s_err + 1e-4, (err, s_err)
        lse_err = (lse[:, :, rows].double() - ref_lse[:, :, rows]).abs().max().item()
        assert lse_err <= 1e-3, lse_err
        return err, s_err
    return 0.0, 0.0


def gpu_knobs(head_dim, **over):
    """The numerics variant for a head dim: at 256, 64-key slots (K/V of 128 keys do not fit)."""
    return knobs(**({"BLOCK_N": 64} if head_dim > 128 else {}), **over)


SQUARE = [1, 37, 113, 1023, 4111]
# The tiles' own head dims, and head dims TMA pads into a larger tile (8, 40 -> 64, 96 -> 128,
# 160, 200 -> 256: at 160 the tile's last 64-column copy lies wholly past the head dim).
HEAD_DIMS = [8, 40, 64, 96, 128, 160, 200, 256]
RECT = [(113, 1023), (1023, 113), (37, 4111), (4111, 37), (1, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", SQUARE)
def test_ragged_square(n, causal, head_dim, dtype, module_dir):
    module = get_module(gpu_knobs(head_dim), module_dir)
    run_case(module, 2, 4, 4, n, n, head_dim, causal, 0, dtype, seed=n)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("nq, nk", RECT)
def test_rectangular_causal_alignments(nq, nk, align, head_dim, module_dir):
    module = get_module(gpu_knobs(head_dim), module_dir)
    offset = 0 if align == "top_left" else nk - nq
    run_case(module, 1, 4, 4, nq, nk, head_dim, True, offset, torch.bfloat16, seed=nq + nk)
    run_case(module, 1, 4, 4, nq, nk, head_dim, False, 0, torch.bfloat16, seed=nq * nk)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [-50, 5000])
def test_offsets_outside_the_matrix(offset, module_dir):
    """Negative offsets leave the first rows without keys; offsets past N_K make causal = full."""
    module = get_module(gpu_knobs(128), module_dir)
    run_case(module, 1, 2, 2, 300, 257, 128, True, offset, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_and_strided_layout(causal, head_dim, module_dir):
    module = get_module(gpu_knobs(head_dim), module_dir)
    run_case(module, 2, 8, 2, 1023, 1023, head_dim, causal, 0, torch.bfloat16, layout="bnhd")
    run_case(module, 2, 8, 2, 777, 1500, head_dim, causal, 1500 - 777, torch.float16, layout="bnhd")


# One case per structural knob value, on a ragged causal GQA problem and a non-causal one.
KNOB_SAMPLE = [
    knobs(INTRA_OVERLAP=False),
    knobs(PERSISTENT=True),
    knobs(PERSISTENT=True, HEAVY_FIRST=False, NUM_STAGES=2, BLOCK_N=64),
    knobs(NUM_STAGES=3, BLOCK_N=64, HEAVY_FIRST=False),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, PINGPONG=True),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, PINGPONG=True, INTRA_OVERLAP=False),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, PINGPONG=False, INTRA_OVERLAP=False),
    knobs(CONSUMER_WARPGROUPS=1, BLOCK_M=64),
    knobs(NUM_CONSUMERS=3, CONSUMER_WARPGROUPS=1, BLOCK_M=64, CONSUMER_REGS=160, INTRA_OVERLAP=False),
    knobs(NUM_CONSUMERS=3, CONSUMER_WARPGROUPS=1, BLOCK_M=64, CONSUMER_REGS=160, INTRA_OVERLAP=False,
          PERSISTENT=True),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, PERSISTENT=True),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, INTRA_OVERLAP=False, PERSISTENT=True, PINGPONG=True,
          CONSUMER_REGS=200, PRODUCER_REGS=40),
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("knob_values", KNOB_SAMPLE, ids=[str(i) for i in range(len(KNOB_SAMPLE))])
def test_knob_variants(knob_values, head_dim, module_dir):
    if knob_values["NUM_CONSUMERS"] == 3 and head_dim == 128:
        pytest.skip("three consumer warpgroups at d128 are not offered (registers)")
    module = get_module(knob_values, module_dir)
    run_case(module, 2, 8, 2, 1023, 1100, head_dim, True, 1100 - 1023, torch.bfloat16, seed=1)
    run_case(module, 1, 4, 4, 4111, 4111, head_dim, False, 0, torch.float16, seed=2)
    run_case(module, 1, 4, 4, 37, 113, head_dim, True, 0, torch.bfloat16, seed=3)


# The 256 tile: a sample of the structures its shared memory and registers allow (64-key slots, two
# stages, one 128-row or two 64-row consumers, not persistent: an O buffer of its own does not fit).
D256_SAMPLE = [
    knobs(BLOCK_N=64),
    knobs(BLOCK_N=64, INTRA_OVERLAP=False),
    knobs(BLOCK_N=64, CONSUMER_WARPGROUPS=1, BLOCK_M=64),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, BLOCK_N=64, INTRA_OVERLAP=False),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, BLOCK_N=64, INTRA_OVERLAP=False, PINGPONG=True),
    knobs(NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, BLOCK_M=64, BLOCK_N=64, INTRA_OVERLAP=False, HEAVY_FIRST=False),
    knobs(BLOCK_N=64, CONSUMER_WARPGROUPS=1, BLOCK_M=64, PERSISTENT=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("knob_values", D256_SAMPLE, ids=[str(i) for i in range(len(D256_SAMPLE))])
def test_d256_variants(knob_values, module_dir):
    module = get_module(knob_values, module_dir)
    run_case(module, 2, 8, 2, 1023, 1100, 256, True, 1100 - 1023, torch.bfloat16, seed=1)
    run_case(module, 1, 4, 4, 4111, 4111, 256, False, 0, torch.float16, seed=2)
    run_case(module, 1, 4, 4, 37, 113, 256, True, 0, torch.bfloat16, seed=3)
    run_case(module, 2, 4, 2, 1023, 1023, 200, True, 0, torch.bfloat16, seed=4, layout="bnhd")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 96, 160, 200])
def test_padded_head_dims_read_and_write_nothing_past_the_head_dim(head_dim, module_dir):
    """q, k, v and o as views [..., :D] of wider rows: NaN past D in the inputs must never be read
    (TMA's box is wider than D), and a sentinel past D in the output must never be written."""
    module = get_module(gpu_knobs(head_dim), module_dir)
    B, H, HK, NQ, NK, pad = 2, 4, 2, 300, 517, 48  # (rows of D + 48 elements: 16-byte aligned strides)
    gen = torch.Generator(device="cuda").manual_seed(head_dim)

    def wide(h, n, fill):
        buf = torch.full((B, h, n, head_dim + pad), fill, device="cuda", dtype=torch.bfloat16)
        buf[..., :head_dim] = torch.randn(B, h, n, head_dim, device="cuda", generator=gen)
        return buf

    qb, kb, vb = wide(H, NQ, float("nan")), wide(HK, NK, float("nan")), wide(HK, NK, float("nan"))
    ob = torch.full((B, H, NQ, head_dim + pad), 7.0, device="cuda", dtype=torch.bfloat16)
    q, k, v, o = (t[..., :head_dim] for t in (qb, kb, vb, ob))
    lse = torch.empty(B, H, NQ, device="cuda", dtype=torch.float32)
    assert module.supports(q, k, v, o) is None
    scale = head_dim ** -0.5
    module.launch(q=q, k=k, v=v, o=o, lse=lse, sm_scale=scale, causal=True, causal_offset=NK - NQ)
    torch.cuda.synchronize()
    assert (ob[..., head_dim:] == 7.0).all(), "the kernel wrote past the head dim"
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "the kernel read past the head dim"
    ref, _, rows = reference(q, k, v, True, NK - NQ, scale)
    assert rel_error(o, ref) <= 2 * sdpa_error(q, k, v, True, NK - NQ, scale, ref, rows) + 1e-4

