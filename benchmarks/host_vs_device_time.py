"""Host time against device time of short attention calls (GPU).

For two short training problems (SmolLM2-135M and Qwen2.5-0.5B at batch 16, 512 tokens) each way of
running attention is timed three ways: do_bench (events around the call, host included), host wall
time per call without synchronization, and the sum of its kernels' times from torch.profiler. Then
cuDNN's forward on the Qwen problem in this process (through `sdpa_kernel`, through the switches set
directly, on expanded K/V) and in four fresh processes. Writes host_vs_device_time.json to $OUT.

    python benchmarks/host_vs_device_time.py
"""
import json, os, sys, time, statistics, subprocess
import torch, triton.testing
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import autoflash
from autoflash import ops
from autoflash.shapes import Shape
from autoflash.reference import make_inputs
from autoflash.training import EagerAttention, TrainingPair
from autoflash.tuning.gate import forward_kernel_for_backward
from autoflash.dispatch import get_dispatcher
from autoflash.vendor import only_backend

out = {}
def bench(fn):
    return statistics.median(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") for _ in range(3))
def host_us(fn, calls=200):
    for _ in range(10): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(calls): fn()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6
def gpu_us(fn, steps=20):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps): fn()
        torch.cuda.synchronize()
    kern = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            kern[e.name] = kern.get(e.name, 0) + e.device_time
    return sum(kern.values()) / steps, {k[:60]: round(v / steps, 1) for k, v in sorted(kern.items(), key=lambda x: -x[1])[:8]}

mode = sys.argv[1] if len(sys.argv) > 1 else "main"
if mode == "cudnn_child":
    shape = Shape(16, 14, 2, 512, 512, 64, True, "bfloat16")
    q, k, v = make_inputs(shape, "cuda", seed=int(sys.argv[2]))
    def f():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    print(json.dumps({"cudnn_ms": bench(f)}))
    sys.exit(0)

# 1. the short training step, piece by piece
for label, shape in [("smollm2_b16_512", Shape(16, 9, 3, 512, 512, 64, True, "bfloat16")),
                     ("qwen05_b16_512", Shape(16, 14, 2, 512, 512, 64, True, "bfloat16"))]:
    q, k, v = (t.requires_grad_() for t in make_inputs(shape, "cuda", seed=7))
    grad = torch.randn_like(q)
    scale = shape.head_dim ** -0.5
    pair = ops.training_pair(q, k, v, scale, True, 0)
    tuner_pair = TrainingPair(forward_kernel_for_backward(q, k, v, True), pair.backward_kernel, scale, True, 0)
    res = {"fwd_kernel": repr(pair.forward_kernel), "bwd_kernel": repr(pair.backward_kernel),
           "tuner_fwd_kernel": repr(tuner_pair.forward_kernel)}
    fns = {
        "dispatched": lambda: autoflash.attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad),
        "own_pair": lambda: EagerAttention.apply(q, k, v, pair).backward(grad),
        "tuner_pair_autograd": lambda: EagerAttention.apply(q, k, v, tuner_pair).backward(grad),
    }
    def cud():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(grad)
    fns["cudnn"] = cud
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    def pair_fwd(): pair.forward(qd, kd, vd)
    o_, l_ = pair.forward(qd, kd, vd)
    def pair_bwd(): pair.backward(qd, kd, vd, o_, l_, grad)
    def tpair_fwd(): tuner_pair.forward(qd, kd, vd)
    fns.update(own_fwd_only=pair_fwd, own_bwd_only=pair_bwd, tuner_fwd_only=tpair_fwd)
    for name, fn in fns.items():
        for t in (q, k, v): t.grad = None
        ms = bench(fn)
        hu, wall = host_us(fn)
        gu, top = gpu_us(fn)
        res[name] = {"do_bench_us": round(ms * 1e3, 1), "host_us_per_call": round(hu, 1), "wall_us_per_call": round(wall, 1),
                     "gpu_kernel_us": round(gu, 1), "kernels": top}
    out[label] = res
    print(label, json.dumps(res, indent=1), flush=True)

# 2. cuDNN forward on Qwen-0.5B B16 512 in this process and in fresh ones
shape = Shape(16, 14, 2, 512, 512, 64, True, "bfloat16")
q, k, v = make_inputs(shape, "cuda", seed=1234)
r = {}
def c1():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
def c2():
    with only_backend(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
ke, ve = k.repeat_interleave(7, 1), v.repeat_interleave(7, 1)
def c3():
    with only_backend(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
for name, fn in (("sdpa_kernel_gqa", c1), ("only_backend_gqa", c2), ("expanded_kv", c3)):
    r[name] = {"do_bench_us": round(bench(fn) * 1e3, 1), "gpu": gpu_us(fn)}
children = []
for seed in (1, 2, 3, 4):
    p = subprocess.run([sys.executable, __file__, "cudnn_child", str(seed)], capture_output=True, text=True)
    children.append(p.stdout.strip().splitlines()[-1] if p.returncode == 0 else p.stderr[-300:])
r["fresh_processes"] = children
out["cudnn_qwen_fwd"] = r
print(json.dumps(r, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "host_vs_device_time.json"), "w"), indent=1)
