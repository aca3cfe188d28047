"""A dispatched short training call against the same training pair called directly and SDPA-cuDNN
(GPU): device time (interleaved CUDA-event rounds), host time per call, cProfile and torch.profiler
tables of both paths, and whether SDPA-cuDNN's backward is bitwise repeatable (50 passes, with and
without torch's deterministic algorithms). The shape is the newgpu set's B8 H14/2 1k d64 causal bf16.

    AUTOFLASH_DB=docs/results/2026-12-06-h100-raw4/newgpu.db python benchmarks/dispatched_training_call.py
"""
import cProfile
import io
import pstats
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import autoflash
from autoflash import ops
from autoflash.dispatch import get_dispatcher
from autoflash.training import EagerAttention
from autoflash.bench import timed_round
from training_host_time import host_us  # (this folder: run as a script)

B, HQ, HKV, N, D = 8, 14, 2, 1024, 64
dev = "cuda"
torch.manual_seed(0)
q = torch.randn(B, HQ, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn_like(q)
pair = ops.training_pair(q, k, v, D ** -0.5, True, 0)
print("pair:", pair and (pair.forward_kernel, pair.backward_kernel))
print("bwd winner:", get_dispatcher().kernel_for(q.detach(), k.detach(), v.detach(), q.detach(), True, op="bwd"))
fns = {
    "dispatched": lambda: autoflash.attention(q, k, v, is_causal=True, enable_gqa=True).backward(g),
    "direct": lambda: EagerAttention.apply(q, k, v, pair).backward(g),
    "cudnn": lambda: _cudnn(),
}


def _cudnn():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g)
for f in fns.values():
    for _ in range(5):
        f()
torch.cuda.synchronize()
flops = 4 * B * HQ * N * N * D / 2 * 3.5
samples = {m: [] for m in fns}
for r in range(8):
    for m, ms in timed_round(fns, q.device, 100, r).items():
        samples[m].append(ms)
print("device-timed (ms per fwd+bwd, median of 8 interleaved rounds) and TFLOP/s:")
for m, s in samples.items():
    med = statistics.median(s)
    print(f"  {m:12s} {med:.4f} ms  {flops / med / 1e9:.1f} TFLOP/s  spread {min(s):.4f}-{max(s):.4f}")

print("host us/call (enqueued, no synchronization inside):")
for rep in range(3):
    for m, f in fns.items():
        print(f"  {m:12s} host {host_us(f):7.1f}")
# small shape: pure host
qs, ks, vs = (torch.randn(1, 2, 64, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
gs = torch.randn_like(qs)
pairs = ops.training_pair(qs, ks, vs, D ** -0.5, True, 0)
small = {"dispatched": lambda: autoflash.attention(qs, ks, vs, is_causal=True).backward(gs),
         "direct": lambda: EagerAttention.apply(qs, ks, vs, pairs).backward(gs),
         "fwd only direct": lambda: EagerAttention.apply(qs, ks, vs, pairs),
         "fwd only dispatched": lambda: autoflash.attention(qs, ks, vs, is_causal=True)}
print("tiny shape host us/call:")
for m, f in small.items():
    print(f"  {m:20s} {host_us(f, 1000):7.1f}")
for name in ("dispatched", "direct"):
    pr = cProfile.Profile()
    f = fns[name]
    pr.enable()
    for _ in range(200):
        f()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"==== cProfile {name} (200 calls)\n" + s.getvalue()[:6000])
for name in ("dispatched", "direct", "cudnn"):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fns[name]()
        torch.cuda.synchronize()
    print(f"==== torch.profiler {name} (20 calls)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))

# cuDNN backward determinism: 50 passes, dense GQA causal
for det in (False, True):
    torch.use_deterministic_algorithms(det, warn_only=True)
    ref = None
    same = 0
    for i in range(50):
        for t in (q, k, v):
            t.grad = None
        _cudnn()
        grads = torch.cat([t.grad.flatten() for t in (q, k, v)]).view(torch.int16)
        if ref is None:
            ref = grads.clone()
        else:
            same += bool(torch.equal(ref, grads))
    print(f"cuDNN backward bitwise equal over 50 passes (deterministic_algorithms={det}): {same}/49")
torch.use_deterministic_algorithms(False)
