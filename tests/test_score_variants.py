"""Attention variants in the generated forward kernel (sliding window, softcap, ALiBi, sinks) against a
float64 reference built from the materialized mask and bias: the kernel itself (a sample of the
family's structural knobs, ragged lengths, Nq != Nk, GQA, float32 and float16, O and LSE), the
window's band-only loop, the public drop-ins that route forward-only calls to it, and bf16 on the GPU."""

import dataclasses
import hashlib
import json
import math
import random

import pytest
import torch

import autoflash
from autoflash import api, codegen
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import Dispatcher, WinnerTable
from autoflash.fallback import FallbackError
from autoflash.problem import Problem, Shape
from autoflash.reference import lse_error, rel_error
from autoflash.score_variant import PLAIN, ScoreArgs, ScoreVariant
from autoflash.space import Variant, load_space

BATCH, HEADS, KV_HEADS = 2, 4, 2  # GQA: two query heads per KV head

# name -> (causal, the call's variant values; slopes and sinks made per test from a seed)
VARIANTS = {
    "window": (False, dict(window=(16, 5))),
    "causal+window": (True, dict(window=(20, -1))),
    "window right only": (False, dict(window=(-1, 7))),
    "window right 0": (False, dict(window=(8, 0))),  # the right bound 0 is causality
    "window 0,0": (False, dict(window=(0, 0))),  # each query sees one key
    "window wider than the keys": (True, dict(window=(500, 3))),
    "softcap": (True, dict(softcap=1.5)),
    "alibi per head": (True, dict(alibi="head")),
    "alibi per batch": (False, dict(alibi="batch")),
    "sinks": (True, dict(sinks=True)),
    "window+softcap (gemma-2)": (True, dict(window=(24, -1), softcap=2.0)),
    "window+sinks (gpt-oss)": (True, dict(window=(24, -1), sinks=True)),
    "all four": (False, dict(window=(10, 3), softcap=1.0, alibi="batch", sinks=True)),
}
LENGTHS = [(1, 37), (37, 113), (113, 37), (113, 113), (200, 61)]


def score_args(values: dict, batch: int = BATCH, heads: int = HEADS, seed: int = 0, device="cpu") -> ScoreArgs:
    g = torch.Generator().manual_seed(seed)
    alibi = values.get("alibi")
    slopes = None if alibi is None else (torch.rand((heads,) if alibi == "head" else (batch, heads), generator=g)
                                         * 0.5).to(device)
    sinks = (torch.randn(heads, generator=g) * 2).to(device) if values.get("sinks") else None
    return ScoreArgs(values.get("window", (-1, -1)), values.get("softcap", 0.0), slopes, sinks)


def reference(q, k, v, scale, causal, offset, score: ScoreArgs):
    """float64 (out, lse) from the materialized mask and bias, on (B, H, N, D) tensors; query i sits
    at key position i + offset. A row that sees no key and has no sink: out 0, lse +inf."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n_q, n_k, device = q.shape[2], k.shape[2], q.device
    i = torch.arange(n_q, device=device)[:, None] + offset
    j = torch.arange(n_k, device=device)[None, :]
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    left, right = score.window
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    s = q @ k.transpose(2, 3) * scale
    if score.softcap:
        s = score.softcap * torch.tanh(s / score.softcap)
    if score.alibi_slopes is not None:
        slopes = score.alibi_slopes.double().reshape(-1, q.shape[1])[:, :, None, None]
        s = s - slopes * (i - j).abs()
    s = s.masked_fill(~mask, -math.inf)
    if score.sinks is not None:
        sink = score.sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if score.sinks is not None:
        p = p[..., :-1]
    return p @ v, lse.masked_fill(lse == -math.inf, math.inf)


def _inputs(n_q, n_k, d, dtype, seed, layout="bhnd", device="cpu", spread=2.0):
    g = torch.Generator().manual_seed(seed)

    def rand(heads, n):
        t = (torch.randn(BATCH, n, heads, d, generator=g) * spread ** 0.5).to(device=device, dtype=dtype)
        return t.transpose(1, 2) if layout == "bnhd" else t.transpose(1, 2).contiguous()

    return rand(HEADS, n_q), rand(KV_HEADS, n_k), rand(KV_HEADS, n_k)


def _sample_variants():
    """One knob choice per (variant, lengths), seeded: the family's structural knobs across the cases."""
    rng = random.Random(38)
    space, device = load_space("triton_fwd"), gpu_fingerprint()
    cases = []
    for n, (name, (causal, _values)) in enumerate(VARIANTS.items()):
        for m, (n_q, n_k) in enumerate(LENGTHS):
            d = (32, 48, 64)[(n + m) % 3]
            problem = Shape(BATCH, HEADS, KV_HEADS, n_q, n_k, d, causal, "float16").problem
            cases.append((name, n_q, n_k, d, rng.choice(space.valid_variants(problem, device))))
    return cases


