"""Benchmarks: autoflash (dispatched and default) vs torch SDPA backends, in one process and run.

Timings are interleaved: each round times every method once per shape, and the reported value
is the median over rounds of device-time medians (`tuning.timing.device_ms`: the kernels' own time,
the host kept ahead), each round's repetitions interleaved across the methods
(`device_ms_interleaved`), so slow drift hits all methods alike. The Llama steps are in
`bench_llama`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from typing import Callable

import torch

from autoflash import codegen
from autoflash.problem import Shape, geomean, unsupported_head_dim
from autoflash.reference import causal_offset_for, make_inputs, sdpa_backend
from autoflash.tuning import gate
from autoflash.tuning.timing import (SDPA_BACKENDS, device_ms_interleaved, if_it_runs, launch_callable, sdpa_callable,
                                     tflops, time_callable)
from autoflash.space import InvalidVariant, Variant, load_space
from autoflash.validate import odd_head_dims_stay_torch


@dataclasses.dataclass
class BenchRow:
    shape: Shape
    ms: dict  # method -> median ms (NaN when the method refused the shape)
    served: str = ""  # what the dispatched column ran (`served_by`): a cell at 1.00 may be the same kernel

    def tflops(self, method: str) -> float:
        return tflops(self.shape, self.ms.get(method, float("nan")))

    def ratio(self, method: str, base: str) -> float:
        a, b = self.tflops(method), self.tflops(base)
        return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else float("nan")

    def ratio_to_best_sdpa(self, method: str = "autoflash") -> float:
        """method / the fastest SDPA backend measured on this shape (NaN when none was)."""
        best = max((self.tflops(m) for m in self.ms if m.startswith("sdpa_") and math.isfinite(self.tflops(m))),
                   default=float("nan"))
        a = self.tflops(method)
        return a / best if math.isfinite(a) and best > 0 else float("nan")


def versus_best_sdpa(rows: list[BenchRow], method: str = "autoflash") -> str:
    """One line: the method against the best SDPA backend of each shape, geomean and lowest cell."""
    ratios = [(r.ratio_to_best_sdpa(method), r.shape.label()) for r in rows]
    ratios = [(x, label) for x, label in ratios if math.isfinite(x)]
    if not ratios:
        return f"{method} / best SDPA backend: not measured"
    low, where = min(ratios)
    return (f"{method} / best SDPA backend per shape: geomean {geomean([x for x, _ in ratios]):.3f}, "
            f"lowest {low:.3f} ({where}), {sum(x < 0.98 for x, _ in ratios)} of {len(ratios)} below 0.98")


def sdpa_backends(shapes: list[Shape]) -> tuple[str, ...]:
    """The SDPA backends a bench times: cuDNN and flash, and the efficient backend where a shape's V
    has a head dim of its own (torch's flash backend refuses those: cuDNN and efficient take them)."""
    return SDPA_BACKENDS + (("efficient",) if any(s.head_dim_v is not None for s in shapes) else ())


def _variant_fn(variant: Variant, shape: Shape, q, k, v, template_file=None) -> Callable[[], None]:
    """Raises ValueError for a TMA variant on TMA-incompatible tensors."""
    if shape.head_dim_v is not None and template_file is None:  # (rendered for V's head dim as the dispatcher serves it)
        from autoflash.device import gpu_fingerprint
        from autoflash.dispatch import Dispatcher

        kernel = Dispatcher._load(variant, shape.problem, gpu_fingerprint(q.device.index if q.is_cuda else None))
    else:  # (a baseline template: rendered for V's head dim too where the shape has one of its own)
        kernel = codegen.load(variant, template_file,
                              value_dim=shape.head_dim_v is not None and not load_space(variant.family).vendor)
    return launch_callable(kernel, shape, q, k, v, causal_offset_for(shape, "top_left"))


def kernel_choosers(disp, device, op: str) -> dict[str, Callable[[Shape], Variant]]:
    """The variants `autoflash bench` times per shape: dispatched (a vendor kernel where one won), own
    kernels only, the built-in default."""
    from autoflash.space import default_variant

    return {"autoflash": lambda s: disp.variant_for(s.problem, device),
            "autoflash-own": lambda s: disp.variant_for(s.problem, device, own_only=True),
            "default": lambda s: default_variant(op, s.problem, device)}


def served_pair_halves(disp, device) -> Callable[[Shape], tuple[Variant, Variant]]:
    """The own forward and backward a backward problem's training pair is timed with."""
    return lambda s: tuple(served_own_half(disp, s, device, half) for half in ("fwd", "bwd"))


def run_bench(shapes: list[Shape], variants: dict[str, Callable[[Shape], Variant]], rounds: int = 3,
              rep_ms: float = 50, sdpa: tuple = SDPA_BACKENDS, progress: Callable[[str], None] | None = None,
              device: str = "cuda", templates: dict[str, str] | None = None,
              pair_halves: Callable[[Shape], tuple[Variant, Variant]] | None = None) -> list[BenchRow]:
    """Time each named variant chooser and each SDPA backend on every shape: the forward, or for a
    backward shape forward + backward as the tuner times a backward problem (rows say op "fwdbwd"):
    after the own forward `pair_halves(shape)` names (and, for a pair with an SDPA forward, with its
    own backward; None: the defaults). templates: method name -> a template file to render that method's
    variants from instead of the package's. device='cpu' (the Triton interpreter) times one call by
    wall clock and skips SDPA: a pipeline check, not performance. Every method gets the same q, k, v,
    laid out as `shape.layout` says (strided (B, N, H, D) views for "bnhd")."""
    rows = []
    for shape in shapes:
        if progress:
            progress(shape.label())
        # (every method the same inputs)
        q, k, v = make_inputs(shape, device, seed=7, layout=shape.layout or "bhnd", draw_on_device=True)
        halves = pair_halves(shape) if shape.op == "bwd" and pair_halves is not None else (None, None)
        with _training_halves(*halves):  # (read when each pair is built)
            fns = {name: _variant_fn(choose(shape), shape, q, k, v, (templates or {}).get(name))
                   for name, choose in variants.items()}
        for backend in sdpa if device == "cuda" else ():
            fn = sdpa_callable(backend, shape, q, k, v, backward=shape.op == "bwd")
            if fn is not None:
                fns[f"sdpa_{backend}"] = fn
        for name, fn in list(fns.items()):
            try:
                fn()  # first call: kernel load (and, in the interpreter, its one-time set-up)
            except RuntimeError as e:
                if gate.VENDOR_REFUSAL not in str(e):
                    raise
                del fns[name]  # a vendor kernel with none for this shape (cuDNN at head dim 36): no column
        if rounds == 0:  # (compiling ahead: `bench_warm`)
            continue
        samples = {name: [] for name in fns}
        for r in range(rounds):
            for name, ms in timed_round(fns, q.device, rep_ms, r).items():
                samples[name].append(ms)
        ms = {name: statistics.median(s) for name, s in samples.items()}
        for name in (*variants, *(f"sdpa_{backend}" for backend in sdpa)):
            ms.setdefault(name, float("nan"))
        rows.append(BenchRow(dataclasses.replace(shape, op="fwdbwd") if shape.op == "bwd" else shape, ms))
        del q, k, v
    return rows


def timed_round(fns: dict, device, rep_ms: float, round_index: int) -> dict:
    """One round of a shape's timings, method -> ms: on a GPU every method's repetitions interleaved
    (`device_ms_interleaved`; the order of the methods reversed every other round); in the
    interpreter the wall clock of one call each."""
    names = alternating(tuple(fns), round_index)
    if torch.device(device).type == "cuda":
        return device_ms_interleaved({n: fns[n] for n in names}, warmup_ms=10, rep_ms=rep_ms, device=device)
    return {n: time_callable(fns[n], device, rep_ms) for n in names}


@contextlib.contextmanager
def _training_halves(forward: Variant | None, backward: Variant | None):
    """The own halves a backward variant is timed with (`gate.candidate_pair`), for the moment."""
    saved = gate.training_forward, gate.training_backward
    gate.training_forward, gate.training_backward = forward, backward
    try:
        yield
    finally:
        gate.training_forward, gate.training_backward = saved


def _fwdbwd_fn(method: str, shape: Shape, q, k, v, grad) -> Callable[[], None] | None:
    """Forward + backward through autograd: autoflash.attention (dispatched: a vendor pair where one
    won), autoflash's own kernels alone ("autoflash-own"), or SDPA with one backend forced."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    import autoflash
    from autoflash import ops
    from autoflash.training import EagerAttention

    gqa = shape.heads_q != shape.heads_kv
    if method == "autoflash":
        def fn():
            autoflash.attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa).backward(grad)
    elif method == "autoflash-own":  # the eager training path on the own pair (what is served where it won)
        pair = ops.training_pair(q, k, v, shape.head_dim ** -0.5, shape.causal, 0)

        def fn():
            EagerAttention.apply(q, k, v, pair).backward(grad)
    else:
        which = sdpa_backend(method)

        def fn():
            with sdpa_kernel([which]):
                F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa).backward(grad)
    return if_it_runs(fn)


def run_fwdbwd(shapes: list[Shape], methods=("autoflash", "autoflash-own", "sdpa_cudnn", "sdpa_flash"), rounds: int = 3,
               rep_ms: float = 100, memory: bool = False, progress=None) -> tuple[list[BenchRow], dict]:
    """Forward+backward timings (FLOPs counted as 3.5x forward) and, with memory=True, the peak
    memory each method allocates above its inputs, per shape label (bytes). Every method gets the same
    q, k, v leaves, laid out as `shape.layout` says, and the same contiguous output gradient."""
    rows, peaks = [], {}
    for shape in shapes:
        if progress:
            progress(shape.label())
        q, k, v = (t.requires_grad_() for t in make_inputs(shape, "cuda", seed=7, layout=shape.layout or "bhnd",
                                                                draw_on_device=True))
        grad = torch.randn((*q.shape[:3], v.shape[3]), device=q.device, dtype=q.dtype)  # (the output's: D_v; contiguous)
        fns = {m: _fwdbwd_fn(m, shape, q, k, v, grad) for m in methods}  # (each called once)
        if rounds == 0:  # (compiling ahead: `bench_warm`)
            continue
        if memory:
            for m, fn in fns.items():
                if fn is None:
                    continue
                for t in (q, k, v):
                    t.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                peaks[(shape.label(), m)] = torch.cuda.max_memory_allocated() - base
        samples = {m: [] for m, fn in fns.items() if fn is not None}
        for r in range(rounds):
            for m, ms in timed_round({m: fns[m] for m in samples}, q.device, rep_ms, r).items():
                samples[m].append(ms)
        ms = {m: statistics.median(samples[m]) if m in samples else float("nan") for m in methods}
        rows.append(BenchRow(dataclasses.replace(shape, op="fwdbwd"), ms))
        del q, k, v, grad
    return rows, peaks


def dispatch_overhead(calls: int = 2000, repeats: int = 7) -> dict:
    """Per-call host time (µs) of autoflash.attention vs launching the same compiled kernel
    directly, on a tiny shape (the GPU work is negligible, so host time dominates). The two are
    timed in alternating runs of `calls` calls (host clocks drift: interleaving keeps the
    comparison fair), median over `repeats` runs each; the GPU is synchronized once per run."""
    import time

    import autoflash
    from autoflash.dispatch import get_dispatcher

    shape = Shape(1, 1, 1, 128, 128, 64, True, "bfloat16")
    q, k, v = make_inputs(shape, "cuda", seed=1)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    host = get_dispatcher().kernel_for(q, k, v, out, causal=True, own_only=True).host
    scale = 1.0 / math.sqrt(shape.head_dim)
    fns = {"bare_launch_us": lambda: host.launch(q=q, k=k, v=v, o=out, lse=lse, sm_scale=scale, causal=True,
                                                 causal_offset=0),
           "autoflash_attention_us": lambda: autoflash.attention(q, k, v, is_causal=True),
           "torch_sdpa_us": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)}
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # compile, load, and let the API remember this call signature
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    result = {name: statistics.median(t) for name, t in times.items()}
    result["overhead_us"] = result["autoflash_attention_us"] - result["bare_launch_us"]
    return result


def alternating(impls: tuple, round_index: int) -> tuple:
    """The order of one interleaved round: reversed every other round, so that a drift over the run
    (clocks, temperature, the allocator's state) does not always favour the implementation timed
    first (a fixed order leaves that bias in every round)."""
    return impls[::-1] if round_index % 2 else impls


def served_by(disp, shape: Shape, device, op: str) -> str:
    """What `autoflash.attention` runs for `shape` (op 'fwd'), or for its training step (op 'bwd'):
    an own kernel family's name, `sdpa-<backend>`, or a pair "forward + backward" whose halves are
    each an own family or SDPA's (the own forward serves with an own backward); "torch SDPA
    (fallback)" where no own kernel takes the shape (the API falls back to torch SDPA there)."""
    def own(half_op: str) -> str:
        return served_own_half(disp, shape, device, half_op).family

    odd = shape.head_dim % 8 or shape.value_dim % 8
    if unsupported_head_dim(shape.head_dim) or (odd and odd_head_dims_stay_torch(device.on_gpu)):
        return "torch SDPA (fallback)"
    try:
        variant = disp.variant_for(dataclasses.replace(shape, op=op).problem, device)
        return _served_name(variant, op, own)
    except InvalidVariant:
        return "torch SDPA (fallback)"


def served_own_half(disp, shape: Shape, device, op: str) -> Variant:
    """The own kernel a training step pairs with the other half (the own winner, else the default)."""
    return disp.variant_for(dataclasses.replace(shape, op=op).problem, device, own_only=True)


def _served_name(variant: Variant, op: str, own: Callable[[str], str]) -> str:
    if not load_space(variant.family).vendor:
        return variant.family if op != "bwd" else f"{own('fwd')} + {variant.family}"
    knobs = variant.as_dict()
    backend = f"sdpa-{knobs['BACKEND']}"
    halves = [own(half_op) if knobs.get(half) == "autoflash" else backend
              for half, half_op in (("FORWARD", "fwd"), ("BACKWARD", "bwd"))]
    return backend if op != "bwd" or halves == [backend, backend] else " + ".join(halves)


def fmt_tflops(x: float) -> str:
    """A TFLOP/s table cell: '-' when not measured, 2 significant digits when below 1."""
    if x != x:
        return "-"
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def summary(rows: list[BenchRow], methods: list[str], base: str = "sdpa_cudnn") -> dict:
    """Geomean TFLOP/s per method and geomean ratio to `base`."""
    return {m: (geomean([r.tflops(m) for r in rows]), geomean([r.ratio(m, base) for r in rows]))
            for m in methods}


def rich_table(rows: list[BenchRow], methods: list[str], title: str, base: str = "sdpa_cudnn"):
    from rich.table import Table

    t = Table(title=title)
    t.add_column("shape")
    for m in methods:
        t.add_column(f"{m}\nTFLOP/s", justify="right")
    for m in methods:
        if m != base:
            t.add_column(f"{m}\n/ {base}", justify="right")
    served = any(r.served for r in rows)  # (a column only where it was filled in)
    if served:
        t.add_column("autoflash\nserves")
    for r in rows:
        t.add_row(r.shape.label(), *(fmt_tflops(r.tflops(m)) for m in methods),
                  *(f"{r.ratio(m, base):.2f}" for m in methods if m != base), *([r.served] if served else []))
    s = summary(rows, methods, base)
    t.add_row("[bold]geomean[/]", *(f"[bold]{fmt_tflops(s[m][0])}[/]" for m in methods),
              *(f"[bold]{s[m][1]:.3f}[/]" for m in methods if m != base), *([""] if served else []))
    return t


def markdown_table(rows: list[BenchRow], methods: list[str], base: str = "sdpa_cudnn") -> str:
    served = any(r.served for r in rows)  # (a column only where it was filled in)
    head = ["shape", *(f"{m} TFLOP/s" for m in methods), *(f"{m}/{base}" for m in methods if m != base),
            *(["autoflash serves"] if served else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r.shape.label(), *(fmt_tflops(r.tflops(m)) for m in methods),
                                         *(f"{r.ratio(m, base):.2f}" for m in methods if m != base),
                                         *([r.served] if served else [])]) + " |")
    s = summary(rows, methods, base)
    lines.append("| **geomean** | " + " | ".join([*(f"**{fmt_tflops(s[m][0])}**" for m in methods),
                                                 *(f"**{s[m][1]:.3f}**" for m in methods if m != base),
                                                 *([""] if served else [])]) + " |")
    return "\n".join(lines)


def plot(rows: list[BenchRow], methods: list[str], path: str, title: str) -> None:
    """Grouped bars of TFLOP/s per shape and method, saved to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.6), 4.5))
    for i, m in enumerate(methods):
        ax.bar([j + i * width for j in range(len(rows))], [r.tflops(m) for r in rows], width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([r.shape.short_label() for r in rows], fontsize=8, rotation=45, ha="right")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


IMPL_NAMES = {"autoflash": "autoflash", "default": "autoflash-default", "baseline": "autoflash-baseline",
              "sdpa_cudnn": "sdpa-cudnn", "sdpa_flash": "sdpa-flash"}


def json_rows(rows: list[BenchRow], methods: list[str], metric: str, device) -> list[dict]:
    """One row per (shape, implementation): the shape's fields, `impl`, `metric` (TFLOP/s, null
    where the implementation refused the shape), and the device and versions it was measured on; the
    dispatched implementation's rows also say what it ran (`served`)."""
    out = []
    for r in rows:
        shape = r.shape.as_dict()
        shape.pop("op", None)
        for m in methods:
            tf = r.tflops(m)
            out.append({**shape, "impl": IMPL_NAMES.get(m, m), metric: float(f"{tf:.4g}") if math.isfinite(tf) else None,
                        "gpu": device.name, "torch": device.torch_version, "triton": device.triton_version,
                        **({"served": r.served} if m == "autoflash" and r.served else {})})
    return out
