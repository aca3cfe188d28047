"""Randomized faults at the DB's doors: whatever an import file holds, `db import` writes all of it
or none of it, runs no code, and a model using the DB still gets the right answer."""

import json
import math
import sqlite3
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoflash import codegen
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import Dispatcher
from autoflash.problem import Problem
from autoflash.reference import reference, rel_error
from autoflash.space import default_variant
from autoflash.store import Store, StoreError

DEVICE = gpu_fingerprint()
PROBLEM = Problem("fwd", "float32", 32, True, 1, 64, 64)
MARKER = "AUTOFLASH_FAULT_MARKER"

# Values a hostile or broken file may hold in any field.
nasty = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**63), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from([
        "'; drop table winners; --", f"__import__('os').system('touch {MARKER}')",
        '{"BLOCK_M": 64, "LOADS": "__import__(\\"os\\")"}', "fwd/float32/d32/causal/g1/q0/k0",
        "fwd/float32/d-32/causal/g1/q64/k64", "bwd/float32/d32/causal/g1/q64/k64", "{}", "[]", "nan"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def good_row() -> dict:
    variant = default_variant("fwd", PROBLEM, DEVICE)
    return {"gpu_key": DEVICE.key, "problem": PROBLEM.key, "template_hash": codegen.template_hash("fwd"),
            "op": "fwd", "dtype": "float32", "head_dim": 32, "causal": 1, "gqa_group": 1, "seqlen_q": 64,
            "seqlen_k": 64, "variant": variant.json(), "median_ms": 1.0, "spread": 0.01, "tflops": 1.0,
            "default_ms": 2.0, "sdpa_cudnn_ms": None, "sdpa_flash_ms": None, "trials": 3, "run_id": None,
            "shape": None, "updated_at": "then"}


def mutated_rows(draw_changes) -> list[dict]:
    rows = []
    for changes, drop, extra in draw_changes:
        row = {**good_row(), **changes}
        for key in drop:
            row.pop(key, None)
        row.update(extra)
        rows.append(row)
    return rows


fields = st.sampled_from(sorted(good_row()))
row_changes = st.tuples(st.dictionaries(fields, nasty, max_size=3), st.lists(fields, max_size=2),
                        st.dictionaries(st.sampled_from(["bogus", "x; drop"]), nasty, max_size=1))


def snapshot(path) -> list:
    return sorted(map(repr, sqlite3.connect(path).execute("select * from winners").fetchall()))


@pytest.mark.interpreter
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(row_changes, min_size=1, max_size=3), top=st.dictionaries(
    st.sampled_from(["format", "schema_version", "gpus"]), nasty, max_size=1))
def test_any_import_file_is_all_or_nothing_and_serves_right_answers(tmp_path_factory, changes, top, monkeypatch):
    tmp = tmp_path_factory.mktemp("rand")
    monkeypatch.chdir(tmp)
    db = tmp / "user.db"
    store = Store(db)
    data = {"format": "autoflash-winners", "schema_version": 1,
            "gpus": [{"gpu_key": DEVICE.key, **DEVICE.as_dict()}], "winners": mutated_rows(changes), **top}
    data = json.loads(json.dumps(data, default=str))  # what a file can hold (NaN/inf survive as JSON extensions)
    before = snapshot(db)
    try:
        counts = store.import_winners(data)
    except StoreError:
        assert snapshot(db) == before  # refused: nothing written
    else:
        assert counts["added"] + counts["updated"] + counts["unchanged"] + counts["rejected"] == len(data["winners"])
    finally:
        store.close()
    assert not (tmp / MARKER).exists()  # no code ran
    # A model using this DB: the served kernel (tuned row or default) gives the right answer.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # rejected rows cost a warning
        dispatcher = Dispatcher(winner_paths=[db])
        q = torch.randn(1, 2, 45, 32, generator=torch.Generator().manual_seed(1))
        out, lse = torch.empty_like(q), torch.empty(1, 2, 45)
        dispatcher.kernel_for(q, q, q, out, causal=True).forward(q, q, q, out, lse, 32 ** -0.5, True, 0)
    assert rel_error(out, reference(q, q, q, True, 0, 32 ** -0.5)[0]) < 1e-4
    assert not math.isnan(out.sum().item())
