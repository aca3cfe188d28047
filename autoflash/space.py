"""Declarative search spaces: each family's `space.toml` -> knobs, constraints, `Variant`s.

Nothing here compiles or imports Triton. A space answers three questions before anything is
built: which variants exist, which of them are valid for a problem on a device (and if not,
which rule says no), and whether a variant read from elsewhere (a DB row, the CLI) uses only
declared knobs and values.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import json
import tomllib
from typing import Any, Iterable, Iterator, Mapping

from autoflash import resources
from autoflash.device import GPUFingerprint, triton_release
from autoflash.problem import WORK_MAX, Problem
from autoflash.score_variant import FEATURES as SCORE_FEATURES

ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

# The kernel families: family name -> its search-space file (data folder, file). An own family is a
# folder of autoflash/families/ (kernel.py.jinja, host.py, space.toml) and one line here and in
# `autoflash.families.HOSTS`. See README "Adding a kernel family".
FAMILIES = {
    "triton_fwd": ("families", "triton_fwd/space.toml"),
    "triton_bwd": ("families", "triton_bwd/space.toml"),
    "gluon_sm90_fwd": ("families", "gluon_sm90_fwd/space.toml"),  # Hopper only (its constraints say cc 9.0)
    "triton_decode": ("families", "triton_decode/space.toml"),
    # vendor kernels (torch SDPA backends) as candidates: autoflash/vendor.py
    "sdpa_fwd": ("search_spaces", "sdpa_fwd.toml"),
    "sdpa_bwd": ("search_spaces", "sdpa_bwd.toml"),
}
# Each op's first family: where its built-in defaults come from, and what a bare op name means
# (`load_space("fwd")`, stored variants written before families existed).
DEFAULT_FAMILY = {"fwd": "triton_fwd", "bwd": "triton_bwd", "decode": "triton_decode"}
OPS = tuple(DEFAULT_FAMILY)


def family_name(name: str) -> str:
    """A family name, or an op name standing for its default family."""
    name = DEFAULT_FAMILY.get(name, name)
    if name not in FAMILIES:
        raise ValueError(f"unknown kernel family or op {name!r}; families: {sorted(FAMILIES)}, ops: {list(OPS)}")
    return name


def families_for(op: str) -> list[str]:
    """The families that implement `op`, the default one first."""
    return [f for f in FAMILIES if load_space(f).op == op]


class InvalidVariant(ValueError):
    """A variant that is not in the declared space, or that a constraint rejects."""


# --------------------------------------------------------------------------- expressions
_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.IfExp, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.List, ast.Call,
)
_FUNCTIONS = {"min": min, "max": max}


_VALID: dict = {}  # `Space.valid_variants` by the space and the values of the names its rules read


def _names_read(code) -> frozenset:
    """The names an expression's code (and any comprehension in it) looks up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_read(const)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def compile_expression(source: str):
    """Compile a rule after checking it only uses the small, side-effect-free subset."""
    tree = ast.parse(source, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ValueError(f"search-space expression {source!r}: {type(node).__name__} not allowed")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name)
                                               and node.func.id in _FUNCTIONS and not node.keywords):
            raise ValueError(f"search-space expression {source!r}: only min()/max() calls allowed")
    return compile(tree, f"<rule {source}>", "eval")


def evaluate(source: str, names: Mapping[str, Any]):
    try:
        return eval(compile_expression(source), {"__builtins__": {}, **_FUNCTIONS}, dict(names))
    except NameError as e:
        raise ValueError(f"search-space expression {source!r}: {e}") from None


