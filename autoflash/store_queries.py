"""Read-only queries the command line runs against a results DB (`autoflash.store.Store`).

Every SQL statement the CLI needs lives here, so the commands stay free of SQL and the queries can
be tested and reused on their own. Each function takes an open `Store` (or a path, for the lock
probe) and returns plain Python values. This module does not import torch.
"""

from __future__ import annotations

import os
import sqlite3

from autoflash.store import Store


def winners_summary(store: Store, gpu: str | None = None, op: str | None = None,
                    head_dim: int | None = None) -> list[dict]:
    """Winner rows (ordered by problem key) of `op` and `head_dim` when given, whose GPU key
    contains `gpu` (case-insensitive) when given."""
    rows = store.winners(op=op, head_dim=head_dim)
    return [r for r in rows if not gpu or gpu.lower() in r["gpu_key"].lower()]


def winners_for_problem(store: Store, problem_key: str) -> list[dict]:
    """Every winner row of one problem key (one per GPU key and template hash)."""
    return [w for w in store.winners() if w["problem"] == problem_key]


def trial_counts(store: Store, problem_key: str) -> dict[str, int]:
    """How many trials of one problem key the DB holds, per status ('ok', 'compile_error', ...)."""
    rows = store.db.execute("select status, count(*) from trials where problem = ? group by status",
                            [problem_key]).fetchall()
    return {status: n for status, n in rows}


def trials_best_first(store: Store, problem_key: str, limit: int | None = None) -> list[dict]:
    """Trials of one problem key, fastest measured first (unmeasured ones last), at most `limit`."""
    return list(store.db["trials"].rows_where("problem = ?", [problem_key],
                                              order_by="median_ms is null, median_ms", limit=limit))


def trial_problem_keys(store: Store) -> list[str]:
    """The distinct problem keys that have trials, in the order SQLite returns them."""
    return [r[0] for r in store.db.execute("select distinct problem from trials")]


def measured_timings(store: Store, problem_key: str) -> tuple[dict | None, dict[str, float]]:
    """The recorded timings of one problem: (the `gpus` row of its first 'ok' trial, or None when
    it has none; {variant JSON: median ms} over its 'ok' trials, a later trial of a variant
    overriding an earlier one)."""
    cur = store.db.execute("select t.variant, t.median_ms, g.* from trials t join gpus g on g.gpu_key = t.gpu_key "
                           "where t.problem = ? and t.status = 'ok'", [problem_key])
    columns = [d[0] for d in cur.description][2:]
    rows = cur.fetchall()
    if not rows:
        return None, {}
    return dict(zip(columns, rows[0][2:])), {r[0]: r[1] for r in rows}


def table_dump(store: Store, table: str) -> tuple[list[str], list[dict]]:
    """(column names, every row) of one table of the DB, e.g. 'winners' or 'trials', for a CSV."""
    if table not in store.db.table_names():
        raise ValueError(f"{store.path} has no table {table!r}")
    return list(store.db[table].columns_dict), list(store.db[table].rows)


def is_locked(path: str | os.PathLike, write: bool = False) -> bool:
    """Whether another connection holds a lock on the DB file at `path` that would make a reader
    (or, with write=True, a writer) wait. Never waits itself; a missing file is not locked."""
    if not os.path.isfile(path):
        return False
    try:
        conn = sqlite3.connect(f"file:{os.fspath(path)}?mode={'rw' if write else 'ro'}", uri=True, timeout=0)
    except sqlite3.Error:
        return False
    try:
        if write:
            conn.execute("begin immediate")
            conn.rollback()
        else:
            conn.execute("select count(*) from sqlite_master").fetchone()
        return False
    except sqlite3.OperationalError as e:
        return "locked" in str(e) or "busy" in str(e)
    except sqlite3.Error:
        return False  # not a database, say: opening the Store reports that
    finally:
        conn.close()
