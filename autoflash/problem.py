"""What is being solved: the problem key, seqlen buckets, and the GPU fingerprint.

A `Problem` is the unit the tuner optimises and the dispatcher looks up. It is deliberately
coarse: sequence lengths are bucketed to powers of two, so one tuned winner serves every
length in its bucket (seqlen is a runtime argument of every kernel, so any length is correct
with any variant; the bucket only decides which variant is fastest).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
SEQLEN_BUCKET_MIN = 16
SEQLEN_BUCKET_MAX = 1 << 20


def seqlen_bucket(n: int) -> int:
    """The power of two at or above n (clamped), e.g. 1000 -> 1024, 1024 -> 1024."""
    n = max(int(n), 1)
    return min(max(SEQLEN_BUCKET_MIN, 1 << (n - 1).bit_length()), SEQLEN_BUCKET_MAX)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One tuning/dispatch key. Shapes inside it are buckets, not exact sizes."""

    op: str  # "fwd" (forward); "bwd" when the backward lands
    dtype: str  # one of DTYPES
    head_dim: int
    causal: bool
    gqa_group: int  # query heads per KV head (1 = MHA)
    seqlen_q: int  # bucket
    seqlen_k: int  # bucket

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.gqa_group < 1:
            raise ValueError(f"gqa_group must be >= 1, got {self.gqa_group}")

    @property
    def key(self) -> str:
        """A stable, human-readable key, used as the DB's problem column and study name."""
        c = "causal" if self.causal else "full"
        return (f"{self.op}/{self.dtype}/d{self.head_dim}/{c}/g{self.gqa_group}"
                f"/q{self.seqlen_q}/k{self.seqlen_k}")

    @classmethod
    def from_key(cls, key: str) -> "Problem":
        op, dtype, d, c, g, q, k = key.split("/")
        return cls(op=op, dtype=dtype, head_dim=int(d[1:]), causal=(c == "causal"),
                   gqa_group=int(g[1:]), seqlen_q=int(q[1:]), seqlen_k=int(k[1:]))

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

    @property
    def problem(self) -> Problem:
        return Problem(op=self.op, dtype=self.dtype, head_dim=self.head_dim, causal=self.causal,
                       gqa_group=self.heads_q // self.heads_kv,
                       seqlen_q=seqlen_bucket(self.seqlen_q), seqlen_k=seqlen_bucket(self.seqlen_k))

    def flops(self) -> float:
        """Forward FLOPs 4*B*H*Nq*Nk*D (two matmuls), halved when causal; the backward counts
        2.5x the forward (five matmuls), forward+backward 3.5x."""
        f = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        if self.causal:
            f /= 2
        return f * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[self.op]

    def short_label(self) -> str:
        """Compact, for plot axes: 'd128 causal 4k' (dtype and batch left out)."""
        n = f"{self.seqlen_q // 1024}k" if self.seqlen_q >= 1024 and self.seqlen_q % 1024 == 0 else str(self.seqlen_q)
        g = f" g{self.heads_q // self.heads_kv}" if self.heads_q != self.heads_kv else ""
        return f"d{self.head_dim}{' causal' if self.causal else ''}{g} {n}"

    def label(self) -> str:
        c = " causal" if self.causal else ""
        g = f" gqa{self.heads_q}/{self.heads_kv}" if self.heads_q != self.heads_kv else ""
        return (f"{'' if self.op == 'fwd' else self.op + ' '}{self.dtype} B{self.batch} H{self.heads_q} q{self.seqlen_q} k{self.seqlen_k} "
                f"d{self.head_dim}{c}{g}")


@dataclasses.dataclass(frozen=True)
class GPUFingerprint:
    """What a tuned result depends on besides the problem: the chip and the software stack."""

    name: str
    cc_major: int
    cc_minor: int
    sm_count: int
    smem_per_block: int  # bytes, opt-in maximum
    torch_version: str
    triton_version: str
    cuda_version: str
    autoflash_version: str

    @property
    def key(self) -> str:
        """The GPU part of a DB key. Versions are part of it: a new Triton may change the winner."""
        return (f"{self.name}|sm{self.cc_major}{self.cc_minor}|{self.sm_count}sm"
                f"|torch{self.torch_version}|triton{self.triton_version}|cuda{self.cuda_version}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def shape_set_names() -> list[str]:
    """Named shape sets: search_spaces/shapes_<name>.toml (standard, gqa, tiny, long, sweep_d64, ...)."""
    from autoflash import resources

    return sorted(p.stem[len("shapes_"):] for p in resources.data_dir("search_spaces").glob("shapes_*.toml"))


def load_shape_set(name_or_path: str, op: str = "fwd") -> list[Shape]:
    """Shapes of a named set (see `shape_set_names`) or of a TOML file with [[grid]]/[[shape]] tables.

    A [[grid]] crosses dtype x head_dim x causal x seqlen lists; batch comes from `tokens`
    (batch = tokens // seqlen) or `batch`; heads from `hidden` (heads = hidden // head_dim) or
    `heads_q` (and `heads_kv`, default heads_q). A [[shape]] gives every Shape field itself.
    """
    import itertools
    import pathlib
    import tomllib

    from autoflash import resources

    if name_or_path in shape_set_names():
        data = tomllib.loads(resources.read_text("search_spaces", f"shapes_{name_or_path}.toml"))
    else:
        path = pathlib.Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"unknown shape set {name_or_path!r}: not one of {shape_set_names()} nor a file")
        data = tomllib.loads(path.read_text())
    shapes = []
    for g in data.get("grid", []):
        for dtype, d, causal, n in itertools.product(g["dtype"], g["head_dim"], g["causal"], g["seqlen"]):
            batch = g["batch"] if "batch" in g else max(1, g["tokens"] // n)
            hq = g["heads_q"] if "heads_q" in g else g["hidden"] // d
            shapes.append(Shape(batch=batch, heads_q=hq, heads_kv=g.get("heads_kv", hq), seqlen_q=n,
                                seqlen_k=n, head_dim=d, causal=causal, dtype=dtype, op=op))
    for s in data.get("shape", []):
        shapes.append(Shape(**{"op": op, "heads_kv": s.get("heads_kv", s["heads_q"]), **s}))
    if not shapes:
        raise ValueError(f"shape set {name_or_path!r} defines no shapes")
    return shapes


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def gpu_fingerprint(device_index: int | None = None) -> GPUFingerprint:
    """Fingerprint of the current CUDA device, or of the CPU interpreter when there is none."""
    import torch
    import triton

    from autoflash import __version__

    versions = dict(torch_version=torch.__version__, triton_version=triton.__version__,
                    cuda_version=str(torch.version.cuda), autoflash_version=__version__)
    if torch.cuda.is_available() and not interpreter_enabled():
        idx = torch.cuda.current_device() if device_index is None else device_index
        props = torch.cuda.get_device_properties(idx)
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 49152
        return GPUFingerprint(name=props.name, cc_major=props.major, cc_minor=props.minor,
                              sm_count=props.multi_processor_count, smem_per_block=int(smem),
                              **versions)
    # The interpreter has no hardware limits or compiler bugs; report a recent compute capability
    # and Hopper's shared memory so every structural variant can be checked on the CPU.
    return GPUFingerprint(name=f"triton-interpreter ({platform.machine()})", cc_major=10, cc_minor=0,
                          sm_count=1, smem_per_block=232448, **versions)


def dtype_name(dtype) -> str:
    """torch dtype -> 'float16' etc."""
    return str(dtype).replace("torch.", "")


def geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))
