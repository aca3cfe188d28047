"""The correctness gate: a candidate kernel is checked against the float64 reference before anyone
times it.

Correct first: every candidate's output is poisoned (NaN) before the run and compared with a
float64 reference on random, ragged inputs; it passes when its error is at most 2x torch SDPA's
own error in the same dtype (3x for gradients), never NaN. Kernels are built through codegen,
never through the public API: a backward candidate gets its O and LSE from the forward family's
default kernel, so the gate never touches the dispatcher, the DB or tune-on-miss.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from autoflash import codegen
from autoflash.codegen import Kernel
from autoflash.device import gpu_fingerprint, interpreter_enabled, launch_sm_count
from autoflash.problem import Shape
from autoflash.score_variant import PLAIN, ScoreVariant
from autoflash.tuning.score_candidates import computes_score_variants
from autoflash.tuning.yardsticks import yardstick
from autoflash.reference import (causal_offset_for, decode_reference, lse_error, make_inputs, output_grad, paged_cache, reference, reference_grads, rel_error,
                                 sdpa_error, sdpa_grads)
from autoflash.space import Variant, default_variant, load_space
from autoflash.training import training_pair_for
from autoflash.vendor import quiet_refusals
from autoflash.validate import output_like

GATE_FACTOR = 2.0  # candidate error <= GATE_FACTOR * SDPA's error (DESIGN.md §4)
GATE_FLOOR = {"float32": 1e-5, "float16": 5e-4, "bfloat16": 4e-3}  # relative L2: binds only when SDPA is ~exact
LSE_TOL = 1e-3  # absolute, natural-log units: LSE is accumulated in fp32 from the same inputs



@dataclasses.dataclass
class GateResult:
    passed: bool
    err: float  # worst relative L2 error of O over the gate's shapes
    sdpa_err: float  # SDPA's error on the same shapes
    lse_err: float
    detail: str = ""
    refused: bool = False  # a vendor backend with no kernel for any gate shape: nothing was checked


def gate_shapes(shape: Shape) -> list[Shape]:
    """Ragged shapes for the correctness gate of a problem (small; the kernel is length-agnostic)."""
    hk = 2 if shape.heads_q >= 2 * (shape.heads_q // shape.heads_kv) else 1
    hq = hk * (shape.heads_q // shape.heads_kv)
    base = dict(heads_q=hq, heads_kv=hk, head_dim=shape.head_dim, causal=shape.causal, dtype=shape.dtype,
                op=shape.op, head_dim_v=shape.head_dim_v, score=shape.score)
    # (batch, seqlen_q, seqlen_k): the short ragged shapes use 2 sequences to cover batch strides.
    if torch.cuda.is_available() and not interpreter_enabled():
        sizes = [(1, 1023, 1023), (2, 113, 203), (2, 203, 113), (1, 1, 37)]
    else:
        sizes = [(1, 37, 37), (2, 17, 64), (2, 64, 17)]
    return [Shape(batch=b, seqlen_q=nq, seqlen_k=nk, **base) for b, nq, nk in sizes]


def require_supported(kernel: Kernel, *tensors) -> None:
    """The gate and timing pass tensors the kernel must take: say so clearly when it cannot."""
    reason = kernel.unsupported(*tensors)
    if reason:
        raise ValueError(f"{kernel.family} variant cannot take these inputs: {reason}")


# What torch SDPA with one backend forced says on tensors that backend has no kernel for.
VENDOR_REFUSAL = "No available kernel"


def refused_by_vendor(kernel: Kernel, error: RuntimeError) -> bool:
    """A vendor backend that has no kernel for a gate shape (torch's flash backend refuses every
    causal call with Nq != Nk): the API serves such calls with the own kernel (it catches the same
    error), so the gate leaves that shape out instead of failing the backend for the whole problem."""
    return bool(kernel.vendor) and VENDOR_REFUSAL in str(error)


def refuses_value_dim(kernel: Kernel, q, v) -> bool:
    """A vendor backend that takes no V of another head dim than Q's (torch's flash backend, the SDPA
    halves of a training pair): it is no candidate for such a problem, as one refusing every gate
    shape (the dispatcher never serves it one either: its `unsupported` says so)."""
    return bool(kernel.vendor) and v.shape[-1] != q.shape[-1] and kernel.unsupported(q, q, v, q) is not None


def _all_refused(worst: GateResult, checked: int) -> GateResult:
    if checked:
        return worst
    return GateResult(False, math.inf, worst.sdpa_err, worst.lse_err, "the backend refused every gate shape",
                      refused=True)


def run_variant(kernel: Kernel, q, k, v, causal: bool, causal_offset: int, scale: float, score_args=None):
    """Launch one compiled variant on (B,H,N,D) inputs; returns (out, lse) (poisoned first).
    score_args: the attention variants' values (`ScoreArgs`) of a kernel rendered with them."""
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), device=q.device, dtype=q.dtype)  # (B, H, N, D_v)
    lse = torch.full(q.shape[:3], float("nan"), device=q.device, dtype=torch.float32)
    require_supported(kernel, q, k, v, out)
    kernel.forward(q, k, v, out, lse, scale, causal, causal_offset, **_score_kwargs(score_args))
    return out, lse


