"""Assemble docs/results/new-gpu.json (issue 44: a new GPU in minutes) from what the runs wrote:
`autoflash bench --json` files before and after tuning (forward, and forward+backward with
--fwdbwd) and the summaries of a budgeted and an unbudgeted tuning run: `autoflash tune --json`
files, or the runs' results DBs (runs made before --json existed: the same figures from their
`runs` and `trials` tables).

    PYTHONPATH=$PWD python benchmarks/new_gpu_report.py \\
        --untuned-fwd untuned-fwd.json --untuned-fwdbwd untuned-fwdbwd.json \\
        --tuned-fwd tuned-fwd.json --tuned-fwdbwd tuned-fwdbwd.json \\
        --tune budget5.json --tune-unbudgeted unbudgeted.db -o docs/results/new-gpu.json

Each bench section also gets its dispatched / best SDPA ratios (geomean and lowest cell), what the
issue's "done when" reads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sqlite3
import sys

NOT_SHAPE = {"impl", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops", "gpu", "torch", "triton", "served"}
DISPATCHED = "autoflash"


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def ratios(rows: list, metric: str) -> dict:
    """Dispatched / best SDPA backend per shape: their geomean and the lowest, with that shape."""
    cells = {}
    for r in rows:
        key = json.dumps({k: v for k, v in r.items() if k not in NOT_SHAPE}, sort_keys=True)
        cells.setdefault(key, {})[r["impl"]] = r.get(metric)
    out = []
    for key, impls in cells.items():
        mine = impls.get(DISPATCHED)
        sdpa = [v for k, v in impls.items() if k.startswith("sdpa") and v]
        if mine and sdpa:
            out.append((mine / max(sdpa), json.loads(key)))
    if not out:
        return {"cells": 0}
    low = min(out, key=lambda x: x[0])
    return {"cells": len(out), "geomean": round(math.exp(sum(math.log(x) for x, _ in out) / len(out)), 4),
            "lowest": round(low[0], 4), "lowest_shape": low[1]}


def bench_section(fwd: str | None, fwdbwd: str | None) -> dict:
    out = {}
    for name, path, metric in (("fwd", fwd, "fwd_tflops"), ("fwdbwd", fwdbwd, "fwdbwd_tflops")):
        if path:
            rows = read_json(path)
            out[name] = {"rows": rows, "dispatched_over_best_sdpa": ratios(rows, metric)}
    return out


def _time(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


def summary_from_db(path: str) -> dict:
    """A tune summary from a results DB's last run: its budget (from its command), wall time,
    problems, those with a winner, own and vendor candidates measured (vendor ones: torch SDPA's,
    whose variants name a BACKEND)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    run = db.execute("select * from runs order by id desc limit 1").fetchone()
    if run is None:
        raise SystemExit(f"{path}: no tuning run recorded")
    trials = db.execute("select problem, variant, status, seconds, created_at from trials where run_id = ?",
                        (run["id"],)).fetchall()
    measured = [t for t in trials if t["status"] not in ("running", "pruned")]
    start = _time(run["started_at"])
    if run["finished_at"]:
        end = _time(run["finished_at"])
    else:  # (a killed run: its last measurement's end)
        end = max((_time(t["created_at"]) + (t["seconds"] or 0) for t in measured), default=start)
    wall = end - start
    budget = re.search(r"--budget[ =]([0-9.]+)", run["command"] or "")
    own = sum('"BACKEND"' not in t["variant"] for t in measured)
    problems = {t["problem"] for t in trials}
    winners = {r[0] for r in db.execute("select distinct problem from winners where run_id = ?", (run["id"],))}
    db.close()
    return {"budget_s": float(budget.group(1)) * 60 if budget else None, "wall_s": round(wall, 1),
            "problems": max(len(problems), run["problems"] or 0), "problems_with_winner": len(winners & problems),
            "own_measured": own, "own_per_min": round(own / (wall / 60), 2) if wall > 0 else None,
            "vendor_measured": len(measured) - own, "status": run["status"], "from": "db"}


def tune_summary(path: str) -> dict:
    return summary_from_db(path) if path.endswith(".db") else read_json(path)


def tune_section(budgeted: str | None, unbudgeted: str | None) -> dict:
    out = {}
    if budgeted:
        s = tune_summary(budgeted)
        out = {k: s.get(k) for k in ("budget_s", "wall_s", "problems", "problems_with_winner", "own_per_min")}
        out["own_measured"] = s.get("own_measured")
        out["details"] = s
    if unbudgeted:
        u = tune_summary(unbudgeted)
        out["own_per_min_unbudgeted"] = u.get("own_per_min")
        out["unbudgeted"] = u
    if out.get("own_per_min") and out.get("own_per_min_unbudgeted"):
        out["own_rate_ratio"] = round(out["own_per_min"] / out["own_per_min_unbudgeted"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("untuned-fwd", "untuned-fwdbwd", "tuned-fwd", "tuned-fwdbwd"):
        ap.add_argument(f"--{name}", help="autoflash bench --json rows")
    ap.add_argument("--tune", help="the budgeted run: autoflash tune --json summary, or its results DB (.db)")
    ap.add_argument("--tune-unbudgeted", help="the unbudgeted run on the same problems: summary or DB")
    ap.add_argument("-o", "--output", default="-", help="where to write (default: standard output)")
    a = ap.parse_args(argv)
    report = {"untuned": bench_section(a.untuned_fwd, a.untuned_fwdbwd),
              "tuned": bench_section(a.tuned_fwd, a.tuned_fwdbwd),
              "tune": tune_section(a.tune, a.tune_unbudgeted)}
    text = json.dumps(report, indent=1) + "\n"
    if a.output == "-":
        sys.stdout.write(text)
    else:
        with open(a.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
