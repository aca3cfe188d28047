"""Attention variants on the tuning side: `Shape.score` (keys, JSON, shape-set files), the gate with the
variant's values against the float64 reference of the same variant, and `autoflash tune` / `which` /
the dispatcher end to end in Triton's interpreter."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle

import pytest
import torch
from click.testing import CliRunner

from autoflash import codegen
from autoflash.cli import cli
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem, Shape
from autoflash.score_variant import ScoreValues, ScoreVariant
from autoflash.shapes import load_shape_set
from autoflash.space import default_variant
from autoflash.store import Store
from autoflash.tuning import gate
from autoflash.tuning.score_candidates import serves_problem

PLAIN = Shape(1, 2, 2, 37, 37, 64, True, "float16")
CAPPED = dataclasses.replace(PLAIN, head_dim=32, score=ScoreValues(window=(20, 0), softcap=30.0))
VARIANT_TOML = ("[[shape]]\nbatch = 1\nheads_q = 4\nheads_kv = 2\nseqlen_q = 45\nseqlen_k = 45\nhead_dim = 32\n"
                "causal = true\ndtype = \"float16\"\nwindow = 16\nsoftcap = 30.0\n")


def test_a_plain_shape_is_what_it_was_and_a_variant_shape_round_trips():
    assert PLAIN.as_dict() == {"batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 37, "seqlen_k": 37,
                               "head_dim": 64, "causal": True, "dtype": "float16", "op": "fwd", "page": None}
    assert Shape(**PLAIN.as_dict(), score={}) == PLAIN  # plain values are no variant
    assert PLAIN.problem.score_variant is None
    stored = json.loads(json.dumps(CAPPED.as_dict()))
    assert stored["score"] == {"window": [20, -1], "softcap": 30.0}
    assert Shape(**stored) == CAPPED and pickle.loads(pickle.dumps(CAPPED)) == CAPPED
    assert CAPPED.problem.key.endswith("/window+softcap")
    assert Problem.from_key(CAPPED.problem.key) == CAPPED.problem


def test_shape_sets_take_variant_values(tmp_path):
    path = tmp_path / "v.toml"
    path.write_text(VARIANT_TOML + "\n[[grid]]\ndtype = [\"float16\"]\nhead_dim = [64]\ncausal = [false]\n"
                    "seqlen = [64]\nbatch = 1\nheads_q = 2\nalibi = true\nsinks = true\n")
    grid, capped = load_shape_set(str(path), op="bwd")  # ([[grid]] tables' shapes first)
    assert capped.score == ScoreValues(window=(16, -1), softcap=30.0)  # (bound as the drop-ins bind it)
    assert grid.score == ScoreValues(alibi=True, sinks=True)
    assert grid.problem.key.endswith("/alibi+sinks") and capped.problem.key.startswith("bwd/")
    path.write_text(VARIANT_TOML.replace("softcap = 30.0", "softcap = -1.0"))
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        load_shape_set(str(path))


def test_a_shape_binds_its_window_as_the_drop_ins_do():
    """The key a tuned winner is stored under is the key a call of that shape looks up: a window that
    excludes no key is none (a 4096-key causal window at 4096 tokens: softcap only), a right bound of 0
    is causality (bottom-right aligned, as flash-attn)."""
    from autoflash.score_variant import binding_window

    base = dict(batch=1, heads_q=2, heads_kv=2, head_dim=64, dtype="bfloat16")
    whole = Shape(seqlen_q=4096, seqlen_k=4096, causal=True, score={"window": (4096, 0), "softcap": 50.0}, **base)
    assert whole.problem.key.endswith("/softcap") and whole.score.window == (-1, -1)
    assert Shape(seqlen_q=4096, seqlen_k=4096, causal=True, score={"window": (4096, 0)}, **base).score is None
    right0 = Shape(seqlen_q=512, seqlen_k=512, causal=False, score={"window": (128, 0)}, **base)
    assert right0.causal and right0.score.window == (128, -1)
    for window, causal in (((128, 0), True), ((128, 128), False), ((4096, 4096), False), ((-1, 0), True)):
        (want, want_causal) = binding_window(window, causal, 512, 512)
        shape = Shape(seqlen_q=512, seqlen_k=512, causal=causal, score={"window": window, "softcap": 5.0}, **base)
        assert (shape.score.window, shape.causal) == (want, want_causal)


def test_a_windows_flops_count_only_its_band():
    """A causal window of w keys at n tokens: w(w+1)/2 + (n-w)w pairs (as `bench --variants` counts);
    a window that excludes no key counts as causal attention does."""
    base = dict(batch=2, heads_q=4, heads_kv=4, head_dim=64, dtype="bfloat16", seqlen_q=4096, seqlen_k=4096)
    w, n = 128, 4096
    windowed = Shape(causal=True, score={"window": (w - 1, 0)}, **base)  # (w - 1 keys back: w in the band)
    assert windowed.flops() == 2.0 * 2 * 4 * (w * (w + 1) // 2 + (n - w) * w) * (64 + 64)
    assert Shape(causal=True, score={"window": (n, 0), "softcap": 1.0}, **base).flops() == Shape(causal=True, **base).flops()
    both_ways = Shape(causal=False, score={"window": (1, 1)}, **base)
    assert both_ways.flops() == 2.0 * 2 * 4 * (3 * n - 2) * (64 + 64)


def test_a_shape_set_refuses_one_problem_with_two_windows(tmp_path):
    path = tmp_path / "two.toml"
    path.write_text("".join(f"[[shape]]\nbatch = 1\nheads_q = 2\nseqlen_q = 512\nseqlen_k = 512\nhead_dim = 64\n"
                            f"causal = true\ndtype = \"float16\"\nwindow = {w}\n" for w in (128, 256)))
    with pytest.raises(ValueError, match="one problem .* with other variant values"):
        load_shape_set(str(path))


def test_bench_refuses_shapes_with_variant_values_it_would_time_without_them():
    """(--fwdbwd loads its shapes the same way; it needs a GPU first)"""
    r = CliRunner().invoke(cli, ["bench", "--interpret", "--shapes", "variants"])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "attention-variant values" in text and "--variants" in text, text


def test_the_named_variants_set_has_the_models_variants():
    keys = [s.problem_on(132).key for s in load_shape_set("variants")]
    assert [k.rsplit("/", 1)[1] for k in keys] == ["window+softcap", "softcap", "window", "window+sinks", "sinks"]
    gemma, _, mistral, oss, _ = load_shape_set("variants")
    assert (gemma.head_dim, gemma.heads_q, gemma.heads_kv, gemma.score.softcap, gemma.score.window) == \
        (256, 16, 8, 50.0, (4096, -1))
    assert (mistral.head_dim, mistral.seqlen_q, mistral.score.window) == (128, 16384, (4096, -1))
    assert (oss.head_dim, oss.heads_q, oss.heads_kv, oss.score.window, oss.score.sinks) == (64, 64, 8, (128, -1), True)


def test_families_that_compute_no_variants_are_no_candidates_for_a_variant_problem():
    from autoflash.space import load_space

    problem = dataclasses.replace(CAPPED, op="bwd").problem
    h100 = dataclasses.replace(gpu_fingerprint(), name="NVIDIA H100", cc_major=9, cc_minor=0, sm_count=132,
                               smem_per_block=232448)
    triton_bwd = load_space("triton_bwd").valid_variants(problem, h100)
    kept = serves_problem(triton_bwd, problem)
    assert kept and all(v["DKDV_KERNEL"] == "triton" for v in kept)
    gluon_dkdv = kept[0].replace(DKDV_KERNEL="gluon_sm90")  # (offered on Hopper GPUs only: made by hand here)
    assert serves_problem([gluon_dkdv], problem) == [] and serves_problem([gluon_dkdv], PLAIN.problem) == [gluon_dkdv]
    assert serves_problem(load_space("sdpa_fwd").valid_variants(problem, h100), CAPPED.problem) == []
    assert serves_problem(triton_bwd, PLAIN.problem) == triton_bwd


def _variant_kernel(shape: Shape):
    variant = default_variant(shape.op, shape.problem, gpu_fingerprint())
    return codegen.load_for(variant, shape.head_dim_v, shape.score_variant)


class _OtherSoftcap:
    """A kernel fed a softcap other than the call's (a variant argument gone wrong on the way)."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def forward(self, *args, score_args=None, **kwargs):
        return self._kernel.forward(*args, score_args=dataclasses.replace(score_args, softcap=score_args.softcap / 2),
                                    **kwargs)

    def backward(self, *args, score_args=None, **kwargs):
        return self._kernel.backward(*args, score_args=dataclasses.replace(score_args, softcap=score_args.softcap / 2),
                                     **kwargs)


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_the_gate_passes_a_variant_kernel_and_rejects_wrong_variant_arguments(op):
    shape = dataclasses.replace(CAPPED, op=op)
    kernel = _variant_kernel(shape)
    assert kernel.score == ScoreVariant(window=True, softcap=True)
    good = gate.check(kernel, shape, "cpu")
    assert good.passed and math.isfinite(good.err), good.detail
    bad = gate.check(_OtherSoftcap(kernel), shape, "cpu")
    assert not bad.passed and ("wrong dq" if op == "bwd" else "wrong result") in bad.detail, bad.detail
    assert "window+softcap" in bad.detail  # (the gate shape's label names the variant)


