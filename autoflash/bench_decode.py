"""Decode benchmark: `autoflash.flash_attn_with_kvcache` vs torch SDPA (cuDNN, flash) on one query
token per sequence, in TB/s of K and V read (the bytes a decode step must stream), every
implementation in one process, interleaved, median of device-time medians. Paged caches (shuffled
block tables) are timed beside the contiguous own kernel on the same tokens.

Every implementation's output is compared with float32 SDPA first; one that disagrees (relative
error above 2e-2) is reported and not timed.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from autoflash.reference import paged_cache
from autoflash.tuning.timing import time_callable

ERR_LIMIT = 2e-2


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    kv_len: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    pages: tuple = ()  # paged-cache block sizes timed beside the contiguous cache

    def kv_bytes(self) -> int:
        return 2 * self.batch * self.kv_len * self.heads_kv * self.head_dim * torch.tensor([], dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def label(self) -> str:
        return f"{self.dtype} B{self.batch} H{self.heads_q}/{self.heads_kv} KV{self.kv_len} d{self.head_dim}"


# The grid: B=16 at 4k/32k/128k, B=1 and B=64 at 32k; paged 16/64 at B=16 32k (H200 sizes).
GPU_CASES = (DecodeCase(16, 4096), DecodeCase(16, 32768, pages=(16, 64)), DecodeCase(16, 131072),
             DecodeCase(1, 32768), DecodeCase(64, 32768))
# The interpreter: a pipeline check on tiny sizes (float32: the interpreter has no bfloat16).
INTERPRETER_CASES = (DecodeCase(2, 64, 4, 2, 32, "float32", pages=(16,)), DecodeCase(1, 300, 4, 2, 32, "float32"))


def _inputs(case: DecodeCase, device):
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=case.torch_dtype)
    q = rand(case.batch, 1, case.heads_q, case.head_dim)
    k, v = (rand(case.batch, case.kv_len, case.heads_kv, case.head_dim) for _ in range(2))
    return q, k, v


def _methods(case: DecodeCase, q, k, v, sdpa: bool) -> dict:
    """name -> no-argument call returning (B, 1, Hq, D)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import autoflash

    lens = torch.full((case.batch,), case.kv_len, device=q.device, dtype=torch.int32)
    fns = {"autoflash": lambda: autoflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)}
    for page in case.pages:
        kp, vp, table = paged_cache(k, v, page, torch.Generator(device=k.device).manual_seed(1))
        fns[f"autoflash-paged{page}"] = (lambda kp=kp, vp=vp, table=table: autoflash.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=lens, block_table=table))
    if sdpa:
        q4, k4, v4 = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def fn(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True).transpose(1, 2)
            fns[name] = fn
    return fns


def run_decode(cases, rounds: int = 3, rep_ms: float = 60, device: str = "cuda", progress=None):
    """Rows {case fields, impl, ms, tb_s, err} per (case, implementation); refusals and wrong
    results have ms None and say why in `note`."""
    rows = []
    for case in cases:
        if progress:
            progress(case.label())
        q, k, v = _inputs(case, device)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), enable_gqa=True
        ).transpose(1, 2)
        timed, notes, errs = {}, {}, {}
        for name, fn in _methods(case, q, k, v, sdpa=device == "cuda").items():
            try:
                out = fn().float()
            except RuntimeError as e:  # a backend that refuses the shape
                notes[name] = f"refused: {str(e).splitlines()[0][:120]}"
                continue
            errs[name] = float((out - ref).norm() / ref.norm())
            if not errs[name] <= ERR_LIMIT:
                notes[name] = f"wrong: relative error {errs[name]:.3g}"
                continue
            timed[name] = fn
        samples = {name: [] for name in timed}
        for _ in range(rounds):
            for name, fn in timed.items():
                samples[name].append(time_callable(fn, q.device, rep_ms))
        fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "pages"}
        for name in [*timed, *notes]:
            ms = statistics.median(samples[name]) if name in samples else None
            rows.append({**fields, "impl": name, "ms": ms, "tb_s": case.kv_bytes() / ms / 1e9 if ms else None,
                         "err": errs.get(name), "note": notes.get(name, "")})
        del q, k, v
    return rows
