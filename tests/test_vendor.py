"""Vendor kernels (torch SDPA backends) as candidates: gated and timed like the own families, stored
beside the best own kernel, dispatched where they won, passed over where their semantics differ
(top-left causal mask only, no log-sum-exp), and never mistaken for a fallback."""

import json

import pytest
import torch

import autoflash
from autoflash import api, codegen
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import Dispatcher, WinnerTable, get_dispatcher
from autoflash.problem import Shape
from autoflash.reference import make_inputs, reference, rel_error
from autoflash.space import Variant, default_variant, families_for, load_space
from autoflash.store import Store
from autoflash.tuning.sandbox import evaluate_variant
from autoflash.tuning.winner_rows import store_winner_rows
from autoflash.vendor import SdpaKernel

pytestmark = pytest.mark.interpreter
DEVICE = gpu_fingerprint()
SHAPE = Shape(batch=2, heads_q=4, heads_kv=2, seqlen_q=40, seqlen_k=40, head_dim=32, causal=True, dtype="float32")


def sdpa(op: str, backend: str, forward: str = "sdpa", backward: str = "sdpa") -> Variant:
    """A vendor variant; a backward one is a training pair whose halves FORWARD/BACKWARD name."""
    knobs = {"BACKEND": backend} if op == "fwd" else {"BACKEND": backend, "FORWARD": forward, "BACKWARD": backward}
    return load_space(f"sdpa_{op}").check_declared(knobs)


def test_vendor_families_are_registered_per_op_and_offer_what_this_device_runs():
    assert "sdpa_fwd" in families_for("fwd") and "sdpa_bwd" in families_for("bwd")
    valid = {v["BACKEND"] for v in load_space("sdpa_fwd").valid_variants(SHAPE.problem, DEVICE)}
    assert valid == {"flash", "math"}  # the CPU build's backends (cuDNN etc. on a GPU)
    # its hash is the space file's: a stored vendor winner is keyed like any other
    assert codegen.family_for_hash("fwd", codegen.template_hash("sdpa_fwd")) == "sdpa_fwd"


@pytest.mark.parametrize("op", ["fwd", "bwd"])
@pytest.mark.parametrize("backend", ["flash", "math"])
def test_a_vendor_candidate_passes_the_same_gate_and_is_timed(op, backend):
    shape = Shape(**{**SHAPE.__dict__, "op": op})
    outcome = evaluate_variant(sdpa(op, backend).json(), f"sdpa_{op}", shape, rep_ms=1, device_str="cpu")
    assert outcome.status == "ok", outcome.message
    assert outcome.ms > 0 and outcome.err <= 2 * outcome.sdpa_err + 1e-5


def _db_with(path, rows, spread=0.0):
    store = Store(path)
    store.add_gpu(DEVICE)
    for problem, variant, ms in rows:
        store.set_winner(gpu_key=DEVICE.key, problem=problem, template_hash=codegen.template_hash(variant.family),
                         variant_json=variant.json(), median_ms=ms, spread=spread, tflops=1.0, trials=3)
    store.close()
    return path


@pytest.fixture
def vendor_winners(tmp_path, monkeypatch):
    """A user DB where torch SDPA (flash backend) won the problems of SHAPE, forward and backward,
    and the best own kernels are stored beside it (slower)."""
    fwd, bwd = SHAPE.problem, Shape(**{**SHAPE.__dict__, "op": "bwd"}).problem
    db = _db_with(tmp_path / "user.db", [
        (fwd, sdpa("fwd", "flash"), 1.0), (fwd, default_variant("fwd", fwd, DEVICE), 2.0),
        (bwd, sdpa("bwd", "flash"), 1.0), (bwd, default_variant("bwd", bwd, DEVICE), 2.0)])
    monkeypatch.setenv("AUTOFLASH_DB", str(db))
    api.reset()
    yield db
    api.reset()


