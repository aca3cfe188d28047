"""d256 forward/backward tiles (8 warps) and GQA_SPLIT on real models' shapes: every variant is
gated first (the tuner's gate: float64 reference, ragged lengths), then timed alone (direct
launches, do_bench medians, 2 interleaved rounds) next to SDPA-cuDNN's backward (or forward) in the
same process. GPU only.

    python benchmarks/backward_variants_sweep.py all    # d256 backward + GQA splits + d256 forward
    python benchmarks/backward_variants_sweep.py gqa    # GQA_SPLIT on the model set's GQA shapes
    python benchmarks/backward_variants_sweep.py prof   # per-kernel time of d256 backward variants
    python benchmarks/backward_variants_sweep.py dq     # dQ modes (separate, atomic, tma_reduce) on the
                                                        # cliffs and Gemma-2's training shapes (device time)

Writes backward_variants_<phase>.json under $OUT (default /tmp); results: docs/results/2026-12-02-h200-d256-gqa-split.md
(phase dq: docs/results/2026-12-02-h200-tma-reduce-dq.md).
"""
import concurrent.futures as cf, itertools, json, math, os, statistics, sys, time
import torch

PHASE = sys.argv[1] if len(sys.argv) > 1 else "all"

# shape specs: (batch, query heads, KV heads, sequence length, head dim), causal, bf16
D256 = [(16, 16, 8, 512, 256), (4, 16, 8, 2048, 256), (1, 16, 8, 8192, 256), (1, 8, 8, 4096, 256)]
GQA = [(16, 8, 1, 512, 128), (4, 8, 1, 2048, 128), (1, 8, 1, 8192, 128),
       (16, 14, 2, 512, 64), (4, 14, 2, 2048, 64), (1, 14, 2, 8192, 64),
       (16, 9, 3, 512, 64), (4, 9, 3, 2048, 64), (16, 28, 4, 512, 128), (16, 32, 8, 512, 128),
       (2, 32, 32, 1777, 64), (3, 12, 12, 1024, 128)]
# the four cliffs, Gemma-2-9B's training shapes, Llama-3-8B and Qwen2.5-0.5B at 2k and 8k
DQ = [(1, 8, 8, 4096, 128), (1, 8, 8, 4096, 256), (3, 12, 12, 1024, 128), (2, 32, 32, 1777, 64),
      (16, 16, 8, 512, 256), (4, 16, 8, 2048, 256), (1, 16, 8, 8192, 256),
      (4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128), (4, 14, 2, 2048, 64), (16, 32, 8, 512, 128)]


def dq_variants(fp, shape, space):
    """The shape's default, its best-known atomic form, and the tma_reduce tiles that fit."""
    prob = shape.problem
    base = space.nearest_valid(space.default_for(prob, fp), prob, fp)
    out = [base]
    d = shape.head_dim
    tiles = ([(64, 64, 8), (32, 64, 8), (32, 64, 4)] if d > 128 else
             [(64, 128, 8), (64, 64, 4), (32, 128, 4), (64, 64, 8), (128, 128, 8)])
    for (m1, n1, w), st, loads, order, mode in itertools.product(tiles, [1, 2, 3], ["tma", "pointer"],
                                                                 ["kv_major", "heavy_first"], ["tma_reduce", "atomic"]):
        if mode == "atomic" and (loads, order) != ("pointer", base["GRID_ORDER"]):
            continue
        out.append(base.replace(BLOCK_M1=m1, BLOCK_N1=n1, num_warps=w, num_stages=st, LOADS=loads,
                                GRID_ORDER=order, DQ_MODE=mode, BLOCK_M2=64, BLOCK_N2=32))
    return [v for i, v in enumerate(out) if not space.violations(v, prob, fp) and v not in out[:i]]


