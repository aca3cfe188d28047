"""torch SDPA's argument rules as `autoflash.attention` applies them: which calls torch takes (autoflash
must answer them, with torch's answer), which it refuses (autoflash raises), and how a call torch takes
maps onto the kernels' (batch, heads, seqlen, head_dim) views.

What torch 2.13's `scaled_dot_product_attention` takes, found by calling it (its math backend, which the
other backends fall back to, is the widest):
- query (*batch_q, L, E), key (*batch_k, S, E), value (*batch_v, S, Ev), each of rank >= 2 (ranks may
  differ). The batch dims broadcast together (numpy's rules, aligned right), the query's included:
  the output is (*broadcast, L, Ev). So a (B*H, N, D) call, a 5-D one, K/V with one head or a batch of
  one against a query with more, are all plain SDPA calls.
- enable_gqa=True: all three need a heads dim (-3); key and value heads each divide the query's (or
  all three are equal); key/value heads are repeated (interleaved) up to the query's, then the batch
  dims broadcast as above.
- scale and dropout_p go through torch's float argument: a Python bool, int or float, a numpy scalar
  (a complex one by its real part), or a 0-d tensor that does not require grad. dropout_p > 1 is always
  refused; a negative or NaN one depends on the backend torch picks (the math backend reads it as no
  dropout, the CPU flash kernel refuses it): autoflash hands such calls to torch as they are.
  is_causal and enable_gqa must be bools (checked in `validate.check_sdpa_kinds`).
- attn_mask: broadcastable to the scores (*broadcast, L, S), bool or a float type torch names: calls
  with a mask go to torch as they are, so its own checks decide.
- key and value with different sequence lengths: the math backend refuses them, while torch's CPU
  flash kernel takes them and reads past the shorter one; autoflash refuses them.
"""

from __future__ import annotations

import math

import torch

try:  # (torch runs without numpy; its scalars are then simply never passed)
    import numpy
except ImportError:  # pragma: no cover
    numpy = None


def check_sdpa_tensors(query, key, value) -> None:
    """ValueError where torch refuses the tensors themselves: not tensors, rank < 2, not floating point,
    mixed dtypes or devices."""
    names = ("query", "key", "value")
    for t, name in zip((query, key, value), names):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor (*batch, seqlen, head_dim), got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be at least 2-D (*batch, seqlen, head_dim), got shape {tuple(t.shape)}")
    if not query.dtype.is_floating_point:
        raise ValueError(f"query must be a floating-point tensor (float16, bfloat16, float32, float64), "
                         f"got {query.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key, value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key, value must be on one device, got {query.device}, {key.device}, {value.device}")


def sdpa_float(value, name: str) -> float:
    """The number torch's float argument makes of `value` (see the module's notes), or its refusal
    (TypeError for a kind torch does not take, ValueError for a tensor it cannot read)."""
    if isinstance(value, (bool, int, float)):  # (numpy's float64 is a float)
        return float(value)
    if numpy is not None and isinstance(value, (numpy.bool_, numpy.number)):
        return float(value.real)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad:
        if value.device.type == "meta":
            raise ValueError(f"{name} must be a readable number, got a meta tensor")
        if value.dtype.is_complex:
            if value.imag.item() != 0:
                raise ValueError(f"{name} must be real: torch cannot convert {value.item()} to a float")
            return float(value.real.item())
        return float(value.item())
    raise TypeError(f"attention(): argument '{name}' must be float, not {type(value).__name__}")


def check_sdpa_numbers(dropout_p, scale) -> tuple[float, float | None]:
    """(dropout_p, scale) as torch reads them. dropout_p > 1 is a ValueError, as torch always refuses it;
    any scale torch reads is taken (a NaN, infinite or non-positive one runs in torch)."""
    p = sdpa_float(dropout_p, "dropout_p")
    if p > 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    return p, None if scale is None else sdpa_float(scale, "scale")


