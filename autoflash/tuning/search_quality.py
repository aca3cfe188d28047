"""Search quality: replay the tuner's sampler against an exhaustive sweep and count the trials it
needs to come within a tolerance of the true best, next to random search (`autoflash search-quality`)."""

from __future__ import annotations

import json
import math
import statistics

import optuna

from autoflash.device import GPUFingerprint
from autoflash.problem import Problem
from autoflash.space import Variant, default_variant, load_space
from autoflash.tuning.tuner import make_sampler


class NoOverlap(ValueError):
    """A sweep none of whose variants the current search space has."""


def in_current_space(table: dict, space) -> dict:
    """A sweep's timings keyed as the current space names its variants: a knob added since the sweep
    takes its `[legacy]` value (the kernel the sweep measured); a row with a knob or a value the
    space does not have (another family's, or a choice removed since) is left out. Without this, a
    sweep older than a knob holds none of the variants the sampler proposes."""
    out = {}
    for key, ms in table.items():
        knobs = json.loads(key)
        if not isinstance(knobs, dict):
            continue
        knobs = {**{k: v for k, v in space.legacy.items() if k not in knobs}, **knobs}
        if set(knobs) == set(space.knobs) and all(v in space.knobs[k] for k, v in knobs.items()):
            out[Variant.of(space.family, knobs).json()] = ms
    return out


def replay_search(table: dict, problem: Problem, device: GPUFingerprint, trials: int, seed: int,
                  first: Variant | None = None) -> list[float]:
    """Run the tuner's sampler against recorded measurements (variant JSON -> ms; missing = failed).

    Returns the objective of each measured trial in search order. With an exhaustive table this
    tells how many trials the search needs to come within x% of the true best.
    """
    space = load_space(problem.op)
    study = optuna.create_study(direction="minimize", sampler=make_sampler(seed, trials))
    if first is not None:
        study.enqueue_trial(first.as_dict())
    out, seen, attempts = [], set(), 0
    while len(out) < trials and attempts < 200 * trials:
        attempts += 1
        trial = study.ask()
        variant = space.suggest(trial)
        key = variant.json()
        if space.violations(variant, problem, device) or key in seen:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        seen.add(key)
        ms = table.get(key)
        if ms is None or not math.isfinite(ms):
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            out.append(math.inf)
        else:
            study.tell(trial, ms)
            out.append(ms)
    return out


def trials_to_reach(sequence: list[float], best: float, tolerance: float) -> int | None:
    """1-based index of the first trial whose running best is within `tolerance` of `best`."""
    running = math.inf
    for i, ms in enumerate(sequence, 1):
        running = min(running, ms)
        if running <= best * (1 + tolerance):
            return i
    return None


def search_quality(table: dict, problem: Problem, device: GPUFingerprint, seeds: int, trials: int,
                   tolerance: float = 0.02) -> dict:
    """Trials the tuner's sampler needs to come within `tolerance` of an exhaustive table's best,
    per seed, against random search (200 shuffles) on the same table."""
    import random

    table = in_current_space(table, load_space(problem.op))
    if not table:
        raise NoOverlap(f"{problem.key}: no recorded variant is one of the current {problem.op} search space's "
                         "(the sweep was made with other knobs)")
    trials = min(trials, len(table))
    best = min(table.values())
    default = default_variant(problem.op, problem, device)
    tpe = [trials_to_reach(replay_search(table, problem, device, trials, seed, first=default), best, tolerance)
           for seed in range(seeds)]
    keys = sorted(table)
    rnd = []
    for seed in range(200):
        order = keys[:]
        random.Random(seed).shuffle(order)
        rnd.append(trials_to_reach([table[k] for k in order], best, tolerance))
    # How much of the space the table covers: its best is the exhaustive best only when it has every
    # variant valid for the problem on the sweep's GPU.
    valid = len(load_space(problem.op).valid_variants(problem, device))
    return {"space": len(table), "valid": valid, "best_ms": best, "default_ms": table.get(default.json()),
            "within_tolerance": sum(ms <= best * (1 + tolerance) for ms in table.values()),
            "tpe": tpe, "random_median": statistics.median(rnd)}