CASES = _sample_variants()
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name, n_q, n_k, d, variant", CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}" for c in CASES])
def test_variant_kernel_matches_the_float64_reference(name, n_q, n_k, d, variant, dtype):
    if dtype == "float16" and (n_q, n_k) not in LENGTHS[1:3]:
        pytest.skip("float16 on two of the lengths (interpreter time)")
    causal, values = VARIANTS[name]
    score = score_args(values, seed=n_q + n_k)
    q, k, v = _inputs(n_q, n_k, d, getattr(torch, dtype), seed=n_q * 7 + d, layout="bnhd" if n_q % 2 else "bhnd")
    offset = n_k - n_q  # bottom-right, as flash-attn
    scale = 0.8 / math.sqrt(d)
    kernel = codegen.load(variant, score=score.variant)
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:3], math.nan)
    kernel.forward(q, k, v, out, lse, scale, causal, offset, score_args=score)
    ref_out, ref_lse = reference(q, k, v, scale, causal, offset, score)
    assert not torch.isnan(out).any(), "unwritten (poisoned) output"
    assert rel_error(out, ref_out) <= TOLERANCE[dtype], variant.short()
    assert lse_error(lse, ref_lse) <= 1e-4, variant.short()


def test_every_structural_choice_meets_a_variant():
    seen = {knob: {c[4][knob] for c in CASES} for knob in ("MASK_MODE", "KV_ORDER", "HEAD_SPLIT", "BLOCK_N")}
    assert seen["MASK_MODE"] == {"split", "single_loop"} and seen["HEAD_SPLIT"] == {False, True}
    assert seen["KV_ORDER"] == {"ascending", "diagonal_first"} and len(seen["BLOCK_N"]) == 3


@pytest.mark.interpreter
@pytest.mark.parametrize("offset, window, poisoned", [
    (0, (4, 8), [(96, 300)]),  # top-left: the one tile's rows see keys <= 63 + 8: blocks from 96 never load
    (200, (4, 8), [(0, 192), (288, 300)]),  # both edges: keys of [196, 280] only, blocks [192, 288)
    (263, (16, 0), [(0, 224)]),  # causal bottom-right, gpt-oss-like: keys >= 247 - 0 only
])
def test_the_window_loop_visits_only_the_band(offset, window, poisoned):
    """Keys in blocks outside a tile's band are NaN: a loop that loaded them (even masked: 0 * NaN)
    would poison the output. Nq = 37 fits one 64-row tile; BLOCK_N 32."""
    space = load_space("triton_fwd")
    knobs = {k: c[0] for k, c in space.knobs.items()}
    variant = space.check_declared({**knobs, "BLOCK_M": 64, "BLOCK_N": 32, "LOADS": "pointer"})
    causal = window[1] == 0
    score = ScoreArgs(window)
    q, k, v = _inputs(37, 300, 32, torch.float32, seed=5)
    want, want_lse = reference(q, k, v, 0.2, causal, offset, score)
    for first, last in poisoned:
        k[:, :, first:last] = math.nan
        v[:, :, first:last] = math.nan
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    codegen.load(variant, score=score.variant).forward(q, k, v, out, lse, 0.2, causal, offset, score_args=score)
    assert not torch.isnan(out).any() and rel_error(out, want) <= 1e-5 and lse_error(lse, want_lse) <= 1e-5


