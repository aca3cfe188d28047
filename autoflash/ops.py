"""The kernels as `torch.library` custom ops, with autograd.

`autoflash::attn_fwd` returns (out, lse); its backward is `autoflash::attn_bwd`, which recomputes
the score tiles from q, k, v, out and lse (the only tensors saved: memory stays linear in N).
Registered as custom ops with fake (meta) implementations, so torch.compile treats each as one
opaque node instead of tracing into Triton's launcher. Both run autoflash's own kernels: where a
vendor kernel (torch SDPA) won a problem, `api` calls it instead of these ops.
"""

from __future__ import annotations

import torch

from autoflash.dispatch import get_dispatcher
from autoflash.validate import output_like


@torch.library.custom_op("autoflash::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
             causal_offset: int, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, H, Nq, D), k/v: (B, H_kv, Nk, D), any strides -> out (q's memory layout), lse (B, H, Nq) fp32.
    deterministic: the backward (`attn_bwd`) is bitwise repeatable (the forward always is)."""
    out = output_like(q, v)  # preserves q's layout: a (B,N,H,D)-strided view gives a (B,N,H,D) buffer
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    # own kernels only: the lse feeds autoflash's backward (a vendor winner gives none)
    get_dispatcher().kernel_for(q, k, v, out, causal, own_only=True).forward(q, k, v, out, lse, scale, causal,
                                                                              causal_offset)
    return out, lse


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, scale, causal, causal_offset, deterministic=False):
    return output_like(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("autoflash::attn_bwd", mutates_args=())
def attn_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float, causal: bool,
             causal_offset: int, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kernel = get_dispatcher().kernel_for(q, k, v, grad_out, causal, op="bwd", own_only=True,
                                         deterministic=deterministic)
    kernel.backward(q, k, v, out, lse, grad_out, dq, dk, dv, scale, causal, causal_offset)
    return dq, dk, dv


@attn_bwd.register_fake
def _attn_bwd_fake(grad_out, q, k, v, out, lse, scale, causal, causal_offset, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, causal_offset, *deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.causal, ctx.causal_offset = scale, causal, causal_offset
    ctx.deterministic = bool(deterministic and deterministic[0])
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attn_bwd(grad_out, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.causal_offset, ctx.deterministic)
    return dq, dk, dv, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


from autoflash.training import TrainingPair, training_pair_for  # noqa: E402 (the eager training path)


def training_pair(q, k, v, sm_scale: float, causal: bool, causal_offset: int, winner=None,
                  deterministic: bool = False) -> TrainingPair | None:
    """The served training pair of this call: the backward problem's `winner` (default: the own-only
    one) with the forward it stands for, the own halves the served own kernels; None where the
    winner is SDPA's whole pair (see `training.training_pair_for`). deterministic: own backward kernels
    whose gradients are bitwise repeatable (a vendor `winner` then only with the own backward half)."""
    dispatcher = get_dispatcher()

    def backward_for(q, k, v, do):  # a gradient (or tensors) the served backward cannot take: what serves it
        return dispatcher.kernel_for(q, k, v, do, causal, op="bwd", own_only=True, deterministic=deterministic)

    def forward_for(q, k, v):
        return dispatcher.kernel_for(q, k, v, q, causal, own_only=True)

    return training_pair_for(backward_for(q, k, v, q) if winner is None else winner, lambda: forward_for(q, k, v),
                             lambda: backward_for(q, k, v, q), sm_scale, causal, causal_offset,
                             fallback_backward=backward_for, fallback_forward=forward_for)


def sdpa_forward_half(q, k, v, causal: bool):
    """The pair of SDPA's forward (with its log-sum-exp) and the own backward (sdpa_bwd: FORWARD "sdpa",
    BACKWARD "autoflash") where an SDPA backend serves this call's forward problem (the serving policy's
    SDPA-cuDNN, or a tuned vendor winner) and has that forward op (cuDNN's; the CPU build's flash);
    else None. A deterministic training call takes it: the forward has no atomics, and the forward the
    call's problem is served with stays, where the own forward alone would cost it (on an H100 at
    Llama-3-8B's shape the own default forward took 0.41 ms against cuDNN's 0.27)."""
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.space import InvalidVariant, load_space

    dispatcher = get_dispatcher()
    forward = dispatcher.kernel_for(q, k, v, q, causal)
    if not forward.vendor:
        return None
    device = gpu_fingerprint(q.device.index if q.is_cuda else None)
    problem = dispatcher.problem_for(q, k, causal, "bwd", device.sm_count, head_dim_v=v.shape[-1])
    try:
        variant = load_space("sdpa_bwd").validate({"BACKEND": forward.backend, "FORWARD": "sdpa",
                                                   "BACKWARD": "autoflash"}, problem, device)
    except (InvalidVariant, ValueError):
        return None
    kernel = codegen.load(variant)
    return kernel if kernel.unsupported(q, k, v, q) is None else None
