"""CLI commands through click's CliRunner (and one real subprocess for `python -m autoflash`)."""

import json
import os
import subprocess
import sys

import pytest

from click.testing import CliRunner

from autoflash.cli import cli
from autoflash.store import SCHEMA_VERSION
from helpers import db_with_winners as _db_with_winners


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_space_prints_axes_and_counts():
    r = invoke("space", "--op", "fwd", "--head-dim", "64", "--causal")
    assert r.exit_code == 0
    assert "BLOCK_M" in r.output and "WARP_SPECIALIZE" in r.output
    assert "variants before constraints: 5184" in r.output
    after = int(r.output.rsplit("after:", 1)[1].split()[0])
    assert 0 < after < 2592


def test_space_list_is_json_lines():
    r = invoke("space", "--list", "--head-dim", "128")
    lines = r.output.strip().splitlines()
    assert len(lines) > 10
    assert {"BLOCK_M", "LOADS"} <= set(json.loads(lines[0]))


def test_render_prints_source():
    r = invoke("render", "--op", "fwd", "--variant", '{"BLOCK_M": 64, "num_warps": 4, "LOADS": "pointer"}')
    assert r.exit_code == 0
    assert "@triton.jit" in r.output and '"BLOCK_M":64' in r.output and '"LOADS":"pointer"' in r.output
    compile(r.output, "<rendered>", "exec")


def test_render_takes_the_gqa_group_a_split_needs():
    """GQA_SPLIT is valid for a GQA group of at least its size: --gqa-group sets the problem's."""
    r = invoke("render", "--op", "bwd", "--gqa-group", "4", "--variant", '{"GQA_SPLIT": 4}')
    assert '"GQA_SPLIT":4' in r.output and "def _bwd_gqa_reduce" in r.output
    compile(r.output, "<rendered>", "exec")
    r = CliRunner().invoke(cli, ["render", "--op", "bwd", "--variant", '{"GQA_SPLIT": 4}'])
    assert r.exit_code != 0 and "gqa_split_within_group" in r.output


def test_render_names_the_violated_constraint():
    r = CliRunner().invoke(cli, ["render", "--variant", '{"BLOCK_M": 64, "num_warps": 8}'])
    assert r.exit_code != 0 and "warps_vs_tile" in r.output
    r = CliRunner().invoke(cli, ["render", "--variant", '{"BLOCK_M": 96}'])
    assert r.exit_code != 0 and "not a declared choice" in r.output
    r = CliRunner().invoke(cli, ["render", "--variant", "not json"])
    assert r.exit_code != 0 and "not valid JSON" in r.output


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "autoflash", "space", "--head-dim", "80"],
                         capture_output=True, text=True, check=True)
    assert "after:" in out.stdout


def test_info_reports_fingerprint_and_db_paths():
    r = invoke("info")
    assert r.exit_code == 0
    text = " ".join(r.output.split())
    assert "template hash" in text and "user DB" in text and "winners that apply here" in text


def test_db_path_and_list(tmp_path, monkeypatch):
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem
    from autoflash.store import Store

    db = tmp_path / "x.db"
    monkeypatch.setenv("AUTOFLASH_DB", str(db))
    assert invoke("db", "path").output.strip() == str(db)
    store = Store(db)
    dev = gpu_fingerprint()
    store.add_gpu(dev)
    for d in (64, 128):
        store.set_winner(gpu_key=dev.key, problem=Problem("fwd", "float16", d, False, 1, 64, 64), template_hash="t",
                         variant_json='{"BLOCK_M": 64, "BLOCK_N": 32}', median_ms=1.0, spread=0.0, tflops=2.0, trials=3)
    store.close()
    r = invoke("db", "list", "--head-dim", "128")
    assert r.exit_code == 0 and "1 winner(s)" in r.output
    assert "2 winner(s)" in invoke("db", "list").output
    r = CliRunner().invoke(cli, ["db", "list", "--db", str(tmp_path / "missing.db")])
    assert r.exit_code != 0 and "no database" in r.output


