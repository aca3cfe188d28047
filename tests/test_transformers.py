"""transformers integration on the CPU (Triton interpreter): a tiny random-weight Llama built from
a config (no downloads), logits and greedy generation vs the "sdpa" implementation."""

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autoflash.integrations.transformers as aft
from autoflash import api

pytestmark = pytest.mark.interpreter


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def logits(model, impl, ids, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_register_returns_a_name_transformers_accepts(model):
    name = aft.register()
    assert "flash" not in name
    model.set_attn_implementation(name)
    with pytest.raises(ValueError, match="flash"):
        aft.register("my_flash_attention")


def test_logits_match_sdpa(model, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")  # the kernels must run, no fallback
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    name = aft.register()
    torch.testing.assert_close(logits(model, name, ids), logits(model, "sdpa", ids), rtol=1e-4, atol=1e-4)


def test_greedy_generation_with_cache_matches_sdpa(model, monkeypatch):
    monkeypatch.setenv("AUTOFLASH_STRICT", "1")
    ids = torch.randint(0, 128, (1, 21), generator=torch.Generator().manual_seed(2))
    name = aft.register()
    outs = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(outs["sdpa"], outs[name])


def test_padded_batch_keeps_its_mask_through_the_fallback(model):
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second sequence
    name = aft.register()
    api.reset()
    with pytest.warns(api.FallbackWarning, match="attn_mask"):
        ours = logits(model, name, ids, attention_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = logits(model, "sdpa", ids, attention_mask=mask)
    torch.testing.assert_close(ours[:, 5:], ref[:, 5:], rtol=1e-4, atol=1e-4)
