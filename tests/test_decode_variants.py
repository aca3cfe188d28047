"""The decode kernels with the attention variants rendered in (sliding window, softcap, ALiBi, sinks):
`flash_attn_with_kvcache(window_size=, softcap=, alibi_slopes=)` and the kernels' own sinks, against
float64 on ragged cache lengths, contiguous and paged caches, one split and several (a window's splits
share only the keys its rows see; a sink is counted by the first split alone). CPU: the interpreter."""

from __future__ import annotations

import warnings

import pytest
import torch

from autoflash import decode_kernels
from autoflash.decode import flash_attn_with_kvcache
from autoflash.eager import eager_attention
from autoflash.fallback import FallbackWarning
from autoflash.score_variant import ScoreArgs
from test_decode import make_problem

LENGTHS = (0, 1, 23, 61, 40)
HEAD_DIM, CAPACITY = 32, 64


def reference(q, keys, values, lengths, causal, window=(-1, -1), softcap=0.0, alibi=None, sinks=None):
    """float64 (out (B, Q, H, D), lse (B, H, Q)), one sequence at a time through the eager variants."""
    outs, lses = [], []
    for b, n in enumerate(lengths):
        k = keys[b][:n].double().transpose(0, 1)[None]
        v = values[b][:n].double().transpose(0, 1)[None]
        slopes = None if alibi is None else (alibi[b:b + 1] if alibi.dim() == 2 else alibi).double()
        out, lse = eager_attention(q[b:b + 1].double().transpose(1, 2), k, v, scale=q.shape[-1] ** -0.5, causal=causal,
                                   offset=n - q.shape[1], window=window, softcap=softcap, alibi_slopes=slopes,
                                   sinks=None if sinks is None else sinks.double())
        outs.append(out.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def close(out, lse, ref_out, ref_lse, dtype):
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    assert not out.isnan().any()
    err = (out.double() - ref_out).norm().item() / max(ref_out.norm().item(), 1e-12)
    assert err < tol, err
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3


CASES = [  # (q_len, heads, kv_heads, layout, num_splits, causal, dtype, variants)
    (1, 4, 1, "contiguous", 1, False, torch.float32, {"window_size": (7, 0)}),
    (1, 4, 1, "contiguous", 3, True, torch.float32, {"window_size": (20, 0)}),
    (3, 4, 2, 16, 4, True, torch.float16, {"window_size": (9, 0), "softcap": 2.0}),
    (3, 2, 2, "contiguous", 2, False, torch.float32, {"window_size": (11, 3)}),
    (1, 4, 2, 16, 8, False, torch.float32, {"softcap": 1.5}),
    (2, 4, 1, 32, 0, True, torch.float32, {"alibi_slopes": "per_head"}),
    (1, 4, 4, "contiguous", 5, False, torch.float16, {"alibi_slopes": "per_batch", "window_size": (30, 2)}),
    (4, 4, 1, 16, 2, True, torch.float32, {"alibi_slopes": "per_head", "softcap": 3.0, "window_size": (13, 0)}),
]


def _values(variants, batch, heads, g):
    values = dict(variants)
    if values.get("alibi_slopes") == "per_head":
        values["alibi_slopes"] = torch.rand(heads, generator=g) * 0.5
    elif values.get("alibi_slopes") == "per_batch":
        values["alibi_slopes"] = torch.rand(batch, heads, generator=g) * 0.5
    return values


@pytest.mark.interpreter
@pytest.mark.parametrize("q_len,heads,kv_heads,layout,num_splits,causal,dtype,variants", CASES)
def test_flash_attn_with_kvcache_serves_the_variants_on_the_decode_kernels(q_len, heads, kv_heads, layout, num_splits,
                                                                          causal, dtype, variants):
    q, kc, vc, seqlens, table, keys, values = make_problem(LENGTHS, q_len, heads, kv_heads, HEAD_DIM, CAPACITY,
                                                           layout, dtype, seed=7)
    args = _values(variants, len(LENGTHS), heads, torch.Generator().manual_seed(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # the kernels, not torch
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=causal,
                                           num_splits=num_splits, return_softmax_lse=True, **args)
    ref_out, ref_lse = reference(q, keys, values, LENGTHS, causal, window=args.get("window_size", (-1, -1)),
                                 softcap=args.get("softcap", 0.0), alibi=args.get("alibi_slopes"))
    close(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits, layout, window", [(1, "contiguous", (-1, -1)), (4, "contiguous", (-1, -1)),
                                                        (3, 16, (10, 0)), (6, 32, (-1, -1))])
def test_sinks_are_counted_once_whatever_the_splits(num_splits, layout, window):
    """gpt-oss's sinks: one more logit per head in each row's softmax. With several splits only the
    first counts it (the combine would count it once per split otherwise); an empty cache gives out = 0
    and lse = sink."""
    heads, kv_heads, q_len = 4, 2, 2
    q, kc, vc, seqlens, table, keys, values = make_problem(LENGTHS, q_len, heads, kv_heads, HEAD_DIM, CAPACITY,
                                                           layout, torch.float32, seed=9)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(10)) * 2
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[0], heads, q_len), dtype=torch.float32)
    decode_kernels.launch(q, kc, vc, out, lse, HEAD_DIM ** -0.5, True, seqlens, table, num_splits, None,
                          ScoreArgs(window=window, sinks=sinks))
    ref_out, ref_lse = reference(q, keys, values, LENGTHS, True, window=window, sinks=sinks[None, :, None, None])
    close(out[1:], lse[1:], ref_out[1:], ref_lse[1:], torch.float32)
    # (the empty cache, as the forward kernels: no key seen, the sink alone in the denominator)
    assert (out[0] == 0).all() and torch.allclose(lse[0], sinks[:, None].expand(heads, q_len))


