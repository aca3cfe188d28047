"""The run's plan (autoflash/tuning/planner.py) against a simulated GPU and compile pool on an
injected clock: compiles take their time on a fixed number of workers in the order asked, a
candidate is measured once its compile is done. The numbers are the H100's (issue: a Triton compile
batch ~8 s, a Gluon one ~27 s, the SDPA backends ~3 s a problem)."""

from __future__ import annotations

import dataclasses
import math

from autoflash.tuning.plan_costs import (CALLS_PER_TIMING, DECIDED_PICK_TIMINGS, NOMINAL_FLOPS_PER_S, VENDOR_TIMINGS,
                                        WALL_PER_TIMING, Costs)
from autoflash.tuning.planner import Arm, Planner, ProblemPlan, Step


@dataclasses.dataclass
class Family:
    compile_s: float
    measure_s: float
    seeds: int
    own_ms: float  # its first candidate's time (the vendor's is 1.0); each further one 3% faster
    cap: int = 40


TRITON = Family(compile_s=8.0, measure_s=1.0, seeds=3, own_ms=1.2)
GLUON = Family(compile_s=27.0, measure_s=1.0, seeds=2, own_ms=1.1)


class Sim:
    def __init__(self, problems: int, families: dict, workers: int = 12, vendor_s: float = 3.0,
                 pick_s: float = 2.0, own_scale=None, ops=None, bwd_costs=(None, None), call_ms=None,
                 rep_ms: float = 100.0):
        self.t = 0.0
        self.families, self.vendor_s, self.pick_s = families, vendor_s, pick_s
        self.ops = ops or ["fwd"] * problems
        # (vendor s, pick s) of a backward problem, where they differ from a forward one's
        self.bwd_vendor_s, self.bwd_pick_s = bwd_costs[0] or vendor_s, bwd_costs[1] or pick_s
        self.free = [0.0] * workers
        self.ready: dict = {}
        self.measured = {(i, f): 0 for i in range(problems) for f in families}
        self.vendor, self.picked = set(), set()
        self.own_scale = own_scale or [1.0] * problems
        # Each problem's call (the vendor's); a long one's vendor pass and pick last longer, as on a GPU
        # where every timing makes CALLS_PER_TIMING calls at least.
        self.call_ms, self.rep_ms = call_ms or [1.0] * problems, rep_ms
        self.deadlines = []
        self.idle = 0.0  # the GPU's wait on compiles
        self.fill = True  # compile ahead until the pool holds the planner's horizon (else one search ahead)

    def clock(self) -> float:
        return self.t

    def plans(self) -> list[ProblemPlan]:
        return [ProblemPlan(f"p{i}", [Arm(f, fam.cap, fam.seeds) for f, fam in self.families.items()], op=self.ops[i])
                for i in range(len(self.own_scale))]

    def extra(self, i: int, timings: int) -> float:
        return timings * max(0.0, CALLS_PER_TIMING * self.call_ms[i] - WALL_PER_TIMING * self.rep_ms) / 1e3

    def compile(self, i: int, family: str, n: int, after: int = 0) -> None:
        """The arm's next n candidates (after `after` more), compiled on the first free workers."""
        for k in range(after, after + n):
            key = (i, family, self.measured[(i, family)] + k)
            if key not in self.ready:
                w = min(range(len(self.free)), key=self.free.__getitem__)
                self.free[w] = max(self.t, self.free[w]) + self.families[family].compile_s
                self.ready[key] = self.free[w]

    def best(self, i: int, family: str) -> float:
        n = self.measured[(i, family)]
        return math.inf if n == 0 else self.families[family].own_ms * self.own_scale[i] * 0.97 ** (n - 1)

    def run(self, planner: Planner) -> None:
        """What `planned.run_planned` does, with this simulation as the tuner."""
        for i, counts in planner.planned_seeds().items():
            for family, n in counts:
                self.compile(i, family, n)
                planner.compiling(i, family, n)
        while (step := planner.next_step()) is not None:
            i = step.problem
            if step.kind == "vendor":
                self.t += (self.bwd_vendor_s if self.ops[i] == "bwd" else self.vendor_s) + self.extra(i, VENDOR_TIMINGS[self.ops[i]])
                self.vendor.add(i)
                planner.done(step, vendor_ms=self.call_ms[i])
            elif step.kind == "pick":
                timings = DECIDED_PICK_TIMINGS if planner.decided(planner.problems[i]) else 21
                self.t += (self.bwd_pick_s if self.ops[i] == "bwd" else self.pick_s) + self.extra(i, timings)
                self.picked.add(i)
                planner.done(step, served="own")
            else:
                self.deadlines.append(step.deadline)
                for family, n in step.counts:
                    self.compile(i, family, n)
                tried = set()  # compile ahead, as `planned._compile_ahead` (the same search's next batch too)
                while ((self.fill or not tried) and planner.backlog_s() < planner.horizon_s()
                       and (nxt := planner.peek(step, tried)) is not None):
                    tried.add(nxt[:2])
                    self.compile(*nxt, after=dict(step.counts).get(nxt[1], 0) if nxt[0] == i else 0)
                    planner.compiling(*nxt)
                force = step.kind == "seeds"  # (as the tuner: the seed step's first family's first)
                planner.done(step, arms={f: self.measure(i, f, n, step.deadline, force and f == step.counts[0][0])
                                         for f, n in step.counts})

    def measure(self, i: int, family: str, n: int, deadline: float | None, force: bool) -> dict:
        waits, new = [], 0
        for k in range(n):
            key = (i, family, self.measured[(i, family)])
            forced = force and k == 0
            wait = max(0.0, self.ready[key] - self.t)
            if deadline is not None and not forced and self.t + wait >= deadline:
                break
            self.t += wait
            self.idle += wait
            waits.append(wait)
            self.t += self.families[family].measure_s
            self.measured[(i, family)] += 1
            new += 1
        return {"measured": self.measured[(i, family)], "best_ms": self.best(i, family),
                "wait_s": waits[0] if waits else None,
                "per_s": (new * self.families[family].measure_s + sum(waits[1:])) / new if new else None,
                "exhausted": False}


