"""Rendering: a variant -> its device source (the family's Jinja template and shared parts), the
hash that keys stored winners (template, includes, host module), and the kernel cache file's
readable name. `codegen` loads what is rendered here."""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import re

import jinja2

from autoflash import families, resources
from autoflash.kernel_cache import kernel_cache_dir
from autoflash.score_variant import PLAIN, ScoreVariant
from autoflash.space import Variant, load_space


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        # "<family>/kernel.py.jinja", a family's other parts and the shared includes "_shared/<part>.jinja"
        loader=jinja2.FileSystemLoader(str(resources.data_dir("families"))),
        undefined=jinja2.StrictUndefined,  # a knob the template reads but the variant lacks: error
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals["user_mod_lines"] = _user_mod_lines  # (a global: the shared macros see it without context)
    return env


def _user_mod_lines(key: str, score: str, out: str, keys: str = "offs_kn", derivative: bool = False) -> list[str]:
    """A user's score or mask function's statements (`score_mods.kernel_lines`), for the templates."""
    from autoflash import score_mods

    return score_mods.kernel_lines(key, score, out, keys, derivative)


@functools.lru_cache(maxsize=None)
def template_source(family: str) -> str:
    """What a family's hash covers: its template, the shared includes and its host module."""
    from autoflash.space import FAMILIES, family_name

    family = family_name(family)
    space = load_space(family)
    if space.vendor:  # nothing rendered: the space file is what a stored result depends on
        return resources.read_text(*FAMILIES[family])
    return families.hashed_source(family)


def _template_name(family: str) -> str:
    return f"{family}/{load_space(family).template}"


@functools.lru_cache(maxsize=None)
def template_hash(family: str) -> str:
    """Part of every stored result's key: a changed template (or include) never serves stale winners.
    family: a family name, or an op name for its default family."""
    return _source_hash(template_source(family))


def family_for_hash(op: str, thash: str, earlier: bool = False) -> str | None:
    """Which current family of `op` a stored template hash belongs to (None: an older template).
    earlier: also a vendor family's earlier space file it `replaces` (rows that need the `[legacy]`
    values of the knobs added since)."""
    from autoflash.space import families_for

    return next((f for f in families_for(op) if template_hash(f) == thash
                 or (earlier and thash in replaced_hashes(f))), None)


def replaced_hashes(family: str) -> tuple[str, ...]:
    """Earlier hashes whose stored winners `family` serves today: a vendor family's earlier space
    files (`replaces` in its space), an own family's templates its `replaces.toml` records show to
    render the same kernels."""
    space = load_space(family)
    if space.vendor:
        return space.replaces
    return families.replaced_hashes(space.family, template_hash(family))


def _source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


class TemplateError(ValueError):
    """A template file (`bench --baseline-template`) that does not render to a kernel module: the
    message names the file and the line."""


def check_template(template_file: str | os.PathLike) -> jinja2.Template:
    """The parsed template of a user's file; TemplateError names the file and line of a Jinja error."""
    try:
        return _environment().from_string(pathlib.Path(template_file).read_text(encoding="utf-8"))
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{template_file}, line {e.lineno}: not a valid template: {e.message}") from None
    except UnicodeDecodeError as e:
        raise TemplateError(f"{template_file}: not a text file ({e.reason} at byte {e.start})") from None


