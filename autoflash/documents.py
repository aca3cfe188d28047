"""`document_attention`: packed documents (a causal or full mask within each document) on the varlen kernels.

A training batch often packs several documents into each row, and a token may see only the tokens of
its own document. As a dense mask that is a (seqlen x seqlen) tensor which sends torch SDPA off its
fast kernels to one that reads the whole mask; FlexAttention writes it as a mask_mod,
`document_id[b, q_idx] == document_id[b, kv_idx]` (with `q_idx >= kv_idx` when causal), and builds a
block mask from it. Here the documents become cu_seqlens and the batch goes through
`flash_attn_varlen_func`'s packed kernels: one launch per kernel, no mask in memory, and no tile that
spans two documents is ever computed.

`Documents` holds the offsets (on the device, and on the host for the grid): build it once per batch
and pass it to every layer, so the one host sync of the conversion is not paid per call.
"""

from __future__ import annotations

import dataclasses

import torch

from autoflash.validate import (check_alibi, check_flag, check_heads, check_numbers, check_tensors,
                                deterministic_backward, needs_autograd)
from autoflash.varlen import _extras, _varlen

LAYOUT = "(batch, seqlen, heads, head_dim)"


@dataclasses.dataclass(frozen=True, eq=False)
class Documents:
    """Where the documents of a packed (batch, seqlen) batch start and end.

    cu_seqlens: int32 (num_documents + 1,), offsets into the batch's batch * seqlen tokens taken row by
    row (flash-attn's cu_seqlens over the flattened batch); offsets: the same on the host; rows: int64
    (num_documents,), the batch row of each document (for per-row ALiBi slopes)."""

    cu_seqlens: torch.Tensor
    offsets: tuple[int, ...]
    rows: torch.Tensor
    batch: int
    seqlen: int

    @property
    def max_seqlen(self) -> int:
        return max((b - a for a, b in zip(self.offsets, self.offsets[1:])), default=0)

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    @classmethod
    def from_ids(cls, document_ids: torch.Tensor) -> "Documents":
        """From a (batch, seqlen) integer tensor: each run of equal ids in a row is one document.

        An id that comes back in the same row after another id (e.g. 0 0 1 0) is a ValueError: a dense
        mask `ids[q] == ids[kv]` would join the two pieces into one document, packed kernels cannot."""
        if (not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2
                or document_ids.dtype.is_floating_point or document_ids.dtype.is_complex
                or document_ids.dtype == torch.bool):
            what = (f"{document_ids.dtype} {tuple(document_ids.shape)}" if isinstance(document_ids, torch.Tensor)
                    else type(document_ids).__name__)
            raise ValueError(f"document_ids must be an integer tensor (batch, seqlen), got {what}")
        batch, seqlen = document_ids.shape
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # (each row's first token starts one too)
        first = starts.flatten().nonzero().squeeze(1)  # flattened position of each document's first token
        rows = first // max(seqlen, 1)
        pairs = torch.stack([rows, document_ids.flatten()[first].long()])
        if first.numel() and torch.unique(pairs, dim=1).shape[1] != first.numel():
            raise ValueError("document_ids: an id appears in two separate runs of one row; each document must "
                             "be one contiguous run of tokens (give the pieces different ids)")
        end = torch.tensor([batch * seqlen], device=first.device, dtype=first.dtype)
        cu = torch.cat([first, end]).to(torch.int32)
        return cls(cu, tuple(cu.tolist()), rows, batch, seqlen)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> "Documents":
        """From flash-attn's cu_seqlens over the flattened (batch * seqlen) tokens. A document never
        crosses a row: every row end must be one of the offsets (a document spanning two rows is
        refused: splitting it would answer differently from flash_attn_varlen_func on the same
        offsets)."""
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
            raise ValueError("cu_seqlens must be an int32 tensor (num_documents + 1,)")
        for name, n in (("batch", batch), ("seqlen", seqlen)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        values = cu_seqlens.tolist()
        total = batch * seqlen
        if not values or values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to batch * seqlen = {total}, "
                             f"got {values[:6]}{'...' if len(values) > 6 else ''}")
        listed = set(values)
        crossing = [r for r in range(seqlen, total, seqlen) if r not in listed] if seqlen else []
        if crossing:
            raise ValueError(f"a document crosses the end of row {crossing[0] // seqlen - 1} (offset {crossing[0]} "
                             f"is not in cu_seqlens): each row's tokens end a document; for documents spanning "
                             f"rows use flash_attn_varlen_func on the flattened tokens")
        # (a zero-length document is no document: equal offsets collapse)
        offsets = sorted(listed) if seqlen else [0]
        device = cu_seqlens.device
        rows = torch.tensor([a // seqlen for a in offsets[:-1]], device=device, dtype=torch.int64)
        return cls(torch.tensor(offsets, device=device, dtype=torch.int32), tuple(offsets), rows, batch, seqlen)


def document_attention(q, k, v, documents, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, deterministic=False):
    """Attention within each packed document, on the packed (varlen) kernels: one launch, no dense mask.

    Args:
        q: (batch, seqlen, nheads, headdim)
        k, v: (batch, seqlen, nheads_k, headdim); nheads_k divides nheads (MQA/GQA)
        documents: a (batch, seqlen) integer tensor of document ids (each run of one id in a row is a
            document; converted with one host sync per call), or a `Documents` built once per batch
            (`Documents.from_ids`, `Documents.from_cu_seqlens`) and passed to every layer
        causal: a token sees the earlier tokens of its document (True) or all of its document (False)
        softmax_scale: default 1/sqrt(headdim)
        window_size: (left, right), flash-attn's sliding window inside each document, -1 unbounded
        softcap: > 0 caps the scaled scores as softcap * tanh(s / softcap)
        alibi_slopes: (nheads,) or (batch, nheads) float32: adds -slope * |i - j| (positions in the document)
        deterministic: a bitwise repeatable backward
    Returns:
        out: (batch, seqlen, nheads, headdim), differentiable in q, k and v.

    The same as a dense mask `ids[b, i] == ids[b, j]` (and `j <= i` when causal) given to torch SDPA,
    FlexAttention's document mask. What the packed kernels do not take runs document by document
    through `flash_attn_func`'s fallbacks, with their warnings (`AUTOFLASH_STRICT=1`: an error).
    """
    check_tensors(q, k, v, ("q", "k", "v"), LAYOUT)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q and k must have the same seqlen (documents are packed alike), got {q.shape[1]} "
                         f"and {k.shape[1]}")
    check_heads(q.shape[2], k.shape[2], True, "q", "k")
    if not isinstance(documents, Documents):
        documents = Documents.from_ids(documents)
    batch, seqlen = q.shape[:2]
    if (documents.batch, documents.seqlen) != (batch, seqlen):
        raise ValueError(f"documents describe a ({documents.batch}, {documents.seqlen}) batch, q is "
                         f"({batch}, {seqlen}) {LAYOUT}")
    if documents.cu_seqlens.device != q.device:
        raise ValueError(f"documents must be on q's device {q.device}, got {documents.cu_seqlens.device}")
    causal = check_flag("causal", causal)
    check_numbers(0.0, softmax_scale, "softmax_scale")
    check_alibi(alibi_slopes, batch, q.shape[2], q.device)
    if alibi_slopes is not None and alibi_slopes.dim() == 2:  # (batch, H) -> one row per document
        alibi_slopes = alibi_slopes.index_select(0, documents.rows)
    # (batch, seqlen, H, D) -> (batch * seqlen, H, D): a view of contiguous rows, else a copy in the graph
    packed = [t.reshape(batch * seqlen, *t.shape[2:]) for t in (q, k, v)]
    offsets = list(documents.offsets)
    deterministic = deterministic_backward(check_flag("deterministic", deterministic)) and needs_autograd(q, k, v)
    extras = _extras(packed[0], offsets, 0.0, window_size, softcap, alibi_slopes)
    cu = documents.cu_seqlens
    out, _ = _varlen(*packed, cu, cu, offsets, offsets, softmax_scale, causal, extras, False, deterministic)
    return out.view(batch, seqlen, *out.shape[1:])
