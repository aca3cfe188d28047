"""Hugging Face transformers integration.

    import autoflash.integrations.transformers as aft
    name = aft.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

`register()` adds an attention function and its mask function to transformers' registries and
returns the name to pass as `attn_implementation`. The name deliberately does not contain
"flash": transformers (seen with 5.17) routes any implementation name containing "flash" to its
own flash-attention / hub loader, which fails for a registered function.

The mask function is transformers' SDPA mask: it returns None for a plain causal (or full) batch,
and then the kernels run causal attention themselves (aligned bottom-right, so a query chunk
attending to a longer cache is right too); with padding it returns a boolean mask, and that call
goes to torch SDPA through autoflash's fallback (one warning; an error under AUTOFLASH_STRICT=1).
Causality is never dropped.
"""

from __future__ import annotations

import autoflash
from autoflash.api import flash_attn_heads_first

NAME = "triton_autotuned"


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention signature: query (B, H, Nq, D), key/value (B, H_kv, Nk, D);
    returns (output (B, Nq, H, D), None)."""
    dropout = dropout if getattr(module, "training", False) else 0.0
    if attention_mask is not None:
        out = autoflash.attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                  enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(is_causal) and query.shape[2] > 1  # a single decoding query sees the whole cache
    out = flash_attn_heads_first(query, key, value, dropout_p=dropout, softmax_scale=scaling, causal=causal)
    return out, None


def register(name: str = NAME) -> str:
    """Register autoflash with transformers; returns the `attn_implementation` name to use."""
    if "flash" in name:
        raise ValueError(f"{name!r} contains 'flash': transformers would route it to its own flash-attention loader")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
