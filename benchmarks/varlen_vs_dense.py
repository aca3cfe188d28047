"""flash_attn_varlen_func on a packed batch of lengths (1, 17, 300, 2048, 4111) vs dense attention
on a batch of equal-length sequences with about the same tokens (5 x 1295), 32/8 heads, d128, bf16:
equality with the per-sequence calls, then TFLOP/s of the forward and of forward+backward, all in
one process, interleaved rounds, medians.

The dense side is timed twice: `autoflash.flash_attn_func` (whatever the tuned DB dispatches, maybe
a vendor or Gluon kernel) and the same Triton kernels the packed call runs, launched dense
(`same kernels`), which isolates what packing costs.

    python benchmarks/varlen_vs_dense.py
"""

from __future__ import annotations

import statistics

import torch
import triton.testing

import autoflash
from autoflash.dispatch import get_dispatcher

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LENGTHS = (1, 17, 300, 2048, 4111)
DENSE = (5, 1295)
ROUNDS = 5


def flops(lengths, causal: bool, backward: bool) -> float:
    forward = sum(4 * n * n * HEADS * HEAD_DIM for n in lengths) / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)


def main() -> None:
    total = sum(LENGTHS)
    cu = torch.tensor((0, *torch.tensor(LENGTHS).cumsum(0).tolist()), device="cuda", dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    for causal in (False, True):
        torch.manual_seed(0)
        q, k, v = rand(total, HEADS, HEAD_DIM), rand(total, KV_HEADS, HEAD_DIM), rand(total, KV_HEADS, HEAD_DIM)

        def varlen():
            return autoflash.flash_attn_varlen_func(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), causal=causal)
        out = varlen()
        worst = 0.0
        for i in range(len(LENGTHS)):
            a, b = int(cu[i]), int(cu[i + 1])
            one = autoflash.flash_attn_func(q[a:b][None], k[a:b][None], v[a:b][None], causal=causal)[0]
            worst = max(worst, (out[a:b].float() - one.float()).abs().max().item())
        batch, n = DENSE
        qd, kd, vd = rand(batch, n, HEADS, HEAD_DIM), rand(batch, n, KV_HEADS, HEAD_DIM), rand(batch, n, KV_HEADS, HEAD_DIM)
        g, gd = torch.randn_like(out), torch.randn_like(qd)

        # The packed call's own kernels, launched on the dense batch ((B, H, N, D) views).
        views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, out)]
        fwd_kernel = get_dispatcher().varlen_kernel_for(*views, causal, "fwd", max(LENGTHS), max(LENGTHS))
        bwd_kernel = get_dispatcher().varlen_kernel_for(*views, causal, "bwd", max(LENGTHS), max(LENGTHS))
        q4, k4, v4, gd4 = (t.detach().transpose(1, 2) for t in (qd, kd, vd, gd))
        o4, lse = torch.empty_like(q4), torch.empty(q4.shape[:3], device="cuda", dtype=torch.float32)
        grads = [torch.empty_like(t) for t in (q4, k4, v4)]

        def same_forward():
            fwd_kernel.forward(q4, k4, v4, o4, lse, scale, causal, 0)

        def same_both():
            same_forward()
            bwd_kernel.backward(q4, k4, v4, o4, lse, gd4, *grads, scale, causal, 0)

        timed = {
            "varlen fwd": (lambda: varlen(), flops(LENGTHS, causal, False), True),
            "dense fwd (dispatched)": (lambda: autoflash.flash_attn_func(qd, kd, vd, causal=causal),
                                       flops([n] * batch, causal, False), True),
            "dense fwd (same kernels)": (same_forward, flops([n] * batch, causal, False), True),
            "varlen fwd+bwd": (lambda: varlen().backward(g), flops(LENGTHS, causal, True), False),
            "dense fwd+bwd (dispatched)": (lambda: autoflash.flash_attn_func(qd, kd, vd, causal=causal).backward(gd),
                                           flops([n] * batch, causal, True), False),
            "dense fwd+bwd (same kernels)": (same_both, flops([n] * batch, causal, True), True),
        }
        samples = {name: [] for name in timed}
        for _ in range(ROUNDS):
            for name, (fn, _, no_grad) in timed.items():
                with torch.set_grad_enabled(not no_grad):
                    samples[name].append(bench_ms(fn))
        tflops = {name: timed[name][1] / statistics.median(s) / 1e9 for name, s in samples.items()}
        print(f"causal={causal}: max |varlen - per-sequence| {worst:.2e}; kernels {fwd_kernel.variant.short()} / "
              f"{bwd_kernel.variant.short()}")
        for part in ("fwd", "fwd+bwd"):
            mine = tflops[f"varlen {part}"]
            print(f"  {part:8s} varlen {mine:6.1f} TFLOP/s | dense dispatched {tflops[f'dense {part} (dispatched)']:6.1f} "
                  f"({mine / tflops[f'dense {part} (dispatched)']:.2f}x) | dense same kernels "
                  f"{tflops[f'dense {part} (same kernels)']:6.1f} ({mine / tflops[f'dense {part} (same kernels)']:.2f}x)")


if __name__ == "__main__":
    main()