# ----------------------------------------------------------------------------- plain kernels, keys, winners
# sha256[:16] of the rendered source of plain variants: a score-variant (or any other) template edit that
# changes a plain kernel's source shows here. Taken before the variants' hooks existed, renewed when the
# shared parts became device functions and again when the kernels' prologue did (sm90 PTX and the
# interpreter's outputs unchanged, docs/results/2026-12-07-family-prologue.md): the stored
# winners of plain problems name these kernels through the families' replaces.toml records.
PLAIN_RENDERINGS = [
    ("triton_fwd", {"BLOCK_M": 128, "BLOCK_N": 64, "GRID_ORDER": "m_major", "HEAD_SPLIT": False, "KV_ORDER": "ascending",
                    "LOADS": "tma", "MASK_MODE": "split", "WARP_SPECIALIZE": False, "num_stages": 3, "num_warps": 4},
     "edcec96fcc4af89b"),
    ("triton_fwd", {"BLOCK_M": 64, "BLOCK_N": 32, "GRID_ORDER": "heavy_first", "HEAD_SPLIT": True,
                    "KV_ORDER": "diagonal_first", "LOADS": "pointer", "MASK_MODE": "split", "WARP_SPECIALIZE": False,
                    "num_stages": 2, "num_warps": 4}, "95f803dd3c8cb789"),
    ("triton_fwd", {"BLOCK_M": 128, "BLOCK_N": 128, "GRID_ORDER": "bh_major", "HEAD_SPLIT": False, "KV_ORDER": "ascending",
                    "LOADS": "block_ptr", "MASK_MODE": "single_loop", "WARP_SPECIALIZE": False, "num_stages": 4,
                    "num_warps": 8}, "9e8f18130dd55ff4"),
    ("triton_fwd", {"BLOCK_M": 128, "BLOCK_N": 64, "GRID_ORDER": "m_major", "HEAD_SPLIT": False, "KV_ORDER": "ascending",
                    "LOADS": "tma", "MASK_MODE": "split", "WARP_SPECIALIZE": True, "num_stages": 3, "num_warps": 8},
     "c4b4bd505918ba75"),
    ("triton_bwd", {"BLOCK_M1": 64, "BLOCK_M2": 64, "BLOCK_N1": 64, "BLOCK_N2": 64, "DKDV_KERNEL": "triton",
                    "DQ_MODE": "separate", "DQ_OVERLAP": "serial", "GQA_SPLIT": 1, "GRID_ORDER": "kv_major",
                    "LOADS": "tma", "num_stages": 2, "num_warps": 4}, "344885555e2804fb"),
]


@pytest.mark.parametrize("family, knobs, digest", PLAIN_RENDERINGS, ids=lambda x: x if isinstance(x, str) else "")
def test_plain_kernels_render_byte_for_byte_as_before_the_variants(family, knobs, digest):
    variant = load_space(family).check_declared(knobs)
    assert hashlib.sha256(codegen.render(variant).encode()).hexdigest()[:16] == digest
    assert codegen.render(variant) == codegen.render(variant, score=PLAIN)
    assert codegen.variant_hash(variant, score=PLAIN) == hashlib.sha256(
        f"{codegen.template_hash(family)}:{variant.json()}".encode()).hexdigest()[:20]


def test_a_variant_kernel_has_its_own_source_file_and_hash():
    variant = Variant.of("triton_fwd", PLAIN_RENDERINGS[1][1])
    windowed = ScoreVariant(window=True, sinks=True)
    assert codegen.variant_hash(variant, score=windowed) != codegen.variant_hash(variant)
    assert "-window_sinks-" in codegen.source_path(variant, score=windowed).name
    assert "window_left" in codegen.render(variant, score=windowed)
    bwd = load_space("triton_bwd").check_declared(PLAIN_RENDERINGS[4][1])
    assert codegen.variant_hash(bwd, score=windowed) != codegen.variant_hash(bwd)
    assert "window_left" in codegen.render(bwd, score=windowed)
    decode = load_space("triton_decode").check_declared({k: c[0] for k, c in load_space("triton_decode").knobs.items()})
    assert "window_left" in codegen.render(decode, score=windowed)  # (the decode kernels compute them too)
    from autoflash import families

    assert not families.host_class("triton_decode").computes(ScoreVariant(score_mod="0123456789"))  # (no user mods)


