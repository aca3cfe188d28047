"""The tuner: one Optuna study per problem and kernel family, candidates measured in sandboxed
workers, winners stored. A run (`planned.run_planned`) drives it in passes over all its problems
(`planner`): a problem's search is opened once (`open_problem`) and goes on across the passes.

Per problem (a shape set entry's bucket) and family:
  1. the study is seeded with the stored winner, the winners of the nearest problems on other GPUs
     of the same architecture (`transfer`), the family's default and known-good variants;
  2. Optuna (TPE, multivariate, grouped) is asked for a batch; constraint violations are told
     PRUNED before anything compiles; variants already in the DB are answered from it, not re-run;
  3. the batch compiles in worker processes (each binary once per run: `compiles`) while one worker
     owns the GPU and gates + times each candidate (claimed in the DB first, so concurrent tuners
     share work; one clearly slower than the best so far is stopped after a short timing);
     failures are recorded; candidates the time left does not reach stay queued in the study;
then the best of all families are re-measured interleaved with the default and SDPA (`pick`); the
lowest median wins. Everything is in SQLite as it happens (the studies in Optuna's journal beside
it, or in --storage): a killed run resumes. A run drives a `shared.SharedTuner`.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import random

import optuna

from autoflash import codegen
from autoflash.device import GPUFingerprint, gpu_fingerprint
from autoflash.problem import Shape
from autoflash.space import Variant, families_for, load_space
from autoflash.store import Store
from autoflash.tuning import sandbox
from autoflash.tuning.compiles import Compiles
from autoflash.tuning.score_candidates import serves_problem, variant_default
from autoflash.tuning.pick import PickWinner
from autoflash.tuning.search_state import ProblemSearch
from autoflash.tuning.storage import make_storage
from autoflash.tuning.sandbox import FAILED_STATUSES, Outcome, Sandbox
from autoflash.tuning.results import ProblemResult, Reporter, TuneOptions  # noqa: F401 - (TuneOptions: its old home)
from autoflash.tuning.seeds import read_shipped_winners, seed_variants, training_backward, training_forward
from autoflash.tuning.timing import tflops
from autoflash.tuning.transfer import sibling_rows, transferred_seeds

optuna.logging.set_verbosity(optuna.logging.WARNING)


def optuna_storage_path(db_path) -> str:
    return f"{db_path}.optuna.journal"


def competes(family: str, interpret: bool) -> bool:
    """Whether a family's candidates are searched: vendor kernels compete on a GPU; in the
    interpreter they would beat every interpreted one."""
    return not (interpret and load_space(family).vendor)


class Tuner(PickWinner):
    def __init__(self, store: Store, options: TuneOptions, device: GPUFingerprint | None = None,
                 reporter: Reporter | None = None, command: str = ""):
        self.store = store
        self.opt = options
        self.device = device or gpu_fingerprint()
        self.reporter = reporter or Reporter()
        self.clock = options.clock
        self.device_str = "cpu" if options.interpret else "cuda"
        env = {"TRITON_INTERPRET": "1"} if options.interpret else {}
        if os.environ.get("AUTOFLASH_KERNEL_CACHE"):
            env["AUTOFLASH_KERNEL_CACHE"] = os.environ["AUTOFLASH_KERNEL_CACHE"]
        self.gpu_key = store.add_gpu(self.device)
        # Warm-start seeds, read once per run: this GPU's shipped winners (none when the run tunes as
        # if this GPU were new) and other GPUs' of its architecture.
        self.shipped_winners = [] if options.hide_shipped_rows else read_shipped_winners(self.gpu_key)
        self.sibling_winners = sibling_rows(self.gpu_key, store) if options.transfer_seeds else []
        store.mark_dead_runs()  # runs a kill left 'running' (their trials are kept and resumed)
        store.drop_orphan_claims()  # candidates those runs claimed but never measured
        self.run_id = store.start_run(self.gpu_key, command)
        self.sandbox = Sandbox(self.device_str, env)
        self.compilers = None if options.interpret else sandbox.WorkerPool(options.compile_workers, self.device_str, env)
        self.compiles = Compiles(self.compilers, options.compile_fn, options.rep_ms, self.device_str,
                                 options.trial_timeout_s)
        self.journal = make_storage(options.storage, store.path)  # (--storage; default: the journal beside the DB)
        self.total_measured = 0
        self.own_measured = self.vendor_measured = 0  # (the run's rates)
        # Every worker starts in the background, before the first problem's clock (`tune` charges
        # start-up to the run's budget): the first compiles queue behind their start, the problems
        # open meanwhile (`planned.run_planned` then waits for the measuring worker).
        if self.compilers:
            self.compilers.start(options.trial_timeout_s, wait=False)
        self.sandbox.start()

    def close(self, status: str, problems: int) -> None:
        stopped = status != "finished"  # Ctrl-C or SIGTERM: the workers are killed, not waited for
        self.sandbox.close(now=stopped)
        if self.compilers:  # (compiles asked ahead for steps the budget left no time for: not waited for)
            self.compilers.close(now=True)
        self.store.finish_run(self.run_id, status, problems, self.total_measured)

    # ------------------------------------------------------------------ one problem, in passes
    def open_problem(self, shape: Shape) -> ProblemSearch | None:
        """The problem's search (None when no family has a valid candidate here): its families,
        their trial caps (the trial budget split between the own families) and seeds."""
        problem = shape.problem
        valid = {f: serves_problem(load_space(f).valid_variants(problem, self.device), problem)
                 for f in families_for(problem.op)}
        families = [f for f in valid if valid[f] and competes(f, self.opt.interpret)]
        if not families:
            return None
        default = variant_default(problem, self.device)
        vendor = [f for f in families if load_space(f).vendor]
        own = sorted((f for f in families if f not in vendor), key=lambda f: f != default.family)
        caps, left = {}, self.opt.trials
        for n, family in enumerate(sorted(own, key=lambda f: len(valid[f]))):  # (a small space's rest to the others)
            caps[family] = min(len(valid[family]), max(1, left // (len(own) - n)))
            left -= caps[family]
        rows = self.store.winners(self.gpu_key, op=problem.op, head_dim=problem.head_dim) + self.shipped_winners
        seeds = {}
        for family in own:
            space, thash = load_space(family), codegen.template_hash(family)
            first = default if default.family == family else space.nearest_valid(
                space.default_for(problem, self.device), problem, self.device)
            moved = transferred_seeds(problem, family, self.device, self.sibling_winners)
            seeds[family] = serves_problem(seed_variants(first, problem, self.device, thash, rows, caps[family], moved),
                                           problem)
        ps = ProblemSearch(shape, valid, vendor, own, default, caps, seeds, self._training_context(shape))
        for family in vendor + own:  # (a resumed run: what earlier runs measured counts)
            trials = self.store.trials_for(self.gpu_key, problem.key, codegen.template_hash(family))
            ps.done.update({f"{family}:{r['variant']}": r for r in trials})
            ps.counted[family] = sum(r["status"] != "pruned" for r in trials)
        return ps

    def _training_context(self, shape: Shape) -> dict:
        """Backward candidates are paired with the stored own forward (and a vendor forward with the
        stored own backward until this search finds a better one): what a training step serves."""
        stored = [self.store.winners(self.gpu_key, head_dim=shape.head_dim), self.shipped_winners]
        return dict(training_forward=training_forward(shape, self.device, stored),
                    training_backward=training_backward(shape, self.device, stored))

    def _enter(self, ps: ProblemSearch) -> None:
        """The sandbox's settings for this problem's candidates (passes interleave problems)."""
        self.sandbox.context.update(ps.context)
        self.sandbox.context["bar_ms"] = None

    def measure_vendor(self, ps: ProblemSearch) -> None:
        """Every vendor candidate, beside the trial budget and the time budget: a handful of variants
        with nothing to compile, and the bar an own kernel must clear (a search that ran out of
        trials or time before reaching them stored own kernels slower than torch SDPA)."""
        self._enter(ps)
        for family in ps.vendor:
            self._search(ps, family, len(ps.valid[family]), None)

    def search(self, ps: ProblemSearch, counts, deadline: float | None, then=None, force: bool = False) -> dict:
        """Up to n more candidates of each (family, n) in `counts`, until `deadline`; returns family
        -> {"measured", "best_ms", "wait_s", "per_s", "exhausted"} (the planner's view). then: called
        once the step's first batch is compiling (what to compile next, behind it). force: the first
        family's first candidate is measured even past the deadline (the seed every problem gets)."""
        self._enter(ps)
        self._then = then
        try:
            return {family: self._search(ps, family, n, deadline, force and family == counts[0][0])
                    for family, n in counts}
        finally:
            if self._then is not None:  # (nothing was asked for)
                self._then()
            self._then = None

    def pick(self, ps: ProblemSearch) -> ProblemResult:
        """The final re-measure. Backward candidates were timed after the forward stored when the
        search opened; the pick re-times its finalists after the one stored now (this run's forward
        winners are picked first)."""
        ps.context = self._training_context(ps.shape)
        self._enter(ps)
        measured = sum(ps.counted.values())
        result = self._pick_winner(ps.shape, ps.problem, ps.done, ps.default, measured, ps.failed)
        result.own_measured = sum(ps.counted.get(f, 0) for f in ps.own)
        result.cut_short = self.opt.budget_s is not None and result.own_measured < sum(ps.caps.values())
        return result

    def ask_ahead(self, ps: ProblemSearch, family: str, n: int) -> int:
        """Start compiling the next n candidates of a family's search before its turn (the GPU is
        busy with another): those queued in its study (seeds, candidates a deadline left), then new
        ones asked of the sampler and queued for that turn. Base methods only: an ask ahead measures
        nothing, so it takes no part in the workers' coordination (`shared`). Returns how many."""
        thash, space = codegen.template_hash(family), load_space(family)
        mine = {r["variant"]: r for r in self.store.trials_for(self.gpu_key, ps.problem.key, thash)}
        study, queue_ = Tuner._open_search(self, ps, family, thash, ps.caps.get(family, len(ps.valid[family])))
        # (those compiling already are the batch its search is about to take, or an earlier ask
        # ahead: asked again they would count as compiles ahead that build nothing)
        def fresh(v) -> bool:
            return v.json() not in mine and not self.compiles.started(v, ps.shape)

        if study is None:
            variants = [v for v in queue_ if fresh(v)][:n]
        else:
            waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
            variants = [v for v in (space.check_declared(t.system_attrs["fixed_params"]) for t in waiting
                                    if "fixed_params" in t.system_attrs) if fresh(v)][:n]
            if not waiting:  # (an ask takes the queued ones first: new ones only once none are)
                batch = Tuner._ask_batch(self, study, space, ps.problem, mine, n)
                Tuner._carry_over(self, study, batch)
                variants += [v for _, v in batch]
        if variants:
            self.compiles.start(variants, ps.shape)
        return len(variants)

    def _search(self, ps: ProblemSearch, family: str, n: int, deadline: float | None, force: bool = False) -> dict:
        """Up to n more candidates of one family's search of `ps`'s problem; fills `ps.done`.
        force: its first candidate is measured even past the deadline."""
        shape, problem, done, valid = ps.shape, ps.problem, ps.done, ps.valid[family]
        space = load_space(family)
        thash = codegen.template_hash(family)
        mine = {r["variant"]: r for r in self.store.trials_for(self.gpu_key, problem.key, thash)}
        done.update({f"{family}:{k}": r for k, r in mine.items()})
        cap = min(ps.caps.get(family, len(valid)), len(valid))
        study, queue_ = self._open_search(ps, family, thash, cap)
        # Variants measured or taken: each counts once against the budget, however often it is heard of.
        counted = {key for key, r in mine.items() if r["status"] != "pruned"}
        budget = min(cap, len(counted) + n)
        best = ps.best_ms(ps.valid)
        batch_size = self.compilers and self.opt.compile_workers or 1
        waits, later_waits, idle_s, measure_s, new, carried = [], [], 0.0, 0.0, 0, False
        recounted = 0  # candidates taken that had counted already: each leaves its place to a new one

        def time_left() -> bool:
            return deadline is None or (force and not new) or self.clock() < deadline

        def next_batch(k: int, stale: int = 0):
            """Ask for up to k new candidates and start compiling them (in the background)."""
            if study is None:
                batch = [(None, v) for v in queue_ if v.json() not in mine][:k] if k > 0 and time_left() else []
                taken = {v for _, v in batch}
                queue_[:] = [v for v in queue_ if v not in taken]
                return (batch, self.compiles.start([v for _, v in batch], shape)) if batch else None
            while k > 0 and time_left() and stale <= 3:
                if stale == 3:  # the sampler keeps proposing known or invalid variants: hand it unmeasured
                    left = [v for v in valid if v.json() not in mine]  # valid ones, so the budget is spent
                    for v in random.Random(self.opt.seed + len(mine)).sample(left, min(k, len(left))):
                        study.enqueue_trial(v.as_dict())
                batch = self._ask_batch(study, space, problem, mine, k)
                if batch:
                    return batch, self.compiles.start([v for _, v in batch], shape)
                stale += 1
            return None

        pending = next_batch(min(batch_size, budget - len(counted)))
        if getattr(self, "_then", None) is not None:
            self._then, then = None, self._then
            then()
        while pending is not None:
            batch, compiling = pending
            if not time_left():  # out of time: queued in the study for the next turn, compiled or not
                self._carry_over(study, batch)
                carried = True
                break
            pending, stop = None, False
            for j, (trial, variant) in enumerate(batch):
                t0 = self.clock()
                try:  # (a forced first candidate waits; others no longer than the deadline: the run's clock)
                    c = compiling.one(j, None if deadline is None or (force and not new) else max(0.0, deadline - t0))
                except concurrent.futures.TimeoutError:
                    stop = True  # still compiling: measured at the search's next turn
                waited = self.clock() - t0
                idle_s += waited  # (the GPU waits on the compile pool)
                (later_waits if waits else waits).append(waited)
                if pending is None and j == 0 and not stop:
                    # the next batch compiles while this one is measured (each as soon as its compile is done)
                    pending = next_batch(min(batch_size, budget - len(counted) - len(batch)))
                if stop or not time_left():
                    self._carry_over(study, batch[j:])
                    carried = True
                    break
                self.sandbox.context["bar_ms"] = best if math.isfinite(best) else None
                t0 = self.clock()
                row, outcome = self._measure(variant, c, shape, thash)
                measure_s += self.clock() - t0
                key = variant.json()
                recounted += key in counted  # (a killed run's trial stored, not told: queued again by its study)
                counted.add(key)
                if row is None:  # in this DB already: a concurrent tuner's claim or measurement (shared, and
                    # never asked for again), or a killed run's that its study queued again: answered from the DB
                    known = mine.setdefault(key, {"variant": key, "status": "claimed", "median_ms": None})
                    if known["status"] == "ok" and known["median_ms"]:
                        _tell(study, trial, known["median_ms"])
                    else:
                        _tell(study, trial, state=optuna.trial.TrialState.PRUNED)
                    continue
                mine[key] = done[f"{family}:{key}"] = row
                self.total_measured += 1
                self.vendor_measured += bool(space.vendor)
                self.own_measured += not space.vendor
                new += 1
                if outcome.status == "ok" and math.isfinite(outcome.ms):
                    _tell(study, trial, outcome.ms)
                    best = min(best, outcome.ms)
                else:
                    ps.failed += outcome.status in FAILED_STATUSES
                    _tell(study, trial, state=optuna.trial.TrialState.FAIL)
                self.reporter.trial_done(len(counted), budget, variant, outcome, tflops(shape, best))
            if stop:
                if pending is not None:
                    self._carry_over(study, pending[0])
                break
            if pending is None and recounted and not carried and len(counted) < budget:
                # (Ended here, a resumed one-candidate step, whose killed run's trial was queued again,
                # measured nothing and was taken for an exhausted search: the budget never completed.)
                recounted = 0
                pending = next_batch(min(batch_size, budget - len(counted)))
        self.sandbox.context["bar_ms"] = None
        ps.counted[family] = len(counted)
        # exhausted: nothing new, and not for want of time (the space or the shared study gives no more)
        exhausted = not new and not carried and (deadline is None or self.clock() < deadline)
        return {"measured": len(counted), "best_ms": ps.best_ms([family]), "wait_s": waits[0] if waits else None,
                "per_s": (measure_s + sum(later_waits)) / new if new else None, "exhausted": exhausted,
                "idle_s": idle_s, "new": new}

    def _carry_over(self, study, batch: list) -> None:
        """Candidates asked for but not measured (the deadline came first): failed in the study (no verdict
        for the sampler) and queued again, first in line for the next turn: no compile thrown away."""
        if study is None:
            return  # (a brute-force queue is rebuilt from the DB: they are still unmeasured there)
        for trial, variant in batch:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            study.enqueue_trial(variant.as_dict())

    def _open_search(self, ps: ProblemSearch, family: str, thash: str, budget: int):
        """(Optuna study, None), or (None, candidate queue) when the whole space fits the budget."""
        valid, problem = ps.valid[family], ps.problem
        if len(valid) <= budget:
            # brute force: the seeds first (stored winner, a neighbour's, default), then the declared order
            return None, list(dict.fromkeys(ps.seeds.get(family, []) + valid))
        study = optuna.create_study(
            study_name=f"{self.gpu_key}|{problem.key}|{thash}", storage=self.journal, direction="minimize",
            load_if_exists=True, sampler=make_sampler(self.opt.seed, budget))
        if not study.trials:
            for seed_variant in ps.seeds.get(family, []):
                study.enqueue_trial(seed_variant.as_dict(), skip_if_exists=True)
        return study, None

    def _ask_batch(self, study, space, problem, done: dict, n: int) -> list:
        batch, seen, attempts = [], set(), 0
        while len(batch) < n and attempts < 50 * n:
            attempts += 1
            trial = study.ask()
            variant = space.suggest(trial)
            if space.violations(variant, problem, self.device) or not serves_problem([variant], problem):
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)  # invalid: never compiled, not a failure
                continue
            key = variant.json()
            if key in done:  # measured before: answer from the DB
                row = done[key]
                if row["status"] == "ok" and row["median_ms"]:
                    study.tell(trial, row["median_ms"])
                else:
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            if key in seen:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            seen.add(key)
            batch.append((trial, variant))
        return batch

    def _measure(self, variant: Variant, compiled: Outcome, shape: Shape, thash: str):
        """Claim the candidate in the DB, gate and time it in the sandbox (unless its compile failed), record
        it: (trial row, outcome), or (None, None) when another tuner on this DB has claimed it."""
        claim = self.store.claim_trial(run_id=self.run_id, gpu_key=self.gpu_key, problem=shape.problem,
                                       template_hash=thash, variant_json=variant.json(),
                                       shape=shape.as_dict())
        if claim is None:
            return None, None
        if compiled.status == "crashed":  # the compile worker died: the compiler aborted on this variant
            compiled = Outcome("compile_error", message=f"compiler crashed: {compiled.message}",
                               seconds=compiled.seconds)
        outcome = compiled if compiled.status != "ok" else self.sandbox.evaluate(
            variant, shape, rep_ms=self.opt.rep_ms, timeout_s=self.opt.trial_timeout_s, fn=self.opt.evaluate_fn)
        return self._record(claim, variant, outcome, shape), outcome

    def _record(self, claim: int, variant, outcome, shape) -> dict:
        tf = tflops(shape, outcome.ms) if outcome.status == "ok" else None
        self.store.finish_trial(claim, status=outcome.status, median_ms=outcome.ms, tflops=tf, err=outcome.err,
                                sdpa_err=outcome.sdpa_err, message=outcome.message, seconds=outcome.seconds)
        return {"variant": variant.json(), "status": outcome.status,
                "median_ms": outcome.ms if outcome.status == "ok" else None}


def _tell(study, trial, value=None, state=None) -> None:
    """study.tell, or nothing for a brute-force run (which has no study)."""
    if study is not None:
        study.tell(trial, value, state=state)


def make_sampler(seed: int, trials: int) -> optuna.samplers.BaseSampler:
    """TPE, multivariate and grouped: the space is categorical and conditional (constraints)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(multivariate=True, group=True, seed=seed,
                                          n_startup_trials=min(10, max(3, trials // 4)))
