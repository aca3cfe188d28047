"""One problem's search as it goes on across a run's passes (`tuner.Tuner.open_problem`)."""

from __future__ import annotations

import dataclasses
import math

from autoflash.problem import Shape
from autoflash.space import Variant


@dataclasses.dataclass
class ProblemSearch:
    """One problem's search across the run's passes."""

    shape: Shape
    valid: dict  # family -> its variants valid for the problem here
    vendor: list  # vendor families (all their candidates are measured, beside the trial budget)
    own: list  # own families, the default's first
    default: Variant
    caps: dict  # own family -> candidates the trial budget allows it (measured earlier included)
    seeds: dict  # own family -> its seeds, measured first
    context: dict  # the sandbox settings its candidates are timed with (a training pair's other halves)
    done: dict = dataclasses.field(default_factory=dict)  # "family:variant json" -> trial row
    counted: dict = dataclasses.field(default_factory=dict)  # family -> candidates measured or taken
    failed: int = 0

    @property
    def problem(self):
        return self.shape.problem

    def best_ms(self, families) -> float:
        return min((r["median_ms"] for k, r in self.done.items() if k.partition(":")[0] in families
                    and r.get("status") == "ok" and r.get("median_ms")), default=math.inf)
