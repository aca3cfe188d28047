"""User score/mask functions traced into Triton statements (autoflash.score_mods): the generated code,
evaluated with torch standing in for triton.language, equals the function called on tensors; the traced
derivative equals autograd's; what cannot become device code is refused with the function's line."""

import math

import pytest
import torch
from helpers import compile_for_sm90

from autoflash.score_mods import ScoreModError, trace_mask_mod, trace_score_mod


class _Math:
    exp2 = staticmethod(torch.exp2)
    rsqrt = staticmethod(torch.rsqrt)


class _TL:  # the triton.language names the generated statements use, on torch tensors
    math = _Math
    exp, log, log2, sqrt = torch.exp, torch.log, torch.log2, torch.sqrt
    sin, cos, abs, where = torch.sin, torch.cos, torch.abs, torch.where
    # (tl.minimum/maximum take a number too)
    minimum = staticmethod(lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)))
    maximum = staticmethod(lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)))


def grid(seed=0):
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(2, 3, 37, 53, generator=g, dtype=torch.float64) * 4
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(3).view(1, 3, 1, 1)
    q = torch.arange(37).view(1, 1, 37, 1)
    kv = torch.arange(53).view(1, 1, 1, 53)
    return score, b, h, q, kv


def run(traced, **inputs):
    names = {n: n for n in inputs}
    env = {"tl": _TL, "float": float, **inputs}
    exec("\n".join(traced.lines(names, "out")), env)  # noqa: S102 - the generated code, in the test
    return env["out"]


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.125


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def alibi(score, b, h, q_idx, kv_idx):
    slope = 2.0 ** -(h + 1)
    return score - slope * abs(q_idx - kv_idx)


def causal_with_bias(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score * 0.5 + b, float("-inf"))


def mixed(score, b, h, q_idx, kv_idx):
    x = torch.maximum(score, score * 0.5 - 1.0) + torch.clamp(score, min=-1.0, max=1.5) * torch.sigmoid(score)
    return x + torch.exp(-score * score / 8) + (kv_idx // 7) % 3 - (q_idx - kv_idx) // 5 + score.tanh()


@pytest.mark.parametrize("fn", [relative_bias, softcap, alibi, causal_with_bias, mixed])
def test_generated_score_code_equals_the_function_on_tensors(fn):
    score, b, h, q, kv = grid()
    got = run(trace_score_mod(fn), score=score, b=b, h=h, q_idx=q, kv_idx=kv)
    want = fn(score, b, h, q, kv)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=1e-12)


def powers(score, b, h, q_idx, kv_idx):
    return score + 0.1 * score ** 2 - 0.01 * score ** 3 + (score * score + 1.0) ** -1 + abs(score) ** 0.5 + score ** 0


@pytest.mark.parametrize("fn", [relative_bias, softcap, alibi, causal_with_bias, mixed, powers])
def test_traced_derivative_equals_autograd(fn):
    score, b, h, q, kv = grid(1)
    score.requires_grad_()
    out = fn(score, b, h, q, kv)
    finite = torch.isfinite(out)
    (grad,) = torch.autograd.grad(out[finite].sum(), score)
    got = run(trace_score_mod(fn).derivative(), score=score.detach(), b=b, h=h, q_idx=q, kv_idx=kv)
    got = torch.broadcast_to(torch.as_tensor(got, dtype=torch.float64), score.shape)
    torch.testing.assert_close(torch.where(finite, got, 0.0), grad, rtol=1e-9, atol=1e-9)


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 8)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 5) | torch.logical_and(q_idx >= kv_idx, ~(h == 1))


@pytest.mark.parametrize("fn", [sliding_window, prefix_lm])
def test_generated_mask_code_equals_the_function_on_tensors(fn):
    _, b, h, q, kv = grid()
    got = run(trace_mask_mod(fn), b=b, h=h, q_idx=q, kv_idx=kv)
    assert got.dtype == torch.bool and torch.equal(got, fn(b, h, q, kv))


def test_the_key_names_the_code():
    assert trace_score_mod(softcap).key == trace_score_mod(lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0)).key
    assert trace_score_mod(softcap).key != trace_score_mod(relative_bias).key
    assert trace_mask_mod(sliding_window).key.startswith("mask-")


def branches(score, b, h, q_idx, kv_idx):
    if score > 0:
        return score
    return -score


def python_math(score, b, h, q_idx, kv_idx):
    return math.tanh(score)


