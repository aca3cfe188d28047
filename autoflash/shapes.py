"""Shape sets: named TOML files in search_spaces/ (shapes_<name>.toml) or a user's file -> `Shape`s;
and the other way: `record_shape` appends a shape a model ran to such a file (AUTOFLASH_RECORD)."""

from __future__ import annotations

import dataclasses
import os

from autoflash.problem import DTYPES, Shape, unsupported_head_dim

# The largest tensor a shape may ask for: 256 TiB, what 48-bit virtual addresses (x86-64, CUDA's
# unified addresses) can map. Larger sizes (or sizes past torch's int64 element count) cannot be
# allocated: every trial of such a shape would fail.
MAX_TENSOR_BYTES = 2 ** 48
SHAPE_FIELDS = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "causal", "dtype")


# A results DB's companions: a shape appended to one is lost, or corrupts the DB.
_DB_COMPANIONS = ("-wal", "-shm", "-journal")


class NotAShapeSet(ValueError):
    """A recording target that holds something else: appending [[shape]] tables would corrupt it."""


def _recorded_tables(path: str | os.PathLike) -> list | None:
    """The [[shape]] tables of a recording target (None: no file yet, or an empty one). Raises
    NotAShapeSet for a file that is not a shape set (a DB, a script, a DB's -wal/-shm/journal)."""
    import tomllib

    name = os.fspath(path)
    refuse = f"{name} is not a shape-set TOML file: refusing to record shapes into it (AUTOFLASH_RECORD)"
    for suffix in _DB_COMPANIONS:
        if name.endswith(suffix) and _is_sqlite(name[:-len(suffix)]):
            raise NotAShapeSet(f"{name} belongs to the SQLite database {name[:-len(suffix)]}: refusing to record "
                               "shapes into it (AUTOFLASH_RECORD)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if not data.strip():
        return None
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        raise NotAShapeSet(refuse) from None
    tables = doc.get("shape", [])
    if set(doc) - {"shape", "grid"} or not isinstance(tables, list):
        raise NotAShapeSet(refuse)
    return tables


def _is_sqlite(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def record_shape(path: str | os.PathLike, shape: Shape) -> None:
    """Append `shape` as a [[shape]] table of a shape-set TOML file (made with a header if new or
    empty), unless the file has it already. One write per shape in append mode, so concurrent
    recorders interleave whole tables. A file that is something else (NotAShapeSet) is never
    written."""
    import json

    tables = _recorded_tables(path)
    if tables and any(isinstance(t, dict) and all(t.get(f) == getattr(shape, f) for f in SHAPE_FIELDS)
                                        and t.get("head_dim_v", t.get("head_dim")) == shape.value_dim
                      for t in tables):
        return
    header = "" if tables is not None else (
        "# Problems a model ran, recorded by autoflash (AUTOFLASH_RECORD). Tune exactly these with\n"
        "#   autoflash tune --ops fwd,bwd --shapes THIS_FILE\n")
    fields = SHAPE_FIELDS + (("head_dim_v",) if shape.head_dim_v is not None else ())
    table = "\n[[shape]]\n" + "".join(f"{f} = {json.dumps(getattr(shape, f))}\n" for f in fields)
    with open(path, "a", encoding="utf-8") as f:
        f.write(header + table)


def shape_problem(shape: Shape) -> str | None:
    """What makes `shape` no shape to tune (sizes that are not positive integers, query heads that
    are no multiple of the KV heads, a head dim or dtype the kernels do not take), or None. A tuned
    winner is stored under the problem's bucket: a bogus shape would stand in for real ones."""
    for field in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim"):
        value = getattr(shape, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{field} must be a positive integer, got {value!r}"
    if shape.heads_q % shape.heads_kv:
        return f"heads_q ({shape.heads_q}) must be a multiple of heads_kv ({shape.heads_kv})"
    if not isinstance(shape.causal, bool):
        return f"causal must be true or false, got {shape.causal!r}"
    if shape.dtype not in DTYPES:
        return f"dtype must be one of {list(DTYPES)}, got {shape.dtype!r}"
    if shape.page is not None and (isinstance(shape.page, bool) or not isinstance(shape.page, int) or shape.page < 1):
        return f"page must be a positive integer, got {shape.page!r}"
    if shape.head_dim_v is not None:
        if isinstance(shape.head_dim_v, bool) or not isinstance(shape.head_dim_v, int) or shape.head_dim_v < 1:
            return f"head_dim_v must be a positive integer, got {shape.head_dim_v!r}"
        if shape.op not in ("fwd", "bwd"):
            return f"head_dim_v (V's head dim of its own) is a forward or backward shape's, not {shape.op!r}"
    if shape.score is not None:
        if shape.op not in ("fwd", "bwd"):
            return f"attention variants ({shape.score_variant.key}) are a forward or backward shape's, not {shape.op!r}"
        if reason := shape.score.problem():
            return reason
    for d in (shape.head_dim, shape.value_dim):
        if reason := unsupported_head_dim(d):
            return reason
    itemsize = 4 if shape.dtype == "float32" else 2
    for name, heads, seqlen in (("q", shape.heads_q, shape.seqlen_q), ("k and v", shape.heads_kv, shape.seqlen_k)):
        size = shape.batch * heads * seqlen * shape.head_dim * itemsize
        if size > MAX_TENSOR_BYTES:
            return (f"{name} would take {size:.3g} bytes (batch {shape.batch} x heads {heads} x seqlen {seqlen} x "
                    f"head_dim {shape.head_dim}), more than any device can hold ({MAX_TENSOR_BYTES:.3g})")
    return None


# The keys of a shape file's tables (see `load_shape_set`): a [[shape]] is a Shape's fields
# (heads_kv defaults to heads_q); a [[grid]] crosses lists.
# The attention variants' values a table may give (`ScoreValues`): window = N (N keys to the left;
# to the right too when not causal) or [left, right]; softcap = 50.0; alibi = true; sinks = true.
SCORE_KEYS = ("window", "softcap", "alibi", "sinks")
SHAPE_KEYS = SHAPE_FIELDS + ("op", "page", "head_dim_v") + SCORE_KEYS  # (head_dim_v: V's own head dim, MLA)
SHAPE_REQUIRED = tuple(f for f in SHAPE_FIELDS if f != "heads_kv")
GRID_KEYS = ("dtype", "head_dim", "causal", "seqlen", "batch", "tokens", "heads_q", "hidden", "heads_kv") + SCORE_KEYS
GRID_REQUIRED = (("dtype",), ("head_dim",), ("causal",), ("seqlen",), ("batch", "tokens"), ("heads_q", "hidden"))


def _entry_problem(entry, keys: tuple) -> str | None:
    """What is wrong with one [[shape]] or [[grid]] table's keys (a misspelt or missing key), or None."""
    import difflib

    if not isinstance(entry, dict):
        return "not a table"
    for key in entry:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"unknown key {key!r}{hint}; the keys are {', '.join(keys)}"
    required = [(f,) for f in SHAPE_REQUIRED] if keys == SHAPE_KEYS else GRID_REQUIRED
    for alternatives in required:
        if not any(a in entry for a in alternatives):
            return f"missing key {' or '.join(repr(a) for a in alternatives)}"
    return None


def _table_score(table: dict, causal) -> dict | None:
    """A table's variant values as `Shape.score` takes them (None: plain). A window of one number N
    reaches N keys back (and N ahead, unless causal: flash-attn's symmetric window)."""
    window = table.get("window", (-1, -1))
    if isinstance(window, int) and not isinstance(window, bool):
        window = (window, 0 if causal is True else window)
    if not (isinstance(window, (list, tuple)) and len(window) == 2 and all(isinstance(w, int) for w in window)):
        raise ValueError(f"window must be a number of keys or [left, right] (-1: unbounded), got {window!r}")
    values = {"window": tuple(window), "softcap": table.get("softcap", 0.0), "alibi": table.get("alibi", False),
              "sinks": table.get("sinks", False)}
    if not isinstance(values["softcap"], (int, float)) or isinstance(values["softcap"], bool):
        raise ValueError(f"softcap must be a number (0: none), got {values['softcap']!r}")
    for flag in ("alibi", "sinks"):
        if not isinstance(values[flag], bool):
            raise ValueError(f"{flag} must be true or false, got {values[flag]!r}")
    return values


def shape_set_names() -> list[str]:
    """Named shape sets: search_spaces/shapes_<name>.toml (standard, gqa, tiny, long, sweep_d64, ...)."""
    from autoflash import resources

    return sorted(p.stem[len("shapes_"):] for p in resources.data_dir("search_spaces").glob("shapes_*.toml"))


def load_shape_set(name_or_path: str, op: str = "fwd") -> list[Shape]:
    """Shapes of a named set (see `shape_set_names`) or of a TOML file with [[grid]]/[[shape]] tables.

    A [[grid]] crosses dtype x head_dim x causal x seqlen lists; batch comes from `tokens`
    (batch = tokens // seqlen) or `batch`; heads from `hidden` (heads = hidden // head_dim) or
    `heads_q` (and `heads_kv`, default heads_q). A [[shape]] gives every Shape field itself.
    """
    import itertools
    import pathlib
    import tomllib

    from autoflash import resources

    if name_or_path.startswith("random:"):
        return random_shapes(*_random_spec(name_or_path), op=op)
    if name_or_path in shape_set_names():
        data = tomllib.loads(resources.read_text("search_spaces", f"shapes_{name_or_path}.toml"))
    else:
        path = pathlib.Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"unknown shape set {name_or_path!r}: not one of {shape_set_names()} nor a file")
        data = tomllib.loads(path.read_text())
    unknown_tables = sorted(set(data) - {"grid", "shape"})
    if unknown_tables:
        raise ValueError(f"{name_or_path}: unknown table(s) {unknown_tables}: a shape set has [[grid]] and [[shape]] tables")
    for table, fields in (("grid", GRID_KEYS), ("shape", SHAPE_KEYS)):
        for i, entry in enumerate(data.get(table, [])):
            if reason := _entry_problem(entry, fields):
                raise ValueError(f"{name_or_path}: [[{table}]] {i + 1}: {reason}")
    shapes = []
    for g in data.get("grid", []):
        for dtype, d, causal, n in itertools.product(g["dtype"], g["head_dim"], g["causal"], g["seqlen"]):
            batch = g["batch"] if "batch" in g else max(1, g["tokens"] // n)
            hq = g["heads_q"] if "heads_q" in g else g["hidden"] // d
            shapes.append(Shape(batch=batch, heads_q=hq, heads_kv=g.get("heads_kv", hq), seqlen_q=n,
                                seqlen_k=n, head_dim=d, causal=causal, dtype=dtype, op=op,
                                score=_table_score(g, causal)))
    for s in data.get("shape", []):
        fields = {k: v for k, v in s.items() if k not in SCORE_KEYS}
        shapes.append(Shape(**{"op": op, "heads_kv": s.get("heads_kv", s["heads_q"]), **fields,
                               "score": _table_score(s, s["causal"])}))
    for i, shape in enumerate(shapes):
        if reason := shape_problem(shape):
            raise ValueError(f"{name_or_path}: shape {i + 1} ({shape.label()}): {reason}")
    _refuse_variant_values_in_one_problem(name_or_path, shapes)
    if not shapes:
        raise ValueError(f"shape set {name_or_path!r} defines no shapes")
    return shapes


def _refuse_variant_values_in_one_problem(name: str, shapes: list[Shape]) -> None:
    """A problem key names its variants, not their values: two shapes of one problem with other values
    (windows of 128 and 4096 keys) would be tuned as one, the first one's values standing for both."""
    first = {}
    for i, shape in enumerate(shapes):
        key = shape.problem.key
        j = first.setdefault(key, i)
        if shapes[j].score != shape.score:
            raise ValueError(f"{name}: shapes {j + 1} and {i + 1} are one problem ({key}) with other variant "
                             f"values ({shapes[j].score.as_dict()} and {shape.score.as_dict()}): tune them in "
                             f"separate runs (a problem key carries no values)")


# Realistic ranges for `random:N[:SEED]` shape sets (models' attention, prefill and training).
RANDOM_HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)
RANDOM_MAX_FLOPS = 2e13  # one forward at most ~30 ms on a Hopper GPU: a bench of 64 shapes stays minutes
RANDOM_STRIDED_SHARE = 1 / 3  # forward/backward shapes with strided (B, N, H, D) q, k, v


def _random_spec(value: str) -> tuple[int, int]:
    """'random:N' or 'random:N:SEED' -> (N, SEED)."""
    parts = value.split(":")
    try:
        count, seed = int(parts[1]), int(parts[2]) if len(parts) > 2 else 0
    except (IndexError, ValueError):
        raise ValueError(f"a random shape set is random:N or random:N:SEED (N shapes, an int seed), got {value!r}") \
            from None
    if len(parts) > 3 or count < 1:
        raise ValueError(f"a random shape set is random:N or random:N:SEED with N >= 1, got {value!r}")
    return count, seed


def random_shapes(count: int, seed: int = 0, op: str = "fwd") -> list[Shape]:
    """`count` problems drawn (reproducibly from `seed`) from realistic ranges: batch 1-16, 1-64 KV
    heads with GQA groups 1-16 (at most 128 query heads), lengths 1-32k, powers of two or not, Nq != Nk
    in one draw of four (bottom-right: Nq <= Nk), head dims 32-256, causal or not, bf16 or fp16;
    shapes past `RANDOM_MAX_FLOPS` are drawn again. Forward and backward shapes (op fwd, bwd, fwdbwd)
    also get a memory layout, contiguous (B, H, N, D) or, one in `RANDOM_STRIDED_SHARE`, strided
    (B, N, H, D) q, k, v as models' attention layers pass them (`Shape.layout` "bnhd"); decode shapes
    stay contiguous. The layouts come from a stream of their own (seeded from `seed` too), so a seed's
    sizes are those it drew before layouts were drawn."""
    import random

    rng = random.Random(seed)
    layouts = random.Random(f"{seed}:layout") if op in ("fwd", "bwd", "fwdbwd") else None
    shapes: list[Shape] = []
    while len(shapes) < count:
        heads_kv = rng.choice((1, 2, 4, 8, 8, 16, 32, 64))
        group = rng.choice([g for g in (1, 1, 2, 3, 4, 5, 7, 8, 16) if heads_kv * g <= 128])
        n_k = int(2 ** rng.uniform(0, 15)) if rng.random() < 0.5 else 2 ** rng.randint(7, 15)
        n_q = n_k if rng.random() < 0.75 else max(1, int(n_k * rng.uniform(0.05, 1.0)))
        shape = Shape(batch=rng.randint(1, 16), heads_q=heads_kv * group, heads_kv=heads_kv, seqlen_q=n_q,
                      seqlen_k=n_k, head_dim=rng.choice(RANDOM_HEAD_DIMS), causal=rng.random() < 0.5,
                      dtype=rng.choice(("bfloat16", "float16")), op=op)
        if shape.flops() <= RANDOM_MAX_FLOPS and shape_problem(shape) is None:
            if layouts is not None and layouts.random() < RANDOM_STRIDED_SHARE:
                shape = dataclasses.replace(shape, layout="bnhd")
            shapes.append(shape)
    return shapes
