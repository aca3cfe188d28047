"""Tuning workers on one Optuna storage (`autoflash tune --workers N --storage ...`): real worker
processes, a real PostgreSQL server (started here on the loopback, in a temp dir), real journal
files, real SQLite; kill -9 for real. The timing of the kill-and-join runs is a deterministic
function of the variant (the interpreter's timings are noise), injected like tests/test_tune.py's
hooks, so that their winners can be compared with a sequential pick over the same trials."""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
import zlib

import pytest

pytestmark = pytest.mark.interpreter

TESTS = str(pathlib.Path(__file__).parent)
TRIALS = 5  # per problem, in the kill-and-join runs
HOLD_AT = 4  # the evaluation (counted over all workers) that hangs until its worker is killed: a
# trial's (the first re-measure of a winner pick comes after some problem's TRIALS trials)
# Two problems: fewer than the workers, so that trials of one problem run in parallel too.
SHAPES = """
[[shape]]
batch = 1
heads_q = 2
heads_kv = 2
seqlen_q = 37
seqlen_k = 37
head_dim = 64
causal = true
dtype = "float16"

[[shape]]
batch = 1
heads_q = 2
heads_kv = 2
seqlen_q = 113
seqlen_k = 113
head_dim = 64
causal = false
dtype = "float16"
"""


# --------------------------------------------------------------------------- timing hooks
def det_ms(variant_json: str) -> float:
    return 1.0 + zlib.crc32(variant_json.encode()) % 100_000 / 100_000


def det_evaluate(variant_json, family, shape, rep_ms, device):
    """A candidate 'measured' as det_ms. With AUTOFLASH_TEST_HOLD set, the HOLD_AT-th evaluation
    writes who runs it to <hold>.held and hangs: the test kills that worker there."""
    from autoflash.tuning.sandbox import Outcome

    hold = os.environ.get("AUTOFLASH_TEST_HOLD")
    if hold:
        with open(hold + ".count", "a+") as f:
            f.seek(0)
            n = len(f.read())
            f.write("x")
        if n >= HOLD_AT:
            with contextlib.suppress(FileExistsError):
                with open(hold + ".held.tmp" + str(os.getpid()), "w") as f:
                    json.dump({"worker": os.getppid(), "sandbox": os.getpid(), "variant": variant_json,
                               "problem": shape.problem.key}, f)
                os.link(hold + ".held.tmp" + str(os.getpid()), hold + ".held")  # the first one only
                time.sleep(600)
    time.sleep(0.05)
    return Outcome("ok", ms=det_ms(variant_json), err=0.0, sdpa_err=0.0, seconds=0.05)


def det_remeasure(methods, op, shape, rounds, rep_ms, device_str):
    return {"status": "ok", "samples": {m: [det_ms(m.partition(":")[2])] * rounds for m in methods}}


# The CLI, with the hooks above in its options (as tests/test_tune.py passes them to tune()).
LAUNCH = """
import dataclasses, sys
import test_workers as hooks
from autoflash.tuning import workers
def hooked(options):
    return dataclasses.replace(options, evaluate_fn=hooks.det_evaluate, remeasure_fn=hooks.det_remeasure)
many, one = workers.tune_workers, workers.tune
workers.tune_workers = lambda shapes, db, options, *a, **k: many(shapes, db, hooked(options), *a, **k)
workers.tune = lambda shapes, store, options, *a, **k: one(shapes, store, hooked(options), *a, **k)
from autoflash.cli import main
sys.argv[0] = "autoflash"
main()
"""


