"""Tuning on several GPUs and hosts: `autoflash tune --workers N --storage URL`.

One measuring process per GPU (a worker: its own `SharedTuner`, its own sandbox that times on its
GPU, its own compile processes), started with `spawn` and CUDA_VISIBLE_DEVICES set to its GPU
alone; each holds that GPU's lock (`gpulock`) for its life, so no two measuring processes ever
share a GPU. Every worker walks all problems, worker i starting at problem i: problems are spread
over the workers, and a worker done with its own joins the search of a problem still running
(trials of one problem in parallel). All of them, on every host, use the same Optuna studies
(`--storage`): the studies hand out the trials, and a host joins by starting the same command
with the same storage, at any time.

Results: SQLite stays each host's results store (WAL: the workers of a host write one file at
once), written as things happen, so a host keeps working when the network or the database server
does not, a killed worker loses at most its running trial, and the runtime reads a plain file
with no server. The database server holds only the search's coordination (which trials are
taken, their values, who picks the winner). Winners are picked once per problem among all
workers and hosts (`picks`): each lands in the DB of the host whose worker picked it; `autoflash
db merge` gathers the hosts' DBs into one (and `db export`/`import` ships them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import os
import queue
import traceback

from autoflash.problem import Shape
from autoflash.store import Store
from autoflash.tuning.stopping import Terminated, sigterm_interrupts
from autoflash.tuning.results import ProblemResult, Reporter, TuneOptions


def tune(shapes: list[Shape], store: Store, options: TuneOptions, reporter: Reporter | None = None,
         command: str = "") -> list[ProblemResult]:
    """One worker, in this process: holds this GPU's lock (not in the interpreter), tunes every
    problem in the passes of a plan over the whole budget (`planned`), taking them from problem
    `options.worker` on; one result per problem, in the given order."""
    from autoflash.tuning.gpulock import current_gpu_lock
    from autoflash.tuning.planned import run_planned
    from autoflash.tuning.shared import SharedTuner
    from autoflash.tuning.results import representative_shapes

    reporter = reporter or Reporter()
    start = options.clock()  # the budget covers the whole run, the workers' start-up included
    todo = representative_shapes(shapes)
    lock = None if options.interpret else current_gpu_lock().acquire()
    try:
        tuner = SharedTuner(store, options, reporter=reporter, command=command)
        results: dict[int, ProblemResult] = {}
        status = "interrupted"
        try:
            results = run_planned(tuner, todo, options, reporter, start, _order(len(todo), options.worker))
            status = "finished"
        finally:
            tuner.close(status, len(results))
    finally:
        if lock is not None:
            lock.release()
    return [results[i] for i in sorted(results)]


def _order(n: int, first: int) -> list[int]:
    first = first % n if n else 0
    return list(range(first, n)) + list(range(first))


# --------------------------------------------------------------------------- several processes
class _QueueReporter(Reporter):
    """A worker's progress, sent to the process that started it."""

    def __init__(self, events, worker: int):
        self.events, self.worker = events, worker

    def step_started(self, kind, index, total, shape):
        self.events.put(("started", self.worker, (kind, index, total, shape)))

    def budget_short(self, budget_s, needed_s):
        self.events.put(("budget_short", self.worker, (budget_s, needed_s)))

    def problem_done(self, result):
        self.events.put(("problem", self.worker, result))

    def run_finished(self, summary):
        self.events.put(("summary", self.worker, summary))


_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(value: str | None) -> int | None:
    """The logging level $AUTOFLASH_LOG names (debug, info, warning, error, critical, any case, or
    a number); None when it is unset or names none (the workers then log as by default)."""
    import logging

    value = (value or "").strip()
    if value.isdigit():
        return int(value)
    return getattr(logging, value.upper()) if value.lower() in _LEVELS else None


def _warn_bad_log_level() -> None:
    """Once per run, in the process that starts the workers (each worker ignores it silently)."""
    import warnings

    value = os.environ.get("AUTOFLASH_LOG")
    if value and log_level(value) is None:
        warnings.warn(f"AUTOFLASH_LOG={value!r} is not a log level ({', '.join(_LEVELS)}): ignored",
                      RuntimeWarning, stacklevel=3)


def _worker_main(worker: int, shapes: list[Shape], db_path: str, options: TuneOptions, command: str, events) -> None:
    """A worker process's body: `tune` on its own connection to the results DB."""
    level = log_level(os.environ.get("AUTOFLASH_LOG"))
    if level is not None:  # e.g. AUTOFLASH_LOG=debug: what the workers coordinate
        import logging

        logging.basicConfig(level=level, format="%(asctime)s worker %(process)d %(message)s")
        logging.getLogger("optuna").setLevel(logging.WARNING)
    try:
        store = Store(db_path)
        from autoflash.device import gpu_fingerprint

        with sigterm_interrupts():
            results = tune(shapes, store, options, reporter=_QueueReporter(events, worker), command=command)
        events.put(("done", worker, (gpu_fingerprint().key, results)))
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        events.put(("error", worker, "terminated" if terminated else "interrupted"))
        raise SystemExit(143 if terminated else 130)
    except BaseException as e:  # noqa: BLE001 - reported by the parent, one line (details below it)
        events.put(("error", worker, f"{type(e).__name__}: {e}".strip().splitlines()[0] if str(e) else type(e).__name__))
        if not storage_failure(e):  # (a storage that fails is said in that one line: no code is wrong)
            traceback.print_exc()
        raise SystemExit(1)


