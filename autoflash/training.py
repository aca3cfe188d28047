"""A training step's attention: forward and backward as one pair, with direct launches (`replay`),
and the autograd.Function that runs them. The halves are autoflash's own kernels, or one of them a
vendor kernel's (torch SDPA's forward with its log-sum-exp, or its backward from a given O and
log-sum-exp) where such a pair won the backward problem (`training_pair_for`).

Used by the API (eager training) and by the tuner (a backward problem is timed as forward +
backward through this same path, so the measured time is what a training step gets).
"""

from __future__ import annotations

import functools

import torch

from autoflash.validate import output_like


class TrainingPair:
    """autoflash's forward and backward kernels for one training call signature (the API's memo
    key), each launched directly after its first call (`Kernel.bind_forward`/`bind_backward`):
    Triton's per-launch host path costs more than the kernels take on short sequences."""

    def __init__(self, forward_kernel, backward_kernel, sm_scale: float, causal: bool, causal_offset: int,
                 fallback_backward=None, fallback_forward=None):
        """fallback_backward(q, k, v, do) -> a backward kernel for a gradient `backward_kernel`
        cannot read (e.g. a TMA kernel and a gradient with stride 0), or for tensors a vendor
        backward refuses; None: such a gradient is an error. fallback_forward(q, k, v) -> the own
        forward kernel for tensors a vendor forward refuses (None: an error)."""
        self.forward_kernel, self.backward_kernel = forward_kernel, backward_kernel
        self.fallback_backward, self.fallback_forward = fallback_backward, fallback_forward
        self.sm_scale, self.causal, self.causal_offset = sm_scale, causal, causal_offset
        self._forward_launch = None  # None: not bound yet; False: cannot be bound
        self._backward_launch: dict[tuple, object] = {}  # by the incoming gradient's layout

    def forward(self, q, k, v):
        if self.forward_kernel.vendor:
            try:
                return self.forward_kernel.attention_with_lse(q, k, v, self.sm_scale, self.causal)
            except RuntimeError:  # the backend refused these tensors: the own forward serves them
                if self.fallback_forward is None:
                    raise
                self.forward_kernel = self.fallback_forward(q, k, v)
        out = output_like(q, v)  # q's memory layout
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        if self._forward_launch:
            self._forward_launch(q, k, v, out, lse)
        elif self._forward_launch is None:
            self._forward_launch = self.forward_kernel.bind_forward(q, k, v, out, lse, self.sm_scale, self.causal,
                                                                    self.causal_offset) or False
        else:
            self.forward_kernel.forward(q, k, v, out, lse, self.sm_scale, self.causal, self.causal_offset)
        return out, lse

    def backward(self, q, k, v, out, lse, do):
        if self.backward_kernel.vendor:
            try:
                return self.backward_kernel.gradients_from(q, k, v, out, lse, do, self.sm_scale, self.causal)
            except RuntimeError:  # the backend refused these tensors (its LSE convention is ours)
                if self.fallback_backward is None:
                    raise
                self.backward_kernel = self.fallback_backward(q, k, v, do)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # The gradient autograd hands over can have any layout (and alignment): kernel and direct
        # launcher are chosen per layout (a TMA kernel cannot read a gradient with stride 0).
        layout = (do.dtype, do.stride(), not do.data_ptr() & 15)
        kernel, launch = self._backward_launch.get(layout, (None, None))
        if launch:
            launch(q, k, v, out, lse, do, dq, dk, dv)
            return dq, dk, dv
        if kernel is None:
            kernel = self.backward_kernel
            reason = kernel.unsupported(q, k, v, do)
            if reason is not None:
                if self.fallback_backward is None:
                    raise ValueError(f"{kernel} cannot read this gradient: {reason}")
                kernel = self.fallback_backward(q, k, v, do)
            if len(self._backward_launch) < 8:  # (bind runs this call, bound or not)
                self._backward_launch[layout] = (kernel, kernel.bind_backward(
                    q, k, v, out, lse, do, dq, dk, dv, self.sm_scale, self.causal, self.causal_offset))
                return dq, dk, dv
        kernel.backward(q, k, v, out, lse, do, dq, dk, dv, self.sm_scale, self.causal, self.causal_offset)
        return dq, dk, dv


def training_pair_for(winner, own_forward, own_backward, sm_scale: float, causal: bool, causal_offset: int,
                      fallback_backward=None, fallback_forward=None) -> TrainingPair | None:
    """The pair a backward problem's winner stands for: an own backward kernel with the own forward
    (`own_forward()`); a vendor variant with its FORWARD/BACKWARD halves, where a half that is not
    SDPA's is the own served kernel (`own_forward()`, `own_backward()`); None for SDPA's whole pair
    (run through torch autograd by its caller). The own kernels are built only when used."""
    if winner.vendor and not winner.takes_causal_offset(causal, causal_offset):
        winner = own_backward()  # (SDPA's causal mask is top-left: neither of its halves takes this call)
    if not winner.vendor:
        return TrainingPair(own_forward(), winner, sm_scale, causal, causal_offset, fallback_backward, fallback_forward)
    if winner.whole_pair:
        return None
    return TrainingPair(winner if winner.forward_from == "sdpa" else own_forward(),
                        winner if winner.backward_from == "sdpa" else own_backward(),
                        sm_scale, causal, causal_offset, fallback_backward, fallback_forward)


class _NotTwiceDifferentiable(torch.autograd.Function):
    """A gradient handed out under create_graph=True, tied to q, k, v and the incoming gradient:
    differentiating it again raises. (`once_differentiable` ties its error node to no input, so
    `torch.autograd.grad(..., inputs)` prunes it and returns the gradient without the second-order
    term, silently.)"""

    @staticmethod
    def forward(ctx, grad, *inputs):
        return grad.clone()

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("autoflash attention is not twice differentiable (its backward kernels have no "
                           "derivative): a double backward needs torch SDPA's math backend")


def first_order(backward):
    """In place of `once_differentiable` on a Function's backward whose first three saved tensors are
    q, k, v: the backward runs without building a graph; under create_graph=True its gradients come
    out tied to q, k, v and the incoming gradients, so a second derivative through them raises
    instead of dropping a term."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not create_graph:
            return outputs
        # (tied to the incoming gradients too: a second derivative may reach its parameters through
        # them alone, e.g. (attention(q, k, v) * w).sum() differentiated for w)
        inputs = (*ctx.saved_tensors[:3], *(g for g in grads if isinstance(g, torch.Tensor)))
        return tuple(_NotTwiceDifferentiable.apply(g, *inputs) if isinstance(g, torch.Tensor) else g
                     for g in outputs)
    return wrapper


class EagerAttention(torch.autograd.Function):
    """The same forward and backward as `attn_fwd`/`attn_bwd`, as a plain autograd.Function for
    eager training: the custom op's per-call dispatch (schema checks, the op's autograd wrapper)
    costs host time that shows whenever the kernels are short. torch.compile keeps the custom op."""

    @staticmethod
    def forward(ctx, q, k, v, pair: TrainingPair):
        out, lse = pair.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pair = pair
        return out

    @staticmethod
    @first_order  # (the backward kernels are not differentiable themselves)
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.pair.backward(q, k, v, out, lse, grad_out)
        return dq, dk, dv, None
