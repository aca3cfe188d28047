"""Search space: declared knobs, constraint pruning, variant validation, rendering."""

import dataclasses

import pytest

from autoflash import codegen
from autoflash.device import GPUFingerprint
from autoflash.problem import Problem
from autoflash.space import InvalidVariant, compile_expression, load_space, parse_space

HOPPER = GPUFingerprint("H200-like", 9, 0, 132, 232448, "t", "t", "c", "a")
AMPERE = dataclasses.replace(HOPPER, name="A100-like", cc_major=8, smem_per_block=166912)
NEWER = dataclasses.replace(HOPPER, name="sm100-like", cc_major=10)


def problem(head_dim=128, causal=False, dtype="bfloat16"):
    return Problem("fwd", dtype, head_dim, causal, 1, 4096, 4096)


def test_space_declares_every_template_knob():
    sp = load_space("fwd")
    assert set(sp.knobs) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "LOADS", "MASK_MODE",
                             "KV_ORDER", "GRID_ORDER", "WARP_SPECIALIZE", "HEAD_SPLIT"}
    assert sp.size == len(list(sp.all_variants()))


def test_constraints_prune_before_compiling():
    sp = load_space("fwd")
    valid = sp.valid_variants(problem(), HOPPER)
    assert 0 < len(valid) < sp.size
    # Measured on an H200: D=128, 128x128 tiles, warp specialization, 3 stages need 262 KB > 232 KB.
    too_big = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, LOADS="tma", MASK_MODE="split",
                   KV_ORDER="ascending", GRID_ORDER="m_major", WARP_SPECIALIZE=True, HEAD_SPLIT=False)
    with pytest.raises(InvalidVariant, match="smem"):
        sp.validate(too_big, problem(), NEWER)
    sp.validate(dict(too_big, num_stages=2, BLOCK_N=64), problem(), NEWER)
    # Triton 3.6 aborts compiling the warp-specialized loop for sm90: pruned there, not failed.
    with pytest.raises(InvalidVariant, match="warp_specialize_sm90"):
        sp.validate(dict(too_big, num_stages=2, BLOCK_N=64), problem(), HOPPER)


def test_tma_needs_hopper_and_diagonal_order_needs_causal():
    sp = load_space("fwd")
    v = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, LOADS="tma", MASK_MODE="split",
             KV_ORDER="ascending", GRID_ORDER="m_major", WARP_SPECIALIZE=False, HEAD_SPLIT=False)
    sp.validate(v, problem(), HOPPER)
    with pytest.raises(InvalidVariant, match="tma_needs_hopper"):
        sp.validate(v, problem(), AMPERE)
    assert all(x["LOADS"] != "tma" for x in sp.valid_variants(problem(), AMPERE))
    with pytest.raises(InvalidVariant, match="kv_order"):
        sp.validate(dict(v, KV_ORDER="diagonal_first"), problem(causal=False), HOPPER)
    sp.validate(dict(v, KV_ORDER="diagonal_first"), problem(causal=True), HOPPER)


def test_large_head_dim_limits_tiles():
    sp = load_space("fwd")
    valid = sp.valid_variants(problem(head_dim=256), HOPPER)
    assert valid and all(v["BLOCK_N"] <= 64 and (v["BLOCK_M"] <= 64 or v["num_warps"] == 8) for v in valid)
    assert any(v["BLOCK_M"] == 128 for v in valid)  # 8 warps hold a 128 x 256 accumulator
    bwd = load_space("bwd").valid_variants(Problem("bwd", "bfloat16", 256, True, 2, 4096, 4096), HOPPER)
    assert all(v["BLOCK_M1"] <= 32 or v["num_warps"] == 8 for v in bwd)
    assert any(v["BLOCK_M1"] == 64 for v in bwd)


@pytest.mark.parametrize("values, match", [
    ({"BLOCK_M": 65}, "not a declared choice"),
    ({"NOT_A_KNOB": 1}, "unknown knob"),
    ({"LOADS": "tma\nimport os; os.system('x')"}, "not a declared choice"),
    ({"WARP_SPECIALIZE": 1}, "not a declared choice"),  # 1 is not the declared bool
])
def test_undeclared_values_are_rejected(values, match):
    sp = load_space("fwd")
    base = next(iter(sp.all_variants())).as_dict()
    with pytest.raises(InvalidVariant, match=match):
        sp.check_declared({**base, **values})


def test_missing_knob_is_rejected():
    sp = load_space("fwd")
    base = next(iter(sp.all_variants())).as_dict()
    base.pop("BLOCK_N")
    with pytest.raises(InvalidVariant, match="missing"):
        sp.check_declared(base)


@pytest.mark.parametrize("expr", ["__import__('os')", "x.y", "(lambda: 1)()", "open('f')", "[a for a in b]"])
def test_rule_expressions_are_a_safe_subset(expr):
    with pytest.raises(ValueError, match="allowed"):
        compile_expression(expr)


def test_bad_rule_fails_at_load():
    text = 'op = "fwd"\ntemplate = "t"\n[knobs]\nA = [1]\n[[constraints]]\nname = "x"\nrule = "getattr(A, 1)"\n'
    with pytest.raises(ValueError):
        parse_space(text)


