"""The plan of a tuning run over its whole budget: which problem gets the GPU next, for how many
candidates, until when. Pure (no kernels, no Optuna, no DB, an injected clock): the run
(`tuning/planned.py`) feeds it the durations it measures and the best times it finds.

A run is four passes:
  1. vendor: every problem's vendor candidates (torch SDPA backends: nothing to compile, ~3 s a
     problem on an H100), while the compile pool builds the seed pass's candidates (compile ahead);
  2. seeds: every problem's first seeds (this GPU's stored winner, the winners of the nearest
     problems on other GPUs of the same architecture, the default), as many as the time left
     affords and one at least: after these two passes every problem has measured candidates;
  3. rounds: the time left, a compile batch at a time, to the search whose expected gain per
     second is largest (its own best near or above the vendor's, a search still improving);
  4. picks: each problem's final interleaved re-measure, whose time is kept back from the start.
It replaces problems taken in turn with budget / problems each, where one compile batch outlasted a
problem's share and most problems got no own measurement (22 problems in 4 minutes on an H100: 6).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from autoflash.tuning.plan_costs import (CALLS_PER_TIMING, DECIDED_MARGIN, DECIDED_PICK_TIMINGS, NOMINAL_FLOPS_PER_S,
                                         VENDOR_TIMINGS, WALL_PER_TIMING, Costs)

SEEDS_IN_PASS = 3  # seeds per family in the seed pass; the rest come first in the rounds
SEED_PASS_SHARE = 0.5  # of the search time left, at most this much goes to the seed pass
NEAR = 0.15  # own/vendor time ratio over which an own gain stops mattering (it would not serve)
PRIOR_GAIN = 0.3  # expected relative gain of the next candidate, / (candidates measured + 2)
AHEAD_BATCHES = 3  # compile batches kept queued ahead of the GPU (`Planner.horizon_s`)
STALLED = 0.002  # a step that gained less per candidate than this did not improve the search
@dataclasses.dataclass
class Arm:
    """One own kernel family's search of one problem."""

    family: str
    cap: int  # candidates the trial budget allows (earlier runs' included)
    seeds: int  # known-good candidates, measured first
    measured: int = 0
    best_ms: float = math.inf
    gains: list = dataclasses.field(default_factory=list)  # relative gain per candidate, per step
    exhausted: bool = False  # asked for candidates and got none (space or shared budget spent)
    ready_at: float | None = None  # when its next step's candidates, compiled ahead, are expected ready
    ahead: bool = False  # whether the step running now had its candidates compiled ahead

    def open(self) -> int:
        return 0 if self.exhausted else max(0, self.cap - self.measured)


@dataclasses.dataclass
class ProblemPlan:
    label: str
    arms: list
    op: str = "fwd"
    has_vendor: bool = True
    vendor_ms: float = math.inf
    flops: float = 0.0  # of one timed call (a backward problem: forward and backward): its time before measured
    stage: str = "waiting"  # waiting | vendor only | seeded | searched | picked
    served: str = ""  # after the pick: "own" or "vendor" ("" when nothing was stored)
    vendor_done: bool = False
    seeded: bool = False
    picked: bool = False
    history: list = dataclasses.field(default_factory=list)  # (seconds into the run, best own ms, vendor ms)

    @property
    def own_ms(self) -> float:
        return min((a.best_ms for a in self.arms), default=math.inf)

    def arm(self, family: str) -> Arm:
        return next(a for a in self.arms if a.family == family)


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # vendor | seeds | search | pick
    problem: int
    counts: tuple = ()  # ((family, candidates), ...)
    deadline: float | None = None


@dataclasses.dataclass
class Row:
    label: str
    stage: str
    own_ms: float
    vendor_ms: float
    measured: int
    cap: int


@dataclasses.dataclass
class Snapshot:
    phase: str  # vendor | seeds | rounds | picks | done
    elapsed_s: float
    eta_s: float  # until the run is expected to end
    rows: list


