"""Triton kernels of the shared stages of Video Sparse Attention: pooling, coarse attention,
top-k selection, list building and cleaning, the backward's preprocess, and the epilogues
the library backends run around their fine stage (coarse mix, pooled-gradient add, valid-row
copy); with the device functions the backends' own kernels share (`_dot`, the list and row
helpers). The fine-stage kernels are their backends' (`vsa_core.backends.*_kernels`).

Every kernel reads and writes caller-provided buffers only: the launchers in
`vsa_core.stages` (and the backends', for their own kernels) allocate nothing and never synchronise the host.

Layout conventions shared by all kernels:
- token tensors (q, k, v, out, gate and their gradients) are addressed with
  (stride_b, stride_h, stride_s) and a contiguous head dim, so BHSD and BSHD both
  run without a transpose;
- block-level tensors (pooled means, coarse outputs, their gradients) are
  BHSD-contiguous `[B, H, n_blocks, D]`, per-row statistics `[B, H, rows]`;
- index lists are `[B, H, n_rows, row_capacity]` int32 with a count per row, ascending;
- token offsets (row * stride) are int64: at BSHD with H40 D128 they pass 2^31 from
  S = 419,431 on.

Lists given by the caller (`block_sparse_attn_from_indices`) are bounded here, whatever
their values (under jax.jit / torch.compile nothing is checked before launch): a count
is clamped to [0, capacity] and an entry counts only if it is a KV block (in [0, nKV))
and greater than the last entry counted in its row. Ascending lists without repeats
are taken as they are. The forward first rewrites given lists by this rule
(`clean_lists_kernel`, in `vsa_core.ops.forward`), so every backend, cuDNN's (which
reads lists as given) included, sees only clean lists, and the backward takes those;
every Triton consumer (forward, dQ, the mask the dK/dV lists come from, the FA4 lists)
applies the rule again on whatever it reads, so no list can make it read out of
bounds or weight a block twice. Per-block token counts are clamped to [0, E] where they
are loaded (a count above E means a full block, below 0 an empty one).

Padding (`vsa_core.problem.PADDINGS`; the constexpr IGNORE_PADDING is padding="ignore"):
the rows of a block past its count are padding. With padding="zeros" they are read as
FastVideo reads them: summed into the block means (whose gradient reaches them), padded
query rows computed like any row, padded KV rows masked as keys (a select on the scores)
but still multiplied in (P @ V with P = 0 there), so they must hold finite values (zeros,
for the means to be the valid tokens' means). With IGNORE_PADDING they are never read into
a result: every load of a padded row is replaced by 0 with a select after the load (also
after a TMA load), so NaN / inf there cannot reach a valid row through 0 * inf, and the
padded rows of every output are written 0.

`UPCAST` is set under TRITON_INTERPRET=1: the interpreter multiplies the bit
patterns of bf16 operands in `tl.dot`, so tiles are widened to fp32 there. On a
GPU it is False and the tensor cores see bf16/fp16 operands, as in FlashAttention.
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded to nearest (ties to even) in DTYPE ("bfloat16", "float16"; "float32"
    leaves it), kept as fp32; beyond DTYPE's largest finite value it saturates there (an
    overflow to -inf would read as an empty block). bf16 is rounded on the bits because
    Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even),
    and the block means and the ranked scores must be the same values on both."""
    if DTYPE == "bfloat16":
        x = tl.minimum(tl.maximum(x, -3.3895313892515355e38), 3.3895313892515355e38)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & tl.full([], 0xFFFF0000, tl.uint32)
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == "float16":
        return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _clamped_count(COUNTS, block, BLOCK_ELEMS: tl.constexpr):
    """Valid tokens of `block`, clamped to [0, BLOCK_ELEMS] (callers' values are not trusted)."""
    return tl.minimum(tl.maximum(tl.load(COUNTS + block), 0), BLOCK_ELEMS)


