"""Hardening, second round: the new surfaces (storage URLs, recording, imports, logging, template
files, shape files, damaged DBs). Each test is one defect found by trying them as a hostile user
would: real SQLite files, real Optuna storages, real worker processes and the CLI."""

import contextlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from click.testing import CliRunner

from autoflash.cli import cli
from autoflash.store import Store, StoreError

from helpers import db_with_winners


def run(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def one_line_error(r, *says, code=None):
    """Failed with one 'Error:' line saying each of `says`, and no traceback."""
    assert r.exit_code not in (0, None) and (code is None or r.exit_code == code), (r.exit_code, r.output)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, r.output
    text = " ".join(r.output.split())
    for s in says:
        assert s in text, r.output


def tables(path) -> set:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- 1. storage URLs
@pytest.mark.parametrize("target", ["results-db", "results-db-wal", "foreign-db"])
def test_tune_storage_url_naming_the_results_db_or_a_foreign_sqlite_file_is_refused(tmp_path, target):
    db = db_with_winners(tmp_path / "results.db", n=1)
    foreign = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(foreign)) as conn:
        conn.execute("create table trials (id integer primary key, note text)")  # (Optuna has a `trials` too)
        conn.commit()
    path = {"results-db": db, "results-db-wal": tmp_path / "results.db-wal", "foreign-db": foreign}[target]
    before = {p: (p.read_bytes(), tables(p)) for p in (db, foreign)}
    r = run("tune", "--interpret", "--trials", 1, "--shapes", "tiny", "--db", db, "--storage", f"sqlite:///{path}")
    one_line_error(r, "as the Optuna storage", "results DB" if target != "foreign-db" else "another program's")
    for p, (content, names) in before.items():
        assert tables(p) == names and "studies" not in names  # Optuna made no table in either
    assert foreign.read_bytes() == before[foreign][0]


def test_a_new_sqlite_url_is_still_an_optuna_storage(tmp_path):
    import optuna

    from autoflash.tuning.storage import make_storage

    db = db_with_winners(tmp_path / "results.db", n=1)
    storage = make_storage(f"sqlite:///{tmp_path / 'studies.db'}", db)
    assert isinstance(storage, optuna.storages.RDBStorage)
    assert isinstance(make_storage(f"sqlite:///{tmp_path / 'studies.db'}", db), optuna.storages.RDBStorage)  # again


# --------------------------------------------------------------------------- 2. AUTOFLASH_RECORD
def _wal_db(path):
    """A results DB in WAL mode whose -wal file holds a transaction not yet checkpointed."""
    db_with_winners(path, n=1)
    conn = sqlite3.connect(path)
    conn.execute("pragma wal_autocheckpoint = 0")
    conn.execute("update winners set spread = 0.5")
    conn.commit()
    return conn  # (kept open: closing the last connection checkpoints and removes the -wal)


@pytest.mark.parametrize("target", ["results-db", "script", "db-wal"])
def test_record_never_writes_into_a_file_that_is_no_shape_set(tmp_path, monkeypatch, target):
    from autoflash.dispatch import Dispatcher

    keep = None
    if target == "script":
        path = tmp_path / "train.py"
        path.write_text("import torch\nprint('training')\n")
    elif target == "results-db":
        path = db_with_winners(tmp_path / "results.db", n=1)
    else:
        keep = _wal_db(tmp_path / "results.db")
        path = tmp_path / "results.db-wal"
    before = path.read_bytes()
    monkeypatch.setenv("AUTOFLASH_RECORD", str(path))
    d = Dispatcher(winner_paths=[])
    try:
        with pytest.warns(RuntimeWarning, match="refusing to record shapes") as caught:
            for n in (37, 77):  # two problems: one warning in all, nothing written for either
                q = torch.randn(1, 2, n, 32)
                d.kernel_for(q, q, q, torch.empty_like(q), causal=False)
        assert len([w for w in caught if "AUTOFLASH_RECORD" in str(w.message)]) == 1
        assert path.read_bytes() == before
    finally:
        if keep is not None:
            keep.close()


