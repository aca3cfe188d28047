"""Problem key from tensors -> winner (any kernel family) -> compiled `Kernel`.

The hot path: everything per key (variant choice, module import) is computed once and kept in
an in-memory table; a call does a dict lookup and a kernel launch. This module never imports
the tuning side or Optuna. Tune-on-miss (opt-in, AUTOFLASH_TUNE_ON_MISS=1) runs `autoflash tune`
in a child process (`python -m autoflash`, never the user's program), or a hook the tuning side
registered with `set_miss_hook`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import warnings
from typing import Callable

import torch

from autoflash import codegen
from autoflash.codegen import Kernel
from autoflash.device import GPUFingerprint, gpu_fingerprint
from autoflash.problem import Problem, Shape, dtype_name, seqlen_bucket, shape_work_bucket
from autoflash.space import InvalidVariant, Variant, default_variant, load_space
from autoflash.vendor import VENDOR_TIE_MARGIN

MissHook = Callable[[Shape], None]
_miss_hook: MissHook | None = None


def set_miss_hook(hook: MissHook | None) -> MissHook | None:
    """Install what tune-on-miss runs for a problem with no exact winner (None: the built-in child
    process). Returns the previous hook. The tuning side registers here; the runtime never imports it."""
    global _miss_hook
    previous, _miss_hook = _miss_hook, hook
    return previous

log = logging.getLogger("autoflash")


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
        self.rows: dict[str, Variant] = {}  # problem key -> variant (of any current family)
        self.origins: dict[str, str] = {}  # problem key -> the DB file its winner came from
        self._ms: dict[str, float] = {}  # problem key -> the winner's rank between families (see _load)
        # The same for autoflash's own families only (a vendor winner is stored beside the best own)
        self.own_rows: dict[str, Variant] = {}
        self.own_origins: dict[str, str] = {}
        self._own_ms: dict[str, float] = {}
        # Stored winners of this GPU that cannot be served (and why): calls of those problems get
        # what serves instead, so a benchmark says so (each one is also a RuntimeWarning)
        self.rejected: list[str] = []
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
            self.rejected.append(f"results DB {path}: {detail}")
            return
        decided = set(self.rows)  # an earlier DB (the user's) already decided these problems
        own_decided = set(self.own_rows)
        stale = 0
        for row in rows:
            if row["problem"] in decided and row["problem"] in own_decided:
                continue
            try:
                problem = Problem.from_key(row["problem"])
                family = codegen.family_for_hash(problem.op, row["template_hash"], earlier=True)
                if family is None:
                    stale += 1  # tuned for another version of the templates, not carried over by `replaces`
                    continue
                space, knobs = load_space(family), json.loads(row["variant"])
                if row["template_hash"] != codegen.template_hash(family) and isinstance(knobs, dict):
                    knobs = {**space.legacy, **knobs}  # a row of an earlier space or template (`replaces`)
                variant = space.validate(knobs, problem, self.device)
            except (InvalidVariant, ValueError, KeyError, TypeError) as e:
                warnings.warn(f"autoflash: rejected winner for {row.get('problem')!r} in {path}: {e}",
                              RuntimeWarning, stacklevel=2)
                self.rejected.append(f"{row.get('problem')} in {path}: {e}")
                continue
            ms = row.get("median_ms") if isinstance(row.get("median_ms"), (int, float)) else math.inf
            vendor = load_space(family).vendor
            # Between families an own kernel must beat a vendor one by the tie margin (see vendor.py).
            tables = [(self.rows, self.origins, self._ms, decided, ms if vendor else ms * (1 + VENDOR_TIE_MARGIN))]
            if not vendor:
                tables.append((self.own_rows, self.own_origins, self._own_ms, own_decided, ms))
            for winners, origins, medians, done, rank in tables:
                if problem.key in done or (problem.key in winners and medians[problem.key] <= rank):
                    continue  # two families' winners in one DB: the faster one serves
                winners[problem.key], origins[problem.key], medians[problem.key] = variant, str(path), rank
        if stale:  # once per DB opened: a template edit never demotes winners silently
            log.warning(
                "autoflash: %d winner(s) in %s were tuned for earlier templates that no `replaces` record "
                "carries over; their problems get the defaults until retuned", stale, path)

    def lookup(self, problem: Problem, own_only: bool = False) -> tuple[Variant | None, str]:
        """(variant, how): exact bucket, else the nearest bucket of the same kind, else None.
        own_only: among autoflash's own kernel families (no vendor kernel)."""
        variant, how, _ = self.explain(problem, own_only)
        return variant, how

    def explain(self, problem: Problem, own_only: bool = False) -> tuple[Variant | None, str, str | None]:
        """(variant, how, DB file it came from): like `lookup`, plus the winner's origin."""
        rows, origins = (self.own_rows, self.own_origins) if own_only else (self.rows, self.origins)
        exact = rows.get(problem.key)
        if exact is not None:
            return exact, "exact", origins[problem.key]
        best, best_distance = None, math.inf
        for key, variant in rows.items():
            p = Problem.from_key(key)
            if (p.op, p.dtype, p.head_dim, p.causal, p.gqa_group, p.page) != (
                    problem.op, problem.dtype, problem.head_dim, problem.causal, problem.gqa_group, problem.page):
                continue  # (a paged cache's block size is never bridged: its winner is another kernel's)
            work = work_distance(p.work, problem.work)
            if p.work is not None and work > NEAREST_WORK_MAX:
                continue  # another occupancy regime: the shape's default beats a big-batch winner
            distance = (abs(math.log2(p.seqlen_q / problem.seqlen_q)) + abs(math.log2(p.seqlen_k / problem.seqlen_k))
                        + work)
            if distance < best_distance or (distance == best_distance and key < best[0]):
                best, best_distance = (key, variant), distance
        if best is None:
            return None, "default", None
        return best[1], f"nearest ({best[0]})", origins[best[0]]