def test_the_variants_are_part_of_the_problem_key_and_plain_keys_are_unchanged():
    plain = Problem("fwd", "float16", 64, True, 2, 1024, 1024, work=3)
    assert plain.key == "fwd/float16/d64/causal/g2/q1024/k1024/w3"
    windowed = dataclasses.replace(plain, score_variant="window+softcap")
    assert windowed.key == "fwd/float16/d64/causal/g2/q1024/k1024/w3/window+softcap"
    assert Problem.from_key(windowed.key) == windowed and Problem.from_key(plain.key) == plain
    assert Problem.from_key("fwd/float16/d64/full/g1/q64/k64/sinks").score_variant == "sinks"  # (no work bucket)
    assert Problem.from_key("bwd/float16/d64/causal/g1/q64/k64/window+sinks").score_variant == "window+sinks"
    for bad in ("fwd/float16/d64/causal/g1/q64/k64/softcap+window", "fwd/float16/d64/causal/g1/q64/k64/tanh",
                "decode/float16/d64/causal/g1/q64/k64/window", "fwd/float16/d64/causal/g1/q64/k64/window+window"):
        with pytest.raises(ValueError):
            Problem.from_key(bad)
    q, k = torch.empty(2, 4, 1000, 64, dtype=torch.float16), torch.empty(2, 2, 1000, 64, dtype=torch.float16)
    key = Dispatcher.problem_for(q, k, True, "fwd", 132).key
    assert key == "fwd/float16/d64/causal/g2/q1024/k1024/w-1"  # as before the variants
    assert Dispatcher.problem_for(q, k, True, "fwd", 132, ScoreVariant(window=True)).key == key + "/window"


def _db(path, rows):
    from autoflash.store import Store

    device = gpu_fingerprint()
    store = Store(path)
    store.add_gpu(device)
    for problem, variant in rows:
        store.set_winner(gpu_key=device.key, problem=problem, template_hash=codegen.template_hash("triton_fwd"),
                         variant_json=variant.json(), median_ms=1.0, spread=0.01, tflops=1.0, trials=5)
    store.close()
    return path


def test_winners_are_kept_and_served_per_variant(tmp_path):
    """A variant's winner serves that variant only (exact or nearest bucket), never another variant; a
    variant with no winner gets the plain problem's own winner rendered with it (the kernel measured
    fastest for the shape), where that is valid with the variant; without one, the family default."""
    device = gpu_fingerprint()
    plain = Problem("fwd", "float32", 64, True, 2, 1024, 1024)
    windowed = dataclasses.replace(plain, score_variant="window")
    valid = load_space("triton_fwd").valid_variants(plain, device)
    v_plain, v_window = valid[1], valid[5]
    db = _db(tmp_path / "w.db", [(plain, v_plain), (windowed, v_window)])
    table = WinnerTable(device, [db])
    assert table.lookup(plain) == (v_plain, "exact") and table.lookup(windowed) == (v_window, "exact")
    assert table.lookup(dataclasses.replace(windowed, seqlen_q=2048, seqlen_k=2048))[0] == v_window
    assert table.lookup(dataclasses.replace(plain, score_variant="softcap")) == (None, "default")
    dispatcher = Dispatcher([db])
    q, k = torch.empty(2, 4, 1000, 64), torch.empty(2, 2, 1000, 64)
    served = dispatcher.kernel_for(q, k, k, q, True, score=ScoreVariant(window=True))
    assert served.variant == v_window and served.score == ScoreVariant(window=True)
    assert dispatcher.kernel_for(q, k, k, q, True).variant == v_plain and dispatcher.kernel_for(q, k, k, q, True).score == PLAIN
    softcapped = dispatcher.kernel_for(q, k, k, q, True, score=ScoreVariant(softcap=True))
    assert softcapped.variant == v_plain and softcapped.score == ScoreVariant(softcap=True)
    assert dispatcher.choose(dataclasses.replace(plain, score_variant="softcap"), device, own_only=True)[1].startswith(
        "the plain problem's winner")
    # No plain winner either (another head dim): the default.
    q96, k96 = torch.empty(2, 4, 1000, 96), torch.empty(2, 2, 1000, 96)
    other = dispatcher.kernel_for(q96, k96, k96, q96, True, score=ScoreVariant(softcap=True))
    problem96 = dataclasses.replace(plain, head_dim=96)
    assert other.variant == load_space("triton_fwd").nearest_valid(
        load_space("triton_fwd").default_for(problem96, device), problem96, device)


