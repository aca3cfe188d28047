"""The run's compiles: each candidate built once per variant and specialization, ahead of its
measurement where the plan knows it, shared by every problem that needs the same binary.

A compile only fills Triton's cache before the measuring worker launches the kernel (which would
build it itself otherwise), so sharing a compile between problems is safe: a key that is too coarse
costs time in the measuring worker, never a wrong result.
"""

from __future__ import annotations

import concurrent.futures

from autoflash.problem import Shape
from autoflash.space import Variant, load_space
from autoflash.tuning import sandbox
from autoflash.tuning.sandbox import Outcome

# Outcomes a second compile of the same binary would repeat; others (a crashed or timed-out
# worker) are tried again when asked for again.
_DETERMINISTIC = ("ok", "compile_error")


def _spec(n: int) -> tuple[bool, bool]:
    """How Triton specializes an integer argument: equal to 1, divisible by 16."""
    return n == 1, n % 16 == 0


def compile_key(variant: Variant, shape: Shape) -> tuple:
    """What `sandbox.compile_variant` builds for this candidate depends on: the variant, the gate's
    shapes (dtype, head dims, causality, GQA group and whether two KV heads fit: `gate.gate_shapes`)
    and how the timing shape's sizes specialize the launch."""
    group = shape.heads_q // shape.heads_kv
    return (variant.family, variant.json(), shape.op, shape.dtype, shape.head_dim, shape.head_dim_v, shape.causal, group,
            shape.heads_q >= 2 * group, shape.page,
            *(_spec(n) for n in (shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q, shape.seqlen_k)))


class Compiling:
    """A batch's compile outcomes, in order (some shared with earlier batches), one future each: a
    candidate is measured as soon as its own compile is done, not once its whole batch is (the seed
    pass sends every problem's seeds in one batch: the first problem's waited for the last one's)."""

    def __init__(self, futures: list, memo: dict, keys: list):
        self._futures, self._memo, self._keys = futures, memo, keys

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def ready(self, j: int) -> bool:
        return self._futures[j].done()

    def one(self, j: int, timeout: float | None = None) -> Outcome:
        """The j-th outcome; concurrent.futures.TimeoutError when it takes longer than `timeout`
        seconds (the compile goes on: a later request of the same candidate gets it)."""
        outcome = self._futures[j].result(timeout)
        if outcome.status not in _DETERMINISTIC:
            self._memo.pop(self._keys[j], None)
        return outcome

    def result(self, timeout: float | None = None) -> list[Outcome]:
        """Every outcome; concurrent.futures.TimeoutError when they take longer than `timeout` seconds."""
        if timeout is not None:
            concurrent.futures.wait(self._futures, timeout=timeout)
            if not self.done():
                raise concurrent.futures.TimeoutError()
        return [self.one(j) for j in range(len(self._futures))]


class Compiles:
    """Compiles on the worker pool, remembered for the run (None pool: the interpreter, which
    compiles nothing)."""

    def __init__(self, pool, fn, rep_ms: float, device_str: str, timeout_s: float):
        self.pool, self.fn = pool, fn or sandbox.compile_variant
        self.rep_ms, self.device_str, self.timeout_s = rep_ms, device_str, timeout_s
        self._memo: dict[tuple, concurrent.futures.Future] = {}  # compile key -> its compile's future
        self.requested = 0  # variants sent to the pool (for the run's summary)

    def started(self, variant: Variant, shape: Shape) -> bool:
        """Whether this candidate is compiled or compiling already (in this run)."""
        return compile_key(variant, shape) in self._memo

    def start(self, variants: list[Variant], shape: Shape) -> Compiling:
        """Compile these candidates of one problem in the background (those not compiled or
        compiling already)."""
        return self.start_all([(v, shape) for v in variants])

    def start_all(self, items: list[tuple[Variant, Shape]]) -> Compiling:
        """Compile (variant, shape) pairs of any problems: the pool's workers take them in the order
        asked, each as soon as a worker is free."""
        done = concurrent.futures.Future()
        done.set_result(Outcome("ok"))
        if self.pool is None:
            return Compiling([done] * len(items), {}, [None] * len(items))
        keys = [compile_key(v, shape) for v, shape in items]
        todo = {}
        for key, (v, shape) in zip(keys, items):
            if load_space(v.family).vendor:  # nothing to build: never queued behind others' compiles
                self._memo[key] = done
            elif key not in self._memo and key not in todo:
                todo[key] = (v, shape)
        if todo:
            args = [(v.json(), v.family, shape, self.rep_ms, self.device_str) for v, shape in todo.values()]
            futures = self.pool.submit_each(self.fn, args, self.timeout_s)
            self.requested += len(todo)
            self._memo.update(zip(todo, futures))
        return Compiling([self._memo[k] for k in keys], self._memo, keys)
