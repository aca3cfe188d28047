"""Problem key from tensors -> variant -> compiled kernel module -> launch.

The hot path: everything per key (variant choice, module import) is computed once and kept in
an in-memory table; a call does a dict lookup and a kernel launch. This module never imports
the tuner, Optuna or the measurement code.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import warnings

import torch
import triton

from autoflash import codegen
from autoflash.problem import GPUFingerprint, Problem, dtype_name, gpu_fingerprint, interpreter_enabled, seqlen_bucket
from autoflash.space import InvalidVariant, Variant, load_space

log = logging.getLogger("autoflash")


def default_variant(op: str, dtype: str, head_dim: int, has_tma: bool) -> Variant:
    """The built-in variant used when nothing is tuned for a problem: choices measured on an H200
    (docs/results/) that pass the correctness gate there."""
    if op == "bwd":
        # Gated winners of the H200 backward tuning (docs/results/). Not 32-row dK/dV query tiles
        # pipelined 2+ stages deep with a separate dQ: Triton 3.6 computes a wrong dK with them there.
        if head_dim <= 64:
            # The tuned winner of the d64 backward problems at 4k and 16k tokens (causal and not); at 1k
            # tokens it measured faster than that size's tuned 64x64 atomic winner too (docs/results/).
            tiles = dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=128, BLOCK_N2=64, DQ_MODE="separate", num_stages=3,
                         LOADS="tma" if has_tma else "pointer")
        elif head_dim <= 128:
            # The tuned winner of every d128 MHA backward problem on the H200 (1k-16k, causal and not);
            # the causal GQA problem's winner is its heavy_first twin (docs/results/).
            tiles = dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, DQ_MODE="separate", num_stages=2,
                         LOADS="tma" if has_tma else "pointer")
        else:  # accumulators of 256 columns: small tiles, and a separate dQ kernel
            tiles = dict(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, DQ_MODE="separate", num_stages=3,
                         LOADS="pointer")
        if dtype == "float32":
            tiles["num_stages"] = 2
        return Variant.of(op, dict(tiles, num_warps=4, GRID_ORDER="kv_major"))
    if op != "fwd":
        raise ValueError(f"no default variant for op {op!r}")
    if head_dim <= 64:
        tiles = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    elif head_dim <= 128:
        tiles = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    else:
        # The exhaustive d256 sweeps on the H200 found 64x64 w4 s3 best on all three complete
        # problems (1.16-1.34x the 64x32 s2 used before).
        tiles = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    if dtype == "float32":
        tiles["num_stages"] = 2
    return Variant.of(op, dict(
        tiles, LOADS="tma" if has_tma else "pointer", MASK_MODE="split", KV_ORDER="ascending",
        GRID_ORDER="m_major", WARP_SPECIALIZE=False))


def nearest_valid(preferred: Variant, problem: Problem, device: GPUFingerprint) -> Variant:
    """`preferred` if the space allows it here, else the valid variant differing in fewest knobs."""
    space = load_space(preferred.op)
    if not space.violations(preferred, problem, device):
        return preferred
    want = preferred.as_dict()
    valid = space.valid_variants(problem, device)
    if not valid:
        raise RuntimeError(f"the {preferred.op} search space has no valid variant for {problem.key} on {device.name}")
    return min(valid, key=lambda v: (sum(v[k] != want[k] for k in want), v.json()))


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a unit last stride and 16-byte aligned base and strides."""
    for t in tensors:
        e = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * e) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _allocate_scratch(size: int, alignment: int, stream):
    """Global scratch for in-kernel tensor descriptors (Triton asks for it at launch)."""
    device = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_allocator() -> None:
    # The allocator lives in a ContextVar: set it in each thread that launches TMA kernels,
    # unless the user already installed one.
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_allocate_scratch)


def prepare_launch(module) -> None:
    """What a kernel module needs before it launches: a TMA variant, the descriptor scratch allocator."""
    if module.LOADS == "tma":
        ensure_allocator()


