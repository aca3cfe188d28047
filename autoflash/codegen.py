"""Kernel families: Variant -> device source (Jinja, `rendering`) -> a .py file in the kernel cache -> module ->
`Kernel` (the family's host object around it).

`@triton.jit` reads its function's source with `inspect`, so kernels must come from real files:
each variant is rendered once to `<kernel cache>/<family>-<op>-<knobs>-<hash>.py` (hash of the
template source, its includes, its host module and the variant; the readable part shows in
tracebacks and profiles) and imported from there, in this process and the next.

The family contract is `autoflash.families.base`: a family's `host.py` launches the rendered
kernels with keyword arguments, says which tensors it cannot take (`supports`) and whether it takes
packed sequences. Everything else (the dispatcher, the correctness gate, timing, bench) goes through
`Kernel`, which owns the launch preparation (the TMA descriptor allocator, the TMA alignment check,
batch chunks that fit a grid axis).

A variant can also be rendered from another template file (`template_file=`), e.g. the previous
version of a template, to time both with the same knobs before retuning (`autoflash bench
--baseline-template`); the family's host launches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import linecache
import os
import pathlib
import sys
import threading
from types import ModuleType

import torch
import triton

from autoflash import families, replay
from autoflash.kernel_cache import _cached_source_file, kernel_cache_dir  # noqa: F401 (part of the module's face)
from autoflash.rendering import (TemplateError, check_template, family_for_hash, name_kernels, readable_knobs,  # noqa: F401
                                 render, replaced_hashes, source_path, template_hash, template_source, variant_hash)
from autoflash.score_variant import PLAIN, ScoreVariant
from autoflash.space import Variant, load_space

_lock = threading.Lock()
_modules: dict[tuple[str, str, str], ModuleType] = {}


def _exec_source(name: str, path: pathlib.Path, source: str) -> ModuleType:
    """Execute the source rendered here (never a .pyc from __pycache__, never the file's bytes, which
    someone else may have replaced) as module `name` whose __file__ is `path`. linecache is primed
    with the same text, so `inspect` (and `@triton.jit`) read what was executed."""
    filename = str(path)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # mtime None: kept
    code = compile(source, filename, "exec", dont_inherit=True)
    module = ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load(variant: Variant, template_file: str | os.PathLike | None = None, score: ScoreVariant = PLAIN,
         value_dim: bool = False, dropout: bool = False, paged: bool = False) -> "Kernel":
    """Render (if not cached on disk), import (if not imported yet) and return the variant's Kernel.
    score: the attention variants rendered into it (a family that serves them: `score_variant`).
    value_dim: rendered for V, O and dO of a head dim other than Q's and K's (a family that serves them).
    dropout: rendered with attention dropout (`autoflash.dropout`; a family that serves it).
    paged: rendered to read K and V from a paged cache through a block table (a family that serves it)."""
    # The interpreter flag is part of the key: @triton.jit decides at import time whether the
    # kernel runs compiled or interpreted.
    key = (variant.family, variant_hash(variant, template_file, score, value_dim, dropout, paged),
           os.environ.get("TRITON_INTERPRET", "0"))
    kernel = _modules.get(key)
    if kernel is not None:
        return kernel
    if load_space(variant.family).vendor:
        if not score.plain or value_dim or dropout or paged:
            raise ValueError(f"{variant.family} (a vendor family) renders no kernel for attention variants "
                             f"({score.key or ('a value head dim of its own' if value_dim else 'dropout or pages')})")
        from autoflash.vendor import SdpaKernel

        kernel = _modules[key] = SdpaKernel(load_space(variant.family).check_declared(variant.as_dict()))
        return kernel
    with _lock:
        kernel = _modules.get(key)
        if kernel is not None:
            return kernel
        source = render(variant, template_file, score, value_dim, dropout, paged)
        path = _cached_source_file(source_path(variant, template_file, score, value_dim, dropout, paged), source)
        name = f"autoflash_kernels.{path.stem}_{key[2]}"
        try:
            module = _exec_source(name, path, source)
        except SyntaxError as e:
            if template_file is None:  # (the package's own templates are tested: a bug, not input)
                raise
            raise TemplateError(f"{template_file}: renders no valid Python for {variant.short()}: {path}, line "
                                f"{e.lineno}: {e.msg}") from None
        name_kernels(module, variant)
        kernel = _modules[key] = Kernel(variant, module, score, value_dim, dropout, paged)
        return kernel


def load_for(variant: Variant, head_dim_v: int | None, score: ScoreVariant = PLAIN) -> "Kernel":
    """The kernel a tuning run or bench measures for a problem: rendered with VALUE_DIM where V has a
    head dim of its own (`head_dim_v` set) and with the problem's attention variants `score`, as the
    dispatcher serves it; a vendor kernel takes such V as torch does, with nothing rendered. An own
    family that renders no VALUE_DIM, or a family that computes no variants asked for, raises ValueError."""
    return load(variant, score=score, value_dim=head_dim_v is not None and not load_space(variant.family).vendor)


@contextlib.contextmanager
def interpreter_off():
    """Import and compile kernels for the GPU while TRITON_INTERPRET is set (Gluon kernels never
    run in Triton's interpreter: with it set, the code generator treats their nested @gluon.jit
    helpers as interpreted functions and refuses them). Compiling for sm90 works on a CPU."""
    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


# --------------------------------------------------------------------------- the typed wrapper
def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a unit last stride and 16-byte aligned base and strides."""
    for t in tensors:
        e = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * e) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _allocate_scratch(size: int, alignment: int, stream):
    """Global scratch for in-kernel tensor descriptors (Triton asks for it at every launch of such a
    kernel: kept cheap, the environment is read before asking torch about CUDA)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreted or not _has_cuda() else "cuda")


@functools.cache
def _has_cuda() -> bool:
    return torch.cuda.is_available()


def ensure_allocator() -> None:
    # The allocator lives in a ContextVar: set it in each thread that launches (autograd runs a
    # backward on a thread of its own), unless the user already installed one. Before every launch,
    # not only of kernels that read through TMA (`uses_tma`): a backward with pointer loads builds a
    # descriptor on the device for its TMA reduce-add of dQ, and asked for scratch on autograd's
    # thread with none set (an odd head dim's causal backward on an H100).
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_allocate_scratch)


# CUDA caps grid axes 1 and 2 at 65535 programs, and a dense launch puts batch x heads on one of
# them (which one depends on the grid order): a call with more runs in batch chunks (views).
GRID_AXIS_MAX = 65535


def batch_chunks(batch: int, heads: int, *tensors):
    """The tensors (batch-major; None passes through) as they go to each launch: all of them at once
    when batch x heads programs fit GRID_AXIS_MAX (the common case: no views made), else batch
    slices that do."""
    per = max(1, GRID_AXIS_MAX // max(heads, 1))
    if batch <= per:
        return [tensors]
    return [tuple(None if t is None else t[first:first + per] for t in tensors) for first in range(0, batch, per)]


def make_host(variant: Variant, module: ModuleType, score: ScoreVariant = PLAIN, value_dim: bool = False,
              dropout: bool = False, paged: bool = False):
    """The family's host object (`families.base.Family`) for this variant's rendered module."""
    flags = {name: True for name, on in (("value_dim", value_dim), ("dropout", dropout), ("paged", paged)) if on}
    return families.host_class(variant.family)(variant.as_dict(), module, score, **flags)


def _chunk_dropout(dropout, first: int, q, k) -> dict:
    """The launch's dropout keyword for the batch chunk starting at batch entry `first`: its Philox
    counters continue the whole call's (the kernels number a chunk's entries from 0)."""
    if dropout is None:
        return {}
    return {"dropout_args": dropout.shifted_rows(first * q.shape[1] * q.shape[2], k.shape[2]) if first else dropout}


class Kernel:
    """One compiled variant behind the family contract: typed forward/backward launches that
    prepare what the kernels need (TMA scratch allocator, batch chunks) and say which tensors the
    family cannot take. `module`: the rendered device code; `host`: the family's launcher; `score`: the
    attention variants rendered into it (`score_variant`), whose values each forward launch takes."""

    __slots__ = ("variant", "module", "host", "op", "family", "uses_tma", "score", "value_dim", "dropout", "paged")
    vendor = False  # generated by autoflash (see autoflash/vendor.py for the others)
    has_lse = True  # forward writes the log-sum-exp a backward needs

    @staticmethod
    def takes_causal_offset(causal: bool, causal_offset: int) -> bool:
        return True  # any alignment of the causal mask

    def __init__(self, variant: Variant, module: ModuleType, score: ScoreVariant = PLAIN, value_dim: bool = False,
                 dropout: bool = False, paged: bool = False):
        self.host = make_host(variant, module, score, value_dim, dropout, paged)
        self.score, self.value_dim, self.dropout, self.paged = score, value_dim, dropout, paged
        if self.host.op != variant.op:
            raise ValueError(f"{variant.family}: the host launches {self.host.op!r}, the space says {variant.op!r}")
        self.variant, self.module, self.op, self.family = variant, module, variant.op, variant.family
        self.uses_tma = self.host.uses_tma

    def unsupported(self, q, k, v, o) -> str | None:
        """Why this kernel cannot take these (B, H, N, D) tensors, or None. o: the output (fwd) or dO (bwd)."""
        if self.uses_tma and not tma_compatible(q, k, v, o):
            return "TMA needs a unit last stride and 16-byte aligned base and strides"
        return self.host.supports(q, k, v, o)

    def forward(self, q, k, v, o, lse, sm_scale: float, causal: bool, causal_offset: int, score_args=None,
                dropout=None) -> None:
        """o (B, H, Nq, D) and lse (B, H, Nq) float32 written in place. score_args: the values of the
        kernel's attention variants (`score_variant.ScoreArgs`; None for a plain kernel). dropout: the
        call's `dropout.DropoutArgs` (a kernel rendered with dropout; None for the others)."""
        ensure_allocator()
        slopes = score_args.alibi_slopes if score_args is not None and score_args.per_batch() else None
        first = 0
        for q_, k_, v_, o_, lse_, slopes_ in batch_chunks(q.shape[0], q.shape[1], q, k, v, o, lse, slopes):
            chunk_args = score_args if slopes_ is None else dataclasses.replace(score_args, alibi_slopes=slopes_)
            self.host.launch(q=q_, k=k_, v=v_, o=o_, lse=lse_, sm_scale=sm_scale, causal=causal,
                             causal_offset=causal_offset, **({} if chunk_args is None else {"score_args": chunk_args}),
                             **_chunk_dropout(dropout, first, q, k))
            first += q_.shape[0]

    def backward(self, q, k, v, o, lse, do, dq, dk, dv, sm_scale: float, causal: bool, causal_offset: int,
                 score_args=None, dropout=None) -> None:
        """dq, dk, dv written in place from the forward's o and lse. score_args: as `forward`'s (the
        sinks' gradient is not the kernel's: `autoflash.variant_training`). dropout: the forward's
        `dropout.DropoutArgs` (the same seed and offset: the kernels draw its mask again)."""
        ensure_allocator()
        slopes = score_args.alibi_slopes if score_args is not None and score_args.per_batch() else None
        first = 0
        for q_, k_, v_, o_, lse_, do_, dq_, dk_, dv_, slopes_ in batch_chunks(q.shape[0], q.shape[1], q, k, v, o, lse,
                                                                              do, dq, dk, dv, slopes):
            chunk_args = score_args if slopes_ is None else dataclasses.replace(score_args, alibi_slopes=slopes_)
            self.host.launch(q=q_, k=k_, v=v_, o=o_, lse=lse_, do=do_, dq=dq_, dk=dk_, dv=dv_, sm_scale=sm_scale,
                             causal=causal, causal_offset=causal_offset,
                             **({} if chunk_args is None else {"score_args": chunk_args}),
                             **_chunk_dropout(dropout, first, q, k))
            first += q_.shape[0]

    @property
    def supports_varlen(self) -> bool:
        """The family also takes packed variable-length sequences (`launch_varlen`; not with dropout)."""
        return self.host.supports_varlen and not self.dropout

    def forward_varlen(self, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, sm_scale: float,
                       causal: bool, score_args=None, block_table=None) -> None:
        """Packed sequences: q, o (total_q, H, D), k, v (total_k, H_kv, D), lse (H, total_q) float32,
        cu_seqlens int32 (B + 1,). Causal is bottom-right per sequence (windows and ALiBi too).
        block_table: int32 (B, pages per sequence) for a kernel rendered `paged`: k, v are then paged
        caches (num_blocks, page_size, H_kv, D), sequence b's keys the first cu_seqlens_k[b+1] -
        cu_seqlens_k[b] rows of its pages."""
        ensure_allocator()
        self.host.launch_varlen(q=q, k=k, v=v, o=o, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=max_seqlen_q, sm_scale=sm_scale, causal=causal,
                                **({} if score_args is None else {"score_args": score_args}),
                                **({} if block_table is None else {"block_table": block_table}))

    def backward_varlen(self, q, k, v, o, lse, do, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        max_seqlen_k: int, sm_scale: float, causal: bool, score_args=None) -> None:
        """Gradients of `forward_varlen` (same layouts), written into dq, dk, dv."""
        ensure_allocator()
        self.host.launch_varlen(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                sm_scale=sm_scale, causal=causal,
                                **({} if score_args is None else {"score_args": score_args}))

    def attention(self, q, k, v, sm_scale: float, causal: bool, causal_offset: int = 0) -> torch.Tensor:
        """The output in q's memory layout (the log-sum-exp is discarded)."""
        out = torch.empty_like(q)
        self.forward(q, k, v, out, torch.empty(q.shape[:3], device=q.device, dtype=torch.float32), sm_scale,
                     causal, causal_offset)
        return out

    def bind_forward(self, q, k, v, o, lse, sm_scale: float, causal: bool, causal_offset: int):
        """Launch once through the module and return a direct launcher `fn(q, k, v, o, lse)` for
        later calls whose tensors have these shapes, strides, dtypes, alignment and device (the
        caller's memo guarantees it), or None (then launch with `forward`). See `replay`."""
        return replay.bind(self.module, lambda: self.forward(q, k, v, o, lse, sm_scale, causal, causal_offset),
                           (q, k, v, o, lse), outputs=(3, 4), before_launch=ensure_allocator)

    def bind_backward(self, q, k, v, o, lse, do, dq, dk, dv, sm_scale: float, causal: bool, causal_offset: int):
        """As `bind_forward`, for `backward`: `fn(q, k, v, o, lse, do, dq, dk, dv)` or None (also for a
        family whose launches do work outside their kernels: `Family.replayable`)."""
        if not self.host.replayable:
            self.backward(q, k, v, o, lse, do, dq, dk, dv, sm_scale, causal, causal_offset)
            return None
        return replay.bind(self.module, lambda: self.backward(q, k, v, o, lse, do, dq, dk, dv, sm_scale, causal,
                                                              causal_offset),
                           (q, k, v, o, lse, do, dq, dk, dv), outputs=(6, 7, 8), before_launch=ensure_allocator)

    def decode(self, q, k_cache, v_cache, o, lse, sm_scale: float, causal: bool, seqlens, block_table=None,
               sm_count: int = 1, num_splits: int | None = None, compile_only: bool = False, score_args=None):
        """A decode-family launch: q, o (B, Q, H, D); caches (B, N, H_kv, D) or pages with block_table;
        seqlens (B,) int32 keys per sequence; lse (B, H, Q) float32. Returns the KV splits used.
        score_args: the values of the attention variants rendered in (`score_variant.ScoreArgs`)."""
        if self.op != "decode":
            raise TypeError(f"{self.family} is not a decode kernel family")
        ensure_allocator()
        paged = block_table is not None  # (a paged cache's pages are shared by the batch: not sliced)
        slopes = score_args.alibi_slopes if score_args is not None and score_args.per_batch() else None
        for qc, oc, lc, sc, tc, ac, kc, vc in batch_chunks(q.shape[0], k_cache.shape[2],  # (axis 1: batch x KV heads)
                                                           q, o, lse, seqlens, block_table, slopes,
                                                           *((None, None) if paged else (k_cache, v_cache))):
            kc, vc = (k_cache, v_cache) if paged else (kc, vc)
            chunk_args = score_args if ac is None else dataclasses.replace(score_args, alibi_slopes=ac)
            splits = self.host.launch(q=qc, k_cache=kc, v_cache=vc, o=oc, lse=lc, sm_scale=sm_scale, causal=causal,
                                      seqlens=sc, block_table=tc, sm_count=sm_count, num_splits=num_splits,
                                      compile_only=compile_only, tma_ok=self.uses_tma and tma_compatible(kc, vc),
                                      score_args=chunk_args)
        return splits

    def bind_decode(self, q, k_cache, v_cache, o, lse, sm_scale: float, causal: bool, seqlens, block_table=None,
                    sm_count: int = 1, num_splits: int | None = None):
        """As `bind_forward`, for `decode`: `fn(q, k_cache, v_cache, o, lse, seqlens[, block_table])`
        (block_table exactly when this call has one), or None. The split count is fixed by the
        shapes, so it is bound with them."""
        tensors = (q, k_cache, v_cache, o, lse, seqlens) + ((block_table,) if block_table is not None else ())
        return replay.bind(self.module, lambda: self.decode(q, k_cache, v_cache, o, lse, sm_scale, causal, seqlens,
                                                            block_table, sm_count, num_splits),
                           tensors, outputs=(3, 4), before_launch=ensure_allocator)

    def compile_for(self, q, k, v, causal: bool, causal_offset: int, page: int | None = None,
                    score_args=None) -> None:
        """Build (or fetch from Triton's cache) the binary for these argument types, no launch.
        q, k, v: (B, H, N, D) as the other ops take them (a decode kernel sees them as a query of
        N_q tokens and a full cache: (B, N, H_kv, D), or pages of `page` tokens behind a block table).
        score_args: the attention variants' values of a kernel rendered with them (`ScoreArgs`)."""
        if self.op == "decode":
            qd = q.transpose(1, 2)
            lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            seqlens = torch.full((q.shape[0],), k.shape[2], device=q.device, dtype=torch.int32)
            table = None
            if page is None:
                kd, vd = (t.transpose(1, 2).contiguous() for t in (k, v))
            else:  # (only the layout matters to the compiler: one page, one table entry per sequence)
                kd, vd = (t.new_empty((1, page, t.shape[1], t.shape[3])) for t in (k, v))
                table = torch.zeros((q.shape[0], 1), device=q.device, dtype=torch.int32)
            self.decode(qd, kd, vd, torch.empty_like(qd), lse, 1.0, causal, seqlens, table, compile_only=True,
                        score_args=score_args)
            return
        ensure_allocator()
        scored = {} if score_args is None else {"score_args": score_args}
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        out = q.new_empty((*q.shape[:3], v.shape[3]))  # (V's head dim: MLA-like problems have their own)
        if self.op == "bwd":
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            self.host.launch(q=q, k=k, v=v, o=torch.empty_like(out), lse=lse, do=out, dq=dq, dk=dk, dv=dv, sm_scale=1.0,
                             causal=causal, causal_offset=causal_offset, compile_only=True, **scored)
        else:
            self.host.launch(q=q, k=k, v=v, o=out, lse=lse, sm_scale=1.0, causal=causal, causal_offset=causal_offset,
                             compile_only=True, **scored)

    def __repr__(self) -> str:
        return (f"Kernel({self.family}: {self.variant.short()}{', own value head dim' if self.value_dim else ''}"
                f"{', dropout' if self.dropout else ''}{', paged' if self.paged else ''})")
