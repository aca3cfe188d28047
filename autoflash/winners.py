"""The tuned winners of one GPU, in memory: loaded once from the user's DB and the shipped ones,
each validated against its family's space, looked up by exact bucket or the nearest of the same kind,
with the evidence (own vs SDPA-cuDNN times) the serving policy decides by."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import warnings

from autoflash import codegen
from autoflash.device import GPUFingerprint
from autoflash.problem import Problem
from autoflash.serving_policy import Evidence
from autoflash.space import InvalidVariant, Variant, load_space
from autoflash.vendor import runs_own_half, tie_margin

log = logging.getLogger("autoflash")


class WinnerTable:
    """Tuned winners that apply to one GPU fingerprint and the current templates, in memory.

    Loaded once: the user DB ($AUTOFLASH_DB or ~/.cache/autoflash/autoflash.db) first, then the
    databases shipped in the package's cache/ folder (a user's own tuning wins). Only rows whose
    GPU key and template hash match are kept, and each row's variant is validated against the
    declared search space before it can ever be rendered. A missing, locked, corrupt or
    foreign-version DB costs one warning, never an error.
    """

    def __init__(self, device: GPUFingerprint, paths: list | None = None):
        self.device = device
        self.rows: dict[str, Variant] = {}  # problem key -> variant (of any current family)
        self.origins: dict[str, str] = {}  # problem key -> the DB file its winner came from
        self._ms: dict[str, float] = {}  # problem key -> the winner's rank between families (see _load)
        # The same for autoflash's own families only (a vendor winner is stored beside the best own)
        self.own_rows: dict[str, Variant] = {}
        self.own_origins: dict[str, str] = {}
        self._own_ms: dict[str, float] = {}
        # Stored winners of this GPU that cannot be served (and why): calls of those problems get
        # what serves instead, so a benchmark says so (each one is also a RuntimeWarning)
        self.rejected: list[str] = []
        self.evidence = Evidence()  # own vs SDPA-cuDNN times per problem (serving_policy)
        for path in self.default_paths() if paths is None else paths:
            self._load(path)

    @staticmethod
    def default_paths() -> list:
        from autoflash import resources
        from autoflash.store import default_db_path

        return [default_db_path(), *resources.shipped_databases()]

    def _load(self, path) -> None:
        from autoflash.store import Store, StoreError

        try:
            if not path.is_file():
                return
            # A short busy timeout: a DB locked by a writer costs a model one warning, not a stall.
            store = Store(path, readonly=True, busy_timeout_ms=500)
            try:
                rows = store.winners(self.device.key)
            finally:
                store.close()
        except Exception as e:  # ours, or sqlite3's for a damaged file: never break the caller's model
            detail = str(e) if isinstance(e, (StoreError, OSError, ValueError)) else f"{type(e).__name__}: {e}"
            warnings.warn(f"autoflash: ignoring results DB {path}: {detail}", RuntimeWarning, stacklevel=2)
            self.rejected.append(f"results DB {path}: {detail}")
            return
        decided = set(self.rows)  # an earlier DB (the user's) already decided these problems
        own_decided = set(self.own_rows)
        stale = 0
        for row in rows:
            if row["problem"] in decided and row["problem"] in own_decided:
                continue
            try:
                problem = Problem.from_key(row["problem"])
                family = codegen.family_for_hash(problem.op, row["template_hash"], earlier=True)
                if family is None:
                    stale += 1  # tuned for another version of the templates, not carried over by `replaces`
                    continue
                space, knobs = load_space(family), json.loads(row["variant"])
                if row["template_hash"] != codegen.template_hash(family) and isinstance(knobs, dict):
                    knobs = {**space.legacy, **knobs}  # a row of an earlier space or template (`replaces`)
                variant = space.validate(knobs, problem, self.device)
                if problem.score_variant and not computes_score_variant(family, problem.score_variant):
                    raise InvalidVariant(f"{family} computes no attention variants ({problem.score_variant})")
            except (InvalidVariant, ValueError, KeyError, TypeError) as e:
                warnings.warn(f"autoflash: rejected winner for {row.get('problem')!r} in {path}: {e}",
                              RuntimeWarning, stacklevel=2)
                self.rejected.append(f"{row.get('problem')} in {path}: {e}")
                continue
            self.evidence.add(problem, variant, row)
            ms = row.get("median_ms") if isinstance(row.get("median_ms"), (int, float)) else math.inf
            vendor = load_space(family).vendor
            # Between families own code (an own kernel, or a vendor pair with an own half) must beat
            # an all-vendor kernel by the tie margin, or its measured spread where wider (vendor.py).
            all_vendor = vendor and not runs_own_half(variant.as_dict())
            rank = ms if all_vendor else ms * (1 + tie_margin(row.get("spread")))
            tables = [(self.rows, self.origins, self._ms, decided, rank)]
            if not vendor:
                tables.append((self.own_rows, self.own_origins, self._own_ms, own_decided, ms))
            for winners, origins, medians, done, rank in tables:
                if problem.key in done or (problem.key in winners and medians[problem.key] <= rank):
                    continue  # two families' winners in one DB: the faster one serves
                winners[problem.key], origins[problem.key], medians[problem.key] = variant, str(path), rank
        if stale:  # once per DB opened: a template edit never demotes winners silently
            log.warning(
                "autoflash: %d winner(s) in %s were tuned for earlier templates that no `replaces` record "
                "carries over; their problems get the defaults until retuned", stale, path)

    def lookup(self, problem: Problem, own_only: bool = False) -> tuple[Variant | None, str]:
        """(variant, how) of `explain`: exact bucket, else the nearest of the same kind, else None."""
        return self.explain(problem, own_only)[:2]

    def plain_twin(self, problem: Problem) -> tuple[Variant, str] | None:
        """(variant, why) for a problem with attention variants (window, softcap, ...) nothing was tuned
        for: the own winner of the same problem without them, where its family computes them and the
        variant is valid with them. That kernel was measured fastest for the shape; the variants change
        which blocks it visits and its softmax, not what its tiles and schedule are good at. None: the
        default serves."""
        if not problem.score_variant:
            return None
        plain, how = self.lookup(dataclasses.replace(problem, score_variant=None), own_only=True)
        if plain is None:
            return None
        if plain.as_dict().get("DKDV_KERNEL", "triton") != "triton":
            plain = plain.replace(DKDV_KERNEL="triton")  # (the Gluon dK/dV kernel computes no variants)
        if not computes_score_variant(plain.family, problem.score_variant) or load_space(plain.family).violations(
                plain, problem, self.device):
            return None
        return plain, f"the plain problem's winner ({how})"

    def explain(self, problem: Problem, own_only: bool = False) -> tuple[Variant | None, str, str | None]:
        """(variant, how, DB file it came from): like `lookup`, plus the winner's origin."""
        rows, origins = (self.own_rows, self.own_origins) if own_only else (self.rows, self.origins)
        exact = rows.get(problem.key)
        if exact is not None:
            return exact, "exact", origins[problem.key]
        best, best_distance = None, math.inf
        for key, variant in rows.items():
            p = Problem.from_key(key)
            if (p.op, p.dtype, p.head_dim, p.causal, p.gqa_group, p.page, p.score_variant, p.head_dim_v) != (
                    problem.op, problem.dtype, problem.head_dim, problem.causal, problem.gqa_group, problem.page,
                    problem.score_variant, problem.head_dim_v):
                continue  # (a paged cache's block size, attention variants or V's head dim are never bridged)
            work = work_distance(p.work, problem.work)
            if p.work is not None and work > NEAREST_WORK_MAX:
                continue  # another occupancy regime: the shape's default beats a big-batch winner
            distance = (abs(math.log2(p.seqlen_q / problem.seqlen_q)) + abs(math.log2(p.seqlen_k / problem.seqlen_k))
                        + work)
            if distance < best_distance or (distance == best_distance and key < best[0]):
                best, best_distance = (key, variant), distance
        if best is None:
            return None, "default", None
        return best[1], f"nearest ({best[0]})", origins[best[0]]


def computes_score_variant(family: str, key: str) -> bool:
    """Whether the family renders the attention variants of problem key segment `key` into its kernels."""
    from autoflash import families
    from autoflash.score_variant import ScoreVariant

    return not load_space(family).vendor and families.host_class(family).computes(ScoreVariant.from_key(key))


# A winner serves a problem of another occupancy bucket at most this many buckets (factors of 2 in
# parallel work) away; further, the variant the space's [[defaults]] pick for the shape serves.
NEAREST_WORK_MAX = 1


def work_distance(row_work: int | None, work: int | None) -> float:
    """Occupancy buckets between a stored winner's problem and a call's. A row stored before the key
    had the bucket (None) counts as 1.5 buckets away: still served by the nearest rule whatever the
    call's occupancy, but behind a winner tuned for this occupancy or the next one."""
    if work is None:
        return 0.0
    if row_work is None:
        return 1.5
    return float(abs(row_work - work))