class WinnerTable:
    """Tuned winners that apply to one GPU fingerprint and the current templates, in memory.

    Loaded once: the user DB ($AUTOFLASH_DB or ~/.cache/autoflash/autoflash.db) first, then the
    databases shipped in the package's cache/ folder (a user's own tuning wins). Only rows whose
    GPU key and template hash match are kept, and each row's variant is validated against the
    declared search space before it can ever be rendered. A missing, locked, corrupt or
    foreign-version DB costs one warning, never an error.
    """

    def __init__(self, device: GPUFingerprint, paths: list | None = None):
        self.device = device
        self.rows: dict[str, Variant] = {}  # problem key -> variant
        self.origins: dict[str, str] = {}  # problem key -> the DB file its winner came from
        for path in self.default_paths() if paths is None else paths:
            self._load(path)

    @staticmethod
    def default_paths() -> list:
        from autoflash import resources
        from autoflash.store import default_db_path

        return [default_db_path(), *resources.shipped_databases()]

    def _load(self, path) -> None:
        from autoflash.store import Store, StoreError

        try:
            if not path.is_file():
                return
            # A short busy timeout: a DB locked by a writer costs a model one warning, not a stall.
            store = Store(path, readonly=True, busy_timeout_ms=500)
            try:
                rows = store.winners(self.device.key)
            finally:
                store.close()
        except Exception as e:  # ours, or sqlite3's for a damaged file: never break the caller's model
            detail = str(e) if isinstance(e, (StoreError, OSError, ValueError)) else f"{type(e).__name__}: {e}"
            warnings.warn(f"autoflash: ignoring results DB {path}: {detail}", RuntimeWarning, stacklevel=2)
            return
        for row in rows:
            if row["problem"] in self.rows:
                continue  # an earlier DB (the user's) already decided this problem
            try:
                problem = Problem.from_key(row["problem"])
                if row["template_hash"] != codegen.template_hash(problem.op):
                    continue  # tuned for another version of the template
                variant = load_space(problem.op).validate(json.loads(row["variant"]), problem, self.device)
            except (InvalidVariant, ValueError, KeyError, TypeError) as e:
                warnings.warn(f"autoflash: rejected winner for {row.get('problem')!r} in {path}: {e}",
                              RuntimeWarning, stacklevel=2)
                continue
            self.rows[problem.key] = variant
            self.origins[problem.key] = str(path)

    def lookup(self, problem: Problem) -> tuple[Variant | None, str]:
        """(variant, how): exact bucket, else the nearest seqlen bucket of the same kind, else None."""
        variant, how, _ = self.explain(problem)
        return variant, how

    def explain(self, problem: Problem) -> tuple[Variant | None, str, str | None]:
        """(variant, how, DB file it came from): like `lookup`, plus the winner's origin."""
        exact = self.rows.get(problem.key)
        if exact is not None:
            return exact, "exact", self.origins[problem.key]
        best, best_distance = None, math.inf
        for key, variant in self.rows.items():
            p = Problem.from_key(key)
            if (p.op, p.dtype, p.head_dim, p.causal, p.gqa_group) != (
                    problem.op, problem.dtype, problem.head_dim, problem.causal, problem.gqa_group):
                continue
            distance = abs(math.log2(p.seqlen_q / problem.seqlen_q)) + abs(math.log2(p.seqlen_k / problem.seqlen_k))
            if distance < best_distance or (distance == best_distance and key < best[0]):
                best, best_distance = (key, variant), distance
        if best is None:
            return None, "default", None
        return best[1], f"nearest ({best[0]})", self.origins[best[0]]