def bwd_variants(fp, shape, space):
    from autoflash.space import InvalidVariant
    prob = shape.problem
    base = space.nearest_valid(space.default_for(prob, fp), prob, fp)
    out = [base]
    B, Hq, Hkv, N, d = shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q, shape.head_dim
    if d == 256:
        for (m1, n1, w), st, dq, loads in itertools.product([(32, 64, 4), (32, 64, 8), (64, 64, 8)], [2, 3],
                                                             ["sep64x32", "sep64x64", "atomic"], ["pointer", "tma"]):
            m2, n2, mode = (64, 32, "atomic") if dq == "atomic" else ((64, 32, "separate") if dq == "sep64x32" else (64, 64, "separate"))
            out.append(base.replace(BLOCK_M1=m1, BLOCK_N1=n1, num_warps=w, num_stages=st, BLOCK_M2=m2, BLOCK_N2=n2,
                                    DQ_MODE=mode, LOADS=loads, GQA_SPLIT=1))
        for w, m1 in ((8, 32), (8, 64)):
            out.append(base.replace(BLOCK_M1=m1, BLOCK_N1=64, num_warps=w, num_stages=2, BLOCK_M2=64, BLOCK_N2=32,
                                    DQ_MODE="separate", LOADS="tma", GQA_SPLIT=2))
    else:
        g = Hq // Hkv
        for split, mode in itertools.product([1, 2, 4, 8], ["separate", "atomic"]):
            if split > max(g, 1):
                continue
            kw = dict(GQA_SPLIT=split, DQ_MODE=mode)
            if mode == "atomic":
                kw.update(BLOCK_M2=64, BLOCK_N2=32)
            out.append(base.replace(**kw))
        if d == 64:
            for split in sorted({1, min(g, 2), min(g, 4)}):
                out.append(base.replace(GQA_SPLIT=split, BLOCK_N1=128, BLOCK_M1=64, num_warps=8))
    valid = []
    for v in out:
        if not space.violations(v, prob, fp) and v not in valid:
            valid.append(v)
    return valid


def fwd_variants(fp, shape, space):
    prob = shape.problem
    base = space.nearest_valid(space.default_for(prob, fp), prob, fp)
    out = [base]
    for n, st, loads, order in itertools.product([32, 64], [2, 3], ["tma", "pointer"], ["m_major", "heavy_first"]):
        out.append(base.replace(BLOCK_M=128, BLOCK_N=n, num_warps=8, num_stages=st, LOADS=loads, GRID_ORDER=order))
    for st, order in itertools.product([2, 3, 4], ["m_major", "heavy_first"]):
        out.append(base.replace(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=st, GRID_ORDER=order))
    return [v for i, v in enumerate(out) if not space.violations(v, prob, fp) and v not in out[:i]]


def compile_one(args):
    fam, knobs, spec = args
    import torch
    from autoflash import codegen
    from autoflash.space import Variant
    from autoflash.problem import Shape
    from autoflash.reference import make_inputs
    B, Hq, Hkv, N, d = spec
    op = "fwd" if fam == "triton_fwd" else "bwd"
    sh = Shape(1, Hq, Hkv, 256, 256, d, True, "bfloat16", op=op)
    q, k, v = make_inputs(sh, "cuda", seed=0)
    t0 = time.time()
    try:
        codegen.load(Variant.of(fam, knobs)).compile_for(q, k, v, True, 0)
        return None, time.time() - t0
    except Exception as e:  # noqa
        return f"{type(e).__name__}: {str(e)[:300]}", time.time() - t0


