"""benchmarks/new_gpu_report.py: docs/results/new-gpu.json from bench rows and tune summaries, a
tune summary also from a results DB of a run made before `tune --json`."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sqlite3

ROOT = pathlib.Path(__file__).resolve().parents[1]


def report_module():
    spec = importlib.util.spec_from_file_location("new_gpu_report", ROOT / "benchmarks" / "new_gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_rows(metric: str, mine: tuple) -> list:
    rows = []
    for seqlen, ratio in zip((1024, 4096), mine):
        shape = {"batch": 1, "heads_q": 8, "heads_kv": 8, "seqlen_q": seqlen, "seqlen_k": seqlen, "head_dim": 128}
        rows += [{**shape, "impl": "autoflash", metric: 100.0 * ratio}, {**shape, "impl": "sdpa-cudnn", metric: 100.0},
                 {**shape, "impl": "sdpa-flash", metric: 80.0}]
    return rows


def tune_db(path) -> None:
    db = sqlite3.connect(path)
    db.execute("create table runs (id integer primary key, started_at text, finished_at text, status text, "
               "command text, problems integer)")
    db.execute("create table trials (id integer primary key, run_id integer, problem text, variant text, "
               "status text, seconds real, created_at text)")
    db.execute("create table winners (problem text, variant text, run_id integer)")
    db.execute("insert into runs values (1, '2026-12-06T06:00:00+00:00', '2026-12-06T06:02:00+00:00', 'finished', "
               "'autoflash tune --ops fwd,bwd --budget 2', 2)")
    rows = [("p1", '{"BACKEND":"cudnn"}', "ok"), ("p1", '{"BLOCK_M":128}', "ok"), ("p1", '{"BLOCK_M":64}', "wrong"),
            ("p2", '{"BACKEND":"cudnn","FORWARD":"sdpa"}', "ok"), ("p2", '{"BLOCK_M":128}', "ok"),
            ("p2", '{"BLOCK_M":32}', "pruned")]
    for i, (problem, variant, status) in enumerate(rows):
        db.execute("insert into trials values (?, 1, ?, ?, ?, 1.0, '2026-12-06T06:01:00+00:00')",
                   (i + 1, problem, variant, status))
    db.execute("insert into winners values ('p1', '{}', 1)")
    db.commit()
    db.close()


def test_the_report_from_bench_rows_a_summary_and_a_db(tmp_path):
    mod = report_module()
    files = {}
    for name, metric, mine in (("untuned-fwd", "fwd_tflops", (0.8, 0.9)), ("untuned-fwdbwd", "fwdbwd_tflops", (0.9, 1.0)),
                               ("tuned-fwd", "fwd_tflops", (1.0, 1.1)), ("tuned-fwdbwd", "fwdbwd_tflops", (1.0, 1.0))):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(bench_rows(metric, mine)))
    summary = tmp_path / "tune.json"
    summary.write_text(json.dumps({"budget_s": 300.0, "wall_s": 310.0, "problems": 22, "problems_with_winner": 22,
                                   "own_measured": 200, "own_per_min": 38.7}))
    db = tmp_path / "unbudgeted.db"
    tune_db(db)
    out = tmp_path / "new-gpu.json"
    args = [f"--{k}={v}" for k, v in files.items()] + [f"--tune={summary}", f"--tune-unbudgeted={db}", "-o", str(out)]
    assert mod.main(args) == 0
    report = json.loads(out.read_text())
    untuned = report["untuned"]["fwd"]["dispatched_over_best_sdpa"]
    assert untuned["cells"] == 2 and untuned["lowest"] == 0.8 and untuned["lowest_shape"]["seqlen_q"] == 1024
    assert abs(untuned["geomean"] - (0.8 * 0.9) ** 0.5) < 1e-3
    assert report["tuned"]["fwdbwd"]["dispatched_over_best_sdpa"]["lowest"] == 1.0
    tune = report["tune"]
    assert {k: tune[k] for k in ("budget_s", "wall_s", "problems", "problems_with_winner", "own_per_min")} == {
        "budget_s": 300.0, "wall_s": 310.0, "problems": 22, "problems_with_winner": 22, "own_per_min": 38.7}
    # from the DB: 3 own candidates measured (a pruned suggestion is none) in 2 minutes, 2 vendor ones
    assert tune["unbudgeted"]["own_measured"] == 3 and tune["unbudgeted"]["vendor_measured"] == 2
    assert tune["own_per_min_unbudgeted"] == 1.5 and tune["unbudgeted"]["budget_s"] == 120.0
    assert tune["unbudgeted"]["problems_with_winner"] == 1 and tune["own_rate_ratio"] == round(38.7 / 1.5, 3)
