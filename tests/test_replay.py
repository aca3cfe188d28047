"""Direct launches (`autoflash.replay`): a recorded module launch replayed with new tensors gives
the module's results bit for bit, or is not bound at all. GPU tests, plus the CPU fallback."""

import os

import pytest
import torch

import autoflash
from autoflash import api, codegen, decode, decode_kernels
from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.reference import make_inputs, reference, reference_grads, rel_error
from autoflash.space import default_variant, load_space

HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
gpu = pytest.mark.gpu


def test_not_bound_in_the_interpreter_but_the_call_runs():
    """On the CPU (interpreter) nothing is bound, and bind still performs the call it was given."""
    if HAS_GPU:
        pytest.skip("the interpreter case")
    shape = Shape(1, 2, 2, 37, 37, 32, True, "float32")
    q, k, v = make_inputs(shape, "cpu", seed=3)
    kernel = codegen.load(default_variant("fwd", shape.problem, gpu_fingerprint()))
    out, lse = torch.zeros_like(q), torch.empty(q.shape[:3], dtype=torch.float32)
    assert kernel.bind_forward(q, k, v, out, lse, 32 ** -0.5, True, 0) is None
    ref, _ = reference(q, k, v, True, 0, 32 ** -0.5)
    assert rel_error(out, ref) <= 1e-4


def _forward_variants():
    if not HAS_GPU:
        return []
    shape = Shape(2, 8, 8, 1023, 1023, 128, True, "bfloat16")
    device = gpu_fingerprint()
    picked = [default_variant("fwd", shape.problem, device)]
    sm90 = load_space("gluon_sm90_fwd")
    if device.cc_major == 9:
        picked.append(sm90.nearest_valid(sm90.default_for(shape.problem, device), shape.problem, device))
    return picked


@gpu
@pytest.mark.parametrize("variant", _forward_variants(), ids=str)
def test_forward_replay_matches_the_module_bit_for_bit(variant):
    shape = Shape(2, 8, 2, 1023, 1023, 128, True, "bfloat16")
    kernel = codegen.load(variant)
    q, k, v = make_inputs(shape, "cuda", seed=1)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    launch = kernel.bind_forward(q, k, v, out, lse, 0.1, True, 0)
    assert launch is not None, f"{kernel} could not be launched directly"
    for seed in (2, 3):  # new data, new buffers: the replay and the module agree exactly
        q, k, v = make_inputs(shape, "cuda", seed=seed)
        o1, l1 = torch.empty_like(q), torch.empty_like(lse)
        o2, l2 = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
        kernel.forward(q, k, v, o1, l1, 0.1, True, 0)
        launch(q, k, v, o2, l2)
        assert torch.equal(o1, o2) and torch.equal(l1, l2)


@gpu
@pytest.mark.parametrize("dq_mode, gqa_split, dkdv_kernel, overlap", [
    ("separate", 1, "triton", "serial"), ("atomic", 1, "triton", "serial"), ("tma_reduce", 1, "triton", "serial"),
    ("separate", 4, "triton", "serial"), ("separate", 1, "gluon_sm90", "serial"), ("separate", 1, "triton", "concurrent"),
    ("separate", 4, "triton", "concurrent"), ("separate", 1, "gluon_sm90", "concurrent")])
