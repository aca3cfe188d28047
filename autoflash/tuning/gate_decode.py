"""The correctness gate of a decode kernel: ragged cache lengths in one batch (0, 1, 17, ... up
to the full cache), a contiguous cache and a paged one behind a shuffled block table, GQA, the
causal mask bottom-right over a few new tokens, against the float64 reference
(`reference.decode_reference`), within 2x the error of the same computation in float32 with the
output rounded to the input dtype (the yardstick SDPA's error is for the other ops). O and LSE are
poisoned (NaN) before the launch; rows that see no key must give O = 0 and LSE = +inf."""

from __future__ import annotations

import math

import torch

from autoflash.codegen import Kernel
from autoflash.device import interpreter_enabled, launch_sm_count
from autoflash.problem import Shape
from autoflash.reference import decode_reference, rel_error
from autoflash.tuning.gate import GATE_FACTOR, GATE_FLOOR, LSE_TOL, GateResult


def decode_gate_cases(shape: Shape, device) -> list[dict]:
    """Small ragged decode calls of `shape`'s problem: its head dim, dtype, GQA group, new tokens."""
    group = shape.heads_q // shape.heads_kv
    q_len = max(1, min(shape.seqlen_q, 16))
    on_gpu = torch.device(device).type == "cuda" and not interpreter_enabled()
    capacity, lengths, page = (4111, [0, 1, 17, 4095, 4111], 64) if on_gpu else (64, [0, 1, 17, 64], 16)
    g = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, shape.dtype)

    def rand(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype)
    batch, kv_heads, d = len(lengths), 2, shape.head_dim
    q = rand(batch, q_len, kv_heads * group, d)
    k, v = rand(batch, capacity, kv_heads, d), rand(batch, capacity, kv_heads, d)
    seqlens = torch.tensor(lengths, device=device, dtype=torch.int32)
    per_seq = -(-capacity // page)
    perm = torch.randperm(batch * per_seq, generator=g, device=device)
    pages = [torch.zeros(batch * per_seq, page, kv_heads, d, device=device, dtype=dtype) for _ in range(2)]
    for src, dst in zip((k, v), pages):
        dst[perm] = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, per_seq * page - capacity)).reshape(-1, page, kv_heads, d)
    table = perm.view(batch, per_seq).to(torch.int32)
    # the new tokens' keys are the last q_len of each sequence (bottom-right causal): lengths >= q_len or 0
    return [dict(q=q, k=k, v=v, seqlens=seqlens, table=None),
            dict(q=q, k=pages[0], v=pages[1], seqlens=seqlens, table=table)]


def check_decode(kernel: Kernel, shape: Shape, device, seed: int = 0) -> GateResult:
    worst = GateResult(True, 0.0, 0.0, 0.0)
    scale = 1.0 / math.sqrt(shape.head_dim)
    for case in decode_gate_cases(shape, device):
        q, k, v, seqlens, table = case["q"], case["k"], case["v"], case["seqlens"], case["table"]
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device, dtype=torch.float32)
        kernel.decode(q, k, v, out, lse, scale, shape.causal, seqlens, table, sm_count=launch_sm_count(q.device))
        ref, ref_lse = decode_reference(q.double(), k.double(), v.double(), seqlens, table, scale, shape.causal)
        yard, _ = decode_reference(q, k, v, seqlens, table, scale, shape.causal)  # float32 math, dtype out
        err, y_err = rel_error(out, ref), rel_error(yard, ref)
        finite = torch.isfinite(ref_lse)
        l_err = float((lse[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0
        empty_ok = bool((lse[~finite] == float("inf")).all()) and not bool(out.isnan().any())
        bound = max(GATE_FACTOR * y_err, GATE_FLOOR[shape.dtype])
        ok = math.isfinite(err) and err <= bound and l_err <= LSE_TOL and empty_ok
        worst = GateResult(worst.passed and ok, max(worst.err, err if math.isfinite(err) else math.inf),
                           max(worst.sdpa_err, y_err), max(worst.lse_err, l_err), worst.detail)
        if not ok:
            worst.detail = (f"wrong decode result ({'paged' if table is not None else 'contiguous'} cache, lengths "
                            f"{seqlens.tolist()}): rel err {err:.3g} (bound {bound:.3g}), lse err {l_err:.3g}, "
                            f"empty rows {'ok' if empty_ok else 'wrong'}")
            return worst
    return worst
