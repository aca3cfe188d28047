"""Host-side TMA set-up shared by the Gluon kernels (the Hopper forward, the backward's Gluon dK/dV):
4-D tensor descriptors over (B, H, N, D) views, the head-dim tile, and which tensors TMA can take."""

from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_LAYOUTS: dict = {}


def head_tile(head_dim):
    """The head-dim tile for a head dim: the smallest of 64, 128, 256 that holds it."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def tma_view(t, block_rows):
    """A 4-D TMA descriptor over (B, H, N, D) with a [1, 1, block_rows, head_tile(D)] box (the copy
    engine zero-fills and clips per (batch, head), so ragged tails stay inside their head, and a
    head dim under the tile reads zeros and writes nothing past D).

    Size-1 dims get a canonical stride (TMA checks every stride, even where it is never used).
    """
    shape = list(t.shape)
    strides = list(t.stride())
    for i in (2, 1, 0):
        if shape[i] == 1:
            strides[i] = strides[i + 1] * shape[i + 1]
    block = [1, 1, block_rows, head_tile(shape[3])]
    key = (block_rows, block[3], t.dtype)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[t.dtype])
    return TensorDescriptor(t, shape, strides, block, _LAYOUTS[key])


def stride_refusal(named_tensors) -> str | None:
    """Why TMA descriptors cannot cover these (name, (B, H, N, D) tensor) pairs, or None."""
    for name, t in named_tensors:
        if t.stride(3) != 1:
            return f"{name} last dim not contiguous"
        if t.data_ptr() % 16 != 0:
            return f"{name} base not 16-byte aligned"
        for i in range(3):
            if t.shape[i] > 1 and (t.stride(i) * t.element_size()) % 16 != 0:
                return f"{name} stride {i} not 16-byte aligned"
            if t.shape[i] > 1 and t.stride(i) == 0:
                return f"{name} has a broadcast (zero) stride"
    return None
