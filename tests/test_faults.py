"""Faults a deployed autoflash meets: unwritable caches, poisoned bytecode, corrupt keys and rows,
foreign and read-only DBs, crafted trials, stale journal locks. Real files, real subprocesses."""

from __future__ import annotations

import errno
import hashlib
import importlib._bootstrap_external as bootstrap_external
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from autoflash.device import GPUFingerprint
from autoflash.problem import Problem
from autoflash.store import Store, StoreError

ROOT = os.geteuid() == 0
GPU = GPUFingerprint("Test GPU", 9, 0, 132, 232448, "2.x", "3.6", "13.0", "0.1")
PROBLEM = Problem("fwd", "float16", 64, False, 1, 64, 64)

# A subprocess computing autoflash.attention on a tiny fp32 problem vs a float64 reference.
ATTENTION = """
import json, sys, warnings
import torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import autoflash
    from autoflash.reference import reference
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 32) for _ in range(3))
    out = autoflash.attention(q, k, v)
    ref, _ = reference(q, k, v, False, 0, 32 ** -0.5)
err = (out.double() - ref).abs().max().item()
print(json.dumps({"err": err, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
"""


def run_python(code: str, env: dict, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def interp_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOFLASH_", "PYTEST_"))}
    env.update(TRITON_INTERPRET="1", AUTOFLASH_DB=str(tmp_path / "none.db"))
    env.update(extra)
    return env


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- 1. kernel cache
@pytest.mark.parametrize("case", ["path_is_a_file", "parent_is_a_file", "readonly_dir"])
def test_unwritable_kernel_cache_falls_back_to_a_private_temp_dir(tmp_path, case):
    if case == "readonly_dir" and ROOT:
        pytest.skip("root ignores directory permissions (the file cases cover root)")
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    if case == "path_is_a_file":
        cache = blocker
    elif case == "parent_is_a_file":
        cache = blocker / "kernels"
    else:
        cache = tmp_path / "ro"
        cache.mkdir()
        cache.chmod(0o500)
    result = last_json(run_python(ATTENTION, interp_env(tmp_path, AUTOFLASH_KERNEL_CACHE=str(cache))))
    assert result["err"] < 1e-4
    cache_warnings = [w for w in result["warnings"] if "kernel cache" in w]
    assert len(cache_warnings) == 1 and cache_warnings[0].startswith("RuntimeWarning") and str(cache) in cache_warnings[0]
    assert blocker.read_text() == "not a directory"


def test_no_writable_place_at_all_raises_kernel_cache_error(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    code = f"""
    import json, tempfile, dataclasses
    tempfile.tempdir = {str(blocker / "tmp")!r}  # mkdtemp cannot work either
    from autoflash import codegen, kernel_cache
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem
    from autoflash.space import default_variant
    variant = default_variant("fwd", Problem("fwd", "float32", 32, False, 1, 64, 64), gpu_fingerprint())
    try:
        codegen.load(variant)
        print(json.dumps({{"raised": None}}))
    except kernel_cache.KernelCacheError as e:
        print(json.dumps({{"raised": type(e).__name__, "message": str(e)}}))
    """
    result = last_json(run_python(code, interp_env(tmp_path, AUTOFLASH_KERNEL_CACHE=str(blocker))))
    assert result["raised"] == "KernelCacheError" and str(blocker) in result["message"]


# --------------------------------------------------------------------------- 2. bytecode
def test_a_planted_pyc_beside_a_cached_kernel_is_never_executed(tmp_path):
    cache, marker = tmp_path / "kernels", tmp_path / "PWNED"
    env = interp_env(tmp_path, AUTOFLASH_KERNEL_CACHE=str(cache))
    assert last_json(run_python(ATTENTION, env))["err"] < 1e-4  # renders the kernels into the cache
    kernels = sorted(cache.glob("*.py"))
    assert kernels
    for py in kernels:  # a .pyc the import system would accept: same mtime and size as the source
        st = py.stat()
        evil = py.read_text() + f"\nopen({str(marker)!r}, 'w').write('executed')\n"
        code = compile(evil, str(py), "exec")
        pyc = pathlib.Path(importlib.util.cache_from_source(str(py)))
        pyc.parent.mkdir(exist_ok=True)
        pyc.write_bytes(bootstrap_external._code_to_timestamp_pyc(code, int(st.st_mtime), st.st_size))
    result = last_json(run_python(ATTENTION, env))
    assert not marker.exists(), "foreign bytecode was executed"
    assert result["err"] < 1e-4


# --------------------------------------------------------------------------- 3. problem keys
BAD_KEYS = ["fwd/float16/d64/full/g1/q0/k0", "fwd/float16/d64/full/g1/q-64/k64", "fwd/float16/d64/full/g1/q48/k64",
            "fwd/float16/d0/full/g1/q64/k64", "fwd/float16/d-8/full/g1/q64/k64", "fwd/float16/d64/full/g0/q64/k64",
            "fwd/float16/d64/full/g-2/q64/k64", "mul/float16/d64/full/g1/q64/k64", "fwd/int8/d64/full/g1/q64/k64",
            "fwd/float16/d64/full/g1/q64", "fwd/float16/d64/full/g1/q64/k64/extra", "fwd/float16/d64/maybe/g1/q64/k64",
            "fwd/float16/dx/full/g1/q64/k64", ""]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_problem_keys_raise_value_error(key):
    with pytest.raises(ValueError, match="problem key"):
        Problem.from_key(key)


def test_problem_range_checks():
    for kwargs in ({"seqlen_q": 0}, {"seqlen_k": -64}, {"seqlen_q": 100}, {"head_dim": 0}, {"gqa_group": 0},
                   {"op": "mul"}, {"dtype": "int8"}):
        with pytest.raises(ValueError):
            Problem(**{**PROBLEM.as_dict(), **kwargs})
    assert Problem.from_key(PROBLEM.key) == PROBLEM


def test_a_winner_with_a_zero_length_key_costs_a_warning_not_a_crash(tmp_path):
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.dispatch import WinnerTable
    from autoflash.space import default_variant

    device = gpu_fingerprint()
    good = Problem("fwd", "float32", 32, False, 1, 64, 64)
    path = tmp_path / "w.db"
    store = Store(path)
    store.add_gpu(device)
    store.set_winner(gpu_key=device.key, problem=good, template_hash=codegen.template_hash("fwd"),
                     variant_json=default_variant("fwd", good, device).json(), median_ms=1.0, spread=0.0,
                     tflops=1.0, trials=1)
    store.db.execute("update winners set problem = 'fwd/float32/d32/full/g1/q0/k0', seqlen_q = 0, seqlen_k = 0")
    store.db.conn.commit()
    store.close()
    with pytest.warns(RuntimeWarning, match="rejected winner"):
        table = WinnerTable(device, [path])
    assert table.explain(Problem("fwd", "float32", 32, False, 1, 128, 128))[1] == "default"


# --------------------------------------------------------------------------- 4. store doors
def winner_row(**over) -> dict:
    from autoflash.space import load_space

    space = load_space("fwd")
    variant = next(space.all_variants()).json()
    row = {"gpu_key": GPU.key, "problem": PROBLEM.key, "template_hash": "t", "op": "fwd", "dtype": "float16",
           "head_dim": 64, "causal": 0, "gqa_group": 1, "seqlen_q": 64, "seqlen_k": 64, "variant": variant,
           "median_ms": 1.0, "spread": 0.01, "tflops": 1.0, "default_ms": 2.0, "sdpa_cudnn_ms": None,
           "sdpa_flash_ms": None, "trials": 3, "run_id": None, "shape": None, "updated_at": "then"}
    row.update(over)
    return {k: v for k, v in row.items() if v is not ...}


def export(*rows) -> dict:
    return {"format": "autoflash-winners", "schema_version": 1,
            "gpus": [{"gpu_key": GPU.key, **GPU.as_dict()}], "winners": list(rows)}


def second_problem(**over) -> dict:
    return winner_row(**{"problem": "fwd/float16/d64/full/g1/q128/k128", "seqlen_q": 128, "seqlen_k": 128, **over})


@pytest.mark.parametrize("bad, match", [
    ({"bogus": 1}, r"row 1 .*unknown column.*'bogus'"),
    ({"gpu_key": ...}, r"row 1.*'gpu_key' is missing"),
    ({"median_ms": "fast"}, r"row 1 .*'median_ms'.*finite number > 0.*'fast'"),
    ({"median_ms": -1.0}, r"row 1 .*'median_ms'"),
    ({"median_ms": float("nan")}, r"row 1 .*'median_ms'"),
    ({"median_ms": float("inf")}, r"row 1 .*'median_ms'"),
    ({"spread": -0.5}, r"row 1 .*'spread'"),
    ({"problem": "fwd/float16/d64/full/g1/q0/k0"}, r"row 1 .*'problem'.*seqlen_q"),
    ({"seqlen_q": 4096}, r"row 1 .*'seqlen_q'.*problem key"),
    ({"variant": "not json"}, r"row 1 .*'variant'"),
])
def test_import_validates_every_row_before_writing_anything(tmp_path, bad, match):
    store = Store(tmp_path / "a.db")
    before = store.counts()
    with pytest.raises(StoreError, match=match):
        store.import_winners(export(winner_row(), second_problem(**bad)))
    assert store.counts() == before  # row 0 was valid and still not written: all or nothing


def test_a_negative_median_does_not_win_later_conflicts(tmp_path):
    store = Store(tmp_path / "a.db")
    assert store.import_winners(export(winner_row(median_ms=2.0)))["added"] == 1
    with pytest.raises(StoreError):
        store.import_winners(export(winner_row(median_ms=-1.0)))
    assert store.import_winners(export(winner_row(median_ms=1.0)))["updated"] == 1
    assert store.winners()[0]["median_ms"] == 1.0


def test_merge_refuses_a_db_with_a_bad_row_and_writes_nothing(tmp_path):
    other = Store(tmp_path / "other.db")
    other.import_winners(export(winner_row(), second_problem()))
    other.db.execute("update winners set median_ms = -5 where problem = ?", [PROBLEM.key])
    other.db.conn.commit()
    other.close()
    mine = Store(tmp_path / "mine.db")
    with pytest.raises(StoreError, match="median_ms"):
        mine.merge_from(tmp_path / "other.db")
    assert mine.counts()["winners"] == 0 and mine.counts()["gpus"] == 0


def test_a_foreign_sqlite_file_is_refused_before_it_is_touched(tmp_path):
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("create table users (id integer primary key, name text)")
    con.execute("insert into users (name) values ('alice')")
    con.commit()
    con.close()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(StoreError, match="not an autoflash database"):
        Store(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]  # no -wal, no -shm
    con = sqlite3.connect(path)
    assert con.execute("pragma journal_mode").fetchone()[0] == "delete"
    assert [r[0] for r in con.execute("select name from sqlite_master where type = 'table'")] == ["users"]


def test_export_onto_its_own_source_file_is_refused(tmp_path):
    path = tmp_path / "a.db"
    store = Store(path)
    store.import_winners(export(winner_row()))
    run = store.start_run(GPU.key, "x")
    store.add_trial(run_id=run, gpu_key=GPU.key, problem=PROBLEM, template_hash="t", variant_json="{}",
                    status="ok", median_ms=1.0)
    with pytest.raises(StoreError, match="source database"):
        store.copy_winners_to(path)
    with pytest.raises(StoreError, match="source database"):
        store.copy_winners_to(tmp_path / "." / "a.db")
    assert store.counts()["trials"] == 1 and store.counts()["runs"] == 1
    assert store.copy_winners_to(tmp_path / "copy.db") == 1
    assert Store(tmp_path / "copy.db", readonly=True).counts()["winners"] == 1


def test_export_validates_rows_before_writing(tmp_path):
    store = Store(tmp_path / "a.db")
    store.import_winners(export(winner_row()))
    store.db.execute("update winners set median_ms = 'fast'")
    store.db.conn.commit()
    with pytest.raises(StoreError, match="median_ms"):
        store.copy_winners_to(tmp_path / "copy.db")
    assert not (tmp_path / "copy.db").exists() and not (tmp_path / "copy.db.partial").exists()


# --------------------------------------------------------------------------- 5. read-only WAL DBs
def wal_db_with_winner(path: pathlib.Path, device, problem: Problem) -> str:
    """A WAL-mode DB holding one winner for `problem` (a valid non-default variant); its JSON."""
    from autoflash import codegen
    from autoflash.space import default_variant, load_space

    default = default_variant("fwd", problem, device)
    valid = load_space("fwd").valid_variants(problem, device)
    variant = next((v for v in valid if v != default and v["LOADS"] == "pointers"), valid[0])
    store = Store(path)
    store.add_gpu(device)
    store.set_winner(gpu_key=device.key, problem=problem, template_hash=codegen.template_hash("fwd"),
                     variant_json=variant.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=1)
    store.close()
    con = sqlite3.connect(path)
    assert con.execute("pragma journal_mode").fetchone()[0] == "wal"
    con.close()
    return variant.json()


def read_winners_as_nobody(path: pathlib.Path) -> list:
    """Store(path, readonly=True).winners() in a forked child that cannot write (uid nobody when
    we are root: root ignores file modes)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            if ROOT:
                os.setgid(65534)
                os.setuid(65534)
            try:
                store = Store(path, readonly=True)
                out = {"rows": [row["problem"] for row in store.winners()]}
            except Exception as e:
                out = {"error": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_a_wal_db_on_a_read_only_file_and_dir_is_read(tmp_path):
    folder = pathlib.Path(tempfile.mkdtemp(prefix="autoflash-ro-", dir="/tmp"))  # reachable by 'nobody'
    try:
        path = folder / "ro.db"
        store = Store(path)
        store.import_winners(export(winner_row()))
        store.close()
        path.chmod(0o444)
        folder.chmod(0o555)
        assert read_winners_as_nobody(path) == {"rows": [PROBLEM.key]}
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_container_like_process_serves_a_read_only_wal_db(tmp_path):
    """HOME unusable (under a file), no XDG_CACHE_HOME, no AUTOFLASH_KERNEL_CACHE; AUTOFLASH_DB a
    read-only WAL DB with a winner for the call's problem: right answer, that winner served."""
    from autoflash.device import gpu_fingerprint

    env_probe = interp_env(tmp_path)
    device_key = last_json(run_python("import json; from autoflash.device import gpu_fingerprint as g; "
                                      "print(json.dumps({'key': g().key}))", env_probe))["key"]
    device = gpu_fingerprint()
    assert device.key == device_key
    problem = Problem("fwd", "float32", 32, False, 1, 64, 64)
    folder = tmp_path / "db"
    folder.mkdir()
    db = folder / "user.db"
    variant = wal_db_with_winner(db, device, problem)
    db.chmod(0o444)
    folder.chmod(0o555)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    env = interp_env(tmp_path, HOME=str(blocker / "home"), AUTOFLASH_DB=str(db))
    env.pop("XDG_CACHE_HOME", None)
    code = ATTENTION.replace("print(json.dumps({", f"""
from autoflash.dispatch import get_dispatcher
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
served, how, origin = get_dispatcher().winners(gpu_fingerprint()).explain(Problem.from_key({problem.key!r}))
print(json.dumps({{"how": how, "origin": origin, "variant": served.json() if served else None,""")
    try:
        result = last_json(run_python(code, env))
    finally:
        folder.chmod(0o755)
    assert result["err"] < 1e-4
    assert result["how"] == "exact" and result["origin"] == str(db) and result["variant"] == variant
    assert not any("ignoring results DB" in w for w in result["warnings"]), result["warnings"]


# --------------------------------------------------------------------------- 6. tuner integrity
def tiny_tune_setup(tmp_path):
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.shapes import load_shape_set

    shape = load_shape_set("tiny")[0]
    store = Store(tmp_path / "tune.db")
    device = gpu_fingerprint()
    store.add_gpu(device)
    return shape, store, device, codegen.template_hash("fwd")


def craft_trials(store, device, problem, thash, variants: list[str]) -> None:
    run = store.start_run(device.key, "crafted")
    for v in variants:
        store.add_trial(run_id=run, gpu_key=device.key, problem=problem, template_hash=thash, variant_json=v,
                        status="ok", median_ms=1e-9, tflops=1e9)
    store.finish_run(run, "finished", 1, len(variants))


@pytest.mark.interpreter
def test_crafted_undeclared_trials_never_become_the_winner(tmp_path):
    from autoflash.space import load_space
    from autoflash.tuning.tuner import TuneOptions
    from autoflash.tuning.workers import tune

    shape, store, device, thash = tiny_tune_setup(tmp_path)
    craft_trials(store, device, shape.problem, thash, ['{"BLOCK_M":7,"EVIL":"yes"}', '{"BLOCK_M":64}'])
    # (the crafted rows use up two of the trial budget: two more are really measured)
    [result] = tune([shape], store, TuneOptions(trials=4, interpret=True))
    assert result.status == "tuned"
    [row] = store.winners(device.key)
    load_space("fwd").check_declared(json.loads(row["variant"]))  # a declared variant, measured here
    assert row["median_ms"] > 1e-6


@pytest.mark.interpreter
def test_a_failed_remeasure_keeps_the_stored_winner_and_stores_nothing(tmp_path):
    from autoflash.space import default_variant, load_space
    from autoflash.tuning.tuner import TuneOptions
    from autoflash.tuning.workers import tune

    shape, store, device, thash = tiny_tune_setup(tmp_path)
    problem = shape.problem
    valid = load_space("fwd").valid_variants(problem, device)
    stored = next(v for v in valid if v != default_variant("fwd", problem, device))
    store.set_winner(gpu_key=device.key, problem=problem, template_hash=thash, variant_json=stored.json(),
                     median_ms=5.0, spread=0.0, tflops=1.0, trials=1)
    before = store.winners(device.key)
    craft_trials(store, device, problem, thash, ['{"BLOCK_M":7,"EVIL":"yes"}'])
    # A re-measure of a million interpreted rounds cannot finish within the trial timeout (each
    # candidate's own gate and timing, one call, does): the re-measure fails, for real.
    options = TuneOptions(trials=2, interpret=True, rounds=1_000_000, trial_timeout_s=40)
    [result] = tune([shape], store, options)
    assert result.status == "remeasure_failed", (result, store.trials_for(device.key, problem.key, thash))
    assert result.winner == stored
    assert store.winners(device.key) == before


# --------------------------------------------------------------------------- 7. stale journal lock
HOLD_LOCK = """
import sys, time
from autoflash.tuning.journal import JournalPidLock
lock = JournalPidLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.mark.interpreter
def _take_lock_and_die(code: str, journal: str) -> None:
    """A process that takes the journal's lock (prints 'locked') and is then killed with SIGKILL."""
    holder = subprocess.Popen([sys.executable, "-c", code, journal], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


def test_a_journal_lock_left_by_kill_9_does_not_stall_the_next_tune(tmp_path):
    from autoflash.tuning.journal import JOURNAL_LOCK_GRACE_S
    from autoflash.tuning.tuner import TuneOptions, optuna_storage_path
    from autoflash.tuning.workers import tune

    shape, store, device, thash = tiny_tune_setup(tmp_path)
    journal = optuna_storage_path(store.path)
    _take_lock_and_die(HOLD_LOCK, journal)
    lock = journal + ".lock"
    assert os.path.lexists(lock)  # what the killed process left behind
    gone_after = []

    def watch(t0):  # when the stale lock disappears (Optuna's own wait would take its 30 s grace)
        while os.path.lexists(lock) and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        gone_after.append(time.monotonic() - t0)

    t0 = time.monotonic()
    watcher = threading.Thread(target=watch, args=(t0,), daemon=True)
    watcher.start()
    [result] = tune([shape], store, TuneOptions(trials=2, interpret=True))
    watcher.join(130)
    assert result.status == "tuned"
    assert gone_after and gone_after[0] < JOURNAL_LOCK_GRACE_S / 2, f"the stale lock stood for {gone_after} s"
    assert not os.path.lexists(lock)


def test_optunas_own_symlink_lock_left_by_a_killed_run_is_cleared_after_its_grace(tmp_path):
    from autoflash.tuning.journal import JOURNAL_LOCK_GRACE_S, clear_stale_journal_lock, journal_backend

    journal = str(tmp_path / "a.db.optuna.journal")
    pathlib.Path(journal).touch()
    code = ("import sys, time, optuna\n"
            "optuna.storages.journal.JournalFileSymlinkLock(sys.argv[1]).acquire()\n"
            "print('locked', flush=True)\ntime.sleep(600)\n")
    _take_lock_and_die(code, journal)
    lock = journal + ".lock"
    assert os.path.islink(lock)
    assert not clear_stale_journal_lock(lock)  # fresh: it may be a live writer's (no pid to check)
    old = time.time() - JOURNAL_LOCK_GRACE_S - 5
    os.utime(lock, (old, old), follow_symlinks=False)
    backend = journal_backend(tmp_path / "a.db")
    assert not os.path.lexists(lock)
    t0 = time.monotonic()
    backend.append_logs([{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}])
    assert time.monotonic() - t0 < 5


def test_a_journal_lock_left_by_an_interrupt_in_this_process_is_cleared_at_once(tmp_path):
    """Ctrl-C between the lock's creation and Optuna's try/finally leaves a lock naming this very
    process: the next acquire (Optuna telling the interrupted trial FAIL) must not wait out the
    grace period for it, and a lock another live thread holds must still be respected."""
    from autoflash.tuning.journal import JournalPidLock, clear_stale_journal_lock

    journal = str(tmp_path / "a.db.optuna.journal")
    lock = JournalPidLock(journal)
    lock.acquire()
    from autoflash.tuning import journal as journal_module
    journal_module._HELD.pop(lock.lock_file)  # what an interrupt before the acquire's bookkeeping leaves
    assert os.path.exists(lock.lock_file)
    # stale now, by its owner (this process, no thread holding it), not by its age
    assert clear_stale_journal_lock(lock.lock_file, grace_s=10**6)
    assert not os.path.exists(lock.lock_file)
    assert JournalPidLock(journal).acquire()
    lock.release()

    held, release = threading.Event(), threading.Event()

    def hold():  # a live writer thread of this process holds the lock
        other = JournalPidLock(journal)
        other.acquire()
        held.set()
        release.wait(30)
        other.release()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(30)
        assert not clear_stale_journal_lock(lock.lock_file)  # not stale: its thread is alive
    finally:
        release.set()
        holder.join(30)
    assert not os.path.exists(lock.lock_file)
    assert [p.name for p in tmp_path.iterdir()] == []  # no owner file left behind


def test_a_journal_lock_taken_after_a_long_wait_is_new(tmp_path):
    """A lock taken after waiting out another host's stale lock must not look as old as the wait
    (others judge a lock of another host by its age): its file is made at the attempt that wins."""
    from autoflash.tuning.journal import JournalPidLock

    journal = str(tmp_path / "a.journal")
    foreign = pathlib.Path(journal + ".lock")
    foreign.write_text("another-host 12345\n")  # not checkable here: stale only once its grace has passed
    foreign_mtime = foreign.stat().st_mtime
    lock = JournalPidLock(journal, grace_s=1.0)
    lock.acquire()
    # the new lock's file dates from the attempt that won (after the foreign one went stale), not
    # from the start of the wait: file timestamps compared, no duration measured
    assert os.lstat(lock.lock_file).st_mtime >= foreign_mtime + 1.0
    checker = subprocess.run([sys.executable, "-c", "import sys\nfrom autoflash.tuning.journal import "
                              "clear_stale_journal_lock as c\nprint(c(sys.argv[1], 30.0))", lock.lock_file],
                             capture_output=True, text=True, check=True)
    assert checker.stdout.strip() == "False"  # another process on this host sees a live lock
    lock.release()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_threads_of_one_process_never_share_the_journal_lock(tmp_path):
    """Each thread with its own lock object on one journal: the critical sections never overlap."""
    from autoflash.tuning.journal import JournalPidLock

    journal = str(tmp_path / "a.journal")
    inside, overlaps, errors = [0], [], []

    def work():
        lock = JournalPidLock(journal)
        try:
            for _ in range(3000):
                lock.acquire()
                inside[0] += 1
                if inside[0] != 1:
                    overlaps.append(inside[0])
                inside[0] -= 1
                lock.release()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not overlaps and not errors, (overlaps[:5], errors[:3])
    assert [p.name for p in tmp_path.iterdir()] == []


def test_the_journal_lock_works_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    from autoflash.tuning.journal import JournalPidLock

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    lock = JournalPidLock(str(tmp_path / "a.journal"))
    assert lock.acquire()
    assert pathlib.Path(lock.lock_file).read_text().split() == [socket.gethostname(), str(os.getpid())]
    lock.release()
    assert [p.name for p in tmp_path.iterdir()] == []


def _sleep_then_ok(seconds):
    from autoflash.tuning.sandbox import Outcome

    time.sleep(seconds)
    return Outcome("ok")


def test_a_stopped_run_kills_its_compile_workers_instead_of_waiting_for_their_batch():
    """A tune stopped by Ctrl-C or SIGTERM closes its compile pool with now=True: the workers are
    killed at once, none is started again, and the batch in flight (minutes of compiling on a GPU
    host, here a 10-minute sleep) is abandoned instead of waited for."""
    from autoflash.tuning.sandbox import WorkerPool

    pool = WorkerPool(2, "cpu", {})
    pool.start(timeout_s=120)
    procs = [sb._proc for sb in pool._all]
    batch = pool.map_async(_sleep_then_ok, [(600,)] * 4, timeout_s=900)
    time.sleep(2)  # both workers are inside a task
    closer = threading.Thread(target=pool.close, kwargs={"now": True})
    closer.start()
    closer.join(timeout=60)  # a hang guard: without now=True, close waits out the whole batch
    assert not closer.is_alive()
    assert batch.done() and all(not p.is_alive() for p in procs)
    assert all(sb._proc is None for sb in pool._all)
