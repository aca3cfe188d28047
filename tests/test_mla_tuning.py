"""Value head dims of their own (MLA: Q/K 192, V 128) on the tuning side: `Shape.head_dim_v` (its
keys, labels, round trips, FLOPs), shape-set files, the gate on such kernels, seeds from other GPUs,
tune-on-miss, and `autoflash tune` / `autoflash which` end to end in Triton's interpreter."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from autoflash import codegen
from autoflash.cli import cli
from autoflash.device import GPUFingerprint, gpu_fingerprint
from autoflash.problem import Problem, Shape
from autoflash.shapes import load_shape_set, record_shape
from autoflash.space import default_variant, load_space
from autoflash.store import Store
from autoflash.tuning import gate
from autoflash.tuning.timing import tflops
from autoflash.tuning.transfer import transferred_seeds

PLAIN = Shape(1, 2, 2, 37, 37, 64, True, "float16")
MLA = Shape(1, 2, 2, 37, 37, 64, True, "float16", head_dim_v=32)
MLA_TOML = ("[[shape]]\nbatch = 1\nheads_q = 2\nseqlen_q = 37\nseqlen_k = 37\nhead_dim = 64\nhead_dim_v = 32\n"
            "causal = true\ndtype = \"float16\"\n")


def test_a_plain_shape_is_what_it_was_and_an_mla_shape_round_trips():
    fields = dataclasses.asdict(PLAIN)
    del fields["head_dim_v"], fields["score"], fields["layout"]  # (fields added after it: not in a plain shape's JSON either)
    assert PLAIN.as_dict() == fields  # (the JSON stored for plain shapes gains no key)
    assert Shape(**json.loads(json.dumps(PLAIN.as_dict()))) == PLAIN == pickle.loads(pickle.dumps(PLAIN))
    assert PLAIN.problem_on(132).key == "fwd/float16/d64/causal/g1/q64/k64/w-6"
    assert Shape(1, 2, 2, 37, 37, 64, True, "float16", head_dim_v=64) == PLAIN  # (one shape, one key)
    assert MLA.as_dict()["head_dim_v"] == 32
    assert Shape(**json.loads(json.dumps(MLA.as_dict()))) == MLA == pickle.loads(pickle.dumps(MLA))
    assert MLA.problem_on(132).key == "fwd/float16/d64/causal/g1/q64/k64/w-6/dv32"
    assert dataclasses.replace(MLA, op="bwd").problem_on(132).head_dim_v == 32
    assert "d64/32 causal" in MLA.label() and MLA.short_label() == "d64/32 causal 37"
    assert "d64 causal" in PLAIN.label() and "/" not in PLAIN.short_label()


def test_flops_count_qk_over_the_query_head_dim_and_pv_over_the_value_one():
    b, h, n, d, dv = 2, 3, 256, 192, 128
    full = 2.0 * b * h * n * n  # per head dim of one matmul
    mla = Shape(b, h, h, n, n, d, False, "bfloat16", head_dim_v=dv)
    assert mla.flops() == full * (d + dv)  # S = QK^T over D, O = PV over D_v
    assert dataclasses.replace(mla, op="bwd").flops() == full * (3 * d + 2 * dv)  # QK^T, dQ, dK; dP, dV
    assert dataclasses.replace(mla, op="fwdbwd").flops() == full * (4 * d + 3 * dv)
    assert dataclasses.replace(mla, causal=True).flops() == full * (d + dv) / 2
    plain = Shape(b, h, h, n, n, d, True, "bfloat16")  # where D_v = D, the formula it always was
    assert plain.flops() == 4.0 * b * h * n * n * d / 2
    for op, factor in (("bwd", 2.5), ("fwdbwd", 3.5)):
        assert dataclasses.replace(plain, op=op).flops() == plain.flops() * factor
    # a backward problem is timed forward + backward
    assert tflops(dataclasses.replace(mla, op="bwd"), 1.0) == pytest.approx(full * (4 * d + 3 * dv) / 1e9)  # (FLOPs / 1 ms, in TFLOP/s)


def test_shape_sets_take_head_dim_v(tmp_path):
    path = tmp_path / "mla.toml"
    path.write_text(MLA_TOML)
    assert load_shape_set(str(path)) == [MLA]
    assert load_shape_set(str(path), op="bwd")[0].problem_on(132).key.endswith("/dv32")
    path.write_text(MLA_TOML.replace("head_dim_v = 32", "head_dim_v = 264"))
    with pytest.raises(ValueError, match="head dim 264 is not supported"):
        load_shape_set(str(path))
    path.write_text(MLA_TOML)
    with pytest.raises(ValueError, match="forward or backward"):  # (decode keys have no /dv)
        load_shape_set(str(path), op="decode")
    shapes = load_shape_set("mla")  # DeepSeek-V3 prefill per GPU
    assert {(s.heads_q, s.seqlen_q, s.head_dim, s.head_dim_v, s.causal, s.dtype) for s in shapes} == {
        (h, n, 192, 128, True, "bfloat16") for h in (128, 16) for n in (4096, 16384)}
    recorded = tmp_path / "recorded.toml"
    record_shape(recorded, MLA)
    record_shape(recorded, PLAIN)  # another problem, though every field but head_dim_v is the same
    record_shape(recorded, MLA)  # (already there)
    assert load_shape_set(str(recorded)) == [MLA, PLAIN]


def _with_last_value_column_zeroed(kernel):
    """`kernel`, except that it leaves V's last head-dim column out of what it writes (as a kernel whose
    value tile stops short of D_v would): the output's in the forward, dV's in the backward."""
    class Wrong:
        def __getattr__(self, name):
            return getattr(kernel, name)

        def forward(self, q, k, v, o, *args, **kwargs):
            kernel.forward(q, k, v, o, *args, **kwargs)
            o[..., -1] = 0

        def backward(self, q, k, v, o, lse, do, dq, dk, dv, *args, **kwargs):
            kernel.backward(q, k, v, o, lse, do, dq, dk, dv, *args, **kwargs)
            dv[..., -1] = 0
    return Wrong()


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_the_gate_passes_a_value_dim_kernel_and_rejects_one_wrong_in_the_value_columns(op):
    shape = dataclasses.replace(MLA, op=op)
    variant = default_variant(op, shape.problem, gpu_fingerprint())
    kernel = codegen.load_for(variant, shape.head_dim_v)
    assert kernel.value_dim
    good = gate.check(kernel, shape, "cpu")
    assert good.passed and math.isfinite(good.err), good.detail
    bad = gate.check(_with_last_value_column_zeroed(kernel), shape, "cpu")
    assert not bad.passed and ("wrong dv" if op == "bwd" else "wrong result") in bad.detail
    assert "d64/32" in bad.detail


def test_seeds_from_other_gpus_come_from_problems_of_the_same_value_head_dim_only(tmp_path):
    h200 = GPUFingerprint("NVIDIA H200", 9, 0, 132, 232448, "2.11.0+cu130", "3.6.0", "13.0", "0.1.0")
    h100 = GPUFingerprint("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448, "2.11.0+cu130", "3.6.0", "13.0", "0.1.0")
    store = Store(tmp_path / "user.db")
    store.add_gpu(h200)
    problem = Problem("fwd", "bfloat16", 192, True, 1, 4096, 4096, work=5, head_dim_v=128)
    valid = load_space("triton_fwd").valid_variants(problem, h100)
    for other, variant in ((problem, valid[1]), (dataclasses.replace(problem, seqlen_q=8192, seqlen_k=8192), valid[2]),
                           (dataclasses.replace(problem, head_dim_v=None), valid[3]),  # V of Q's head dim
                           (dataclasses.replace(problem, head_dim_v=64), valid[4])):  # another D_v
        store.set_winner(gpu_key=h200.key, problem=other, template_hash=codegen.template_hash("triton_fwd"),
                         variant_json=variant.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=1)
    rows = store.winners(h200.key)
    assert transferred_seeds(problem, "triton_fwd", h100, rows) == ([valid[1]], [valid[2]])
    plain = dataclasses.replace(problem, head_dim_v=None)
    exact, near = transferred_seeds(plain, "triton_fwd", h100, rows)
    assert exact == [valid[3]] and valid[1] not in near and valid[4] not in near


@pytest.mark.interpreter
def test_tune_on_miss_tunes_a_value_head_dim_problem(monkeypatch):
    from autoflash.dispatch import Dispatcher, set_miss_hook

    asked = []
    monkeypatch.setenv("AUTOFLASH_TUNE_ON_MISS", "1")
    previous = set_miss_hook(asked.append)
    try:
        q, k, v = torch.randn(1, 2, 45, 64), torch.randn(1, 2, 45, 64), torch.randn(1, 2, 45, 32)
        Dispatcher(winner_paths=[]).kernel_for(q, k, v, torch.empty(1, 2, 45, 32), False)
    finally:
        set_miss_hook(previous)
    assert [(s.head_dim, s.head_dim_v, s.seqlen_q) for s in asked] == [(64, 32, 45)]
    assert asked[0].problem.key.endswith("/dv32")


@pytest.mark.interpreter
def test_tune_stores_value_head_dim_winners_and_which_serves_them(tmp_path):
    shapes, db = tmp_path / "mla.toml", tmp_path / "t.db"
    shapes.write_text(MLA_TOML)
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--ops", "fwd,bwd", "--shapes", str(shapes), "--trials", "2",
                                 "--db", str(db)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "d64/32" in " ".join(r.output.split())
    store = Store(db)
    winners = {w["problem"]: w for w in store.winners()}
    assert sorted(Problem.from_key(key).op for key in winners) == ["bwd", "fwd"]
    assert all(key.endswith("/dv32") for key in winners), winners
    assert all(json.loads(w["shape"])["head_dim_v"] == 32 for w in winners.values())
    assert all(row["status"] == "ok" and row["err"] is not None for row in store.db["trials"].rows)
    for op in ("fwd", "bwd"):
        r = CliRunner().invoke(cli, ["which", "--interpret", "--op", op, "--shapes", str(shapes), "--db", str(db)],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        text = " ".join(r.output.split())
        assert "exact" in text and "own" in text and str(db.name) in text, text


@pytest.mark.interpreter
def test_a_recorded_value_head_dim_call_is_a_shape_to_tune(tmp_path, monkeypatch):
    from autoflash.dispatch import Dispatcher

    record = tmp_path / "recorded.toml"
    monkeypatch.setenv("AUTOFLASH_RECORD", str(record))
    q, k, v = torch.randn(1, 2, 37, 64), torch.randn(1, 2, 37, 64), torch.randn(1, 2, 37, 32)
    Dispatcher(winner_paths=[]).kernel_for(q, k, v, torch.empty(1, 2, 37, 32), True)
    (shape,) = load_shape_set(str(record))
    assert (shape.head_dim, shape.head_dim_v, shape.causal) == (64, 32, True)


@pytest.mark.interpreter
def test_bench_times_value_head_dim_shapes(tmp_path):
    from autoflash.bench import sdpa_backends

    shapes, out = tmp_path / "mla.toml", tmp_path / "bench.json"
    shapes.write_text(MLA_TOML)
    r = CliRunner().invoke(cli, ["bench", "--interpret", "--shapes", str(shapes), "--rounds", "1", "--json", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    assert {row["impl"] for row in rows} >= {"autoflash", "autoflash-own"}
    assert all(row["head_dim"] == 64 and row["head_dim_v"] == 32 and row["fwd_tflops"] for row in rows), rows
    # SDPA's flash backend refuses D_v != D_qk: its efficient one stands beside cuDNN for such shapes
    assert sdpa_backends([MLA]) == ("cudnn", "flash", "efficient") and sdpa_backends([PLAIN]) == ("cudnn", "flash")


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_sdpa_backends_that_refuse_a_value_head_dim_are_unsupported_not_failed(tmp_path, monkeypatch, op):
    """torch's flash backend takes no D_v != D_qk (nor do the SDPA halves of a training pair): such a
    vendor candidate is recorded `unsupported`; a backend that takes it (the CPU's math one here) is
    gated and measured like any other. (Vendor kernels sit out interpreted runs: let them compete.)"""
    from autoflash.tuning import tuner
    from autoflash.tuning.tuner import TuneOptions
    from autoflash.tuning.workers import tune

    monkeypatch.setattr(tuner, "competes", lambda family, interpret: True)
    store = Store(tmp_path / "t.db")
    shape = dataclasses.replace(MLA, dtype="float32", op=op)
    tune([shape], store, TuneOptions(trials=1, interpret=True))
    family = f"sdpa_{op}"
    vendor = [r for r in store.db["trials"].rows if r["template_hash"] == codegen.template_hash(family)]
    assert vendor
    for row in vendor:
        variant = load_space(family).check_declared(json.loads(row["variant"]))
        takes = variant["BACKEND"] != "flash" and (op == "fwd" or variant.as_dict().get("FORWARD", "sdpa") == "sdpa"
                                                    and variant.as_dict().get("BACKWARD", "sdpa") == "sdpa")
        assert row["status"] == ("ok" if takes else "unsupported"), (row["variant"], row["status"], row["message"])


@pytest.mark.interpreter
def test_bench_against_a_baseline_template_renders_it_for_vs_head_dim(tmp_path):
    """`--baseline-template` on a shape set with a value head dim of its own: the old template is
    rendered for it too (it was loaded plain and refused the call, ending the bench)."""
    shapes = tmp_path / "mla.toml"
    shapes.write_text("[[shape]]\nbatch = 1\nheads_q = 2\nseqlen_q = 37\nseqlen_k = 37\nhead_dim = 64\n"
                      "head_dim_v = 32\ncausal = true\ndtype = \"float16\"\n")
    baseline = tmp_path / "old.jinja"
    baseline.write_text((Path(codegen.__file__).parent / "families" / "triton_fwd" / "kernel.py.jinja").read_text())
    out = tmp_path / "rows.json"
    r = CliRunner().invoke(cli, ["bench", "--interpret", "--shapes", str(shapes), "--rounds", "1",
                                 "--baseline-template", str(baseline), "--json", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())
    assert any(row["impl"] == "autoflash-baseline" and row["fwd_tflops"] for row in rows), {row["impl"] for row in rows}
