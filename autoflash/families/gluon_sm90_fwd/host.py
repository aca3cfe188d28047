"""The Gluon Hopper forward family's host side: TMA descriptors over (B, H, N, D) views, which
tensors it takes, the grid (persistent or one program per tile), register budgets and the launch of
`_attn_fwd_sm90` (kernel.py.jinja), with the values of the attention variants it was rendered with."""

from __future__ import annotations

import torch
import triton

from autoflash.families.base import ForwardFamily
from autoflash.families._shared.gluon_tma import GL_DTYPES, head_tile, stride_refusal, tma_view
from autoflash.score_variant import NO_SCORE_ARGS

_NUM_SMS: dict = {}


def num_sms(device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


class GluonSm90Forward(ForwardFamily):
    name = "gluon_sm90_fwd"
    serves_score_variants = True  # window, softcap, ALiBi, sinks (score_parts' semantics)
    serves_user_mods = False  # a user's score_mod / mask_mod: the Triton forward's
    # Where measured on an H100 (benchmarks/gluon_variants.py), its default against the Triton forward's:
    # 1.23x at a causal window of 4096 keys, 16k-64k tokens, d128, GQA 4 (two ping-pong consumers;
    # docs/results/2026-12-07-h100-gluon-variants.md); at d256, GQA 2, causal (one consumer of two
    # warpgroups): 1.13x with softcap 50 at 8k, 1.19x with Gemma-2's window 4096 + softcap 50 at 16k
    # (docs/results/2026-12-07-h100-tuner-rate.md). Not at d64 (gpt-oss' sinks + window 128: 0.71x). No
    # further than measured: d193-256 (the d256 tile), 4k keys or more, without ALiBi or sinks.
    default_for_score_variants = ("causal and (window and head_dim > 64 and head_dim <= 128 and gqa_group >= 4"
                                  " or head_dim > 192 and (window or softcap) and not (alibi or sinks)"
                                  " and gqa_group >= 2 and seqlen_k >= 4096)")

    @property
    def uses_tma(self) -> bool:
        return True

    @property
    def num_warps(self) -> int:
        """Warps of the default partition (consumer 0); workers add 1 producer warp and the other consumers."""
        return 4 * self.knobs["CONSUMER_WARPGROUPS"]

    @property
    def maxnreg(self) -> int:
        """Registers the kernel starts with: the register file (64K) split evenly over every warp
        (warpgroups are rounded up, so the producer warp counts as a warpgroup), rounded down to 8."""
        total_warps = self.num_warps * self.knobs["NUM_CONSUMERS"] + 4
        return min(248, (65536 // (total_warps * 32)) // 8 * 8)

    def supports(self, q, k, v, o):
        """None when this kernel takes these tensors, else a short reason."""
        if q.dtype not in GL_DTYPES:
            return f"dtype {q.dtype} (needs bfloat16 or float16)"
        if not (k.dtype == v.dtype == o.dtype == q.dtype):
            return "q, k, v, o dtypes differ"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or o.dim() != 4:
            return "needs 4-D (B, H, N, D) tensors"
        head_dim = q.shape[3]
        if head_dim > 256 or head_dim % 8:
            return f"head dim {head_dim} (needs a multiple of 8 up to 256: TMA rows of 16-byte multiples)"
        if k.shape[3] != head_dim or v.shape[3] != head_dim or tuple(o.shape) != tuple(q.shape):
            return "head dims or shapes differ"
        if q.shape[1] % k.shape[1] != 0 or k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0]:
            return "heads not divisible for GQA, or k/v shapes differ"
        if q.device.type != "cuda":
            return "not a CUDA tensor"
        return stride_refusal((("q", q), ("k", k), ("v", v), ("o", o)))

    def kernel_args(self, q, k, v, o, lse, sm_scale, causal, causal_offset, sms=132, score_args=NO_SCORE_ARGS):
        """(args, constexprs, grid, options) of the launch; the CPU compile test reads these too.
        score_args: the values of the variants the kernel was rendered with (`score_variant.ScoreArgs`)."""
        kn = self.knobs
        batch, heads, n_q, head_dim = q.shape
        n_k = k.shape[2]
        rows_per_tile = kn["NUM_CONSUMERS"] * kn["BLOCK_M"]
        n_m_tiles = triton.cdiv(n_q, rows_per_tile)
        n_tiles = batch * heads * n_m_tiles
        args = (
            tma_view(q, kn["BLOCK_M"]), tma_view(k, kn["BLOCK_N"]), tma_view(v, kn["BLOCK_N"]),
            tma_view(o, kn["BLOCK_M"]), lse,
            float(sm_scale), n_q, n_k, heads, heads // k.shape[1], int(causal_offset), n_m_tiles, n_tiles,
            *score_args.kernel_args(self.score),
        )
        constexprs = dict(
            IS_CAUSAL=bool(causal), HEAVY_FIRST=kn["HEAVY_FIRST"], INTRA_OVERLAP=kn["INTRA_OVERLAP"],
            PINGPONG=kn["PINGPONG"], PERSISTENT=kn["PERSISTENT"], BLOCK_M=kn["BLOCK_M"], BLOCK_N=kn["BLOCK_N"],
            HEAD_DIM=head_tile(head_dim), NUM_STAGES=kn["NUM_STAGES"], NUM_CONSUMERS=kn["NUM_CONSUMERS"],
        )
        grid = (min(n_tiles, sms) if kn["PERSISTENT"] else n_tiles,)
        options = dict(num_warps=self.num_warps, maxnreg=self.maxnreg)
        return args, constexprs, grid, options

    def launch(self, *, q, k, v, o, lse, sm_scale, causal, causal_offset, compile_only=False, score_args=None):
        """Any strides TMA accepts (unit last stride, 16-byte aligned base and strides), e.g. (B, N, H, D)
        memory seen through .transpose(1, 2); lse contiguous."""
        if not sm_scale > 0:
            raise ValueError(f"the kernels need a positive softmax scale, got {sm_scale}")
        reason = self.supports(q, k, v, o)
        if reason is not None:
            raise ValueError(f"gluon_sm90 forward cannot take these tensors: {reason}")
        args, constexprs, grid, options = self.kernel_args(q, k, v, o, lse, sm_scale, causal, causal_offset,
                                                           sms=num_sms(q.device), score_args=score_args or NO_SCORE_ARGS)
        kernel = self.kernels._attn_fwd_sm90
        if compile_only:
            kernel.warmup(*args, **constexprs, **options, grid=grid)
        else:
            kernel[grid](*args, **constexprs, **options)
