"""The tuner end to end in Triton's interpreter: a real Optuna study, real worker processes, a
real SQLite file. Faults (a candidate that raises, hangs, or kills its worker) are injected
through the tuner's evaluate hook; kill -9 of a whole tune process is done for real."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import zlib

import pytest
from click.testing import CliRunner

from autoflash.tuning import gate, sandbox
from autoflash.cli import cli
from autoflash.space import default_variant
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem, Shape
from autoflash.shapes import load_shape_set
from autoflash.space import load_space
from autoflash.store import Store
from autoflash.tuning.search_quality import replay_search
from autoflash.tuning.tuner import TuneOptions
from autoflash.tuning.workers import tune

pytestmark = pytest.mark.interpreter

TINY = Shape(1, 2, 2, 37, 37, 64, True, "float16")


def faulty_evaluate(variant_json, op, shape, rep_ms, device):
    """The first three candidates misbehave (raise, hang, kill the worker); the rest are real."""
    counter = os.environ["AUTOFLASH_TEST_COUNTER"]
    with open(counter, "a+") as f:
        f.seek(0)
        n = len(f.read())
        f.write("x")
    if n == 0:
        raise RuntimeError("injected: candidate raised")
    if n == 1:
        time.sleep(600)  # injected hang: the per-trial timeout must end it
    if n == 2:
        os._exit(7)  # injected: the worker process dies
    return sandbox.evaluate_variant(variant_json, op, shape, rep_ms, device)


def test_tune_interpret_cli_end_to_end(tmp_path):
    db = tmp_path / "t.db"
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--db", str(db), "--trials", "3"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "interpreter mode" in text and "Real tuning needs a CUDA GPU" in text
    assert "reached the time budget" not in text  # every problem got its 3 trials
    out = subprocess.run([sys.executable, "-m", "sqlite_utils", "tables", str(db), "--counts"],
                         capture_output=True, text=True, check=True).stdout
    counts = {t["table"]: t["count"] for t in json.loads(out)}
    assert counts["winners"] == len(load_shape_set("tiny")) and counts["trials"] == 3 * counts["winners"]
    store = Store(db)
    for w in store.winners():
        problem = Problem.from_key(w["problem"])
        load_space("fwd").validate(json.loads(w["variant"]), problem, gpu_fingerprint())  # valid by construction
    assert all(row["status"] == "ok" and row["err"] is not None for row in store.db["trials"].rows)


def test_tune_cli_says_when_the_budget_cut_searches_short(tmp_path):
    shapes = tmp_path / "one.toml"
    shapes.write_text("[[shape]]\nbatch = 1\nheads_q = 2\nheads_kv = 2\nseqlen_q = 37\nseqlen_k = 37\n"
                      "head_dim = 32\ncausal = true\ndtype = \"float16\"\n")
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--db", str(tmp_path / "t.db"), "--shapes", str(shapes),
                                 "--trials", "500", "--budget", "0.1"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "1 of 1 problems reached the time budget before 500 measured candidates" in text
    assert "larger --budget continues them" in text


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tune_cli_says_when_the_budget_is_below_what_every_problem_needs(tmp_path, workers):
    """A budget smaller than the passes every problem gets (here 0.6 s for two problems) is overrun by
    them: the run says so when it starts (once, with several workers too) and still stores a winner
    for each problem."""
    shapes = tmp_path / "two.toml"
    shapes.write_text("".join(f"[[shape]]\nbatch = 1\nheads_q = 2\nseqlen_q = {n}\nseqlen_k = {n}\n"
                              "head_dim = 32\ncausal = true\ndtype = \"float16\"\n" for n in (37, 100)))  # (two buckets: q64, q128)
    db = tmp_path / "t.db"
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--db", str(db), "--shapes", str(shapes),
                                 "--trials", "3", "--budget", "0.01", "--workers", workers], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert text.count("The budget of 0:01 is below what every problem's vendor pass, seed and pick") == 1
    store = Store(db)
    assert len(store.winners()) == 2
    store.close()


def test_tune_without_gpu_says_a_gpu_is_needed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # stands in for "no usable CUDA" on any machine
    r = CliRunner().invoke(cli, ["tune"])
    text = " ".join(r.output.split())
    assert r.exit_code != 0 and "needs a CUDA GPU" in text and "--interpret" in text


def test_faults_are_recorded_and_the_run_still_stores_a_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_TEST_COUNTER", str(tmp_path / "counter"))
    store = Store(tmp_path / "t.db")
    # (a trial that hangs waits for the timeout; a generous one keeps a loaded machine from timing out the rest)
    options = TuneOptions(trials=6, interpret=True, trial_timeout_s=20, evaluate_fn=faulty_evaluate)
    (result,) = tune([TINY], store, options)
    statuses = [r["status"] for r in store.db["trials"].rows_where(order_by="id")]
    assert statuses[:3] == ["runtime_error", "timeout", "crashed"], statuses
    assert statuses[3:] == ["ok"] * 3
    messages = [r["message"] for r in store.db["trials"].rows_where(order_by="id")]
    assert "injected: candidate raised" in messages[0] and "exit code 7" in messages[2]
    assert result.status == "tuned" and result.failed == 3
    assert store.db["winners"].count == 1
    assert list(store.db["runs"].rows)[0]["status"] == "finished"


def tiny_default():
    device = gpu_fingerprint()
    return default_variant("fwd", TINY.problem, device)


def wrong_default(variant_json, op, shape, rep_ms, device):
    """The default variant (always the first candidate) gets its output corrupted by 1%."""
    if variant_json != tiny_default().json():
        return sandbox.evaluate_variant(variant_json, op, shape, rep_ms, device)
    real_run = gate.run_variant

    def corrupted(*args, **kwargs):
        out, lse = real_run(*args, **kwargs)
        return out * 1.01, lse
    gate.run_variant = corrupted
    try:
        return sandbox.evaluate_variant(variant_json, op, shape, rep_ms, device)
    finally:
        gate.run_variant = real_run


def test_a_wrong_kernel_is_recorded_and_never_wins(tmp_path):
    store = Store(tmp_path / "t.db")
    (result,) = tune([TINY], store, TuneOptions(trials=4, interpret=True, evaluate_fn=wrong_default))
    rows = {r["variant"]: r for r in store.db["trials"].rows}
    bad = rows[tiny_default().json()]
    assert bad["status"] == "wrong" and "wrong result" in bad["message"] and bad["median_ms"] is None
    assert result.winner is not None and result.winner != tiny_default()
    assert store.winners()[0]["variant"] != tiny_default().json()


def test_resume_after_kill_9(tmp_path):
    db = tmp_path / "t.db"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "autoflash", "tune", "--interpret", "--db", str(db), "--trials", "5"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    seen = 0
    while time.time() < deadline and seen < 7:
        time.sleep(0.2)
        if db.exists():
            try:
                seen = sqlite3.connect(db).execute("select count(*) from trials where status != 'running'").fetchone()[0]
            except sqlite3.OperationalError:
                pass
    assert proc.poll() is None, "the tune finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the tuner and its workers, no chance to clean up
    proc.wait()
    # (claims the kill left unfinished are freed for the next run: only finished trials count)
    before = sqlite3.connect(db).execute("select id, problem, variant from trials where status != 'running'").fetchall()
    assert len(before) >= 7
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    con = sqlite3.connect(db)
    after = con.execute("select id, problem, variant from trials").fetchall()
    assert set(before) <= set(after)  # finished trials kept
    pairs = [(p, v) for _, p, v in after]
    assert len(pairs) == len(set(pairs))  # none repeated
    assert len(after) == 5 * 4  # and the budget completed, not restarted
    assert con.execute("select count(*) from winners").fetchone()[0] == 4
    # The killed run is marked as such when the next tune starts, not left 'running' forever.
    assert [r[0] for r in con.execute("select status from runs order by id")] == ["interrupted", "finished"]


# Kills the tune's process group right after its Nth trial reached SQLite, before Optuna's study
# heard of it: the narrowest window of a kill -9, made certain instead of left to chance.
KILL_AFTER_NTH_TRIAL = """
import os, signal, sys
from autoflash.store import Store
from autoflash.cli import cli
finish, calls = Store.finish_trial, []
def finish_then_die(self, *args, **kwargs):
    finish(self, *args, **kwargs)
    calls.append(1)
    if len(calls) == int(sys.argv[1]):
        os.killpg(0, signal.SIGKILL)