def test_search_quality_on_a_recorded_sweep(tmp_path, monkeypatch):
    import autoflash.cli

    monkeypatch.setattr(autoflash.cli.console, "width", 200)
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem
    from autoflash.space import load_space
    from autoflash.store import Store

    dev = gpu_fingerprint()
    prob = Problem("fwd", "float16", 256, False, 1, 2048, 2048)
    store = Store(tmp_path / "sweep.db")
    store.add_gpu(dev)
    run = store.start_run(dev.key, "sweep")
    for i, v in enumerate(load_space("fwd").valid_variants(prob, dev)):
        store.add_trial(run_id=run, gpu_key=dev.key, problem=prob, template_hash="t", variant_json=v.json(),
                        status="ok", median_ms=1.0 + 0.5 * (v["BLOCK_N"] != 64) + (i % 7) / 100)
    store.close()
    r = CliRunner().invoke(cli, ["search-quality", "--db", str(tmp_path / "sweep.db"), "--seeds", "2", "--trials", "30"],
                           catch_exceptions=False, terminal_width=200)
    assert r.exit_code == 0 and "fwd/float16/d256/full/g1/q2048/k2048" in r.output
    row = next(line for line in r.output.splitlines() if "d256" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    n = len(load_space("fwd").valid_variants(prob, dev))
    assert cells[1] == f"{n} / {n}"  # every valid variant recorded: an exhaustive sweep
    assert "not an exhaustive sweep" not in r.output


def test_search_quality_reads_a_sweep_made_before_a_knob_existed():
    """A sweep older than a knob (its rows lack it) is read with the knob's `[legacy]` value, the
    kernel it measured; rows of other knobs (another family's) are left out; none at all: an error."""
    import json

    from autoflash.space import load_space
    from autoflash.tuning.search_quality import in_current_space

    space = load_space("fwd")
    assert space.legacy, "the forward space names the values of its later knobs"
    variant = next(space.all_variants())
    old = {k: v for k, v in variant.as_dict().items() if k not in space.legacy}  # as recorded before
    table = in_current_space({json.dumps(old): 1.5, json.dumps({"BACKEND": "cudnn"}): 0.5}, space)
    assert table == {variant.replace(**space.legacy).json(): 1.5}


def test_db_export_import_merge_are_idempotent(tmp_path):
    src = _db_with_winners(tmp_path / "src.db", n=3)
    out = tmp_path / "w.json"
    assert invoke("db", "export", "--db", str(src), "-o", str(out)).exit_code == 0
    data = json.loads(out.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and len(data["winners"]) == 3
    dst = tmp_path / "dst.db"
    r = invoke("db", "import", str(out), "--db", str(dst))
    assert "3 added" in " ".join(r.output.split())
    r = invoke("db", "import", str(out), "--db", str(dst))
    assert "0 added, 0 updated, 3 unchanged" in " ".join(r.output.split())
    faster = _db_with_winners(tmp_path / "faster.db", n=3, ms=0.5)
    r = invoke("db", "merge", str(faster), "--db", str(dst))
    assert "3 updated" in " ".join(r.output.split())
    r = invoke("db", "merge", str(src), "--db", str(dst))  # slower rows never replace faster ones
    assert "3 unchanged" in " ".join(r.output.split())
    csv_out = tmp_path / "t.csv"
    assert invoke("db", "export", "--db", str(dst), "--format", "csv", "-o", str(csv_out)).exit_code == 0
    assert csv_out.read_text().splitlines()[0].startswith("gpu_key,problem,template_hash")


def test_db_import_refuses_foreign_schema_and_rejects_undeclared_variants(tmp_path):
    src = _db_with_winners(tmp_path / "src.db", n=2)
    out = tmp_path / "w.json"
    invoke("db", "export", "--db", str(src), "-o", str(out))
    data = json.loads(out.read_text())
    (tmp_path / "future.json").write_text(json.dumps({**data, "schema_version": 99}))
    r = CliRunner().invoke(cli, ["db", "import", str(tmp_path / "future.json"), "--db", str(tmp_path / "d.db")])
    assert r.exit_code != 0 and "schema version 99" in " ".join(r.output.split())
    data["winners"][0]["variant"] = json.dumps({**json.loads(data["winners"][0]["variant"]), "LOADS": "evil"})
    (tmp_path / "bad.json").write_text(json.dumps(data))
    r = invoke("db", "import", str(tmp_path / "bad.json"), "--db", str(tmp_path / "d.db"))
    assert "1 added" in " ".join(r.output.split()) and "1 rejected" in " ".join(r.output.split())


def test_db_show(tmp_path, monkeypatch):
    import autoflash.cli

    monkeypatch.setattr(autoflash.cli.console, "width", 200)
    src = _db_with_winners(tmp_path / "src.db", n=1)
    r = invoke("db", "show", "fwd/float16/d64/full/g1/q64/k64", "--db", str(src))
    assert r.exit_code == 0 and "template_hash" in r.output
    r = CliRunner().invoke(cli, ["db", "show", "fwd/nothing", "--db", str(src)])
    assert r.exit_code != 0 and "no winner" in r.output


def test_bench_interpret_runs_the_pipeline(tmp_path):
    md = tmp_path / "b.md"
    r = invoke("bench", "--interpret", "--rounds", "1", "--markdown", str(md), "--plot", str(tmp_path / "b.png"))
    assert r.exit_code == 0
    lines = md.read_text().splitlines()
    assert lines[0].startswith("| shape | autoflash TFLOP/s | autoflash-own TFLOP/s | default TFLOP/s")
    assert len(lines) == 2 + 4 + 1  # header, 4 tiny shapes, geomean
    # what the dispatched column ran: no DB here, so each shape's default own family
    assert lines[0].endswith("| autoflash serves |")
    assert all(line.split("|")[-2].strip() == "triton_fwd" for line in lines[2:-1])
    assert (tmp_path / "b.png").stat().st_size > 1000


@pytest.mark.interpreter
def test_the_backward_bench_times_each_pair_after_the_forward_a_training_step_serves(tmp_path):
    """`bench --op bwd` times forward + backward as the tuner does: after the own forward that serves
    (here one that is not the default), which is rendered and run; the tuner's globals are restored."""
    from autoflash import bench, codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Shape
    from autoflash.space import default_variant, load_space
    from autoflash.tuning import gate

    device = gpu_fingerprint()
    shape = Shape(batch=1, heads_q=2, heads_kv=2, seqlen_q=37, seqlen_k=37, head_dim=16, causal=True,
                  dtype="float32", op="bwd")
    fwd_problem = Shape(**{**shape.__dict__, "op": "fwd"}).problem
    default_fwd = default_variant("fwd", fwd_problem, device)
    served_fwd = next(v for v in load_space("fwd").valid_variants(fwd_problem, device)
                      if v != default_fwd and not codegen.source_path(v).exists())  # (not rendered by earlier tests)
    seen = []

    def choose(s):
        seen.append(gate.training_forward)
        return default_variant("bwd", s.problem, device)

    rows = bench.run_bench([shape], {"autoflash": choose}, rounds=1, device="cpu",
                           pair_halves=lambda s: (served_fwd, None))
    assert seen == [served_fwd] and rows[0].shape.op == "fwdbwd" and rows[0].ms["autoflash"] > 0
    assert codegen.source_path(served_fwd).exists()  # rendered: the pair ran after it
    assert gate.training_forward is None and gate.training_backward is None


def test_bench_baseline_template_times_the_same_variant_from_another_template(tmp_path):
    """An A/B of a template edit: the backward variants rendered from a second template file."""
    import os
    import pathlib

    from autoflash import resources

    baseline = tmp_path / "attn_bwd_old.py.jinja"
    source = resources.read_text("families", "triton_bwd/kernel.py.jinja")
    baseline.write_text(source.replace("import triton\n", "import triton  # baseline-marker\n", 1))
    md = tmp_path / "ab.md"
    r = invoke("bench", "--interpret", "--op", "bwd", "--rounds", "1", "--baseline-template", str(baseline),
               "--markdown", str(md))
    assert r.exit_code == 0, r.output
    lines = md.read_text().splitlines()
    assert lines[0] == ("| shape | autoflash TFLOP/s | autoflash-own TFLOP/s | default TFLOP/s | baseline TFLOP/s "
                        "| autoflash/baseline | autoflash-own/baseline | default/baseline | autoflash serves |")
    # backward problems are timed as forward + backward, as the tuner times them
    assert len(lines) == 2 + 4 + 1 and all(line.startswith("| fwdbwd ") for line in lines[2:6])
    assert all(line.endswith("| triton_fwd + triton_bwd |") for line in lines[2:6])  # a training step's pair
    rendered = [p.read_text() for p in pathlib.Path(os.environ["AUTOFLASH_KERNEL_CACHE"]).glob("triton_bwd-*.py")]
    assert any("baseline-marker" in text for text in rendered)  # really rendered from the other file


def test_db_plot_of_the_committed_h200_results(tmp_path):
    import pathlib

    db = pathlib.Path(__file__).resolve().parent.parent / "docs" / "results" / "2026-11-30-h200-tune-standard.db"
    out = tmp_path / "w.png"
    r = invoke("db", "plot", "--db", str(db), "-o", str(out))
    assert r.exit_code == 0 and "24 winners" in r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_db_export_sqlite_writes_a_winners_only_db(tmp_path):
    from autoflash.store import Store

    src = _db_with_winners(tmp_path / "src.db", n=2)
    out = tmp_path / "ship.db"
    r = invoke("db", "export", "--db", str(src), "--format", "sqlite", "-o", str(out))
    assert r.exit_code == 0 and "2 winner(s)" in r.output
    counts = Store(out, readonly=True).counts()
    assert counts["winners"] == 2 and counts["trials"] == 0 and counts["gpus"] == 1


def test_db_export_ships_only_current_winners_of_one_op(tmp_path):
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem
    from autoflash.space import load_space
    from autoflash.store import Store

    src = _db_with_winners(tmp_path / "src.db", n=2)  # template hash "t": an earlier template
    dev = gpu_fingerprint()
    store = Store(src)
    for op in ("fwd", "bwd"):
        prob = Problem(op, "float16", 64, True, 1, 128, 128)
        store.set_winner(gpu_key=dev.key, problem=prob, template_hash=codegen.template_hash(op),
                         variant_json=load_space(op).valid_variants(prob, dev)[0].json(),
                         median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    store.close()
    out = _db_with_winners(tmp_path / "ship.db", n=1)  # an earlier shipped file: replaced, not merged into
    r = invoke("db", "export", "--db", str(src), "--format", "sqlite", "--op", "bwd", "--current", "-o", str(out))
    assert r.exit_code == 0 and "1 winner(s)" in r.output
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ship.db") and p.name != "ship.db"]
    (row,) = Store(out, readonly=True).winners()
    assert row["op"] == "bwd" and row["template_hash"] == codegen.template_hash("bwd")
    r = invoke("db", "export", "--db", str(src), "--op", "fwd")
    assert r.exit_code == 0 and len(json.loads(r.output)["winners"]) == 3  # both fwd templates


def test_which_names_the_winner_and_the_db_it_came_from(tmp_path, monkeypatch):
    import autoflash.dispatch
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.shapes import load_shape_set
    from autoflash.space import load_space
    from autoflash.store import Store

    db = tmp_path / "mine.db"
    monkeypatch.setenv("AUTOFLASH_DB", str(db))
    monkeypatch.setattr(autoflash.dispatch, "_dispatcher", None)  # a fresh dispatcher reads the new DB
    dev, shape = gpu_fingerprint(), load_shape_set("tiny")[0]
    winner = load_space("fwd").valid_variants(shape.problem, dev)[5]
    store = Store(db)
    store.add_gpu(dev)
    store.set_winner(gpu_key=dev.key, problem=shape.problem, template_hash=codegen.template_hash("fwd"),
                     variant_json=winner.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    store.close()
    import autoflash.cli

    monkeypatch.setattr(autoflash.cli.console, "width", 400)  # one table row per line
    r = invoke("which", "--interpret", "--shapes", "tiny")
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if "fwd/" in line]
    assert len(lines) == 4, r.output
    assert "exact" in lines[0] and "mine.db" in lines[0] and winner.short() in lines[0]
    # The causal shapes have no winner of their own kind: built-in default, never the non-causal row.
    assert sum("built-in" in line for line in lines) == 2


def test_store_queries_answer_what_the_cli_shows(tmp_path):
    import sqlite3

    from autoflash import store_queries as q
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem
    from autoflash.store import Store

    dev, prob = gpu_fingerprint(), Problem("fwd", "float16", 64, False, 1, 64, 64)
    store = Store(tmp_path / "q.db")
    store.add_gpu(dev)
    run = store.start_run(dev.key, "test")
    for status, ms in (("ok", 2.0), ("ok", 1.0), ("compile_error", None)):
        store.add_trial(run_id=run, gpu_key=dev.key, problem=prob, template_hash="t", variant_json=f'{{"v": {ms}}}',
                        status=status, median_ms=ms)
    store.set_winner(gpu_key=dev.key, problem=prob, template_hash="t", variant_json="{}", median_ms=1.0,
                     spread=0.0, tflops=1.0, trials=3)
    assert q.trial_counts(store, prob.key) == {"ok": 2, "compile_error": 1}
    assert [r["median_ms"] for r in q.trials_best_first(store, prob.key)] == [1.0, 2.0, None]
    assert len(q.trials_best_first(store, prob.key, limit=1)) == 1
    assert q.trial_problem_keys(store) == [prob.key]
    gpu, timings = q.measured_timings(store, prob.key)
    assert gpu["gpu_key"] == dev.key and sorted(timings.values()) == [1.0, 2.0]
    assert q.measured_timings(store, "fwd/nothing") == (None, {})
    assert len(q.winners_summary(store, gpu=dev.name[:3].upper(), op="fwd", head_dim=64)) == 1
    assert q.winners_summary(store, gpu="no such gpu") == [] and q.winners_summary(store, op="bwd") == []
    columns, rows = q.table_dump(store, "trials")
    assert "median_ms" in columns and len(rows) == 3
    assert not q.is_locked(store.path, write=True) and not q.is_locked(tmp_path / "absent.db")
    holder = sqlite3.connect(store.path)
    holder.execute("BEGIN EXCLUSIVE")
    assert q.is_locked(store.path, write=True)
    holder.rollback()
    holder.close()


def test_bench_says_torch_sdpa_serves_a_shape_no_own_kernel_takes(monkeypatch):
    """Head dim 512: no own variant is valid; the API answers with torch SDPA, and the bench says so."""
    import warnings

    import torch

    import autoflash
    from autoflash import api
    from autoflash.bench import served_by
    from autoflash.device import gpu_fingerprint
    from autoflash.dispatch import get_dispatcher
    from autoflash.problem import Shape

    monkeypatch.delenv("AUTOFLASH_STRICT", raising=False)
    api.reset()  # (a fallback warns once per reason and process)
    shape = Shape(batch=1, heads_q=2, heads_kv=2, seqlen_q=16, seqlen_k=16, head_dim=512, causal=True, dtype="float32")
    q = torch.randn(1, 2, 16, 512)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = autoflash.attention(q, q, q, is_causal=True)
    assert any("fall" in str(w.message).lower() for w in caught) and out.shape == q.shape
    for op in ("fwd", "bwd"):
        assert served_by(get_dispatcher(), shape, gpu_fingerprint(), op) == "torch SDPA (fallback)"


@pytest.mark.interpreter
def test_bench_json_has_one_row_per_shape_and_implementation(tmp_path):
    out = tmp_path / "bench.json"
    r = invoke("bench", "--interpret", "--rounds", "1", "--json", str(out))
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    shapes = {(x["batch"], x["heads_q"], x["seqlen_q"], x["head_dim"], x["causal"]) for x in rows}
    assert len(rows) == 3 * len(shapes) and {x["impl"] for x in rows} == {"autoflash", "autoflash-own", "autoflash-default"}
    assert all(x["fwd_tflops"] is None or x["fwd_tflops"] > 0 for x in rows)
    assert {"dtype", "heads_kv", "seqlen_k", "gpu", "triton"} <= set(rows[0])
    assert all(("served" in x) == (x["impl"] == "autoflash") for x in rows)


@pytest.mark.interpreter
def test_bench_decode_from_a_shell_without_the_interpreter_set(tmp_path):
    """`autoflash bench --interpret --op decode` as a user types it (TRITON_INTERPRET unset: Triton
    is imported before the option is read, so the command starts again with it on): every
    implementation is checked against float32 SDPA, then timed; paged caches beside contiguous."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "decode.json"
    done = subprocess.run([sys.executable, "-m", "autoflash", "bench", "--interpret", "--op", "decode", "--rounds", "1",
                           "--json", str(out)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["impl"] for r in rows} == {"autoflash", "autoflash-paged16"}
    assert all(r["err"] < 1e-5 and r["ms"] > 0 and r["tb_s"] > 0 and not r["note"] for r in rows)


def test_bench_says_when_a_stored_winner_cannot_be_served(tmp_path, monkeypatch):
    """A stored winner this GPU rejects (here: a knob missing) is measured as its stand-in: the
    bench says so under its table, not only in a warning that scrolls away above it."""
    from autoflash import codegen, dispatch
    from autoflash.device import gpu_fingerprint
    from autoflash.shapes import load_shape_set
    from autoflash.space import default_variant
    from autoflash.store import Store

    db = tmp_path / "x.db"
    monkeypatch.setenv("AUTOFLASH_DB", str(db))
    monkeypatch.setattr(dispatch, "_dispatcher", None)  # a dispatcher that reads this DB
    dev = gpu_fingerprint()
    shape = load_shape_set("tiny")[0]
    good = default_variant("fwd", shape.problem, dev)
    knobs = good.as_dict()
    knobs.pop(next(iter(knobs)))
    store = Store(db)
    store.add_gpu(dev)
    store.set_winner(gpu_key=dev.key, problem=shape.problem, template_hash=codegen.template_hash(good.family),
                     variant_json=json.dumps(knobs), median_ms=1.0, spread=0.0, tflops=1.0, trials=1)
    store.close()
    r = invoke("bench", "--interpret", "--rounds", "1")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "1 stored winner(s) cannot be served on this GPU" in text and shape.problem.key in text


def test_bench_rounds_alternate_the_order_of_the_implementations():
    """A drift over a run must not always favour the implementation timed first: every
    implementation goes first in as many rounds as it goes last (of an even number)."""
    from autoflash.bench import alternating

    impls = ("sdpa", "autoflash", "autoflash-own")
    orders = [alternating(impls, r) for r in range(4)]
    assert orders[0] == impls and orders[1] == impls[::-1]
    for impl in impls:
        assert sum(o.index(impl) for o in orders) == len(orders) * (len(impls) - 1) / 2


def test_interleaved_timing_gives_every_call_each_place_equally_often():
    """`device_ms_interleaved` rotates its calls per repetition: over len(names) repetitions each
    call is timed once in every position, so a drift within a repetition favours none of them."""
    from autoflash.tuning.timing import interleaved_order

    names = ["a", "b", "c"]
    orders = [interleaved_order(names, i) for i in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and orders[3:] == orders[:3]
    for name in names:
        assert sorted(o.index(name) for o in orders[:3]) == [0, 1, 2]
    assert [interleaved_order(["only"], i) for i in range(2)] == [["only"], ["only"]]


def test_llama_speedup_is_the_median_of_paired_ratios_with_its_quartiles():
    from autoflash.bench_llama import paired_speedup

    up = paired_speedup([0.99, 1.00, 1.01, 1.02, 1.20])
    assert up["median"] == 1.01 and up["q1"] < up["median"] < up["q3"]
    assert paired_speedup([1.5])["median"] == 1.5


def test_which_and_info_on_a_gpu_with_no_winners_say_sdpa_serves_and_why(tmp_path, monkeypatch):
    """A new GPU (an H100 fingerprint; the shipped winners are an H200's): every half-precision shape
    is served by SDPA-cuDNN, for want of any measurement here or near, and `info` says so."""
    import autoflash.cli
    import autoflash.device
    import autoflash.dispatch
    from autoflash.device import GPUFingerprint

    h100 = GPUFingerprint("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448, "2.11.0", "3.6.0", "13.0", "0.1.0")
    monkeypatch.setattr(autoflash.device, "gpu_fingerprint", lambda device_index=None: h100)
    monkeypatch.setattr(autoflash.dispatch, "gpu_fingerprint", lambda device_index=None: h100)
    monkeypatch.setenv("AUTOFLASH_DB", str(tmp_path / "none.db"))
    monkeypatch.setattr(autoflash.dispatch, "_dispatcher", None)
    monkeypatch.setattr(autoflash.cli.console, "width", 400)  # one table row per line
    r = invoke("which", "--shapes", "models")
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if "fwd/bfloat16" in line]
    assert rows and all("vendor" in row and "no measurement near: SDPA-cuDNN" in row for row in rows), r.output
    said = " ".join(invoke("info").output.split())
    assert "no winners for this GPU: SDPA-cuDNN serves every problem it takes" in said


@pytest.mark.parametrize("message, left_out", [("No available kernel. Aborting execution.", True), ("boom", False)])
def test_bench_leaves_out_a_vendor_kernel_that_refuses_the_shape(monkeypatch, message, left_out):
    """A column whose vendor kernel has none for a shape (cuDNN at a head dim that is not a multiple
    of 8) is NaN for that shape; any other error still stops the bench."""
    import math

    from autoflash import bench
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Shape
    from autoflash.space import default_variant, load_space

    real = bench._variant_fn

    def refusing(variant, *args, **kwargs):
        if not load_space(variant.family).vendor:
            return real(variant, *args, **kwargs)

        def fn():
            raise RuntimeError(message)
        return fn
    monkeypatch.setattr(bench, "_variant_fn", refusing)
    shape = Shape(batch=1, heads_q=2, heads_kv=2, seqlen_q=37, seqlen_k=37, head_dim=16, causal=True, dtype="float32")
    cudnn = load_space("sdpa_fwd").check_declared({"BACKEND": "cudnn"})
    choosers = {"autoflash": lambda s: cudnn, "default": lambda s: default_variant("fwd", s.problem, gpu_fingerprint())}
    if not left_out:
        with pytest.raises(RuntimeError, match="boom"):
            bench.run_bench([shape], choosers, rounds=1, device="cpu")
        return
    (row,) = bench.run_bench([shape], choosers, rounds=1, device="cpu")
    assert math.isnan(row.ms["autoflash"]) and row.ms["default"] > 0


@pytest.mark.parametrize("flag, served_in_torch", [(None, True), ("1", False)])
def test_the_bench_says_an_odd_head_dim_runs_in_torch_on_a_gpu(monkeypatch, flag, served_in_torch):
    """A head dim that is not a multiple of 8 runs in torch on a GPU (its flash backend pads it, faster
    than the kernels' padded tiles), unless AUTOFLASH_ODD_HEAD_DIMS=1: the bench's `served` says which."""
    import dataclasses

    from autoflash.bench import served_by
    from autoflash.device import gpu_fingerprint
    from autoflash.dispatch import get_dispatcher
    from autoflash.problem import Shape

    if flag is None:
        monkeypatch.delenv("AUTOFLASH_ODD_HEAD_DIMS", raising=False)
    else:
        monkeypatch.setenv("AUTOFLASH_ODD_HEAD_DIMS", flag)
    h100 = dataclasses.replace(gpu_fingerprint(), name="NVIDIA H100 80GB HBM3", cc_major=9, cc_minor=0,
                               smem_per_block=232448)
    shape = Shape(batch=2, heads_q=16, heads_kv=16, seqlen_q=2048, seqlen_k=2048, head_dim=100, causal=True,
                  dtype="bfloat16")
    said = served_by(get_dispatcher(), shape, h100, "fwd")
    assert (said == "torch SDPA (fallback)") == served_in_torch, said
    assert served_by(get_dispatcher(), dataclasses.replace(shape, head_dim=96), h100, "fwd") != "torch SDPA (fallback)"
    assert served_by(get_dispatcher(), shape, gpu_fingerprint(), "fwd") != "torch SDPA (fallback)"  # (interpreter)