def test_record_writes_into_an_empty_file_and_a_shape_set(tmp_path, monkeypatch):
    from autoflash.dispatch import Dispatcher
    from autoflash.shapes import load_shape_set

    path = tmp_path / "shapes.toml"
    path.write_text("")
    monkeypatch.setenv("AUTOFLASH_RECORD", str(path))
    for n in (37, 77):  # the second process appends to what the first wrote
        q = torch.randn(1, 2, n, 32)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            Dispatcher(winner_paths=[]).kernel_for(q, q, q, torch.empty_like(q), causal=False)
    assert [s.seqlen_q for s in load_shape_set(str(path))] == [37, 77]


# --------------------------------------------------------------------------- 3. imported medians
def _export(tmp_path, median_ms, name="edited.json"):
    data = Store(db_with_winners(tmp_path / f"src-{name}.db", n=1), readonly=True).export_winners()
    data["winners"][0]["median_ms"] = median_ms
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path, data


@pytest.mark.parametrize("median_ms", [1e-300, 1e-9, 5e-4])
def test_db_import_refuses_a_median_below_what_a_kernel_takes(tmp_path, median_ms):
    path, data = _export(tmp_path, median_ms)
    target = tmp_path / "target.db"
    one_line_error(run("db", "import", path, "--db", target), "median_ms", "below what any GPU kernel takes")
    assert not target.exists() or not Store(target, readonly=True).winners()
    with pytest.raises(StoreError, match="below what any GPU kernel takes"):
        Store(tmp_path / "lib.db").import_winners(data)


def test_db_merge_refuses_a_db_holding_a_median_below_the_floor(tmp_path):
    other = db_with_winners(tmp_path / "other.db", n=1)
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("update winners set median_ms = 1e-300")
        conn.commit()
    mine = db_with_winners(tmp_path / "mine.db", n=0)
    one_line_error(run("db", "merge", other, "--db", mine), "below what any GPU kernel takes")
    assert not Store(mine, readonly=True).winners()


def test_a_winner_measured_here_is_kept_over_an_imported_faster_one(tmp_path):
    from autoflash.device import gpu_fingerprint

    store = Store(tmp_path / "mine.db")
    src = Store(db_with_winners(tmp_path / "src.db", n=1, ms=2.0), readonly=True)
    data = src.export_winners()
    row = data["winners"][0]
    device = gpu_fingerprint()
    store.add_gpu(device)
    from autoflash.problem import Problem

    run_id = store.start_run(device.key, "autoflash tune")  # measured by a run of this DB
    store.set_winner(gpu_key=row["gpu_key"], problem=Problem.from_key(row["problem"]),
                     template_hash=row["template_hash"], variant_json=row["variant"], median_ms=2.0, spread=0.0,
                     tflops=1.0, trials=3, run_id=run_id)
    row.update(median_ms=1.0, run_id=run_id)  # claims to be faster, and carries a run id that exists here
    assert store.import_winners(data)["unchanged"] == 1
    assert store.winners()[0]["median_ms"] == 2.0
    # Between imported rows the faster one still wins, and an imported row names no run of this DB.
    other = Store(tmp_path / "other.db")
    assert other.import_winners({**data, "winners": [{**row, "median_ms": 3.0}]})["added"] == 1
    assert other.import_winners(data)["updated"] == 1
    assert [(w["median_ms"], w["run_id"]) for w in other.winners()] == [(1.0, None)]


# --------------------------------------------------------------------------- 4. AUTOFLASH_LOG
def test_an_invalid_autoflash_log_warns_once_and_the_workers_run(tmp_path, monkeypatch):
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.workers import tune_workers

    monkeypatch.setenv("AUTOFLASH_LOG", "junk")
    db = db_with_winners(tmp_path / "t.db", n=0)
    with pytest.warns(RuntimeWarning, match="AUTOFLASH_LOG='junk' is not a log level") as caught:
        results, failures = tune_workers([], db, TuneOptions(interpret=True), 1)  # a real spawned worker
    assert failures == [] and results == []
    assert len([w for w in caught if "AUTOFLASH_LOG" in str(w.message)]) == 1


def test_autoflash_log_takes_level_names_in_any_case_and_numbers():
    from autoflash.tuning.workers import log_level

    assert [log_level(v) for v in ("debug", "INFO", " Warning ", "10", "junk", "", None)] == [
        10, 20, 30, 10, None, None, None]


# --------------------------------------------------------------------------- 5. template files
def test_bench_baseline_template_that_jinja_cannot_parse_is_a_usage_error_naming_file_and_line(tmp_path):
    bad = tmp_path / "old.jinja"
    bad.write_text("x = 1\n{% if %}\n")
    r = run("bench", "--interpret", "--shapes", "tiny", "--baseline-template", bad)
    one_line_error(r, "--baseline-template", f"{bad}, line 2", code=2)


