"""Where dropout's time goes, and how much a tuned variant would win back: on BERT-large's and
Llama-3-8B's training shapes, every sampled forward and backward variant of the Triton families is
timed with dropout 0.1 rendered in and without it (direct launches, do_bench medians, interleaved
rounds), beside SDPA's backends with and without the same dropout, in one process. GPU only.

Each dropout variant's output (and gradients) is compared with the op's default variant's under the
same seed (the same mask: the kernels draw it per row and 8 keys, whatever the tiles) before it is
timed: a variant that differs is reported, never timed.

    python benchmarks/dropout_variants_sweep.py --json dropout-sweep.json [--variants 24]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import random
import statistics
import time

import torch

CASES = {  # name: (batch, query heads, KV heads, sequence length, head dim, causal)
    "bert-large": (32, 16, 16, 512, 64, False),
    "llama-3-8b": (4, 32, 8, 2048, 128, True),
}
P = 0.1


def _inputs(case, seed=0):
    from autoflash.problem import Shape
    from autoflash.reference import make_inputs

    b, hq, hkv, n, d, causal = CASES[case]
    q, k, v = make_inputs(Shape(b, hq, hkv, n, n, d, causal, "bfloat16"), "cuda", seed=seed, draw_on_device=True)
    return q, k, v, causal, d ** -0.5


def _variants(op, case, count, rng):
    """The op's default (as the dispatcher serves an untuned problem) and `count` sampled valid
    variants of the Triton family, without warp specialization (dropout's is not yet GPU-checked)."""
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Shape
    from autoflash.space import load_space

    b, hq, hkv, n, d, causal = CASES[case]
    family = "triton_fwd" if op == "fwd" else "triton_bwd"
    space, device = load_space(family), gpu_fingerprint()
    problem = Shape(b, hq, hkv, n, n, d, causal, "bfloat16", op=op).problem
    default = space.nearest_valid(space.default_for(problem, device), problem, device)
    if default.as_dict().get("WARP_SPECIALIZE"):
        default = space.nearest_valid(default.replace(WARP_SPECIALIZE=False), problem, device)
    pool = [v for v in space.valid_variants(problem, device) if not v.as_dict().get("WARP_SPECIALIZE")
            and v.as_dict().get("DKDV_KERNEL", "triton") == "triton" and v.as_dict().get("DQ_MODE") != "ordered"]
    picked = rng.sample(pool, min(count, len(pool)))
    return [default] + [v for v in picked if v != default]


def _run(op, case, variant, dropout, seed=1234):
    """One launch of the variant (rendered with dropout or not); returns the outputs."""
    from autoflash import codegen
    from autoflash.dropout import DropoutArgs

    q, k, v, causal, scale = _inputs(case)
    args = DropoutArgs(P, 1 << 40 | seed) if dropout else None
    kernel = codegen.load(variant, dropout=dropout)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    if op == "fwd":
        return kernel, (q, k, v, o, lse, scale, causal, args), None
    base = codegen.load(_variants("fwd", case, 0, random.Random(0))[0], dropout=dropout)
    base.forward(q, k, v, o, lse, scale, causal, 0, dropout=args)
    do = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(seed))
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return kernel, (q, k, v, o, lse, do, *grads, scale, causal, args), grads


def _call(op, kernel, a):
    if op == "fwd":
        q, k, v, o, lse, scale, causal, args = a
        kernel.forward(q, k, v, o, lse, scale, causal, 0, dropout=args)
        return (o,)
    q, k, v, o, lse, do, dq, dk, dv, scale, causal, args = a
    kernel.backward(q, k, v, o, lse, do, dq, dk, dv, scale, causal, 0, dropout=args)
    return (dq, dk, dv)


def _compile(job):
    """In a worker process: build one (op, case, variant, dropout) by running it once."""
    op, case, variant_json, dropout = job
    from autoflash.space import Variant

    try:
        family = "triton_fwd" if op == "fwd" else "triton_bwd"
        kernel, a, _ = _run(op, case, Variant.of(family, json.loads(variant_json)), dropout)
        _call(op, kernel, a)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 (reported per variant)
        return f"{type(e).__name__}: {str(e)[:200]}"


