"""Every CLI input is validated: a user mistake is a one-line error naming the option, with a
non-zero exit code and never a traceback (issue "harden", CLI part)."""

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoflash.cli import cli


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_usage_error(r, option):
    """Non-zero exit, exactly one 'Error:' line and it names the option, no traceback."""
    assert r.exit_code not in (0, None), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, r.output
    assert option in errors[0], r.output


def test_tune_shapes_that_do_not_exist_or_are_not_toml(tmp_path):
    assert_usage_error(run("tune", "--interpret", "--db", tmp_path / "t.db", "--shapes", "nonexistent"), "--shapes")
    (tmp_path / "bad.toml").write_text("this is = [not toml\n")
    assert_usage_error(run("tune", "--interpret", "--db", tmp_path / "t.db", "--shapes", tmp_path / "bad.toml"),
                       "--shapes")
    (tmp_path / "partial.toml").write_text("[[shape]]\nbatch = 1\n")  # TOML, but no usable shape
    assert_usage_error(run("tune", "--interpret", "--db", tmp_path / "t.db", "--shapes", tmp_path / "partial.toml"),
                       "--shapes")
    assert_usage_error(run("which", "--interpret", "--shapes", "nonexistent"), "--shapes")
    assert_usage_error(run("bench", "--interpret", "--shapes", tmp_path / "bad.toml"), "--shapes")


@pytest.mark.parametrize("option,value", [("--budget", "0"), ("--budget", "-1"), ("--trials", "0"),
                                          ("--trials", "-5"), ("--workers", "-3"), ("--workers", "0"),
                                          ("--compile-workers", "0"), ("--compile-workers", "-2"),
                                          ("--rep-ms", "-1"), ("--rep-ms", "0"), ("--ops", "fwd,xyz")])
def test_tune_numbers_out_of_range(tmp_path, option, value):
    assert_usage_error(run("tune", "--interpret", "--db", tmp_path / "t.db", option, value), option)


def test_other_numbers_out_of_range(tmp_path):
    assert_usage_error(run("bench", "--interpret", "--rounds", "0"), "--rounds")
    assert_usage_error(run("search-quality", "--db", tmp_path / "missing.db"), "--db")
    assert_usage_error(run("db", "list", "--op", "xyz"), "--op")


@pytest.mark.parametrize("head_dim", ["0", "-8", "512"])
def test_render_and_space_refuse_impossible_head_dims(head_dim):
    assert_usage_error(run("render", "--head-dim", head_dim), "--head-dim")
    assert_usage_error(run("space", "--head-dim", head_dim), "--head-dim")


def test_render_fills_knobs_not_given_from_the_nearest_valid_variant():
    # The README's example: the d128 default's num_warps=8 does not fit BLOCK_M=64.
    r = CliRunner().invoke(cli, ["render", "--op", "fwd", "--variant", '{"BLOCK_M": 64, "LOADS": "pointer"}'])
    assert r.exit_code == 0, r.output
    assert '"BLOCK_M":64' in r.stdout and '"LOADS":"pointer"' in r.stdout  # (the header names the variant)
    compile(r.stdout, "<rendered>", "exec")
    assert "num_warps=4" in r.stderr  # says which knob it filled in away from the default
    # Knobs the user gave are never changed: a given combination no valid variant has is an error.
    r = run("render", "--variant", '{"BLOCK_M": 64, "num_warps": 8}')
    assert_usage_error(r, "--variant")
    assert "warps_vs_tile" in r.output


def test_db_export_to_a_missing_folder(tmp_path):
    from helpers import db_with_winners as _db_with_winners

    src = _db_with_winners(tmp_path / "src.db", n=1)
    for fmt in ("json", "csv", "sqlite"):
        r = run("db", "export", "--db", src, "--format", fmt, "-o", tmp_path / "missing" / "x.out")
        assert_usage_error(r, "--output")
    assert_usage_error(run("db", "plot", "--db", src, "-o", tmp_path / "missing" / "x.png"), "--output")
    assert_usage_error(run("tune", "--interpret", "--markdown", tmp_path / "missing" / "t.md"), "--markdown")


def test_a_locked_db_is_announced_instead_of_silence(tmp_path):
    from helpers import db_with_winners as _db_with_winners

    src = _db_with_winners(tmp_path / "src.db", n=1)
    out = tmp_path / "w.json"
    assert run("db", "export", "--db", src, "-o", out).exit_code == 0
    dst = _db_with_winners(tmp_path / "dst.db", n=0)
    holder = sqlite3.connect(dst, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing
    release = threading.Timer(1.5, holder.rollback)
    release.start()
    try:
        r = run("db", "import", out, "--db", dst)
    finally:
        release.join()
        holder.close()
    assert r.exit_code == 0, r.output
    assert "waiting for the DB lock" in r.output and "1 added" in " ".join(r.output.split())


def test_an_unusable_db_file_is_one_line(tmp_path):
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    r = run("db", "list", "--db", tmp_path / "junk.db")
    assert r.exit_code == 1 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    r = run("db", "import", tmp_path / "junk.db", "--db", tmp_path / "d.db")  # not JSON
    assert r.exit_code == 1 and "cannot import" in r.output and "Traceback" not in r.output


def test_ctrl_c_in_a_command_says_interrupted_and_exits_130(tmp_path):
    with mock.patch("autoflash.tuning.workers.tune", side_effect=KeyboardInterrupt):
        r = run("tune", "--interpret", "--db", tmp_path / "t.db", "--trials", "1")
    assert r.exit_code == 130 and "interrupted" in r.output and "Aborted" not in r.output


# `python -m autoflash` with Python's Ctrl-C handler installed: a test run started in the background
# by a non-interactive shell inherits SIGINT ignored, and Python then installs none (the tuner must
# see Ctrl-C as a terminal delivers it).
RUN_WITH_SIGINT = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "sys.argv[0] = 'autoflash'; runpy.run_module('autoflash', run_name='__main__', alter_sys=True)")


