"""Public functions: `attention` (torch SDPA form) and `flash_attn_func` (flash-attn form).

This module validates inputs, decides between the autoflash kernel and a torch SDPA fallback,
and lays out outputs. Kernel choice and launch live in `dispatch`; kernels in `templates/`.

Fallbacks (cases the kernels do not cover) go to torch SDPA with one warning per reason, never
silently; with AUTOFLASH_STRICT=1 each fallback raises `FallbackError` instead.
"""

from __future__ import annotations


import torch

from autoflash import decode_kernels
from autoflash.kernel_cache import KernelCacheError
from autoflash.device import interpreter_enabled
from autoflash.dispatch import get_dispatcher
from autoflash.fallback import FallbackError, FallbackWarning, fall_back, strict_mode, warned_reasons  # noqa: F401
from autoflash.reference import torch_sdpa
from autoflash.vendor import is_refusal, other_fused_attention, quiet_refusals
from autoflash.sdpa_args import check_sdpa_numbers, check_sdpa_tensors, kernel_views, numbers_reason, sdpa_batch
from autoflash.validate import (check_sdpa_kinds, deterministic_backward, needs_autograd, output_like,
                                softmax_scale_or_default, unsupported_reason)



def forward_with_lse(q, k, v, causal: bool = False, causal_offset: int = 0, scale: float | None = None,
                     out: torch.Tensor | None = None):
    """Run the kernel directly. q: (B, H, Nq, D), k/v: (B, H_kv, Nk, D), any strides.

    Returns (out (B, H, Nq, D) in q's memory layout unless `out` is given, lse (B, H, Nq) float32,
    natural log), not differentiable (the public functions are). Key j is visible to query i
    iff j <= i + causal_offset when causal. Rows that see no key get out = 0 and lse = +inf.
    No validation or fallback: the public functions do that.
    """
    if out is None:
        out = output_like(q, v)  # q's memory layout (see flash_attn_func)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    sm_scale = softmax_scale_or_default(scale, q.shape[-1])
    get_dispatcher().kernel_for(q, k, v, out, causal, own_only=True).forward(q, k, v, out, lse, sm_scale, causal,
                                                                              causal_offset)
    return out, lse


# The API's memos: a call's signature -> plan(q, k, v) -> out, one for inference calls and one for
# differentiable ones. A repeated call with the same signature launches at once (`repeat_call`).
inference_plans: dict[tuple, object] = {}
training_plans: dict[tuple, object] = {}
PLAN_MEMOS = [inference_plans, training_plans, decode_kernels.decode_plans]
MAX_PLANS = 4096


def _signature(q, k, v, causal: bool, scale, enable_gqa: bool, causal_offset: int = 0,
               deterministic: bool = False) -> tuple:
    """Everything validation and kernel choice depend on, for a (B, H, N, D) call (views of
    flash_attn_func's tensors included) with no mask and no dropout. Raises AttributeError for
    non-tensors. deterministic: a training call's backward must be bitwise repeatable."""
    # Each pointer's 16-byte alignment on its own: Triton specializes every pointer argument on it,
    # and the plan replays the compiled kernel of the first call with this signature.
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, causal, scale, enable_gqa, causal_offset, deterministic,
            not q.data_ptr() & 15, not k.data_ptr() & 15, not v.data_ptr() & 15)


def _memoizable(q, scale) -> bool:
    """Whether a call may use (or fill) the repeated-signature memo: not while torch.compile
    traces, a plain-number scale, and CPU tensors only while the interpreter is on."""
    if torch.compiler.is_compiling() or not (scale is None or type(scale) in (int, float)):
        return False
    return getattr(q, "is_cuda", False) or interpreter_enabled()


def repeat_call(q, k, v, causal: bool, scale, enable_gqa: bool, causal_offset: int = 0, deterministic: bool = False):
    """The host fast path: a call whose exact signature was planned before launches its kernels
    directly (no validation, no dispatcher lookup). None when the call is new or being traced by
    torch.compile: the full path handles those."""
    if torch.compiler.is_compiling():  # traced calls go through the registered op
        return None
    if scale is not None and type(scale) not in (int, float):  # (True == 1: never a planned scale)
        return None
    training = needs_autograd(q, k, v)
    try:
        signature = _signature(q, k, v, causal, scale, enable_gqa, causal_offset,
                               training and deterministic_backward(deterministic))
    except (AttributeError, TypeError):  # not tensors, or an unhashable scale: the full path decides
        return None
    plan = (training_plans if training else inference_plans).get(signature)
    if plan is None:
        return None
    if not q.is_cuda and not interpreter_enabled():  # planned under the interpreter, which is now off
        return None
    return plan(q, k, v)


