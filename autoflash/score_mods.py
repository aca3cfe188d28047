"""User-written score and mask functions, FlexAttention's signatures, traced into Triton code.

    score_mod(score, b, h, q_idx, kv_idx) -> the new score
    mask_mod(b, h, q_idx, kv_idx)         -> True where query q_idx may see key kv_idx

The function is called once with stand-in values that record each operation made on them
(arithmetic, comparisons, `&`/`|`/`~`, and the torch functions in `TORCH_OPS`, through torch's
`__torch_function__` protocol), which gives an expression graph; `Traced.lines` writes it as Triton
statements over the names a kernel supplies (the score tile, the batch entry, the head, and the
query and key positions as broadcastable index vectors). A score function's derivative with respect
to the score is traced from the same graph (`Traced.derivative`), for the backward's dS.

What cannot become device code is refused when the function is traced, by a `ScoreModError` that
names the function's line: Python branches on a traced value (`if score > 0:`; use `torch.where`),
`float()`/`int()`/`math.*` of one, torch functions outside `TORCH_OPS`, indexing a tensor.
Numbers the function closes over become constants of the generated code (a new value is a new kernel).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import traceback

import torch

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")


class ScoreModError(ValueError):
    """A construct of a score or mask function that the kernels cannot run, with its line."""


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One operation of the graph: `op` names it ('input', 'const', '+', 'where', 'tanh', ...)."""

    op: str
    args: tuple = ()
    boolean: bool = False  # a comparison or a logical combination of them

    # arithmetic and logic record a node; Python's reflected forms swap the operands
    def _bin(self, op, other, reflected=False, boolean=False):
        a, b = (wrap(other), self) if reflected else (self, wrap(other))
        if op in ("&", "|") and not (a.boolean and b.boolean):
            _refuse(f"`{op}` combines masks (comparisons); on numbers use arithmetic")
        return Node(op, (a, b), boolean or op in ("&", "|"))

    __hash__ = object.__hash__

    def __pow__(self, other):
        if not isinstance(other, (int, float)) or isinstance(other, bool):
            _refuse("`**` takes a number as its exponent")
        return Node("**", (self, wrap(other)))

    def __rpow__(self, base):  # base ** x = exp2(x * log2(base)), for a positive number base
        if not isinstance(base, (int, float)) or isinstance(base, bool) or base <= 0:
            _refuse("a number ** a traced value takes a positive number as its base")
        return Node("exp2", (self * math.log2(base),))

    def __neg__(self):
        return Node("neg", (self,))

    def __abs__(self):
        return Node("abs", (self,))

    def __invert__(self):
        if not self.boolean:
            _refuse("`~` negates a mask (a comparison)")
        return Node("not", (self,), True)

    def __bool__(self):
        _refuse("a Python branch or `and`/`or`/`not` on a traced value; use torch.where or `&`, `|`, `~`")

    def __float__(self):
        _refuse("float() of a traced value (math.* functions take floats: use the torch function)")

    __int__ = __index__ = __float__

    def __getitem__(self, _):
        _refuse("indexing a traced value")

    # tensor methods a score function may call (score.tanh(), ...)
    def __getattr__(self, name):
        if name in UNARY:
            return lambda: Node(name, (self,))
        raise AttributeError(name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = TORCH_OPS.get(func)
        if func is torch.Tensor.__getitem__:
            _refuse("indexing a tensor with a traced value (a table read in the kernel is not supported)")
        if name is None:
            _refuse(f"torch.{getattr(func, '__name__', func)} is not one the kernels run "
                    f"(they run: {', '.join(sorted(set(TORCH_OPS.values())))})")
        if name == "where":
            cond, a, b = (wrap(x) for x in args)
            if not cond.boolean:
                _refuse("torch.where's condition must be a comparison or a mask")
            return Node("where", (cond, a, b), a.boolean and b.boolean)
        if name == "clamp":
            x, lo, hi = wrap(args[0]), kwargs.get("min", args[1] if len(args) > 1 else None), \
                kwargs.get("max", args[2] if len(args) > 2 else None)
            if lo is not None:
                x = Node("maximum", (x, wrap(lo)))
            return Node("minimum", (x, wrap(hi))) if hi is not None else x
        if name in ("minimum", "maximum"):
            return Node(name, (wrap(args[0]), wrap(args[1])))
        if name in ("logical_and", "logical_or"):
            return wrap(args[0])._bin("&" if name == "logical_and" else "|", args[1])
        if name == "logical_not":
            return ~wrap(args[0])
        return Node(name, (wrap(args[0]),))


# Python's operators on a traced value record nodes: each arithmetic/logic one and its reflected form
# (operands swapped), and the comparisons (boolean nodes).
_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "and": "&", "or": "|"}
for _name, _op in _OPERATORS.items():
    setattr(Node, f"__{_name}__", lambda s, o, _op=_op: s._bin(_op, o))
    setattr(Node, f"__r{_name}__", lambda s, o, _op=_op: s._bin(_op, o, True))
