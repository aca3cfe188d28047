"""Problem key from tensors -> winner (any kernel family) -> compiled `Kernel`.

The hot path: everything per key (variant choice, module import) is computed once and kept in
an in-memory table; a call does a dict lookup and a kernel launch. This module never imports
the tuning side or Optuna. Tune-on-miss (opt-in, AUTOFLASH_TUNE_ON_MISS=1) runs `autoflash tune`
in a child process (`python -m autoflash`, never the user's program), or a hook the tuning side
registered with `set_miss_hook`.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Callable

import torch

from autoflash import codegen, families
from autoflash.codegen import Kernel
from autoflash.device import GPUFingerprint, gpu_fingerprint
from autoflash.problem import Problem, Shape, dtype_name, seqlen_bucket, shape_work_bucket
from autoflash.score_variant import PLAIN, ScoreVariant
from autoflash.serving_policy import cudnn_variant
from autoflash.space import InvalidVariant, Variant, default_variant, load_space
from autoflash.winners import WinnerTable

MissHook = Callable[[Shape], None]
_miss_hook: MissHook | None = None


def set_miss_hook(hook: MissHook | None) -> MissHook | None:
    """Install what tune-on-miss runs for a problem with no exact winner (None: the built-in child
    process). Returns the previous hook. The tuning side registers here; the runtime never imports it."""
    global _miss_hook
    previous, _miss_hook = _miss_hook, hook
    return previous

log = logging.getLogger("autoflash")


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
        self.derived: dict = {}  # kernels derived from what serves (dropout's), by their callers' keys
        self._recorded: set = set()  # AUTOFLASH_RECORD: shapes written already (the op is not part)
        self._record_failed: set = set()
        self._refused_record: set = set()  # AUTOFLASH_RECORD files that are no shape set: never written

    def reset(self) -> None:
        """Forget loaded winners and compiled kernels (e.g. after tuning into the DB)."""
        with self._lock:
            for memo in (self.kernels, self._winners, self._served, self.derived):
                memo.clear()

    def winners(self, device: GPUFingerprint, device_index=None) -> WinnerTable:
        table = self._winners.get(device_index)
        if table is None:
            table = self._winners[device_index] = WinnerTable(device, self._winner_paths)
        return table

    @staticmethod
    def problem_for(q: torch.Tensor, k: torch.Tensor, causal: bool, op: str, sm_count: int,
                    score: ScoreVariant = PLAIN, head_dim_v: int | None = None) -> Problem:
        """head_dim_v: V's head dim (None or q's: the plain problem)."""
        return Problem(op=op, dtype=dtype_name(q.dtype), head_dim=q.shape[-1], causal=causal,
                       gqa_group=q.shape[1] // k.shape[1], seqlen_q=seqlen_bucket(q.shape[2]),
                       seqlen_k=seqlen_bucket(k.shape[2]),
                       work=shape_work_bucket(op, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], sm_count),
                       score_variant=score.key or None, head_dim_v=_value_dim(q, head_dim_v))

    def _claim_tune_on_miss(self, problem: Problem, q) -> bool:
        """Whether this call tunes its problem (AUTOFLASH_TUNE_ON_MISS=1, first seen, not while a CUDA
        graph is captured or torch.compile traces). Under the lock: one call per problem claims it."""
        if os.environ.get("AUTOFLASH_TUNE_ON_MISS", "0").strip().lower() in ("", "0", "false", "no", "off"):
            return False
        if problem.key in self._tuned_on_miss or torch.compiler.is_compiling():
            return False
        if problem.score_variant is not None:
            return False  # (the problem key has no window or softcap values for a tuning shape: not yet)
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        self._tuned_on_miss.add(problem.key)
        return True

    def _tune_on_miss(self, problem: Problem, q, k) -> None:
        """Tune a problem `_claim_tune_on_miss` claimed (a short, budgeted run into the user DB),
        then reload the winners. Runs outside the lock: other threads' calls, of other problems or of
        this one (served by what serves now), never wait for a tune. A failure costs one warning,
        never the model's call."""
        shape = Shape(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q=q.shape[2],
                      seqlen_k=k.shape[2], head_dim=q.shape[3], causal=problem.causal, dtype=problem.dtype,
                      op=problem.op, head_dim_v=problem.head_dim_v)
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
        self.reset()  # (the winners reload, now with the new one)

    def variant_for(self, problem: Problem, device: GPUFingerprint, device_index=None, own_only: bool = False) -> Variant:
        """The variant that serves this problem (`choose`). own_only: autoflash's own kernels only."""
        return self.choose(problem, device, device_index, own_only)[0]

    def choose(self, problem: Problem, device: GPUFingerprint, device_index=None,
               own_only: bool = False) -> tuple[Variant, str]:
        """(variant, why): a tuned vendor winner as it is; otherwise SDPA-cuDNN unless the measured
        evidence says the own kernels are faster here (`serving_policy`); then the own winner (exact or
        nearest bucket); for attention variants the plain problem's (`WinnerTable.plain_twin`); else the default."""
        table = self.winners(device, device_index)
        tuned, how = table.lookup(problem, own_only)
        if not own_only and not (tuned is not None and load_space(tuned.family).vendor):
            vendor = cudnn_variant(problem, device)
            if vendor is not None:
                own_faster, why = table.evidence.own_faster(problem)
                if not own_faster:
                    log.debug("autoflash: %s -> SDPA-cuDNN (%s)", problem.key, why)
                    return vendor, why
        if tuned is not None:
            log.debug("autoflash: %s -> tuned winner (%s)", problem.key, how)
            return tuned, how
        if problem.score_variant:  # (nothing tuned for these variants: the plain problem's winner, else their default)
            return table.plain_twin(problem) or (families.score_variant_default(problem, device), "default")
        if not table.rows and device.key not in self._told_untuned:
            self._told_untuned.add(device.key)
            log.info("autoflash: no tuned kernels for %s; using built-in defaults (run `autoflash tune`)",
                     device.name)
        return default_variant(problem.op, problem, device), "default"

    def serving_variant(self, problem: Problem, device: GPUFingerprint) -> Variant:
        """`variant_for` remembered per problem (one dict lookup per call)."""
        key = (problem, device.key)
        variant = self._served.get(key)
        if variant is None:
            variant = self._served[key] = self.variant_for(problem, device)
        return variant

    def kernel_for(self, q, k, v, o, causal: bool, op: str = "fwd", own_only: bool = False,
                   deterministic: bool = False, score: ScoreVariant = PLAIN) -> Kernel:
        """The compiled kernel for these tensors. Hot path: one dict lookup keyed by exact shapes,
        strides and 16-byte alignment; everything else happens once per key.
        o: the fourth tensor a kernel reads or writes: the output (fwd), dO (bwd).
        own_only: autoflash's own kernels only (the caller needs the log-sum-exp, or a causal
        alignment other than top-left): a vendor winner is passed over for the best own one.
        deterministic: a variant whose results are bitwise repeatable (`deterministic_variant`).
        score: the attention variants (fwd, bwd): their own problem key, winners and kernels."""
        own_only = own_only or deterministic or not score.plain  # (no vendor kernel computes them)
        aligned = not ((q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) & 15)
        key = (op, causal, q.dtype, q.device, q.shape, k.shape, q.stride(), k.stride(), v.stride(), o.stride(),
               aligned, own_only, deterministic) + ((score,) if score.key else ()) + (
            (v.shape[-1],) if v.shape[-1] != q.shape[-1] else ())
        kernel = self.kernels.get(key)
        if kernel is None:
            device_index = q.device.index if q.is_cuda else None
            device = gpu_fingerprint(device_index)
            problem = self.problem_for(q, k, causal, op, device.sm_count, score, v.shape[-1])
            with self._lock:
                if os.environ.get("AUTOFLASH_RECORD") and score.plain:
                    self._record(q, k, problem)  # (shape sets hold plain problems, V's own head dim included)
                tune = (problem.key not in self.winners(device, device_index).rows
                        and self._claim_tune_on_miss(problem, q))
            if tune:  # (a tune takes minutes: outside the lock)
                self._tune_on_miss(problem, q, k)
            with self._lock:
                if len(self.kernels) > 4096:  # many distinct shapes: keep the table bounded
                    self.kernels.clear()
                kernel = self._load(self.variant_for(problem, device, device_index, own_only), problem, device,
                                    deterministic)
                if kernel.vendor and kernel.unsupported(q, k, v, o):  # e.g. a GPU winner, CPU tensors
                    kernel = self._load(self.variant_for(problem, device, device_index, own_only=True), problem,
                                        device, deterministic)
                kernel = self._servable(kernel, problem, device, q, k, v, o, deterministic)
                log.debug("autoflash: %s -> %s", problem.key, kernel)
                self.kernels[key] = kernel
        return kernel

    def varlen_kernel_for(self, q, k, v, o, causal: bool, op: str, max_seqlen_q: int, max_seqlen_k: int,
                          deterministic: bool = False, score: ScoreVariant = PLAIN, pages=None) -> Kernel:
        """The kernel for packed variable-length sequences. q, k, v, o: (1, H, total, D) views of the
        packed tensors (o: the output or dO). The problem is the dense one of the longest sequences
        with the packed tokens' work; its winner serves when its family takes packed sequences,
        else the op's default family (the only own families that take them are the defaults).
        pages: (k, v) paged caches as (num_blocks, H_kv, page_size, D) views, which q, k, v, o's packed
        K and V stand for: the forward kernel rendered to read them through a block table (`_paged_twin`)."""
        # The packed token counts change from batch to batch: the key holds what the choice depends
        # on (their work bucket, the longest sequences' buckets, the layout without the batch stride).
        aligned = not ((q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) & 15)
        device_index = q.device.index if q.is_cuda else None
        device = gpu_fingerprint(device_index)
        work = shape_work_bucket(op, 1, q.shape[1], k.shape[1], q.shape[2], k.shape[2], device.sm_count)
        key = ("varlen", op, causal, q.dtype, q.device, q.shape[1], k.shape[1], q.shape[3], v.shape[3], work,
               *(t.stride()[1:] for t in (q, k, v, o)), aligned, seqlen_bucket(max_seqlen_q), seqlen_bucket(max_seqlen_k),
               deterministic, score, None if pages is None else _layout(*pages))
        kernel = self.kernels.get(key)
        if kernel is None:
            with self._lock:
                if len(self.kernels) > 4096:  # many distinct layouts: keep the table bounded
                    self.kernels.clear()
                problem = Problem(op=op, dtype=dtype_name(q.dtype), head_dim=q.shape[-1], causal=causal,
                                  gqa_group=q.shape[1] // k.shape[1], seqlen_q=seqlen_bucket(max_seqlen_q),
                                  seqlen_k=seqlen_bucket(max_seqlen_k), work=work, score_variant=score.key or None,
                                  head_dim_v=_value_dim(q, v.shape[-1]))
                kernel = self._load(self.variant_for(problem, device, device_index, own_only=True), problem, device,
                                    deterministic)
                if not kernel.supports_varlen:
                    kernel = self._load(default_variant(op, problem, device), problem, device, deterministic)
                if pages is not None:
                    kernel = self._paged_twin(kernel, problem, device, q, *pages, o)
                else:
                    kernel = self._servable(kernel, problem, device, q, k, v, o, deterministic)
                if not kernel.supports_varlen:  # (the pointer twin of a default is in the same family)
                    raise InvalidVariant(f"no {op} kernel takes packed sequences: {kernel}")
                log.debug("autoflash: varlen %s -> %s", problem.key, kernel)
                self.kernels[key] = kernel
        return kernel

    def _record(self, q, k, problem: Problem) -> None:
        """AUTOFLASH_RECORD=FILE: append each new exact shape this process runs to FILE (a shape set
        for `autoflash tune --shapes FILE`). A file that cannot be written costs one warning."""
        from autoflash.shapes import NotAShapeSet, record_shape

        shape = Shape(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q=q.shape[2],
                      seqlen_k=k.shape[2], head_dim=q.shape[3], causal=problem.causal, dtype=problem.dtype,
                      head_dim_v=problem.head_dim_v)
        path = os.environ["AUTOFLASH_RECORD"]
        if shape in self._recorded or path in self._refused_record:
            return
        self._recorded.add(shape)
        try:
            record_shape(path, shape)
        except NotAShapeSet as e:  # another kind of file: one warning, and nothing recorded into it
            self._refused_record.add(path)
            warnings.warn(f"autoflash: {e}", RuntimeWarning, stacklevel=4)
        except OSError as e:
            if path not in self._record_failed:
                self._record_failed.add(path)
                warnings.warn(f"autoflash: cannot record shapes to {path} (AUTOFLASH_RECORD): {e}",
                              RuntimeWarning, stacklevel=4)

    @staticmethod
    def _load(variant: Variant, problem: Problem, device: GPUFingerprint, deterministic: bool = False) -> Kernel:
        """The variant's kernel (with its family's deterministic knobs when asked: `deterministic_variant`),
        rendered with the problem's attention variants and value head dim; where its family computes
        none (a winner of another family, e.g. the Gluon forward), the op's default. A vendor kernel
        takes a value head dim of its own as torch does (its `unsupported` says where it does not)."""
        if deterministic:
            variant = deterministic_variant(variant, problem, device)
        score = ScoreVariant.from_key(problem.score_variant)
        value_dim = problem.head_dim_v is not None
        if score.plain and (not value_dim or load_space(variant.family).vendor):
            return codegen.load(variant)
        if not load_space(variant.family).vendor:
            host = families.host_class(variant.family)
            if host.computes(score) and (not value_dim or host.serves_value_dim):
                return codegen.load(variant, score=score, value_dim=value_dim)
        return codegen.load(default_variant(problem.op, problem, device), score=score, value_dim=value_dim)

    @staticmethod
    def _paged_twin(kernel: Kernel, problem: Problem, device: GPUFingerprint, q, k_pages, v_pages, o) -> Kernel:
        """The packed kernel's variant rendered to read K and V from pages through a block table, without
        warp specialization: with its TMA loads where the pages allow them (a key tile within a page: the
        tile shortened to fit a page where it must), else its pointer-load twin (a page per key row); in
        its family, else the default one."""
        for variant in (kernel.variant, default_variant(problem.op, problem, device)):
            space = load_space(variant.family)
            if not (families.host_class(variant.family).serves_paged and "pointer" in space.knobs.get("LOADS", ())):
                continue
            no_ws = {"WARP_SPECIALIZE": False} if "WARP_SPECIALIZE" in space.knobs else {}
            for loads in dict.fromkeys((variant["LOADS"], "pointer")):
                wanted, page = variant.replace(LOADS=loads, **no_ws), k_pages.shape[2]
                if loads == "tma" and page % variant["BLOCK_N"]:  # (a TMA key tile lies within a page)
                    fitting = [n for n in space.knobs["BLOCK_N"] if page % n == 0 and n < variant["BLOCK_N"]]
                    wanted = wanted.replace(BLOCK_N=max(fitting)) if fitting else wanted
                twin = space.nearest_valid(wanted, problem, device)
                paged = codegen.load(twin, score=kernel.score, value_dim=kernel.value_dim, paged=True)
                if paged.unsupported(q, k_pages, v_pages, o) is None:
                    return paged
        raise InvalidVariant(f"no {problem.op} kernel reads these paged caches (from {kernel})")

    @classmethod
    def _servable(cls, kernel: Kernel, problem: Problem, device: GPUFingerprint, q, k, v, o,
                  deterministic: bool = False) -> Kernel:
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
            twin = cls._load(space.nearest_valid(variant.replace(LOADS="pointer", **no_ws), problem, device), problem,
                             device, deterministic)
            if twin.unsupported(q, k, v, o) is None:
                return twin
        raise InvalidVariant(f"no kernel of {problem.op} takes these tensors: {kernel.unsupported(q, k, v, o)}")


