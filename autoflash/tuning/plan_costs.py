"""What the tuning planner (`tuning/planner.py`) expects each kind of work to cost: priors, replaced
by the durations a run measures, and the constants behind a problem's extra time where its calls
are long or its pick is decided by its trials. Pure: no kernels, no clock."""

from __future__ import annotations

import dataclasses
import math

# `timing._device_ms_interleaved`: a timing makes this many calls at least (10 repetitions, 9 to
# estimate the call and its host time, a warm-up) and lasts ~WALL_PER_TIMING x rep_ms where calls are
# short; where they are long, the calls' time is what counts (`Planner.extra_s`).
CALLS_PER_TIMING = 20
WALL_PER_TIMING = 1.5
# Timings of a problem's vendor pass: each vendor candidate is timed twice (a short first look, then in
# full), 3 SDPA backends for a forward problem, 5 training pairs for a backward one.
VENDOR_TIMINGS = {"fwd": 6, "bwd": 10}
# A pick whose trials put SDPA's whole kernel this far ahead of every own candidate is decided: it
# re-measures DECIDED_PICK_TIMINGS methods once (`winner_rows.vendor_decided`: SDPA's, the best with
# own code, the best own kernel, the default; and SDPA's flash column, the cuDNN one being SDPA's).
DECIDED_MARGIN = 0.10
DECIDED_PICK_TIMINGS = 4
# FLOP/s a problem's call is assumed to run at until its vendor pass measures it (an H100's flash
# attention in bf16 runs ~300-600 TFLOP/s: the low end, so an unmeasured problem is not costed short).
NOMINAL_FLOPS_PER_S = 300e12


@dataclasses.dataclass
class Costs:
    """Seconds of each kind of work: priors (an H100, Triton 3.6: a compile batch ~8 s, vendor
    backends ~3 s a forward problem), replaced by what the run measures as it goes. vendor_s and
    pick_s are a problem's whose calls are short: the planner adds the time of long calls
    (`Planner.extra_s`), and takes it off a measured duration before it is observed."""

    vendor_s: float = 3.0  # every vendor candidate of one forward problem (of short calls)
    pick_s: float = 4.0  # one forward problem's final re-measure (of short calls)
    decided_pick_s: float = 1.5  # the same where SDPA is clearly ahead: a few methods, one round (`decided`)
    # A backward problem's vendor pass and pick time a forward and a backward pass, five vendor pairs
    # instead of three backends (an H100, 22 problems: vendor 2.6 s a forward problem, 9.7 s a
    # backward one; picks 2.2 s and 5.5 s): one op's durations say little about another's, and a
    # cheap forward pick that stood for the backward ones overran the budget by their difference.
    op_scale: dict = dataclasses.field(default_factory=lambda: {"vendor_s": {"bwd": 3.5}, "pick_s": {"bwd": 2.5},
                                                                "decided_pick_s": {"bwd": 2.5}})
    seen: dict = dataclasses.field(default_factory=dict)  # (kind, op) -> measured seconds
    wait_s: dict = dataclasses.field(default_factory=dict)  # family -> wait for a step's first compiled batch
    per_s: dict = dataclasses.field(default_factory=dict)  # family -> seconds per candidate after it
    prior_wait_s: float = 8.0
    prior_per_s: float = 1.5
    prior_waits: dict = dataclasses.field(default_factory=dict)  # family -> its own prior wait

    def observe(self, kind: str, seconds: float, family: str | None = None, op: str = "fwd") -> None:
        """A measured duration: the first replaces the prior, later ones are averaged in. vendor_s
        and pick_s are per op, wait_s and per_s per family."""
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            return
        table, key = (getattr(self, kind), family) if kind in ("wait_s", "per_s") else (self.seen, (kind, op))
        table[key] = seconds if key not in table else 0.5 * (table[key] + seconds)

    def vendor(self, op: str = "fwd") -> float:
        return self._per_op("vendor_s", op)

    def pick(self, op: str = "fwd", decided: bool = False) -> float:
        return self._per_op("decided_pick_s" if decided else "pick_s", op)

    def _per_op(self, kind: str, op: str) -> float:
        return self.seen.get((kind, op), getattr(self, kind) * self.op_scale.get(kind, {}).get(op, 1.0))

    def wait(self, family: str) -> float:
        return self.wait_s.get(family, self.prior_waits.get(family, self.prior_wait_s))

    def per(self, family: str) -> float:
        return self.per_s.get(family, self.prior_per_s)
