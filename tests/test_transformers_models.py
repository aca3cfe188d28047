"""Real models' attention keywords end to end on the GPU: tiny random-weight Gemma-2 (logit softcap and
sliding windows), Mistral (sliding window), gpt-oss (learned sinks, `s_aux`) and Llama through
`register()`, bf16, with q/k weights scaled so that scores reach O(10) (where a dropped softcap or sink
shows). On the GPU their logits must be as close to float32 "eager" as bf16 "eager" is (within 1.5x
of its error); on the CPU (interpreter, float32) they must match float32 "eager": the keywords are
served, not dropped."""

import warnings

import pytest
import torch

SEQ, BATCH = 96, 2


def _configs():
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    return {
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(**common, sliding_window=24, attn_logit_softcapping=5.0,
                                                         final_logit_softcapping=None, query_pre_attn_scalar=32)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**common, sliding_window=24)),
        "gpt_oss": (tf.GptOssForCausalLM, tf.GptOssConfig(**common, sliding_window=24, num_local_experts=4,
                                                          num_experts_per_tok=2,
                                                          layer_types=["sliding_attention", "full_attention"])),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**common)),
    }


def _model(name):
    cls, cfg = _configs()[name]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # scores of O(10): a dropped softcap or sink changes the answer
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _logits(model, impl, ids, dtype, device="cuda"):
    model = model.to(device, dtype)
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids).logits.float()


MODELS = ["gemma2", "mistral", "gpt_oss", "llama"]


@pytest.mark.interpreter
@pytest.mark.parametrize("name", MODELS)
def test_model_logits_match_float32_eager_on_the_cpu(name):
    import autoflash.integrations.transformers as aft

    impl = aft.register()
    model = _model(name)
    ids = torch.randint(0, 256, (BATCH, 40), generator=torch.Generator().manual_seed(1))
    want = _logits(model, "eager", ids, torch.float32, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = _logits(model, impl, ids, torch.float32, "cpu")
    assert ((ours - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_model_logits_as_close_to_float32_eager_as_bf16_eager(name):
    import autoflash.integrations.transformers as aft

    impl = aft.register()
    model = _model(name)
    ids = torch.randint(0, 256, (BATCH, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    want = _logits(model, "eager", ids, torch.float32)
    eager_bf16 = _logits(model, "eager", ids, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (variants served in torch say so once)
        ours = _logits(model, impl, ids, torch.bfloat16)

    def err(x):
        return ((x - want).norm() / want.norm()).item()
    print(f"{name}: autoflash bf16 {err(ours):.4f}, eager bf16 {err(eager_bf16):.4f}")
    assert err(ours) <= 1.5 * err(eager_bf16), (err(ours), err(eager_bf16))


@pytest.mark.interpreter
def test_the_variant_models_benchmark_runs_and_compares_tokens(tmp_path, monkeypatch):
    """benchmarks/variant_models.py (Gemma-2 and Mistral against "eager", then sdpa / flex_attention on a
    GPU): its pipeline on tiny models in the interpreter, float32 greedy tokens the same as "eager"'s."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "variant_models.py"
    spec = importlib.util.spec_from_file_location("variant_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (what main sets: restored after the test)
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    assert module.main(["--interpret", "--json", str(tmp_path / "out.json")]) == 0
    models = json.loads((tmp_path / "out.json").read_text())["models"]
    assert set(models) == {"gemma2", "mistral"}
    assert all(row["tokens_float32"]["same_tokens"] for row in models.values())