@pytest.mark.parametrize("text, says", [("def f(:\n    pass\n", "line 1: invalid syntax"),
                                        ("x = 1\ny = {{ NO_SUCH_KNOB }}\n", "line 2: cannot render")])
def test_bench_baseline_template_that_renders_no_kernel_is_one_line_naming_file_and_line(tmp_path, text, says):
    from autoflash import codegen
    from autoflash.space import load_space

    bad = tmp_path / "old.jinja"
    bad.write_text(text)
    shapes = tmp_path / "one.toml"
    shapes.write_text('[[shape]]\nbatch = 1\nheads_q = 2\nseqlen_q = 16\nseqlen_k = 16\nhead_dim = 32\n'
                      'causal = false\ndtype = "float32"\n')
    one_line_error(run("bench", "--interpret", "--shapes", shapes, "--baseline-template", bad), str(bad), says)
    with pytest.raises(codegen.TemplateError, match=says.split(":")[0]):
        codegen.load(next(load_space("fwd").all_variants()), bad)


# --------------------------------------------------------------------------- 6. shape sizes, exit codes
SHAPE = 'heads_q = 64\nseqlen_q = 4096\nseqlen_k = 4096\nhead_dim = 64\ncausal = false\ndtype = "float16"\n'


def test_a_shape_no_tensor_can_have_is_refused_before_tuning(tmp_path):
    from autoflash.shapes import load_shape_set

    path = tmp_path / "huge.toml"
    path.write_text("[[shape]]\nbatch = 99999999999999999999\n" + SHAPE)
    with pytest.raises(ValueError, match="more than any device can hold"):
        load_shape_set(str(path))
    db = tmp_path / "t.db"
    one_line_error(run("tune", "--interpret", "--trials", 1, "--db", db, "--shapes", path), "--shapes",
                   "more than any device can hold", code=2)
    assert not db.exists() or not Store(db, readonly=True).counts()["trials"]


@pytest.mark.interpreter
def test_tune_exits_1_and_names_the_problems_that_got_no_winner(tmp_path):
    # 2**48 bytes per tensor: within the shape check's ceiling, and no machine can allocate it (every
    # trial fails), so the problem gets no winner.
    path = tmp_path / "too_big.toml"
    path.write_text("[[shape]]\nbatch = 8388608\n" + SHAPE)
    r = run("tune", "--interpret", "--trials", 1, "--db", tmp_path / "t.db", "--shapes", path)
    one_line_error(r, "1 of 1 problems got no winner", "B8388608", code=1)


# --------------------------------------------------------------------------- 7. damaged schema
def _drop_column(path, table, column):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"alter table {table} drop column {column}")  # (what `_migrations` says is there)
        conn.commit()


def test_a_db_missing_a_column_its_migrations_claim_is_repaired_for_writing(tmp_path):
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem

    db = db_with_winners(tmp_path / "d.db", n=1)
    _drop_column(db, "winners", "page")
    store = Store(db)  # repaired on opening for writing: the next write works, the rows stay
    assert "page" in store.db["winners"].columns_dict and len(store.winners()) == 1
    row = store.winners()[0]
    store.set_winner(gpu_key=gpu_fingerprint().key, problem=Problem.from_key(row["problem"]), template_hash="t2",
                     variant_json=row["variant"], median_ms=1.0, spread=0.0, tflops=1.0, trials=1)
    assert len(store.winners()) == 2


def test_a_db_missing_a_column_its_migrations_claim_is_refused_read_only_with_a_clear_message(tmp_path):
    db = db_with_winners(tmp_path / "d.db", n=1)
    _drop_column(db, "trials", "work")
    with pytest.raises(StoreError, match=r"d.db is damaged: it lacks trials.work \(of migration 003_occupancy_key\)"):
        Store(db, readonly=True)
    one_line_error(run("db", "export", "--db", db, "-o", "-"), "is damaged", "trials.work")


