"""A deterministic backward: flash-attn's `deterministic=True` (dense and packed forms) and torch's
`torch.use_deterministic_algorithms(True)` (every form) serve the backward with a variant whose
gradients are bitwise repeatable: no float32 atomics adding dQ tiles in whatever order programs reach
them (the backward family's DQ_MODE "atomic" and "tma_reduce"). CPU: Triton's interpreter, float32;
the 100-repeat check runs on the GPU, where atomics do reorder."""

import dataclasses
import warnings

import pytest
import torch

import autoflash
from autoflash import api, dispatch
from autoflash.device import INTERPRETER_NAME, gpu_fingerprint
from autoflash.dispatch import DETERMINISTIC_KNOBS, deterministic_variant, get_dispatcher
from autoflash.fallback import FallbackWarning
from autoflash.problem import Problem
from autoflash.reference import reference_grads, rel_error, sdpa_grads
from autoflash.space import FAMILIES, load_space

HOPPER = dataclasses.replace(gpu_fingerprint(), name="H100-like", cc_major=9, cc_minor=0, smem_per_block=232448)


@pytest.fixture(autouse=True)
def _fresh():
    api.reset()
    yield
    api.reset()


@pytest.fixture
def deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def rand(*shape, seed, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def problem(head_dim=64, causal=True, dtype="float16", group=1):
    return Problem(op="bwd", dtype=dtype, head_dim=head_dim, causal=causal, gqa_group=group, seqlen_q=2048,
                   seqlen_k=2048)


# ----------------------------------------------------------------------------- the variant
def test_every_own_backward_family_declares_its_deterministic_knobs():
    own = [f for f in FAMILIES if load_space(f).op == "bwd" and not load_space(f).vendor]
    assert own and all(f in DETERMINISTIC_KNOBS for f in own)
    for family, alternatives in DETERMINISTIC_KNOBS.items():
        space = load_space(family)
        assert alternatives and all(value in space.knobs[knob] for pins in alternatives for knob, value in pins.items())


# The dQ modes whose gradients are bitwise repeatable: the ordered one is preferred where the space
# offers it (in the interpreter; on a GPU only once it has run there), the separate one elsewhere.
REPEATABLE = {"ordered", "separate"}
ON_A_GPU = HOPPER
# The interpreter's fingerprint with Hopper's numbers (on any machine, a GPU one too): where the ordered dQ is offered.
INTERPRETED_HOPPER = dataclasses.replace(gpu_fingerprint(), name=f"{INTERPRETER_NAME} (as Hopper)", cc_major=9, cc_minor=0,
                                         smem_per_block=232448)
assert ON_A_GPU.on_gpu and not INTERPRETED_HOPPER.on_gpu


# (the interpreter has no bulk reduce-add: no tma_reduce variant there)
@pytest.mark.parametrize("device, dq_mode, mode", [(INTERPRETED_HOPPER, "atomic", "ordered"),
                                                   (ON_A_GPU, "atomic", "separate"), (ON_A_GPU, "tma_reduce", "separate")],
                         ids=["interpreter-atomic", "gpu-atomic", "gpu-tma_reduce"])
def test_an_atomic_dq_variant_becomes_a_repeatable_one_with_its_other_knobs(dq_mode, device, mode):
    space = load_space("triton_bwd")
    prob = problem()
    atomic = [v for v in space.valid_variants(prob, device) if v["DQ_MODE"] == dq_mode]
    assert atomic
    for variant in atomic[:20]:
        fixed = deterministic_variant(variant, prob, device)
        assert fixed["DQ_MODE"] == mode and not space.violations(fixed, prob, device)
        wanted = variant.replace(DQ_MODE=mode)
        if not space.violations(wanted, prob, device):  # (else another knob had to change too)
            assert fixed == wanted


def test_a_window_takes_the_separate_dq_and_a_repeatable_variant_stays_as_it_is():
    """Under a sliding window the key blocks that see a query block are a band: no ordered dQ."""
    space, windowed = load_space("triton_bwd"), dataclasses.replace(problem(), score_variant="window")
    device = INTERPRETED_HOPPER  # (where the ordered dQ is offered)
    atomic = next(v for v in space.valid_variants(windowed, device) if v["DQ_MODE"] == "atomic")
    assert deterministic_variant(atomic, windowed, device)["DQ_MODE"] == "separate"
    for mode in REPEATABLE:
        variant = next(v for v in space.valid_variants(problem(), device) if v["DQ_MODE"] == mode)
        assert deterministic_variant(variant, problem(), device) is variant


def test_the_hopper_default_for_d64_causal_is_atomic_and_deterministic_calls_leave_it():
    """The untuned backward of d64 causal problems on Hopper adds dQ by bulk reduce-add: exactly the
    variant a deterministic call must not get."""
    default = load_space("bwd").default_for(problem(), ON_A_GPU)
    assert default["DQ_MODE"] == "tma_reduce"
    assert deterministic_variant(default, problem(), ON_A_GPU)["DQ_MODE"] == "separate"
    separate = load_space("bwd").default_for(problem(head_dim=128), ON_A_GPU)
    assert deterministic_variant(separate, problem(head_dim=128), ON_A_GPU) is separate


@pytest.fixture
def atomic_winner(monkeypatch):
    """Every backward problem's winner is an atomic-dQ variant (as a tuned one may be)."""
    served = dispatch.Dispatcher.variant_for

    def variant_for(self, prob, device, device_index=None, own_only=False):
        variant = served(self, prob, device, device_index, own_only)
        if prob.op == "bwd":
            space = load_space(variant.family)
            variant = space.nearest_valid(variant.replace(DQ_MODE="atomic", BLOCK_M2=64, BLOCK_N2=32), prob, device)
            assert variant["DQ_MODE"] == "atomic"
        return variant

    monkeypatch.setattr(dispatch.Dispatcher, "variant_for", variant_for)
    api.reset()


def served_dq_modes():
    return {kernel.variant["DQ_MODE"] for kernel in get_dispatcher().kernels.values()
            if not kernel.vendor and kernel.op == "bwd"}


def repeatable(modes: set) -> bool:
    return bool(modes) and modes <= REPEATABLE


def _backward(fn, tensors, *args, **kwargs):
    """The gradients of q, k, v (`tensors`) through fn(q, k, v, *args, **kwargs)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves, *args, **kwargs)
    out.backward(torch.ones_like(out) if out.dim() < 3 else rand(*out.shape, seed=99))
    return [t.grad for t in leaves]


@pytest.mark.interpreter
def test_deterministic_calls_are_served_without_atomics_and_the_others_keep_the_winner(atomic_winner):
    q, k, v = rand(1, 29, 4, 16, seed=1), rand(1, 29, 2, 16, seed=2), rand(1, 29, 2, 16, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # served by the kernels, not by torch
        _backward(autoflash.flash_attn_func, (q, k, v), causal=True)
        assert served_dq_modes() == {"atomic"}
        api.reset()
        _backward(autoflash.flash_attn_func, (q, k, v), causal=True, deterministic=True)
        assert repeatable(served_dq_modes())
        api.reset()
        cu = torch.tensor([0, 11, 29], dtype=torch.int32)
        _backward(autoflash.flash_attn_varlen_func, (q[0], k[0], v[0]), cu, cu, 18, 18, causal=True,
                  deterministic=True)
        assert repeatable(served_dq_modes())


@pytest.mark.interpreter
def test_torchs_deterministic_setting_is_honoured_by_attention(atomic_winner, deterministic_algorithms):
    q, k, v = rand(1, 2, 23, 16, seed=4), rand(1, 1, 23, 16, seed=5), rand(1, 1, 23, 16, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        _backward(autoflash.attention, (q, k, v), is_causal=True)
    assert repeatable(served_dq_modes())


@pytest.mark.interpreter
def test_the_plan_memo_keeps_deterministic_and_other_calls_apart(atomic_winner):
    q, k, v = rand(1, 17, 2, 16, seed=7), rand(1, 17, 2, 16, seed=8), rand(1, 17, 2, 16, seed=9)
    _backward(autoflash.flash_attn_func, (q, k, v))  # plans an atomic backward for this signature
    _backward(autoflash.flash_attn_func, (q, k, v), deterministic=True)
    modes = served_dq_modes()
    assert "atomic" in modes and repeatable(modes - {"atomic"})
    assert sorted(key[16] for key in api.training_plans) == [False, True]


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["flash_attn_func", "varlen", "attention"])
def test_two_deterministic_backward_passes_are_bitwise_equal(form, atomic_winner, deterministic_algorithms):
    q, k, v = rand(2, 21, 4, 16, seed=10), rand(2, 21, 2, 16, seed=11), rand(2, 21, 2, 16, seed=12)
    cu = torch.tensor([0, 21, 42], dtype=torch.int32)
    call = {"flash_attn_func": lambda *t: autoflash.flash_attn_func(*t, causal=True, deterministic=True),
            "varlen": lambda *t: autoflash.flash_attn_varlen_func(*(x.flatten(0, 1) for x in t), cu, cu, 21, 21,
                                                                  causal=True, deterministic=True),
            "attention": lambda *t: autoflash.attention(*(x.transpose(1, 2) for x in t), is_causal=True,
                                                        enable_gqa=True)}[form]
    first, second = _backward(call, (q, k, v)), _backward(call, (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert repeatable(served_dq_modes())


@pytest.mark.interpreter
def test_a_forward_sdpa_serves_stays_in_the_deterministic_pair(tmp_path, monkeypatch, atomic_winner):
    """Where an SDPA backend serves the call's forward problem (here a stored winner of the CPU build's
    flash backend; on a GPU the policy's SDPA-cuDNN), a deterministic training call keeps that forward
    (with its log-sum-exp) before the own backward without atomics: the gradients are the float64
    reference's and bitwise repeatable. A call that is not deterministic is served as before."""
    from autoflash import codegen
    from autoflash.problem import Shape
    from autoflash.store import Store

    device = gpu_fingerprint()
    shape = Shape(batch=1, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=33, head_dim=16, causal=True, dtype="float32")
    flash = load_space("sdpa_fwd").check_declared({"BACKEND": "flash"})
    store = Store(tmp_path / "user.db")
    store.add_gpu(device)
    store.set_winner(gpu_key=device.key, problem=shape.problem, template_hash=codegen.template_hash("sdpa_fwd"),
                     variant_json=flash.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    store.close()
    monkeypatch.setenv("AUTOFLASH_DB", str(tmp_path / "user.db"))
    api.reset()
    q, k, v = rand(1, 33, 4, 16, seed=21), rand(1, 33, 2, 16, seed=22), rand(1, 33, 2, 16, seed=23)

    def call(*t):
        return autoflash.flash_attn_func(*t, causal=True, deterministic=True)
    first, second = _backward(call, (q, k, v)), _backward(call, (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    (plan,) = api.training_plans.values()
    assert plan.pair.forward_kernel.vendor and not plan.pair.backward_kernel.vendor
    assert plan.pair.backward_kernel.variant["DQ_MODE"] in REPEATABLE
    do = rand(1, 33, 4, 16, seed=99).transpose(1, 2)
    want = reference_grads(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), do, True, 0, 16 ** -0.5)
    for mine, ref in zip(first, want):
        assert rel_error(mine.transpose(1, 2), ref) < 1e-5
    api.reset()
    _backward(autoflash.flash_attn_func, (q, k, v), causal=True)  # not deterministic: the backward's winner
    (plan,) = api.training_plans.values()
    assert not hasattr(plan, "pair") or not plan.pair.forward_kernel.vendor


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, causal, heads", [(64, True, (16, 16)), (128, False, (16, 4)), (64, True, (8, 1))])
def test_a_hundred_deterministic_backward_passes_are_bitwise_equal_on_the_gpu(head_dim, causal, heads, own_kernels):
    """d64 causal is where the untuned Hopper backward adds dQ by bulk reduce-add: its gradients differ in
    their last bits from run to run, unless deterministic=True serves the separate dQ kernel."""
    hq, hkv = heads
    q = rand(2, 1024, hq, head_dim, seed=13, device="cuda", dtype=torch.bfloat16)
    k, v = (rand(2, 1024, hkv, head_dim, seed=s, device="cuda", dtype=torch.bfloat16) for s in (14, 15))
    grad = rand(2, 1024, hq, head_dim, seed=16, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def grads():
        for t in leaves:
            t.grad = None
        autoflash.flash_attn_func(*leaves, causal=causal, deterministic=True).backward(grad)
        return [t.grad.clone() for t in leaves]

    first = grads()
    for _ in range(99):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    assert repeatable(served_dq_modes())
    heads_first = [t.transpose(1, 2) for t in (q, k, v, grad)]
    exact = reference_grads(*heads_first, causal, 0, head_dim ** -0.5)
    theirs = sdpa_grads(*heads_first, causal, 0, head_dim ** -0.5)
    for mine, want, sdpa in zip(first, exact, theirs):
        assert rel_error(mine.transpose(1, 2), want) <= 3 * rel_error(sdpa, want) + 1e-6


# ----------------------------------------------------------------------------- the ordered dQ
ORDERED_CASES = [  # (knobs over the space's first choices, head dim, causal, (heads_q, heads_kv), dims of V)
    (dict(LOADS="pointer", GRID_ORDER="kv_major"), 128, True, (8, 2), None),
    (dict(LOADS="tma", GRID_ORDER="heavy_first", GQA_SPLIT=2), 64, True, (8, 2), None),
    (dict(LOADS="pointer", GRID_ORDER="kv_major"), 64, False, (4, 4), None),
    (dict(LOADS="pointer", GRID_ORDER="kv_major", num_warps=8), 192, True, (4, 1), 128),
]


def ordered_kernel(knobs: dict, head_dim_v=None):
    from autoflash import codegen

    bwd = load_space("triton_bwd")
    base = {n: c[0] for n, c in bwd.knobs.items()} | {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                                                        "num_warps": 4, "num_stages": 2, "DQ_MODE": "ordered"}
    return codegen.load(bwd.check_declared(base | knobs), value_dim=head_dim_v is not None)


def test_buffered_dq_launches_are_never_replayed(monkeypatch):
    """The dQ modes that add into a float32 buffer zero it with torch before the kernels and copy dQ out
    after them, work a direct replay would skip; the ordered one would spin forever on turn counters
    the replay check poisons. Their backward launches are never bound (the module launches each call)."""
    from autoflash import codegen, replay

    bound = []
    monkeypatch.setattr(replay, "bind", lambda module, run, *a, **k: bound.append(1) or run())
    q, k, v = (rand(1, 2, 37, 16, seed=s) for s in (30, 31, 32))
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 37)
    for mode in ("ordered", "atomic", "separate"):
        knobs = {"DQ_MODE": mode} | ({"BLOCK_M2": 64, "BLOCK_N2": 32} if mode != "separate" else {})
        kernel = ordered_kernel(knobs)
        assert kernel.host.replayable == (mode == "separate")
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        launcher = kernel.bind_backward(q, k, v, out, lse, q, *grads, 0.25, True, 0)
        assert (launcher is None) and (len(bound) == (mode == "separate"))
        assert not any(torch.isnan(g).any() for g in grads)  # (the call itself ran)


@pytest.mark.interpreter
@pytest.mark.parametrize("tiles", [(32, 64), (64, 32), (32, 32)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("causal, nq, nk, offset, knobs", [
    (True, 130, 130, 0, dict(GRID_ORDER="heavy_first")),
    (True, 161, 97, -64, dict(GRID_ORDER="kv_major")),  # bottom-right: the first query rows see no key
    (True, 97, 203, 106, dict(GRID_ORDER="heavy_first", GQA_SPLIT=2)),
    (True, 97, 203, 0, dict(GRID_ORDER="kv_major")),  # top-left with more keys than queries
    (False, 111, 150, 0, dict(GRID_ORDER="kv_major"))], ids=["square", "bottom-right-short", "split", "top-left",
                                                              "full"])
def test_the_ordered_dq_is_right_in_the_interpreter(tiles, causal, nq, nk, offset, knobs):
    """The turns come round for every query block, whatever the tiles, the causal alignment (each query
    block's last key block computed from its rows), the grid order and the GQA split: gradients against
    float64, each gradient element written (poisoned first). (A turn that never comes hangs the
    interpreter, which runs the programs one after another in launch order.)"""
    block_m, block_n = tiles
    kernel = ordered_kernel(dict(LOADS="pointer", BLOCK_M1=block_m, BLOCK_N1=block_n, **knobs))
    q, grad = rand(2, 4, nq, 16, seed=30), rand(2, 4, nq, 16, seed=31)
    k, v = rand(2, 2, nk, 16, seed=32), rand(2, 2, nk, 16, seed=33)
    scale = 0.3
    from autoflash.reference import reference

    out, lse = (t.float() for t in reference(q, k, v, causal, offset, scale))
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, out, lse, grad, dq, dk, dv, scale, causal, offset)
    for mine, want in zip((dq, dk, dv), reference_grads(q, k, v, grad, causal, offset, scale)):
        assert not torch.isnan(mine).any() and rel_error(mine, want) <= 1e-4


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_the_ordered_dq_is_right_on_packed_sequences(causal):
    """Packed sequences: each sequence's own key blocks and causal offset set the turns (ragged lengths,
    more queries than keys in one), programs past a sequence's end take no turn."""
    from test_varlen import cu, packed_inputs, per_sequence_reference

    lens_q, lens_k = [37, 150, 90], [70, 41, 133]
    kernel = ordered_kernel(dict(LOADS="pointer", GRID_ORDER="heavy_first", BLOCK_M1=32, BLOCK_N1=64))
    q, k, v, grad = packed_inputs(lens_q, lens_k, 4, 2, 16, torch.float32, "cpu", seed=40)
    out, lse, want = per_sequence_reference(q, k, v, grad, lens_q, lens_k, causal, 0.3)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    kernel.backward_varlen(q, k, v, out.float(), lse.float(), grad, *grads, cu(lens_q), cu(lens_k), max(lens_q),
                           max(lens_k), 0.3, causal)
    for mine, ref in zip(grads, want):
        assert not torch.isnan(mine).any() and rel_error(mine, ref) <= 1e-4


def test_the_ordered_dq_compiles_for_sm90(tmp_path):
    """The interpreter runs programs one after another, so it cannot see a spin-wait the GPU compiler
    refuses: the ordered dQ's dK/dV kernel compiles for Hopper on any machine."""
    from helpers import run_in_clean_process

    done = run_in_clean_process("from tests.test_deterministic import compile_for_sm90; compile_for_sm90()", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == len(ORDERED_CASES)


def compile_for_sm90() -> None:
    """(Run by the test above in a clean process.) Capture each ordered backward's dK/dV launch and compile it."""
    from helpers import capture_launches, compile_for_sm90 as compile_one

    for knobs, d, causal, (hq, hkv), dv in ORDERED_CASES:
        kernel = ordered_kernel(knobs, dv)
        q, o = torch.empty(2, hq, 333, d, dtype=torch.bfloat16), torch.empty(2, hq, 333, dv or d, dtype=torch.bfloat16)
        k, v = torch.empty(2, hkv, 517, d, dtype=torch.bfloat16), torch.empty(2, hkv, 517, dv or d, dtype=torch.bfloat16)
        m = kernel.module
        launches = capture_launches([m._bwd_dkdv, m._bwd_preprocess] + ([m._bwd_gqa_reduce] if knobs.get("GQA_SPLIT") else []))
        kernel.host.launch(q=q, k=k, v=v, o=o, lse=torch.empty(2, hq, 333), do=torch.empty_like(o), dq=torch.empty_like(q),
                           dk=torch.empty_like(k), dv=torch.empty_like(v), sm_scale=0.1, causal=causal, causal_offset=184,
                           compile_only=True)
        jit, a, kw = next(launch for launch in launches if launch[0] is m._bwd_dkdv)
        assert "atom" in compile_one(jit, a, kw)  # (the turns are atomics)
        print("ordered", knobs, d, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(ORDERED_CASES)))
def test_the_ordered_dq_on_the_gpu_is_right_and_bitwise_repeatable(case):
    """The spin-waits on real concurrent programs (the interpreter runs them one by one): ragged lengths,
    GQA, causal and not, 20 passes bitwise equal and within 3x SDPA's error of float64."""
    knobs, d, causal, (hq, hkv), dv = ORDERED_CASES[case]
    kernel = ordered_kernel(knobs, dv)
    q = rand(3, hq, 1111, d, seed=20, device="cuda", dtype=torch.bfloat16)
    k = rand(3, hkv, 1023, d, seed=21, device="cuda", dtype=torch.bfloat16)
    v = rand(3, hkv, 1023, dv or d, seed=22, device="cuda", dtype=torch.bfloat16)
    grad = rand(3, hq, 1111, dv or d, seed=23, device="cuda", dtype=torch.bfloat16)
    scale, offset = d ** -0.5, 1023 - 1111
    from autoflash.reference import reference

    out, lse = (t.to(dtype) for t, dtype in zip(reference(q, k, v, causal, offset, scale), (torch.bfloat16, torch.float32)))

    def grads():
        dq, dk, dv_ = torch.full_like(q, float("nan")), torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        kernel.backward(q, k, v, out, lse, grad, dq, dk, dv_, scale, causal, offset)
        return dq, dk, dv_

    first = grads()
    for _ in range(19):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))
    exact = reference_grads(q, k, v, grad, causal, offset, scale)
    for mine, want in zip(first, exact):
        assert not torch.isnan(mine).any() and rel_error(mine, want) <= 2e-2
