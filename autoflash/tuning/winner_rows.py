"""How a picked winner is stored: one row per problem, and when a vendor kernel (torch SDPA,
autoflash/vendor.py) won, the best own kernel of the same re-measure beside it, so a call that
needs autoflash's own kernel (a forward whose log-sum-exp feeds autoflash's backward, or `autoflash
bench`'s own-kernels column) is still served a tuned one."""

from __future__ import annotations

import json

from autoflash import codegen
from autoflash.space import FAMILIES, families_for, load_space
from autoflash.tuning.results import spread as spread_of
from autoflash.tuning.timing import tflops
from autoflash.tuning.plan_costs import DECIDED_MARGIN
from autoflash.vendor import runs_own_half, tie_margin


def is_vendor(method: str) -> bool:
    """Whether a 'family:variant JSON' method is a vendor family's."""
    return bool(load_space(method.partition(":")[0]).vendor)


def is_all_vendor(method: str) -> bool:
    """Whether a method is a vendor family's with no half of autoflash's own (`runs_own_half`)."""
    return is_vendor(method) and not runs_own_half(json.loads(method.partition(":")[2]))


def vendor_on_a_tie(winner_key: str, finite: list[str], medians: dict, samples: dict) -> str:
    """The method to store: the fastest all-vendor candidate where the fastest one with own code (an
    own kernel, or a vendor pair with an own half) beats it by no more than the tie margin, widened
    to that candidate's round-to-round spread (`vendor.tie_margin`; the dispatcher ranks stored rows
    the same way, with the own row's spread), else `winner_key`."""
    vendors = [m for m in finite if is_all_vendor(m)]
    if not vendors or is_all_vendor(winner_key):
        return winner_key
    vendor_key = min(vendors, key=lambda m: medians[m])
    margin = tie_margin(spread_of(samples.get(winner_key, [])))
    return vendor_key if medians[vendor_key] <= medians[winner_key] * (1 + margin) else winner_key


def vendor_decided(ok: list[str], done: dict) -> list[str] | None:
    """The methods a decided pick re-measures, once: the fastest all-vendor candidate, the fastest
    one with own code and the fastest own kernel (both stored beside it); None where the trials leave
    the pick open. ok: gated candidates' keys, fastest trial first.

    Trial medians DECIDED_MARGIN apart decide it: short timings of one kernel spread by ~10% at most,
    interleaved ones by 1-4% (H100/H200), so three rounds of every finalist would only confirm it. On a
    GPU with no winners most problems are so (22 new problems: own 0.69-0.97x SDPA after the seed
    pass), and their picks took 72 s of a 5-minute run."""
    vendors = [key for key in ok if is_all_vendor(key)]
    mine = [key for key in ok if not is_all_vendor(key)]
    if not vendors or (mine and done[mine[0]]["median_ms"] < done[vendors[0]]["median_ms"] * (1 + DECIDED_MARGIN)):
        return None
    return list(dict.fromkeys([vendors[0], *mine[:1], *[key for key in mine if not is_vendor(key)][:1]]))


def yardstick_twin(column: str, methods: list[str]) -> str | None:
    """The method among `methods` that makes the very call an SDPA yardstick column ('sdpa_cudnn',
    'sdpa_flash': `timing.sdpa_callable`) times: its backend's vendor candidate, whole (the forward, or
    forward and backward through torch autograd); None where none is. The pick times such a column
    once, as that candidate (the cuDNN column beside the cuDNN candidate was the same kernel timed
    twice in every round of nearly every pick)."""
    backend = column.removeprefix("sdpa_")
    for method in methods:
        family, _, variant_json = method.partition(":")
        if family not in FAMILIES or not variant_json:
            continue
        space = load_space(family)
        if space.vendor and space.op in ("fwd", "bwd"):
            knobs = json.loads(variant_json)
            whole = knobs.get("FORWARD", "sdpa") == knobs.get("BACKWARD", "sdpa") == "sdpa"
            if knobs.get("BACKEND") == backend and whole:
                return method
    return None


def pairs_with_own_backward(method: str) -> bool:
    """Whether a 'family:variant JSON' method is a vendor pair whose backward half is autoflash's."""
    family, _, variant_json = method.partition(":")
    return bool(load_space(family).vendor) and json.loads(variant_json).get("BACKWARD") == "autoflash"


def store_winner_rows(store, *, gpu_key, problem, shape, winner_key: str, finite: list[str], medians: dict,
                      samples: dict, spread: float, ms: dict, measured: int, run_id: int,
                      paired_own: str | None = None) -> None:
    """Write the winner (superseding every other family's winner of the problem); after a vendor
    win, first the fastest finite own candidate (superseding the own families' rows only), or
    `paired_own` where the winner's backward half is autoflash's (the own backward it was timed
    with: the dispatcher serves the pair with the own row stored beside it)."""
    families = families_for(problem.op)
    own_families = [f for f in families if not load_space(f).vendor]
    rows = [(winner_key, medians[winner_key], spread, families)]
    if is_vendor(winner_key):
        own = [m for m in finite if not is_vendor(m)]
        if own:
            best_own = min(own, key=lambda m: medians[m])
            if pairs_with_own_backward(winner_key) and paired_own in own:
                best_own = paired_own
            rows.insert(0, (best_own, medians[best_own], spread_of(samples.get(best_own, [])), own_families))
        rows[-1] = (*rows[-1][:3], [f for f in families if f not in own_families])
    for method, median_ms, row_spread, replaced in rows:
        family, _, variant_json = method.partition(":")
        store.set_winner(gpu_key=gpu_key, problem=problem, template_hash=codegen.template_hash(family),
                         variant_json=variant_json, median_ms=median_ms, spread=row_spread,
                         tflops=tflops(shape, median_ms), trials=measured, run_id=run_id,
                         default_ms=ms["default"], sdpa_cudnn_ms=ms["sdpa_cudnn"], sdpa_flash_ms=ms["sdpa_flash"],
                         shape=shape.as_dict(), replaces=[codegen.template_hash(f) for f in replaced])


