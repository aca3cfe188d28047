"""autoflash: a code-generating autotuner for Triton flash-attention kernels.

    import autoflash
    out = autoflash.attention(q, k, v, is_causal=True)            # SDPA form, (B, H, N, D)
    out = autoflash.flash_attn_func(q, k, v, causal=True)          # flash-attn form, (B, N, H, D)
    out = autoflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)  # decode
"""

from autoflash._version import __version__  # noqa: E402

from autoflash.api import attention  # noqa: E402
from autoflash.decode import flash_attn_with_kvcache  # noqa: E402
from autoflash.flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func  # noqa: E402
from autoflash.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,  # noqa: E402
                              flash_attn_varlen_qkvpacked_func)

__all__ = ["attention", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_with_kvcache", "__version__"]