# --------------------------------------------------------------------------- PostgreSQL
def _postgres_bin() -> str | None:
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(found)
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),  # apt-get install postgresql
                    key=lambda p: int(re.sub(r"\D", "", p.split("/")[4]) or 0))
    return os.path.dirname(debian[-1]) if debian else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server of this test run: initdb into a temp dir, on a free loopback port,
    stopped at the end. As root it runs as 'nobody' (PostgreSQL refuses root)."""
    bindir = _postgres_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL's initdb is not installed (.ci/run installs it)")
        pytest.skip("PostgreSQL's initdb/pg_ctl are not installed (apt-get install postgresql)")
    root = tempfile.mkdtemp(prefix="autoflash-pg-")  # not under pytest's 0700 dirs: its user must reach it
    as_user = []
    if os.geteuid() == 0:
        import pwd

        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
        runuser = shutil.which("runuser") or next(p for p in ("/usr/sbin/runuser", "/sbin/runuser") if os.path.exists(p))
        as_user = [runuser, "-u", "nobody", "--"]
    data, log = os.path.join(root, "data"), os.path.join(root, "server.log")
    subprocess.run(as_user + [f"{bindir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                              "-N"], check=True, capture_output=True, timeout=120)
    port = _free_port()
    started = subprocess.run(as_user + [f"{bindir}/pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "-o",
                                        f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c fsync=off "
                                        "-c max_connections=200", "start"], capture_output=True, text=True, timeout=90)
    assert started.returncode == 0, (started.stderr, pathlib.Path(log).read_text() if os.path.exists(log) else "")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(as_user + [f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "-w", "-t", "30", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server):
    """A fresh database of the session's server."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{postgres_server}/postgres", autocommit=True) as con:
        con.execute(f"create database {name}")
    return f"{postgres_server}/{name}"


# --------------------------------------------------------------------------- helpers
def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOFLASH_", "PYTEST_"))}
    env.update(TRITON_INTERPRET="1", PYTHONUNBUFFERED="1", COLUMNS="200", AUTOFLASH_HEARTBEAT_S="1",
               AUTOFLASH_KERNEL_CACHE=os.environ.get("AUTOFLASH_KERNEL_CACHE", str(tmp_path / "kernels")),
               AUTOFLASH_DB=str(tmp_path / "unused.db"), PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def _start(cmd: list, env: dict, log: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=log.parent)


def _open(storage: str):
    """The Optuna storage a test reads (a journal file, or a database URL)."""
    import optuna

    if "://" in storage:
        return optuna.storages.RDBStorage(storage)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))


def _trials(db) -> list[tuple]:
    return sqlite3.connect(db).execute("select problem, template_hash, variant, status from trials").fetchall()


def _studies(storage) -> tuple[dict, dict]:
    """{problem key: [trials of its search study]}, {problem key: [pick results]}."""
    searches, picks = collections.defaultdict(list), collections.defaultdict(list)
    for s in storage.get_all_studies():
        parts = s.study_name.split("|")
        if parts[0] == "autoflash-pick":
            picks[parts[-3]].append(storage.get_study_user_attrs(s._study_id).get("result"))
        else:  # '<gpu key>|<problem key>|<template hash>'
            searches[parts[-2]] += storage.get_all_trials(s._study_id)
    return searches, picks


