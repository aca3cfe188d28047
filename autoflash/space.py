"""Declarative search spaces: `search_spaces/<op>.toml` -> knobs, constraints, `Variant`s.

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
from autoflash.problem import GPUFingerprint, Problem

ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
OPS = {"fwd": "attn_fwd.toml", "bwd": "attn_bwd.toml"}


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
    """One choice per knob of an op's space. Hashable, with a stable JSON form."""

    op: str
    items: tuple  # ((knob, value), ...) sorted by knob

    @classmethod
    def of(cls, op: str, values: Mapping[str, Any]) -> "Variant":
        return cls(op, tuple(sorted(values.items())))

    def as_dict(self) -> dict:
        return dict(self.items)

    def json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    def __getitem__(self, knob: str):
        return self.as_dict()[knob]

    def replace(self, **changes) -> "Variant":
        return Variant.of(self.op, {**self.as_dict(), **changes})

    def short(self) -> str:
        """Compact, for tables: tiles, warps, stages, then the other knobs' values (a true flag by
        its name, a false one left out), e.g. '128x64 w8 s3 m_major ascending tma split' or
        '64x64/128x32 w4 s2 separate kv_major' (dK/dV tile / dQ tile; no dQ tile when atomic)."""
        d = self.as_dict()
        if "BLOCK_M" in d:
            tiles = f"{d['BLOCK_M']}x{d['BLOCK_N']}"
        elif "BLOCK_M1" in d:
            tiles = f"{d['BLOCK_M1']}x{d['BLOCK_N1']}"
            if d.get("DQ_MODE") != "atomic":
                tiles += f"/{d['BLOCK_M2']}x{d['BLOCK_N2']}"
        else:
            return " ".join(f"{k}={v}" for k, v in d.items())
        shown = {"BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages"}
        rest = [k if v is True else str(v) for k, v in d.items() if k not in shown and v is not False]
        return " ".join([tiles, f"w{d.get('num_warps')}", f"s{d.get('num_stages')}", *rest])


@dataclasses.dataclass(frozen=True)
class Constraint:
    name: str
    rule: str
    why: str


@dataclasses.dataclass(frozen=True)
class Space:
    op: str
    template: str
    knobs: dict  # knob -> tuple of choices (declared order)
    derived: dict  # name -> expression
    constraints: tuple

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
            yield Variant.of(self.op, dict(zip(names, combo)))

    def valid_variants(self, problem: Problem, device: GPUFingerprint) -> list[Variant]:
        return [v for v in self.all_variants() if not self.violations(v, problem, device)]

    # ---- validation
    def check_declared(self, values: Mapping[str, Any]) -> Variant:
        """Reject unknown knobs, missing knobs and undeclared values (e.g. from a DB row)."""
        if not isinstance(values, Mapping):
            raise InvalidVariant(f"a {self.op} variant must be a JSON object, got {type(values).__name__}")
        unknown = sorted(set(values) - set(self.knobs))
        if unknown:
            raise InvalidVariant(f"unknown knob(s) for op {self.op!r}: {unknown}; declared: {list(self.knobs)}")
        missing = sorted(set(self.knobs) - set(values))
        if missing:
            raise InvalidVariant(f"missing knob(s) for op {self.op!r}: {missing}")
        for knob, value in values.items():
            # bool is an int subclass: compare types too, so True never passes for 1.
            if not any(type(value) is type(c) and value == c for c in self.knobs[knob]):
                raise InvalidVariant(f"{knob}={value!r} is not a declared choice {list(self.knobs[knob])}")
        return Variant.of(self.op, values)

    def names(self, variant: Variant, problem: Problem, device: GPUFingerprint) -> dict:
        ns = dict(problem_names(problem))
        ns.update(cc_major=device.cc_major, cc_minor=device.cc_minor, smem_limit=device.smem_per_block)
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
        return Variant.of(self.op, {k: trial.suggest_categorical(k, list(c)) for k, c in self.knobs.items()})


def problem_names(problem: Problem) -> dict:
    block_d = 16
    while block_d < problem.head_dim:
        block_d *= 2
    return dict(head_dim=problem.head_dim, BLOCK_D=block_d, elem_bytes=ELEM_BYTES[problem.dtype],
                causal=problem.causal, gqa_group=problem.gqa_group,
                seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k)


@functools.lru_cache(maxsize=None)
def load_space(op: str) -> Space:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known ops: {sorted(OPS)}")
    return parse_space(resources.read_text("search_spaces", OPS[op]))


def parse_space(text: str) -> Space:
    data = tomllib.loads(text)
    knobs = {k: tuple(v) for k, v in data["knobs"].items()}
    for k, choices in knobs.items():
        if not choices:
            raise ValueError(f"knob {k!r} declares no choices")
    constraints = tuple(Constraint(c["name"], c["rule"], c.get("why", c["rule"]))
                        for c in data.get("constraints", []))
    derived = dict(data.get("derived", {}))
    for expr in [*derived.values(), *(c.rule for c in constraints)]:
        compile_expression(expr)  # fail at load time, not mid-tune
    return Space(op=data["op"], template=data["template"], knobs=knobs, derived=derived,
                 constraints=constraints)


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
