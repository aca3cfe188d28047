"""The flash-attn drop-in's costs of its extra arguments, on the GPU, one process, interleaved:

- `deterministic=True`: 100 repeated backward passes must be bitwise equal (dense and varlen), and
  the deterministic training pair (forward + backward) is timed beside the default pair;
- paged prefill: `flash_attn_varlen_func` with a `block_table` (16- and 256-token pages, pages in a
  shuffled order) against the same call on a contiguous packed K/V — chunked prefill's shape: each
  sequence's new queries against its whole cache, causal (bottom-right);
- dropout 0.1 training pairs (BERT-large and Llama shapes): `autoflash.flash_attn_func` against torch
  SDPA's backends with the same dropout (each backend that takes the call).

Times are medians of `triton.testing.do_bench` (CUDA events) over interleaved rounds. Prints one
line per case and writes every number as JSON.

    python benchmarks/dropin_speed.py --json dropin-speed.json [--parts deterministic,paged,dropout]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import autoflash

ROUNDS = 5
SDPA = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")


def interleaved(fns: dict) -> dict:
    """Median ms of each function, rounds alternating the order (no method always runs first)."""
    samples = {name: [] for name in fns}
    for r in range(ROUNDS):
        for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            samples[name].append(ms(fns[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


def rand(*shape, grad=False, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)


def attention_flops(pairs, heads, head_dim, causal) -> float:
    """Forward FLOPs of (queries, keys) pairs; causal bottom-right: the masked triangle left out."""
    total = 0
    for nq, nk in pairs:
        seen = nq * nk - nq * (nq - 1) // 2 if causal and nq <= nk else nq * nk
        total += 4 * seen * heads * head_dim
    return total


def record(results: list, part: str, timed: dict, flops: float, **fields) -> dict:
    """One JSON row: the case's fields, each method's median ms and TFLOP/s."""
    row = {"part": part, **fields, "ms": timed, "tflops": {m: flops / t / 1e9 for m, t in timed.items()}}
    results.append(row)
    return row


# ----------------------------------------------------------------------------- deterministic
def deterministic(results: list) -> None:
    for batch, n, heads, kv, d in ((4, 2048, 32, 8, 128), (8, 1024, 16, 16, 64)):
        torch.manual_seed(0)
        q, k, v = rand(batch, n, heads, d, grad=True), rand(batch, n, kv, d, grad=True), rand(batch, n, kv, d, grad=True)
        g = torch.randn_like(q)

        def pair(det):
            q.grad = k.grad = v.grad = None
            autoflash.flash_attn_func(q, k, v, causal=True, deterministic=det).backward(g)

        def grads(det):
            pair(det)
            return [t.grad.clone() for t in (q, k, v)]

        first = grads(True)
        repeats_equal = all(all(torch.equal(a, b) for a, b in zip(first, grads(True))) for _ in range(99))
        # varlen: the same tokens packed as ragged sequences
        lengths = [n // 2, n + n // 3, 37, n - n // 3 - 37][:batch] + [n] * max(0, batch - 4)
        lengths[-1] += batch * n - sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        qp, kp, vp = (t.detach().reshape(batch * n, *t.shape[2:]).clone().requires_grad_() for t in (q, k, v))
        gp = g.reshape(batch * n, heads, d)

        def varlen_grads():
            qp.grad = kp.grad = vp.grad = None
            autoflash.flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lengths), max(lengths), causal=True,
                                             deterministic=True).backward(gp)
            return [t.grad.clone() for t in (qp, kp, vp)]

        vfirst = varlen_grads()
        varlen_equal = all(all(torch.equal(a, b) for a, b in zip(vfirst, varlen_grads())) for _ in range(99))
        timed = interleaved({"default": lambda: pair(False), "deterministic": lambda: pair(True)})
        flops = 3.5 * attention_flops([(n, n)] * batch, heads, d, True)
        row = record(results, "deterministic", timed, flops, batch=batch, seqlen=n, heads_q=heads, heads_kv=kv,
                     head_dim=d, causal=True, repeats=100, dense_bitwise_equal=repeats_equal,
                     varlen_bitwise_equal=varlen_equal, slowdown=timed["deterministic"] / timed["default"])
        print(f"deterministic B{batch} {n} {heads}/{kv} d{d}: 100 backward passes bitwise equal dense "
              f"{repeats_equal}, varlen {varlen_equal}; pair {timed['default']:.3f} ms default, "
              f"{timed['deterministic']:.3f} ms deterministic ({row['slowdown']:.3f}x)")


# ----------------------------------------------------------------------------- paged prefill
def paged(results: list) -> None:
    heads, kv, d = 32, 8, 128
    for chunk, cached in ((512, 4096), (2048, 16384), (1024, 1024)):
        batch = 4
        torch.manual_seed(0)
        keys = [cached + chunk + 7 * b for b in range(batch)]  # ragged cache lengths
        queries = [chunk] * batch
        cu_q = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(keys).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        q = rand(sum(queries), heads, d)
        k, v = rand(sum(keys), kv, d), rand(sum(keys), kv, d)
        flops = attention_flops(list(zip(queries, keys)), heads, d, True)
        for page in (16, 256):
            pages_per = [-(-n // page) for n in keys]
            count = sum(pages_per) + 3
            order = torch.randperm(count, device="cuda")  # pages scattered through the cache
            k_cache, v_cache = rand(count, page, kv, d), rand(count, page, kv, d)
            table = torch.zeros(batch, max(pages_per), device="cuda", dtype=torch.int32)
            used = 0
            for b, n in enumerate(keys):
                ids = order[used:used + pages_per[b]]
                used += pages_per[b]
                table[b, :len(ids)] = ids.int()
                flat_k = k[int(cu_k[b]):int(cu_k[b + 1])]
                flat_v = v[int(cu_k[b]):int(cu_k[b + 1])]
                for i, p in enumerate(ids.tolist()):
                    part = slice(i * page, min((i + 1) * page, n))
                    k_cache[p, :part.stop - part.start] = flat_k[part]
                    v_cache[p, :part.stop - part.start] = flat_v[part]

            def contiguous():
                return autoflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(queries), max(keys), causal=True)

            def paged_call():
                return autoflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(queries), max(keys),
                                                        causal=True, block_table=table)
            with torch.no_grad():
                want, got = contiguous(), paged_call()
                same, differ = torch.equal(want, got), (want.float() - got.float()).abs().max().item()
                timed = interleaved({"contiguous": contiguous, "paged": paged_call})
            row = record(results, "paged_prefill", timed, flops, batch=batch, queries=chunk, cached=cached, page=page,
                         heads_q=heads, heads_kv=kv, head_dim=d, causal=True, outputs_equal=same, max_abs_diff=differ,
                         paged_vs_contiguous=timed["contiguous"] / timed["paged"])
            print(f"paged prefill B{batch} {chunk} new vs {cached}+ cached, {page}-token pages: outputs equal {same} (max diff {differ:.2e}); "
                  f"contiguous {timed['contiguous']:.3f} ms, paged {timed['paged']:.3f} ms "
                  f"({row['paged_vs_contiguous']:.3f}x)")


# ----------------------------------------------------------------------------- dropout
def dropout(results: list) -> None:
    os.environ["AUTOFLASH_DROPOUT_KERNELS"] = "1"  # (the kernels; on a GPU dropout runs in torch by default)
    # BERT-large (16 heads, d64, 512 tokens, batch 32, not causal) and Llama-3-8B (32/8 heads, d128, 2k, causal)
    for name, batch, n, heads, kv, d, causal in (("bert-large", 32, 512, 16, 16, 64, False),
                                                 ("llama-3-8b", 4, 2048, 32, 8, 128, True)):
        torch.manual_seed(0)
        q, k, v = rand(batch, n, heads, d, grad=True), rand(batch, n, kv, d, grad=True), rand(batch, n, kv, d, grad=True)
        g = torch.randn_like(q)
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        kt_full, vt_full = (t.detach().repeat_interleave(heads // kv, 1).requires_grad_() for t in (kt, vt))
        gt = g.transpose(1, 2).contiguous()
        fns = {"autoflash": lambda: autoflash.flash_attn_func(q, k, v, dropout_p=0.1, causal=causal).backward(g)}
        for method, backend in SDPA.items():
            def call(backend=backend):
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(qt, kt_full, vt_full, dropout_p=0.1, is_causal=causal).backward(gt)
            try:
                call()
                torch.cuda.synchronize()
                fns[method] = call
            except RuntimeError as e:  # the backend does not take this call
                print(f"  {name}: {method} refuses: {str(e).splitlines()[0][:100]}")
        with warnings.catch_warnings(record=True) as caught:  # the kernels, or a fallback to torch that says so
            warnings.simplefilter("always")
            fns["autoflash"]()
        fell_back = [str(w.message)[:160] for w in caught if "allback" in type(w.message).__name__]
        timed = interleaved(fns)
        flops = 3.5 * attention_flops([(n, n)] * batch, heads, d, causal)
        best = min((m for m in timed if m.startswith("sdpa")), key=timed.get)
        row = record(results, "dropout", timed, flops, model=name, batch=batch, seqlen=n, heads_q=heads, heads_kv=kv,
                     head_dim=d, causal=causal, dropout_p=0.1, best_sdpa=best, fallback=fell_back,
                     vs_best_sdpa=timed[best] / timed["autoflash"])
        print(f"dropout 0.1 {name}: autoflash {timed['autoflash']:.3f} ms, best SDPA ({best}) {timed[best]:.3f} ms: "
              f"{row['vs_best_sdpa']:.3f}x" + (f" (torch fallback: {fell_back[0]})" if fell_back else " (kernels)"))


PARTS = {"deterministic": deterministic, "paged": paged, "dropout": dropout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--parts", default=",".join(PARTS), help="which parts, comma-separated")
    args = parser.parse_args()
    results: list = []
    for part in args.parts.split(","):
        PARTS[part](results)
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
                "command": "python benchmarks/dropin_speed.py --parts " + args.parts}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