def _inputs(nq=SHAPE.seqlen_q, nk=SHAPE.seqlen_k, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(SHAPE.batch, SHAPE.heads_q, nq, SHAPE.head_dim, generator=g)
    k, v = (torch.randn(SHAPE.batch, SHAPE.heads_kv, nk, SHAPE.head_dim, generator=g) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def test_an_sdpa_winner_is_dispatched_and_the_own_one_is_kept_for_calls_that_need_it(vendor_winners):
    q, k, v = _inputs()
    d = get_dispatcher()
    assert d.kernel_for(q, k, v, q, True).vendor
    assert not d.kernel_for(q, k, v, q, True, own_only=True).vendor
    ref = reference(q, k, v, True, 0, SHAPE.head_dim ** -0.5)[0]
    for _ in range(2):  # the first call plans, the second replays the plan
        out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
        assert rel_error(out, ref) < 1e-5
    (plan,) = api.inference_plans.values()
    assert rel_error(plan(q, k, v), ref) < 1e-5


def test_bench_says_an_sdpa_winner_serves(vendor_winners):
    from autoflash.bench import served_by

    for op in ("fwd", "bwd"):  # the forward, and SDPA's whole pair for training
        assert served_by(get_dispatcher(), SHAPE, DEVICE, op) == "sdpa-flash"


def test_a_causal_mask_aligned_bottom_right_goes_to_the_own_kernel(vendor_winners):
    q, k, v = _inputs(nq=24)  # flash_attn_func: query i sees keys j <= i + (40 - 24)
    out = autoflash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    ref = reference(q, k, v, True, 16, SHAPE.head_dim ** -0.5)[0]
    assert rel_error(out.transpose(1, 2), ref) < 1e-5


def test_training_runs_the_vendor_pair_through_torch_autograd(vendor_winners):
    q, k, v = _inputs(grad=True)
    out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert "autoflash" not in out.grad_fn.name()  # SDPA's own autograd node, not autoflash's op
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(q64, k64, v64, True, 0, SHAPE.head_dim ** -0.5)[0].sum().backward()
    for mine, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert rel_error(mine, ref) < 1e-5


def test_strict_mode_serves_a_vendor_winner_but_still_refuses_fallbacks(vendor_winners, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    q, k, v = _inputs()
    autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)  # a tuned winner: not a fallback
    with pytest.raises(api.FallbackError):
        autoflash.attention(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.bool), enable_gqa=True)


def test_the_final_re_measure_times_vendor_candidates_as_candidates():
    """A vendor family's method ('sdpa_fwd:{...}') is a candidate, not one of the SDPA yardstick
    columns ('sdpa_cudnn'), in the interleaved re-measure of the winner pick."""
    from autoflash.tuning.sandbox import remeasure

    for op in ("fwd", "bwd"):
        shape = Shape(**{**SHAPE.__dict__, "op": op})
        methods = [f"sdpa_{op}:" + sdpa(op, "flash").json(), f"sdpa_{op}:" + sdpa(op, "math").json()]
        samples = remeasure(methods, op, shape, 2, 1, "cpu")["samples"]
        assert all(len(samples[m]) == 2 and all(x > 0 for x in samples[m]) for m in methods)


def test_a_vendor_win_stores_the_best_own_candidate_beside_it(tmp_path):
    store = Store(tmp_path / "w.db")
    gpu_key = store.add_gpu(DEVICE)
    problem = SHAPE.problem
    own = [default_variant("fwd", problem, DEVICE), load_space("fwd").valid_variants(problem, DEVICE)[0]]
    methods = [f"{v.family}:{v.json()}" for v in (sdpa("fwd", "flash"), *own)]
    medians = dict(zip(methods, (1.0, 3.0, 2.0)))
    ms = {"default": 3.0, "sdpa_cudnn": float("nan"), "sdpa_flash": float("nan")}
    store_winner_rows(store, gpu_key=gpu_key, problem=problem, shape=SHAPE, winner_key=methods[0], finite=methods,
                      medians=medians, samples={}, spread=0.0, ms=ms, measured=3, run_id=None)
    rows = {r["template_hash"]: json.loads(r["variant"]) for r in store.winners()}
    assert rows == {codegen.template_hash("sdpa_fwd"): {"BACKEND": "flash"},
                    codegen.template_hash("triton_fwd"): own[1].as_dict()}
    table = WinnerTable(DEVICE, [store.path])
    assert table.lookup(problem) == (sdpa("fwd", "flash"), "exact")
    assert table.lookup(problem, own_only=True) == (own[1], "exact")
    # an own win afterwards supersedes both
    store_winner_rows(store, gpu_key=gpu_key, problem=problem, shape=SHAPE, winner_key=methods[1],
                      finite=methods, medians=medians, samples={}, spread=0.0, ms=ms, measured=3, run_id=None)
    assert [json.loads(r["variant"]) for r in store.winners()] == [own[0].as_dict()]
    store.close()


def test_a_vendor_winner_this_device_does_not_offer_is_never_served(tmp_path):
    """cuDNN on the CPU: the kernel says it cannot take the tensors, and the stored row is rejected
    by the space's constraints (with a warning) before it could be served."""
    cudnn = load_space("sdpa_fwd").check_declared({"BACKEND": "cudnn"})
    problem = SHAPE.problem
    db = _db_with(tmp_path / "w.db", [(problem, cudnn, 1.0)])
    q, k, v = _inputs()
    assert "not offered" in codegen.load(cudnn).unsupported(q, k, v, q)
    with pytest.warns(RuntimeWarning, match="rejected winner"):  # not valid on this device's space either
        kernel = Dispatcher(winner_paths=[db]).kernel_for(q, k, v, q, True)
    assert not kernel.vendor


def test_tensors_a_vendor_backend_refuses_are_served_by_the_own_kernel(vendor_winners, tmp_path):
    """A vendor winner for the problem, and a query whose head dim is not contiguous (torch's
    fused backends refuse it; autoflash's kernels take any strides): the own kernel answers."""
    q, k, v = _inputs()
    q_strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) != 1
    assert q_strided.stride(-1) != 1
    d = get_dispatcher()
    assert not d.kernel_for(q_strided, k, v, torch.empty_like(q_strided), True).vendor
    for _ in range(2):
        out = autoflash.attention(q_strided, k, v, is_causal=True, enable_gqa=True)
        assert rel_error(out, reference(q, k, v, True, 0, SHAPE.head_dim ** -0.5)[0]) < 1e-5


