"""Decode problems in the tuner and the dispatcher: keyed by (dtype, head dim, GQA group, new
tokens, cache length bucket, occupancy, paged block size), gated against the float64 reference on ragged cache
lengths with contiguous and paged caches, tuned into the DB, and served to flash_attn_with_kvcache."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from autoflash import decode_kernels, api, codegen, decode
from autoflash.device import gpu_fingerprint
from autoflash.problem import Problem, Shape
from autoflash.space import load_space
from autoflash.store import Store
from autoflash.tuning.gate import check, check_decode

pytestmark = pytest.mark.interpreter
DEVICE = gpu_fingerprint()
SHAPE = Shape(batch=2, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_k=64, head_dim=32, causal=False, dtype="float16",
              op="decode")


def test_the_gate_passes_the_default_decode_kernel_and_refuses_a_wrong_one():
    kernel = decode_kernels.load_kernel(dict(decode_kernels.default_knobs(torch.float16, 32, 2, 1, 64, False)))
    for shape in (SHAPE, Shape(**{**SHAPE.__dict__, "seqlen_q": 4, "causal": True})):
        result = check(kernel, shape, "cpu")
        assert result.passed, result.detail
        assert result.err <= 2 * result.sdpa_err + 5e-4

    class OffByAScale:  # the right kernel with a wrong softmax scale: close, but wrong
        op = "decode"

        def decode(self, q, k, v, o, lse, scale, *args, **kwargs):
            return kernel.decode(q, k, v, o, lse, scale * 1.05, *args, **kwargs)
    result = check_decode(OffByAScale(), SHAPE, "cpu")
    assert not result.passed and "wrong decode result" in result.detail


def _run(*args, db):
    env = {**os.environ, "TRITON_INTERPRET": "1", "AUTOFLASH_DB": str(db)}
    done = subprocess.run([sys.executable, "-m", "autoflash", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_decode_problems_are_tuned_and_then_served_exact(tmp_path):
    db = tmp_path / "user.db"
    _run("tune", "--interpret", "--ops", "decode", "--trials", "2", "--db", str(db), db=db)
    store = Store(db)
    rows = store.winners()
    store.close()
    assert {r["op"] for r in rows} == {"decode"} and len(rows) == 3  # decode_tiny: three problems
    assert sorted(r["page"] for r in rows if r["page"] is not None) == [16]  # one of them paged
    out = _run("which", "--interpret", "--op", "decode", "--shapes", "decode_tiny", db=db)
    assert out.count("exact") == 3


def test_flash_attn_with_kvcache_serves_the_tuned_decode_winner(tmp_path, monkeypatch):
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16)
    cache = torch.randn(2, 64, 2, 32, dtype=torch.float16)
    problem = decode_kernels.decode_problem(q.dtype, 32, 2, 2, 2, 1, 64, False, DEVICE.sm_count)
    assert problem == SHAPE.problem  # the tensors' key is the shape set's key
    tuned = load_space("triton_decode").check_declared({**dict(decode_kernels.default_knobs(q.dtype, 32, 2, 1, 64, False)),
                                                        "BLOCK_N": 32, "NUM_SPLITS": 2})
    store = Store(tmp_path / "user.db")
    store.add_gpu(DEVICE)
    store.set_winner(gpu_key=DEVICE.key, problem=problem, template_hash=codegen.template_hash("triton_decode"),
                     variant_json=tuned.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=2)
    store.close()
    monkeypatch.setenv("AUTOFLASH_DB", str(tmp_path / "user.db"))
    api.reset()
    try:
        assert decode_kernels._served_knobs(q, cache, 64, False, None, None) == tuned.as_dict()
        lens = torch.tensor([0, 40], dtype=torch.int32)
        out = decode.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens)
        ref, _ = decode.torch_decode(q.double(), cache.double(), cache.double(), lens, None, 32 ** -0.5, False)
        assert float((out.double() - ref).norm() / ref.norm()) < 2e-3
        # a caller's override still applies on top of the tuned winner
        assert decode_kernels._served_knobs(q, cache, 64, False, None, {"BLOCK_N": 64})["NUM_SPLITS"] == 2
    finally:
        api.reset()


def test_the_paged_block_size_is_part_of_the_decode_key():
    paged = dataclasses.replace(SHAPE, page=16).problem
    assert paged.key == SHAPE.problem.key + "/p16" and Problem.from_key(paged.key) == paged
    assert dataclasses.replace(SHAPE, op="fwd", page=16).problem.page is None  # other ops ignore it
    with pytest.raises(ValueError, match="decode key"):
        Problem("fwd", "float16", 32, False, 1, 64, 64, page=16)
    with pytest.raises(ValueError, match="page"):
        Problem.from_key(SHAPE.problem.key + "/p0")


def test_a_paged_winner_serves_only_calls_with_that_page_size(tmp_path, monkeypatch):
    """A winner tuned on 16-token pages serves 16-token pages (exact, and by the nearest-bucket
    rule at another length), never a contiguous cache or another page size (the default does)."""
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16)
    pages = torch.randn(8, 16, 2, 32, dtype=torch.float16)
    default = dict(decode_kernels.default_knobs(q.dtype, 32, 2, 1, 64, False))
    tuned = load_space("triton_decode").check_declared({**default, "BLOCK_N": 16, "NUM_SPLITS": 4})
    problem = decode_kernels.decode_problem(q.dtype, 32, 2, 2, 2, 1, 64, False, DEVICE.sm_count, page=16)
    store = Store(tmp_path / "user.db")
    store.add_gpu(DEVICE)
    store.set_winner(gpu_key=DEVICE.key, problem=problem, template_hash=codegen.template_hash("triton_decode"),
                     variant_json=tuned.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=2)
    assert [r["page"] for r in store.winners()] == [16]
    store.close()
    monkeypatch.setenv("AUTOFLASH_DB", str(tmp_path / "user.db"))
    api.reset()
    try:
        assert decode_kernels._served_knobs(q, pages, 64, False, 16, None) == tuned.as_dict()
        assert decode_kernels._served_knobs(q, pages, 128, False, 16, None) == tuned.as_dict()  # nearest
        assert decode_kernels._served_knobs(q, pages, 64, False, None, None) == default
        assert decode_kernels._served_knobs(q, pages, 64, False, 32, None) == default
        # and the launch of a paged call runs it, correctly
        table = torch.tensor([[3, 0, 5, 1], [2, 7, 4, 6]], dtype=torch.int32)
        lens = torch.tensor([64, 23], dtype=torch.int32)
        out = decode.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table)
        ref, _ = decode.torch_decode(q.double(), pages.double(), pages.double(), lens, table, 32 ** -0.5, False)
        assert float((out.double() - ref).norm() / ref.norm()) < 2e-3
    finally:
        api.reset()