def numbers_reason(dropout_p: float, scale: float | None) -> str | None:
    """Why the kernels cannot take these numbers as torch read them, for the reasons only the SDPA form
    has (the other limits are `validate.unsupported_reason`'s): None if they can."""
    if not dropout_p >= 0.0:
        return f"dropout_p={dropout_p} (torch answers or refuses it depending on its backend)"
    if scale is not None and not math.isfinite(scale):
        return f"a softmax scale that is not a finite number ({scale})"
    return None


def sdpa_batch(query, key, value, enable_gqa: bool) -> tuple[int, ...] | None:
    """The output's batch dims (*broadcast) of a call whose tensors passed `check_sdpa_tensors`, or a
    ValueError where torch refuses the shapes. None when a tensor is empty: torch decides those (it
    answers some that no rule here would predict, e.g. zero key heads under enable_gqa)."""
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same head dim, got {tuple(query.shape)} and {tuple(key.shape)}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must agree in seqlen (*batch, seqlen, head_dim), "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if any(t.numel() == 0 for t in (query, key, value)):
        return None
    batch_q, batch_k, batch_v = query.shape[:-2], key.shape[:-2], value.shape[:-2]
    if enable_gqa:
        if min(t.dim() for t in (query, key, value)) < 3:
            raise ValueError("enable_gqa=True needs a heads dim: query, key and value must be at least 3-D "
                             f"(*batch, heads, seqlen, head_dim), got {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}")
        heads, heads_k, heads_v = query.shape[-3], key.shape[-3], value.shape[-3]
        if not heads == heads_k == heads_v and (heads % heads_k or heads % heads_v):
            raise ValueError(f"query heads ({heads}) must be a multiple of key heads ({heads_k}) and of value "
                             f"heads ({heads_v}) for grouped-query attention")
        batch_k, batch_v = (*batch_k[:-1], heads), (*batch_v[:-1], heads)  # (repeated up to the query's)
    try:
        return tuple(torch.broadcast_shapes(batch_q, batch_k, batch_v))
    except RuntimeError:
        hint = ""
        if not enable_gqa and min(t.dim() for t in (query, key, value)) >= 3 and key.shape[-3] != query.shape[-3]:
            hint = f"; query has {query.shape[-3]} heads but key has {key.shape[-3]}: pass enable_gqa=True for " \
                   "grouped-query attention"
        raise ValueError(f"the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} do not broadcast (*batch, seqlen, head_dim){hint}") from None


def kernel_views(query, key, value, batch: tuple[int, ...]):
    """(q, k, v) as (B, H, N, D) views for the kernels, B the product of the batch dims but the last,
    H the last (1 for 2-D calls): a broadcast dim becomes a stride-0 view, and K/V with fewer heads
    than the query (one head, or a GQA group) keep them, served as grouped-query attention. Nothing is
    copied unless a broadcast leaves dims that no view can merge into B (5-D and up), or key and value
    have different head counts (one is then repeated to the query's heads)."""
    heads = batch[-1] if batch else 1
    lead = batch[:-1]
    heads_k, heads_v = (t.shape[-3] if t.dim() >= 3 else 1 for t in (key, value))
    if heads_k != heads_v:  # one group size for both: the other repeated (a view where it has one head)
        key, value = (_repeat_heads(t, h, heads) for t, h in ((key, heads_k), (value, heads_v)))
        heads_k = heads_v = heads
    views = []
    for t, h in ((query, heads), (key, heads_k), (value, heads_v)):
        full = t.expand(*lead, h, *t.shape[-2:])
        views.append(full.reshape(math.prod(lead), h, *t.shape[-2:]))
    return tuple(views)


def _repeat_heads(t, heads_t: int, heads: int):
    """t (..., heads_t, N, D) with each head repeated heads // heads_t times (torch's repeat_interleave)."""
    if heads_t == heads:
        return t
    if t.dim() < 3:
        t = t.unsqueeze(0)
    grouped = t.unsqueeze(-3).expand(*t.shape[:-2], heads // heads_t, *t.shape[-2:])
    return grouped.reshape(*t.shape[:-3], heads, *t.shape[-2:])

