"""What is being solved: the problem key, seqlen buckets and concrete shapes.

A `Problem` is the unit the tuner optimises and the dispatcher looks up. It is deliberately
coarse: sequence lengths are bucketed to powers of two, so one tuned winner serves every
length in its bucket (seqlen is a runtime argument of every kernel, so any length is correct
with any variant; the bucket only decides which variant is fastest).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from autoflash.score_variant import PLAIN, ScoreValues, ScoreVariant, binding_window, score_values

OPS = ("fwd", "bwd", "decode")
DTYPES = ("float16", "bfloat16", "float32")
# A Shape's memory layouts of q, k, v (`Shape.layout`): None or "bhnd" contiguous (B, H, N, D), "bnhd"
# (B, N, H, D) memory seen as (B, H, N, D)
SHAPE_LAYOUTS = (None, "bhnd", "bnhd")
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
SEQLEN_BUCKET_MIN = 16
SEQLEN_BUCKET_MAX = 1 << 20
HEAD_DIM_MAX = 1 << 16  # far above any kernel's limit (the API falls back above 256): larger is a corrupt row
MAX_HEAD_DIM = 256  # the largest head dim the kernels take (the API falls back to torch SDPA above)
GQA_GROUP_MAX = 1 << 16
# The occupancy bucket: log2 of the tiles of parallel work per SM (see `work_bucket`).
WORK_TILE_ROWS = 128
WORK_MIN, WORK_MAX = -6, 10
_KEY = re.compile(r"(?P<op>[a-z]+)/(?P<dtype>[a-z0-9]+)/d(?P<d>-?\d+)/(?P<c>causal|full)/g(?P<g>-?\d+)"
                  r"/q(?P<q>-?\d+)/k(?P<k>-?\d+)(?:/w(?P<w>-?\d+))?(?:/p(?P<p>-?\d+))?(?:/dv(?P<dv>-?\d+))?"
                  r"(?:/(?P<s>[a-z0-9+-]+))?")


def unsupported_head_dim(d: int) -> str | None:
    """Why the kernels cannot take this head dim (a call falls back to torch SDPA), or None. Any head dim
    up to 256: the kernels pad it to their power-of-two tile and mask the columns past it; one whose rows
    are not 16-byte multiples (bf16/fp16: not a multiple of 8) runs the pointer-load variants (TMA needs
    16-byte rows: the spaces' tma_alignment constraints, the Gluon kernels' refusals)."""
    if d > MAX_HEAD_DIM:
        return f"head dim {d} is not supported (up to {MAX_HEAD_DIM} are)"
    return None


# Every kernel multiplies its scores by sm_scale * log2(e) in float32 (softmax by exp2): that factor
# must be a normal float32. Outside, it is a subnormal (flushed to zero on a GPU, a float64 the
# interpreter's dot refuses) or infinite; torch's own SDPA takes those scales.
LOG2E = 1.4426950408889634
_FLOAT32_TINY, _FLOAT32_MAX = 2.0 ** -126, (2 - 2.0 ** -23) * 2.0 ** 127


def unsupported_scale(scale: float | None) -> str | None:
    """Why the kernels cannot take this finite softmax scale (a call falls back), or None. Zero is
    taken where a kernel takes it at all (the forward refuses scales <= 0 on its own)."""
    if scale is None or scale == 0 or (abs(scale) >= _FLOAT32_TINY and abs(scale) * LOG2E <= _FLOAT32_MAX):
        return None  # (the scale itself and scale * log2(e) normal float32s: the backward takes the first)
    return (f"a softmax scale of {scale!r} is outside the kernels' float32 range "
            f"(|scale| must lie in [{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX / LOG2E:.3g}])")


def _check_int(name: str, value, low: int, high: int, power_of_two: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{name} must be a power-of-two bucket, got {value}")


def seqlen_bucket(n: int) -> int:
    """The power of two at or above n (clamped), e.g. 1000 -> 1024, 1024 -> 1024."""
    n = max(int(n), 1)
    return min(max(SEQLEN_BUCKET_MIN, 1 << (n - 1).bit_length()), SEQLEN_BUCKET_MAX)


def work_bucket(batch: int, heads_q: int, seqlen: int, sm_count: int) -> int:
    """How much parallel work a call gives the GPU: log2 of (batch x query heads x 128-row tiles of
    `seqlen`) per SM, rounded and clamped. The best variant changes with it (a big batch wants big
    tiles; a small one wants more, smaller programs or a split), so it is part of the key: a winner
    tuned on a big batch is not served to a small one. `seqlen` is the length the kernel's grid
    runs over (queries for the forward, keys for the backward's KV-outer kernel)."""
    tiles = max(int(batch), 1) * max(int(heads_q), 1) * max(-(-int(seqlen) // WORK_TILE_ROWS), 1)
    return min(WORK_MAX, max(WORK_MIN, round(math.log2(tiles / max(int(sm_count), 1)))))


def shape_work_bucket(op: str, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int,
                      sm_count: int) -> int:
    """`work_bucket` of a call: the forward's grid runs over query tiles, the backward's KV-outer
    kernel over key tiles, decode over (batch, KV head) programs (all query heads of a GQA group and
    every new token in one program) before any KV split."""
    if op == "decode":
        return work_bucket(batch, heads_kv, 1, sm_count)
    return work_bucket(batch, heads_q, seqlen_k if op == "bwd" else seqlen_q, sm_count)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One tuning/dispatch key. Shapes inside it are buckets, not exact sizes."""

    op: str  # "fwd" (forward), "bwd" (backward) or "decode" (a few query tokens against a KV cache)
    dtype: str  # one of DTYPES
    head_dim: int
    causal: bool
    gqa_group: int  # query heads per KV head (1 = MHA)
    seqlen_q: int  # bucket
    seqlen_k: int  # bucket
    # work_bucket() of the call on its GPU; None: any occupancy (keys and DB rows made before the
    # occupancy bucket existed are served by the nearest-bucket rule, never as an exact match)
    work: int | None = None
    # decode only: the paged KV cache's block size (tokens per page); None: a contiguous cache.
    # Keys and rows made before it existed are contiguous problems.
    page: int | None = None
    # fwd and bwd: the attention variants the kernel computes (a `ScoreVariant.key` such as
    # "window+softcap"; each combination is its own kernel, tuned and served on its own). None: plain
    # attention, as every key made before variants existed.
    score_variant: str | None = None
    # fwd and bwd: V's (and the output's) head dim where it differs from Q's and K's (MLA prefill:
    # 192/128), a kernel rendered for it, tuned and served on its own. None: V has Q's head dim, as
    # every key made before value head dims of their own.
    head_dim_v: int | None = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if isinstance(self.causal, str) or self.causal not in (True, False):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        _check_int("head_dim", self.head_dim, 1, HEAD_DIM_MAX)
        _check_int("gqa_group", self.gqa_group, 1, GQA_GROUP_MAX)
        _check_int("seqlen_q", self.seqlen_q, 1, SEQLEN_BUCKET_MAX, power_of_two=True)
        _check_int("seqlen_k", self.seqlen_k, 1, SEQLEN_BUCKET_MAX, power_of_two=True)
        if self.work is not None:
            _check_int("work", self.work, WORK_MIN, WORK_MAX)
        if self.page is not None:
            if self.op != "decode":
                raise ValueError(f"page (a paged KV cache's block size) is a decode key, not {self.op!r}")
            _check_int("page", self.page, 1, SEQLEN_BUCKET_MAX)
        if self.score_variant is not None:
            if self.op not in ("fwd", "bwd"):
                raise ValueError(f"score_variant (attention variants) is a forward or backward key, not {self.op!r}")
            if not isinstance(self.score_variant, str) or ScoreVariant.from_key(self.score_variant).key != \
                    self.score_variant or not self.score_variant:
                raise ValueError(f"score_variant must be a non-empty ScoreVariant key, got {self.score_variant!r}")
        if self.head_dim_v is not None:
            if self.op not in ("fwd", "bwd"):
                raise ValueError(f"head_dim_v (a value head dim of its own) is a forward or backward key, not {self.op!r}")
            _check_int("head_dim_v", self.head_dim_v, 1, HEAD_DIM_MAX)
            if self.head_dim_v == self.head_dim:
                raise ValueError(f"head_dim_v is None when it equals head_dim ({self.head_dim}): one problem, one key")

    @property
    def key(self) -> str:
        """A stable, human-readable key, used as the DB's problem column and study name."""
        c = "causal" if self.causal else "full"
        work = "" if self.work is None else f"/w{self.work}"
        page = "" if self.page is None else f"/p{self.page}"
        score = "" if self.score_variant is None else f"/{self.score_variant}"
        value = "" if self.head_dim_v is None else f"/dv{self.head_dim_v}"
        return (f"{self.op}/{self.dtype}/d{self.head_dim}/{c}/g{self.gqa_group}"
                f"/q{self.seqlen_q}/k{self.seqlen_k}{work}{page}{value}{score}")

    @classmethod
    def from_key(cls, key: str) -> "Problem":
        """Parse a key made by `.key`; anything else (missing/extra parts, a length <= 0, a
        non-power-of-two bucket, an unknown op or dtype) raises ValueError naming the part."""
        if not isinstance(key, str):
            raise ValueError(f"a problem key must be a string, got {type(key).__name__}")
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"malformed problem key {key!r}: expected "
                             "'op/dtype/d<head_dim>/causal|full/g<gqa>/q<bucket>/k<bucket>[/w<work>][/p<page>]"
                             "[/dv<value head dim>][/<score variant, e.g. window+softcap>]'")
        try:
            problem = cls(op=m["op"], dtype=m["dtype"], head_dim=int(m["d"]), causal=(m["c"] == "causal"),
                          gqa_group=int(m["g"]), seqlen_q=int(m["q"]), seqlen_k=int(m["k"]),
                          work=None if m["w"] is None else int(m["w"]),
                          page=None if m["p"] is None else int(m["p"]), score_variant=m["s"],
                          head_dim_v=None if m["dv"] is None else int(m["dv"]))
        except ValueError as e:
            raise ValueError(f"invalid problem key {key!r}: {e}") from None
        if problem.key != key:  # e.g. leading zeros: one problem, one key
            raise ValueError(f"non-canonical problem key {key!r} (canonical: {problem.key!r})")
        return problem

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A concrete benchmark shape (exact sizes) and the problem bucket it falls in."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    dtype: str
    op: str = "fwd"
    page: int | None = None  # decode: a paged cache of this block size (None: contiguous); other ops ignore it
    # V's (and the output's) head dim where it differs from Q's and K's (MLA prefill: 192/128); None:
    # head_dim. Last and defaulted, so every plain shape (constructor calls, pickles, JSON rows made
    # before it) stays as it was; one equal to head_dim is stored as None (one shape, one problem key).
    head_dim_v: int | None = None
    # fwd and bwd: the attention variants' values its kernels are tuned with (`ScoreValues`: window,
    # softcap, ALiBi, sinks; a dict is taken too, as JSON rows hold it); None: plain attention. Last and
    # defaulted for the reason head_dim_v is; plain values are stored as None.
    score: ScoreValues | None = None
    # How a bench lays out q, k and v in memory (`reference.make_inputs`): None, contiguous (B, H, N, D)
    # ("bhnd" is stored as None); "bnhd", (B, N, H, D) memory seen as (B, H, N, D), the strided views
    # a model's attention layers pass. Not part of the problem key (the tuner's gate checks both layouts).
    # Last and defaulted for the reason head_dim_v is.
    layout: str | None = None

    def __post_init__(self):
        if self.layout not in SHAPE_LAYOUTS:
            raise ValueError(f"layout must be one of {list(SHAPE_LAYOUTS)} (None: contiguous (B, H, N, D); "
                             f"'bnhd': (B, N, H, D) memory), got {self.layout!r}")
        if self.layout == "bhnd":
            object.__setattr__(self, "layout", None)
        if self.head_dim_v is not None and self.head_dim_v == self.head_dim:
            object.__setattr__(self, "head_dim_v", None)
        score = score_values(self.score)
        if score is not None:  # as the drop-ins bind a window (one call, one problem key: see binding_window)
            window, causal = binding_window(score.window, self.causal, self.seqlen_q, self.seqlen_k)
            score = score_values(dataclasses.replace(score, window=window))
            object.__setattr__(self, "causal", causal)
        object.__setattr__(self, "score", score)

    def as_dict(self) -> dict:
        """The fields as stored in JSON (winner rows, bench output): head_dim_v, score and layout only
        where set, so a plain contiguous shape's JSON is what it was before value head dims, variants
        and layouts."""
        fields = dataclasses.asdict(self)
        for optional in ("head_dim_v", "layout"):
            if fields[optional] is None:
                del fields[optional]
        del fields["score"]
        if self.score is not None:
            fields["score"] = self.score.as_dict()
        return fields

    @property
    def score_variant(self) -> ScoreVariant:
        """The variants its kernels are rendered with (PLAIN for a plain shape)."""
        return PLAIN if self.score is None else self.score.variant

    @property
    def value_dim(self) -> int:
        """V's head dim (head_dim unless the shape has one of its own)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def problem(self) -> Problem:
        """The problem of this shape on the current device (its SM count decides the work bucket)."""
        from autoflash.device import gpu_fingerprint

        return self.problem_on(gpu_fingerprint().sm_count)

    def problem_on(self, sm_count: int) -> Problem:
        return Problem(op=self.op, dtype=self.dtype, head_dim=self.head_dim, causal=self.causal,
                       gqa_group=self.heads_q // self.heads_kv,
                       seqlen_q=seqlen_bucket(self.seqlen_q), seqlen_k=seqlen_bucket(self.seqlen_k),
                       work=shape_work_bucket(self.op, self.batch, self.heads_q, self.heads_kv, self.seqlen_q,
                                              self.seqlen_k, sm_count),
                       page=self.page if self.op == "decode" else None,
                       head_dim_v=self.head_dim_v if self.op in ("fwd", "bwd") else None,
                       score_variant=self.score_variant.key or None if self.op in ("fwd", "bwd") else None)

    def flops(self) -> float:
        """FLOPs of the matmuls, 2*B*H*Nq*Nk per head dim each matmul runs over, halved when causal.
        The forward (and decode) runs S = QK^T over D and O = PV over D_v: 2*B*H*Nq*Nk*(D + D_v), i.e.
        4*B*H*Nq*Nk*D where D_v = D. The backward runs five: S = QK^T again, dQ = dS K and dK = dS^T Q
        over D, dP = dO V^T and dV = P^T dO over D_v: 2*B*H*Nq*Nk*(3D + 2D_v) (2.5x the forward where
        D_v = D); forward+backward the sum of both (3.5x)."""
        d, dv = self.head_dim, self.value_dim
        per_dim = 2.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k
        if self.causal:
            per_dim /= 2
        if self.score is not None and self.score.window != (-1, -1):  # only the band's (query, key) pairs
            per_dim = 2.0 * self.batch * self.heads_q * self._window_pairs()
        dims = {"fwd": d + dv, "decode": d + dv, "bwd": 3 * d + 2 * dv, "fwdbwd": 4 * d + 3 * dv}[self.op]
        return per_dim * dims

    def _window_pairs(self) -> int:
        """(query, key) pairs a sliding window lets through (bottom-right aligned, causal or not): a
        window of 128 keys at 4k tokens is 1/16 of causal attention's work, and its TFLOP/s count that."""
        n_q, n_k, (left, right) = self.seqlen_q, self.seqlen_k, self.score.window
        offset, right = n_k - n_q, 0 if self.causal else (n_k if right < 0 else right)
        left = n_k if left < 0 else left
        return sum(max(0, min(n_k - 1, i + offset + right) - max(0, i + offset - left) + 1) for i in range(n_q))

    def short_label(self) -> str:
        """Compact, for plot axes: 'd128 causal 4k' (dtype and batch left out)."""
        n = f"{self.seqlen_q // 1024}k" if self.seqlen_q >= 1024 and self.seqlen_q % 1024 == 0 else str(self.seqlen_q)
        g = f" g{self.heads_q // self.heads_kv}" if self.heads_q != self.heads_kv else ""
        return f"{self.dims_label()}{' causal' if self.causal else ''}{g} {n}"

    def dims_label(self) -> str:
        """'d128', or 'd192/128' where V has a head dim of its own."""
        return f"d{self.head_dim}" + ("" if self.head_dim_v is None else f"/{self.head_dim_v}")

    def label(self) -> str:
        c = " causal" if self.causal else ""
        g = f" gqa{self.heads_q}/{self.heads_kv}" if self.heads_q != self.heads_kv else ""
        page = f" page{self.page}" if self.page is not None and self.op == "decode" else ""
        score = f" {self.score_variant.key}" if self.score is not None else ""
        layout = f" {self.layout}" if self.layout is not None else ""
        return (f"{'' if self.op == 'fwd' else self.op + ' '}{self.dtype} B{self.batch} H{self.heads_q} q{self.seqlen_q} k{self.seqlen_k} "
                f"{self.dims_label()}{c}{g}{page}{score}{layout}")


def distance_between(a: Problem, b: Problem) -> float:
    """How far apart two problems of one kind are: factors of 2 in head dim, GQA group and sequence
    lengths, plus occupancy buckets. The serving policy reads a neighbour's measurement by it, and
    the tuner a neighbour's winner as a seed (it lives here, with the key, for both)."""
    work = 0.0 if a.work is None or b.work is None else abs(a.work - b.work)
    return (abs(math.log2(a.head_dim / b.head_dim)) + abs(math.log2(a.gqa_group / b.gqa_group))
            + abs(math.log2(a.seqlen_q / b.seqlen_q)) + abs(math.log2(a.seqlen_k / b.seqlen_k)) + work)


def dtype_name(dtype) -> str:
    """torch dtype -> 'float16' etc."""
    return str(dtype).replace("torch.", "")


def geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


# The backward recomputes each probability as exp2(s * scale * log2(e) - lse) from the forward's
# float32 log-sum-exp, whose rounding (about |lse| * 2^-23) grows with the size of the logits: at large
# scales the gradients drift from float64 where torch's own float32 error does not (a nearly one-hot
# softmax is exact in torch). Measured in the interpreter with unit-variance inputs (d16-d64, causal and
# not): float32 gradients stay within 3x torch's float32 error up to scale * sqrt(head_dim) = 8 and
# leave it from ~30 (dv 30x torch's at 1e3, -inf at 1e30); float16/bfloat16 inputs carry ~1e3 times
# more error of their own. Differentiable calls above these bounds run in torch (forward-only calls
# are right at any scale the kernels take).
TRAINING_SCALE_BOUND = {"float32": 8.0, "float16": 64.0, "bfloat16": 64.0}


def unsupported_training_scale(scale: float, head_dim: int, dtype: str) -> str | None:
    """Why the backward kernels cannot take this scale for these inputs (a call falls back), or None."""
    bound = TRAINING_SCALE_BOUND.get(dtype)
    if bound is None or abs(scale) * max(1, head_dim) ** 0.5 <= bound:
        return None
    return (f"a softmax scale of {scale:.3g} with head dim {head_dim} ({dtype}) in a differentiable call: "
            f"the backward's float32 log-sum-exp loses the gradients' precision above scale * sqrt(head_dim) "
            f"= {bound:g}")