def test_autoflash_render_shows_a_variant_kernel():
    from click.testing import CliRunner

    from autoflash.cli import cli

    r = CliRunner().invoke(cli, ["render", "--op", "fwd", "--causal", "--score", "window+softcap", "--variant",
                                 '{"LOADS": "pointer"}'], catch_exceptions=False)
    assert r.exit_code == 0 and "window_left, window_right," in r.output and "softcap_log2" in r.output
    compile(r.output, "<rendered>", "exec")
    r = CliRunner().invoke(cli, ["render", "--op", "bwd", "--score", "window+softcap", "--variant",
                                 '{"LOADS": "pointer", "DKDV_KERNEL": "triton"}'], catch_exceptions=False)
    assert r.exit_code == 0 and "window_left, window_right," in r.output and "softcap_t * softcap_t" in r.output
    compile(r.output, "<rendered>", "exec")
    r = CliRunner().invoke(cli, ["render", "--op", "fwd", "--score", "tanh"])
    assert r.exit_code != 0 and "score variant 'tanh'" in r.output


# ----------------------------------------------------------------------------- the public drop-ins
@pytest.fixture
def fresh():
    api.reset()
    yield
    api.reset()


def _flash(q, k, v, **kwargs):
    """flash_attn_func on (B, H, N, D) tensors (it takes (B, N, H, D)); (out, lse) as (B, H, N, D), (B, H, N)."""
    out, lse, _ = autoflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            return_attn_probs=True, **kwargs)
    return out.transpose(1, 2), lse


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["causal+window", "window", "softcap", "alibi per batch", "window+softcap (gemma-2)"])
def test_flash_attn_func_serves_forward_only_variants_on_the_kernel(name, strict, fresh):
    """Under AUTOFLASH_STRICT=1 a fallback is an error: these run on the kernel, and right."""
    causal, values = VARIANTS[name]
    score = score_args(values, seed=3)
    q, k, v = _inputs(37, 61, 32, torch.float32, seed=9)
    out, lse = _flash(q, k, v, softmax_scale=0.3, causal=causal, window_size=score.window, softcap=score.softcap,
                      alibi_slopes=score.alibi_slopes)
    ref_out, ref_lse = reference(q, k, v, 0.3, causal, 61 - 37, score)
    assert rel_error(out, ref_out) <= 1e-5 and lse_error(lse, ref_lse) <= 1e-5


@pytest.mark.interpreter
def test_dropout_the_kernels_do_not_take_with_a_variant_stays_in_torch(strict, fresh):
    # (0 < dropout_p < 1 with a window, softcap or ALiBi runs on the kernels: tests/test_dropout_kernels.py)
    q, k, v = _inputs(9, 9, 16, torch.float32, seed=2)
    with pytest.raises(FallbackError, match="softcap"):
        _flash(q.requires_grad_(), k, v, softcap=2.0, dropout_p=1.0)


@pytest.mark.interpreter
def test_flash_attn_varlen_func_serves_variants_in_one_launch(strict, fresh):
    lengths_q, lengths_k = [5, 1, 40], [7, 30, 40]
    cu_q = torch.tensor([0, 5, 6, 46], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 37, 77], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(46, 4, 16, generator=g), torch.randn(77, 2, 16, generator=g), torch.randn(77, 2, 16, generator=g)
    score = ScoreArgs((6, -1), 1.5, torch.rand(3, 4, generator=g))
    out, lse, _ = autoflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, 0.0, 0.35, True, score.window,
                                                   score.softcap, score.alibi_slopes, False, True)
    for b in range(3):
        a, z, c, e = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        seq = ScoreArgs(score.window, score.softcap, score.alibi_slopes[b])
        ref, ref_lse = reference(q[None, a:z].transpose(1, 2), k[None, c:e].transpose(1, 2), v[None, c:e].transpose(1, 2),
                                 0.35, True, int(e - c) - int(z - a), seq)
        assert rel_error(out[a:z], ref[0].transpose(0, 1)) <= 1e-5 and lse_error(lse[:, a:z], ref_lse[0]) <= 1e-5
    assert lengths_q and lengths_k


@pytest.mark.interpreter
def test_transformers_sinks_and_windows_run_on_the_kernel(strict, fresh):
    """gpt-oss's per-head sinks with its sliding window, no mask: the kernel (strict mode), right."""
    from autoflash.integrations.transformers import attention_forward

    class Layer(torch.nn.Module):
        is_causal = True

    q, k, v = _inputs(45, 45, 16, torch.float32, seed=6)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, _ = attention_forward(Layer(), q, k, v, None, scaling=0.4, sliding_window=8, s_aux=sinks)
    ref, _ = reference(q, k, v, 0.4, True, 0, ScoreArgs((7, -1), 0.0, None, sinks))
    assert rel_error(out.transpose(1, 2), ref) <= 1e-5


