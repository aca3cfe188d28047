"""Direct launches: record the JIT launches a kernel module makes for one call, replay them later.

A module's `launch` costs host time on every call: Python argument handling, Triton's per-launch
binding and cache lookup, TMA descriptor objects. Measured on the H200 (Triton 3.6): 43 us for a
one-kernel Triton forward, 130 us for the Gluon forward, 157-190 us for the three-kernel backward,
against 21 us for a whole torch SDPA call; whenever the kernels are short the GPU waits for it.

`bind(run, tensors, outputs)` runs `run()` (the module launch on `tensors`) once while recording
every JIT launch it makes (arguments, grid, compiled binary), and returns `launch(*tensors)` that
replays them with new tensors of the same shapes, strides, dtypes and device: the compiled
binaries are called directly. The caller's memo guarantees that sameness (its key holds shapes,
strides, dtypes, devices, 16-byte alignment and every scalar).

Arguments are mapped, never guessed:
- a call tensor (or a view of one, or a TMA descriptor over one) is re-derived from the new tensor;
- a tensor the module allocated itself (scratch: the backward's row sums, decode's partial
  results) is allocated anew on each replay with the same size, strides and dtype;
- everything else (ints, floats, constexprs) is replayed as recorded.

Then the replay is checked before it is returned: the outputs of the real launch are kept, the
output tensors and every scratch buffer are poisoned (NaN), the replay runs, and it must reproduce
the outputs bit for bit. A module that does work outside its JIT launches (a torch copy, a zeroed
accumulator) or is not deterministic fails that check and is not bound (None): the caller keeps
calling the module, which stays correct. What the check cannot see, and the contract of a kernel
module therefore is: its launch depends on its tensors' shapes, strides, dtypes and device and on
its scalar arguments, never on tensor values read on the host (a replay would freeze them).
A call whose tensors alias one another (q is k) is not bound.

Streams: launches the module makes on a stream other than the caller's (the backward's dK/dV kernels
beside its dQ kernel) are replayed on a stream of the replay's own for that caller stream (one per
caller stream: a graph capture or another thread's stream never shares it), with the module's
ordering contract (see `codegen`): each run of such launches starts by waiting for the caller's
stream (what was launched before it), and the call ends with the caller's stream waiting for every
other stream it used, also when a launch raised.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import typing

import torch


def bind(module, run, tensors: tuple, outputs: tuple[int, ...], before_launch=None):
    """Run `run()` (which launches the kernel module `module` on `tensors`) and return a direct
    launcher `launch(*tensors)` for later calls of the same signature, or None where that cannot
    be done safely (the interpreter, CUDA graph capture, launch hooks, a failed replay check).

    outputs: indices of the tensors the module writes. before_launch: called before each replay
    that needs it (Triton's scratch allocator for in-kernel TMA descriptors is per thread)."""
    from triton.runtime.jit import JITFunction

    if not _bindable(tensors):
        run()
        return None
    module_jits = [f for f in vars(module).values() if isinstance(f, JITFunction)]
    records = []
    recording_thread = threading.get_ident()
    device = tensors[0].device
    caller = torch.cuda.current_stream(device)

    def recorder(jit):
        def record(*args, **kwargs):  # (Triton's keyword-only grid/warmup: taken as they come)
            compiled = JITFunction.run(jit, *args, **kwargs)
            if threading.get_ident() == recording_thread:  # (another thread's launch of this module is not ours)
                stream = torch.cuda.current_stream(device)
                records.append((jit, args, kwargs, compiled, None if stream == caller else stream))
            return compiled
        return record

    with _RECORDING:  # one recording at a time: the patch below is on the shared module
        for jit in module_jits:
            jit.run = recorder(jit)  # an instance attribute: shadows the method for this one call
        try:
            run()
        finally:
            for jit in module_jits:
                vars(jit).pop("run", None)
    try:
        plan = _Plan(records, tensors, before_launch)
    except _NotBindable:
        return None
    return plan.launch if plan.verified(tensors, outputs) else None


_RECORDING = threading.Lock()


def _bindable(tensors) -> bool:
    from triton import knobs

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    if torch.cuda.is_current_stream_capturing():  # the check below synchronizes: not while capturing
        return False
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return not any(h is not None and getattr(h, "calls", True) for h in hooks)  # (a profiler's hooks)


class _NotBindable(Exception):
    pass


class _Launch(typing.NamedTuple):
    grid: tuple[int, int, int]
    run: object  # the compiled binary's launcher
    function: object
    metadata: object
    values: list  # the arguments as recorded, None where `fills` makes them per call
    fills: list  # (position, fill(tensors, scratch))
    global_scratch: bool  # in-kernel TMA descriptors: Triton's allocator gives scratch at each launch
    side: int | None  # None: the caller's stream; else which of the call's other streams


_SIDE_STREAMS: dict[tuple[int, int, int], "torch.cuda.Stream"] = {}  # (device, caller stream, slot) -> stream


def _side_stream(device_index: int, caller_raw: int, slot: int):
    """The replay's other stream number `slot` beside the caller's stream `caller_raw` (made once)."""
    key = (device_index, caller_raw, slot)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS.setdefault(key, torch.cuda.Stream(device_index))
    return stream


class _Plan:
    """The recorded launches with each argument slot marked: constant, call tensor, scratch."""

    def __init__(self, records: list, tensors: tuple, before_launch):
        if not records:
            raise _NotBindable("no JIT launch recorded")
        if len({id(t) for t in tensors}) < len(tensors):
            # (q is k is v, or k_cache is v_cache: a slot taken from "the" tensor would be replayed
            # from one slot for calls whose tensors differ, and no memo key sees the aliasing)
            raise _NotBindable("one tensor passed in several slots")
        self.scratch: list[tuple] = []  # (size, dtype) of each buffer the module allocated
        self._scratch_of: dict[int, tuple[int, int]] = {}  # storage -> (index, id of its tensor)
        self._storages = [t.untyped_storage().data_ptr() for t in tensors]
        self._slots: dict[int, int] = {}  # recorded other stream -> its slot
        self.launches = [self._launch_of(record, tensors) for record in records]
        self.before_launch = before_launch if any(launch.global_scratch for launch in self.launches) else None
        self.other_streams = len(self._slots)

    def _launch_of(self, record, tensors) -> _Launch:
        jit, args, kwargs, compiled, stream = record
        if compiled is None or not hasattr(compiled, "run") or hasattr(compiled, "result"):
            raise _NotBindable("no compiled binary")
        names = [p.name for p in jit.params]
        bound = inspect.signature(jit.fn).bind(*args, **{n: kwargs[n] for n in names if n in kwargs})
        bound.apply_defaults()
        values = [bound.arguments[n] for n in names]
        grid = kwargs.get("grid")
        if callable(grid):
            grid = grid(bound.arguments)
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        fills = []
        for pos, value in enumerate(values):
            fill = self._fill_of(value, tensors)
            if fill is not None:
                fills.append((pos, fill))
                values[pos] = None  # (the plan must not keep the recorded call's tensors alive)
        side = None if stream is None else self._slots.setdefault(stream.cuda_stream, len(self._slots))
        return _Launch((g0, g1, g2), compiled.run, compiled.function, compiled.packed_metadata, values, fills,
                       bool(getattr(compiled.metadata, "global_scratch_size", 0)), side)

    def _fill_of(self, value, tensors):
        """How to produce this argument at replay time from (new tensors, new scratch); None: as recorded."""
        if isinstance(value, torch.Tensor):
            return self._tensor_fill(value, tensors)
        # (a dataclass with a tensor `base`: Triton's and Gluon's host-side TMA descriptors)
        base = getattr(value, "base", None)
        if dataclasses.is_dataclass(value) and isinstance(base, torch.Tensor):
            base_fill = self._tensor_fill(base, tensors)
            cls, fields = type(value), {k: v for k, v in vars(value).items() if k != "base"}  # (not the old base)

            def descriptor(ts, scratch):
                new = object.__new__(cls)  # (no __post_init__: checked when it was recorded)
                new.__dict__.update(fields)
                new.base = base_fill(ts, scratch)
                return new
            return descriptor
        if isinstance(value, (list, tuple, dict)) and _holds_tensor(value):
            raise _NotBindable("a tensor inside a container argument")
        return None

    def _tensor_fill(self, t: torch.Tensor, tensors):
        for i, call_tensor in enumerate(tensors):
            if t is call_tensor:
                return lambda ts, scratch, i=i: ts[i]
        storage = t.untyped_storage().data_ptr()
        owners = [i for i, s in enumerate(self._storages) if s == storage]
        if len(owners) > 1:  # (q, k, v packed in one buffer): which one it derives from is unknown
            raise _NotBindable("a view of one of several call tensors sharing a buffer")
        if owners:  # a view of a call tensor: the same view of the new one
            i = owners[0]
            if t.dtype != tensors[i].dtype:
                raise _NotBindable("a view of a call tensor as another dtype")
            size, stride = tuple(t.shape), t.stride()
            delta = t.storage_offset() - tensors[i].storage_offset()
            return lambda ts, scratch: ts[i].as_strided(size, stride, ts[i].storage_offset() + delta)
        # a buffer the module allocated: a new one on each replay
        if storage not in self._scratch_of:
            if not (t.is_contiguous() and t.storage_offset() == 0):
                raise _NotBindable("a view of a scratch buffer")
            self._scratch_of[storage] = (len(self.scratch), id(t))
            self.scratch.append((tuple(t.shape), t.dtype))
        j, owner = self._scratch_of[storage]
        if owner != id(t):
            raise _NotBindable("two scratch tensors over one storage")
        return lambda ts, scratch: scratch[j]

    def _replay(self, tensors, scratch) -> None:
        if self.before_launch is not None:
            self.before_launch()
        index = tensors[0].device.index
        caller_raw = torch._C._cuda_getCurrentRawStream(index)
        if not self.other_streams:  # (the common case, kept to the fewest host calls)
            for launch in self.launches:
                launch.run(*launch.grid, caller_raw, launch.function, launch.metadata, None, None, None,
                           *self._arguments(launch, tensors, scratch))
            return
        caller = torch.cuda.current_stream(index)
        others = [_side_stream(index, caller_raw, slot) for slot in range(self.other_streams)]
        running = None  # the slot of the run of other-stream launches in progress
        try:
            for launch in self.launches:
                args = self._arguments(launch, tensors, scratch)
                if launch.side is None:
                    running = None
                    launch.run(*launch.grid, caller_raw, launch.function, launch.metadata, None, None, None, *args)
                    continue
                stream = others[launch.side]
                if running != launch.side:  # a run of launches on another stream starts after the caller's work
                    stream.wait_stream(caller)
                    running = launch.side
                with torch.cuda.stream(stream):  # (the scratch Triton allocates comes from that stream's pool)
                    launch.run(*launch.grid, stream.cuda_stream, launch.function, launch.metadata, None, None, None,
                               *args)
        finally:
            for stream in others:
                caller.wait_stream(stream)

    @staticmethod
    def _arguments(launch: _Launch, tensors, scratch) -> list:
        args = list(launch.values)
        for pos, fill in launch.fills:
            args[pos] = fill(tensors, scratch)
        return args

    def launch(self, *tensors) -> None:
        device = tensors[0].device
        scratch = [torch.empty(size, dtype=dtype, device=device) for size, dtype in self.scratch]
        self._replay(tensors, scratch)

    def verified(self, tensors, outputs) -> bool:
        """Replay on the recorded call's tensors with outputs and scratch poisoned: it must
        reproduce the real launch's outputs bit for bit (and leave them so)."""
        kept = [tensors[i].clone() for i in outputs]
        if any(t.is_floating_point() and bool(torch.isnan(t).any()) for t in kept):
            return False  # (NaN never equals itself: cannot be checked this way; the real outputs stand)
        for i in outputs:
            _poison(tensors[i])
        device = tensors[0].device
        scratch = [_poison(torch.empty(size, dtype=dtype, device=device)) for size, dtype in self.scratch]
        try:
            self._replay(tensors, scratch)
            same = all(torch.equal(tensors[i], ref) for i, ref in zip(outputs, kept))
        except Exception:  # noqa: BLE001 - any failure means: do not bind
            same = False
        if not same:
            for i, ref in zip(outputs, kept):  # the caller gets the real launch's results
                tensors[i].copy_(ref)
        return same


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


def _holds_tensor(value) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple, dict)) and _holds_tensor(x)) for x in items)