@triton.jit
def _list_entry(LIST, t, last, n_blocks, TILES_PER_ENTRY: tl.constexpr):
    """Entry t // TILES_PER_ENTRY of a caller's index list, by the rule in the module doc.

    Returns (keep, block, last): whether the entry counts, the entry clamped into
    [0, n_blocks) (always safe to address; a skipped entry's tile is masked by the caller),
    and the last counted entry once tile t is the entry's last tile. The address depends
    on the loaded entry only, not on the loop-carried `last`, so the software pipeliner
    can still prefetch the next tiles."""
    entry = tl.load(LIST + t // TILES_PER_ENTRY)
    keep = (entry > last) & (entry < n_blocks)
    last = tl.where(keep & (t % TILES_PER_ENTRY == TILES_PER_ENTRY - 1), entry, last)
    return keep, tl.minimum(tl.maximum(entry, 0), n_blocks - 1), last


@triton.jit
def _list_length(NUM, row, capacity):
    """A row's count clamped to [0, capacity]."""
    return tl.minimum(tl.maximum(tl.load(NUM + row), 0), capacity)


@triton.jit
def _load_rows(X, b, h, row0, stride_b, stride_h, stride_s, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """ROWS consecutive token rows of (batch b, head h) starting at row0, by pointer."""
    rows = (row0 + tl.arange(0, ROWS)).to(tl.int64)
    return tl.load(X + b * stride_b + h * stride_h + rows[:, None] * stride_s + tl.arange(0, HEAD_DIM)[None, :])


@triton.jit
def _rows_or_zero(x, ok):
    """x with the rows where `ok` is False replaced by 0: a select, so NaN / inf loaded
    there are dropped (a product with a zero weight would keep them)."""
    return tl.where(ok[:, None], x, tl.zeros_like(x))


# --------------------------------------------------------------------------------------
# Block mean pooling
# --------------------------------------------------------------------------------------
@triton.jit
def _pool_block(X, COUNTS, POOLED, block, bh, H, stride_b, stride_h, stride_s, n_blocks,
                BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, IGNORE_PADDING: tl.constexpr):
    """POOLED[b, h, block] = sum of the block's rows / COUNTS[block]: all BLOCK_ELEMS rows
    (FastVideo's mean; the padded tail holds zeros), or with IGNORE_PADDING the valid rows
    only (the padded tail is not read)."""
    b = bh // H
    h = bh % H
    d = tl.arange(0, HEAD_DIM)
    base = X + b * stride_b + h * stride_h
    n_valid = _clamped_count(COUNTS, block, BLOCK_ELEMS)
    total = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(0, BLOCK_ELEMS, ROWS):
        in_block = start + tl.arange(0, ROWS)
        rows = (block * BLOCK_ELEMS + in_block).to(tl.int64)
        if IGNORE_PADDING:
            x = tl.load(base + rows[:, None] * stride_s + d[None, :], mask=(in_block < n_valid)[:, None], other=0.0)
        else:
            x = tl.load(base + rows[:, None] * stride_s + d[None, :])
        total += tl.sum(x.to(tl.float32), axis=0)
    count = n_valid.to(tl.float32)
    mean = tl.where(count > 0, total / tl.maximum(count, 1.0), 0.0)
    if POOLED.dtype.element_ty == tl.bfloat16:  # rounded to nearest on the interpreter too (_round_to)
        mean = _round_to(mean, "bfloat16")
    tl.store(POOLED + (bh * n_blocks + block) * HEAD_DIM + d, mean.to(POOLED.dtype.element_ty))


@triton.jit
def block_mean_pool_kernel(
    X, COUNTS, POOLED,
    stride_b, stride_h, stride_s,
    H, n_blocks,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, IGNORE_PADDING: tl.constexpr = False,
):
    """POOLED[b, h, i] = the mean of block i (see _pool_block): the sum of its rows divided
    by COUNTS[i], padded rows summed too unless IGNORE_PADDING. A block with no valid
    token has a zero mean.
    """
    _pool_block(X, COUNTS, POOLED, tl.program_id(0), tl.program_id(1).to(tl.int64), H, stride_b, stride_h,
                stride_s, n_blocks, BLOCK_ELEMS, HEAD_DIM, ROWS, IGNORE_PADDING)


@triton.jit
def block_mean_pool_qkv_kernel(
    Q, K, V, Q_COUNTS, KV_COUNTS, Q_POOL, K_POOL, V_POOL,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    H, n_q, n_kv,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, IGNORE_PADDING: tl.constexpr = False,
):
    """block_mean_pool_kernel of q, k and v in one launch: program i < n_q pools query
    block i, the next n_kv programs the key blocks, the last n_kv the value blocks
    (one launch instead of three; the bytes read are the same)."""
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    if i < n_q:
        _pool_block(Q, Q_COUNTS, Q_POOL, i, bh, H, stride_qb, stride_qh, stride_qs, n_q,
                    BLOCK_ELEMS, HEAD_DIM, ROWS, IGNORE_PADDING)
    elif i < n_q + n_kv:
        _pool_block(K, KV_COUNTS, K_POOL, i - n_q, bh, H, stride_kb, stride_kh, stride_ks, n_kv,
                    BLOCK_ELEMS, HEAD_DIM, ROWS, IGNORE_PADDING)
    else:
        _pool_block(V, KV_COUNTS, V_POOL, i - n_q - n_kv, bh, H, stride_kb, stride_kh, stride_ks, n_kv,
                    BLOCK_ELEMS, HEAD_DIM, ROWS, IGNORE_PADDING)


# --------------------------------------------------------------------------------------
# Coarse attention over block means
# --------------------------------------------------------------------------------------
# The coarse dots multiply fp32 operands (P, dS, dO_c) with the pooled q, k, v. Their products
# must be exact fp32 (the backward's dS = P * (dO_c V^T - rowsum(dO_c * out_c)) cancels when the
# coarse softmax is sharp, which is what made TF32 dots 5e-2 off in dK at x16 activations).
# Triton's exact fp32 dot runs on the FMA units, slowly and at high register pressure; instead
# each operand is written as a sum of bf16 parts (`_bf16_parts`: fp32 needs three, 24 mantissa
# bits = 3 x 8; fp16 two; bf16 one), the parts are multiplied on the tensor cores (a product of
# two bf16 values is exact in fp32) and summed in fp32, largest part last, leaving out only the
# products below 2^-16 of the leading one (fp32 itself rounds at 2^-24).
@triton.jit
def _bf16_parts(x):
    """(hi, mid, lo) bf16 with hi + mid + lo == x for fp32 x (exact up to fp32 underflow)."""
    x = x.to(tl.float32)
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _part_dot(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:  # the interpreter multiplies bf16 bit patterns (module doc)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _coarse_dot(a, b, acc, A_PARTS: tl.constexpr, B_PARTS: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """acc + a @ b with exact fp32 products: a and b as A_PARTS / B_PARTS bf16 parts (3 for an
    fp32 operand, 2 for fp16, 1 for bf16). DOT_PRECISION "tf32" instead runs one TF32 dot (for
    comparisons only: benchmarks/coarse_bench.py, the precision tests' TF32 detector)."""
    if DOT_PRECISION == "tf32":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    a0, a1, a2 = _bf16_parts(a)
    b0, b1, b2 = _bf16_parts(b)
    if A_PARTS >= 3:
        acc = _part_dot(a2, b0, acc, UPCAST)
    if B_PARTS >= 3:
        acc = _part_dot(a0, b2, acc, UPCAST)
    if A_PARTS >= 2 and B_PARTS >= 2:
        acc = _part_dot(a1, b1, acc, UPCAST)
    if A_PARTS >= 2:
        acc = _part_dot(a1, b0, acc, UPCAST)
    if B_PARTS >= 2:
        acc = _part_dot(a0, b1, acc, UPCAST)
    return _part_dot(a0, b0, acc, UPCAST)


@triton.jit
def coarse_attn_fwd_kernel(
    QC, KC, VC, KV_COUNTS, SCORES, OUT_C, LSE_C, Q_SEQ, KV_SEQ,
    n_q, n_kv, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INPUT_PARTS: tl.constexpr, VARLEN: tl.constexpr = False,
    RANK_DTYPE: tl.constexpr = "float32",
):
    """Softmax attention of pooled queries over pooled keys with empty KV blocks masked.

    Also writes the scores the top-k selection ranks (-inf for empty KV blocks): the dot
    q_c . k_c rounded to RANK_DTYPE (the input dtype), times the scale, rounded again
    (`_round_to`; "float32": the fp32 scaled score). That is FastVideo's score,
    `torch.matmul(q_c, k_c^T) / sqrt(D)` on the input dtype's block means (a matmul with
    fp32 accumulation and one rounding to its output dtype, then a division by a Python
    float that CUDA torch runs as a multiply by the fp32 reciprocal, rounded again): ranking
    the fp32 scores instead picks another block wherever two scores round to the same value
    or swap order within one rounding. The softmax here keeps the fp32 scores.
    VARLEN (packed sequences): a KV block of another sequence than the query block's
    (Q_SEQ / KV_SEQ: sequence id per block) is masked like an empty block. INPUT_PARTS: bf16
    parts of a pooled value (1 for bf16 inputs, 2 for fp16; `_coarse_dot`).
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    q = tl.load(QC + (bh * n_q + rows[:, None]) * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
    if VARLEN:
        q_seq = tl.load(Q_SEQ + rows, mask=row_ok, other=-2)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, n_kv, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n_kv
        valid = tl.load(KV_COUNTS + cols, mask=col_ok, other=0) > 0
        k = tl.load(KC + (bh * n_kv + cols[:, None]) * HEAD_DIM + d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(VC + (bh * n_kv + cols[:, None]) * HEAD_DIM + d[None, :], mask=col_ok[:, None], other=0.0)
        dot = _dot(q, tl.trans(k), UPCAST)
        keep = valid[None, :]
        if VARLEN:  # a KV block of another sequence: masked like an empty block
            keep = keep & (tl.load(KV_SEQ + cols, mask=col_ok, other=-1)[None, :] == q_seq[:, None])
        s = tl.where(keep, dot * sm_scale, float("-inf"))
        ranked = tl.where(keep, _round_to(_round_to(dot, RANK_DTYPE) * sm_scale, RANK_DTYPE), float("-inf"))
        tl.store(SCORES + (bh * n_q + rows[:, None]) * n_kv + cols[None, :], ranked,
                 mask=row_ok[:, None] & col_ok[None, :])
        s2 = s * 1.4426950408889634
        m_new = tl.maximum(m_i, tl.max(s2, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s2 - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P stays fp32 here (unlike the fine stage): the coarse backward's rowsum(dO_c * out_c)
        # cancels against dP when the coarse softmax is sharp, and this stage is cheap.
        acc = _coarse_dot(p, v, acc * alpha[:, None], 3, INPUT_PARTS, UPCAST, DOT_PRECISION)
        m_i = m_new
    has_any = l_i > 0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(OUT_C + (bh * n_q + rows[:, None]) * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])
    tl.store(LSE_C + bh * n_q + rows, lse, mask=row_ok)


@triton.jit
def coarse_attn_bwd_ds_kernel(
    QC, KC, VC, KV_COUNTS, OUT_C, LSE_C, DOUT_C, P_C, DS_C, Q_SEQ, KV_SEQ,
    n_q, n_kv, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INPUT_PARTS: tl.constexpr, VARLEN: tl.constexpr = False,
):
    """The coarse backward's first half, one [BLOCK_M, BLOCK_N] tile of the pooled score
    matrix per program: P = exp(S - lse) and dS = P * (dO_c V^T - rowsum(dO_c * out_c)), both
    fp32, to P_C / DS_C ([B, H, n_q, n_kv]). Tiling the whole matrix instead of giving each
    program a band of rows or columns keeps the grid large at any n_q, n_kv, and S and dP are
    computed once (not once for dq_c and again for dk_c, dv_c);
    `coarse_attn_bwd_grads_kernel` then contracts P and dS into the three gradients."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_kv
    row_ptr = (bh * n_q + rows[:, None]) * HEAD_DIM + d[None, :]
    col_ptr = (bh * n_kv + cols[:, None]) * HEAD_DIM + d[None, :]
    q = tl.load(QC + row_ptr, mask=row_ok[:, None], other=0.0)
    k = tl.load(KC + col_ptr, mask=col_ok[:, None], other=0.0)
    v = tl.load(VC + col_ptr, mask=col_ok[:, None], other=0.0)
    do = tl.load(DOUT_C + row_ptr, mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do * tl.load(OUT_C + row_ptr, mask=row_ok[:, None], other=0.0), axis=1)
    lse = tl.load(LSE_C + bh * n_q + rows, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    valid = tl.load(KV_COUNTS + cols, mask=col_ok, other=0) > 0
    s = _dot(q, tl.trans(k), UPCAST) * sm_scale
    if VARLEN:  # a KV block of another sequence: exp(-inf - lse) = 0, as for an empty block
        q_seq = tl.load(Q_SEQ + rows, mask=row_ok, other=-2)
        s = tl.where(tl.load(KV_SEQ + cols, mask=col_ok, other=-1)[None, :] == q_seq[:, None], s, float("-inf"))
    p = tl.where(valid[None, :], tl.exp(s - lse[:, None]), 0.0)
    dp = _coarse_dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), 3, INPUT_PARTS, UPCAST,
                     DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    tile = (bh * n_q + rows[:, None]) * n_kv + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(P_C + tile, p, mask=ok)
    tl.store(DS_C + tile, ds, mask=ok)


@triton.jit
def _contract(A, a_base, out_idx, out_ok, a_stride_out, a_stride_inner, B, b_base, n_inner, d, acc,
              B_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """acc + sum over inner of A[out, inner] * B[inner, d] (exact fp32 products), BLOCK_K inner
    indices at a time. A (P or dS, fp32) is addressed by its (out, inner) strides, so one loop
    serves dS, dS^T and P^T; B's rows (pooled q, k or dO_c: B_PARTS bf16 parts) are
    HEAD_DIM-contiguous."""
    for start in range(0, n_inner, BLOCK_K):
        inner = start + tl.arange(0, BLOCK_K)
        inner_ok = inner < n_inner
        a = tl.load(A + a_base + out_idx[:, None] * a_stride_out + inner[None, :] * a_stride_inner,
                    mask=out_ok[:, None] & inner_ok[None, :], other=0.0)
        b = tl.load(B + (b_base + inner[:, None]) * HEAD_DIM + d[None, :], mask=inner_ok[:, None], other=0.0)
        acc = _coarse_dot(a, b, acc, 3, B_PARTS, UPCAST, DOT_PRECISION)
    return acc


@triton.jit
def coarse_attn_bwd_grads_kernel(
    QC, KC, DOUT_C, P_C, DS_C, DQ_C, DK_C, DV_C,
    n_q, n_kv, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, INPUT_PARTS: tl.constexpr,
):
    """The coarse backward's second half: dq_c = scale * dS K, dk_c = scale * dS^T Q and
    dv_c = P^T dO_c (fp32). Program (i, g, bh) writes rows [i * BLOCK_M, +BLOCK_M) and
    columns [c * BLOCK_D, +BLOCK_D) of gradient g // (HEAD_DIM // BLOCK_D), c the rest: the
    three products share one launch and each output tile has one owner (no atomics)."""
    pid = tl.program_id(0)
    n_col_tiles: tl.constexpr = HEAD_DIM // BLOCK_D
    which = tl.program_id(1) // n_col_tiles
    d = (tl.program_id(1) % n_col_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
    bh = tl.program_id(2).to(tl.int64)
    out_idx = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    scores = bh * n_q * n_kv
    if which == 0:
        ok = out_idx < n_q
        if pid * BLOCK_M < n_q:
            acc = _contract(DS_C, scores, out_idx, ok, n_kv, 1, KC, bh * n_kv, n_kv, d, acc,
                            INPUT_PARTS, HEAD_DIM, BLOCK_K, UPCAST, DOT_PRECISION)
            tl.store(DQ_C + (bh * n_q + out_idx[:, None]) * HEAD_DIM + d[None, :], acc * sm_scale,
                     mask=ok[:, None])
    elif which == 1:
        ok = out_idx < n_kv
        if pid * BLOCK_M < n_kv:
            acc = _contract(DS_C, scores, out_idx, ok, 1, n_kv, QC, bh * n_q, n_q, d, acc,
                            INPUT_PARTS, HEAD_DIM, BLOCK_K, UPCAST, DOT_PRECISION)
            tl.store(DK_C + (bh * n_kv + out_idx[:, None]) * HEAD_DIM + d[None, :], acc * sm_scale,
                     mask=ok[:, None])
    else:
        ok = out_idx < n_kv
        if pid * BLOCK_M < n_kv:
            acc = _contract(P_C, scores, out_idx, ok, 1, n_kv, DOUT_C, bh * n_q, n_q, d, acc,
                            3, HEAD_DIM, BLOCK_K, UPCAST, DOT_PRECISION)
            tl.store(DV_C + (bh * n_kv + out_idx[:, None]) * HEAD_DIM + d[None, :], acc, mask=ok[:, None])


# --------------------------------------------------------------------------------------
# Selection metadata
# --------------------------------------------------------------------------------------
@triton.jit
def _order_keys(SCORES, cols, n_kv, KEY_SHIFT: tl.constexpr):
    """(scores, keys) of the columns `cols` of one score row (-inf past n_kv): each score's
    fp32 bit pattern mapped to an unsigned key with the order of the floats (negative
    floats: all bits flipped; others: the sign bit set), -0.0 made +0.0 first (the two
    compare equal), shifted right by KEY_SHIFT."""
    scores = tl.load(SCORES + cols, mask=cols < n_kv, other=float("-inf"))
    bits = tl.where(scores == 0.0, 0.0, scores).to(tl.uint32, bitcast=True)
    negative = (bits >> 31) != 0
    # the flip is an xor with a typed all-ones: `~bits` makes Triton's interpreter (3.6 - 3.8)
    # fill a uint32 with the Python int -1, which numpy 2 refuses
    return scores, tl.where(negative, bits ^ tl.full([], 0xFFFFFFFF, tl.uint32), bits | 0x80000000) >> KEY_SHIFT


@triton.jit
def _ranked_keys(scores, key, cols, k0, n_prefix, prefix_row, PREFIX_MODE: tl.constexpr):
    """(the keys the threshold ranks, 0 for the others; the columns forced in; how many are
    ranked). Without a prefix every finite score is ranked and none is forced."""
    finite = scores > float("-inf")
    if PREFIX_MODE == 0:
        forced = finite & (cols < 0)
        ranked = finite
    else:
        forced = finite & prefix_row  # a prefix row: dense
        if PREFIX_MODE == 1:
            local = cols - k0
            forced = forced | (finite & (local >= 0) & (local < n_prefix))
        ranked = finite & (forced == 0)  # not ~forced: the interpreter's all-ones, as above
        key = tl.where(ranked, key, 0)
    return key, forced, tl.sum(ranked.to(tl.int32), axis=0)


@triton.jit
def _count_at_least(key, candidate):
    return tl.sum((key >= candidate).to(tl.int32), axis=0)


@triton.jit
def _low_keys(key, high):
    """The low 15 bits of the keys whose bits above them equal `high`; 0x7FFF for the keys
    above those, 0 for the keys below."""
    above = key >> 15
    low = tl.where(above == high, key & 0x7FFF, 0)
    return tl.where(above > high, 0x7FFF, low).to(tl.uint32)


@triton.jit
def _packed_count_at_least(words, candidate):
    """How many of the 15-bit keys packed two to a word (each under a set guard bit) are >=
    candidate (1 <= candidate <= 0x7FFF): the guard bit of (key | 0x8000) - candidate stays set
    exactly when key >= candidate, and no lane borrows from the other. The low half of the
    sum counts the low lanes, the high half the high lanes (below 2^16 words, each fits)."""
    s = tl.sum(((words - (candidate | (candidate << 16))) >> 15) & 0x10001, axis=0)
    return ((s & 0xFFFF) + (s >> 16)).to(tl.int32)


@triton.jit
def _take(key, threshold, need, ties_before):
    """(the columns of this tile taken: keys above the threshold and, in index order, the ties
    while fewer than `need` ties are taken before them; the ties counted so far)."""
    ties = (key == threshold).to(tl.int32)
    order = tl.cumsum(ties, axis=0) + ties_before
    return (key > threshold) | ((ties > 0) & (order <= need)), ties_before + tl.sum(ties, axis=0)


@triton.jit
def _emit(SEL_IDX, SEL_MASK, n_kv, cols, chosen, taken_before):
    """Writes this tile's part of the row's index list and mask; returns the entries so far."""
    chosen = chosen.to(tl.int32)
    slot = tl.cumsum(chosen, axis=0) - 1 + taken_before
    tl.store(SEL_IDX + slot, cols, mask=chosen > 0)
    tl.store(SEL_MASK + cols, chosen.to(tl.int8), mask=cols < n_kv)
    return taken_before + tl.sum(chosen, axis=0)


@triton.jit
def _row_prefix(row, Q_SEQ, CU_Q, CU_K, SEQ_PREFIX, n_q, n_kv, topk, n_prefix, n_seqs,
                PREFIX_MODE: tl.constexpr, VARLEN: tl.constexpr, PER_SEQ_PREFIX: tl.constexpr,
                BLOCK_ELEMS: tl.constexpr):
    """(how many columns the row ranks in, P, the first KV block of its sequence, whether it is a
    prefix row) of score row `row` by the prefix rule of `topk_select_kernel`: topk, plus P in
    "compete"; P from the offsets of the query's own sequence when VARLEN, clamped."""
    k0 = 0
    prefix_row = False
    if PREFIX_MODE != 0:
        q_block = (row % n_q).to(tl.int32)
        q0 = 0
        if VARLEN:
            seq = tl.minimum(tl.maximum(tl.load(Q_SEQ + q_block), 0), n_seqs - 1)
            q0 = tl.load(CU_Q + seq) // BLOCK_ELEMS
            k0 = tl.load(CU_K + seq) // BLOCK_ELEMS
            if PER_SEQ_PREFIX:
                n_prefix = tl.load(SEQ_PREFIX + seq)
        n_prefix = tl.minimum(tl.maximum(n_prefix, 0), tl.maximum(n_q, n_kv))
        prefix_row = q_block - q0 < n_prefix
        if PREFIX_MODE == 2:
            topk = topk + n_prefix
    return topk, n_prefix, k0, prefix_row


@triton.jit
def topk_select_kernel(
    SCORES, SEL_IDX, SEL_NUM, SEL_MASK, Q_SEQ, CU_Q, CU_K, SEQ_PREFIX,
    n_q, n_kv, topk, idx_capacity, n_prefix, n_seqs,
    HALF: tl.constexpr, TAIL_HALF: tl.constexpr, PREFIX_MODE: tl.constexpr = 0, VARLEN: tl.constexpr = False,
    PER_SEQ_PREFIX: tl.constexpr = False, BLOCK_ELEMS: tl.constexpr = 64, KEY_SHIFT: tl.constexpr = 0,
):
    """Per score row: the `topk` highest finite scores (ties to the lower index).

    Writes the ascending index list, its length and the row of the 0/1 block mask.
    Empty KV blocks carry a -inf score and are never taken; k = min(topk, finite scores).

    One threshold pass instead of k rounds of max + argmin: each score is mapped to an
    unsigned key with the order of the floats (`_order_keys`), the k-th largest key T is
    found bit by bit from the top (one counting pass per bit: keep a bit if at least k keys
    are >= the threshold with it set), and the row takes every key > T plus the
    lowest-index keys == T until it has k: the same set as k rounds of "largest score,
    lowest index first". Scores rounded to a narrower dtype (the coarse forward ranks bf16-
    or fp16-rounded values) have their low KEY_SHIFT fp32 bits zero, so their keys differ in
    the high bits only: the keys are shifted right by KEY_SHIFT (an order-preserving,
    one-to-one map on such values) and only 32 - KEY_SHIFT passes run.

    The passes are reductions over the row, so their cost is the row's width: the row is
    read as a power-of-two main tile (columns [0, 2 HALF)) and a tail tile (the next
    2 TAIL_HALF columns), not padded to one power of two (624 KV blocks: 512 + 128 columns,
    not 1024). Once the bits above the low 15 are settled, the last 15 passes count 15-bit
    keys packed two to a 32-bit word (`_packed_count_at_least`): half the work per pass.
    The keys are 32-bit (64-bit integer compares and adds take two instructions each on a
    GPU), and a row is best reduced by few warps: each counting pass is a reduction.

    Prefix blocks (PREFIX_MODE 1 "exempt", 2 "compete"; `vsa_core.reference.prefix_topk_mask`):
    the first P blocks of the sequence (n_prefix; packed sequences: of each query's own
    sequence, from its offsets, P per sequence from SEQ_PREFIX with PER_SEQ_PREFIX) on both
    sides. Some finite columns are then forced in (a prefix row: all of them; "exempt": the
    prefix columns) and the threshold pass ranks the others only (their keys; the rest get
    key 0, below every score), taking topk ("exempt") or topk + P ("compete") of them.
    P is clamped to [0, max(nQ, nKV)] (no overflow; a larger P selects the same).
    """
    row = tl.program_id(0).to(tl.int64)
    SCORES += row * n_kv
    # the row's columns in four tiles, in index order: the main tile's halves, the tail's halves
    c0 = tl.arange(0, HALF)
    c1 = c0 + HALF
    c2 = tl.arange(0, TAIL_HALF) + 2 * HALF
    c3 = c2 + TAIL_HALF
    s0, key0 = _order_keys(SCORES, c0, n_kv, KEY_SHIFT)
    s1, key1 = _order_keys(SCORES, c1, n_kv, KEY_SHIFT)
    s2, key2 = _order_keys(SCORES, c2, n_kv, KEY_SHIFT)
    s3, key3 = _order_keys(SCORES, c3, n_kv, KEY_SHIFT)
    topk, n_prefix, k0, prefix_row = _row_prefix(row, Q_SEQ, CU_Q, CU_K, SEQ_PREFIX, n_q, n_kv, topk, n_prefix,
                                                 n_seqs, PREFIX_MODE, VARLEN, PER_SEQ_PREFIX, BLOCK_ELEMS)
    key0, forced0, n0 = _ranked_keys(s0, key0, c0, k0, n_prefix, prefix_row, PREFIX_MODE)
    key1, forced1, n1 = _ranked_keys(s1, key1, c1, k0, n_prefix, prefix_row, PREFIX_MODE)
    key2, forced2, n2 = _ranked_keys(s2, key2, c2, k0, n_prefix, prefix_row, PREFIX_MODE)
    key3, forced3, n3 = _ranked_keys(s3, key3, c3, k0, n_prefix, prefix_row, PREFIX_MODE)
    k_eff = tl.minimum(topk, n0 + n1 + n2 + n3)

    # the bits above the low 15, one pass each over the keys as they are
    threshold = tl.full([], 0, tl.uint32)  # the smallest key; raised one bit at a time
    step = tl.full([], 0x80000000 >> KEY_SHIFT, tl.uint32)
    for _ in range(0, 32 - KEY_SHIFT - 15):
        candidate = threshold | step
        at_least = (_count_at_least(key0, candidate) + _count_at_least(key1, candidate)
                    + _count_at_least(key2, candidate) + _count_at_least(key3, candidate))
        threshold = tl.where(at_least >= k_eff, candidate, threshold)
        step = step >> 1
    # the low 15 bits over packed keys: above the settled high bits counts as 0x7FFF, below as 0
    high = threshold >> 15
    guards = tl.full([], 0x80008000, tl.uint32)
    main = (_low_keys(key1, high) << 16) | _low_keys(key0, high) | guards
    tail = (_low_keys(key3, high) << 16) | _low_keys(key2, high) | guards
    low = tl.full([], 0, tl.uint32)
    step = tl.full([], 0x4000, tl.uint32)
    for _ in range(0, 15):
        candidate = low | step
        at_least = _packed_count_at_least(main, candidate) + _packed_count_at_least(tail, candidate)
        low = tl.where(at_least >= k_eff, candidate, low)
        step = step >> 1
    threshold = (high << 15) | low

    need = k_eff - tl.sum((key0 > threshold).to(tl.int32), axis=0) - tl.sum((key1 > threshold).to(tl.int32), axis=0) \
        - tl.sum((key2 > threshold).to(tl.int32), axis=0) - tl.sum((key3 > threshold).to(tl.int32), axis=0)
    chosen0, ties = _take(key0, threshold, need, 0)
    chosen1, ties = _take(key1, threshold, need, ties)
    chosen2, ties = _take(key2, threshold, need, ties)
    chosen3, ties = _take(key3, threshold, need, ties)
    SEL_IDX += row * idx_capacity
    SEL_MASK += row * n_kv
    count = _emit(SEL_IDX, SEL_MASK, n_kv, c0, chosen0 | forced0, 0)
    count = _emit(SEL_IDX, SEL_MASK, n_kv, c1, chosen1 | forced1, count)
    count = _emit(SEL_IDX, SEL_MASK, n_kv, c2, chosen2 | forced2, count)
    count = _emit(SEL_IDX, SEL_MASK, n_kv, c3, chosen3 | forced3, count)
    tl.store(SEL_NUM + row, count)


# ---- the same selection on packed 16-bit keys ------------------------------------------------
# `topk_select_packed_kernel` selects what `topk_select_kernel` selects with fewer instructions per
# row (that kernel is bound by its instruction stream, one warp per row): the keys are 16 bits,
# built and searched two to a word, the count above the threshold comes out of the search, and
# a tile's list slots come from one prefix sum over groups of 4 columns.
@triton.jit
def _key_words(lo, hi, KEYS: tl.constexpr):
    """The keys of two [n] tensors of scores, packed: lo's in the low 16 bits, hi's in the high.

    A key has the order of the scores, for scores that are values of KEYS ("bfloat16",
    "float16"): the dtype's bit pattern, sign s and 15-bit magnitude m, becomes 0x8000 + m,
    or 0x8000 - m when s is set. -0.0 and +0.0 both get 0x8000 (they compare equal); every
    key is in [1, 0xFFFF] (NaN too), so the lanes never borrow from each other; -inf gets
    0x8000 - m(inf), below every finite score's key. Computed on both lanes at once."""
    if KEYS == "bfloat16":  # a bf16 value's low 16 fp32 bits are 0
        words = (lo.to(tl.uint32, bitcast=True) >> 16) | (hi.to(tl.uint32, bitcast=True) & 0xFFFF0000)
    else:  # exact for a float16 value
        words = (lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
                 | (hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16))
    negative = ((words >> 15) & 0x10001) * 0xFFFF  # 0xFFFF in the lanes whose sign is set
    m = words & 0x7FFF7FFF
    return 0x80008000 + m - 2 * (m & negative)


@triton.jit
def _key32(scores):
    """The key of `_key_words` on the fp32 bit pattern (any fp32 scores): 2^31 + m, or 2^31 - m
    when negative."""
    bits = scores.to(tl.uint32, bitcast=True)
    m = bits & 0x7FFFFFFF
    half = tl.full([], 0x80000000, tl.uint32)
    return tl.where(bits >= half, half - m, half + m)


@triton.jit
def _column_quads(SCORES, first, n_kv, k0, n_prefix, prefix_row, QUADS: tl.constexpr, PREFIX_MODE: tl.constexpr):
    """The scores of columns first + 4q + i (q < QUADS; -inf past n_kv), then whether each is
    forced in (a prefix row: every finite one; "exempt": the finite prefix columns): eight
    [QUADS] tensors, i = 0..3 of each (flat: older Triton cannot unpack nested tuples). Read as [QUADS, 4] (16-byte loads) and split: each thread
    then holds whole quads, one element per thread and repetition, as the list stores want
    them (no layout conversion), and a quad's columns share one element of the prefix sum
    (`_emit_quads`)."""
    cols = first + 4 * tl.arange(0, QUADS)[:, None] + tl.arange(0, 4)[None, :]
    scores = tl.load(SCORES + cols, mask=cols < n_kv, other=float("-inf"))
    forced = cols < 0
    if PREFIX_MODE != 0:
        forced = (scores > float("-inf")) & prefix_row
        if PREFIX_MODE == 1:
            local = cols - k0
            forced = forced | ((scores > float("-inf")) & (local >= 0) & (local < n_prefix))
    s_0, s_1, s_2, s_3 = _quads(scores)
    f_0, f_1, f_2, f_3 = _quads(forced)
    return s_0, s_1, s_2, s_3, f_0, f_1, f_2, f_3


@triton.jit
def _quads(x):
    """x [QUADS, 4] as four [QUADS] tensors (columns 4q + 0 .. 4q + 3)."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # columns 4q + 2j and 4q + 2j + 1
    x_0, x_2 = tl.split(even)
    x_1, x_3 = tl.split(odd)
    return x_0, x_1, x_2, x_3


@triton.jit
def _lanes(s):
    """The number of lane flags in a sum of words that each hold two 0/1 flags (bits 0, 16)."""
    return ((s & 0xFFFF) + (s >> 16)).to(tl.int32)


@triton.jit
def _relative_low(words, high):
    """Packed 16-bit keys as 15-bit keys relative to the settled top bit `high`: the low 15
    bits where the key's top bit is `high`, 0x7FFF where it is above, 0 where below; each
    under a guard bit (bits 15 and 31) for `_kth_largest16`'s counting."""
    top = ((words >> 15) & 0x10001) * 0x7FFF  # 0x7FFF in the lanes whose top bit is set
    low = words & 0x7FFF7FFF
    return tl.where(high, low & top, low | top) | 0x80008000


@triton.jit
def _flags(words):
    """Bits 15 and 31 of each word moved to bits 0 and 16: g = bit15 * 2^15 + bit31 * 2^31 times
    2^17 + 1 is the flags * 2^32 plus g (< 2^32, no carry), so the high half of the product is
    the flags. The multiply-high runs on the FMA pipe, where a shift and a mask are two ALU
    operations (the ALU pipe is the busy one here); the + 1 keeps the compiler from turning
    it back into the shift."""
    return tl.umulhi(words & 0x80008000, 0x20001)


@triton.jit
def _count_top(a, b):
    """Lane flags of the keys packed in words a, b (same shape) with their top bit set, summed."""
    return tl.sum(_flags(a) + _flags(b), axis=0)


@triton.jit
def _count_at_least16(a, b, both):
    """Lane flags of the guarded 15-bit keys in words a, b that are >= the candidate (`both`:
    it in each lane), summed: the guard of (0x8000 | key) - candidate stays set exactly when
    key >= candidate, and no lane borrows from the other."""
    return tl.sum(_flags(a - both) + _flags(b - both), axis=0)


@triton.jit
def _kth_largest16(main_a, main_b, tail_a, tail_b, k):
    """(T, above): the k-th largest of the 16-bit keys packed two to a word in the four word
    tensors, and how many keys are above T (T = 0 when there are fewer than k keys).

    Bit by bit from the top (one counting pass per bit: a bit is kept when at least k keys
    are >= the threshold with it set). The top bit is counted from the keys as they are,
    the other 15 on keys relative to it (`_relative_low`). Each rejected candidate counts
    the keys above the threshold so far, and the last one is T + 1: `above` needs no pass of
    its own."""
    at_least = _lanes(_count_top(main_a, main_b) + _count_top(tail_a, tail_b))
    high = at_least >= k
    above = tl.where(high, 0, at_least)
    main_a = _relative_low(main_a, high)
    main_b = _relative_low(main_b, high)
    tail_a = _relative_low(tail_a, high)
    tail_b = _relative_low(tail_b, high)
    low = tl.full([], 0, tl.uint32)
    step = tl.full([], 0x4000, tl.uint32)
    for _ in range(0, 15):
        candidate = low | step
        both = candidate | (candidate << 16)
        at_least = _lanes(_count_at_least16(main_a, main_b, both) + _count_at_least16(tail_a, tail_b, both))
        keep = at_least >= k
        low = tl.where(keep, candidate, low)
        above = tl.where(keep, above, at_least)
        step = step >> 1
    return tl.where(high, 0x8000, 0).to(tl.uint32) | low, above


@triton.jit
def _pack(lo, hi):
    return lo | (hi << 16)


@triton.jit
def _bucket_low(key, t_high):
    """The low 16 bits of the 32-bit keys whose high 16 bits are t_high, 0 for the others."""
    return tl.where((key >> 16) == t_high, key & 0xFFFF, 0)


@triton.jit
def _counts_word(key, floor, tie_key, PREFIX_MODE: tl.constexpr, FIELD: tl.constexpr):
    """1 << FIELD if the column is always taken (above `floor`; forced: key 1), else 1 if it
    is a tie (== tie_key), else 0: the prefix sum of these words counts both at once."""
    always = key > floor
    if PREFIX_MODE != 0:
        always = always | (key == 1)
    dtype: tl.constexpr = tl.int32 if FIELD == 16 else tl.int64
    return tl.where(always, tl.full([], 1, dtype) << FIELD, (key == tie_key).to(dtype))


@triton.jit
def _taken_through(counts, need, FIELD: tl.constexpr):
    """The columns taken up to a column, from the count word through it: the always-taken ones
    and the first `need` ties."""
    return ((counts >> FIELD) + tl.minimum(counts & ((1 << FIELD) - 1), need)).to(tl.int32)


@triton.jit
def _emit_quads(SEL_IDX, SEL_MASK, n_kv, first, k_0, k_1, k_2, k_3, floor, tie_key, need, before,
                QUADS: tl.constexpr, PREFIX_MODE: tl.constexpr, FIELD: tl.constexpr):
    """Writes the list entries and mask bytes of columns [first, first + 4 QUADS) (keys as
    `_quads` splits them) and returns `before` plus this tile's count word.

    Taken: the keys above `floor` (the threshold, or the -inf key when fewer finite keys than
    k are ranked), the forced columns (key 1), and in index order the first `need` keys equal
    to `tie_key` (the threshold when it is a finite key, else 0, which no key is). One prefix
    sum over the quads counts both (`_counts_word`; FIELD 16 and int32 while a row has fewer
    than 2^16 columns, else int64); a column is taken when the taken count through it is
    above the count through the column before it, and that count is its list slot + 1."""
    v_0 = _counts_word(k_0, floor, tie_key, PREFIX_MODE, FIELD)
    v_1 = _counts_word(k_1, floor, tie_key, PREFIX_MODE, FIELD)
    v_2 = _counts_word(k_2, floor, tie_key, PREFIX_MODE, FIELD)
    v_3 = _counts_word(k_3, floor, tie_key, PREFIX_MODE, FIELD)
    through_3 = tl.cumsum(v_0 + v_1 + v_2 + v_3, axis=0) + before
    through_2 = through_3 - v_3
    through_1 = through_2 - v_2
    through_0 = through_1 - v_1
    n_before = _taken_through(through_0 - v_0, need, FIELD)
    n_0 = _taken_through(through_0, need, FIELD)
    n_1 = _taken_through(through_1, need, FIELD)
    n_2 = _taken_through(through_2, need, FIELD)
    n_3 = _taken_through(through_3, need, FIELD)
    col = first + 4 * tl.arange(0, QUADS)
    SEL_IDX -= 1  # slot = taken through the column - 1
    tl.store(SEL_IDX + n_0, col, mask=n_0 > n_before)
    tl.store(SEL_IDX + n_1, col + 1, mask=n_1 > n_0)
    tl.store(SEL_IDX + n_2, col + 2, mask=n_2 > n_1)
    tl.store(SEL_IDX + n_3, col + 3, mask=n_3 > n_2)
    taken = tl.join(tl.join(n_0 - n_before, n_2 - n_1), tl.join(n_1 - n_0, n_3 - n_2))  # [QUADS, 2, 2]: 4q + 2j + i
    cols = col[:, None] + tl.arange(0, 4)[None, :]
    tl.store(SEL_MASK + cols, tl.reshape(taken, (QUADS, 4)).to(tl.int8), mask=cols < n_kv)
    return before + tl.sum(v_0 + v_1 + v_2 + v_3, axis=0)


@triton.jit
def topk_select_packed_kernel(
    SCORES, SEL_IDX, SEL_NUM, SEL_MASK, Q_SEQ, CU_Q, CU_K, SEQ_PREFIX,
    n_q, n_kv, topk, idx_capacity, n_prefix, n_seqs,
    HALF: tl.constexpr, TAIL_HALF: tl.constexpr, PREFIX_MODE: tl.constexpr = 0, VARLEN: tl.constexpr = False,
    PER_SEQ_PREFIX: tl.constexpr = False, BLOCK_ELEMS: tl.constexpr = 64, KEYS: tl.constexpr = "float32",
):
    """`topk_select_kernel`'s selection (the same lists, counts and mask rows, every mode) with
    fewer instructions per row; its arguments, KEYS naming the dtype every score is a value of
    ("bfloat16", "float16"; "float32": any fp32 scores) instead of KEY_SHIFT.

    - Keys are 16 bits (`_key_words`: the score's bf16 / fp16 bit pattern, order-mapped), built
      and searched two to a 32-bit word; fp32 scores search their keys' high 16 bits, then the
      low 16 bits of the keys in the high bits' bucket (2 x 16 passes).
    - Every column is searched, the unranked ones (-inf, forced) with keys below every ranked
      one (forced: key 1): no count of the ranked columns is needed first, and fewer than k
      ranked ones give a threshold below them (all taken, no ties).
    - The count above the threshold comes from the search itself (`_kth_largest16`).
    - Columns are grouped in quads (4q .. 4q + 3) held by one thread, so that a tile's list
      slots come from one prefix sum over quads (`_emit_quads`).
    Rows are read as the main tile (2 HALF columns) and the tail tile (2 TAIL_HALF) of
    `stages.topk_tiles`."""
    row = tl.program_id(0).to(tl.int64)
    SCORES += row * n_kv
    k, n_prefix, k0, prefix_row = _row_prefix(row, Q_SEQ, CU_Q, CU_K, SEQ_PREFIX, n_q, n_kv, topk, n_prefix, n_seqs,
                                              PREFIX_MODE, VARLEN, PER_SEQ_PREFIX, BLOCK_ELEMS)
    MAIN: tl.constexpr = HALF // 2  # quads
    TAIL: tl.constexpr = TAIL_HALF // 2
    m_0, m_1, m_2, m_3, m_f0, m_f1, m_f2, m_f3 = _column_quads(SCORES, 0, n_kv, k0, n_prefix, prefix_row,
                                                                 MAIN, PREFIX_MODE)
    t_0, t_1, t_2, t_3, t_f0, t_f1, t_f2, t_f3 = _column_quads(SCORES, 2 * HALF, n_kv, k0, n_prefix,
                                                                 prefix_row, TAIL, PREFIX_MODE)
    FIELD: tl.constexpr = 16 if 2 * (HALF + TAIL_HALF) < 65536 else 32
    SEL_IDX += row * idx_capacity
    SEL_MASK += row * n_kv
    if KEYS == "float32":
        m_0, m_1, m_2, m_3 = _key32(m_0), _key32(m_1), _key32(m_2), _key32(m_3)
        t_0, t_1, t_2, t_3 = _key32(t_0), _key32(t_1), _key32(t_2), _key32(t_3)
        if PREFIX_MODE != 0:
            m_0, m_1, m_2, m_3 = tl.where(m_f0, 1, m_0), tl.where(m_f1, 1, m_1), tl.where(m_f2, 1, m_2), \
                tl.where(m_f3, 1, m_3)
            t_0, t_1, t_2, t_3 = tl.where(t_f0, 1, t_0), tl.where(t_f1, 1, t_1), tl.where(t_f2, 1, t_2), \
                tl.where(t_f3, 1, t_3)
        t_high, above = _kth_largest16(_pack(m_0 >> 16, m_1 >> 16), _pack(m_2 >> 16, m_3 >> 16),
                                       _pack(t_0 >> 16, t_1 >> 16), _pack(t_2 >> 16, t_3 >> 16), k)
        t_low, above_low = _kth_largest16(
            _pack(_bucket_low(m_0, t_high), _bucket_low(m_1, t_high)),
            _pack(_bucket_low(m_2, t_high), _bucket_low(m_3, t_high)),
            _pack(_bucket_low(t_0, t_high), _bucket_low(t_1, t_high)),
            _pack(_bucket_low(t_2, t_high), _bucket_low(t_3, t_high)), k - above)
        threshold = (t_high << 16) | t_low
        need = k - above - above_low
        neg_inf_key = _key32(tl.full([], float("-inf"), tl.float32))
        floor = tl.maximum(threshold, neg_inf_key)
        tie_key = tl.where(threshold > neg_inf_key, threshold, 0)
        counts = _emit_quads(SEL_IDX, SEL_MASK, n_kv, 0, m_0, m_1, m_2, m_3, floor, tie_key, need, 0, MAIN,
                             PREFIX_MODE, FIELD)
        counts = _emit_quads(SEL_IDX, SEL_MASK, n_kv, 2 * HALF, t_0, t_1, t_2, t_3, floor, tie_key, need, counts,
                             TAIL, PREFIX_MODE, FIELD)
    else:
        m_a, m_b = _key_words(m_0, m_1, KEYS), _key_words(m_2, m_3, KEYS)
        t_a, t_b = _key_words(t_0, t_1, KEYS), _key_words(t_2, t_3, KEYS)
        if PREFIX_MODE != 0:
            m_a, m_b = _force(m_a, m_f0, m_f1), _force(m_b, m_f2, m_f3)
            t_a, t_b = _force(t_a, t_f0, t_f1), _force(t_b, t_f2, t_f3)
        threshold, above = _kth_largest16(m_a, m_b, t_a, t_b, k)
        need = k - above
        neg_inf = tl.full([], float("-inf"), tl.float32)
        neg_inf_key = _key_words(neg_inf, neg_inf, KEYS) & 0xFFFF
        floor = tl.maximum(threshold, neg_inf_key)
        tie_key = tl.where(threshold > neg_inf_key, threshold, 0)
        counts = _emit_quads(SEL_IDX, SEL_MASK, n_kv, 0, m_a & 0xFFFF, m_a >> 16, m_b & 0xFFFF, m_b >> 16, floor,
                             tie_key, need, 0, MAIN, PREFIX_MODE, FIELD)
        counts = _emit_quads(SEL_IDX, SEL_MASK, n_kv, 2 * HALF, t_a & 0xFFFF, t_a >> 16, t_b & 0xFFFF, t_b >> 16,
                             floor, tie_key, need, counts, TAIL, PREFIX_MODE, FIELD)
    tl.store(SEL_NUM + row, _taken_through(counts, need, FIELD))


@triton.jit
def _force(words, lo, hi):
    """Key 1 in the lanes of the forced columns (lo: the low lanes', hi: the high lanes')."""
    words = tl.where(lo, (words & 0xFFFF0000) | 1, words)
    return tl.where(hi, (words & 0xFFFF) | 0x10000, words)


@triton.jit
def compact_mask_kernel(
    MASK, IDX, NUM, LINE_SEQ, ELEM_SEQ,
    n_lines, line_len, mask_bh_stride, mask_line_stride, mask_elem_stride, idx_capacity,
    N_PAD: tl.constexpr, SAME_SEQ: tl.constexpr = False,
):
    """Turns each line of a 0/1 mask into an ascending index list and its length.

    Lines are chosen by the strides; `rows_to_lists` runs it on rows (block map ->
    query-owned lists), contiguous in memory. Columns (-> KV-owned lists) have their own
    kernel, `columns_to_lists_kernel`. SAME_SEQ (packed sequences) drops the elements
    whose sequence id (ELEM_SEQ) differs from the line's (LINE_SEQ).
    """
    line = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pos = tl.arange(0, N_PAD)
    ok = pos < line_len
    bits = tl.load(MASK + bh * mask_bh_stride + line * mask_line_stride + pos * mask_elem_stride,
                   mask=ok, other=0)
    taken = bits != 0
    if SAME_SEQ:
        taken = taken & (tl.load(ELEM_SEQ + pos, mask=ok, other=-1) == tl.load(LINE_SEQ + line))
    taken = taken.to(tl.int32)
    slot = tl.cumsum(taken, axis=0) - 1
    out_row = bh * n_lines + line
    tl.store(IDX + out_row * idx_capacity + slot, pos, mask=taken > 0)
    tl.store(NUM + out_row, tl.sum(taken, axis=0))


@triton.jit
def columns_to_lists_kernel(
    MASK, IDX, NUM, n_q, n_kv, idx_capacity,
    COLS: tl.constexpr, ROWS: tl.constexpr,
):
    """compact_mask_kernel's lists of the mask's columns (KV-owned lists: IDX[bh, column]
    the query blocks that take the column, ascending, NUM[bh, column] their number; slots
    past the count are not written), COLS adjacent columns per program.

    One column alone is nQ single bytes nKV apart, a load each, latency-bound; a row of
    the tile is COLS adjacent bytes, one coalesced load. The query axis is walked ROWS
    rows at a time with each column's count so far carried along, so the registers a
    program holds do not grow with nQ.
    """
    col = tl.program_id(0) * COLS + tl.arange(0, COLS)
    bh = tl.program_id(1).to(tl.int64)
    col_ok = col < n_kv
    MASK += bh * n_q * n_kv
    lists = IDX + (bh * n_kv + col) * idx_capacity
    count = tl.zeros([COLS], tl.int32)
    for start in range(0, n_q, ROWS):
        rows = start + tl.arange(0, ROWS)
        bits = tl.load(MASK + rows[:, None].to(tl.int64) * n_kv + col[None, :],  # nQ * nKV may pass 2^31
                       mask=(rows < n_q)[:, None] & col_ok[None, :], other=0)
        taken = (bits != 0).to(tl.int32)
        slot = count[None, :] + tl.cumsum(taken, axis=0) - 1
        tl.store(lists[None, :] + slot, tl.broadcast_to(rows[:, None], (ROWS, COLS)), mask=taken > 0)
        count += tl.sum(taken, axis=0)
    tl.store(NUM + bh * n_kv + col, count, mask=col_ok)


@triton.jit
def block_seq_ids_kernel(
    CU_SEQLENS, SEQ, n_blocks, n_seqs,
    BLOCK_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
):
    """SEQ[i] = the sequence that block i of a packed stream belongs to: the number of
    sequence ends CU_SEQLENS[1..n_seqs] at or before the block's first token (token
    offsets, multiples of BLOCK_ELEMS). Read on the device: no host sync."""
    blocks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = blocks.to(tl.int64) * BLOCK_ELEMS
    seq = tl.zeros([BLOCK], tl.int32)
    for j in range(1, n_seqs + 1):
        seq += (tl.load(CU_SEQLENS + j).to(tl.int64) <= start).to(tl.int32)
    tl.store(SEQ + blocks, seq, mask=blocks < n_blocks)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _counted_entries(j, valid, i, SLOTS: tl.constexpr):
    """The rule of the module doc over a whole row at once: entry i (valid: listed and a
    KV block) counts iff it is greater than every valid entry before it (an entry not
    counted is at most the last counted one, so the running maximum of valid entries is
    the last counted entry). Keys j * SLOTS + (SLOTS-1-i) are distinct per entry and order
    equal entries first-one-largest, so that is "the key equals the running maximum of
    keys". `i` may repeat (several slots of one entry): they share the entry's verdict."""
    key = tl.where(valid, j.to(tl.int64), -1) * SLOTS + (SLOTS - 1 - i)
    return valid & (key == tl.associative_scan(key, 0, _max_combine))


@triton.jit
def clean_lists_kernel(
    IN_IDX, IN_NUM, Q_SEQ, KV_SEQ, OUT_IDX, OUT_NUM,
    n_q_blocks, n_kv_blocks, idx_capacity,
    SLOTS: tl.constexpr, SAME_SEQ: tl.constexpr,
):
    """Writes the caller's query-owned lists as the rule of the module doc reads them:
    the entries that count, ascending and without repeats, and their number. Consumers
    that do not apply the rule themselves (cuDNN's kernels read a list as given) then see
    only in-range entries and counts within the capacity.

    With SAME_SEQ (packed sequences) an entry also counts only if it names a KV block of
    the query block's own sequence; the others are dropped before the rule. Slots past
    the count are written 0 (a valid block, in case a consumer prefetches past the count)."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, SLOTS)
    listed = pos < tl.minimum(tl.maximum(tl.load(IN_NUM + row), 0), idx_capacity)
    j = tl.load(IN_IDX + row * idx_capacity + pos, mask=listed, other=-1)
    valid = listed & (j >= 0) & (j < n_kv_blocks)
    if SAME_SEQ:
        kv_seq = tl.load(KV_SEQ + j, mask=valid, other=-1)
        valid = valid & (kv_seq == tl.load(Q_SEQ + row % n_q_blocks))
    keep = _counted_entries(j, valid, pos, SLOTS)
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    count = tl.sum(keep.to(tl.int32), axis=0)
    tl.store(OUT_IDX + row * idx_capacity + slot, j, mask=keep)
    tl.store(OUT_IDX + row * idx_capacity + pos, tl.zeros([SLOTS], tl.int32), mask=(pos >= count) & (pos < idx_capacity))
    tl.store(OUT_NUM + row, count)


@triton.jit
def sparse_attn_bwd_preprocess_kernel(
    DOUT, OUT_FINE, GATE, OUT_C, DELTA, DGATE, DOUT_C, Q_COUNTS, OUT,
    stride_qb, stride_qh, stride_qs,
    H, q_len, n_q_blocks,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
    HAS_COARSE: tl.constexpr, HAS_GATE: tl.constexpr, IGNORE_PADDING: tl.constexpr = False,
    FINE_ROUNDING: tl.constexpr = False,
):
    """Per query block: delta = rowsum(dO * out_fine) for the fine backward and, with the
    coarse branch, dgate = dO * out_c and dout_c = sum over the block of dO * gate, over
    every row of the block. With the coarse branch (VSA) and IGNORE_PADDING, dO and the
    gate of the block's padded rows (past Q_COUNTS) read as 0: the output is 0 there
    whatever the inputs, so no gradient comes from those rows. FINE_ROUNDING (coarse branch):
    OUT_FINE holds out's rounding residual, and the fine output is formed in fp32 as
    out + residual - gate * out_c (`AttnProblem.fine_residual`)."""
    q_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    d = tl.arange(0, HEAD_DIM)
    n_valid = BLOCK_ELEMS
    if HAS_COARSE:
        coarse = tl.load(OUT_C + (bh * n_q_blocks + q_block) * HEAD_DIM + d)
        if IGNORE_PADDING:
            n_valid = _clamped_count(Q_COUNTS, q_block, BLOCK_ELEMS)
    dcoarse = tl.zeros([HEAD_DIM], tl.float32)
    for start in range(0, BLOCK_ELEMS, ROWS):
        in_block = start + tl.arange(0, ROWS)
        rows = (q_block * BLOCK_ELEMS + in_block).to(tl.int64)
        ptr = b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + d[None, :]
        valid = (in_block < n_valid)[:, None]
        do = tl.load(DOUT + ptr, mask=valid, other=0.0).to(tl.float32)
        out_fine = tl.load(OUT_FINE + ptr, mask=valid, other=0.0).to(tl.float32)
        if HAS_COARSE:
            gate = tl.zeros([ROWS, HEAD_DIM], tl.float32)
            if HAS_GATE:
                gate = tl.load(GATE + ptr, mask=valid, other=0.0).to(tl.float32)
            if FINE_ROUNDING:
                mixed = tl.load(OUT + ptr, mask=valid, other=0.0).to(tl.float32) + out_fine
                if HAS_GATE:
                    out_fine = mixed - gate * coarse[None, :]
                else:
                    out_fine = mixed - coarse[None, :]
        tl.store(DELTA + bh * q_len + rows, tl.sum(do * out_fine, axis=1))
        if HAS_COARSE:
            if HAS_GATE:
                tl.store(DGATE + ptr, (do * coarse[None, :]).to(DGATE.dtype.element_ty))
                dcoarse += tl.sum(do * gate, axis=0)
            else:
                dcoarse += tl.sum(do, axis=0)
    if HAS_COARSE:
        tl.store(DOUT_C + (bh * n_q_blocks + q_block) * HEAD_DIM + d, dcoarse)


@triton.jit
def lists_to_mask_kernel(
    IDX, NUM, MASK,
    n_kv, idx_capacity,
    N_PAD: tl.constexpr,
):
    """Scatters each query block's index list into its row of a 0/1 block mask, by the
    rule in the module doc (the dK/dV lists come from this mask)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N_PAD)
    bits = tl.zeros([N_PAD], tl.int32)
    last = tl.full([], -1, tl.int32)
    for i in range(0, _list_length(NUM, row, idx_capacity)):
        keep, block, last = _list_entry(IDX + row * idx_capacity, i, last, n_kv, 1)
        bits = tl.where(keep & (cols == block), 1, bits)
    tl.store(MASK + row * n_kv + cols, bits.to(tl.int8), mask=cols < n_kv)


@triton.jit
def _row_tile(H, stride_b, stride_h, stride_s, BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr,
              ROWS: tl.constexpr):
    """The ROWS token rows of this program (grid: row tiles of the sequence x B * H; ROWS
    divides BLOCK_ELEMS, so a tile lies in one block): (b * H + h, the rows (int64), their
    positions in their block, the block, the head-dim offsets, the [ROWS, HEAD_DIM] element
    offsets of a buffer of these strides)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    in_block = (pid * ROWS) % BLOCK_ELEMS + tl.arange(0, ROWS)
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    block = (pid * ROWS) // BLOCK_ELEMS
    ptr = (bh // H) * stride_b + (bh % H) * stride_h + rows[:, None] * stride_s + d[None, :]
    return bh, rows, in_block, block, d, ptr


@triton.jit
def mix_coarse_kernel(
    OUT, LSE, GATE, OUT_C, OUT_FINE, Q_COUNTS,
    stride_b, stride_h, stride_s,
    H, q_len, n_q_blocks,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
    HAS_GATE: tl.constexpr, STORE_FINE: tl.constexpr, IGNORE_PADDING: tl.constexpr = False,
):
    """OUT holds the fine output on entry; on exit out_fine + gate * out_c (or + out_c).
    STORE_FINE also keeps the fine output (in OUT_FINE's dtype: the values are OUT's, so q's
    dtype holds them exactly) for the backward's delta.
    Padded query rows (past Q_COUNTS) as in sparse_attn_fwd_kernel: like any row, or with
    IGNORE_PADDING out 0, out_fine 0 and LSE +inf, so that the library's backward gives
    them probability 0 (no gradient from them to K and V, none to them)."""
    bh, rows, in_block, q_block, d, ptr = _row_tile(H, stride_b, stride_h, stride_s, BLOCK_ELEMS, HEAD_DIM, ROWS)
    if IGNORE_PADDING:
        valid = in_block < _clamped_count(Q_COUNTS, q_block, BLOCK_ELEMS)
    else:  # every row of the block is computed
        valid = in_block < BLOCK_ELEMS
    fine = tl.where(valid[:, None], tl.load(OUT + ptr).to(tl.float32), 0.0)
    if STORE_FINE:
        tl.store(OUT_FINE + ptr, fine.to(OUT_FINE.dtype.element_ty))
    coarse = tl.load(OUT_C + (bh * n_q_blocks + q_block) * HEAD_DIM + d)
    if HAS_GATE:
        out = fine + tl.load(GATE + ptr, mask=valid[:, None], other=0.0).to(tl.float32) * coarse[None, :]
    else:
        out = fine + tl.where(valid[:, None], coarse[None, :], 0.0)
    tl.store(OUT + ptr, out.to(OUT.dtype.element_ty))
    if IGNORE_PADDING:
        at = LSE + bh * q_len + rows
        tl.store(at, tl.where(valid, tl.load(at), float("inf")))


@triton.jit
def add_block_grad_kernel(
    X, POOL, COUNTS,
    stride_b, stride_h, stride_s,
    H, n_blocks,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, IGNORE_PADDING: tl.constexpr = False,
):
    """X[token] += POOL[its block] / COUNTS[block] for every token of the block (the mean
    summed them all), in place: the mean pooling's gradient. With IGNORE_PADDING the
    padded rows (past COUNTS) are written exactly 0 instead, whatever the library left
    there: they are inputs of nothing."""
    bh, _, in_block, block, d, ptr = _row_tile(H, stride_b, stride_h, stride_s, BLOCK_ELEMS, HEAD_DIM, ROWS)
    n_valid = _clamped_count(COUNTS, block, BLOCK_ELEMS)
    count = n_valid.to(tl.float32)
    g = tl.load(POOL + (bh * n_blocks + block) * HEAD_DIM + d)
    g = tl.where(count > 0, g / tl.maximum(count, 1.0), 0.0)
    x = tl.load(X + ptr).to(tl.float32) + g[None, :]
    if IGNORE_PADDING:
        x = tl.where((in_block < n_valid)[:, None], x, 0.0)
    tl.store(X + ptr, x.to(X.dtype.element_ty))


@triton.jit
def valid_rows_copy_kernel(
    X, Y, COUNTS,
    stride_b, stride_h, stride_s,
    H,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):
    """Y = X with the padded rows of each block (past COUNTS) written 0 (selected, so NaN
    and inf there do not pass): what a library kernel that multiplies padded rows by zero
    weights reads under padding="ignore"."""
    _, _, in_block, block, _, ptr = _row_tile(H, stride_b, stride_h, stride_s, BLOCK_ELEMS, HEAD_DIM, ROWS)
    ok = in_block < _clamped_count(COUNTS, block, BLOCK_ELEMS)
    tl.store(Y + ptr, _rows_or_zero(tl.load(X + ptr), ok))


# ---- shared-KV lists (sm90_fwd64's shared_kv variants) -------------------------------------
@triton.jit
def _counted_chunk(SEL, NUM, row, present, start, capacity, n_kv_blocks, carry, CH: tl.constexpr):
    """Slots [start, start + CH) of list `row` as the rule of the module doc reads it: the
    counted entries, -1 elsewhere. The rule is applied chunk by chunk: `carry` is the largest
    valid entry of the slots before `start` (-1 at the row's start), returned updated. A row
    that is not `present` (a group member past the last query block) is an empty list."""
    slots = start + tl.arange(0, CH)
    n = tl.minimum(tl.maximum(tl.load(NUM + row, mask=present, other=0), 0), capacity)
    listed = slots < tl.where(present, n, 0)
    entry = tl.load(SEL + row * capacity + slots, mask=listed, other=-1)
    valid = listed & (entry >= 0) & (entry < n_kv_blocks)
    counted = _counted_entries(entry, valid, tl.arange(0, CH), CH) & (entry > carry)
    carry = tl.maximum(carry, tl.max(tl.where(valid, entry, -1), axis=0))
    return tl.where(counted, entry, -1), carry


@triton.jit
def _in_list(a, SEL, NUM, row, present, capacity, n_kv_blocks, CH: tl.constexpr):
    """For each value of a (-1: none), whether list `row` counts it."""
    found = tl.zeros(a.shape, tl.int1)
    carry = tl.full([], -1, tl.int32)
    for start in range(0, capacity, CH):
        f, carry = _counted_chunk(SEL, NUM, row, present, start, capacity, n_kv_blocks, carry, CH)
        found = found | (tl.sum(((a[:, None] == f[None, :]) & (f[None, :] >= 0)).to(tl.int32), axis=1) > 0)
    return found


@triton.jit
def shared_kv_lists_kernel(
    SEL, NUM, UNION_IDX, UNION_NUM, OWN_POS, OWN_NUM,
    n_q_blocks, n_kv_blocks, capacity, n_groups,
    GROUP: tl.constexpr, CH: tl.constexpr,
):
    """For the group of GROUP neighbouring query blocks g * GROUP + c (one (batch, head)), the
    ascending union of their lists as the rule reads them (UNION_IDX [B, H, n_groups,
    GROUP * capacity], UNION_NUM [B, H, n_groups]) and, per query block, the positions in that
    union of its own counted entries (OWN_POS [B, H, nQ, capacity], OWN_NUM [B, H, nQ]; slots
    past the count are not written). Members past the last query block have empty lists.

    A value's union position is the number of distinct values below it: over the group's
    lists, the entries below it that no earlier list (lower c) counts (each distinct value is
    counted once, by the first list that holds it). Chunked (CH slots) so that any capacity
    runs; at capacity <= CH every list is one chunk and a program does GROUP^2 (GROUP + 1)
    CH x CH compares (about 0.1 M at GROUP 3, CH 64)."""
    g = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    union_base = (bh * n_groups + g) * (GROUP * capacity)
    union_count = tl.zeros([], tl.int32)
    for c in tl.static_range(GROUP):
        qb = g * GROUP + c
        present = qb < n_q_blocks
        row = bh * n_q_blocks + qb
        carry = tl.full([], -1, tl.int32)
        n_own = tl.zeros([], tl.int32)
        for start in range(0, capacity, CH):
            a, carry = _counted_chunk(SEL, NUM, row, present, start, capacity, n_kv_blocks, carry, CH)
            mine = a >= 0
            first = mine  # counted by no earlier list of the group: this slot puts the value in the union
            for e in tl.static_range(c):
                first = first & ~_in_list(a, SEL, NUM, bh * n_q_blocks + g * GROUP + e,
                                          g * GROUP + e < n_q_blocks, capacity, n_kv_blocks, CH)
            pos = tl.zeros([CH], tl.int32)
            for o in tl.static_range(GROUP):
                o_row = bh * n_q_blocks + g * GROUP + o
                o_present = g * GROUP + o < n_q_blocks
                o_carry = tl.full([], -1, tl.int32)
                for o_start in range(0, capacity, CH):
                    f, o_carry = _counted_chunk(SEL, NUM, o_row, o_present, o_start, capacity, n_kv_blocks,
                                                o_carry, CH)
                    f_first = f >= 0
                    for e in tl.static_range(o):
                        f_first = f_first & ~_in_list(f, SEL, NUM, bh * n_q_blocks + g * GROUP + e,
                                                      g * GROUP + e < n_q_blocks, capacity, n_kv_blocks, CH)
                    pos += tl.sum(((f[None, :] < a[:, None]) & f_first[None, :]).to(tl.int32), axis=1)
            slot = n_own + tl.cumsum(mine.to(tl.int32), axis=0) - 1
            tl.store(OWN_POS + row * capacity + slot, pos, mask=mine)
            tl.store(UNION_IDX + union_base + pos, a, mask=first)
            n_own += tl.sum(mine.to(tl.int32), axis=0)
            union_count += tl.sum(first.to(tl.int32), axis=0)
        tl.store(OWN_NUM + row, n_own, mask=present)
    tl.store(UNION_NUM + bh * n_groups + g, union_count)


# ---- pair lists (sm90_fwd64's cluster_pairs variant) ----------------------------------------
@triton.jit
def pair_lists_kernel(
    SEL, NUM, PAIR_IDX, PAIR_NUM, SHARED_NUM,
    n_q_blocks, n_kv_blocks, capacity, n_pairs,
    CH: tl.constexpr,
):
    """For the pair of query blocks 2p, 2p + 1 (one (batch, head); a second block past the last
    query block has an empty list): each list as the rule reads it, reordered so that the blocks
    both lists count come first, ascending, at the same positions in both lists, and the list's
    other blocks after them, ascending (PAIR_IDX [B, H, nQ, capacity], -1 from the count on;
    PAIR_NUM [B, H, nQ] the counted entries; SHARED_NUM [B, H, n_pairs] the shared ones). A block
    both select is then loaded for the pair at one position, once (sm90_fwd64's cluster_pairs:
    one TMA multicast into both CTAs of a cluster)."""
    p = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = (bh * n_q_blocks + 2 * p, bh * n_q_blocks + 2 * p + 1)
    present = (2 * p < n_q_blocks, 2 * p + 1 < n_q_blocks)
    n_shared = tl.zeros([], tl.int32)
    carry = tl.full([], -1, tl.int32)
    for start in range(0, capacity, CH):
        a, carry = _counted_chunk(SEL, NUM, rows[0], present[0], start, capacity, n_kv_blocks, carry, CH)
        both = (a >= 0) & _in_list(a, SEL, NUM, rows[1], present[1], capacity, n_kv_blocks, CH)
        n_shared += tl.sum(both.to(tl.int32), axis=0)
    for m in tl.static_range(2):
        carry = tl.full([], -1, tl.int32)
        shared_before = tl.zeros([], tl.int32)
        own_before = tl.zeros([], tl.int32)
        for start in range(0, capacity, CH):
            a, carry = _counted_chunk(SEL, NUM, rows[m], present[m], start, capacity, n_kv_blocks, carry, CH)
            mine = a >= 0
            both = mine & _in_list(a, SEL, NUM, rows[1 - m], present[1 - m], capacity, n_kv_blocks, CH)
            own = mine & ~both
            slot = tl.where(both, shared_before + tl.cumsum(both.to(tl.int32), axis=0) - 1,
                            n_shared + own_before + tl.cumsum(own.to(tl.int32), axis=0) - 1)
            tl.store(PAIR_IDX + rows[m] * capacity + slot, a, mask=mine)
            shared_before += tl.sum(both.to(tl.int32), axis=0)
            own_before += tl.sum(own.to(tl.int32), axis=0)
        count = shared_before + own_before
        for start in range(0, capacity, CH):
            slots = start + tl.arange(0, CH)
            tl.store(PAIR_IDX + rows[m] * capacity + slots, slots * 0 - 1,
                     mask=(slots >= count) & (slots < tl.where(present[m], capacity, 0)))
        tl.store(PAIR_NUM + rows[m], count, mask=present[m])
    tl.store(SHARED_NUM + bh * n_pairs + p, n_shared)
