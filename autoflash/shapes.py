"""Shape sets: named TOML files in search_spaces/ (shapes_<name>.toml) or a user's file -> `Shape`s."""

from __future__ import annotations

from autoflash.problem import Shape


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
    shapes = []
    for g in data.get("grid", []):
        for dtype, d, causal, n in itertools.product(g["dtype"], g["head_dim"], g["causal"], g["seqlen"]):
            batch = g["batch"] if "batch" in g else max(1, g["tokens"] // n)
            hq = g["heads_q"] if "heads_q" in g else g["hidden"] // d
            shapes.append(Shape(batch=batch, heads_q=hq, heads_kv=g.get("heads_kv", hq), seqlen_q=n,
                                seqlen_k=n, head_dim=d, causal=causal, dtype=dtype, op=op))
    for s in data.get("shape", []):
        shapes.append(Shape(**{"op": op, "heads_kv": s.get("heads_kv", s["heads_q"]), **s}))
    if not shapes:
        raise ValueError(f"shape set {name_or_path!r} defines no shapes")
    return shapes
