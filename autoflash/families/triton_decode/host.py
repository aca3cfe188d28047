"""The decode family's host side: how many KV splits, the query tile, scratch for the partial
results, and the launches of `_decode_split` and `_decode_combine` (kernel.py.jinja)."""

from __future__ import annotations

import functools
import math

import torch
import triton

from autoflash.families._shared.triton_launch import dot_precision, head_block
from autoflash.families.base import DecodeFamily
from autoflash.score_variant import NO_SCORE_ARGS

MAX_SPLITS = 128  # flash-attn's cap; also bounds the combine tile
PAGED_PROGRAMS_PER_SM = 6  # see num_splits_for


@functools.lru_cache(maxsize=1024)  # (pure; its search loop costs host time a decode step cannot spare)
def num_splits_for(block_n, num_splits_knob, batch, kv_heads, row_tiles, max_seqlen, sm_count, requested=None,
                   paged=False):
    """How many KV splits to launch. `requested` (a caller's num_splits > 0), else a fixed
    NUM_SPLITS knob, is used as is, capped at one split per KV tile of the longest possible sequence
    and at MAX_SPLITS. "auto" is flash-attn's heuristic: no split when the
    (batch, KV head, row tile) programs already fill 80% of the SMs; else the fewest splits whose
    wave efficiency (waves / ceil(waves)) is within 85% of the best, skipping counts that give the
    same tiles per split as a smaller one.

    A paged cache asks for at least PAGED_PROGRAMS_PER_SM programs per SM, with a power-of-two
    split count: every K/V tile waits for its block-table entry first, and only more programs in
    flight hide that dependent load. Measured on an H200 (B=16 32k, 128 programs before splitting;
    contiguous 4.38 TB/s): 4 or 8 splits 4.12-4.25 TB/s at pages 16/32/64, 5 splits 3.29 at pages
    16 and 32 (and 4.05 at 64), 1 split 2.0-2.7."""
    n_blocks = max(1, triton.cdiv(max_seqlen, block_n))
    fixed = requested if requested else (None if num_splits_knob == "auto" else num_splits_knob)
    if fixed is not None:
        return max(1, min(fixed, n_blocks, MAX_SPLITS))
    programs = batch * kv_heads * row_tiles
    if paged and programs < PAGED_PROGRAMS_PER_SM * sm_count:
        wanted = triton.next_power_of_2(triton.cdiv(PAGED_PROGRAMS_PER_SM * sm_count, programs))
        return max(1, min(wanted, n_blocks, MAX_SPLITS))
    if programs >= 0.8 * sm_count:
        return 1
    max_splits = min(MAX_SPLITS, sm_count, n_blocks)

    def eligible(s):
        return s == 1 or triton.cdiv(n_blocks, s) != triton.cdiv(n_blocks, s - 1)

    def efficiency(s):
        waves = programs * s / sm_count
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1) if eligible(s))
    return next(s for s in range(1, max_splits + 1) if eligible(s) and efficiency(s) >= 0.85 * best)


def block_m_for(rows, head_dim):
    """Query-tile rows: GROUP * Q_LEN padded to a power of two >= 16 (tl.dot's minimum), at most
    128 (64 for head dims above 128, to stay inside the register file)."""
    cap = 128 if head_dim <= 128 else 64
    return min(max(16, triton.next_power_of_2(max(rows, 1))), cap)


class TritonDecode(DecodeFamily):
    name = "triton_decode"
    serves_score_variants = True  # window, softcap, ALiBi, sinks (kernel.py.jinja's SCORE)
    serves_user_mods = False

    def num_splits_for(self, batch, kv_heads, row_tiles, max_seqlen, sm_count, requested=None, paged=False):
        return num_splits_for(self.knobs["BLOCK_N"], self.knobs["NUM_SPLITS"], batch, kv_heads, row_tiles,
                              max_seqlen, sm_count, requested, paged)

    def launch(self, *, q, k_cache, v_cache, o, lse, sm_scale, causal, seqlens, block_table=None, sm_count=1,
               num_splits=None, compile_only=False, tma_ok=False, score_args=None):
        batch, q_len, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        paged = block_table is not None
        rows = group * q_len
        block_m = block_m_for(rows, head_dim)
        row_tiles = triton.cdiv(rows, block_m)
        max_seqlen = k_cache.shape[1] * block_table.shape[1] if paged else k_cache.shape[1]
        score_args = score_args or NO_SCORE_ARGS
        # (a window's splits share only the keys its rows see: split for those)
        seen = max_seqlen if not self.score.window or score_args.window[0] < 0 else \
            min(max_seqlen, score_args.window[0] + q_len + self.knobs["BLOCK_N"])
        splits = self.num_splits_for(batch, kv_heads, row_tiles, seen, sm_count, num_splits, paged)
        block_d = head_block(head_dim)
        if splits > 1:
            o_part = torch.empty((batch, heads, q_len, splits, head_dim), device=q.device, dtype=torch.float32)
            lse_part = torch.empty((batch, heads, q_len, splits), device=q.device, dtype=torch.float32)
        else:
            o_part, lse_part = o, lse  # unused: the split kernel writes O and LSE itself
        part_strides = o_part.stride()[:4] if splits > 1 else (0, 0, 0, 0)
        lse_strides = lse_part.stride() if splits > 1 else (0, 0, 0, 0)
        table = block_table if paged else seqlens  # a placeholder pointer when not paged
        table_strides = block_table.stride() if paged else (0, 0)
        split_kernel = self.kernels._decode_split
        (split_kernel.warmup if compile_only else split_kernel.run)(
            q, k_cache, v_cache, seqlens, table, o, lse, o_part, lse_part,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *table_strides, *o.stride(),
            *part_strides, *lse_strides,
            kv_heads, q_len, group, splits, sm_scale, max_seqlen, k_cache.shape[0] if paged else 1,
            *score_args.kernel_args(self.score),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=self.knobs["BLOCK_N"],
            PAGED=paged,
            PAGE_SIZE=k_cache.shape[1] if paged else 1,
            IS_CAUSAL=bool(causal),
            SINGLE_SPLIT=splits == 1,
            DOT_PRECISION=dot_precision(q.dtype),
            USE_TMA=self.knobs["LOADS"] == "tma" and not paged and tma_ok,
            num_warps=self.knobs["num_warps"],
            num_stages=self.knobs["num_stages"],
            grid=(splits, batch * kv_heads, row_tiles),
            **({} if compile_only else {"warmup": False}),
        )
        if splits > 1:
            combine = self.kernels._decode_combine
            (combine.warmup if compile_only else combine.run)(
                o_part, lse_part, o, lse,
                *o_part.stride()[:4], *lse_part.stride(), *o.stride(),
                heads, q_len, splits,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                BLOCK_S=triton.next_power_of_2(splits),
                num_warps=4,
                grid=(batch * heads * q_len,),
                **({} if compile_only else {"warmup": False}),
            )
        return splits
