"""Packed documents (`document_attention`): ids and cu_seqlens to offsets, and the output and gradients of
the packed kernels against a float64 dense-mask reference (ragged lengths 1, 37, 113; batch > 1; GQA;
windows and softcaps inside documents), one launch per call, and a differential against torch SDPA
given the equivalent boolean mask. Under the interpreter on tiny shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoflash
from autoflash import codegen
from autoflash.documents import Documents
from autoflash.reference import rel_error


def ids_of(lengths_per_row) -> torch.Tensor:
    """(batch, seqlen) ids: row b holds documents of the given lengths, numbered from 0 in each row."""
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths_per_row])


def dense_mask(ids, causal: bool, window=(-1, -1)) -> torch.Tensor:
    """(batch, seqlen, seqlen) bool: query i sees key j (FlexAttention's document mask_mod, materialized)."""
    n = ids.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = ids[:, :, None] == ids[:, None, :]
    if causal:
        mask = mask & (j <= i)
    if window[0] >= 0:
        mask = mask & (i - j <= window[0])
    if window[1] >= 0:
        mask = mask & (j - i <= window[1])
    return mask


def masked_reference(q, k, v, mask, scale, softcap=0.0, alibi=None):
    """float64 out (batch, seqlen, H, D) from the materialized mask, q, k, v (batch, seqlen, H, D);
    alibi: (batch, H) slopes (distances inside a document are distances in the row)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        n = q.shape[2]
        s = s - alibi.double()[:, :, None, None] * (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def inputs(batch, seqlen, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, hq, d, generator=g)
    k, v = (torch.randn(batch, seqlen, hkv, d, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)], torch.randn(batch, seqlen, hq, d, generator=g)


def test_ids_become_offsets_with_each_row_end_a_document_end():
    ids = torch.tensor([[7, 7, 7, 2, 2, 9], [9, 9, 9, 9, 9, 9], [0, 1, 2, 3, 3, 3]])
    docs = Documents.from_ids(ids)
    assert docs.offsets == (0, 3, 5, 6, 12, 13, 14, 15, 18)  # the same id across rows: two documents
    assert docs.cu_seqlens.dtype == torch.int32 and docs.cu_seqlens.tolist() == list(docs.offsets)
    assert docs.rows.tolist() == [0, 0, 0, 1, 2, 2, 2, 2] and docs.max_seqlen == 6


def test_cu_seqlens_lose_empty_documents():
    docs = Documents.from_cu_seqlens(torch.tensor([0, 3, 3, 5, 9, 10], dtype=torch.int32), 2, 5)
    assert docs.offsets == (0, 3, 5, 9, 10) and docs.rows.tolist() == [0, 0, 1, 1]


def test_cu_seqlens_with_a_document_across_rows_are_refused():
    """flash_attn_varlen_func on the same offsets attends across the row end; splitting the document
    there would give another answer without a word."""
    with pytest.raises(ValueError, match="crosses the end of row 0"):
        Documents.from_cu_seqlens(torch.tensor([0, 3, 9, 10], dtype=torch.int32), 2, 5)


@pytest.mark.parametrize("bad", [torch.tensor([[0, 0, 1, 0]]), torch.zeros(4, dtype=torch.int64),
                                 torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.bool)])
def test_ids_that_are_not_contiguous_runs_of_integers_are_refused(bad):
    with pytest.raises(ValueError, match="document_ids"):
        Documents.from_ids(bad)


@pytest.mark.parametrize("cu, batch, seqlen", [([1, 4], 1, 4), ([0, 3], 1, 4), ([0, 3, 2, 4], 1, 4)])
def test_cu_seqlens_that_do_not_cover_the_batch_are_refused(cu, batch, seqlen):
    with pytest.raises(ValueError, match="cu_seqlens"):
        Documents.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32), batch, seqlen)


def test_documents_of_another_batch_shape_are_refused():
    (q, k, v), _ = inputs(1, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="documents describe"):
        autoflash.document_attention(q, k, v, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="same seqlen"):
        autoflash.document_attention(q, k[:, :4], v[:, :4], torch.zeros(1, 8, dtype=torch.int64))


CASES = [  # (document lengths per row, heads_q, heads_kv, head dim, causal, window, softcap, ALiBi)
    (((1, 37, 113),), 2, 1, 16, True, (-1, -1), 0.0, False),
    (((113, 1, 37),), 2, 2, 16, False, (-1, -1), 0.0, False),
    (((37, 1, 20, 5), (5, 58)), 4, 2, 16, True, (8, 0), 0.0, False),  # batch 2, a window inside documents
    (((30, 1, 32), (63,)), 2, 1, 32, False, (-1, -1), 2.0, False),  # batch 2, a softcap
    (((30, 1, 32), (40, 23)), 2, 2, 16, True, (-1, -1), 0.0, True),  # batch 2, ALiBi slopes per row
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=["causal-1-37-113", "full-113-1-37", "batch2-window", "batch2-softcap",
                                         "batch2-alibi"])
def test_documents_match_a_float64_dense_mask_forward_and_backward(case):
    lengths, hq, hkv, d, causal, window, softcap, alibi = case
    ids = ids_of(lengths)
    (q, k, v), grad = inputs(ids.shape[0], ids.shape[1], hq, hkv, d, seed=len(lengths[0]))
    scale = 0.6 / d ** 0.5
    slopes = torch.rand(ids.shape[0], hq, generator=torch.Generator().manual_seed(5)) if alibi else None
    out = autoflash.document_attention(q, k, v, ids, causal=causal, softmax_scale=scale, window_size=window,
                                       softcap=softcap, alibi_slopes=slopes)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = masked_reference(q, k, v, dense_mask(ids, causal, window), scale, softcap, slopes)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    assert rel_error(out.detach(), ref.detach()) <= 1e-5
    for mine, theirs in zip(got, want):
        assert rel_error(mine, theirs) <= 1e-5


@pytest.mark.interpreter
def test_a_batch_of_documents_is_one_packed_launch_and_documents_can_be_reused():
    ids = ids_of([(1, 37, 22), (40, 20)])
    (q, k, v), _ = inputs(2, 60, 2, 2, 16, seed=3)
    launched = []
    original = codegen.Kernel.forward_varlen

    def spy(self, *args, **kwargs):
        launched.append(args[5].tolist())  # (cu_seqlens_q)
        return original(self, *args, **kwargs)

    codegen.Kernel.forward_varlen = spy
    try:
        with torch.no_grad():
            by_ids = autoflash.document_attention(q, k, v, ids)
            by_docs = autoflash.document_attention(q, k, v, Documents.from_ids(ids))
    finally:
        codegen.Kernel.forward_varlen = original
    assert launched == [[0, 1, 38, 60, 100, 120]] * 2
    assert torch.equal(by_ids, by_docs)


@st.composite
def packings(draw):
    batch = draw(st.integers(1, 2))
    seqlen = draw(st.integers(1, 40))
    rows = []
    for _ in range(batch):
        cuts = sorted(draw(st.sets(st.integers(1, seqlen - 1), max_size=4))) if seqlen > 1 else []
        bounds = [0, *cuts, seqlen]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    hkv = draw(st.sampled_from([1, 2]))
    return rows, hkv * draw(st.sampled_from([1, 2])), hkv, draw(st.booleans()), draw(st.integers(0, 2**16))


@pytest.mark.interpreter
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packings())
def test_documents_agree_with_torch_sdpa_given_the_boolean_mask(packing):
    lengths, hq, hkv, causal, seed = packing
    ids = ids_of(lengths)
    (q, k, v), grad = inputs(ids.shape[0], ids.shape[1], hq, hkv, 16, seed=seed)
    out = autoflash.document_attention(q, k, v, ids, causal=causal)
    mask = dense_mask(ids, causal)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert rel_error(out.detach(), ref.detach()) <= 1e-5
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        # (absolute too: a one-token document's dq is 0, torch's is rounding noise around it)
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_bf16_documents_on_ragged_lengths_against_float64(causal, strict):
    """bfloat16 on the GPU (the interpreter cannot see miscompiles): two rows of ragged documents,
    GQA, forward and gradients within bf16's reach of the float64 dense-mask reference, on the kernels
    (AUTOFLASH_STRICT: no fallback)."""
    ids = ids_of([(1, 37, 113, 1023, 4111), (4111, 1174)]).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, ids.shape[1], 8, 128, generator=g, device="cuda").bfloat16().requires_grad_()
    k, v = (torch.randn(2, ids.shape[1], 2, 128, generator=g, device="cuda").bfloat16().requires_grad_()
            for _ in range(2))
    grad = torch.randn(q.shape, generator=g, device="cuda").bfloat16()
    out = autoflash.document_attention(q, k, v, ids, causal=causal)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = masked_reference(q, k, v, dense_mask(ids.cpu(), causal).cuda(), 128 ** -0.5)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    assert rel_error(out.detach(), ref.detach()) <= 2e-2
    for mine, theirs in zip(got, want):
        assert rel_error(mine, theirs) <= 2e-2