def plan(sim: Sim, budget_s: float | None, rep_ms: float = 100.0, **costs) -> Planner:
    # (the simulation's picks last the same, decided or not: the decided prior is the open one)
    costs.setdefault("decided_pick_s", costs.get("pick_s", Costs.pick_s))
    return Planner(sim.plans(), budget_s, sim.clock, Costs(prior_waits={"gluon": 27.0}, **costs), batch=12,
                   rep_ms=rep_ms)


def test_a_budget_smaller_than_one_problems_compile_still_measures_every_problems_vendor_and_seed():
    families = {"triton": TRITON, "gluon": GLUON}
    sim = Sim(problems=4, families=families)
    budget = 26.0
    assert budget < GLUON.compile_s  # one problem's Gluon batch alone would outlast the run
    planner = plan(sim, budget)
    sim.run(planner)
    assert sim.vendor == sim.picked == {0, 1, 2, 3}
    for i in range(4):
        assert sum(sim.measured[(i, f)] for f in families) >= 1, sim.measured  # a seed of every problem
    assert sim.t <= budget, sim.t
    assert all(p.stage == "picked" for p in planner.problems)


def test_a_budget_below_what_every_problem_must_get_is_overrun_by_that_only():
    """Vendor, one seed and the pick of every problem are the reserve: a budget that does not hold
    them is overrun by them, by nothing else (no search round, no second seed)."""
    sim = Sim(problems=6, families={"triton": TRITON})
    planner = plan(sim, 10.0)
    sim.run(planner)
    assert all(sim.measured[(i, "triton")] == 1 for i in range(6))
    assert sim.t <= 6 * (sim.vendor_s + TRITON.measure_s + sim.pick_s) + TRITON.compile_s


def test_a_larger_budget_is_used_and_ends_on_time():
    families = {"triton": TRITON, "gluon": GLUON}
    sim = Sim(problems=11, families=families)
    budget = 240.0
    planner = plan(sim, budget, pick_s=3.0)
    sim.run(planner)
    assert sim.picked == set(range(11))
    assert 0.85 * budget <= sim.t <= budget, sim.t
    measured = [sum(sim.measured[(i, f)] for f in families) for i in range(11)]
    assert min(measured) >= 2 and sum(measured) >= 60, measured


