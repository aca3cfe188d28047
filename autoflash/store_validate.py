"""Validation of files and rows that enter the results DB through its doors (import, merge, export copy).

Every row of a batch is checked before anything is written: a problem key that parses (and
columns that agree with it), numbers that are finite and positive where they must be, the
required columns present and no column the schema lacks. The first bad row raises `StoreError`
naming the row and the field. This module does not import torch.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pathlib
import sqlite3
import urllib.parse

WINNER_COLUMNS = ("gpu_key", "problem", "template_hash", "op", "dtype", "head_dim", "causal", "gqa_group",
                  "seqlen_q", "seqlen_k", "work", "page", "variant", "median_ms", "spread", "tflops", "default_ms",
                  "sdpa_cudnn_ms", "sdpa_flash_ms", "trials", "run_id", "shape", "updated_at")
WINNER_REQUIRED = ("gpu_key", "problem", "template_hash", "variant", "median_ms")
GPU_COLUMNS = ("gpu_key", "name", "cc_major", "cc_minor", "sm_count", "smem_per_block", "torch_version",
               "triton_version", "cuda_version", "autoflash_version")
_POSITIVE = ("median_ms",)  # required, finite, > 0
_OPTIONAL_POSITIVE = ("default_ms", "sdpa_cudnn_ms", "sdpa_flash_ms")  # None or finite > 0
_OPTIONAL_NONNEGATIVE = ("spread", "tflops")  # None or finite >= 0
_OPTIONAL_COUNT = ("trials", "run_id")  # None or an integer >= 0
_OPTIONAL_TEXT = ("shape", "updated_at")
# The shortest time a GPU kernel can take, in ms (one microsecond: a launch alone takes longer on
# every GPU). A stored time below it is no measurement: imported, it would win every later conflict.
MIN_KERNEL_MS = 1e-3


# Of the results DB (autoflash.store re-exports it). 2: problem keys may carry the occupancy
# bucket (/w<n>) and rows have a `work` column; 3: decode keys may carry the paged cache's block
# size (/p<n>) and rows have a `page` column. Older files and exports are read as they are.
SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


class StoreError(RuntimeError):
    """A database that cannot be used (corrupt, foreign schema version, unreadable)."""


def _error(what: str, message: str):
    return StoreError(f"{what}: {message}")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _is_count(x) -> bool:
    """An integer SQLite stores (a signed 64-bit one) and that counts something (>= 0)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and 0 <= x < 2 ** 63


def shape_text_problem(text: str) -> str | None:
    """Why a winners row's `shape` (the JSON of the `Shape` it was tuned on) is none, or None."""
    from autoflash.problem import Shape
    from autoflash.shapes import shape_problem

    try:
        fields = json.loads(text)
        shape = Shape(**fields) if isinstance(fields, dict) else None
    except (ValueError, TypeError) as e:
        return f"is not the JSON of a shape ({e})"
    if shape is None:
        return f"must be the JSON object of a shape, got {text[:60]!r}"
    reason = shape_problem(shape)
    return None if reason is None else f"is no valid shape: {reason}"


def problem_columns(problem) -> dict:
    """The columns of a trials or winners row that repeat its problem key (for SQL queries)."""
    return {"op": problem.op, "dtype": problem.dtype, "head_dim": problem.head_dim, "causal": int(problem.causal),
            "gqa_group": problem.gqa_group, "seqlen_q": problem.seqlen_q, "seqlen_k": problem.seqlen_k,
            "work": problem.work, "page": problem.page}