def _sdpa(case, dropout, training):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, causal, _ = _inputs(case)
    gqa = q.shape[1] != k.shape[1]
    leaves = [t.detach().clone().requires_grad_(training) for t in (q, k, v)]
    g = torch.randn_like(q)
    out = {}
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(*leaves, dropout_p=P if dropout else 0.0, is_causal=causal,
                                                   enable_gqa=gqa)
            if training:
                o.backward(g)
        try:
            fn()
            torch.cuda.synchronize()
            out[name] = fn
        except RuntimeError:
            pass
    return out


def main() -> None:
    import triton
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--variants", type=int, default=24, help="sampled variants per op and case")
    parser.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 4) - 2)))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from autoflash.space import Variant  # noqa: F401 (fails early where autoflash is missing)

    rng = random.Random(7)
    plan = {(op, case): _variants(op, case, args.variants, rng) for case in CASES for op in ("fwd", "bwd")}
    jobs = [(op, case, v.json(), dropout) for (op, case), vs in plan.items() for v in vs for dropout in (True, False)]
    t0 = time.time()
    with cf.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        errors = {job: err for job, err in zip(jobs, ex.map(_compile, jobs)) if err}
    print(f"built {len(jobs)} kernels in {time.time() - t0:.0f} s, {len(errors)} errors", flush=True)

    ms = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")  # noqa: E731
    rows = []
    for case in CASES:
        b, hq, hkv, n, d, causal = CASES[case]
        fwd_flops = 4 * b * hq * n * n * d * (0.5 if causal else 1.0)
        for dropout in (True, False):
            for training, label in ((False, "fwd"), (True, "fwd+bwd")):
                fns = _sdpa(case, dropout, training)
                timed = {m: statistics.median(ms(f) for _ in range(args.rounds)) for m, f in fns.items()}
                rows.append(dict(case=case, kind="sdpa", op=label, dropout=dropout, ms=timed))
                print(case, "sdpa", label, "dropout" if dropout else "plain",
                      {m: round(t, 3) for m, t in timed.items()}, flush=True)
        for op in ("fwd", "bwd"):
            flops = fwd_flops * (1 if op == "fwd" else 2.5)
            reference = {}
            for i, variant in enumerate(plan[(op, case)]):
                for dropout in (True, False):
                    row = dict(case=case, kind="own", op=op, dropout=dropout, variant=variant.as_dict(), default=i == 0)
                    job = (op, case, variant.json(), dropout)
                    if job in errors:
                        rows.append({**row, "status": "error", "detail": errors[job]})
                        continue
                    kernel, a, _ = _run(op, case, variant, dropout)
                    got = [t.float().clone() for t in _call(op, kernel, a)]
                    if dropout not in reference:
                        reference[dropout] = got
                    worst = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-6)).item()
                                for x, y in zip(got, reference[dropout]))
                    if worst > 0.02:
                        rows.append({**row, "status": "differs", "detail": f"max relative difference {worst:.3g}"})
                        print(f"DIFFERS {case} {op} {variant.short()} dropout={dropout}: {worst:.3g}", flush=True)
                        continue
                    t = statistics.median(ms(lambda: _call(op, kernel, a)) for _ in range(args.rounds))
                    rows.append({**row, "status": "ok", "ms": t, "tflops": flops / t / 1e9})
            for dropout in (True, False):
                ok = [r for r in rows if r["case"] == case and r["op"] == op and r.get("status") == "ok"
                      and r["dropout"] == dropout]
                if ok:
                    best, default = min(ok, key=lambda r: r["ms"]), next((r for r in ok if r["default"]), None)
                    print(f"{case} own {op} {'dropout' if dropout else 'plain'}: best {best['ms']:.3f} ms "
                          f"default {default['ms'] if default else float('nan'):.3f} ms over {len(ok)} variants "
                          f"(best {json.dumps(best['variant'])})", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"), "p": P,
            "command": f"python benchmarks/dropout_variants_sweep.py --variants {args.variants}"}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "cases": CASES, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