def main():
    from autoflash import codegen
    from autoflash.device import gpu_fingerprint
    from autoflash.problem import Shape
    from autoflash.space import load_space
    from autoflash.tuning.gate import check
    from autoflash.tuning.timing import bench_ms, device_ms
    from autoflash.reference import make_inputs
    from autoflash.tuning.gate import forward_kernel_for_backward
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    fp = gpu_fingerprint()
    bspace, fspace = load_space("bwd"), load_space("fwd")
    jobs = []  # (op, spec, variants)
    if PHASE == "prof":
        return profile()
    if PHASE == "dq":
        for spec in DQ:
            sh = Shape(*spec[:4], spec[3], spec[4], True, "bfloat16", op="bwd")
            jobs.append(("bwd", spec, dq_variants(fp, sh, bspace)))
    if PHASE in ("all", "bwd", "gqa"):
        for spec in (GQA if PHASE == "gqa" else D256 + GQA):
            sh = Shape(*spec[:4], spec[3], spec[4], True, "bfloat16", op="bwd")
            jobs.append(("bwd", spec, bwd_variants(fp, sh, bspace)))
    if PHASE in ("all", "fwd"):
        for spec in D256[:3]:
            sh = Shape(*spec[:4], spec[3], spec[4], True, "bfloat16", op="fwd")
            jobs.append(("fwd", spec, fwd_variants(fp, sh, fspace)))
    # compile every distinct (variant, head_dim, group) in parallel processes (Triton's disk cache)
    todo = {}
    for op, spec, vs in jobs:
        for v in vs:
            todo.setdefault((v.json(), spec[4]), (v.family, v.as_dict(), spec))
    t0 = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    errors = {}
    with cf.ProcessPoolExecutor(14, mp_context=ctx) as ex:
        for key, (err, secs) in zip(todo, ex.map(compile_one, todo.values())):
            if err:
                errors[key[0]] = err
    print(f"compiled {len(todo)} variants in {time.time() - t0:.0f} s, {len(errors)} errors", flush=True)
    for k, e in list(errors.items())[:5]:
        print("  ", k, e, flush=True)
    results = []
    gated = {}
    for op, spec, vs in jobs:
        B, Hq, Hkv, N, d = spec
        sh = Shape(B, Hq, Hkv, N, N, d, True, "bfloat16", op=op)
        q, k, v = make_inputs(sh, "cuda", seed=1)
        do = torch.randn_like(q)
        scale = d ** -0.5
        fns = {}
        if op == "bwd":
            fk = forward_kernel_for_backward(q, k, v, True)
            o = torch.empty_like(q); lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
            fk.forward(q, k, v, o, lse, scale, True, 0)
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ref_out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=Hq != Hkv)
            fns["cudnn_bwd"] = lambda: torch.autograd.grad(ref_out, leaves, do, retain_graph=True)
        else:
            def cud():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
            fns["cudnn_fwd"] = cud
        for i, var in enumerate(vs):
            if var.json() in errors:
                results.append(dict(op=op, spec=spec, variant=var.as_dict(), status="compile_error"))
                continue
            kern = codegen.load(var)
            gk = (var.json(), d, Hq // Hkv)
            if gk not in gated:
                try:
                    gated[gk] = check(kern, sh, "cuda")
                except Exception as e:
                    gated[gk] = e
            g = gated[gk]
            if isinstance(g, Exception) or not g.passed:
                results.append(dict(op=op, spec=spec, variant=var.as_dict(), status="gate_fail", detail=str(getattr(g, "detail", g))[:200]))
                print(f"GATE FAIL {op} {spec} {var.short()}: {getattr(g, 'detail', g)}", flush=True)
                continue
            name = f"v{i}"
            if op == "bwd":
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                launch = kern.bind_backward(q, k, v, o, lse, do, dq, dk, dv, scale, True, 0)
                fns[name] = (lambda launch=launch, dq=dq, dk=dk, dv=dv: launch(q, k, v, o, lse, do, dq, dk, dv)) if launch else \
                    (lambda kern=kern, dq=dq, dk=dk, dv=dv: kern.backward(q, k, v, o, lse, do, dq, dk, dv, scale, True, 0))
            else:
                out = torch.empty_like(q); l2 = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
                launch = kern.bind_forward(q, k, v, out, l2, scale, True, 0)
                fns[name] = (lambda launch=launch, out=out, l2=l2: launch(q, k, v, out, l2)) if launch else \
                    (lambda kern=kern, out=out, l2=l2: kern.forward(q, k, v, out, l2, scale, True, 0))
            results.append(dict(op=op, spec=spec, variant=var.as_dict(), status="ok", name=name, short=var.short()))
        times = {n: [] for n in fns}
        for _ in range(2):
            for n, fn in fns.items():
                times[n].append(device_ms(fn, rep_ms=25) if PHASE == "dq" else bench_ms(fn, warmup_ms=5, rep_ms=25))
        med = {n: statistics.median(t) for n, t in times.items()}
        ref = med.get("cudnn_bwd", med.get("cudnn_fwd"))
        flops = 4 * B * Hq * N * N * d / 2 * (2.5 if op == "bwd" else 1)
        print(f"== {op} B{B} H{Hq}/{Hkv} N{N} d{d}: cuDNN {ref*1e3:.1f} us {flops/ref/1e9:.0f} TFLOP/s", flush=True)
        rows = [r for r in results if r["op"] == op and r["spec"] == spec and r["status"] == "ok"]
        for r in rows:
            r["ms"] = med[r["name"]]; r["cudnn_ms"] = ref; r["ratio"] = ref / r["ms"]
        for r in sorted(rows, key=lambda r: r["ms"])[:8] + [rows[0]] if rows else []:
            print(f"   {r['name']:4s} {r['ms']*1e3:8.1f} us  {r['ratio']:.2f}x cuDNN  {r['short']}", flush=True)
        with open(f"{os.environ.get('OUT', '/tmp')}/backward_variants_{PHASE}.json", "w") as f:
            json.dump(results, f)


def profile():
    """Per-kernel GPU time of d256 backward variants (torch.profiler)."""
    from torch.profiler import profile as prof, ProfilerActivity
    from autoflash import codegen
    from autoflash.space import Variant
    from autoflash.problem import Shape
    from autoflash.reference import make_inputs
    from autoflash.tuning.gate import forward_kernel_for_backward
    base = dict(BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, DQ_MODE="separate", GQA_SPLIT=1,
                GRID_ORDER="kv_major", LOADS="tma", num_stages=2, num_warps=8)
    variants = [base, dict(base, GRID_ORDER="heavy_first"), dict(base, BLOCK_M2=32, BLOCK_N2=64),
                dict(base, BLOCK_M2=128, BLOCK_N2=32), dict(base, num_stages=1),
                dict(base, BLOCK_M2=64, BLOCK_N2=64, num_stages=2, BLOCK_M1=32)]
    for spec in [(1, 8, 8, 4096, 256), (4, 16, 8, 2048, 256)]:
        B, Hq, Hkv, N, d = spec
        sh = Shape(B, Hq, Hkv, N, N, d, True, "bfloat16", op="bwd")
        q, k, v = make_inputs(sh, "cuda", seed=1)
        do = torch.randn_like(q)
        o = torch.empty_like(q); lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        forward_kernel_for_backward(q, k, v, True).forward(q, k, v, o, lse, d ** -0.5, True, 0)
        for kn in variants:
            kern = codegen.load(Variant.of("triton_bwd", kn))
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            try:
                for _ in range(3):
                    kern.backward(q, k, v, o, lse, do, dq, dk, dv, d ** -0.5, True, 0)
                torch.cuda.synchronize()
                with prof(activities=[ProfilerActivity.CUDA]) as p:
                    for _ in range(5):
                        kern.backward(q, k, v, o, lse, do, dq, dk, dv, d ** -0.5, True, 0)
                    torch.cuda.synchronize()
                parts = {e.key: e.device_time_total / 5 for e in p.key_averages() if e.device_time_total > 0}
                print(spec, Variant.of("triton_bwd", kn).short(), {k2[:20]: round(t) for k2, t in parts.items()}, flush=True)
            except Exception as e:
                print(spec, kn, "ERR", str(e)[:200], flush=True)


if __name__ == "__main__":
    main()