def test_transformers_window_mask_is_none_only_for_flash_attn_s_own_window():
    pytest.importorskip("transformers")
    from transformers import MistralConfig
    from transformers.masking_utils import sliding_window_causal_mask_function

    from autoflash.integrations.transformers import window_mask

    fn, config = sliding_window_causal_mask_function(8), MistralConfig(sliding_window=8)
    assert window_mask(2, 40, 40, mask_function=fn, local_size=8, config=config) is None  # prefill, no padding
    assert window_mask(2, 1, 40, q_offset=39, mask_function=fn, local_size=8, config=config) is None  # decoding
    padded = torch.ones(2, 40, dtype=torch.bool)
    padded[0, :3] = False
    assert window_mask(2, 40, 40, mask_function=fn, attention_mask=padded, local_size=8, config=config) is not None
    assert window_mask(2, 10, 40, q_offset=30, mask_function=fn, local_size=8, config=config) is not None
    # no config, or one whose window is another size: the layer's keyword may not match, the mask stays
    assert window_mask(2, 40, 40, mask_function=fn, local_size=8) is not None
    assert window_mask(2, 40, 40, mask_function=fn, local_size=8, config=MistralConfig(sliding_window=16)) is not None


def test_transformers_chunked_attention_mask_is_never_dropped():
    """Llama-4's chunked attention: on a decoding step at a chunk's last token the chunk's mask looks
    like a sliding window of `local_size` keys, but the layer passes no `sliding_window`: dropping the
    mask attended to every key of the cache (1.28 off SDPA with the mask)."""
    pytest.importorskip("transformers")
    from transformers import PretrainedConfig
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

    from autoflash.integrations.transformers import attention_forward, window_mask

    config = PretrainedConfig(attention_chunk_size=4)
    fn = chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    args = dict(q_offset=7, kv_offset=0, mask_function=fn, local_size=4)
    want_mask = sdpa_mask(batch_size=1, q_length=1, kv_length=8, **args)
    mask = window_mask(batch_size=1, q_length=1, kv_length=8, config=config, **args)
    assert mask is not None and torch.equal(mask, want_mask)

    class Layer(torch.nn.Module):
        is_causal = True

    q, k, v = (torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(n)) for n in (1, 8, 8))
    out, _ = attention_forward(Layer().eval(), q, k, v, mask, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=want_mask, scale=0.25)
    assert (out - want.transpose(1, 2)).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- the GPU compiler
