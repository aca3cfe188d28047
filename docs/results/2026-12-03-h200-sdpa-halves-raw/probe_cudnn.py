"""Probe: cuDNN's aten forward (with LSE) and backward as halves of a training pair with autoflash's own."""
import json, math, os, sys, time
import torch, torch.nn.functional as F
from autoflash import ops
from autoflash.tuning.timing import device_ms
from autoflash.reference import reference_grads, rel_error
from torch.nn.attention import sdpa_kernel, SDPBackend

A = torch.ops.aten
out_dir = os.environ.get("OUT", "/tmp")
log = open(os.path.join(out_dir, "probe.txt"), "w")
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); log.write(s + "\n"); log.flush()

def cudnn_fwd(q, k, v, causal, scale):
    r = A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r
def cudnn_bwd(do, q, k, v, o, lse, causal, scale, seed, off, nq, nk):
    return A._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, seed, off, None, None, None, nq, nk, 0.0, causal, scale=scale)

def mk(B, H, Hk, N, D, layout, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def r(h):
        if layout == "bnhd":
            return torch.randn(B, N, h, D, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(B, h, N, D, device="cuda", generator=g, dtype=torch.bfloat16)
    return r(H), r(Hk), r(Hk)

e0 = torch.empty(0, device="cuda")
say("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
# 1) formats and correctness on small ragged shapes
for (B, H, Hk, N, D) in [(2, 4, 2, 113, 128), (1, 6, 2, 1023, 64), (2, 4, 4, 37, 96), (1, 2, 1, 1, 256), (2, 8, 2, 4111, 128)]:
    for layout in ("bhnd", "bnhd"):
        q, k, v = mk(B, H, Hk, N, D, layout)
        scale = 1 / math.sqrt(D)
        try:
            r = cudnn_fwd(q, k, v, True, scale)
        except Exception as e:
            say("FWD FAIL", B, H, Hk, N, D, layout, str(e)[:200]); continue
        o, lse = r[0], r[1]
        pair = ops.training_pair(q, k, v, scale, True, 0)
        mo, mlse = pair.forward(q, k, v)
        say(f"{B} {H}/{Hk} {N} d{D} {layout}: cudnn out {tuple(o.shape)} {o.stride()} lse {tuple(lse.shape)} {lse.stride()} seed {tuple(r[6].shape)} off {tuple(r[7].shape)}; "
            f"lse diff {float((lse.reshape(mlse.shape) - mlse).abs().max()):.3g} out diff {float((o - mo).abs().max()):.3g}")
        do = torch.randn_like(q)
        refs = reference_grads(q, k, v, do, True, 0, scale) if N <= 1100 else None
        try:
          with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            sg = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=H != Hk), leaves, do)
        except RuntimeError as e:
            say("  sdpa cudnn refuses", str(e)[:80]); sg = None
        try:
            cg = cudnn_bwd(do, q, k, v, mo, mlse.unsqueeze(-1), True, scale, e0, e0, N, N)
        except Exception as e:
            say("  own-fwd + cudnn-bwd FAIL", str(e)[:300]); cg = None
        og = pair.backward(q, k, v, o, lse.reshape(mlse.shape), do)
        for name, g in (("sdpa-cudnn", sg), ("own-fwd+cudnn-bwd", cg), ("cudnn-fwd+own-bwd", og)):
            if g is None: continue
            if refs is not None:
                say("  ", name, " ".join(f"{n} {rel_error(a, b):.3g}" for n, a, b in zip(("dq", "dk", "dv"), g, refs)), [tuple(t.shape) for t in g])
            elif sg is not None:
                say("  ", name, "vs sdpa", " ".join(f"{n} {rel_error(a.float(), b.float()):.3g}" for n, a, b in zip(("dq", "dk", "dv"), g, sg)))

# 2) timing on the models cells: training pairs
cells = [(16, 32, 8, 512, 128), (4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128), (16, 8, 1, 512, 128), (4, 8, 1, 2048, 128),
         (1, 8, 1, 8192, 128), (16, 28, 4, 512, 128), (4, 28, 4, 2048, 128), (1, 28, 4, 8192, 128), (16, 14, 2, 512, 64),
         (4, 14, 2, 2048, 64), (1, 14, 2, 8192, 64), (16, 16, 8, 512, 256), (4, 16, 8, 2048, 256), (1, 16, 8, 8192, 256),
         (16, 32, 32, 512, 96), (4, 32, 32, 2048, 96), (1, 32, 32, 8192, 96), (16, 9, 3, 512, 64), (4, 9, 3, 2048, 64),
         (1, 9, 3, 8192, 64), (16, 16, 16, 577, 64)]
rows = []
for (B, H, Hk, N, D) in cells:
    causal = N != 577
    q, k, v = mk(B, H, Hk, N, D, "bnhd")
    scale = 1 / math.sqrt(D)
    do = torch.randn_like(q)
    pair = ops.training_pair(q, k, v, scale, causal, 0)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    def sdpa_pair():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=H != Hk)
        torch.autograd.grad(out, leaves, do)
    def aten_pair():
        r = cudnn_fwd(q, k, v, causal, scale); cudnn_bwd(do, q, k, v, r[0], r[1], causal, scale, r[6], r[7], N, N)
    def own_pair():
        o, l = pair.forward(q, k, v); pair.backward(q, k, v, o, l, do)
    def own_cudnn():
        o, l = pair.forward(q, k, v); cudnn_bwd(do, q, k, v, o, l.unsqueeze(-1), causal, scale, e0, e0, N, N)
    def cudnn_own():
        r = cudnn_fwd(q, k, v, causal, scale); pair.backward(q, k, v, r[0], r[1].view(B, H, N), do)
    def cudnn_fwd_only():
        cudnn_fwd(q, k, v, causal, scale)
    def cudnn_fwd_nolse():
        A._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, causal, False, scale=scale)
    e0 = torch.empty(0, device="cuda")
    fns = dict(sdpa_pair=sdpa_pair, aten_pair=aten_pair, own_pair=own_pair, own_cudnn=own_cudnn, cudnn_own=cudnn_own,
               cudnn_fwd_lse=cudnn_fwd_only, cudnn_fwd_nolse=cudnn_fwd_nolse)
    ms = {n: [] for n in fns}
    for rnd in range(2):
        for n, f in fns.items():
            try:
                ms[n].append(device_ms(f, rep_ms=60))
            except Exception as e:
                say("ERR", n, str(e)[:200]); ms[n].append(float("nan"))
    med = {n: sorted(v)[len(v) // 2] if len(v) == 2 else v[0] for n, v in ms.items()}
    med = {n: min(v) for n, v in ms.items()}
    row = dict(cell=[B, H, Hk, N, D], **{n: round(m, 4) for n, m in med.items()})
    rows.append(row)
    base = med["sdpa_pair"]
    say(f"B{B} H{H}/{Hk} N{N} d{D}: " + " ".join(f"{n} {base / m:.3f}" for n, m in med.items() if not n.startswith("cudnn_fwd")) +
        f" | fwd lse/nolse {med['cudnn_fwd_lse'] / med['cudnn_fwd_nolse']:.3f}")
json.dump(rows, open(os.path.join(out_dir, "probe.json"), "w"), indent=1)
