"""Memory layouts of a shape's q, k, v (`Shape.layout`): the random shape sets draw strided (B, N, H, D)
inputs beside contiguous ones, without changing the sizes a seed draws; JSON rows carry the layout;
the bench gives every method the same strided tensors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import types

import pytest
import torch

from autoflash import bench
from autoflash.problem import Shape
from autoflash.reference import make_inputs
from autoflash.shapes import RANDOM_STRIDED_SHARE, load_shape_set, random_shapes

PLAIN = Shape(2, 4, 2, 37, 45, 64, True, "float16")
STRIDED = dataclasses.replace(PLAIN, layout="bnhd")

# sha256 (first 16 hex digits) of the JSON list of (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim,
# causal, dtype) of random_shapes(64, seed, op) for seeds 0..3, as drawn before layouts were drawn.
SIZES_DIGESTS = {"fwd": ["d59f71672465f541", "1afe28dabdff2dbb", "a62ee8b0e4cd6ef6", "e29692508f03745d"],
                 "bwd": ["f594925264e5d781", "f951e26a4cd7c313", "a03bb95d6e1944df", "66d18b28dc9d3393"]}


def _sizes_digest(shapes: list[Shape]) -> str:
    sizes = [(s.batch, s.heads_q, s.heads_kv, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal, s.dtype) for s in shapes]
    return hashlib.sha256(json.dumps(sizes).encode()).hexdigest()[:16]


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_a_seed_draws_the_sizes_it_drew_before_layouts(op):
    assert [_sizes_digest(random_shapes(64, seed, op=op)) for seed in range(4)] == SIZES_DIGESTS[op]


def test_about_a_third_of_the_random_shapes_are_strided():
    for seed in range(4):
        layouts = [s.layout for s in random_shapes(64, seed)]
        assert set(layouts) == {None, "bnhd"}, layouts
        assert 0.15 <= layouts.count("bnhd") / 64 <= 0.5, layouts
    drawn = [s.layout for seed in range(16) for s in random_shapes(64, seed)]
    assert abs(drawn.count("bnhd") / len(drawn) - RANDOM_STRIDED_SHARE) < 0.05
    # reproducible, and the same draws for every forward/backward op; decode shapes stay contiguous
    assert load_shape_set("random:40:3") == load_shape_set("random:40:3")
    assert [s.layout for s in random_shapes(64, 2, op="fwdbwd")] == [s.layout for s in random_shapes(64, 2)]
    assert {s.layout for s in random_shapes(64, 2, op="decode")} == {None}


def test_the_layout_round_trips_and_old_rows_are_contiguous():
    d = STRIDED.as_dict()
    assert d["layout"] == "bnhd"
    assert Shape(**json.loads(json.dumps(d))) == STRIDED == pickle.loads(pickle.dumps(STRIDED))
    assert "layout" not in PLAIN.as_dict() and Shape(**PLAIN.as_dict()).layout is None  # (rows made before it)
    assert STRIDED != PLAIN and Shape(**{**d, "layout": "bhnd"}) == PLAIN  # ("bhnd" is contiguous: stored as None)
    assert STRIDED.problem_on(132) == PLAIN.problem_on(132)  # (no part of the problem key)
    assert STRIDED.label() == PLAIN.label() + " bnhd" and "bnhd" not in PLAIN.label()
    with pytest.raises(ValueError, match="layout must be one of.*bnhd"):
        Shape(1, 1, 1, 16, 16, 64, False, "float16", layout="nhd")


def test_bench_json_rows_say_which_cells_were_strided():
    device = types.SimpleNamespace(name="GPU", torch_version="2", triton_version="3")
    rows = [bench.BenchRow(PLAIN, {"autoflash": 1.0}), bench.BenchRow(STRIDED, {"autoflash": 1.0})]
    plain, strided = bench.json_rows(rows, ["autoflash"], "fwd_tflops", device)
    assert "layout" not in plain and strided["layout"] == "bnhd"
    assert Shape(**{k: strided[k] for k in PLAIN.as_dict() if k != "op"}, layout=strided["layout"]) == STRIDED


def _bnhd_views(*tensors) -> bool:
    """(B, H, N, D) views of (B, N, H, D) memory, not contiguous."""
    return all(not t.is_contiguous() and t.transpose(1, 2).is_contiguous() for t in tensors)


def test_make_inputs_lays_out_a_strided_shape_as_b_n_h_d_memory():
    q, k, v = make_inputs(STRIDED, "cpu", seed=3, layout=STRIDED.layout)
    assert _bnhd_views(q, k, v)
    assert q.shape == (2, 4, 37, 64) and q.stride() == (37 * 4 * 64, 64, 4 * 64, 1)
    assert k.shape == v.shape == (2, 2, 45, 64) and k.stride() == (45 * 2 * 64, 64, 2 * 64, 1)
    plain = make_inputs(PLAIN, "cpu", seed=3)
    assert all(t.is_contiguous() for t in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, (q, k, v)))  # (the same values either way)


def _on_the_cpu(monkeypatch):
    """The bench's input drawing on the CPU and its timings stubbed: what each method is given."""
    real = make_inputs
    monkeypatch.setattr(bench, "make_inputs", lambda shape, device, seed, layout="bhnd", draw_on_device=False:
                        real(shape, "cpu", seed, layout, draw_on_device))
    monkeypatch.setattr(bench, "timed_round", lambda fns, device, rep_ms, r: {name: 1.0 for name in fns})


