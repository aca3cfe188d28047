"""A one-kernel attention backward in Gluon for Hopper (dK, dV and dQ in one program per KV block,
FlashAttention-3's structure), measured against the template's backward and SDPA-cuDNN's. A
prototype kept with its results (docs/results/2026-12-03-h200-gluon-fused-backward.md): it is not
a variant of the template. GPU only (Triton 3.6's Gluon API, sm90).

The kernel is the template's Gluon dK/dV kernel (producer warp, Q/dO TMA ring, two consumer
warpgroups, scores keys x queries) plus dQ: dS^T goes to shared memory, dQ^T = K^T dS^T is a fifth
wgmma whose accumulator takes dP^T's registers, and the tile is added into a float32 accumulator:
DQ_TMA 0: float32 atomics from the consumer's registers; 1: a TMA reduce-add by the consumer
(which waits until the copy engine has read it); 2: handed to a one-warp writer partition through
shared memory, which reduce-adds it WRITER_ROWS rows at a time while the consumer goes on.

    python benchmarks/gluon_fused_backward.py correct          # float64 gate, ragged lengths (DIMS=128,64,96)
    (SPECS=0,3 picks shapes of the timing list by index, after the MAXD filter)
    VARIANTS='{"sync": {"dq_tma": 1}}' python benchmarks/gluon_fused_backward.py time   # vs template, cuDNN

Writes fused_<phase>.json under $OUT (default /tmp).
"""
import itertools
import json
import os
import statistics
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton._C.libtriton import ir as _ir
from triton.experimental.gluon.language._core import builtin as _builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
)


@_builtin
def _tma_reduce_add(desc, coord, value, _semantic=None):
    """Adds a register tile into global memory through the copy engine (cp.reduce.async.bulk.tensor):
    Gluon 3.6 has no wrapper; its TMA lowering pass stages the tile in shared memory and waits until
    the copy engine has read it."""
    offsets = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_descriptor_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, value.handle, offsets)


@gluon.jit
def _coords(H_KV, HEAVY_FIRST: gl.constexpr):
    if HEAVY_FIRST:
        off_bkv = gl.program_id(0)
        start_n = gl.program_id(1)
    else:
        start_n = gl.program_id(0)
        off_bkv = gl.program_id(1)
    return off_bkv // H_KV, off_bkv % H_KV, start_n


