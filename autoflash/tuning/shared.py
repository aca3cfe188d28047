"""The tuner of one worker among many on one Optuna storage (`autoflash tune --workers N
--storage URL`, on one host or several): the `Tuner`'s search and pick, coordinated through the
studies so that N workers behave like one.

- A family's trial budget is the study's, not the worker's: a worker asks for no more candidates
  than the budget minus what every worker has measured or is measuring (`_taken`).
- A candidate some other worker measured or is measuring (a lower-numbered trial of the study with
  the same parameters) is not measured again, on any host; on this host the DB claim says so too.
- A dead worker's RUNNING trial is failed and queued again (`storage.Liveness`), and its DB claim
  freed, so the next worker to ask measures it.
- Before the pick, a worker waits until no other worker is measuring the problem, gathers every
  worker's trials (this host's DB and the studies: another host's are gated again here), and
  claims the pick (`picks.claim_pick`): exactly one worker re-measures and stores the winner of
  one set of trials; the others report its result.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
import warnings

import optuna
from optuna.trial import TrialState

from autoflash import codegen
from autoflash.space import families_for, load_space
from autoflash.tuning.picks import claim_pick, digest
from autoflash.tuning.results import ProblemResult
from autoflash.tuning.storage import MEASURING_ATTR, OWNER_ATTR, STATUS_ATTR, Liveness, grace_s, pid_alive
from autoflash.tuning.tuner import Tuner

# How long an earlier trial of the same variant, asked by another worker but not yet adopted, is
# waited for before this worker measures the variant itself (that worker may have died in between).
ADOPTION_WAIT_S = 30.0

log = logging.getLogger("autoflash.tuning")
# Optuna's heartbeat is meant for Study.optimize; here each worker beats its asked trials itself.
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")

MAX_RETRIES_AT_ONCE = 8  # dead workers' trials measured per round of the wait before a pick


def params_key(params: dict) -> str:
    """A trial's parameters as its variant's JSON (`Variant.json`)."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def _measured(trial) -> bool:
    """Whether a trial stands for a measurement, done or under way, by some worker: told a value,
    or failed as measured, or running in a worker's batch (adopted). A trial of a worker that died
    counts until it is reaped; then its retry does."""
    if not trial.params:
        return False
    if trial.state == TrialState.RUNNING:
        return OWNER_ATTR in trial.user_attrs
    return trial.state == TrialState.COMPLETE or (trial.state == TrialState.FAIL and STATUS_ATTR in trial.user_attrs)


def _taken(trials) -> set[str]:
    return {params_key(t.params) for t in trials if _measured(t)}


def _thash(study) -> str:
    """The template hash of a search study ('<gpu key>|<problem key>|<template hash>')."""
    return study.study_name.rpartition("|")[2]


def _retried(trials) -> list:
    return [t for t in trials if t.state == TrialState.WAITING and "failed_trial" in t.system_attrs]


