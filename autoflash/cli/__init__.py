"""The `autoflash` command line: thin click commands over the library, rich output."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from autoflash.problem import DTYPES, Problem, seqlen_bucket

console = Console()


def _problem_options(f):
    f = click.option("--causal/--no-causal", default=False, show_default=True, help="Causal problem.")(f)
    f = click.option("--head-dim", type=int, default=128, show_default=True, help="Head dim.")(f)
    f = click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", show_default=True)(f)
    f = click.option("--op", type=click.Choice(["fwd", "bwd"]), default="fwd", show_default=True, help="Kernel op.")(f)
    return f


def _problem(op, dtype, head_dim, causal, seqlen=4096) -> Problem:
    return Problem(op=op, dtype=dtype, head_dim=head_dim, causal=causal, gqa_group=1,
                   seqlen_q=seqlen_bucket(seqlen), seqlen_k=seqlen_bucket(seqlen))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="autoflash")
def cli():
    """autoflash: tune Triton flash-attention kernels for this GPU and serve the winners.

    Example: autoflash tune --interpret
    """


@cli.command()
@_problem_options
@click.option("--list", "list_variants", is_flag=True, help="Print every valid variant as JSON, one a line.")
def space(op, dtype, head_dim, causal, list_variants):
    """The search space of an op: its axes, and its size before and after constraints.

    Constraints are evaluated for one problem (--dtype/--head-dim/--causal) on this machine's GPU
    (or, without one, for the Triton interpreter, which allows every structural variant).

    Example: autoflash space --op fwd --head-dim 64 --causal
    """
    from autoflash.device import gpu_fingerprint
    from autoflash.space import count_by_constraint, load_space

    sp = load_space(op)
    device = gpu_fingerprint()
    problem = _problem(op, dtype, head_dim, causal)
    valid = sp.valid_variants(problem, device)
    if list_variants:
        for v in valid:
            click.echo(v.json())
        return
    table = Table(title=f"search space: {op} ({sp.template})")
    table.add_column("knob")
    table.add_column("choices")
    for knob, choices in sp.knobs.items():
        table.add_row(knob, ", ".join(json.dumps(c) for c in choices))
    console.print(table)
    rejected = count_by_constraint(sp, problem, device)
    ct = Table(title=f"constraints for {problem.key} on {device.name} (sm{device.cc_major}{device.cc_minor})")
    ct.add_column("constraint")
    ct.add_column("rejects (first failing rule)", justify="right")
    ct.add_column("why")
    for c in sp.constraints:
        ct.add_row(c.name, str(rejected[c.name]), c.why)
    console.print(ct)
    console.print(f"variants before constraints: [bold]{sp.size}[/]   after: [bold green]{len(valid)}[/]")


@cli.command()
@_problem_options
@click.option("--variant", "variant_json", default="{}", show_default=True,
              help="Variant as JSON; knobs left out take the built-in default's values.")
def render(op, dtype, head_dim, causal, variant_json):
    """Print the generated Triton source of one variant.

    The variant is checked against the declared space and its constraints for the given problem
    on this machine; an invalid one is an error naming the violated rule.

    Example: autoflash render --op fwd --variant '{"BLOCK_M": 64, "LOADS": "block_ptr"}'
    """
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.space import InvalidVariant, load_space, parse_variant_json

    device = gpu_fingerprint()
    problem = _problem(op, dtype, head_dim, causal)
    try:
        given = parse_variant_json(op, variant_json)
        values = {**load_space(op).default_for(problem, device).as_dict(), **given}
        variant = load_space(op).validate(values, problem, device)
    except InvalidVariant as e:
        raise click.ClickException(f"invalid variant: {e}") from None
    click.echo(codegen.render(variant), nl=False)


def _use_interpreter() -> None:
    """Run kernels in Triton's CPU interpreter from here on (set before any kernel module loads);
    the GPU fingerprint becomes the interpreter's."""
    import os

    from autoflash.device import gpu_fingerprint

    os.environ["TRITON_INTERPRET"] = "1"
    gpu_fingerprint.cache_clear()


def _require_gpu(what: str, hint: str = "") -> None:
    import torch

    from autoflash.device import interpreter_enabled

    if not torch.cuda.is_available() or interpreter_enabled():
        raise click.ClickException(f"{what} needs a CUDA GPU: none is visible here.{hint}")


