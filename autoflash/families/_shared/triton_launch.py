"""Launch arguments the Triton kernels share, computed once."""

from __future__ import annotations

import torch
import triton


def head_block(head_dim: int) -> int:
    """BLOCK_D: the head dim padded to a power of two (at least 16, tl.dot's minimum); the kernels
    mask the columns past the real head dim."""
    return triton.next_power_of_2(max(head_dim, 16))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact for float32 inputs (the CPU checks' reference dtype), tf32
    otherwise (16-bit inputs are exact in it anyway)."""
    return "ieee" if dtype == torch.float32 else "tf32"
