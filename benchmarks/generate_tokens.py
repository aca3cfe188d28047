"""Greedy generate() of the small random-weight Llama of `autoflash bench --llama` with "sdpa" and
with autoflash's attention, in float32 and bfloat16: whether the tokens agree, and where they do
not, how far apart sdpa's own two best logits were at that step (a near-tie is decided by rounding).

    python benchmarks/generate_tokens.py
"""

from __future__ import annotations

import torch

from autoflash import bench_llama


def main(prompt: int = 256, new_tokens: int = 64, batch: int = 2) -> None:
    model, name = bench_llama._small_llama(prompt + new_tokens)
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        torch.manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
        runs = {}
        for impl in ("sdpa", name):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                runs[impl] = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                            do_sample=False, pad_token_id=0, output_scores=True,
                                            return_dict_in_generate=True)
        same = runs["sdpa"].sequences[:, prompt:] == runs[name].sequences[:, prompt:]
        first = [int((~row).nonzero()[0]) if not row.all() else None for row in same]
        gaps = [float(runs["sdpa"].scores[f][row].float().topk(2).values.diff().abs())
                for row, f in enumerate(first) if f is not None]
        print(f"{dtype}: same tokens {bool(same.all())}; first difference per sequence {first}; "
              f"sdpa's top-2 logit gap there {gaps}")


if __name__ == "__main__":
    main()
