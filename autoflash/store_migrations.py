"""The results DB's schema, as named migrations applied in order (each once, recorded in
`_migrations`), and its version in `_meta`. A migration is additive: files written by an older
autoflash open and keep their rows."""

from __future__ import annotations

import datetime as _dt
import sqlite3

import sqlite_utils

from autoflash.store_validate import SCHEMA_VERSION


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _m001_initial(db: sqlite_utils.Database) -> None:
    db["gpus"].create({"gpu_key": str, "name": str, "cc_major": int, "cc_minor": int, "sm_count": int,
                       "smem_per_block": int, "torch_version": str, "triton_version": str,
                       "cuda_version": str, "autoflash_version": str}, pk="gpu_key", if_not_exists=True)
    db["runs"].create({"id": int, "gpu_key": str, "started_at": str, "finished_at": str, "status": str,
                       "command": str, "problems": int, "trials": int}, pk="id", if_not_exists=True)
    db["trials"].create({
        "id": int, "run_id": int, "gpu_key": str, "problem": str, "op": str, "dtype": str, "head_dim": int,
        "causal": int, "gqa_group": int, "seqlen_q": int, "seqlen_k": int, "template_hash": str,
        "variant": str, "status": str, "median_ms": float, "spread": float, "tflops": float,
        "err": float, "sdpa_err": float, "message": str, "seconds": float, "shape": str, "created_at": str,
    }, pk="id", foreign_keys=[("run_id", "runs", "id"), ("gpu_key", "gpus", "gpu_key")], if_not_exists=True)
    db["trials"].create_index(["gpu_key", "problem", "template_hash", "variant"], if_not_exists=True)
    db["winners"].create({
        "gpu_key": str, "problem": str, "template_hash": str, "op": str, "dtype": str, "head_dim": int,
        "causal": int, "gqa_group": int, "seqlen_q": int, "seqlen_k": int, "variant": str,
        "median_ms": float, "spread": float, "tflops": float, "default_ms": float, "sdpa_cudnn_ms": float,
        "sdpa_flash_ms": float, "trials": int, "run_id": int, "shape": str, "updated_at": str,
    }, pk=("gpu_key", "problem", "template_hash"), foreign_keys=[("gpu_key", "gpus", "gpu_key")],
        if_not_exists=True)


def _m002_run_process(db: sqlite_utils.Database) -> None:
    """Which process ran a run (host, pid): a run left 'running' by a killed process can be told
    from one still going. Additive: older readers ignore the columns."""
    for column, kind in (("host", str), ("pid", int)):
        _add_column(db, "runs", column, kind)


def _m003_occupancy_key(db: sqlite_utils.Database) -> None:
    """The problem key's occupancy bucket (problem.work_bucket) as a column of trials and winners.
    Rows written before keep NULL and their keys without /w<n>: the dispatcher serves them by the
    nearest-bucket rule, one occupancy bucket away from every call."""
    for table in ("trials", "winners"):
        _add_column(db, table, "work", int)


def _m004_paged_key(db: sqlite_utils.Database) -> None:
    """A decode problem's paged-cache block size (problem.page) as a column of trials and winners.
    Rows written before keep NULL and their keys without /p<n>: contiguous-cache problems."""
    for table in ("trials", "winners"):
        _add_column(db, table, "page", int)


def _add_column(db: sqlite_utils.Database, table: str, column: str, kind) -> None:
    """Add a column unless it is there, also when another process added it between the check and
    the ALTER (two tuners opening an older DB at once): then it is there, which is what was asked."""
    if column in db[table].columns_dict:
        return
    try:
        db[table].add_column(column, kind)
    except sqlite3.OperationalError as e:
        if "duplicate column" not in str(e):
            raise


MIGRATIONS = [("001_initial", _m001_initial), ("002_run_process", _m002_run_process),
              ("003_occupancy_key", _m003_occupancy_key), ("004_paged_key", _m004_paged_key)]


def _apply_migrations(db: sqlite_utils.Database) -> None:
    db["_migrations"].create({"name": str, "applied_at": str}, pk="name", if_not_exists=True)
    db["_meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
    done = {r["name"] for r in db["_migrations"].rows}
    for name, fn in MIGRATIONS:
        if name in done:
            continue
        with db.conn:
            fn(db)
            db["_migrations"].insert({"name": name, "applied_at": now()}, replace=True)
    db["_meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")


def schema_version(db: sqlite_utils.Database) -> int | None:
    if "_meta" not in db.table_names():
        return None
    row = db.execute("select value from _meta where key = 'schema_version'").fetchone()
    return int(row[0]) if row else None