@gluon.jit
def _q_range(start_n, N_Q, causal_offset, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    lo = 0
    if IS_CAUSAL:
        lo = (gl.maximum(start_n * BLOCK_N - causal_offset, 0) // BLOCK_M) * BLOCK_M
    return lo, gl.cdiv(gl.maximum(N_Q - lo, 0), BLOCK_M)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, qd_ready, qd_empty,
              N_Q, H_KV, GQA_GROUP, causal_offset, IS_CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    off_b, off_hk, start_n = _coords(H_KV, HEAVY_FIRST)
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [off_b, off_hk, start_n * BLOCK_N, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [off_b, off_hk, start_n * BLOCK_N, 0], kv_ready, v_smem)
    lo, n_m = _q_range(start_n, N_Q, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    it = 0
    for g in range(GQA_GROUP):
        off_h = off_hk * GQA_GROUP + g
        for i in range(n_m):
            s = it % STAGES
            mbarrier.wait(qd_empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(qd_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [off_b, off_h, lo + i * BLOCK_M, 0], qd_ready.index(s),
                                            q_smem.index(s))
            tma.async_copy_global_to_shared(do_desc, [off_b, off_h, lo + i * BLOCK_M, 0], qd_ready.index(s),
                                            do_smem.index(s))
            it += 1


@gluon.jit
def _dq_writer(dq_chunk_desc, dq_smem, dq_full, dq_empty, N_Q, H_KV, GQA_GROUP, causal_offset,
               IS_CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr, ROWS: gl.constexpr):
    """One warp: adds each tile's dQ (handed over in shared memory) to the float32 accumulator
    through the copy engine, ROWS rows at a time, while the consumer goes on."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])
    off_b, off_hk, start_n = _coords(H_KV, HEAVY_FIRST)
    lo, n_m = _q_range(start_n, N_Q, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    it = 0
    for g in range(GQA_GROUP):
        off_h = off_hk * GQA_GROUP + g
        for i in range(n_m):
            mbarrier.wait(dq_full, it & 1)
            for r in gl.static_range(0, BLOCK_M, ROWS):
                part = dq_smem.slice(r, ROWS).load(layout)
                if r + ROWS == BLOCK_M:  # every row is in registers: the consumer may refill it
                    mbarrier.arrive(dq_empty, count=1)
                _tma_reduce_add(dq_chunk_desc, [off_b, off_h, lo + i * BLOCK_M + r, 0],
                                gl.reshape(part, [1, 1, ROWS, HEAD_DIM]))
            it += 1


@gluon.jit
def _consumer(dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready,
              qd_ready, qd_empty, dq_full, dq_empty,
              LSE, DELTA, DQ, stride_lz, stride_lh, sm_scale, N_Q, N_K, D, H, H_KV, GQA_GROUP, causal_offset,
              IS_CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, P_SMEM: gl.constexpr, DQ_WAIT: gl.constexpr, DQ_TMA: gl.constexpr):
    dtype: gl.constexpr = k_smem.dtype
    WG_M: gl.constexpr = BLOCK_N // 64
    WG_N: gl.constexpr = 2 // WG_M
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG_M, WG_N],
                                                       instr_shape=[16, BLOCK_M // WG_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG_M, WG_N],
                                                         instr_shape=[16, HEAD_DIM // WG_N, 16])
    DQ_WG_M: gl.constexpr = 2 if HEAD_DIM >= 128 else 1
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * DQ_WG_M, 2 // DQ_WG_M],
                                                        instr_shape=[16, BLOCK_M // (2 // DQ_WG_M), 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    offs_dq_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, dq_layout))
    offs_dq_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, dq_layout))
    qk_scale = sm_scale * 1.4426950408889634

    off_b, off_hk, start_n = _coords(H_KV, HEAVY_FIRST)
    lo, n_m = _q_range(start_n, N_Q, causal_offset, IS_CAUSAL, BLOCK_M, BLOCK_N)
    offs_n = start_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    key_first_query = gl.expand_dims(offs_n - causal_offset, 1)
    key_valid = gl.expand_dims(offs_n < N_K, 1)
    mbarrier.wait(kv_ready, 0)
    k = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v = v_smem.reshape([BLOCK_N, HEAD_DIM])
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    p_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
    ds_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
    it = 0
    for g in range(GQA_GROUP):
        off_h = off_hk * GQA_GROUP + g
        row0 = off_b.to(gl.int64) * stride_lz + off_h.to(gl.int64) * stride_lh
        for i in range(n_m):
            s = it % STAGES
            m0 = lo + i * BLOCK_M
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            lse2 = gl.load(LSE + row0 + offs_m, mask=offs_m < N_Q, other=float("inf")) * 1.4426950408889634
            delta = gl.load(DELTA + row0 + offs_m, mask=offs_m < N_Q, other=0.0)
            mbarrier.wait(qd_ready.index(s), (it // STAGES) & 1)
            q = q_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
            do = do_smem.index(s).reshape([BLOCK_M, HEAD_DIM])
            st_tok = warpgroup_mma(k, q.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout),
                                   use_acc=False, is_async=True)
            dpt_tok = warpgroup_mma(v, do.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout),
                                    use_acc=False, is_async=True)
            # previous tile's dK GEMM done: free its ring slot (dV and dQ were waited for already)
            dv, dk, p_op, ds_op = warpgroup_mma_wait(num_outstanding=2, deps=(dv, dk, p_op, ds_op))
            mbarrier.arrive(qd_empty.index((it + STAGES - 1) % STAGES), count=1, pred=it > 0)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
            p = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
            if IS_CAUSAL:
                p = gl.where((key_first_query <= gl.expand_dims(offs_m, 0)) & key_valid, p, 0.0)
            else:
                p = gl.where(key_valid, p, 0.0)
            if P_SMEM:
                p_smem.store(p.to(dtype))
                fence_async_shared()
                dv = warpgroup_mma(p_smem, do, dv, is_async=True)
            else:
                p_op = gl.convert_layout(p.to(dtype), a_layout)
                dv = warpgroup_mma(p_op, do, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok,))
            ds = (p * (dpt - gl.expand_dims(delta, 0))).to(dtype)
            ds_smem.store(ds)
            fence_async_shared()
            gl.thread_barrier()  # the dQ GEMM reads both warpgroups' rows
            # dQ^T = K^T dS^T (head dim x queries): at HEAD_DIM == BLOCK_N its accumulator has dP^T's
            # layout, and takes dP^T's registers (dead now) instead of a fresh zeroed set.
            if HEAD_DIM == BLOCK_N:
                dq = warpgroup_mma(k.permute((1, 0)), ds_smem, dpt, use_acc=False, is_async=True)
            else:
                dq = warpgroup_mma(k.permute((1, 0)), ds_smem, gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, dq_layout),
                                   use_acc=False, is_async=True)
            if P_SMEM:
                dk = warpgroup_mma(ds_smem, q, dk, is_async=True)
            else:
                ds_op = gl.convert_layout(ds, a_layout)
                dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=DQ_WAIT, deps=(dq,))  # dV and dQ done
            if DQ_TMA == 1:  # the consumer reduces (waits until the copy engine has read the tile)
                dq_tile = gl.reshape(gl.permute(dq, (1, 0)), [1, 1, BLOCK_M, HEAD_DIM])
                _tma_reduce_add(dq_desc, [off_b, off_h, m0, 0], dq_tile)
            elif DQ_TMA == 2:  # hand the tile to the writer warp
                mbarrier.wait(dq_empty, (it & 1) ^ 1)
                dq_smem.permute((1, 0)).store(dq)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(dq_full, count=1)
            else:
                # dQ^T[d, m] -> DQ[m0 + m, d]: offsets from one scalar row pointer. The aranges pass
                # through an opaque copy each tile: else all 32 offsets are hoisted and spill.
                d_rt = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [offs_dq_d], dtype=gl.int32,
                                                 is_pure=False, pack=1)
                m_rt = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [offs_dq_m], dtype=gl.int32,
                                                 is_pure=False, pack=1)
                dq_ptrs = DQ + ((off_b * H + off_h).to(gl.int64) * N_Q + m0) * D + (
                    gl.expand_dims(d_rt, 1) + gl.expand_dims(m_rt * D, 0))
                row_ok = gl.expand_dims(m_rt < N_Q - m0, 0)
                if D == HEAD_DIM:
                    gl.atomic_add(dq_ptrs, dq, mask=row_ok, sem="relaxed")
                else:
                    gl.atomic_add(dq_ptrs, dq, mask=row_ok & gl.expand_dims(d_rt < D, 1), sem="relaxed")
            it += 1
    dv, dk, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, p_op, ds_op))
    k_smem.reshape([BLOCK_N, HEAD_DIM]).store((dk * sm_scale).to(dtype))
    v_smem.reshape([BLOCK_N, HEAD_DIM]).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [off_b, off_hk, start_n * BLOCK_N, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [off_b, off_hk, start_n * BLOCK_N, 0], v_smem)
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["stride_lz", "stride_lh", "sm_scale", "N_Q", "N_K", "H", "H_KV", "GQA_GROUP", "causal_offset"])
def _bwd_fused_sm90(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, dq_chunk_desc, LSE, DELTA, DQ, stride_lz, stride_lh,
                    sm_scale, N_Q, N_K, D: gl.constexpr, H, H_KV, GQA_GROUP, causal_offset,
                    IS_CAUSAL: gl.constexpr, HEAVY_FIRST: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, P_SMEM: gl.constexpr,
                    DQ_WAIT: gl.constexpr, DQ_TMA: gl.constexpr, WRITER_ROWS: gl.constexpr,
                    WRITER_REGS: gl.constexpr, DQ_SWIZZLE: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], pl)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], pl)
    # the writer's dQ tile (queries x head dim): unswizzled, read back a few rows at a time
    if DQ_SWIZZLE:  # rows q and q + 2 of the consumer's transposed store land in different bank groups
        # (compiles for sm90; not yet run on a GPU: the measured runs used the plain layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], gl.SwizzledSharedLayout(8, 2, 4, [1, 0]))
    else:
        dq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_DIM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    dq_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(dq_full, count=1)
    mbarrier.init(dq_empty, count=1)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qd_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(qd_ready.index(s), count=1)
        mbarrier.init(qd_empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (dk_desc, dv_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready,
                     qd_ready, qd_empty, dq_full, dq_empty,
                     LSE, DELTA, DQ, stride_lz, stride_lh, sm_scale, N_Q, N_K, D, H, H_KV, GQA_GROUP, causal_offset,
                     IS_CAUSAL, HEAVY_FIRST, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, P_SMEM, DQ_WAIT, DQ_TMA)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, qd_ready,
                     qd_empty, N_Q, H_KV, GQA_GROUP, causal_offset, IS_CAUSAL, HEAVY_FIRST, BLOCK_M, BLOCK_N,
                     STAGES)),
        (_dq_writer, (dq_chunk_desc, dq_smem, dq_full, dq_empty, N_Q, H_KV, GQA_GROUP, causal_offset, IS_CAUSAL,
                      HEAVY_FIRST, BLOCK_M, BLOCK_N, HEAD_DIM, WRITER_ROWS)),
    ], [1, 1], [24, WRITER_REGS])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def head_tile(d):
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _tma_view(t, rows):
    shape, strides = list(t.shape), list(t.stride())
    for i in (2, 1, 0):
        if shape[i] == 1:
            strides[i] = strides[i + 1] * shape[i + 1]
    block = [1, 1, rows, head_tile(shape[3])]
    return TensorDescriptor(t, shape, strides, block, gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype]))


def _dq_view(t, rows):
    """The float32 dQ accumulator (B, H, N, D) for TMA reduce-adds: unswizzled (a 128-byte swizzle
    would cap the box at 32 columns)."""
    shape, strides = list(t.shape), list(t.stride())
    for i in (2, 1, 0):
        if shape[i] == 1:
            strides[i] = strides[i + 1] * shape[i + 1]
    block = [1, 1, rows, head_tile(shape[3])]
    return TensorDescriptor(t, shape, strides, block, gl.NVMMASharedLayout(0, 32, rank=4))


def kernel_args(q, k, v, do, dk, dv, lse, delta, dq_acc, sm_scale, is_causal, causal_offset,
                block_m=64, block_n=None, stages=2, heavy_first=True, p_smem=True, dq_wait=1, dq_tma=2, writer_rows=8,
                writer_regs=56, dq_swizzle=False):
    B, H, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    block_n = block_n or (128 if D <= 128 else 64)
    heavy = heavy_first and is_causal
    args = (_tma_view(q, block_m), _tma_view(k, block_n), _tma_view(v, block_n), _tma_view(do, block_m),
            _tma_view(dk, block_n), _tma_view(dv, block_n), _dq_view(dq_acc, block_m), _dq_view(dq_acc, writer_rows), lse, delta, dq_acc, lse.stride(0), lse.stride(1),
            float(sm_scale), NQ, NK, D, H, HKV, H // HKV, int(causal_offset))
    cx = dict(IS_CAUSAL=bool(is_causal), HEAVY_FIRST=heavy, BLOCK_M=block_m, BLOCK_N=block_n,
              HEAD_DIM=head_tile(D), STAGES=stages, P_SMEM=p_smem, DQ_WAIT=dq_wait, DQ_TMA=dq_tma,
              WRITER_ROWS=writer_rows, WRITER_REGS=writer_regs, DQ_SWIZZLE=dq_swizzle)
    nb = triton.cdiv(NK, block_n)
    grid = (B * HKV, nb) if heavy else (nb, B * HKV)
    return args, cx, grid, dict(num_warps=8, maxnreg=(65536 // (12 * 32)) // 8 * 8)


def backward(q, k, v, do, lse, delta, sm_scale, is_causal, causal_offset, dq_acc=None, **kw):
    """dq, dk, dv (dq via a float32 accumulator, zeroed here)."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if dq_acc is None:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq_acc.zero_()
    args, cx, grid, opts = kernel_args(q, k, v, do, dk, dv, lse, delta, dq_acc, sm_scale, is_causal, causal_offset, **kw)
    _bwd_fused_sm90[grid](*args, **cx, **opts)
    return (dq_acc * sm_scale).to(q.dtype), dk, dv


def main():
    from autoflash.problem import Shape
    from autoflash.reference import make_inputs, reference_grads, rel_error, sdpa_grads
    from autoflash.tuning.gate import forward_for_backward
    from autoflash.tuning.timing import device_ms
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    OUT = os.environ.get("OUT", "/tmp")
    PH = sys.argv[1]
    KW = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    T0 = time.time()
    res = {"correct": [], "time": []}


    def fused(q, k, v, o, lse, do, scale, causal, off, **kw):
        delta = (do.float() * o.float()).sum(-1).contiguous()
        return backward(q, k, v, do, lse.contiguous(), delta, scale, causal, off, **kw)


    fails = 0
    if PH == "correct":
        lens = [(1, 1), (37, 113), (113, 1023), (1023, 113), (4111, 4111)]
        CASES = [(l, d, c, lay) for l, d, c, lay in itertools.product(lens, [int(x) for x in os.environ.get('DIMS', '128,64,96').split(',')], [True, False],
                                                                      ["bhnd", "bnhd"]) if not (l[0] == 4111 and lay == "bnhd")]
        for (nq, nk), d, causal, layout in CASES:
            if time.time() - T0 > float(os.environ.get("BUDGET", 500)):
                print("budget out", flush=True); break
            sh = Shape(2, 4, 2, nq, nk, d, causal, "bfloat16", op="bwd")
            q, k, v = make_inputs(sh, "cuda", seed=nq + d, layout=layout)
            do = make_inputs(sh, "cuda", seed=7, layout=layout)[0]
            for off in ([0, nk - nq] if causal else [0]):
                scale = d ** -0.5
                o, lse = forward_for_backward(q, k, v, causal, off, scale)
                try:
                    dq, dk, dv = fused(q, k, v, o, lse, do, scale, causal, off, **KW)
                    torch.cuda.synchronize()
                except Exception as e:
                    print("ERR", nq, nk, d, causal, str(e)[:800], flush=True); fails += 1; continue
                ref = reference_grads(q, k, v, do, causal, off, scale)
                sdp = sdpa_grads(q, k, v, do, causal, off, scale)
                row = dict(nq=nq, nk=nk, d=d, causal=causal, off=off, layout=layout)
                ok = True
                for name, got, r, s in zip("qkv", (dq, dk, dv), ref, sdp):
                    e, b = rel_error(got, r), max(3 * rel_error(s, r), 1e-2)
                    row["e" + name], row["b" + name] = e, b
                    ok &= bool(e <= b)
                row["ok"] = ok
                fails += not ok
                res["correct"].append(row)
                print(f"[{time.time()-T0:.0f}s] {'ok  ' if ok else 'FAIL'} {nq}x{nk} d{d} c{int(causal)} off{off} {layout}: "
                      + " ".join(f"d{n} {row['e'+n]:.2g}/{row['b'+n]:.2g}" for n in "qkv"), flush=True)
        print("correctness cases", len(res["correct"]), "fails", fails, flush=True)

    if PH == "time":
        from autoflash import codegen
        from autoflash.space import load_space
        from autoflash.device import gpu_fingerprint
        fp = gpu_fingerprint(); space = load_space("bwd")
        specs = [(1, 8, 8, 4096, 128), (4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128), (16, 32, 8, 512, 128),
                 (3, 12, 12, 1024, 128), (2, 32, 32, 1777, 64), (4, 14, 2, 2048, 64), (1, 8, 8, 4096, 256),
                 (4, 16, 8, 2048, 256), (4, 32, 32, 2048, 96)]
        specs = [s for s in specs if s[4] <= int(os.environ.get("MAXD", 128))]
        if os.environ.get("SPECS"):
            specs = [specs[int(i)] for i in os.environ["SPECS"].split(",")]
        for B, H, HKV, N, d in specs:
            if time.time() - T0 > float(os.environ.get("BUDGET", 500)):
                print("budget out", flush=True); break
            sh = Shape(B, H, HKV, N, N, d, True, "bfloat16", op="bwd")
            q, k, v = make_inputs(sh, "cuda", seed=1); do = torch.randn_like(q); scale = d ** -0.5
            o, lse = forward_for_backward(q, k, v, True, 0, scale)
            lse = lse.contiguous()
            var = space.nearest_valid(space.default_for(sh.problem, fp), sh.problem, fp)
            kern = codegen.load(var)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
            fns = {"template_bwd": lambda: kern.backward(q, k, v, o, lse, do, dq, dk, dv, scale, True, 0)}
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ref_out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=H != HKV)
            fns["cudnn_bwd"] = lambda: torch.autograd.grad(ref_out, leaves, do, retain_graph=True)
            fns["fused"] = lambda: fused(q, k, v, o, lse, do, scale, True, 0, dq_acc=dq_acc, **KW)
            delta = (do.float() * o.float()).sum(-1).contiguous()
            dk2, dv2 = torch.empty_like(k), torch.empty_like(v)
            args, cx, grid, opts = kernel_args(q, k, v, do, dk2, dv2, lse, delta, dq_acc, scale, True, 0, **KW)
            fns["fused_kernel_only"] = lambda a=args, c=cx, g=grid, o=opts: _bwd_fused_sm90[g](*a, **c, **o)
            for vname, vkw in json.loads(os.environ.get("VARIANTS", "{}")).items():
                a2, c2, g2, o2 = kernel_args(q, k, v, do, torch.empty_like(k), torch.empty_like(v), lse, delta, dq_acc,
                                               scale, True, 0, **dict(KW, **vkw))
                fns["kernel_" + vname] = (lambda a2=a2, c2=c2, g2=g2, o2=o2: _bwd_fused_sm90[g2](*a2, **c2, **o2))
            # correctness of this very call against cuDNN's gradients (bf16-level agreement)
            g = fns["fused"](); gc = fns["cudnn_bwd"]()
            agree = [rel_error(a, b.to(a.dtype)) for a, b in zip(g, gc)]
            times = {n: [] for n in fns}
            for _ in range(3):
                for n, fn in list(fns.items()):
                    try:
                        times[n].append(device_ms(fn, rep_ms=30))
                    except Exception as e:
                        print("timing ERR", n, str(e)[:300], flush=True); fns.pop(n); times.pop(n)
            med = {n: statistics.median(t) for n, t in times.items() if t}
            fl = 2.5 * 4 * B * H * N * N * d / 2  # backward = 2.5x forward flops (causal half)
            res["time"].append(dict(spec=(B, H, HKV, N, d), variant=var.short(), ms=med, agree_vs_cudnn=agree))
            print(f"[{time.time()-T0:.0f}s] B{B} H{H}/{HKV} N{N} d{d} (agree {['%.3g' % a for a in agree]}): " + "  ".join(
                f"{n} {t*1e3:.0f}us {fl/t/1e9:.0f}TF" for n, t in med.items())
                + "".join(f"  {n}/cudnn {med['cudnn_bwd'] / med[n]:.3f}" for n in ("fused", "template_bwd")
                          if n in med and "cudnn_bwd" in med), flush=True)
            json.dump(res, open(f"{OUT}/fused_{PH}.json", "w"), indent=1, default=str)  # after each shape
    if PH != "time":
        json.dump(res, open(f"{OUT}/fused_{PH}.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
