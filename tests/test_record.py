"""AUTOFLASH_RECORD -> autoflash tune --shapes FILE -> the recorded problems are served exact."""

import os
import subprocess
import sys
import textwrap

import pytest

from autoflash.shapes import load_shape_set

MODEL = textwrap.dedent("""
    import torch, autoflash
    g = torch.Generator().manual_seed(0)
    def rand(*shape):
        return torch.randn(*shape, generator=g)
    for _ in range(2):  # a repeated shape is recorded once
        q, k, v = rand(1, 2, 37, 32), rand(1, 2, 37, 32), rand(1, 2, 37, 32)
        autoflash.attention(q, k, v, is_causal=True)
    q = rand(2, 45, 4, 32).requires_grad_()  # flash-attn layout, GQA 4/2, Nq != Nk, and a backward
    k, v = rand(2, 61, 2, 32), rand(2, 61, 2, 32)
    autoflash.flash_attn_func(q, k, v, causal=True).sum().backward()
""")


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOFLASH_")}
    return {**env, "TRITON_INTERPRET": "1", "AUTOFLASH_KERNEL_CACHE": str(tmp_path / "kernels"), **extra}


def _run(args, env, cwd):
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.interpreter
def test_recorded_shapes_are_tuned_and_then_served_exact(tmp_path):
    record, db = tmp_path / "model_shapes.toml", tmp_path / "user.db"
    _run([sys.executable, "-c", MODEL], _env(tmp_path, AUTOFLASH_RECORD=str(record), AUTOFLASH_DB=str(db)), tmp_path)
    shapes = load_shape_set(str(record))
    assert [(s.batch, s.heads_q, s.heads_kv, s.seqlen_q, s.seqlen_k, s.head_dim, s.causal, s.dtype) for s in shapes] == [
        (1, 2, 2, 37, 37, 32, True, "float32"), (2, 4, 2, 45, 61, 32, True, "float32")]

    env = _env(tmp_path, AUTOFLASH_DB=str(db))
    _run([sys.executable, "-m", "autoflash", "tune", "--interpret", "--ops", "fwd,bwd", "--shapes", str(record),
          "--trials", "1"], env, tmp_path)
    for op in ("fwd", "bwd"):
        out = _run([sys.executable, "-m", "autoflash", "which", "--interpret", "--op", op, "--shapes", str(record)],
                   {**env, "COLUMNS": "300"}, tmp_path)
        served = [line for line in out.splitlines() if f"{op}/float32/d32/causal" in line]
        assert len(served) == 2 and all(" exact " in line for line in served), out


def test_an_unwritable_record_file_costs_one_warning_and_the_call_still_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = MODEL + "\nprint('ran')\n"
    env = _env(tmp_path, AUTOFLASH_RECORD=str(blocker / "shapes.toml"), AUTOFLASH_DB=str(tmp_path / "none.db"))
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ran"), done.stderr[-2000:]
    assert done.stderr.count("cannot record shapes") == 1