@pytest.mark.interpreter
def test_a_window_splits_only_the_keys_its_rows_see(monkeypatch):
    """A window of 8 keys at the end of a 4096-key cache: the split heuristic counts the keys the rows
    see, not the cache's capacity (the kernel's splits then share those), and the answer is the same."""
    from autoflash.families.triton_decode import host

    asked = []
    real = host.num_splits_for
    monkeypatch.setattr(host, "num_splits_for", lambda *a, **kw: asked.append(a[5]) or real(*a, **kw))
    q, kc, vc, seqlens, table, keys, values = make_problem((4096,), 1, 2, 1, HEAD_DIM, 4096, "contiguous",
                                                           torch.float32, seed=11)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, window_size=(8, 0),
                                       return_softmax_lse=True)
    assert asked and max(asked) < 4096 // 8
    close(out, lse, *reference(q, keys, values, (4096,), True, window=(8, 0)), torch.float32)


def test_a_plain_decode_kernel_renders_no_variant_code():
    """The variants' hooks render nothing into a plain kernel: its source is what the shipped winners
    were measured with."""
    from autoflash.device import gpu_fingerprint
    from autoflash.rendering import render
    from autoflash.score_variant import ScoreVariant
    from autoflash.space import load_space

    problem = decode_kernels.decode_problem(torch.float16, 64, 1, 1, 4, 1, 4096, True, 132)
    variant = load_space("decode").valid_variants(problem, gpu_fingerprint())[0]
    plain = render(variant)
    for name in ("window_left", "softcap", "ALIBI", "SINKS", "key_lo"):
        assert name not in plain
    scored = render(variant, score=ScoreVariant(window=True, softcap=True, alibi=True, sinks=True))
    assert all(name in scored for name in ("window_left", "softcap_in", "alibi_log2", "SINKS", "key_lo"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", 16, 256])
@pytest.mark.parametrize("variants", [{"window_size": (4096, 0), "softcap": 50.0}, {"alibi_slopes": "per_head"},
                                      {"window_size": (127, 0), "sinks": True}])
def test_the_variants_on_the_gpu_in_bf16(layout, variants):
    """Gemma-2's (window 4096 + softcap 50), BLOOM's (ALiBi) and gpt-oss's (sinks + window 128) decoding
    steps in bf16 on ragged 8k caches, GQA 32/8, d128, against float64."""
    lengths = (8192, 1, 5000, 4097)
    q, kc, vc, seqlens, table, keys, values = make_problem(lengths, 1, 32, 8, 128, 8192, layout, torch.bfloat16,
                                                           seed=12)
    q, kc, vc, seqlens = (t.cuda() for t in (q, kc, vc, seqlens))
    table = table.cuda() if table is not None else None
    g = torch.Generator().manual_seed(13)
    sinks = torch.randn(32, generator=g).cuda() if variants.get("sinks") else None
    args = _values({k: v for k, v in variants.items() if k != "sinks"}, len(lengths), 32, g)
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = torch.empty_like(q)
    lse = torch.empty((len(lengths), 32, 1), device="cuda", dtype=torch.float32)
    score = ScoreArgs(window=args.get("window_size", (-1, -1)), softcap=args.get("softcap", 0.0),
                      alibi_slopes=args.get("alibi_slopes"), sinks=sinks)
    decode_kernels.launch(q, kc, vc, out, lse, 128 ** -0.5, True, seqlens, table, 0, None, score)
    ref_out, ref_lse = reference(q.cpu(), keys, values, lengths, True, window=score.window, softcap=score.softcap,
                                 alibi=None if score.alibi_slopes is None else score.alibi_slopes.cpu(),
                                 sinks=None if sinks is None else sinks.cpu()[None, :, None, None])
    close(out.cpu(), lse.cpu(), ref_out, ref_lse, torch.bfloat16)


@pytest.mark.interpreter
@pytest.mark.parametrize("n_q, causal, variants", [
    (1, True, {"window_size": (7, 0)}), (3, True, {"softcap": 2.0, "window_size": (5, 0)}),
    (2, True, {"alibi_slopes": "per_head"}), (1, True, {"sinks": True, "window_size": (9, 0)}),
    (4, False, {"window_size": (6, 2), "alibi_slopes": "per_batch"}),
    (2, False, {"sinks": True, "softcap": 3.0, "alibi_slopes": "per_head"})])
def test_decoding_steps_with_variants_run_the_decode_kernels(monkeypatch, n_q, causal, variants):
    """A model's decoding step with a window, softcap, ALiBi or sinks (the drop-ins and the transformers
    integration reach `variant_forward.serve`): a few queries at the end of the keys go to the decode
    kernels (all query heads of a KV head in one tile), not the forward kernel, with the same answer."""
    from autoflash import variant_forward

    launched = []
    real = decode_kernels.launch
    monkeypatch.setattr(decode_kernels, "launch", lambda *a, **kw: launched.append(a[-1]) or real(*a, **kw))
    g = torch.Generator().manual_seed(14)
    n_k, heads, kv_heads = 45, 4, 2
    q = torch.randn(2, heads, n_q, HEAD_DIM, generator=g)
    k, v = (torch.randn(2, kv_heads, n_k, HEAD_DIM, generator=g) for _ in range(2))
    values = _values({k_: v_ for k_, v_ in variants.items() if k_ != "sinks"}, 2, heads, g)
    sinks = torch.randn(heads, generator=g) if variants.get("sinks") else None
    score = ScoreArgs(window=values.get("window_size", (-1, -1)), softcap=values.get("softcap", 0.0),
                      alibi_slopes=values.get("alibi_slopes"), sinks=sinks)
    (out, lse), why = variant_forward.serve(q, k, v, 0.0, None, causal, n_k - n_q, score, training=False)
    assert why is None and len(launched) == 1 and launched[0] is score
    ref_out, ref_lse = eager_attention(q.double(), k.double(), v.double(), scale=HEAD_DIM ** -0.5, causal=causal,
                                       offset=n_k - n_q, window=score.window, softcap=score.softcap,
                                       alibi_slopes=None if score.alibi_slopes is None else score.alibi_slopes.double(),
                                       sinks=None if sinks is None else sinks.double()[None, :, None, None])
    close(out.transpose(1, 2), lse, ref_out.transpose(1, 2), ref_lse, torch.float32)


@pytest.mark.interpreter
def test_a_softcap_outside_float32s_range_goes_to_torch_with_a_warning():
    """The kernels hold softcap and scale/softcap as float32 constants: a softcap they cannot hold is
    computed in torch (one FallbackWarning), never on the kernels with wrong scores."""
    q, kc, vc, seqlens, table, keys, values = make_problem((16, 5), 1, 2, 1, HEAD_DIM, 16, "contiguous",
                                                           torch.float32, seed=15)
    with pytest.warns(FallbackWarning, match="softcap"):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, softcap=1e-39, return_softmax_lse=True)
    close(out, lse, *reference(q, keys, values, (16, 5), False, softcap=1e-39), torch.float32)


@pytest.mark.interpreter
def test_per_batch_alibi_slopes_follow_their_batch_chunks(monkeypatch):
    """A batch past the grid's axis decodes in chunks: per-(batch, head) slopes go with their chunk."""
    from autoflash import codegen

    monkeypatch.setattr(codegen, "GRID_AXIS_MAX", 4)  # (two KV heads: two sequences per launch)
    lengths = (9, 30, 0, 17, 44)
    q, kc, vc, seqlens, table, keys, values = make_problem(lengths, 2, 4, 2, HEAD_DIM, 48, "contiguous",
                                                           torch.float32, seed=16)
    slopes = torch.rand(len(lengths), 4, generator=torch.Generator().manual_seed(17))
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, alibi_slopes=slopes,
                                       window_size=(12, 0), num_splits=3, return_softmax_lse=True)
    close(out, lse, *reference(q, keys, values, lengths, True, window=(12, 0), alibi=slopes), torch.float32)