def test_backward_replay_or_module_launch_is_exact(dq_mode, gqa_split, dkdv_kernel, overlap):
    """The separate-dQ backward (three kernels, one scratch buffer; four and two with a split GQA
    group; the Gluon dK/dV kernel's TMA descriptors; the dK/dV kernels on a second stream) is bound
    and replays exactly; the atomic and tma_reduce ones (a zeroed accumulator and a torch copy outside
    the kernels) are refused by the replay check, and the call each was given still has the right
    gradients."""
    shape = Shape(2, 8, 2 if gqa_split > 1 else 8, 1000, 1000, 64, True, "bfloat16", op="bwd")
    device = gpu_fingerprint()
    base = default_variant("bwd", shape.problem, device)
    space = load_space("triton_bwd")
    tiles = {"BLOCK_M2": 64, "BLOCK_N2": 32} if dq_mode != "separate" else {}  # (the space's rule for atomic dQ)
    if dkdv_kernel == "gluon_sm90":
        tiles.update(BLOCK_M1=64, BLOCK_N1=128)  # (the space's rule for the Gluon kernel at d64)
    variant = space.nearest_valid(base.replace(DQ_MODE=dq_mode, GQA_SPLIT=gqa_split, DKDV_KERNEL=dkdv_kernel,
                                               DQ_OVERLAP=overlap, **tiles), shape.problem, device)
    assert (variant["DQ_MODE"], variant["GQA_SPLIT"], variant["DKDV_KERNEL"], variant["DQ_OVERLAP"]) == (
        dq_mode, gqa_split, dkdv_kernel, overlap)
    kernel = codegen.load(variant)
    q, k, v = make_inputs(shape, "cuda", seed=1)
    out, lse = api.forward_with_lse(q, k, v, causal=True)
    do = torch.randn_like(q)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    launch = kernel.bind_backward(q, k, v, out, lse, do, *grads, 0.125, True, 0)
    ref = [torch.empty_like(t) for t in (q, k, v)]
    kernel.backward(q, k, v, out, lse, do, *ref, 0.125, True, 0)
    for g, r in zip(grads, ref):  # the bound call's own results are the module's
        assert rel_error(g, r) <= 1e-2
    if dq_mode != "separate":
        assert launch is None
        return
    assert launch is not None
    # the replay runs the dK/dV kernels on the module's second stream where the module did
    assert launch.__self__.other_streams == (1 if overlap == "concurrent" else 0)
    q, k, v = make_inputs(shape, "cuda", seed=5)
    out, lse = api.forward_with_lse(q, k, v, causal=True)
    mine = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    theirs = [torch.empty_like(t) for t in (q, k, v)]
    launch(q, k, v, out, lse, do, *mine)
    kernel.backward(q, k, v, out, lse, do, *theirs, 0.125, True, 0)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_replay_orders_launches_on_another_stream_as_the_family_contract_says(monkeypatch):
    """(Fake streams, any machine.) A run of launches on another stream starts by waiting for the
    caller's stream; launches on the caller's stream in between do not wait; the caller's stream
    waits for the other one when the call ends, also when a launch raised (the caller frees the
    buffers those launches use)."""
    import contextlib

    from autoflash import replay

    events = []

    class FakeStream:
        def __init__(self, name):
            self.name, self.cuda_stream = name, len(name)

        def wait_stream(self, other):
            events.append(f"{self.name} waits {other.name}")

    caller, other = FakeStream("caller"), FakeStream("other stream")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: caller.cuda_stream, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: caller)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(replay, "_side_stream", lambda index, caller_raw, slot: other)

    def launch(name, side, fails=False):
        def run(g0, g1, g2, stream, *rest):
            if fails:
                raise RuntimeError("out of resources")
            events.append(f"{name} on {'caller' if stream == caller.cuda_stream else other.name}")
        return replay._Launch((1, 1, 1), run, None, None, [], [], False, side)

    plan = object.__new__(replay._Plan)
    plan.before_launch, plan.other_streams = None, 1
    plan.launches = [launch("delta", None), launch("dkdv", 0), launch("reduce", 0), launch("dq", None),
                     launch("dkdv 2", 0)]
    plan._replay((torch.empty(1),), [])
    assert events == ["delta on caller", "other stream waits caller", "dkdv on other stream",
                      "reduce on other stream", "dq on caller", "other stream waits caller",
                      "dkdv 2 on other stream", "caller waits other stream"]
    events.clear()
    plan.launches = [launch("delta", None), launch("dkdv", 0), launch("dq", None, fails=True)]
    with pytest.raises(RuntimeError, match="out of resources"):
        plan._replay((torch.empty(1),), [])
    assert events == ["delta on caller", "other stream waits caller", "dkdv on other stream",
                      "caller waits other stream"]


@gpu
def test_concurrent_backward_on_a_caller_stream_and_in_a_cuda_graph():
    """The backward whose dK/dV kernels run on a second stream (DQ_OVERLAP "concurrent"): the module's
    call and its bound launch on a stream of the caller's, and the bound launch inside a captured CUDA
    graph, each right after the caller's stream spun and then wrote new inputs (a launch that did
    not wait for the caller's stream would read the old ones), give the gradients of the same kernels
    run serially, bit for bit."""
    shape = Shape(2, 8, 2, 1000, 1000, 128, True, "bfloat16", op="bwd")
    device, space = gpu_fingerprint(), load_space("triton_bwd")
    variant = space.nearest_valid(default_variant("bwd", shape.problem, device).replace(
        DQ_MODE="separate", DQ_OVERLAP="concurrent", GQA_SPLIT=2), shape.problem, device)
    assert (variant["DQ_OVERLAP"], variant["GQA_SPLIT"]) == ("concurrent", 2)
    concurrent, serial = codegen.load(variant), codegen.load(variant.replace(DQ_OVERLAP="serial"))
    scale, spin = shape.head_dim ** -0.5, 50_000_000  # (cycles: tens of milliseconds)
    inputs, expected = [], []
    for seed in (1, 2, 3):
        q, k, v = make_inputs(shape, "cuda", seed=seed)
        out, lse = api.forward_with_lse(q, k, v, causal=True)
        inputs.append((q, k, v, out, lse, torch.randn_like(q)))
        grads = [torch.empty_like(t) for t in (q, k, v)]
        serial.backward(*inputs[-1], *grads, scale, True, 0)
        expected.append(grads)
    static = [t.clone() for t in inputs[0]]
    grads = [torch.empty_like(t) for t in static[:3]]

    def after_new_inputs(run, which):  # the caller's stream spins, then writes the inputs, then runs
        torch.cuda._sleep(spin)
        for dst, src in zip(static, inputs[which]):
            dst.copy_(src)
        for t in grads:
            t.fill_(float("nan"))
        run()
        return all(torch.equal(a, b) for a, b in zip(grads, expected[which]))

    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        assert after_new_inputs(lambda: concurrent.backward(*static, *grads, scale, True, 0), 1)
        launch = concurrent.bind_backward(*static, *grads, scale, True, 0)
        assert launch is not None and launch.__self__.other_streams == 1
        assert after_new_inputs(lambda: launch(*static, *grads), 2)
        assert after_new_inputs(lambda: launch(*static, *grads), 0)
    torch.cuda.current_stream().wait_stream(caller)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(*static, *grads)
    for which in (1, 2):
        assert after_new_inputs(graph.replay, which)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_training_calls_launch_directly_and_stay_correct(causal):
    """Repeated differentiable calls (the training memo and its direct launches): new data each
    time, gradients against the float64 reference."""
    shape = Shape(2, 8, 2, 1023, 1023, 128, causal, "bfloat16", op="bwd")
    _check_repeated_training_calls(shape, "cuda", (False, False, False), out_tol=2e-2, grad_tol=3e-2)