Store.finish_trial = finish_then_die
cli(sys.argv[2:])
"""


def test_a_trial_stored_but_not_told_before_kill_9_counts_once(tmp_path):
    """A trial in the DB whose study still holds it RUNNING (killed between the two writes) is
    queued again by the study on resume; it is answered from the DB and counted once, so the
    resumed run measures the whole budget (it used to end one trial short: 19 of 20)."""
    db = tmp_path / "t.db"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = ["tune", "--interpret", "--db", str(db), "--trials", "5"]
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_NTH_TRIAL, "3", *args], env=env,
                            capture_output=True, start_new_session=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert sqlite3.connect(db).execute("select count(*) from trials where status = 'ok'").fetchone()[0] == 3
    subprocess.run([sys.executable, "-m", "autoflash", *args], env=env, check=True, capture_output=True, timeout=300)
    con = sqlite3.connect(db)
    per_problem = dict(con.execute("select problem, count(*) from trials group by problem").fetchall())
    assert sorted(per_problem.values()) == [5, 5, 5, 5]
    assert con.execute("select count(*) from winners").fetchone()[0] == 4


def test_a_resumed_step_whose_one_candidate_was_stored_but_not_told_measures_a_new_one(tmp_path):
    """Killed between the two writes of a problem's first trial (its only seed): the resumed run's
    seed step asks for one candidate and gets that trial, queued again by the study and answered
    from the DB. The step takes a new candidate in its place; it used to end having measured none,
    taken for an exhausted search, and the run stopped at 1 trial of 3."""
    shapes = tmp_path / "one.toml"
    shapes.write_text("[[shape]]\nbatch = 1\nheads_q = 2\nheads_kv = 2\nseqlen_q = 37\nseqlen_k = 37\n"
                      "head_dim = 64\ncausal = false\ndtype = \"float16\"\n")
    db = tmp_path / "t.db"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = ["tune", "--interpret", "--db", str(db), "--shapes", str(shapes), "--trials", "3"]
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_NTH_TRIAL, "1", *args], env=env,
                            capture_output=True, start_new_session=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert sqlite3.connect(db).execute("select count(*) from trials where status = 'ok'").fetchone()[0] == 1
    subprocess.run([sys.executable, "-m", "autoflash", *args], env=env, check=True, capture_output=True, timeout=300)
    con = sqlite3.connect(db)
    rows = con.execute("select variant, status from trials").fetchall()
    assert len(rows) == 3 and len({v for v, _ in rows}) == 3 and all(s == "ok" for _, s in rows)
    assert con.execute("select count(*) from winners").fetchone()[0] == 1


def test_replay_search_learns_a_structured_objective():
    """Against a recorded table with structure, the tuner's sampler finds a near-best variant
    in a small fraction of the space."""
    problem, device = TINY.problem, gpu_fingerprint()
    valid = load_space("fwd").valid_variants(problem, device)

    def ms(v):
        noise = (zlib.crc32(v.json().encode()) % 1000) / 1e5  # deterministic across processes
        return (1.0 + 0.5 * (v["BLOCK_N"] != 64) + 0.3 * (v["LOADS"] != "tma") + 0.2 * (v["num_warps"] != 8)
                + 0.1 * (v["GRID_ORDER"] != "m_major") + noise)
    table = {v.json(): ms(v) for v in valid}
    best = min(table.values())
    seq = replay_search(table, problem, device, trials=60, seed=0)
    assert len(seq) == 60
    assert min(seq) <= 1.05 * best, (min(seq), best, len(valid))


def test_backward_tuning_in_the_interpreter(tmp_path):
    """op bwd: the gradient gate runs for every candidate and winners are stored under bwd keys."""
    store = Store(tmp_path / "t.db")
    shape = Shape(1, 4, 2, 45, 45, 64, True, "float16", op="bwd")
    (result,) = tune([shape], store, TuneOptions(trials=3, interpret=True))
    assert result.status == "tuned" and result.problem.op == "bwd" and not result.cut_short
    rows = list(store.db["trials"].rows)
    assert len(rows) == 3 and all(r["status"] == "ok" and r["err"] is not None for r in rows)
    assert store.winners(op="bwd")[0]["problem"].startswith("bwd/float16/d64/causal/g2/")


def test_global_budget_is_shared_and_respected(tmp_path):
    """A budget far too small to exhaust the space: every problem still gets its share and a
    winner, and each stops well before its (large) trial budget."""
    store = Store(tmp_path / "t.db")
    shapes = load_shape_set("tiny")
    ticks = iter(range(10**9))
    # A clock that advances 0.1 "s" each time the tuner looks: the budget's arithmetic, not this
    # machine's speed, decides how far each problem gets.
    results = tune(shapes, store, TuneOptions(trials=1000, budget_s=8, interpret=True,
                                              clock=lambda: next(ticks) * 0.1))
    assert [r.status for r in results] == ["tuned"] * len(shapes)
    for r in results:
        assert 1 <= r.measured < len(load_space("fwd").valid_variants(r.problem, gpu_fingerprint()))
        assert r.cut_short  # and the result says so (the CLI tells the user to raise --budget)


def test_winner_of_an_earlier_template_seeds_the_search(tmp_path):
    """After a template edit the old winner is retired but measured first again (a warm start);
    a knob the old template lacked takes the default's value."""
    store = Store(tmp_path / "t.db")
    gpu_key = store.add_gpu(gpu_fingerprint())
    old = dict(tiny_default().as_dict(), BLOCK_N=32 if tiny_default()["BLOCK_N"] != 32 else 64, num_stages=2)
    del old["GRID_ORDER"]  # say the earlier template had no such knob
    store.set_winner(gpu_key=gpu_key, problem=TINY.problem, template_hash="0123456789abcdef",
                     variant_json=json.dumps(old), median_ms=1.0, spread=0.0, tflops=1.0, trials=1)
    tune([TINY], store, TuneOptions(trials=16, interpret=True))
    tried = [json.loads(r["variant"]) for r in store.db["trials"].rows_where(order_by="id")]
    carried = dict(old, GRID_ORDER=tiny_default()["GRID_ORDER"])
    assert tried[0] == tiny_default().as_dict() and tried[1] == carried
    # TINY is causal: the same two with their heaviest programs first come next.
    assert tried[2:4] == [dict(tiny_default().as_dict(), GRID_ORDER="heavy_first"), dict(carried, GRID_ORDER="heavy_first")]