def test_backward_problems_picks_are_not_costed_by_a_forward_one():
    """The H100's 22 problems (issue 44): a backward problem's vendor pass takes ~3.7x a forward
    one's and its pick ~2.5x. The first pick (a forward one) said nothing of the backward picks:
    the rounds are stopped in time for them and the run ends within its budget."""
    families = {"triton": TRITON, "gluon": GLUON}
    sim = Sim(problems=22, families=families, vendor_s=2.6, pick_s=2.2, ops=["fwd"] * 11 + ["bwd"] * 11,
              bwd_costs=(9.7, 5.5))
    budget = 300.0
    planner = plan(sim, budget, pick_s=4.6)
    sim.run(planner)
    assert sim.picked == set(range(22)) and sim.t <= budget, sim.t
    assert all(sum(sim.measured[(i, f)] for f in families) >= 1 for i in range(22))


def test_a_problem_of_long_calls_costs_its_vendor_pass_and_pick_by_its_calls():
    """Every timing makes CALLS_PER_TIMING calls at least: at rep_ms 100 a problem whose calls take
    100 ms has a pick 21 x (2 s - 0.15 s) longer than a 1-ms one's (21 timings) and a vendor pass 6
    timings' worth longer; before its vendor pass measures the call, its FLOPs say how long it is."""
    short, long = ProblemPlan("short", [], vendor_ms=1.0), ProblemPlan("long", [], vendor_ms=100.0)
    unmeasured = ProblemPlan("unmeasured", [], flops=0.1 * NOMINAL_FLOPS_PER_S)  # (100 ms at the nominal rate)
    planner = Planner([short, long, unmeasured], None, lambda: 0.0, Costs(), rep_ms=100.0, pick_timings=21)
    assert planner.pick_s(short) == planner.costs.pick("fwd") and planner.vendor_s(short) == planner.costs.vendor("fwd")
    assert math.isclose(planner.pick_s(long), planner.pick_s(short) + 21 * 1.85)
    assert math.isclose(planner.vendor_s(long), planner.vendor_s(short) + 6 * 1.85)
    assert math.isclose(planner.pick_s(unmeasured), planner.pick_s(long))
    assert Planner([long], None, lambda: 0.0, Costs(), rep_ms=math.inf).pick_s(long) == planner.pick_s(short)


def test_one_problem_of_long_calls_among_short_ones_is_kept_time_for():
    """DeepSeek-V3 prefill on an H100 (`--shapes mla`): one backward problem's calls take ~100 ms, its
    pick over 33 s where 5.5 s was kept back, and the run overran its budget by over 20 s. Here its calls
    take 60 ms (its pick 22 s longer than the others'): the reserve at the end of the seed pass
    holds its pick, and the run ends within its budget; costed per op only, it overruns."""
    families = {"triton": TRITON, "gluon": GLUON}
    budget, ends = 240.0, {}
    for rep_ms in (100.0, math.inf):  # (an infinite rep_ms: no call is long, the costs per op only)
        sim = Sim(problems=8, families=families, vendor_s=2.6, pick_s=2.2, ops=["fwd"] * 4 + ["bwd"] * 4,
                  bwd_costs=(9.7, 5.5), call_ms=[1.0] * 7 + [60.0])
        planner = plan(sim, budget, rep_ms=rep_ms, pick_s=2.2)
        planner.done = reserve_after_seeds(planner, ends, rep_ms)
        sim.run(planner)
        assert sim.picked == set(range(8))
        ends[rep_ms, "t"] = sim.t
    picks = 4 * 2.2 + 4 * 5.5 + 21 * (CALLS_PER_TIMING * 60.0 - WALL_PER_TIMING * 100.0) / 1e3  # (as simulated)
    assert ends[100.0, "reserve"] >= picks > ends[math.inf, "reserve"] + 20
    assert ends[math.inf, "t"] > budget + 20, ends
    assert ends[100.0, "t"] <= budget + TRITON.measure_s, ends


def reserve_after_seeds(planner: Planner, ends: dict, key) -> callable:
    """planner.done, which records the reserve into ends[key, "reserve"] when the seed pass ends."""
    done = planner.done

    def recorded(step: Step, **kwargs):
        done(step, **kwargs)
        if step.kind == "seeds" and all(p.seeded for p in planner.problems):
            ends[key, "reserve"] = planner.reserve_s()

    return recorded


