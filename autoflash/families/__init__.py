"""The kernel families, one folder each: `kernel.py.jinja` (device code only), `host.py` (the launch,
a subclass of `base.Family`), `space.toml` (knobs, constraints, defaults) and `replaces.toml` (earlier
template hashes whose stored winners are this family's kernels unchanged). Shared parts (Jinja macros
and includes of device code, @triton.jit device functions the kernel modules import, host helpers) are
in `_shared/`, part of every family's template hash.

Importing this package imports no torch and no triton: the space layer reads the folders' data.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import tomllib

FOLDER = pathlib.Path(__file__).resolve().parent
SHARED = "_shared"  # the includes and host helpers every family may use

# family name -> "module:class" of its host (a `base.Family` subclass). A new family: its folder, one
# line here and one in `autoflash.space.FAMILIES`.
HOSTS = {
    "triton_fwd": "autoflash.families.triton_fwd.host:TritonForward",
    "triton_bwd": "autoflash.families.triton_bwd.host:TritonBackward",
    "gluon_sm90_fwd": "autoflash.families.gluon_sm90_fwd.host:GluonSm90Forward",
    "triton_decode": "autoflash.families.triton_decode.host:TritonDecode",
}


@functools.lru_cache(maxsize=None)
def host_class(family: str):
    """The family's host class (imports its host module, hence torch and triton)."""
    from autoflash.families.base import Family

    module, _, name = HOSTS[family].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Family)) or cls.name != family:
        raise TypeError(f"{HOSTS[family]} is not the host of family {family!r} (a base.Family subclass named so)")
    return cls


def score_variant_default(problem, device):
    """The default variant of a problem with attention variants (window, softcap, ALiBi, sinks): the default
    of a family whose `default_for_score_variants` expression holds for the problem (where it was measured
    faster than the op's default family for them) and that computes the variants, where it is valid on
    this device; else the op's default. What serves such a problem nothing was tuned for, and the
    tuner's baseline for it."""
    from autoflash.score_variant import ScoreVariant
    from autoflash.space import InvalidVariant, default_variant, device_names, evaluate, families_for, load_space

    score = ScoreVariant.from_key(problem.score_variant)
    for family in families_for(problem.op):
        space = load_space(family)
        when = "" if space.vendor else host_class(family).default_for_score_variants
        if when and host_class(family).computes(score) and evaluate(when, device_names(problem, device)):
            try:
                return space.nearest_valid(space.default_for(problem, device), problem, device)
            except InvalidVariant:  # (no valid variant here: another GPU, another Triton)
                continue
    return default_variant(problem.op, problem, device)


def hashed_source(family: str) -> str:
    """What a family's template hash covers: every template and Python file of its folder (kernel
    templates, host module) and of `_shared/` (includes, host helpers). The host decides the launch
    arguments, so it is part of what a stored winner ran; `space.toml` and `replaces.toml` are not."""
    files = [p for folder in (FOLDER / family, FOLDER / SHARED) for p in sorted(folder.iterdir())
             if p.suffix in (".jinja", ".py") and p.is_file()]
    return "".join(f"# {p.parent.name}/{p.name}\n" + p.read_text(encoding="utf-8") for p in files)


@functools.lru_cache(maxsize=None)
def replacements(family: str) -> tuple[dict, ...]:
    """The family's `replaces.toml` records: {"hash": earlier template hash, "by": the template hash
    it was checked against, "evidence": how the kernels were shown to be the same}."""
    path = FOLDER / family / "replaces.toml"
    if not path.is_file():
        return ()
    records = tuple(tomllib.loads(path.read_text(encoding="utf-8")).get("replaces", ()))
    for r in records:
        if not (isinstance(r.get("hash"), str) and isinstance(r.get("by"), str) and r.get("evidence")):
            raise ValueError(f"{path}: each [[replaces]] needs hash, by and evidence, got {r!r}")
    return records


def replaced_hashes(family: str, current: str) -> tuple[str, ...]:
    """Earlier template hashes whose winners are served as `family`'s today (its hash `current`):
    a record checked against `current`, and, transitively, the records that one was checked against.
    A record for another hash (the template changed since, unchecked) carries nothing over."""
    by = {}
    for r in replacements(family):
        by.setdefault(r["by"], []).append(r["hash"])
    carried, todo = [], [current]
    while todo:
        for earlier in by.get(todo.pop(), ()):
            if earlier not in carried and earlier != current:
                carried.append(earlier)
                todo.append(earlier)
    return tuple(carried)
