"""Argument checks shared by every public function (the SDPA form, the flash-attn forms, varlen,
decode): malformed input is a `ValueError` (or torch's own `TypeError` where torch refuses an
argument's kind) naming the argument; a valid call the kernels cannot take gets its reason
(`unsupported_reason`), and the caller falls back with it.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from autoflash.device import interpreter_enabled, interpreter_numpy_problem
from autoflash.problem import LOG2E, unsupported_head_dim, unsupported_scale, unsupported_training_scale

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensors(q, k, v, names: tuple[str, str, str], layout: str) -> None:
    """Raise ValueError for malformed input. `layout` names the expected 4-D shape."""
    for t, name in zip((q, k, v), names):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
    qn, kn, vn = names
    if not q.dtype.is_floating_point:
        raise ValueError(f"{qn} must be a floating-point tensor (float16, bfloat16, float32, float64), got {q.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{qn}, {kn}, {vn} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{qn}, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{kn} and {vn} must agree in batch, heads and seqlen {layout}, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{qn} and {kn} must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{qn} and {kn} must have the same head dim, got {q.shape[3]} and {k.shape[3]}")


def check_heads(hq: int, hkv: int, gqa_allowed: bool, qn: str, kn: str) -> None:
    if hq == hkv:
        return
    if not gqa_allowed:
        raise ValueError(f"{qn} has {hq} heads but {kn} has {hkv}: pass enable_gqa=True for grouped-query attention")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{qn} heads ({hq}) must be a multiple of {kn} heads ({hkv}) for grouped-query attention")


def check_numbers(dropout_p, scale, scale_name: str) -> None:
    """dropout_p a probability, scale a finite number or a one-element 0-d tensor (or None): else
    ValueError. (Stricter than torch, which returns NaN for a NaN scale and takes True for 1.)"""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    if scale is None:
        return
    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and not scale.dtype.is_complex:
        value = float(scale)
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        value = float(scale)
    else:
        raise ValueError(f"{scale_name} must be a finite number or None, got {scale!r}")
    if not math.isfinite(value):
        raise ValueError(f"{scale_name} must be a finite number or None, got {scale!r}")


def check_sdpa_kinds(is_causal, enable_gqa) -> None:
    """torch's SDPA takes only bools for its flags (`is_causal=1` is a TypeError there): so does
    autoflash, so that code written against it runs unchanged on torch."""
    for name, value in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if type(value) is not bool:
            raise TypeError(f"attention(): argument '{name}' must be bool, not {type(value).__name__}")


def check_flag(name: str, value) -> bool:
    """A flash-attn flag: a bool (or 0/1)."""
    if isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r}")


def check_window(window_size) -> tuple[int, int]:
    """flash-attn's window_size=(left, right): ints, -1 (any negative) for unbounded."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    return tuple(-1 if w < 0 else int(w) for w in window_size)


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no capping), got {softcap!r}")
    return float(softcap)


_FLOAT32_MAX = 3.4e38


def softcap_out_of_range(softcap: float, sm_scale: float) -> str | None:
    """Why the kernels cannot cap scores at `softcap` with this softmax scale (their scale/softcap and
    softcap constants, in log2 units, must be float32 numbers), or None (0: no softcap)."""
    if softcap > 0 and not (sm_scale / softcap * 2 * LOG2E < _FLOAT32_MAX and softcap * LOG2E < _FLOAT32_MAX):
        return f"a softcap of {softcap!r} with a softmax scale of {sm_scale:.3g} is outside float32's range"
    return None


def check_alibi(alibi_slopes, batch: int, heads: int, device) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor) or tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
        raise ValueError(f"alibi_slopes must be a tensor of shape (nheads,) = ({heads},) or (batch_size, nheads) "
                         f"= ({batch}, {heads}), got {shape}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}, got {alibi_slopes.device}")


