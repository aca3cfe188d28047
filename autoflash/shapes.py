"""Shape sets: named TOML files in search_spaces/ (shapes_<name>.toml) or a user's file -> `Shape`s;
and the other way: `record_shape` appends a shape a model ran to such a file (AUTOFLASH_RECORD)."""

from __future__ import annotations

import os

from autoflash.problem import DTYPES, Shape, unsupported_head_dim

SHAPE_FIELDS = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "causal", "dtype")


def _recorded_already(path: str | os.PathLike, shape: Shape) -> bool:
    """Whether the file holds this shape's [[shape]] table (written by an earlier run of the model);
    a file that does not parse is appended to as it is."""
    import tomllib

    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f).get("shape", [])
    except (OSError, ValueError):
        return False
    return any(isinstance(t, dict) and all(t.get(f) == getattr(shape, f) for f in SHAPE_FIELDS) for t in tables)


def record_shape(path: str | os.PathLike, shape: Shape) -> None:
    """Append `shape` as a [[shape]] table of a shape-set TOML file (made with a header if new),
    unless the file has it already. One write per shape in append mode, so concurrent recorders
    interleave whole tables."""
    import json

    if _recorded_already(path, shape):
        return
    header = "" if os.path.exists(path) else (
        "# Problems a model ran, recorded by autoflash (AUTOFLASH_RECORD). Tune exactly these with\n"
        "#   autoflash tune --ops fwd,bwd --shapes THIS_FILE\n")
    table = "\n[[shape]]\n" + "".join(f"{f} = {json.dumps(getattr(shape, f))}\n" for f in SHAPE_FIELDS)
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
    return unsupported_head_dim(shape.head_dim)


# The keys of a shape file's tables (see `load_shape_set`): a [[shape]] is a Shape's fields
# (heads_kv defaults to heads_q); a [[grid]] crosses lists.
SHAPE_KEYS = SHAPE_FIELDS + ("op", "page")
SHAPE_REQUIRED = tuple(f for f in SHAPE_FIELDS if f != "heads_kv")
GRID_KEYS = ("dtype", "head_dim", "causal", "seqlen", "batch", "tokens", "heads_q", "hidden", "heads_kv")
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
                                seqlen_k=n, head_dim=d, causal=causal, dtype=dtype, op=op))
    for s in data.get("shape", []):
        shapes.append(Shape(**{"op": op, "heads_kv": s.get("heads_kv", s["heads_q"]), **s}))
    for i, shape in enumerate(shapes):
        if reason := shape_problem(shape):
            raise ValueError(f"{name_or_path}: shape {i + 1} ({shape.label()}): {reason}")
    if not shapes:
        raise ValueError(f"shape set {name_or_path!r} defines no shapes")
    return shapes
