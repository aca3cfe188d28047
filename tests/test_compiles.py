"""The run's compiles (autoflash/tuning/compiles.py) on a real worker pool, and the short timing
that stops a clearly slower candidate (sandbox.evaluate_variant)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.space import default_variant, load_space
from autoflash.tuning import sandbox
from autoflash.tuning.compiles import Compiles, compile_key

TINY = Shape(1, 2, 2, 37, 37, 64, True, "float16")


def test_problems_that_need_the_same_binary_share_one_compile_key():
    v = default_variant("fwd", TINY.problem, gpu_fingerprint())
    longer = dataclasses.replace(TINY, seqlen_q=53, seqlen_k=53)  # another bucket, the same specialization
    assert compile_key(v, TINY) == compile_key(v, longer)
    for other in (dataclasses.replace(TINY, seqlen_q=64, seqlen_k=64),  # divisible by 16: another binary
                  dataclasses.replace(TINY, causal=False), dataclasses.replace(TINY, dtype="bfloat16"),
                  dataclasses.replace(TINY, heads_q=4, heads_kv=1)):
        assert compile_key(v, other) != compile_key(v, TINY)
    w = next(x for x in load_space(v.family).valid_variants(TINY.problem, gpu_fingerprint()) if x != v)
    assert compile_key(w, TINY) != compile_key(v, TINY)


def crash_on_block_n_32(variant_json, family, shape, rep_ms, device_str):
    """A compile that kills its worker for one variant (the first time: a flaky compiler), else real."""
    import json

    marker = os.environ["AUTOFLASH_TEST_MARKER"]
    if json.loads(variant_json).get("BLOCK_N") == 32 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(9)
    return sandbox.compile_variant(variant_json, family, shape, rep_ms, device_str)


@pytest.mark.interpreter
def test_each_binary_is_compiled_once_and_a_crashed_compile_is_tried_again(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_TEST_MARKER", str(tmp_path / "crashed"))
    device = gpu_fingerprint()
    variants = load_space("triton_fwd").valid_variants(TINY.problem, device)
    a = next(v for v in variants if v["BLOCK_N"] != 32)
    b = next(v for v in variants if v["BLOCK_N"] == 32)
    pool = sandbox.WorkerPool(2, "cpu", {"TRITON_INTERPRET": "1"})
    try:
        compiles = Compiles(pool, crash_on_block_n_32, 1.0, "cpu", 120)
        first = compiles.start_all([(a, TINY), (b, TINY)])
        again = compiles.start([a, a], dataclasses.replace(TINY, seqlen_q=53, seqlen_k=53))  # (compiling: shared)
        assert compiles.requested == 2
        assert [o.status for o in first.result()] == ["ok", "crashed"]
        assert [o.status for o in again.result()] == ["ok", "ok"]
        retried = compiles.start([b], TINY)  # a crash is not remembered: compiled again, now fine
        assert compiles.requested == 3 and [o.status for o in retried.result()] == ["ok"]
        assert compiles.start([b], TINY).done() and compiles.requested == 3
    finally:
        pool.close()


@pytest.mark.interpreter
def test_a_clearly_slower_candidate_is_stopped_after_a_short_timing():
    variant = default_variant("fwd", TINY.problem, gpu_fingerprint())
    try:
        sandbox._apply_context({"bar_ms": 1e-9})  # a best so far no candidate comes near
        stopped = sandbox.evaluate_variant(variant.json(), variant.family, TINY, 40, "cpu")
        assert stopped.status == "ok" and "stopped early" in stopped.message and stopped.ms > 0
        assert stopped.err == stopped.err  # (gated all the same: correctness is never skipped)
        sandbox._apply_context({"bar_ms": 1e9})
        full = sandbox.evaluate_variant(variant.json(), variant.family, TINY, 40, "cpu")
        assert full.status == "ok" and not full.message
    finally:
        sandbox._apply_context({})
    assert sandbox._bar_ms is None


def test_vendor_candidates_are_never_queued_behind_compiles():
    """Torch SDPA has nothing to build: its candidates are ready at once, whatever the pool holds
    (the vendor pass runs while the seeds compile)."""
    class Busy:
        def submit_each(self, *args):
            raise AssertionError("sent to the pool")

    device = gpu_fingerprint()
    device = dataclasses.replace(device, name="NVIDIA H100 80GB HBM3", cc_major=9, cc_minor=0)
    shape = dataclasses.replace(TINY, dtype="bfloat16")
    vendor = load_space("sdpa_fwd").valid_variants(shape.problem, device)
    assert vendor
    compiling = Compiles(Busy(), None, 1.0, "cuda", 60).start(vendor, shape)
    assert compiling.done() and [o.status for o in compiling.result()] == ["ok"] * len(vendor)


def held_on_block_n_32(variant_json, family, shape, rep_ms, device_str):
    """A compile that waits for the test's go-ahead (a marker file) on one variant, else real."""
    import json
    import time

    marker = os.environ["AUTOFLASH_TEST_MARKER"]
    while json.loads(variant_json).get("BLOCK_N") == 32 and not os.path.exists(marker):
        time.sleep(0.05)
    return sandbox.compile_variant(variant_json, family, shape, rep_ms, device_str)


