"""Compiling a benchmark's kernels ahead of its timings, in parallel worker processes.

A benchmark of many shapes spends most of its wall time compiling: each Triton/Gluon compile is
single-threaded, and a shape set of 64 random problems holds ~60 specializations (head dim,
causality, dtype, GQA group) of three kernels each. Worker processes run every shape's methods once
first, filling Triton's and autoflash's on-disk kernel caches; the timing process then only loads
them. Nothing is timed here, and nothing here decides a result: a call that fails in a worker fails
again, and is reported, where the benchmark builds it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing

from autoflash.device import compile_processes
from autoflash.problem import Shape


def default_jobs() -> int:
    """As the tuner's compile pool (`device.compile_processes`): nothing is timed while they run.
    Half the CPUs left a 64-problem random set compiling for over 200 s on 16 cores."""
    return compile_processes()


def compile_ahead(shapes: list[Shape], mode: str, jobs: int) -> int:
    """Run each shape's benchmark methods once in `jobs` spawned processes (mode "fwd", "bwd" or
    "fwdbwd", as `autoflash bench` times them). Returns the number of worker chunks that raised."""
    if jobs <= 1 or len(shapes) < 2:
        return 0
    chunks = [shapes[i::jobs] for i in range(min(jobs, len(shapes)))]
    context = multiprocessing.get_context("spawn")  # (a forked CUDA context is unusable)
    with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=context) as pool:
        futures = [pool.submit(_run_once, mode, chunk) for chunk in chunks]
        return sum(f.exception() is not None for f in futures)


def _run_once(mode: str, shapes: list[Shape]) -> None:
    from autoflash import bench
    from autoflash.device import gpu_fingerprint
    from autoflash.dispatch import get_dispatcher

    if mode == "fwdbwd":
        bench.run_fwdbwd(shapes, rounds=0)
        return
    disp, device = get_dispatcher(), gpu_fingerprint()
    bench.run_bench(shapes, bench.kernel_choosers(disp, device, mode), rounds=0, sdpa=(),
                    pair_halves=bench.served_pair_halves(disp, device))
