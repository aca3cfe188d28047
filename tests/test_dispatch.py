"""Dispatcher: winners from SQLite (exact, nearest bucket, default), what is ignored or rejected."""

import dataclasses
import json
import warnings

import pytest
import torch

from autoflash import codegen
from autoflash.dispatch import Dispatcher, WinnerTable
from autoflash.reference import reference, rel_error
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem
from autoflash.space import load_space
from autoflash.store import Store
from helpers import OTHER_LOADS, default_for

DEVICE = gpu_fingerprint()
THASH = codegen.template_hash("fwd")


def problem(q=1024, k=1024, causal=False, head_dim=64, dtype="float16"):
    return Problem("fwd", dtype, head_dim, causal, 1, q, k)


def some_variant(prob, index):
    return load_space("fwd").valid_variants(prob, DEVICE)[index]


def make_db(path, rows, device=DEVICE, template_hash=THASH):
    store = Store(path)
    store.add_gpu(device)
    for prob, variant_json in rows:
        store.set_winner(gpu_key=device.key, problem=prob, template_hash=template_hash, variant_json=variant_json,
                         median_ms=1.0, spread=0.01, tflops=1.0, trials=5)
    store.close()
    return path


def test_exact_nearest_and_default(tmp_path):
    p1k, p8k = problem(1024, 1024), problem(8192, 8192)
    v1, v8 = some_variant(p1k, 3), some_variant(p8k, 7)
    db = make_db(tmp_path / "w.db", [(p1k, v1.json()), (p8k, v8.json())])
    table = WinnerTable(DEVICE, [db])
    assert table.lookup(p1k) == (v1, "exact")
    variant, how = table.lookup(problem(2048, 2048))
    assert variant == v1 and how.startswith("nearest")
    assert table.lookup(problem(16384, 16384))[0] == v8
    assert table.lookup(problem(causal=True)) == (None, "default")  # no causal winner: default
    assert table.lookup(problem(head_dim=128)) == (None, "default")


def test_user_db_wins_over_shipped(tmp_path):
    p = problem()
    user = make_db(tmp_path / "user.db", [(p, some_variant(p, 1).json())])
    shipped = make_db(tmp_path / "shipped.db", [(p, some_variant(p, 2).json())])
    assert WinnerTable(DEVICE, [user, shipped]).lookup(p)[0] == some_variant(p, 1)


def test_foreign_gpu_and_stale_template_are_ignored(tmp_path):
    p = problem()
    other = dataclasses.replace(DEVICE, name="Some Other GPU")
    db1 = make_db(tmp_path / "foreign.db", [(p, some_variant(p, 1).json())], device=other)
    db2 = make_db(tmp_path / "stale.db", [(p, some_variant(p, 1).json())], template_hash="0" * 16)
    assert WinnerTable(DEVICE, [db1, db2]).rows == {}


@pytest.mark.parametrize("mutate", [
    lambda d: {**d, "BLOCK_M": 96},  # outside the declared choices
    lambda d: {**d, "LOADS": "tma\"\nimport os; os.system('touch /tmp/pwned')\n#"},  # injected text
    lambda d: {**d, "EXTRA": 1},  # unknown knob
    lambda d: "not a dict",
])
def test_out_of_space_or_injected_rows_are_rejected(tmp_path, mutate):
    p = problem()
    bad = json.dumps(mutate(some_variant(p, 0).as_dict()))
    db = make_db(tmp_path / "bad.db", [(p, bad)])
    before = set(codegen.kernel_cache_dir().glob("*.py")) if codegen.kernel_cache_dir().exists() else set()
    with pytest.warns(RuntimeWarning, match="rejected winner"):
        table = WinnerTable(DEVICE, [db])
    assert table.rows == {}
    assert len(table.rejected) == 1 and p.key in table.rejected[0]  # what `autoflash bench` reports
    after = set(codegen.kernel_cache_dir().glob("*.py")) if codegen.kernel_cache_dir().exists() else set()
    assert not any("pwned" in f.read_text() for f in after - before)


def test_corrupt_or_foreign_version_db_warns_and_uses_default(tmp_path):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"garbage" * 1000)
    with pytest.warns(RuntimeWarning, match="ignoring results DB"):
        table = WinnerTable(DEVICE, [corrupt, tmp_path / "missing.db"])
    assert table.lookup(problem()) == (None, "default")
    d = Dispatcher(winner_paths=[corrupt])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        v = d.variant_for(problem(), DEVICE)
    assert v == default_for("fwd", "float16", 64, has_tma=True)


@pytest.mark.interpreter
def test_dispatcher_launches_the_tuned_winner(tmp_path):
    p = problem(64, 64, causal=True)
    winner = load_space("fwd").validate(dict(default_for("fwd", "float16", 64, has_tma=True).as_dict(),
                                             BLOCK_M=64, BLOCK_N=32, LOADS=OTHER_LOADS), p, DEVICE)
    d = Dispatcher(winner_paths=[make_db(tmp_path / "w.db", [(p, winner.json())])])
    q = torch.randn(1, 2, 61, 64, dtype=torch.float16)
    out = torch.empty_like(q)
    kernel = d.kernel_for(q, q, q, out, causal=True)
    assert (kernel.variant["BLOCK_M"], kernel.variant["BLOCK_N"], kernel.variant["LOADS"]) == (64, 32, OTHER_LOADS)
    lse = torch.empty(1, 2, 61)
    kernel.forward(q, q, q, out, lse, 0.125, True, 0)
    ref, _ = reference(q, q, q, True, 0, 0.125)
    assert rel_error(out, ref) < 2e-3


