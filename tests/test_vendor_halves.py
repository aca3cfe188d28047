"""Training pairs with one half torch SDPA's and the other autoflash's own (sdpa_bwd's FORWARD and
BACKWARD knobs): the log-sum-exp they exchange, the gate, the tuner, the dispatcher. On the CPU the
SDPA half is the CPU build's flash backend, the own half runs in the interpreter; the cuDNN halves
are checked on a GPU."""

import json
import math

import pytest
import torch

import autoflash
from autoflash import api, codegen
from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.reference import make_inputs, reference, reference_grads, rel_error
from autoflash.space import default_variant, load_space
from autoflash.store import Store
from autoflash.tuning import seeds
from autoflash.tuning.sandbox import evaluate_variant
from autoflash.vendor import SdpaKernel

DEVICE = gpu_fingerprint()
SHAPE = Shape(batch=2, heads_q=4, heads_kv=2, seqlen_q=40, seqlen_k=40, head_dim=32, causal=True, dtype="float32",
              op="bwd")
HALVES = [("sdpa", "autoflash"), ("autoflash", "sdpa")]


def pair_variant(backend: str, forward: str, backward: str):
    return load_space("sdpa_bwd").check_declared({"BACKEND": backend, "FORWARD": forward, "BACKWARD": backward})


def _float64_grads(q, k, v, do, causal=True):
    return reference_grads(q, k, v, do, causal, 0, q.shape[-1] ** -0.5)


@pytest.mark.interpreter
def test_sdpa_and_autoflash_exchange_one_log_sum_exp():
    """SDPA's forward LSE is autoflash's (natural log, (B, H, Nq)), and SDPA's backward from
    autoflash's O and LSE gives the gradients: the two halves fit either way round."""
    q, k, v = make_inputs(SHAPE, "cpu", seed=3)
    do = make_inputs(SHAPE, "cpu", seed=4)[0]
    scale = SHAPE.head_dim ** -0.5
    kernel = SdpaKernel(pair_variant("flash", "autoflash", "sdpa"))
    out, lse = kernel.attention_with_lse(q, k, v, scale, True)
    ref_out, ref_lse = reference(q, k, v, True, 0, scale)
    assert lse.shape == q.shape[:3] and lse.stride(-1) == 1
    assert float((lse - ref_lse).abs().max()) < 1e-5 and rel_error(out, ref_out) < 1e-5
    own_out, own_lse = api.forward_with_lse(q, k, v, causal=True)
    assert float((own_lse - lse).abs().max()) < 1e-5
    for mine, ref in zip(kernel.gradients_from(q, k, v, own_out, own_lse, do, scale, True),
                         _float64_grads(q, k, v, do)):
        assert mine.shape == ref.shape and rel_error(mine, ref) < 1e-5  # dK, dV with the KV heads (GQA)


@pytest.mark.interpreter
@pytest.mark.parametrize("forward, backward", HALVES)
def test_a_pair_with_an_sdpa_half_passes_the_gate_and_is_timed(forward, backward):
    variant = pair_variant("flash", forward, backward)
    assert not load_space("sdpa_bwd").violations(variant, SHAPE.problem, DEVICE)
    outcome = evaluate_variant(variant.json(), "sdpa_bwd", SHAPE, rep_ms=1, device_str="cpu")
    assert outcome.status == "ok", outcome.message
    assert outcome.ms > 0 and outcome.err <= 3 * outcome.sdpa_err + 1e-5


def test_the_space_offers_halves_only_where_they_are_wired():
    space = load_space("sdpa_bwd")
    offered = {(v["BACKEND"], v["FORWARD"], v["BACKWARD"]) for v in space.valid_variants(SHAPE.problem, DEVICE)}
    if torch.cuda.is_available():
        assert {("cudnn", "sdpa", "autoflash"), ("cudnn", "autoflash", "sdpa")} <= offered
        assert not any(b in ("flash", "efficient") and (f, w) != ("sdpa", "sdpa") for b, f, w in offered)
    else:
        assert offered == {("flash", "sdpa", "sdpa"), ("flash", "sdpa", "autoflash"), ("flash", "autoflash", "sdpa"),
                           ("math", "sdpa", "sdpa")}
    assert not any(f == w == "autoflash" for _, f, w in offered)  # that pair is the own family's
    assert space.legacy == {"FORWARD": "sdpa", "BACKWARD": "sdpa"}  # what a vendor winner was before


