"""`autoflash bench --variants` on the CPU (the Triton interpreter, tiny cases): every method of every
case has its row, agreed with the reference before it was timed, and FLOPs count the visible pairs."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from autoflash import bench_variants
from autoflash.bench_variants import ERR_LIMIT, INTERPRETER_CASES, VariantCase
from autoflash.cli import cli

# case variant -> the methods the interpreter runs (FlexAttention uncompiled: no max-autotune there)
METHODS = {"window": {"autoflash", "sdpa-mask", "flex"}, "softcap": {"autoflash", "torch-eager", "flex"},
           "documents": {"autoflash", "autoflash-varlen", "sdpa-mask", "flex"}}


def run(*args):
    return CliRunner().invoke(cli, ["bench", "--variants", "--interpret", "--rounds", "1", *args],
                              catch_exceptions=False)


def rows_by_case(rows):
    cases = {}
    for r in rows:
        cases.setdefault(r["variant"], {})[r["impl"]] = r
    return cases


@pytest.mark.interpreter
def test_the_forward_rows_are_there_and_every_method_agreed_before_timing(tmp_path):
    out = tmp_path / "variants.json"
    r = run("--json", str(out))
    assert r.exit_code == 0, r.output
    cases = rows_by_case(json.loads(out.read_text()))
    assert {v: set(m) for v, m in cases.items()} == METHODS
    for variant, methods in cases.items():
        for impl, row in methods.items():
            assert row["note"] == "" and row["err"] <= ERR_LIMIT, (variant, impl, row)
            assert row["fwd_tflops"] > 0 and row["ms"] > 0
            assert {"seqlen", "heads_q", "heads_kv", "head_dim", "dtype", "visible_pairs", "gpu", "triton"} <= set(row)
    assert cases["documents"]["flex"]["compiled"] is False  # (the interpreter runs FlexAttention eagerly)


@pytest.mark.interpreter
def test_forward_and_backward_rows_check_gradients_and_say_why_flex_is_not_run(tmp_path):
    out = tmp_path / "variants.json"
    r = run("--fwdbwd", "--json", str(out))
    assert r.exit_code == 0, r.output
    cases = rows_by_case(json.loads(out.read_text()))
    for variant, methods in cases.items():
        assert set(methods) == METHODS[variant]
        for impl, row in methods.items():
            if impl == "flex":
                assert row["fwdbwd_tflops"] is None and "no backward on the CPU" in row["note"]
            else:
                assert row["note"] == "" and row["err"] <= ERR_LIMIT and row["fwdbwd_tflops"] > 0, (variant, impl)


@pytest.mark.interpreter
def test_a_method_that_ignores_the_documents_is_reported_wrong_and_not_timed(monkeypatch):
    import autoflash

    def no_documents(q, k, v, documents, causal=True):  # plain causal attention over the whole row
        return autoflash.flash_attn_func(q, k, v, causal=causal)

    monkeypatch.setattr(autoflash, "document_attention", no_documents)
    case = next(c for c in INTERPRETER_CASES if c.variant == "documents")
    rows = {r["impl"]: r for r in bench_variants.run_variants([case], rounds=1, device="cpu")}
    assert rows["autoflash"]["note"].startswith("wrong") and rows["autoflash"]["ms"] is None
    assert rows["autoflash"]["fwd_tflops"] is None and rows["autoflash"]["err"] > ERR_LIMIT
    assert rows["autoflash-varlen"]["note"] == "" and rows["autoflash-varlen"]["ms"] > 0


DOCUMENTS_GPU_CASE = next(c for c in bench_variants.GPU_CASES if c.variant == "documents")


@pytest.mark.parametrize("case", [*INTERPRETER_CASES, DOCUMENTS_GPU_CASE,
                                  VariantCase("window", 2, 50, 2, 1, 16, "float32", window=64),
                                  VariantCase("window", 1, 50, 2, 1, 16, "float32", window=1),
                                  VariantCase("documents", 1, 9, 2, 1, 16, "float32", documents=9)])
def test_flops_count_exactly_the_pairs_the_mask_lets_through(case):
    ids = case.document_ids("cpu") if case.variant == "documents" else None
    assert case.visible_pairs() == int(case.visible(torch.arange(case.seqlen), ids).sum())
    assert case.flops(True) == 3.5 * case.flops(False) == 3.5 * 4 * case.head_dim * case.heads_q * case.visible_pairs()
    if case.variant == "documents":
        lengths = case.document_lengths()
        assert len(lengths) == case.documents and sum(lengths) == case.seqlen and min(lengths) >= 1
        assert len(set(lengths)) > 1 or case.documents == case.seqlen  # ragged



@pytest.mark.interpreter
def test_a_sample_of_rows_checks_gradients_as_on_the_gpu(monkeypatch):
    """On the GPU the reference covers sampled query rows only (the output's gradient is zero elsewhere,
    so dK and dV come from those rows alone): the right methods still agree, a wrong one does not."""
    import autoflash

    case = next(c for c in INTERPRETER_CASES if c.variant == "documents")
    monkeypatch.setattr(bench_variants, "_rows", lambda case, device: torch.tensor([0, 5, 30, 47, 48, 95]))
    rows = {r["impl"]: r for r in bench_variants.run_variants([case], fwdbwd=True, rounds=1, device="cpu")}
    assert all(rows[m]["note"] == "" and rows[m]["err"] <= 1e-5 for m in ("autoflash", "autoflash-varlen", "sdpa-mask"))
    monkeypatch.setattr(autoflash, "document_attention",
                        lambda q, k, v, documents, causal=True: autoflash.flash_attn_func(q, k, v, causal=causal))
    rows = {r["impl"]: r for r in bench_variants.run_variants([case], fwdbwd=True, rounds=1, device="cpu")}
    assert rows["autoflash"]["note"].startswith("wrong")


def test_the_softcap_cases_inputs_make_a_missing_softcap_fail_the_check():
    """Scores of unit spread barely feel a cap of 50: the inputs spread them so that dropping the
    softcap errs far above the limit (the GPU case's sizes, shorter)."""
    case = VariantCase("softcap", 1, 512, 2, 1, 256, "float32", softcap=50.0)
    t = bench_variants._inputs(case, torch.device("cpu"), False)
    rows = torch.arange(case.seqlen)
    capped, _ = bench_variants._reference(case, t, None, rows, None, False)
    uncapped, _ = bench_variants._reference(VariantCase("softcap", 1, 512, 2, 1, 256, "float32"), t, None, rows,
                                            None, False)
    assert bench_variants._rel(uncapped, capped) > 2 * ERR_LIMIT


def test_each_row_of_the_documents_case_is_packed_differently():
    ids = VariantCase("documents", 3, 96, 2, 1, 16, "float32", documents=4).document_ids("cpu")
    assert not torch.equal(ids[0], ids[1]) and not torch.equal(ids[1], ids[2])


@pytest.mark.interpreter
def test_an_autoflash_method_that_falls_back_to_torch_is_not_timed_under_its_name(monkeypatch):
    from autoflash import api, variant_forward

    monkeypatch.setattr(variant_forward, "unsupported", lambda *args, **kwargs: "a reason the kernels refuse")
    api.reset()
    rows = bench_variants.run_variants(INTERPRETER_CASES[:1], rounds=1, rep_ms=1, device="cpu")
    api.reset()
    row = next(r for r in rows if r["impl"] == "autoflash")
    assert row["ms"] is None and "FallbackError" in row["note"], row
    assert next(r for r in rows if r["impl"] == "sdpa-mask")["ms"] > 0  # (the others still timed)


def test_flex_recompiles_are_allowed_for_the_run_only_and_a_limit_hit_raises():
    """Ten compiles of flex_attention (five cases, two modes) must not pass dynamo's recompile limit,
    where torch would run it uncompiled (the scores materialized); the settings are the run's alone."""
    import torch._dynamo

    from autoflash.bench_variant_methods import compile_limits

    config = torch._dynamo.config
    before = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    with compile_limits():
        assert config.recompile_limit >= 20
        assert config.fail_on_recompile_limit_hit
    assert (config.recompile_limit, config.fail_on_recompile_limit_hit) == before
    with config.patch(suppress_errors=True), compile_limits():  # (dynamo refuses both at once)
        assert not config.fail_on_recompile_limit_hit
        assert torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2)).tolist() == [2.0, 2.0]
