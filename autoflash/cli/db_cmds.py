"""`autoflash db ...`: inspect, export, import and merge results databases (no SQL here: the
queries live in `autoflash.store_queries`)."""

from __future__ import annotations

import json

import click
from rich.table import Table

from autoflash.cli.common import (OPS, FriendlyGroup, console, db_file_option, one_line, open_store,
                                  output_option, refuse_database)


@click.group(cls=FriendlyGroup)
def db():
    """Inspect the results database.

    Example: autoflash db list --head-dim 128
    """


@db.command("path")
@click.option("--interpret", is_flag=True, help="The DB of `autoflash tune --interpret` (the CPU interpreter's).")
def db_path_cmd(interpret):
    """Print the path of the user results DB ($AUTOFLASH_DB, else ~/.cache/autoflash/autoflash.db;
    with --interpret the interpreter's, ~/.cache/autoflash/interpret.db).

    Example: sqlite-utils tables "$(autoflash db path)" --counts
    """
    from autoflash.store import default_db_path

    click.echo(str(default_db_path(interpret=interpret or None)))


@db.command("list")
@db_file_option
@click.option("--gpu", default=None, help="Only GPUs whose key contains this text.")
@click.option("--op", type=click.Choice(OPS), default=None, help="Only this op.")
@click.option("--head-dim", type=click.IntRange(min=1), default=None, help="Only this head dim.")
def db_list(db_file, gpu, op, head_dim):
    """List stored winners (problem, variant, TFLOP/s, spread, trials).

    Example: autoflash db list --db cache/h200-forward.db --op fwd
    """
    from autoflash.space import Variant
    from autoflash.store_queries import winners_summary

    store = open_store(db_file, readonly=True)
    rows = winners_summary(store, gpu=gpu, op=op, head_dim=head_dim)
    t = Table(title=f"winners in {store.path}")
    for col in ("gpu", "problem", "variant", "TFLOP/s", "spread", "trials"):
        t.add_column(col, overflow="fold")  # wrap long keys whole, never cut them off
    for r in rows:
        variant = Variant.of(r["op"], json.loads(r["variant"])).short() if r["variant"].startswith("{") else r["variant"]
        t.add_row(r["gpu_key"].split("|")[0], r["problem"], variant, f"{r['tflops'] or float('nan'):.1f}",
                  f"{(r['spread'] or 0) * 100:.1f}%", str(r["trials"]))
    console.print(t)
    console.print(f"{len(rows)} winner(s)")


@db.command("plot")
@db_file_option
@click.option("--gpu", default=None, help="Only GPUs whose key contains this text.")
@click.option("--op", type=click.Choice(OPS), default="fwd", show_default=True)
@output_option("-o", "--output", required=True, help="PNG file to write.")
def db_plot(db_file, gpu, op, output):
    """Bar chart of stored winners: tuned vs untuned default vs SDPA cuDNN and flash (TFLOP/s),
    as re-measured together at the end of tuning.

    Example: autoflash db plot --db docs/results/2026-11-30-h200-tune-standard.db -o tuned.png
    """
    from autoflash import bench as bench_mod
    from autoflash.problem import Shape
    from autoflash.store_queries import winners_summary

    from autoflash.store_validate import shape_text_problem

    store = open_store(db_file, readonly=True)
    rows, gpu_name, skipped = [], None, []
    for w in winners_summary(store, gpu=gpu, op=op):
        if not w["shape"]:
            continue
        if reason := shape_text_problem(w["shape"]):  # (a row written by hand or by an older autoflash)
            skipped.append(f"{w['problem']}: shape {reason}")
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
    if skipped:
        console.print(f"[yellow]warning:[/] {len(skipped)} winner(s) left out, first: {skipped[0]}")


@db.command("show")
@click.argument("problem_key")
@db_file_option
def db_show(problem_key, db_file):
    """Show the winner(s) of one problem key and its measured trials, best first.

    Example: autoflash db show fwd/bfloat16/d128/causal/g1/q4096/k4096 --db cache/h200-forward.db
    """
    from autoflash.store_queries import trial_counts, trials_best_first, winners_for_problem

    store = open_store(db_file, readonly=True)
    winners = winners_for_problem(store, problem_key)
    if not winners:
        raise click.ClickException(f"no winner for {problem_key!r} in {store.path}")
    for w in winners:
        t = Table(title=f"winner: {problem_key}", show_header=False)
        for k in ("gpu_key", "template_hash", "variant", "tflops", "median_ms", "spread", "default_ms",
                  "sdpa_cudnn_ms", "sdpa_flash_ms", "trials", "updated_at"):
            t.add_row(k, str(w[k]))
        console.print(t)
    total = sum(trial_counts(store, problem_key).values())
    if total:
        t = Table(title=f"{total} trial(s)")
        for col in ("status", "median ms", "TFLOP/s", "error", "variant / message"):
            t.add_column(col)
        listed = trials_best_first(store, problem_key, limit=20)
        for r in listed:
            t.add_row(r["status"], f"{r['median_ms'] or float('nan'):.4f}", f"{r['tflops'] or float('nan'):.1f}",
                      f"{r['err'] or float('nan'):.2e}", r["variant"] if r["status"] == "ok" else (r["message"] or "")[:120])
        console.print(t)
        slowest_winner = max((w["median_ms"] for w in winners if w["median_ms"]), default=None)
        faster = [r for r in listed if r["status"] == "ok" and r["median_ms"] and slowest_winner
                  and r["median_ms"] < slowest_winner]
        if faster:
            console.print(f"note: {len(faster)} trial(s) above read faster than a winner's median_ms. Trials are "
                          "timed one at a time while searching; the winner was picked afterwards by re-measuring the "
                          "best candidates, the default and SDPA interleaved in one process (its median_ms is that "
                          "re-measurement), where it was the fastest. Trial times are not comparable with it.")


