"""Models whose attention has variants, through transformers: a random-weight Gemma-2 (sliding window
and logit softcap on alternate layers) and Mistral (sliding window), with autoflash's registered
attention against transformers' "sdpa" and "flex_attention", as a user runs them.

- Tokens: greedy `generate()` in float32 with autoflash and with "eager" (the reference
  implementation): the same tokens, or where they first differ.
- Speed, bf16: an inference forward and a training step (forward + backward) per implementation, timed
  in adjacent groups whose order rotates (`autoflash.bench.alternating`), each step from an idle GPU to
  its last kernel (`bench_llama.step_ms`); medians, and the median per-group ratio to autoflash.

    python benchmarks/variant_models.py --json variant-models.json            (a GPU)
    python benchmarks/variant_models.py --interpret --json smoke.json         (tiny, the CPU interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def configs(tiny: bool) -> dict:
    """name -> (model class, config): a few layers of the real models' attention shapes (windows 4096
    keys; Gemma-2's softcap 50, its 256-wide heads), or a tiny stand-in for the interpreter."""
    import transformers as tf

    if tiny:
        common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
        return {"gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(**common, sliding_window=24, attn_logit_softcapping=5.0,
                                                                 final_logit_softcapping=None, query_pre_attn_scalar=16)),
                "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**common, sliding_window=24))}
    return {
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(
            vocab_size=32000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, sliding_window=4096, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, query_pre_attn_scalar=256, max_position_embeddings=32768)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, sliding_window=4096, max_position_embeddings=32768)),
    }


def same_tokens(model_cls, config, name: str, device: str, prompt: int, new: int) -> dict:
    """Greedy tokens in float32, autoflash against "eager"."""
    import torch

    torch.manual_seed(0)
    model = model_cls(config).to(device, torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (2, prompt), device=device)
    out = {}
    for impl in ("eager", name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                       pad_token_id=0)[:, prompt:]
    same = out["eager"] == out[name]
    return {"same_tokens": bool(same.all()),
            "first_difference": [int((~row).nonzero()[0]) if not row.all() else None for row in same]}


def speeds(model_cls, config, name: str, batch: int, seqlen: int, groups: int) -> dict:
    """bf16 inference and training steps per implementation (sdpa, flex_attention, autoflash)."""
    import torch

    from autoflash.bench import alternating
    from autoflash.bench_llama import paired_speedup, step_ms

    torch.manual_seed(0)
    model = model_cls(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (batch, seqlen), device="cuda")
    impls, skipped = [], {}

    def infer():
        with torch.no_grad():
            model(ids)

    def train():
        model(ids, labels=ids).loss.backward()

    for impl in ("sdpa", "flex_attention", name):
        try:
            model.set_attn_implementation(impl)
            for _ in range(2):  # compile (flex: torch.compile), load every kernel, settle the allocator
                infer()
                train()
            impls.append(impl)
        except Exception as e:  # (an implementation this install cannot run: said, not timed)
            skipped[impl] = f"{type(e).__name__}: {e}"[:300]
        model.zero_grad(set_to_none=True)
    result = {"skipped": skipped, "ms": {}, "vs_autoflash": {}}
    for step, fn in (("inference", infer), ("train_step", train)):
        times = {impl: [] for impl in impls}
        ratios = {impl: [] for impl in impls if impl != name}
        for g in range(groups):
            group = {}
            for impl in alternating(tuple(impls), g):
                model.set_attn_implementation(impl)
                group[impl] = step_ms(fn)
                times[impl].append(group[impl])
            for impl in ratios:
                if name in group:
                    ratios[impl].append(group[impl] / group[name])
        model.zero_grad(set_to_none=True)
        result["ms"][step] = {impl: statistics.median(t) for impl, t in times.items()}
        result["vs_autoflash"][step] = {impl: paired_speedup(r) for impl, r in ratios.items()}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--models", default="gemma2,mistral")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--groups", type=int, default=10, help="timed groups per step (each times every implementation)")
    parser.add_argument("--interpret", action="store_true", help="tiny models, tokens only, in Triton's CPU interpreter")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import autoflash.integrations.transformers as aft

    name = aft.register()
    os.environ.setdefault("AUTOFLASH_STRICT", "1")  # a variant dropped to torch would be an error, not a number
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "gpu": None if args.interpret else torch.cuda.get_device_name(), "models": {}}
    for model_name in args.models.split(","):
        model_cls, config = configs(args.interpret)[model_name]
        row = {"tokens_float32": same_tokens(model_cls, config, name, "cpu" if args.interpret else "cuda",
                                             prompt=40 if args.interpret else config.sliding_window + 512,
                                             new=8 if args.interpret else 32)}  # (past the window: it excludes keys)
        if not args.interpret:
            row["bf16"] = speeds(model_cls, config, name, args.batch, args.seqlen, args.groups)
        result["models"][model_name] = row
        print(model_name, json.dumps(row), flush=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
