"""Which candidates a problem with attention variants (window, softcap, ALiBi, sinks) has: only kernels
that compute them. Vendor kernels (SDPA's backends) compute none, the Gluon forward all but a user's
score_mod / mask_mod (the decode family too, but a decode problem has no variant key: its plain winner's
knobs serve the variants); the backward family computes them with its Triton dK/dV
kernel only (its host launches that one in place of the Gluon dK/dV kernel for a variant: the same
candidate twice)."""

from __future__ import annotations

from autoflash import families
from autoflash.device import GPUFingerprint
from autoflash.problem import Problem
from autoflash.score_variant import ScoreVariant
from autoflash.space import Variant, default_variant, load_space


def computes_score_variants(variant: Variant, score: ScoreVariant) -> bool:
    """Whether a variant's kernel computes the attention variants `score` (window, softcap, ALiBi, sinks, a
    user's score_mod / mask_mod): its family renders them (not a vendor's; the Gluon forward and the decode
    family render all but a user's functions) and, in the backward, its dK/dV kernel is the Triton one (the
    Gluon dK/dV kernel computes none: its host would launch the Triton one instead, the same candidate
    as DKDV_KERNEL = "triton")."""
    if load_space(variant.family).vendor or not families.host_class(variant.family).computes(score):
        return False
    return variant.as_dict().get("DKDV_KERNEL", "triton") == "triton"


def serves_problem(variants: list[Variant], problem: Problem) -> list[Variant]:
    """The variants whose kernels compute `problem`'s attention variants (all of them for plain
    attention): for a window, softcap, ALiBi or sinks no vendor kernel or Gluon dK/dV, for a user's
    score_mod / mask_mod no Gluon forward either (`computes_score_variants`)."""
    if not problem.score_variant:
        return list(variants)
    score = ScoreVariant.from_key(problem.score_variant)
    return [v for v in variants if computes_score_variants(v, score)]


def variant_default(problem: Problem, device: GPUFingerprint) -> Variant:
    """The default variant the dispatcher serves the problem untuned; for a problem with attention
    variants `families.score_variant_default` (one whose kernel computes them), with the Triton dK/dV
    kernel where the backward default's would be Gluon's."""
    default = (families.score_variant_default(problem, device) if problem.score_variant
               else default_variant(problem.op, problem, device))
    if serves_problem([default], problem) or "DKDV_KERNEL" not in default.as_dict():
        return default
    return load_space(default.family).nearest_valid(default.replace(DKDV_KERNEL="triton"), problem, device)
