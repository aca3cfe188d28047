"""flash_attn_varlen_func on a packed batch of lengths (1, 17, 300, 2048, 4111) vs flash_attn_func
on a dense batch with about the same tokens (5 x 1295), 32/8 heads, d128, bf16: equality with the
per-sequence calls, then TFLOP/s of the forward and of forward+backward.

    python benchmarks/varlen_vs_dense.py
"""

from __future__ import annotations

import torch
import triton.testing

import autoflash

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LENGTHS = (1, 17, 300, 2048, 4111)
DENSE = (5, 1295)


def flops(lengths, causal: bool, backward: bool) -> float:
    forward = sum(4 * n * n * HEADS * HEAD_DIM for n in lengths) / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def main() -> None:
    total = sum(LENGTHS)
    cu = torch.tensor((0, *torch.tensor(LENGTHS).cumsum(0).tolist()), device="cuda", dtype=torch.int32)
    for causal in (False, True):
        torch.manual_seed(0)
        q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))

        def varlen():
            return autoflash.flash_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=causal)
        out = varlen()
        worst = 0.0
        for i in range(len(LENGTHS)):
            a, b = int(cu[i]), int(cu[i + 1])
            one = autoflash.flash_attn_func(q[a:b][None], k[a:b][None], v[a:b][None], causal=causal)[0]
            worst = max(worst, (out[a:b].float() - one.float()).abs().max().item())
        batch, n = DENSE
        qd = torch.randn(batch, n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kd, vd = (torch.randn(batch, n, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))
        g, gd = torch.randn_like(out), torch.randn_like(qd)
        with torch.no_grad():
            fwd = (flops(LENGTHS, causal, False) / bench_ms(varlen) / 1e9,
                   flops([n] * batch, causal, False) / bench_ms(lambda: autoflash.flash_attn_func(qd, kd, vd, causal=causal)) / 1e9)
        both = (flops(LENGTHS, causal, True) / bench_ms(lambda: varlen().backward(g)) / 1e9,
                flops([n] * batch, causal, True) / bench_ms(
                    lambda: autoflash.flash_attn_func(qd, kd, vd, causal=causal).backward(gd)) / 1e9)
        print(f"causal={causal}: max |varlen - per-sequence| {worst:.2e}; forward {fwd[0]:.0f} vs dense {fwd[1]:.0f} "
              f"TFLOP/s ({fwd[0] / fwd[1]:.2f}x); forward+backward {both[0]:.0f} vs {both[1]:.0f} ({both[0] / both[1]:.2f}x)")


if __name__ == "__main__":
    main()
