"""The serving policy (CPU, a GPU fingerprint and winner rows in a real SQLite DB): SDPA-cuDNN serves
every problem the measured evidence does not show the own kernels faster on; in the interpreter (and
for what cuDNN cannot take) the own kernels serve as before."""

import pytest

from autoflash import codegen
from autoflash.device import GPUFingerprint, gpu_fingerprint
from autoflash.dispatch import Dispatcher
from autoflash.problem import Problem
from autoflash.serving_policy import EVIDENCE_MAX_DISTANCE, cudnn_variant, distance_between
from autoflash.space import default_variant, load_space
from autoflash.store import Store

H200 = GPUFingerprint("NVIDIA H200", 9, 0, 132, 232448, "2.11.0", "3.6.0", "13.0", "0.1.0")


def prob(q=2048, k=2048, head_dim=128, causal=True, group=1, dtype="bfloat16", op="fwd"):
    return Problem(op, dtype, head_dim, causal, group, q, k)


def make_db(path, rows, spread=0.01):
    """rows: (problem, own median_ms, SDPA-cuDNN ms of the same run)."""
    store = Store(path)
    store.add_gpu(H200)
    for problem, own_ms, cudnn_ms in rows:
        variant = default_variant(problem.op, problem, H200)
        store.set_winner(gpu_key=H200.key, problem=problem, template_hash=codegen.template_hash(variant.family),
                         variant_json=variant.json(), median_ms=own_ms, spread=spread, tflops=1.0, trials=5,
                         sdpa_cudnn_ms=cudnn_ms)
    store.close()
    return path


def served(tmp_path, rows, problem, spread=0.01):
    path = tmp_path / f"w{len(list(tmp_path.glob('*.db')))}.db"  # (a fresh DB per call)
    disp = Dispatcher(winner_paths=[make_db(path, rows, spread)])
    variant, why = disp.choose(problem, H200)
    return load_space(variant.family).vendor, why


def test_no_evidence_serves_sdpa_cudnn(tmp_path):
    vendor, why = served(tmp_path, [], prob())
    assert vendor and "no measurement" in why


def test_an_own_winner_measured_slower_than_cudnn_does_not_serve(tmp_path):
    p = prob()
    assert served(tmp_path, [(p, 1.0, 0.9)], p)[0]  # the row's own SDPA-cuDNN time is faster
    assert not served(tmp_path, [(p, 0.9, 1.0)], p)[0]
    assert served(tmp_path, [(p, 0.99, 1.0)], p)[0]  # within the tie margin: the vendor kernel
    # 3% ahead clears the 2% margin, but not rounds that spread by 4%: the lead is noise
    assert not served(tmp_path, [(p, 0.97, 1.0)], p, spread=0.01)[0]
    assert served(tmp_path, [(p, 0.97, 1.0)], p, spread=0.04)[0]


def test_nearest_evidence_decides_and_far_evidence_does_not(tmp_path):
    near = prob(q=4096, k=4096)  # one factor of 2 in each length: distance 2
    far = prob(q=16384, k=16384, head_dim=64)
    assert distance_between(near, prob()) <= EVIDENCE_MAX_DISTANCE < distance_between(far, prob())
    vendor, why = served(tmp_path, [(near, 0.8, 1.0)], prob())
    assert not vendor and "nearest" in why  # (the own winner of the nearest bucket serves)
    assert served(tmp_path, [(far, 0.8, 1.0)], prob())[0]
    assert served(tmp_path, [(prob(causal=False), 0.8, 1.0)], prob())[0]  # another causality says nothing


def test_backward_problems_get_cudnns_whole_pair(tmp_path):
    p = prob(op="bwd")
    vendor, _ = served(tmp_path, [], p)
    assert vendor
    variant = cudnn_variant(p, H200)
    assert variant.as_dict() == {"BACKEND": "cudnn", "FORWARD": "sdpa", "BACKWARD": "sdpa"}


@pytest.mark.parametrize("problem, device", [(prob(dtype="float32"), H200), (prob(), gpu_fingerprint()),
                                             (prob(head_dim=100), H200), (prob(head_dim=36, op="bwd"), H200)])
def test_where_cudnn_cannot_serve_the_own_kernels_do(tmp_path, problem, device):
    assert cudnn_variant(problem, device) is None or device.on_gpu
    disp = Dispatcher(winner_paths=[make_db(tmp_path / "w.db", [])])
    variant, _ = disp.choose(problem, device)
    assert not load_space(variant.family).vendor


def test_own_only_calls_never_get_a_vendor_kernel(tmp_path):
    disp = Dispatcher(winner_paths=[make_db(tmp_path / "w.db", [])])
    assert not load_space(disp.variant_for(prob(), H200, own_only=True).family).vendor


def test_random_shape_sets_are_reproducible_and_realistic():
    from autoflash.shapes import RANDOM_MAX_FLOPS, load_shape_set

    first, again, other = (load_shape_set(name) for name in ("random:40:3", "random:40:3", "random:40:4"))
    assert first == again and first != other and len(first) == 40
    assert all(s.flops() <= RANDOM_MAX_FLOPS and s.heads_q % s.heads_kv == 0 and s.seqlen_q <= s.seqlen_k
               for s in first)
    assert any(s.seqlen_q != s.seqlen_k for s in first) and any(s.heads_q != s.heads_kv for s in first)
    with pytest.raises(ValueError, match="random:N"):
        load_shape_set("random:x")


H100 = GPUFingerprint("NVIDIA H100 80GB HBM3", 9, 0, 132, 232448, "2.11.0", "3.6.0", "13.0", "0.1.0")


def test_a_gpu_with_no_rows_of_its_own_is_served_sdpa_cudnn_whatever_its_neighbours_measured(tmp_path):
    """An H100 where only an H200's winners are stored (the shipped DBs on a new GPU): own kernels that
    beat cuDNN on the H200 are no evidence here, so SDPA-cuDNN serves every problem it takes, forward
    and backward; `autoflash tune` on the H100 is what can change that."""
    forward, backward = prob(), prob(op="bwd")
    db = make_db(tmp_path / "h200.db", [(forward, 0.8, 1.0), (backward, 0.8, 1.0)])  # own 1.25x cuDNN there
    h200 = Dispatcher(winner_paths=[db])
    assert not load_space(h200.variant_for(forward, H200).family).vendor  # (the H200 serves its own)
    h100 = Dispatcher(winner_paths=[db])
    for problem in (forward, backward):
        variant, why = h100.choose(problem, H100)
        assert variant == cudnn_variant(problem, H100) and "no measurement near" in why
    assert not h100.winners(H100).rows


def test_evidence_of_one_value_head_dim_says_nothing_of_another(tmp_path):
    import dataclasses

    mla = dataclasses.replace(prob(head_dim=192), head_dim_v=128)
    other = dataclasses.replace(prob(head_dim=192), head_dim_v=64)
    assert not served(tmp_path, [(mla, 0.5, 1.0)], mla)[0]  # (its own evidence serves the own kernel)
    vendor, why = served(tmp_path, [(mla, 0.5, 1.0)], other)
    assert vendor and "no measurement" in why