@db.command("export")
@db_file_option
@click.option("--format", "fmt", type=click.Choice(["json", "csv", "sqlite"]), default="json", show_default=True,
              help="json: winners for `db import`; csv: one table; sqlite: a winners-only DB (e.g. for cache/).")
@click.option("--table", type=click.Choice(["winners", "trials"]), default="winners", show_default=True,
              help="CSV only: which table (JSON exports winners, importable elsewhere).")
@click.option("--op", type=click.Choice(OPS), help="Winners of this op only (json, sqlite).")
@click.option("--current", is_flag=True,
              help="Only winners the current templates can serve (json, sqlite): what to ship in cache/.")
@output_option("-o", "--output", default="-", show_default=True, database=True)
def db_export(db_file, fmt, table, op, current, output):
    """Export winners as JSON (for `autoflash db import`), a table as CSV, or winners as a small DB.

    Example: autoflash db export -o h200-winners.json
    Example: autoflash db export --format sqlite --op fwd --current -o cache/h200-forward.db
    """
    import csv

    from autoflash import codegen
    from autoflash.store_queries import table_dump

    def keep(row) -> bool:
        return ((op is None or row["op"] == op)
                and (not current or codegen.family_for_hash(row["op"], row["template_hash"], earlier=True) is not None))

    store = open_store(db_file, readonly=True)
    if fmt == "sqlite":
        if output == "-":
            raise click.BadParameter("--format sqlite needs -o FILE", param_hint="'-o' / '--output'")
        # (it replaces another DB whole; never a DB's -wal/-shm/journal)
        refuse_database(output, replaces_databases=True, param_hint="'-o' / '--output'")
        n = store.copy_winners_to(output, keep=keep)
        console.print(f"{n} winner(s) written to {output}")
        return
    refuse_database(output, param_hint="'-o' / '--output'")  # (JSON or CSV in place of a DB, its source too)
    with click.open_file(output, "w") as f:
        if fmt == "json":
            data = store.export_winners(keep=keep)
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            n, what = len(data["winners"]), "winner(s)"
        else:
            columns, rows = table_dump(store, table)
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
            n, what = len(rows), f"{table} row(s)"
    if output != "-":  # (on standard output the data alone: it may be piped)
        console.print(f"{n} {what} written to {output}")


@db.command("import")
@click.argument("json_file", type=click.Path(exists=True, dir_okay=False))
@db_file_option
def db_import(json_file, db_file):
    """Import a winners JSON export (idempotent; a conflict keeps a row measured here, else the faster).

    Example: autoflash db import h200-winners.json
    """
    import sqlite3

    from autoflash.store import StoreError

    data = _read_export(json_file)
    store = open_store(db_file, readonly=False)
    try:
        counts = store.import_winners(data)
    except (StoreError, ValueError, KeyError, TypeError, AttributeError, sqlite3.IntegrityError,
            sqlite3.InterfaceError) as e:
        why = f"missing field {e}" if isinstance(e, KeyError) else one_line(e)
        raise click.ClickException(f"cannot import {json_file}: {why}") from None
    console.print(f"imported into {store.path}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


def _read_export(path: str):
    """The JSON of a winners export; a file that is none (a DB, other text, binary) is a one-line
    error naming what it is and what to do instead."""
    with open(path, "rb") as f:
        raw = f.read()
    fix = "make one with `autoflash db export -o FILE.json` on the machine that has the winners"
    if raw.startswith(b"SQLite format 3"):
        raise click.ClickException(f"cannot import {path}: it is an SQLite database, not a JSON export; to take "
                                   f"its winners, run `autoflash db merge {path}`")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise click.ClickException(f"cannot import {path}: it is not a text file, so no winners export "
                                   f"(those are JSON); {fix}") from None
    except ValueError as e:
        raise click.ClickException(f"cannot import {path}: it is not JSON ({one_line(e)}), so no winners export; "
                                   f"{fix}") from None
    if not isinstance(data, dict) or data.get("format") != "autoflash-winners":
        raise click.ClickException(f"cannot import {path}: it is JSON but no winners export (those have "
                                   f"\"format\": \"autoflash-winners\"); {fix}")
    return data


@db.command("merge")
@click.argument("other_db", type=click.Path(exists=True, dir_okay=False))
@db_file_option
def db_merge(other_db, db_file):
    """Merge the winners of another autoflash DB into this one (idempotent; refuses a foreign schema).

    Example: autoflash db merge colleague.db
    """
    from autoflash.store import StoreError

    store = open_store(db_file, readonly=False)
    try:
        counts = store.merge_from(other_db)
    except StoreError as e:
        raise click.ClickException(f"cannot merge {other_db}: {e}") from None
    console.print(f"merged into {store.path}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
