"""Decoding steps with attention variants on the decode kernels (`flash_attn_with_kvcache`'s
window_size / softcap / alibi_slopes, gpt-oss's sinks through the kernels' own argument), one process,
interleaved: each case beside the plain decoding step on the same cache (the window's splits share only
the keys its rows see: a 4k window on a 32k cache should cost about a 4k cache's step) and beside torch
(`autoflash.eager`, what served these calls before), as TB/s of the keys and values the step reads.
Every output is checked against the eager path in float32 first. GPU only.

    python benchmarks/decode_variants.py --json decode-variants.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.testing

from autoflash import decode_kernels
from autoflash.eager import eager_attention
from autoflash.score_variant import ScoreArgs

CASES = {  # name: (window, softcap, alibi, sinks)
    "plain": ((-1, -1), 0.0, False, False),
    "gemma2 window 4096 + softcap 50": ((4096, 0), 50.0, False, False),
    "mistral window 4096": ((4096, 0), 0.0, False, False),
    "gpt-oss sinks + window 128": ((127, 0), 0.0, False, True),
    "alibi": ((-1, -1), 0.0, True, False),
}


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for batch, heads, kv_heads, capacity in ((16, 32, 8, 32768), (64, 32, 8, 4096)):
        d = 128
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kc, vc = (torch.randn(batch, capacity, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(2))
        seqlens = torch.full((batch,), capacity, device="cuda", dtype=torch.int32)
        for name, (window, softcap, alibi, sinks) in CASES.items():
            score = ScoreArgs(window=window, softcap=softcap,
                              alibi_slopes=torch.rand(heads, device="cuda") * 0.1 if alibi else None,
                              sinks=torch.randn(heads, device="cuda") if sinks else None)
            variant = None if score.variant.plain else score
            out = torch.empty_like(q)
            lse = torch.empty((batch, heads, 1), device="cuda", dtype=torch.float32)

            def kernels():
                decode_kernels.launch(q, kc, vc, out, lse, d ** -0.5, True, seqlens, None, 0, None, variant)

            def eager():
                return eager_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), scale=d ** -0.5,
                                       causal=True, offset=capacity - 1, window=window, softcap=softcap,
                                       alibi_slopes=score.alibi_slopes,
                                       sinks=None if score.sinks is None else score.sinks[None, :, None, None])[0]
            kernels()
            want = eager().transpose(1, 2)
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            samples = {"kernels": [], "eager": []}
            for r in range(args.rounds):
                for method in (("kernels", "eager") if r % 2 == 0 else ("eager", "kernels")):
                    samples[method].append(ms(kernels if method == "kernels" else eager))
            timed = {m: statistics.median(s) for m, s in samples.items()}
            seen = capacity if window[0] < 0 else min(capacity, window[0] + 1)
            read = 2 * batch * seen * kv_heads * d * 2  # bytes of K and V the step needs
            row = dict(case=name, batch=batch, heads_q=heads, heads_kv=kv_heads, cache=capacity, head_dim=d,
                       keys_seen=seen, ms=timed, tbps={m: read / t / 1e9 for m, t in timed.items()},
                       rel_error_vs_eager=err)
            rows.append(row)
            print(f"B{batch} {heads}/{kv_heads} cache {capacity} {name}: kernels {timed['kernels']:.4f} ms "
                  f"({row['tbps']['kernels']:.2f} TB/s of the keys seen), eager {timed['eager']:.3f} ms, "
                  f"error vs eager {err:.2e}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/decode_variants.py"}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
