"""The Triton backend's fine-stage kernels: block-sparse attention forward, dQ and dK/dV.

Launched by `vsa_core.backends.triton_backend`; the layout, list and padding conventions
are those of `vsa_core.stage_kernels`, whose device functions they call.
"""

import triton
import triton.language as tl

from ..stage_kernels import (_clamped_count, _dot, _list_entry, _list_length, _load_rows, _rows_or_zero)


# --------------------------------------------------------------------------------------
# Block-sparse (fine) attention
# --------------------------------------------------------------------------------------
@triton.jit
def _long_tiles_first(first_blocks, TILES_PER_BLOCK: tl.constexpr):
    """(tile, bh) of this program in a (tiles, B * H) grid where the tiles of the first
    `first_blocks` blocks of every head run first: a mixed-modality prefix's dense query rows
    (and the prefix KV blocks every video row takes) each carry ~nKV / topk times a video
    tile's work, and one started last would run alone at the end of the grid."""
    n_tiles = tl.num_programs(0)
    lin = tl.program_id(1) * n_tiles + tl.program_id(0)
    n_first = first_blocks * TILES_PER_BLOCK
    n_long = tl.num_programs(1) * n_first
    if lin < n_long:
        tile = lin % n_first
        bh = lin // n_first
    else:
        rest = lin - n_long
        tile = n_first + rest % (n_tiles - n_first)
        bh = rest // (n_tiles - n_first)
    return tile, bh.to(tl.int64)


@triton.jit
def _query_list(SEL_IDX, SEL_NUM, list_row, idx_capacity, TILES_PER_BLOCK: tl.constexpr):
    """(the query block's KV list, its length in BLOCK_N tiles, the `last` entry before any)."""
    n_tiles = _list_length(SEL_NUM, list_row, idx_capacity) * TILES_PER_BLOCK
    return SEL_IDX + list_row * idx_capacity, n_tiles, tl.full([], -1, tl.int32)


