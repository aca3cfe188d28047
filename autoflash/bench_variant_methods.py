"""What `autoflash bench --variants` times for each case (`bench_variants.VariantCase`): autoflash's drop-ins,
torch SDPA given the equivalent boolean mask (torch's eager attention for the softcap) and compiled
FlexAttention with a block mask, each as (layout, no-argument call) on the case's inputs, or a string saying
why it is not run (a mask that would not fit in memory, FlexAttention missing or without a CPU backward).
"""

from __future__ import annotations

import contextlib
import warnings

import torch


def _compiled_flex(mode: str | None):
    """flex_attention compiled once per mode (None: uncompiled, the interpreter's CPU run)."""
    from torch.nn.attention.flex_attention import flex_attention

    if mode is None:  # (the rows say so: `compiled` False; torch's warning about it would only repeat that)
        def eager(*args, **kwargs):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return flex_attention(*args, **kwargs)
        return eager
    cache = _compiled_flex.__dict__.setdefault("cache", {})
    if mode not in cache:
        cache[mode] = torch.compile(flex_attention, dynamic=False, **({} if mode == "default" else {"mode": mode}))
    return cache[mode]


@contextlib.contextmanager
def compile_limits():
    """Around a run of the variant cases: every case (its shapes, its block mask's mask_mod) compiles
    flex_attention again, and both modes compile the same code object, so a run needs up to 20
    compiles of it. Past dynamo's recompile limit (8) torch runs flex_attention uncompiled,
    materializing the scores (32 GiB at 16k tokens and 32 heads), with a warning only: the limit is
    raised, and a hit raises instead (unless dynamo is told to suppress errors, which excludes that).
    Dynamo reads these settings when a call compiles: scoped to the run, restored after it."""
    import torch._dynamo

    config = torch._dynamo.config
    patch = {name: max(getattr(config, name), 64) for name in ("recompile_limit", "cache_size_limit")
             if hasattr(config, name)}  # (the older name, an alias on newer torch)
    if hasattr(config, "fail_on_recompile_limit_hit") and not getattr(config, "suppress_errors", False):
        patch["fail_on_recompile_limit_hit"] = True
    with config.patch(patch):
        yield


def _block_mask(case, ids, device):
    from torch.nn.attention.flex_attention import create_block_mask

    window = case.window

    def mask_mod(b, h, q_idx, kv_idx):
        visible = q_idx >= kv_idx
        if case.variant == "window":
            visible = visible & (q_idx - kv_idx < window)
        if case.variant == "documents":
            visible = visible & (ids[b, q_idx] == ids[b, kv_idx])
        return visible

    # compiled on the GPU, as torch recommends (its `_compile=True` is deprecated): the mask of a 64k
    # case is built block by block instead of as a dense (N, N) tensor
    build = torch.compile(create_block_mask) if device.type == "cuda" else create_block_mask
    return build(mask_mod, case.batch, None, case.seqlen, case.seqlen, device=device)


def _mask_bytes(case) -> int:
    """What torch SDPA allocates for the boolean mask: the mask and its additive float copy."""
    element = torch.tensor([], dtype=case.torch_dtype).element_size()
    return case.batch * case.seqlen ** 2 * (1 + element)


def _eager_bytes(case, fwdbwd: bool) -> int:
    """The materialized scores of torch-eager: scores, capped, probabilities (float32), saved for backward."""
    return case.batch * case.heads_q * case.seqlen ** 2 * 12 * (2 if fwdbwd else 1)


def _fits(needed: int, device) -> str | None:
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    if needed <= free // 2:
        return None
    return f"skipped: needs ~{needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on the GPU"


def methods(case, t: dict, ids, device, fwdbwd: bool) -> dict:
    """name -> (layout, call returning the output in that layout), or a string: why it is not run."""
    import torch.nn.functional as F

    import autoflash
    from autoflash.documents import Documents

    qf, kf, vf = t["bnhd"]
    methods = {}
    if case.variant == "documents":
        docs = Documents.from_ids(ids)
        methods["autoflash"] = ("bnhd", lambda: autoflash.document_attention(qf, kf, vf, docs, causal=True))
        b, n = case.batch, case.seqlen
        cu, longest = docs.cu_seqlens, docs.max_seqlen
        methods["autoflash-varlen"] = ("bnhd", lambda: autoflash.flash_attn_varlen_func(
            qf.view(b * n, *qf.shape[2:]), kf.view(b * n, *kf.shape[2:]), vf.view(b * n, *vf.shape[2:]), cu, cu,
            longest, longest, causal=True).view(qf.shape))
    else:
        extra = {"window_size": (case.window - 1, 0)} if case.variant == "window" else {"softcap": case.softcap}
        methods["autoflash"] = ("bnhd", lambda: autoflash.flash_attn_func(qf, kf, vf, causal=True, **extra))
    qx, kx, vx = t["bhnd-x"]
    if case.variant == "softcap":
        methods["torch-eager"] = _fits(_eager_bytes(case, fwdbwd), device) or ("bhnd-x", lambda: _eager_softcap(
            qx, kx, vx, case.softcap))
    else:
        why = _fits(_mask_bytes(case), device)
        if why is None:
            mask = case.visible(torch.arange(case.seqlen, device=device), ids)[:, None]
            methods["sdpa-mask"] = ("bhnd-x", lambda: F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask))
        else:
            methods["sdpa-mask"] = why
    try:
        methods.update(_flex_methods(case, t["bhnd"], ids, device, fwdbwd))
    except Exception as e:  # (the block mask on a torch that lacks a piece, ...): said, the rest still timed
        methods["flex"] = refused(e)
    return methods


def refused(e: Exception) -> str:
    return f"refused: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def _eager_softcap(q, k, v, softcap: float):
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = softcap * torch.tanh(s / softcap)
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def _flex_methods(case, t, ids, device, fwdbwd: bool) -> dict:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as e:
        return {"flex": f"skipped: FlexAttention not importable ({e})"}
    if device.type != "cuda" and fwdbwd:
        return {"flex": "skipped: FlexAttention has no backward on the CPU"}
    q, k, v = t
    block_mask = _block_mask(case, ids, device)
    softcap = case.softcap
    score_mod = (lambda s, b, h, q_idx, kv_idx: softcap * torch.tanh(s / softcap)) if softcap else None
    modes = {"flex": "default", "flex-max-autotune": "max-autotune-no-cudagraphs"} if device.type == "cuda" \
        else {"flex": None}
    return {name: ("bhnd", lambda fn=_compiled_flex(mode): fn(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                             enable_gqa=case.heads_q != case.heads_kv))
            for name, mode in modes.items()}