@cli.command()
@click.option("--shapes", default="standard", show_default=True,
              help="Shape set: standard, gqa, tiny, or a TOML file.")
@click.option("--rounds", default=3, show_default=True, help="Interleaved timing rounds per shape.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Save a bar chart (PNG) here.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Write the table as Markdown here.")
@click.option("--fwdbwd", is_flag=True, help="Time forward+backward through autograd instead of the forward.")
@click.option("--memory", is_flag=True, help="With --fwdbwd: also report each method's peak memory above its inputs.")
@click.option("--overhead", is_flag=True, help="Per-call host overhead of autoflash.attention vs a bare kernel launch.")
@click.option("--llama", is_flag=True,
              help="A small random-weight Llama (transformers) with 'sdpa' vs autoflash's attention: ms per step.")
@click.option("--op", type=click.Choice(["fwd", "bwd"]), default="fwd", show_default=True,
              help="Time the forward or the backward kernels (without --fwdbwd/--overhead/--llama).")
@click.option("--baseline-template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Also time each shape's variant rendered from this template file (e.g. the previous "
                   "version of the op's template), as method 'baseline': an A/B of a template edit. A knob "
                   "value that template does not know renders as that template treats it.")
@click.option("--interpret", is_flag=True,
              help="Tiny shapes in Triton's CPU interpreter: checks the bench pipeline; timings are not GPU performance.")
def bench(shapes, rounds, plot_path, md_path, fwdbwd, memory, overhead, llama, op, baseline_template, interpret):
    """autoflash (dispatched, and the untuned default) vs torch SDPA (cuDNN, flash), TFLOP/s.

    All methods are timed in this one process, interleaved, median of do_bench medians.

    Example: autoflash bench --shapes standard --plot bench.png
    Example: git show HEAD~1:templates/attn_fwd.py.jinja > old.jinja && autoflash bench --baseline-template old.jinja
    """
    import dataclasses

    if interpret:
        _use_interpreter()
        shapes = "tiny" if shapes == "standard" else shapes
        if fwdbwd or overhead or llama:
            raise click.ClickException("--fwdbwd, --overhead and --llama need a CUDA GPU")
    else:
        _require_gpu("autoflash bench", " Use --interpret to check the pipeline on tiny shapes on the CPU.")
    from autoflash import bench as bench_mod
    from autoflash.dispatch import get_dispatcher
    from autoflash.space import default_variant
    from autoflash.device import gpu_fingerprint
    from autoflash.shapes import load_shape_set

    device = gpu_fingerprint()
    if overhead:
        r = bench_mod.dispatch_overhead()
        console.print(f"bare kernel launch {r['bare_launch_us']:.1f} µs/call, autoflash.attention "
                      f"{r['autoflash_attention_us']:.1f} µs/call: dispatch overhead {r['overhead_us']:.1f} µs "
                      f"({device.name}, torch {device.torch_version}, triton {device.triton_version})")
        return
    if llama:
        r = bench_mod.llama_step_times(rounds=rounds)
        t = Table(title=f"Llama (8 layers, hidden 2048, GQA 16/4, d128, bf16, batch 4 x 2048 tokens) on {device.name}")
        for col in ("step", "sdpa ms", f"{r['name']} ms", "speed-up"):
            t.add_column(col)
        for step in ("inference", "train_step"):
            base, mine = r["ms"][("sdpa", step)], r["ms"][(r["name"], step)]
            t.add_row(step, f"{base:.2f}", f"{mine:.2f}", f"{base / mine:.3f}x")
        console.print(t)
        console.print(f"logits vs sdpa: relative difference {r['logits_rel_diff']:.2e}")
        return
    shape_list = load_shape_set(shapes, op)
    if fwdbwd:
        with console.status("benchmarking forward+backward") as status:
            rows, peaks = bench_mod.run_fwdbwd(shape_list, rounds=rounds, memory=memory,
                                               progress=lambda label: status.update(f"benchmarking {label}"))
        methods = ["autoflash", "sdpa_cudnn", "sdpa_flash"]
        title = f"forward+backward TFLOP/s on {device.name}, torch {device.torch_version}, triton {device.triton_version}"
        console.print(bench_mod.rich_table(rows, methods, title))
        if memory:
            mt = Table(title="peak memory above the inputs (GiB), forward+backward")
            for col in ("shape", *methods, "autoflash / sdpa_flash"):
                mt.add_column(col)
            for r in rows:
                label = dataclasses.replace(r.shape, op="fwd").label()
                gib = {m: peaks.get((label, m), float("nan")) / 2**30 for m in methods}
                mt.add_row(label, *(f"{gib[m]:.2f}" for m in methods), f"{gib['autoflash'] / gib['sdpa_flash']:.3f}")
            console.print(mt)
        if md_path:
            with open(md_path, "w") as f:
                f.write(bench_mod.markdown_table(rows, methods) + "\n")
        if plot_path:
            bench_mod.plot(rows, methods, plot_path, title)
            console.print(f"plot saved to {plot_path}")
        return
    disp = get_dispatcher()
    choosers = {
        "autoflash": lambda s: disp.variant_for(s.problem, device),
        "default": lambda s: default_variant(op, s.problem, device),
    }
    templates = None
    if baseline_template:  # the dispatched variant again, rendered from the other template
        choosers["baseline"] = choosers["autoflash"]
        templates = {"baseline": baseline_template}
    with console.status("benchmarking") as status:
        rows = bench_mod.run_bench(shape_list, choosers, rounds=rounds, device="cpu" if interpret else "cuda",
                                   progress=lambda label: status.update(f"benchmarking {label}"), templates=templates)
    methods = list(choosers) + ([] if interpret else ["sdpa_cudnn", "sdpa_flash"])
    base = "baseline" if baseline_template else "default" if interpret else "sdpa_cudnn"
    title = (f"{'forward' if op == 'fwd' else 'backward'} TFLOP/s on {device.name}, torch {device.torch_version}, "
             f"triton {device.triton_version}")
    if interpret:
        title += " (interpreter wall clock: not GPU performance)"
    console.print(bench_mod.rich_table(rows, methods, title, base=base))
    if md_path:
        with open(md_path, "w") as f:
            f.write(bench_mod.markdown_table(rows, methods, base=base) + "\n")
    if plot_path:
        bench_mod.plot(rows, methods, plot_path, title)
        console.print(f"plot saved to {plot_path}")