# --------------------------------------------------------------------------- kill and join
@pytest.mark.parametrize("kind", ["journal", "postgresql"])
def test_three_workers_one_killed_another_joins_every_trial_once_and_the_sequential_winners(
        tmp_path, kind, request):
    from optuna.trial import TrialState

    storage = request.getfixturevalue("postgres_url") if kind == "postgresql" else str(tmp_path / "study.journal")
    db, hold, shapes = tmp_path / "host.db", str(tmp_path / "hold"), tmp_path / "shapes.toml"
    shapes.write_text(SHAPES)
    env = _env(tmp_path, AUTOFLASH_TEST_HOLD=hold)
    cmd = [sys.executable, "-c", LAUNCH, "tune", "--interpret", "--db", str(db), "--trials", str(TRIALS),
           "--storage", storage, "--shapes", str(shapes)]
    first = _start(cmd + ["--workers", "3"], env, tmp_path / "first.log")
    joiner = None
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(hold + ".held") and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(hold + ".held"), (tmp_path / "first.log").read_text()[-3000:]
        held = json.loads(pathlib.Path(hold + ".held").read_text())
        os.kill(held["worker"], signal.SIGKILL)  # mid-trial: the worker and its sandbox, no clean-up
        os.kill(held["sandbox"], signal.SIGKILL)
        joiner = _start(cmd + ["--workers", "1"], env, tmp_path / "joiner.log")
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
        assert joiner.wait(timeout=300) == 0, (tmp_path / "joiner.log").read_text()[-3000:]
    finally:
        for p in (first, joiner):
            if p is not None and p.poll() is None:
                p.kill()
    said = " ".join((tmp_path / "first.log").read_text().split())
    assert f"(pid {held['worker']}) was killed by signal 9" in said, said[-3000:]

    rows = _trials(db)
    assert not [r for r in rows if r[3] == "running"]  # every claim finished or freed
    keys = [r[:3] for r in rows]
    assert len(keys) == len(set(keys)), "a candidate was measured twice"
    per_problem = collections.Counter(r[0] for r in rows)
    assert len(per_problem) == 2 and all(TRIALS <= n <= TRIALS + 3 for n in per_problem.values()), per_problem
    searches, picks = _studies(_open(storage))
    story = "\n".join(f"{t.number} {t.state.name} {t.user_attrs} {t.system_attrs.get('retry_history')} "
                      f"{json.dumps(t.params, sort_keys=True, separators=(',', ':')) == held['variant']}"
                      for t in searches[held["problem"]])
    assert (held["problem"], held["variant"], "ok") in {(r[0], r[2], r[3]) for r in rows}, story  # not lost
    runs = sorted(r[0] for r in sqlite3.connect(db).execute("select status from runs"))
    assert runs == ["finished"] * 3 + ["interrupted"]  # the killed worker's run, marked by the others

    assert set(searches) == set(per_problem)
    for problem, trials in searches.items():
        measured = collections.Counter(json.dumps(t.params, sort_keys=True, separators=(",", ":"))
                                       for t in trials if "status" in t.user_attrs and t.state.is_finished())
        assert set(measured) == {r[2] for r in rows if r[0] == problem} and set(measured.values()) == {1}
        assert not [t for t in trials if t.state == TrialState.RUNNING]
    killed = [t for t in searches[held["problem"]] if t.params and json.dumps(
        t.params, sort_keys=True, separators=(",", ":")) == held["variant"]]
    original = [t for t in killed if t.user_attrs.get("worker") == f"{socket.gethostname()} {held['worker']}"]
    assert [t.state for t in original] == [TrialState.FAIL], killed  # the dead worker's trial was failed...
    retried = [t for t in killed if t.system_attrs.get("failed_trial") == original[0].number]
    # ...and tried again: measured once (two workers that reaped it at once queued it twice)
    assert [t.user_attrs.get("status") for t in retried if "status" in t.user_attrs] == ["ok"], story

    winners = dict(sqlite3.connect(db).execute("select problem, variant from winners"))
    assert set(winners) == set(per_problem)
    for problem, variant in winners.items():  # the sequential pick over the same trials
        assert variant == min((r[2] for r in rows if r[0] == problem and r[3] == "ok"), key=det_ms)
        assert [p["status"] for p in picks[problem] if p] == ["tuned"]  # picked by exactly one worker
    assert _sequential_winners(tmp_path, db, shapes) == winners


def _sequential_winners(tmp_path, db, shapes) -> dict:
    """One tuner, in this process, over a copy of the same trials (and nothing new to measure)."""
    from autoflash.shapes import load_shape_set
    from autoflash.store import Store
    from autoflash.tuning.tuner import TuneOptions
    from autoflash.tuning.workers import tune

    copy = Store(tmp_path / "sequential.db")
    rows = [{k: v for k, v in row.items() if k not in ("id", "run_id")} for row in Store(db).db["trials"].rows]
    copy.db["trials"].insert_all(rows)
    results = tune(load_shape_set(str(shapes)), copy, TuneOptions(trials=1, interpret=True, evaluate_fn=det_evaluate,
                                                             remeasure_fn=det_remeasure))
    assert copy.db["trials"].count == len(rows)
    return {r.problem.key: r.winner.json() for r in results}