# A winner serves a problem of another occupancy bucket at most this many buckets (factors of 2 in
# parallel work) away; further, the variant the space's [[defaults]] pick for the shape serves.
NEAREST_WORK_MAX = 1


def work_distance(row_work: int | None, work: int | None) -> float:
    """Occupancy buckets between a stored winner's problem and a call's. A row stored before the key
    had the bucket (None) counts as 1.5 buckets away: still served by the nearest rule whatever the
    call's occupancy, but behind a winner tuned for this occupancy or the next one."""
    if work is None:
        return 0.0
    if row_work is None:
        return 1.5
    return float(abs(row_work - work))


class Dispatcher:
    """Maps a call's tensors to a compiled Kernel. One per process (see `get_dispatcher`)."""

    def __init__(self, winner_paths: list | None = None):
        self.kernels: dict[tuple, Kernel] = {}
        self._winners: dict[int | None, WinnerTable] = {}
        self._winner_paths = winner_paths
        self._lock = threading.Lock()
        self._told_untuned: set = set()
        self._tuned_on_miss: set = set()
        self._served: dict = {}  # (problem, device key) -> variant, for callers that launch themselves (decode)
        self._recorded: set = set()  # AUTOFLASH_RECORD: shapes written already (the op is not part)
        self._record_failed: set = set()

    def reset(self) -> None:
        """Forget loaded winners and compiled kernels (e.g. after tuning into the DB)."""
        with self._lock:
            self.kernels.clear()
            self._winners.clear()
            self._served.clear()

    def winners(self, device: GPUFingerprint, device_index=None) -> WinnerTable:
        table = self._winners.get(device_index)
        if table is None:
            table = self._winners[device_index] = WinnerTable(device, self._winner_paths)
        return table

    @staticmethod
    def problem_for(q: torch.Tensor, k: torch.Tensor, causal: bool, op: str, sm_count: int) -> Problem:
        return Problem(op=op, dtype=dtype_name(q.dtype), head_dim=q.shape[-1], causal=causal,
                       gqa_group=q.shape[1] // k.shape[1], seqlen_q=seqlen_bucket(q.shape[2]),
                       seqlen_k=seqlen_bucket(k.shape[2]),
                       work=shape_work_bucket(op, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], sm_count))

    def _tune_on_miss(self, problem: Problem, q, k) -> None:
        """AUTOFLASH_TUNE_ON_MISS=1: tune a problem with no exact winner the first time it is seen
        (a short, budgeted run into the user DB), then reload the winners. Never while a CUDA graph
        is captured or torch.compile traces; a failure costs one warning, never the model's call."""
        if os.environ.get("AUTOFLASH_TUNE_ON_MISS", "0").strip().lower() in ("", "0", "false", "no", "off"):
            return
        if problem.key in self._tuned_on_miss or torch.compiler.is_compiling():
            return
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self._tuned_on_miss.add(problem.key)
        shape = Shape(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q=q.shape[2],
                      seqlen_k=k.shape[2], head_dim=q.shape[3], causal=problem.causal, dtype=problem.dtype,
                      op=problem.op)
        log.info("autoflash: tuning %s on first use (AUTOFLASH_TUNE_ON_MISS=1)", problem.key)
        try:
            if _miss_hook is not None:
                _miss_hook(shape)
            else:
                tune_in_child_process(shape, q.device.index if q.is_cuda else None)
        except Exception as e:  # noqa: BLE001 - tuning is an optimisation: never break the model
            warnings.warn(f"autoflash: tune-on-miss failed for {problem.key}: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)
            return
        self.kernels.clear()
        self._winners.clear()  # reload, now with the new winner

    def variant_for(self, problem: Problem, device: GPUFingerprint, device_index=None, own_only: bool = False) -> Variant:
        """The tuned winner for this problem (exact or nearest bucket), else the built-in default.
        own_only: autoflash's own kernels only (no vendor kernel)."""
        tuned, how = self.winners(device, device_index).lookup(problem, own_only)
        if tuned is not None:
            log.debug("autoflash: %s -> tuned winner (%s)", problem.key, how)
            return tuned
        if not self.winners(device, device_index).rows and device.key not in self._told_untuned:
            self._told_untuned.add(device.key)
            log.info("autoflash: no tuned kernels for %s; using built-in defaults (run `autoflash tune`)",
                     device.name)
        return default_variant(problem.op, problem, device)

    def serving_variant(self, problem: Problem, device: GPUFingerprint) -> Variant:
        """`variant_for` remembered per problem (one dict lookup per call)."""
        key = (problem, device.key)
        variant = self._served.get(key)
        if variant is None:
            variant = self._served[key] = self.variant_for(problem, device)
        return variant

    def kernel_for(self, q, k, v, o, causal: bool, op: str = "fwd", own_only: bool = False) -> Kernel:
        """The compiled kernel for these tensors. Hot path: one dict lookup keyed by exact shapes,
        strides and 16-byte alignment; everything else happens once per key.
        o: the fourth tensor a kernel reads or writes: the output (fwd), dO (bwd).
        own_only: autoflash's own kernels only (the caller needs the log-sum-exp, or a causal
        alignment other than top-left): a vendor winner is passed over for the best own one."""
        aligned = not ((q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) & 15)
        key = (op, causal, q.dtype, q.device, q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(),
               aligned, own_only)
        kernel = self.kernels.get(key)
        if kernel is None:
            with self._lock:
                if len(self.kernels) > 4096:  # many distinct shapes: keep the table bounded
                    self.kernels.clear()
                device_index = q.device.index if q.is_cuda else None
                device = gpu_fingerprint(device_index)
                problem = self.problem_for(q, k, causal, op, device.sm_count)
                if os.environ.get("AUTOFLASH_RECORD"):
                    self._record(q, k, problem)
                if problem.key not in self.winners(device, device_index).rows:
                    self._tune_on_miss(problem, q, k)
                kernel = codegen.load(self.variant_for(problem, device, device_index, own_only))
                if kernel.vendor and kernel.unsupported(q, k, v, o):  # e.g. a GPU winner, CPU tensors
                    kernel = codegen.load(self.variant_for(problem, device, device_index, own_only=True))
                kernel = self._servable(kernel, problem, device, q, k, v, o)
                log.debug("autoflash: %s -> %s", problem.key, kernel)
                self.kernels[key] = kernel
        return kernel

    def varlen_kernel_for(self, q, k, v, o, causal: bool, op: str, max_seqlen_q: int, max_seqlen_k: int) -> Kernel:
        """The kernel for packed variable-length sequences. q, k, v, o: (1, H, total, D) views of the
        packed tensors (o: the output or dO). The problem is the dense one of the longest sequences
        with the packed tokens' work; its winner serves when its family takes packed sequences,
        else the op's default family (the only own families that take them are the defaults)."""
        # The packed token counts change from batch to batch: the key holds what the choice depends
        # on (their work bucket, the longest sequences' buckets, the layout without the batch stride).
        aligned = not ((q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) & 15)
        device_index = q.device.index if q.is_cuda else None
        device = gpu_fingerprint(device_index)
        work = shape_work_bucket(op, 1, q.shape[1], k.shape[1], q.shape[2], k.shape[2], device.sm_count)
        key = ("varlen", op, causal, q.dtype, q.device, q.shape[1], k.shape[1], q.shape[3], work,
               *(t.stride()[1:] for t in (q, k, v, o)), aligned, seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_k))
        kernel = self.kernels.get(key)
        if kernel is None:
            with self._lock:
                if len(self.kernels) > 4096:  # many distinct layouts: keep the table bounded
                    self.kernels.clear()
                problem = Problem(op=op, dtype=dtype_name(q.dtype), head_dim=q.shape[-1], causal=causal,
                                  gqa_group=q.shape[1] // k.shape[1], seqlen_q=seqlen_bucket(max_seqlen_q),
                                  seqlen_k=seqlen_bucket(max_seqlen_k), work=work)
                kernel = codegen.load(self.variant_for(problem, device, device_index, own_only=True))
                if not kernel.supports_varlen:
                    kernel = codegen.load(default_variant(op, problem, device))
                kernel = self._servable(kernel, problem, device, q, k, v, o)
                if not kernel.supports_varlen:  # (the pointer twin of a default is in the same family)
                    raise InvalidVariant(f"no {op} kernel takes packed sequences: {kernel}")
                log.debug("autoflash: varlen %s -> %s", problem.key, kernel)
                self.kernels[key] = kernel
        return kernel

    def _record(self, q, k, problem: Problem) -> None:
        """AUTOFLASH_RECORD=FILE: append each new exact shape this process runs to FILE (a shape set
        for `autoflash tune --shapes FILE`). A file that cannot be written costs one warning."""
        from autoflash.shapes import record_shape

        shape = Shape(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q=q.shape[2],
                      seqlen_k=k.shape[2], head_dim=q.shape[3], causal=problem.causal, dtype=problem.dtype)
        if shape in self._recorded:
            return
        self._recorded.add(shape)
        path = os.environ["AUTOFLASH_RECORD"]
        try:
            record_shape(path, shape)
        except OSError as e:
            if path not in self._record_failed:
                self._record_failed.add(path)
                warnings.warn(f"autoflash: cannot record shapes to {path} (AUTOFLASH_RECORD): {e}",
                              RuntimeWarning, stacklevel=4)

    @staticmethod
    def _servable(kernel: Kernel, problem: Problem, device: GPUFingerprint, q, k, v, o) -> Kernel:
        """The kernel itself when it takes these tensors; else its pointer-load twin in the same
        family, else the op's default family's pointer variant (which takes any strides)."""
        if kernel.unsupported(q, k, v, o) is None:
            return kernel
        candidates = [kernel.variant, default_variant(problem.op, problem, device)]
        for variant in candidates:
            space = load_space(variant.family)
            if "LOADS" not in space.knobs or "pointer" not in space.knobs["LOADS"]:
                continue
            # (warp specialization is offered only with TMA loads)
            no_ws = {"WARP_SPECIALIZE": False} if "WARP_SPECIALIZE" in space.knobs else {}
            twin = codegen.load(space.nearest_valid(variant.replace(LOADS="pointer", **no_ws), problem, device))
            if twin.unsupported(q, k, v, o) is None:
                return twin
        raise InvalidVariant(f"no kernel of {problem.op} takes these tensors: {kernel.unsupported(q, k, v, o)}")