def test_sigint_during_a_real_tune_exits_130(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-c", RUN_WITH_SIGINT, "tune", "--interpret", "--trials", "200",
                             "--db", str(tmp_path / "t.db")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # wait until tuning has started
            lines.append(line)
            if "interpreter mode" in line or time.monotonic() > deadline:
                break
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "interrupted" in output and "Aborted" not in output and "Traceback" not in output


FINISHED_TRIALS = "select count(*) from trials where status not in ('running', 'pruned')"


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_during_a_real_tune_stops_it_like_ctrl_c(tmp_path, workers):
    """A scheduler's SIGTERM (sent to the tuner alone): exit 143, every worker's run marked
    interrupted, and the finished trials in the DB file itself: a copy of that one file (no -wal
    beside it) has them."""
    db = tmp_path / "t.db"
    log = tmp_path / "log.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "autoflash", "tune", "--interpret", "--trials", "200",
                                 "--workers", str(workers), "--db", str(db)], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        finished = running = 0
        deadline = time.monotonic() + 180
        # Until trials are stored and every worker is tuning (each has claimed a trial of its run).
        while (finished < 2 or running < workers) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            try:  # closed at once: the tuner, as the DB's last connection, folds the -wal into the file
                with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
                    finished = conn.execute(FINISHED_TRIALS).fetchone()[0]
                    running = conn.execute("select count(distinct run_id) from trials").fetchone()[0]
            except sqlite3.Error:  # not created yet
                pass
        assert finished >= 2 and running == workers, log.read_text()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 143, output
    assert "terminated" in output and "Traceback" not in output
    assert not db.with_name(db.name + "-wal").exists()
    alone = tmp_path / "copy.db"
    alone.write_bytes(db.read_bytes())
    with contextlib.closing(sqlite3.connect(alone)) as conn:
        assert conn.execute(FINISHED_TRIALS).fetchone()[0] >= finished
        assert [r[0] for r in conn.execute("select status from runs")] == ["interrupted"] * workers


# --------------------------------------------------------------------------- randomized
_numbers = st.one_of(st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                     st.text(max_size=8))
_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _assert_clean(r):
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    assert r.exit_code in (0, 1, 2), r.output
    if r.exit_code:
        assert "Error" in r.output


@_settings
@given(option=st.sampled_from(["--budget", "--trials", "--workers", "--compile-workers", "--rep-ms", "--seed",
                               "--ops", "--dtype", "--shapes"]), value=_numbers)
def test_random_tune_arguments_never_trace_back(tmp_path, option, value):
    with mock.patch("autoflash.tuning.workers.tune", return_value=[]), \
            mock.patch("autoflash.tuning.workers.tune_workers", return_value=([], [])):  # validation only, no tuning
        r = CliRunner().invoke(cli, ["tune", "--interpret", "--db", str(tmp_path / "t.db"), option, value])
    _assert_clean(r)


@_settings
@given(head_dim=_numbers, op=st.sampled_from(["fwd", "bwd", "xyz"]),
       variant=st.one_of(st.text(max_size=20),
                         st.dictionaries(st.sampled_from(["BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "LOADS", "x"]),
                                         st.one_of(st.sampled_from([16, 32, 64, 128, 8, "block_ptr", "pointer"]),
                                                   st.booleans(), st.none()), max_size=3).map(json.dumps)))
def test_random_render_arguments_never_trace_back(head_dim, op, variant):
    _assert_clean(CliRunner().invoke(cli, ["render", "--op", op, "--head-dim", head_dim, "--variant", variant]))


@_settings
@given(fmt=st.sampled_from(["json", "csv", "sqlite", "xml"]), op=st.sampled_from(["fwd", "bwd", "", "x"]),
       out=st.sampled_from(["-", "ok.json", "missing/x.json", ".", "", "ok.db"]),
       table=st.sampled_from(["winners", "trials", "gpus"]), db=st.sampled_from(["src.db", "missing.db", "."]))
def test_random_db_export_arguments_never_trace_back(tmp_path, fmt, op, out, table, db):
    from helpers import db_with_winners as _db_with_winners

    if not (tmp_path / "src.db").exists():
        _db_with_winners(tmp_path / "src.db", n=1)
    args = ["db", "export", "--db", str(tmp_path / db), "--format", fmt, "--op", op, "--table", table,
            "-o", out if out in ("-", "") else str(tmp_path / out)]
    _assert_clean(CliRunner().invoke(cli, args))