@triton.jit
def _kv_tile(K, V, KV_COUNTS, sel, t, last, b, h, n_kv_blocks, stride_kb, stride_kh, stride_ks,
             BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """The t-th BLOCK_N-row tile of a query block's KV list: (its K rows, its V rows, which of
    its keys are valid tokens, the last entry taken). A skipped entry still loads a tile (in
    bounds) and masks all of it: no branch."""
    keep, kv_block, last = _list_entry(sel, t, last, n_kv_blocks, BLOCK_ELEMS // BLOCK_N)
    sub = (t % (BLOCK_ELEMS // BLOCK_N)) * BLOCK_N
    n_valid = tl.where(keep, tl.load(KV_COUNTS + kv_block), 0)
    key_ok = sub + tl.arange(0, BLOCK_N) < n_valid
    k, v = _row_tiles(K, V, b, h, kv_block * BLOCK_ELEMS + sub, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM,
                      USE_TMA)
    return k, v, key_ok, last


@triton.jit
def _row_tiles(X, Y, b, h, row0, stride_b, stride_h, stride_s, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               USE_TMA: tl.constexpr):
    """The [ROWS, HEAD_DIM] tiles of X and Y at token row0 of head (b, h): by TMA when they are
    tensor descriptors over (B, H, S, D) (USE_TMA), else by pointer loads."""
    if USE_TMA:
        x = X.load([b.to(tl.int32), h.to(tl.int32), row0, 0]).reshape(ROWS, HEAD_DIM)
        y = Y.load([b.to(tl.int32), h.to(tl.int32), row0, 0]).reshape(ROWS, HEAD_DIM)
    else:
        x = _load_rows(X, b, h, row0, stride_b, stride_h, stride_s, ROWS, HEAD_DIM)
        y = _load_rows(Y, b, h, row0, stride_b, stride_h, stride_s, ROWS, HEAD_DIM)
    return x, y


@triton.jit(do_not_specialize=["store_fine"])  # one binary for store_fine 0 and 1
def sparse_attn_fwd_kernel(
    Q, K, V, OUT, LSE, SEL_IDX, SEL_NUM, KV_COUNTS, Q_COUNTS, GATE, OUT_C, OUT_FINE,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    H, q_len, n_q_blocks, n_kv_blocks, idx_capacity, qk_scale_log2, store_fine, first_blocks,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_COARSE: tl.constexpr, HAS_GATE: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    IGNORE_PADDING: tl.constexpr = False, FINE_ROUNDING: tl.constexpr = False,
):
    """Each query attends to the valid tokens of the KV blocks its block selected.

    With HAS_COARSE the coarse branch is mixed in here, so the output is written once:
    out = out_fine + gate * out_c[query block] (or + out_c without a gate).
    store_fine != 0 (training) also keeps out_fine in fp32 for the backward's
    delta = rowsum(dO * out_fine): where logits are large the softmax is near one-hot
    and dP - delta cancels, so a bf16-rounded out (FlashAttention's recipe) costs dQ / dK
    accuracy (benchmarks/fine_residual_precision.py measures it). FINE_ROUNDING
    (HAS_COARSE): out_fine holds out's rounding residual instead, in out's dtype (the fp32 mix
    minus out rounded), from which the backward forms the fp32 fine output at half the bytes
    (`AttnProblem.fine_residual`).
    LSE is the fine branch's natural-log logsumexp (-inf for a query with nothing to see).
    Padded query rows (past Q_COUNTS) are computed like any row; with IGNORE_PADDING and
    HAS_COARSE (VSA) they are written out 0, out_fine 0 and lse +inf instead: they read no
    gate, and their probabilities exp(S - lse) in the backward are 0, so they feed no
    gradient. Padded KV rows are masked by a select on the scores; with IGNORE_PADDING their
    V rows are also read as 0. first_blocks: query blocks of each head scheduled first
    (`_long_tiles_first`).
    """
    pid_m, bh = _long_tiles_first(first_blocks, BLOCK_ELEMS // BLOCK_M)
    b = bh // H
    h = bh % H
    q_block = pid_m // (BLOCK_ELEMS // BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    q_ptr = b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + d[None, :]
    q = tl.load(Q + q_ptr)
    if HAS_COARSE:  # VSA: the query block's padded rows (past its count) are outputs of nothing
        q_in_block = (pid_m % (BLOCK_ELEMS // BLOCK_M)) * BLOCK_M + tl.arange(0, BLOCK_M)
        q_valid = q_in_block < _clamped_count(Q_COUNTS, q_block, BLOCK_ELEMS)
    sel, n_tiles, last = _query_list(SEL_IDX, SEL_NUM, bh * n_q_blocks + q_block, idx_capacity,
                                     BLOCK_ELEMS // BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for t in range(0, n_tiles):
        k, v, key_ok, last = _kv_tile(K, V, KV_COUNTS, sel, t, last, b, h, n_kv_blocks, stride_kb, stride_kh,
                                      stride_ks, BLOCK_ELEMS, HEAD_DIM, BLOCK_N, USE_TMA)
        if IGNORE_PADDING:  # P is 0 on the padded keys, but 0 * inf is NaN: V is read as 0 there
            v = _rows_or_zero(v, key_ok)
        s = tl.where(key_ok[None, :], _dot(q, tl.trans(k), UPCAST) * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    has_any = l_i > 0
    l_safe = tl.where(has_any, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if HAS_COARSE:
        if IGNORE_PADDING:
            out = tl.where(q_valid[:, None], out, 0.0)
            lse = tl.where(q_valid, lse, float("inf"))  # P = exp(S - lse) = 0 there in any backward
    if not FINE_ROUNDING:
        if store_fine != 0:  # a run-time flag: training and inference run the same binary, same out
            tl.store(OUT_FINE + q_ptr, out)
    if HAS_COARSE:
        coarse = tl.load(OUT_C + (bh * n_q_blocks + q_block) * HEAD_DIM + d)
        if HAS_GATE:
            if IGNORE_PADDING:
                gate = tl.load(GATE + q_ptr, mask=q_valid[:, None], other=0.0).to(tl.float32)
            else:
                gate = tl.load(GATE + q_ptr).to(tl.float32)
            out += gate * coarse[None, :]
        elif IGNORE_PADDING:
            out += tl.where(q_valid[:, None], coarse[None, :], 0.0)
        else:
            out += coarse[None, :]
    rounded = out.to(OUT.dtype.element_ty)
    tl.store(OUT + q_ptr, rounded)
    if FINE_ROUNDING:
        if store_fine != 0:
            tl.store(OUT_FINE + q_ptr, (out - rounded.to(tl.float32)).to(OUT_FINE.dtype.element_ty))
    tl.store(LSE + bh * q_len + rows, lse)


@triton.jit
def sparse_attn_bwd_dq_kernel(
    Q, K, V, DOUT, LSE, DELTA, DQ, SEL_IDX, SEL_NUM, KV_COUNTS, Q_COUNTS, DQ_C,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    H, q_len, n_q_blocks, n_kv_blocks, idx_capacity, qk_scale_log2, sm_scale, first_blocks,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_COARSE: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, IGNORE_PADDING: tl.constexpr = False,
):
    """dQ, owned by query tiles (no atomics). With HAS_COARSE it also adds the pooling
    gradient dq_c[block] / q_count[block] to every row of the block (the mean summed them
    all), so dQ is written once; with IGNORE_PADDING to the valid rows only, the padded
    ones written exactly 0 (their lse is +inf, so P is 0 there too). IGNORE_PADDING also
    reads the padded K rows as 0 and drops dS on the padded keys (dP there reads V).
    first_blocks: query blocks of each head scheduled first (`_long_tiles_first`)."""
    pid_m, bh = _long_tiles_first(first_blocks, BLOCK_ELEMS // BLOCK_M)
    b = bh // H
    h = bh % H
    q_block = pid_m // (BLOCK_ELEMS // BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    q_ptr = b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + d[None, :]
    q = tl.load(Q + q_ptr)
    do = tl.load(DOUT + q_ptr)
    lse2 = tl.load(LSE + bh * q_len + rows) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    delta = tl.load(DELTA + bh * q_len + rows)
    sel, n_tiles, last = _query_list(SEL_IDX, SEL_NUM, bh * n_q_blocks + q_block, idx_capacity,
                                     BLOCK_ELEMS // BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for t in range(0, n_tiles):
        k, v, key_ok, last = _kv_tile(K, V, KV_COUNTS, sel, t, last, b, h, n_kv_blocks, stride_kb, stride_kh,
                                      stride_ks, BLOCK_ELEMS, HEAD_DIM, BLOCK_N, USE_TMA)
        if IGNORE_PADDING:  # dS is 0 on the padded keys, but dS @ K would multiply inf there
            k = _rows_or_zero(k, key_ok)
        s = tl.where(key_ok[None, :], _dot(q, tl.trans(k), UPCAST) * qk_scale_log2, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        if IGNORE_PADDING:  # dP on the padded keys read their V rows (0 * inf there): dropped
            ds = tl.where(key_ok[None, :], ds, 0.0)
        dq += _dot(ds.to(k.dtype), k, UPCAST)
    dq *= sm_scale
    if HAS_COARSE:  # the pooling gradient: to every row of the block, or to the valid ones only
        n_valid = _clamped_count(Q_COUNTS, q_block, BLOCK_ELEMS)
        count = n_valid.to(tl.float32)
        dq_c = tl.load(DQ_C + (bh * n_q_blocks + q_block) * HEAD_DIM + d)
        dq += tl.where(count > 0, dq_c / tl.maximum(count, 1.0), 0.0)[None, :]
        if IGNORE_PADDING:  # padded rows are inputs of nothing: exactly 0
            q_in_block = (pid_m % (BLOCK_ELEMS // BLOCK_M)) * BLOCK_M + tl.arange(0, BLOCK_M)
            dq = tl.where((q_in_block < n_valid)[:, None], dq, 0.0)
    tl.store(DQ + q_ptr, dq.to(DQ.dtype.element_ty))


@triton.jit
def sparse_attn_bwd_dkdv_kernel(
    Q, K, V, DOUT, LSE, DELTA, DK, DV, INV_IDX, INV_NUM, KV_COUNTS, DK_C, DV_C, Q_COUNTS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    H, q_len, n_kv_blocks, idx_capacity, qk_scale_log2, sm_scale, first_blocks,
    BLOCK_ELEMS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_COARSE: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr, IGNORE_PADDING: tl.constexpr = False,
):
    """dK and dV, owned by KV tiles: each walks the query blocks that selected its block
    (the inverse lists). With HAS_COARSE it adds the pooling gradients dk_c/count and
    dv_c/count to every row of the block (padded rows included: the mean summed them), so
    blocks that no query selected still get their coarse gradient. IGNORE_PADDING reads
    the padded rows of this block's K, V and (VSA: past Q_COUNTS) of the query tiles' Q, dO
    as 0, and gives the pooling gradients to the valid rows only (padded rows exactly 0).
    first_blocks: KV blocks of each head scheduled first (`_long_tiles_first`)."""
    pid_n, bh = _long_tiles_first(first_blocks, BLOCK_ELEMS // BLOCK_N)
    b = bh // H
    h = bh % H
    kv_block = pid_n // (BLOCK_ELEMS // BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    in_block = (pid_n % (BLOCK_ELEMS // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    count = _clamped_count(KV_COUNTS, kv_block, BLOCK_ELEMS)
    valid = in_block < count
    kv_rows = (kv_block * BLOCK_ELEMS + in_block).to(tl.int64)
    kv_ptr = b * stride_kb + h * stride_kh + kv_rows[:, None] * stride_ks + d[None, :]
    k = tl.load(K + kv_ptr)
    v = tl.load(V + kv_ptr)
    if IGNORE_PADDING:
        k = _rows_or_zero(k, valid)
        v = _rows_or_zero(v, valid)
    inv = INV_IDX + (bh * n_kv_blocks + kv_block) * idx_capacity
    n_tiles = tl.load(INV_NUM + bh * n_kv_blocks + kv_block) * (BLOCK_ELEMS // BLOCK_M)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for t in range(0, n_tiles):
        q_block = tl.load(inv + t // (BLOCK_ELEMS // BLOCK_M))
        row0 = q_block * BLOCK_ELEMS + (t % (BLOCK_ELEMS // BLOCK_M)) * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        q, do = _row_tiles(Q, DOUT, b, h, row0, stride_qb, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, USE_TMA)
        if IGNORE_PADDING:
            if HAS_COARSE:  # VSA: the query block's padded rows (lse +inf, so P = 0) are read as 0
                q_ok = (t % (BLOCK_ELEMS // BLOCK_M)) * BLOCK_M + tl.arange(0, BLOCK_M) < _clamped_count(
                    Q_COUNTS, q_block, BLOCK_ELEMS)
                q = _rows_or_zero(q, q_ok)
                do = _rows_or_zero(do, q_ok)
        lse2 = tl.load(LSE + bh * q_len + rows) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta = tl.load(DELTA + bh * q_len + rows)
        st = _dot(k, tl.trans(q), UPCAST) * qk_scale_log2
        pt = tl.where(valid[:, None], tl.exp2(st - lse2[None, :]), 0.0)
        dv += _dot(pt.to(do.dtype), do, UPCAST)
        dpt = _dot(v, tl.trans(do), UPCAST)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(q.dtype), q, UPCAST)
    dk *= sm_scale
    if HAS_COARSE:  # the pooling gradients (IGNORE_PADDING: the padded rows stay exactly 0)
        inv_count = tl.where(count > 0, 1.0 / tl.maximum(count.to(tl.float32), 1.0), 0.0)
        c_ptr = (bh * n_kv_blocks + kv_block) * HEAD_DIM + d
        dk_pool = (tl.load(DK_C + c_ptr) * inv_count)[None, :]
        dv_pool = (tl.load(DV_C + c_ptr) * inv_count)[None, :]
        if IGNORE_PADDING:
            dk += tl.where(valid[:, None], dk_pool, 0.0)
            dv += tl.where(valid[:, None], dv_pool, 0.0)
        else:
            dk += dk_pool
            dv += dv_pool
    tl.store(DK + kv_ptr, dk.to(DK.dtype.element_ty))
    tl.store(DV + kv_ptr, dv.to(DV.dtype.element_ty))
