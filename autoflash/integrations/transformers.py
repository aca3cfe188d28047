"""Hugging Face transformers integration.

    import autoflash.integrations.transformers as aft
    name = aft.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

`register()` adds an attention function and its mask function to transformers' registries and
returns the name to pass as `attn_implementation`. The name deliberately does not contain
"flash": transformers (seen with 5.17) routes any implementation name containing "flash" to its
own flash-attention / hub loader, which fails for a registered function.

The mask function is transformers' SDPA mask: it returns None for a plain causal (or full) batch,
and then the kernels run causal attention themselves (a prefill into an empty static cache, the one
unmasked call with more keys than queries, has its empty slots cut off first, as transformers' own
SDPA path does). A sliding window that binds gets no mask either where, without padding, it is
flash-attn's bottom-right window (`window_mask`): the `sliding_window` keyword then reaches the kernels.
With padding it returns a boolean mask, and that call goes to torch through autoflash's fallback (one
warning; an error under AUTOFLASH_STRICT=1). Causality is never dropped.

Every keyword transformers' models pass to an attention function (transformers 5.17-5.25: read
from their `attention_interface(...)` calls) is served, or known not to change the result
(`HARMLESS`): `scaling`, `dropout`, `is_causal`, `sliding_window`, `softcap` (Gemma-2), `s_aux` /
`sinks` (gpt-oss's learned sinks, per-query sinks), `position_bias` (an additive bias),
`deterministic`, and packed sequences as `cu_seq_lens_q/k` (+ `max_length_q/k`). Sliding windows,
softcaps and per-head sinks run on the generated kernels, with their backward in training
(`autoflash.variant_forward`); the rest (dropout with sinks, a position bias, a mask with a variant) runs
in torch (`autoflash.eager`, transformers' eager semantics) with one warning. Any other keyword with a value is never dropped silently: one warning, an error under
AUTOFLASH_STRICT=1.
"""

from __future__ import annotations

import torch

import autoflash
from autoflash import variant_forward
from autoflash.eager import eager_attention
from autoflash.fallback import fall_back, ignored
from autoflash.flash_attn import flash_attn_func, flash_attn_heads_first
from autoflash.score_variant import binding_window
from autoflash.score_variant import ScoreArgs
from autoflash.validate import needs_autograd

NAME = "triton_autotuned"

# Keywords that do not change attention's result here: positions are applied to q/k (rotary) before
# the call, packed sequences reach it as a mask (or as cu_seq_lens, served), the rest are outputs'
# or other layers' switches.
HARMLESS = frozenset({
    "position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "output_attentions",
    "output_hidden_states", "output_router_logits", "num_items_in_batch", "return_dict", "seq_idx", "target_dtype",
    "layer_idx", "max_length_q", "max_length_k",
})


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, s_aux=None, sinks=None, position_bias=None,
                      deterministic=None, cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
    """transformers' attention signature: query (B, H, Nq, D), key/value (B, H_kv, Nk, D);
    returns (output (B, Nq, H, D), None)."""
    for name, value_ in kwargs.items():
        if value_ is not None and name not in HARMLESS:
            ignored(name, "autoflash's transformers attention")
    dropout = dropout if getattr(module, "training", False) else 0.0
    sinks = s_aux if s_aux is not None else sinks
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(is_causal) and query.shape[2] > 1  # a single decoding query sees the whole cache
    deterministic = bool(deterministic) and needs_autograd(query, key, value, sinks, position_bias)
    if causal and attention_mask is None and key.shape[2] > query.shape[2]:
        # Only a prefill into an empty static cache comes here (transformers builds a mask whenever real
        # context precedes the queries): causality is top-left there, the slots past the queries are
        # empty. As transformers' own SDPA path does: those keys are cut off.
        n = query.shape[2]
        key, value = key[:, :, :n], value[:, :, :n]
        position_bias = None if position_bias is None else position_bias[..., :n]
    window = (-1, -1)
    if sliding_window is not None and attention_mask is None:  # (a mask holds the window when it binds)
        window = (sliding_window - 1, -1 if causal else sliding_window - 1)
    documents = _documents(query, attention_mask, cu_seq_lens_q, cu_seq_lens_k)
    if documents is not None and sinks is None and position_bias is None:
        out = autoflash.flash_attn_varlen_func(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), documents[0], documents[1],
            query.shape[2], key.shape[2], dropout, scaling, causal, window, softcap or 0.0, None, deterministic)
        return out[None], None
    if documents is not None:  # the documents as a mask: each query sees the keys of its own document
        attention_mask = _document_mask(*documents, query.shape[2], key.shape[2], causal)
    why = "not served by the kernels yet"
    if sinks is not None and position_bias is None and attention_mask is None:  # gpt-oss: per-head sinks
        n_q, n_k = query.shape[2], key.shape[2]
        window_, causal_ = binding_window(window, causal, n_q, n_k)
        served, why = variant_forward.serve(query, key, value, dropout, scaling, causal_, n_k - n_q,
                                            ScoreArgs(window_, softcap or 0.0, None, sinks),
                                            needs_autograd(query, key, value, sinks), deterministic)
        if served is not None:
            return served[0].transpose(1, 2).contiguous(), None
    if sinks is not None or position_bias is not None or (attention_mask is not None and (
            softcap or deterministic or window != (-1, -1))):
        used = [n for n, v in (("sinks", sinks), ("position_bias", position_bias), ("softcap", softcap)) if v is not None]
        fall_back(f"{', '.join(used) or 'a mask with a variant'} ({why})", to="torch (autoflash.eager)")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out, _ = eager_attention(query, key, value, scale=scale, causal=causal and attention_mask is None,
                                 offset=key.shape[2] - query.shape[2], window=window, softcap=softcap or 0.0,
                                 sinks=sinks, bias=position_bias, mask=attention_mask, dropout_p=dropout)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None:
        out = autoflash.attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                  enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if softcap or deterministic or window != (-1, -1):
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout, scaling,
                              causal, window, softcap or 0.0, None, deterministic)
        return out, None
    out = flash_attn_heads_first(query, key, value, dropout_p=dropout, softmax_scale=scaling, causal=causal)
    return out, None