# --------------------------------------------------------------------------- two hosts
def test_two_hosts_on_one_postgres_storage_share_the_trials_and_pick_each_winner_once(tmp_path, postgres_url):
    """Two 'hosts' (two results DBs) start the same command on the same storage, at once, with the
    real interpreted kernels: no candidate is measured on both, each problem's winner is picked by
    one of them (in its DB), and `autoflash db merge` gathers every winner into one DB."""
    env = _env(tmp_path)
    dbs, shapes = [tmp_path / "host-a.db", tmp_path / "host-b.db"], tmp_path / "shapes.toml"
    shapes.write_text(SHAPES)
    procs = [_start([sys.executable, "-m", "autoflash", "tune", "--interpret", "--trials", "3", "--workers", "1",
                     "--shapes", str(shapes), "--storage", postgres_url, "--db", str(db)], env,
                    tmp_path / f"{db.stem}.log") for db in dbs]
    for p, db in zip(procs, dbs):
        assert p.wait(timeout=400) == 0, (tmp_path / f"{db.stem}.log").read_text()[-3000:]
    said = " ".join((tmp_path / "host-b.log").read_text().split())
    assert "studies: postgresql://postgres@127.0.0.1" in said
    a, b = ({(r[0], r[2]) for r in _trials(db) if r[3] != "running"} for db in dbs)
    assert a and b and not a & b, "a candidate was measured on both hosts"
    winners = [dict(sqlite3.connect(db).execute("select problem, variant from winners")) for db in dbs]
    assert not set(winners[0]) & set(winners[1]) and len(winners[0]) + len(winners[1]) == 2
    _, picks = _studies(_open(postgres_url))
    assert sorted(len([p for p in results if p and p["status"] == "tuned"]) for results in picks.values()) == [1] * 2
    merged = subprocess.run([sys.executable, "-m", "autoflash", "db", "merge", str(dbs[1]), "--db", str(dbs[0])],
                            env=env, capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    assert dict(sqlite3.connect(dbs[0]).execute("select problem, variant from winners")) == {**winners[0], **winners[1]}


# --------------------------------------------------------------------------- the pieces
CLAIM_AND_HANG = """
import sys, time, optuna
from autoflash.tuning.picks import claim_pick
storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(sys.argv[1]))
claim, other = claim_pick(storage, "gpu", "fwd/p", "d")
print("claimed" if claim else "refused", flush=True)
time.sleep(600)
"""


def test_a_pick_is_claimed_once_and_taken_over_from_a_killed_holder(tmp_path):
    import optuna

    from autoflash.tuning.picks import claim_pick
    from autoflash.tuning.results import ProblemResult
    from autoflash.tuning.storage import worker_id

    journal = str(tmp_path / "picks.journal")
    holder = subprocess.Popen([sys.executable, "-c", CLAIM_AND_HANG, journal], stdout=subprocess.PIPE, text=True,
                              env=_env(tmp_path))
    try:
        assert holder.stdout.readline().strip() == "claimed"
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(journal))
        claim, other = claim_pick(storage, "gpu", "fwd/p", "d")
        assert claim is None and other == {"status": "picking", "by": f"{socket.gethostname()} {holder.pid}"}
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    claim, _ = claim_pick(storage, "gpu", "fwd/p", "d")  # its holder died mid-pick: taken over
    assert claim is not None and claim.name.endswith("|d|1")
    claim.finish(ProblemResult(None, None, None, {"tuned": 2.0}, 0.01, 3, 0, "tuned"))
    again, said = claim_pick(storage, "gpu", "fwd/p", "d")  # the same trials again: nothing to pick
    assert again is None and said["status"] == "tuned" and said["by"] == worker_id() and said["ms"] == {"tuned": 2.0}
    fresh, _ = claim_pick(storage, "gpu", "fwd/p", "more-trials")  # more trials: a new pick
    assert fresh is not None
    fresh.abandon()


def test_a_storage_that_cannot_be_used_is_one_line(tmp_path):
    from click.testing import CliRunner

    from autoflash.cli import cli

    port = _free_port()  # nothing listens there
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--db", str(tmp_path / "t.db"), "--storage",
                                 f"postgresql://user:secret@127.0.0.1:{port}/x"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    text = " ".join(r.output.split())
    assert f"cannot open the Optuna storage postgresql://user:***@127.0.0.1:{port}/x" in text and "secret" not in text
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--db", str(tmp_path / "t.db"), "--storage",
                                 str(tmp_path / "no-such-dir" / "s.journal")])
    assert r.exit_code == 1 and "cannot use the journal file" in " ".join(r.output.split())