def test_every_family_takes_the_tuners_compile_call():
    """The tuner builds every candidate with kernel.compile_for(q, k, v, causal, offset, page=...),
    a step the interpreter skips: each family's kernel must take that call (a vendor kernel that
    did not failed every SDPA candidate on the GPU)."""
    import inspect

    from autoflash.space import FAMILIES

    expected = list(inspect.signature(codegen.Kernel.compile_for).parameters)
    for family in FAMILIES:
        space = load_space(family)
        kernel = codegen.load(Variant(family, tuple(sorted((k, c[0]) for k, c in space.knobs.items()))))
        assert list(inspect.signature(type(kernel).compile_for).parameters) == expected, family
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    codegen.load(sdpa("bwd", "flash")).compile_for(q, k, v, True, 0, page=None)  # nothing to build, no error


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "math"])
def test_only_backend_switches_as_torchs_sdpa_kernel_does_and_restores(backend):
    """The vendor kernels' cheap backend switch: inside it torch reports exactly the backends that
    `sdpa_kernel([b])` leaves enabled; on exit (also by an exception) every switch is as before."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel

    from autoflash.reference import sdpa_backend
    from autoflash.vendor import only_backend

    b = sdpa_backend(backend)
    before = _cur_sdpa_kernel_backends()
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):  # a caller's own choice, kept
        outer = _cur_sdpa_kernel_backends()
        with sdpa_kernel([b]):
            theirs = _cur_sdpa_kernel_backends()
        with only_backend(b):
            assert _cur_sdpa_kernel_backends() == theirs == [b]
        assert _cur_sdpa_kernel_backends() == outer
        with pytest.raises(RuntimeError, match="inside"):
            with only_backend(b):
                raise RuntimeError("inside")
        assert _cur_sdpa_kernel_backends() == outer
    assert _cur_sdpa_kernel_backends() == before


def test_only_backend_takes_several_backends_as_torchs_sdpa_kernel_does():
    """`only_backend((a, b))` (a tuple or a list): the backends `sdpa_kernel([a, b])` leaves enabled,
    restored on exit; the same through torch's own context where this torch's switches have other names."""
    from torch.nn.attention import _cur_sdpa_kernel_backends, sdpa_kernel

    from autoflash import vendor

    before = _cur_sdpa_kernel_backends()
    with sdpa_kernel(list(vendor.FALLBACK_BACKENDS)):
        theirs = sorted(map(str, _cur_sdpa_kernel_backends()))
    for switches in (vendor._SWITCHES, None):
        saved, vendor._SWITCHES = vendor._SWITCHES, switches
        try:
            for backends in (vendor.FALLBACK_BACKENDS, list(vendor.FALLBACK_BACKENDS)):
                with vendor.only_backend(backends):
                    assert sorted(map(str, _cur_sdpa_kernel_backends())) == theirs
                assert _cur_sdpa_kernel_backends() == before
        finally:
            vendor._SWITCHES = saved


@pytest.mark.parametrize("own_ms, served", [(0.99, "vendor"), (0.95, "own")])
def test_an_own_kernel_serves_over_a_vendor_one_only_beyond_the_tie_margin(tmp_path, own_ms, served):
    """Stored beside a vendor winner at 1.0 ms: an own kernel 1% faster is within the margin (the
    vendor kernel, what the user had, serves); 5% faster, the own kernel serves."""
    from autoflash.vendor import VENDOR_TIE_MARGIN

    assert 0.01 < VENDOR_TIE_MARGIN < 0.05
    problem, own = SHAPE.problem, default_variant("fwd", SHAPE.problem, DEVICE)
    db = _db_with(tmp_path / "w.db", [(problem, sdpa("fwd", "flash"), 1.0), (problem, own, own_ms)])
    table = WinnerTable(DEVICE, [db])
    assert table.lookup(problem) == ((sdpa("fwd", "flash") if served == "vendor" else own), "exact")
    assert table.lookup(problem, own_only=True) == (own, "exact")


@pytest.mark.parametrize("pair_ms, stored", [(0.99, "all-vendor"), (0.95, "pair")])
def test_a_vendor_pair_with_an_own_half_meets_the_tie_margin_too(pair_ms, stored):
    """cuDNN's backward after the own forward is partly own code: in the pick, 1% faster than cuDNN's
    whole pair is a tie (the all-vendor pair is stored); 5% faster, the pair is."""
    from autoflash.tuning.winner_rows import vendor_on_a_tie

    whole, mixed = sdpa("bwd", "flash"), sdpa("bwd", "flash", forward="autoflash")
    keys = {v: f"sdpa_bwd:{v.json()}" for v in (whole, mixed)}
    medians = {keys[whole]: 1.0, keys[mixed]: pair_ms}
    assert vendor_on_a_tie(keys[mixed], list(medians), medians, {}) == keys[whole if stored == "all-vendor" else mixed]


@pytest.mark.parametrize("spread, stored", [(0.01, "pair"), (0.035, "all-vendor"), (0.30, "pair")])
def test_a_lead_inside_the_measured_spread_is_a_tie(spread, stored):
    """A pair 2.7% ahead of cuDNN's whole pair clears the 2% margin, but not the rounds' 3.5% spread
    (an H100 pick stored such a pair, and the bench measured it 3% behind); a 30% spread is a noisy
    run's and widens the margin only to its cap (5%)."""
    from autoflash.tuning.winner_rows import vendor_on_a_tie
    from autoflash.vendor import MAX_SPREAD_MARGIN, tie_margin

    assert tie_margin(0.30) == MAX_SPREAD_MARGIN < 0.06
    assert tie_margin(float("nan")) == tie_margin(None) == tie_margin(float("inf")) == 0.02
    whole, mixed = sdpa("bwd", "flash"), sdpa("bwd", "flash", forward="autoflash")
    keys = {v: f"sdpa_bwd:{v.json()}" for v in (whole, mixed)}
    medians = {keys[whole]: 1.0, keys[mixed]: 0.973 if spread < 0.1 else 0.94}
    samples = {keys[mixed]: [medians[keys[mixed]] * (1 + spread * f) for f in (-0.5, 0.0, 0.5)],
               keys[whole]: [1.0, 1.0, 1.0]}
    assert vendor_on_a_tie(keys[mixed], list(medians), medians, samples) == keys[whole if stored == "all-vendor" else mixed]
    # Only the own candidate's spread counts (the dispatcher has the own row's, not the vendor row's, to rank by)
    noisy_vendor = {keys[mixed]: [0.97] * 3, keys[whole]: [0.98, 1.0, 1.02]}
    assert vendor_on_a_tie(keys[mixed], list(medians), {keys[whole]: 1.0, keys[mixed]: 0.97}, noisy_vendor) == keys[mixed]