@pytest.fixture
def half_sdpa_winner(tmp_path, monkeypatch, request):
    """A user DB where a pair with one SDPA half won SHAPE's backward problem; the own default is
    stored beside it (slower), as the tuner stores it."""
    forward, backward = request.param
    store = Store(tmp_path / "user.db")
    store.add_gpu(DEVICE)
    problem = SHAPE.problem
    for variant, ms in ((pair_variant("flash", forward, backward), 1.0), (default_variant("bwd", problem, DEVICE), 2.0)):
        store.set_winner(gpu_key=DEVICE.key, problem=problem, template_hash=codegen.template_hash(variant.family),
                         variant_json=variant.json(), median_ms=ms, spread=0.0, tflops=1.0, trials=3)
    store.close()
    monkeypatch.setenv("AUTOFLASH_DB", str(tmp_path / "user.db"))
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")  # a tuned winner is not a fallback
    api.reset()
    yield forward, backward
    api.reset()


@pytest.mark.interpreter
@pytest.mark.parametrize("half_sdpa_winner", HALVES, indirect=True)
def test_a_winner_with_an_sdpa_half_is_served_as_that_pair(half_sdpa_winner):
    forward, backward = half_sdpa_winner
    q, k, v = (t.requires_grad_() for t in make_inputs(SHAPE, "cpu", seed=5))
    do = make_inputs(SHAPE, "cpu", seed=6)[0]
    for _ in range(2):  # the first call plans, the second replays the plan
        for t in (q, k, v):
            t.grad = None
        out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
        assert "EagerAttention" in out.grad_fn.name()  # autoflash's pair, not SDPA's autograd node
        out.backward(do)
        grads = _float64_grads(*(t.detach() for t in (q, k, v)), do)
        for mine, ref in zip((q.grad, k.grad, v.grad), grads):
            assert rel_error(mine, ref) < 1e-5
    (plan,) = api.training_plans.values()
    assert plan.pair.forward_kernel.vendor == (forward == "sdpa")
    assert plan.pair.backward_kernel.vendor == (backward == "sdpa")


@pytest.mark.interpreter
def test_the_tuner_measures_pairs_with_sdpa_halves(tmp_path, monkeypatch):
    """(Vendor kernels sit out interpreted runs, where they would beat every interpreted kernel:
    let them compete here.) Every pair the device offers is timed, and gated where it has an own
    half (SDPA's whole pair of a backend clearly slower than the best is stopped before its gate)."""
    from autoflash.tuning import tuner
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.workers import tune

    monkeypatch.setattr(tuner, "competes", lambda family, interpret: True)
    store = Store(tmp_path / "t.db")
    shape = Shape(1, 2, 1, 37, 37, 32, True, "float32", op="bwd")
    tune([shape], store, TuneOptions(trials=1, interpret=True))
    vendor = [r for r in store.db["trials"].rows if r["template_hash"] == codegen.template_hash("sdpa_bwd")]
    pairs = {(json.loads(r["variant"])["FORWARD"], json.loads(r["variant"])["BACKWARD"]) for r in vendor}
    assert pairs == {("sdpa", "sdpa"), *HALVES}
    assert all(r["status"] in ("ok", "slower") and r["median_ms"] > 0 for r in vendor), [r["message"] for r in vendor]
    assert all(r["status"] == "ok" for r in vendor if "autoflash" in r["variant"])
    store.close()


