"""Seeds from other GPUs of the same architecture (autoflash/tuning/transfer.py): which rows count,
which variants they give a problem, and that a search measures them first. Real SQLite DBs (this
tree's shipped ones included), the tuner in Triton's interpreter."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autoflash import codegen
from autoflash.device import GPUFingerprint, gpu_fingerprint
from autoflash.problem import Problem, Shape
from autoflash.space import default_variant, load_space
from autoflash.store import Store
from autoflash.tuning.transfer import architecture, sibling_rows, transferred_seeds

H200 = GPUFingerprint("NVIDIA H200", 9, 0, 132, 232448, "2.11.0+cu130", "3.6.0", "13.0", "0.1.0")
H100 = GPUFingerprint("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448, "2.11.0+cu130", "3.6.0", "13.0", "0.1.0")
B200 = GPUFingerprint("NVIDIA B200", 10, 0, 148, 232448, "2.11.0+cu130", "3.6.0", "13.0", "0.1.0")
TINY = Shape(1, 2, 2, 37, 37, 64, True, "float16")


def put(store: Store, device: GPUFingerprint, problem: Problem, variant) -> None:
    store.add_gpu(device)
    store.set_winner(gpu_key=device.key, problem=problem, template_hash=codegen.template_hash(variant.family),
                     variant_json=variant.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=1)


def test_sibling_rows_are_other_gpus_of_this_architecture(tmp_path):
    store = Store(tmp_path / "user.db")
    problem = Problem("fwd", "bfloat16", 128, True, 1, 4096, 4096)
    variant = default_variant("fwd", problem, H100)
    put(store, B200, problem, variant)  # another architecture: no seed
    put(store, H100, problem, variant)  # this GPU's own: a winner, not a neighbour's
    assert architecture(H100.key) == "sm90" and architecture("garbage") == ""
    rows = sibling_rows(H100.key, store)
    assert rows and {r["gpu_key"] for r in rows} == {H200.key}  # the shipped H200 winners
    assert sibling_rows(H200.key, Store(tmp_path / "empty.db")) == []  # the H200's shipped rows are its own


def test_a_problems_own_winner_comes_first_then_the_nearest_valid_here(tmp_path):
    store = Store(tmp_path / "user.db")
    problem = Problem("fwd", "bfloat16", 128, True, 4, 4096, 4096, work=4)
    valid = load_space("triton_fwd").valid_variants(problem, H100)
    same, near, far = valid[3], valid[7], valid[11]
    put(store, H200, dataclasses.replace(problem, work=None), same)  # this problem (a key without occupancy)
    put(store, H200, dataclasses.replace(problem, seqlen_q=8192, seqlen_k=8192), near)
    put(store, H200, dataclasses.replace(problem, seqlen_q=512, seqlen_k=512, head_dim=64), far)
    put(store, H200, dataclasses.replace(problem, causal=False), valid[13])  # other causality: never
    rows = store.winners(H200.key)  # (these alone: not the shipped ones)
    exact, nearest = transferred_seeds(problem, "triton_fwd", H100, rows)
    assert exact == [same] and nearest == [near, far]
    assert transferred_seeds(problem, "triton_fwd", H100, rows, limit=2) == ([same], [near])
    # float16 takes bfloat16's winners (the same tiles), one step further; float32 does not
    half = dataclasses.replace(problem, dtype="float16")
    assert transferred_seeds(half, "triton_fwd", H100, rows) == ([], [same, near, far])
    assert transferred_seeds(dataclasses.replace(problem, dtype="float32"), "triton_fwd", H100, rows) == ([], [])
    # another family's rows are not this family's seeds
    assert transferred_seeds(problem, "gluon_sm90_fwd", H100, rows) == ([], [])


def test_the_shipped_h200_winners_seed_a_new_h100():
    """The acceptance shape set on an H100 with only the H200's winners shipped: most problems get
    seeds of both forward families, the float16 ones from the bfloat16 winners."""
    from autoflash.shapes import load_shape_set

    rows = sibling_rows(H100.key, Store(":memory:"))
    seeded = 0
    shapes = load_shape_set("newgpu")
    for shape in shapes:
        problem = shape.problem_on(H100.sm_count)
        if sum(len(x) for f in ("triton_fwd", "gluon_sm90_fwd") for x in transferred_seeds(problem, f, H100, rows)):
            seeded += 1
    assert len(shapes) >= 10 and seeded >= len(shapes) - 1


@pytest.mark.interpreter
@pytest.mark.parametrize("transfer", [True, False])
def test_a_neighbours_winner_is_measured_before_the_default(tmp_path, transfer):
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.workers import tune

    here = gpu_fingerprint()
    neighbour = dataclasses.replace(here, torch_version="0.0-another-build")  # same architecture, another key
    store = Store(tmp_path / "t.db")
    default = default_variant("fwd", TINY.problem, here)
    theirs = next(v for v in load_space(default.family).valid_variants(TINY.problem, here) if v != default)
    put(store, neighbour, TINY.problem, theirs)
    tune([TINY], store, TuneOptions(trials=3, interpret=True, transfer_seeds=transfer))
    tried = [json.loads(r["variant"]) for r in store.db["trials"].rows_where("gpu_key = ?", [here.key], order_by="id")]
    assert tried[0] == (theirs if transfer else default).as_dict()
    assert (theirs.as_dict() in tried) if transfer else tried[0] == default.as_dict()


@pytest.mark.interpreter
@pytest.mark.parametrize("hide", [False, True])
def test_hide_shipped_rows_tunes_as_if_this_gpu_were_new(tmp_path, monkeypatch, hide):
    """Shipped winners of this very GPU seed its search first; `--hide-shipped-rows` leaves them out,
    and a neighbour's winner (another GPU of its architecture) comes first instead."""
    from autoflash import resources
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.workers import tune

    here = gpu_fingerprint()
    neighbour = dataclasses.replace(here, torch_version="0.0-another-build")
    valid = [v for v in load_space("triton_fwd").valid_variants(TINY.problem, here)
             if v != default_variant("fwd", TINY.problem, here)]
    shipped = Store(tmp_path / "shipped.db")
    put(shipped, here, TINY.problem, valid[0])  # "ours", as a shipped DB holds it
    put(shipped, neighbour, TINY.problem, valid[1])
    shipped.close()
    monkeypatch.setattr(resources, "shipped_databases", lambda: [tmp_path / "shipped.db"])
    store = Store(tmp_path / "t.db")
    tune([TINY], store, TuneOptions(trials=2, interpret=True, hide_shipped_rows=hide))
    tried = [r["variant"] for r in store.db["trials"].rows_where(order_by="id")]
    assert tried[0] == (valid[1] if hide else valid[0]).json()
    assert (valid[0].json() not in tried) if hide else True