class Dispatcher:
    """Maps a forward call to a kernel module. One per process (see `get_dispatcher`)."""

    def __init__(self, winner_paths: list | None = None):
        self._table: dict[tuple, object] = {}
        self._winners: dict[int | None, WinnerTable] = {}
        self._winner_paths = winner_paths
        self._lock = threading.Lock()
        self._told_untuned: set = set()
        self._tuned_on_miss: set = set()
        # api's inference fast path: validated call signature -> (kernel module, lse scratch, scale)
        self.inference_calls: dict[tuple, tuple] = {}

    def winners(self, device: GPUFingerprint, device_index=None) -> WinnerTable:
        table = self._winners.get(device_index)
        if table is None:
            table = self._winners[device_index] = WinnerTable(device, self._winner_paths)
        return table

    def problem_for(self, q: torch.Tensor, k: torch.Tensor, causal: bool, op: str = "fwd") -> Problem:
        return Problem(op=op, dtype=dtype_name(q.dtype), head_dim=q.shape[-1], causal=causal,
                       gqa_group=q.shape[1] // k.shape[1], seqlen_q=seqlen_bucket(q.shape[2]),
                       seqlen_k=seqlen_bucket(k.shape[2]))

    def _tune_on_miss(self, problem: Problem, q, k, device: GPUFingerprint, device_index) -> None:
        """AUTOFLASH_TUNE_ON_MISS=1: tune a problem with no exact winner the first time it is seen
        (a short, budgeted run into the user DB), then reload the winners. Opt-in only: this is the
        one place the runtime path imports the tuner. Never while a CUDA graph is being captured."""
        import os

        if os.environ.get("AUTOFLASH_TUNE_ON_MISS", "0") in ("", "0") or problem.key in self._tuned_on_miss:
            return
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self._tuned_on_miss.add(problem.key)
        from autoflash import tune
        from autoflash.problem import Shape
        from autoflash.store import Store

        shape = Shape(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q=q.shape[2],
                      seqlen_k=k.shape[2], head_dim=q.shape[3], causal=problem.causal, dtype=problem.dtype,
                      op=problem.op)
        log.info("autoflash: tuning %s on first use (AUTOFLASH_TUNE_ON_MISS=1)", problem.key)
        options = tune.TuneOptions(trials=int(os.environ.get("AUTOFLASH_TUNE_ON_MISS_TRIALS", "16")), budget_s=120,
                                   interpret=not q.is_cuda)
        store = Store()
        try:
            tune.tune([shape], store, options, command="tune on miss")
        finally:
            store.close()
        self._winners.pop(device_index, None)  # reload, now with the new winner
        self.inference_calls.clear()

    def variant_for(self, problem: Problem, device: GPUFingerprint, tma_ok: bool, device_index=None) -> Variant:
        """The tuned winner for this problem (exact or nearest bucket), else the built-in default."""
        tuned, how = self.winners(device, device_index).lookup(problem)
        if tuned is not None:
            log.debug("autoflash: %s -> tuned winner (%s)", problem.key, how)
            preferred = tuned
        else:
            if not self.winners(device, device_index).rows and device.key not in self._told_untuned:
                self._told_untuned.add(device.key)
                log.info("autoflash: no tuned kernels for %s; using built-in defaults (run `autoflash tune`)",
                         device.name)
            preferred = default_variant(problem.op, problem.dtype, problem.head_dim, device.cc_major >= 9)
        if preferred.as_dict().get("LOADS") == "tma" and not tma_ok:
            # (warp specialization is offered only with TMA loads; the backward has no such knob)
            no_ws = {"WARP_SPECIALIZE": False} if "WARP_SPECIALIZE" in preferred.as_dict() else {}
            preferred = preferred.replace(LOADS="pointer", **no_ws)
        return nearest_valid(preferred, problem, device)

    def module_for(self, q, k, v, o, causal: bool, op: str = "fwd"):
        """The compiled kernel module for these tensors. Hot path: one dict lookup keyed by exact
        shapes, strides and 16-byte alignment; everything else happens once per key.
        o: the fourth tensor a TMA variant reads or writes: the output (fwd), dO (bwd)."""
        aligned = not ((q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) & 15)
        key = (op, causal, q.dtype, q.device, q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(),
               aligned)
        module = self._table.get(key)
        if module is None:
            with self._lock:
                if len(self._table) > 4096:  # many distinct shapes: keep the tables bounded
                    self._table.clear()
                    self.inference_calls.clear()
                device_index = q.device.index if q.is_cuda else None
                device = gpu_fingerprint(device_index)
                problem = self.problem_for(q, k, causal, op)
                if problem.key not in self.winners(device, device_index).rows and not torch.compiler.is_compiling():
                    self._tune_on_miss(problem, q, k, device, device_index)
                variant = self.variant_for(problem, device, aligned and tma_compatible(q, k, v, o), device_index)
                log.debug("autoflash: %s -> %s", problem.key, variant.json())
                module = codegen.load(variant)
                self._table[key] = module
        return module

    def forward(self, q, k, v, o, lse, sm_scale: float, causal: bool, causal_offset: int) -> None:
        module = self.module_for(q, k, v, o, causal)
        prepare_launch(module)
        module.launch(q, k, v, o, lse, sm_scale, causal, causal_offset)

    def backward(self, q, k, v, o, lse, do, dq, dk, dv, sm_scale: float, causal: bool, causal_offset: int) -> None:
        module = self.module_for(q, k, v, do, causal, op="bwd")
        prepare_launch(module)
        module.launch(q, k, v, o, lse, do, dq, dk, dv, sm_scale, causal, causal_offset)


_dispatcher: Dispatcher | None = None


def get_dispatcher() -> Dispatcher:
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = Dispatcher()
    return _dispatcher