# The gate's variant values. A variant's values are runtime arguments (the same device code for any
# window or softcap), so the gate checks the code with values that show in the error on its short
# shapes: a window of the tuned size would cover every key of a 64-key gate shape (a kernel without it
# would pass), and a softcap of 50 barely bends unit-variance scores (~1e-3 of the output: below a
# half-precision bound). The gate's window reaches a quarter of the keys at most, its softcap 2 at most.
GATE_SOFTCAP_MAX = 2.0


def gate_score_args(shape: Shape, gs: Shape, device):
    """The `ScoreArgs` a candidate for `shape`'s problem is gated with on gate shape `gs` (None: plain)."""
    if shape.score is None:
        return None
    reach = max(1, gs.seqlen_k // 4)
    window = tuple(w if w < 0 else min(w, reach) for w in shape.score.window)
    softcap = min(shape.score.softcap, GATE_SOFTCAP_MAX)
    return shape.score.args(gs.heads_q, device, window=window, softcap=softcap)


def _score_kwargs(score_args) -> dict:
    """A launch's variant keyword (none for a plain call: vendor kernels take no such argument)."""
    return {} if score_args is None else {"score_args": score_args}


def variant_mismatch(kernel: Kernel, shape: Shape) -> str | None:
    """Why `kernel` cannot stand for `shape`'s problem: rendered with other attention variants than the
    problem's (a plain kernel would ignore a window: wrong answers), or None."""
    rendered, wanted = getattr(kernel, "score", PLAIN), shape.score_variant
    if rendered == wanted:
        return None
    return (f"{kernel.family} rendered for score variant {rendered.key or 'plain'!r}, the problem's is "
            f"{wanted.key or 'plain'!r}")


def _alignment(kernel: Kernel, gs: Shape, i: int) -> int:
    """The causal offset of gate shape i: every other one bottom-right, where the kernel takes it
    (a vendor kernel's mask is top-left only, and it is never served another)."""
    off = causal_offset_for(gs, "bottom_right" if i % 2 else "top_left")
    return off if kernel.takes_causal_offset(gs.causal, off) else causal_offset_for(gs, "top_left")


def check(kernel: Kernel, shape: Shape, device, seed: int = 0) -> GateResult:
    """The correctness gate of a forward, backward or decode kernel (by its op)."""
    if reason := variant_mismatch(kernel, shape):
        return GateResult(False, math.inf, math.nan, math.nan, reason)
    if kernel.op == "decode":
        return check_decode(kernel, shape, device, seed)
    gate = check_backward if kernel.op == "bwd" else check_forward
    if not kernel.vendor:
        return gate(kernel, shape, device, seed)
    with quiet_refusals():  # (one warning per reason per gate shape: the gate records the refusal itself)
        return gate(kernel, shape, device, seed)


def check_forward(kernel: Kernel, shape: Shape, device, seed: int = 0) -> GateResult:
    """The correctness gate over the ragged gate shapes of `shape`'s problem.

    Alternate shapes use (B,N,H,D)-strided inputs and bottom-right causal alignment, so one
    gate covers both layouts and both alignments the public API produces.
    """
    worst, checked = GateResult(True, 0.0, 0.0, 0.0), 0
    for i, gs in enumerate(gate_shapes(shape)):
        q, k, v = make_inputs(gs, device, seed=seed + i, layout="bnhd" if i % 2 else "bhnd")
        off = _alignment(kernel, gs, i)
        scale = 1.0 / math.sqrt(gs.head_dim)
        if refuses_value_dim(kernel, q, v):
            continue
        score = gate_score_args(shape, gs, device)
        # (before the launch: a kernel that writes into its inputs must not shape the kept reference)
        ref_out, ref_lse, s_err = yardstick(_yardstick_key("fwd", shape, gs, i, seed, off, q),
                                            lambda: _forward_yardstick(q, k, v, gs.causal, off, scale, score))
        try:
            out, lse = run_variant(kernel, q, k, v, gs.causal, off, scale, score)
        except RuntimeError as e:
            if not refused_by_vendor(kernel, e):
                raise
            continue
        checked += 1
        err = rel_error(out, ref_out)
        l_err = lse_error(lse, ref_lse) if kernel.has_lse else 0.0  # (a vendor kernel serves no LSE)
        bound = max(GATE_FACTOR * s_err, GATE_FLOOR[gs.dtype])
        ok = math.isfinite(err) and err <= bound and l_err <= LSE_TOL
        worst = GateResult(worst.passed and ok, max(worst.err, err if math.isfinite(err) else math.inf),
                           max(worst.sdpa_err, s_err), max(worst.lse_err, l_err), worst.detail)
        if not ok:
            worst.detail = (f"wrong result on {gs.label()}: rel err {err:.3g} (bound {bound:.3g}, "
                            f"SDPA {s_err:.3g}), lse err {l_err:.3g}")
            return worst
    return _all_refused(worst, checked)


def _yardstick_key(op: str, shape: Shape, gs: Shape, i: int, seed: int, off: int, q) -> tuple:
    """What a gate shape's reference and SDPA error depend on: the gate shape and its inputs (index:
    layout; seed), the causal offset, the device, and the problem's attention variants themselves
    (`gate_score_args` derives the gate's window from the problem's, which the short gate shape's own
    key may have dropped: a window of 4096 and none look alike there)."""
    return (op, gs, shape.score, i, seed, off, str(q.device))


def _forward_yardstick(q, k, v, causal: bool, off: int, scale: float, score) -> tuple:
    ref_out, ref_lse = reference(q, k, v, causal, off, scale, score=score)
    return ref_out, ref_lse, sdpa_error(q, k, v, causal, off, scale, ref_out, score)


GRAD_GATE_FACTOR = 3.0  # gradients: error <= 3x SDPA's own gradient error (DESIGN.md §4)


def forward_kernel_for_backward(q, k, v, causal: bool, forward: Variant | None = None,
                                score: ScoreVariant = PLAIN) -> Kernel:
    """What gives a backward variant its O and LSE: `forward` (an own forward variant, e.g. the
    problem's stored winner, what a training step serves) where it takes these tensors, else the
    forward family's default kernel, rendered with the attention variants `score`. Built through
    codegen (never the API: no dispatcher, DB or tune-on-miss)."""
    return _own_kernel("fwd", q, k, v, causal, forward, score)


def backward_kernel_for_pair(q, k, v, causal: bool, backward: Variant | None = None) -> Kernel:
    """The own backward a vendor forward is paired with: `backward` (the problem's stored own
    winner, what the dispatcher serves beside a vendor win) where it takes these tensors, else the
    backward family's default kernel. Built through codegen."""
    return _own_kernel("bwd", q, k, v, causal, backward)


def _own_kernel(op: str, q, k, v, causal: bool, stored: Variant | None, score: ScoreVariant = PLAIN) -> Kernel:
    """`stored` where it takes these tensors, else the op's default (own) variant, with pointer
    loads where the default's TMA cannot take them; rendered with the attention variants `score`
    (a stored variant of a family that computes none is passed over)."""
    # (an output's shape and strides for `unsupported`: q where V has its head dim, as always)
    out = q if v.shape[3] == q.shape[3] else q.new_empty((*q.shape[:3], v.shape[3]))
    head_dim_v = None if v.shape[3] == q.shape[3] else v.shape[3]
    if stored is not None and (score.plain or computes_score_variants(stored, score)):
        kernel = codegen.load_for(stored, head_dim_v, score)
        if not kernel.unsupported(q, k, v, out):
            return kernel
    shape = Shape(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q=q.shape[2],
                  seqlen_k=k.shape[2], head_dim=q.shape[3], causal=causal, dtype=str(q.dtype)[6:], op=op,
                  head_dim_v=v.shape[3])
    device = gpu_fingerprint(q.device.index if q.is_cuda else None)
    variant = default_variant(op, shape.problem, device)
    kernel = codegen.load_for(variant, shape.head_dim_v, score)
    knobs = variant.as_dict()
    if kernel.unsupported(q, k, v, out) and "LOADS" in knobs:
        fallback = {"LOADS": "pointer", **({"WARP_SPECIALIZE": False} if "WARP_SPECIALIZE" in knobs else {})}
        kernel = codegen.load_for(load_space(variant.family).nearest_valid(variant.replace(**fallback), shape.problem,
                                                                           device), shape.head_dim_v, score)
    return kernel


# The own kernels a backward candidate is paired with, set in a tuning worker for the problem at
# hand (`Sandbox.context`): its stored own forward winner (what a training step serves with an own
# backward) and own backward winner (what serves beside a vendor forward); None: the defaults.
training_forward: Variant | None = None
training_backward: Variant | None = None


def candidate_pair(kernel: Kernel, q, k, v, causal: bool, offset: int, scale: float):
    """The training pair a backward candidate stands for (`training.training_pair_for`), its own
    halves `training_forward`/`training_backward`; None for SDPA's whole pair."""
    return training_pair_for(kernel, lambda: forward_kernel_for_backward(q, k, v, causal, training_forward),
                             lambda: backward_kernel_for_pair(q, k, v, causal, training_backward), scale, causal, offset)


def forward_for_backward(q, k, v, causal: bool, offset: int, scale: float, score_args=None):
    """(out, lse) from `forward_kernel_for_backward`: what a backward variant consumes (with the
    attention variants' values `score_args`, its forward rendered with them)."""
    out = output_like(q, v)  # (B, H, N, D_v) in q's memory layout, as the API hands the backward its O
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    variant = PLAIN if score_args is None else score_args.variant
    forward_kernel_for_backward(q, k, v, causal, score=variant).forward(q, k, v, out, lse, scale, causal, offset,
                                                                        **_score_kwargs(score_args))
    return out, lse


def check_backward(kernel: Kernel, shape: Shape, device, seed: int = 0) -> GateResult:
    """Gradient gate: dQ, dK, dV (poisoned first) vs float64 autograd, each within 3x SDPA's error."""
    worst, checked = GateResult(True, 0.0, 0.0, 0.0), 0
    for i, gs in enumerate(gate_shapes(shape)):
        q, k, v = make_inputs(gs, device, seed=seed + i, layout="bnhd" if i % 2 else "bhnd")
        grad = output_grad(gs, device, seed=seed + 100 + i)
        off = _alignment(kernel, gs, i)
        scale = 1.0 / math.sqrt(gs.head_dim)
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        score = gate_score_args(shape, gs, device)
        if refuses_value_dim(kernel, q, v):
            continue
        require_supported(kernel, q, k, v, grad)
        refs, theirs = yardstick(_yardstick_key("bwd", shape, gs, i, seed, off, q), lambda: (  # (before the launch)
            reference_grads(q, k, v, grad, gs.causal, off, scale, score=score),
            sdpa_grads(q, k, v, grad, gs.causal, off, scale, score)))
        try:
            if kernel.vendor and not kernel.whole_pair:  # half SDPA's, half autoflash's: the pair as served
                pair = candidate_pair(kernel, q, k, v, gs.causal, off, scale)
                grads = pair.backward(q, k, v, *pair.forward(q, k, v), grad)
            elif kernel.vendor:  # SDPA's whole pair: its own forward through autograd (no O or LSE given)
                kernel.backward(q, k, v, None, None, grad, *grads, scale, gs.causal, off)
            else:
                out, lse = forward_for_backward(q, k, v, gs.causal, off, scale, score)
                kernel.backward(q, k, v, out, lse, grad, *grads, scale, gs.causal, off, **_score_kwargs(score))
        except RuntimeError as e:
            if not refused_by_vendor(kernel, e):
                raise
            continue
        checked += 1
        for name, mine, ref, sd in zip(("dq", "dk", "dv"), grads, refs, theirs):
            err, s_err = rel_error(mine, ref), rel_error(sd, ref)
            bound = max(GRAD_GATE_FACTOR * s_err, GATE_FLOOR[gs.dtype])
            ok = math.isfinite(err) and err <= bound
            worst = GateResult(worst.passed and ok, max(worst.err, err if math.isfinite(err) else math.inf),
                               max(worst.sdpa_err, s_err), 0.0, worst.detail)
            if not ok:
                worst.detail = (f"wrong {name} on {gs.label()}: rel err {err:.3g} (bound {bound:.3g}, "
                                f"SDPA {s_err:.3g})")
                return worst
    return _all_refused(worst, checked)


# ---------------------------------------------------------------------------- decode
# The correctness gate of a decode kernel: ragged cache lengths in one batch (0, 1, 17, ... up
# to the full cache), a contiguous cache and a paged one behind a shuffled block table, GQA, the
# causal mask bottom-right over a few new tokens, against the float64 reference
# (`reference.decode_reference`), within 2x the error of the same computation in float32 with the
# output rounded to the input dtype (the yardstick SDPA's error is for the other ops). O and LSE are
# poisoned (NaN) before the launch; rows that see no key must give O = 0 and LSE = +inf.


def decode_gate_cases(shape: Shape, device) -> list[dict]:
    """Small ragged decode calls of `shape`'s problem: its head dim, dtype, GQA group, new tokens."""
    group = shape.heads_q // shape.heads_kv
    q_len = max(1, min(shape.seqlen_q, 16))
    on_gpu = torch.device(device).type == "cuda" and not interpreter_enabled()
    capacity, lengths, page = (4111, [0, 1, 17, 4095, 4111], 64) if on_gpu else (64, [0, 1, 17, 64], 16)
    page = shape.page or page  # a paged problem is gated on its own block size
    g = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, shape.dtype)

    def rand(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype)
    batch, kv_heads, d = len(lengths), 2, shape.head_dim
    q = rand(batch, q_len, kv_heads * group, d)
    k, v = rand(batch, capacity, kv_heads, d), rand(batch, capacity, kv_heads, d)
    seqlens = torch.tensor(lengths, device=device, dtype=torch.int32)
    k_pages, v_pages, table = paged_cache(k, v, page, g)
    # the new tokens' keys are the last q_len of each sequence (bottom-right causal): lengths >= q_len or 0
    return [dict(q=q, k=k, v=v, seqlens=seqlens, table=None),
            dict(q=q, k=k_pages, v=v_pages, seqlens=seqlens, table=table)]


