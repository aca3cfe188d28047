"""The family contract: what every kernel family's `host.py` implements.

A kernel family is one folder of `autoflash/families/`: `kernel.py.jinja` (device code only: the
`@triton.jit` / `@gluon.jit` functions a variant renders to), `host.py` (a subclass of one of the
classes below: grid, `supports`, TMA descriptor set-up, the keyword-argument launch) and
`space.toml` (knobs, constraints, defaults). `replaces.toml` lists the template hashes whose stored
winners are this family's kernels unchanged (see `autoflash.families.replaced_hashes`).

A host object serves one variant: `knobs` are its validated knob values, `kernels` the module
rendered from the template for them, `score` the attention variants rendered into it
(`autoflash.score_variant`; plain unless the family `serves_score_variants`, whose launches then take
the call's `ScoreArgs`). A launch works on the caller's current stream; it may put
kernels on a stream of its own if each run of them first waits for the caller's stream, the
caller's stream waits for them only when `launch` returns (also when it raises), and nothing on the
caller's stream reads what they write before that: the order `replay` reproduces for a bound
launch. A launch depends on its tensors' shapes, strides, dtypes and device and on its scalars,
never on tensor values read on the host.
"""

from __future__ import annotations

import abc
from types import ModuleType
from typing import ClassVar

from autoflash.score_variant import PLAIN, ScoreVariant

# CUDA caps grid axes 1 and 2 at 65535 programs.
MAX_GRID_AXIS = 65535


class Family(abc.ABC):
    """One compiled variant of a kernel family, as the runtime launches it."""

    name: ClassVar[str]  # the family's name (its folder, its key in `space.FAMILIES`)
    op: ClassVar[str]  # "fwd" | "bwd" | "decode"
    supports_varlen: ClassVar[bool] = False  # `launch_varlen` takes packed variable-length sequences
    serves_score_variants: ClassVar[bool] = False  # renders and launches `score_variant` hooks
    # ... a user's score_mod / mask_mod among them (traced to Triton code and spliced in)
    serves_user_mods: ClassVar[bool] = True
    # A search-space expression (the spaces' names): the attention-variant problems nothing was tuned for
    # that this family's default serves before the op's default family's (where measured faster for
    # them; `families.score_variant_default`); "": none
    default_for_score_variants: ClassVar[str] = ""
    # renders VALUE_DIM: V, O and dO with a head dim other than Q's and K's (MLA), launched as such
    serves_value_dim: ClassVar[bool] = False
    # renders DROPOUT: attention dropout drawn in the kernels from a (seed, offset) pair (dense calls)
    serves_dropout: ClassVar[bool] = False
    # renders PAGED: packed queries against K/V pages found through a block table (`launch_varlen`)
    serves_paged: ClassVar[bool] = False

    def __init__(self, knobs: dict, kernels: ModuleType, score: ScoreVariant = PLAIN, value_dim: bool = False,
                 dropout: bool = False, paged: bool = False):
        if not self.computes(score):
            raise ValueError(f"{self.name} computes no attention variants {score.key!r}")
        if value_dim and not self.serves_value_dim:
            raise ValueError(f"{self.name} takes no value head dim other than the query's")
        if dropout and not self.serves_dropout:
            raise ValueError(f"{self.name} renders no attention dropout")
        if paged and not self.serves_paged:
            raise ValueError(f"{self.name} reads no paged K/V cache")
        self.knobs = dict(knobs)
        self.kernels = kernels
        self.score = score
        self.value_dim = value_dim  # rendered with VALUE_DIM: takes V's head dim from v's shape
        self.dropout = dropout  # rendered with DROPOUT: every launch takes a `dropout.DropoutArgs`
        self.paged = paged  # rendered with PAGED: packed launches only, each with its block table

    @classmethod
    def computes(cls, score: ScoreVariant) -> bool:
        """Whether the family's kernels compute the attention variants `score` (plain: every family)."""
        return score.plain or (cls.serves_score_variants and (cls.serves_user_mods or not score.user))

    def dropout_kernel_args(self, args, compile_only: bool = False) -> tuple:
        """The kernels' dropout parameters (dropout_p, dropout_seed, dropout_offset) for a launch: none for
        a kernel rendered without DROPOUT (which refuses `args`), the call's `DropoutArgs` for one with it
        (a build without a launch takes stand-ins of the same types)."""
        if not self.dropout:
            if args is not None:
                raise ValueError(f"{self.name}: a kernel rendered without dropout got dropout arguments")
            return ()
        if args is None:
            if not compile_only:
                raise ValueError(f"{self.name}: a kernel rendered with dropout needs its (p, seed, offset) at each launch")
            return (0.5, 1 << 40, 0)  # (DropoutArgs.kernel_args' types: a float and two 64-bit integers)
        return args.kernel_args()

    @property
    def replayable(self) -> bool:
        """Whether every launch's work is in its JIT launches, so that `replay` may record and replay
        them (the replay check would catch the rest, unless the kernels need what the host prepared
        to finish at all)."""
        return True

    @property
    def uses_tma(self) -> bool:
        """The kernels read through TMA tensor descriptors (the caller registers Triton's scratch
        allocator and checks the tensors' alignment first)."""
        return self.knobs.get("LOADS") == "tma"

    def supports(self, q, k, v, o) -> str | None:
        """Why these (B, H, N, D) tensors cannot be taken (beyond TMA alignment), or None."""
        return self.value_dim_refusal(q, v)

    def value_dim_refusal(self, q, v) -> str | None:
        """A kernel rendered with VALUE_DIM takes only V of another head dim than Q's, one rendered
        without it only V of Q's: else the reason."""
        if (v.shape[-1] != q.shape[-1]) != self.value_dim:
            return (f"{self.name} rendered {'with' if self.value_dim else 'without'} a value head dim of its own "
                    f"got V of head dim {v.shape[-1]} for Q of {q.shape[-1]}")
        return None


