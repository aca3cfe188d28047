"""Faults at the API's doors: bad arguments raise ValueError naming them; a broken environment
(kernel cache, DB, tune-on-miss) never breaks the model's call: it gets the right answer."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import autoflash
from autoflash import api


def _qkv(dtype=torch.float32, n=37):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, 32, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_non_floating_inputs_are_a_value_error(dtype):
    q, k, v = (t.to(dtype) for t in _qkv())
    with pytest.raises(ValueError, match="query must be a floating-point tensor"):
        autoflash.attention(q, k, v)
    with pytest.raises(ValueError, match="q must be a floating-point tensor"):
        autoflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


@pytest.mark.parametrize("dropout_p", [1.5, float("inf")])
def test_dropout_above_one_is_a_value_error(dropout_p):
    with pytest.raises(ValueError, match="dropout_p"):
        autoflash.attention(*_qkv(), dropout_p=dropout_p)


@pytest.mark.parametrize("dropout_p", [-0.1, float("nan")])
@pytest.mark.parametrize("heads_kv", [2, 1])
def test_a_negative_or_nan_dropout_is_torchs_to_answer_or_refuse(dropout_p, heads_kv):
    """torch's math backend reads it as no dropout (K/V heads broadcast take that backend on the CPU), its
    CPU flash kernel refuses it: autoflash hands the call to torch as it is."""
    api.reset()  # (the warning comes once per reason)
    q, k, v = _qkv()
    k, v = k[:, :heads_kv], v[:, :heads_kv]
    try:
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            autoflash.attention(q, k, v, dropout_p=dropout_p)
        return
    with pytest.warns(api.FallbackWarning, match="dropout_p"):
        torch.testing.assert_close(autoflash.attention(q, k, v, dropout_p=dropout_p), theirs)


@pytest.mark.parametrize("name, value", [("dropout_p", "0.1"), ("dropout_p", None), ("scale", "0.1"),
                                         ("scale", [0.1]), ("scale", torch.tensor([0.1]))])
def test_a_number_of_a_kind_torch_refuses_is_torchs_type_error(name, value):
    with pytest.raises(TypeError):
        torch.nn.functional.scaled_dot_product_attention(*_qkv(), **{name: value})
    with pytest.raises(TypeError, match=f"argument '{name}' must be float"):
        autoflash.attention(*_qkv(), **{name: value})


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), True])
def test_a_scale_torch_takes_gets_torchs_answer_and_the_flash_attn_form_refuses_it(scale):
    # torch SDPA answers these (NaN, infinity, True as 1.0): so does autoflash.attention, through torch
    # where the kernels cannot take the number. flash-attn's form keeps its stricter check.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", api.FallbackWarning)
        out = autoflash.attention(*_qkv(), scale=scale)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(*_qkv(), scale=scale),
                               equal_nan=True)
    with pytest.raises(ValueError, match="softmax_scale"):
        autoflash.flash_attn_func(*(t.transpose(1, 2) for t in _qkv()), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", [0.1]])
def test_a_softmax_scale_that_is_no_number_is_a_value_error(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        autoflash.flash_attn_func(*(t.transpose(1, 2) for t in _qkv()), softmax_scale=scale)


@pytest.mark.parametrize("value, strict", [("false", False), ("0", False), ("off", False), ("", False),
                                           ("1", True), ("true", True), ("yes", True)])
def test_strict_mode_reads_its_variable_as_a_flag(monkeypatch, value, strict):
    monkeypatch.setenv("AUTOFLASH_STRICT", value)
    api.reset()
    q, k, v = _qkv()
    if strict:
        with pytest.raises(api.FallbackError):
            autoflash.attention(q, k, v, dropout_p=1.0)  # (0 < dropout_p < 1 runs on the kernels)
    else:
        with pytest.warns(api.FallbackWarning):
            autoflash.attention(q, k, v, dropout_p=1.0)


def _script_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOFLASH_")}
    return {**env, "TRITON_INTERPRET": "1", "AUTOFLASH_KERNEL_CACHE": str(tmp_path / "kernels"), **extra}


MODEL_SCRIPT = """
import json, sys, torch, autoflash
from autoflash.reference import reference, rel_error
with open(sys.argv[1], "a") as f:  # one line each time this program runs
    f.write("ran\\n")
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 37, 32, generator=g) for _ in range(3))
out = autoflash.attention(q, k, v, is_causal=True)
print(json.dumps({"err": rel_error(out, reference(q, k, v, True, 0, 32 ** -0.5)[0])}))
"""


@pytest.mark.interpreter
def test_tune_on_miss_never_reruns_a_script_without_a_main_guard(tmp_path):
    script, counter, db = tmp_path / "model.py", tmp_path / "runs.txt", tmp_path / "user.db"
    script.write_text(MODEL_SCRIPT)  # no `if __name__ == "__main__":` on purpose
    env = _script_env(tmp_path, AUTOFLASH_DB=str(db), AUTOFLASH_TUNE_ON_MISS="1", AUTOFLASH_TUNE_ON_MISS_TRIALS="1")
    done = subprocess.run([sys.executable, str(script), str(counter)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["err"] < 1e-4
    assert counter.read_text().splitlines() == ["ran"]  # the user's program ran exactly once
    import sqlite3

    assert sqlite3.connect(db).execute("select count(*) from winners").fetchone()[0] == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("db_kind", ["corrupt", "directory"])
def test_tune_on_miss_with_an_unusable_db_warns_and_answers(tmp_path, db_kind):
    db = tmp_path / "user.db"
    if db_kind == "corrupt":
        db.write_bytes(b"this is not a database" * 100)
    else:
        db.mkdir()
    env = _script_env(tmp_path, AUTOFLASH_DB=str(db), AUTOFLASH_TUNE_ON_MISS="1", AUTOFLASH_TUNE_ON_MISS_TRIALS="1")
    script = tmp_path / "model.py"
    script.write_text(MODEL_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs.txt")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["err"] < 1e-4
    assert "Traceback" not in done.stderr and "autoflash" in done.stderr  # one warning, not an error


@pytest.mark.interpreter
def test_no_usable_kernel_cache_falls_back_to_sdpa_with_the_right_answer(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    code = textwrap.dedent(f"""
        import json, tempfile, warnings, torch, autoflash
        tempfile.tempdir = {str(blocker / "tmp")!r}  # no private temporary directory either
        from autoflash.reference import reference, rel_error
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 37, 32, generator=g) for _ in range(3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = autoflash.attention(q, k, v, is_causal=True)
        print(json.dumps({{"err": rel_error(out, reference(q, k, v, True, 0, 32 ** -0.5)[0]),
                          "warnings": [str(w.message) for w in caught]}}))
    """)
    env = _script_env(tmp_path, AUTOFLASH_KERNEL_CACHE=str(blocker), AUTOFLASH_DB=str(tmp_path / "none.db"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["err"] < 1e-5
    assert any("falling back to torch SDPA" in w and "kernel cache" in w for w in result["warnings"])


@pytest.mark.interpreter
def test_two_concurrent_tuners_on_one_db_share_the_work(tmp_path):
    """Each candidate is claimed in the DB before it is measured: two tuners never measure the same
    variant of a problem twice (before: 31 of 302 trials repeated)."""
    db = tmp_path / "shared.db"
    env = _script_env(tmp_path)
    cmd = [sys.executable, "-m", "autoflash", "tune", "--interpret", "--shapes", "tiny", "--trials", "4",
           "--db", str(db)]
    procs = [subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outputs]
    import sqlite3

    rows = sqlite3.connect(db).execute("select problem, template_hash, variant, status from trials").fetchall()
    keys = [r[:3] for r in rows]
    assert len(keys) == len(set(keys)), "a candidate was measured twice"
    assert not [r for r in rows if r[3] == "running"]  # every claim was finished
    assert sqlite3.connect(db).execute("select count(*) from winners").fetchone()[0] == 4


def _offset_view(t, elements):
    """The same values at an address `elements` past a 16-byte boundary (same shape and strides)."""
    base = torch.empty(t.numel() + elements, dtype=t.dtype)
    view = base[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.interpreter
def test_the_repeat_call_memo_keys_each_tensors_alignment_on_its_own():
    """A plan made for (q unaligned, k aligned) must not serve (q aligned, k unaligned): Triton
    specializes each pointer on its 16-byte alignment."""
    api.reset()
    q, k, v = _qkv()
    ref = autoflash.attention(q, k, v, is_causal=True)
    first = autoflash.attention(_offset_view(q, 1), k, v, is_causal=True)
    second = autoflash.attention(q, _offset_view(k, 1), v, is_causal=True)
    assert len(api.inference_plans) == 3  # three alignments, three plans
    for out in (first, second):
        assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.interpreter
def test_arguments_are_checked_even_when_a_plan_for_the_call_exists():
    api.reset()
    q, k, v = _qkv()
    planned = autoflash.attention(q, k, v, scale=1)  # a plan for scale=1 and dropout 0
    with pytest.raises(TypeError, match="dropout_p"):
        autoflash.attention(q, k, v, dropout_p=None, scale=1)
    # True == 1: torch reads it as 1.0, the answer of the planned call (not through the plan's fast path)
    assert torch.equal(autoflash.attention(q, k, v, scale=True), planned)