def unsupported_torch(score, b, h, q_idx, kv_idx):
    return torch.erf(score)


TABLE = torch.arange(10)


def indexes_a_tensor(score, b, h, q_idx, kv_idx):
    return score + TABLE[h]


@pytest.mark.parametrize("fn, words", [(branches, "Python branch"), (python_math, "float()"),
                                       (unsupported_torch, "torch.erf"), (indexes_a_tensor, "indexing a tensor")])
def test_unsupported_constructs_are_refused_naming_the_line(fn, words):
    with pytest.raises(ScoreModError) as e:
        trace_score_mod(fn)
    line = fn.__code__.co_firstlineno + 1
    assert words in str(e.value) and f"line {line}" in str(e.value) and fn.__name__ in str(e.value)


def test_wrong_signatures_and_kinds_are_refused():
    with pytest.raises(ScoreModError, match="takes 4 arguments"):
        trace_score_mod(sliding_window)
    with pytest.raises(ScoreModError, match="returns a number"):
        trace_mask_mod(lambda b, h, q, k: q - k)
    with pytest.raises(ScoreModError, match="returns a mask"):
        trace_score_mod(lambda s, b, h, q, k: q >= k)
    with pytest.raises(ScoreModError, match="combines masks"):
        trace_mask_mod(lambda b, h, q, k: (q >= k) & 3)


KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def apply_mod(S, OUT, B: tl.constexpr, H: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    b = tl.program_id(0) // H
    h = tl.program_id(0) % H
    rows = tl.arange(0, M)
    keys = tl.arange(0, N)
    offsets = tl.program_id(0) * M * N + rows[:, None] * N + keys[None, :]
    score = tl.load(S + offsets)
{body}
    tl.store(OUT + offsets, out)
'''


def mod_kernel(fn, which: str, folder):
    """A kernel module computing `fn`'s traced statements (or their derivative) on a score tile."""
    import importlib.util
    import pathlib
    import sys

    traced = trace_score_mod(fn)
    traced = traced if which == "value" else traced.derivative()
    names = {"score": "score", "b": "b", "h": "h", "q_idx": "rows[:, None]", "kv_idx": "keys[None, :]"}
    body = "\n".join("    " + line for line in traced.lines(names, "out"))
    if which == "derivative":  # a constant derivative is a number: broadcast it to the tile
        body += "\n    out = out + tl.zeros([M, N], dtype=tl.float32)"
    path = pathlib.Path(folder) / f"mod_{fn.__name__}_{which}.py"
    path.write_text(KERNEL.format(body=body))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


MODS = [relative_bias, softcap, alibi, causal_with_bias, mixed]


@pytest.mark.parametrize("fn", MODS)
@pytest.mark.parametrize("which", ["value", "derivative"])
def test_generated_code_runs_as_a_triton_kernel(fn, which, tmp_path):
    """The statements are Triton: spliced into a kernel (Triton's interpreter on the CPU, float32),
    the score tile and its derivative match the function and autograd."""
    module = mod_kernel(fn, which, tmp_path)
    score, b, h, q, kv = grid(2)
    score = score[:, :, :32, :32].float().contiguous()
    out = torch.empty_like(score)
    module.apply_mod[(2 * 3,)](score, out, 2, 3, 32, 32)
    s64 = score.double().requires_grad_()
    want = fn(s64, b, h, q[..., :32, :], kv[..., :32])
    if which == "derivative":
        finite = torch.isfinite(want)
        (want,) = torch.autograd.grad(want[finite].sum(), s64)
        out = torch.where(finite, out.double(), 0.0)
    torch.testing.assert_close(out.double(), want.detach(), rtol=2e-5, atol=2e-5)


def compile_mods_for_sm90(folder) -> None:
    for fn in MODS:
        for which in ("value", "derivative"):
            x = torch.empty(2, 3, 32, 32)
            compile_for_sm90(mod_kernel(fn, which, folder).apply_mod, (x, x), {"B": 2, "H": 3, "M": 32, "N": 32})
            print(fn.__name__, which)


def test_generated_code_compiles_for_sm90(tmp_path):
    """... and it compiles for Hopper on any machine (the interpreter checks few types), in a clean
    process (helpers.run_in_clean_process)."""
    from helpers import run_in_clean_process

    done = run_in_clean_process(f"from tests.test_score_mods import compile_mods_for_sm90; "
                                f"compile_mods_for_sm90({str(tmp_path)!r})", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.split()) == 2 * 2 * len(MODS)