@pytest.mark.parametrize("spread, served", [(0.0, "own"), (0.04, "vendor")])
def test_the_dispatcher_widens_the_tie_margin_to_a_rows_spread(tmp_path, spread, served):
    """An own row 3% faster than the vendor row serves when its spread is inside the margin, not when
    its rounds spread by 4% (the pick would have stored the vendor kernel: the two agree)."""
    problem, own = SHAPE.problem, default_variant("fwd", SHAPE.problem, DEVICE)
    db = _db_with(tmp_path / "w.db", [(problem, sdpa("fwd", "flash"), 1.0), (problem, own, 0.97)], spread=spread)
    table = WinnerTable(DEVICE, [db])
    assert table.lookup(problem) == ((sdpa("fwd", "flash") if served == "vendor" else own), "exact")


def _remeasure_table(methods, op, shape, rounds, rep_ms, device_str):
    """Re-measure hook (run in a worker process): each method at its ms in the JSON table of
    $AUTOFLASH_TEST_REMEASURED (NaN for the SDPA yardstick columns)."""
    import json
    import os

    table = json.loads(os.environ["AUTOFLASH_TEST_REMEASURED"])
    if os.environ.get("AUTOFLASH_TEST_REMEASURE_LOG"):  # (what the pick asked for)
        with open(os.environ["AUTOFLASH_TEST_REMEASURE_LOG"], "w") as f:
            json.dump({"methods": methods, "rounds": rounds}, f)
    return {"samples": {m: [table.get(m, float("nan"))] * rounds for m in methods}}


