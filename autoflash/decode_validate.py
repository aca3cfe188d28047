"""Input validation of the decode and varlen functions: one clear `ValueError` per malformed input.

Shapes, dtypes and devices are checked on the host. The values of cache_seqlens and block_table
(lengths within the capacity, table entries inside the cache) live on the GPU: reading them costs
one host sync, which a decode step cannot afford on every call (the GPU would idle while the
host prepares the next launch). They are checked once per tensor state: a tensor whose values
passed is remembered by identity and version counter (`torch.Tensor._version`, bumped by every
in-place write through torch), and is checked again only after it changed. Writes that torch does
not see (a custom kernel, `.data`, DLPack) do not bump it: such a change is not re-checked, and the
decode kernels clamp every length and block-table entry into the cache, so it can never make them
read outside it. cu_seqlens are read and checked on the host at every varlen call (the grid spans
the longest sequence they give), right before the kernels read them.
"""

from __future__ import annotations

import numbers
import weakref

import torch

from autoflash.validate import check_numbers

def _tensor(t, name: str, dim: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {layout}, got shape {tuple(t.shape)}")
    return t


def _same(ref: torch.Tensor, t: torch.Tensor, name: str, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def _index_tensor(t, name: str, dim: int, layout: str, device) -> torch.Tensor:
    _tensor(t, name, dim, layout)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor {layout}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    return t


def _check_values(checks: list) -> bool:
    """checks: (bool tensor that must be all true, message). One host transfer for all of them.
    False when they were not checked (nothing to check, or a CUDA graph is being captured)."""
    if not checks or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False
    ok = torch.stack([c.all() for c, _ in checks]).tolist()
    for good, (_, message) in zip(ok, checks):
        if not good:
            raise ValueError(message() if callable(message) else message)  # (a callable: worked out on failure)
    return True


def validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, num_splits,
                     cache_batch_idx=None):
    """Raise ValueError for malformed input; returns (seqlens int32 (B,) before the append, new tokens).
    With cache_batch_idx (checked by the caller) a contiguous cache may hold any number of rows."""
    qlay = "(batch, seqlen_q, nheads, headdim)"
    _tensor(q, "q", 4, qlay)
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    paged = block_table is not None
    clay = "(num_blocks, page_block_size, nheads_k, headdim)" if paged else "(batch, seqlen_cache, nheads_k, headdim)"
    _tensor(k_cache, "k_cache", 4, clay)
    _tensor(v_cache, "v_cache", 4, clay)
    _same(q, k_cache, "k_cache", "q")
    _same(q, v_cache, "v_cache", "q")
    batch, q_len, heads, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape {clay}, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache must have q's head dim {head_dim}, got shape {tuple(k_cache.shape)}")
    kv_heads = k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of k_cache heads ({kv_heads}) for grouped-query attention")
    if paged:
        _index_tensor(block_table, "block_table", 2, "(batch, max_num_blocks_per_seq)", q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have q's batch size {batch} rows, got shape {tuple(block_table.shape)}")
        if k_cache.shape[1] == 0:
            raise ValueError("k_cache must have a page_block_size >= 1")
        capacity = k_cache.shape[1] * block_table.shape[1]
    else:
        if k_cache.shape[0] != batch and cache_batch_idx is None:
            raise ValueError(f"k_cache must have q's batch size {batch} (or pass cache_batch_idx), got shape "
                             f"{tuple(k_cache.shape)}")
        capacity = k_cache.shape[1]
    new = _validate_new_tokens(q, k_cache, k, v)
    host_length = None  # the lengths when they come from the host (an int, or the whole cache)
    if cache_seqlens is None:
        if new:
            raise ValueError("cache_seqlens is required to append k/v (the lengths before the append)")
        host_length = capacity
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        host_length = int(cache_seqlens)
        if host_length < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {host_length}")
        if host_length + new > capacity:
            raise ValueError(f"cache_seqlens + seqlen_new ({host_length} + {new}) must be <= the cache capacity "
                             f"({capacity} tokens)")
    else:
        _index_tensor(cache_seqlens, "cache_seqlens", 1, "(batch,)", q.device)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have q's batch size {batch}, got shape {tuple(cache_seqlens.shape)}")
    check_numbers(0.0, softmax_scale, "softmax_scale")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: the heuristic), got {num_splits!r}")
    if host_length is not None:
        seqlens = torch.full((batch,), host_length, dtype=torch.int32, device=q.device)
    else:
        seqlens = cache_seqlens
    tables = paged and block_table.numel() > 0
    if host_length is None or tables:
        key = (host_length if host_length is not None else cache_seqlens, block_table if tables else None,
               new, capacity, k_cache.shape[0])
        if not _values_known_good(key):
            checks = []
            if host_length is None:
                def too_long(lengths=seqlens, new=new, capacity=capacity):  # the first row past the capacity
                    b = int(torch.nonzero(lengths.long() + new > capacity)[0, 0])
                    return (f"cache_seqlens[{b}] + seqlen_new ({int(lengths[b])} + {new}) must be <= the cache "
                            f"capacity ({capacity} tokens)")
                checks += [(seqlens >= 0, "cache_seqlens must be >= 0"), (seqlens.long() + new <= capacity, too_long)]
            if tables:
                used = (torch.arange(block_table.shape[1], device=q.device) * k_cache.shape[1]
                        < (seqlens.long() + new)[:, None])
                bad = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
                checks.append((~bad, f"block_table entries for the cached and new tokens must be in "
                                     f"[0, {k_cache.shape[0]}) (num_blocks of k_cache)"))
            if _check_values(checks):
                _remember_good(key)
    return seqlens, new


# Value checks that passed, by tensor identity and version: (lengths, table, new, capacity, blocks).
_GOOD_VALUES: dict[tuple, tuple] = {}
_MAX_GOOD = 256


def _identity(x):
    """A tensor by identity and state; an int (or None) by value."""
    return (id(x), x._version) if isinstance(x, torch.Tensor) else x


def _values_known_good(key: tuple) -> bool:
    entry = _GOOD_VALUES.get(tuple(_identity(x) for x in key))
    # (the weak references tell a live tensor from a new one that reuses a freed one's id)
    return entry is not None and all(ref() is obj for ref, obj in zip(entry, key[:2]) if ref is not None)


def _remember_good(key: tuple) -> None:
    if len(_GOOD_VALUES) >= _MAX_GOOD:
        _GOOD_VALUES.clear()
    _GOOD_VALUES[tuple(_identity(x) for x in key)] = tuple(
        weakref.ref(x) if isinstance(x, torch.Tensor) else None for x in key[:2])


def _validate_new_tokens(q, k_cache, k, v) -> int:
    """The number of new tokens to append (0 without k/v); ValueError for malformed k/v."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values to append), or neither")
    if k is None:
        return 0
    batch, kv_heads, head_dim = q.shape[0], k_cache.shape[2], q.shape[3]
    nlay = "(batch, seqlen_new, nheads_k, headdim)"
    for t, name in ((k, "k"), (v, "v")):
        _tensor(t, name, 4, nlay)
        _same(q, t, name, "q")
        if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"{name} must be {nlay} = ({batch}, seqlen_new, {kv_heads}, {head_dim}), got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    return k.shape[1]


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    lay = "(total_tokens, nheads, headdim)"
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _tensor(t, name, 3, lay)
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    _same(q, k, "k", "q")
    _same(q, v, "v", "q")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in total_tokens and heads {lay}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]}) for grouped-query attention")
    cus = []
    for cu, name, total in ((cu_seqlens_q, "cu_seqlens_q", q.shape[0]), (cu_seqlens_k, "cu_seqlens_k", k.shape[0])):
        _index_tensor(cu, name, 1, "(batch_size + 1,)", q.device)
        values = cu.tolist()
        if not values or values[0] != 0:
            raise ValueError(f"{name} must start at 0 (batch_size + 1 offsets), got {values[:4]}")
        if any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if values[-1] != total:
            raise ValueError(f"{name}[-1] ({values[-1]}) must equal the total tokens of its tensor ({total})")
        cus.append(values)
    if len(cus[0]) != len(cus[1]):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch_size + 1), "
                         f"got {len(cus[0])} and {len(cus[1])}")
    for m, name, values in ((max_seqlen_q, "max_seqlen_q", cus[0]), (max_seqlen_k, "max_seqlen_k", cus[1])):
        longest = max((b - a for a, b in zip(values, values[1:])), default=0)
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < longest:
            raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), got {m!r}")
    check_numbers(0.0, softmax_scale, "softmax_scale")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    return cus


