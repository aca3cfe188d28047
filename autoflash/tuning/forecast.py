"""What a larger budget is expected to gain, bounded by what the run measured.

Per problem, from its own candidates' times in the order they were measured (its search curve):
  - fewer than MIN_CANDIDATES: no estimate ("not enough data": a curve of one or two points says
    nothing of the next ones, and extrapolating one gave a 7x speed-up on an H100);
  - a search with nothing left to measure (its trial budget reached) gains nothing;
  - else the curve's gain over its last doubling of candidates (the best of the first half against
    the best of all) is taken for each further doubling the extra time buys, and the whole gain is
    capped by the spread the problem's candidates show (best against median: a search finds
    better kernels among those it has not measured, not kernels faster than its spread suggests)
    and by MAX_GAIN.
The extra candidates are the run's own measurement rate times the extra time, shared evenly by the
problems that can still gain (the rounds favour some: an even share does not promise more).
Pure: the run (`planned`) gathers the curves.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

MIN_CANDIDATES = 3  # own candidates a problem needs for an estimate
MAX_GAIN = 0.25  # no problem is expected more than this much faster, whatever its curve


@dataclasses.dataclass(frozen=True)
class Curve:
    label: str
    times_ms: tuple  # its own candidates' times, in measurement order (finite ones only)
    vendor_ms: float
    open: bool  # whether its search has candidates left to measure


@dataclasses.dataclass(frozen=True)
class Expected:
    label: str
    now_ms: float  # own best now
    expected_ms: float  # own best expected with the larger budget
    vendor_ms: float
    note: str = ""  # "not enough data" | "trial budget reached" | ""


def expected_best(times_ms, more: float) -> float:
    """The own best expected after `more` further candidates of a curve (see the module)."""
    n = len(times_ms)
    best = min(times_ms)
    if n < MIN_CANDIDATES or more <= 0:
        return best
    half = min(times_ms[: math.ceil(n / 2)])
    per_doubling = max(0.0, 1.0 - best / half)
    gain = 1.0 - (1.0 - per_doubling) ** math.log2((n + more) / n)
    spread = max(0.0, 1.0 - best / statistics.median(times_ms))
    return best * (1.0 - min(gain, spread, MAX_GAIN))


def forecast(curves: list[Curve], extra_s: float, own_per_s: float) -> list[Expected]:
    """Each problem's own best now and expected with `extra_s` more seconds, at `own_per_s` own
    candidates a second (the run's rate)."""
    growing = [c for c in curves if c.open and len(c.times_ms) >= MIN_CANDIDATES]
    more = max(0.0, extra_s) * max(0.0, own_per_s) / len(growing) if growing else 0.0
    out = []
    for c in curves:
        now = min(c.times_ms) if c.times_ms else math.inf
        if len(c.times_ms) < MIN_CANDIDATES:
            out.append(Expected(c.label, now, now, c.vendor_ms, "not enough data"))
        elif not c.open:
            out.append(Expected(c.label, now, now, c.vendor_ms, "trial budget reached"))
        else:
            out.append(Expected(c.label, now, expected_best(c.times_ms, more), c.vendor_ms))
    return out


def served_gain(expected: list[Expected]) -> tuple[float, list]:
    """(expected geomean speed-up of the served kernels, the problems it comes from). Served: the
    faster of own and vendor."""
    ratios, movers = [], []
    for e in expected:
        before, after = min(e.now_ms, e.vendor_ms), min(e.expected_ms, e.vendor_ms)
        if math.isfinite(before) and math.isfinite(after) and after > 0:
            ratios.append(before / after)
            if before / after > 1.005:
                movers.append(e)
    gain = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 1.0
    return gain, movers
