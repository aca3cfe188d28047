"""The backward's Gluon dK/dV kernel (`_gl_bwd_dkdv`, gluon_dkdv.py.jinja) as the host launches it:
which calls it takes, and its launch arguments. Variants with DKDV_KERNEL "gluon_sm90" run it on
dense bfloat16/float16 calls that TMA can take, and their Triton dK/dV kernel on anything else."""

from __future__ import annotations

import triton

from autoflash.families._shared.gluon_tma import GL_DTYPES, head_tile, tma_view

STAGES = 2  # Q/dO ring depth: at d256 two slots + K + V fill 196 KB; one slot cannot overlap
CONSUMER_WARPS = 8
# Registers the kernel starts with: 64K over the consumer's 8 warps and the producer's warpgroup.
MAXNREG = (65536 // ((CONSUMER_WARPS + 4) * 32)) // 8 * 8


def refusal(*tensors):
    """None when the Gluon dK/dV kernel takes these (B, H, N, D) tensors, else why not: TMA needs a
    unit last stride, 16-byte aligned bases and strides, no broadcast strides; wgmma 16-bit types."""
    head_dim = tensors[0].shape[3]
    if tensors[0].dtype not in GL_DTYPES or head_dim % 8 or head_dim > 256:
        return f"dtype {tensors[0].dtype} / head dim {head_dim} (needs 16-bit, a multiple of 8 up to 256)"
    for t in tensors:
        if t.device.type != "cuda" or t.dim() != 4 or t.stride(3) != 1 or t.data_ptr() % 16:
            return "a tensor TMA cannot read (not CUDA, not 4-D, last dim strided or base unaligned)"
        if any(t.shape[i] > 1 and (t.stride(i) == 0 or (t.stride(i) * t.element_size()) % 16) for i in range(3)):
            return "a stride TMA cannot take (zero, or not a 16-byte multiple)"
    return None


def launch_args(knobs, q, k, v, do, dk, dv, lse, delta, sm_scale, causal, causal_offset):
    """(args, constexprs, grid, options) of the Gluon dK/dV launch; the CPU compile test reads these."""
    batch, heads, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    block_m, block_n = knobs["BLOCK_M1"], knobs["BLOCK_N1"]
    heavy_first = bool(causal) and knobs["GRID_ORDER"] == "heavy_first"
    args = (tma_view(q, block_m), tma_view(k, block_n), tma_view(v, block_n), tma_view(do, block_m),
            tma_view(dk, block_n), tma_view(dv, block_n), lse, delta, lse.stride(0), lse.stride(1),
            float(sm_scale), n_q, n_k, heads_kv, heads // heads_kv, int(causal_offset))
    constexprs = dict(IS_CAUSAL=bool(causal), HEAVY_FIRST=heavy_first, BLOCK_M=block_m, BLOCK_N=block_n,
                      HEAD_DIM=head_tile(head_dim), STAGES=STAGES)
    blocks = triton.cdiv(n_k, block_n)
    grid = (batch * heads_kv, blocks) if heavy_first else (blocks, batch * heads_kv)
    return args, constexprs, grid, dict(num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)
