"""Vendor kernel families: torch SDPA with one backend forced (cuDNN, flash, efficient; flash and
math on the CPU), behind the same contract as autoflash's generated kernels (`codegen.Kernel`), so
the tuner gates and times them like any family and the dispatcher can serve one as a problem's
winner: a tuned model is never slower than torch SDPA was.

What differs from a generated kernel, and who checks it:
- `forward` gives no log-sum-exp (`has_lse = False`): the gate does not compare one, and a call
  that needs it (a forward feeding autoflash's backward) is served by the best own kernel instead;
- SDPA's causal mask is aligned top-left (`takes_causal_offset`): calls with another alignment are
  served by an own kernel;
- a backward problem's vendor winner is a training pair chosen on forward + backward time, its
  halves named by the sdpa_bwd knobs FORWARD and BACKWARD: both "sdpa" is the backend's forward and
  backward through torch autograd; otherwise one half is SDPA's (its forward with the log-sum-exp,
  `attention_with_lse`, or its backward from a given O and log-sum-exp, `gradients_from`: the
  backend's own ATen ops, same convention as autoflash's LSE, natural log) and the other is
  autoflash's own served kernel (`training.training_pair_for` puts them together).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.nn.functional as F

from autoflash.reference import sdpa_backend
from autoflash.space import Variant


def _sdpa_switches():
    """(backend, read, write) of torch's global SDPA backend switches, as
    `torch.nn.attention.sdpa_kernel` sets them; None where this torch names them otherwise."""
    try:
        from torch.nn.attention import SDPBackend, _backend_names

        return tuple((getattr(SDPBackend, member), getattr(torch._C, f"_get_{name}_sdp_enabled"),
                      getattr(torch._C, f"_set_sdp_use_{name}")) for name, member in _backend_names.items())
    except (ImportError, AttributeError):
        return None


# An own kernel serves in place of a vendor kernel (what the user had before autoflash) only when it
# measured faster by more than this fraction; a tie goes to the vendor kernel. The same cuDNN kernel
# timed twice in one process on an H200 differed by under 0.5% in most cells and by up to 4% in one
# (docs/results/2026-12-02-h200-gluon-head-dims.md): a kernel "faster" by less than 2% may be slower.
VENDOR_TIE_MARGIN = 0.02
# A lead inside the measurement's own round-to-round spread is noise too: an H100 pick stored an own
# forward with cuDNN's backward 2.7% ahead of cuDNN's whole pair, with a 3.5% spread, and the bench
# measured it 3% behind. Spreads above this cap are a noisy run's, not a kernel's: they do not widen
# the margin further (interleaved timings of one kernel spread by 1-4% on H100/H200).
MAX_SPREAD_MARGIN = 0.05


def tie_margin(spread=None) -> float:
    """The fraction by which own code (an own kernel, or a vendor pair with an own half) must beat
    an all-vendor kernel to serve in its place: the tie margin, or the own candidate's round-to-round
    spread where that is wider, up to MAX_SPREAD_MARGIN (the tuner's pick, the dispatcher's ranking
    and the serving policy all take the own row's spread, so they agree)."""
    finite = isinstance(spread, (int, float)) and math.isfinite(spread) and spread >= 0
    return max(VENDOR_TIE_MARGIN, min(spread if finite else 0.0, MAX_SPREAD_MARGIN))


def runs_own_half(knobs) -> bool:
    """Whether a vendor training pair's knobs name one of autoflash's kernels as a half (FORWARD or
    BACKWARD "autoflash"): such a pair is partly own code, and the tie margin holds it to the same bar
    as an own kernel (an H100 pick stored cuDNN's backward after an own forward at 1.01x cuDNN's whole
    pair, inside its 2.3% spread; the bench then measured it at 0.97x)."""
    return isinstance(knobs, dict) and "autoflash" in (knobs.get("FORWARD"), knobs.get("BACKWARD"))


# sdpa_kernel's own host path (a generator context manager that looks every switch up by name)
# cost about 100 us per call on a CPU where torch SDPA's dispatch costs 20: a model whose
# attention a vendor kernel serves paid it in every layer. The same switches, read and written
# directly, cost a few microseconds (tests/test_vendor.py holds the two to the same effect).
_SWITCHES = _sdpa_switches()
FALLBACK_BACKENDS = (sdpa_backend("flash"), sdpa_backend("efficient"))  # (torch's fused backends after cuDNN: `other_fused_attention`)


class SdpaKernel:
    """torch SDPA with `variant["BACKEND"]` forced, as a kernel family of `variant.op`."""

    vendor = True
    has_lse = False
    uses_tma = False
    __slots__ = ("variant", "op", "family", "backend", "_backend", "forward_from", "backward_from")

    def __init__(self, variant: Variant):
        self.variant, self.op, self.family = variant, variant.op, variant.family
        self.backend = variant["BACKEND"]
        self._backend = sdpa_backend(self.backend)
        knobs = variant.as_dict()  # (a forward variant has neither knob: SDPA's all through)
        self.forward_from, self.backward_from = knobs.get("FORWARD", "sdpa"), knobs.get("BACKWARD", "sdpa")

    @property
    def whole_pair(self) -> bool:
        """Whether this variant is SDPA's forward and backward together (through torch autograd)."""
        return self.forward_from == "sdpa" and self.backward_from == "sdpa"

    @staticmethod
    def takes_causal_offset(causal: bool, causal_offset: int) -> bool:
        """SDPA's is_causal is the top-left mask: other alignments are not this family's."""
        return not causal or causal_offset == 0

    def unsupported(self, q, k, v, o) -> str | None:
        offered = ("cudnn", "flash", "efficient") if q.is_cuda else ("flash", "math")  # as sdpa_*.toml
        if self.backend not in offered:
            return f"the {self.backend} backend is not offered on {q.device.type} tensors here"
        if self.backend != "math" and any(t.stride(-1) != 1 or t.data_ptr() % 16 for t in (q, k, v)):
            return "torch's fused SDPA backends need a unit last stride and 16-byte aligned tensors"
        if v.shape[-1] != q.shape[-1]:  # (MLA-like: torch's flash backend refuses it, cuDNN and efficient take it)
            if self.backend == "flash":
                return "torch's flash backend needs V of the query's head dim"
            if not self.whole_pair:
                return "the SDPA halves of a training pair are wired for one head dim"
        return None

    def attention(self, q, k, v, sm_scale: float, causal: bool, causal_offset: int = 0) -> torch.Tensor:
        """The output (B, H, Nq, D) of SDPA on this backend. Differentiable through torch autograd."""
        if not self.takes_causal_offset(causal, causal_offset):
            raise ValueError(f"torch SDPA's causal mask is top-left; causal_offset {causal_offset} is not")
        with only_backend(self._backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, q, k, v, o, lse, sm_scale: float, causal: bool, causal_offset: int) -> None:
        """o written in place (a copy of SDPA's output); lse is left as it is (`has_lse`)."""
        o.copy_(self.attention(q, k, v, sm_scale, causal, causal_offset))

    def backward(self, q, k, v, o, lse, do, dq, dk, dv, sm_scale: float, causal: bool, causal_offset: int) -> None:
        """dq, dk, dv into the given tensors: of SDPA's own forward on this backend where this variant
        is the whole pair (o and lse are not used), else SDPA's backward from o and lse."""
        if self.backward_from != "sdpa":
            raise ValueError(f"{self}: its backward is autoflash's own (see training.training_pair_for)")
        if self.whole_pair:
            grads = self.gradients(q, k, v, do, sm_scale, causal, causal_offset)
        else:
            grads = self.gradients_from(q, k, v, o, lse, do, sm_scale, causal)
        for grad, value in zip((dq, dk, dv), grads):
            grad.copy_(value)

    def attention_with_lse(self, q, k, v, sm_scale: float, causal: bool):
        """(out, lse): SDPA's forward on this backend by its ATen op, with its log-sum-exp as a
        (B, H, Nq) float32 view with unit last stride (what autoflash's backward reads)."""
        if self.backend == "cudnn":
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=sm_scale)[:2]
        elif self.backend == "flash" and not q.is_cuda:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=sm_scale)
        else:
            raise ValueError(f"{self}: no forward with a log-sum-exp is wired for this backend")
        lse = lse.reshape(q.shape[:3])  # (cuDNN's is (B, H, Nq, 1))
        return out, lse if lse.stride(-1) == 1 else lse.contiguous()

    def gradients_from(self, q, k, v, out, lse, do, sm_scale: float, causal: bool):
        """(dq, dk, dv) by this backend's backward ATen op from a given out and lse (B, H, Nq)
        (any forward's: the convention is the same), K/V with H_kv heads taken as they are."""
        n_q, n_k = q.shape[2], k.shape[2]
        if do.stride() != out.stride():  # (cuDNN reads the gradient with the output's strides: seen
            do = torch.empty_like(out).copy_(do)  # to crash the process on an H200 when they differ)
        if self.backend == "cudnn":
            if n_q == n_k == 1:  # refused by cuDNN's frontend ("s_q = s_kv = 1 is not supported")
                raise RuntimeError("cuDNN attention has no backward for one query and one key")
            none = torch.empty(0, device=q.device)  # (dropout's RNG state: no dropout)
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, out, lse.unsqueeze(-1), none, none, None, None, None, n_q, n_k, 0.0, causal, scale=sm_scale)
        if self.backend == "flash" and not q.is_cuda:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, out, lse, 0.0, causal, scale=sm_scale)
        raise ValueError(f"{self}: no backward from a given log-sum-exp is wired for this backend")

    def gradients(self, q, k, v, do, sm_scale: float, causal: bool, causal_offset: int = 0):
        """(dq, dk, dv) by forward + backward through torch autograd: what a training step runs."""
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out = self.attention(*leaves, sm_scale, causal, causal_offset)
            return torch.autograd.grad(out, leaves, do)

    def bind_forward(self, q, k, v, o, lse, sm_scale: float, causal: bool, causal_offset: int):
        return None  # SDPA has its own host path

    def compile_for(self, q, k, v, causal: bool, causal_offset: int, page: int | None = None,
                    score_args=None) -> None:
        pass  # nothing to build (and no attention variants: a variant problem has no vendor candidates)

    def __repr__(self) -> str:
        return f"SdpaKernel({self.family}: {self.backend})"


