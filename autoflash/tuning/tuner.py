"""The tuner: one Optuna study per problem, candidates measured in sandboxed workers, winners stored.

Per problem (a shape set entry's bucket), every vendor candidate (torch SDPA backends: the bar),
then for each own kernel family of its op (trials split):
  1. seed the study with the stored winner, the family's default and known-good variants;
  2. ask Optuna (TPE, multivariate, grouped) for a batch; constraint violations are told PRUNED
     before anything compiles; variants already in the DB are answered from it, not re-run;
  3. compile the batch in worker processes while one worker owns the GPU and gates + times each
     candidate (claimed in the DB first, so concurrent tuners share work); failures are recorded;
then re-measure the best of all families interleaved with the default and SDPA; the lowest median
wins. Everything is in SQLite as it happens (the studies in Optuna's journal beside it, or in --storage):
a killed run resumes. A run (`workers.tune`, `workers.tune_workers`) drives a `shared.SharedTuner`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import random

import optuna

from autoflash import codegen
from autoflash.device import GPUFingerprint, gpu_fingerprint
from autoflash.problem import Shape
from autoflash.space import Variant, default_variant, families_for, load_space
from autoflash.store import Store
from autoflash.tuning import sandbox
from autoflash.tuning.storage import make_storage
from autoflash.tuning.sandbox import FAILED_STATUSES, Outcome, Sandbox
from autoflash.tuning.results import ProblemResult, Reporter, TuneOptions, median
from autoflash.tuning.results import spread as spread_of
from autoflash.tuning.seeds import current_winners, read_shipped_winners, seed_variants, training_backward, training_forward
from autoflash.tuning.timing import tflops
from autoflash.tuning.winner_rows import is_vendor, store_winner_rows, vendor_on_a_tie

optuna.logging.set_verbosity(optuna.logging.WARNING)


def optuna_storage_path(db_path) -> str:
    return f"{db_path}.optuna.journal"


def competes(family: str, interpret: bool) -> bool:
    """Whether a family's candidates are searched: vendor kernels compete on a GPU; in the
    interpreter they would beat every interpreted one."""
    return not (interpret and load_space(family).vendor)


class Tuner:
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
        self.shipped_winners = read_shipped_winners(self.gpu_key)  # warm-start seeds, read once per run
        store.mark_dead_runs()  # runs a kill left 'running' (their trials are kept and resumed)
        store.drop_orphan_claims()  # candidates those runs claimed but never measured
        self.run_id = store.start_run(self.gpu_key, command)
        self.sandbox = Sandbox(self.device_str, env)
        self.compilers = None if options.interpret else sandbox.WorkerPool(options.compile_workers, self.device_str, env)
        self.journal = make_storage(options.storage, store.path)  # (--storage; default: the journal beside the DB)
        self.total_measured = 0
        # Workers start before the first problem's clock (start-up is not charged to one problem;
        # `tune` charges it to the run's budget, which it then splits over the problems).
        self.sandbox.call(sandbox.ping, (), options.trial_timeout_s)
        if self.compilers:
            self.compilers.start(options.trial_timeout_s)

    def close(self, status: str, problems: int) -> None:
        stopped = status != "finished"  # Ctrl-C or SIGTERM: the workers are killed, not waited for
        self.sandbox.close(now=stopped)
        if self.compilers:
            self.compilers.close(now=stopped)
        self.store.finish_run(self.run_id, status, problems, self.total_measured)

    # ------------------------------------------------------------------ one problem
    def tune_problem(self, shape: Shape, deadline: float | None) -> ProblemResult:
        """Search every kernel family of the problem's op that has valid variants here (the trial
        budget split between them), then re-measure the best of all families together."""
        problem = shape.problem
        valid = {f: load_space(f).valid_variants(problem, self.device) for f in families_for(problem.op)}
        families = [f for f in valid if valid[f] and competes(f, self.opt.interpret)]
        if not families:
            return ProblemResult(shape, problem, None, {}, math.nan, 0, 0, "no_valid_candidate")
        default = default_variant(problem.op, problem, self.device)
        # Backward candidates are paired with the stored own forward (and a vendor forward with the
        # stored own backward until this search finds a better one): what a training step serves.
        stored = [self.store.winners(self.gpu_key, head_dim=shape.head_dim), self.shipped_winners]
        self.sandbox.context.update(training_forward=training_forward(shape, self.device, stored),
                                    training_backward=training_backward(shape, self.device, stored))
        done: dict[str, dict] = {}  # "family:variant json" -> trial row
        measured = failed = 0
        # Vendor kernels first, every one of them, beside the trial budget and the time budget: a
        # handful of variants with nothing to compile (each bounded by the trial timeout), and the
        # bar an own kernel must clear. A short search that ran out of trials or time before
        # reaching them stored own kernels slower than torch SDPA.
        vendor = [f for f in families if load_space(f).vendor]
        for family in vendor:
            m, f = self._search(shape, family, valid[family], default, done, len(valid[family]), None)
            measured, failed = measured + m, failed + f
        own = [f for f in families if f not in vendor]
        own_measured = 0
        for n, family in enumerate(own):
            family_deadline = deadline
            if deadline is not None:  # the families left share the time left
                family_deadline = self.clock() + (deadline - self.clock()) / (len(own) - n)
            trials = max(1, (self.opt.trials - own_measured) // (len(own) - n))
            m, f = self._search(shape, family, valid[family], default, done, trials, family_deadline)
            measured, failed, own_measured = measured + m, failed + f, own_measured + m
        cut_short = deadline is not None and self.clock() >= deadline and own_measured < self.opt.trials
        result = self._pick_winner(shape, problem, done, default, measured, failed)
        result.cut_short, result.own_measured = cut_short, own_measured
        return result

    def _search(self, shape: Shape, family: str, valid: list[Variant], default: Variant, done: dict, trials: int,
                deadline: float | None) -> tuple[int, int]:
        """One family's search for `shape`'s problem over its `valid` variants; fills `done`,
        returns (measured, failed)."""
        problem = shape.problem
        space = load_space(family)
        thash = codegen.template_hash(family)
        first = default if default.family == family else space.nearest_valid(space.default_for(problem, self.device),
                                                                             problem, self.device)
        mine = {r["variant"]: r for r in self.store.trials_for(self.gpu_key, problem.key, thash)}
        done.update({f"{family}:{k}": r for k, r in mine.items()})
        budget = min(trials, len(valid))
        study, queue_ = self._open_search(problem, thash, first, valid, trials, budget)
        # Variants measured or taken: each counts once against the budget, however often it is heard of.
        counted = {key for key, r in mine.items() if r["status"] != "pruned"}
        failed = 0
        best = min((r["median_ms"] for r in done.values() if r["status"] == "ok" and r["median_ms"]), default=math.inf)
        batch_size = self.compilers and self.opt.compile_workers or 1

        def time_left() -> bool:
            # (the first candidate is measured even past the deadline: every problem gets a winner)
            return deadline is None or not counted or self.clock() < deadline

        def next_batch(n: int, stale: int = 0):
            """Ask for up to n new candidates and start compiling them (in the background)."""
            if study is None:
                batch = [(None, v) for v in queue_ if v.json() not in mine][:n] if n > 0 and time_left() else []
                taken = {v for _, v in batch}
                queue_[:] = [v for v in queue_ if v not in taken]
                return (batch, self._compile_async(batch, shape)) if batch else None
            while n > 0 and time_left() and stale <= 3:
                if stale == 3:  # the sampler keeps proposing known or invalid variants: hand it unmeasured
                    left = [v for v in valid if v.json() not in mine]  # valid ones, so the budget is spent
                    for v in random.Random(self.opt.seed + len(mine)).sample(left, min(n, len(left))):
                        study.enqueue_trial(v.as_dict())
                batch = self._ask_batch(study, space, problem, mine, n)
                if batch:
                    return batch, self._compile_async(batch, shape)
                stale += 1
            return None

        pending = next_batch(min(batch_size, budget - len(counted)))
        while pending is not None:
            batch, compiling = pending
            compiled = compiling.result()
            # Compile the next batch on the CPU cores while this one is measured on the GPU.
            pending = next_batch(min(batch_size, budget - len(counted) - len(batch)))
            for (trial, variant), c in zip(batch, compiled):
                if not time_left():
                    _tell(study, trial, state=optuna.trial.TrialState.PRUNED)  # out of time: not measured
                    continue
                row, outcome = self._measure(variant, c, shape, thash)
                key = variant.json()
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
                if outcome.status == "ok" and math.isfinite(outcome.ms):
                    _tell(study, trial, outcome.ms)
                    best = min(best, outcome.ms)
                else:
                    failed += outcome.status in FAILED_STATUSES
                    _tell(study, trial, state=optuna.trial.TrialState.FAIL)
                self.reporter.trial_done(len(counted), budget, variant, outcome, tflops(shape, best))
        return len(counted), failed

    def _open_search(self, problem, thash: str, first: Variant, valid: list, trials: int, budget: int):
        """(Optuna study, None), or (None, candidate queue) when the whole space fits the budget."""
        if len(valid) <= trials:
            # Brute force: no sampler; the stored winner and the default first, then the declared
            # order. (The DB alone makes this resumable.)
            known = current_winners(problem, self.device, thash, self.shipped_winners + self.store.winners(self.gpu_key))
            return None, list(dict.fromkeys(known + [first] + valid))
        study = optuna.create_study(
            study_name=f"{self.gpu_key}|{problem.key}|{thash}", storage=self.journal, direction="minimize",
            load_if_exists=True, sampler=make_sampler(self.opt.seed, trials))
        if not study.trials:
            rows = self.store.winners(self.gpu_key, op=problem.op, head_dim=problem.head_dim) + self.shipped_winners
            for seed_variant in seed_variants(first, problem, self.device, thash, rows, budget):
                study.enqueue_trial(seed_variant.as_dict(), skip_if_exists=True)
        return study, None

    def _ask_batch(self, study, space, problem, done: dict, n: int) -> list:
        batch, seen, attempts = [], set(), 0
        while len(batch) < n and attempts < 50 * n:
            attempts += 1
            trial = study.ask()
            variant = space.suggest(trial)
            if space.violations(variant, problem, self.device):
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

    def _compile_async(self, batch: list, shape: Shape) -> concurrent.futures.Future:
        if self.compilers is None:  # the interpreter compiles nothing
            done = concurrent.futures.Future()
            done.set_result([Outcome("ok") for _ in batch])
            return done
        fn = self.opt.compile_fn or sandbox.compile_variant
        args = [(v.json(), v.family, shape, self.opt.rep_ms, self.device_str) for _, v in batch]
        return self.compilers.map_async(fn, args, self.opt.trial_timeout_s)

    def _measure(self, variant: Variant, compiled: Outcome, shape: Shape, thash: str):
        """Claim the candidate in the DB, gate and time it in the sandbox (unless its compile
        failed), record the outcome: (trial row, outcome), or (None, None) when another tuner on
        this DB has claimed it."""
        claim = self.store.claim_trial(run_id=self.run_id, gpu_key=self.gpu_key, problem=shape.problem,
                                       template_hash=thash, variant_json=variant.json(),
                                       shape=dataclasses.asdict(shape))
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

    def _pick_winner(self, shape, problem, done, default, measured, failed) -> ProblemResult:
        """Re-measure the top candidates of all families interleaved (with the default, the stored
        winner and SDPA); store the lowest median, unless the stored winner is within the noise band.

        Integrity: a trial row read from the DB becomes a candidate only when its family is one of
        the op's current families and its variant is declared in that family's space, canonical and
        valid here; one measured by an earlier run is gated again in this run before it competes.
        Only a candidate whose re-measure median (this run) is finite is promoted: when the
        re-measure fails, the stored winner stays and nothing new is stored."""
        candidates = {}
        for key, r in done.items():
            variant = self._trusted_variant(key, r, problem)
            if variant is not None:
                candidates[key] = variant
        ok = sorted(candidates, key=lambda key: done[key]["median_ms"])
        if not ok:
            return ProblemResult(shape, problem, None, {}, math.nan, measured, failed, "no_valid_candidate")
        top = ok[: self.opt.top_k]
        default_key = f"{default.family}:{default.json()}"
        if default_key in ok:
            top.append(default_key)  # a gated default competes in the final round too
        incumbent = self._incumbent(problem, set(ok))
        if incumbent:
            top.append(incumbent)
        best_vendor = next((key for key in ok if is_vendor(key)), None)
        if best_vendor:
            top.append(best_vendor)  # the bar: an own kernel is stored only where it beats it (below)
            top += [key for key in ok if not is_vendor(key)][:1]  # (stored beside a vendor win)
        top = [key for key in dict.fromkeys(top) if self._gated_this_run(key, done[key], candidates[key], shape)]
        if incumbent not in top:
            incumbent = None
        stored = self._stored_winner(problem)
        if not top:
            return ProblemResult(shape, problem, stored, {}, math.nan, measured, failed, "no_valid_candidate")
        methods = list(dict.fromkeys(top + ([default_key] if default_key in ok else [])))
        # A vendor forward is re-measured with the fastest gated own backward, and stored with it.
        paired_own = next((key for key in ok if key in top and not is_vendor(key)), None)
        if problem.op == "bwd" and paired_own:
            self.sandbox.context["training_backward"] = tuple(paired_own.split(":", 1))
        if not self.opt.interpret:
            methods += ["sdpa_cudnn", "sdpa_flash"]
        result = self.sandbox.call(self.opt.remeasure_fn or sandbox.remeasure, (
            methods, problem.op, shape, self.opt.rounds, self.opt.rep_ms, self.device_str), self.opt.trial_timeout_s)
        samples = {} if isinstance(result, Outcome) else result["samples"]
        medians = {m: median(samples.get(m, [])) for m in methods}
        finite = [m for m in top if math.isfinite(medians[m]) and medians[m] > 0]
        if not finite:  # the re-measure failed: keep the stored winner, store nothing
            return ProblemResult(shape, problem, stored, {}, math.nan, measured, failed, "remeasure_failed")
        winner_key = min(finite, key=lambda m: medians[m])
        spread = spread_of(samples.get(winner_key, []))
        # Noise band: a re-tune keeps the stored winner unless a challenger beats it by more than
        # the winner's own round-to-round spread (at least 1%), so winners do not flap on noise.
        band = max(0.01, spread)
        # (Not across the own/vendor line: there a tie goes to the vendor kernel, `vendor_on_a_tie`.)
        if (incumbent in finite and winner_key != incumbent and is_vendor(incumbent) == is_vendor(winner_key)
                and medians[incumbent] <= medians[winner_key] * (1 + band)):
            winner_key = incumbent
            spread = spread_of(samples.get(winner_key, []))
        if (tie := vendor_on_a_tie(winner_key, finite, medians)) != winner_key:
            winner_key, spread = tie, spread_of(samples.get(tie, []))
        ms = {"tuned": medians[winner_key], "default": medians.get(default_key, math.nan),
              "sdpa_cudnn": medians.get("sdpa_cudnn", math.nan), "sdpa_flash": medians.get("sdpa_flash", math.nan)}
        store_winner_rows(self.store, gpu_key=self.gpu_key, problem=problem, shape=shape, winner_key=winner_key,
                          finite=finite, medians=medians, samples=samples, spread=spread, ms=ms,
                          measured=measured, run_id=self.run_id, paired_own=paired_own)
        return ProblemResult(shape, problem, candidates[winner_key], ms, spread, measured, failed, "tuned")

    def _trusted_variant(self, key: str, row: dict, problem) -> Variant | None:
        """The Variant of a 'family:variant JSON' trial, when it may compete (see `_pick_winner`)."""
        family, _, variant_json = key.partition(":")
        ms = row.get("median_ms")
        if row.get("status") != "ok" or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            return None
        if family not in families_for(problem.op):
            return None
        try:
            space = load_space(family)
            variant = space.check_declared(json.loads(variant_json))
            if variant.json() != variant_json or space.violations(variant, problem, self.device):
                return None
        except (ValueError, TypeError):
            return None
        return variant

    def _gated_this_run(self, key: str, row: dict, variant: Variant, shape) -> bool:
        """Whether the candidate passed the correctness gate in this run: rows this run recorded
        did; a row of an earlier run (a resumed or crafted DB) is evaluated again now."""
        if "id" not in row:  # `_record`'s rows (this run) carry no DB id; rows read from the DB do
            return True
        outcome = self.sandbox.evaluate(variant, shape, rep_ms=self.opt.rep_ms, timeout_s=self.opt.trial_timeout_s,
                                        fn=self.opt.evaluate_fn)
        return outcome.status == "ok" and math.isfinite(outcome.ms) and outcome.ms > 0

    def _stored_winner(self, problem) -> Variant | None:
        for family in families_for(problem.op):
            row = self.store.winner(self.gpu_key, problem.key, codegen.template_hash(family))
            if row:
                try:
                    return load_space(family).check_declared(json.loads(row["variant"]))
                except (ValueError, TypeError):
                    return None
        return None

    def _incumbent(self, problem, passed: set) -> str | None:
        """The stored winner served for this problem, when it passed this run's gate: of the rows of
        the current families the fastest, as the dispatcher picks (after a vendor win the best own
        kernel is stored beside it, and is not the incumbent)."""
        rows = [(row["median_ms"], f"{family}:{row['variant']}") for family in families_for(problem.op)
                for row in [self.store.winner(self.gpu_key, problem.key, codegen.template_hash(family))]
                if row and isinstance(row.get("median_ms"), (int, float))]
        served = min(rows, default=None)
        return served[1] if served and served[1] in passed else None


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