class _RichReporter:
    """Draws tuning progress: a bar over problems and one over the current problem's trials."""

    def __init__(self, progress):
        self.progress = progress
        self.problems = None
        self.trials = None

    def problem_started(self, index, total, shape):
        if self.problems is None:
            self.problems = self.progress.add_task("problems", total=total)
        self.progress.update(self.problems, completed=index, description=f"problem {index + 1}/{total}")
        if self.trials is not None:
            self.progress.remove_task(self.trials)
        self.trials = self.progress.add_task(shape.label(), total=None)

    def trial_done(self, measured, budget, variant, outcome, best_tflops):
        best = f"best {best_tflops:.1f} TFLOP/s" if best_tflops == best_tflops else "no valid candidate yet"
        self.progress.update(self.trials, completed=measured, total=budget,
                             description=f"{best} | last: {outcome.status}")

    def problem_done(self, result):
        self.progress.advance(self.problems)
        if result.winner is not None:
            self.progress.console.print(
                f"[green]{result.shape.label()}[/]: {result.tflops('tuned'):.1f} TFLOP/s "
                f"(default {result.tflops('default'):.1f}) after {result.measured} trials, "
                f"{result.failed} failed; winner {result.winner.short()}")
        else:
            self.progress.console.print(f"[red]{result.shape.label()}[/]: {result.status}")


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


@cli.command()
@click.option("--ops", default="fwd", show_default=True, help="Comma-separated ops to tune: fwd, bwd.")
@click.option("--shapes", default=None, help="Shape set: standard (default), gqa, long, train (backward grid), llama (the problem of `bench --llama`), sweep_d64, sweep_d256, tiny (default with --interpret), or a TOML file.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="Override the shape set's dtype.")
@click.option("--budget", type=float, default=None, help="Time budget for the whole run, in minutes.")
@click.option("--trials", type=int, default=40, show_default=True, help="Measured candidates per problem.")
@click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
              help="Results DB (default: $AUTOFLASH_DB or ~/.cache/autoflash/autoflash.db).")
@click.option("--workers", type=int, default=None, help="Parallel compile processes (default: cores - 2, max 12).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampler seed.")
@click.option("--rep-ms", type=float, default=40, show_default=True, help="do_bench repetition time per candidate (ms).")
@click.option("--interpret", is_flag=True,
              help="Run the whole pipeline on tiny shapes in Triton's CPU interpreter (no GPU; timings are not GPU performance).")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), help="Also write the final table as Markdown.")
