"""The backward family's host side: delta (the preprocessing kernel), the dK/dV kernel (Triton's,
or the Gluon one where the variant carries it and the call allows), the dQ kernel or the atomic dQ
buffer, the GQA partial-sum reduce, grid orders, windows of packed sequences and the second stream
of DQ_OVERLAP "concurrent". The kernels are in kernel.py.jinja (and gluon_dkdv.py.jinja). The attention
variants (`autoflash.score_variant`) are rendered into the Triton kernels (the Gluon dK/dV kernel computes
none: a variant kernel runs Triton's); their values go to the launches as the kernels' variant parameters."""

from __future__ import annotations

import contextlib

import torch
import triton

from autoflash.families._shared.triton_launch import dot_precision, head_block
from autoflash.families.base import MAX_GRID_AXIS, BackwardFamily
from autoflash.score_variant import NO_SCORE_ARGS

PREPROCESS_BLOCK = 64  # query rows per delta program
GQA_REDUCE_ROWS = 32  # key rows per program of the GQA partial-sum reduce

_SIDE_STREAMS: dict = {}  # (device index, the caller's stream) -> the stream its dK/dV kernels run on


def side_stream(device):
    """The second stream for the caller's current stream on `device`, made once (a stream per call
    would cost a driver call); one per caller stream, so a CUDA graph capture or a thread on a
    stream of its own never shares it."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS.setdefault(key, torch.cuda.Stream(device))
    return stream


class TritonBackward(BackwardFamily):
    name = "triton_bwd"
    supports_varlen = True
    serves_score_variants = True
    serves_value_dim = True  # (the Triton kernels; the Gluon dK/dV kernel takes one head dim)
    serves_dropout = True  # (dense calls, the Triton kernels: the Gluon dK/dV kernel has none)
    max_grid_axis = MAX_GRID_AXIS  # (a test lowers it to exercise the windows of packed sequences)

    def supports(self, q, k, v, o):
        if self.value_dim and self.knobs["GQA_SPLIT"] > 1:  # (the partial-sum buffers have one width)
            return "a GQA split with a value head dim of its own"
        return super().supports(q, k, v, o)

    @property
    def replayable(self) -> bool:
        # dQ added into a float32 buffer (atomic, tma_reduce, ordered) needs the buffer zeroed by torch
        # before the kernels and copied out after them: work a replay would skip. And the ordered
        # dQ's turn counters, poisoned by the replay check, would never come round: it would spin.
        return self.knobs["DQ_MODE"] == "separate"

    def grid(self, blocks: int, heads: int) -> tuple[int, int]:
        return (blocks, heads) if self.knobs["GRID_ORDER"] == "kv_major" else (heads, blocks)

    def launch(self, *, q, k, v, o, lse, do, dq, dk, dv, sm_scale, causal, causal_offset, compile_only=False,
               score_args=None, dropout_args=None):
        batch = q.shape[0]
        lse = lse.contiguous()  # delta is made with lse's (contiguous) layout: the kernels index both alike
        delta = torch.empty((batch, q.shape[1], q.shape[2]), device=q.device, dtype=torch.float32)
        self._launch(q, k, v, o, lse, do, dq, dk, dv, delta, None, None, batch, q.shape[2], k.shape[2], sm_scale,
                     causal, causal_offset, compile_only, score_args or NO_SCORE_ARGS,
                     self.dropout_kernel_args(dropout_args, compile_only))

    def launch_varlen(self, *, q, k, v, o, lse, do, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      sm_scale, causal, compile_only=False, score_args=None):
        if self.dropout:  # (launch windows would renumber the sequences: dense calls only)
            raise ValueError(f"{self.name}: a kernel rendered with dropout takes no packed sequences")
        views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, o, do, dq, dk, dv)]  # (1, H, total, D)
        lse = lse.contiguous()  # delta and the atomic dQ buffer are made contiguous and indexed with lse's strides
        delta = torch.empty((1, q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)
        self._launch(*views[:4], lse.unsqueeze(0), *views[4:], delta, cu_seqlens_q, cu_seqlens_k,
                     cu_seqlens_q.shape[0] - 1, max(max_seqlen_q, 1), max(max_seqlen_k, 1), sm_scale, causal, 0,
                     compile_only, score_args or NO_SCORE_ARGS)

    def _launch(self, q, k, v, o, lse, do, dq, dk, dv, delta, cu_q, cu_k, batch, n_q, n_k, sm_scale, causal,
                causal_offset, compile_only, score_args=NO_SCORE_ARGS, dropout=()):
        """DQ_OVERLAP "concurrent": the dK/dV launches on the second stream for the caller's stream;
        each run of them first waits for the caller's stream, and the caller's stream waits for them
        when the call ends, also when a launch raised (the buffers they use are freed on the caller's
        stream). autoflash.replay replays a bound launch in that same order."""
        concurrent = self.knobs["DQ_OVERLAP"] == "concurrent"
        side = side_stream(q.device) if concurrent and q.is_cuda and not compile_only else None
        try:
            self._launch_beside(side, q, k, v, o, lse, do, dq, dk, dv, delta, cu_q, cu_k, batch, n_q, n_k, sm_scale,
                                causal, causal_offset, compile_only, score_args, dropout)
        finally:
            if side is not None:
                torch.cuda.current_stream(q.device).wait_stream(side)

    def _on_side(self, side, device):
        """Where the dK/dV work goes: the second stream (after the caller's work so far), or the caller's."""
        if self.knobs["DQ_OVERLAP"] != "concurrent":
            return contextlib.nullcontext()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(device))  # (delta; a previous window's work)
        return torch.cuda.stream(side)  # (None: the caller's stream)

    def _launch_beside(self, side, q, k, v, o, lse, do, dq, dk, dv, delta, cu_q, cu_k, batch, n_q, n_k, sm_scale,
                       causal, causal_offset, compile_only, score_args, dropout=()):
        """q ... dv: (B, H, N, D) views (B = 1 for packed sequences, whose rows the cu tensors split);
        lse and delta (B, H, total rows) float32; n_q, n_k: the (longest) sequence lengths."""
        kn, kernels = self.knobs, self.kernels
        heads, rows, head_dim = q.shape[1], q.shape[2], q.shape[3]
        heads_kv = k.shape[1]
        block_d = head_block(head_dim)
        head_dim_v = v.shape[3]  # (MLA: V, O, dO and dV have their own head dim, `value_dim`)
        precision = dot_precision(q.dtype)
        varlen = cu_q is not None
        split = kn["GQA_SPLIT"]

        def call(kernel, grid, *args, **kwargs):
            if compile_only:
                kernel.warmup(*args, grid=grid, **kwargs)
            else:
                kernel.run(*args, grid=grid, warmup=False, **kwargs)

        # delta is a row-wise product: packed sequences are just rows of one batch entry here.
        call(kernels._bwd_preprocess, (triton.cdiv(rows, PREPROCESS_BLOCK), q.shape[0] * heads),
             o, do, delta, *o.stride(), *do.stride(), heads, rows,
             HEAD_DIM=head_dim_v, BLOCK_D=head_block(head_dim_v), BLOCK_M=PREPROCESS_BLOCK)
        common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, IS_CAUSAL=causal, DOT_PRECISION=precision, VARLEN=varlen,
                      num_warps=kn["num_warps"], num_stages=kn["num_stages"])
        if self.value_dim:
            common.update(HEAD_DIM_V=head_dim_v, BLOCK_DV=head_block(head_dim_v))
        stride_lz, stride_lh = lse.stride(0), lse.stride(1)
        dq_acc, turns = None, ()
        if kn["DQ_MODE"] != "separate":
            dq_acc = torch.zeros((q.shape[0], heads, rows, block_d), device=q.device, dtype=torch.float32)
        if kn["DQ_MODE"] == "ordered":  # whose turn it is to add into each query block (indexed by its first row)
            turns = (torch.zeros((q.shape[0], heads, rows), device=q.device, dtype=torch.int32),)
        parts = ()
        if split > 1:
            # Partial dK/dV of each slice of the GQA group: (dK | dV, slice, B, H_kv, key rows, BLOCK_D)
            # float32. Packed: rows outside every sequence are never written by the kernel: start at zero.
            key_rows = k.shape[2]
            buffer = (torch.zeros if varlen else torch.empty)(
                (2, split, k.shape[0], heads_kv, key_rows, block_d), device=q.device, dtype=torch.float32)
            part_slice = k.shape[0] * heads_kv * key_rows * block_d
            parts = (buffer, key_rows, part_slice)
        # Packed sequences: a grid axis holds batch x heads programs and CUDA caps axes 1 and 2 at
        # 65535, so many short sequences run in several launches, each over a window of cu_seqlens.
        per_launch = max(1, self.max_grid_axis // max(heads, heads_kv * split)) if varlen else batch
        gluon_dkdv = False
        if kn["DKDV_KERNEL"] == "gluon_sm90":
            from autoflash.families.triton_bwd import gluon_dkdv as gluon

            gluon_dkdv = not varlen and self.score.plain and not self.value_dim and not self.dropout and gluon.refusal(q, k, v, do, dk, dv) is None
        for first in range(0, batch, per_launch):
            window = min(per_launch, batch - first)
            cu_qw, cu_kw = (cu_q[first:], cu_k[first:]) if varlen else (None, None)
            score = score_args.batch_slice(first).kernel_args(self.score)  # (the window's (B, H) ALiBi slopes)
            score = (*score, *dropout)  # (and the dropout's parameters after them: dense calls, one window)
            with self._on_side(side, q.device):
                if gluon_dkdv:  # the Gluon kernel where it takes the call, else Triton's
                    args, constexprs, gl_grid, options = gluon.launch_args(kn, q, k, v, do, dk, dv, lse, delta,
                                                                           sm_scale, causal, causal_offset)
                    if compile_only:
                        kernels._gl_bwd_dkdv.warmup(*args, **constexprs, **options, grid=gl_grid)
                    else:
                        kernels._gl_bwd_dkdv[gl_grid](*args, **constexprs, **options)
                else:
                    call(kernels._bwd_dkdv, self.grid(triton.cdiv(n_k, kn["BLOCK_N1"]), window * heads_kv * split),
                         q, k, v, do, lse, delta, dk, dv, dq_acc if dq_acc is not None else dq, *turns, cu_qw, cu_kw,
                         *parts,
                         *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), stride_lz,
                         stride_lh, heads, heads_kv, n_q, n_k, heads // heads_kv, sm_scale, causal_offset, *score,
                         BLOCK_M=kn["BLOCK_M1"], BLOCK_N=kn["BLOCK_N1"], **common)
            if kn["DQ_MODE"] == "separate":
                call(kernels._bwd_dq, self.grid(triton.cdiv(n_q, kn["BLOCK_M2"]), window * heads),
                     q, k, v, do, lse, delta, dq, cu_qw, cu_kw,
                     *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), stride_lz, stride_lh,
                     heads, n_q, n_k, heads // heads_kv, sm_scale, causal_offset, *score,
                     BLOCK_M=kn["BLOCK_M2"], BLOCK_N=kn["BLOCK_N2"], **common)
            if compile_only:
                break
        if split > 1:
            buffer, key_rows, part_slice = parts
            row_blocks = triton.cdiv(key_rows, GQA_REDUCE_ROWS)
            with self._on_side(side, q.device):
                call(kernels._bwd_gqa_reduce, (row_blocks * k.shape[0] * heads_kv,),
                     buffer, dk, dv, *dk.stride(), *dv.stride(), heads_kv, key_rows, part_slice, row_blocks,
                     HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=GQA_REDUCE_ROWS, SPLIT=split)
        if kn["DQ_MODE"] != "separate" and not compile_only:
            dq.copy_(dq_acc[..., :head_dim])