for _name, _op in {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}.items():
    setattr(Node, f"__{_name}__", lambda s, o, _op=_op: s._bin(_op, o, boolean=True))

UNARY = ("tanh", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "abs", "sin", "cos", "neg")
TORCH_OPS = {getattr(torch, n): n for n in UNARY if hasattr(torch, n)} | {
    torch.where: "where", torch.clamp: "clamp", torch.minimum: "minimum", torch.maximum: "maximum",
    torch.logical_and: "logical_and", torch.logical_or: "logical_or", torch.logical_not: "logical_not",
    torch.Tensor.tanh: "tanh", torch.Tensor.exp: "exp", torch.Tensor.abs: "abs", torch.Tensor.sigmoid: "sigmoid"}


def wrap(x) -> Node:
    if isinstance(x, Node):
        return x
    if isinstance(x, bool):
        return Node("const", (x,), True)
    if isinstance(x, (int, float)):
        return Node("const", (x,))
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.requires_grad:
        return wrap(x.item())  # a 0-d constant the function closes over
    _refuse(f"a value of type {type(x).__name__} (numbers, and the function's arguments, only)")


_TRACING: list = []  # the function being traced (its code object names the user's frames)


def _refuse(what: str):
    code = _TRACING[-1] if _TRACING else None
    for frame in reversed(traceback.extract_stack()):
        if code is not None and frame.filename == code.co_filename and frame.lineno >= code.co_firstlineno:
            raise ScoreModError(f"{code.co_name}, line {frame.lineno} ({frame.line}): {what}")
    raise ScoreModError(what)


@dataclasses.dataclass(frozen=True)
class Traced:
    """A traced function: its result node and whether it is a mask."""

    name: str
    result: Node
    mask: bool

    def lines(self, names: dict[str, str], out: str) -> list[str]:
        """Triton statements that compute the function into `out`, reading the inputs by `names`
        (e.g. {'score': 'qk', 'q_idx': 'rows[:, None]', ...})."""
        return _emit(self.result, names, out)

    def derivative(self) -> "Traced":
        """d score_mod / d score, as a traced function of the same inputs."""
        if self.mask:
            raise ValueError("a mask has no derivative")
        return Traced(self.name + "_dscore", _d(self.result, {}), False)

    @property
    def key(self) -> str:
        """A short hash of the generated code: the kernel's and the problem key's name for it."""
        text = "\n".join(self.lines({a: a for a in SCORE_ARGS}, "out"))
        return ("mask" if self.mask else "score") + "-" + hashlib.sha256(text.encode()).hexdigest()[:10]


def trace_score_mod(fn) -> Traced:
    return _register(_trace(fn, SCORE_ARGS, mask=False))


def trace_mask_mod(fn) -> Traced:
    return _register(_trace(fn, MASK_ARGS, mask=True))


# Traced functions by key: a kernel rendered for a key (`ScoreVariant.score_mod`/`mask_mod`) finds its
# code here. Process-local, as the functions are: a key of another process's function is not known here.
_REGISTRY: dict[str, Traced] = {}


def _register(traced: Traced) -> Traced:
    return _REGISTRY.setdefault(traced.key, traced)


