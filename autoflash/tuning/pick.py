"""The pick: one problem's best candidates of all families re-measured together, interleaved (with
the default, the stored winner and torch SDPA), the lowest median stored, unless the stored winner
is within the noise band. A mixin of `tuner.Tuner` (its store, sandbox and options)."""

from __future__ import annotations

import json
import math

from autoflash import codegen
from autoflash.space import Variant, families_for, load_space
from autoflash.tuning import sandbox
from autoflash.tuning.results import ProblemResult, median
from autoflash.tuning.results import spread as spread_of
from autoflash.tuning.sandbox import Outcome
from autoflash.tuning.winner_rows import (is_all_vendor, is_vendor, store_winner_rows, vendor_decided, vendor_on_a_tie,
                                          yardstick_twin)
from autoflash.vendor import tie_margin


class PickWinner:
    def _pick_winner(self, shape, problem, done, default, measured, failed) -> ProblemResult:
        """Re-measure the top candidates of all families interleaved (with the default, the stored
        winner and SDPA); store the lowest median, unless the stored winner is within the noise band.

        Integrity: a trial row read from the DB becomes a candidate only when its family is one of
        the op's current families and its variant is declared in that family's space, canonical and
        valid here; one measured by an earlier run is gated again in this run before it competes.
        Only a candidate whose re-measure median (this run) is finite is promoted: when the
        re-measure fails, the stored winner stays and nothing new is stored."""
        candidates = {}
        for key, r in done.items():
            variant = self._trusted_variant(key, r, problem)
            if variant is not None:
                candidates[key] = variant
        ok = sorted(candidates, key=lambda key: done[key]["median_ms"])
        if not ok:
            return ProblemResult(shape, problem, None, {}, math.nan, measured, failed, "no_valid_candidate")
        default_key = f"{default.family}:{default.json()}"
        incumbent = self._incumbent(problem, set(ok))
        decided = vendor_decided(ok, done)
        if decided:  # SDPA's kernel is clearly ahead: one round confirms it (and times what is stored beside it)
            top = decided + ([incumbent] if incumbent else [])
        else:
            top = self._finalists(ok, default_key, incumbent)
        top = [key for key in dict.fromkeys(top) if self._gated_this_run(key, done[key], candidates[key], shape)]
        if incumbent not in top:
            incumbent = None
        stored = self._stored_winner(problem)
        if not top:
            return ProblemResult(shape, problem, stored, {}, math.nan, measured, failed, "no_valid_candidate")
        methods = list(dict.fromkeys(top + ([default_key] if default_key in ok else [])))
        # A vendor forward is re-measured with the fastest gated own backward, and stored with it.
        paired_own = next((key for key in ok if key in top and not is_vendor(key)), None)
        if problem.op == "bwd" and paired_own:
            self.sandbox.context["training_backward"] = tuple(paired_own.split(":", 1))
        twins = {}  # SDPA yardstick column -> the candidate that is the same call (timed once, as it)
        if not self.opt.interpret and problem.score_variant is None:  # (SDPA computes no attention variants)
            twins = {column: yardstick_twin(column, methods) for column in ("sdpa_cudnn", "sdpa_flash")}
            methods += [column for column, twin in twins.items() if twin is None]
        result = self.sandbox.call(self.opt.remeasure_fn or sandbox.remeasure, (
            methods, problem.op, shape, 1 if decided else self.opt.rounds, self.opt.rep_ms, self.device_str),
            self.opt.trial_timeout_s)
        samples = {} if isinstance(result, Outcome) else result["samples"]
        medians = {m: median(samples.get(m, [])) for m in methods}
        medians.update({column: medians[twin] for column, twin in twins.items() if twin is not None})
        finite = [m for m in top if math.isfinite(medians[m]) and medians[m] > 0]
        if not finite:  # the re-measure failed: keep the stored winner, store nothing
            return ProblemResult(shape, problem, stored, {}, math.nan, measured, failed, "remeasure_failed")
        winner_key = min(finite, key=lambda m: medians[m])
        spread = spread_of(samples.get(winner_key, []))
        # Noise band: a re-tune keeps the stored winner unless a challenger beats it by more than
        # the winner's own round-to-round spread (at least 1%), so winners do not flap on noise.
        band = max(0.01, spread)
        # (Not across the line between SDPA's whole kernels and anything with own code, a pair with an
        # own half too: there a tie goes to SDPA's, `vendor_on_a_tie`.)
        if (incumbent in finite and winner_key != incumbent and is_all_vendor(incumbent) == is_all_vendor(winner_key)
                and medians[incumbent] <= medians[winner_key] * (1 + band)):
            winner_key = incumbent
            spread = spread_of(samples.get(winner_key, []))
        if (tie := vendor_on_a_tie(winner_key, finite, medians, samples)) != winner_key:
            winner_key, spread = tie, spread_of(samples.get(tie, []))
        ms = {"tuned": medians[winner_key], "default": medians.get(default_key, math.nan),
              "sdpa_cudnn": medians.get("sdpa_cudnn", math.nan), "sdpa_flash": medians.get("sdpa_flash", math.nan)}
        store_winner_rows(self.store, gpu_key=self.gpu_key, problem=problem, shape=shape, winner_key=winner_key,
                          finite=finite, medians=medians, samples=samples, spread=spread, ms=ms,
                          measured=measured, run_id=self.run_id, paired_own=paired_own)
        return ProblemResult(shape, problem, candidates[winner_key], ms, spread, measured, failed, "tuned")

    def _finalists(self, ok: list[str], default_key: str, incumbent: str | None) -> list[str]:
        """An open pick's re-measured candidates: the top k by trial time, the gated default, the
        incumbent, and beside the best vendor candidate SDPA's best whole kernel (a pair with an own
        half must beat it by the tie margin) and the best own kernel (stored beside a vendor win)."""
        top = ok[: self.opt.top_k]
        if default_key in ok:
            top.append(default_key)  # a gated default competes in the final round too
        if incumbent:
            top.append(incumbent)
        best_vendor = next((key for key in ok if is_vendor(key)), None)
        if best_vendor:
            top.append(best_vendor)  # the bar: an own kernel is stored only where it beats it
            top += [key for key in ok if is_all_vendor(key)][:1]
            top += [key for key in ok if not is_vendor(key)][:1]
        return top

    def _trusted_variant(self, key: str, row: dict, problem) -> Variant | None:
        """The Variant of a 'family:variant JSON' trial, when it may compete (see `_pick_winner`)."""
        family, _, variant_json = key.partition(":")
        ms = row.get("median_ms")
        if row.get("status") != "ok" or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            return None
        if family not in families_for(problem.op):
            return None
        try:
            space = load_space(family)
            variant = space.check_declared(json.loads(variant_json))
            if variant.json() != variant_json or space.violations(variant, problem, self.device):
                return None
        except (ValueError, TypeError):
            return None
        return variant

    def _gated_this_run(self, key: str, row: dict, variant: Variant, shape) -> bool:
        """Whether the candidate passed the correctness gate in this run: rows this run recorded
        did; a row of an earlier run (a resumed or crafted DB) is evaluated again now."""
        if "id" not in row:  # `_record`'s rows (this run) carry no DB id; rows read from the DB do
            return True
        outcome = self.sandbox.evaluate(variant, shape, rep_ms=self.opt.rep_ms, timeout_s=self.opt.trial_timeout_s,
                                        fn=self.opt.evaluate_fn)
        return outcome.status == "ok" and math.isfinite(outcome.ms) and outcome.ms > 0

    def _stored_winner(self, problem) -> Variant | None:
        for family in families_for(problem.op):
            row = self.store.winner(self.gpu_key, problem.key, codegen.template_hash(family))
            if row:
                try:
                    return load_space(family).check_declared(json.loads(row["variant"]))
                except (ValueError, TypeError):
                    return None
        return None

    def _incumbent(self, problem, passed: set) -> str | None:
        """The stored winner served for this problem, when it passed this run's gate: of the rows of
        the current families the fastest, as the dispatcher picks (after a vendor win the best own
        kernel is stored beside it, and is not the incumbent)."""
        rows = [(row["median_ms"], row.get("spread"), f"{family}:{row['variant']}") for family in families_for(problem.op)
                for row in [self.store.winner(self.gpu_key, problem.key, codegen.template_hash(family))]
                if row and isinstance(row.get("median_ms"), (int, float))]
        # Ranked as the dispatcher ranks them: own code pays the tie margin against SDPA's whole kernels.
        served = min(((ms if is_all_vendor(key) else ms * (1 + tie_margin(spread)), key) for ms, spread, key in rows),
                     default=None)
        return served[1] if served and served[1] in passed else None