# --------------------------------------------------------------------------- cosmetic items
def test_a_bad_schema_version_names_the_file(tmp_path):
    db = db_with_winners(tmp_path / "d.db", n=1)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("update _meta set value = 'three' where key = 'schema_version'")
        conn.commit()
    for readonly in (True, False):
        with pytest.raises(StoreError, match=r"d.db is damaged: its schema_version \(table _meta\) is 'three'"):
            Store(db, readonly=readonly)
    r = run("db", "list", "--db", db)
    one_line_error(r, str(db), "schema_version")
    assert "invalid literal" not in r.output


def test_a_malformed_postgres_url_is_named_without_its_password(tmp_path):
    r = run("tune", "--interpret", "--db", tmp_path / "t.db", "--storage", "postgresql://user:secret@db.example:port/x")
    one_line_error(r, "malformed storage URL postgresql://user:***@db.example:port/x", "port 'port' is not a number")
    assert "secret" not in r.output and "invalid literal" not in r.output


def _kvcache_inputs():
    q = torch.randn(2, 1, 2, 32)
    cache = torch.randn(2, 8, 2, 32)
    return q, cache, cache.clone()


def test_kvcache_capacity_error_names_the_row_and_its_cache_length():
    import autoflash

    q, k_cache, v_cache = _kvcache_inputs()
    new = torch.randn(2, 1, 2, 32)
    lengths = torch.tensor([3, 8], dtype=torch.int32)  # row 1: 8 cached + 1 new > 8
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] \+ seqlen_new \(8 \+ 1\) must be <= the cache "
                                         r"capacity \(8 tokens\)"):
        autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, k=new, v=new, cache_seqlens=lengths)


def test_kvcache_variant_that_is_no_mapping_is_a_value_error():
    import autoflash

    q, k_cache, v_cache = _kvcache_inputs()
    with pytest.raises(ValueError, match="variant must be a mapping of knob -> value.*'x'"):
        autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, variant="x")


# --------------------------------------------------------------------------- suspicions
def test_a_jsonl_log_passed_as_storage_is_not_appended_to(tmp_path):
    log = tmp_path / "events.jsonl"
    content = b'{"level": "info", "msg": "started"}\n{"level": "info", "msg": "done"}\n'
    log.write_bytes(content)
    r = run("tune", "--interpret", "--trials", 1, "--shapes", "tiny", "--db", tmp_path / "t.db", "--storage", log)
    one_line_error(r, "as an Optuna journal", "not a journal record")
    assert log.read_bytes() == content


def test_a_postgres_server_that_never_answers_fails_the_tune_in_bounded_time(tmp_path):
    # A loopback port that accepts connections (the kernel's backlog) and never says a word: libpq
    # without a connect timeout waits for it forever (psycopg2), psycopg 3 for 130 s. With a 2 s
    # timeout the tune ends long before the 100 s this test waits (process start-up included).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        env = {**os.environ, "AUTOFLASH_CONNECT_TIMEOUT_S": "2", "TRITON_INTERPRET": "1"}
        try:
            done = subprocess.run([sys.executable, "-m", "autoflash", "tune", "--interpret", "--db",
                                   str(tmp_path / "t.db"), "--storage", f"postgresql://user@127.0.0.1:{port}/x"],
                                  env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail("the tune waited for a server that never answers")
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out, out
    assert f"cannot open the Optuna storage postgresql://user@127.0.0.1:{port}/x" in " ".join(out.split()), out


@pytest.mark.interpreter
def test_tune_on_miss_never_holds_the_dispatcher_lock(monkeypatch):
    from autoflash.dispatch import Dispatcher, set_miss_hook

    other_served = threading.Event()
    waited = []

    def hook(shape):  # the tune of the first problem lasts until the other thread's call is served
        if shape.seqlen_q == 45:
            waited.append(other_served.wait(timeout=120))

    monkeypatch.setenv("AUTOFLASH_TUNE_ON_MISS", "1")
    previous = set_miss_hook(hook)
    try:
        d = Dispatcher(winner_paths=[])
        q = torch.randn(1, 2, 45, 32)
        tuning = threading.Thread(target=d.kernel_for, args=(q, q, q, torch.empty_like(q), False))
        tuning.start()
        while not d._tuned_on_miss:  # (the first call is in its tune)
            tuning.join(timeout=0.01)
        r = torch.randn(1, 2, 200, 32)  # another problem, in another thread, while that tune runs
        d.kernel_for(r, r, r, torch.empty_like(r), causal=False)
        other_served.set()
        tuning.join()
    finally:
        set_miss_hook(previous)
    assert waited == [True]
