"""`autoflash tune`'s progress: the plan's phase and ETA, each problem's state (vendor only,
seeded, searched, picked; best own vs vendor) at each pass's end, a line per winner, what a
larger budget is expected to gain, and `--plot`'s best-so-far curves."""

from __future__ import annotations

import math

from rich.table import Table

from autoflash.space import load_space

PHASES = {"vendor": "vendor pass (SDPA backends)", "seeds": "seed pass (stored, neighbours' and default variants)",
          "rounds": "search rounds", "picks": "final picks (interleaved re-measure)", "done": "done"}


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


def own_vs_vendor(own_ms: float, vendor_ms: float) -> str:
    """'1.07x' (own faster) / '0.85x', '-' where either is unmeasured: vendor time / own time."""
    if math.isfinite(own_ms) and math.isfinite(vendor_ms) and own_ms > 0:
        return f"{vendor_ms / own_ms:.2f}x"
    return "-"


def state_table(snapshot, title: str) -> Table:
    t = Table(title=title)
    for col, justify in (("problem", "left"), ("state", "left"), ("own / vendor speed", "right"),
                         ("own candidates", "right")):
        t.add_column(col, justify=justify, overflow="fold")
    for r in snapshot.rows:
        t.add_row(r.label, r.stage, own_vs_vendor(r.own_ms, r.vendor_ms), f"{r.measured}/{r.cap}")
    return t


class RichReporter:
    """Draws a planned run: a bar over the run's expected time (phase, ETA), one over the current
    step's candidates; prints the problems' states as each pass ends and a line per winner."""

    def __init__(self, progress):
        self.progress = progress
        self.run = progress.add_task("planning", total=1.0)
        self.step = None
        self.phase = None
        self.told = set()
        self.summaries = []  # planned.RunSummary of each worker (one here)

    def step_started(self, kind, index, total, shape):
        if self.step is not None:
            self.progress.remove_task(self.step)
        self.step = self.progress.add_task(f"{kind}: {shape.label()}", total=None)

    def trial_done(self, measured, budget, variant, outcome, best_tflops):
        best = f"best {best_tflops:.1f} TFLOP/s" if best_tflops == best_tflops else "no valid candidate yet"
        self.progress.update(self.step, completed=measured, total=budget, description=f"{best} | last: {outcome.status}")

    def plan_update(self, snapshot):
        total = snapshot.elapsed_s + snapshot.eta_s
        self.progress.update(self.run, completed=snapshot.elapsed_s / total if total > 0 else 1.0,
                             description=f"{PHASES.get(snapshot.phase, snapshot.phase)} | ETA {_clock(snapshot.eta_s)}")
        if snapshot.phase != self.phase:
            done = self.phase
            self.phase = snapshot.phase
            if done in ("seeds", "rounds") and done not in self.told:  # (a pick can give time back to rounds)
                self.told.add(done)
                self.progress.console.print(state_table(
                    snapshot, f"after the {PHASES[done]} at {_clock(snapshot.elapsed_s)} "
                              f"(ETA {_clock(snapshot.eta_s)} more)"))

    def budget_short(self, budget_s, needed_s):
        self.progress.console.print(f"[yellow]{budget_short_text(budget_s, needed_s)}[/]")

    def problem_done(self, result):
        if result.winner is not None:
            vendor = load_space(result.winner.family).vendor
            self.progress.console.print(
                f"[green]{result.shape.label()}[/]: {result.tflops('tuned'):.1f} TFLOP/s "
                f"(default {result.tflops('default'):.1f}) after {result.measured} trials, "
                f"{result.failed} failed; serves {'vendor' if vendor else 'own'}: {result.winner.short()}")
        elif result.status == "picking_elsewhere":
            self.progress.console.print(f"[yellow]{result.shape.label()}[/]: its winner is being picked by "
                                        f"{result.picked_by} (a worker sharing the studies)")
        else:
            self.progress.console.print(f"[red]{result.shape.label()}[/]: {result.status}")

    def run_finished(self, summary):
        self.summaries.append(summary)
        if self.step is not None:  # (the last pick's bar: the run bar says done)
            self.progress.remove_task(self.step)
            self.step = None


def budget_short_text(budget_s: float, needed_s: float) -> str:
    """What a run whose budget is below every problem's must-have passes says when it starts."""
    return (f"The budget of {_clock(budget_s)} is below what every problem's vendor pass, seed and pick are "
            f"expected to take (about {_clock(needed_s)} here): the run takes that long, so that each problem "
            f"ends with a measured winner, and searches nothing beyond. Fewer --shapes or a larger --budget "
            f"leave time to search.")


