"""flex_attention: a user's score and mask functions rendered into the forward kernel (Triton's
interpreter on the CPU; the same tests run on the GPU in bf16 with the gpu marker), against the float64
reference of the same functions on materialized scores, at ragged lengths, GQA, Nq != Nk."""

import os

import pytest
import torch

import autoflash
from autoflash import api
from autoflash.fallback import FallbackError, FallbackWarning
from autoflash.flex import eager
from autoflash.score_mods import trace_score_mod
from conftest import HAS_GPU


@pytest.fixture(autouse=True)
def _fresh():
    api.reset()
    yield
    api.reset()


def relative(score, b, h, q_idx, kv_idx):
    return score - 0.05 * abs(q_idx - kv_idx)


def capped(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def per_head(score, b, h, q_idx, kv_idx):
    return score + (h + 1) * 0.25 * (kv_idx - q_idx) / 64 + b


def kills_a_band(score, b, h, q_idx, kv_idx):  # a score_mod that masks: -inf scores
    return torch.where((kv_idx > q_idx + 3) & (kv_idx < q_idx + 20), float("-inf"), score)


def squared(score, b, h, q_idx, kv_idx):  # a power of the score: its derivative is not 1
    return score + 0.1 * score ** 2


def steep_at_zero(score, b, h, q_idx, kv_idx):  # d/ds is infinite at s = 0 (padding rows and keys have s = 0)
    return score + 0.1 * torch.sqrt(score * score)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= 16) & (kv_idx - q_idx <= 16)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 9) | (q_idx >= kv_idx) & (h != 1)  # head 1 sees only the prefix (row 0..: some rows see all 9)


def late_start(b, h, q_idx, kv_idx):  # rows below 5 see no key at all
    return (kv_idx <= q_idx - 5)


CASES = [(relative, None), (capped, causal), (per_head, window), (kills_a_band, None), (None, prefix_lm),
         (relative, late_start), (squared, None), (steep_at_zero, causal)]


