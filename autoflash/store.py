"""The results database (SQLite through sqlite-utils): schema, migrations, writes, queries.

Tables (open them with `sqlite-utils tables autoflash.db --counts` or datasette):
  gpus      one row per GPU fingerprint key (name, compute capability, SMs, versions)
  runs      one row per `autoflash tune` invocation (started, finished, status, command)
  trials    every measured candidate: problem, variant, status, median ms, spread, TFLOP/s, error
  winners   the chosen variant per (GPU key, problem key, template hash), with its numbers
  _meta     schema_version; `_migrations` lists the named migrations applied

WAL mode and a busy timeout let several tuners write one file at once without losing rows.
This module does not import torch.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import socket
import sqlite3
import time
from typing import Iterable

import sqlite_utils

from autoflash.store_migrations import _apply_migrations, describe_missing, missing_schema, now, schema_version
from autoflash.store_validate import (READABLE_VERSIONS, SCHEMA_VERSION, StoreError, problem_columns,  # noqa: F401
                                      _connect_readonly, _refuse_foreign, _same_file, declared_in_some_family,
                                      validate_export)

BUSY_TIMEOUT_MS = 30_000


def default_db_path(interpret: bool | None = None) -> pathlib.Path:
    """$AUTOFLASH_DB, else $XDG_CACHE_HOME/autoflash/autoflash.db, else ~/.cache/autoflash/autoflash.db.

    Kernels run in Triton's CPU interpreter (`interpret`; None: as TRITON_INTERPRET says) have a DB
    of their own beside it, interpret.db: `autoflash tune --interpret` stores its results (timings
    of the interpreter, no GPU's) there, never among a GPU's winners, and the interpreter's runs
    read them from there. $AUTOFLASH_DB, the user's explicit choice, is used either way."""
    if os.environ.get("AUTOFLASH_DB"):
        return pathlib.Path(os.environ["AUTOFLASH_DB"])
    if interpret is None:
        from autoflash.device import interpreter_enabled

        interpret = interpreter_enabled()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "autoflash" / ("interpret.db" if interpret else "autoflash.db")


# --------------------------------------------------------------------------- the store
class Store:
    """A results database file. `readonly=True` never creates or migrates (for shipped DBs)."""

    def __init__(self, path: str | os.PathLike | None = None, readonly: bool = False,
                 busy_timeout_ms: int = BUSY_TIMEOUT_MS):
        self.path = pathlib.Path(path) if path else default_db_path()
        self.readonly = readonly
        self.busy_timeout_s = timeout = busy_timeout_ms / 1000
        try:
            if readonly:
                if not self.path.is_file():
                    raise StoreError(f"no database at {self.path}")
                conn = _connect_readonly(self.path, timeout)
            else:
                _refuse_foreign(self.path, timeout)  # before anything (WAL, tables) touches the file
                self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(str(self.path), timeout=timeout)
            self.db = sqlite_utils.Database(conn)
            self.db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            version = schema_version(self.db, self.path)
            if version is not None and version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} has schema version {version}; this autoflash reads up to "
                                 f"{SCHEMA_VERSION}: upgrade autoflash to use it")
            if not readonly:
                self._retry(lambda: self.db.enable_wal())
                self._retry(lambda: _apply_migrations(self.db, self.path))
            elif version is None:
                raise StoreError(f"{self.path} is not an autoflash database (no schema version)")
            elif missing := missing_schema(self.db):  # (opened for writing, it is repaired instead)
                raise StoreError(f"{self.path} is damaged: it lacks {describe_missing(missing)}; opening it for "
                                 "writing (e.g. `autoflash db import`, `autoflash tune`) repairs it")
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot use {self.path}: {e}") from None
        except OSError as e:
            raise StoreError(f"cannot use {self.path}: {e}") from None

    def close(self) -> None:
        self.db.close()

    def _retry(self, fn):
        """Run fn, retrying while SQLite answers "locked" or "busy" at once (which it does, e.g.,
        when a read transaction must become a write), for one busy timeout in all: a process that
        holds the lock longer (an open write transaction elsewhere) makes this fail then, with
        SQLite's error, instead of waiting a busy timeout per retry (20 of them: ten minutes)."""
        deadline = time.monotonic() + self.busy_timeout_s
        for i in itertools.count():
            try:
                return fn()
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() >= deadline:
                    raise
                time.sleep(min(0.05 * (i + 1), 1.0))

    def _transaction(self, fn):
        """fn(conn) inside one IMMEDIATE transaction: all of its writes or none (retried when locked)."""
        def run():
            conn = self.db.conn
            if conn.in_transaction:  # this connection's earlier, implicit one: not part of this
                conn.commit()
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
            except BaseException:
                conn.rollback()
                raise
            conn.commit()
            return result
        return self._retry(run)

    # ---- writes (each one its own transaction: a kill -9 loses at most the row in flight)
    def add_gpu(self, fingerprint) -> str:
        row = {"gpu_key": fingerprint.key, **fingerprint.as_dict()}
        self._retry(lambda: self.db["gpus"].upsert(row, pk="gpu_key"))
        return fingerprint.key

    def start_run(self, gpu_key: str, command: str) -> int:
        def insert():
            with self.db.conn:
                return self.db["runs"].insert({"gpu_key": gpu_key, "started_at": now(), "finished_at": None,
                                               "status": "running", "command": command, "problems": 0,
                                               "trials": 0, "host": socket.gethostname(),
                                               "pid": os.getpid()}).last_pk
        return self._retry(insert)

    def mark_dead_runs(self) -> int:
        """Runs still 'running' whose process on this host is gone (killed, crashed) become
        'interrupted'; their trials and winners stay. Runs of other hosts are left as they are."""
        host, dead = socket.gethostname(), []
        for row in self.db["runs"].rows_where("status = 'running' and host = ?", [host]):
            try:
                os.kill(row["pid"], 0)
            except ProcessLookupError:
                dead.append(row["id"])
            except (PermissionError, TypeError, OverflowError):  # alive (another user's) or no pid
                continue
        for run_id in dead:
            self._retry(lambda: self.db["runs"].update(run_id, {"status": "interrupted"}))
        return len(dead)

    def finish_run(self, run_id: int, status: str, problems: int, trials: int) -> None:
        self._retry(lambda: self.db["runs"].update(run_id, {"finished_at": now(), "status": status,
                                                            "problems": problems, "trials": trials}))

    def add_trial(self, *, run_id, gpu_key, problem, template_hash, variant_json, status, median_ms=None,
                  spread=None, tflops=None, err=None, sdpa_err=None, message="", seconds=None, shape=None) -> int:
        row = {"run_id": run_id, "gpu_key": gpu_key, "problem": problem.key, **problem_columns(problem),
               "template_hash": template_hash, "variant": variant_json, "status": status,
               "median_ms": _num(median_ms), "spread": _num(spread), "tflops": _num(tflops), "err": _num(err),
               "sdpa_err": _num(sdpa_err), "message": message, "seconds": _num(seconds),
               "shape": json.dumps(shape) if shape is not None else None, "created_at": now()}

        def insert():
            with self.db.conn:
                return self.db["trials"].insert(row).last_pk
        return self._retry(insert)

    def claim_trial(self, *, run_id, gpu_key, problem, template_hash, variant_json, shape=None) -> int | None:
        """Claim a candidate before measuring it: a 'running' trial row, unless the variant already
        has a row for this problem (measured, failed, or claimed by a concurrent tuner on this DB):
        then None. The check and the insert are one transaction, so two tuners never both measure."""
        def claim(conn):
            taken = conn.execute("select 1 from trials where gpu_key = ? and problem = ? and template_hash = ? "
                                 "and variant = ? limit 1", [gpu_key, problem.key, template_hash, variant_json])
            if taken.fetchone():
                return None
            row = {"run_id": run_id, "gpu_key": gpu_key, "problem": problem.key, **problem_columns(problem),
                   "template_hash": template_hash, "variant": variant_json, "status": "running", "message": "",
                   "shape": json.dumps(shape) if shape is not None else None, "created_at": now()}
            cols = ", ".join(row)
            return conn.execute(f"insert into trials ({cols}) values ({', '.join('?' * len(row))})",
                                list(row.values())).lastrowid
        return self._transaction(claim)

    def finish_trial(self, trial_id: int, *, status, median_ms=None, tflops=None, err=None, sdpa_err=None,
                     message="", seconds=None) -> None:
        """The measurement of a claimed trial."""
        values = {"status": status, "median_ms": _num(median_ms), "tflops": _num(tflops), "err": _num(err),
                  "sdpa_err": _num(sdpa_err), "message": message, "seconds": _num(seconds)}
        self._retry(lambda: self.db["trials"].update(trial_id, values))

    def drop_orphan_claims(self) -> int:
        """Claims ('running' trials) of runs that are not running any more (killed): free again."""
        def drop(conn):
            return conn.execute("delete from trials where status = 'running' and run_id in "
                                "(select id from runs where status != 'running')").rowcount
        return self._transaction(drop)

    def set_winner(self, *, gpu_key, problem, template_hash, variant_json, median_ms, spread, tflops,
                   trials, run_id=None, default_ms=None, sdpa_cudnn_ms=None, sdpa_flash_ms=None, shape=None,
                   replaces: Iterable[str] = ()) -> None:
        """Store a problem's winner. replaces: template hashes of the op's other kernel families,
        whose winners for this problem the new one supersedes (one winner per problem and GPU)."""
        row = {"gpu_key": gpu_key, "problem": problem.key, "template_hash": template_hash,
               **problem_columns(problem), "variant": variant_json, "median_ms": _num(median_ms),
               "spread": _num(spread), "tflops": _num(tflops), "default_ms": _num(default_ms),
               "sdpa_cudnn_ms": _num(sdpa_cudnn_ms), "sdpa_flash_ms": _num(sdpa_flash_ms), "trials": trials,
               "run_id": run_id, "shape": json.dumps(shape) if shape is not None else None, "updated_at": now()}
        others = [h for h in replaces if h != template_hash]

        def write():
            with self.db.conn:  # one transaction: never two current winners, never none
                for h in others:
                    self.db.execute("delete from winners where gpu_key = ? and problem = ? and template_hash = ?",
                                    [gpu_key, problem.key, h])
                self.db["winners"].upsert(row, pk=("gpu_key", "problem", "template_hash"))
        self._retry(write)

    # ---- reads
    def trials_for(self, gpu_key: str, problem_key: str, template_hash: str) -> list[dict]:
        return list(self.db["trials"].rows_where(
            "gpu_key = ? and problem = ? and template_hash = ?", [gpu_key, problem_key, template_hash],
            order_by="id"))

    def winners(self, gpu_key: str | None = None, op: str | None = None, head_dim: int | None = None,
                template_hash: str | None = None) -> list[dict]:
        where, args = [], []
        for col, val in (("gpu_key", gpu_key), ("op", op), ("head_dim", head_dim), ("template_hash", template_hash)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        return list(self.db["winners"].rows_where(" and ".join(where) or None, args, order_by="problem"))

    def winner(self, gpu_key: str, problem_key: str, template_hash: str) -> dict | None:
        rows = list(self.db["winners"].rows_where("gpu_key = ? and problem = ? and template_hash = ?",
                                                  [gpu_key, problem_key, template_hash]))
        return rows[0] if rows else None

    def copy_winners_to(self, path, gpu_key: str | None = None, keep=None) -> int:
        """Write a small DB (same schema) holding only winners and their GPUs, e.g. to ship in cache/.
        keep: optional row filter (see `export_winners`). A file already at `path` is replaced
        whole (never merged into: rows it held must not survive an export); this DB's own file
        (or its -wal/-shm/journal) is refused."""
        path = pathlib.Path(path)
        if _same_file(path, self.path):
            raise StoreError(f"refusing to export onto the source database itself ({self.path})")
        data = self.export_winners(gpu_key, keep)  # validated: a bad row stops the copy before any write
        tmp = path.with_name(path.name + ".partial")
        for stale in (tmp, tmp.with_name(tmp.name + "-wal"), tmp.with_name(tmp.name + "-shm")):
            stale.unlink(missing_ok=True)
        out = Store(tmp)
        try:
            out._transaction(lambda conn: _write_rows(conn, data["gpus"], data["winners"]))
            out.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            out.db.conn.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
        except BaseException:
            out.close()
            tmp.unlink(missing_ok=True)
            raise
        out.close()
        os.replace(tmp, path)
        return len(data["winners"])

    # ---- exchange: export / import / merge (winners and their GPUs; trials stay local history)
    def export_winners(self, gpu_key: str | None = None, keep=None) -> dict:
        """Winners (those for which keep(row) is true, when given) and the GPUs they belong to.
        Every row is validated (StoreError names the first bad row and field)."""
        rows = [r for r in self.winners(gpu_key) if keep is None or keep(r)]
        gpus = [g for g in (self.db["gpus"].get(k) if self.db["gpus"].count_where("gpu_key = ?", [k]) else None
                            for k in sorted({r["gpu_key"] for r in rows})) if g is not None]
        data = {"format": "autoflash-winners", "schema_version": SCHEMA_VERSION, "gpus": gpus, "winners": rows}
        data["gpus"], data["winners"] = validate_export(data)
        return data

    def import_winners(self, data: dict) -> dict:
        """Upsert exported winners, all or nothing: every row is validated first (StoreError names
        the row and field), then one transaction writes them. Idempotent; on a key present in both,
        a row measured here (by a run of this DB) is kept, else the faster row. Imported rows lose
        their run id (another DB's runs name nothing here). Rows whose variant is not in the
        declared search space are rejected (counted, not stored)."""
        gpus, rows = validate_export(data)
        accepted = [{**row, "run_id": None} for row in rows if declared_in_some_family(row)]
        rejected = len(rows) - len(accepted)

        def write(conn) -> dict:
            counts = {"added": 0, "updated": 0, "unchanged": 0, "rejected": rejected}
            upserts = []
            for row in accepted:
                mine = self.winner(row["gpu_key"], row["problem"], row["template_hash"])
                if mine is not None and (mine == row or self._measured_here(mine)
                                         or _ms(mine.get("median_ms")) <= row["median_ms"]):
                    counts["unchanged"] += 1
                    continue
                upserts.append(row)
                counts["updated" if mine is not None else "added"] += 1
            _write_rows(conn, gpus, upserts)
            return counts
        return self._transaction(write)

    def _measured_here(self, row: dict) -> bool:
        """Whether a winners row was measured by a tuning run of this DB on its own GPU (not
        imported): such a row is kept over an imported one, whatever the imported one claims."""
        return row.get("run_id") is not None and self.db["runs"].count_where(
            "id = ? and gpu_key = ?", [row["run_id"], row["gpu_key"]]) > 0

    def merge_from(self, path) -> dict:
        """Import the winners of another autoflash DB file (refused if its schema is foreign, or
        if any of its rows is invalid: nothing is written then)."""
        if _same_file(pathlib.Path(path), self.path):
            raise StoreError(f"refusing to merge {path} into itself")
        other = Store(path, readonly=True)
        try:
            version = schema_version(other.db, path)
            if version not in READABLE_VERSIONS:
                raise StoreError(f"{path} has schema version {version}; this autoflash merges versions "
                                 f"{', '.join(map(str, READABLE_VERSIONS))}")
            try:
                data = other.export_winners()
            except StoreError as e:
                raise StoreError(f"{path}: {e}") from None
            return self.import_winners(data)
        finally:
            other.close()

    def counts(self) -> dict:
        return {t: self.db[t].count for t in ("gpus", "runs", "trials", "winners")}


def _write_rows(conn: sqlite3.Connection, gpus: list[dict], winners: list[dict]) -> None:
    """Upsert validated rows (inside the caller's transaction)."""
    for table, rows, pk in (("gpus", gpus, ("gpu_key",)), ("winners", winners, ("gpu_key", "problem", "template_hash"))):
        for row in rows:
            cols = list(row)
            updates = ", ".join(f"[{c}] = excluded.[{c}]" for c in cols if c not in pk)
            conn.execute(f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in cols)}) "
                         f"VALUES ({', '.join('?' for _ in cols)}) ON CONFLICT({', '.join(pk)}) DO UPDATE SET {updates}",
                         [row[c] for c in cols])


def _ms(x) -> float:
    """A stored median as a comparable number: missing, non-finite or non-positive ones lose."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 \
        else float("inf")


def _num(x):
    """NaN/inf are not JSON and confuse SQL aggregates: store them as NULL."""
    if x is None:
        return None
    x = float(x)
    return x if x == x and abs(x) != float("inf") else None


def rows_to_json(rows: Iterable[dict]) -> str:
    return json.dumps(list(rows), indent=1, sort_keys=True)