def _pick_scripted(tmp_path, shape, done, default, stored=None, **options):
    """Tuner._pick_winner of `shape` over the trials `done` (re-measured by `_remeasure_table`), with
    `stored` (a Variant) as this GPU's stored winner first. Returns (result, the stored template hashes)."""
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.tuner import Tuner

    store = Store(tmp_path / "t.db")
    store.add_gpu(DEVICE)
    tuner = Tuner(store, TuneOptions(trials=1, interpret=True, trial_timeout_s=60, remeasure_fn=_remeasure_table,
                                     **options), device=DEVICE)
    if stored is not None:
        store.set_winner(gpu_key=tuner.gpu_key, problem=shape.problem, template_hash=codegen.template_hash(stored.family),
                         variant_json=stored.json(), median_ms=1.0, spread=0.0, tflops=1.0, trials=3)
    try:
        result = tuner._pick_winner(shape, shape.problem, done, default, measured=len(done), failed=0)
    finally:
        tuner.close("done", 1)
    hashes = {r["template_hash"] for r in store.winners()}
    store.close()
    return result, hashes


def test_the_pick_re_measures_sdpas_whole_pair_beside_a_pair_with_an_own_half(tmp_path, monkeypatch):
    """The vendor pass found the own forward before SDPA's backward (0.95 ms) ahead of SDPA's whole pair
    (1.0 ms); the re-measure has them at 0.99 and 1.0 ms: a tie, so SDPA's whole pair is stored. It
    must be re-measured for that, though it is neither the fastest vendor candidate nor in the top k."""

    bwd = Shape(**{**SHAPE.__dict__, "op": "bwd"})
    own = default_variant("bwd", bwd.problem, DEVICE)
    whole, mixed = sdpa("bwd", "flash"), sdpa("bwd", "flash", forward="autoflash")
    keys = {v: f"{v.family}:{v.json()}" for v in (own, whole, mixed)}
    monkeypatch.setenv("AUTOFLASH_TEST_REMEASURED", json.dumps({keys[own]: 1.2, keys[whole]: 1.0, keys[mixed]: 0.99}))
    done = {keys[own]: {"status": "ok", "median_ms": 0.9}, keys[mixed]: {"status": "ok", "median_ms": 0.95},
            keys[whole]: {"status": "ok", "median_ms": 1.0}}
    result, _ = _pick_scripted(tmp_path, bwd, done, own, top_k=1)
    assert result.status == "tuned" and result.winner == whole


