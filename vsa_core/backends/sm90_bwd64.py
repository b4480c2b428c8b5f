"""Our own block-sparse attention backward for 64-token blocks on sm_90 (Hopper), in CuTe DSL.

The sm90 backend's backward (`sm90_backend`); `sm90_bwd64_launch` builds, checks and launches it
(`sparse_backward64` / `prepare_backward64` on torch tensors); benchmarks/sm90_bwd64_check.py
checks it against float64 and the Triton backward and times it.

What it computes (the contract of `base.FineBackward`, the fine branch only, and of
`triton_fine_kernels.sparse_attn_bwd_dq_kernel` / `sparse_attn_bwd_dkdv_kernel`): with
P = exp(S * scale - lse) recomputed from the forward's natural-log lse, dP = dO V^T,
dS = P * (dP - delta) (delta = rowsum(dO * O) from the Triton preprocess),
dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K over the selected blocks only.
The lists are the KV-owned ones (`inv_idx` [B, H, nKV, capacity], `inv_num` [B, H, nKV]: for each
KV block, the ascending query blocks that selected it), read by the list rule of the forward: the
count is clamped to [0, capacity], an entry counts only if it is in [0, nQ) and greater than the
last counted entry (a skipped entry still loads a clamped, in-bounds tile and masks all of it, so it
adds exact zeros). Keys past `kv_counts[n]` (clamped to [0, 64]) are masked (their dK, dV rows are
exactly 0). A query row whose lse is -inf (it saw nothing) gets P = 0, like lse +inf (the padded
query rows of a VSA forward under padding="ignore"). Padded rows are multiplied by zero weights, as in
cuDNN's kernel: under padding="ignore" the caller hands in copies with them zeroed
(`stages.valid_rows_copy`). The pooling gradients (VSA) are added where the gradients are formed
when given (`pool_grads`: dk_pool / dv_pool in the epilogue, dq_pool in the dQ postprocess).

Design: KV-major, one CTA (one warpgroup, 128 threads) per 64-token KV block, walking its list of
query blocks. K and V come once by TMA; Q and dO tiles (and the 64 lse / delta values of the
query block, by bulk copies on the same mbarrier) come per list entry into a ring of `stages`
slots. Per query block, five wgmma m64 GEMMs with fp32 accumulators:
  S^T = K Q^T and dP^T = V dO^T (SS: 64 x 64, k = D), issued together;
  P^T = exp2(S^T c - lse log2 e) with c = scale log2 e (rows past the KV count selected to 0);
  dV += P^T dO (P^T from the accumulator to bf16 registers, the A operand, without a shuffle: for
  m64 tiles the accumulator's register order is the A fragment's, as in the forward);
  dS^T = P^T (dP^T - delta), to bf16 registers (dK += dS^T Q, register A) and to shared memory
  (dQ = dS K needs it as an operand with query rows: shared memory, read M-major);
  dQ = dS K (SS), fresh per query block.
Computing S^T rather than S makes the KV rows the accumulator rows, so dK and dV need no
transpose of P or dS; Q^T, dO^T and K^T are transposed views of the same shared-memory tiles
(MN-major wgmma operands), nothing is copied. dK and dV stay in registers across the whole list.

dQ: every (query block, KV block) pair adds its 64 x D fp32 partial sum into an fp32 workspace
`dq_accum` [B, H, nQ, 64 * D] by one bulk reduction (cp.reduce.async.bulk .add.f32, 32 KiB at
D128) from shared memory: one instruction per pair instead of 8192 scalar atomics. The staging
buffer is the query block's own Q + dO slot (64 x D fp32 is exactly the two bf16 tiles), free
once the GEMMs that read it retired; the slot's refill waits for the reduction to have read it.
The workspace holds each thread's accumulator registers in chunks of four floats, threads
interleaved (conflict-free 16-byte shared stores, a linear bulk copy); `_DqPostprocess` turns it
into dq (times the scale, the input dtype, any strides) with the same accumulator partition.
The order of the atomic reductions varies run to run: dq is not bitwise deterministic; dk, dv are.
Registers, spills and shared memory per variant: benchmarks/sm90_bwd64_compile.py (0 spills; two
CTAs per SM at stages=2).

Variants (constructor options). The default is dq_red + dk_overlap, the fastest of the three
on the H200 (benchmarks/results/2026-12-02-h200/); dq_red=False is the staged path above:
  dq_red=True: dQ leaves by 16 `red.global.add.v4.f32` per thread straight from the accumulator
    registers (after the dQ GEMM retired), at the same workspace addresses the staging uses (the
    postprocess is unchanged). No staging store, no bulk reduction, 2 barriers per step instead of 3
    (the slot refill and sdS's reuse are ordered by one barrier at the top of the next step, after
    every warp's wait_group(0)). Prediction: per pair the kernel moves ~224 KiB through shared memory
    (wgmma operands 120 KiB: S and dP are m64n64 SS GEMMs, 128 B/clk each, at the smem port's limit;
    TMA 32, dS 8, dQ staging 32 + the bulk reduction's read 32) against 1280 tensor clocks at peak;
    dropping the 64 KiB of the dQ staging brings the smem floor from ~1790 to ~1280 clk/pair, the
    tensor floor. The L2 sees the same 32 KiB of fp32 adds per pair, as 256 vector requests of 128 B
    instead of one bulk operation (cuDNN keeps a dedicated warp for the bulk path; FA2 used scalar
    atomics). Expected +5-12% if shared memory and the barriers bind; a loss if L2's vector
    reductions are slower than bulk ones (the thing to measure). Adds are FTZ (denormals flushed).
  dk_overlap=True (with dq_red): dQ is issued before dK, the step waits only for dQ (wait_group(1)),
    sends it, and goes on: dK retires under the next step's S / dP (they queue behind it in the
    tensor pipe), and the barrier that frees the slot and sdS moves after the wait for S (which
    implies dK of the step before). No wait_group(0) inside the loop; ptxas keeps the in-flight dK
    across the back edge (no serialisation warning, no DEPBAR at the loop top: checked in the SASS).
    Prediction: the per-step bubble between dQ retiring and the next S issue (reds, list read,
    mbarrier wait) is hidden behind dK; +3-8% over dq_red; registers 251, no spills.

Query groups (`q_group_bytes`, split kernel only; the sm90 backend's default at 32 MiB). A KV block's
list spans every query block of its head, so the CTAs running at once read Q and dO and reduce into
the fp32 dQ of the whole head: 64 KiB per query block at D128, 75 MB a head at S 75264, more than the
50 MB of L2, and Q / dO / dQ lines then make round trips to DRAM between the KV blocks that share
them. With groups, CTA (KV block, g) walks only the entries of the list in query group g (groups of
at most q_group_bytes of that working set, `group_blocks`), the grid runs chunk by chunk of KV blocks
(a chunk: the CTAs resident at once), each chunk once per group, so the CTAs running together share
one group's query blocks. dK and dV become sums over the groups: each group but the last stores its
fp32 partial sums into a ring of slots in L2 (a few chunks' worth, `group_workspace_shapes`, not a
copy of dK / dV), and the last group's CTA adds them in group order before its epilogue, so dk and dv
are still the same every run (but not bitwise the one-group result: another order of fp32 sums).
Counters order the ring (`sm90_bwd64_split._join_groups`); every wait is for a CTA launched before
the waiting one. A problem with one group runs the kernel without any of it.

Head sweep (`head_sweep`, with query groups; the sm90 backend's default). The grid's chunk is a head's
KV blocks (`sm90_bwd64_launch.launch_chunk`), so every group runs over the whole head before the next, as cuDNN's
backward orders its grid: a group's Q / dO / dQ come into L2 once a head instead of once per chunk of
resident CTAs, and the ring of partial sums holds one head (`ring_slots`; the kernel is the same
build, the chunk and the ring's size are run-time values).

Persistent (`persistent`, split kernel only; a variant, not the default: it measured no faster,
benchmarks/README.md). A grid of at most `chunk` CTAs, each taking the next (KV block, group) tile
from a counter in `group_flags` (zeroed per launch) until none is left, in the grid's tile order: a
tile is taken only by a running CTA, so the waits of the groups stay deadlock-free whatever the SM
count. The next tile's first Q / dO tiles load under the current tile's last steps and its K / V
under the epilogue (`sm90_bwd64_split`, `_next_tile`, `_produce`).

K / V in registers (`k_in_regs`, `v_in_regs`, split kernel only; the sm90 backend's default together
with the options below, benchmarks/README.md). Warpgroup 1's S^T = K Q^T takes K, warpgroup 2's dP^T = V dO^T takes V as
a register operand, loaded by ldmatrix once a tile, so the steps no longer read them from shared
memory (`sm90_bwd64_split._kv_operand`). dk and dv stay bitwise the default's.

Handing P over (split kernel). p_early: warpgroup 2 waits for P_j and reads it while its dP_j is in
flight, so neither the wait nor the loads sit between dP retiring and dS. p_rounded: P goes to
warpgroup 2 in the input dtype, rounded as dV takes it (16-byte shared-memory stores and loads, half
P's bytes), and dS = P (dP - delta) takes the rounded P, as cuDNN's blk64 backward does: dq and dk
round differently from the fp32-P kernel (by about what separates cuDNN's from it), dv is unchanged.
l2_hints: Q / dO loads evict_last (every KV block of a group reads them), K / V evict_first (each
read by one CTA).

Layouts: tensors are [B, H, S, D] views with arbitrary batch / head / token strides and a
contiguous head dim (BSHD is the same tensor transposed: no copy); strides must be multiples
of 8 elements and base addresses 16-byte aligned (TMA); lse, delta [B, H, Sq] fp32 with a
contiguous last dim and strides in multiples of 4 (bulk copies of 64 values).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers
from cutlass.cutlass_dsl import dsl_user_op
from cutlass._mlir.dialects import llvm

try:  # cutlass-dsl >= 4.8 moved these; 4.8.1 is what we pin
    from cutlass.tensor_utils import LayoutEnum
    from cutlass.memory import SmemAllocator
except ModuleNotFoundError:  # pragma: no cover
    from cutlass.utils import LayoutEnum, SmemAllocator

from .sm90_bwd64_groups import BLOCK
from .sm90_common import rows_cols, tma_load

LOG2_E = 1.4426950408889634
THREADS = 128       # one warpgroup
LIST_WINDOW = 256   # list_in_smem: the first entries of a KV block's list kept in shared memory
MAJOR_K = cute.nvgpu.warpgroup.OperandMajorMode.K
MAJOR_MN = cute.nvgpu.warpgroup.OperandMajorMode.MN


# ---- small helpers -----------------------------------------------------------------------------
def _transposed(t: cute.Tensor) -> cute.Tensor:
    """The same shared-memory tensor with its first two modes swapped (a view, no copy)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


