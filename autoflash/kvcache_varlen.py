"""FlashAttention-3's packed forms of flash_attn_with_kvcache: cu_seqlens_q / max_seqlen_q (q packed,
(total_q, nheads, headdim)), cu_seqlens_k_new (k, v packed, (total_new, nheads_k, headdim)) and
rotary_seqlens (the rotary position of each entry's first new token, in place of cache_seqlens).

Entry b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q, its new keys rows
cu_seqlens_k_new[b] .. of k, v, appended at cache_seqlens[b]; causal and windows align bottom-right
per entry (query i of L_b sees keys j <= i + seqlen_k[b] - L_b), as FA3's kernel does.

Served on the host, then by the flash-attn 2 form (`autoflash.decode`): rotate and append the packed
new tokens here, then run the decode kernels on q padded to (batch, max_seqlen_q): each entry's
queries right-aligned in its padded block, so the bottom-right alignment of the padded block is
that of the entry (padded rows are computed and dropped). Reading cu_seqlens costs a host sync.
"""

from __future__ import annotations

import numbers

import torch

from autoflash import decode, kvcache_args
from autoflash.decode_validate import _check_values, _index_tensor, validate_kvcache
from autoflash.validate import check_window


def _offsets(cu, name: str, total: int, device) -> list[int]:
    _index_tensor(cu, name, 1, "(batch_size + 1,)", device)
    values = cu.tolist()
    if not values or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] != total:
        raise ValueError(f"{name} must go from 0 to the total tokens ({total}), non-decreasing, got {values[:8]}")
    return values