def _layout(*pages) -> tuple:
    """What the choice of a paged kernel reads of the caches' (num_blocks, H_kv, page_size, D) views: all
    but the number of pages (a cache that grows keeps its kernel)."""
    return tuple((t.shape[1:], t.stride(), not t.data_ptr() & 15) for t in pages)


def _value_dim(q, head_dim_v: int | None) -> int | None:
    """The problem's head_dim_v: V's head dim where it is not q's, else None (one key per problem)."""
    return None if head_dim_v is None or head_dim_v == q.shape[-1] else int(head_dim_v)


# Knob values that make a family's kernels bitwise repeatable, for the families whose space also offers
# variants that are not: the backward's "atomic" and "tma_reduce" dQ add float32 tiles into one buffer
# in whatever order the programs reach it, so dQ changes in its last bits from run to run; "ordered"
# adds them in a fixed order (the last key block down to 0, each waiting for its turn),
# "separate" computes each dQ tile in one program (dK/dV are always so: the GQA split's partial sums
# are reduced in a fixed order).
# Each family's alternatives, preferred first: the first its space allows for the problem serves. A
# family missing here serves deterministic calls as it is: tests/test_deterministic.py holds every
# backward family to an entry.
DETERMINISTIC_KNOBS: dict[str, list[dict]] = {"triton_bwd": [{"DQ_MODE": "ordered"}, {"DQ_MODE": "separate"}]}


def deterministic_variant(variant: Variant, problem: Problem, device: GPUFingerprint) -> Variant:
    """`variant` itself where it is deterministic already, else with its family's first deterministic
    knob values (`DETERMINISTIC_KNOBS`) the space allows here, the other knobs kept where it allows
    them, else changed as few as possible."""
    alternatives = DETERMINISTIC_KNOBS.get(variant.family, [])
    if not alternatives or any(all(variant.as_dict().get(knob) == value for knob, value in pins.items())
                               for pins in alternatives):
        return variant
    space = load_space(variant.family)
    for pins in alternatives:
        wanted = variant.replace(**pins)
        if not space.violations(wanted, problem, device):
            return wanted
        valid = [v for v in space.valid_variants(problem, device)
                 if all(v[knob] == value for knob, value in pins.items())]
        if valid:
            want = wanted.as_dict()
            return min(valid, key=lambda v: (sum(v[knob] != want.get(knob) for knob in v.as_dict()), v.json()))
    raise InvalidVariant(f"no deterministic {variant.family} variant is valid for {problem.key} on {device.name}")


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