@dsl_user_op
def _bulk_g2s(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, size: int, *, loc=None,
              ip=None):
    """cp.async.bulk global -> shared of `size` bytes, completing on an mbarrier (transaction bytes)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         mbar_ptr.toint(loc=loc, ip=ip).ir_value(), cutlass.Int32(size).ir_value()],
        "cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [$1], [$0], $3, [$2];",
        "l,r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _bulk_reduce_add_f32(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, size: int, *, loc=None, ip=None):
    """gmem[i] += smem[i] (fp32) over `size` bytes, asynchronously (bulk async-group of this thread)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value(), smem_ptr.toint(loc=loc, ip=ip).ir_value(),
         cutlass.Int32(size).ir_value()],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _red_add_v4_f32(gmem_ptr: cute.Pointer, v0, v1, v2, v3, *, loc=None, ip=None):
    """gmem[0:4] += (v0, v1, v2, v3) (fp32, one 16-byte vector reduction at L2, no return value)."""
    llvm.inline_asm(
        None,
        [gmem_ptr.toint(loc=loc, ip=ip).ir_value()]
        + [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _tok_major(t: cute.Tensor, D: int, divby: Optional[int] = None) -> cute.Tensor:
    """(S, D, H, B) view of a [B, H, S, D] tensor, head dim static and contiguous. divby: the strides'
    known divisibility in elements (16 bytes, checked on the host), so that the register -> global
    stores of neighbouring columns vectorize."""
    st = (t.stride[2], t.stride[1], t.stride[0])
    if cutlass.const_expr(divby is not None):
        st = tuple(cute.assume(x, divby=divby) for x in st)
    return cute.make_tensor(t.iterator, cute.make_layout(
        (t.shape[2], D, t.shape[1], t.shape[0]), stride=(st[0], 1, st[1], st[2])))


@cute.jit
def _pooling_grad(pool: cute.Tensor, count, ignore_padding: cutlass.Constexpr, acc_rc: cute.Tensor,
                  c_rc: cute.Tensor, scale):
    """acc = acc * scale + pool[col] / count in place over a (row, col) accumulator view (`c_rc`: its
    coordinates): the mean pooling's gradient (VSA) added where the gradient is formed, one rounding
    to the input dtype instead of two. ignore_padding: rows past the count get nothing (their
    fine-stage gradient is exactly 0 already: masked keys, zeroed query rows); count 0: nothing."""
    n = cutlass.min(cutlass.max(count, 0), BLOCK)
    inv = cutlass.Float32(0.0)
    if n > 0:
        inv = cutlass.Float32(1.0) / cutlass.Float32(n)
    for ci in cutlass.range_constexpr(cute.size(acc_rc, mode=[1])):
        g = pool[c_rc[0, ci][1]] * inv
        for ri in cutlass.range_constexpr(cute.size(acc_rc, mode=[0])):
            add = g
            if cutlass.const_expr(ignore_padding):
                add = g if c_rc[ri, 0][0] < n else cutlass.Float32(0.0)
            acc_rc[ri, ci] = cute.math.fma(acc_rc[ri, ci], scale, add)


def _staging_layout(D: int):
    """Thread t's dQ accumulator registers (D / 2 fp32 at m64) in the 64 * D workspace of one query
    block: (4 consecutive registers, chunk, thread), chunks of 4 threads-interleaved."""
    v = BLOCK * D // THREADS
    return cute.make_layout((4, v // 4, THREADS), stride=(1, 4 * THREADS, 4))


def _regs_4(acc: cute.Tensor) -> cute.Tensor:
    """The accumulator's registers in storage order as (4, chunk)."""
    v = cute.size(acc)
    return cute.make_tensor(acc.iterator, cute.make_layout((4, v // 4), stride=(1, 4)))


def _dq_mma(dt, D: int):
    """dQ = dS K: A = dS from shared memory, query rows contiguous (M-major); B = K^T (MN-major)."""
    return hopper_helpers.make_trivial_tiled_mma(dt, dt, MAJOR_MN, MAJOR_MN, cutlass.Float32, (1, 1, 1),
                                                tiler_mn=(BLOCK, D))


class BlockSparseBwd64Sm90:
    """One compiled configuration of the backward: element type, head dim and the depth of the
    Q / dO ring (`stages` >= 2: a slot is refilled one query block after it was used, once the
    dQ reduction staged in it has been read)."""

    def __init__(self, dtype=cutlass.BFloat16, head_dim: int = 128, stages: int = 2,
                 ctas_per_sm: Optional[int] = None, dq_red: bool = True, dk_overlap: bool = True,
                 pool_grads: bool = False, ignore_padding: bool = False, list_in_smem: bool = False):
        assert dtype in (cutlass.BFloat16, cutlass.Float16), "bf16 or fp16"
        assert head_dim in (64, 128), "head dim 64 or 128"
        assert stages >= 2, "the dQ staging reuses a Q / dO slot: 2 slots at least"
        assert dq_red or not dk_overlap, "dk_overlap needs dq_red (dQ retires before dK)"
        self.dtype = dtype
        self.head_dim = head_dim
        self.stages = stages
        self.dq_red = dq_red          # dQ by red.global.add.v4.f32 from the accumulator registers
        self.dk_overlap = dk_overlap  # dQ issued before dK; dK retires under the next S / dP
        self.pool_grads = pool_grads  # VSA: dk_pool / dv_pool spread over the block's rows in the epilogue
        self.ignore_padding = ignore_padding  # ... to its valid rows only (padding="ignore")
        # the list's first LIST_WINDOW entries copied to shared memory once per CTA: a step's entry
        # and its refill's come by LDS instead of a global load (whose round trip the refill's TMA
        # and the entry's clamp wait for, in order, at every step; entries past the window: global)
        self.list_in_smem = list_in_smem
        tile_bytes = BLOCK * head_dim * 2
        # K, V; Q + dO per stage; dS; lse + delta per stage; barriers
        self.smem_bytes = tile_bytes * (2 + 2 * stages) + BLOCK * BLOCK * 2 + 2 * 4 * BLOCK * stages + 1024
        # dK, dV and dQ accumulators alone take 192 registers a thread at D128: two warpgroups per SM
        self.ctas_per_sm = ctas_per_sm or max(1, min(2, (227 * 1024) // self.smem_bytes))

    # ---- host side (traced once per compile) ----------------------------------------------------
    def _operands(self, mQ, mK, mV, mdO, mdK, mdV) -> dict:
        """The shared-memory layouts, the TMA atoms and the tiled MMAs of the backward (called while
        `__call__` is traced; the split variant's too)."""
        D = self.head_dim
        S = self.stages
        dt = self.dtype
        gQ4, gK4, gV4, gdO4 = (_tok_major(t, D) for t in (mQ, mK, mV, mdO))
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            hopper_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dt, D), dt)
        # K in slot 0, V in slot 1; stage s: Q in slot 2s, dO in 2s + 1 (adjacent: the dQ staging)
        sKV_layout = cute.tile_to_shape(atom, (BLOCK, D, 2), order=(0, 1, 2))
        sQdO_layout = cute.tile_to_shape(atom, (BLOCK, D, 2 * S), order=(0, 1, 2))
        ds_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            hopper_helpers.get_smem_layout_atom(LayoutEnum.COL_MAJOR, dt, BLOCK), dt)
        sdS_layout = cute.tile_to_shape(ds_atom, (BLOCK, BLOCK), order=(1, 0))  # (q, kv), q contiguous
        self.tile_bytes = cute.size_in_bytes(dt, cute.slice_(sQdO_layout, (None, None, 0)))

        o = dict(sKV_layout=sKV_layout, sQdO_layout=sQdO_layout, sdS_layout=sdS_layout,
                 gdK4=_tok_major(mdK, D, 8), gdV4=_tok_major(mdV, D, 8))
        o["mma_s"], o["mma_kv"], o["mma_dq"] = self._mmas()
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        one_tile = cute.slice_(sQdO_layout, (None, None, 0))
        for name, g in (("q", gQ4), ("do", gdO4), ("k", gK4), ("v", gV4)):
            o["tma_" + name], o["t" + ("dO" if name == "do" else name.upper())] = \
                cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, g, one_tile, (BLOCK, D))
        return o

    def _mmas(self):
        """(S / dP: m64n64 SS; dK / dV: register A, MN-major B; dQ), fresh TiledMma objects: their
        ACCUMULATE field is state, so each warpgroup that sets it needs its own."""
        dt, D = self.dtype, self.head_dim
        RMEM = cute.nvgpu.warpgroup.OperandSource.RMEM
        return (hopper_helpers.make_trivial_tiled_mma(dt, dt, MAJOR_K, MAJOR_K, cutlass.Float32, (1, 1, 1),
                                                      tiler_mn=(BLOCK, BLOCK)),
                hopper_helpers.make_trivial_tiled_mma(dt, dt, MAJOR_K, MAJOR_MN, cutlass.Float32, (1, 1, 1),
                                                      tiler_mn=(BLOCK, D), a_source=RMEM),
                _dq_mma(dt, D))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mDQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mInvIdx: cute.Tensor, mInvNum: cute.Tensor, mKVCounts: cute.Tensor,
                 mdKPool: cute.Tensor, mdVPool: cute.Tensor, mPartial: cute.Tensor, mFlags: cute.Tensor,
                 softmax_scale: cutlass.Float32, chunk: cutlass.Int32, stream):
        """q, k, v, dout, dk, dv: [B, H, S, D]; lse, delta [B, H, Sq] fp32; dq_accum [B, H, nQ, 64 * D]
        fp32 (zeroed by the caller); inv_idx [B, H, nKV, cap], inv_num [B, H, nKV], kv_counts [nKV] int32;
        dk_pool, dv_pool [B, H, nKV, D] fp32 with pool_grads (placeholders otherwise, never read);
        dkv_partial, group_flags and chunk: the split kernel's query groups (`group_workspace_shapes`;
        chunk: the CTAs resident at once), not read by this kernel."""
        S = self.stages
        dt = self.dtype
        o = self._operands(mQ, mK, mV, mdO, mdK, mdV)
        sKV_layout, sQdO_layout, sdS_layout = o["sKV_layout"], o["sQdO_layout"], o["sdS_layout"]

        list_len = LIST_WINDOW * int(self.list_in_smem) + 4 * int(not self.list_in_smem)  # (no `if`: traced)

        @cute.struct
        class Storage:
            kv_full: cute.struct.MemRange[cutlass.Int64, 1]
            qdo_full: cute.struct.MemRange[cutlass.Int64, S]
            sLSE: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK * S], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK * S], 128]
            sKV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sQdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]
            sList: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, list_len], 16]

        self.storage = Storage
        self.smem_bytes = Storage.size_in_bytes()
        tQ, tdO, tK, tV = o["tQ"], o["tdO"], o["tK"], o["tV"]
        tma_q, tma_do, tma_k, tma_v = o["tma_q"], o["tma_do"], o["tma_k"], o["tma_v"]
        gdK4, gdV4, mma_s, mma_kv, mma_dq = o["gdK4"], o["gdV4"], o["mma_s"], o["mma_kv"], o["mma_dq"]
        grid = (mInvIdx.shape[2], mQ.shape[1], mQ.shape[0])
        self.kernel(tQ, tdO, tK, tV, tma_q, tma_do, tma_k, tma_v, mLSE, mDelta, mDQacc, gdK4, gdV4,
                    mInvIdx, mInvNum, mKVCounts, mdKPool, mdVPool, mma_s, mma_kv, mma_dq, sKV_layout, sQdO_layout,
                    sdS_layout, softmax_scale * LOG2_E, softmax_scale).launch(
            grid=grid, block=(THREADS, 1, 1), smem=Storage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=self.ctas_per_sm, preferred_smem_carveout=100)

    # ---- device side ------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tQ: cute.Tensor, tdO: cute.Tensor, tK: cute.Tensor, tV: cute.Tensor,
               tma_q: cute.CopyAtom, tma_do: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mDQacc: cute.Tensor, gdK4: cute.Tensor, gdV4: cute.Tensor,
               mInvIdx: cute.Tensor, mInvNum: cute.Tensor, mKVCounts: cute.Tensor,
               mdKPool: cute.Tensor, mdVPool: cute.Tensor,
               mma_s: cute.TiledMma, mma_kv: cute.TiledMma, mma_dq: cute.TiledMma,
               sKV_layout: cute.ComposedLayout, sQdO_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
               c: cutlass.Float32, scale: cutlass.Float32):
        S = self.stages
        D = self.head_dim
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        kvb, h, b = cute.arch.block_idx()
        n_q = mDQacc.shape[2]
        cap = mInvIdx.shape[3]

        st = SmemAllocator().allocate(self.storage)
        kv_full, qdo_full = self._load_barriers(st, warp, (tma_q, tma_do, tma_k, tma_v))

        sKV, sQdO, sdS, sLSE, sDelta = self._shared_tensors(st, sKV_layout, sQdO_layout, sdS_layout)
        # the dQ staging of stage s: its Q + dO slots as 64 * D fp32
        stage_f32 = cute.recast_ptr(st.sQdO.data_ptr(), dtype=cutlass.Float32)
        sStage = cute.make_tensor(stage_f32, cute.append(_staging_layout(D), cute.make_layout(S, stride=BLOCK * D)))

        one = cute.make_layout(1)
        gK = cute.local_tile(tK[None, None, h, b], (BLOCK, D), (kvb, 0))
        gV = cute.local_tile(tV[None, None, h, b], (BLOCK, D), (kvb, 0))
        gQ = cute.local_tile(tQ[None, None, h, b], (BLOCK, D), (None, 0))
        gdO = cute.local_tile(tdO[None, None, h, b], (BLOCK, D), (None, 0))
        tKs, tKg = cute.nvgpu.cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sKV, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cute.nvgpu.cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sKV, 0, 2), cute.group_modes(gV, 0, 2))
        tQs, tQg = cute.nvgpu.cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQdO, 0, 2), cute.group_modes(gQ, 0, 2))
        tdOs, tdOg = cute.nvgpu.cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sQdO, 0, 2),
                                                      cute.group_modes(gdO, 0, 2))
        loads = dict(tma_q=tma_q, tma_do=tma_do, tQs=tQs, tQg=tQg, tdOs=tdOs, tdOg=tdOg, sLSE=sLSE, sDelta=sDelta,
                     mLSE=mLSE, mDelta=mDelta, bar=qdo_full, b=b, h=h)

        # fragments
        thr_s = mma_s.get_slice(tidx)
        thr_kv = mma_kv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        tSrKV = mma_s.make_fragment_A(thr_s.partition_A(sKV))          # [.., 0] K, [.., 1] V
        tSrQdO = mma_s.make_fragment_B(thr_s.partition_B(sQdO))        # [.., 2s] Q, [.., 2s + 1] dO
        tKVrQdO_t = mma_kv.make_fragment_B(thr_kv.partition_B(_transposed(sQdO)))  # Q^T, dO^T
        tDQrdS = mma_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tDQrK_t = mma_dq.make_fragment_B(thr_dq.partition_B(_transposed(sKV)))   # [.., 0] K^T
        tSsdS = thr_s.partition_C(_transposed(sdS))                    # dS^T as the S accumulator holds it

        accS = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK, BLOCK)), cutlass.Float32)
        accdP = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK, BLOCK)), cutlass.Float32)
        accdK = cute.make_rmem_tensor(thr_kv.partition_shape_C((BLOCK, D)), cutlass.Float32)
        accdV = cute.make_rmem_tensor(thr_kv.partition_shape_C((BLOCK, D)), cutlass.Float32)
        accdQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((BLOCK, D)), cutlass.Float32)
        rP = cute.make_rmem_tensor(thr_kv.partition_shape_A((BLOCK, BLOCK)), dt)
        rdS = cute.make_rmem_tensor(thr_kv.partition_shape_A((BLOCK, BLOCK)), dt)
        assert cute.size(rP) == cute.size(accS)
        rP_as_S = cute.make_tensor(rP.iterator, accS.layout)
        rdS_as_S = cute.make_tensor(rdS.iterator, accS.layout)
        P = rows_cols(accS)
        dS = rows_cols(accdP)
        cS_rc = rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK, BLOCK))))
        n_rows = cute.size(P, mode=[0])
        n_cols = cute.size(P, mode=[1])
        stat = cute.make_rmem_tensor(cute.make_layout(n_cols), cutlass.Float32)  # lse2, then delta, per column
        accdK.fill(0.0)
        accdV.fill(0.0)
        # dK and dV accumulate over the whole list (the field is state of the TiledMma, not per call)
        mma_kv.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        cute.arch.sync_threads()  # barrier inits visible before any arrive / wait
        n = cutlass.min(cutlass.max(mInvNum[b, h, kvb], 0), cap)
        count = cutlass.min(cutlass.max(mKVCounts[kvb], 0), BLOCK)
        sel = mInvIdx[b, h, kvb, None]
        sList = self._list_window(st, sel, n, tidx, THREADS)
        if n > 0:
            if warp == 0:
                kv_full.arrive_and_expect_tx(0, 2 * self.tile_bytes)
                cute.copy(tma_k, tKg, tKs[None, 0], tma_bar_ptr=kv_full.get_barrier(0))
                cute.copy(tma_v, tVg, tKs[None, 1], tma_bar_ptr=kv_full.get_barrier(0))
                for s in cutlass.range_constexpr(S):
                    if s < n:
                        self._load_q_tile(loads, self._clamp(self._entry(sel, sList, s), n_q), s)
            kv_full.wait(0, 0)
            last = cutlass.Int32(-1)
            for j in cutlass.range(n, unroll=1):
                s = j % S
                entry = self._entry(sel, sList, j)
                qb = self._clamp(entry, n_q)
                valid = cutlass.Int32(0)
                if (entry > last) & (entry < n_q):
                    last = entry
                    valid = count
                qdo_full.wait(s, (j // S) % 2)
                # S^T = K Q^T and dP^T = V dO^T, in flight together
                cute.nvgpu.warpgroup.fence()
                self._gemm_k(mma_s, accS, tSrKV, 0, tSrQdO, 2 * s)
                cute.nvgpu.warpgroup.commit_group()
                self._gemm_k(mma_s, accdP, tSrKV, 1, tSrQdO, 2 * s + 1)
                cute.nvgpu.warpgroup.commit_group()
                if cutlass.const_expr(not self.dq_red):
                    # the previous query block's slot, once its dQ reduction has read it, takes block j - 1 + S
                    if warp == 0:
                        if j >= 1 and j - 1 + S < n:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                            self._refill(loads, sel, sList, j - 1 + S, n_q, (j - 1) % S)
                elif cutlass.const_expr(not self.dk_overlap):
                    # every warp's GEMMs of step j - 1 retired (their wait_group(0)): the slot of step
                    # j - 1 takes block j - 1 + S, and sdS may be overwritten (WAR on dQ_{j-1}'s reads)
                    if j >= 1:
                        cute.arch.barrier(barrier_id=2, number_of_threads=THREADS)
                        if warp == 0:
                            if j - 1 + S < n:
                                self._refill(loads, sel, sList, j - 1 + S, n_q, (j - 1) % S)
                for ci in cutlass.range_constexpr(n_cols):
                    lse2 = sLSE[cS_rc[0, ci][1], s] * LOG2_E
                    if lse2 == -cutlass.Float32.inf:  # a row that saw nothing: P = 0
                        lse2 = cutlass.Float32.inf
                    stat[ci] = lse2
                cute.nvgpu.warpgroup.wait_group(1)
                if cutlass.const_expr(self.dk_overlap):
                    # S_j retired, so did dK_{j-1} before it (groups retire in order): in every warp
                    # after this barrier, the slot of step j - 1 is free (dV_{j-1}, dK_{j-1} read it)
                    # and so is sdS (dQ_{j-1} retired at step j - 1)
                    if j >= 1:
                        cute.arch.barrier(barrier_id=2, number_of_threads=THREADS)
                        if warp == 0:
                            if j - 1 + S < n:
                                self._refill(loads, sel, sList, j - 1 + S, n_q, (j - 1) % S)
                # P^T; KV rows past the count (all of them for a skipped entry) are exactly 0
                for ri in cutlass.range_constexpr(n_rows):
                    row_ok = cS_rc[ri, 0][0] < valid
                    for ci in cutlass.range_constexpr(n_cols):
                        p = cute.math.exp2(cute.math.fma(P[ri, ci], c, -stat[ci]), fastmath=True)
                        P[ri, ci] = p if row_ok else cutlass.Float32(0.0)
                rP_as_S.store(accS.load().to(dt))
                # dV += P^T dO
                cute.nvgpu.warpgroup.fence()
                cute.gemm(mma_kv, accdV, rP, tKVrQdO_t[None, None, None, 2 * s + 1], accdV)
                cute.nvgpu.warpgroup.commit_group()
                for ci in cutlass.range_constexpr(n_cols):
                    stat[ci] = sDelta[cS_rc[0, ci][1], s]
                cute.nvgpu.warpgroup.wait_group(1)
                # dS^T = P^T (dP^T - delta)
                for ri in cutlass.range_constexpr(n_rows):
                    for ci in cutlass.range_constexpr(n_cols):
                        dS[ri, ci] = P[ri, ci] * (dS[ri, ci] - stat[ci])
                rdS_as_S.store(accdP.load().to(dt))
                cute.autovec_copy(rdS_as_S, tSsdS)
                if cutlass.const_expr(not self.dk_overlap):
                    # dK += dS^T Q
                    cute.nvgpu.warpgroup.fence()
                    cute.gemm(mma_kv, accdK, rdS, tKVrQdO_t[None, None, None, 2 * s], accdK)
                    cute.nvgpu.warpgroup.commit_group()
                cute.arch.fence_view_async_shared()  # dS in shared memory, visible to the wgmma
                cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
                # dQ = dS K (this query block's part)
                cute.nvgpu.warpgroup.fence()
                self._gemm_k(mma_dq, accdQ, tDQrdS, None, tDQrK_t, 0)
                cute.nvgpu.warpgroup.commit_group()
                if cutlass.const_expr(self.dk_overlap):
                    # dK += dS^T Q, behind dQ: it runs while dQ goes out and under the next S / dP
                    cute.gemm(mma_kv, accdK, rdS, tKVrQdO_t[None, None, None, 2 * s], accdK)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)
                else:
                    cute.nvgpu.warpgroup.wait_group(0)
                if cutlass.const_expr(self.dq_red):
                    # this thread's dQ registers, four at a time, added at L2 into the workspace (the
                    # staging order: the postprocess is the same)
                    gAcc = cute.make_tensor(mDQacc[b, h, qb, None].iterator, _staging_layout(D))
                    rq = _regs_4(accdQ)
                    for k4 in cutlass.range_constexpr(cute.size(rq, mode=[1])):
                        _red_add_v4_f32(gAcc[None, k4, tidx].iterator, rq[0, k4], rq[1, k4], rq[2, k4], rq[3, k4])
                else:
                    # every warp's GEMMs that read the slot have retired: it becomes the dQ staging
                    cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
                    cute.autovec_copy(_regs_4(accdQ), sStage[None, None, tidx, s])
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
                    if warp == 0:
                        with cute.arch.elect_one():
                            _bulk_reduce_add_f32(sStage[None, None, 0, s].iterator,
                                                 mDQacc[b, h, qb, None].iterator, BLOCK * D * 4)
                        cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.dk_overlap):
                cute.nvgpu.warpgroup.wait_group(0)  # the last dK
            if cutlass.const_expr(not self.dq_red):
                if warp == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory outlives the reductions

        # epilogue: dK (scaled) and dV straight to global memory
        gdK = cute.local_tile(gdK4[None, None, h, b], (BLOCK, D), (kvb, 0))
        gdV = cute.local_tile(gdV4[None, None, h, b], (BLOCK, D), (kvb, 0))
        rOut = cute.make_rmem_tensor_like(accdK, dt)
        if cutlass.const_expr(self.pool_grads):  # VSA: + the pooling gradients, one rounding
            cKV_rc = rows_cols(thr_kv.partition_C(cute.make_identity_tensor((BLOCK, D))))
            n_kv = mKVCounts[kvb]
            _pooling_grad(mdKPool[b, h, kvb, None], n_kv, self.ignore_padding, rows_cols(accdK), cKV_rc, scale)
            _pooling_grad(mdVPool[b, h, kvb, None], n_kv, self.ignore_padding, rows_cols(accdV), cKV_rc,
                          cutlass.Float32(1.0))
            rOut.store(accdK.load().to(dt))
        else:
            rOut.store((accdK.load() * scale).to(dt))
        cute.autovec_copy(rOut, thr_kv.partition_C(gdK))
        rOut.store(accdV.load().to(dt))
        cute.autovec_copy(rOut, thr_kv.partition_C(gdV))

    # ---- helpers ----------------------------------------------------------------------------------
    @cute.jit
    def _clamp(self, entry, n_blocks):
        """An entry clamped into [0, n_blocks): always safe to address (a skipped entry is masked)."""
        return cutlass.min(cutlass.max(entry, 0), n_blocks - 1)

    def _load_barriers(self, st, warp, atoms):
        """The K / V and the Q / dO ring's transaction mbarriers; warp 0 prefetches the TMA descriptors
        (called while the kernel is traced)."""
        by_tma = (pipeline.PipelineOp.TmaLoad, pipeline.CooperativeGroup(pipeline.Agent.Thread))
        kv_full = pipeline.MbarrierArray(st.kv_full.data_ptr(), num_stages=1, agent=by_tma)
        qdo_full = pipeline.MbarrierArray(st.qdo_full.data_ptr(), num_stages=self.stages, agent=by_tma)
        self._prefetch(warp, atoms)
        return kv_full, qdo_full

    @cute.jit
    def _prefetch(self, warp, atoms):
        if warp == 0:
            with cute.arch.elect_one():
                for atom in atoms:
                    cute.nvgpu.cpasync.prefetch_descriptor(atom)

    def _shared_tensors(self, st, sKV_layout, sQdO_layout, sdS_layout):
        """(K / V, the Q / dO ring, dS, lse, delta) in shared memory (called while the kernel is traced)."""
        S = self.stages
        return (st.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner),
                st.sQdO.get_tensor(sQdO_layout.outer, swizzle=sQdO_layout.inner),
                st.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner),
                st.sLSE.get_tensor(cute.make_layout((BLOCK, S))), st.sDelta.get_tensor(cute.make_layout((BLOCK, S))))

    @cute.jit
    def _list_window(self, st, sel, n, tidx, threads: cutlass.Constexpr):
        """list_in_smem: the list's first LIST_WINDOW entries copied to shared memory by the CTA's
        `threads` threads (then visible to all); the list itself otherwise (a placeholder, not read)."""
        window = sel
        if cutlass.const_expr(self.list_in_smem):
            window = st.sList.get_tensor(cute.make_layout(LIST_WINDOW))
            for i in cutlass.range_constexpr((LIST_WINDOW + threads - 1) // threads):
                if i * threads + tidx < cutlass.min(n, LIST_WINDOW):
                    window[i * threads + tidx] = sel[i * threads + tidx]
            cute.arch.sync_threads()
        return window

    @cute.jit
    def _refill(self, loads, sel, sList, j, n_q, s):
        """Stage s takes the query block of list entry j."""
        self._load_q_tile(loads, self._clamp(self._entry(sel, sList, j), n_q), s)

    @cute.jit
    def _entry(self, sel, sList, j):
        """List entry j (j < the clamped count): from the shared-memory window with list_in_smem."""
        entry = cutlass.Int32(0)
        if cutlass.const_expr(self.list_in_smem):
            if j < LIST_WINDOW:
                entry = sList[j]
            else:
                entry = sel[j]
        else:
            entry = sel[j]
        return entry

    @cute.jit
    def _gemm_k(self, mma, acc, rA, a_slot, rB, b_slot):
        """acc = A B over the k blocks (a fresh accumulator); a_slot None: A has no slot mode."""
        for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
            mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb != 0)
            if cutlass.const_expr(a_slot is None):
                cute.gemm(mma, acc, rA[None, None, kb], rB[None, None, kb, b_slot], acc)
            else:
                cute.gemm(mma, acc, rA[None, None, kb, a_slot], rB[None, None, kb, b_slot], acc)

    @cute.jit
    def _load_q_tile(self, loads, qb, s):
        """Query block qb's Q, dO tiles and its 64 lse / delta values into stage s (one mbarrier)."""
        bar = loads["bar"]
        bar.arrive_and_expect_tx(s, 2 * self.tile_bytes + 2 * BLOCK * 4)
        policy = loads.get("policy")  # an L2 policy for Q / dO (split kernel, l2_hints), or None
        tma_load(loads["tma_q"], loads["tQg"][None, qb], loads["tQs"][None, 2 * s], bar.get_barrier(s), policy)
        tma_load(loads["tma_do"], loads["tdOg"][None, qb], loads["tdOs"][None, 2 * s + 1], bar.get_barrier(s), policy)
        b, h = loads["b"], loads["h"]
        with cute.arch.elect_one():
            for name, smem in (("mLSE", "sLSE"), ("mDelta", "sDelta")):
                g = cute.local_tile(loads[name][b, h, None], (BLOCK,), (qb,))
                _bulk_g2s(g.iterator, loads[smem][None, s].iterator, bar.get_barrier(s), BLOCK * 4)