def check_decode(kernel: Kernel, shape: Shape, device, seed: int = 0) -> GateResult:
    worst = GateResult(True, 0.0, 0.0, 0.0)
    scale = 1.0 / math.sqrt(shape.head_dim)
    for case in decode_gate_cases(shape, device):
        q, k, v, seqlens, table = case["q"], case["k"], case["v"], case["seqlens"], case["table"]
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device, dtype=torch.float32)
        kernel.decode(q, k, v, out, lse, scale, shape.causal, seqlens, table, sm_count=launch_sm_count(q.device))
        ref, ref_lse = decode_reference(q.double(), k.double(), v.double(), seqlens, table, scale, shape.causal)
        yard, _ = decode_reference(q, k, v, seqlens, table, scale, shape.causal)  # float32 math, dtype out
        err, y_err = rel_error(out, ref), rel_error(yard, ref)
        finite = torch.isfinite(ref_lse)
        l_err = float((lse[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0
        empty_ok = bool((lse[~finite] == float("inf")).all()) and not bool(out.isnan().any())
        bound = max(GATE_FACTOR * y_err, GATE_FLOOR[shape.dtype])
        ok = math.isfinite(err) and err <= bound and l_err <= LSE_TOL and empty_ok
        worst = GateResult(worst.passed and ok, max(worst.err, err if math.isfinite(err) else math.inf),
                           max(worst.sdpa_err, y_err), max(worst.lse_err, l_err), worst.detail)
        if not ok:
            worst.detail = (f"wrong decode result ({'paged' if table is not None else 'contiguous'} cache, lengths "
                            f"{seqlens.tolist()}): rel err {err:.3g} (bound {bound:.3g}), lse err {l_err:.3g}, "
                            f"empty rows {'ok' if empty_ok else 'wrong'}")
            return worst
    return worst