@pytest.mark.parametrize("shape", [PLAIN, STRIDED, dataclasses.replace(STRIDED, op="bwd")])
def test_the_bench_gives_every_method_the_same_tensors_in_the_shapes_layout(monkeypatch, shape):
    _on_the_cpu(monkeypatch)
    given = []
    monkeypatch.setattr(bench, "_variant_fn", lambda variant, s, q, k, v, template=None: given.append((q, k, v)) or
                        (lambda: None))
    monkeypatch.setattr(bench, "sdpa_callable", lambda backend, s, q, k, v, backward=False: given.append((q, k, v)) or
                        (lambda: None))
    rows = bench.run_bench([shape], {"autoflash": lambda s: None, "default": lambda s: None}, rounds=1,
                           device="cuda", sdpa=("cudnn", "flash"))
    assert len(given) == 4 and all(all(a is b for a, b in zip(given[0], g)) for g in given)
    assert _bnhd_views(*given[0]) if shape.layout else all(t.is_contiguous() for t in given[0])
    assert rows[0].shape.layout == shape.layout


@pytest.mark.parametrize("shape", [PLAIN, STRIDED])
def test_the_fwdbwd_bench_gives_every_method_the_same_leaves_in_the_shapes_layout(monkeypatch, shape):
    _on_the_cpu(monkeypatch)
    given = []
    monkeypatch.setattr(bench, "_fwdbwd_fn", lambda m, s, q, k, v, grad: given.append((q, k, v, grad)) or
                        (lambda: None))
    rows, _ = bench.run_fwdbwd([shape], rounds=1)
    assert len(given) == 4 and all(all(a is b for a, b in zip(given[0], g)) for g in given)
    q, k, v, grad = given[0]
    assert all(t.requires_grad and t.is_leaf for t in (q, k, v)) and grad.is_contiguous()
    assert _bnhd_views(q, k, v) if shape.layout else all(t.is_contiguous() for t in (q, k, v))
    assert rows[0].shape.layout == shape.layout and rows[0].shape.op == "fwdbwd"


def test_tuning_a_random_set_tunes_its_shapes_contiguous():
    from autoflash.cli.tune_cmds import _tune_shapes

    drawn = load_shape_set("random:16:0")
    tuned = _tune_shapes(["fwd"], "random:16:0", None, False)
    assert any(s.layout for s in drawn) and [dataclasses.replace(s, layout=None) for s in drawn] == tuned


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_the_kernels_run_on_a_strided_shape_in_the_bench(op):
    from autoflash.device import gpu_fingerprint
    from autoflash.space import default_variant

    shape = Shape(1, 2, 2, 37, 37, 32, True, "float16", op=op, layout="bnhd")
    chooser = {"default": lambda s: default_variant(op, s.problem, gpu_fingerprint())}
    (row,) = bench.run_bench([shape], chooser, rounds=1, device="cpu")
    assert row.shape.layout == "bnhd" and row.ms["default"] > 0
