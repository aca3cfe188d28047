"""Seeds from other GPUs: the winners of the nearest problems on GPUs of the same architecture.

A GPU with no winners of its own (an H100 where only an H200's are shipped) starts its searches
from its neighbours': an sm90 winner was compiled for the same instructions and shared-memory
limits, so it is a better first guess than the space's default more often than not (the H200's
winners measured on an H100: docs/results). They are only seeds: each is gated and timed again
here before it can compete, and the search goes on from them.
"""

from __future__ import annotations

import dataclasses
import json

from autoflash import codegen, resources
from autoflash.device import GPUFingerprint
from autoflash.problem import Problem, distance_between
from autoflash.space import Variant, load_space
from autoflash.store import Store

TRANSFER_SEEDS = 3  # of the nearest problems' winners, per family
# float16 and bfloat16 problems run the same tiles and pipelines: one's winner is a fair first guess
# for the other (a factor of 2 further than the same dtype's). float32's is another kernel.
HALVES = {"float16", "bfloat16"}


def architecture(gpu_key: str) -> str:
    """The architecture part of a GPU key ('NVIDIA H200|sm90|132sm|...' -> 'sm90')."""
    parts = gpu_key.split("|")
    return parts[1] if len(parts) > 1 else ""


def sibling_rows(gpu_key: str, store: Store) -> list[dict]:
    """Winner rows of the other GPUs of this GPU's architecture, in the shipped DBs and in `store`
    (the user's DB, where `db merge` or `db import` may have put another GPU's rows)."""
    arch = architecture(gpu_key)
    rows = []
    for path in resources.shipped_databases():
        try:
            shipped = Store(path, readonly=True)
            try:
                rows += [r for r in shipped.winners() if r["gpu_key"] != gpu_key]
            finally:
                shipped.close()
        except Exception:  # an unreadable shipped DB only costs these seeds
            continue
    rows += [r for r in store.winners() if r["gpu_key"] != gpu_key]
    return [r for r in rows if arch and architecture(r["gpu_key"]) == arch]


def transferred_seeds(problem: Problem, family: str, device: GPUFingerprint, rows: list[dict],
                      limit: int = TRANSFER_SEEDS) -> tuple[list[Variant], list[Variant]]:
    """(the winners of this very problem, those of the nearest other problems) among `rows`
    (`sibling_rows`) for one family, valid here, nearest first (`problem.distance_between`, +1 for
    the other half-precision dtype); at most `limit` in all."""
    space = load_space(family)
    ranked = []
    for row in rows:
        try:
            other = Problem.from_key(row["problem"])
        except (ValueError, KeyError, TypeError):
            continue
        # (the same V head dim or none: a winner for another D_v is another rendered kernel's)
        if (other.op, other.causal, other.page, other.head_dim_v) != (problem.op, problem.causal, problem.page,
                                                                       problem.head_dim_v):
            continue
        if other.dtype != problem.dtype and {other.dtype, problem.dtype} != HALVES:
            continue
        if codegen.family_for_hash(problem.op, row["template_hash"], earlier=True) != family:
            continue
        try:
            knobs = json.loads(row["variant"])
            if row["template_hash"] != codegen.template_hash(family) and isinstance(knobs, dict):
                knobs = {**space.legacy, **knobs}  # a row of an earlier template that `replaces` carries over
            variant = space.validate(knobs, problem, device)
        except (ValueError, TypeError):
            continue
        same = other.key == problem.key or dataclasses.replace(other, work=None) == dataclasses.replace(problem, work=None)
        distance = distance_between(other, problem) + (other.dtype != problem.dtype)
        ranked.append((distance, not same, row["problem"], variant))
    ranked.sort(key=lambda x: x[:3])
    seen: dict[Variant, bool] = {}
    for _, near, _, variant in ranked:
        if variant not in seen and len(seen) < limit:
            seen[variant] = near
    return [v for v, near in seen.items() if not near], [v for v, near in seen.items() if near]
