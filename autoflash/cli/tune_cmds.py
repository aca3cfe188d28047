"""`autoflash tune` (with its progress reporter and result table) and `autoflash search-quality`."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from autoflash.cli.common import (OPS, console, default_shape_set, load_shapes, one_line, output_option,
                                  require_gpu, shapes_help, use_interpreter)
from autoflash.problem import DTYPES, Problem


def _results_table(results, title):
    """One row per problem: TFLOP/s of the tuned winner, the default and (on a GPU) SDPA, ratios."""
    import math

    from autoflash.bench import fmt_tflops
    from autoflash.problem import geomean

    def ratio(r, a, b):
        x, y = r.tflops(a), r.tflops(b)
        return x / y if math.isfinite(x) and math.isfinite(y) and y > 0 else float("nan")

    with_sdpa = any(math.isfinite(r.tflops("sdpa_cudnn")) for r in results)
    methods = ["tuned", "default"] + (["sdpa_cudnn", "sdpa_flash"] if with_sdpa else [])
    bases = (["sdpa_cudnn", "sdpa_flash"] if with_sdpa else []) + ["default"]
    t = Table(title=title)
    t.add_column("shape", overflow="fold", min_width=14)
    for m in methods:
        t.add_column(m.replace("sdpa_", ""), justify="right")
    for b in bases:
        t.add_column(f"tuned /{b.replace('sdpa_', '')}", justify="right")
    t.add_column("spread", justify="right")
    t.add_column("trials (failed)", justify="right")
    for r in results:
        ratios = [ratio(r, "tuned", b) for b in bases]
        t.add_row(r.shape.label(), *(fmt_tflops(r.tflops(m)) for m in methods),
                  *(f"{x:.2f}" if x == x else "-" for x in ratios),
                  f"{r.spread * 100:.1f}%" if r.spread == r.spread else "-", f"{r.measured} ({r.failed})")
    means = [geomean([ratio(r, "tuned", b) for r in results]) for b in bases]
    t.add_row("[bold]geomean[/]", *([""] * len(methods)), *(f"[bold]{m:.3f}[/]" if m == m else "-" for m in means),
              "", "")
    return t


OWN_DB_NOTE = " (the interpreter's own DB, never among a GPU's winners)"


def _parse_ops(ops: str) -> list[str]:
    op_list = [o.strip() for o in ops.split(",") if o.strip()]
    unknown = [o for o in op_list if o not in OPS]
    if unknown or not op_list:
        raise click.BadParameter(f"unknown op(s) {unknown or ops!r}: choose from {', '.join(OPS)}",
                                param_hint="'--ops'")
    return op_list


def _tune_shapes(op_list, shapes, dtype, interpret):
    import dataclasses

    # Forward problems first: a backward problem's candidates are timed after the stored forward
    # winner of its shape (what training serves with them), where one exists.
    ordered = sorted(op_list, key=lambda op: op != "fwd")
    shape_list = [s for op in ordered for s in load_shapes(shapes or default_shape_set(op, interpret), op)]
    # (the tuner times contiguous inputs and gates both layouts itself: a random set's drawn layouts are the bench's)
    shape_list = [dataclasses.replace(s, layout=None) for s in shape_list]
    if dtype:
        shape_list = [dataclasses.replace(s, dtype=dtype) for s in shape_list]
    if interpret and any(s.dtype == "bfloat16" for s in shape_list):
        raise click.ClickException("bfloat16 is not computed correctly by Triton's interpreter: use --dtype float16")
    return shape_list


def _report(results, store, op_list, device, interpret, md_path, trials, summaries=(), plot_path=None):
    title = f"TFLOP/s ({', '.join(op_list)}) on {device.name}, torch {device.torch_version}, triton {device.triton_version}"
    if interpret:
        title += " (interpreter: not GPU performance)"
    table = _results_table(results, title)
    console.print(table)
    if md_path:
        from rich.console import Console as _Console

        with click.open_file(md_path, "w") as f:  # ("-": standard output)
            _Console(file=f, width=200, color_system=None).print(table)
    short = [r for r in results if r.cut_short]
    if short:
        fewest = min(r.measured if r.own_measured is None else r.own_measured for r in short)
        console.print(f"[yellow]{len(short)} of {len(results)} problems reached the time budget before {trials} "
                      f"measured candidates (fewest: {fewest}). Short searches miss good "
                      "variants: the same command with a larger --budget continues them (trials already in "
                      "the DB count).[/]")
    from autoflash.cli.tune_progress import forecast_lines, plot, rate_line

    for summary in summaries[:1]:  # (several workers: the first one's view)
        took = f"The run took {summary.elapsed_s / 60:.1f} minutes"
        if summary.budget_s is not None:
            took += f" of its {summary.budget_s / 60:.1f}-minute budget"
        if not interpret:
            took += f"; {summary.compiled} variants compiled (each binary once, shared by the problems that need it)"
        console.print(took + ".")
        console.print(rate_line(summary))
        for line in forecast_lines(summary):
            console.print(line)
    if plot_path and summaries:
        plot(list(summaries), plot_path, title)
        console.print(f"plot: {plot_path}")
    # (a pick recorded elsewhere without a winner is a failed problem, said with the failures)
    elsewhere = [r for r in results if (r.picked_by and r.winner is not None) or r.status == "picking_elsewhere"]
    if elsewhere:
        console.print(f"{len(elsewhere)} of {len(results)} winners were picked by another worker or an earlier run "
                      f"over the same trials ({', '.join(sorted({r.picked_by for r in elsewhere}))}): those of this "
                      "host are in its DB, another host's in that host's DB (`autoflash db merge` gathers them).")
    counts = store.counts()
    console.print(f"DB {store.path}: {counts['winners']} winners, {counts['trials']} trials")


@click.command()
@click.option("--ops", default="fwd", show_default=True, help="Comma-separated ops to tune: fwd, bwd, decode (flash_attn_with_kvcache; default shapes: decode).")
@click.option("--shapes", default=None, help=shapes_help("Problems to tune"))
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="Override the shape set's dtype.")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Time budget for the whole run, in minutes (default: none).")
@click.option("--trials", type=click.IntRange(min=1), default=40, show_default=True, help="Measured candidates of own kernels per problem (torch SDPA backends are measured beside them, on a GPU).")
@click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
              help="Results DB (default: $AUTOFLASH_DB, else ~/.cache/autoflash/autoflash.db; with --interpret "
                   "~/.cache/autoflash/interpret.db).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Measuring processes, one per GPU, all on the same Optuna studies (default: one per visible "
                   "GPU; 1 with --interpret).")
@click.option("--compile-workers", type=click.IntRange(min=1), default=None,
              help="Parallel compile processes per worker (default: (cores - 2) / workers, max 12).")
@click.option("--storage", default=None, metavar="URL",
              help="Where the Optuna studies live: a journal file (e.g. on a shared file system) or a database URL "
                   "(postgresql://user@host/db) that workers on several hosts share (default: the journal beside "
                   "the DB).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampler seed.")
@click.option("--rep-ms", type=click.FloatRange(min=0, min_open=True), default=40, show_default=True,
              help="Timing repetition time per candidate (ms): device time, the host kept ahead of the GPU.")
@click.option("--interpret", is_flag=True,
              help="Run the whole pipeline on tiny shapes in Triton's CPU interpreter (no GPU; timings are not GPU performance).")
@click.option("--hide-shipped-rows", is_flag=True,
              help="Tune as if this GPU were new: its winners in the shipped DBs are left out (no seeds, no "
                   "training pairs); other GPUs' winners of its architecture still seed the searches (pair with "
                   "a fresh --db).")
@click.option("--transfer-seeds/--no-transfer-seeds", default=True, show_default=True,
              help="Seed each search with the winners of the nearest problems on other GPUs of this GPU's "
                   "architecture (shipped DBs and the results DB), gated and timed again here.")
@output_option("--plot", "plot_path", help="Write best-so-far TFLOP/s against time, one line per problem (PNG).")
@output_option("--markdown", "md_path", help="Also write the final table as Markdown.")
@output_option("--json", "json_path", help="Write the run's summary as JSON: budget_s, wall_s, problems, "
               "problems_with_winner, own_measured, own_per_min, vendor_measured, phases (seconds each), gpu_idle_s.")
def tune(ops, shapes, dtype, budget, trials, db_path, workers, compile_workers, storage, seed, rep_ms, interpret,
         hide_shipped_rows, transfer_seeds, plot_path, md_path, json_path):
    """Tune this GPU: search kernel variants per problem, store the winners.

    The run is planned over its whole budget: first every problem's torch SDPA backends and seeds
    (its stored winner, the winners of the nearest problems on other GPUs of its architecture, the
    default), so that any budget leaves every problem with a measured winner, then search rounds
    where the expected gain is largest, then each problem's final re-measure, ending on time.
    Every candidate is checked against a float64 reference before it is timed; failures
    (compile errors, wrong results, crashes, hangs) are recorded and the run goes on. Interrupt
    it at any time: finished trials are stored and a re-run resumes. With several GPUs, one
    worker per GPU; with --storage, workers on several hosts join the same studies. Exit status:
    0 every problem has a winner, 1 some got none (named), 2 a usage error, 130/143 interrupted.

    Example: autoflash tune --budget 15
    Example: autoflash tune --ops fwd,bwd --shapes newgpu --budget 5 --plot tune.png
    Example: autoflash tune --hide-shipped-rows --db /tmp/as-new.db --budget 5   (as if this GPU were new)
    """
    import time

    from autoflash.cli.common import open_store
    from autoflash.device import gpu_fingerprint
    from autoflash.tuning import tuner as tune_mod
    from autoflash.tuning.results import representative_shapes, without_winner
    from autoflash.tuning import workers as workers_mod
    from autoflash.tuning.storage import describe, make_storage
    from autoflash.tuning.stopping import sigterm_interrupts

    began = time.monotonic()
    op_list = _parse_ops(ops)
    if interpret:
        use_interpreter()
    else:
        require_gpu("autoflash tune", " Use --interpret to run the whole pipeline on tiny shapes in "
                    "Triton's CPU interpreter (correctness is real, timings are not GPU performance).")
    shape_list = _tune_shapes(op_list, shapes, dtype, interpret)
    gpus = None if interpret else workers_mod.visible_gpus()
    n = workers or (1 if interpret else max(1, len(gpus)))
    if gpus is not None and n > max(1, len(gpus)):
        raise click.BadParameter(f"{n} workers need {n} GPUs, {len(gpus)} visible: two measuring processes on one "
                                 "GPU would disturb each other's timings", param_hint="'--workers'")
    options = tune_mod.TuneOptions(trials=trials, budget_s=budget * 60 if budget else None, seed=seed,
                                   rep_ms=rep_ms, interpret=interpret, storage=storage,
                                   hide_shipped_rows=hide_shipped_rows, transfer_seeds=transfer_seeds)
    options.compile_workers = compile_workers or max(1, options.compile_workers // n)
    store = open_store(db_path, readonly=False)
    make_storage(storage, store.path)  # a storage that cannot be used is said now, in one line
    device = gpu_fingerprint()
    console.print(f"tuning {len(representative_shapes(shape_list))} problems on [bold]{device.name}[/] "
                  f"(torch {device.torch_version}, triton {device.triton_version}) -> {store.path}"
                  + (f" with {n} workers" if n > 1 else "") + f"; studies: {describe(storage, store.path)}")
    if interpret:
        from autoflash.store import default_db_path

        own = default_db_path(interpret=True)
        apart = store.path == own != default_db_path(interpret=False)  # (not when --db or $AUTOFLASH_DB chose)
        console.print(f"[yellow]interpreter mode: kernels run on the CPU; correctness is real, timings are not "
                      f"GPU performance. Real tuning needs a CUDA GPU (`autoflash tune` there). Results go to "
                      f"{store.path}{OWN_DB_NOTE if apart else ''}.[/]")
    command = " ".join(["autoflash", *sys.argv[1:]])
    try:
        with sigterm_interrupts():  # a scheduler's SIGTERM stops the run like Ctrl-C: work stored, DB one file
            summaries = []
            if n == 1:
                results = _tune_one(workers_mod, shape_list, store, options, command, summaries)
            else:
                results = _tune_many(workers_mod, shape_list, store, options, n, gpus, command, summaries)
    except Exception as e:  # noqa: BLE001 - the studies' database failing is one line, other errors rise
        if not workers_mod.storage_failure(e):
            raise
        raise click.ClickException(f"the Optuna storage {describe(storage, store.path)} failed: {one_line(e)}") from None
    _report(results, store, op_list, device, interpret, md_path, trials, summaries, plot_path)
    if json_path:
        _write_json(json_path, summaries, results, n, time.monotonic() - began)
    if missing := without_winner(results):  # exit 1: a script must not take a partial run for a tuned one
        raise click.ClickException(
            f"{len(missing)} of {len(results)} problems got no winner: "
            + ", ".join(f"{r.shape.label()} ({r.status.replace('_', ' ')})" for r in missing))


def _write_json(path, summaries, results, workers, command_s):
    """`--json`: the run's summary (with several workers: candidates and compiles summed over them,
    the rates over the longest worker's wall time, phases and GPU idle time those of the first), the
    winners as the merged results say, the command's own wall time beside the run's (the run's clock
    starts once the command is set up)."""
    import json

    out = summaries[0].as_json() if summaries else {}
    if len(summaries) > 1:
        each = [s.as_json() for s in summaries]
        wall = max(e["wall_s"] for e in each)
        for key in ("own_measured", "vendor_measured", "compiled"):
            out[key] = sum(e[key] for e in each)
        out.update(wall_s=wall, phases_of="the first worker",
                   **{f"{kind}_per_min": round(out[f"{kind}_measured"] / (wall / 60), 2) if wall > 0 else None
                      for kind in ("own", "vendor")})
    out.update(problems=len(results), problems_with_winner=sum(r.winner is not None for r in results),
               workers=workers, command_wall_s=round(command_s, 1))
    with click.open_file(path, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


def _tune_one(workers_mod, shape_list, store, options, command, summaries):
    """One worker, in this process, with progress bars."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from autoflash.cli.tune_progress import RichReporter
    from autoflash.tuning.gpulock import GPUBusyError

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    try:
        with Progress(*columns, console=console, transient=False) as progress:
            reporter = RichReporter(progress)
            try:
                return workers_mod.tune(shape_list, store, options, reporter=reporter, command=command)
            finally:
                summaries += reporter.summaries
    except GPUBusyError as e:
        raise click.ClickException(str(e)) from None