@pytest.mark.interpreter
def test_tune_on_miss_is_opt_in_and_stores_a_winner(tmp_path, monkeypatch):
    db = tmp_path / "user.db"
    monkeypatch.setenv("AUTOFLASH_DB", str(db))
    q = torch.randn(1, 2, 45, 64, dtype=torch.float16)
    Dispatcher(winner_paths=[db]).kernel_for(q, q, q, torch.empty_like(q), causal=False)
    assert not db.exists()  # off by default: no tuning, no DB written
    monkeypatch.setenv("AUTOFLASH_TUNE_ON_MISS", "1")
    monkeypatch.setenv("AUTOFLASH_TUNE_ON_MISS_TRIALS", "2")
    d = Dispatcher(winner_paths=[db])
    module = d.kernel_for(q, q, q, torch.empty_like(q), causal=False)
    store = Store(db)
    (winner,) = store.winners()
    assert winner["problem"] == "fwd/float16/d64/full/g1/q64/k64/w1"  # 2 tiles of work per (interpreter) SM
    assert module.variant["BLOCK_M"] == json.loads(winner["variant"])["BLOCK_M"]


def test_locked_db_warns_and_uses_default_without_stalling(tmp_path):
    import sqlite3

    p = problem()
    db = make_db(tmp_path / "locked.db", [(p, some_variant(p, 1).json())])
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode=DELETE")  # a rollback-journal DB: an exclusive lock blocks readers
    con.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.warns(RuntimeWarning, match="ignoring results DB"):
            table = WinnerTable(DEVICE, [db])
        assert table.lookup(p) == (None, "default")
    finally:
        con.rollback()
        con.close()
    assert WinnerTable(DEVICE, [db]).lookup(p)[0] == some_variant(p, 1)


@pytest.mark.interpreter
def test_backward_winner_is_served_through_autograd(tmp_path, monkeypatch):
    import autoflash
    import autoflash.dispatch
    from autoflash.reference import reference_grads
    from autoflash.problem import seqlen_bucket

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(1, 2, 40, 32, generator=g)
    prob = Problem("bwd", "float32", 32, True, 1, seqlen_bucket(40), seqlen_bucket(40))
    winner = [w for w in load_space("bwd").valid_variants(prob, DEVICE) if w["DQ_MODE"] == "atomic"][-1]
    assert winner != default_for("bwd", "float32", 32, has_tma=False)
    db = make_db(tmp_path / "bwd.db", [(prob, winner.json())], template_hash=codegen.template_hash("bwd"))
    dispatcher = Dispatcher([db])
    monkeypatch.setattr(autoflash.dispatch, "_dispatcher", dispatcher)
    autoflash.attention(q, k, v, is_causal=True).backward(grad)
    assert any(m is codegen.load(winner) for m in dispatcher.kernels.values())
    for mine, ref in zip((q.grad, k.grad, v.grad), reference_grads(q, k, v, grad, True, 0, 32 ** -0.5)):
        assert rel_error(mine, ref) < 1e-4


@pytest.mark.interpreter
def test_backward_reads_grad_out_through_tma_only_when_it_can(monkeypatch):
    """The d128-class backward default loads dO through TMA descriptors, which need a unit last
    stride: a dO without one gets the pointer-load twin (the choice is keyed on dO, not on O), and
    both calls give the right gradients."""
    import autoflash
    import autoflash.dispatch
    from autoflash.reference import reference_grads

    assert default_for("bwd", "float32", 96, has_tma=True)["LOADS"] == "tma"
    dispatcher = Dispatcher([])  # no DBs: the built-in defaults
    monkeypatch.setattr(autoflash.dispatch, "_dispatcher", dispatcher)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 96, generator=g).requires_grad_() for _ in range(3))
    strided = torch.randn(1, 2, 40, 2 * 96, generator=g)[..., ::2]  # last stride 2
    ran = []
    real_backward = codegen.Kernel.backward
    monkeypatch.setattr(codegen.Kernel, "backward", lambda self, *a: ran.append(self.variant["LOADS"]) or real_backward(self, *a))
    for grad, loads in ((strided, "pointer"), (strided.contiguous(), "tma")):
        for t in (q, k, v):
            t.grad = None
        autoflash.attention(q, k, v, is_causal=True).backward(grad)
        assert ran[-1] == loads
        for mine, ref in zip((q.grad, k.grad, v.grad), reference_grads(q, k, v, grad, True, 0, 96 ** -0.5)):
            assert rel_error(mine, ref) < 1e-4


def test_every_shipped_winner_is_servable_on_its_own_gpu():
    """A shipped row of a current template that its GPU's dispatcher would reject (a knob missing
    after a template gained one, a value the space no longer allows) silently serves defaults
    there: the dispatcher's own table, built for each GPU stored in a shipped DB, rejects none."""
    import contextlib
    import sqlite3

    from autoflash import resources
    from autoflash.device import GPUFingerprint

    fields = [f.name for f in dataclasses.fields(GPUFingerprint)]
    served = 0
    for path in resources.shipped_databases():
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            db.row_factory = sqlite3.Row
            gpus = [GPUFingerprint(**{f: row[f] for f in fields}) for row in db.execute("SELECT * FROM gpus")]
            # a row of no current template is never served: a change to a template or a vendor
            # space whose `replaces` record does not carry the shipped rows over leaves them dead
            stale = [(row["problem"], row["template_hash"]) for row in db.execute("SELECT * FROM winners")
                     if codegen.family_for_hash(Problem.from_key(row["problem"]).op, row["template_hash"],
                                                earlier=True) is None]
            assert stale == [], f"{path.name}: {len(stale)} rows of no current template, e.g. {stale[:2]}"
        for gpu in gpus:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the rejections are asserted below
                table = WinnerTable(gpu, [path])
            assert table.rejected == [], table.rejected[:3]
            served += len(table.rows)
    assert served > 0