def test_a_stored_own_kernel_keeps_its_place_against_a_pair_with_an_own_half_within_the_noise(tmp_path, monkeypatch):
    """Stored: the own backward (1.0 ms). Re-measured: a pair with an own half at 0.995 ms, inside the
    1% noise band: both are own code, so the stored winner stays (no flapping between re-tunes)."""

    bwd = Shape(**{**SHAPE.__dict__, "op": "bwd"})
    own = default_variant("bwd", bwd.problem, DEVICE)
    whole, mixed = sdpa("bwd", "flash"), sdpa("bwd", "flash", forward="autoflash")
    keys = {v: f"{v.family}:{v.json()}" for v in (own, whole, mixed)}
    monkeypatch.setenv("AUTOFLASH_TEST_REMEASURED", json.dumps({keys[own]: 1.0, keys[whole]: 1.05, keys[mixed]: 0.995}))
    done = {key: {"status": "ok", "median_ms": 1.0} for key in keys.values()}
    result, _ = _pick_scripted(tmp_path, bwd, done, own, stored=own)
    assert result.status == "tuned" and result.winner == own


@pytest.mark.parametrize("own_trial_ms, decided", [(1.2, True), (1.05, False)])
def test_a_pick_that_trials_decided_re_measures_once(tmp_path, monkeypatch, own_trial_ms, decided):
    """SDPA's kernel 20% ahead of every own candidate in the trials: the pick re-measures it and the
    best own kernel once and stores SDPA's, the own kernel beside it; 5% ahead, the full pick runs."""
    from autoflash.tuning.winner_rows import vendor_decided

    own = default_variant("fwd", SHAPE.problem, DEVICE)
    vendor, own_key = f"sdpa_fwd:{sdpa('fwd', 'flash').json()}", f"{own.family}:{own.json()}"
    done = {vendor: {"status": "ok", "median_ms": 1.0}, own_key: {"status": "ok", "median_ms": own_trial_ms}}
    assert (vendor_decided([vendor, own_key], done) is not None) == decided
    log = tmp_path / "remeasure.json"
    monkeypatch.setenv("AUTOFLASH_TEST_REMEASURED", json.dumps({vendor: 1.0, own_key: own_trial_ms}))
    monkeypatch.setenv("AUTOFLASH_TEST_REMEASURE_LOG", str(log))
    result, stored = _pick_scripted(tmp_path, SHAPE, done, own, rounds=3)
    assert result.status == "tuned" and result.winner.family == "sdpa_fwd"
    assert codegen.template_hash(own.family) in stored  # (the own kernel beside the vendor win)
    asked = json.loads(log.read_text())
    assert asked["rounds"] == (1 if decided else 3) and set(asked["methods"]) == {vendor, own_key}


def test_the_dispatcher_ranks_a_pair_with_an_own_half_as_own_code(tmp_path):
    """Stored in one DB, an own backward 1% faster than a pair with an own half serves: between the two
    no tie margin applies (both hold own code); before, the pair was ranked as all-vendor and served."""
    bwd = Shape(**{**SHAPE.__dict__, "op": "bwd"}).problem
    own, mixed = default_variant("bwd", bwd, DEVICE), sdpa("bwd", "flash", forward="autoflash")
    db = _db_with(tmp_path / "w.db", [(bwd, mixed, 1.0), (bwd, own, 0.99)])
    assert WinnerTable(DEVICE, [db]).lookup(bwd) == (own, "exact")


def _remeasure_scripted(methods, op, shape, rounds, rep_ms, device_str):
    """Re-measure hook: the vendor candidate 1.00 ms; own candidates at the ms in OWN_MS (env)."""
    import os

    own_ms = float(os.environ["AUTOFLASH_TEST_OWN_MS"])
    return {"samples": {m: [1.0 if m.startswith("sdpa_") else own_ms] * rounds for m in methods}}