def test_a_long_pick_does_not_raise_a_short_problems_estimate():
    """What long calls added is taken off a measured duration before it is averaged: a long problem's
    pick leaves a short one's estimate at the base, and a short one's pick moves the base."""
    clock = [0.0]
    long, short = (ProblemPlan(label, [], vendor_ms=ms, vendor_done=True, seeded=True)
                   for label, ms in (("long", 100.0), ("short", 1.0)))
    planner = Planner([long, short], 600.0, lambda: clock[0], Costs(pick_s=2.0), rep_ms=100.0, pick_timings=21)
    step = planner.next_step()
    assert step == Step("pick", 0)
    clock[0] += 2.0 + 21 * 1.85  # (as costed)
    planner.done(step)
    assert math.isclose(planner.pick_s(short), 2.0) and math.isclose(planner.costs.pick("fwd"), 2.0)
    step = planner.next_step()
    clock[0] += 3.0
    planner.done(step)
    assert math.isclose(planner.costs.pick("fwd"), 2.5) and math.isclose(planner.pick_s(long), 2.5 + 21 * 1.85)


def test_the_pool_is_kept_busy_ahead_of_the_gpu():
    """Four problems forward and backward in three minutes (issue 44's convergence check): compiling
    ahead until the pool holds a Gluon batch's worth, not one search ahead, the GPU waits less on
    compiles and measures more candidates in the same budget."""
    families = {"triton": TRITON, "gluon": GLUON}
    runs = {}
    for fill in (False, True):
        sim = Sim(problems=8, families=families, ops=["fwd"] * 4 + ["bwd"] * 4, bwd_costs=(6.0, 5.0))
        sim.fill = fill
        sim.run(plan(sim, 180.0, pick_s=2.0))
        assert sim.t <= 180.0 and sim.picked == set(range(8))
        runs[fill] = (sum(sim.measured.values()), sim.idle)
    (one_ahead, idle_one), (filled, idle_filled) = runs[False], runs[True]
    assert filled > one_ahead and idle_filled < idle_one, runs


def test_rounds_go_where_an_own_gain_would_serve():
    """Two problems, one whose own kernel is near the vendor's and one far behind: the rounds spend
    the time on the first."""
    sim = Sim(problems=2, families={"triton": TRITON}, own_scale=[0.9, 2.0])
    planner = plan(sim, 60.0)
    sim.run(planner)
    near, far = sim.measured[(0, "triton")], sim.measured[(1, "triton")]
    assert near >= 5 * far, (near, far)
    assert sim.t <= 60.0


def test_without_a_budget_every_search_reaches_its_trial_budget():
    fam = dataclasses.replace(TRITON, cap=7)
    sim = Sim(problems=3, families={"triton": fam})
    planner = plan(sim, None)
    sim.run(planner)
    assert all(sim.measured[(i, "triton")] == 7 for i in range(3))
    assert planner.phase() == "done" and planner.eta_s() == 0
    assert all(d is None for d in sim.deadlines)


def test_no_step_reaches_into_the_time_kept_for_the_picks():
    sim = Sim(problems=5, families={"triton": TRITON, "gluon": GLUON})
    budget = 90.0
    planner = plan(sim, budget)
    sim.run(planner)
    searches = [d for d in sim.deadlines if d is not None]
    assert searches and max(searches) <= budget
    assert sim.t <= budget


def test_a_long_vendor_pass_is_judged_by_the_call_it_measured():
    """A problem with no FLOP estimate and no time yet: its vendor pass measures 100-ms calls and lasts
    as long as that makes it. The duration is judged with the call just measured (its long calls'
    time taken off), so the short-call vendor cost stays at its prior."""
    clock = [0.0]
    p = ProblemPlan("long", [], op="fwd")
    planner = Planner([p], 600.0, lambda: clock[0], Costs(vendor_s=3.0), rep_ms=100.0)
    step = planner.next_step()
    assert step == Step("vendor", 0) and planner.vendor_s(p) == 3.0  # (nothing says its calls are long yet)
    clock[0] += 3.0 + 6 * (CALLS_PER_TIMING * 100.0 - WALL_PER_TIMING * 100.0) / 1e3
    planner.done(step, vendor_ms=100.0)
    assert math.isclose(planner.costs.vendor("fwd"), 3.0)


