"""autoflash: a code-generating autotuner for Triton flash-attention kernels.

    import autoflash
    out = autoflash.attention(q, k, v, is_causal=True)            # SDPA form, (B, H, N, D)
    out = autoflash.flash_attn_func(q, k, v, causal=True)          # flash-attn form, (B, N, H, D)
    out = autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)  # decode
    out, lse = autoflash.flash_attn_combine(out_partial, lse_partial)   # merge attention over key splits
    out = autoflash.document_attention(q, k, v, document_ids, causal=True)  # packed documents, (B, N, H, D)
    out = autoflash.flex_attention(q, k, v, score_mod=fn, mask_mod=fn2)  # your own score/mask functions

FlashAttention-3's forms (their own signatures, as flash-attn keeps them in their own module):
`autoflash.flash_attn_interface`.
"""

from autoflash._version import __version__  # noqa: E402

from autoflash.api import attention  # noqa: E402
from autoflash.combine import flash_attn_combine  # noqa: E402
from autoflash.decode import flash_attn_with_kvcache  # noqa: E402
from autoflash.documents import Documents, document_attention  # noqa: E402
from autoflash.flex import flex_attention  # noqa: E402
from autoflash.flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func  # noqa: E402
from autoflash.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,  # noqa: E402
                              flash_attn_varlen_qkvpacked_func)

__all__ = ["attention", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_with_kvcache", "flash_attn_combine", "document_attention", "Documents",
           "flex_attention", "__version__"]