def test_training_backward_is_the_stored_own_backward_winner(tmp_path):
    store = Store(tmp_path / "w.db")
    gpu_key = store.add_gpu(DEVICE)
    problem = SHAPE.problem
    own = load_space("triton_bwd").valid_variants(problem, DEVICE)[1]
    for variant, ms in ((pair_variant("flash", "sdpa", "autoflash"), 1.0), (own, 2.0)):
        store.set_winner(gpu_key=gpu_key, problem=problem, template_hash=codegen.template_hash(variant.family),
                         variant_json=variant.json(), median_ms=ms, spread=0.0, tflops=1.0, trials=3)
    rows = store.winners(gpu_key)
    assert seeds.training_backward(SHAPE, DEVICE, [[], rows]) == ("triton_bwd", own.json())
    assert seeds.training_backward(Shape(**{**SHAPE.__dict__, "op": "fwd"}), DEVICE, [rows]) is None
    assert seeds.training_backward(Shape(**{**SHAPE.__dict__, "head_dim": 64}), DEVICE, [rows]) is None
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("forward, backward", HALVES)
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_cudnn_halves_on_the_gpu(forward, backward, layout):
    """cuDNN's forward LSE feeds autoflash's backward and autoflash's feeds cuDNN's backward, ragged
    lengths and GQA, both layouts; where cuDNN refuses (one query and one key) the own half serves."""
    from autoflash import ops

    kernel = SdpaKernel(pair_variant("cudnn", forward, backward))
    for b, hq, hkv, n, d in ((2, 4, 2, 113, 128), (1, 6, 2, 1023, 64), (2, 4, 4, 37, 96), (1, 2, 1, 1, 256)):
        shape = Shape(b, hq, hkv, n, n, d, True, "bfloat16", op="bwd")
        q, k, v = make_inputs(shape, "cuda", seed=n, layout=layout)
        do = make_inputs(shape, "cuda", seed=n + 1)[0]
        pair = ops.training_pair(q, k, v, d ** -0.5, True, 0, winner=kernel)  # as served
        out, lse = pair.forward(q, k, v)
        ref_out, ref_lse = reference(q, k, v, True, 0, d ** -0.5)
        assert float((lse - ref_lse).abs().max()) < 1e-3 and rel_error(out, ref_out) < 1e-2
        for grad in (do, do.transpose(1, 2).contiguous().transpose(1, 2)):  # either layout, whatever q's
            for mine, ref in zip(pair.backward(q, k, v, out, lse, grad), _float64_grads(q, k, v, grad)):
                err = rel_error(mine, ref)
                assert math.isfinite(err) and err < 2e-2, (shape, err)


@pytest.mark.parametrize("half_sdpa_winner", HALVES, indirect=True)
def test_which_names_both_halves_of_the_served_pair(half_sdpa_winner, tmp_path, monkeypatch):
    from click.testing import CliRunner

    import autoflash.cli
    from autoflash.cli import cli

    shapes = tmp_path / "s.toml"
    shapes.write_text("[[shape]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in SHAPE.as_dict().items()
                                                 if k not in ("op", "page")) + "\n")
    monkeypatch.setattr(autoflash.cli.console, "width", 400)  # one table row per line
    r = CliRunner().invoke(cli, ["which", "--interpret", "--shapes", str(shapes), "--op", "bwd"])
    assert r.exit_code == 0, r.output
    (line,) = [line for line in r.output.splitlines() if "bwd/" in line]
    forward, backward = half_sdpa_winner
    assert f"BACKEND=flash BACKWARD={backward} FORWARD={forward}" in line
    if backward == "autoflash":  # the own backward stored beside the pair
        own = default_variant("bwd", SHAPE.problem, DEVICE)
        assert f"(backward: triton_bwd: {own.short()})" in line and "(forward:" not in line
    else:  # no forward stored: the own forward default
        own = default_variant("fwd", Shape(**{**SHAPE.__dict__, "op": "fwd"}).problem, DEVICE)
        assert f"(forward: {own.family}: {own.short()})" in line and "(backward:" not in line


@pytest.mark.interpreter
@pytest.mark.parametrize("forward, backward", HALVES)
def test_a_causal_mask_not_top_left_never_reaches_an_sdpa_half(forward, backward):
    """SDPA's causal mask is top-left: a pair with an SDPA half asked for a bottom-right call
    (flash-attn's alignment, Nq < Nk) is the own pair instead, with the right gradients."""
    from autoflash import ops

    shape = Shape(**{**SHAPE.__dict__, "seqlen_q": 24})
    q, k, v = make_inputs(shape, "cpu", seed=7)
    do = make_inputs(shape, "cpu", seed=8)[0]
    offset, scale = shape.seqlen_k - shape.seqlen_q, shape.head_dim ** -0.5
    pair = ops.training_pair(q, k, v, scale, True, offset, winner=SdpaKernel(pair_variant("flash", forward, backward)))
    assert not pair.forward_kernel.vendor and not pair.backward_kernel.vendor
    out, lse = pair.forward(q, k, v)
    assert rel_error(out, reference(q, k, v, True, offset, scale)[0]) < 1e-5
    for mine, ref in zip(pair.backward(q, k, v, out, lse, do), reference_grads(q, k, v, do, True, offset, scale)):
        assert rel_error(mine, ref) < 1e-5