def rate_line(summary) -> str:
    """How many candidates the run measured a minute, own and vendor, and where its time went."""
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in summary.phases.items() if seconds >= 0.5)
    idle = f"; the GPU waited {summary.gpu_idle_s:.0f} s on compiles" if summary.gpu_idle_s >= 0.5 else ""
    return (f"Measured {summary.own_measured} own candidates ({summary.per_min(summary.own_measured):.1f}/min) and "
            f"{summary.vendor_measured} vendor ones ({summary.per_min(summary.vendor_measured):.1f}/min)"
            + (f" ({phases}{idle})" if phases else "") + ".")


def forecast_lines(summary) -> list[str]:
    """What a larger budget is expected to gain (`forecast`), in a few lines."""
    from autoflash.tuning.forecast import MIN_CANDIDATES, served_gain

    if all(r.measured >= r.cap for r in summary.snapshot.rows):
        return ["Every search reached its trial budget: a larger --trials, not a larger --budget, searches further."]
    gain, movers = served_gain(summary.forecast)
    thin = [e for e in summary.forecast if e.note == "not enough data"]
    more = f"{summary.extra_s / 60:.1f} more minutes"
    if summary.budget_s is not None:
        more = f"a budget of {(summary.budget_s + summary.extra_s) / 60:.1f} minutes (--budget)"
    lines = []
    if not movers:
        lines.append(f"A larger budget ({more}) is not expected to change what serves"
                     + (": the searches have converged or their own kernels are far from the vendor's." if not thin
                        else " where the searches say anything."))
    else:
        lines.append(f"With {more}, the served kernels are expected {100 * (gain - 1):.1f}% faster (geomean; bounded "
                     "by the spread of this run's own candidates, at this run's rate), mostly on:")
        for e in sorted(movers, key=lambda e: e.expected_ms / e.now_ms)[:5]:
            flip = " (own would serve)" if e.expected_ms < e.vendor_ms <= e.now_ms else ""
            if not math.isfinite(e.vendor_ms):  # (no vendor candidate: the interpreter)
                lines.append(f"  {e.label}: own {e.now_ms:.3g} ms -> {e.expected_ms:.3g} ms")
                continue
            lines.append(f"  {e.label}: own {own_vs_vendor(e.now_ms, e.vendor_ms)} -> "
                         f"{own_vs_vendor(e.expected_ms, e.vendor_ms)} the vendor's speed{flip}")
    if thin:
        lines.append(f"{len(thin)} of {len(summary.forecast)} problems have fewer than {MIN_CANDIDATES} own candidates "
                     "measured: not enough data to say what more time would give them.")
    return lines


def plot(summaries: list, path: str, title: str) -> None:
    """Two panels over the run's time, one line per problem: above, the best-so-far TFLOP/s served
    (the faster of own and vendor; the own kernels' alone dashed where the vendor's is ahead); below,
    the own kernels' best speed relative to the vendor's (above 1, own serves): with twenty problems
    the ratios say at a glance where the search is winning, which the TFLOP/s levels do not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from autoflash.tuning.timing import tflops

    fig, (ax, rel) = plt.subplots(2, 1, figsize=(11, 9), sharex=True, height_ratios=(3, 2))
    colors = plt.get_cmap("tab20").colors
    lines = 0
    for summary in summaries:
        for shape, history in zip(summary.shapes, summary.histories):
            if not history:
                continue
            color = colors[lines % len(colors)]
            lines += 1
            ts = [0.0] + [t for t, _, _ in history]
            served = [math.nan] + [tflops(shape, min(own, vendor)) for _, own, vendor in history]
            ax.step(ts, served, where="post", label=shape.label(), color=color)
            own = [math.nan] + [tflops(shape, o) for _, o, _ in history]
            if any(o == o and s == s and o < s for o, s in zip(own, served)):
                ax.step(ts, own, where="post", linestyle="--", color=color, alpha=0.5)
            ratio = [math.nan] + [vendor / o if math.isfinite(vendor) and math.isfinite(o) and o > 0 else math.nan
                                  for _, o, vendor in history]
            rel.step(ts, ratio, where="post", color=color)
    ax.set_ylabel("best so far, TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.2))
    rel.axhline(1.0, color="black", linewidth=1)
    rel.set_ylabel("own best / vendor's speed")
    rel.set_xlabel("seconds into the run")
    rel.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