# --------------------------------------------------------------------------- variants
@dataclasses.dataclass(frozen=True)
class Variant:
    """One choice per knob of a family's space. Hashable, with a stable JSON form (the knobs only:
    the family of a stored variant is told by its template hash)."""

    family: str
    items: tuple  # ((knob, value), ...) sorted by knob

    @classmethod
    def of(cls, family: str, values: Mapping[str, Any]) -> "Variant":
        """family: a family name, or an op name for that op's default family."""
        return cls(family_name(family), tuple(sorted(values.items())))

    @property
    def op(self) -> str:
        return load_space(self.family).op

    def as_dict(self) -> dict:
        return dict(self.items)

    def json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    def __getitem__(self, knob: str):
        return self.as_dict()[knob]

    def replace(self, **changes) -> "Variant":
        return Variant(self.family, tuple(sorted({**self.as_dict(), **changes}.items())))

    def short(self) -> str:
        """Compact, for tables: tiles, warps, stages, then the other knobs (a word value as it is,
        a true flag by its name, a false one left out, a number with its knob's name), e.g.
        '128x64 w8 s3 m_major ascending tma split', '64x64/128x32 w4 s2 separate kv_major' (dK/dV
        tile / dQ tile; no dQ tile when the dK/dV kernel adds dQ itself) or, for a family without
        num_warps/num_stages, '64x128 NUM_STAGES=2 HEAVY_FIRST CONSUMER_REGS=240'."""
        d = self.as_dict()
        if "BLOCK_M" in d:
            tiles = f"{d['BLOCK_M']}x{d['BLOCK_N']}"
        elif "BLOCK_M1" in d:
            tiles = f"{d['BLOCK_M1']}x{d['BLOCK_N1']}"
            if d.get("DQ_MODE") == "separate":
                tiles += f"/{d['BLOCK_M2']}x{d['BLOCK_N2']}"
        else:
            return " ".join(f"{k}={v}" for k, v in d.items())
        shown = {"BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages"}
        parts = [tiles] + [f"{label}{d[knob]}" for knob, label in (("num_warps", "w"), ("num_stages", "s")) if knob in d]
        for k, v in d.items():
            if k not in shown and v is not False:
                parts.append(k if v is True else v if isinstance(v, str) else f"{k}={v}")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Constraint:
    name: str
    rule: str
    why: str


