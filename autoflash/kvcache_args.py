"""flash_attn_with_kvcache's cache arguments, served on the host with torch ops ahead of the decode
kernels: rotary embeddings (of q and of the new keys), the in-place append, cache_batch_idx and
cache_leftpad, with flash-attn's semantics (flash_attn/flash_attn_interface.py and
tests/test_flash_attn.py::test_flash_attn_kvcache):

- rotary: rotary_cos/rotary_sin (seqlen_ro, rotary_dim / 2), rotary_dim <= headdim; the new key t of
  entry b is rotated at position cache_seqlens[b] + t; q's token i at cache_seqlens[b] + i when the
  call is causal or local (a window), else every token of q at cache_seqlens[b]. Interleaved (GPT-J)
  pairs dims (0, 1), (2, 3), ...; not interleaved (GPT-NeoX) pairs d and d + rotary_dim / 2. The
  product runs in float32 and is rounded to q's dtype once, as flash-attn's kernel does.
- cache_batch_idx[b]: the row of a contiguous cache that entry b reads and appends to.
- cache_leftpad[b]: entry b's sequence starts at that cache position: keys before it are not
  attended, and causal / window / ALiBi positions count from it (which, bottom-right aligned, is
  the same as counting from 0: only the masked prefix changes).

The decode kernels read keys 0 .. length - 1 of each entry through a block table. These arguments
become one (`visible_keys`): cache_batch_idx makes each cache row one page; cache_leftpad makes each
token a page (the cache viewed as pages of one token), so entry b's key j is token leftpad[b] + j.
No key is copied (unless the cache's strides cannot be viewed that way: then torch copies it).
"""

from __future__ import annotations

import torch

from autoflash.decode_validate import _check_values, _index_tensor, _tensor


# --------------------------------------------------------------------------- checks
def check_rotary(rotary_cos, rotary_sin, q, new: int, capacity: int) -> int:
    """The rotary dim (0 without rotary); ValueError for malformed cos/sin."""
    if rotary_cos is None and rotary_sin is None:
        return 0
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together (or neither)")
    lay = "(seqlen_ro, rotary_dim / 2)"
    for t, name in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
        _tensor(t, name, 2, lay)
        if not t.dtype.is_floating_point or t.device != q.device:
            raise ValueError(f"{name} must be a floating-point tensor on q's device {q.device}, got {t.dtype} "
                             f"on {t.device}")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape {lay}, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if not 0 < rotary_dim <= q.shape[3]:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be in [2, headdim = {q.shape[3]}]")
    if not new:  # (flash-attn: rotary only applies with new keys to rotate)
        raise ValueError("rotary_cos/rotary_sin need k and v (the new keys to rotate before they are appended)")
    if rotary_cos.shape[0] < capacity:  # (flash-attn's check: a position for every cache slot)
        raise ValueError(f"rotary_cos/rotary_sin must have a row for every cache position: seqlen_ro "
                         f"({rotary_cos.shape[0]}) must be >= the cache capacity ({capacity})")
    return rotary_dim


def check_batch_idx(cache_batch_idx, q, k_cache, block_table) -> None:
    if cache_batch_idx is None:
        return
    if block_table is not None:  # (flash-attn refuses the pair too: the block table already picks the pages)
        raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache), as in flash-attn")
    _index_tensor(cache_batch_idx, "cache_batch_idx", 1, "(batch_size,)", q.device)
    if cache_batch_idx.shape[0] != q.shape[0]:
        raise ValueError(f"cache_batch_idx must have q's batch size {q.shape[0]}, got {tuple(cache_batch_idx.shape)}")


def check_leftpad(cache_leftpad, q) -> None:
    if cache_leftpad is None:
        return
    _index_tensor(cache_leftpad, "cache_leftpad", 1, "(batch_size,)", q.device)
    if cache_leftpad.shape[0] != q.shape[0]:
        raise ValueError(f"cache_leftpad must have q's batch size {q.shape[0]}, got {tuple(cache_leftpad.shape)}")


def check_values(cache_batch_idx, cache_leftpad, seqlens, cache_rows: int, rotary_span: int = 0,
                 seqlen_ro: int = 0) -> None:
    """The values (one host sync, only when these arguments are given): rows inside the cache,
    0 <= cache_leftpad[b] <= cache_seqlens[b] (the sequence starts before its end), and with
    rotary_span (q's tokens past the new keys, each at its own position) a cos/sin row for each."""
    checks = []
    if rotary_span:  # (the new keys' positions are inside the capacity; q's may run past them)
        checks.append((seqlens.long() + rotary_span <= seqlen_ro,
                       f"rotary_cos/rotary_sin need a row for each of q's positions: cache_seqlens[b] + "
                       f"seqlen_q ({rotary_span} past the cache) must be <= seqlen_ro ({seqlen_ro})"))
    if cache_batch_idx is not None:
        checks.append(((cache_batch_idx >= 0) & (cache_batch_idx < cache_rows),
                       f"cache_batch_idx entries must be in [0, {cache_rows}) (the rows of k_cache)"))
    if cache_leftpad is not None:
        checks.append(((cache_leftpad >= 0) & (cache_leftpad <= seqlens),
                       "cache_leftpad must be in [0, cache_seqlens[b]] for every entry b"))
    _check_values(checks)


