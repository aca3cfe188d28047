"""Attention variants the generated kernels compute: sliding windows, logit softcaps, ALiBi and sinks.

Two halves, as a kernel sees them:
- `ScoreVariant`: which variants a kernel is rendered with. It decides the device code (a render-time
  choice: each combination is its own kernel, tuned and served per combination), so it is part of the
  problem key (`Problem.score_variant`, its `key` below) and of the kernel's file name and hash.
- `ScoreArgs`: the values of one call (window bounds, the softcap, the slope and sink tensors). They
  are runtime arguments: a new window size or softcap never compiles a new kernel.

Semantics are flash-attn's (those of `autoflash.eager`, which transformers' eager attention shares),
with query i at key position i + offset (offset = Nk - Nq: bottom-right):
    s = q.k * scale;  s = softcap * tanh(s / softcap) if softcap;  s -= slope[b, h] * |i + offset - j|
    key j is visible iff i + offset - left <= j <= i + offset + right (a bound of -1: unbounded; causal
    is right = 0), and a sink adds exp(sink[h]) to the softmax's denominator (gpt-oss), the LSE with it.

Torch is not imported here: the problem key (and the space layer under it) reads this module.
"""

from __future__ import annotations

import dataclasses
import re

# The variants in the order their names appear in a key ("window+softcap").
FEATURES = ("window", "softcap", "alibi", "sinks")
# A window bound of -1 (unbounded) goes to the kernel as this reach: further than any sequence, small
# enough that position + reach stays an int32.
WINDOW_UNBOUNDED = 1 << 30


@dataclasses.dataclass(frozen=True)
class ScoreVariant:
    """Which score variants a kernel is rendered with (all False: the plain kernel, rendered exactly
    as before variants existed)."""

    window: bool = False
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False
    # A user's score_mod / mask_mod (autoflash.score_mods): the traced code's key, 'score-<hash>' /
    # 'mask-<hash>', '' for none. The code itself is looked up by key when the kernel is rendered.
    score_mod: str = ""
    mask_mod: str = ""

    @property
    def key(self) -> str:
        """The problem key's segment, e.g. 'window+softcap' or 'score-1a2b3c4d5e'; '' for the plain kernel."""
        return "+".join([f for f in FEATURES if getattr(self, f)] + [m for m in (self.score_mod, self.mask_mod) if m])

    @classmethod
    def from_key(cls, key: str | None) -> "ScoreVariant":
        """Parse `key` ('' or None: plain). Unknown, repeated or out-of-order names raise ValueError."""
        if not key:
            return PLAIN
        names = key.split("+")
        mods = {kind: [n for n in names if _USER_MOD.fullmatch(n) and n.startswith(kind)] for kind in ("score-", "mask-")}
        features = [n for n in names if n not in mods["score-"] + mods["mask-"]]
        if (any(n not in FEATURES for n in features) or features != sorted(set(features), key=FEATURES.index)
                or any(len(m) > 1 for m in mods.values()) or names != features + mods["score-"] + mods["mask-"]):
            raise ValueError(f"score variant {key!r}: expected names of {FEATURES} joined by '+', in that order, "
                             f"then a score-<hash> and a mask-<hash> of user functions")
        return cls(**{n: True for n in features}, score_mod="".join(mods["score-"]), mask_mod="".join(mods["mask-"]))

    @property
    def plain(self) -> bool:
        return not (self.window or self.softcap or self.alibi or self.sinks or self.user)

    @property
    def user(self) -> bool:
        """A user's score or mask function is rendered in (every KV tile then takes the masked path)."""
        return bool(self.score_mod or self.mask_mod)

    @property
    def modifies_scores(self) -> bool:
        """The variant changes score values (not only which keys are visible, or the denominator): the
        kernel's fused scale-and-max of fully visible tiles cannot be used."""
        return self.softcap or self.alibi or bool(self.score_mod)