def render(variant: Variant, template_file: str | os.PathLike | None = None, score: ScoreVariant = PLAIN,
           value_dim: bool = False, dropout: bool = False, paged: bool = False) -> str:
    """The Triton source of one variant. Only declared knob values ever reach the template.
    template_file: render from this template instead of the package's (knobs it does not read are
    ignored; a knob it reads that the variant lacks is an error). score: the attention variants the
    kernel computes (`score_variant`; SCORE in the templates); the plain kernel renders as it did
    before they existed. value_dim: V (and O, dO) have a head dim of their own (MLA); VALUE_DIM in the
    templates, whose plain render is the kernel as it was before it existed. dropout: attention dropout
    drawn in the kernels (`autoflash.dropout`); DROPOUT in the templates, likewise. paged: K and V read
    from a paged cache through a block table (packed queries: `autoflash.varlen`); PAGED, likewise."""
    checked = load_space(variant.family).check_declared(variant.as_dict())
    # (FAMILY and KNOBS_JSON: the header of the rendered module says which variant it is)
    context = dict(**checked.as_dict(), FAMILY=checked.family, KNOBS_JSON=checked.json(), SCORE=score,
                   VALUE_DIM=value_dim, DROPOUT=dropout, PAGED=paged)
    if template_file is None:
        return _environment().get_template(_template_name(variant.family)).render(**context)
    try:
        return check_template(template_file).render(**context)
    except jinja2.TemplateError as e:  # (StrictUndefined: a knob the variant lacks, a bad filter, ...)
        line = next((f", line {tb.tb_lineno}" for tb in _frames(e.__traceback__)
                     if tb.tb_frame.f_code.co_filename == "<template>"), "")
        raise TemplateError(f"{template_file}{line}: cannot render {variant.short()}: {e}") from None


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def variant_hash(variant: Variant, template_file: str | os.PathLike | None = None, score: ScoreVariant = PLAIN,
                 value_dim: bool = False, dropout: bool = False, paged: bool = False) -> str:
    thash = template_hash(variant.family) if template_file is None else _source_hash(
        pathlib.Path(template_file).read_text(encoding="utf-8"))
    scored = f":{score.key}" if score.key else ""  # (a plain kernel's hash as before the variants)
    scored += ":dv" if value_dim else ""  # (and as before value head dims of their own)
    scored += ":drop" if dropout else ""  # (and dropout)
    scored += ":paged" if paged else ""  # (and paged caches)
    return hashlib.sha256(f"{thash}:{variant.json()}{scored}".encode()).hexdigest()[:20]


def source_path(variant: Variant, template_file: str | os.PathLike | None = None,
                score: ScoreVariant = PLAIN, value_dim: bool = False, dropout: bool = False,
                paged: bool = False) -> pathlib.Path:
    """<family>-<op>-<knob values>[-<score variant>]-<hash>.py: what a traceback or a profile shows says
    which kernel."""
    scored = f"-{score.key.replace('+', '_')}" if score.key else ""
    scored += "-dv" if value_dim else ""
    scored += "-drop" if dropout else ""
    scored += "-paged" if paged else ""
    return kernel_cache_dir() / f"{variant.family}-{variant.op}-{readable_knobs(variant)}{scored}-" \
                                f"{variant_hash(variant, template_file, score, value_dim, dropout, paged)[:12]}.py"


# Short names of the common knobs in kernel file names (the others: their value, a true flag its name).
_KNOB_TAGS = {"BLOCK_M": "bm", "BLOCK_N": "bn", "BLOCK_M1": "bm1_", "BLOCK_N1": "bn1_", "BLOCK_M2": "bm2_",
              "BLOCK_N2": "bn2_", "num_warps": "w", "num_stages": "s", "NUM_STAGES": "s"}


def readable_knobs(variant: Variant) -> str:
    """e.g. 'bm128-bn64-w8-s3-m_major-ascending-tma-split' (declared values only: safe in a file name)."""
    parts = []
    for knob, value in variant.items:
        if knob in _KNOB_TAGS:
            parts.append(f"{_KNOB_TAGS[knob]}{value}")
        elif value is True:
            parts.append(knob.lower())
        elif value is not False:
            parts.append(str(value).lower())
    return "-".join(p.replace("/", "_").replace(" ", "_") for p in parts)[:150]


def name_kernels(module, variant: Variant) -> None:
    """Give the module's @triton.jit / @gluon.jit kernels readable compiled names: what a profiler
    (nsys, ncu, torch.profiler) lists is `attn_fwd__triton_fwd_d128_causal_bm128_bn64_w8_s3_...` instead
    of every variant's `_attn_fwd`. Through Triton's `repr` hook (the `repr=` argument of `triton.jit`),
    set here so that the templates (and their hashes) stay as they are; the name is not part of
    Triton's cache key, so a kernel compiled before keeps the name it was compiled with."""
    knobs = readable_knobs(variant)
    for attr, fn in list(vars(module).items()):
        if getattr(fn, "_repr", False) is None and callable(getattr(fn, "repr", None)):
            fn._repr = functools.partial(_compiled_name, attr.strip("_"), variant.family, knobs)


def _compiled_name(function: str, family: str, knobs: str, specialization) -> str:
    """`<function>__<family>_d<head dim>[_causal]_<knobs>`, a legal identifier (Triton checks it)."""
    try:
        constants = dict(getattr(specialization, "constants", None) or {})
    except (TypeError, ValueError):
        constants = {}
    head_dim = next((constants[k] for k in ("HEAD_DIM", "BLOCK_D") if k in constants), None)
    shape = (f"_d{head_dim}" if isinstance(head_dim, int) else "") + ("_causal" if constants.get("IS_CAUSAL") is True else "")
    return re.sub(r"\W", "_", f"{function}__{family}{shape}_{knobs}")[:200]
