"""Results DB: schema, migrations, upserts, refusal of foreign/corrupt files, concurrent writers."""

import multiprocessing
import sqlite3
import subprocess
import sys

import pytest

from autoflash.device import GPUFingerprint

from autoflash.problem import Problem
from autoflash.store import SCHEMA_VERSION, Store, StoreError

GPU = GPUFingerprint("Test GPU", 9, 0, 132, 232448, "2.x", "3.6", "13.0", "0.1")
PROBLEM = Problem("fwd", "bfloat16", 128, True, 1, 4096, 4096)


def add_trials(path, n, tag):
    store = Store(path)
    run = store.start_run(GPU.key, f"writer {tag}")
    for i in range(n):
        store.add_trial(run_id=run, gpu_key=GPU.key, problem=PROBLEM, template_hash="t",
                        variant_json=f'{{"w": "{tag}", "i": {i}}}', status="ok", median_ms=1.0 + i, tflops=1.0)
    store.close()


def test_schema_and_migrations(tmp_path):
    path = tmp_path / "a.db"
    store = Store(path)
    assert {"gpus", "runs", "trials", "winners", "_meta", "_migrations"} <= set(store.db.table_names())
    assert store.db.execute("select value from _meta where key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert [r["name"] for r in store.db["_migrations"].rows] == ["001_initial", "002_run_process", "003_occupancy_key",
                                                               "004_paged_key"]
    assert store.db.execute("pragma journal_mode").fetchone()[0] == "wal"
    store.close()
    Store(path).close()  # re-opening applies nothing twice
    assert [r["name"] for r in Store(path).db["_migrations"].rows] == ["001_initial", "002_run_process", "003_occupancy_key",
                                                                       "004_paged_key"]


def test_a_db_made_before_a_migration_gets_it_and_keeps_its_rows(tmp_path):
    """A DB made by an earlier autoflash (only 001) opens, gains the run columns, loses nothing."""
    import sqlite3

    import sqlite_utils

    from autoflash.store_migrations import _m001_initial

    path = tmp_path / "old.db"
    db = sqlite_utils.Database(sqlite3.connect(path))
    _m001_initial(db)
    db["_migrations"].insert({"name": "001_initial", "applied_at": "then"}, pk="name")
    db["_meta"].insert({"key": "schema_version", "value": "1"}, pk="key")
    db["runs"].insert({"id": 1, "gpu_key": "g", "status": "finished", "command": "autoflash tune"})
    db.close()
    store = Store(path)
    assert {"host", "pid"} <= set(store.db["runs"].columns_dict)
    assert [r["command"] for r in store.db["runs"].rows] == ["autoflash tune"]


def test_winner_upsert_keeps_one_row_per_key(tmp_path):
    store = Store(tmp_path / "a.db")
    store.add_gpu(GPU)
    for ms in (2.0, 1.5):
        store.set_winner(gpu_key=GPU.key, problem=PROBLEM, template_hash="t", variant_json="{}", median_ms=ms,
                         spread=0.01, tflops=100 / ms, trials=10)
    rows = store.winners(GPU.key)
    assert len(rows) == 1 and rows[0]["median_ms"] == 1.5
    store.set_winner(gpu_key=GPU.key, problem=PROBLEM, template_hash="other", variant_json="{}", median_ms=1.0,
                     spread=0.0, tflops=1.0, trials=1)
    assert len(store.winners(GPU.key)) == 2
    assert store.winner(GPU.key, PROBLEM.key, "t")["median_ms"] == 1.5
    assert store.winner("another gpu", PROBLEM.key, "t") is None


def test_nan_is_stored_as_null(tmp_path):
    store = Store(tmp_path / "a.db")
    run = store.start_run(GPU.key, "x")
    store.add_trial(run_id=run, gpu_key=GPU.key, problem=PROBLEM, template_hash="t", variant_json="{}",
                    status="wrong", median_ms=float("nan"), err=float("inf"))
    row = store.trials_for(GPU.key, PROBLEM.key, "t")[0]
    assert row["median_ms"] is None and row["err"] is None and row["status"] == "wrong"