def test_vendor_candidates_are_all_measured_beside_the_trial_budget(tmp_path, monkeypatch):
    """Every torch SDPA backend this device offers is measured before the own families' search and
    outside its trial budget: a short search must not store an own kernel slower than SDPA because
    it never timed SDPA. (Vendor kernels sit out interpreted runs, where they would beat every
    interpreted kernel: let them compete here to see the order.)"""
    from autoflash import codegen
    from autoflash.tuning import tuner

    monkeypatch.setattr(tuner, "competes", lambda family, interpret: True)
    store = Store(tmp_path / "t.db")
    shape = Shape(1, 2, 2, 37, 37, 32, True, "float32")
    (result,) = tune([shape], store, TuneOptions(trials=1, interpret=True))
    rows = list(store.db["trials"].rows)
    vendor = [r for r in rows if r["template_hash"] == codegen.template_hash("sdpa_fwd")]
    offered = load_space("sdpa_fwd").valid_variants(shape.problem, gpu_fingerprint())
    assert sorted(json.loads(r["variant"])["BACKEND"] for r in vendor) == sorted(v["BACKEND"] for v in offered)
    # (measured all; one clearly slower than the best so far is stopped before its gate: 'slower')
    assert all(r["status"] in ("ok", "slower") and r["median_ms"] > 0 for r in vendor)
    assert vendor[0]["status"] == "ok"  # the first, with no best to stop it at: gated and timed in full
    own = [r for r in rows if r not in vendor]
    assert 1 <= len(own) <= 2  # the trial budget, split between the own families that have valid variants
    assert result.status == "tuned" and not result.cut_short