# What torch warns while a forced backend looks for a kernel it lacks: the refusal (a RuntimeError) is
# the answer, and autoflash serves the call otherwise; the warnings would only tell users of a path
# their call did not take.
SDPA_REFUSAL_WARNINGS = (r"(Flash attention|Memory efficient|Memory Efficient attention|cuDNN attention|Flash Attention)"
                         r".*(not used because|runtime disabled|does not support)|For dense input, both fused kernels")


@contextlib.contextmanager
def quiet_refusals():
    """torch's refusal warnings (`SDPA_REFUSAL_WARNINGS`) are not shown inside."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SDPA_REFUSAL_WARNINGS, category=UserWarning)
        yield


def is_refusal(error: RuntimeError) -> bool:
    """Whether a RuntimeError from an SDPA backend is its refusal of the call (torch's "No available
    kernel", a cuDNN frontend error), which another backend may take, rather than an out-of-memory or
    a device error, which the caller must see."""
    return not isinstance(error, torch.OutOfMemoryError) and type(error).__name__ != "AcceleratorError" \
        and "CUDA error" not in str(error)


def other_fused_attention(q, k, v, sm_scale: float, causal: bool) -> torch.Tensor:
    """SDPA on torch's flash or memory-efficient backend (torch's own pick between them), for a call
    the backend serving it refused after all (cuDNN takes no training call of one query and one key):
    what plain SDPA runs there, so such a call is never slower than plain SDPA. Differentiable through
    torch autograd; RuntimeError where both refuse too (torch warns then: a first call is asked inside
    `quiet_refusals`)."""
    with only_backend(FALLBACK_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


class only_backend:
    """`with only_backend(b):` torch SDPA may use backend b alone (or the backends of a tuple b), as
    with `torch.nn.attention.sdpa_kernel([b])`: the same global switches, restored on exit."""

    __slots__ = ("backends", "previous", "fallback")

    def __init__(self, backend):
        self.backends = tuple(backend) if isinstance(backend, (tuple, list)) else (backend,)
        self.previous, self.fallback = None, None

    def __enter__(self):
        if _SWITCHES is None:
            from torch.nn.attention import sdpa_kernel

            self.fallback = sdpa_kernel(list(self.backends))
            return self.fallback.__enter__()
        # Only the switches that change are written, and only those restored (a model's layers
        # call this per attention: each torch._C call is host time).
        changed = []
        for backend, read, write in _SWITCHES:
            was, wanted = read(), backend in self.backends
            if was != wanted:
                write(wanted)
                changed.append((write, was))
        self.previous = changed
        return self

    def __exit__(self, *exc):
        if self.fallback is not None:
            return self.fallback.__exit__(*exc)
        for write, was in self.previous:
            write(was)
        return False