@pytest.mark.interpreter
def test_a_candidate_is_ready_as_soon_as_its_own_compile_is_done(tmp_path, monkeypatch):
    """One batch holds every problem's seeds: the first is measured once its compile is done, not
    once the batch's slowest one is."""
    marker = tmp_path / "go"
    monkeypatch.setenv("AUTOFLASH_TEST_MARKER", str(marker))
    variants = load_space("triton_fwd").valid_variants(TINY.problem, gpu_fingerprint())
    slow = next(v for v in variants if v["BLOCK_N"] == 32)
    fast = next(v for v in variants if v["BLOCK_N"] != 32)
    pool = sandbox.WorkerPool(2, "cpu", {"TRITON_INTERPRET": "1"})
    try:
        compiling = Compiles(pool, held_on_block_n_32, 1.0, "cpu", 120).start_all([(fast, TINY), (slow, TINY)])
        assert compiling.one(0).status == "ok"
        assert not compiling.ready(1) and not compiling.done()  # (held until the marker exists)
        marker.touch()
        assert [o.status for o in compiling.result()] == ["ok", "ok"]
    finally:
        pool.close()


def test_a_backward_problems_pair_halves_compile_first_with_the_seeds():
    """A backward candidate is gated and timed with the own forward (and a vendor forward with the
    own backward): those halves go to the pool first, before the seeds, for the vendor pass."""
    from autoflash.tuning.planned import _compile_seeds
    from autoflash.tuning.planner import Arm, Planner, ProblemPlan
    from autoflash.tuning.search_state import ProblemSearch

    device = gpu_fingerprint()
    bwd = dataclasses.replace(TINY, op="bwd")
    searches, plans = [], []
    for shape in (TINY, bwd):
        default = default_variant(shape.op, shape.problem, device)
        searches.append(ProblemSearch(shape, {default.family: [default]}, [], [default.family], default,
                                      {default.family: 4}, {default.family: [default]},
                                      {"training_forward": None, "training_backward": None}))
        plans.append(ProblemPlan(shape.label(), [Arm(default.family, 4, 1)], op=shape.op))
    sent = []

    class Tuner:
        pass

    tuner = Tuner()
    tuner.device = device
    tuner.compiles = type("Recorder", (), {"start_all": lambda self, items: sent.extend(items)})()
    _compile_seeds(tuner, Planner(plans, 60.0, lambda: 0.0), searches)
    ops = [(v.op, shape.op) for v, shape in sent]
    assert ops[:2] == [("fwd", "fwd"), ("bwd", "bwd")]  # the backward problem's halves, first
    assert sent[0][0] == default_variant("fwd", dataclasses.replace(bwd, op="fwd").problem, device)
    assert [v for v, _ in sent[2:]] == [searches[0].default, searches[1].default]  # then every problem's seed


def test_pair_halves_leave_out_a_forward_that_fits_no_kernel_on_the_gpu():
    """A backward problem whose forward space has no variant on this GPU (fp32 d128 in 64 KiB of
    shared memory) must not stop the run: only the pairs needing that half fail, as they did."""
    import dataclasses as dc
    from types import SimpleNamespace

    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Shape
    from autoflash.space import InvalidVariant, default_variant
    from autoflash.tuning.planned import pair_halves

    t4 = dc.replace(gpu_fingerprint(), name="Tesla T4", cc_major=7, cc_minor=5, sm_count=40, smem_per_block=65536,
                    triton_version="3.2.0")
    shape = Shape(1, 8, 8, 1024, 1024, 128, True, "float32", op="bwd")
    with pytest.raises(InvalidVariant):
        default_variant("fwd", dc.replace(shape, op="fwd").problem, t4)
    ps = SimpleNamespace(problem=shape.problem, shape=shape, context={})
    halves = pair_halves(ps, t4)
    assert [v.family for v, _ in halves] == ["triton_bwd"]


@pytest.mark.interpreter
def test_asking_ahead_of_a_search_without_a_study_compiles_its_next_candidates(tmp_path):
    """A search that takes every valid variant (no study) asked ahead while its own batch compiles:
    the next candidates, not the batch in flight again (which would count as compiled ahead and
    build nothing)."""
    from autoflash.shapes import load_shape_set
    from autoflash.store import Store
    from autoflash.tuning import sandbox
    from autoflash.tuning.compiles import Compiles
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.tuner import Tuner

    options = TuneOptions(trials=100000, budget_s=None, interpret=True, compile_workers=1)
    tuner = Tuner(Store(tmp_path / "t.db"), options)
    tuner.compilers = sandbox.WorkerPool(1, "cpu", {"TRITON_INTERPRET": "1"})
    tuner.compiles = Compiles(tuner.compilers, None, options.rep_ms, "cpu", options.trial_timeout_s)
    ps = tuner.open_problem(load_shape_set("tiny")[0])
    family = ps.own[0]
    assert len(ps.valid[family]) <= ps.caps[family]  # (no study: the case in question)
    started, asked = [], []
    start = tuner.compiles.start

    def recording_start(variants, shape):
        started.append({v.json() for v in variants})
        return start(variants, shape)

    tuner.compiles.start = recording_start

    def then():
        sent = tuner.compiles.requested
        asked.append((tuner.ask_ahead(ps, family, 2), tuner.compiles.requested - sent))

    try:
        tuner.search(ps, ((family, 2),), None, then=then)
    finally:
        tuner.close("finished", 1)
    (n, sent), = asked
    assert n == 2 and sent == 2 and started[0].isdisjoint(started[-1])
