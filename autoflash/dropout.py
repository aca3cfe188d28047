"""Attention dropout in autoflash's own kernels (rendered with DROPOUT, `_shared/dropout_parts.jinja`),
as flash-attn 2's `dropout_p`: the softmax of the undropped scores (its log-sum-exp is the plain one),
then each probability kept with probability 1 - p and scaled by 1 / (1 - p): O = (P * Z / (1 - p)) V.

The keep mask Z is never stored. Each call draws a fresh seed from torch's generator (the default
CUDA generator for CUDA tensors, the CPU one otherwise: `torch.manual_seed` makes a run repeatable);
the kernels draw element (b, h, i, j) of Z from Philox at (seed, offset + ((b * H + h) * N_Q + i) * N_K
+ j), so the backward, given the same (seed, offset), regenerates the same Z whatever its tiles
(tests/test_dropout_kernels.py draws the same Z as a tensor with a kernel of its own).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DropoutArgs:
    """One call's dropout: `p` in (0, 1), the Philox `seed` and the counter `offset` of element (0, 0, 0, 0)."""

    p: float
    seed: int
    offset: int = 0

    def __post_init__(self):
        if not 0.0 <= self.p < 1.0:
            raise ValueError(f"the kernels' dropout takes 0 <= p < 1, got {self.p}")
        if not (0 <= self.seed < 1 << 63 and 0 <= self.offset < 1 << 62):
            raise ValueError(f"a dropout seed and offset are non-negative 63-bit integers, got {self.seed}, {self.offset}")

    def kernel_args(self) -> tuple:
        return (float(self.p), int(self.seed), int(self.offset))

    def shifted(self, elements: int) -> "DropoutArgs":
        """The same draw for a batch slice that starts `elements` score elements later (a chunked launch)."""
        return dataclasses.replace(self, offset=self.offset + elements)


def new_seed(device: torch.device | str | None = None) -> int:
    """A fresh seed from torch's generator for `device` (its default CUDA generator for a CUDA device):
    the same `torch.manual_seed` gives the same dropout. A 62-bit value at or above 2**32, so the
    kernels always see a 64-bit integer (a smaller one would build a kernel of its own)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        value = torch.empty((), dtype=torch.int64, device=device).random_(1 << 32, 1 << 62).item()
    else:
        value = torch.randint(1 << 32, 1 << 62, (), dtype=torch.int64).item()
    return int(value)


def draw(p: float, device=None) -> DropoutArgs:
    """The dropout of one call: p and a fresh seed (offset 0)."""
    return DropoutArgs(float(p), new_seed(device))
