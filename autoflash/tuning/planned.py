"""A tuning run planned over its whole budget: the `planner`'s passes carried out by a `Tuner`, the
compiles started ahead of their measurement, the progress it reports, and at the end what a larger
budget is expected to gain."""

from __future__ import annotations

import dataclasses
import json
import math

from autoflash.problem import Shape
from autoflash.space import InvalidVariant, default_variant, load_space
from autoflash.tuning.forecast import Curve, forecast
from autoflash.tuning.plan_costs import DECIDED_PICK_TIMINGS, WALL_PER_TIMING, Costs
from autoflash.tuning.planner import Arm, Planner, ProblemPlan, Snapshot
from autoflash.tuning.sandbox import ping
from autoflash.tuning.results import ProblemResult, Reporter, TuneOptions
from autoflash.tuning.vendor_warm import cudnn_variants, warm


WARM_SHARE = 0.25  # of a budget, at most, before the cuDNN build-ahead leaves the rest to the candidates
PHASE_OF = {"vendor": "vendor", "seeds": "seed", "search": "rounds", "pick": "picks"}  # step kind -> phase


@dataclasses.dataclass
class RunSummary:
    """What the run did, for the end of its report, `tune --plot` and `tune --json`."""

    elapsed_s: float
    budget_s: float | None
    snapshot: Snapshot
    shapes: list  # per planned problem, its Shape
    histories: list  # per planned problem, [(seconds into the run, best own ms, best vendor ms)]
    extra_s: float  # the larger budget `forecast` is for: this much more time
    forecast: list  # per planned problem, a forecast.Expected
    compiled: int  # variants sent to the compile pool (each binary once)
    own_measured: int = 0  # own candidates measured in this run
    vendor_measured: int = 0  # vendor candidates measured in this run
    phases: dict = dataclasses.field(default_factory=dict)  # phase -> seconds (startup, cudnn_warm, vendor, seed, rounds, picks)
    gpu_idle_s: float = 0.0  # seconds the measuring worker waited on compiles
    problems_with_winner: int = 0

    def per_min(self, n: int) -> float:
        return n / (self.elapsed_s / 60) if self.elapsed_s > 0 else math.nan

    def as_json(self) -> dict:
        """`autoflash tune --json`: what the run measured and how fast."""
        return {"budget_s": self.budget_s, "wall_s": round(self.elapsed_s, 1), "problems": len(self.shapes),
                "problems_with_winner": self.problems_with_winner, "own_measured": self.own_measured,
                "own_per_min": round(self.per_min(self.own_measured), 2), "vendor_measured": self.vendor_measured,
                "vendor_per_min": round(self.per_min(self.vendor_measured), 2),
                "phases": {k: round(v, 1) for k, v in self.phases.items()}, "gpu_idle_s": round(self.gpu_idle_s, 1),
                "compiled": self.compiled}


# A compile batch's wall time per family where it differs from the default prior (measured on an
# H100, Triton 3.6: a Triton batch of 12 variants ~8 s, a Gluon forward batch ~27 s).
COMPILE_PRIORS_S = {"gluon_sm90_fwd": 27.0}


def costs_for(options: TuneOptions) -> Costs:
    """The planner's priors, replaced by the run's own measurements as they come: SDPA backends ~3 s a
    forward problem and a candidate ~1.5 s (an H100: 27 forward candidates in 37 s); a forward pick
    re-times about top_k + 3 methods for `rounds` rounds, each ~1.5 rep_ms of wall time (spins,
    flushes), after ~1 s of set-up (an H100, the defaults: 2.2 s a forward pick, 5.5 s a backward
    one; the 4.6 s this prior said before, 11 s for a backward pick, would keep a minute of a
    22-problem run from its searches until the picks came); a backward problem's both take longer
    (`Costs.op_scale`). The interpreter compiles
    nothing and has no vendor candidates."""
    if options.interpret:
        return Costs(vendor_s=0.0, pick_s=1.0, decided_pick_s=1.0, prior_wait_s=0.0, prior_per_s=0.5, op_scale={})
    pick_s = 1.0 + pick_timings(options) * WALL_PER_TIMING * options.rep_ms / 1e3
    decided_pick_s = 1.0 + DECIDED_PICK_TIMINGS * WALL_PER_TIMING * options.rep_ms / 1e3  # (SDPA clearly ahead: one round)
    return Costs(pick_s=pick_s, decided_pick_s=decided_pick_s, prior_waits=dict(COMPILE_PRIORS_S))