@pytest.mark.parametrize("own_ms, winner", [(0.99, "sdpa_fwd"), (0.95, "triton_fwd")])
def test_the_tuner_stores_a_vendor_win_on_a_tie(tmp_path, monkeypatch, own_ms, winner):
    """The pick applies the dispatcher's rule: an own candidate 1% faster than the vendor one in the
    final re-measure loses to it (stored beside it), 5% faster it wins."""
    from autoflash.tuning.results import TuneOptions
    from autoflash.tuning.tuner import Tuner

    monkeypatch.setenv("AUTOFLASH_TEST_OWN_MS", str(own_ms))
    problem, own = SHAPE.problem, default_variant("fwd", SHAPE.problem, DEVICE)
    vendor_key, own_key = f"sdpa_fwd:{sdpa('fwd', 'flash').json()}", f"{own.family}:{own.json()}"
    done = {vendor_key: {"status": "ok", "median_ms": 1.0}, own_key: {"status": "ok", "median_ms": 0.9}}
    store = Store(tmp_path / "t.db")
    tuner = Tuner(store, TuneOptions(trials=1, interpret=True, trial_timeout_s=60, remeasure_fn=_remeasure_scripted),
                  device=DEVICE)
    try:
        result = tuner._pick_winner(SHAPE, problem, done, own, measured=2, failed=0)
    finally:
        tuner.close("done", 1)
    assert result.status == "tuned" and result.winner.family == winner
    stored = {r["template_hash"] for r in store.winners()}
    store.close()
    assert codegen.template_hash(own.family) in stored  # (beside a vendor win, or as the winner)
    assert (codegen.template_hash("sdpa_fwd") in stored) == (winner == "sdpa_fwd")


class _FlashAsOnCuda(SdpaKernel):
    """torch's CUDA flash backend's rule, on the CPU: a causal call with Nq != Nk has no kernel
    (torch raises the same "No available kernel" error there)."""

    def attention(self, q, k, v, sm_scale, causal, causal_offset=0):
        if causal and q.shape[2] != k.shape[2]:
            raise RuntimeError("No available kernel. Aborting execution.")
        return super().attention(q, k, v, sm_scale, causal, causal_offset)


class _RefusesEverything(SdpaKernel):
    def attention(self, q, k, v, sm_scale, causal, causal_offset=0):
        raise RuntimeError("No available kernel. Aborting execution.")


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_the_gate_leaves_out_shapes_a_vendor_backend_refuses_but_not_all_of_them(op):
    """A vendor backend is gated on the shapes it takes (the API serves the others with the own
    kernel); one that takes none fails; an own kernel's RuntimeError is never read as a refusal."""
    from autoflash.tuning.gate import check, gate_shapes, refused_by_vendor

    shape = Shape(**{**SHAPE.__dict__, "op": op})
    assert any(g.seqlen_q != g.seqlen_k for g in gate_shapes(shape)) and shape.causal
    result = check(_FlashAsOnCuda(sdpa(op, "flash")), shape, "cpu")
    assert result.passed and result.err > 0 and not result.refused, result.detail  # (the square shape was checked)
    refused = check(_RefusesEverything(sdpa(op, "flash")), shape, "cpu")
    assert not refused.passed and refused.refused and "refused every gate shape" in refused.detail
    own = codegen.load(default_variant(op, shape.problem, DEVICE))
    assert not refused_by_vendor(own, RuntimeError("No available kernel"))



class _TorchRefusesGqa(SdpaKernel):
    """torch's own refusal (and its warnings): K/V with fewer heads, without enable_gqa."""

    def attention(self, q, k, v, sm_scale, causal, causal_offset=0):
        import torch.nn.functional as F

        from autoflash.vendor import only_backend

        with only_backend(self._backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def test_the_gate_keeps_torchs_refusal_warnings_out_of_a_tuning_run():
    """torch warns once per reason while a forced backend looks for a kernel it lacks (every gate
    shape of every vendor candidate): the gate records the refusal, the warnings stay out of the
    tuner's output. The same call outside the gate does warn (so the test can fail)."""
    import warnings

    from autoflash.tuning.gate import check

    kernel = _TorchRefusesGqa(sdpa("fwd", "flash"))
    q, k, v = make_inputs(SHAPE, "cpu", seed=1)
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="No available kernel"):
            kernel.attention(q, k, v, 0.1, True)
    assert outside
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = check(kernel, SHAPE, "cpu")
    assert result.refused and not result.passed
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []


