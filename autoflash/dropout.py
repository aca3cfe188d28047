"""Attention dropout in autoflash's own kernels (rendered with DROPOUT, `_shared/dropout_parts.jinja`),
as flash-attn 2's `dropout_p`: the softmax of the undropped scores (its log-sum-exp is the plain one),
then each probability kept with probability 1 - p and scaled by 1 / (1 - p): O = (P * Z / (1 - p)) V.

The keep mask Z is never stored. Each call draws a fresh seed from torch's default (CPU) generator
(`torch.manual_seed` makes a run repeatable; a CUDA graph capture would fix it: refused there);
the kernels draw element (b, h, i, j) of Z from Philox at (seed, offset + ((b * H + h) * N_Q + i) *
cdiv(N_K, 8) + j // 8), one draw for 8 keys (`triton_device.dropout_keep`), so the backward, given the
same (seed, offset), regenerates the same Z whatever its tiles (tests/test_dropout_kernels.py draws
the same Z as a tensor with the same device function).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from autoflash.score_variant import PLAIN, ScoreArgs, ScoreVariant
from autoflash.training import first_order


@dataclasses.dataclass(frozen=True)
class DropoutArgs:
    """One call's dropout: `p` in (0, 1), the Philox `seed` and the counter `offset` of elements (0, 0, 0, 0..7)."""

    p: float
    seed: int
    offset: int = 0

    def __post_init__(self):
        if not 0.0 <= self.p < 1.0:
            raise ValueError(f"the kernels' dropout takes 0 <= p < 1, got {self.p}")
        if not (0 <= self.seed < 1 << 63 and 0 <= self.offset < 1 << 62):
            raise ValueError(f"a dropout seed and offset are non-negative 63-bit integers, got {self.seed}, {self.offset}")

    def kernel_args(self) -> tuple:
        return (float(self.p), int(self.seed), int(self.offset))

    def shifted_rows(self, rows: int, seqlen_k: int) -> "DropoutArgs":
        """The same draw for a batch slice that starts `rows` score rows (of `seqlen_k` keys) later (a
        chunked launch): the kernels draw once per row and 8 keys."""
        return dataclasses.replace(self, offset=self.offset + rows * -(-seqlen_k // 8))


def new_seed(device: torch.device | str | None = None) -> int:
    """A fresh seed from torch's default CPU generator, whatever the tensors' device: `torch.manual_seed`
    repeats a run, and a CUDA call does not wait for the device to read a seed back (a draw on the CUDA
    generator would need `.item()`, a synchronization per call). A 62-bit value at or above 2**32, so
    the kernels always see a 64-bit integer (a smaller one would build a kernel of its own)."""
    return int(torch.randint(1 << 32, 1 << 62, (), dtype=torch.int64).item())


def draw(p: float, device=None) -> DropoutArgs:
    """The dropout of one call: p and a fresh seed (offset 0)."""
    return DropoutArgs(float(p), new_seed(device))


# --------------------------------------------------------------------------- serving
MAX_REMEMBERED = 4096  # distinct call signatures whose dropout kernels are remembered (then forgotten, all)


def kernels_for(q, k, v, o, causal: bool, op: str, deterministic: bool = False, score: ScoreVariant = PLAIN):
    """The kernel of `op` for these (B, H, N, D) tensors with dropout: the variant the dispatcher
    serves the plain problem with (its winner, else the default), rendered with DROPOUT; a winner of
    a family without dropout (the Gluon forward) gives the op's default variant, and tensors the
    variant cannot take (TMA alignment) its pointer-load twin, as the dispatcher's `_servable`.
    Resolved once per call signature (the dispatcher forgets them with its winners): a training step
    asks three times, and resolving costs ~150 us of host time each, as much as a short step's kernels."""
    from autoflash.dispatch import get_dispatcher

    dispatcher = get_dispatcher()
    key = ("dropout", op, causal, deterministic, score, q.device, q.dtype, k.dtype,
           *((t.shape, t.stride(), not t.data_ptr() & 15) for t in (q, k, v, o)))
    found = dispatcher.derived.get(key)
    if found is None:
        try:
            found = _resolve(dispatcher, q, k, v, o, causal, op, deterministic, score)
        except _Unservable as e:
            found = str(e)
        if len(dispatcher.derived) >= MAX_REMEMBERED:
            dispatcher.derived.clear()
        dispatcher.derived[key] = found
    if isinstance(found, str):
        raise _Unservable(found)
    return found


def _resolve(dispatcher, q, k, v, o, causal: bool, op: str, deterministic: bool, score: ScoreVariant):
    from autoflash import codegen, families
    from autoflash.device import gpu_fingerprint
    from autoflash.space import default_variant, load_space

    plain = dispatcher.kernel_for(q, k, v, o, causal, op, own_only=True, deterministic=deterministic, score=score)
    device = gpu_fingerprint(q.device.index if q.is_cuda else None)
    problem = dispatcher.problem_for(q, k, causal, op, device.sm_count, score, head_dim_v=v.shape[-1])
    candidates = [plain.variant, default_variant(op, problem, device)]
    candidates = [c for c in candidates if not load_space(c.family).vendor
                  and families.host_class(c.family).serves_dropout]
    # A warp-specialized loop with the Philox draw compiles for sm90 (tests/test_dropout_kernels.py) but
    # has not run on a GPU yet: the same variant without it, until a GPU check shows it right.
    candidates = [load_space(c.family).nearest_valid(c.replace(WARP_SPECIALIZE=False), problem, device)
                  if c.as_dict().get("WARP_SPECIALIZE") else c for c in candidates]
    if op == "fwd":
        candidates = [_dropout_forward_tiles(c, problem, device) for c in candidates]
    for variant in list(candidates):
        space = load_space(variant.family)
        if "LOADS" in space.knobs and "pointer" in space.knobs["LOADS"]:
            no_ws = {"WARP_SPECIALIZE": False} if "WARP_SPECIALIZE" in space.knobs else {}
            candidates.append(space.nearest_valid(variant.replace(LOADS="pointer", **no_ws), problem, device))
    why = f"no {op} family with dropout"
    for variant in candidates:
        kernel = codegen.load(variant, score=score, value_dim=v.shape[-1] != q.shape[-1], dropout=True)
        if (why := kernel.unsupported(q, k, v, o)) is None:
            return kernel
    raise _Unservable(why)


# The forward's tiles with the Philox draw rendered in (nothing tunes dropout problems yet). Measured on
# an H100 (benchmarks/dropout_variants_sweep.py, 21 forward variants each, with dropout 0.1 and without,
# docs/results/2026-12-07-h100-policy-dropout.md): 64x64 tiles with 4 warps were the fastest with
# dropout at BERT-large's shape (d64, 512 tokens) and Llama-3-8B's (d128 causal 2k), where the plain
# problem's default (128-row tiles; 8 warps at d128) was fastest or near it without: the draw's
# registers, on top of the larger tile's, cost the larger tile 0.772 ms against 0.636 at Llama's shape
# (0.259 against 0.253 at BERT's). Two stages: the variant measured at both.
DROPOUT_FORWARD_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


def _dropout_forward_tiles(variant, problem, device):
    """`variant` with the forward tiles dropout ran fastest with, where its space allows them."""
    from autoflash.space import load_space

    space = load_space(variant.family)
    if not set(DROPOUT_FORWARD_TILES) <= set(space.knobs):
        return variant
    return space.nearest_valid(variant.replace(**DROPOUT_FORWARD_TILES), problem, device)


class _Unservable(Exception):
    pass


class DropoutAttention(torch.autograd.Function):
    """Forward and backward of (B, H, N, D) views with attention dropout on the own kernels; the
    forward's (seed, offset) is kept for the backward, which draws the same mask again."""

    @staticmethod
    def forward(ctx, q, k, v, args: DropoutArgs, sm_scale: float, causal: bool, offset: int, deterministic: bool,
                score: ScoreArgs | None = None):
        from autoflash.validate import output_like

        out = output_like(q, v)  # q's memory layout
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        variant = score.variant if score is not None else PLAIN
        kernels_for(q, k, v, out, causal, "fwd", score=variant).forward(q, k, v, out, lse, sm_scale, causal, offset,
                                                                        score_args=score, dropout=args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (args, sm_scale, causal, offset, deterministic, score)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @first_order  # (the backward kernels are not differentiable themselves)
    def backward(ctx, grad_out, grad_lse):  # (the LSE is an output for the caller, not differentiable)
        q, k, v, out, lse = ctx.saved_tensors
        args, sm_scale, causal, offset, deterministic, score = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kernel = kernels_for(q, k, v, grad_out, causal, "bwd", deterministic, score.variant if score is not None else PLAIN)
        kernel.backward(q, k, v, out, lse, grad_out, dq, dk, dv, sm_scale, causal, offset, score_args=score, dropout=args)
        return dq, dk, dv, None, None, None, None, None, None


def unsupported(q, k, v, p: float, scale, training: bool, score: ScoreArgs | None = None) -> str | None:
    """Why the kernels cannot take this call with dropout `p` (and the attention variants `score`: a
    window, softcap or ALiBi; sinks stay in torch), or None. q, k, v: (B, H, N, D) views."""
    from autoflash.validate import unsupported_reason

    if torch.compiler.is_compiling():
        return "traced by torch.compile: dropout in the kernels has no registered op yet"
    if q.is_cuda and os.environ.get("AUTOFLASH_DROPOUT_KERNELS", "0").strip() != "1":
        # Measured on an H100 (benchmarks/dropin_speed.py, 2026-12-07): the training pair with dropout 0.1
        # on the own kernels ran at 0.66x SDPA-cuDNN's at BERT-large's and at Llama-3-8B's shape (the
        # backward pays 1.6-2.0x its plain time for the draws); torch keeps these calls until the kernels
        # are faster.
        return ("dropout on the GPU runs in torch: autoflash's dropout kernels are slower than SDPA's so far "
                "(AUTOFLASH_DROPOUT_KERNELS=1 serves them)")
    if not 0.0 < p < 1.0:
        return f"dropout_p={p} (the kernels drop with 0 < dropout_p < 1)"
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return "dropout under CUDA graph capture (the seed drawn on the host would be fixed in the graph)"
    if score is not None and not score.variant.plain:
        from autoflash import variant_forward

        if score.sinks is not None:
            return "dropout with attention sinks (flash-attn has no such call: what the sink's share drops is open)"
        return variant_forward.unsupported(q, k, v, 0.0, scale, score, training)
    return unsupported_reason(q, k, v, None, 0.0, scale, training=training)


def serve(q, k, v, p: float, scale, causal: bool, offset: int, training: bool, deterministic: bool = False,
          args: DropoutArgs | None = None, score: ScoreArgs | None = None):
    """((out (B, H, Nq, Dv) in q's memory layout, lse (B, H, Nq) float32), None) when the kernels compute
    this call with dropout `p` (a fresh seed from torch's generator, or `args`), else (None, why).
    offset: query i sits at key position i + offset (flash-attn: Nk - Nq). training: differentiable
    in q, k, v through the backward kernels, which draw the forward's mask again. score: the call's
    window, softcap or ALiBi (`score_variant.ScoreArgs`; None: plain), rendered in with the dropout."""
    from autoflash.kernel_cache import KernelCacheError
    from autoflash.space import InvalidVariant
    from autoflash.validate import softmax_scale_or_default

    why = unsupported(q, k, v, p, scale, training, score)
    if why is not None:
        return None, why
    sm_scale = softmax_scale_or_default(scale, q.shape[-1])
    args = args if args is not None else draw(p, q.device)
    try:
        if training:
            kernels_for(q, k, v, q.new_empty((*q.shape[:3], v.shape[3])), causal, "bwd", deterministic,
                        score.variant if score is not None else PLAIN)  # (refuses early)
            return DropoutAttention.apply(q, k, v, args, sm_scale, causal, offset, deterministic, score), None
        with torch.no_grad():
            return DropoutAttention.forward(_NoCtx(), q, k, v, args, sm_scale, causal, offset, deterministic, score), None
    except KernelCacheError as e:
        return None, f"no usable kernel cache ({e})"
    except (_Unservable, InvalidVariant) as e:
        return None, f"dropout: {e}"


class _NoCtx:
    """A stand-in autograd context for a forward that needs no backward."""

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass
