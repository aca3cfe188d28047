"""Compiling a benchmark's kernels ahead in worker processes (`autoflash.bench_warm`)."""

import pytest

from autoflash.bench_warm import compile_ahead
from autoflash.problem import Shape


def _shapes():
    return [Shape(batch=1, heads_q=4, heads_kv=2, seqlen_q=n, seqlen_k=n, head_dim=d, causal=c,
                  dtype="bfloat16", op="fwd") for n, d, c in ((256, 64, True), (300, 128, False))]


def test_one_job_compiles_nothing_ahead():
    assert compile_ahead(_shapes(), "fwd", jobs=1) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_workers_run_every_method_once(mode):
    assert compile_ahead(_shapes(), mode, jobs=2) == 0
