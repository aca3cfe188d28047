"""What a tuning run is given and gives back: its options, one result per problem, the progress
callbacks, and the statistics of re-measured candidates."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable

from autoflash.device import compile_processes
from autoflash.problem import Problem, Shape
from autoflash.space import Variant
from autoflash.tuning.timing import tflops


@dataclasses.dataclass
class TuneOptions:
    trials: int = 40  # measured candidates per problem (pruned suggestions do not count)
    budget_s: float | None = None  # whole run, planned over all its problems (tuning/planner.py)
    top_k: int = 3
    rounds: int = 3  # interleaved re-measurement rounds for the top candidates
    rep_ms: float = 40
    compile_workers: int = dataclasses.field(default_factory=compile_processes)
    trial_timeout_s: float = 180
    seed: int = 0
    interpret: bool = False
    # The budget's clock (injectable: tests of the budget must not depend on this machine's speed).
    clock: Callable[[], float] = time.monotonic
    # The Optuna storage of the studies: None (the journal beside the results DB), a journal file
    # path, or a database URL (postgresql://...): see autoflash.tuning.storage.
    storage: str | None = None
    worker: int = 0  # this worker's index among those started together: where its problem order starts
    # Tune as if this GPU were new: its winners in the shipped DBs are no seeds and pair no backward
    # (other GPUs' winners of its architecture still seed the searches).
    hide_shipped_rows: bool = False
    transfer_seeds: bool = True  # seed searches with the winners of other GPUs of the same architecture
    # Test hooks: picklable top-level functions with sandbox.evaluate_variant's signature
    # (remeasure_fn: with sandbox.remeasure's).
    evaluate_fn: Callable | None = None
    compile_fn: Callable | None = None
    remeasure_fn: Callable | None = None


@dataclasses.dataclass
class ProblemResult:
    shape: Shape
    problem: Problem
    winner: Variant | None
    ms: dict  # method -> median ms: "tuned", "default", "sdpa_cudnn", "sdpa_flash"
    spread: float
    measured: int
    failed: int
    status: str  # "tuned" | "no_valid_candidate" | "remeasure_failed" | "skipped" | "picking_elsewhere"
    cut_short: bool = False  # the time budget ended the search before its trial budget
    own_measured: int | None = None  # candidates of own kernel families (the trial budget's count); None: all
    picked_by: str = ""  # 'host pid' of the worker that picked the winner, when another one did

    def tflops(self, method: str) -> float:
        return tflops(self.shape, self.ms.get(method, float("nan")))


def without_winner(results: list[ProblemResult]) -> list[ProblemResult]:
    """The problems a run leaves with no winner (every candidate failed, the budget ran out before
    them); not those whose winner another worker sharing the studies is picking."""
    return [r for r in results if r.winner is None and r.status != "picking_elsewhere"]


class Reporter:
    """Progress callbacks (the CLI draws them with rich; the library stays silent)."""

    # A step of the run's plan on one problem: "vendor", "seeds", "search" or "pick" (tuning/planner.py).
    def step_started(self, kind: str, index: int, total: int, shape: Shape) -> None: ...
    def trial_done(self, measured: int, budget: int, variant: Variant, outcome, best_tflops: float) -> None: ...
    def plan_update(self, snapshot) -> None: ...  # a planner.Snapshot: phase, ETA, each problem's state
    # The budget is below what every problem's vendor pass, seed and pick are expected to need.
    def budget_short(self, budget_s: float, needed_s: float) -> None: ...
    def problem_done(self, result: ProblemResult) -> None: ...
    def run_finished(self, summary) -> None: ...  # a planned.RunSummary


def spread(xs) -> float:
    """(max - min) / median of a candidate's re-measurement rounds."""
    m = median(xs)
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return (max(xs) - min(xs)) / m if len(xs) > 1 and m > 0 else 0.0


def median(xs) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else math.nan


def representative_shapes(shapes: list[Shape]) -> list[Shape]:
    """One shape per problem bucket (the first given), in order."""
    seen, out = set(), []
    for s in shapes:
        if s.problem not in seen:
            seen.add(s.problem)
            out.append(s)
    return out