def _check_repeated_training_calls(shape, device, transposed_grads, out_tol, grad_tol):
    """Differentiable calls of one signature with fresh tensors each time (and the incoming gradient
    in (B, H, N, D) or (B, N, H, D) memory): outputs and gradients against float64, one plan."""
    api.reset()
    scale = shape.head_dim ** -0.5
    for seed, transposed in enumerate(transposed_grads, start=1):
        q, k, v = (t.requires_grad_() for t in make_inputs(shape, device, seed=seed))
        b, h, n, d = q.shape
        do = torch.randn(b, n, h, d, device=device, dtype=q.dtype).transpose(1, 2) if transposed else torch.randn_like(q)
        out = autoflash.attention(q, k, v, is_causal=shape.causal, enable_gqa=True)
        out.backward(do)
        ref, _ = reference(q, k, v, shape.causal, 0, scale)
        assert rel_error(out, ref) <= out_tol
        for t, r in zip((q, k, v), reference_grads(q, k, v, do, shape.causal, 0, scale)):
            assert rel_error(t.grad, r) <= grad_tol
    assert len(api.training_plans) == 1


@gpu
@pytest.mark.parametrize("page", [None, 16, 64])
def test_decode_calls_launch_directly_and_stay_correct(page):
    torch.manual_seed(0)
    b, n, hq, hkv, d = 3, 4111, 32, 8, 128
    for step in range(3):
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.tensor([1, 37, n][: b], device="cuda", dtype=torch.int32).roll(step)
        ref, _ = decode.torch_decode(q.double(), kc.double(), vc.double(), lens, None, d ** -0.5, False)
        if page is None:
            out = autoflash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        else:
            from autoflash.reference import paged_cache
            kp, vp, table = paged_cache(kc, vc, page)
            out = autoflash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
        assert rel_error(out, ref) <= 2e-2
    assert any(plan[1] for plan in decode_kernels.decode_plans.values())


def test_a_call_whose_tensors_alias_is_not_bound():
    """q is k is v at the first call: a plan taking every slot from one tensor would be replayed for
    later calls whose tensors differ (no memo key sees aliasing), so such a call is never bound."""
    from autoflash import replay

    t = torch.zeros(2, 2)
    with pytest.raises(replay._NotBindable):
        replay._Plan([("record",)], (t, t, torch.zeros(2)), None)


@gpu
def test_aliased_first_call_then_distinct_tensors_stay_correct():
    api.reset()
    shape = Shape(2, 8, 8, 256, 256, 128, False, "bfloat16")
    x = make_inputs(shape, "cuda", seed=1)[0]
    autoflash.attention(x, x, x)
    q, k, v = make_inputs(shape, "cuda", seed=2)
    ref, _ = reference(q, k, v, False, 0, 128 ** -0.5)
    assert rel_error(autoflash.attention(q, k, v), ref) <= 2e-2
    for t in (q, k, v):
        t.requires_grad_()
    autoflash.attention(x.requires_grad_(), x, x).sum().backward()
    out = autoflash.attention(q, k, v)
    out.backward(torch.ones_like(out))
    for t, r in zip((q, k, v), reference_grads(q, k, v, torch.ones_like(out), False, 0, 128 ** -0.5)):
        assert rel_error(t.grad, r) <= 3e-2


@pytest.mark.interpreter
def test_repeated_training_calls_use_one_plan_and_new_data():
    """The training memo: one plan per call signature, reused with fresh tensors (new data, new
    gradients) and still right against float64; a new layout of the incoming gradient is served too."""
    shape = Shape(1, 4, 2, 37, 37, 32, True, "float32", op="bwd")
    _check_repeated_training_calls(shape, "cpu", (False, False, True), out_tol=1e-4, grad_tol=1e-4)