def _documents(query, attention_mask, cu_q, cu_k):
    """(cu_seqlens_q, cu_seqlens_k) int32 of a packed batch (one row of several documents) that no
    mask describes, else None (a mask holds the packing when transformers builds one). Offsets that
    cannot describe this batch are refused by name, never ignored."""
    if attention_mask is not None or (cu_q is None and cu_k is None):
        return None
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    n_q = query.shape[2]
    if query.shape[0] != 1 or int(cu_q[-1]) != n_q or int(cu_k[0]) != 0 or int(cu_q[0]) != 0:
        raise ValueError(f"cu_seq_lens_q/k {cu_q.tolist()} / {cu_k.tolist()} do not describe this batch "
                         f"(batch {query.shape[0]}, {n_q} tokens): packed documents need batch 1 and offsets "
                         "from 0 to the row's length")
    if cu_q.numel() <= 2 and cu_k.numel() <= 2:  # one document: plain attention
        return None
    return cu_q.to(torch.int32), cu_k.to(torch.int32)


def _document_mask(cu_q, cu_k, n_q: int, n_k: int, causal: bool):
    """(n_q, n_k) bool: query i sees key j iff both lie in the same document (and, when causal, j's
    place in it is at most i's, aligned bottom-right per document as the packed kernels)."""
    device = cu_q.device
    cu_q, cu_k = cu_q.long(), cu_k.to(device).long()
    doc_q = torch.bucketize(torch.arange(n_q, device=device), cu_q[1:], right=True)
    doc_k = torch.bucketize(torch.arange(n_k, device=device), cu_k[1:], right=True)
    mask = doc_q[:, None] == doc_k[None, :]
    if causal:  # key j's place in its document <= query i's place + (keys - queries of i's document)
        pos_q = torch.arange(n_q, device=device) - cu_q[doc_q]
        pos_k = torch.arange(n_k, device=device) - cu_k[doc_k]
        shift = (cu_k.diff() - cu_q.diff())[doc_q]
        mask &= pos_k[None, :] <= (pos_q + shift)[:, None]
    return mask


def window_mask(batch_size, q_length, kv_length, *args, local_size=None, config=None, **kwargs):
    """transformers' SDPA mask, but None where it is exactly flash-attn's bottom-right causal sliding
    window of `local_size` keys over every batch entry (no padding, no other pattern), in a prefill
    (as many queries as keys) or a one-token decoding step: the attention function then computes the
    window from its `sliding_window` keyword, on the kernels (the same contract as transformers'
    flash-attention path). Only for a model whose config says its layers slide a window of that size
    (`sliding_window`) and chunk nothing: `local_size` is also the chunk of a chunked-attention mask
    (Llama-4's `attention_chunk_size`), which can look like a window on one step while the layer passes
    no `sliding_window`; dropping it there would attend to every key. Anything else: the mask as
    transformers builds it."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(batch_size, q_length, kv_length, *args, local_size=local_size, config=config, **kwargs)
    if (mask is None or local_size is None or q_length not in (1, kv_length) or mask.dtype != torch.bool
            or torch.compiler.is_compiling() or not _slides_window(config, local_size)):
        return mask
    i = torch.arange(q_length, device=mask.device)[:, None] + (kv_length - q_length)
    j = torch.arange(kv_length, device=mask.device)[None, :]
    flash_window = (j <= i) & (j > i - local_size)
    return None if mask.shape[-2:] == flash_window.shape and bool((mask == flash_window).all()) else mask


def _slides_window(config, local_size: int) -> bool:
    """Whether the model's (text) config declares a sliding window of `local_size` and no chunked attention."""
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (getattr(text, "sliding_window", None) == local_size
            and not getattr(text, "attention_chunk_size", None))


def register(name: str = NAME) -> str:
    """Register autoflash with transformers; returns the `attn_implementation` name to use."""
    if "flash" in name:
        raise ValueError(f"{name!r} contains 'flash': transformers would route it to its own flash-attention loader")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, window_mask)
    return name