def test_the_backward_gate_of_sdpas_whole_pair_builds_no_own_kernel(monkeypatch):
    """SDPA's whole pair runs its own forward through autograd: its gate neither builds nor launches
    an own forward for an O and LSE it would not read (on a GPU, the first vendor candidate of a new
    problem waited for that build). A pair with an own half still gets one."""
    from autoflash.tuning import gate

    built = []
    real = gate.forward_kernel_for_backward
    monkeypatch.setattr(gate, "forward_kernel_for_backward", lambda *a, **kw: built.append(1) or real(*a, **kw))
    shape = Shape(**{**SHAPE.__dict__, "op": "bwd"})
    whole = gate.check(codegen.load(sdpa("bwd", "flash")), shape, "cpu")
    assert whole.passed and whole.err > 0 and not built, whole.detail
    mixed = gate.check(codegen.load(sdpa("bwd", "flash", forward="autoflash")), shape, "cpu")
    assert mixed.passed and built, mixed.detail


class _CountedRefusal(SdpaKernel):
    """A served vendor kernel whose backend refuses every call after all (as cuDNN refuses a training
    call of one query and one key), counting how often it was asked."""

    asked = 0

    def attention(self, q, k, v, sm_scale, causal, causal_offset=0):
        import warnings

        type(self).asked += 1
        warnings.warn("cuDNN attention kernel not used because: (as torch warns)", UserWarning)
        raise RuntimeError("No available kernel. Aborting execution.")


@pytest.mark.parametrize("training", [False, True])
def test_a_vendor_winner_that_refuses_after_all_gives_plain_sdpas_pick_not_the_own_kernels(monkeypatch, training):
    """Where the served backend refuses a call at run time, torch's other fused backends serve it (what
    plain SDPA would run: on the H100 a one-query one-key training call fell to the own pair at 0.88x
    SDPA-flash), the refusal is asked once per signature, quietly, and the answer is SDPA's."""
    import warnings

    api.reset()
    _CountedRefusal.asked = 0
    refusing = _CountedRefusal(sdpa("bwd" if training else "fwd", "flash"))
    own_asked = []
    original = Dispatcher.kernel_for

    def kernel_for(self, q, k, v, o, causal, op="fwd", own_only=False, **kw):
        if own_only:
            own_asked.append(op)
            return original(self, q, k, v, o, causal, op, own_only=own_only, **kw)
        return refusing

    monkeypatch.setattr(Dispatcher, "kernel_for", kernel_for)
    q, k, v = (t.requires_grad_(training) for t in make_inputs(SHAPE, "cpu", seed=3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out = autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
            if training:
                out.sum().backward()
    assert not [w for w in caught if "not used because" in str(w.message)]  # (torch's refusal: not the user's business)
    want = torch.nn.functional.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True,
                                                            enable_gqa=True)
    assert rel_error(out.detach(), want) < 1e-5
    assert _CountedRefusal.asked == 1 and own_asked == []
    api.reset()


class _OutOfMemory(SdpaKernel):
    def attention(self, q, k, v, sm_scale, causal, causal_offset=0):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("training", [False, True])
def test_an_out_of_memory_in_a_vendor_kernel_is_raised_not_taken_for_a_refusal(monkeypatch, training):
    """Only a backend's refusal sends a call elsewhere: an out-of-memory (or a device error) is the
    caller's to see, never remembered as the signature's refusal."""
    api.reset()
    failing = _OutOfMemory(sdpa("bwd" if training else "fwd", "flash"))
    monkeypatch.setattr(Dispatcher, "kernel_for", lambda self, *a, **kw: failing)
    q, k, v = (t.requires_grad_(training) for t in make_inputs(SHAPE, "cpu", seed=3))
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            autoflash.attention(q, k, v, is_causal=True, enable_gqa=True)
    api.reset()