class SharedTuner(Tuner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.liveness = Liveness(self.journal)
        self._budgets: dict[str, int] = {}  # study name -> the family's trial budget
        self._searches: dict[tuple, tuple] = {}  # (problem key, template hash) -> (study, valid, trials)
        # (problem key, template hash, variant JSON) -> [(study, trial)] this worker is to measure, oldest first
        self._asked: dict[tuple, list] = {}

    def close(self, status: str, problems: int) -> None:
        self.liveness.close()
        super().close(status, problems)

    def _reap(self, study) -> None:
        """Fail dead workers' trials of `study` (queued again) and free their DB claims."""
        if self.liveness.reap(study):
            self._free_dead_claims()

    def _free_dead_claims(self) -> None:
        """Runs of this host whose process is gone become 'interrupted' (Store.mark_dead_runs, and
        here a killed worker not yet reaped by its parent, a zombie, too); their claims are freed."""
        self.store.mark_dead_runs()
        host = socket.gethostname()
        for row in list(self.store.db["runs"].rows_where("status = 'running' and host = ?", [host])):
            if isinstance(row["pid"], int) and not pid_alive(row["pid"]):
                self.store._transaction(lambda conn: conn.execute(
                    "update runs set status = 'interrupted' where id = ? and status = 'running'", [row["id"]]))
        self.store.drop_orphan_claims()

    # ------------------------------------------------------------------ the search
    def _search(self, ps, family, n, deadline, force=False):
        try:
            return super()._search(ps, family, n, deadline, force)
        finally:  # (a trial left unmeasured, out of time, was failed and queued again)
            thash = codegen.template_hash(family)
            self._asked = {k: v for k, v in self._asked.items() if k[:2] != (ps.problem.key, thash)}
            study = self._searches.get((ps.problem.key, thash), (None,))[0]
            if study is not None:
                self.liveness.searching(study._study_id, False)

    def _open_search(self, ps, family, thash, budget):
        study, queue_ = super()._open_search(ps, family, thash, budget)
        problem, valid = ps.problem, ps.valid[family]
        self._searches[(problem.key, thash)] = (study, valid, budget)
        if study is not None:
            self.liveness.searching(study._study_id, True)
            self._budgets[study.study_name] = budget
            self._reap(study)
        return study, queue_

    def _ask_batch(self, study, space, problem, done, n):
        """Dead workers' trials queued again first (their place in the budget is kept for them),
        then new candidates while the study's budget lasts."""
        self._reap(study)
        trials = study.get_trials(deepcopy=False)
        retries = _retried(trials)
        for t in retries:  # a dead worker's claim, seen as taken when the search began
            if done.get(params_key(t.params), {}).get("status") in ("running", "claimed"):
                del done[params_key(t.params)]
        budget = self._budgets.get(study.study_name)
        new = n if budget is None else budget - len(_taken(trials) | {params_key(t.params) for t in retries})
        batch = self._pop(study, space, retries, n)
        if min(n - len(batch), new) > 0:
            batch += super()._ask_batch(study, space, problem, done, min(n - len(batch), new))
        for trial, variant in batch:
            self.liveness.adopt(trial._trial_id)
            self._asked.setdefault((problem.key, _thash(study), variant.json()), []).append((study, trial))
        return batch

    def _pop(self, study, space, waiting: list, n: int) -> list:
        """Take up to n of these WAITING trials (as `study.ask` takes the first one waiting)."""
        batch = []
        for t in waiting[:n]:
            try:
                if not study._storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    continue  # another worker took it
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
            trial = optuna.Trial(study, t._trial_id)
            batch.append((trial, space.suggest(trial)))  # (its parameters, fixed)
        return batch

    def _measure(self, variant, compiled, shape, thash):
        asked = self._asked.get((shape.problem.key, thash, variant.json()))
        study, trial = asked.pop(0) if asked else (None, None)
        if trial is not None:
            if self._measured_elsewhere(study, trial.number, variant.json()):
                log.debug("trial %d: measured by another worker", trial.number)
                return None, None
            if "failed_trial" in self.journal.get_trial_system_attrs(trial._trial_id):
                self._free_dead_claims()  # a dead worker's trial: free its claim first
            trial.set_user_attr(MEASURING_ATTR, True)
        row, outcome = super()._measure(variant, compiled, shape, thash)
        if trial is not None and row is not None:
            trial.set_user_attr(STATUS_ATTR, outcome.status)
        return row, outcome

    @staticmethod
    def _measured_elsewhere(study, number: int, key: str) -> bool:
        """An earlier trial of the same variant, measured or being measured (by any worker). One
        just asked by another worker, not yet in its batch nor told, is watched until it is (or is
        given up): its asker adopts it within milliseconds, but on a loaded host (two tuners and
        their compile workers on two cores) a second went by, and both measured it."""
        deadline = time.monotonic() + ADOPTION_WAIT_S
        while time.monotonic() < deadline:
            trials = study.get_trials(deepcopy=False)
            dead = {n for t in trials for n in t.system_attrs.get("retry_history", [])}  # (queued again)
            same = [t for t in trials
                    if t.number < number and t.number not in dead and t.params and params_key(t.params) == key]
            if any(_measured(t) for t in same):
                return True
            if not any(t.state == TrialState.RUNNING for t in same):
                return False
            time.sleep(0.05)
        return False

    # ------------------------------------------------------------------ the pick
    def _pick_winner(self, shape, problem, done, default, measured, failed) -> ProblemResult:
        self._settle(shape, problem, done)
        self._gather(problem, done)
        keys = [k for k, r in done.items() if r.get("status") == "ok"]
        claim, other = claim_pick(self.journal, self.gpu_key, problem.key, digest(keys))
        if claim is None:
            return self._picked_elsewhere(shape, problem, other, measured, failed)
        try:
            result = super()._pick_winner(shape, problem, done, default, measured, failed)
        except BaseException:
            claim.abandon()
            raise
        claim.finish(result)
        return result

    def _problem_searches(self, problem) -> list[tuple]:
        return [(thash, *v) for (key, thash), v in self._searches.items() if key == problem.key]

    def _settle(self, shape, problem, done) -> None:
        """Wait until no other worker searches or measures this problem, measuring the trials of
        workers that died meanwhile. (Bounded: after three trial timeouts and a heartbeat grace,
        the pick goes on with the trials there are; a pick over more trials later supersedes it.)"""
        deadline = time.monotonic() + 3 * self.opt.trial_timeout_s + grace_s()
        while True:
            busy = 0
            for thash, study, valid, trials in self._problem_searches(problem):
                if study is None:
                    continue
                self._reap(study)
                self._measure_retries(shape, study, load_space(valid[0].family), thash, done)
                trials_now = study.get_trials(deepcopy=False)
                busy += len([t for t in trials_now if t.state == TrialState.RUNNING]) + len(self._due(study))
                busy += self.liveness.searchers(study._study_id)
            self._free_dead_claims()
            busy += self.store.db.execute(
                "select count(*) from trials where gpu_key = ? and problem = ? and status = 'running' and run_id != ?",
                [self.gpu_key, problem.key, self.run_id]).fetchone()[0]
            if not busy or time.monotonic() > deadline:
                return
            log.debug("%s: waiting for %d trials or searches of other workers", problem.key, busy)
            time.sleep(0.25)

    def _due(self, study) -> list:
        """The trials of dead workers queued again that are still to be measured: those that died
        being measured, and the others while the study's budget has room."""
        trials = study.get_trials(deepcopy=False)
        retries = _retried(trials)
        room = self._budgets.get(study.study_name, 0) - len(_taken(trials))
        owed = [t for t in retries if t.system_attrs.get("owed")]
        return owed + [t for t in retries if not t.system_attrs.get("owed")][:max(0, room)]

    def _measure_retries(self, shape, study, space, thash: str, done: dict) -> None:
        """Measure the trials of dead workers queued again that are due (`_due`)."""
        batch = self._pop(study, space, self._due(study), MAX_RETRIES_AT_ONCE)
        if not batch:
            return
        for trial, _ in batch:
            self.liveness.adopt(trial._trial_id)
        compiled = self.compiles.start([v for _, v in batch], shape).result()
        for (trial, variant), outcome in zip(batch, compiled):
            self._asked.setdefault((shape.problem.key, thash, variant.json()), []).append((study, trial))
            row, outcome = self._measure(variant, outcome, shape, thash)
            if row is None:
                study.tell(trial, state=TrialState.PRUNED)
                continue
            done[f"{space.family}:{variant.json()}"] = row
            self.total_measured += 1
            if outcome.status == "ok" and math.isfinite(outcome.ms):
                study.tell(trial, outcome.ms)
            else:
                study.tell(trial, state=TrialState.FAIL)

    def _gather(self, problem, done: dict) -> None:
        """Every worker's finished trials of the problem into `done`: this DB's rows, then the
        studies' measured trials of other hosts (with an id: they are gated again before they compete)."""
        for family in families_for(problem.op):
            thash = codegen.template_hash(family)
            for row in self.store.trials_for(self.gpu_key, problem.key, thash):
                key = f"{family}:{row['variant']}"
                if key not in done or done[key].get("status") in ("running", "claimed"):
                    done[key] = row
            study = self._searches.get((problem.key, thash), (None,))[0]
            if study is None:
                continue
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                key = f"{family}:{params_key(t.params)}"
                if t.user_attrs.get(STATUS_ATTR) == "ok" and key not in done:
                    done[key] = {"id": f"optuna trial {t.number}", "variant": params_key(t.params),
                                 "status": "ok", "median_ms": t.value}

    @staticmethod
    def _picked_elsewhere(shape, problem, other: dict, measured: int, failed: int) -> ProblemResult:
        """The result of a pick another worker made (or is making), as it recorded it."""
        by = other.get("by", "?")
        if other.get("status") == "picking":
            return ProblemResult(shape, problem, None, {}, math.nan, measured, failed, "picking_elsewhere",
                                 picked_by=by)
        winner = other.get("winner")
        if winner:
            winner = load_space(winner["family"]).check_declared(json.loads(winner["variant"]))
        ms = {k: math.nan if v is None else v for k, v in (other.get("ms") or {}).items()}
        spread = other.get("spread")
        return ProblemResult(shape, problem, winner, ms, math.nan if spread is None else spread, measured, failed,
                             other.get("status", "tuned"), picked_by=by)
