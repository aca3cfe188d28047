"""Host time of a training step's attention, piece by piece, next to torch SDPA (GPU).

A kernel that finishes before the host has launched the next one leaves the GPU waiting: on short
sequences a training step is as fast as its host path. This times each piece of autoflash's path
as wall clock per call over many calls with no synchronization inside (on a shape whose GPU work
is negligible, that is host time), then GPU-timed steps on a few model shapes.

    python benchmarks/training_host_time.py
"""

from __future__ import annotations

import time

import torch
import triton.testing

import autoflash
from autoflash import ops
from autoflash.dispatch import get_dispatcher
from autoflash.training import EagerAttention


def host_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def pieces(batch: int, heads: int, n: int, d: int) -> dict:
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    dispatcher, scale = get_dispatcher(), d ** -0.5
    fwd = dispatcher.kernel_for(qd, kd, vd, qd, True, own_only=True)
    bwd = dispatcher.kernel_for(qd, kd, vd, qd, True, op="bwd", own_only=True)
    out, lse = torch.empty_like(qd), torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    fwd.forward(qd, kd, vd, out, lse, scale, True, 0)
    grads = [torch.empty_like(t) for t in (qd, kd, vd)]
    pair = ops.training_pair(qd, kd, vd, scale, True, 0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "forward launched through its module": lambda: fwd.forward(qd, kd, vd, out, lse, scale, True, 0),
        "backward launched through its module": lambda: bwd.backward(qd, kd, vd, out, lse, g, *grads, scale, True, 0),
        "own pair through autograd (direct launches)": lambda: EagerAttention.apply(q, k, v, pair).backward(g),
        "autoflash.attention forward+backward": lambda: autoflash.attention(q, k, v, is_causal=True).backward(g),
        "torch SDPA forward+backward": lambda: sdpa(q, k, v, is_causal=True).backward(g),
        "autoflash.attention inference": lambda: autoflash.attention(qd, kd, vd, is_causal=True),
        "torch SDPA inference": lambda: sdpa(qd, kd, vd, is_causal=True),
    }


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("host time per call, B1 H2 N128 d64 causal (GPU work negligible):")
    for name, fn in pieces(1, 2, 128, 64).items():
        print(f"  {name:45s} {host_us(fn):7.1f} us")
    print("GPU-timed training steps (median ms), causal:")
    for batch, heads, n, d in ((1, 8, 4096, 128), (1, 8, 4096, 256), (3, 12, 1024, 128)):
        fns = pieces(batch, heads, n, d)
        own, api, ref = (fns[k] for k in ("own pair through autograd (direct launches)",
                                          "autoflash.attention forward+backward", "torch SDPA forward+backward"))
        ms = [triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median") for f in (own, api, ref)]
        print(f"  B{batch} H{heads} N{n} d{d}: own pair {ms[0]:.3f}, autoflash.attention {ms[1]:.3f}, "
              f"SDPA {ms[2]:.3f} ms ({ms[2] / ms[1]:.2f}x); host per step {host_us(api, 100):.0f} us")


if __name__ == "__main__":
    main()
