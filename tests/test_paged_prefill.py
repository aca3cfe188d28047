"""Paged prefill: packed queries against K/V caches in pages, read in place through the block table by
the forward kernel rendered `paged` (no gathered copy), against float64 per sequence."""

from __future__ import annotations

import math

import pytest
import torch

import autoflash
from autoflash import api, codegen, varlen
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import get_dispatcher
from autoflash.problem import Problem
from autoflash.reference import rel_error
from autoflash.space import default_variant
from test_varlen import FWD_SAMPLE, GPU_LENGTHS, INTERPRETER_CASES, cu, packed_inputs, per_sequence_reference


def paged_caches(k, v, lens_k, page: int, seed: int = 0):
    """The packed k, v (total_k, H_kv, D*) written into shuffled pages of a cache whose other rows are
    NaN (a read of a row no sequence owns shows), and a block table one entry wider than the longest
    sequence needs, its entries past each sequence's pages junk (never read)."""
    width = max(-(-n // page) for n in lens_k) + 1
    blocks = len(lens_k) * width
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).view(len(lens_k), width)
    table = order.to(torch.int32)
    k_cache = torch.full((blocks, page, *k.shape[1:]), float("nan"), dtype=k.dtype, device=k.device)
    v_cache = torch.full((blocks, page, *v.shape[1:]), float("nan"), dtype=v.dtype, device=v.device)
    start = 0
    for b, n in enumerate(lens_k):
        rows = torch.arange(n)
        pages = table[b, rows // page].long()
        k_cache[pages, rows % page] = k[start:start + n]
        v_cache[pages, rows % page] = v[start:start + n]
        table[b, -(-n // page):] = 10 ** 6  # past the sequence's pages: junk, never read
        start += n
    return k_cache, v_cache, table.to(k.device)


def no_gather(*_):
    raise AssertionError("the paged call gathered its pages into a copy")


def check(out, lse, want, tolerance):
    ref_out, ref_lse, _ = want
    assert not torch.isnan(out).any() and rel_error(out, ref_out) <= tolerance
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # rows with no key: +inf
    assert (lse[finite].double() - ref_lse[finite]).abs().max() <= 10 * tolerance


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=["ragged-gqa", "nq-ne-nk"])
@pytest.mark.parametrize("page", [1, 5, 16, 64])  # below, not dividing, equal to BLOCK_N (64 here)
def test_the_api_reads_pages_in_place(page, case, causal, monkeypatch):
    lens_q, lens_k, hq, hkv, d = case
    q, k, v, _ = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.float32, "cpu", seed=page)
    k_cache, v_cache, table = paged_caches(k, v, lens_k, page, seed=page)
    monkeypatch.setattr(varlen, "_gather_pages", no_gather)
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")  # served by the kernels, no fallback
    out, lse, _ = autoflash.flash_attn_varlen_func(q, k_cache, v_cache, cu(lens_q), cu(lens_k), max(lens_q),
                                                   max(lens_k), 0.0, 0.3, causal, return_attn_probs=True,
                                                   block_table=table)
    check(out, lse, per_sequence_reference(q, k, v, q, lens_q, lens_k, causal, 0.3), 1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("page", [32, 128])
@pytest.mark.parametrize("i", range(len(FWD_SAMPLE)))
def test_every_structural_choice_renders_a_paged_twin(i, page):
    """Each structural forward variant's paged twin (its TMA loads where a key tile lies within a page,
    else pointer loads; its other knobs kept where valid) reads the pages right, rows of a page past
    the sequence's end (NaN here) never reaching the output: the twin is what the dispatcher serves a
    paged call from that variant."""
    lens_q, lens_k, hq, hkv, d = INTERPRETER_CASES[0]
    q, k, v, _ = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.float32, "cpu", seed=i)
    k_cache, v_cache, table = paged_caches(k, v, lens_k, page, seed=i)
    problem = Problem("fwd", "float32", d, True, hq // hkv, 64, 64)
    variant = FWD_SAMPLE[i]
    q4 = q[None].transpose(1, 2)
    kernel = get_dispatcher()._paged_twin(codegen.load(variant), problem, gpu_fingerprint(), q4,
                                          k_cache.transpose(1, 2), v_cache.transpose(1, 2), q4)
    assert kernel.paged and kernel.variant["LOADS"] == ("tma" if variant["LOADS"] == "tma" else "pointer")
    if kernel.variant["LOADS"] == "tma":  # (a key tile within a page: shortened where it had to be)
        assert page % kernel.variant["BLOCK_N"] == 0 and kernel.variant["BLOCK_N"] == min(variant["BLOCK_N"], page)
    assert all(kernel.variant[knob] == variant[knob] for knob in ("MASK_MODE", "KV_ORDER", "GRID_ORDER"))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"))
    kernel.forward_varlen(q, k_cache, v_cache, out, lse, cu(lens_q), cu(lens_k), max(lens_q), 0.25, True,
                          block_table=table)
    check(out, lse, per_sequence_reference(q, k, v, q, lens_q, lens_k, True, 0.25), 1e-5)


@pytest.mark.interpreter
def test_long_calls_on_pages_a_tile_cannot_read_gather_them_first(monkeypatch):
    """Pages smaller than a key tile go through pointer loads, slower than a gathered copy's kernel on
    long calls: above `POINTER_PAGES_MAX_FLOPS` of attention work such pages are gathered, below it they
    are read in place (right answers either way)."""
    lens_q, lens_k, hq, hkv, d = INTERPRETER_CASES[0]
    q, k, v, _ = packed_inputs(lens_q, lens_k, hq, hkv, d, torch.float32, "cpu", seed=3)
    want = per_sequence_reference(q, k, v, q, lens_q, lens_k, True, 0.3)[0]
    gathered = []
    real_gather = varlen._gather_pages
    monkeypatch.setattr(varlen, "_gather_pages", lambda *a: gathered.append(1) or real_gather(*a))
    for limit, page in ((1e30, 5), (0.0, 5)):
        monkeypatch.setattr(varlen, "POINTER_PAGES_MAX_FLOPS", limit)
        k_cache, v_cache, table = paged_caches(k, v, lens_k, page)
        out = autoflash.flash_attn_varlen_func(q, k_cache, v_cache, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                               0.0, 0.3, True, block_table=table)
        assert rel_error(out, want) <= 1e-5
        assert len(gathered) == (limit == 0.0)


@pytest.mark.interpreter
def test_a_value_head_dim_of_its_own_reads_pages_too(monkeypatch):
    lens_q, lens_k = (3, 9), (12, 9)
    q, k, _, _ = packed_inputs(lens_q, lens_k, 2, 1, 16, torch.float32, "cpu", seed=5)
    v = torch.randn(sum(lens_k), 1, 8)
    k_cache, v_cache, table = paged_caches(k, v, lens_k, 4)
    monkeypatch.setattr(varlen, "_gather_pages", no_gather)
    out = autoflash.flash_attn_varlen_func(q, k_cache, v_cache, cu(lens_q), cu(lens_k), 9, 12, causal=True,
                                           block_table=table)
    assert out.shape == (12, 2, 8)
    want = per_sequence_reference(q, k, v, torch.zeros_like(q[..., :8]), lens_q, lens_k, True, 0.25)[0]
    assert rel_error(out, want) <= 1e-5


@pytest.mark.interpreter
def test_paged_and_packed_launches_are_not_mixed():
    """A kernel rendered for pages takes block tables only, and one without takes none."""
    lens = (4, 6)
    q, k, v, _ = packed_inputs(lens, lens, 2, 2, 16, torch.float32, "cpu")
    k_cache, v_cache, table = paged_caches(k, v, lens, 4)
    variant = FWD_SAMPLE[0].replace(LOADS="pointer")
    plain, paged = codegen.load(variant), codegen.load(variant, paged=True)
    out, lse = torch.empty_like(q), torch.empty(2, q.shape[0])
    with pytest.raises(ValueError, match="got block table"):
        plain.forward_varlen(q, k_cache, v_cache, out, lse, cu(lens), cu(lens), 6, 0.25, False, block_table=table)
    with pytest.raises(ValueError, match="got no block table"):
        paged.forward_varlen(q, k, v, out, lse, cu(lens), cu(lens), 6, 0.25, False)
    with pytest.raises(ValueError, match="packed sequences only"):
        paged.forward(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                      out[None].transpose(1, 2), lse[None], 0.25, False, 0)
    with pytest.raises(ValueError, match="reads no paged"):
        codegen.load(default_variant("bwd", Problem("bwd", "float32", 16, False, 1, 64, 64), gpu_fingerprint()),
                     paged=True)


@pytest.mark.interpreter
def test_gradients_and_variants_still_gather_the_pages():
    """Paged calls the in-place kernel does not serve (a backward, a sliding window) run on a gathered
    copy: right answers, gradients in the pages."""
    lens = (5, 11)
    q, k, v, do = packed_inputs(lens, lens, 2, 1, 16, torch.float32, "cpu", seed=9)
    k_cache, v_cache, table = paged_caches(k, v, lens, 4)
    api.reset()
    want = autoflash.flash_attn_varlen_func(q, k, v, cu(lens), cu(lens), 11, 11, causal=True, window_size=(3, 0))
    got = autoflash.flash_attn_varlen_func(q, k_cache, v_cache, cu(lens), cu(lens), 11, 11, causal=True,
                                           window_size=(3, 0), block_table=table)
    assert torch.allclose(got, want, atol=1e-6)
    k_cache.requires_grad_()
    out = autoflash.flash_attn_varlen_func(q, k_cache, v_cache, cu(lens), cu(lens), 11, 11, causal=True,
                                           block_table=table)
    out.backward(do)
    assert torch.isfinite(k_cache.grad[~torch.isnan(k_cache.detach())]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_paged_prefill_on_ragged_lengths(page, causal, monkeypatch):
    """bfloat16 on the GPU (the interpreter cannot see miscompiles): chunked prefill's shape, new
    queries against longer cached keys, and equal lengths."""
    for lens_q, lens_k in ((GPU_LENGTHS, GPU_LENGTHS), ((1, 37, 113, 512, 1023), (0, 64, 1000, 2000, 4111))):
        q, k, v, _ = packed_inputs(lens_q, lens_k, 8, 2, 128, torch.bfloat16, "cuda", seed=page)
        k_cache, v_cache, table = paged_caches(k, v, lens_k, page, seed=page)
        monkeypatch.setattr(varlen, "_gather_pages", no_gather)
        scale = 1 / math.sqrt(128)
        out, lse, _ = autoflash.flash_attn_varlen_func(q, k_cache, v_cache, cu(lens_q, "cuda"), cu(lens_k, "cuda"),
                                                       max(lens_q), max(lens_k), 0.0, scale, causal,
                                                       return_attn_probs=True, block_table=table)
        check(out, lse, per_sequence_reference(q, k, v, q, lens_q, lens_k, causal, scale), 2e-2)


def test_paged_kernels_compile_for_sm90(tmp_path):
    """The interpreter cannot see a kernel the GPU compiler refuses: the paged forward compiles for
    Hopper on any machine, with pages smaller than a key tile (a table entry per row) and larger (one
    entry per tile), pointer and TMA loads, both KV orders, and V of a head dim of its own."""
    from helpers import run_in_clean_process

    done = run_in_clean_process("from tests.test_paged_prefill import compile_for_sm90; compile_for_sm90()", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 6


def compile_for_sm90() -> None:
    """(Run by the test above in a clean process.) Capture each paged launch and compile it."""
    from helpers import capture_launches, compile_for_sm90 as compile_one

    from autoflash.space import load_space

    fwd = load_space("triton_fwd")
    base = {**{n: c[0] for n, c in fwd.knobs.items()}, "LOADS": "pointer", "MASK_MODE": "split", "BLOCK_M": 128,
            "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    lens = (333, 517)
    for page, order, dv, loads in ((16, "ascending", 128, "pointer"), (256, "diagonal_first", 128, "pointer"),
                                   (64, "ascending", 64, "pointer"), (32, "ascending", 128, "pointer"),
                                   (256, "ascending", 128, "tma"), (64, "diagonal_first", 64, "tma")):
        kernel = codegen.load(fwd.check_declared({**base, "KV_ORDER": order, "LOADS": loads}), value_dim=dv != 128,
                              paged=True)
        q = torch.empty(sum(lens), 8, 128, dtype=torch.bfloat16)
        k_cache = torch.empty(80, page, 2, 128, dtype=torch.bfloat16)
        v_cache = torch.empty(80, page, 2, dv, dtype=torch.bfloat16)
        table = torch.zeros(2, 600 // page + 1, dtype=torch.int32)
        launches = capture_launches([kernel.module._attn_fwd])
        kernel.host.launch_varlen(q=q, k=k_cache, v=v_cache, o=torch.empty(sum(lens), 8, dv, dtype=torch.bfloat16),
                                  lse=torch.empty(8, sum(lens)), cu_seqlens_q=cu(lens), cu_seqlens_k=cu((500, 600)),
                                  max_seqlen_q=517, sm_scale=0.1, causal=True, compile_only=True, block_table=table)
        for jit, a, kw in launches:
            defaults = {p.name: p.default for p in jit.params if p.is_constexpr and p.has_default}
            compile_one(jit, a, {**defaults, **kw})
        print("paged", page, order, dv, loads)
