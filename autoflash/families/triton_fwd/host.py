"""The Triton forward family's host side: grid, argument set-up and the launch of `_attn_fwd`
(kernel.py.jinja). Knobs that shape the device code are rendered into it; the ones read here are the
tile sizes, launch options and the grid order. The attention variants (`autoflash.score_variant`) are
rendered into it too; their values go to the launch as the kernel's variant parameters."""

from __future__ import annotations

import triton

from autoflash.families._shared.triton_launch import dot_precision, head_block
from autoflash.families.base import MAX_GRID_AXIS, ForwardFamily
from autoflash.score_variant import NO_SCORE_ARGS


class TritonForward(ForwardFamily):
    name = "triton_fwd"
    supports_varlen = True
    serves_score_variants = True
    serves_value_dim = True
    serves_dropout = True  # (dense calls: a packed batch's launch windows would renumber its sequences)
    serves_paged = True  # (pointer loads: a page is found per key row)
    max_grid_axis = MAX_GRID_AXIS  # (a test lowers it to exercise the split launches)

    def supports(self, q, k, v, o):
        if self.value_dim and self.knobs["LOADS"] == "block_ptr":  # (the value tile is written for the others)
            return "block-pointer loads with a value head dim of its own"
        if self.paged and (reason := self._paged_refusal(k, v)):
            return reason
        return super().supports(q, k, v, o)

    def _paged_refusal(self, k, v) -> str | None:
        """Why this paged kernel cannot read these caches ((num_blocks, H_kv, page_size, D) views), or None:
        pointer loads find a page per key row; TMA loads one tile from one page, through a descriptor
        over the whole cache (its pages evenly strided)."""
        if self.knobs["LOADS"] == "pointer":
            return None
        if self.knobs["LOADS"] != "tma" or self.knobs.get("WARP_SPECIALIZE"):
            return "a paged cache is read by pointer loads or by TMA without warp specialization"
        page = k.shape[2]
        if page % self.knobs["BLOCK_N"]:
            return f"TMA reads a key tile of {self.knobs['BLOCK_N']} rows from one page: pages of {page} rows are not"
        if any(t.stride(0) != page * t.stride(2) for t in (k, v)):
            return "TMA reads a paged cache as one tensor: its pages must be evenly strided rows"
        if k.shape[0] * page >= 2 ** 31:  # (TMA coordinates are 32-bit)
            return "TMA addresses at most 2**31 rows of a paged cache"
        return None

    def grid(self, batch: int, heads: int, n_q: int) -> tuple[int, int]:
        blocks_m = triton.cdiv(n_q, self.knobs["BLOCK_M"])
        if self.knobs["GRID_ORDER"] == "m_major":
            return (blocks_m, batch * heads)
        return (batch * heads, blocks_m)

    def launch(self, *, q, k, v, o, lse, sm_scale, causal, causal_offset, compile_only=False, score_args=None,
               dropout_args=None):
        if self.paged:
            raise ValueError(f"{self.name}: a kernel rendered for paged caches takes packed sequences only")
        batch, _heads, n_q, _ = q.shape
        self._launch(q, k, v, o, lse, None, None, lse.stride(0), lse.stride(1), batch, n_q, k.shape[2], sm_scale,
                     causal, causal_offset, compile_only, score_args or NO_SCORE_ARGS,
                     self.dropout_kernel_args(dropout_args, compile_only))

    def launch_varlen(self, *, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sm_scale, causal,
                      compile_only=False, score_args=None, block_table=None):
        if self.dropout:  # (launch windows would renumber the sequences: dense calls only)
            raise ValueError(f"{self.name}: a kernel rendered with dropout takes no packed sequences")
        if (block_table is None) == self.paged:
            raise ValueError(f"{self.name}: a kernel rendered {'with' if self.paged else 'without'} paged caches "
                             f"got {'no ' if block_table is None else ''}block table")
        batch = cu_seqlens_q.shape[0] - 1
        q4, o4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, o))  # (1, H, total, D) views
        if self.paged:  # (num_blocks, H_kv, page_size, D) views: the batch stride steps from page to page
            k4, v4 = k.transpose(1, 2), v.transpose(1, 2)
        else:
            k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (k, v))
        # A grid axis holds batch x heads programs; CUDA caps axes 1 and 2 at 65535, so a batch of many
        # short sequences runs in several launches, each over a window of cu_seqlens.
        per_launch = max(1, self.max_grid_axis // q.shape[1])
        score_args = score_args or NO_SCORE_ARGS
        for first in range(0, batch, per_launch):
            paged = () if block_table is None else (block_table[first:], *block_table.stride())
            # (N_K: the packed keys, or with pages the cache's rows, the bound of its TMA descriptors)
            self._launch(q4, k4, v4, o4, lse, cu_seqlens_q[first:], cu_seqlens_k[first:], 0, lse.stride(0),
                         min(per_launch, batch - first), max(max_seqlen_q, 1), k.shape[0] * (k.shape[1] if self.paged else 1),
                         sm_scale, causal, 0, compile_only, score_args.batch_slice(first), paged=paged)
            if compile_only:
                break

    def _launch(self, q, k, v, o, lse, cu_q, cu_k, stride_lz, stride_lh, batch, n_q, n_k, sm_scale, causal,
                causal_offset, compile_only, score_args, dropout=(), paged=()):
        if not sm_scale > 0:
            raise ValueError(f"the kernels need a positive softmax scale, got {sm_scale}")
        heads, head_dim = q.shape[1], q.shape[3]
        split = {}
        if self.knobs["HEAD_SPLIT"]:  # d = BLOCK_DA + (the rest padded to a power of two >= 16)
            block_da = 1 << (head_dim.bit_length() - 1)
            split = dict(BLOCK_DA=block_da, BLOCK_DB=triton.next_power_of_2(max(head_dim - block_da, 16)))
        if self.value_dim:  # V and O: their own head dim, one block padded to a power of two
            split.update(HEAD_DIM_V=v.shape[3], BLOCK_DV=head_block(v.shape[3]))
        kernel = self.kernels._attn_fwd
        (kernel.warmup if compile_only else kernel.run)(
            q, k, v, o, lse, cu_q, cu_k,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), stride_lz, stride_lh,
            heads, n_q, n_k, heads // k.shape[1], sm_scale, causal_offset,
            *score_args.kernel_args(self.score), *dropout, *paged,
            HEAD_DIM=head_dim,
            BLOCK_D=head_block(head_dim),
            IS_CAUSAL=causal,
            DOT_PRECISION=dot_precision(q.dtype),
            BLOCK_M=self.knobs["BLOCK_M"],
            BLOCK_N=self.knobs["BLOCK_N"],
            VARLEN=cu_q is not None,
            **split,
            **({"PAGE_SIZE": k.shape[2]} if self.paged else {}),
            num_warps=self.knobs["num_warps"],
            num_stages=self.knobs["num_stages"],
            grid=self.grid(batch, heads, n_q),
            **({} if compile_only else {"warmup": False}),
        )