def validate_winner(row, index: int) -> dict:
    """A checked copy of one winners row (problem columns filled from its key)."""
    from autoflash.problem import Problem

    what = f"winners row {index}"
    if not isinstance(row, dict):
        raise _error(what, f"must be an object, got {type(row).__name__}")
    if isinstance(row.get("problem"), str):
        what += f" ({row['problem']!r})"
    unknown = sorted(set(row) - set(WINNER_COLUMNS))
    if unknown:
        raise _error(what, f"unknown column(s) {', '.join(map(repr, unknown))}")
    for col in WINNER_REQUIRED:
        if row.get(col) is None:
            raise _error(what, f"required field {col!r} is missing")
    for col in ("gpu_key", "problem", "template_hash", "variant"):
        if not isinstance(row[col], str) or not row[col]:
            raise _error(what, f"field {col!r} must be a non-empty string, got {row[col]!r}")
    try:
        problem = Problem.from_key(row["problem"])
    except ValueError as e:
        raise _error(what, f"field 'problem': {e}") from None
    cols = problem_columns(problem)
    for col, value in cols.items():
        if row.get(col) is not None and row[col] != value:
            raise _error(what, f"field {col!r} is {row[col]!r} but the problem key says {value!r}")
    try:
        knobs = json.loads(row["variant"])
    except ValueError as e:
        raise _error(what, f"field 'variant' is not JSON ({e})") from None
    if not isinstance(knobs, dict):
        raise _error(what, f"field 'variant' must be a JSON object, got {row['variant']!r}")
    for col in _POSITIVE:
        if not _is_number(row[col]) or row[col] <= 0:
            raise _error(what, f"field {col!r} must be a finite number > 0, got {row[col]!r}")
        if row[col] < MIN_KERNEL_MS:
            raise _error(what, f"field {col!r} is {row[col]!r} ms, below what any GPU kernel takes "
                               f"({MIN_KERNEL_MS} ms): not a measurement")
    for col in _OPTIONAL_POSITIVE + _OPTIONAL_NONNEGATIVE:
        x = row.get(col)
        if x is not None and (not _is_number(x) or x < 0 or (x == 0 and col in _OPTIONAL_POSITIVE)):
            low = "> 0" if col in _OPTIONAL_POSITIVE else ">= 0"
            raise _error(what, f"field {col!r} must be empty or a finite number {low}, got {x!r}")
        if x is not None and col in _OPTIONAL_POSITIVE and x < MIN_KERNEL_MS:
            raise _error(what, f"field {col!r} is {x!r} ms, below what any GPU kernel takes "
                               f"({MIN_KERNEL_MS} ms): not a measurement")
    for col in _OPTIONAL_COUNT:
        x = row.get(col)
        if x is not None and not _is_count(x):
            raise _error(what, f"field {col!r} must be empty or an integer in [0, 2**63), got {x!r}")
    for col in _OPTIONAL_TEXT:
        x = row.get(col)
        if x is not None and not isinstance(x, str):
            raise _error(what, f"field {col!r} must be empty or text, got {x!r}")
    if row.get("shape") is not None and (reason := shape_text_problem(row["shape"])):
        raise _error(what, f"field 'shape' {reason}")
    return {**{c: row.get(c) for c in WINNER_COLUMNS}, **cols}


def validate_gpu(row, index: int) -> dict:
    what = f"gpus row {index}"
    if not isinstance(row, dict):
        raise _error(what, f"must be an object, got {type(row).__name__}")
    unknown = sorted(set(row) - set(GPU_COLUMNS))
    if unknown:
        raise _error(what, f"unknown column(s) {', '.join(map(repr, unknown))}")
    if not isinstance(row.get("gpu_key"), str) or not row["gpu_key"]:
        raise _error(what, f"required field 'gpu_key' must be a non-empty string, got {row.get('gpu_key')!r}")
    for col in ("cc_major", "cc_minor", "sm_count", "smem_per_block"):
        x = row.get(col)
        if x is not None and not _is_count(x):
            raise _error(f"{what} ({row['gpu_key']!r})",
                         f"field {col!r} must be empty or an integer in [0, 2**63), got {x!r}")
    for col in ("name", "torch_version", "triton_version", "cuda_version", "autoflash_version"):
        x = row.get(col)
        if x is not None and not isinstance(x, str):
            raise _error(f"{what} ({row['gpu_key']!r})", f"field {col!r} must be empty or text, got {x!r}")
    return {c: row.get(c) for c in GPU_COLUMNS}