class ForwardFamily(Family):
    op = "fwd"

    @abc.abstractmethod
    def launch(self, *, q, k, v, o, lse, sm_scale: float, causal: bool, causal_offset: int,
               compile_only: bool = False, score_args=None) -> None:
        """q, o: (B, H, N_Q, D) views; k, v: (B, H_kv, N_K, D) views; lse: (B, H, N_Q) float32 (any
        strides), written in place. causal_offset: key j is visible to query i iff j <= i + causal_offset
        (and the position query i sits at for windows and ALiBi).
        compile_only: build (or fetch from Triton's cache) the binary for these argument types, no launch.
        score_args: the values of the `score` variants (`score_variant.ScoreArgs`; None: plain)."""

    def launch_varlen(self, *, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, sm_scale: float,
                      causal: bool, compile_only: bool = False, score_args=None, block_table=None) -> None:
        """Packed sequences: q, o (total_q, H, D); k, v (total_k, H_kv, D); lse (H, total_q) float32;
        cu_seqlens int32 (B + 1,). Causal (and windows, ALiBi) bottom-right per sequence. block_table
        (a kernel rendered `paged`, and only it): int32 (B, pages per sequence), k and v then paged
        caches (num_blocks, page_size, H_kv, D)."""
        raise NotImplementedError(f"{self.name} takes no packed sequences")


class BackwardFamily(Family):
    op = "bwd"

    @abc.abstractmethod
    def launch(self, *, q, k, v, o, lse, do, dq, dk, dv, sm_scale: float, causal: bool, causal_offset: int,
               compile_only: bool = False, score_args=None) -> None:
        """dq, dk, dv written in place from the forward's o and lse (layouts as the forward's).
        score_args: the values of the `score` variants, as the forward's (None: plain)."""

    def launch_varlen(self, *, q, k, v, o, lse, do, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                      max_seqlen_k: int, sm_scale: float, causal: bool, compile_only: bool = False,
                      score_args=None) -> None:
        raise NotImplementedError(f"{self.name} takes no packed sequences")


class DecodeFamily(Family):
    op = "decode"

    @abc.abstractmethod
    def launch(self, *, q, k_cache, v_cache, o, lse, sm_scale: float, causal: bool, seqlens, block_table=None,
               sm_count: int = 1, num_splits: int | None = None, compile_only: bool = False,
               tma_ok: bool = False, score_args=None) -> int:
        """q, o: (B, Q_LEN, H, D) any strides; k_cache, v_cache: (B, N_max, H_KV, D) or, with
        block_table (B, max_blocks) int32, pages (num_blocks, PAGE_SIZE, H_KV, D), any strides;
        seqlens: (B,) int32 contiguous, keys per sequence; lse: (B, H, Q_LEN) float32 contiguous.
        sm_count: the GPU's SMs; num_splits: a caller's split count (None or 0: the knob's).
        tma_ok: the caches' strides and alignment allow TMA descriptors. score_args: the values of the
        `score` variants (`score_variant.ScoreArgs`; None: plain), positions bottom-right (query token i
        at key position i + seqlen - Q_LEN). Returns the splits used."""