def tune(ops, shapes, dtype, budget, trials, db_path, workers, seed, rep_ms, interpret, md_path):
    """Tune this GPU: search kernel variants per problem, store the winners.

    Every candidate is checked against a float64 reference before it is timed; failures
    (compile errors, wrong results, crashes, hangs) are recorded and the run goes on. Interrupt
    it at any time: finished trials are stored and a re-run resumes.

    Example: autoflash tune --budget 15
    """
    import dataclasses

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from autoflash.tuning import tuner as tune_mod
    from autoflash.device import gpu_fingerprint
    from autoflash.shapes import load_shape_set
    from autoflash.store import Store, StoreError

    op_list = [o.strip() for o in ops.split(",") if o.strip()]
    unknown = [o for o in op_list if o not in ("fwd", "bwd")]
    if unknown or not op_list:
        raise click.ClickException(f"unknown op(s) {unknown or ops!r}: choose from fwd, bwd")
    if interpret:
        _use_interpreter()
    else:
        _require_gpu("autoflash tune", " Use --interpret to run the whole pipeline on tiny shapes in "
                     "Triton's CPU interpreter (correctness is real, timings are not GPU performance).")
    shape_list = [s for op in op_list for s in load_shape_set(shapes or ("tiny" if interpret else "standard"), op)]
    if dtype:
        shape_list = [dataclasses.replace(s, dtype=dtype) for s in shape_list]
    if interpret and any(s.dtype == "bfloat16" for s in shape_list):
        raise click.ClickException("bfloat16 is not computed correctly by Triton's interpreter: use --dtype float16")
    options = tune_mod.TuneOptions(trials=trials, budget_s=budget * 60 if budget else None, seed=seed,
                                   rep_ms=rep_ms, interpret=interpret)
    if workers:
        options.compile_workers = workers
    try:
        store = Store(db_path)
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    device = gpu_fingerprint()
    console.print(f"tuning {len(tune_mod.representative_shapes(shape_list))} problems on [bold]{device.name}[/] "
                  f"(torch {device.torch_version}, triton {device.triton_version}) -> {store.path}")
    if interpret:
        console.print("[yellow]interpreter mode: kernels run on the CPU; correctness is real, timings are not "
                      "GPU performance. A CUDA GPU is needed for real tuning.[/]")
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as progress:
        results = tune_mod.tune(shape_list, store, options, reporter=_RichReporter(progress),
                                command=" ".join(["autoflash", *sys.argv[1:]]))
    title = f"TFLOP/s ({', '.join(op_list)}) on {device.name}, torch {device.torch_version}, triton {device.triton_version}"
    if interpret:
        title += " (interpreter: not GPU performance)"
    table = _results_table(results, title)
    console.print(table)
    if md_path:
        from rich.console import Console as _Console

        with open(md_path, "w") as f:
            _Console(file=f, width=200, color_system=None).print(table)
    short = [r for r in results if r.cut_short]
    if short:
        console.print(f"[yellow]{len(short)} of {len(results)} problems reached the time budget before {trials} "
                      f"measured candidates (fewest: {min(r.measured for r in short)}). Short searches miss good "
                      "variants: the same command with a larger --budget continues them (trials already in "
                      "the DB count).[/]")
    counts = store.counts()
    console.print(f"DB {store.path}: {counts['winners']} winners, {counts['trials']} trials")


@cli.command("search-quality")
@click.option("--db", "db_path", type=click.Path(exists=True, dir_okay=False), required=True,
              help="A DB holding an exhaustive sweep (autoflash tune --trials 100000).")