class DqPostprocess:
    """dq = scale * dq_accum in the input dtype, any strides: one CTA per query block, each thread
    reading back its own dQ accumulator registers (the backward's staging order) and storing them
    through the same accumulator partition. pool_grads (VSA): + dq_pool / q_count over the block's
    rows (its valid rows only with ignore_padding)."""

    def __init__(self, dtype=cutlass.BFloat16, head_dim: int = 128, pool_grads: bool = False,
                 ignore_padding: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.pool_grads = pool_grads
        self.ignore_padding = ignore_padding

    @cute.jit
    def __call__(self, mDQacc: cute.Tensor, mdQ: cute.Tensor, mdQPool: cute.Tensor, mQCounts: cute.Tensor,
                 softmax_scale: cutlass.Float32, stream):
        """dq_pool [B, H, nQ, D] fp32 and q_counts [nQ] int32 with pool_grads (placeholders otherwise)."""
        D = self.head_dim
        mma_dq = _dq_mma(self.dtype, D)
        grid = (mDQacc.shape[2], mdQ.shape[1], mdQ.shape[0])
        self.kernel(mDQacc, _tok_major(mdQ, D, 8), mdQPool, mQCounts, mma_dq, softmax_scale).launch(
            grid=grid, block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mDQacc: cute.Tensor, gdQ4: cute.Tensor, mdQPool: cute.Tensor, mQCounts: cute.Tensor,
               mma_dq: cute.TiledMma, scale: cutlass.Float32):
        D = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        qb, h, b = cute.arch.block_idx()
        thr = mma_dq.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((BLOCK, D)), cutlass.Float32)
        src = cute.make_tensor(mDQacc[b, h, qb, None].iterator, _staging_layout(D))
        cute.autovec_copy(src[None, None, tidx], _regs_4(acc))
        out = cute.make_rmem_tensor_like(acc, self.dtype)
        if cutlass.const_expr(self.pool_grads):
            c_rc = rows_cols(thr.partition_C(cute.make_identity_tensor((BLOCK, D))))
            _pooling_grad(mdQPool[b, h, qb, None], mQCounts[qb], self.ignore_padding, rows_cols(acc), c_rc, scale)
            out.store(acc.load().to(self.dtype))
        else:
            out.store((acc.load() * scale).to(self.dtype))
        gdQ = cute.local_tile(gdQ4[None, None, h, b], (BLOCK, D), (qb, 0))
        cute.autovec_copy(out, thr.partition_C(gdQ))
