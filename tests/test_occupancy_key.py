"""The occupancy bucket of the problem key: its values, the nearest rule across buckets, and the
named migration that lets results DBs written before it open, merge and serve their old rows."""

import sqlite3

import pytest
import sqlite_utils
import torch

from autoflash import codegen, store_migrations
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import Dispatcher, WinnerTable
from autoflash.problem import Problem, Shape, work_bucket
from autoflash.space import load_space
from autoflash.store import SCHEMA_VERSION, Store

DEVICE = gpu_fingerprint()
THASH = codegen.template_hash("fwd")


def prob(work=None, q=1024):
    return Problem("fwd", "float16", 64, False, 1, q, q, work)


def variant(index, problem=None):
    return load_space("fwd").valid_variants(problem or prob(), DEVICE)[index]


def test_work_bucket_is_log2_of_tiles_per_sm():
    # B=1, 8 heads, 4096 queries: 8 x 32 tiles of 128 rows on 132 SMs = 1.94 per SM -> 2^1
    assert work_bucket(1, 8, 4096, 132) == 1
    assert work_bucket(4, 32, 2048, 132) == 4  # 2048 tiles, 15.5 per SM: the regime of the tuned grid
    assert work_bucket(1, 1, 1, 132) == -6  # clamped
    assert work_bucket(1024, 128, 1 << 20, 1) == 10  # clamped
    shape = Shape(batch=1, heads_q=8, heads_kv=8, seqlen_q=4096, seqlen_k=16, head_dim=128, causal=True,
                  dtype="bfloat16")
    assert shape.problem_on(132).work == 1
    # the backward's KV-outer grid runs over the keys: 8 x 1 tile -> 2^-4
    assert Shape(**{**shape.__dict__, "op": "bwd"}).problem_on(132).work == -4


def test_key_round_trips_with_and_without_the_bucket():
    for p in (prob(), prob(3), prob(-2)):
        assert Problem.from_key(p.key) == p
    assert prob(-2).key.endswith("/k1024/w-2") and prob().key.endswith("/k1024")
    for bad in ("fwd/float16/d64/full/g1/q1024/k1024/w", "fwd/float16/d64/full/g1/q1024/k1024/w99",
                "fwd/float16/d64/full/g1/q1024/k1024/w03"):
        with pytest.raises(ValueError):
            Problem.from_key(bad)