_USER_MOD = re.compile(r"(score|mask)-[0-9a-f]{10}")
PLAIN = ScoreVariant()


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreArgs:
    """One call's variant values. window: (left, right), -1 unbounded, aligned bottom-right (query i
    at key position i + offset); softcap: 0 for none; alibi_slopes: (H,) or (B, H), any float dtype
    and strides; sinks: (H,), one logit per query head, any float dtype."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: object = None
    sinks: object = None
    score_mod: object = None  # a traced user function (autoflash.score_mods.Traced), rendered into the kernel
    mask_mod: object = None

    @property
    def variant(self) -> ScoreVariant:
        return ScoreVariant(window=tuple(self.window) != (-1, -1), softcap=self.softcap > 0,
                            alibi=self.alibi_slopes is not None, sinks=self.sinks is not None,
                            score_mod=self.score_mod.key if self.score_mod is not None else "",
                            mask_mod=self.mask_mod.key if self.mask_mod is not None else "")

    def per_batch(self) -> bool:
        """ALiBi slopes per (batch, head): a launch over a slice of the batch takes the same slice."""
        return self.alibi_slopes is not None and self.alibi_slopes.dim() == 2

    def batch_slice(self, first: int, last: int | None = None) -> "ScoreArgs":
        """The arguments of a launch over batch entries [first, last)."""
        if not self.per_batch():
            return self
        return dataclasses.replace(self, alibi_slopes=self.alibi_slopes[first:last])

    def kernel_args(self, variant: ScoreVariant) -> tuple:
        """The kernel's variant parameters, in their order (`score_params` in _shared/score_parts.jinja:
        window, softcap, ALiBi, sinks), for a kernel rendered with `variant`; a call whose values are
        another variant's is a ValueError. Positional, as the kernels' other runtime arguments."""
        if self.variant != variant:
            raise ValueError(f"a kernel rendered for score variant {variant.key or 'plain'!r} got the values "
                             f"of {self.variant.key or 'plain'!r}")
        args = []
        if variant.window:
            args += [WINDOW_UNBOUNDED if w < 0 else min(int(w), WINDOW_UNBOUNDED) for w in self.window]
        if variant.softcap:
            args.append(float(self.softcap))
        if variant.alibi:
            slopes = self.alibi_slopes  # (a batch stride of 0: one slope per head)
            args += [slopes, *((slopes.stride(0), slopes.stride(1)) if slopes.dim() == 2 else (0, slopes.stride(0)))]
        if variant.sinks:
            args += [self.sinks, self.sinks.stride(0)]
        return tuple(args)


NO_SCORE_ARGS = ScoreArgs()


@dataclasses.dataclass(frozen=True)
class ScoreValues:
    """A tuning shape's variant values (`Shape.score`): what its kernels are gated and timed with. The
    tensors of `ScoreArgs` are made from them per head count (deterministic: ALiBi's geometric slopes,
    evenly spaced sink logits), so a shape stays a small picklable, JSON-able value.
    window: (left, right), -1 unbounded; a Shape binds it as the drop-ins do (`binding_window`: a causal
    window of 4096 keys is (4096, -1), one that excludes no key none)."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False

    def __post_init__(self):  # (JSON gives a list: one shape, one value)
        object.__setattr__(self, "window", tuple(int(w) for w in self.window))

    @property
    def variant(self) -> ScoreVariant:
        return ScoreVariant(window=self.window != (-1, -1), softcap=self.softcap > 0, alibi=self.alibi,
                            sinks=self.sinks)

    def as_dict(self) -> dict:
        """The values set (JSON rows, TOML-like): {'window': [4096, 0], 'softcap': 50.0}."""
        out = {"window": list(self.window), "softcap": self.softcap, "alibi": self.alibi, "sinks": self.sinks}
        return {k: v for k, v in out.items() if v and v != [-1, -1]}

    def problem(self) -> str | None:
        """What is wrong with these values (a window bound below -1, a negative softcap), or None."""
        if len(self.window) != 2 or any(w < -1 for w in self.window):
            return f"window must be (left, right) with bounds >= -1 (-1: unbounded), got {self.window!r}"
        if not self.softcap >= 0:
            return f"softcap must be >= 0 (0: none), got {self.softcap!r}"
        return None

    def args(self, heads: int, device, window: tuple[int, int] | None = None,
             softcap: float | None = None) -> ScoreArgs:
        """The call's `ScoreArgs` for `heads` query heads on `device`; window/softcap: other values of
        the same variants in their place (the gate's: see `tuning.gate.gate_score_args`)."""
        import torch

        window = self.window if window is None else window
        softcap = self.softcap if softcap is None else softcap
        slopes = torch.tensor(alibi_slopes(heads), device=device) if self.alibi else None
        sinks = torch.linspace(-1.0, 2.0, heads, device=device) if self.sinks else None
        return ScoreArgs(window=window, softcap=softcap, alibi_slopes=slopes, sinks=sinks)


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's geometric slopes (Press et al.): 2^(-8 (h + 1) / heads) for head h (the power-of-two rule,
    used for any head count: tuning needs deterministic, realistic values, not the paper's interleave)."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def binding_window(window: tuple[int, int], causal: bool, n_q: int, n_k: int) -> tuple[tuple[int, int], bool]:
    """(window, causal) with the bounds that exclude no key dropped (-1), and a right bound of 0
    turned into causality itself (the kernels serve that). Positions are bottom-right aligned."""
    left, right = window
    if left >= n_k - 1:  # the first key is within reach of every query
        left = -1
    if right == 0:
        causal, right = True, -1
    if right >= 0 and (causal or right >= n_q - 1):  # causality is tighter / the last key is within reach
        right = -1
    return (left, right), causal


def score_values(value) -> "ScoreValues | None":
    """A shape's `score` field from a ScoreValues, a dict (JSON rows, shape-set tables) or None; None for
    plain values (one shape, one problem key)."""
    if value is None:
        return None
    values = value if isinstance(value, ScoreValues) else ScoreValues(**value)
    return None if values.variant.plain else values