def inputs(batch, heads, heads_kv, nq, nk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return make(batch, heads, nq, d), make(batch, heads_kv, nk, d), make(batch, heads_kv, nk, d)


def check(score_mod, mask_mod, dtype, device, shapes):
    for batch, heads, heads_kv, nq, nk, d in shapes:
        q, k, v = inputs(batch, heads, heads_kv, nq, nk, d, dtype, device)
        out, lse = autoflash.flex_attention(q, k, v, score_mod, mask_mod, enable_gqa=heads != heads_kv, return_lse=True)
        want, want_lse = eager(q.double(), k.double(), v.double(), score_mod, mask_mod, d ** -0.5)
        tol = 2e-2 if dtype != torch.float32 else 2e-4
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        finite = torch.isfinite(want_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        torch.testing.assert_close(lse.double()[finite], want_lse[finite], rtol=tol, atol=tol)


@pytest.mark.skipif(HAS_GPU, reason="interpreter test (the gpu-marked twin runs on the GPU)")
@pytest.mark.parametrize("score_mod, mask_mod", CASES)
def test_user_functions_on_the_kernels_match_float64(score_mod, mask_mod, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")  # served by the kernels, or this fails
    check(score_mod, mask_mod, torch.float32, "cpu", [(2, 4, 2, 37, 113, 32), (1, 2, 2, 61, 61, 16)])


@pytest.mark.gpu
@pytest.mark.parametrize("score_mod, mask_mod", CASES)
def test_gpu_user_functions_on_the_kernels_match_float64(score_mod, mask_mod, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    check(score_mod, mask_mod, torch.bfloat16, "cuda", [(2, 8, 2, 1023, 4111, 128), (1, 4, 4, 113, 37, 64),
                                                        (3, 2, 1, 1, 1023, 64)])


def check_gradients(score_mod, mask_mod, dtype, device, shapes, tol):
    """Gradients of flex_attention on the kernels (forward and backward rendered with the functions)
    against torch's autograd through the float64 reference of the same functions."""
    for batch, heads, heads_kv, nq, nk, d in shapes:
        q, k, v = (t.requires_grad_() for t in inputs(batch, heads, heads_kv, nq, nk, d, dtype, device, seed=nq))
        grad = inputs(batch, heads, heads_kv, nq, nk, d, dtype, device, seed=nk + 1)[0]
        autoflash.flex_attention(q, k, v, score_mod, mask_mod, enable_gqa=heads != heads_kv).backward(grad)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        eager(q64, k64, v64, score_mod, mask_mod, d ** -0.5)[0].backward(grad.double())
        for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(HAS_GPU, reason="interpreter test (the gpu-marked twin runs on the GPU)")
@pytest.mark.parametrize("score_mod, mask_mod", CASES)
def test_gradients_of_user_functions_on_the_kernels_match_float64(score_mod, mask_mod, monkeypatch):
    """The backward kernels recompute the scores through the score_mod, apply the mask_mod, and carry
    dS through d score_mod / d score (traced from the same function); GQA sums dK/dV over the group."""
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")  # served by the kernels, or this fails
    check_gradients(score_mod, mask_mod, torch.float32, "cpu", [(2, 4, 2, 37, 45, 16), (1, 2, 2, 19, 19, 16)], 2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("score_mod, mask_mod", CASES)
def test_gpu_gradients_of_user_functions_on_the_kernels_match_float64(score_mod, mask_mod, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    check_gradients(score_mod, mask_mod, torch.bfloat16, "cuda", [(2, 8, 2, 1023, 4111, 128), (1, 4, 4, 113, 37, 64)],
                    5e-2)


def test_functions_the_kernels_cannot_run_go_to_torch_naming_the_line(monkeypatch):
    """A construct the tracer refuses: torch computes the call (one warning naming the function's line),
    AUTOFLASH_STRICT=1 turns it into an error; a document mask (a table indexed by positions) likewise."""
    def branchy(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else -score

    documents = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])

    def same_document(b, h, q_idx, kv_idx):
        return documents[q_idx] == documents[kv_idx]

    q, k, v = inputs(1, 1, 1, 8, 8, 16, torch.float32, "cpu")
    monkeypatch.delenv("AUTOFLASH_STRICT", raising=False)
    with pytest.warns(FallbackWarning, match=r"same_document, line \d+ \(return documents\[q_idx\]"):
        out = autoflash.flex_attention(q, k, v, mask_mod=same_document)
    want, _ = eager(q.double(), k.double(), v.double(), None, lambda b, h, i, j: documents[i] == documents[j], 0.25)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    api.reset()
    with pytest.raises(FallbackError, match=r"branchy, line \d+ \(return score if q_idx > kv_idx else -score\)"):
        autoflash.flex_attention(q, k, v, branchy)
    with pytest.raises(ValueError, match="enable_gqa"):
        autoflash.flex_attention(q, k[:, :0], v[:, :0])


def test_powers_keep_the_sign_of_a_negative_base():
    """x ** 2.0, x ** 3 and x ** -1 as products (exp2/log2 would give NaN for negative scores)."""
    import math

    traced = trace_score_mod(lambda s, b, h, q, k: s ** 2.0 + (q - k) ** 3 + s ** -1 + s ** 0.0)
    assert "log2" not in "\n".join(traced.lines({a: a for a in ("score", "b", "h", "q_idx", "kv_idx")}, "out"))
    score = torch.tensor([[-2.0, -0.5, 3.0]])
    env = {"tl": None, "score": score, "b": 0, "h": 0, "q_idx": torch.tensor([[1]]), "kv_idx": torch.tensor([[0, 2, 5]])}
    exec("\n".join(traced.lines({a: a for a in env if a != "tl"}, "out")), env)  # noqa: S102
    want = score ** 2 + (env["q_idx"] - env["kv_idx"]) ** 3 + 1 / score + 1
    assert not math.isnan(env["out"].sum().item())
    torch.testing.assert_close(env["out"], want)


def test_a_backward_key_names_the_user_function_as_the_forward_key_does():
    from autoflash.problem import Problem

    key = f"bwd/bfloat16/d64/causal/g1/q1024/k1024/{trace_score_mod(relative).key}"
    assert Problem.from_key(key).key == key
    assert Problem.from_key(key.replace("bwd/", "fwd/", 1)).key == key.replace("bwd/", "fwd/", 1)


def test_each_function_is_its_own_kernel(tmp_path, monkeypatch):
    """Two functions, two kernels (the code's hash in the kernel's file name); the same function
    traced again, the same kernel."""
    monkeypatch.setenv("AUTOFLASH_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    q, k, v = inputs(1, 2, 2, 16, 16, 16, torch.float32, "cpu")

    def halved(score, b, h, q_idx, kv_idx):  # (functions no other test compiled: their kernels are new here)
        return score * 0.5 - 0.01 * kv_idx

    def quartered(score, b, h, q_idx, kv_idx):
        return score * 0.25 - 0.01 * kv_idx

    for fn in (halved, quartered, halved):
        autoflash.flex_attention(q, k, v, fn)
    names = sorted(p.name for p in tmp_path.rglob("*.py"))
    assert len([n for n in names if "-score-" in n]) == 2, names
    assert os.environ["AUTOFLASH_STRICT"] == "1"