def make_db(path, rows):
    store = Store(path)
    store.add_gpu(DEVICE)
    for problem, v in rows:
        store.set_winner(gpu_key=DEVICE.key, problem=problem, template_hash=THASH, variant_json=v.json(),
                         median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    store.close()
    return path


def test_a_winner_is_served_one_occupancy_bucket_away_but_not_further(tmp_path):
    big, small = variant(1), variant(2)
    table = WinnerTable(DEVICE, [make_db(tmp_path / "w.db", [(prob(5), big), (prob(1), small)])])
    assert table.lookup(prob(5)) == (big, "exact")
    assert table.lookup(prob(4)) == (big, "nearest (fwd/float16/d64/full/g1/q1024/k1024/w5)")
    assert table.lookup(prob(0))[0] == small
    assert table.lookup(prob(2))[0] == small  # one from w1, three from w5
    assert table.lookup(prob(-1)) == (None, "default")  # two buckets from the smallest: the default serves
    # a query without a bucket (a key typed by hand) sees every row
    assert table.lookup(prob())[0] in (big, small)


def _version_1_db(path, problem, v):
    """A results DB as autoflash wrote it before the occupancy bucket: migrations 001 and 002,
    schema version 1, a winner under a key without /w<n>."""
    db = sqlite_utils.Database(sqlite3.connect(str(path)))
    db["_migrations"].create({"name": str, "applied_at": str}, pk="name")
    db["_meta"].create({"key": str, "value": str}, pk="key")
    store_migrations._m001_initial(db)
    store_migrations._m002_run_process(db)
    db["_migrations"].insert_all([{"name": n, "applied_at": "2026-11-30"} for n in ("001_initial", "002_run_process")])
    db["_meta"].insert({"key": "schema_version", "value": "1"})
    db["gpus"].insert(DEVICE.as_dict() | {"gpu_key": DEVICE.key})
    db["winners"].insert({"gpu_key": DEVICE.key, "problem": problem.key, "template_hash": THASH, "op": "fwd",
                          "dtype": "float16", "head_dim": 64, "causal": 0, "gqa_group": 1, "seqlen_q": 1024,
                          "seqlen_k": 1024, "variant": v.json(), "median_ms": 1.0, "trials": 3})
    db.conn.commit()
    db.close()
    return path


def test_old_dbs_open_read_only_and_their_rows_serve_by_the_nearest_bucket(tmp_path):
    old = _version_1_db(tmp_path / "old.db", prob(), variant(3))
    table = WinnerTable(DEVICE, [old])  # opened read-only, as shipped DBs are: never migrated
    assert table.lookup(prob(5)) == (variant(3), "nearest (fwd/float16/d64/full/g1/q1024/k1024)")
    assert table.lookup(prob(-6))[0] == variant(3)  # an old row knows no regime: it serves any
    # a winner tuned for the call's own bucket beats it
    new = make_db(tmp_path / "new.db", [(prob(4), variant(4))])
    assert WinnerTable(DEVICE, [old, new]).lookup(prob(4)) == (variant(4), "exact")
    assert WinnerTable(DEVICE, [old, new]).lookup(prob(3))[0] == variant(4)  # one bucket away beats an old row
    assert sqlite3.connect(old).execute("select value from _meta").fetchone() == ("1",)


def test_opening_an_old_db_for_writing_applies_the_named_migration_and_keeps_its_rows(tmp_path):
    old = _version_1_db(tmp_path / "old.db", prob(), variant(3))
    store = Store(old)
    assert [r["name"] for r in store.db["_migrations"].rows][-2:] == ["003_occupancy_key", "004_paged_key"]
    assert store.db.execute("select value from _meta where key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    (row,) = store.winners()
    assert row["problem"] == prob().key and row["work"] is None and row["page"] is None
    store.set_winner(gpu_key=DEVICE.key, problem=prob(2), template_hash=THASH, variant_json=variant(5).json(),
                     median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    assert {r["problem"]: r["work"] for r in store.winners()} == {prob().key: None, prob(2).key: 2}
    store.close()


def test_an_old_db_merges_into_a_new_one(tmp_path):
    old = _version_1_db(tmp_path / "old.db", prob(), variant(3))
    new = Store(make_db(tmp_path / "new.db", [(prob(2), variant(5))]))
    assert new.merge_from(old)["added"] == 1
    assert {r["problem"] for r in new.winners()} == {prob().key, prob(2).key}
    new.close()


@pytest.mark.interpreter
def test_the_dispatcher_keys_a_call_by_its_occupancy(tmp_path):
    """Two calls of one length bucket but very different batch land in different problems, and a
    winner tuned for the big batch is not served to the small one."""
    q_big = torch.randn(64, 2, 64, 32, dtype=torch.float16)  # 128 tiles on the interpreter's 1 "SM": w7
    q_small = q_big[:1]  # 2 tiles: w1
    d = Dispatcher(winner_paths=[])
    p_big = d.problem_for(q_big, q_big, False, "fwd", DEVICE.sm_count)
    p_small = d.problem_for(q_small, q_small, False, "fwd", DEVICE.sm_count)
    assert (p_big.work, p_small.work) == (7, 1) and p_big.seqlen_q == p_small.seqlen_q
    tuned = variant(6, p_big)
    d = Dispatcher(winner_paths=[make_db(tmp_path / "w.db", [(p_big, tuned)])])
    assert d.kernel_for(q_big, q_big, q_big, torch.empty_like(q_big), causal=False).variant == tuned
    assert d.kernel_for(q_small, q_small, q_small, torch.empty_like(q_small), causal=False).variant != tuned
