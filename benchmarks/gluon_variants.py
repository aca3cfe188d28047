"""The attention variants on the Gluon forward against the Triton forward's default and what the
dispatcher serves for the call, on a GPU, bf16, interleaved device time.

For each case (a sliding window of 4096 keys at 16k/32k/64k tokens, the softcap of 50 at d256,
Gemma-2's window + softcap, gpt-oss's sinks + window 128): every method's output is first checked
against float64 on sampled query rows (the materialized mask and bias of those rows only), then timed.
Methods: `served` (what `flash_attn_func` runs for the call now), the Triton forward's default, and the
Gluon forward rendered with the variant in the plain problem's winner's knobs (`gluon-plain-winner`,
where the plain problem is served by the Gluon family), in its default's and in two fixed structures. TFLOP/s count the visible (query, key) pairs only.

    python benchmarks/gluon_variants.py --json gluon-variants.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time

import torch

from autoflash import codegen
from autoflash.device import gpu_fingerprint
from autoflash.dispatch import get_dispatcher
from autoflash.reference import rel_error
from autoflash.score_variant import ScoreArgs
from autoflash.space import Variant, default_variant, load_space
from autoflash.tuning.timing import device_ms_interleaved

STRUCTURES = {  # (the knobs of tests/test_gluon_variants.py's structures)
    "gluon-overlap": dict(BLOCK_M=128, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=1, CONSUMER_WARPGROUPS=2, PINGPONG=False,
                          INTRA_OVERLAP=True, PERSISTENT=False, HEAVY_FIRST=True, CONSUMER_REGS=240, PRODUCER_REGS=24),
    "gluon-pingpong": dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2, NUM_CONSUMERS=2, CONSUMER_WARPGROUPS=1, PINGPONG=True,
                           INTRA_OVERLAP=False, PERSISTENT=True, HEAVY_FIRST=True, CONSUMER_REGS=200, PRODUCER_REGS=40),
}


@dataclasses.dataclass
class Case:
    label: str
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    window: int = -1  # keys a query sees, itself included (causal); -1: all before it
    softcap: float = 0.0
    sinks: bool = False

    def score(self, device) -> ScoreArgs:
        sinks = torch.linspace(-1.0, 2.0, self.heads_q, device=device) if self.sinks else None
        return ScoreArgs(window=(self.window - 1, -1) if self.window > 0 else (-1, -1), softcap=self.softcap,
                         sinks=sinks)

    def visible_pairs(self) -> int:
        n, w = self.seqlen, self.window if self.window > 0 else self.seqlen
        w = min(w, n)
        return w * (w + 1) // 2 + (n - w) * w

    def flops(self) -> float:
        return 4.0 * self.head_dim * self.heads_q * self.visible_pairs()


CASES = [*(Case(f"window 4096, {n // 1024}k", n, 32, 8, 128, window=4096) for n in (16384, 32768, 65536)),
         Case("softcap 50, 8k, d256", 8192, 16, 8, 256, softcap=50.0),
         Case("gemma-2: window 4096 + softcap 50, 16k, d256", 16384, 16, 8, 256, window=4096, softcap=50.0),
         Case("gpt-oss: sinks + window 128, 16k, d64", 16384, 64, 8, 64, window=128, sinks=True)]


def reference_rows(q, k, v, rows, scale, score: ScoreArgs):
    """float64 O of query rows `rows` (causal, bottom-right = top-left here: Nq == Nk)."""
    group = q.shape[1] // k.shape[1]
    qd = q[:, :, rows].double()
    kd, vd = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = qd @ kd.transpose(2, 3) * scale
    if score.softcap:
        s = score.softcap * torch.tanh(s / score.softcap)
    i, j = rows[:, None], torch.arange(k.shape[2], device=q.device)[None, :]
    visible = j <= i
    if score.window[0] >= 0:
        visible &= j >= i - score.window[0]
    s = s.masked_fill(~visible, -math.inf)
    if score.sinks is not None:
        s = torch.cat([s, score.sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    if score.sinks is not None:
        p = p[..., :-1]
    return p @ vd


def methods_for(case: Case, q, k, v, out_like, score: ScoreArgs) -> dict:
    """name -> kernel (codegen.Kernel) for the call, or the reason it has none: what `flash_attn_func`
    serves, the Triton forward's default, the Gluon forward's default and two fixed structures (made
    valid for the problem: the fewest knobs changed)."""
    dispatcher, device = get_dispatcher(), gpu_fingerprint()
    problem = dispatcher.problem_for(q, k, True, "fwd", device.sm_count, score.variant)
    kernels = {"served": lambda: dispatcher.kernel_for(q, k, v, out_like, True, score=score.variant),
               "triton-default": lambda: codegen.load(default_variant("fwd", problem, device), score=score.variant)}
    plain = dispatcher.choose(dataclasses.replace(problem, score_variant=None), device, own_only=True)[0]
    gluon = load_space("gluon_sm90_fwd")
    if plain.family == "gluon_sm90_fwd":
        kernels["gluon-plain-winner"] = lambda: codegen.load(plain, score=score.variant)
    kernels["gluon-default"] = lambda: codegen.load(gluon.nearest_valid(gluon.default_for(problem, device), problem,
                                                                        device), score=score.variant)
    for name, knobs in STRUCTURES.items():
        kernels[name] = lambda knobs=knobs: codegen.load(gluon.nearest_valid(Variant.of("gluon_sm90_fwd", knobs),
                                                                             problem, device), score=score.variant)
    out = {}
    for name, make in kernels.items():
        try:
            out[name] = make()
        except Exception as e:  # (a method this GPU or problem has no kernel for: said, not timed)
            out[name] = f"{type(e).__name__}: {e}"[:500]
    return out


def run(case: Case, rep_ms: float) -> dict:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    qs = 12.5 if case.softcap else 1.0  # scores that feel the cap
    q, k, v = ((torch.randn(1, case.seqlen, h, case.head_dim, device=dev, generator=g) * (qs if t == "q" else 1.0))
               .to(torch.bfloat16).transpose(1, 2) for t, h in (("q", case.heads_q), ("k", case.heads_kv), ("v", case.heads_kv)))
    score, scale = case.score(dev), case.head_dim ** -0.5
    out_like = torch.empty(1, case.seqlen, case.heads_q, case.head_dim, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    kernels = methods_for(case, q, k, v, out_like, score)
    rows = torch.cat([torch.arange(0, 64, device=dev), torch.randint(0, case.seqlen, (192,), generator=g, device=dev),
                      torch.arange(case.seqlen - 64, case.seqlen, device=dev)]).unique()
    ref = reference_rows(q, k, v, rows, scale, score)
    row = {"case": case.label, "seqlen": case.seqlen, "heads_q": case.heads_q, "heads_kv": case.heads_kv,
           "head_dim": case.head_dim, "window": case.window, "softcap": case.softcap, "sinks": case.sinks,
           "visible_pairs_per_head": case.visible_pairs(), "methods": {}}
    fns = {}
    for name, kernel in kernels.items():
        if isinstance(kernel, str):
            row["methods"][name] = {"skipped": kernel}
            continue
        out = torch.full_like(out_like, math.nan)
        lse = torch.empty(1, case.heads_q, case.seqlen, device=dev)
        try:
            kernel.forward(q, k, v, out, lse, scale, True, 0, score_args=score)
            torch.cuda.synchronize()
        except Exception as e:  # (e.g. out of shared memory for this head dim: said, not timed)
            row["methods"][name] = {"family": kernel.variant.family, "variant": kernel.variant.as_dict(),
                                    "skipped": f"{type(e).__name__}: {e}"[:500]}
            continue
        err = rel_error(out[:, :, rows], ref)
        entry = {"variant": kernel.variant.as_dict(), "family": kernel.variant.family, "rel_error_sampled_rows": err,
                 "nan": bool(torch.isnan(out).any().item())}
        row["methods"][name] = entry
        if entry["nan"] or err > 2e-2:
            entry["wrong"] = "output off the float64 reference on sampled rows: not timed"
            continue
        fns[name] = (lambda kernel=kernel, out=out, lse=lse: kernel.forward(q, k, v, out, lse, scale, True, 0,
                                                                            score_args=score))
    for rnd in range(2):
        for name, ms in device_ms_interleaved(fns, rep_ms=rep_ms).items():
            row["methods"][name].setdefault("ms_rounds", []).append(ms)
    for name in fns:
        entry = row["methods"][name]
        entry["ms"] = sorted(entry["ms_rounds"])[len(entry["ms_rounds"]) // 2]
        entry["tflops"] = case.flops() / entry["ms"] / 1e9
    if "served" in fns:
        for name in fns:
            row["methods"][name]["vs_served"] = row["methods"]["served"]["ms"] / row["methods"][name]["ms"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rep-ms", type=float, default=200)
    parser.add_argument("--cases", default="", help="substrings of case labels to run (comma-separated)")
    args = parser.parse_args(argv)
    device = gpu_fingerprint()
    result = {"command": " ".join(sys.argv), "gpu": device.name, "torch": torch.__version__,
              "triton": device.triton_version, "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "rows": []}
    wanted = [w for w in args.cases.split(",") if w]
    for case in CASES:
        if wanted and not any(w in case.label for w in wanted):
            continue
        try:
            row = run(case, args.rep_ms)
        except Exception as e:  # (one case's failure is reported; the others still run)
            row = {"case": case.label, "error": f"{type(e).__name__}: {e}"[:2000]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