def test_a_pair_with_the_own_backward_is_stored_with_the_own_backward_it_was_timed_with(tmp_path):
    """The dispatcher serves such a pair with the own row stored beside it: that row is the own
    backward the pair was re-measured with, even where another own candidate re-measured faster."""
    from autoflash.dispatch import WinnerTable
    from autoflash.tuning.winner_rows import store_winner_rows

    store = Store(tmp_path / "w.db")
    gpu_key = store.add_gpu(DEVICE)
    problem = SHAPE.problem
    paired, faster = load_space("triton_bwd").valid_variants(problem, DEVICE)[:2]
    methods = [f"{v.family}:{v.json()}" for v in (pair_variant("flash", "sdpa", "autoflash"), paired, faster)]
    medians = dict(zip(methods, (1.0, 3.0, 2.0)))
    ms = {"default": 3.0, "sdpa_cudnn": float("nan"), "sdpa_flash": float("nan")}
    for paired_own, stored in ((methods[1], paired), (None, faster)):
        store_winner_rows(store, gpu_key=gpu_key, problem=problem, shape=SHAPE, winner_key=methods[0], finite=methods,
                          medians=medians, samples={}, spread=0.0, ms=ms, measured=3, run_id=None, paired_own=paired_own)
        table = WinnerTable(DEVICE, [store.path])
        assert table.lookup(problem)[0] == pair_variant("flash", "sdpa", "autoflash")
        assert table.lookup(problem, own_only=True) == (stored, "exact")
    store.close()


def test_a_vendor_row_of_the_earlier_space_file_is_still_served(tmp_path):
    """A user's DB tuned before the halves were knobs holds SDPA pair winners under the earlier
    space file's hash, without FORWARD/BACKWARD: they are served as SDPA's whole pair (not dropped,
    which would serve the slower own kernel stored beside them)."""
    from autoflash.dispatch import WinnerTable

    earlier_hashes = load_space("sdpa_bwd").replaces  # (the file before the halves, and each later edit)
    assert earlier_hashes and codegen.template_hash("sdpa_bwd") not in earlier_hashes
    problem = SHAPE.problem
    own = default_variant("bwd", problem, DEVICE)
    for earlier in earlier_hashes:
        store = Store(tmp_path / f"old-{earlier}.db")
        store.add_gpu(DEVICE)
        store.set_winner(gpu_key=DEVICE.key, problem=problem, template_hash=earlier,
                         variant_json='{"BACKEND":"flash"}', median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
        store.set_winner(gpu_key=DEVICE.key, problem=problem, template_hash=codegen.template_hash(own.family),
                         variant_json=own.json(), median_ms=2.0, spread=0.0, tflops=1.0, trials=3)
        store.close()
        table = WinnerTable(DEVICE, [tmp_path / f"old-{earlier}.db"])
        assert table.rejected == []
        assert table.lookup(problem) == (pair_variant("flash", "sdpa", "sdpa"), "exact")
        assert table.lookup(problem, own_only=True) == (own, "exact")
        assert codegen.family_for_hash("bwd", earlier) is None  # (served through `replaces` only)


@pytest.mark.interpreter
@pytest.mark.parametrize("half_sdpa_winner", HALVES, indirect=True)
def test_bench_names_both_halves_of_the_served_pair(half_sdpa_winner):
    from autoflash.bench import served_by
    from autoflash.dispatch import get_dispatcher

    forward, backward = half_sdpa_winner
    own_forward = default_variant("fwd", Shape(**{**SHAPE.__dict__, "op": "fwd"}).problem, DEVICE).family
    expected = "sdpa-flash + triton_bwd" if forward == "sdpa" else f"{own_forward} + sdpa-flash"
    assert served_by(get_dispatcher(), SHAPE, DEVICE, "bwd") == expected
    assert served_by(get_dispatcher(), SHAPE, DEVICE, "fwd") == own_forward  # (no forward winner stored)
