"""Backward alone, per training problem: the stored own winner serial vs concurrent dQ (DQ_OVERLAP),
variants of it, and cuDNN's backward; bound launches (the serving path), interleaved, device time."""
import dataclasses, json, os, statistics, sys, time, traceback
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from autoflash import api, codegen
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import WinnerTable
from autoflash.reference import make_inputs, rel_error
from autoflash.shapes import load_shape_set
from autoflash.space import load_space
from autoflash.tuning.timing import device_ms

OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()
dev = gpu_fingerprint()
space = load_space("triton_bwd")
table = WinnerTable(dev, WinnerTable.default_paths()[1:])
shapes = [dataclasses.replace(s, op="bwd") for s in load_shape_set("models")]
shapes += [dataclasses.replace(s, op="bwd") for s in load_shape_set("cliffs")]
limit = float(sys.argv[1]) if len(sys.argv) > 1 else 400
rows = []


def flops(s):  # backward: 2.5x the forward's 4*B*H*N^2*d, halved when causal
    return 2.5 * 4 * s.batch * s.heads_q * s.seqlen_q * s.seqlen_k * s.head_dim * (0.5 if s.causal else 1.0)


def own_variant(problem, **changes):
    w, how = table.lookup(problem, own_only=True)
    if w is None:
        return None
    if not changes:
        return w
    v = space.nearest_valid(w.replace(**changes), problem, dev)
    return v if all(v[k] == val for k, val in changes.items()) else None


for shape in shapes:
    if time.time() - T0 > limit:
        print("time limit", flush=True)
        break
    try:
        problem = shape.problem_on(dev.sm_count)
        w, how = table.lookup(problem, own_only=True)
        cand = {"stored": own_variant(problem)}
        if w is None:
            continue
        cand["stored+conc"] = own_variant(problem, DQ_OVERLAP="concurrent", DQ_MODE="separate")
        cand["split1+conc"] = own_variant(problem, DQ_OVERLAP="concurrent", DQ_MODE="separate", GQA_SPLIT=1)
        gl_tiles = dict(BLOCK_M1=64, BLOCK_N1=128 if shape.head_dim <= 128 else 64)
        cand["gluon+conc"] = own_variant(problem, DQ_OVERLAP="concurrent", DQ_MODE="separate", GQA_SPLIT=1,
                                         DKDV_KERNEL="gluon_sm90", **gl_tiles)
        cand["gluon"] = own_variant(problem, DQ_MODE="separate", GQA_SPLIT=1, DKDV_KERNEL="gluon_sm90", DQ_OVERLAP="serial", **gl_tiles)
        cand = {k: v for k, v in cand.items() if v is not None}
        uniq = {}
        for k, v in cand.items():
            if v not in uniq.values():
                uniq[k] = v
        q, k, v = make_inputs(shape, "cuda", seed=3)
        o, lse = api.forward_with_lse(q, k, v, causal=shape.causal)
        do = torch.randn_like(q)
        scale = shape.head_dim ** -0.5
        fns, grads = {}, {}
        for name, var in uniq.items():
            kern = codegen.load(var)
            g = [torch.empty_like(t) for t in (q, k, v)]
            launch = kern.bind_backward(q, k, v, o, lse, do, *g, scale, shape.causal, 0)
            bound = launch is not None
            if bound:
                fns[name] = (lambda launch=launch, g=g: launch(q, k, v, o, lse, do, *g))
                sides = len(launch.__self__.side_streams)
            else:
                fns[name] = (lambda kern=kern, g=g: kern.backward(q, k, v, o, lse, do, *g, scale, shape.causal, 0))
                sides = -1
            fns[name]()
            torch.cuda.synchronize()
            grads[name] = ([t.clone() for t in g], bound, sides)
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=shape.causal, enable_gqa=shape.heads_q != shape.heads_kv)
        fns["cudnn_bwd"] = lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
        ref = torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
        errors = {name: max(rel_error(a, b) for a, b in zip(gs, ref)) for name, (gs, _, _) in grads.items()}
        samples = {n: [] for n in fns}
        names = list(fns)
        for r in range(3):
            for n in (names if r % 2 == 0 else names[::-1]):
                samples[n].append(device_ms(fns[n], warmup_ms=10, rep_ms=40))
        ms = {n: statistics.median(s) for n, s in samples.items()}
        row = dict(shape=shape.label(), ms=ms, tflops={n: flops(shape) / (t * 1e9) for n, t in ms.items()},
                   vs_cudnn={n: ms["cudnn_bwd"] / t for n, t in ms.items()}, errors=errors,
                   bound={n: grads[n][1] for n in grads}, side_streams={n: grads[n][2] for n in grads},
                   variants={n: uniq[n].json() for n in uniq})
        rows.append(row)
        print(f"[{time.time()-T0:.0f}s] {shape.label()}: " + ", ".join(f"{n} {ms[n]*1e3:.0f}us x{row['vs_cudnn'][n]:.3f} e{errors.get(n, 0):.1e}" for n in ms), flush=True)
        del q, k, v, o, lse, do, fns, grads, out, qr, kr, vr
    except Exception:
        traceback.print_exc()
    with open(f"{OUT}/overlap.json", "w") as f:
        json.dump(dict(rows=rows, env=dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())), f, indent=1)