class Planner:
    def __init__(self, problems: list[ProblemPlan], budget_s: float | None, clock: Callable[[], float],
                 costs: Costs | None = None, start: float | None = None, batch: int = 1, rep_ms: float = 100.0,
                 pick_timings: int = 21):
        self.problems, self.clock, self.costs = problems, clock, costs or Costs()
        self.rep_ms = rep_ms  # the run's timing length (`TuneOptions.rep_ms`): what a call is long against
        self.pick_timings = pick_timings  # timings in a pick: its methods (top_k + ~4) x rounds
        self.start = clock() if start is None else start
        self.end = None if budget_s is None else self.start + budget_s
        self.batch = max(1, batch)  # candidates per search step: one compile batch
        self.pool_free_at = self.start  # when the compile pool is expected through what it was sent
        self._t0 = self.start

    # ------------------------------------------------------------------ time
    def left(self) -> float:
        return math.inf if self.end is None else self.end - self.clock()

    def vendor_left_s(self) -> float:
        return sum(self.vendor_s(p) for p in self.problems if p.has_vendor and not p.vendor_done)

    def picks_left_s(self) -> float:
        return sum(self.pick_s(p) for p in self.problems if not p.picked)

    # ------------------------------------------------------------------ a problem's costs
    def call_ms(self, p: ProblemPlan) -> float:
        """One call's time: the vendor's measured (a backward problem's: the pair's), else the best
        own candidate's, else the estimate from its FLOPs (0 where it has none)."""
        for ms in (p.vendor_ms, p.own_ms):
            if math.isfinite(ms):
                return ms
        return p.flops / NOMINAL_FLOPS_PER_S * 1e3

    def extra_s(self, p: ProblemPlan, timings: int) -> float:
        """Seconds that `timings` timings of a problem with long calls take beyond a short-call
        problem's: each makes CALLS_PER_TIMING calls at least, where a short call's timing lasts
        WALL_PER_TIMING x rep_ms (a 100-ms backward call at rep_ms 40, 21 timings in a pick: ~41 s
        more; on an H100 such a pick outlasted the 5.5 s kept back by over 28 s and the run overran)."""
        return timings * max(0.0, CALLS_PER_TIMING * self.call_ms(p) - WALL_PER_TIMING * self.rep_ms) / 1e3

    def vendor_s(self, p: ProblemPlan) -> float:
        return self.costs.vendor(p.op) + self.extra_s(p, VENDOR_TIMINGS.get(p.op, VENDOR_TIMINGS["fwd"]))

    def decided(self, p: ProblemPlan) -> bool:
        """Whether p's pick is decided by its trials (SDPA clearly ahead of its own best): a cheap pick."""
        return (p.has_vendor and math.isfinite(p.vendor_ms) and math.isfinite(p.own_ms)
                and p.own_ms >= p.vendor_ms * (1 + DECIDED_MARGIN))

    def pick_s(self, p: ProblemPlan) -> float:
        decided = self.decided(p)
        return self.costs.pick(p.op, decided) + self.extra_s(p, DECIDED_PICK_TIMINGS if decided else self.pick_timings)

    def reserve_s(self) -> float:
        """Time kept back for what every problem must still get: its vendor pass, one seed (the
        cheapest, compiled during the vendor pass) and its pick. A budget smaller than these is
        overrun by them, never by anything else."""
        seeds = sum(min((self.costs.per(a.family) for a in p.arms if a.open()), default=0.0)
                    for p in self.problems if not p.seeded)
        return self.vendor_left_s() + seeds + self.picks_left_s()

    def step_s(self, arm: Arm, n: int, at: float | None = None) -> float:
        """Expected seconds of n candidates of an arm in a step starting at `at` (default now): the
        wait for its first compiled batch (what is left of it when compiled ahead), then n measured."""
        if n <= 0:
            return 0.0
        now = self.clock()
        at = now if at is None else at
        ready = max(now, self.pool_free_at) + self.costs.wait(arm.family) if arm.ready_at is None else arm.ready_at
        return max(0.0, ready - at) + n * self.costs.per(arm.family)

    def _deadline(self, estimate: float, avail: float) -> float | None:
        # Twice the estimate: a slow step is cut, not allowed to eat the others' rounds; never the reserve.
        return None if self.end is None else self.clock() + min(avail, 2 * estimate)

    # ------------------------------------------------------------------ the steps
    def next_step(self) -> Step | None:
        self._t0 = self.clock()
        for i, p in enumerate(self.problems):
            if not p.vendor_done:
                if p.has_vendor:
                    return Step("vendor", i)
                p.vendor_done = True
        for i, p in enumerate(self.problems):
            if not p.seeded:
                counts = self.seed_counts(i)
                if counts:
                    avail = self.left() - self.reserve_s() + self.costs.per(counts[0][0])
                    estimate = sum(self.step_s(p.arm(f), n) for f, n in counts)
                    return self._take(Step("seeds", i, counts, self._deadline(estimate, max(avail, estimate))))
                p.seeded = True
        ranked = self._ranked()
        if ranked:
            i, arm, n = ranked[0]
            avail = self.left() - self.reserve_s()
            return self._take(Step("search", i, ((arm.family, n),), self._deadline(self.step_s(arm, n), avail)))
        # Picks last, the problem with least to gain from more rounds first: a pick that takes less
        # than its reserve gives the time back to the rounds of the problems not picked yet.
        left = [(max((self.score(p, a) for a in p.arms if a.open()), default=0.0), i)
                for i, p in enumerate(self.problems) if not p.picked]
        return Step("pick", min(left)[1]) if left else None

    def _take(self, step: Step) -> Step:
        """The step's arms take their candidates compiled ahead; those not compiled ahead are sent
        to the pool now, behind what it holds."""
        for family, n in step.counts:
            arm = self.problems[step.problem].arm(family)
            arm.ahead = arm.ready_at is not None
            if not arm.ahead:
                self.compiling(step.problem, family, n)
            arm.ready_at = None  # (an ask ahead during the step is for its next step)
        return step

    def seed_counts(self, i: int) -> tuple:
        """((family, n), ...) of the seed pass for problem i: its share of the time left, at least
        one candidate where that fits (or where no vendor candidate gives the problem a winner)."""
        p = self.problems[i]
        wanted = {a.family: min(a.open(), a.seeds, SEEDS_IN_PASS) for a in p.arms}
        if self.end is None:
            return tuple((f, n) for f, n in wanted.items() if n)
        at = self.clock() + self.vendor_left_s()  # (seeds compile while the vendor pass measures)
        arms = [a for a in p.arms if wanted[a.family]]
        if not arms:
            return ()
        cheapest = min(arms, key=lambda a: self.step_s(a, 1, at))
        # The reserve holds one seed of each problem: the share is what the time left adds to it.
        share = (max(0.0, self.left() - self.reserve_s()) * SEED_PASS_SHARE / sum(1 for q in self.problems if not q.seeded)
                 + self.costs.per(cheapest.family))
        counts = {f: 0 for f in wanted}
        grew = True
        while grew:  # one more candidate to each family in turn while the share lasts
            grew = False
            for a in arms:
                if counts[a.family] < wanted[a.family]:
                    trial = dict(counts, **{a.family: counts[a.family] + 1})
                    if sum(self.step_s(p.arm(f), n, at) for f, n in trial.items()) <= share:
                        counts, grew = trial, True
        if not any(counts.values()):
            counts[cheapest.family] = 1  # (every problem gets a seed: the reserve counted it)
        return tuple((f, n) for f, n in counts.items() if n)

    def _ranked(self, ready: bool = True) -> list:
        """(problem, arm, candidates) of every search that may run now, none once the time left is
        the reserve; best first by expected gain per second, the wait for its compile counted
        (ready: what to measure next, a search compiled ahead before one that would keep the GPU
        waiting) or not (what is worth compiling ahead)."""
        avail = self.left() - self.reserve_s()
        out = []
        for i, p in enumerate(self.problems):
            if p.picked or not p.seeded:
                continue
            for arm in p.arms:
                n = arm.open() if self.end is None else min(self.batch, arm.open())
                while n > 1 and self.step_s(arm, n) > avail:
                    n -= 1
                if n >= 1 and self.step_s(arm, n) <= avail:
                    score = self.gain(p, arm) * n / self.step_s(arm, n) if ready else self.score(p, arm)
                    out.append((score, i, arm, n))
        out.sort(key=lambda x: (-x[0], x[1]))
        return [x[1:] for x in out]

    def backlog_s(self) -> float:
        """Seconds the compile pool is expected to need for what it was sent."""
        return max(0.0, self.pool_free_at - self.clock())

    def horizon_s(self) -> float:
        """How far ahead the pool is kept busy: AHEAD_BATCHES batches of the slowest family. The
        pool, not the GPU, is the bottleneck (12 Gluon compiles take ~27 s, their measurement
        ~12 s): asked one step ahead, a batch started compiling only when the step before it did,
        and 60 s of a 180-s run on an H100 went to the GPU waiting."""
        return AHEAD_BATCHES * max((self.costs.wait(a.family) for p in self.problems for a in p.arms), default=0.0)

    def peek(self, step: Step, skip=()) -> tuple | None:
        """(problem, family, n) of the search to compile ahead while `step` measures: the most
        valuable one not compiling already (nor in `skip`: (problem, family) pairs), as the ranking
        will stand once the step's candidates are measured (a search that stays best gets its next
        batch ready too)."""
        arms = [(self.problems[step.problem].arm(f), n) for f, n in step.counts]
        saved = [(a.measured, a.ready_at) for a, _ in arms]
        for a, n in arms:
            a.measured = a.measured + n
        try:
            ranked = [(i, arm, n) for i, arm, n in self._ranked(ready=False)
                      if arm.ready_at is None and (i, arm.family) not in skip]
        finally:
            for (a, _), (measured, ready_at) in zip(arms, saved):
                a.measured, a.ready_at = measured, ready_at
        return (ranked[0][0], ranked[0][1].family, ranked[0][2]) if ranked else None

    def compiling(self, i: int, family: str, n: int = 1) -> None:
        """n candidates of this arm were sent to the compile pool now, for its next step. The pool
        takes compiles in order, `batch` at once: they start when it is through what it holds."""
        arm = self.problems[i].arm(family)
        start = max(self.clock(), self.pool_free_at)
        self.pool_free_at = start + n * self.costs.wait(family) / self.batch
        arm.ready_at = start + self.costs.wait(family)

    def planned_seeds(self) -> dict:
        """{problem: ((family, n), ...)} the seed pass is expected to measure: compiled ahead while
        the vendor pass measures."""
        return {i: self.seed_counts(i) for i, p in enumerate(self.problems) if not p.seeded}

    # ------------------------------------------------------------------ expected gains
    def score(self, p: ProblemPlan, arm: Arm) -> float:
        """Expected relative gain in the problem's served time per second of this arm's search."""
        return self.gain(p, arm) / self.costs.per(arm.family)

    def gain(self, p: ProblemPlan, arm: Arm) -> float:
        """Expected relative gain of the arm's next candidate: a prior that falls with the
        candidates measured (the best of n random draws improves ~1/n), averaged with what its last
        step gained, halved once two steps gained nothing; weighted by whether an own gain serves
        (own best near or faster than the vendor)."""
        prior = PRIOR_GAIN / (arm.measured + 2)
        g = prior if not arm.gains else 0.5 * (prior + arm.gains[-1])
        if len(arm.gains) >= 2 and max(arm.gains[-2:]) < STALLED:
            g *= 0.5
        return g * self.weight(p)

    @staticmethod
    def weight(p: ProblemPlan) -> float:
        if not (p.has_vendor and math.isfinite(p.vendor_ms) and math.isfinite(p.own_ms)):
            return 1.0
        ratio = p.own_ms / p.vendor_ms
        return 1.0 if ratio <= 1 else math.exp(-(ratio - 1) / NEAR)

    # ------------------------------------------------------------------ results
    def done(self, step: Step, *, vendor_ms: float | None = None, arms: dict | None = None,
             served: str = "") -> None:
        """What a step did. arms: family -> {"measured", "best_ms", "wait_s", "per_s", "exhausted"}
        (totals after the step; the durations of its candidates, None where none were measured;
        whether its search has nothing left to measure)."""
        now = self.clock()
        p = self.problems[step.problem]
        if step.kind == "vendor":
            p.vendor_ms = vendor_ms if vendor_ms is not None else p.vendor_ms  # (first: the extra time is of this call)
            # As a problem of short calls: one of long calls would inflate every other's estimate.
            self._observe_short("vendor_s", now - self._t0, self.vendor_s(p) - self.costs.vendor(p.op), p.op)
            p.vendor_done = True
            p.stage = "vendor only" if p.stage == "waiting" else p.stage
        elif step.kind == "pick":
            decided = self.decided(p)
            self._observe_short("decided_pick_s" if decided else "pick_s", now - self._t0,
                                self.pick_s(p) - self.costs.pick(p.op, decided), p.op)
            p.picked, p.stage, p.served = True, "picked", served
        else:
            asked = dict(step.counts)
            for family, r in (arms or {}).items():
                arm = p.arm(family)
                before, new = arm.best_ms, r.get("best_ms", math.inf)
                delta = r.get("measured", arm.measured) - arm.measured
                if family in asked and delta <= 0 and r.get("exhausted", step.deadline is None):
                    arm.exhausted = True  # asked and nothing was left to measure
                if step.kind == "search" and delta > 0:
                    arm.gains.append((before - new) / before / delta if math.isfinite(before) and new < before else 0.0)
                if not arm.ahead:  # (else its wait says how far ahead, not how long a compile takes)
                    self.costs.observe("wait_s", r.get("wait_s"), family)
                self.costs.observe("per_s", r.get("per_s"), family)
                arm.measured, arm.best_ms = arm.measured + max(0, delta), min(before, new)
            if step.kind == "seeds":
                p.seeded, p.stage = True, "seeded"
            else:
                p.stage = "searched"
            if vendor_ms is not None:
                p.vendor_ms = vendor_ms
        p.history.append((now - self.start, p.own_ms, p.vendor_ms))

    def phase(self) -> str:
        for name, flag in (("vendor", "vendor_done"), ("seeds", "seeded")):
            if any(not getattr(p, flag) for p in self.problems):
                return name
        if self._ranked():
            return "rounds"
        return "picks" if any(not p.picked for p in self.problems) else "done"

    def _observe_short(self, kind: str, seconds: float, extra: float, op: str) -> None:
        """A measured vendor pass or pick, less what its long calls added: where the estimate of
        that exceeds the whole, the duration says nothing about short problems and is not kept."""
        if seconds - extra > 0:
            self.costs.observe(kind, seconds - extra, op=op)

    def eta_s(self) -> float:
        """Seconds until the run is expected to end: the work left, bounded by the budget, but never
        below what every problem must still get (`reserve_s`): a budget smaller than that is overrun,
        and an ETA of 0:00 while 24 vendor passes were still to come said otherwise."""
        todo = self.vendor_left_s()
        todo += sum(self.step_s(a, a.open()) for p in self.problems if not p.picked for a in p.arms)
        todo += self.picks_left_s()
        return max(0.0, min(todo, max(self.left(), self.reserve_s())))

    def snapshot(self) -> Snapshot:
        rows = [Row(p.label, p.stage, p.own_ms, p.vendor_ms, sum(a.measured for a in p.arms),
                    sum(a.cap for a in p.arms)) for p in self.problems]
        return Snapshot(self.phase(), self.clock() - self.start, self.eta_s(), rows)
