"""The cute backend's Triton kernels: FA4's block-sparse tensors from our lists and counts,
and delta -> dlse for FA4's backward.

Launched by `vsa_core.backends.cute_backend` (GPU only); the conventions are those of
`vsa_core.stage_kernels`, whose device functions they call.
"""

import triton
import triton.language as tl

from ..stage_kernels import _clamped_count, _counted_entries, _list_length


# --------------------------------------------------------------------------------------
# Helpers of the CuTe (FlashAttention-4) backend
#
# FA4's block-sparse kernels on sm_90 walk 128-token KV tiles, each listed as "full"
# (every token valid: no mask) or "mask" (partly filled: a mask_mod trims the padded
# tail). These kernels turn our per-block lists and counts into that form, mix the
# coarse branch into FA4's output, and fold the backward's extra terms in.
# --------------------------------------------------------------------------------------
@triton.jit
def kv_sub_counts_kernel(
    KV_COUNTS, SUB_COUNTS, n_sub,
    SUB: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
):
    """SUB_COUNTS[n] = valid tokens of TILE-token sub-block n (SUB sub-blocks per block)."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < n_sub
    c = tl.minimum(tl.maximum(tl.load(KV_COUNTS + n // SUB, mask=ok, other=0), 0), SUB * TILE) - (n % SUB) * TILE
    tl.store(SUB_COUNTS + n, tl.minimum(tl.maximum(c, 0), TILE), mask=ok)


@triton.jit
def fa4_fwd_lists_kernel(
    SEL_IDX, SEL_NUM, KV_COUNTS, FULL_IDX, FULL_NUM, MASK_IDX, MASK_NUM,
    n_kv_blocks, idx_capacity, out_capacity,
    SUB: tl.constexpr, TILE: tl.constexpr, SLOTS: tl.constexpr,
):
    """Query-owned lists of TILE-token KV sub-blocks, one program per (b, h, query block).

    Selected block j stands for sub-blocks j*SUB .. j*SUB+SUB-1; each goes to the full
    list (TILE valid tokens), the mask list (1..TILE-1) or nowhere (empty). Entries
    count by the rule in the module doc; the counted ones ascend, so the lists do.
    """
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, SLOTS)
    i = pos // SUB
    s = pos % SUB
    listed = i < _list_length(SEL_NUM, row, idx_capacity)
    j = tl.load(SEL_IDX + row * idx_capacity + i, mask=listed, other=-1)
    taken = _counted_entries(j, listed & (j >= 0) & (j < n_kv_blocks), i, SLOTS)
    j = tl.where(taken, j, 0)
    c = tl.minimum(tl.maximum(tl.load(KV_COUNTS + j, mask=taken, other=0), 0), SUB * TILE) - s * TILE
    full = taken & (c >= TILE)
    part = taken & (c > 0) & (c < TILE)
    sub = j * SUB + s
    f_slot = tl.cumsum(full.to(tl.int32), axis=0) - 1
    m_slot = tl.cumsum(part.to(tl.int32), axis=0) - 1
    tl.store(FULL_IDX + row * out_capacity + f_slot, sub, mask=full & (f_slot < out_capacity))
    tl.store(MASK_IDX + row * out_capacity + m_slot, sub, mask=part & (m_slot < out_capacity))
    tl.store(FULL_NUM + row, tl.minimum(tl.sum(full.to(tl.int32), axis=0), out_capacity))
    tl.store(MASK_NUM + row, tl.minimum(tl.sum(part.to(tl.int32), axis=0), out_capacity))


@triton.jit
def fa4_bwd_lists_kernel(
    INV_IDX, INV_NUM, KV_COUNTS, IDX, FULL_NUM, MASK_NUM,
    n_kv_blocks, idx_capacity,
    SUB: tl.constexpr, TILE: tl.constexpr, Q_PAD: tl.constexpr, COPY_IDX: tl.constexpr,
):
    """KV-owned lists per TILE-token sub-block n of block j = n // SUB, one program per
    (n, b*h): the query blocks that selected j (the inverse list), counted as full or
    mask by the sub-block's fill, or not at all when it is empty. The full and mask
    lists share one index tensor (a sub-block is one or the other); with SUB == 1 it
    is the inverse list itself and nothing is copied (COPY_IDX False)."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    j = n // SUB
    c = _clamped_count(KV_COUNTS, j, SUB * TILE) - (n % SUB) * TILE
    num = tl.load(INV_NUM + bh * n_kv_blocks + j)
    out_row = bh * (n_kv_blocks * SUB) + n
    if COPY_IDX:
        pos = tl.arange(0, Q_PAD)
        ok = pos < num
        vals = tl.load(INV_IDX + (bh * n_kv_blocks + j) * idx_capacity + pos, mask=ok, other=0)
        tl.store(IDX + out_row * idx_capacity + pos, vals, mask=ok)
    tl.store(FULL_NUM + out_row, tl.where(c >= TILE, num, 0))
    tl.store(MASK_NUM + out_row, tl.where((c > 0) & (c < TILE), num, 0))


@triton.jit
def delta_to_dlse_kernel(
    OUT, DOUT, DELTA,
    stride_b, stride_h, stride_s,
    H, q_len,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):
    """DELTA <- rowsum(OUT * DOUT) - DELTA, in place.

    A backward that forms its own delta' = rowsum(O * dO) - dlse from the O it is
    given then uses exactly our delta, whatever O is (FA4 can only be given a bf16 O)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    d = tl.arange(0, HEAD_DIM)
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ptr = b * stride_b + h * stride_h + rows[:, None] * stride_s + d[None, :]
    s = tl.sum(tl.load(OUT + ptr).to(tl.float32) * tl.load(DOUT + ptr).to(tl.float32), axis=1)
    at = DELTA + bh * q_len + rows
    tl.store(at, s - tl.load(at))