@dataclasses.dataclass(frozen=True)
class Space:
    family: str
    op: str
    template: str  # "" for a vendor family
    knobs: dict  # knob -> tuple of choices (declared order)
    derived: dict  # name -> expression
    constraints: tuple
    defaults: tuple = ()  # ((when rule, {knob: value}, measured), ...), applied in order
    vendor: str = ""  # a family of kernels autoflash does not generate (e.g. "torch_sdpa")
    # knob -> the value that renders what the template rendered before the knob existed (a winner
    # stored then is that kernel: `[legacy]` in the space file)
    legacy: Mapping = dataclasses.field(default_factory=dict)
    # A vendor family's earlier space files, by hash (`replaces`): their rows name the same kernels,
    # with the `[legacy]` value of every knob added since (nothing is rendered from a vendor space).
    replaces: tuple = ()

    # ---- sizes and enumeration
    @property
    def size(self) -> int:
        n = 1
        for choices in self.knobs.values():
            n *= len(choices)
        return n

    def all_variants(self) -> Iterator[Variant]:
        names = list(self.knobs)
        for combo in itertools.product(*(self.knobs[k] for k in names)):
            yield Variant(self.family, tuple(sorted(dict(zip(names, combo)).items())))  # dict(zip(names, combo)))

    def valid_variants(self, problem: Problem, device: GPUFingerprint) -> list[Variant]:
        """The variants `violations` finds nothing wrong with, by the same rules evaluated without
        its per-variant set-up (the problem's and device's names, a copy of them per rule): a tuning
        run opens every problem before its first compile, and a backward space's 20k variants took
        ~1 s a problem that way."""
        base, env = device_names(problem, device), {"__builtins__": {}, **_FUNCTIONS}
        derived = [(name, compile_expression(expr)) for name, expr in self.derived.items()]
        rules = [compile_expression(c.rule) for c in self.constraints]
        # Problems that agree on every name the rules read have the same valid variants (a run's
        # problems of one head dim and dtype at different lengths, mostly): computed once per process.
        read = frozenset().union(*(_names_read(code) for _, code in derived), *(_names_read(code) for code in rules))
        try:
            key = (self.family, self.constraints, tuple(self.derived.items()), tuple(self.knobs.items()),
                   tuple(sorted((name, base[name]) for name in read if name in base)))
            hash(key)
        except TypeError:  # (a name's value that cannot be a key: computed every time)
            key = None
        if key is not None and key in _VALID:
            return list(_VALID[key])
        out = self._evaluate_rules(base, env, derived, rules, problem, device)
        if key is not None:
            _VALID[key] = tuple(out)
        return out

    def _evaluate_rules(self, base: dict, env: dict, derived: list, rules: list, problem: Problem,
                        device: GPUFingerprint) -> list[Variant]:
        out = []
        try:
            for v in self.all_variants():
                ns = {**base, **dict(v.items)}
                for name, code in derived:
                    ns[name] = eval(code, env, ns)
                if all(eval(code, env, ns) for code in rules):
                    out.append(v)
        except NameError:  # (a rule naming what is not defined: `violations` says which)
            return [v for v in self.all_variants() if not self.violations(v, problem, device)]
        return out

    # ---- validation
    def check_declared(self, values: Mapping[str, Any]) -> Variant:
        """Reject unknown knobs, missing knobs and undeclared values (e.g. from a DB row)."""
        if not isinstance(values, Mapping):
            raise InvalidVariant(f"a {self.family} variant must be a JSON object, got {type(values).__name__}")
        unknown = sorted(set(values) - set(self.knobs))
        if unknown:
            raise InvalidVariant(f"unknown knob(s) for {self.family!r}: {unknown}; declared: {list(self.knobs)}")
        missing = sorted(set(self.knobs) - set(values))
        if missing:
            raise InvalidVariant(f"missing knob(s) for {self.family!r}: {missing}")
        for knob, value in values.items():
            # bool is an int subclass: compare types too, so True never passes for 1.
            if not any(type(value) is type(c) and value == c for c in self.knobs[knob]):
                raise InvalidVariant(f"{knob}={value!r} is not a declared choice {list(self.knobs[knob])}")
        return Variant(self.family, tuple(sorted(values.items())))

    def names(self, variant: Variant, problem: Problem, device: GPUFingerprint) -> dict:
        ns = device_names(problem, device)
        ns.update(variant.as_dict())
        for name, expr in self.derived.items():
            ns[name] = evaluate(expr, ns)
        return ns

    def violations(self, variant: Variant, problem: Problem, device: GPUFingerprint) -> list[Constraint]:
        ns = self.names(variant, problem, device)
        return [c for c in self.constraints if not evaluate(c.rule, ns)]

    def validate(self, values: Mapping[str, Any], problem: Problem, device: GPUFingerprint) -> Variant:
        """A declared and constraint-satisfying Variant, or InvalidVariant naming the rule."""
        variant = self.check_declared(values)
        bad = self.violations(variant, problem, device)
        if bad:
            c = bad[0]
            raise InvalidVariant(f"constraint {c.name!r} violated ({c.rule}): {c.why}")
        return variant

    def suggest(self, trial) -> Variant:
        """Map an Optuna trial's categorical suggestions to a Variant."""
        return Variant(self.family, tuple(sorted((k, trial.suggest_categorical(k, list(c)))
                                                for k, c in self.knobs.items())))

    # ---- defaults
    def default_for(self, problem: Problem, device: GPUFingerprint) -> Variant:
        """The built-in variant for an untuned problem, from the space file's [[defaults]] (each
        entry whose `when` holds overrides the knobs it names; `measured` says where the values come
        from). Not necessarily valid here: pass it through `nearest_valid`."""
        ns = device_names(problem, device)
        values: dict = {}
        for when, knobs, _measured in self.defaults:
            if evaluate(when, ns):
                values.update(knobs)
        return self.check_declared(values)

    def nearest_valid(self, preferred: Variant, problem: Problem, device: GPUFingerprint) -> Variant:
        """`preferred` if this space allows it here, else the valid variant differing in fewest knobs."""
        if not self.violations(preferred, problem, device):
            return preferred
        want = preferred.as_dict()
        valid = self.valid_variants(problem, device)
        if not valid:
            raise InvalidVariant(f"the {self.family} search space has no valid variant for {problem.key} on {device.name}")
        return min(valid, key=lambda v: (sum(v[k] != want.get(k) for k in v.as_dict()), v.json()))


def problem_names(problem: Problem) -> dict:
    head_dim_v = problem.head_dim if problem.head_dim_v is None else problem.head_dim_v
    block_d, block_dv = (1 << max(4, (d - 1).bit_length()) for d in (problem.head_dim, head_dim_v))
    return dict(head_dim=problem.head_dim, BLOCK_D=block_d, elem_bytes=ELEM_BYTES[problem.dtype],
                head_dim_v=head_dim_v, BLOCK_DV=block_dv,  # V's (= head_dim but for MLA-like problems)
                causal=problem.causal, gqa_group=problem.gqa_group,
                seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k,
                # occupancy bucket (problem.work_bucket); a key without one: plenty of work, as the
                # grid of 16k tokens the first winners were tuned on
                work=WORK_MAX if problem.work is None else problem.work,
                page_size=problem.page or 0,  # decode: a paged cache's block size; 0: contiguous
                # the attention variants computed (window, softcap, alibi, sinks: each True or False)
                **{feature: feature in (problem.score_variant or "").split("+") for feature in SCORE_FEATURES})