def storage_failure(e: BaseException) -> bool:
    """Whether an error is the Optuna storage's (its database or journal failing, unreachable)."""
    from autoflash.tuning.storage import StorageError

    return isinstance(e, StorageError) or type(e).__module__.split(".")[0] in ("optuna", "sqlalchemy", "psycopg",
                                                                              "psycopg2")


@contextlib.contextmanager
def _environ(extra: dict):
    """os.environ with `extra` while a spawned child starts (it copies the parent's environment)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tune_workers(shapes: list[Shape], db_path, options: TuneOptions, workers: int, gpus: list[str] | None = None,
                 command: str = "", on_event=None) -> tuple[list[ProblemResult], list[str]]:
    """Start `workers` worker processes on the same studies (worker i sees only GPU gpus[i]), wait
    for them. Returns one result per problem (the picking worker's) and one line per worker that
    failed or died (the others carry on: it loses only its running trial). on_event(kind, worker,
    payload) sees 'started', 'budget_short' and 'problem' events as they come."""
    from autoflash.tuning.storage import make_storage
    from autoflash.tuning.results import representative_shapes

    if gpus is not None and len(gpus) < workers:
        raise ValueError(f"{workers} workers need {workers} GPUs, {len(gpus)} visible: two measuring "
                         "processes on one GPU would disturb each other's timings")
    make_storage(options.storage, db_path)  # once here: its tables made and its errors said before any start
    _warn_bad_log_level()
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    events = ctx.Queue()
    procs = {}
    try:
        for i in range(workers):
            with _environ({"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {}):
                procs[i] = ctx.Process(target=_worker_main, name=f"autoflash-worker-{i}", args=(
                    i, shapes, str(db_path), dataclasses.replace(options, worker=i), command, events))
                procs[i].start()
        done, errors = _collect(procs, events, on_event)
    except KeyboardInterrupt as e:
        _stop(procs, terminated=isinstance(e, Terminated))
        raise
    failures = [f"worker {i} (pid {p.pid}) {errors.get(i) or _exit_text(p.exitcode)}"
                for i, p in procs.items() if i not in done]
    results = _merge(representative_shapes(shapes), [r for _, rs in done.values() for r in rs])
    with contextlib.closing(Store(db_path)) as store:
        keys = {key for key, _ in done.values()}
        return [_with_db_counts(store, keys, r) for r in results], failures


def _collect(procs: dict, events, on_event) -> tuple[dict, dict]:
    done, errors = {}, {}
    while True:
        try:
            kind, worker, payload = events.get(timeout=0.5)
        except queue.Empty:
            if not [p for p in procs.values() if p.is_alive()]:  # (each polled: a dead one is reaped now)
                break
            continue
        if kind == "done":
            done[worker] = payload
        elif kind == "error":
            errors[worker] = payload
        elif on_event is not None:
            on_event(kind, worker, payload)
    for p in procs.values():
        p.join()
    return done, errors


def _stop(procs: dict, terminated: bool) -> None:
    """This process was stopped. Ctrl-C reached the workers too (the terminal signals the whole
    process group): let them record it. A SIGTERM may have reached this process alone: pass it on,
    each worker stops the same way. One that does not stop within 30 s is killed."""
    if terminated:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
    for p in procs.values():
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _exit_text(code) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _merge(todo: list[Shape], results: list[ProblemResult]) -> list[ProblemResult]:
    """Per problem, the result of the worker that picked its winner (else the best said)."""
    def rank(r: ProblemResult) -> int:
        if r.status == "tuned":
            return 0 if not r.picked_by else 1
        return {"picking_elsewhere": 3, "skipped": 4}.get(r.status, 2)

    merged = []
    for shape in todo:
        mine = sorted((r for r in results if r.problem == shape.problem), key=rank)
        merged.append(mine[0] if mine else ProblemResult(shape, shape.problem, None, {}, math.nan, 0, 0, "skipped"))
    return merged


def _with_db_counts(store: Store, gpu_keys: set, result: ProblemResult) -> ProblemResult:
    """The problem's measured and failed trials (current templates) as this host's DB holds them:
    every worker's, not only the picking one's."""
    from autoflash import codegen
    from autoflash.space import families_for
    from autoflash.tuning.sandbox import FAILED_STATUSES

    if not gpu_keys:
        return result
    hashes = [codegen.template_hash(f) for f in families_for(result.problem.op)]
    rows = store.db.execute(
        f"select status, count(*) from trials where problem = ? and gpu_key in ({', '.join('?' * len(gpu_keys))}) "
        f"and template_hash in ({', '.join('?' * len(hashes))}) group by status",
        [result.problem.key, *gpu_keys, *hashes]).fetchall()
    counts = dict(rows)
    measured = sum(n for status, n in counts.items() if status not in ("running", "pruned"))
    failed = sum(counts.get(s, 0) for s in FAILED_STATUSES)
    return dataclasses.replace(result, measured=measured, failed=failed)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (one per worker)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