@pytest.mark.parametrize("loads", ["pointer", "tma"])
def test_variant_kernels_compile_for_sm90(loads, tmp_path):
    """The interpreter cannot see a kernel the GPU compiler refuses: the variants' kernels compile for
    Hopper on any machine (every variant at once and window + sinks, causal, bf16 d128), in a clean
    child process (helpers.run_in_clean_process)."""
    from helpers import run_in_clean_process

    code = f"from tests.test_score_variants import compile_variants_for_sm90; compile_variants_for_sm90({loads!r})"
    done = run_in_clean_process(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["window+softcap+alibi+sinks", "window+sinks"]


def compile_variants_for_sm90(loads: str) -> None:
    """(Run by the test above in a clean process.) Capture each variant kernel's launch and compile it."""
    from helpers import capture_launches, compile_for_sm90

    space = load_space("triton_fwd")
    knobs = {**{k: c[0] for k, c in space.knobs.items()}, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8,
             "num_stages": 3, "LOADS": loads}
    q = torch.empty(2, 8, 333, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 517, 128, dtype=torch.bfloat16)
    for score in (ScoreArgs((63, -1), 30.0, torch.empty(2, 8), torch.empty(8)), ScoreArgs((63, -1), sinks=torch.empty(8))):
        kernel = codegen.load(space.check_declared(knobs), score=score.variant)
        launches = capture_launches([kernel.module._attn_fwd])
        kernel.host.launch(q=q, k=k, v=k, o=torch.empty_like(q), lse=torch.empty(2, 8, 333), sm_scale=0.1, causal=True,
                           causal_offset=184, compile_only=True, score_args=score)
        for jit, args, kwargs in launches:
            defaults = {p.name: p.default for p in jit.params if p.is_constexpr and p.has_default}  # (BLOCK_DA/DB)
            compile_for_sm90(jit, args, {**defaults, **kwargs})
        print(score.variant.key)


# ----------------------------------------------------------------------------- bf16 on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n_q, n_k", [(1023, 1023), (1023, 4111), (4111, 4111)])
@pytest.mark.parametrize("name", ["causal+window", "window", "window 0,0", "softcap", "alibi per head",
                                  "alibi per batch", "sinks", "window+softcap (gemma-2)", "window+sinks (gpt-oss)",
                                  "all four"])
def test_bf16_variants_on_the_gpu_against_float64(name, n_q, n_k, fresh):
    """The same variants in bfloat16 at larger ragged lengths, through the public drop-in: within 2x
    the error of the float32-score torch path (autoflash.eager) in bfloat16, and a bf16-sized bound."""
    from autoflash.eager import eager_attention

    causal, values = VARIANTS[name]
    values = {**values, "window": tuple(w * 16 if w > 0 else w for w in values.get("window", (-1, -1)))}
    score = score_args(values, seed=1, device="cuda")
    q, k, v = _inputs(n_q, n_k, 128, torch.bfloat16, seed=n_q, layout="bnhd", device="cuda", spread=1.0)
    out, lse = _flash(q, k, v, softmax_scale=128 ** -0.5, causal=causal, window_size=score.window,
                      softcap=score.softcap, alibi_slopes=score.alibi_slopes) if score.sinks is None else \
        _sinks_call(q, k, v, causal, score)
    ref_out, ref_lse = reference(q, k, v, 128 ** -0.5, causal, n_k - n_q, score)  # (float64 on the GPU)
    torch_out, _ = eager_attention(q, k, v, scale=128 ** -0.5, causal=causal, offset=n_k - n_q, window=score.window,
                                   softcap=score.softcap, alibi_slopes=score.alibi_slopes, sinks=score.sinks)
    err, torch_err = rel_error(out, ref_out), rel_error(torch_out, ref_out)
    assert err <= max(2 * torch_err, 1e-2), (err, torch_err)
    assert lse_error(lse, ref_lse) <= 2e-2


def _sinks_call(q, k, v, causal, score):
    """Sinks reach the kernel through the transformers integration's path (flash-attn has no sinks)."""
    from autoflash import variant_forward

    served, why = variant_forward.serve(q, k, v, 0.0, 128 ** -0.5, causal, k.shape[2] - q.shape[2], score, False)
    assert served is not None, why
    return served



def test_a_plain_winner_that_cannot_compute_the_variant_is_not_its_twin(tmp_path):
    """`plain_twin` passes over a plain winner whose family computes no such variant (a user's score_mod
    with a Gluon winner), one its variant rules reject (the ordered dQ under a window), and a vendor
    winner (SDPA computes no variant); a backward winner's Gluon dK/dV kernel becomes the Triton one."""
    from autoflash.families import host_class

    device = gpu_fingerprint()
    fwd = Problem("fwd", "float32", 64, True, 2, 1024, 1024)
    bwd = dataclasses.replace(fwd, op="bwd")

    def Table(variant):  # (a winner table whose lookup finds one plain winner)
        table = WinnerTable(device, [])
        table.lookup = lambda problem, own_only=False: (variant, "exact") if not problem.score_variant else (None, "default")
        return table

    gluon = load_space("gluon_sm90_fwd").default_for(fwd, device)
    assert not host_class("gluon_sm90_fwd").computes(ScoreVariant(score_mod="score-0123456789"))
    assert Table(gluon).plain_twin(dataclasses.replace(fwd, score_variant="score-0123456789")) is None
    bwd_space = load_space("triton_bwd")
    ordered = bwd_space.check_declared({**bwd_space.default_for(bwd, device).as_dict(), "DQ_MODE": "ordered"})
    assert Table(ordered).plain_twin(dataclasses.replace(bwd, score_variant="window")) is None
    vendor = load_space("sdpa_fwd").check_declared({"BACKEND": "flash"})
    assert Table(vendor).plain_twin(dataclasses.replace(fwd, score_variant="window")) is None
    gluon_dkdv = bwd_space.check_declared({**bwd_space.default_for(bwd, device).as_dict(), "DKDV_KERNEL": "gluon_sm90"})
    twin = Table(gluon_dkdv).plain_twin(dataclasses.replace(bwd, score_variant="softcap"))
    assert twin is not None and twin[0]["DKDV_KERNEL"] == "triton"