@pytest.mark.interpreter
def test_the_gate_rejects_a_kernel_rendered_without_the_problems_variants():
    plain_kernel = _variant_kernel(dataclasses.replace(CAPPED, score=None))
    result = gate.check(plain_kernel, CAPPED, "cpu")
    assert not result.passed and "rendered for score variant 'plain'" in result.detail
    window_only = _variant_kernel(dataclasses.replace(CAPPED, score=ScoreValues(window=(20, 0))))
    assert not gate.check(window_only, CAPPED, "cpu").passed


@pytest.mark.interpreter
def test_the_gates_window_reaches_fewer_keys_than_the_gate_shapes_have():
    """A window as long as the tuned one covers a whole gate shape: a kernel without it would pass."""
    shape = dataclasses.replace(CAPPED, seqlen_q=8192, seqlen_k=8192, score=ScoreValues(window=(4096, 0), softcap=50.0))
    assert shape.score.window == (4096, -1)
    for gs in gate.gate_shapes(shape):
        args = gate.gate_score_args(shape, gs, "cpu")
        assert args.window[0] < gs.seqlen_k and args.softcap <= gate.GATE_SOFTCAP_MAX


@pytest.mark.interpreter
def test_tune_stores_variant_winners_and_which_and_the_dispatcher_serve_them(tmp_path, monkeypatch):
    shapes, db = tmp_path / "variants.toml", tmp_path / "t.db"
    shapes.write_text(VARIANT_TOML)
    r = CliRunner().invoke(cli, ["tune", "--interpret", "--ops", "fwd,bwd", "--shapes", str(shapes), "--trials", "2",
                                 "--db", str(db)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    store = Store(db)
    winners = {w["problem"]: w for w in store.winners()}
    assert sorted(Problem.from_key(key).op for key in winners) == ["bwd", "fwd"]
    assert all(key.endswith("/window+softcap") for key in winners), winners
    assert all(json.loads(w["shape"])["score"] == {"window": [16, -1], "softcap": 30.0} for w in winners.values())
    trials = list(store.db["trials"].rows)
    assert trials and all(row["status"] == "ok" and row["err"] is not None for row in trials)
    for op in ("fwd", "bwd"):
        r = CliRunner().invoke(cli, ["which", "--interpret", "--op", op, "--shapes", str(shapes), "--db", str(db)],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        text = " ".join(r.output.split())
        assert "exact" in text and "window+so" in text, text  # (the label, cut to the column)
    _dispatcher_serves_the_stored_variant(db, winners, monkeypatch)


def _dispatcher_serves_the_stored_variant(db, winners, monkeypatch):
    from autoflash.dispatch import Dispatcher

    monkeypatch.setenv("AUTOFLASH_DB", str(db))
    shape = load_shape_set(str(db.parent / "variants.toml"))[0]
    q = torch.randn(1, 4, 45, 32, dtype=torch.float16)
    k, v = torch.randn(1, 2, 45, 32, dtype=torch.float16), torch.randn(1, 2, 45, 32, dtype=torch.float16)
    kernel = Dispatcher(winner_paths=[db]).kernel_for(q, k, v, torch.empty_like(q), True, own_only=True,
                                                      score=shape.score_variant)
    stored = winners[shape.problem.key]
    assert kernel.score == shape.score_variant
    assert (codegen.template_hash(kernel.family), kernel.variant.json()) == (stored["template_hash"], stored["variant"])


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["fwd", "bwd"])
@pytest.mark.parametrize("values", [ScoreValues(alibi=True, sinks=True), ScoreValues(window=(8, 3), sinks=True)])
def test_the_gate_passes_alibi_and_sinks_kernels_and_rejects_a_plain_one_fed_none_of_them(op, values):
    shape = dataclasses.replace(CAPPED, op=op, causal=False, score=values)
    kernel = _variant_kernel(shape)
    result = gate.check(kernel, shape, "cpu")
    assert result.passed, result.detail

    class Plain:  # the same kernel with the variant's values dropped: the reference must tell
        def __getattr__(self, name):
            return getattr(kernel, name)

        def forward(self, *args, score_args=None, **kwargs):
            slopes, window = score_args.alibi_slopes, score_args.window
            plain = dataclasses.replace(score_args, alibi_slopes=None if slopes is None else slopes * 0,
                                        sinks=score_args.sinks - 1e4,  # (a sink that adds nothing)
                                        window=window if window == (-1, -1) else (1000, 1000))
            return kernel.forward(*args, score_args=plain, **kwargs)

    if op == "fwd":
        assert not gate.check(Plain(), shape, "cpu").passed


def test_the_gates_kept_references_tell_a_long_window_from_none():
    """A window longer than a short gate shape drops out of that gate shape's own value (nothing it
    would exclude there), while the gate runs it shortened to a quarter of the keys: the reference a
    worker keeps per gate shape is keyed by the problem's variants too, so a softcapped problem's
    reference never checks its windowed twin's kernels (Gemma-2's global and local layers)."""
    from autoflash.tuning import yardsticks

    yardsticks.clear()
    capped = Shape(1, 2, 2, 4096, 4096, 32, True, "float16", score=ScoreValues(softcap=30.0))
    windowed = dataclasses.replace(capped, score=ScoreValues(window=(2000, 0), softcap=30.0))
    assert windowed.problem.score_variant == "window+softcap" and capped.problem.score_variant == "softcap"
    assert gate.gate_shapes(capped) == gate.gate_shapes(windowed)  # (the short gate shapes alike)
    for shape in (capped, windowed, capped):
        result = gate.check(_variant_kernel(shape), shape, "cpu")
        assert result.passed, (shape.problem.key, result.detail)
    yardsticks.clear()
