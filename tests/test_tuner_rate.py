"""What the measuring worker spends between the candidates it learns from: timing inputs drawn once
per problem (not per timing), torch's whole SDPA backends stopped before their gate where a short
timing shows them clearly slower, and the pick's SDPA yardstick columns timed once where a candidate
is the same call. The decisions are unchanged: these tests hold them to that."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from autoflash import codegen
from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.reference import make_inputs, output_grad
from autoflash.space import default_variant, load_space
from autoflash.store import Store
from autoflash.tuning import gate, sandbox, timing, yardsticks
from autoflash.tuning.winner_rows import yardstick_twin
from autoflash.vendor import SdpaKernel

DEVICE = gpu_fingerprint()
SHAPE = Shape(batch=2, heads_q=4, heads_kv=2, seqlen_q=40, seqlen_k=40, head_dim=32, causal=True, dtype="float32")


def sdpa_key(op: str, backend: str, forward: str = "sdpa", backward: str = "sdpa") -> str:
    knobs = {"BACKEND": backend} if op == "fwd" else {"BACKEND": backend, "FORWARD": forward, "BACKWARD": backward}
    variant = load_space(f"sdpa_{op}").check_declared(knobs)
    return f"{variant.family}:{variant.json()}"


@pytest.fixture(autouse=True)
def _fresh_worker_state():
    timing._inputs.clear()
    sandbox._gate_cache.clear()
    yardsticks.clear()
    sandbox._apply_context({})
    yield
    timing._inputs.clear()
    sandbox._gate_cache.clear()
    yardsticks.clear()
    sandbox._apply_context({})


def _counting(monkeypatch, module, name: str = "make_inputs") -> list:
    """Record the shapes `module.<name>` is called with (the call still happens)."""
    calls, real = [], getattr(module, name)

    def counted(shape, *args, **kwargs):
        calls.append(shape)
        return real(shape, *args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


# --------------------------------------------------------------------------- timing inputs
def test_timing_inputs_are_drawn_once_per_problem_with_the_values_they_always_had(monkeypatch):
    drawn = _counting(monkeypatch, timing)
    q, k, v = timing.timing_inputs(SHAPE, "cpu")
    again = timing.timing_inputs(SHAPE, "cpu")
    assert all(a is b for a, b in zip((q, k, v), again)) and len(drawn) == 1
    for mine, fresh in zip((q, k, v), make_inputs(SHAPE, "cpu", seed=timing.TIMING_SEED)):
        assert torch.equal(mine, fresh) and mine.stride() == fresh.stride()
    bwd = dataclasses.replace(SHAPE, op="bwd")
    assert torch.equal(timing.timing_grad(bwd, "cpu"), output_grad(bwd, "cpu", seed=timing.GRAD_SEED))
    assert timing.timing_grad(bwd, "cpu") is timing.timing_grad(bwd, "cpu")
    other = dataclasses.replace(SHAPE, seqlen_q=48, seqlen_k=48)
    assert timing.timing_inputs(other, "cpu")[0].shape[2] == 48 and len(drawn) == 2


def test_the_input_cache_is_bounded_in_bytes_and_drops_the_least_recently_used(monkeypatch):
    one = sum(t.numel() * t.element_size() for t in make_inputs(SHAPE, "cpu"))
    monkeypatch.setattr(timing, "CACHED_INPUT_BYTES", 2 * one)
    drawn = _counting(monkeypatch, timing)
    shapes = [dataclasses.replace(SHAPE, batch=SHAPE.batch * (1 + i)) for i in range(3)]  # (1x, 2x, 3x one's bytes)
    timing.timing_inputs(shapes[0], "cpu")
    timing.timing_inputs(shapes[0], "cpu")
    assert len(drawn) == 1
    timing.timing_inputs(shapes[1], "cpu")  # 1x + 2x > the bound: the first goes before it is drawn
    assert len(timing._inputs) == 1
    timing.timing_inputs(shapes[2], "cpu")  # larger than the bound alone: kept alone
    assert len(timing._inputs) == 1 and len(drawn) == 3
    held = sum(t.numel() * t.element_size() for ts in timing._inputs.values() for t in ts)
    assert held == 3 * one


def test_the_input_cache_holds_an_eighth_of_the_device_unless_set(monkeypatch):
    monkeypatch.setattr(timing, "CACHED_INPUT_BYTES", None)
    assert timing._input_bound("cpu") == timing.MIN_CACHED_INPUT_BYTES
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        assert timing._input_bound("cuda:0") == max(timing.MIN_CACHED_INPUT_BYTES, total // 8)
    monkeypatch.setattr(timing, "CACHED_INPUT_BYTES", 12345)
    assert timing._input_bound("cpu") == 12345


@pytest.mark.gpu
def test_timing_inputs_are_drawn_on_the_gpu_the_same_each_time():
    q, k, v = timing.timing_inputs(SHAPE, "cuda")
    again = make_inputs(SHAPE, "cuda", seed=timing.TIMING_SEED, draw_on_device=True)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again)) and q.is_cuda
    host = make_inputs(SHAPE, "cuda", seed=timing.TIMING_SEED)  # (the host's draw: other values, same law)
    assert not torch.equal(q, host[0]) and abs(q.float().std().item() - 1) < 0.1


@pytest.mark.gpu
def test_a_long_call_is_estimated_from_one_timed_call_a_short_one_from_several():
    calls = []

    def long_call():  # ~5 ms on a GPU clocked near 2 GHz
        calls.append("long")
        torch.cuda._sleep(10_000_000)

    def short_call():
        calls.append("short")
        torch.cuda._sleep(10_000)
    spin, ms, host_s = timing._spin_and_estimate(long_call)
    assert calls.count("long") == 2 and ms >= timing.LONG_CALL_MS and spin > 0
    spin, ms, host_s = timing._spin_and_estimate(short_call)
    assert calls.count("short") == 10 and 0 < ms < timing.LONG_CALL_MS
    assert 3 < timing.device_ms(long_call, rep_ms=20) < 20  # (the timing itself still repeats it)


def test_a_worker_writes_its_profile_where_asked(tmp_path, monkeypatch):
    """`AUTOFLASH_PROFILE_WORKERS=DIR`: each worker writes the cProfile of its tasks to DIR."""
    import pstats

    monkeypatch.setenv(sandbox.PROFILE_ENV, str(tmp_path))
    with sandbox.Sandbox("cpu", {"TRITON_INTERPRET": "1"}) as sb:
        assert sb.call(sandbox.ping, (), timeout_s=120)["status"] == "ok"
    (written,) = tmp_path.glob("worker-*.prof")
    assert any(func[2] == "ping" for func in pstats.Stats(str(written)).stats)


def test_a_candidates_two_timings_and_a_pick_share_one_draw(monkeypatch):
    """The short timing, the full one and the pick's re-measure of a problem draw its inputs once
    (they were drawn per timing, on the host, while the GPU waited)."""
    drawn = _counting(monkeypatch, timing)
    kernel = SdpaKernel(load_space("sdpa_fwd").check_declared({"BACKEND": "flash"}))
    for rep_ms in (10, 40):
        assert timing.time_variant(kernel, SHAPE, "cpu", rep_ms=rep_ms) > 0
    methods = [sdpa_key("fwd", "flash"), sdpa_key("fwd", "math")]
    samples = sandbox.remeasure(methods, "fwd", SHAPE, 2, 1, "cpu")["samples"]
    assert all(len(samples[m]) == 2 and all(x > 0 for x in samples[m]) for m in methods)
    assert len(drawn) == 1


def test_a_compile_builds_for_the_timing_shape_without_drawing_its_inputs(monkeypatch):
    drawn = _counting(monkeypatch, sandbox)
    configs = sandbox._gate_and_timing_inputs(SHAPE, torch.device("cpu"))
    assert SHAPE not in drawn and len(drawn) == len(configs) - 1  # (the gate's small shapes only)
    q, k, v, offset, score = configs[-1]
    for mine, drawn_as_timed in zip((q, k, v), make_inputs(SHAPE, "cpu", seed=timing.TIMING_SEED)):
        assert (mine.shape, mine.stride(), mine.dtype) == (drawn_as_timed.shape, drawn_as_timed.stride(),
                                                            drawn_as_timed.dtype)
    assert offset == 0 and score is None


# --------------------------------------------------------------------------- the gate's yardsticks
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_the_gates_reference_and_sdpas_error_are_computed_once_per_gate_shape(monkeypatch, op):
    """A second variant of the same problem is gated against the same reference and SDPA error,
    not recomputed; a wrong kernel still fails with them kept."""
    shape = dataclasses.replace(SHAPE, op=op)
    yard = _counting(monkeypatch, gate, "sdpa_error" if op == "fwd" else "sdpa_grads")
    space = load_space(op)
    first = default_variant(op, shape.problem, DEVICE)
    other = next(v for v in space.valid_variants(shape.problem, DEVICE) if v != first)
    for variant in (first, other):
        result = gate.check(codegen.load(variant), shape, "cpu")
        assert result.passed and result.sdpa_err > 0
    assert len(yard) == len(gate.gate_shapes(shape))  # (once per gate shape: the first variant's)
    real_run = gate.run_variant if op == "fwd" else None
    if op == "fwd":
        monkeypatch.setattr(gate, "run_variant", lambda *a, **kw: tuple(t * 1.01 for t in real_run(*a, **kw)))
        assert not gate.check(codegen.load(other), shape, "cpu").passed


def test_a_kernel_that_writes_into_its_inputs_fails_and_leaves_the_kept_reference_clean(monkeypatch):
    """The reference is computed before the launch: a kernel that scales its q in place (then attends
    to it correctly) fails, and the next kernel is checked against the inputs as drawn."""
    real_run = gate.run_variant

    def writes_q(kernel, q, *args, **kwargs):
        q.mul_(1.5)
        return real_run(kernel, q, *args, **kwargs)
    kernel = codegen.load(default_variant("fwd", SHAPE.problem, DEVICE))
    monkeypatch.setattr(gate, "run_variant", writes_q)
    assert not gate.check(kernel, SHAPE, "cpu").passed
    monkeypatch.setattr(gate, "run_variant", real_run)
    assert gate.check(kernel, SHAPE, "cpu").passed


# --------------------------------------------------------------------------- vendor backends
def _gate_called(monkeypatch) -> list:
    calls = []

    def gate(kernel, shape, device, *args):
        calls.append(kernel)
        raise RuntimeError("the gate ran")
    monkeypatch.setattr(sandbox, "check", gate)
    return calls


def test_a_whole_sdpa_backend_clearly_slower_is_stopped_before_its_gate(monkeypatch):
    gated = _gate_called(monkeypatch)
    flash = load_space("sdpa_fwd").check_declared({"BACKEND": "flash"})
    sandbox._apply_context({"bar_ms": 1e-9})  # a best so far no candidate comes near
    out = sandbox.evaluate_variant(flash.json(), flash.family, SHAPE, 40, "cpu")
    assert out.status == "slower" and out.ms > 0 and "before its gate" in out.message and not gated
    assert out.status not in sandbox.FAILED_STATUSES  # (measured, not failed: just no candidate)
    sandbox._apply_context({"bar_ms": 1e9})  # not slower: gated as every candidate
    out = sandbox.evaluate_variant(flash.json(), flash.family, SHAPE, 40, "cpu")
    assert out.status == "runtime_error" and "the gate ran" in out.message and len(gated) == 1
    sandbox._apply_context({})  # no best yet: gated first
    out = sandbox.evaluate_variant(flash.json(), flash.family, SHAPE, 40, "cpu")
    assert "the gate ran" in out.message and len(gated) == 2


@pytest.mark.parametrize("family, knobs", [
    ("sdpa_bwd", {"BACKEND": "flash", "FORWARD": "autoflash", "BACKWARD": "sdpa"}), ("triton_fwd", None)])
def test_code_of_autoflashs_own_is_gated_before_any_timing(monkeypatch, family, knobs):
    """A pair with an own half and an own kernel are never timed ungated, however slow."""
    gated = _gate_called(monkeypatch)
    variant = (default_variant("fwd", SHAPE.problem, DEVICE) if knobs is None
               else load_space(family).check_declared(knobs))
    shape = SHAPE if knobs is None else dataclasses.replace(SHAPE, op="bwd")
    timed = _counting(monkeypatch, sandbox, "time_variant")
    sandbox._apply_context({"bar_ms": 1e-9})
    out = sandbox.evaluate_variant(variant.json(), variant.family, shape, 40, "cpu")
    assert "the gate ran" in out.message and len(gated) == 1 and not timed


@pytest.mark.parametrize("call_ms, timings", [(1.0, [10.0, 40.0]), (5.0, [10.0])])
def test_a_candidate_within_reach_is_timed_short_once_and_in_full_where_that_adds_repetitions(
        monkeypatch, call_ms, timings):
    """A backend within reach of the best: gated after its short timing, which is not taken twice;
    a call of 4 ms or more gets the least repetitions (10) in a 10-ms timing and in a 40-ms one
    alike, so the full timing would repeat the short one and is not taken."""
    timed = []

    def fake_time(kernel, shape, device, rep_ms=100, align="top_left"):
        timed.append(rep_ms)
        return call_ms
    monkeypatch.setattr(sandbox, "time_variant", fake_time)
    flash = load_space("sdpa_fwd").check_declared({"BACKEND": "flash"})
    sandbox._apply_context({"bar_ms": call_ms * 0.9})  # within 1.3x of the best: gated, then timed
    out = sandbox.evaluate_variant(flash.json(), flash.family, SHAPE, 40, "cpu")
    assert out.status == "ok" and out.ms == call_ms and out.err == out.err and not out.message  # (gated)
    assert timed == timings and 40 * sandbox.QUICK_TIMING == 10.0


class _Refuses(SdpaKernel):
    def attention(self, q, k, v, sm_scale, causal, causal_offset=0):
        raise RuntimeError("No available kernel. Aborting execution.")


def test_a_backend_that_refuses_the_timing_shape_is_still_gated_and_says_so(monkeypatch):
    flash = load_space("sdpa_fwd").check_declared({"BACKEND": "flash"})
    monkeypatch.setattr(codegen, "load_for", lambda variant, *args: _Refuses(variant))
    sandbox._apply_context({"bar_ms": 1e-9})
    out = sandbox.evaluate_variant(flash.json(), flash.family, SHAPE, 40, "cpu")
    assert out.status == "unsupported"  # (the gate's word, as before: not 'slower', not a failure)


# --------------------------------------------------------------------------- the pick's columns
def test_a_yardstick_column_has_a_twin_only_in_its_backends_whole_candidate():
    fwd_flash, bwd_flash = sdpa_key("fwd", "flash"), sdpa_key("bwd", "flash")
    mixed = sdpa_key("bwd", "flash", forward="autoflash")
    own = default_variant("fwd", SHAPE.problem, DEVICE)
    own_key = f"{own.family}:{own.json()}"
    assert yardstick_twin("sdpa_flash", [own_key, fwd_flash]) == fwd_flash
    assert yardstick_twin("sdpa_flash", [mixed, bwd_flash]) == bwd_flash
    assert yardstick_twin("sdpa_flash", [mixed, own_key]) is None  # (a pair with an own half is another call)
    assert yardstick_twin("sdpa_cudnn", [fwd_flash, sdpa_key("fwd", "math")]) is None
    assert yardstick_twin("sdpa_flash", ["sdpa_cudnn", "sdpa_flash", own.json()]) is None


def _remeasure_logged(methods, op, shape, rounds, rep_ms, device_str):
    """Re-measure hook: vendor candidates 1.0 ms, own ones 1.5 ms, the columns 2.0 ms; logs its methods."""
    import os

    with open(os.environ["AUTOFLASH_TEST_REMEASURE_LOG"], "w") as f:
        json.dump(methods, f)
    ms = {m: 2.0 if m in ("sdpa_cudnn", "sdpa_flash") else 1.0 if m.startswith("sdpa_") else 1.5 for m in methods}
    return {"samples": {m: [ms[m]] * rounds for m in methods}}


def test_the_pick_times_a_column_once_where_a_candidate_is_the_same_call(tmp_path, monkeypatch):
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.tuner import Tuner

    log = tmp_path / "methods.json"
    monkeypatch.setenv("AUTOFLASH_TEST_REMEASURE_LOG", str(log))
    own = default_variant("fwd", SHAPE.problem, DEVICE)
    flash, own_key = sdpa_key("fwd", "flash"), f"{own.family}:{own.json()}"
    done = {flash: {"status": "ok", "median_ms": 1.0}, own_key: {"status": "ok", "median_ms": 1.5}}
    store = Store(tmp_path / "t.db")
    tuner = Tuner(store, TuneOptions(trials=1, interpret=True, trial_timeout_s=60, remeasure_fn=_remeasure_logged),
                  device=DEVICE)
    tuner.opt = dataclasses.replace(tuner.opt, interpret=False)  # (the columns: as on a GPU)
    try:
        result = tuner._pick_winner(SHAPE, SHAPE.problem, done, own, measured=2, failed=0)
    finally:
        tuner.close("done", 1)
    methods = json.loads(log.read_text())
    assert "sdpa_flash" not in methods and "sdpa_cudnn" in methods and flash in methods
    assert result.status == "tuned" and result.winner.family == "sdpa_fwd"
    assert result.ms["sdpa_flash"] == 1.0 and result.ms["sdpa_cudnn"] == 2.0  # (the twin's median; its own)
    rows = {r["template_hash"]: r for r in store.winners()}
    assert rows[codegen.template_hash("sdpa_fwd")]["sdpa_flash_ms"] == 1.0
    assert math.isclose(rows[codegen.template_hash(own.family)]["median_ms"], 1.5)
    store.close()