def traced_for(key: str) -> Traced:
    """The traced function a kernel's key names (traced in this process), else a clear error."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ScoreModError(f"no function traced in this process has the key {key!r} (trace it with "
                            "trace_score_mod / trace_mask_mod before a kernel is rendered for it)") from None


# The kernels' names for a user function's inputs, in the Triton forward's KV loop: the batch entry,
# the query head, the query rows and key columns of the tile as broadcastable index vectors.
KERNEL_NAMES = {"b": "off_z", "h": "off_h", "q_idx": "offs_m[:, None]", "kv_idx": "offs_kn[None, :]"}


def kernel_lines(key: str, score: str, out: str, keys: str = "offs_kn", derivative: bool = False) -> list[str]:
    """The statements a kernel runs for the function `key`, its score tile named `score` and its key
    columns `keys`; derivative: those of d score_mod / d score instead (the backward's chain rule)."""
    traced = traced_for(key)
    return (traced.derivative() if derivative else traced).lines(
        {**KERNEL_NAMES, "kv_idx": f"{keys}[None, :]", "score": score}, out)


def _trace(fn, arg_names, mask: bool) -> Traced:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and len(params) != len(arg_names):
        raise ScoreModError(f"{getattr(fn, '__name__', fn)} takes {len(params)} arguments; a "
                            f"{'mask' if mask else 'score'}_mod takes ({', '.join(arg_names)})")
    _TRACING.append(getattr(fn, "__code__", None))
    try:
        result = wrap(fn(*(Node("input", (n,)) for n in arg_names)))
    finally:
        _TRACING.pop()
    if mask and not result.boolean:
        raise ScoreModError(f"{fn.__name__} returns a number; a mask_mod returns a comparison (True: the key is seen)")
    if not mask and result.boolean:
        raise ScoreModError(f"{fn.__name__} returns a mask; a score_mod returns the new score")
    return Traced(getattr(fn, "__name__", "mod"), result, mask)


# ----------------------------------------------------------------------------- Triton code
_INFIX = {"+", "-", "*", "/", "<", "<=", ">", ">=", "==", "!=", "&", "|"}
_CALLS = {"tanh": None, "exp": "tl.exp", "exp2": "tl.math.exp2", "log": "tl.log", "log2": "tl.log2",
          "sqrt": "tl.sqrt", "rsqrt": "tl.math.rsqrt", "sin": "tl.sin", "cos": "tl.cos", "abs": "tl.abs",
          "minimum": "tl.minimum", "maximum": "tl.maximum", "where": "tl.where"}


def _const(x) -> str:
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, float) and math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    if isinstance(x, float) and math.isnan(x):
        return 'float("nan")'
    return repr(x)


def _emit(root: Node, names: dict[str, str], out: str) -> list[str]:
    lines, done = [], {}

    def visit(n: Node) -> str:
        if id(n) in done:
            return done[id(n)]
        if n.op == "input":
            return names[n.args[0]]
        if n.op == "const":
            return _const(n.args[0])
        a = [visit(x) for x in n.args]
        if n.op in _INFIX:
            expr = f"({a[0]} {n.op} {a[1]})"
        elif n.op == "//":  # Python's floor division (Triton's `//` truncates toward zero)
            expr = f"(({a[0]} - ((({a[0]} % {a[1]}) + {a[1]}) % {a[1]})) // {a[1]})"
        elif n.op == "%":  # Python's sign of the divisor
            expr = f"((({a[0]} % {a[1]}) + {a[1]}) % {a[1]})"
        elif n.op == "**":
            expr = _power(a[0], n.args[1].args[0])
        elif n.op == "neg":
            expr = f"(-{a[0]})"
        elif n.op == "not":
            expr = f"(~{a[0]})"
        elif n.op == "tanh":  # through exp2 (the interpreter has no tanh), as the softcap does
            expr = f"(1.0 - 2.0 / (tl.math.exp2({a[0]} * 2.8853900817779268) + 1.0))"
        elif n.op == "sigmoid":
            expr = f"(1.0 / (1.0 + tl.exp(-{a[0]})))"
        else:
            expr = f"{_CALLS[n.op]}({', '.join(a)})"
        name = f"_{out}_{len(lines)}"
        lines.append(f"{name} = {expr}")
        done[id(n)] = name
        return name

    lines.append(f"{out} = {visit(root)}")
    return lines