def test_every_constrained_variant_renders_to_python():
    """Every variant valid for some problem on a Hopper or Ampere GPU renders to valid Python."""
    sp = load_space("fwd")
    seen = set()
    for device in (HOPPER, AMPERE, NEWER):
        for hd in (64, 80, 128, 256):
            for causal in (False, True):
                for dtype in ("bfloat16", "float32"):
                    seen.update(sp.valid_variants(problem(hd, causal, dtype), device))
    assert len(seen) > 300
    for v in seen:
        src = codegen.render(v)
        compile(src, f"<{v.json()}>", "exec")
        assert v.json() in src  # (the header names the variant it renders)


def test_render_refuses_undeclared_values():
    sp = load_space("fwd")
    v = next(iter(sp.all_variants())).replace(LOADS="evil")
    with pytest.raises(InvalidVariant):
        codegen.render(v)


def test_every_named_shape_set_loads_for_both_ops():
    from autoflash.shapes import load_shape_set, shape_set_names

    assert {"standard", "train", "gqa", "llama", "tiny"} <= set(shape_set_names())
    for name in shape_set_names():
        for op in ("fwd", "bwd"):
            shapes = load_shape_set(name, op)
            assert shapes and all(s.op == op and s.heads_q % s.heads_kv == 0 for s in shapes)
    (llama,) = load_shape_set("llama", "bwd")
    assert llama.problem_on(132).key == "bwd/bfloat16/d128/causal/g4/q2048/k2048/w3"  # 1024 tiles on 132 SMs


def test_heavy_first_is_offered_for_causal_problems_only():
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem

    dev = gpu_fingerprint()
    for op in ("fwd", "bwd"):
        space = load_space(op)
        orders = {c: {v["GRID_ORDER"] for v in space.valid_variants(Problem(op, "float16", 64, c, 1, 1024, 1024), dev)}
                  for c in (False, True)}
        assert "heavy_first" in orders[True] and "heavy_first" not in orders[False]


def test_short_names_tell_every_valid_variant_apart():
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Problem

    for op in ("fwd", "bwd"):
        valid = load_space(op).valid_variants(Problem(op, "float16", 64, True, 1, 1024, 1024), gpu_fingerprint())
        names = {v.short() for v in valid}
        assert len(names) == len(valid)


def test_head_split_only_for_head_dims_that_are_no_power_of_two():
    sp = load_space("fwd")
    for d, offered in ((64, False), (128, False), (96, True), (80, True), (16, False)):
        valid = sp.valid_variants(problem(head_dim=d), HOPPER)
        assert any(v["HEAD_SPLIT"] for v in valid) == offered, d
        assert not any(v["HEAD_SPLIT"] and v["LOADS"] == "block_ptr" for v in valid)


def test_valid_variants_are_those_violations_finds_nothing_wrong_with():
    """valid_variants evaluates the rules without violations' per-variant set-up: the same variants
    for every family, on the CPU's fingerprint and an H100's."""
    import dataclasses

    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Shape
    from autoflash.space import families_for, load_space

    cpu = gpu_fingerprint()
    h100 = dataclasses.replace(cpu, name="NVIDIA H100 80GB HBM3", cc_major=9, cc_minor=0, sm_count=132)
    for op, shape in (("fwd", Shape(2, 32, 8, 4096, 4096, 128, True, "bfloat16")),
                      ("bwd", Shape(8, 14, 2, 1024, 1024, 64, True, "bfloat16", op="bwd"))):
        for family in families_for(op):
            space = load_space(family)
            for device in (cpu, h100):
                slow = [v for v in space.all_variants() if not space.violations(v, shape.problem, device)]
                assert space.valid_variants(shape.problem, device) == slow


def test_valid_variants_kept_per_values_the_rules_read():
    """Problems that differ only in what no rule reads (lengths here) share one evaluation; any name a
    rule reads (head dim, causality, GQA group) keys its own, equal to a fresh evaluation of the rules."""
    space = load_space("triton_bwd")
    base = Problem(op="bwd", dtype="bfloat16", head_dim=64, causal=True, gqa_group=4, seqlen_q=1024, seqlen_k=1024)
    first = space.valid_variants(base, HOPPER)
    assert first == space.valid_variants(dataclasses.replace(base, seqlen_q=4096, seqlen_k=8192), HOPPER)
    first.clear()  # (a caller's list is its own)
    assert space.valid_variants(base, HOPPER)
    for change in ({"head_dim": 256}, {"causal": False}, {"gqa_group": 1}):
        other = dataclasses.replace(base, **change)
        kept = space.valid_variants(other, HOPPER)
        fresh = [v for v in space.all_variants() if not space.violations(v, other, HOPPER)]
        assert kept == fresh
    assert space.valid_variants(dataclasses.replace(base, head_dim=256), HOPPER) != space.valid_variants(base, HOPPER)


def test_valid_variants_kept_per_names_only_a_derived_expression_reads():
    """The decode space reads the query tokens and GQA group only through a derived size (`block_m`,
    then its shared-memory bytes): problems that differ there get their own evaluation."""
    space = load_space("triton_decode")
    small = Problem(op="decode", dtype="bfloat16", head_dim=256, causal=False, gqa_group=1, seqlen_q=1, seqlen_k=4096)
    tight = dataclasses.replace(HOPPER, smem_per_block=64 * 1024)
    for change in ({"seqlen_q": 64}, {"gqa_group": 64}):
        other = dataclasses.replace(small, **change)
        kept = space.valid_variants(other, tight)
        assert kept == [v for v in space.all_variants() if not space.violations(v, other, tight)]
    assert space.valid_variants(small, tight) != space.valid_variants(dataclasses.replace(small, seqlen_q=64), tight)