def tune_in_child_process(shape: Shape, device_index: int | None = None) -> None:
    """The built-in tune-on-miss: `python -m autoflash tune` on this one shape in a child process,
    into the user DB, bounded in time. A child process, never a fork or a re-run of the user's
    program: the model's process imports nothing of the tuning side."""
    import subprocess
    import sys
    import tempfile

    from autoflash.shapes import record_shape

    trials = int(os.environ.get("AUTOFLASH_TUNE_ON_MISS_TRIALS", "16"))
    budget_min = float(os.environ.get("AUTOFLASH_TUNE_ON_MISS_BUDGET_MIN", "2"))
    with tempfile.TemporaryDirectory(prefix="autoflash-miss-") as tmp:
        shapes = os.path.join(tmp, "shape.toml")
        record_shape(shapes, shape)  # the same shape-set format AUTOFLASH_RECORD writes
        command = [sys.executable, "-m", "autoflash", "tune", "--ops", shape.op, "--shapes", shapes,
                   "--trials", str(trials), "--budget", str(budget_min),
                   "--workers", "1"]  # one shape: one measuring process, whatever GPUs the machine has
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            command.append("--interpret")
        env = dict(os.environ)
        if device_index is not None:  # the call's GPU (its physical id), not the child's default one
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            env["CUDA_VISIBLE_DEVICES"] = visible[device_index] if device_index < len(visible) else str(device_index)
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                              timeout=budget_min * 60 + 300, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(f"`autoflash tune` exited {done.returncode}: {done.stderr.strip()[-500:]}")


_dispatcher: Dispatcher | None = None


def get_dispatcher() -> Dispatcher:
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = Dispatcher()
    return _dispatcher