def _remember(plans: dict, q, k, v, causal, scale, enable_gqa, causal_offset, plan, deterministic=False) -> None:
    if len(plans) > MAX_PLANS:  # many distinct signatures: stay bounded
        plans.clear()
    plans[_signature(q, k, v, causal, scale, enable_gqa, causal_offset, deterministic)] = plan


def run_planned(q, k, v, causal: bool, causal_offset: int, scale, enable_gqa: bool, deterministic: bool = False):
    """The planned kernel call on (B, H, N, D) views: output in q's memory layout, differentiable
    when needed. The call stores its plan for `repeat_call`. deterministic: as flash-attn's (torch's
    deterministic-algorithms setting asks for it too)."""
    sm_scale = softmax_scale_or_default(scale, q.shape[-1])
    own_only = causal and causal_offset != 0  # a vendor kernel's causal mask is top-left only
    training = needs_autograd(q, k, v)
    deterministic = training and deterministic_backward(deterministic)
    if torch.compiler.is_compiling():
        from autoflash import ops  # the registered custom op: autograd and torch.compile see one node

        return ops.attn_fwd(q, k, v, sm_scale, causal, causal_offset, deterministic)[0]
    memoize = _memoizable(q, scale)
    if training:
        plan = _training_plan(q, k, v, sm_scale, causal, causal_offset, own_only, deterministic)
        if memoize:
            _remember(training_plans, q, k, v, causal, scale, enable_gqa, causal_offset, plan, deterministic)
        return plan(q, k, v)
    if _decode_shaped(q, k, causal, causal_offset) and v.shape[-1] == q.shape[-1]:  # (decode: one head dim)
        def plan(q, k, v):
            return decode_kernels.short_query_attention(q, k, v, sm_scale, causal)
        if memoize:
            _remember(inference_plans, q, k, v, causal, scale, enable_gqa, causal_offset, plan)
        return plan(q, k, v)
    out = output_like(q, v)
    kernel = get_dispatcher().kernel_for(q, k, v, out, causal, own_only=own_only)
    if kernel.vendor:  # a vendor kernel won this problem: called as it is, now and next time
        how, vendor_out = _first_vendor_call(kernel, q, k, v, sm_scale, causal, causal_offset)
        if how == "took":
            out, plan, kernel = vendor_out, _vendor_plan(kernel, sm_scale, causal, causal_offset), None
        elif how == "other":  # the backend refused these tensors after all: plain SDPA's pick serves
            out, plan, kernel = vendor_out, _other_fused_plan(sm_scale, causal), None
        else:  # (torch's fused backends refused them too: the own kernel)
            kernel = get_dispatcher().kernel_for(q, k, v, out, causal, own_only=True)
    if kernel is not None and not kernel.vendor:
        if memoize:
            plan = _own_plan(kernel, q, k, v, out, sm_scale, causal, causal_offset)  # (runs this call)
        else:
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            kernel.forward(q, k, v, out, lse, sm_scale, causal, causal_offset)
    if memoize:
        _remember(inference_plans, q, k, v, causal, scale, enable_gqa, causal_offset, plan)
    return out