@click.option("--problem", "problem_key", default=None, help="Problem key (default: every problem in the DB).")
@click.option("--seeds", default=5, show_default=True)
@click.option("--trials", default=110, show_default=True, help="Search length replayed per seed.")
@click.option("--tolerance", default=0.02, show_default=True)
def search_quality_cmd(db_path, problem_key, seeds, trials, tolerance):
    """Replay the tuner's Optuna sampler against an exhaustive sweep's recorded timings.

    Reports how many trials the search needs to come within --tolerance of the exhaustive best
    (per seed), next to random search on the same table. No GPU needed: the objective is the
    recorded measurement of each variant.

    Example: autoflash search-quality --db docs/results/2026-11-30-h200-sweep-d64.db
    """
    import statistics

    from autoflash.device import GPUFingerprint
    from autoflash.store import Store
    from autoflash.tuning.search_quality import search_quality

    store = Store(db_path, readonly=True)
    gpu_columns = [d[0] for d in store.db.execute("select * from gpus limit 0").description]
    keys = [problem_key] if problem_key else [r[0] for r in store.db.execute("select distinct problem from trials")]
    t = Table(title=f"search quality: trials to come within {tolerance:.0%} of the exhaustive best")
    for col in ("problem", "variants", "within tol.", "default/best", "TPE per seed", "TPE median", "random median"):
        t.add_column(col)
    for key in keys:
        rows = list(store.db.execute(
            "select t.variant, t.median_ms, g.* from trials t join gpus g on g.gpu_key = t.gpu_key "
            "where t.problem = ? and t.status = 'ok'", [key]))
        if not rows:
            continue
        g = dict(zip(gpu_columns, rows[0][2:]))
        device = GPUFingerprint(**{k: g[k] for k in GPUFingerprint.__dataclass_fields__})
        table = {r[0]: r[1] for r in rows}
        q = search_quality(table, Problem.from_key(key), device, seeds, min(trials, len(table)), tolerance)
        found = [x for x in q["tpe"] if x is not None]
        t.add_row(key, str(q["space"]), str(q["within_tolerance"]),
                  f"{q['default_ms'] / q['best_ms']:.3f}" if q["default_ms"] else "-",
                  ", ".join(str(x) if x else "not found" for x in q["tpe"]),
                  f"{statistics.median(found):.0f}" if found else "-", f"{q['random_median']:.0f}")
    console.print(t)


@cli.command()
def info():
    """This machine's GPU fingerprint, versions, DB paths and how many tuned winners apply here.

    Example: autoflash info
    """
    from autoflash import codegen
    from autoflash.dispatch import WinnerTable
    from autoflash.device import gpu_fingerprint

    device = gpu_fingerprint()
    t = Table(title="autoflash info", show_header=False)
    for k, v in device.as_dict().items():
        t.add_row(k, str(v))
    t.add_row("gpu key", device.key)
    for op in ("fwd", "bwd"):
        t.add_row(f"template hash ({op})", codegen.template_hash(op))
    t.add_row("kernel cache", str(codegen.kernel_cache_dir()))
    paths = WinnerTable.default_paths()
    for i, path in enumerate(paths):
        label = "user DB" if i == 0 else "shipped DB"
        t.add_row(label, f"{path}{'' if path.is_file() else ' (absent)'}")
    table = WinnerTable(device, paths)
    t.add_row("winners that apply here", str(len(table.rows)))
    console.print(t)


@cli.command()
@click.option("--shapes", default="standard", show_default=True,
              help="Shape set (standard, gqa, long, ...) or a TOML file.")
@click.option("--op", type=click.Choice(["fwd", "bwd"]), default="fwd", show_default=True, help="Kernel op.")
@click.option("--interpret", is_flag=True, help="Resolve for the Triton CPU interpreter instead of the GPU.")
def which(shapes, op, interpret):
    """Which kernel autoflash.attention serves for each shape on this machine, and where it comes from.

    For each shape: the problem key, whether a tuned winner matched (exact or nearest seqlen bucket)
    or the built-in default is used, the DB file the winner was read from, and the variant.
    Nothing is compiled or launched.

    Example: autoflash which --shapes standard
    """
    import dataclasses
    from pathlib import Path

    if interpret:
        _use_interpreter()
    from autoflash.dispatch import get_dispatcher
    from autoflash.device import gpu_fingerprint
    from autoflash.shapes import load_shape_set

    device = gpu_fingerprint()
    disp = get_dispatcher()
    t = Table(title=f"kernels served on {device.name} ({op}, contiguous inputs)")
    for col in ("shape", "problem", "winner", "from", "variant"):
        t.add_column(col)
    for shape in load_shape_set(shapes):
        problem = dataclasses.replace(shape, op=op).problem
        _, how, origin = disp.winners(device).explain(problem)
        variant = disp.variant_for(problem, device)
        t.add_row(shape.label(), problem.key, how, Path(origin).name if origin else "built-in",
                  f"{variant.family}: {variant.short()}")
    console.print(t)