def _power(x: str, p) -> str:
    """x ** p: a whole exponent (an int, or a float with no fraction) as products, which keeps the sign of
    a negative base; any other through exp2/log2 (NaN for a negative base, as torch's real power gives)."""
    if float(p).is_integer() and abs(p) <= 16:
        n = int(abs(p))
        product = "(" + (" * ".join([x] * n) if n else f"({x} * 0.0 + 1.0)") + ")"
        return f"(1.0 / {product})" if p < 0 else product
    return f"tl.math.exp2(tl.log2({x}) * {float(p)!r})"


# ----------------------------------------------------------------------------- the derivative
ZERO = Node("const", (0.0,))
ONE = Node("const", (1.0,))


def _d(n: Node, memo: dict) -> Node:
    """d n / d score (forward mode over the graph; ZERO where the score does not reach)."""
    if id(n) in memo:
        return memo[id(n)]
    op, a = n.op, n.args
    if op == "input":
        r = ONE if a[0] == "score" else ZERO
    elif op == "const" or n.boolean or op in ("//", "%"):
        r = ZERO  # piecewise constant in the score
    else:
        da = [_d(x, memo) for x in a]
        r = _rule(n, op, a, da)
    memo[id(n)] = r
    return r


def _mul(x: Node, y: Node) -> Node:
    return ZERO if x is ZERO or y is ZERO else x if y is ONE else y if x is ONE else x * y


def _add(x: Node, y: Node) -> Node:
    return y if x is ZERO else x if y is ZERO else x + y


def _rule(n: Node, op: str, a: tuple, da: list) -> Node:
    if op == "+":
        return _add(da[0], da[1])
    if op == "-":
        return _add(da[0], ZERO if da[1] is ZERO else -da[1])
    if op == "*":
        return _add(_mul(da[0], a[1]), _mul(a[0], da[1]))
    if op == "/":
        quotient = ZERO if da[0] is ZERO else _mul(da[0], ONE / a[1])
        return _add(quotient, ZERO if da[1] is ZERO else _mul(da[1], -(a[0] / (a[1] * a[1]))))
    if op == "neg":
        return ZERO if da[0] is ZERO else -da[0]
    if da[0] is ZERO and op not in ("where", "minimum", "maximum"):
        return ZERO  # (a function of one argument, or x ** constant: the score does not reach it)
    if op == "**" and a[1].args[0] == 0:
        return ZERO  # (x ** 0 is 1: no 0 * x ** -1, NaN at x = 0)
    x = a[0]
    outer = {"tanh": lambda: 1.0 - n * n, "exp": lambda: n, "exp2": lambda: n * math.log(2.0),
             "log": lambda: 1.0 / x, "log2": lambda: 1.0 / (x * math.log(2.0)), "sqrt": lambda: 0.5 / n,
             "rsqrt": lambda: -0.5 * n / x, "sigmoid": lambda: n * (1.0 - n), "sin": lambda: Node("cos", (x,)),
             "cos": lambda: -Node("sin", (x,)), "abs": lambda: Node("where", (x >= 0.0, ONE, -ONE)),
             "**": lambda: a[1].args[0] * x ** (a[1].args[0] - 1) if a[1].args[0] != 1 else ONE}
    if op in outer:
        return _mul(outer[op](), da[0])
    if op == "where":
        return ZERO if da[1] is ZERO and da[2] is ZERO else Node("where", (a[0], da[1], da[2]))
    if op in ("minimum", "maximum"):
        if da[0] is ZERO and da[1] is ZERO:
            return ZERO
        first = (a[0] <= a[1]) if op == "minimum" else (a[0] >= a[1])
        return Node("where", (first, da[0], da[1]))
    raise ScoreModError(f"no derivative for {op}")