def test_foreign_schema_version_is_refused(tmp_path):
    path = tmp_path / "future.db"
    Store(path).close()
    con = sqlite3.connect(path)
    con.execute("update _meta set value = '99' where key = 'schema_version'")
    con.commit()
    con.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store(path)


def test_corrupt_and_missing_files_are_refused(tmp_path):
    bad = tmp_path / "corrupt.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot use"):
        Store(bad)
    with pytest.raises(StoreError, match="no database"):
        Store(tmp_path / "missing.db", readonly=True)


def test_two_concurrent_writers_lose_no_row(tmp_path):
    path = tmp_path / "shared.db"
    Store(path).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=add_trials, args=(path, 150, tag)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = Store(path)
    assert store.db["trials"].count == 300
    assert store.db["runs"].count == 2


def test_a_writer_gives_up_after_one_busy_timeout_while_another_process_holds_the_lock(tmp_path):
    """A write lock held elsewhere (an open write transaction in another process) makes a write fail
    after about one busy timeout, with SQLite's "locked", not after one busy timeout per retry."""
    import time

    path = tmp_path / "held.db"
    Store(path).close()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sqlite3, sys, time
conn = sqlite3.connect({str(path)!r}, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises((sqlite3.OperationalError, StoreError), match="locked|busy"):
            Store(path, busy_timeout_ms=1000).start_run(GPU.key, "blocked writer")  # (opening writes too)
        assert time.monotonic() - t0 < 10  # (one busy timeout of 1 s, and the last attempt's own wait)
    finally:
        holder.kill()
        holder.wait()
    store = Store(path)  # the lock gone: writes go through
    assert store.start_run(GPU.key, "after") >= 1


def test_opens_in_sqlite_utils_cli(tmp_path):
    # The running interpreter's own sqlite-utils (a dependency), whether or not its venv is on PATH.
    path = tmp_path / "a.db"
    add_trials(path, 3, "x")
    out = subprocess.run([sys.executable, "-m", "sqlite_utils", "tables", str(path), "--counts"],
                         capture_output=True, text=True, check=True).stdout
    assert '"table": "trials", "count": 3' in out


def test_runs_left_running_by_a_dead_process_are_marked_interrupted(tmp_path):
    import subprocess
    import sys

    from autoflash.store import Store

    store = Store(tmp_path / "r.db")
    alive = store.start_run("gpu", "this process")  # our own pid: alive, left alone
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = store.start_run("gpu", "a killed tune")
    store.db["runs"].update(dead, {"pid": int(gone.stdout)})
    other_host = store.start_run("gpu", "elsewhere")
    store.db["runs"].update(other_host, {"host": "another-machine", "pid": int(gone.stdout)})
    assert store.mark_dead_runs() == 1
    status = {r["id"]: r["status"] for r in store.db["runs"].rows}
    assert status == {alive: "running", dead: "interrupted", other_host: "running"}


def test_a_worker_counts_an_unsupported_vendor_backend_as_measured_not_failed(tmp_path):
    """The per-problem counts a multi-worker tune reports are read back from the DB: a candidate the
    backend has no kernel for ('unsupported') was measured, but it is no failure; a wrong one is."""
    import dataclasses
    import json

    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Shape
    from autoflash.tuning.results import ProblemResult
    from autoflash.tuning.workers import _with_db_counts

    device = gpu_fingerprint()
    shape = Shape(batch=1, heads_q=4, heads_kv=1, seqlen_q=64, seqlen_k=64, head_dim=64, causal=True, dtype="float16")
    store = Store(tmp_path / "t.db")
    store.add_gpu(device)
    run = store.start_run(device.key, "test")
    for family, status in (("sdpa_fwd", "ok"), ("sdpa_fwd", "unsupported"), ("triton_fwd", "ok"), ("triton_fwd", "wrong")):
        store.add_trial(run_id=run, gpu_key=device.key, problem=shape.problem, template_hash=codegen.template_hash(family),
                        variant_json=json.dumps({"status": status}), status=status)
    result = ProblemResult(shape, shape.problem, None, {}, 0.0, measured=0, failed=0, status="tuned")
    counted = _with_db_counts(store, {device.key}, result)
    assert (counted.measured, counted.failed) == (4, 1)
    assert dataclasses.replace(counted, measured=0, failed=0) == result
    store.close()
