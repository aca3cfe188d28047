"""The results DB's schema, as named migrations applied in order (each once, recorded in
`_migrations`), and its version in `_meta`. A migration is additive: files written by an older
autoflash open and keep their rows."""

from __future__ import annotations

import datetime as _dt
import functools
import logging
import sqlite3

import sqlite_utils

from autoflash.store_validate import SCHEMA_VERSION, StoreError

log = logging.getLogger("autoflash")


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


@functools.lru_cache(maxsize=None)
def _reference() -> tuple[dict, dict]:
    """What each migration makes, from running them all on an empty in-memory DB: (migration ->
    [(table, column, declared type)] it adds, table -> its CREATE statement)."""
    db = sqlite_utils.Database(memory=True)
    added, before = {}, set()
    for name, fn in MIGRATIONS:
        fn(db)
        now_there = {(t, c.name, c.type) for t in db.table_names() for c in db[t].columns}
        added[name] = sorted(now_there - before)
        before = now_there
    return added, {t: db[t].schema for t in db.table_names()}


def missing_schema(db: sqlite_utils.Database) -> list[tuple[str, str, str, str]]:
    """(migration, table, column, type) for each column that a migration `_migrations` lists as
    applied made and the file lacks (a damaged or hand-edited DB), in migration order."""
    if "_migrations" not in db.table_names():
        return []
    done = {r["name"] for r in db["_migrations"].rows}
    added, _ = _reference()
    columns = {t: set(db[t].columns_dict) for t in db.table_names()}
    return [(name, table, column, kind) for name, _ in MIGRATIONS if name in done
            for table, column, kind in added[name] if column not in columns.get(table, ())]


def _repair(db: sqlite_utils.Database, missing: list) -> None:
    """Make what `missing_schema` found missing: the tables from their CREATE statement, the
    columns added to the table (migrations are additive: rows there keep their values)."""
    _, schemas = _reference()
    with db.conn:
        for table in dict.fromkeys(t for _, t, _, _ in missing):
            if table not in db.table_names():
                db.execute(schemas[table])
        for _, table, column, kind in missing:
            if column not in db[table].columns_dict:
                db[table].add_column(column, kind)


def _apply_migrations(db: sqlite_utils.Database, where="the results DB") -> None:
    db["_migrations"].create({"name": str, "applied_at": str}, pk="name", if_not_exists=True)
    db["_meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
    if missing := missing_schema(db):  # a migration listed as applied whose columns are not all there
        log.warning("autoflash: repairing %s: it lacks %s", where, describe_missing(missing))
        _repair(db, missing)
    done = {r["name"] for r in db["_migrations"].rows}
    for name, fn in MIGRATIONS:
        if name in done:
            continue
        with db.conn:
            fn(db)
            db["_migrations"].insert({"name": name, "applied_at": now()}, replace=True)
    db["_meta"].upsert({"key": "schema_version", "value": str(SCHEMA_VERSION)}, pk="key")


def describe_missing(missing: list) -> str:
    """For messages: what `missing_schema` found, e.g. 'winners.page (of migration 004_paged_key)'."""
    shown = [f"{t}.{c} (of migration {m})" for m, t, c, _ in missing[:3]]
    return ", ".join(shown) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")


def schema_version(db: sqlite_utils.Database, where="the DB") -> int | None:
    """The `_meta` schema_version (None: no `_meta`); StoreError naming `where` if it is no number."""
    if "_meta" not in db.table_names():
        return None
    row = db.execute("select value from _meta where key = 'schema_version'").fetchone()
    if row is None:
        return None
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise StoreError(f"{where} is damaged: its schema_version (table _meta) is {row[0]!r}, not a "
                         "number") from None