def _training_plan(q, k, v, sm_scale: float, causal: bool, causal_offset: int, own_only: bool,
                   deterministic: bool = False):
    """plan(q, k, v) -> differentiable out. The backward problem's winner decides the pair: SDPA's
    whole pair runs through torch autograd; an own pair, or one half SDPA's and the other autoflash's,
    runs through `EagerAttention`. deterministic: a backward variant whose gradients are bitwise
    repeatable (no float32 atomics; SDPA's backends decide their own determinism), after the forward
    that serves the call's forward problem: SDPA's with its log-sum-exp where an SDPA backend serves it
    and has that op (`ops.sdpa_forward_half`), else the own forward."""
    from autoflash import ops
    from autoflash.training import EagerAttention

    if deterministic and not own_only and (half := ops.sdpa_forward_half(q, k, v, causal)) is not None:
        pair = ops.training_pair(q, k, v, sm_scale, causal, causal_offset, winner=half, deterministic=True)

        def sdpa_forward_deterministic_backward(q, k, v):
            return EagerAttention.apply(q, k, v, pair)
        sdpa_forward_deterministic_backward.pair = pair  # (what serves, for a look from outside)
        return sdpa_forward_deterministic_backward

    pairs = []  # the own pair, built at its first use (not at all while a vendor pair serves)

    def own(q, k, v):
        if not pairs:
            pairs.append(ops.training_pair(q, k, v, sm_scale, causal, causal_offset, deterministic=deterministic))
        return EagerAttention.apply(q, k, v, pairs[0])

    winner = get_dispatcher().kernel_for(q, k, v, q, causal, op="bwd", own_only=own_only or deterministic,
                                         deterministic=deterministic)
    if not winner.vendor:
        return own
    if not winner.whole_pair:  # one half SDPA's (a refusal falls back to the own half inside)
        pair = ops.training_pair(q, k, v, sm_scale, causal, causal_offset, winner=winner)

        def half_vendor_pair(q, k, v):
            return EagerAttention.apply(q, k, v, pair)
        half_vendor_pair.pair = pair  # (what serves, for a look from outside)
        return half_vendor_pair

    state = [None]  # how this signature's first call was served (`_first_vendor_call`)

    def vendor_pair(q, k, v):
        how = state[0]
        if how is None:
            how, out = _first_vendor_call(winner, q, k, v, sm_scale, causal, causal_offset)
            state[0] = how
            return out if how != "own" else own(q, k, v)
        if how == "took":
            try:
                return winner.attention(q, k, v, sm_scale, causal, causal_offset)
            except RuntimeError as e:  # (it took the first call of this signature: this one goes on below)
                if not is_refusal(e):
                    raise
                how = "other"
        if how == "other":
            try:
                return other_fused_attention(q, k, v, sm_scale, causal)
            except RuntimeError as e:
                if not is_refusal(e):
                    raise
        return own(q, k, v)
    return vendor_pair


def _decode_shaped(q, k, causal: bool, causal_offset: int) -> bool:
    """A decoding step (`decode_kernels.decode_shaped`)."""
    return decode_kernels.decode_shaped(q.shape[2], k.shape[2], causal, causal_offset)


def _vendor_plan(kernel, sm_scale: float, causal: bool, causal_offset: int):
    """The plan of a signature a vendor kernel serves: `plan(q, k, v) -> out`, the kernel called as it is."""
    def plan(q, k, v):
        return kernel.attention(q, k, v, sm_scale, causal, causal_offset)
    return plan


def _first_vendor_call(kernel, q, k, v, sm_scale: float, causal: bool, causal_offset: int) -> tuple:
    """A signature's first call of the vendor kernel serving it: ("took", out); where its backend
    refuses the call after all, torch's other fused backends: ("other", out) (plain SDPA's pick there:
    cuDNN takes no training call of one query and one key); where they refuse too, ("own", None). Asked
    quietly (a refusal's warnings would tell of a path the call does not take); an out-of-memory or a
    device error is raised, never taken for a refusal."""
    with quiet_refusals():
        for how, call in (("took", lambda: kernel.attention(q, k, v, sm_scale, causal, causal_offset)),
                          ("other", lambda: other_fused_attention(q, k, v, sm_scale, causal))):
            try:
                return how, call()
            except RuntimeError as e:
                if not is_refusal(e):
                    raise
    return "own", None


def _other_fused_plan(sm_scale: float, causal: bool):
    """The plan of a signature the vendor winner refused and torch's flash or efficient backend took."""
    def plan(q, k, v):
        return other_fused_attention(q, k, v, sm_scale, causal)
    return plan


def _own_plan(kernel, q, k, v, out, sm_scale: float, causal: bool, causal_offset: int):
    """Run this call into `out` and return the plan of its signature, `plan(q, k, v) -> out`: the
    kernel launches through its module once, leaving a direct launcher of the compiled kernel."""
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    launch = bound = kernel.bind_forward(q, k, v, out, lse, sm_scale, causal, causal_offset)
    if launch is None:
        def launch(q, k, v, o, lse):
            kernel.forward(q, k, v, o, lse, sm_scale, causal, causal_offset)

    def plan(q, k, v):
        out = output_like(q, v)  # q's memory layout, as forward_with_lse
        # A fresh lse each call (discarded): a buffer kept by the plan could be freed while a kernel
        # on another stream, or a captured CUDA graph, still writes to it.
        launch(q, k, v, out, torch.empty(q.shape[:3], device=q.device, dtype=torch.float32))
        return out
    plan.launches_directly = bound is not None
    return plan