def test_a_pick_sdpa_clearly_wins_is_costed_and_learned_apart():
    """Own best 20% behind SDPA's: the pick is decided by the trials (one round of a few methods) and
    costed at the decided prior; its measured duration teaches that cost, not an open pick's."""
    clock = [0.0]
    decided, open_ = (ProblemPlan(label, [Arm("triton", 5, 1, measured=5, best_ms=own)], vendor_ms=1.0,
                                  vendor_done=True, seeded=True) for label, own in (("decided", 1.2), ("open", 1.02)))
    planner = Planner([decided], 600.0, lambda: clock[0], Costs(pick_s=4.0, decided_pick_s=1.5))
    assert planner.decided(decided) and not planner.decided(open_)
    assert planner.pick_s(decided) == 1.5 and planner.pick_s(open_) == 4.0
    step = planner.next_step()
    assert step == Step("pick", 0)
    clock[0] += 1.0
    planner.done(step)
    assert planner.costs.pick("fwd", decided=True) == 1.0 and planner.costs.pick("fwd") == 4.0


def test_the_eta_past_a_too_small_budget_counts_what_every_problem_still_needs():
    """Ten problems on a 5 s budget: past the budget, with vendor passes still to come, the ETA is the
    work every problem must still get, not 0:00 (as the progress bar said on an H100)."""
    sim = Sim(problems=10, families={"triton": TRITON})
    planner = plan(sim, 5.0)
    assert planner.reserve_s() > planner.left()  # (the run says so when it starts)
    step = planner.next_step()
    sim.t += 10.0  # a slow first vendor pass: the budget is spent
    planner.done(step, vendor_ms=1.0)
    assert planner.left() < 0 and planner.eta_s() >= planner.reserve_s() > 0


def test_eta_progress_and_states():
    sim = Sim(problems=3, families={"triton": TRITON})
    planner = plan(sim, 60.0)
    first = planner.snapshot()
    assert first.phase == "vendor" and 0 < first.eta_s <= 60.0
    assert [r.stage for r in first.rows] == ["waiting"] * 3
    sim.run(planner)
    last = planner.snapshot()
    assert last.phase == "done" and last.eta_s == 0
    assert [r.stage for r in last.rows] == ["picked"] * 3
    assert all(r.measured >= 1 and math.isfinite(r.own_ms) and r.vendor_ms == 1.0 for r in last.rows)
    # the histories: each problem's best so far, in time order
    for p in planner.problems:
        times = [t for t, _, _ in p.history]
        assert times == sorted(times) and p.history[-1][1] == p.own_ms


def test_a_larger_budget_forecast_is_bounded_by_what_was_measured():
    """No estimate from fewer than three own candidates (one candidate at 0.85x the vendor was
    forecast at 5.96x on an H100), nothing for a search at its trial budget, and a gain no larger
    than the spread of the problem's candidates, however much time is added."""
    from autoflash.tuning.forecast import MAX_GAIN, Curve, expected_best, forecast, served_gain

    curves = [Curve("one", (1.18,), 1.0, True), Curve("two", (1.3, 1.2), 1.0, True),
              Curve("closed", (1.3, 1.2, 1.1), 1.0, False), Curve("improving", (1.3, 1.2, 1.15, 1.05, 1.04), 1.0, True),
              Curve("flat", (1.1, 1.1, 1.1, 1.1), 1.0, True)]
    out = {e.label: e for e in forecast(curves, extra_s=3600.0, own_per_s=1.0)}
    assert out["one"].note == out["two"].note == "not enough data"
    assert all(out[k].expected_ms == out[k].now_ms for k in ("one", "two", "closed", "flat"))
    improving = out["improving"]
    spread = 1 - 1.04 / 1.15  # best against the median
    assert improving.now_ms * (1 - spread) <= improving.expected_ms < improving.now_ms
    assert expected_best((2.0, 1.0, 0.5, 0.4), 1e9) >= 0.4 * (1 - MAX_GAIN)
    assert expected_best((1.3, 1.2, 1.15, 1.05, 1.04), 0) == 1.04  # (no more candidates, no gain)
    gain, movers = served_gain(list(out.values()))
    assert [m.label for m in movers] == ["improving"]  # (elsewhere the vendor serves, before and after)
    faster = forecast([Curve("near", (1.3, 1.2, 1.15, 1.05, 1.02), 1.03, True)], 600.0, 1.0)
    gain, movers = served_gain(faster)
    assert [m.label for m in movers] == ["near"] and 1.0 < gain <= 1.03 / faster[0].expected_ms + 1e-9