def _tune_many(workers_mod, shape_list, store, options, n, gpus, command, summaries):
    """n worker processes; a line per winner as each is picked, a line per worker that failed."""
    from autoflash.cli.tune_progress import budget_short_text

    def said(kind, worker, result):
        if kind == "summary":
            summaries.append(result)
        if kind == "budget_short" and worker == 0:  # (each worker plans all problems: one says it)
            console.print(f"[yellow]{budget_short_text(*result)}[/]")
        if kind != "problem" or result.picked_by or result.status == "picking_elsewhere":
            return
        if result.winner is not None:
            console.print(f"worker {worker}: [green]{result.shape.label()}[/]: {result.tflops('tuned'):.1f} TFLOP/s "
                          f"(default {result.tflops('default'):.1f}); winner {result.winner.short()}")
        else:
            console.print(f"worker {worker}: [red]{result.shape.label()}[/]: {result.status}")

    results, failures = workers_mod.tune_workers(shape_list, store.path, options, n, gpus=gpus, command=command,
                                                 on_event=said)
    for line in failures:
        console.print(f"[yellow]{line}[/]")
    if len(failures) == n:
        raise click.ClickException(f"all {n} workers failed (first: {failures[0]})")
    return results


@click.command("search-quality")
@click.option("--db", "db_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="A DB holding an exhaustive sweep (autoflash tune --trials 100000).")
@click.option("--problem", "problem_key", default=None, help="Problem key (default: every problem in the DB).")
@click.option("--seeds", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--trials", type=click.IntRange(min=1), default=110, show_default=True, help="Search length replayed per seed.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=0.02, show_default=True)
def search_quality_cmd(db_path, problem_key, seeds, trials, tolerance):
    """Replay the tuner's Optuna sampler against an exhaustive sweep's recorded timings.

    Reports how many trials the search needs to come within --tolerance of the best recorded
    variant (per seed), next to random search on the same table. That is the exhaustive best only
    when the DB holds every valid variant (a sweep): the table says how many it holds, and a DB
    with fewer is said to be no sweep. No GPU needed: the objective is the
    recorded measurement of each variant.

    Example: autoflash search-quality --db docs/results/2026-11-30-h200-sweep-d64.db
    """
    import statistics

    from autoflash.cli.common import open_store
    from autoflash.device import GPUFingerprint
    from autoflash.store_queries import measured_timings, trial_problem_keys
    from autoflash.tuning.search_quality import NoOverlap, search_quality

    store = open_store(db_path, readonly=True)
    if problem_key:
        try:
            Problem.from_key(problem_key)
        except (ValueError, KeyError, IndexError) as e:
            raise click.BadParameter(f"not a problem key: {one_line(e)}", param_hint="'--problem'") from None
    keys = [problem_key] if problem_key else trial_problem_keys(store)
    t = Table(title=f"search quality: trials to come within {tolerance:.0%} of the best recorded variant")
    for col in ("problem", "recorded / valid", "within tol.", "default/best", "TPE per seed", "TPE median",
                "random median"):
        t.add_column(col)
    partial = []
    for key in keys:
        gpu, table = measured_timings(store, key)
        if gpu is None:
            continue
        device = GPUFingerprint(**{k: gpu[k] for k in GPUFingerprint.__dataclass_fields__})
        try:
            q = search_quality(table, Problem.from_key(key), device, seeds, trials, tolerance)
        except NoOverlap as e:
            console.print(f"[yellow]{one_line(e)}[/]")
            continue
        found = [x for x in q["tpe"] if x is not None]
        if q["space"] < q["valid"]:
            partial.append(f"{key}: {q['space']} of {q['valid']}")
        t.add_row(key, f"{q['space']} / {q['valid']}", str(q["within_tolerance"]),
                  f"{q['default_ms'] / q['best_ms']:.3f}" if q["default_ms"] else "-",
                  ", ".join(str(x) if x else "not found" for x in q["tpe"]),
                  f"{statistics.median(found):.0f}" if found else "-", f"{q['random_median']:.0f}")
    console.print(t)
    if partial:
        console.print(f"[yellow]not an exhaustive sweep: {len(partial)} problem(s) hold fewer variants than the space "
                      f"has valid ({'; '.join(partial[:3])}{'; ...' if len(partial) > 3 else ''}), so their best is the "
                      "best recorded, not the best there is, and the replay can only rank those. For a sweep: "
                      "autoflash tune --trials 100000 --db SWEEP.db (on the GPU), then this command on SWEEP.db.[/]")