def test_a_knob_the_earlier_template_lacked_takes_its_legacy_value():
    """GQA_SPLIT came after winners were stored: such a winner is the unsplit kernel, so it is
    seeded with GQA_SPLIT = 1 (the space's [legacy] value), not the split today's default picks
    for a long sequence with a large group and little parallel work."""
    from autoflash import codegen
    from autoflash.tuning.seeds import seed_variants

    device = gpu_fingerprint()
    problem = Problem("bwd", "float16", 64, True, 8, 8192, 8192, work=2)
    default = default_variant("bwd", problem, device)
    assert default["GQA_SPLIT"] == 8
    old = {k: v for k, v in default.as_dict().items() if k != "GQA_SPLIT"}
    old["num_stages"] = 2 if default["num_stages"] != 2 else 3
    row = dict(problem=problem.key, template_hash="0123456789abcdef", variant=json.dumps(old), op="bwd",
               head_dim=64, dtype="float16")
    seeds = [s.as_dict() for s in seed_variants(default, problem, device, codegen.template_hash("triton_bwd"), [row], 40)]
    assert dict(old, GQA_SPLIT=1) in seeds and dict(old, GQA_SPLIT=8) not in seeds


def test_a_stored_backward_winner_is_seeded_with_its_dq_overlap_twin():
    """On a GPU a short backward search measures the stored winner and then the same kernels with
    the other DQ_OVERLAP (the dQ kernel beside the dK/dV kernel, or after it), before the default;
    the interpreter (no streams) gets no such twin."""
    import dataclasses

    from autoflash import codegen
    from autoflash.tuning.seeds import seed_variants

    from autoflash.device import INTERPRETER_NAME

    h200 = dataclasses.replace(gpu_fingerprint(), name="NVIDIA H200", cc_major=9, cc_minor=0, smem_per_block=232448)
    interpreter = dataclasses.replace(h200, name=INTERPRETER_NAME)
    problem = Problem("bwd", "bfloat16", 128, True, 4, 2048, 2048, work=3)
    space, thash = load_space("triton_bwd"), codegen.template_hash("triton_bwd")
    for device, twins in ((h200, 1), (interpreter, 0)):
        default = default_variant("bwd", problem, device)
        stored = space.nearest_valid(default.replace(DQ_OVERLAP="serial", GRID_ORDER="heavy_first", num_stages=3),
                                     problem, device)
        row = dict(problem=problem.key, template_hash=thash, variant=stored.json(), op="bwd", head_dim=128,
                   dtype="bfloat16", gpu_key=device.key)
        seeds = seed_variants(default, problem, device, thash, [row], 8)
        assert seeds[0] == stored
        if twins:
            assert seeds[1] == stored.replace(DQ_OVERLAP="concurrent") and default["DQ_OVERLAP"] == "concurrent"
        else:
            assert all(s["DQ_OVERLAP"] == "serial" for s in seeds) and seeds[1] == default