def test_costs_learn_from_measurements():
    costs = Costs()
    costs.observe("per_s", 2.0, "triton")
    assert costs.per("triton") == 2.0 and costs.per("gluon") == costs.prior_per_s
    costs.observe("per_s", 4.0, "triton")
    assert costs.per("triton") == 3.0
    costs.observe("pick_s", 10.0)
    assert costs.pick("fwd") == 10.0 and costs.pick("bwd") == costs.pick_s * costs.op_scale["pick_s"]["bwd"]
    costs.observe("pick_s", 20.0, op="bwd")  # (one op's picks say nothing of another's)
    assert costs.pick("bwd") == 20.0 and costs.pick("fwd") == 10.0
    costs.observe("wait_s", None, "triton")  # (a step that measured nothing says nothing)
    assert costs.wait("triton") == costs.prior_wait_s


# --------------------------------------------------------------------------- the real tuner
def test_a_planned_run_in_the_interpreter_measures_every_problem_and_ends_in_its_budget(tmp_path, monkeypatch):
    """The tuner end to end (real workers, Optuna studies, SQLite) on a clock that counts work done:
    a measured candidate or a problem's pick is one 'second'. Torch SDPA competes here (it sits out
    interpreted runs otherwise), as on a GPU: every problem gets its vendor candidates and a seed,
    the run stops within its budget, and the time left over the must-haves went to searches."""
    import sqlite3

    from autoflash import codegen
    from autoflash.shapes import load_shape_set
    from autoflash.store import Store
    from autoflash.tuning import tuner
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.workers import tune

    monkeypatch.setattr(tuner, "competes", lambda family, interpret: True)
    db = tmp_path / "t.db"
    store = Store(db)
    reader = sqlite3.connect(db)

    def work_done() -> float:
        trials = reader.execute("select count(*) from trials where status != 'running'").fetchone()[0]
        picks = reader.execute("select count(distinct problem) from winners").fetchone()[0]
        return float(trials + picks)

    shapes = load_shape_set("tiny")
    budget = 24.0  # the must-haves are 4 a problem: two SDPA backends, a seed, the pick
    results = tune(shapes, store, TuneOptions(trials=1000, budget_s=budget, interpret=True, clock=work_done))
    assert work_done() <= budget
    assert [r.status for r in results] == ["tuned"] * len(shapes)
    vendor = codegen.template_hash("sdpa_fwd")
    rows = list(store.db["trials"].rows)
    for s in shapes:
        measured = [r for r in rows if r["problem"] == s.problem.key and r["status"] in ("ok", "slower")]
        # (the CPU's flash and math; one clearly slower than the other is stopped before its gate)
        assert len([r for r in measured if r["template_hash"] == vendor]) == 2
        mine = [r for r in measured if r["status"] == "ok"]
        assert [r for r in mine if r["template_hash"] == vendor]  # the vendor's bar
        assert [r for r in mine if r["template_hash"] != vendor]  # a seed at least
    assert len(rows) > 3 * len(shapes)  # more than the must-haves: the budget was spent
    assert all(r.cut_short for r in results)


def test_tune_cli_shows_the_plan_and_plots_best_so_far(tmp_path):
    """The interpreter's dry run prints each problem's state after the seed pass and the rounds, how
    long the run took, what a larger budget would change, and --plot writes the curves."""
    from click.testing import CliRunner

    from autoflash.cli import cli

    shapes = tmp_path / "two.toml"
    one = ("[[shape]]\nbatch = 1\nheads_q = 2\nheads_kv = 2\nseqlen_q = {n}\nseqlen_k = {n}\nhead_dim = 32\n"
           "causal = true\ndtype = \"float16\"\n")
    shapes.write_text(one.format(n=37) + one.format(n=113))
    plot = tmp_path / "tune.png"
    summary = tmp_path / "tune.json"
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--db", str(tmp_path / "t.db"), "--shapes", str(shapes),
                                 "--trials", "3", "--plot", str(plot), "--json", str(summary)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "after the seed pass" in said and "seeded" in said and "own candidates" in said
    assert "after the search rounds" in said and "searched" in said
    assert "The run took" in said and "Every search reached its trial budget" in said
    assert plot.is_file() and plot.read_bytes()[:4] == b"\x89PNG"
    assert "own candidates (" in said and "/min)" in said  # the run's rate
    import json

    data = json.loads(summary.read_text())
    assert data["problems"] == data["problems_with_winner"] == 2 and data["budget_s"] is None
    assert data["own_measured"] == 6 and data["own_per_min"] > 0 and data["vendor_measured"] == 0
    assert set(data["phases"]) == {"startup", "cudnn_warm", "vendor", "seed", "rounds", "picks"} and data["wall_s"] > 0