def pick_timings(options: TuneOptions) -> int:
    """Timings in an open pick: about top_k + 3 methods (the default, the incumbent, the best vendor
    and own candidates, SDPA's flash column; its cuDNN column is the cuDNN candidate's timing,
    `winner_rows.yardstick_twin`) for each of its rounds."""
    return (options.top_k + 3) * options.rounds


def plan_of(ps) -> ProblemPlan:
    arms = [Arm(f, ps.caps[f], len(ps.seeds[f]), measured=ps.counted.get(f, 0), best_ms=ps.best_ms([f]))
            for f in ps.own]
    return ProblemPlan(ps.shape.label(), arms, op=ps.problem.op, has_vendor=bool(ps.vendor),
                       vendor_ms=ps.best_ms(ps.vendor), flops=timed_flops(ps.shape))


def timed_flops(shape: Shape) -> float:
    """FLOPs of one timed call: a backward problem's times forward and backward (as `timing.tflops`)."""
    return (dataclasses.replace(shape, op="fwdbwd") if shape.op == "bwd" else shape).flops()


def run_planned(tuner, shapes: list[Shape], options: TuneOptions, reporter: Reporter, start: float,
                order: list[int]) -> dict[int, ProblemResult]:
    """Tune `shapes` (one per problem) in the planner's passes; order: the shapes' indices in the
    order this worker takes them. Returns {shape index: result}."""
    results, searches, index = {}, [], []
    for i in order:
        ps = tuner.open_problem(shapes[i])
        if ps is None:
            results[i] = ProblemResult(shapes[i], shapes[i].problem, None, {}, math.nan, 0, 0, "no_valid_candidate")
            reporter.problem_done(results[i])
            continue
        searches.append(ps)
        index.append(i)
    tuner.sandbox.call(ping, (), options.trial_timeout_s)  # (the measuring worker started as they opened)
    plans = [plan_of(ps) for ps in searches]
    batch = options.compile_workers if tuner.compilers else 1
    # The interpreter times one call, not rep_ms of repetitions: its long calls add no extra time.
    rep_ms = math.inf if options.interpret else options.rep_ms
    planner = Planner(plans, options.budget_s, options.clock, costs_for(options), start=start, batch=batch,
                      rep_ms=rep_ms, pick_timings=pick_timings(options))
    _compile_seeds(tuner, planner, searches)
    if options.budget_s is not None and planner.reserve_s() > planner.left():
        reporter.budget_short(options.budget_s, options.clock() - start + planner.reserve_s())
    phases = dict.fromkeys(("startup", "cudnn_warm", "vendor", "seed", "rounds", "picks"), 0.0)
    phases["startup"] = options.clock() - start  # (the workers' start, the problems opened)
    _warm_vendor(tuner, searches, options, start)
    phases["cudnn_warm"] = options.clock() - start - phases["startup"]
    idle, own0, vendor0 = 0.0, tuner.own_measured, tuner.vendor_measured
    while (step := planner.next_step()) is not None:
        t0 = options.clock()
        ps = searches[step.problem]
        reporter.step_started(step.kind, step.problem, len(searches), ps.shape)
        if step.kind == "vendor":
            tuner.measure_vendor(ps)
            planner.done(step, vendor_ms=ps.best_ms(ps.vendor))
        elif step.kind == "pick":
            result = tuner.pick(ps)
            results[index[step.problem]] = result
            winner = result.winner
            planner.done(step, served="" if winner is None else "vendor" if load_space(winner.family).vendor else "own")
            reporter.problem_done(result)
        else:
            ahead = _compile_ahead(tuner, planner, searches, step)  # (from the seed steps on: the rounds')
            reports = tuner.search(ps, step.counts, step.deadline, then=ahead, force=step.kind == "seeds")
            idle += sum(r.get("idle_s") or 0.0 for r in reports.values())
            planner.done(step, arms=reports)
        phases[PHASE_OF[step.kind]] += options.clock() - t0
        reporter.plan_update(planner.snapshot())
    elapsed = options.clock() - start
    extra = options.budget_s if options.budget_s is not None else elapsed
    own = tuner.own_measured - own0
    expected = forecast(curves_of(searches, plans), extra, own / elapsed if elapsed > 0 else 0.0)
    reporter.run_finished(RunSummary(
        elapsed, options.budget_s, planner.snapshot(), [ps.shape for ps in searches], [p.history for p in plans],
        extra, expected, tuner.compiles.requested, own, tuner.vendor_measured - vendor0, phases, idle,
        sum(r.winner is not None for r in results.values())))
    return results