# --------------------------------------------------------------------------- host operations
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """x (B, T, H, D) rotated at positions (B, T): its first rotary_dim dims, in float32, rounded
    once to x's dtype (the rest as it is)."""
    half = cos.shape[1]
    c = cos.float()[positions][:, :, None, :]  # (B, T, 1, rotary_dim / 2)
    s = sin.float()[positions][:, :, None, :]
    part = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., :half], part[..., half:]
        turned = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


def rotary_positions(start: torch.Tensor, length: int, per_token: bool) -> torch.Tensor:
    """(B, length) positions start[b] + t (per_token), else start[b] for every t."""
    steps = torch.arange(length, device=start.device) if per_token else torch.zeros(length, dtype=torch.long,
                                                                                    device=start.device)
    return start.long()[:, None] + steps


def q_is_positional(causal: bool, window: tuple, capacity: int) -> bool:
    """Whether q's tokens get their own rotary positions: flash-attn rotates them one position apart
    in a causal or local kernel, where a window side >= the cache capacity counts as unbounded."""
    return causal or any(0 <= w < capacity for w in window)


def append(k_cache, v_cache, k, v, seqlens, block_table, cache_batch_idx) -> None:
    """Write k, v (B, S_new, H_kv, D) into the caches at positions seqlens[b] + t of entry b."""
    batch, new = k.shape[:2]
    entry = torch.arange(batch, device=k.device).repeat_interleave(new)
    pos = (seqlens.long()[:, None] + torch.arange(new, device=k.device)).flatten()
    append_tokens(k_cache, v_cache, k.flatten(0, 1), v.flatten(0, 1), entry, pos, block_table, cache_batch_idx)


def append_tokens(k_cache, v_cache, k_rows, v_rows, entry, pos, block_table, cache_batch_idx) -> None:
    """Write token rows k_rows, v_rows (T, H_kv, D) of entries entry (T,) at their cache positions
    pos (T,): row cache_batch_idx[entry] of a contiguous cache (row entry without it), or the pages
    of the entry's block table. (Entries sharing a cache row: which one lands is torch's choice, as
    flash-attn leaves it to its kernel.)"""
    if block_table is None:
        rows = cache_batch_idx.long()[entry] if cache_batch_idx is not None else entry
        k_cache[rows, pos] = k_rows
        v_cache[rows, pos] = v_rows
    else:
        page = k_cache.shape[1]
        blocks = block_table.long()[entry, pos // page]
        k_cache[blocks, pos % page] = k_rows
        v_cache[blocks, pos % page] = v_rows


def visible_keys(k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad, total):
    """(k pages, v pages, block table or None, lengths int32 (B,)) for the decode kernels: entry b's
    keys 0 .. lengths[b] - 1 are its visible keys (cache positions cache_leftpad[b] .. total[b] - 1)."""
    if cache_leftpad is None:
        if cache_batch_idx is None:
            return k_cache, v_cache, block_table, total
        # each cache row a page of the whole row: entry b's one page is row cache_batch_idx[b]
        return k_cache, v_cache, cache_batch_idx.view(-1, 1), total
    page = k_cache.shape[1]
    capacity = page * (block_table.shape[1] if block_table is not None else 1)
    # cache position of entry b's key j (clamped past its length: those are never read unmasked)
    pos = (cache_leftpad.long()[:, None] + torch.arange(capacity, device=k_cache.device)).clamp(max=capacity - 1)
    if block_table is None:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(pos.shape[0],
                                                                                       device=pos.device)
        token = rows[:, None] * page + pos
    else:
        blocks = torch.gather(block_table.long(), 1, pos // page).clamp(0, k_cache.shape[0] - 1)
        token = blocks * page + pos % page
    # the cache as pages of one token (a view where its strides allow, else torch copies it)
    k_tokens, v_tokens = (c.flatten(0, 1).unsqueeze(1) for c in (k_cache, v_cache))
    lengths = (total - cache_leftpad).to(torch.int32).contiguous()
    return k_tokens, v_tokens, token.to(torch.int32).contiguous(), lengths
