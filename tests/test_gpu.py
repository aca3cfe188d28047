"""GPU tests (bf16 and fp16 on realistic shapes). Skipped without CUDA."""

import math
import random

import pytest
import torch

import autoflash
from autoflash import codegen
from autoflash.dispatch import Dispatcher
from autoflash.reference import make_inputs, reference, rel_error, sdpa_error
from autoflash.tuning.gate import check
from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.space import load_space

pytestmark = pytest.mark.gpu


def gpu_sample(op: str, seed: int, pick, heads_kv: int = 8):
    """Per (head_dim, causal) on this GPU: pick(rng, valid variants) -> the variants to test
    (valid for 8 query heads and `heads_kv` KV heads)."""
    if not torch.cuda.is_available():
        return []
    rng = random.Random(seed)
    space, device = load_space(op), gpu_fingerprint()
    picked = []
    for d in (64, 128):
        for causal in (False, True):
            valid = space.valid_variants(Shape(2, 8, heads_kv, 1024, 1024, d, causal, "bfloat16", op=op).problem, device)
            picked += [(v, d, causal) for v in pick(rng, valid)]
    return picked


# Forward: 3 random valid variants and 2 TMA ones per (head_dim, causal).
SAMPLE = gpu_sample("fwd", 7, lambda rng, valid: rng.sample(valid, 3) + rng.sample([v for v in valid if v["LOADS"] == "tma"], 2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("variant, head_dim, causal", SAMPLE,
                         ids=[f"d{d}{'c' if c else ''}-{v.short()}" for v, d, c in SAMPLE])
def test_variant_passes_gate_on_gpu(variant, head_dim, causal, dtype):
    """Ragged lengths (1023, 113/203, 1), both layouts, both causal alignments, vs float64."""
    for hkv in (8, 2):  # MHA and GQA 4:1
        result = check(codegen.load(variant), Shape(2, 8, hkv, 1024, 1024, head_dim, causal, dtype), "cuda")
        assert result.passed, result.detail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_realistic_shapes(dtype, head_dim, causal, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    shape = Shape(2, 16, 4, 2047, 2047, head_dim, causal, str(dtype).split(".")[1])
    q, k, v = make_inputs(shape, "cuda", seed=3)
    out = autoflash.attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref, _ = reference(q, k, v, causal, 0, 1 / math.sqrt(head_dim), dtype=torch.float32)
    err, s_err = rel_error(out, ref), sdpa_error(q, k, v, causal, 0, 1 / math.sqrt(head_dim), ref)
    assert err <= max(2 * s_err, 1e-2 if dtype == torch.bfloat16 else 2e-3), (err, s_err)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_bnhd_no_copy(causal, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 1000, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 1537, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 1537, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    out = autoflash.flash_attn_func(q, k, v, causal=causal)
    ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, 537, 1 / math.sqrt(128),
                       dtype=torch.float32)
    assert rel_error(out.transpose(1, 2), ref) < 1e-2


def test_default_uses_tma_on_hopper_for_contiguous_inputs():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9")
    untuned = Dispatcher(winner_paths=[])  # the built-in default alone, whatever the shipped DBs hold
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    module = untuned.kernel_for(q, q, q, torch.empty_like(q), causal=False, own_only=True)  # (not SDPA's)
    assert module.variant["LOADS"] == "tma"
    base = torch.randn(q.numel() + 1, device="cuda", dtype=torch.bfloat16)
    odd = base[1:].view(q.shape)  # base address 2 bytes off a 16-byte boundary -> pointer loads
    assert untuned.kernel_for(odd, odd, odd, torch.empty_like(odd), causal=False, own_only=True).variant["LOADS"] != "tma"


DEFAULTS = [(op, d, c) for op in ("fwd", "bwd") for d in (64, 128, 256) for c in (False, True)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op, head_dim, causal", DEFAULTS)
def test_default_variants_pass_the_gate_on_gpu(op, head_dim, causal, dtype):
    """What untuned problems get: the built-in default (as the dispatcher adjusts it) is gated too."""
    from autoflash.space import default_variant

    device = gpu_fingerprint()
    for hkv in (8, 2):
        shape = Shape(2, 8, hkv, 1024, 1024, head_dim, causal, dtype, op=op)
        variant = default_variant(op, shape.problem, device)
        result = check(codegen.load(variant), shape, "cuda")
        assert result.passed, f"{variant.short()}: {result.detail}"


def test_shipped_winners_are_served_on_their_gpu():
    """With only the DBs shipped in cache/ (no user DB), the dispatcher serves their winners here."""
    from autoflash.dispatch import WinnerTable
    from autoflash.shapes import load_shape_set

    device, shipped_paths = gpu_fingerprint(), WinnerTable.default_paths()[1:]
    shipped = WinnerTable(device, shipped_paths)
    if not shipped.rows:
        pytest.skip(f"no shipped winners for {device.key}")
    dispatcher, served = Dispatcher(winner_paths=shipped_paths), 0
    for shape in load_shape_set("standard"):
        # (the grid was tuned before the occupancy bucket: its rows serve by the nearest-bucket rule)
        expected, how = shipped.lookup(shape.problem)
        if expected is not None:
            q, k, v = make_inputs(shape, "cuda", seed=9)
            module = dispatcher.kernel_for(q, k, v, torch.empty_like(q), shape.causal)
            assert module is codegen.load(expected), (shape.label(), how)
            served += 1
    assert served > 0


# Backward: one variant per dQ mode per (head_dim, causal), and one that splits a GQA group of 4
# (run on groups of 1 and 4 below: more slices than heads must stay exact too).
BWD_SAMPLE = gpu_sample("bwd", 11, lambda rng, valid: [rng.choice([v for v in valid if v["DQ_MODE"] == m]) for m in ("separate", "atomic", "tma_reduce")]
                        + [rng.choice([v for v in valid if v["GQA_SPLIT"] > 1])]
                        + [rng.choice([v for v in valid if v["DKDV_KERNEL"] == "gluon_sm90"])]
                        + [rng.choice([v for v in valid if v["DQ_OVERLAP"] == "concurrent"])], heads_kv=2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("variant, head_dim, causal", BWD_SAMPLE,
                         ids=[f"d{d}{'c' if c else ''}-{v.short()}" for v, d, c in BWD_SAMPLE])
def test_backward_variant_passes_gradient_gate_on_gpu(variant, head_dim, causal, dtype):
    """dQ, dK, dV within 3x SDPA's own error vs float64, ragged lengths, both layouts/alignments."""
    for hkv in (8, 2):
        shape = Shape(2, 8, hkv, 1024, 1024, head_dim, causal, dtype, op="bwd")
        result = check(codegen.load(variant), shape, "cuda")
        assert result.passed, result.detail


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients_bf16(causal, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    shape = Shape(2, 16, 4, 2047, 2047, 128, causal, "bfloat16")
    q, k, v = (t.requires_grad_() for t in make_inputs(shape, "cuda", seed=5))
    grad = torch.randn_like(q)
    autoflash.attention(q, k, v, is_causal=causal, enable_gqa=True).backward(grad)
    from autoflash.reference import reference_grads, sdpa_grads as _sdpa_grads

    refs = reference_grads(q, k, v, grad, causal, 0, 1 / math.sqrt(128), dtype=torch.float32)
    theirs = _sdpa_grads(q, k, v, grad, causal, 0, 1 / math.sqrt(128))
    for mine, ref, sd in zip((q.grad, k.grad, v.grad), refs, theirs):
        assert rel_error(mine, ref) <= max(3 * rel_error(sd, ref), 4e-3)


def test_cuda_graph_replay_matches_eager(monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    q, k, v = make_inputs(Shape(2, 8, 8, 1000, 1000, 128, True, "bfloat16"), "cuda", seed=6)
    eager = autoflash.attention(q, k, v, is_causal=True)  # also compiles and caches the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = autoflash.attention(q, k, v, is_causal=True)
    for t, fresh in zip((q, k, v), make_inputs(Shape(2, 8, 8, 1000, 1000, 128, True, "bfloat16"), "cuda", seed=7)):
        t.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(captured, autoflash.attention(q, k, v, is_causal=True), rtol=0, atol=0)
    assert not torch.equal(captured, eager)


def test_torch_compile_fullgraph_on_gpu(monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    q, k, v = make_inputs(Shape(2, 8, 2, 1024, 1024, 128, True, "bfloat16"), "cuda", seed=8)
    q.requires_grad_()

    def block(q, k, v):
        return torch.nn.functional.gelu(autoflash.attention(q, k, v, is_causal=True, enable_gqa=True))

    out = torch.compile(block, fullgraph=True)(q, k, v)
    # compiled and eager calls may be served by different kernels (bf16 roundings differ): each is
    # held against float64 instead of against the other
    ref, _ = reference(q.detach(), k, v, True, 0, 128 ** -0.5)
    ref = torch.nn.functional.gelu(ref.double())
    eager_error = rel_error(block(q, k, v), ref)
    assert rel_error(out, ref) <= 2 * eager_error + 1e-3, (rel_error(out, ref), eager_error)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_transformers_llama_bf16_matches_sdpa(monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoflash.integrations.transformers as aft

    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (2, 1500), device="cuda")
    name = aft.register()
    out = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model(ids).logits.float()
    err = (out[name] - out["sdpa"]).norm() / out["sdpa"].norm()
    assert err < 2e-2, err


@pytest.mark.parametrize("b, h, n, d, causal, layout", [(1, 1, 128, 64, True, "bhnd"), (2, 8, 1023, 128, False, "bhnd"),
                                                       (2, 4, 777, 64, True, "bnhd")])
def test_repeated_calls_launch_directly_and_stay_correct(b, h, n, d, causal, layout, own_kernels):
    """The second call of a signature takes the API's direct launcher: new data, the right answer."""
    from autoflash import api
    from autoflash.reference import make_inputs, reference, rel_error

    shape = Shape(b, h, h, n, n, d, causal, "bfloat16")
    for seed in (1, 2, 3):  # the first call plans, the next ones replay the compiled kernel directly
        q, k, v = make_inputs(shape, "cuda", seed=seed, layout=layout)
        out = autoflash.attention(q, k, v, is_causal=causal)
        ref, _ = reference(q, k, v, causal, 0, d ** -0.5)
        assert rel_error(out, ref) <= 2e-2
    # (the memo's key holds the strides of the kernel's views: those of size-one dims may differ from q's)
    launch = next(p for s, p in api.inference_plans.items() if s[0] == q.shape and s[6] == q.dtype)
    assert launch.launches_directly  # really the direct launcher, not the module's launch


def test_device_time_leaves_out_host_time():
    """`device_ms` times the kernels, not a slow host path in front of them (do_bench times both)."""
    import time

    from autoflash.tuning.timing import bench_ms, device_ms

    x = torch.zeros(1 << 20, device="cuda")

    def slow_host_short_kernel():
        time.sleep(0.002)  # 2 ms of host work in front of a few microseconds of GPU work
        x.add_(1.0)

    assert bench_ms(slow_host_short_kernel, rep_ms=50) > 1.5
    assert device_ms(slow_host_short_kernel, rep_ms=50) < 0.5


def test_device_time_agrees_with_do_bench_on_a_long_kernel():
    """Where the host is negligible, the spin in front of the events changes nothing."""
    from autoflash.tuning.timing import bench_ms, device_ms

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ratio = device_ms(lambda: a @ a, rep_ms=100) / bench_ms(lambda: a @ a, rep_ms=100)
    assert 0.8 < ratio < 1.25, ratio


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_a_backend_without_a_kernel_for_the_problem_is_unsupported_not_a_failure(op):
    """torch's memory-efficient backend refuses K/V with fewer heads (GQA): its candidate is recorded
    as not offered for the problem, not as a wrong kernel or a failure of the search."""
    from autoflash.tuning.sandbox import FAILED_STATUSES, evaluate_variant

    shape = Shape(batch=1, heads_q=4, heads_kv=1, seqlen_q=256, seqlen_k=256, head_dim=64, causal=True,
                  dtype="bfloat16", op=op)
    knobs = {"BACKEND": "efficient"} if op == "fwd" else {"BACKEND": "efficient", "FORWARD": "sdpa", "BACKWARD": "sdpa"}
    variant = load_space(f"sdpa_{op}").check_declared(knobs)
    outcome = evaluate_variant(variant.json(), f"sdpa_{op}", shape, rep_ms=1, device_str="cuda")
    assert outcome.status == "unsupported" and "refused every gate shape" in outcome.message
    assert outcome.status not in FAILED_STATUSES
