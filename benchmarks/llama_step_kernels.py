"""What the small Llama of `autoflash bench --llama` runs with "sdpa" and with autoflash (GPU).

Two questions about a ratio near 1.00: do both implementations run the same kernels (if they do,
the ratio is noise), and how large is that noise? This prints, per implementation, the GPU
kernels of one training step (and one inference forward) grouped by name with their device time
(torch.profiler), the kernels only one of them runs, and then a paired timing: steps timed
A, B, B, A, ... (each with CUDA events around one step), the ratio of each adjacent pair, and the
median with its interquartile range.

    python benchmarks/llama_step_kernels.py [--pairs 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch

from autoflash.bench_llama import _small_llama, paired_speedup, step_ms


def kernel_times(fn, steps: int = 3) -> dict:
    """Kernel name -> (launches per step, device microseconds per step)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc[ev.name][0] += 1
            acc[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {name: (n / steps, us / steps) for name, (n, us) in acc.items()}


def paired_ratios(model, impls, fn, pairs: int) -> dict:
    """Steps timed in ABBA order; ratio = time(impls[0]) / time(impls[1]) per adjacent pair (>1: the
    second implementation is faster)."""
    ratios, times = [], {impl: [] for impl in impls}
    for p in range(pairs):
        order = impls if p % 2 == 0 else impls[::-1]
        t = {}
        for impl in order:
            model.set_attn_implementation(impl)
            t[impl] = step_ms(fn)
            times[impl].append(t[impl])
        ratios.append(t[impls[0]] / t[impls[1]])
    up = paired_speedup(ratios)
    return {"median_ratio": up["median"], "q1": up["q1"], "q3": up["q3"],
            "median_ms": {impl: statistics.median(v) for impl, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    batch, seqlen = 4, 2048
    model, name = _small_llama(seqlen)
    ids = torch.randint(0, model.config.vocab_size, (batch, seqlen), device="cuda")

    def infer():
        with torch.no_grad():
            model(ids)

    def train_step():
        model(ids, labels=ids).loss.backward()

    impls = ("sdpa", name)
    report = {}
    for step_name, fn in (("train_step", train_step), ("inference", infer)):
        kernels = {}
        for impl in impls:
            model.set_attn_implementation(impl)
            fn()
            kernels[impl] = kernel_times(fn)
        a, b = kernels["sdpa"], kernels[name]
        print(f"\n== {step_name}: device time per step: sdpa {sum(v[1] for v in a.values()) / 1e3:.3f} ms, "
              f"{name} {sum(v[1] for v in b.values()) / 1e3:.3f} ms")
        print(f"{'kernel':80s} {'sdpa n':>7s} {'sdpa us':>9s} {'af n':>6s} {'af us':>9s}")
        names = sorted(set(a) | set(b), key=lambda k: -max(a.get(k, (0, 0))[1], b.get(k, (0, 0))[1]))
        for k in names:
            na, ua = a.get(k, (0, 0.0))
            nb, ub = b.get(k, (0, 0.0))
            only = "" if (k in a and k in b) else ("  <- sdpa only" if k in a else "  <- autoflash only")
            if max(ua, ub) > 20 or only:
                print(f"{k[:80]:80s} {na:7.1f} {ua:9.1f} {nb:6.1f} {ub:9.1f}{only}")
        paired = paired_ratios(model, impls, fn, args.pairs)
        print(f"paired ({args.pairs} ABBA pairs): sdpa/autoflash time ratio median {paired['median_ratio']:.4f} "
              f"(IQR {paired['q1']:.4f}-{paired['q3']:.4f}); medians {paired['median_ms']}")
        report[step_name] = {"kernels": kernels, "paired": paired}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