def test_a_planned_run_with_a_compile_pool_asks_ahead_and_loses_nothing(tmp_path, monkeypatch):
    """The GPU's path in the interpreter: a real compile pool (the interpreter's compile only renders
    and imports), the seed pass compiled in one batch, the next search's batch asked for ahead and
    queued in its study, a deadline's leftovers queued again. Every candidate is measured once, no
    study keeps a trial running, and the run keeps its budget."""
    import collections
    import json
    import sqlite3

    import optuna

    from autoflash.shapes import load_shape_set
    from autoflash.store import Store
    from autoflash.tuning import sandbox
    from autoflash.tuning.compiles import Compiles
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.shared import SharedTuner
    from autoflash.tuning.workers import tune

    sent = []  # (variant JSON, family, shape) of every compile sent to the pool
    original = SharedTuner.__init__

    def with_a_pool(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.compilers = sandbox.WorkerPool(2, "cpu", {"TRITON_INTERPRET": "1"})
        submit_each = self.compilers.submit_each

        def recorded(fn, args_list, timeout_s):
            sent.extend(a[:3] for a in args_list)
            return submit_each(fn, args_list, timeout_s)

        self.compilers.submit_each = recorded
        self.compiles = Compiles(self.compilers, None, self.opt.rep_ms, "cpu", self.opt.trial_timeout_s)

    monkeypatch.setattr(SharedTuner, "__init__", with_a_pool)
    db = tmp_path / "t.db"
    store = Store(db)
    reader = sqlite3.connect(db)

    def work_done() -> float:
        return float(reader.execute("select count(*) from trials where status != 'running'").fetchone()[0]
                     + reader.execute("select count(distinct problem) from winners").fetchone()[0])

    shapes = load_shape_set("tiny")
    options = TuneOptions(trials=8, budget_s=30.0, interpret=True, clock=work_done, compile_workers=2)
    results = tune(shapes, store, options)
    assert [r.status for r in results] == ["tuned"] * len(shapes) and work_done() <= 30.0
    rows = [(r["problem"], r["template_hash"], r["variant"]) for r in store.db["trials"].rows]
    assert len(rows) == len(set(rows)) and collections.Counter(p for p, _, _ in rows).keys() == {
        s.problem.key for s in shapes}
    # Each binary compiled once (the tiny shapes' two lengths specialize alike: problems share them),
    # and every measured candidate's before it was measured.
    from autoflash.space import load_space
    from autoflash.tuning.compiles import compile_key

    def key(variant_json, shape):
        return compile_key(load_space("fwd").check_declared(json.loads(variant_json)), shape)

    compiled = [key(v, shape) for v, _, shape in sent]
    assert len(compiled) == len(set(compiled))
    by_problem = {s.problem.key: s for s in shapes}
    assert {key(v, by_problem[p]) for p, _, v in rows} <= set(compiled)
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(f"{db}.optuna.journal"))
    for study in journal.get_all_studies():
        assert not [t for t in journal.get_all_trials(study._study_id) if t.state == optuna.trial.TrialState.RUNNING]


def test_the_json_summary_of_several_workers_counts_every_workers_candidates(tmp_path):
    """Each worker measures its own share: the run's rates are the sum over them (the first worker's
    alone under-reported an N-GPU run about N times)."""
    import json
    from types import SimpleNamespace

    from autoflash.cli.tune_cmds import _write_json

    def summary(wall, own, vendor):
        return SimpleNamespace(as_json=lambda: {"budget_s": 60.0, "wall_s": wall, "own_measured": own,
                                                "own_per_min": own / (wall / 60), "vendor_measured": vendor,
                                                "vendor_per_min": vendor / (wall / 60), "compiled": own,
                                                "phases": {"vendor": 5.0}, "gpu_idle_s": 1.0})

    results = [SimpleNamespace(winner=object()), SimpleNamespace(winner=None)]
    out = tmp_path / "run.json"
    _write_json(str(out), [summary(60.0, 30, 4), summary(54.0, 24, 4)], results, 2, 61.0)
    data = json.loads(out.read_text())
    assert data["own_measured"] == 54 and data["vendor_measured"] == 8 and data["compiled"] == 54
    assert data["own_per_min"] == 54.0 and data["wall_s"] == 60.0 and data["workers"] == 2
    assert data["problems"] == 2 and data["problems_with_winner"] == 1