_db_file_option = click.option("--db", "db_file", type=click.Path(dir_okay=False), default=None,
                               help="DB file (default: the user DB).")


@cli.group()
def db():
    """Inspect the results database.

    Example: autoflash db list --head-dim 128
    """


@db.command("path")
def db_path_cmd():
    """Print the path of the user results DB ($AUTOFLASH_DB or ~/.cache/autoflash/autoflash.db)."""
    from autoflash.store import default_db_path

    click.echo(str(default_db_path()))


@db.command("list")
@_db_file_option
@click.option("--gpu", default=None, help="Only GPUs whose key contains this text.")
@click.option("--op", default=None, help="Only this op.")
@click.option("--head-dim", type=int, default=None, help="Only this head dim.")
def db_list(db_file, gpu, op, head_dim):
    """List stored winners (problem, variant, TFLOP/s, spread, trials).

    Example: autoflash db list --db cache/h200-forward.db --op fwd
    """
    store = _open_store(db_file, readonly=True)
    path = store.path
    rows = [r for r in store.winners(op=op, head_dim=head_dim) if not gpu or gpu.lower() in r["gpu_key"].lower()]
    t = Table(title=f"winners in {path}")
    for col in ("gpu", "problem", "variant", "TFLOP/s", "spread", "trials"):
        t.add_column(col, overflow="fold")  # wrap long keys whole, never cut them off
    from autoflash.space import Variant

    for r in rows:
        variant = Variant.of(r["op"], json.loads(r["variant"])).short() if r["variant"].startswith("{") else r["variant"]
        t.add_row(r["gpu_key"].split("|")[0], r["problem"], variant, f"{r['tflops'] or float('nan'):.1f}",
                  f"{(r['spread'] or 0) * 100:.1f}%", str(r["trials"]))
    console.print(t)
    console.print(f"{len(rows)} winner(s)")


@db.command("plot")
@_db_file_option
@click.option("--gpu", default=None, help="Only GPUs whose key contains this text.")
@click.option("--op", default="fwd", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="PNG file to write.")
def db_plot(db_file, gpu, op, output):
    """Bar chart of stored winners: tuned vs untuned default vs SDPA cuDNN and flash (TFLOP/s),
    as re-measured together at the end of tuning.

    Example: autoflash db plot --db docs/results/2026-11-30-h200-tune-standard.db -o tuned.png
    """
    from autoflash import bench as bench_mod
    from autoflash.problem import Shape

    store = _open_store(db_file, readonly=True)
    rows, gpu_name = [], None
    for w in store.winners(op=op):
        if (gpu and gpu.lower() not in w["gpu_key"].lower()) or not w["shape"]:
            continue
        gpu_name = gpu_name or w["gpu_key"].split("|")[0]
        ms = {"tuned": w["median_ms"], "default": w["default_ms"], "sdpa_cudnn": w["sdpa_cudnn_ms"],
              "sdpa_flash": w["sdpa_flash_ms"]}
        rows.append(bench_mod.BenchRow(Shape(**json.loads(w["shape"])), {k: v if v else float("nan") for k, v in ms.items()}))
    if not rows:
        raise click.ClickException(f"no {op} winners with measurements in {store.path}")
    rows.sort(key=lambda r: (r.shape.head_dim, r.shape.causal, r.shape.seqlen_q))
    bench_mod.plot(rows, ["tuned", "default", "sdpa_cudnn", "sdpa_flash"], output,
                   f"{op} TFLOP/s of stored winners on {gpu_name}")
    console.print(f"plot of {len(rows)} winners saved to {output}")


def _open_store(db_file, readonly: bool):
    from autoflash.store import Store, StoreError, default_db_path

    try:
        return Store(db_file or default_db_path(), readonly=readonly)
    except StoreError as e:
        raise click.ClickException(str(e)) from None


