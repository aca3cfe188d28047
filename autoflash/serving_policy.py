"""Which serves a problem: autoflash's own kernels or SDPA-cuDNN, decided by measured evidence.

A tuned model must never be slower than plain torch SDPA. Tuned problems settle that by measurement
(SDPA's backends are candidates; every winner row also holds the SDPA-cuDNN time measured in its
run). For the rest the policy is:
- the measured own/cuDNN ratio of the problem itself, else of the nearest measured problem (same op,
  dtype, causality and page; distance in head dim, GQA group, sequence lengths and occupancy, each in
  factors of 2, at most `EVIDENCE_MAX_DISTANCE`), decides;
- the own kernel serves only where that evidence says it is faster by more than the vendor tie
  margin; with no evidence (an untuned GPU, a region nothing near was measured in) SDPA-cuDNN serves.
SDPA-cuDNN serves only where it takes the call (a GPU, float16/bfloat16, top-left causal, no call
that needs the log-sum-exp); elsewhere the own kernels serve as before (and in the CPU interpreter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoflash.problem import Problem, distance_between
from autoflash.space import InvalidVariant, Variant, load_space
from autoflash.vendor import tie_margin

# Evidence further than this (summed factors of 2 across head dim, group, lengths, occupancy) says
# nothing about a problem: SDPA-cuDNN serves it until it is tuned.
EVIDENCE_MAX_DISTANCE = 3.0
VENDOR_FAMILIES = {"fwd": "sdpa_fwd", "bwd": "sdpa_bwd"}


@dataclass
class Measured:
    own_ms: float = math.inf  # the best own kernel (or own pair) measured for the problem
    cudnn_ms: float = math.inf  # SDPA-cuDNN (its whole pair for a backward problem), same run
    own_spread: float = 0.0  # the best own kernel's round-to-round spread (widens the tie margin)

    @property
    def complete(self) -> bool:
        return math.isfinite(self.own_ms) and math.isfinite(self.cudnn_ms)

    def own_faster(self) -> bool:
        return self.own_ms * (1 + tie_margin(self.own_spread)) < self.cudnn_ms


class Evidence:
    """Own and SDPA-cuDNN times per problem key, from the winner rows of one GPU."""

    def __init__(self):
        self.measured: dict[str, Measured] = {}

    def add(self, problem: Problem, variant: Variant, row: dict) -> None:
        entry = self.measured.setdefault(problem.key, Measured())
        median, cudnn = _number(row.get("median_ms")), _number(row.get("sdpa_cudnn_ms"))
        if load_space(variant.family).vendor:
            knobs = variant.as_dict()
            if knobs.get("BACKEND") == "cudnn" and knobs.get("FORWARD", "sdpa") == knobs.get("BACKWARD", "sdpa") == "sdpa":
                entry.cudnn_ms = min(entry.cudnn_ms, median)
        elif median < entry.own_ms:
            entry.own_ms, entry.own_spread = median, _number(row.get("spread"), zero=True)
        entry.cudnn_ms = min(entry.cudnn_ms, cudnn)

    def nearest(self, problem: Problem) -> tuple[str, Measured] | None:
        """The problem's own measurement, else the nearest complete one within reach, else None."""
        exact = self.measured.get(problem.key)
        if exact is not None and exact.complete:
            return problem.key, exact
        best, best_distance = None, math.inf
        for key, entry in self.measured.items():
            if not entry.complete:
                continue
            p = Problem.from_key(key)
            if (p.op, p.dtype, p.causal, p.page, p.score_variant, p.head_dim_v) != (
                    problem.op, problem.dtype, problem.causal, problem.page, problem.score_variant,
                    problem.head_dim_v):  # (a value head dim of its own: evidence only from the same one)
                continue
            distance = distance_between(p, problem)
            if distance < best_distance or (distance == best_distance and key < best[0]):
                best, best_distance = (key, entry), distance
        return best if best_distance <= EVIDENCE_MAX_DISTANCE else None

    def own_faster(self, problem: Problem) -> tuple[bool, str]:
        """(whether the own kernels serve this problem, why) under the policy above."""
        found = self.nearest(problem)
        if found is None:
            return False, "no measurement near: SDPA-cuDNN"
        key, entry = found
        ratio = entry.cudnn_ms / entry.own_ms
        where = "measured" if key == problem.key else f"nearest measured {key}"
        return entry.own_faster(), f"{where}: own {ratio:.2f}x SDPA-cuDNN"


def cudnn_variant(problem: Problem, device) -> Variant | None:
    """SDPA-cuDNN (its whole training pair for a backward problem) where it is a valid candidate for
    this problem on this device (a GPU, half precision), else None."""
    family = VENDOR_FAMILIES.get(problem.op)
    if family is None or problem.score_variant is not None:  # (SDPA computes no attention variants)
        return None
    space = load_space(family)
    knobs = {"BACKEND": "cudnn", **({"FORWARD": "sdpa", "BACKWARD": "sdpa"} if problem.op == "bwd" else {})}
    try:
        return space.validate(knobs, problem, device)
    except (InvalidVariant, ValueError):
        return None


def _number(value, zero: bool = False) -> float:
    """A positive finite number, else inf (zero: else 0.0, for a spread)."""
    if isinstance(value, (int, float)) and value > 0 and math.isfinite(value):
        return float(value)
    return 0.0 if zero else math.inf