def _int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def packed_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                   cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_seqlens,
                   softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits, return_lse):
    """FA3's flash_attn_with_kvcache with any of cu_seqlens_q, cu_seqlens_k_new, rotary_seqlens:
    out shaped as q, and with return_lse the log-sum-exp, (nheads, total_q) for packed q, else
    (batch_size, nheads, seqlen_q) (+inf where no key: the caller turns it into FA3's -inf)."""
    for t, name in ((q, "q"), (k_cache, "k_cache")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = q.device
    # ---- q as packed rows with offsets (a q with a batch dim: even offsets)
    if cu_seqlens_q is not None:
        if q.dim() != 3:
            raise ValueError(f"with cu_seqlens_q, q must be (total_q, nheads, headdim), got {tuple(q.shape)}")
        q_cu = _offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0], device)
        longest = max((b - a for a, b in zip(q_cu, q_cu[1:])), default=0)
        if not _int(max_seqlen_q) or max_seqlen_q < longest:
            raise ValueError(f"max_seqlen_q must be an int >= the longest query sequence ({longest}) with "
                             f"cu_seqlens_q, got {max_seqlen_q!r}")
        q_rows = q
    else:
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"q must be (batch_size, seqlen_q, nheads, headdim) without cu_seqlens_q, got "
                             f"{tuple(q.shape)}")
        if max_seqlen_q is not None and not (_int(max_seqlen_q) and max_seqlen_q >= q.shape[1]):
            raise ValueError(f"max_seqlen_q must be None or an int >= seqlen_q ({q.shape[1]}), got {max_seqlen_q!r}")
        q_cu = [b * q.shape[1] for b in range(q.shape[0] + 1)]
        longest, q_rows = q.shape[1], q.flatten(0, 1)
    batch = len(q_cu) - 1
    q_lens = [b - a for a, b in zip(q_cu, q_cu[1:])]
    # ---- the new tokens as packed rows with offsets
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append), or neither")
    if cu_seqlens_k_new is not None:
        if k is None or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
            raise ValueError("with cu_seqlens_k_new, k and v must be (total_new, nheads_k, headdim)")
        new_cu = _offsets(cu_seqlens_k_new, "cu_seqlens_k_new", k.shape[0], device)
        if len(new_cu) != len(q_cu):
            raise ValueError(f"cu_seqlens_k_new must have batch_size + 1 = {batch + 1} entries, got {len(new_cu)}")
        k_rows, v_rows = k, v
    elif k is not None:
        if k.dim() != 4 or k.shape[0] != batch or k.shape[:2] != v.shape[:2]:
            raise ValueError(f"k and v must be (batch_size = {batch}, seqlen_new, nheads_k, headdim) without "
                             f"cu_seqlens_k_new, got {tuple(k.shape)} and {tuple(v.shape)}")
        new_cu = [b * k.shape[1] for b in range(batch + 1)]
        k_rows, v_rows = k.flatten(0, 1), v.flatten(0, 1)
    else:
        new_cu, k_rows, v_rows = [0] * (batch + 1), None, None
    new_lens = torch.tensor([b - a for a, b in zip(new_cu, new_cu[1:])], dtype=torch.int32, device=device)
    # ---- checks of everything before the caches are written
    padded_q = q_rows.new_zeros((batch, longest, *q_rows.shape[1:]))
    if cache_seqlens is None:
        if k_rows is not None:
            raise ValueError("cache_seqlens is required to append k/v (the lengths before the append)")
        capacity = k_cache.shape[1] * (page_table.shape[1] if isinstance(page_table, torch.Tensor) else 1)
        cache_seqlens = capacity
    if _int(cache_seqlens):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=device)
    else:
        seqlens = _index_tensor(cache_seqlens, "cache_seqlens", 1, "(batch_size,)", device)
        if seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have batch_size {batch} entries, got {tuple(seqlens.shape)}")
    total = (seqlens + new_lens).to(torch.int32)
    kvcache_args.check_batch_idx(cache_batch_idx, padded_q, k_cache, page_table)
    kvcache_args.check_leftpad(cache_leftpad, padded_q)
    # (the lengths after the append: within the capacity, their block-table entries inside the cache)
    validate_kvcache(padded_q, k_cache, v_cache, None, None, total, page_table, softmax_scale, causal, num_splits,
                     cache_batch_idx)
    if k_rows is not None and (k_rows.dtype != q.dtype or v_rows.dtype != q.dtype or k_rows.shape[1:] !=
                               k_cache.shape[2:] or v_rows.shape[1:] != v_cache.shape[2:]):
        raise ValueError(f"k and v must have q's dtype and the caches' (nheads_k, headdim) "
                         f"{tuple(k_cache.shape[2:])}, got {tuple(k_rows.shape)} {k_rows.dtype}")
    capacity = k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
    kvcache_args.check_values(cache_batch_idx, cache_leftpad, seqlens, k_cache.shape[0])
    window = check_window(window_size)
    rotary_dim = kvcache_args.check_rotary(rotary_cos, rotary_sin, padded_q, 0 if k_rows is None else max(
        k_rows.shape[0], 1), capacity)
    q_entry = torch.arange(batch, device=device).repeat_interleave(torch.tensor(q_lens, device=device))
    q_step = torch.cat([torch.arange(n, device=device) for n in q_lens]) if q_rows.shape[0] else q_entry
    new_entry = torch.arange(batch, device=device).repeat_interleave(new_lens.long())
    new_step = torch.cat([torch.arange(b - a, device=device) for a, b in zip(new_cu, new_cu[1:])]).long()
    with torch.no_grad():
        if rotary_dim:
            start = seqlens if rotary_seqlens is None else _index_tensor(rotary_seqlens, "rotary_seqlens", 1,
                                                                         "(batch_size,)", device)
            if start.shape[0] != batch:
                raise ValueError(f"rotary_seqlens must have batch_size {batch} entries, got {tuple(start.shape)}")
            positional = kvcache_args.q_is_positional(causal, window, capacity)
            q_pos = start.long()[q_entry] + (q_step if positional else 0)
            k_pos = start.long()[new_entry] + new_step
            last = torch.cat([q_pos, k_pos, start.long()])
            _check_values([((last >= 0) & (last < rotary_cos.shape[0]),
                            f"rotary positions (rotary_seqlens or cache_seqlens, + the token's index) must be in "
                            f"[0, seqlen_ro = {rotary_cos.shape[0]})")])
            q_rows = kvcache_args.rotate(q_rows[None], rotary_cos, rotary_sin, q_pos[None], rotary_interleaved)[0]
            k_rows = kvcache_args.rotate(k_rows[None], rotary_cos, rotary_sin, k_pos[None], rotary_interleaved)[0]
        elif rotary_seqlens is not None:
            raise ValueError("rotary_seqlens needs rotary_cos and rotary_sin")
        if k_rows is not None and k_rows.shape[0]:
            kvcache_args.append_tokens(k_cache, v_cache, k_rows, v_rows, new_entry, seqlens.long()[new_entry] +
                                       new_step, page_table, cache_batch_idx)
        # each entry's queries right-aligned in its padded block (bottom-right alignment kept)
        slot = q_entry * longest + (longest - torch.tensor(q_lens, device=device).long()[q_entry]) + q_step
        padded_q.flatten(0, 1)[slot] = q_rows
    result = decode.flash_attn_with_kvcache(padded_q, k_cache, v_cache, None, None, None, None, total,
                                            cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                            window_size, softcap, True, None, num_splits, return_lse)
    out, lse = result if return_lse else (result, None)
    out = out.flatten(0, 1)[slot]
    if cu_seqlens_q is None:
        return (out.view(q.shape), lse) if return_lse else out.view(q.shape)
    if lse is not None:
        lse = lse.transpose(0, 1).flatten(1)[:, slot]  # (nheads, total_q), FA3's packed layout
    return (out, lse) if return_lse else out