@db.command("show")
@click.argument("problem_key")
@_db_file_option
def db_show(problem_key, db_file):
    """Show the winner(s) of one problem key and its measured trials, best first.

    Example: autoflash db show fwd/bfloat16/d128/causal/g1/q4096/k4096 --db cache/h200-forward.db
    """
    store = _open_store(db_file, readonly=True)
    winners = [w for w in store.winners() if w["problem"] == problem_key]
    if not winners:
        raise click.ClickException(f"no winner for {problem_key!r} in {store.path}")
    for w in winners:
        t = Table(title=f"winner: {problem_key}", show_header=False)
        for k in ("gpu_key", "template_hash", "variant", "tflops", "median_ms", "spread", "default_ms",
                  "sdpa_cudnn_ms", "sdpa_flash_ms", "trials", "updated_at"):
            t.add_row(k, str(w[k]))
        console.print(t)
    trials = list(store.db["trials"].rows_where("problem = ?", [problem_key], order_by="median_ms is null, median_ms"))
    if trials:
        t = Table(title=f"{len(trials)} trial(s)")
        for col in ("status", "median ms", "TFLOP/s", "error", "variant / message"):
            t.add_column(col)
        for r in trials[:20]:
            t.add_row(r["status"], f"{r['median_ms'] or float('nan'):.4f}", f"{r['tflops'] or float('nan'):.1f}",
                      f"{r['err'] or float('nan'):.2e}", r["variant"] if r["status"] == "ok" else (r["message"] or "")[:120])
        console.print(t)


@db.command("export")
@_db_file_option
@click.option("--format", "fmt", type=click.Choice(["json", "csv", "sqlite"]), default="json", show_default=True,
              help="json: winners for `db import`; csv: one table; sqlite: a winners-only DB (e.g. for cache/).")
@click.option("--table", type=click.Choice(["winners", "trials"]), default="winners", show_default=True,
              help="CSV only: which table (JSON exports winners, importable elsewhere).")
@click.option("--op", type=click.Choice(["fwd", "bwd"]), help="Winners of this op only (json, sqlite).")
@click.option("--current", is_flag=True,
              help="Only winners the current templates can serve (json, sqlite): what to ship in cache/.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="-", show_default=True)
def db_export(db_file, fmt, table, op, current, output):
    """Export winners as JSON (for `autoflash db import`), a table as CSV, or winners as a small DB.

    Example: autoflash db export -o h200-winners.json
    Example: autoflash db export --format sqlite --op fwd --current -o cache/h200-forward.db
    """
    import csv

    from autoflash import codegen

    def keep(row) -> bool:
        return ((op is None or row["op"] == op)
                and (not current or row["template_hash"] == codegen.template_hash(row["op"])))

    store = _open_store(db_file, readonly=True)
    if fmt == "sqlite":
        if output == "-":
            raise click.ClickException("--format sqlite needs -o FILE")
        n = store.copy_winners_to(output, keep=keep)
        console.print(f"{n} winner(s) written to {output}")
        return
    with click.open_file(output, "w") as f:
        if fmt == "json":
            json.dump(store.export_winners(keep=keep), f, indent=1, sort_keys=True)
            f.write("\n")
        else:
            rows = list(store.db[table].rows)
            writer = csv.DictWriter(f, fieldnames=list(store.db[table].columns_dict))
            writer.writeheader()
            writer.writerows(rows)


@db.command("import")
@click.argument("json_file", type=click.Path(exists=True, dir_okay=False))
@_db_file_option
def db_import(json_file, db_file):
    """Import a winners JSON export (idempotent; the faster row wins a conflict).

    Example: autoflash db import h200-winners.json
    """
    from autoflash.store import StoreError

    store = _open_store(db_file, readonly=False)
    try:
        with open(json_file) as f:
            counts = store.import_winners(json.load(f))
    except (StoreError, json.JSONDecodeError) as e:
        raise click.ClickException(f"cannot import {json_file}: {e}") from None
    console.print(f"imported into {store.path}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


@db.command("merge")
@click.argument("other_db", type=click.Path(exists=True, dir_okay=False))
@_db_file_option
def db_merge(other_db, db_file):
    """Merge the winners of another autoflash DB into this one (idempotent; refuses a foreign schema).

    Example: autoflash db merge colleague.db
    """
    from autoflash.store import StoreError

    store = _open_store(db_file, readonly=False)
    try:
        counts = store.merge_from(other_db)
    except StoreError as e:
        raise click.ClickException(f"cannot merge {other_db}: {e}") from None
    console.print(f"merged into {store.path}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


def main():
    try:
        cli(prog_name="autoflash")
    except KeyboardInterrupt:  # finished work is already stored; say so instead of a traceback
        console.print("[yellow]interrupted[/]")
        sys.exit(130)