def validate_export(data) -> tuple[list[dict], list[dict]]:
    """(gpus, winners) of an export, every row checked; StoreError at the first bad one."""
    if not isinstance(data, dict) or data.get("format") != "autoflash-winners":
        raise _error("import", "not an autoflash winners export (missing format: autoflash-winners)")
    if data.get("schema_version") not in READABLE_VERSIONS:
        raise _error("import", f"the export has schema version {data.get('schema_version')!r}; this autoflash "
                               f"reads versions {', '.join(map(str, READABLE_VERSIONS))}")
    unknown = sorted(set(data) - {"format", "schema_version", "gpus", "winners"})
    if unknown:
        raise _error("import", f"unknown top-level field(s) {', '.join(map(repr, unknown))}")
    gpus, winners = data.get("gpus", []), data.get("winners", [])
    for name, rows in (("gpus", gpus), ("winners", winners)):
        if not isinstance(rows, list):
            raise _error("import", f"{name!r} must be a list, got {type(rows).__name__}")
    checked_gpus = [validate_gpu(g, i) for i, g in enumerate(gpus)]
    checked = [validate_winner(w, i) for i, w in enumerate(winners)]
    seen = {}
    for i, w in enumerate(checked):
        key = (w["gpu_key"], w["problem"], w["template_hash"])
        if key in seen:
            raise _error(f"winners row {i} ({w['problem']!r})", f"duplicates row {seen[key]} (same GPU, problem, template)")
        seen[key] = i
    return checked_gpus, checked


# --------------------------------------------------------------------------- files
def _connect_readonly(path: pathlib.Path, timeout: float) -> sqlite3.Connection:
    """A read-only connection. `mode=ro` needs the -shm (and, for WAL, may need to create it); on a
    read-only file system or file that fails ('unable to open', 'readonly'), so retry with
    `immutable=1` (which reads the main file as it is, without locks or -wal/-shm)."""
    uri = "file:" + urllib.parse.quote(str(path.absolute()))
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=timeout)
    try:
        conn.execute("select count(*) from sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError as e:
        conn.close()
        text = str(e).lower()
        if "unable to open" not in text and "readonly" not in text and "read-only" not in text:
            raise
    conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=timeout)
    conn.execute("select count(*) from sqlite_master").fetchone()
    return conn


def _refuse_foreign(path: pathlib.Path, timeout: float) -> None:
    """StoreError for an existing SQLite file with tables but no autoflash `_meta` (somebody else's
    database): refused before it is converted to WAL or given tables."""
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
    except OSError:
        return
    conn = _connect_readonly(path, timeout)
    try:
        tables = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
    finally:
        conn.close()
    if tables and "_meta" not in tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise StoreError(f"{path} is not an autoflash database (it has tables {shown} but no _meta): "
                         "refusing to modify it; pass another --db")


def _same_file(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Whether a is b, or b's -wal/-shm/-journal or Optuna journal."""
    try:
        if a.exists() and b.exists() and os.path.samefile(a, b):
            return True
    except OSError:
        pass
    rb = b.resolve()
    return a.resolve() in {rb, *(rb.with_name(rb.name + s) for s in ("-wal", "-shm", "-journal", ".optuna.journal"))}


def declared_in_some_family(row: dict) -> bool:
    """Whether a row's variant uses only declared knobs and values of one of its op's kernel
    families (which family is the dispatcher's business: it reads the template hash)."""
    from autoflash.space import families_for, load_space

    try:
        knobs = json.loads(row["variant"])
    except (ValueError, TypeError):
        return False
    for family in families_for(row["op"]):
        try:
            load_space(family).check_declared(knobs)
            return True
        except ValueError:  # (InvalidVariant is a ValueError)
            continue
    return False
