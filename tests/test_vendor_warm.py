"""cuDNN built ahead in the measuring worker (`tuning.vendor_warm`): which candidates it calls, on
which inputs, and that a failure there decides nothing. cuDNN itself needs a GPU; on the CPU the same
calls run through torch's CPU flash backend, which has every entry point the cuDNN candidates use."""

import dataclasses

import pytest

from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.space import load_space
from autoflash.tuning import vendor_warm
from autoflash.tuning.gate import gate_shapes

pytestmark = pytest.mark.interpreter
SHAPE = Shape(batch=2, heads_q=4, heads_kv=2, seqlen_q=40, seqlen_k=40, head_dim=32, causal=True, dtype="float32",
              op="bwd")


def variant(op: str, **knobs):
    return load_space(f"sdpa_{op}").check_declared(knobs)


def test_only_cudnn_candidates_are_warmed():
    whole = variant("bwd", BACKEND="cudnn", FORWARD="sdpa", BACKWARD="sdpa")
    half = variant("bwd", BACKEND="cudnn", FORWARD="sdpa", BACKWARD="autoflash")
    flash = variant("bwd", BACKEND="flash", FORWARD="sdpa", BACKWARD="sdpa")
    valid = {"sdpa_bwd": [whole, flash, half], "triton_bwd": []}
    assert vendor_warm.cudnn_variants(valid, ["sdpa_bwd"]) == [whole, half]
    assert vendor_warm.cudnn_variants(valid, []) == []


@pytest.mark.parametrize("knobs", [dict(FORWARD="sdpa", BACKWARD="sdpa"), dict(FORWARD="sdpa", BACKWARD="autoflash"),
                                   dict(FORWARD="autoflash", BACKWARD="sdpa")])
def test_each_kind_of_candidate_is_called_on_every_gate_shape_and_the_timing_shape(knobs, monkeypatch):
    from autoflash import vendor

    calls = []
    for name in ("attention", "gradients", "attention_with_lse", "gradients_from"):
        real = getattr(vendor.SdpaKernel, name)
        monkeypatch.setattr(vendor.SdpaKernel, name, lambda self, q, *a, _n=name, _r=real, **kw:
                            calls.append((_n, tuple(q.shape))) or _r(self, q, *a, **kw))
    cpu_flash = variant("bwd", BACKEND="flash", **knobs)  # (cuDNN's stand-in: the same methods)
    inputs = vendor_warm._input_sets(SHAPE)
    assert len(inputs) == len(gate_shapes(SHAPE)) + 1
    assert all(vendor_warm._call(SHAPE, cpu_flash, i, "cpu") for i in inputs)
    shapes = {q for _, q in calls}
    assert (SHAPE.batch, SHAPE.heads_q, SHAPE.seqlen_q, SHAPE.head_dim) in shapes  # the timing inputs
    assert len(shapes) >= len(gate_shapes(SHAPE))
    expected = ({"gradients"} if knobs["BACKWARD"] == knobs["FORWARD"] else {"attention_with_lse"}
                if knobs["FORWARD"] == "sdpa" else {"attention_with_lse", "gradients_from"})  # (the SDPA halves)
    assert {n for n, _ in calls} - {"attention"} == expected
    forward = dataclasses.replace(SHAPE, op="fwd")
    calls.clear()
    assert vendor_warm._call(forward, variant("fwd", BACKEND="flash"), None, "cpu")
    assert [n for n, _ in calls] == ["attention"]


def test_a_failing_call_is_counted_not_raised_and_the_switches_come_back(monkeypatch):
    """The whole task on the CPU with torch's flash backend in cuDNN's place: every gate shape and the
    timing shape called, a failure counted (never raised), torch's backend switches as they were;
    for cuDNN itself nothing runs off a GPU."""
    import torch

    from autoflash import vendor

    switches = [getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in ("flash", "mem_efficient", "math")]
    forward = dataclasses.replace(SHAPE, op="fwd")
    done = vendor_warm.warm(forward, [variant("fwd", BACKEND="flash")], "cpu", backend="flash")
    assert done["samples"]["calls"] == [len(gate_shapes(forward)) + 1] and done["samples"]["failed"] == [0]

    def broken(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: no engine")
    monkeypatch.setattr(vendor.SdpaKernel, "attention", broken)
    assert vendor_warm._call(forward, variant("fwd", BACKEND="flash"), None, "cpu") is False
    done = vendor_warm.warm(forward, [variant("fwd", BACKEND="flash")], "cpu", backend="flash")
    assert done["samples"]["failed"] == done["samples"]["calls"] == [len(gate_shapes(forward)) + 1]
    assert [getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in ("flash", "mem_efficient", "math")] \
        == switches
    assert vendor_warm.warm(forward, [variant("fwd", BACKEND="cudnn")], "cpu")["samples"]["calls"] == [0]


def test_a_run_builds_ahead_per_problem_in_its_worker_within_a_quarter_of_the_budget():
    """`planned._warm_vendor` sends one task per problem with cuDNN candidates to the real measuring
    worker (a spawned process: the task pickles by name), none in the interpreter, and none once a
    quarter of the budget has gone."""
    import types

    from autoflash.tuning import planned
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.sandbox import Sandbox

    forward = dataclasses.replace(SHAPE, op="fwd")
    cudnn, flash = variant("fwd", BACKEND="cudnn"), variant("fwd", BACKEND="flash")
    searches = [types.SimpleNamespace(shape=forward, valid={"sdpa_fwd": [cudnn, flash]}, vendor=["sdpa_fwd"]),
                types.SimpleNamespace(shape=SHAPE, valid={"sdpa_bwd": []}, vendor=["sdpa_bwd"])]
    answers = []
    with Sandbox("cpu") as worker:
        def call(fn, args, timeout_s):
            answers.append((args[0], args[1], worker.call(fn, args, timeout_s)))
            return answers[-1][2]
        tuner = types.SimpleNamespace(sandbox=types.SimpleNamespace(call=call), device_str="cpu")
        now = [0.0]
        options = TuneOptions(interpret=False, budget_s=100.0, clock=lambda: now[0])
        planned._warm_vendor(tuner, searches, options, start=0.0)
        assert [(shape, variants) for shape, variants, _ in answers] == [(forward, [cudnn])]
        assert answers[0][2]["status"] == "ok" and answers[0][2]["samples"]["calls"] == [0]  # (no cuDNN here)
        now[0] = 26.0  # past a quarter of the budget
        planned._warm_vendor(tuner, searches, options, start=0.0)
        planned._warm_vendor(tuner, searches, dataclasses.replace(options, interpret=True, budget_s=None), start=0.0)
    assert len(answers) == 1