def reset() -> None:
    """Forget every plan, warning and loaded winner (tests; after tuning into the DB in-process)."""
    for plans in PLAN_MEMOS:
        plans.clear()
    warned_reasons.clear()
    get_dispatcher().reset()


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`: every call torch takes gets
    torch's answer (from the kernels where they serve it), every call torch refuses raises.

    Args:
        query: (*batch, seqlen_q, headdim), usually (batch_size, nheads, seqlen_q, headdim); any rank >= 2
        key: (*batch_k, seqlen_k, headdim); value: (*batch_v, seqlen_k, headdim). The batch dims of all
            three broadcast together as in torch (a (B*H, N, D) call, 5-D calls, K/V with one head or a
            batch of one); with enable_gqa, key/value heads (dim -3) divide the query's
        attn_mask: broadcastable to the scores; not served by the kernels (runs in torch SDPA)
        dropout_p: attention dropout, as torch applies it (whenever > 0): served by the kernels for
            0 < dropout_p < 1 without attn_mask (a fresh seed from torch's generator per call, the mask
            drawn again in the backward: `autoflash.dropout`); not torch's random stream, so the mask
            differs from torch SDPA's for the same seed
        is_causal: causal mask aligned top-left, as SDPA (query i sees keys j <= i)
        scale: softmax scale, default 1/sqrt(headdim): a number or what torch's float argument takes
            (a numpy scalar, a 0-d tensor)
        enable_gqa: allow key/value heads that divide the query's (grouped-query attention)
    torch's argument kinds hold: `scale` and `enable_gqa` are keyword-only, `is_causal` and
    `enable_gqa` bools (a TypeError otherwise). A call the kernels do not take runs torch's SDPA with
    these very arguments, so its answer, and its refusals (e.g. of a mask that does not broadcast), are
    torch's. With `torch.use_deterministic_algorithms(True)` the backward is bitwise repeatable.
    Returns:
        (*broadcast batch, seqlen_q, headdim), dtype of query. A 4-D output is in query's memory
        layout: a query that is a (batch, seqlen, heads, headdim) tensor seen through `.transpose(1, 2)`,
        as attention layers make them, gives an output laid out the same way, so the usual
        `out.transpose(1, 2).reshape(batch, seqlen, -1)` copies nothing (torch SDPA's CUDA backends do
        not return contiguous outputs either). A query with gaps between its elements gives a
        contiguous output.
    """
    if (attn_mask is None and type(dropout_p) in (int, float) and not dropout_p
            and type(is_causal) is bool and type(enable_gqa) is bool):
        out = repeat_call(query, key, value, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    check_sdpa_kinds(is_causal, enable_gqa)
    check_sdpa_tensors(query, key, value)
    p, sm_scale = check_sdpa_numbers(dropout_p, scale)
    batch = sdpa_batch(query, key, value, enable_gqa)
    if batch is None:
        reason = "an empty tensor (zero batch, heads, sequence or head dim)"
    else:
        reason = numbers_reason(p, sm_scale)
    if reason is None:
        q, k, v = kernel_views(query, key, value, batch)
        if p > 0 and attn_mask is None:  # (as torch, dropout whenever asked: the caller passes 0 in eval)
            from autoflash import dropout

            served, reason = dropout.serve(q, k, v, p, sm_scale, is_causal, 0, needs_autograd(q, k, v),
                                           deterministic_backward())
            if served is not None:
                out = served[0]
                return out if out.shape == (*batch, *out.shape[-2:]) else out.reshape(*batch, *out.shape[-2:])
        else:
            reason = unsupported_reason(q, k, v, attn_mask, p, sm_scale, training=needs_autograd(q, k, v))
    if reason is None:
        try:
            # (a numpy or tensor scale as the number torch reads: the plan memo takes plain numbers)
            out = repeat_call(q, k, v, is_causal, sm_scale, enable_gqa)
            if out is None:
                out = run_planned(q, k, v, is_causal, 0, sm_scale, enable_gqa)
            return out if out.shape == (*batch, *out.shape[-2:]) else out.reshape(*batch, *out.shape[-2:])
        except KernelCacheError as e:  # nowhere to write kernels: the call still gets its answer
            reason = f"no usable kernel cache ({e})"
    fall_back(reason)
    return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
