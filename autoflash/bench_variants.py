"""`autoflash bench --variants`: attention variants on autoflash's kernels vs torch and FlexAttention.

The cases are issue 38's speed criteria (a causal language model's attention each time): a sliding
window of 4096 keys at 16k, 32k and 64k tokens, a logit softcap at d256 and 8k tokens, 8 ragged documents
packed into 16k tokens. Each is timed, interleaved in one process, for (built in `bench_variant_methods`)
- `autoflash`: `flash_attn_func` with `window_size`/`softcap`; for documents `document_attention` on
  `Documents` built once (as a model builds them once per batch);
- `autoflash-varlen` (documents): `flash_attn_varlen_func` on the same packing;
- `sdpa-mask` (window, documents): torch SDPA given the equivalent boolean mask (backend left to torch,
  which must leave cuDNN/flash for it), K/V heads repeated to the query heads beforehand (not every SDPA
  backend takes GQA with a mask); skipped, and said so, where the mask would not fit in memory;
- `torch-eager` (softcap: no SDPA argument expresses it): the materialized scores, capped, masked,
  softmaxed, as transformers' eager attention;
- `flex`, `flex-max-autotune`: `torch.compile(flex_attention)` (default mode, and max-autotune) with a
  block mask built once (and a score_mod for the softcap); in the interpreter FlexAttention runs
  uncompiled (forward only: it has no CPU backward).

FLOPs are counted the same for every method, whatever it computes: 4 * head_dim * heads_q * (visible
(query, key) pairs) for the forward, 3.5x that for forward+backward, where a pair is visible iff the
mask lets the query see the key (causal, in its window, in its document). Work a method spends on
masked-out pairs is not counted.

Before timing, each method's output (and with fwdbwd its gradients) is compared with a reference
computed from the materialized mask on a sample of query rows (all rows in the interpreter; float64
there, float32 on the GPU); a method that disagrees (relative error above ERR_LIMIT) is reported,
not timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics

import torch

# A wrong mask (a document boundary one token off: ~0.6) or a missing softcap (the softcap cases' inputs
# make it ~0.15) errs by 1e-1 and more; bf16 rounding (torch-eager's bf16 scores, a backward's) by up to
# ~3e-2: the limit tells the two apart without failing a baseline on rounding. A window one key too wide
# or narrow at 4096 errs by ~2e-3 on this norm: out of this check's reach (the kernels' own tests hold it).
ERR_LIMIT = 5e-2
SAMPLED_ROWS = 96  # query rows of the GPU reference (plus each document's first and last)


@dataclasses.dataclass(frozen=True)
class VariantCase:
    variant: str  # "window", "softcap" or "documents"
    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str = "bfloat16"
    window: int = 0  # keys each query sees, its own included (flash-attn window_size=(window - 1, 0))
    softcap: float = 0.0
    documents: int = 0  # ragged documents per row (causal inside each)

    def query_scale(self) -> float:
        """q's multiplier: scores of unit spread barely feel a cap of 50 (dropping it errs by ~1e-3, under
        any check's reach); spread cap / 4 makes a missing softcap err by ~0.15 while bf16 rounding of
        torch's eager scores stays near 0.03."""
        return max(1.0, self.softcap / 4) if self.variant == "softcap" else 1.0

    def label(self) -> str:
        extra = {"window": f"window {self.window}", "softcap": f"softcap {self.softcap:g}",
                 "documents": f"{self.documents} docs"}[self.variant]
        return (f"{self.variant}: {extra}, {self.dtype} B{self.batch} N{self.seqlen} "
                f"H{self.heads_q}/{self.heads_kv} d{self.head_dim}")

    def document_lengths(self, row: int = 0) -> list[int]:
        """Ragged lengths summing to seqlen, the same every run (a seeded draw of the cut points per row)."""
        g = torch.Generator().manual_seed(self.documents * 1000 + self.seqlen + 7919 * row)
        cuts = (torch.randperm(self.seqlen - 1, generator=g)[:self.documents - 1] + 1).sort().values.tolist()
        bounds = [0, *cuts, self.seqlen]
        return [b - a for a, b in zip(bounds, bounds[1:])]

    def document_ids(self, device) -> torch.Tensor:
        """(batch, seqlen) ids, each row packed differently (a method that applied one row's documents to
        every row would fail the check)."""
        rows = [torch.cat([torch.full((n,), i) for i, n in enumerate(self.document_lengths(r))])
                for r in range(self.batch)]
        return torch.stack(rows).to(device)

    def visible(self, rows: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """(batch, len(rows), seqlen) bool: query row i sees key j."""
        i, j = rows[:, None], torch.arange(self.seqlen, device=rows.device)[None, :]
        mask = (j <= i).expand(self.batch, -1, -1)
        if self.variant == "window":  # (j > i - window: a bool at once, no (N, N) int64 difference)
            mask = mask & (j > i - self.window)
        if self.variant == "documents":
            mask = mask & (ids[:, rows, None] == ids[:, None, :])
        return mask

    def visible_pairs(self) -> int:
        """(query, key) pairs the mask lets through, over the batch (per head)."""
        n = self.seqlen
        if self.variant == "window":
            w = min(self.window, n)
            per_row = w * (w + 1) // 2 + (n - w) * w
        elif self.variant == "documents":
            return sum(m * (m + 1) // 2 for r in range(self.batch) for m in self.document_lengths(r))
        else:
            per_row = n * (n + 1) // 2
        return self.batch * per_row

    def flops(self, fwdbwd: bool) -> float:
        forward = 4.0 * self.head_dim * self.heads_q * self.visible_pairs()
        return forward * (3.5 if fwdbwd else 1.0)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# The cases (a window's 16k and 64k beside its 32k: its cost must grow linearly, 16k -> 64k
# within 4.4x).
GPU_CASES = (*(VariantCase("window", 1, n, 32, 8, 128, window=4096) for n in (16384, 32768, 65536)),
             VariantCase("softcap", 1, 8192, 16, 8, 256, softcap=50.0),
             VariantCase("documents", 1, 16384, 32, 8, 128, documents=8))
# The interpreter: a pipeline check on tiny sizes (float32: the interpreter has no bfloat16).
INTERPRETER_CASES = (VariantCase("window", 1, 80, 4, 2, 16, "float32", window=24),
                     VariantCase("softcap", 1, 64, 2, 1, 32, "float32", softcap=2.0),
                     VariantCase("documents", 2, 96, 4, 2, 16, "float32", documents=4))


def _inputs(case: VariantCase, device, fwdbwd: bool) -> dict:
    """layout -> (q, k, v) leaves holding the same values: 'bnhd' (flash-attn's), 'bhnd' (SDPA's,
    FlexAttention's), 'bhnd-x' (K/V heads repeated to the query heads)."""
    g = torch.Generator(device=device).manual_seed(0)
    b, n, hq, hk, d = case.batch, case.seqlen, case.heads_q, case.heads_kv, case.head_dim
    q = (torch.randn(b, n, hq, d, generator=g, device=device) * case.query_scale()).to(case.torch_dtype)
    k, v = (torch.randn(b, n, hk, d, generator=g, device=device).to(case.torch_dtype) for _ in range(2))
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    group = hq // hk
    layouts = {"bnhd": (q, k, v), "bhnd": tuple(heads_first),
               "bhnd-x": (heads_first[0], *(t.repeat_interleave(group, 1) for t in heads_first[1:]))}
    return {name: tuple(t.detach().clone().requires_grad_(fwdbwd) for t in ts) for name, ts in layouts.items()}


def _rows(case: VariantCase, device) -> torch.Tensor:
    """The query rows the reference checks: all of them in the interpreter, else a spread sample and
    each document's (or the window's) edges."""
    n = case.seqlen
    if device.type != "cuda":
        return torch.arange(n, device=device)
    picked = set(torch.linspace(0, n - 1, SAMPLED_ROWS).round().long().tolist())
    if case.variant == "documents":
        for r in range(case.batch):
            ends = torch.tensor(case.document_lengths(r)).cumsum(0).tolist()
            picked |= {e - 1 for e in ends} | {e for e in ends[:-1]}
    if case.variant == "window":
        picked |= {min(n - 1, case.window + edge) for edge in (-1, 0, 1)}
    return torch.tensor(sorted(picked), device=device)


def _reference(case: VariantCase, t: dict, ids, rows, grad, fwdbwd: bool):
    """Output rows (batch, R, H, D) and, with fwdbwd, (dq rows, dk, dv) for a gradient that is
    `grad` on the sampled rows and 0 elsewhere; float64 on the CPU, float32 on the GPU."""
    dtype = torch.float64 if rows.device.type == "cpu" else torch.float32
    q, k, v = (x.detach().to(dtype).requires_grad_(fwdbwd) for x in t["bnhd"])
    group = case.heads_q // case.heads_kv
    qr = q[:, rows].transpose(1, 2)
    kx, vx = (x.transpose(1, 2).repeat_interleave(group, 1) for x in (k, v))
    s = qr @ kx.transpose(-1, -2) * case.head_dim ** -0.5
    if case.softcap:
        s = case.softcap * torch.tanh(s / case.softcap)
    s = s.masked_fill(~case.visible(rows, ids)[:, None], float("-inf"))
    out = (torch.softmax(s, -1) @ vx).transpose(1, 2)
    if not fwdbwd:
        return out.detach(), None
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad[:, rows].to(dtype))
    return out.detach(), (dq[:, rows], dk, dv)


def _to_bnhd(x, layout: str, case: VariantCase, is_kv: bool = False):
    if layout == "bnhd":
        return x
    if layout == "bhnd-x" and is_kv:  # the repeated heads' gradients summed back to their K/V head
        x = x.unflatten(1, (case.heads_kv, case.heads_q // case.heads_kv)).sum(2)
    return x.transpose(1, 2)


def _rel(x, ref) -> float:
    x = x.to(ref.dtype)
    if not torch.isfinite(x).all():
        return float("nan")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _check(case, layout, call, t, rows, grad, ref, fwdbwd: bool) -> float:
    """The method's largest relative error against the reference (output, and gradients)."""
    out = call()
    errs = [_rel(_to_bnhd(out.detach(), layout, case)[:, rows], ref[0])]
    if fwdbwd:
        sampled = torch.zeros_like(grad)
        sampled[:, rows] = grad[:, rows]
        grads = torch.autograd.grad(out, t[layout], _from_bnhd(sampled, layout))
        dq, dk, dv = (_to_bnhd(g, layout, case, is_kv=i > 0) for i, g in enumerate(grads))
        errs += [_rel(dq[:, rows], ref[1][0]), _rel(dk, ref[1][1]), _rel(dv, ref[1][2])]
    return max(errs, key=lambda e: float("inf") if e != e else e)


def _from_bnhd(x, layout: str):
    return x if layout == "bnhd" else x.transpose(1, 2).contiguous()


@contextlib.contextmanager
def _strict(on: bool):
    """AUTOFLASH_STRICT=1 while autoflash's methods are checked: a call the kernels do not serve raises
    `FallbackError` (the row says so) instead of timing torch's fallback under autoflash's name."""
    before = os.environ.get("AUTOFLASH_STRICT")
    if on:
        os.environ["AUTOFLASH_STRICT"] = "1"
    try:
        yield
    finally:
        if on and before is None:
            del os.environ["AUTOFLASH_STRICT"]
        elif on:
            os.environ["AUTOFLASH_STRICT"] = before


def _timed_fn(layout, call, t, grad, fwdbwd: bool):
    if not fwdbwd:
        return call
    g = _from_bnhd(grad, layout)
    return lambda: torch.autograd.grad(call(), t[layout], g)


def run_variants(cases, fwdbwd: bool = False, rounds: int = 3, rep_ms: float = 100, device: str = "cuda",
                 progress=None) -> list[dict]:
    """Rows {case fields, impl, ms, fwd_tflops or fwdbwd_tflops, err, note, compiled} per (case, method);
    methods skipped, refused or wrong have ms None and say why in `note`."""
    from autoflash import bench_variant_methods

    device = torch.device(device)
    metric = "fwdbwd_tflops" if fwdbwd else "fwd_tflops"
    rows = []
    with bench_variant_methods.compile_limits():
        for case in cases:
            rows += _run_case(case, fwdbwd, rounds, rep_ms, device, metric, progress)
    return rows


def _run_case(case, fwdbwd: bool, rounds: int, rep_ms: float, device, metric: str, progress) -> list[dict]:
    """One case's rows: every method checked on sampled rows, then the right ones timed, interleaved."""
    from autoflash import bench_variant_methods
    from autoflash.bench import timed_round

    rows = []
    if progress:
        progress(case.label())
    t = _inputs(case, device, fwdbwd)
    ids = case.document_ids(device) if case.variant == "documents" else None
    grad = torch.randn(t["bnhd"][0].shape, generator=torch.Generator(device=device).manual_seed(1),
                       device=device).to(case.torch_dtype)
    sampled = _rows(case, device)
    ref = _reference(case, t, ids, sampled, grad, fwdbwd)
    notes, errs, timed = {}, {}, {}
    methods = bench_variant_methods.methods(case, t, ids, device, fwdbwd)
    for name, method in methods.items():
        if isinstance(method, str):
            notes[name] = method
            continue
        layout, call = method
        try:
            with _strict(name.startswith("autoflash")):  # a torch fallback raises: never timed as autoflash
                errs[name] = _check(case, layout, call, t, sampled, grad, ref, fwdbwd)
        except Exception as e:  # a backend that refuses the case, or runs out of memory
            notes[name] = bench_variant_methods.refused(e)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if not errs[name] <= ERR_LIMIT:
            notes[name] = f"wrong: relative error {errs[name]:.3g} (limit {ERR_LIMIT})"
            continue
        timed[name] = _timed_fn(layout, call, t, grad, fwdbwd)
    samples = {name: [] for name in timed}
    for r in range(rounds):
        for name, ms in timed_round(timed, device, rep_ms, r).items():
            samples[name].append(ms)
    fields = dataclasses.asdict(case)
    for name in methods:
        ms = statistics.median(samples[name]) if samples.get(name) else None
        tflops = case.flops(fwdbwd) / (ms * 1e-3) / 1e12 if ms else None
        rows.append({**fields, "impl": name, "ms": ms, metric: float(f"{tflops:.4g}") if tflops else None,
                     "err": errs.get(name), "note": notes.get(name, ""), "visible_pairs": case.visible_pairs(),
                     "compiled": device.type == "cuda" if name.startswith("flex") else None})
    del t, grad, ref, methods, timed  # (the masks and inputs of this case, before the next one's)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], metric: str) -> tuple[list[str], list[list[str]]]:
    """(header, lines) of the rows: each method's TFLOP/s and its ratio to the case's torch method
    (sdpa-mask, or torch-eager for the softcap) and to compiled FlexAttention."""
    def of(row, impl):
        return next((x[metric] for x in rows if x["impl"] == impl and _same_case(x, row) and x[metric]), None)

    head = ["case", "impl", "ms", "TFLOP/s", "/ torch", "/ flex", "rel. err", "note"]
    lines = []
    for r in rows:
        torch_base = of(r, "sdpa-mask") or of(r, "torch-eager")
        flex = of(r, "flex")
        tf = r[metric]
        case = VariantCase(**{f.name: r[f.name] for f in dataclasses.fields(VariantCase)})
        lines.append([case.label(), r["impl"], f"{r['ms']:.3f}" if r["ms"] else "-", f"{tf:.4g}" if tf else "-",
                      f"{tf / torch_base:.2f}" if tf and torch_base else "-",
                      f"{tf / flex:.2f}" if tf and flex else "-",
                      f"{r['err']:.1e}" if r["err"] is not None else "-", r["note"]])
    return head, lines


def _same_case(a: dict, b: dict) -> bool:
    return all(a[f.name] == b[f.name] for f in dataclasses.fields(VariantCase))
