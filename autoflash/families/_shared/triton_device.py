"""Device functions several Triton families' kernels call, each written once. The rendered kernel
modules import it through `device_modules` (once per interpreter setting) and call
`triton_device.<name>(...)`: Triton inlines a called @triton.jit function, and each function here is
the statements the kernels had inline before, in the same order, so the kernels compute the same
values. This file is part of every family's template hash (`families.hashed_source`) and of
Triton's own cache key of every kernel that calls it."""

import triton
import triton.language as tl


@triton.jit
def online_softmax_masked(qk, visible, m_i, l_i):
    """One masked score tile `qk` (log2 domain, already scaled) into the online softmax state m_i,
    l_i: returns p, alpha (what the output sum is rescaled by), m_new (the new m_i) and l_i."""
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen only masked keys keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def window_kv_range(first_row, causal_offset, N_K, window_left, window_right,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """The KV blocks a tile of ROWS query rows from `first_row` visits under a sliding window: only
    the band, so the cost is linear in the sequence length. Query i sees key j iff
    i + causal_offset - window_left <= j <= i + causal_offset + window_right. Returns (lo, full_lo,
    band_lo, hi): [lo, full_lo) the band's left edge (masked), [full_lo, band_lo) keys every row
    sees (no mask), [band_lo, hi) the right edge (masked). All bounds but hi are multiples of
    BLOCK_N; divisions only of non-negative numbers."""
    reach = window_right  # the last key a row sees, relative to its own position
    if IS_CAUSAL:
        reach = tl.minimum(reach, 0)
    first = first_row + causal_offset  # key position of the tile's first row
    hi = tl.minimum(N_K, tl.maximum(first + ROWS + reach, 0))
    lo = (tl.minimum(tl.maximum(first - window_left, 0), hi) // BLOCK_N) * BLOCK_N
    every_row_hi = tl.maximum(first + reach + 1, 0)  # keys below it (and in the band) are seen by every row
    band_lo = tl.maximum(lo, tl.minimum((every_row_hi // BLOCK_N) * BLOCK_N, (hi // BLOCK_N) * BLOCK_N))
    every_row_lo = tl.maximum(first + ROWS - 1 - window_left, 0)  # the last row's first key
    full_lo = tl.minimum(tl.maximum(((every_row_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), band_lo)
    return lo, full_lo, band_lo, hi


@triton.jit
def packed_sequence(CU_Q, CU_K, off_z):
    """Packed sequences: batch entry off_z owns rows [CU_Q[z], CU_Q[z+1]) of the (total, H, D) query
    tensors and [CU_K[z], CU_K[z+1]) of the key ones. Returns (q_start, k_start) in int64 and the
    sequence's lengths (N_Q, N_K)."""
    q_start = tl.load(CU_Q + off_z).to(tl.int64)
    k_start = tl.load(CU_K + off_z).to(tl.int64)
    N_Q = tl.load(CU_Q + off_z + 1) - q_start.to(tl.int32)
    N_K = tl.load(CU_K + off_z + 1) - k_start.to(tl.int32)
    return q_start, k_start, N_Q, N_K


@triton.jit
def sequence_rows(CU_Q, CU_K, off_z, N_Q, N_K, causal_offset, VARLEN: tl.constexpr):
    """The rows batch entry off_z attends with: (q_start, k_start, N_Q, N_K, causal_offset). Packed
    sequences (VARLEN): their first rows and lengths (packed_sequence), the causal mask bottom-right
    per sequence as flash-attn's varlen. Dense: starts 0 (unused: head_offset steps by the batch
    stride), the lengths and offset as given."""
    if VARLEN:
        q_start, k_start, N_Q, N_K = packed_sequence(CU_Q, CU_K, off_z)
        causal_offset = N_K - N_Q
    else:
        q_start = off_z * 0
        k_start = off_z * 0
    return q_start, k_start, N_Q, N_K, causal_offset


@triton.jit
def head_offset(off_z, row_start, off_h, stride_z, stride_row, stride_h, VARLEN: tl.constexpr):
    """Where head off_h of batch entry off_z starts in a tensor, in elements: packed sequences
    (VARLEN) start at their first row (the batch stride unused), dense tensors at their batch."""
    if VARLEN:
        offset = row_start * stride_row + off_h * stride_h
    else:
        offset = off_z * stride_z + off_h * stride_h
    return offset


@triton.jit
def load_rows(BASE, offs, n, stride_row, offs_col, stride_col, n_cols):
    """A tile of rows `offs` (below n) and columns `offs_col` (below n_cols) by pointers, zero
    outside, and its mask (the stores of the tile's gradients reuse it)."""
    mask = (offs[:, None] < n) & (offs_col[None, :] < n_cols)
    tile = tl.load(BASE + offs[:, None].to(tl.int64) * stride_row + offs_col[None, :] * stride_col, mask=mask, other=0.0)
    return tile, mask


@triton.jit
def pair_bases(A, B, off_z, row_start, off_h, stride_az, stride_arow, stride_ah, stride_bz, stride_brow, stride_bh,
               VARLEN: tl.constexpr):
    """The base pointers of head off_h of two tensors whose rows go together (K and V, dK and dV),
    as head_offset's."""
    a = A + head_offset(off_z, row_start, off_h, stride_az, stride_arow, stride_ah, VARLEN)
    b = B + head_offset(off_z, row_start, off_h, stride_bz, stride_brow, stride_bh, VARLEN)
    return a, b


# Philox rounds of the dropout draws: 7, as flash-attn's kernels (Philox4x32-7 passes TestU01's
# BigCrush, Salmon et al. 2011; 10 is Triton's default margin). Each draw gives four 32-bit words.
DROPOUT_PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def dropout_keep(seed, offset, rows, key0, N_K, p, KEYS: tl.constexpr):
    """Dropout's keep mask of a (len(rows) x KEYS) score tile: keys key0 .. key0 + KEYS - 1 (key0 and
    KEYS multiples of 8) of the score rows `rows` (int64, the row's index in the (B x H x N_Q) rows
    of the call). One Philox draw per row and 8 keys: counter offset + row * cdiv(N_K, 8) + key // 8,
    its four 32-bit words cut into eight 16-bit uniforms; key 8g + 4h + 2v + s takes half h (0: the
    low 16 bits) of word 2s + v. A key is kept when its uniform u (0 .. 65535) is >= p * 65536: p is
    rounded up to a multiple of 2**-16 (flash-attn rounds the keep probability to 2**-8). A per-key draw
    (tl.rand) costs 8x the Philox rounds, which on an H100 took more time than the tile's matmuls."""
    groups = key0 // 8 + tl.arange(0, KEYS // 8)
    counter = offset + rows[:, None] * ((N_K + 7) // 8) + groups[None, :]
    w0, w1, w2, w3 = tl.randint4x(seed, counter, DROPOUT_PHILOX_ROUNDS)
    a0 = tl.join((w0 & 0xFFFF).to(tl.int32), (w0 >> 16).to(tl.int32))  # (uint32 words: >> is logical)
    a1 = tl.join((w1 & 0xFFFF).to(tl.int32), (w1 >> 16).to(tl.int32))
    a2 = tl.join((w2 & 0xFFFF).to(tl.int32), (w2 >> 16).to(tl.int32))
    a3 = tl.join((w3 & 0xFFFF).to(tl.int32), (w3 >> 16).to(tl.int32))
    uniform = tl.reshape(tl.join(tl.join(a0, a1), tl.join(a2, a3)), (rows.shape[0], KEYS))
    return uniform.to(tl.float32) >= p * 65536.0