def curves_of(searches: list, plans: list) -> list[Curve]:
    """Each problem's own candidates' times in the order measured (`forecast`'s search curves)."""
    curves = []
    for ps, p in zip(searches, plans):
        times = tuple(r["median_ms"] for key, r in ps.done.items() if key.partition(":")[0] in ps.own
                      and r.get("status") == "ok" and isinstance(r.get("median_ms"), (int, float))
                      and math.isfinite(r["median_ms"]) and r["median_ms"] > 0)
        curves.append(Curve(p.label, times, p.vendor_ms, any(a.open() for a in p.arms)))
    return curves


def pair_halves(ps, device) -> list:
    """(variant, shape) of the own kernels a backward problem's candidates are timed with (the
    training pair's other halves: the stored own forward, else the forward default, which also
    gives the gate its O and LSE; the stored own backward, else the default, beside a vendor
    forward). Built by no candidate's compile, they were built by the measuring worker itself, the
    GPU idle, when the vendor pass first paired them."""
    if ps.problem.op != "bwd":
        return []
    out = []
    for op, stored in (("fwd", ps.context.get("training_forward")), ("bwd", ps.context.get("training_backward"))):
        shape = dataclasses.replace(ps.shape, op=op)
        try:
            variants = [default_variant(op, shape.problem, device)]
        except InvalidVariant:  # (no own kernel of this op fits the shape on this GPU, e.g. d256 forwards
            variants = []      # in 64 KiB of shared memory: the pairs that need it fail alone, as before)
        if stored:
            try:
                variants.insert(0, load_space(stored[0]).check_declared(json.loads(stored[1])))
            except (ValueError, TypeError):
                pass  # (the gate says what is wrong with it, when it is used)
        out += [(v, shape) for v in variants]
    return out


def _warm_vendor(tuner, searches: list, options: TuneOptions, start: float) -> None:
    """cuDNN's kernels for each problem's cuDNN candidates, built in the measuring worker before the
    vendor pass (`vendor_warm`; a task per problem): on a GPU only, before anything is timed, and
    within a quarter of the budget (what is not built ahead is built by the candidate's own call)."""
    if options.interpret:
        return
    for ps in searches:
        if options.budget_s is not None and options.clock() - start > WARM_SHARE * options.budget_s:
            return
        if variants := cudnn_variants(ps.valid, ps.vendor):
            tuner.sandbox.call(warm, (ps.shape, variants, tuner.device_str), options.trial_timeout_s)


def _compile_seeds(tuner, planner: Planner, searches: list) -> None:
    """The seed pass's candidates start compiling now, in one batch, while the vendor pass measures;
    first the backward problems' pair halves, which the vendor pass's pairs need."""
    items = [item for ps in searches for item in pair_halves(ps, tuner.device)]
    for i, counts in planner.planned_seeds().items():
        for family, n in counts:
            items += [(v, searches[i].shape) for v in searches[i].seeds[family][:n]]
            planner.compiling(i, family, n)
    if items:
        tuner.compiles.start_all(items)


def _compile_ahead(tuner, planner: Planner, searches: list, step):
    """A callback for the step's search: once its own first batch is compiling, the searches
    expected after it start compiling their batches too, the most valuable first, until the pool
    holds `Planner.horizon_s` of work: ready when the GPU is."""
    def ahead():
        if tuner.compilers is None:
            return
        tried = set()
        while planner.backlog_s() < planner.horizon_s() and (nxt := planner.peek(step, tried)) is not None:
            i, family, n = nxt
            tried.add((i, family))
            asked = tuner.ask_ahead(searches[i], family, n)
            if asked:
                planner.compiling(i, family, asked)
    return ahead
