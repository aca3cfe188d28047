"""Warm-start seeds of a search: the default, this problem's winners under earlier templates (this
DB's or shipped in cache/), heavy-first twins for causal problems, other problems' winners; and the
stored own winners a backward problem's candidates are paired with (its forward's, its own)."""

from __future__ import annotations

import dataclasses
import json

from autoflash import codegen, resources
from autoflash.device import GPUFingerprint
from autoflash.problem import Problem, Shape
from autoflash.space import Space, Variant, load_space
from autoflash.store import Store


def seed_variants(default: Variant, problem: Problem, device: GPUFingerprint, thash: str, rows: list[dict],
                  budget: int, transferred: tuple[list, list] = ((), ())) -> list[Variant]:
    """The default and known-good variants: the winner served today and its twin with the other
    DQ_OVERLAP (backward); this problem's winner on another GPU of the same architecture (before
    the default: a neighbour's winner beats the default more often than not); this problem's
    winners under earlier versions of the template (a warm start after a template edit; knobs they
    lack take the default's values); the nearest problems' winners on those GPUs; for a causal
    problem, the heavy_first grid order of the default and of the first earlier winner; then other
    problems' winners of the same dtype and head dim. rows: winners rows of this GPU (this DB's and
    the shipped ones); transferred: (exact, nearest) of `transfer.transferred_seeds`."""
    space = load_space(default.family)
    rows = [w for w in rows if w["op"] == problem.op and w["head_dim"] == problem.head_dim
            and _value_dim(w) == problem.head_dim_v]  # (a V of another head dim is another kernel's winner)
    # The winner served today for this very problem (this DB's or shipped) comes first: a short
    # search must never end below what users already get.
    current = current_winners(problem, device, thash, rows)
    # (rows of the op's other current families are another space's knobs: not seeds here)
    earlier = [w for w in rows if w["problem"] in same_problem_keys(problem) and w["template_hash"] != thash
               and codegen.family_for_hash(problem.op, w["template_hash"]) is None]
    others = [w for w in rows if w["problem"] != problem.key and w["template_hash"] == thash
              and w["dtype"] == problem.dtype]
    exact, near = transferred
    known = current + list(exact) + [default] + _valid_variants(earlier, default, problem, device, thash, space)
    seeds = current + _overlap_twins(current[:1], problem, device, space) + known + list(near)
    seeds += _heavy_first_twins(known[:2], problem, device, space)
    seeds += _valid_variants(others, default, problem, device, thash, space)
    return list(dict.fromkeys(seeds))[: max(2, budget // 4)]


def current_winners(problem: Problem, device: GPUFingerprint, thash: str, rows: list[dict]) -> list[Variant]:
    """The valid winners stored for this problem under this template hash (rows: this GPU's)."""
    space = load_space(codegen.family_for_hash(problem.op, thash) or problem.op)
    mine = [w for w in rows if w["problem"] in same_problem_keys(problem) and w["template_hash"] == thash]
    return _valid_variants(mine, None, problem, device, thash, space)


def _value_dim(row: dict) -> int | None:
    """The head_dim_v of a winners row's problem (None for plain rows and unparsable keys)."""
    try:
        return Problem.from_key(row["problem"]).head_dim_v
    except (ValueError, KeyError, TypeError):
        return None


def same_problem_keys(problem: Problem) -> tuple[str, ...]:
    """The problem's key, and its key without the occupancy bucket (rows stored before the key had
    one, which the dispatcher serves to this problem unless a closer winner exists)."""
    return (problem.key, dataclasses.replace(problem, work=None).key)


def training_forward(shape: Shape, device: GPUFingerprint, sources: list[list[dict]]) -> tuple[str, str] | None:
    """For a backward problem, the own forward its own kernels serve with in training (the
    dispatcher's own-only forward): the stored winner of the same shape's forward problem, from the
    first of `sources` (winner rows of this GPU: this DB's, then the shipped ones) that has one, its
    exact key before one without the occupancy bucket, the fastest own family's, as (family,
    variant JSON). None where none is stored (the forward default times the candidates then: tune
    the forward problems first) or for another op."""
    return stored_own_winner(shape, "fwd", device, sources) if shape.op == "bwd" else None


def training_backward(shape: Shape, device: GPUFingerprint, sources: list[list[dict]]) -> tuple[str, str] | None:
    """For a backward problem, the own backward a vendor forward is paired with (a vendor candidate
    whose BACKWARD is "autoflash": the dispatcher serves it with the own-only backward winner): the
    stored own winner of this very problem, looked up as `training_forward`. None where none is
    stored (the backward default stands in) or for another op."""
    return stored_own_winner(shape, "bwd", device, sources) if shape.op == "bwd" else None


def stored_own_winner(shape: Shape, op: str, device: GPUFingerprint, sources: list[list[dict]]) -> tuple[str, str] | None:
    """The stored winner of `shape`'s problem of `op` among autoflash's own families, from the first
    of `sources` that has one (exact key before one without the occupancy bucket, then the fastest),
    as (family, variant JSON); None where none is stored."""
    problem = dataclasses.replace(shape, op=op).problem_on(device.sm_count)
    keys = same_problem_keys(problem)
    for rows in sources:
        found = []
        for row in rows:
            family = codegen.family_for_hash(op, row["template_hash"])
            ms = row.get("median_ms")
            if row["problem"] not in keys or family is None or load_space(family).vendor or not isinstance(ms, (int, float)):
                continue
            try:
                variant = load_space(family).validate(json.loads(row["variant"]), problem, device)
            except (ValueError, TypeError):
                continue
            found.append((row["problem"] != problem.key, ms, family, variant.json()))
        if found:
            return min(found)[2:]
    return None


def read_shipped_winners(gpu_key: str) -> list[dict]:
    """This GPU's winners in the DBs shipped in cache/ (any template version)."""
    rows = []
    for path in resources.shipped_databases():
        try:
            shipped = Store(path, readonly=True)
            try:
                rows += shipped.winners(gpu_key)
            finally:
                shipped.close()
        except Exception:  # an unreadable shipped DB only costs the warm start
            continue
    return rows


def _valid_variants(rows: list[dict], default: Variant | None, problem: Problem, device: GPUFingerprint, thash: str,
                    space: Space) -> list[Variant]:
    """The rows' variants that are valid for this problem; a row of an earlier template gets, for
    each knob it lacks, the value that renders its kernel (the space's `[legacy]`), else the
    default's."""
    variants = []
    for w in rows:
        try:
            knobs = json.loads(w["variant"])
            if isinstance(knobs, dict) and default is not None and w["template_hash"] != thash:
                knobs = {k: knobs.get(k, space.legacy.get(k, value)) for k, value in default.as_dict().items()}
            variants.append(space.validate(knobs, problem, device))
        except ValueError:
            continue
    return variants


def _overlap_twins(variants: list[Variant], problem: Problem, device: GPUFingerprint, space: Space) -> list[Variant]:
    """The same variants with the other DQ_OVERLAP (the backward's dQ kernel beside its dK/dV kernel,
    or after it): measured on an H200 (docs/results/2026-12-03-h200-concurrent-dq.md) it moved the
    stored winners' backward by -8% to +8%, a difference a search that starts from them should see first."""
    twins = []
    for v in variants:
        for value in space.knobs.get("DQ_OVERLAP", ()):
            twin = v.replace(DQ_OVERLAP=value)
            if twin != v and not space.violations(twin, problem, device):
                twins.append(twin)
    return twins


def _heavy_first_twins(variants: list[Variant], problem: Problem, device: GPUFingerprint,
                       space: Space) -> list[Variant]:
    """The same variants launching their heaviest causal programs first: measured on an H200
    (docs/results/2026-11-30-h200-retune.md) that order gained up to 18% in the causal forward
    (not on every shape) and 34-37% in a GQA backward, yet a short search often never samples it."""
    if not problem.causal or "heavy_first" not in space.knobs.get("GRID_ORDER", ()):
        return []
    twins = []
    for v in variants:
        twin = v.replace(GRID_ORDER="heavy_first")
        if not space.violations(twin, problem, device):
            twins.append(twin)
    return twins