def device_names(problem: Problem, device: GPUFingerprint) -> dict:
    triton_major, triton_minor = triton_release(device.triton_version)
    return dict(problem_names(problem), cc_major=device.cc_major, cc_minor=device.cc_minor,
                smem_limit=device.smem_per_block, triton_major=triton_major, triton_minor=triton_minor,
                on_gpu=device.on_gpu)


@functools.lru_cache(maxsize=None)
def load_space(name: str) -> Space:
    """The search space of a family (or of an op's default family)."""
    family = family_name(name)
    text = resources.read_text(*FAMILIES[family])
    space = parse_space(text, family)
    declared = tomllib.loads(text).get("family", family)
    if declared != family:
        raise ValueError(f"{'/'.join(FAMILIES[family])} declares family {declared!r}, registered as {family!r}")
    return space


def parse_space(text: str, family: str | None = None) -> Space:
    data = tomllib.loads(text)
    family = family or data.get("family") or DEFAULT_FAMILY[data["op"]]
    knobs = {k: tuple(v) for k, v in data["knobs"].items()}
    for k, choices in knobs.items():
        if not choices:
            raise ValueError(f"knob {k!r} declares no choices")
    constraints = tuple(Constraint(c["name"], c["rule"], c.get("why", c["rule"]))
                        for c in data.get("constraints", []))
    derived = dict(data.get("derived", {}))
    defaults = tuple((d.get("when", "True"), dict(d["values"]), d.get("measured", ""))
                     for d in data.get("defaults", []))
    for expr in [*derived.values(), *(c.rule for c in constraints), *(d[0] for d in defaults)]:
        compile_expression(expr)  # fail at load time, not mid-tune
    for _when, values, _measured in defaults:
        for knob, value in values.items():
            if knob not in knobs or not any(type(value) is type(c) and value == c for c in knobs[knob]):
                raise ValueError(f"[[defaults]] of {family}: {knob}={value!r} is not a declared choice")
    legacy = dict(data.get("legacy", {}))
    for knob, value in legacy.items():
        if knob not in knobs or not any(type(value) is type(c) and value == c for c in knobs[knob]):
            raise ValueError(f"[legacy] of {family}: {knob}={value!r} is not a declared choice")
    if bool(data.get("template")) == bool(data.get("vendor")):
        raise ValueError(f"search space of {family}: name either a `template` or a `vendor`, not both or neither")
    replaces = tuple(data.get("replaces", ()))
    if replaces and not data.get("vendor"):
        raise ValueError(f"search space of {family}: `replaces` is for vendor families (a template's kernels change with it)")
    return Space(family=family, op=data["op"], template=data.get("template", ""), knobs=knobs, derived=derived,
                 constraints=constraints, defaults=defaults, vendor=data.get("vendor", ""), legacy=legacy,
                 replaces=replaces)


def default_variant(op: str, problem: Problem, device: GPUFingerprint) -> Variant:
    """The op's built-in variant for an untuned problem, made valid here (default family)."""
    space = load_space(op)
    return space.nearest_valid(space.default_for(problem, device), problem, device)


def parse_variant_json(op: str, text: str | Mapping) -> dict:
    """Parse a user- or DB-supplied variant; returns the dict (validate it with the space)."""
    if isinstance(text, Mapping):
        return dict(text)
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidVariant(f"variant is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise InvalidVariant(f"a {op} variant must be a JSON object")
    return values


def count_by_constraint(space: Space, problem: Problem, device: GPUFingerprint,
                        variants: Iterable[Variant] | None = None) -> dict:
    """How many variants each constraint rejects (first failing rule), for `autoflash space`."""
    counts = {c.name: 0 for c in space.constraints}
    for v in variants if variants is not None else space.all_variants():
        bad = space.violations(v, problem, device)
        if bad:
            counts[bad[0].name] += 1
    return counts
