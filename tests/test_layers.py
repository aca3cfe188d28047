"""The one-way layers, checked on the running code: the runtime never loads the tuning side."""

import json
import os
import subprocess
import sys

import pytest

RUNTIME_CALL = """
import json, sys, torch, autoflash
from autoflash.reference import reference, rel_error
q, k, v = (torch.randn(1, 2, 37, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
out = autoflash.attention(q, k, v, is_causal=True)
out = autoflash.attention(q, k, v, is_causal=True)  # the repeated call's path too
err = rel_error(out, reference(q, k, v, True, 0, 32 ** -0.5)[0])
print(json.dumps({"err": err, "modules": sorted(m for m in sys.modules if m.startswith(("autoflash", "optuna")))}))
"""


def _run_model_process(tmp_path, **env):
    environ = {**os.environ, "TRITON_INTERPRET": "1", "AUTOFLASH_DB": str(tmp_path / "user.db"), **env}
    done = subprocess.run([sys.executable, "-c", RUNTIME_CALL], capture_output=True, text=True, env=environ,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.interpreter
def test_an_inference_call_loads_nothing_of_the_tuning_side(tmp_path):
    result = _run_model_process(tmp_path)
    assert result["err"] < 1e-4
    loaded = set(result["modules"])
    assert not {m for m in loaded if m.startswith(("autoflash.tuning", "optuna", "autoflash.cli"))}, loaded
    assert {"autoflash.api", "autoflash.dispatch", "autoflash.codegen"} <= loaded


@pytest.mark.interpreter
def test_tune_on_miss_tunes_in_a_child_process_and_loads_no_tuner_here(tmp_path):
    result = _run_model_process(tmp_path, AUTOFLASH_TUNE_ON_MISS="1", AUTOFLASH_TUNE_ON_MISS_TRIALS="1")
    assert result["err"] < 1e-4
    assert not {m for m in result["modules"] if m.startswith(("autoflash.tuning", "optuna"))}
    import sqlite3

    winners = sqlite3.connect(tmp_path / "user.db").execute("select problem from winners").fetchall()
    assert winners == [("fwd/float32/d32/causal/g1/q64/k64/w1",)]  # the child tuned exactly the missed problem


@pytest.mark.interpreter
def test_a_registered_miss_hook_is_called_once_per_problem_and_its_failure_never_reaches_the_model(monkeypatch):
    import torch

    from autoflash.dispatch import Dispatcher, set_miss_hook

    seen = []

    def hook(shape):
        seen.append(shape)
        raise RuntimeError("the tuner broke")

    monkeypatch.setenv("AUTOFLASH_TUNE_ON_MISS", "1")
    previous = set_miss_hook(hook)
    try:
        d = Dispatcher(winner_paths=[])
        q = torch.randn(2, 4, 45, 32)
        with pytest.warns(RuntimeWarning, match="the tuner broke"):
            d.kernel_for(q, q, q, torch.empty_like(q), causal=False)
        r = q[:, :, :50]  # another length in the same bucket: the same problem, not tuned again
        d.kernel_for(r, r, r, torch.empty_like(r), causal=False)
    finally:
        set_miss_hook(previous)
    assert [(s.batch, s.heads_q, s.seqlen_q, s.head_dim) for s in seen] == [(2, 4, 45, 32)]