def report_training_forward(variant_json, family, shape, rep_ms, device):
    """A real evaluation, whose message says which forward the backward candidates were timed after."""
    from autoflash.tuning import gate

    outcome = sandbox.evaluate_variant(variant_json, family, shape, rep_ms, device)
    forward = gate.training_forward
    outcome.message = json.dumps(forward and [forward.family, forward.json()])
    return outcome


def test_backward_candidates_are_timed_after_the_stored_forward_winner(tmp_path):
    """A training step serves an own backward with the own forward winner of its shape, so the
    backward's candidates (and the own/vendor decision) are timed after that forward, not after the
    forward default; with no forward stored, after the default."""
    fwd = Shape(1, 2, 2, 37, 37, 64, True, "float16")
    bwd = Shape(1, 2, 2, 37, 37, 64, True, "float16", op="bwd")
    options = TuneOptions(trials=2, interpret=True, evaluate_fn=report_training_forward)

    def forwards_seen(store):
        rows = [t for t in store.db["trials"].rows_where("problem = ? and status = 'ok'", [bwd.problem.key])]
        assert rows
        return {r["message"] for r in rows}

    alone = Store(tmp_path / "alone.db")
    tune([bwd], alone, options)  # no forward winner stored: the default times them
    assert forwards_seen(alone) == {"null"}

    both = Store(tmp_path / "both.db")
    (fwd_result,) = tune([fwd], both, TuneOptions(trials=2, interpret=True))
    tune([bwd], both, options)
    assert forwards_seen(both) == {json.dumps([fwd_result.winner.family, fwd_result.winner.json()])}


def test_a_given_forward_variant_gives_the_backward_its_output():
    from autoflash import codegen
    from autoflash.reference import make_inputs

    fwd = Shape(1, 2, 2, 37, 37, 64, True, "float16")
    q, k, v = make_inputs(fwd, "cpu", seed=1)
    default = default_variant("fwd", fwd.problem, gpu_fingerprint())
    other = next(variant for variant in load_space(default.family).valid_variants(fwd.problem, gpu_fingerprint())
                 if variant != default)
    assert gate.forward_kernel_for_backward(q, k, v, True, other) is codegen.load(other)
    assert gate.forward_kernel_for_backward(q, k, v, True) is codegen.load(default)


def test_a_sampler_stuck_on_known_variants_still_spends_the_budget(tmp_path, monkeypatch):
    """A sampler that keeps proposing measured (or invalid) variants (TPE concentrated on a small
    good region, or a resumed study) must not end the search short of its trial budget: the tuner
    hands it unmeasured valid variants. Here a real Optuna sampler that only ever proposes the default."""
    import optuna

    from autoflash.tuning import tuner

    shape = Shape(1, 2, 2, 37, 37, 32, True, "float32")
    default = default_variant("fwd", shape.problem, gpu_fingerprint())
    monkeypatch.setattr(tuner, "make_sampler", lambda seed, trials: optuna.samplers.PartialFixedSampler(
        default.as_dict(), optuna.samplers.RandomSampler(seed=seed)))
    store = Store(tmp_path / "t.db")
    tune([shape], store, TuneOptions(trials=5, interpret=True))
    measured = [r["variant"] for r in store.db["trials"].rows if r["status"] != "pruned"]
    assert len(measured) == 5 and len(set(measured)) == 5
    store.close()
