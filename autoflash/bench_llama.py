"""`autoflash bench --llama` / `--generate`: a small random-weight Llama (transformers) with "sdpa"
attention and with autoflash's, timed as a user sees it (host time included), in one process.

A step of this model spends about a tenth of its time in attention, so the two differ by a few
tenths of a percent at most, while the GPU's clocks drift by more over the seconds a block of
steps takes. Steps are therefore timed in adjacent pairs (sdpa, autoflash; then autoflash, sdpa;
...), each step between CUDA events after a synchronize, and the speed-up is the median of the
pairs' ratios, with its interquartile range: the ratio's own noise, printed beside it.
"""

from __future__ import annotations

import statistics
import time

import torch

from autoflash.bench import alternating


def _small_llama(max_positions: int):
    """The random-weight Llama of `bench --llama` (bf16, 8 layers, hidden 2048, 16 query / 4 KV
    heads of 128) and autoflash's registered attention name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoflash.integrations.transformers as aft

    name = aft.register()
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16), name


def step_ms(fn) -> float:
    """Milliseconds of one fn() as its caller sees it: from an idle GPU (synchronized) to the end of
    its last kernel, the host's launches included."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def paired_speedup(ratios: list[float]) -> dict:
    """The median of per-pair ratios (baseline time / own time: > 1 is faster) and its quartiles."""
    if len(ratios) < 2:
        return {"median": ratios[0] if ratios else float("nan"), "q1": float("nan"), "q3": float("nan")}
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3}


def llama_step_times(batch: int = 4, seqlen: int = 2048, rounds: int = 3, pairs_per_round: int = 10) -> dict:
    """The small Llama with transformers' "sdpa" attention and with autoflash's registered
    implementation: an inference forward and a training step (forward + backward), each timed in
    rounds x pairs_per_round adjacent pairs (the order reversed every other pair). Returns median
    ms per (implementation, step), the paired speed-up per step (`paired_speedup`) and the logits'
    relative difference."""
    model, name = _small_llama(seqlen)
    ids = torch.randint(0, model.config.vocab_size, (batch, seqlen), device="cuda")

    def infer():
        with torch.no_grad():
            return model(ids).logits

    def train_step():
        model(ids, labels=ids).loss.backward()

    impls = ("sdpa", name)
    logits = {}
    for impl in impls:
        model.set_attn_implementation(impl)
        logits[impl] = infer().float()
        for _ in range(3):  # compile and load every kernel, settle the allocator, before timing
            train_step()
    times = {(impl, step): [] for impl in impls for step in ("inference", "train_step")}
    ratios = {"inference": [], "train_step": []}
    for step, fn in (("inference", infer), ("train_step", train_step)):
        for p in range(rounds * pairs_per_round):
            pair = {}
            for impl in alternating(impls, p):
                model.set_attn_implementation(impl)
                pair[impl] = step_ms(fn)
                times[(impl, step)].append(pair[impl])
            ratios[step].append(pair["sdpa"] / pair[name])
    model.zero_grad(set_to_none=True)
    err = ((logits[name] - logits["sdpa"]).norm() / logits["sdpa"].norm()).item()
    return {"name": name, "logits_rel_diff": err, "pairs": rounds * pairs_per_round,
            "ms": {key: statistics.median(t) for key, t in times.items()},
            "speedup": {step: paired_speedup(r) for step, r in ratios.items()}}


def llama_generate(batch: int = 4, prompt: int = 1024, new_tokens: int = 128, rounds: int = 3) -> dict:
    """Greedy `generate()` of the small Llama with "sdpa" and with autoflash's attention (its decoding
    steps take the decode kernels): the tokens of both, where they first differ, and tokens/s
    (new tokens of the batch per second, median of interleaved rounds, wall clock with the GPU
    synchronized)."""
    model, name = _small_llama(prompt + new_tokens)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")

    def generate():
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0)

    impls = ("sdpa", name)
    tokens, seconds = {}, {impl: [] for impl in impls}
    for impl in impls:
        model.set_attn_implementation(impl)
        tokens[impl] = generate()[:, prompt:]
    for r in range(rounds):
        for impl in alternating(impls, r):
            model.set_attn_implementation(impl)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate()
            torch.cuda.synchronize()
            seconds[impl].append(time.perf_counter() - t0)
    same = tokens["sdpa"] == tokens[name]
    first = [int((~row).nonzero()[0]) if not row.all() else None for row in same]
    return {"name": name, "same_tokens": bool(same.all()), "first_difference": first,
            "tokens_per_s": {impl: batch * new_tokens / statistics.median(t) for impl, t in seconds.items()}}