def unsupported_tensors(q) -> str | None:
    """Why no kernel takes tensors of q's dtype on q's device (every public function asks), or None."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32 are)"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreter_enabled()):
        return f"{q.device.type} tensors need a CUDA GPU (or CPU tensors with TRITON_INTERPRET=1)"
    if interpreter_enabled() and q.dtype == torch.bfloat16:
        return "bfloat16 is not computed correctly by Triton's CPU interpreter"
    return None


def odd_head_dim_on_gpu(q, *head_dims: int) -> str | None:
    """Head dims that are not a multiple of 8 run on the kernels (padded to their tile inside them) in
    the CPU interpreter, checked there against float64 (tests/test_odd_head_dims.py). On a GPU they are
    right too (the same test in bf16 on an H100) but slower than torch: its flash backend pads them and
    ran 1.04-4.2x the kernels' pointer-load tiles (d20-d130, untuned: docs/results/2026-12-07-h100-tuner-rate.md),
    so there torch serves them; AUTOFLASH_ODD_HEAD_DIMS=1 serves them on the kernels."""
    odd = [d for d in head_dims if d % 8]
    if odd and odd_head_dims_stay_torch(q.is_cuda):
        return (f"head dim {odd[0]} (not a multiple of 8) runs in torch on a GPU, whose flash backend pads it "
                "faster than the kernels' padded tiles (AUTOFLASH_ODD_HEAD_DIMS=1 serves them)")
    return None


def odd_head_dims_stay_torch(on_gpu: bool) -> bool:
    """Whether a call with a head dim that is not a multiple of 8 runs in torch (`odd_head_dim_on_gpu`)."""
    return on_gpu and os.environ.get("AUTOFLASH_ODD_HEAD_DIMS", "0").strip() != "1"


def unsupported_reason(q, k, v, attn_mask, dropout_p, scale, training: bool = False) -> str | None:
    """Why the kernels cannot take this (valid) call, or None when they can. `training`: the call
    needs the backward too."""
    if scale is not None and not float(scale) > 0:
        # The kernels scale scores after taking their row max, which needs a positive scale.
        return "a softmax scale that is not positive is not supported by the kernels"
    if scale is not None and (reason := unsupported_scale(float(scale))):
        return reason
    if attn_mask is not None:
        return "an explicit attn_mask is not supported by the kernels"
    if dropout_p > 0.0:
        return "dropout_p > 0 is not supported by the kernels"
    if reason := unsupported_tensors(q):
        return reason
    if interpreter_enabled() and (numpy_problem := interpreter_numpy_problem()):
        return numpy_problem
    d, dv = q.shape[-1], v.shape[-1]
    if reason := unsupported_head_dim(d):
        return reason
    if dv != d and (reason := unsupported_head_dim(dv)):  # (V's own head dim: MLA-like, e.g. 192/128)
        return f"value {reason}"
    if reason := odd_head_dim_on_gpu(q, d, dv):
        return reason
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "an empty tensor (zero batch, heads, sequence or head dim)"
    if training:
        sm_scale = softmax_scale_or_default(scale, d)
        return unsupported_training_scale(sm_scale, d, str(q.dtype).removeprefix("torch."))
    return None


def softmax_scale_or_default(scale, head_dim: int) -> float:
    """The softmax scale a call asked for, as a float, or the usual 1/sqrt(head_dim) when it asked for none."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def output_like(q, v):
    """An uninitialised output for a (B, H, N, D) call: q's shape with V's head dim, in q's memory
    layout (a (B, N, H, D) tensor seen through `.transpose(1, 2)` gives one laid out the same way)."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)
    shape = (*q.shape[:-1], v.shape[-1])
    if q.stride(-1) != 1:
        return q.new_empty(shape)
    order = sorted(range(q.dim() - 1), key=lambda i: -q.stride(i)) + [q.dim() - 1]  # outermost first
    out = q.new_empty([shape[i] for i in order])
    return out.permute([order.index(i) for i in range(q.dim())])


def needs_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def deterministic_backward(requested: bool = False) -> bool:
    """Whether a differentiable call's backward must be bitwise repeatable: asked for (flash-attn's
    `deterministic=True`) or required by torch (`torch.use_deterministic_algorithms(True)`)."""
    return bool(requested) or torch.are_deterministic_algorithms_enabled()
