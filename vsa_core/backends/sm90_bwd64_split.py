"""The 64-token backward on sm_90 with its GEMMs split over two cooperating warpgroups (CuTe DSL):
a variant of `sm90_bwd64.BlockSparseBwd64Sm90` (same contract, same arguments, same dQ workspace and
postprocess), chosen by `prepare_backward64(..., split=True)`.

Why: the one-warpgroup kernel runs two CTAs per SM (251 registers a thread), each a serial chain
S -> P -> dV -> dS -> dQ -> dK per query block, so a warpgroup's elementwise work (exp2, dS) leaves the
tensor pipe to the other CTA only. Here one CTA (384 threads, one per SM) owns the KV block, and the
five GEMMs of a (query block, KV block) pair go to two warpgroups that run a pair apart:
  warpgroup 1: S^T = K Q^T, P^T = exp2(S^T c - lse2) (rows past the KV count 0), P^T in fp32 to shared
    memory for warpgroup 2, dV += P^T dO (register A);
  warpgroup 2: dP^T = V dO^T, dS^T = P^T (dP^T - delta) (P^T read back from shared memory in the
    accumulator's own thread order: both warpgroups' m64n64 accumulators give thread t the same
    elements), dQ = dS K (dS through shared memory, as in the one-warpgroup kernel), dK += dS^T Q,
    dQ added into the workspace by red.global.add.v4.f32 from its registers (dq_bulk: staged in shared
    memory for the producer's warp 1, which sends it as one bulk reduction).
  warpgroup 0, warp 0: every TMA load (K and V once a tile; per list entry Q, dO, lse, delta into a ring of
    `stages` slots behind "empty" mbarriers that both compute warpgroups' warps arrive on, 8 per fill).
P^T travels in fp32, so dS (and with it dK, dQ) is the one-warpgroup kernel's arithmetic exactly:
dk and dv stay bitwise equal to the Triton backward's.

Ordering. Slot j % stages holds query block j. Warpgroup 1 at step j: waits for the slot, issues S_j,
waits for dV_{j-1} (then releases slot j - 1: S_{j-1} and dV_{j-1} were its reads of it) and for S_j,
forms P_j, waits on named barrier P_FREE[j % 2] (warpgroup 2 has read P_{j-2} from P buffer j % 2;
not at j < 2), writes P_j there, arrives on P_READY[j % 2], issues dV_j. Warpgroup 2 at step j: waits
for the slot, issues dP_j, waits for dK_{j-1} (then releases slot j - 1: its reads were dP_{j-1},
dK_{j-1}; dQ_{j-1} retired before its reductions) and for dP_j, waits on P_READY[j % 2], forms dS_j,
arrives on P_FREE[j % 2] (only where step j + 2 exists, so every arrival has its wait), stores dS_j for
dQ (sdS is free: dQ_{j-1} retired), issues dQ_j and dK_j, waits for dQ_j and sends it.
Two P buffers, and a barrier pair per buffer: with one, ptxas moved most of the exp2s below the
P_FREE wait (they feed the stores behind it), so warpgroup 1's softmax waited for warpgroup 2's dS
of the step before. A named barrier counts threads, so each buffer needs its own pair: one side
cannot arrive twice on a pair before the other side's wait (its next arrival there needs the other
side's next arrival on the other barrier of the pair). The producer fills entry j once both
warpgroups released entry j - stages, which each does at its step j - stages + 1 <= n - 1: every wait
is met without a cycle (warpgroup 1 runs at most two entries ahead of warpgroup 2, through P_FREE).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper_helpers

from .sm90_bwd64 import (BLOCK, LIST_WINDOW, LOG2_E, MAJOR_K, BlockSparseBwd64Sm90, SmemAllocator, _bulk_reduce_add_f32,
                         _pooling_grad, _red_add_v4_f32, _regs_4, _staging_layout, _transposed)
from .sm90_bwd64_groups import RING_CHUNKS, group_count
from .sm90_common import EVICT_FIRST, EVICT_LAST, rows_cols, tma_load

WG = 128            # threads per warpgroup
P_READY, P_FREE, DS_STORED = (1, 2), (4, 5), 3  # named barriers (0 is sync_threads); P_*: per P buffer
DQ_FULL, DQ_EMPTY = 6, 7  # dq_bulk: warpgroup 2 <-> the producer's warp 1, 128 + 32 threads
GROUP_SYNC = (8, 9)       # query groups: warpgroup 1 (dV), warpgroup 2 (dK) around their partial sums
TILE_DONE = 10            # persistent: warpgroups 1 and 2 at the end of each tile's steps
SCAN_LOADS = 4            # `_group_range`: list entries a lane loads before it compares any


def _regs_8(regs: cute.Tensor) -> cute.Tensor:
    """16-bit registers in storage order as (8, chunk): 16 bytes a chunk."""
    v = cute.size(regs)
    return cute.make_tensor(regs.iterator, cute.make_layout((8, v // 8), stride=(1, 8)))


class KVOperand(NamedTuple):
    """K or V as the A operand of S^T / dP^T (`_kv_operand`): `fragment` and `slot` for `_gemm_k`;
    in registers, `copy` fills the fragment from `source` through `dest` (its retiled view)."""
    fragment: Any
    slot: Optional[int]
    copy: Any = None
    source: Any = None
    dest: Any = None


@cute.jit
def _wait_count(counter, target):
    """Spin until the int32 at `counter` reaches `target` (acquire: what its adders stored before
    their release is visible after)."""
    seen = cute.arch.load(counter, cutlass.Int32, sem="acquire", scope="gpu")
    while seen < target:
        seen = cute.arch.load(counter, cutlass.Int32, sem="acquire", scope="gpu")


class BlockSparseBwd64Sm90Split(BlockSparseBwd64Sm90):
    """One compiled configuration of the split backward: element type, head dim, Q / dO ring depth,
    the pooling gradients (VSA) as in the one-warpgroup kernel."""

    def __init__(self, dtype=cutlass.BFloat16, head_dim: int = 128, stages: int = 3, pool_grads: bool = False,
                 ignore_padding: bool = False, list_in_smem: bool = False, dq_bulk: bool = False,
                 q_group_blocks: int = 0, persistent: bool = False, k_in_regs: bool = False,
                 v_in_regs: bool = False, p_early: bool = False, p_rounded: bool = False, l2_hints: bool = False):
        # stages >= 2: entry j's fill waits for both warpgroups' release of entry j - stages, which
        # warpgroup 1 gives at its step j - stages + 1 (one slot would be a cycle)
        assert stages >= 2, "the split backward needs 2 Q / dO slots at least"
        super().__init__(dtype, head_dim, stages, ctas_per_sm=1, dq_red=True, dk_overlap=True,
                         pool_grads=pool_grads, ignore_padding=ignore_padding, list_in_smem=list_in_smem)
        # dQ leaves through a shared-memory staging buffer: warpgroup 2 stores its registers there and
        # the producer's warp 1 sends one 32 KiB cp.reduce.async.bulk per pair (cuDNN's blk64 split), in
        # place of 16 red.global.add.v4 a thread on warpgroup 2 (the busier one)
        self.dq_bulk = dq_bulk
        # query groups (sm90_bwd64's module docstring, "Query groups"): at most this many query blocks
        # per CTA's part of a list; 0: one CTA walks the whole list
        assert not (q_group_blocks and list_in_smem), "query groups read the list from global memory"
        self.q_group_blocks = q_group_blocks
        # persistent: a grid of at most `chunk` CTAs, each taking tiles (KV block, group) from a
        # counter in tile order until none is left (`_next_tile`): the next tile's first Q / dO
        # tiles and its K / V load run under the current tile's last steps and epilogue
        assert not (persistent and list_in_smem), "the list window is filled once per CTA"
        self.persistent = persistent
        # warpgroup 1's S^T = K Q^T with K from registers, warpgroup 2's dP^T = V dO^T with V (ldmatrix
        # once a tile, register-A wgmmas): their shared-memory reads leave the steps, which read Q / dO,
        # P and dS there as well
        self.k_in_regs, self.v_in_regs = k_in_regs, v_in_regs
        # warpgroup 2 waits for P and reads it while its dP is in flight (not after): the wait and the
        # loads leave the path from dP retiring to dS
        self.p_early = p_early
        # P handed to warpgroup 2 in the input dtype, rounded as dV takes it (half P's shared-memory
        # bytes; dS = P (dP - delta) then takes the rounded P, as cuDNN's blk64 backward does)
        self.p_rounded = p_rounded
        # Q / dO TMA loads kept in L2 (evict_last: every KV block of the group reads them), K / V
        # evict_first (each read by one CTA)
        self.l2_hints = l2_hints
        # setmaxnreg budgets: 128 * (24 + 2 * 240) = 64,512 of the SM's 65,536 registers
        self.producer_regs, self.mma_regs = 24, 240

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mDQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mInvIdx: cute.Tensor, mInvNum: cute.Tensor, mKVCounts: cute.Tensor,
                 mdKPool: cute.Tensor, mdVPool: cute.Tensor, mPartial: cute.Tensor, mFlags: cute.Tensor,
                 softmax_scale: cutlass.Float32, chunk: cutlass.Int32, stream):
        """The arguments of `BlockSparseBwd64Sm90.__call__`."""
        S = self.stages
        dt = self.dtype
        o = self._operands(mQ, mK, mV, mdO, mdK, mdV)
        sKV_layout, sQdO_layout, sdS_layout = o["sKV_layout"], o["sQdO_layout"], o["sdS_layout"]
        p_elems = 2 * BLOCK * BLOCK  # P^T of a pair, thread-ordered: two buffers
        p_dtype = dt if self.p_rounded else cutlass.Float32
        list_len = LIST_WINDOW * int(self.list_in_smem) + 4 * int(not self.list_in_smem)  # (no `if`: traced)
        dq_floats = BLOCK * self.head_dim * int(self.dq_bulk) + 4 * int(not self.dq_bulk)

        @cute.struct
        class Storage:
            kv_full: cute.struct.MemRange[cutlass.Int64, 1]
            kv_empty: cute.struct.MemRange[cutlass.Int64, 1]      # persistent only
            tile_full: cute.struct.MemRange[cutlass.Int64, 2]     # persistent only: the tile handoff
            tile_empty: cute.struct.MemRange[cutlass.Int64, 2]
            qdo_full: cute.struct.MemRange[cutlass.Int64, S]
            qdo_empty: cute.struct.MemRange[cutlass.Int64, S]
            sTile: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 2], 16]
            sLSE: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK * S], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, BLOCK * S], 128]
            sP: cute.struct.Align[cute.struct.MemRange[p_dtype, p_elems], 128]
            sKV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKV_layout)], 1024]
            sQdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]
            sList: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, list_len], 16]
            sdQ: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, dq_floats], 128]

        self.storage = Storage
        self.smem_bytes = Storage.size_in_bytes()
        groups = 1
        if cutlass.const_expr(self.q_group_blocks > 0):
            groups = group_count(mDQacc.shape[2], self.q_group_blocks)
        grid = (mInvIdx.shape[2] * groups, mQ.shape[1], mQ.shape[0])
        if cutlass.const_expr(self.persistent):
            grid = (cutlass.min(chunk, mInvIdx.shape[2] * groups * mQ.shape[1] * mQ.shape[0]), 1, 1)
        mma_s2, mma_kv2, _ = self._mmas()  # warpgroup 2's own
        mma_s1 = o["mma_s"]
        if cutlass.const_expr(self.k_in_regs):
            mma_s1 = self._mma_s_registers()
        if cutlass.const_expr(self.v_in_regs):
            mma_s2 = self._mma_s_registers()
        self.kernel(o["tQ"], o["tdO"], o["tK"], o["tV"], o["tma_q"], o["tma_do"], o["tma_k"], o["tma_v"], mLSE,
                    mDelta, mDQacc, o["gdK4"], o["gdV4"], mInvIdx, mInvNum, mKVCounts, mdKPool, mdVPool, mPartial,
                    mFlags, mma_s1, o["mma_kv"], mma_s2, mma_kv2, o["mma_dq"], sKV_layout, sQdO_layout,
                    sdS_layout, softmax_scale * LOG2_E, softmax_scale, chunk).launch(
            grid=grid, block=(3 * WG, 1, 1), smem=Storage.size_in_bytes(), stream=stream, min_blocks_per_mp=1,
            preferred_smem_carveout=100)

    def _mma_s_registers(self):
        """S^T / dP^T's m64n64 wgmma with its A operand (K / V) from registers."""
        dt = self.dtype
        return hopper_helpers.make_trivial_tiled_mma(dt, dt, MAJOR_K, MAJOR_K, cutlass.Float32, (1, 1, 1),
                                                     tiler_mn=(BLOCK, BLOCK),
                                                     a_source=cute.nvgpu.warpgroup.OperandSource.RMEM)

    @cute.kernel
    def kernel(self, tQ: cute.Tensor, tdO: cute.Tensor, tK: cute.Tensor, tV: cute.Tensor,
               tma_q: cute.CopyAtom, tma_do: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mDQacc: cute.Tensor, gdK4: cute.Tensor, gdV4: cute.Tensor,
               mInvIdx: cute.Tensor, mInvNum: cute.Tensor, mKVCounts: cute.Tensor,
               mdKPool: cute.Tensor, mdVPool: cute.Tensor, mPartial: cute.Tensor, mFlags: cute.Tensor,
               mma_s: cute.TiledMma, mma_kv: cute.TiledMma, mma_s2: cute.TiledMma, mma_kv2: cute.TiledMma,
               mma_dq: cute.TiledMma, sKV_layout: cute.ComposedLayout, sQdO_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, c: cutlass.Float32, scale: cutlass.Float32, chunk: cutlass.Int32):
        S = self.stages
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4
        t = tidx % WG
        x, y, z = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        n_q = mDQacc.shape[2]
        groups = cutlass.Int32(1)
        if cutlass.const_expr(self.q_group_blocks > 0):
            groups = group_count(n_q, self.q_group_blocks)
        # the work: tiles (KV block, group) of every head, in `_tile`'s order within a head
        w = dict(n_q=n_q, n_kv=mInvIdx.shape[2], groups=groups, heads=mInvNum.shape[1], chunk=chunk,
                 inv_idx=mInvIdx, inv_num=mInvNum, partial=mPartial, flags=mFlags,
                 n_tiles=mInvIdx.shape[2] * groups * mInvNum.shape[1] * mInvNum.shape[0],
                 block_tile=x + gx * (y + gy * z))

        st = SmemAllocator().allocate(self.storage)
        kv_full, qdo_full = self._load_barriers(st, warp, (tma_q, tma_do, tma_k, tma_v))
        release = (pipeline.PipelineOp.AsyncThread, pipeline.CooperativeGroup(pipeline.Agent.Thread, 8))
        qdo_empty = pipeline.MbarrierArray(st.qdo_empty.data_ptr(), num_stages=S, agent=release)
        kv_empty = qdo_empty  # (not persistent: K / V are loaded once, never released)
        hand = None
        if cutlass.const_expr(self.persistent):
            kv_empty = pipeline.MbarrierArray(st.kv_empty.data_ptr(), num_stages=1, agent=release)
            one = (pipeline.PipelineOp.AsyncThread, pipeline.CooperativeGroup(pipeline.Agent.Thread, 1))
            readers = (pipeline.PipelineOp.AsyncThread,
                       pipeline.CooperativeGroup(pipeline.Agent.Thread, 8 + int(self.dq_bulk)))
            hand = dict(full=pipeline.MbarrierArray(st.tile_full.data_ptr(), num_stages=2, agent=one),
                        empty=pipeline.MbarrierArray(st.tile_empty.data_ptr(), num_stages=2, agent=readers),
                        tile=st.sTile.get_tensor(cute.make_layout(2)),
                        counter=mFlags[mFlags.shape[0] - 1, None].iterator)

        sKV, sQdO, sdS, sLSE, sDelta = self._shared_tensors(st, sKV_layout, sQdO_layout, sdS_layout)
        v = BLOCK * BLOCK // WG  # accumulator registers of an m64n64 tile per thread
        if cutlass.const_expr(self.p_rounded):
            # thread t's 8 registers 8k..8k+7 at (k * 128 + t) * 8: a warp stores / loads 512
            # consecutive bytes per 16-byte access
            sP = st.sP.get_tensor(cute.make_layout((8, v // 8, WG, 2), stride=(1, 8 * WG, 8, v * WG)))
        else:
            # thread t's register i at i * 128 + t: a warp's 32 threads store / load 32 consecutive words
            sP = st.sP.get_tensor(cute.make_layout((v, WG, 2), stride=(WG, 1, v * WG)))
        sdQ = st.sdQ.get_tensor(_staging_layout(self.head_dim)) if cutlass.const_expr(self.dq_bulk) else sP
        cute.arch.sync_threads()  # barrier inits visible before any arrive / wait
        window = mInvIdx[0, 0, 0, None]  # (a placeholder without list_in_smem, never read)
        if cutlass.const_expr(self.list_in_smem):  # one tile per CTA, no groups: its list's window
            kvb0, _, h0, b0, _, _, _, n0 = self._work(w["block_tile"], w)
            window = self._list_window(st, mInvIdx[b0, h0, kvb0, None], n0, tidx, 3 * WG)
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                self._produce(tQ, tdO, tK, tV, tma_q, tma_do, tma_k, tma_v, mLSE, mDelta, sKV, sQdO, sLSE,
                              sDelta, kv_full, kv_empty, qdo_full, qdo_empty, window, dict(w), self._own(hand))
            if cutlass.const_expr(self.dq_bulk):
                if warp == 1:
                    self._send_dq(sdQ, mDQacc, window, dict(w), self._own(hand))
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            if wg == 1:
                self._s_and_dv(t, window, kv_full, kv_empty, qdo_full, qdo_empty, sKV, sQdO, sLSE, sP, mma_s, mma_kv,
                               gdV4, mKVCounts, mdVPool, c, dict(w), self._own(hand))
            else:
                self._dp_dq_dk(t, window, kv_full, kv_empty, qdo_full, qdo_empty, sKV, sQdO, sdS, sDelta, sP, sdQ,
                               mma_s2, mma_kv2, mma_dq, mDQacc, gdK4, mKVCounts, mdKPool, scale, dict(w),
                               self._own(hand))

    # ---- the tiles ------------------------------------------------------------------------------------
    @staticmethod
    def _own(hand):
        """A role's own copy of the handoff's table: the tracer rebinds the values of a table a staged
        loop reads in place, so roles sharing one would see each other's loop values."""
        return None if hand is None else dict(hand)

    @cute.jit
    def _next_tile(self, k, w, hand, producer: cutlass.Constexpr):
        """This CTA's k-th tile (>= w["n_tiles"]: none left). Not persistent: the block's own tile, then
        none. Persistent: the producer's warp 0 takes the next tile index from the counter and hands it
        to the CTA's other roles through a 2-slot buffer in shared memory (`producer`), which read it
        there (each warp arrives on the slot's "empty" barrier once it has). Tiles are taken in tile
        order, and only by running CTAs, so every tile a CTA waits for (`_join_groups`) is held by a
        running CTA, whatever the grid size."""
        tile = w["n_tiles"]
        if cutlass.const_expr(not self.persistent):
            if k == 0:
                tile = w["block_tile"]
        else:
            slot = k % 2
            if cutlass.const_expr(producer):
                if k >= 2:  # the slot's tile of two handoffs ago has been read by every warp
                    hand["empty"].wait(slot, (k // 2 + 1) % 2)
                got = cutlass.Int32(0)
                if cute.arch.lane_idx() == 0:
                    got = cute.arch.atomic_add(hand["counter"], cutlass.Int32(1), sem="relaxed", scope="gpu")
                    hand["tile"][slot] = got
                    cute.arch.mbarrier_arrive(hand["full"].get_barrier(slot))
                tile = cute.arch.shuffle_sync(got, 0)
            else:
                hand["full"].wait(slot, (k // 2) % 2)
                tile = hand["tile"][slot]
                self._release(hand["empty"], slot)
        return tile

    @cute.jit
    def _work(self, tile, w):
        """(KV block, group, head, batch, the group's query blocks [first, end), and where in the KV
        block's list the group's entries start and how many they are) of tile `tile`."""
        per_head = w["n_kv"] * w["groups"]
        bh = tile // per_head
        x = tile - bh * per_head
        h = bh % w["heads"]
        b = bh // w["heads"]
        n_q = w["n_q"]
        kvb, g, first, end = x, cutlass.Int32(0), cutlass.Int32(0), n_q
        if cutlass.const_expr(self.q_group_blocks > 0):
            size = (n_q + w["groups"] - 1) // w["groups"]
            kvb, g = self._tile(x, w["n_kv"], w["groups"], w["chunk"])
            first = g * size
            end = cutlass.min(first + size, n_q)
        n = cutlass.min(cutlass.max(w["inv_num"][b, h, kvb], 0), w["inv_idx"].shape[3])
        lo = cutlass.Int32(0)
        if cutlass.const_expr(self.q_group_blocks > 0):
            if w["groups"] > 1:
                lo, n = self._group_range(w["inv_idx"][b, h, kvb, None], n, n_q, first, end)
        return kvb, g, h, b, first, end, lo, n

    @cute.jit
    def _list(self, w, kvb, h, b, lo):
        """The tile's part of its KV block's list, as a list (entry 0 at `lo`)."""
        return cute.domain_offset((lo,), w["inv_idx"][b, h, kvb, None])

    # ---- query groups -------------------------------------------------------------------------------
    @cute.jit
    def _tile(self, x, n_kv, groups, chunk):
        """(KV block, group) of CTA x. The grid runs in chunks of `chunk` KV blocks (the CTAs resident
        at once), each chunk once per group in group order: the CTAs running together share one
        group's query blocks (the working set the groups exist for), a KV block's last group starts
        about one chunk after its first (the partial sums it adds are still in L2), and every CTA a
        group waits for (`_join_groups`) has a lower block index (launched before it: it cannot wait
        for a CTA that has no SM)."""
        per_chunk = groups * chunk
        c = x // per_chunk
        base = c * chunk
        width = cutlass.min(chunk, n_kv - base)
        within = x - c * per_chunk
        g = within // width
        return base + within - g * width, g

    @cute.jit
    def _group_range(self, sel, n, n_q, first, end):
        """(start, count) of the group's part of the list (its first n entries): from the first entry
        in [first, n_q) to the first in [end, n_q). Under the list rule the counted entries ascend,
        so the group's counted entries are all in that span, and the first entry in [first, n_q) is
        counted (every in-range entry before it is smaller); inside the span the walk applies the rule
        with the group's bounds (an entry counts if in [first, end) and above the last counted one),
        which counts what the rule over the whole list does. Every warp finds it on its own (no
        barrier). Each lane issues SCAN_LOADS loads (clamped into the list) before it compares any,
        so a round of 32 * SCAN_LOADS entries waits for one trip to L2, not SCAN_LOADS."""
        lane = cute.arch.lane_idx()
        per_round = 32 * SCAN_LOADS
        lo = n
        hi = n
        got = cute.make_rmem_tensor(cute.make_layout(SCAN_LOADS), cutlass.Int32)
        for i in cutlass.range((n + per_round - 1) // per_round, unroll=1):
            base = i * per_round + lane
            for r in cutlass.range_constexpr(SCAN_LOADS):
                got[r] = sel[cutlass.min(base + r * 32, n - 1)]
            for r in cutlass.range_constexpr(SCAN_LOADS):
                p = base + r * 32
                e = got[r]
                if p < n:
                    if (e >= first) & (e < n_q):
                        lo = cutlass.min(lo, p)
                    if (e >= end) & (e < n_q):
                        hi = cutlass.min(hi, p)
        lo = cute.arch.warp_redux_sync(lo, "min")
        hi = cute.arch.warp_redux_sync(hi, "min")
        return lo, hi - lo

    @cute.jit
    def _join_groups(self, acc, w, g, which: cutlass.Constexpr, kvb, h, b, t):
        """The KV block's other groups' fp32 partial dV (which 0) or dK (1) added to this warpgroup's
        `acc`, in group order (the same sum every run). True for the CTA that writes the gradient
        (the last group's).

        The partial sums go through a ring of R slots (`partial`, thread-ordered as `_staging_layout`),
        one counter per slot in `flags`: KV block u (numbered over batch, head and KV block) uses slot
        u % R in its generation k = u // R. R is RING_CHUNKS * chunk, or fewer where `flags` has fewer
        rows (head_sweep: one head's KV blocks, the chunk; the last group of the KV block in the head
        before has a lower block index).
        A group before the last waits for the count k * groups (the slot's previous generation read),
        stores its sums and counts itself; the last group waits for k * groups + groups - 1 (every
        partial of its generation stored), adds them and counts itself, freeing the slot. Every wait
        is for CTAs of lower block index (`_tile`; the previous generation's block is two chunks'
        width back, so in an earlier chunk)."""
        D = self.head_dim
        groups, partial, flags, chunk = w["groups"], w["partial"], w["flags"], w["chunk"]
        u = (b * w["heads"] + h) * w["n_kv"] + kvb
        ring = cutlass.min(flags.shape[0] - 1, RING_CHUNKS * chunk)
        ring_slot = u % ring
        base = (u // ring) * groups
        counter = flags[ring_slot, None].iterator + which
        v = BLOCK * D // WG
        slots = cute.make_tensor(partial.iterator, cute.make_layout(
            (4, v // 4, WG, partial.shape[0] // (BLOCK * D)), stride=(1, 4 * WG, 4, BLOCK * D)))
        regs = _regs_4(acc)
        barrier = GROUP_SYNC[which]
        if g < groups - 1:
            if t == 0:
                _wait_count(counter, base)
            cute.arch.barrier(barrier_id=barrier, number_of_threads=WG)
            cute.autovec_copy(regs, slots[None, None, t, (ring_slot * (groups - 1) + g) * 2 + which])
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=barrier, number_of_threads=WG)
            if t == 0:
                cute.arch.atomic_add(counter, cutlass.Int32(1), sem="release", scope="gpu")
        else:
            if t == 0:
                _wait_count(counter, base + groups - 1)
            cute.arch.barrier(barrier_id=barrier, number_of_threads=WG)
            cute.arch.fence_acq_rel_gpu()
            part = cute.make_rmem_tensor(regs.layout, cutlass.Float32)
            for gi in cutlass.range(groups - 1, unroll=1):
                cute.autovec_copy(slots[None, None, t, (ring_slot * (groups - 1) + gi) * 2 + which], part)
                for i in cutlass.range_constexpr(cute.size(part)):
                    regs[i] = regs[i] + part[i]
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=barrier, number_of_threads=WG)
            if t == 0:
                cute.arch.atomic_add(counter, cutlass.Int32(1), sem="release", scope="gpu")
        return g == groups - 1

    # ---- warpgroup 0, warp 0: the loads -----------------------------------------------------------
    @cute.jit
    def _produce(self, tQ, tdO, tK, tV, tma_q, tma_do, tma_k, tma_v, mLSE, mDelta, sKV, sQdO, sLSE, sDelta,
                 kv_full, kv_empty, qdo_full, qdo_empty, window, w, hand):
        """Per tile: K and V, then per list entry Q, dO, lse, delta into the ring (entry `filled` of the
        CTA into slot filled % stages). Persistent: the tile's first stages - 1 entries go in before its
        K / V, whose buffer the tile before may still be reading (their slots free up at that tile's
        last steps)."""
        S = self.stages
        D = self.head_dim
        one = cute.make_layout(1)
        n_q = w["n_q"]
        filled = cutlass.Int32(0)  # ring entries filled by this CTA
        kv_loads = cutlass.Int32(0)  # tiles whose K / V this CTA loaded
        k = cutlass.Int32(0)
        tile = self._next_tile(k, w, hand, True)
        while tile < w["n_tiles"]:
            kvb, _, h, b, _, _, lo, n = self._work(tile, w)
            if n > 0:
                sel = self._list(w, kvb, h, b, lo)
                gK = cute.local_tile(tK[None, None, h, b], (BLOCK, D), (kvb, 0))
                gV = cute.local_tile(tV[None, None, h, b], (BLOCK, D), (kvb, 0))
                gQ = cute.local_tile(tQ[None, None, h, b], (BLOCK, D), (None, 0))
                gdO = cute.local_tile(tdO[None, None, h, b], (BLOCK, D), (None, 0))
                tKs, tKg = cute.nvgpu.cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sKV, 0, 2),
                                                            cute.group_modes(gK, 0, 2))
                tVs, tVg = cute.nvgpu.cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sKV, 0, 2),
                                                            cute.group_modes(gV, 0, 2))
                tQs, tQg = cute.nvgpu.cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQdO, 0, 2),
                                                            cute.group_modes(gQ, 0, 2))
                tdOs, tdOg = cute.nvgpu.cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sQdO, 0, 2),
                                                              cute.group_modes(gdO, 0, 2))
                loads = dict(tma_q=tma_q, tma_do=tma_do, tQs=tQs, tQg=tQg, tdOs=tdOs, tdOg=tdOg, sLSE=sLSE,
                             sDelta=sDelta, mLSE=mLSE, mDelta=mDelta, bar=qdo_full, b=b, h=h,
                             policy=EVICT_LAST if self.l2_hints else None)
                kv_policy = EVICT_FIRST if self.l2_hints else None
                ahead = 0
                if cutlass.const_expr(self.persistent):
                    ahead = cutlass.min(n, S - 1)
                    for j in cutlass.range(ahead, unroll=1):
                        filled = self._fill(loads, sel, window, j, filled, qdo_empty, n_q)
                    if kv_loads > 0:  # both compute warpgroups are done with the tile before's K / V
                        kv_empty.wait(0, (kv_loads - 1) % 2)
                kv_full.arrive_and_expect_tx(0, 2 * self.tile_bytes)
                tma_load(tma_k, tKg, tKs[None, 0], kv_full.get_barrier(0), kv_policy)
                tma_load(tma_v, tVg, tVs[None, 1], kv_full.get_barrier(0), kv_policy)
                kv_loads += 1
                for j in cutlass.range(ahead, n, unroll=1):
                    filled = self._fill(loads, sel, window, j, filled, qdo_empty, n_q)
            k += 1
            tile = self._next_tile(k, w, hand, True)

    @cute.jit
    def _fill(self, loads, sel, window, j, filled, qdo_empty, n_q):
        """List entry j's query block into the ring's next slot (once both compute warpgroups released
        the entry `stages` before it); returns the count of entries filled."""
        S = self.stages
        qb = self._clamp(self._entry(sel, window, j), n_q)  # read before the wait: its latency under it
        if filled >= S:
            qdo_empty.wait(filled % S, (filled // S + 1) % 2)
        self._load_q_tile(loads, qb, filled % S)
        return filled + 1

    # ---- warpgroup 0, warp 1 (dq_bulk): dQ out ------------------------------------------------------
    @cute.jit
    def _send_dq(self, sdQ, mDQacc, window, w, hand):
        """Per list entry: wait for warpgroup 2's staged dQ, add it into the workspace by one bulk
        reduction, and free the staging once the reduction has read it (warpgroup 2 waits for that
        before its next staging store; after the CTA's last one it waits once more, so every arrival
        has its wait)."""
        n_q = w["n_q"]
        k = cutlass.Int32(0)
        tile = self._next_tile(k, w, hand, False)
        while tile < w["n_tiles"]:
            kvb, _, h, b, _, _, lo, n = self._work(tile, w)
            sel = self._list(w, kvb, h, b, lo)
            for j in cutlass.range(n, unroll=1):
                qb = self._clamp(self._entry(sel, window, j), n_q)
                cute.arch.barrier(barrier_id=DQ_FULL, number_of_threads=WG + 32)
                with cute.arch.elect_one():
                    _bulk_reduce_add_f32(sdQ[None, None, 0].iterator, mDQacc[b, h, qb, None].iterator,
                                         BLOCK * self.head_dim * 4)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY, number_of_threads=WG + 32)
            k += 1
            tile = self._next_tile(k, w, hand, False)

    @cute.jit
    def _release(self, bar, slot):
        """This warp's arrival on an "empty" mbarrier: its wgmmas reading the slot have retired."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(bar.get_barrier(slot))

    def _kv_operand(self, mma, thr, sKV, slot: int, in_regs: bool, t) -> KVOperand:
        """K (slot 0) or V (slot 1) as the A operand of S^T = K Q^T / dP^T = V dO^T: the shared-memory
        descriptors' fragment, or in_regs a register fragment that `_load_kv_operand` fills once a tile."""
        if not in_regs:
            return KVOperand(mma.make_fragment_A(thr.partition_A(sKV)), slot)
        dt = self.dtype
        ldmatrix = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dt)
        copy = cute.make_tiled_copy_A(ldmatrix, mma).get_slice(t)
        regs = cute.make_rmem_tensor(thr.partition_shape_A((BLOCK, self.head_dim)), dt)
        return KVOperand(regs, None, copy, copy.partition_S(sKV[None, None, slot]), copy.retile(regs))

    @cute.jit
    def _load_kv_operand(self, a: KVOperand):
        """A register operand: this tile's K or V from shared memory (K / V full; the wgmmas reading the
        registers of the tile before all retired). Nothing for a shared-memory one."""
        if cutlass.const_expr(a.copy is not None):
            cute.copy(a.copy, a.source, a.dest)

    # ---- warpgroup 1: S^T, P^T, dV ----------------------------------------------------------------
    @cute.jit
    def _s_and_dv(self, t, window, kv_full, kv_empty, qdo_full, qdo_empty, sKV, sQdO, sLSE, sP, mma_s, mma_kv,
                  gdV4, mKVCounts, mdVPool, c, w, hand):
        S = self.stages
        D = self.head_dim
        dt = self.dtype
        thr_s = mma_s.get_slice(t)
        thr_kv = mma_kv.get_slice(t)
        tSrQdO = mma_s.make_fragment_B(thr_s.partition_B(sQdO))        # [.., 2s] Q
        a_K = self._kv_operand(mma_s, thr_s, sKV, 0, self.k_in_regs, t)  # K for S^T
        tKVrQdO_t = mma_kv.make_fragment_B(thr_kv.partition_B(_transposed(sQdO)))  # [.., 2s + 1] dO^T
        accS = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK, BLOCK)), cutlass.Float32)
        accdV = cute.make_rmem_tensor(thr_kv.partition_shape_C((BLOCK, D)), cutlass.Float32)
        rP = cute.make_rmem_tensor(thr_kv.partition_shape_A((BLOCK, BLOCK)), dt)
        rP_as_S = cute.make_tensor(rP.iterator, accS.layout)
        flatS = cute.make_tensor(accS.iterator, cute.make_layout(cute.size(accS)))
        P = rows_cols(accS)
        cS_rc = rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK, BLOCK))))
        n_rows = cute.size(P, mode=[0])
        n_cols = cute.size(P, mode=[1])
        stat = cute.make_rmem_tensor(cute.make_layout(n_cols), cutlass.Float32)
        mma_kv.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        used = cutlass.Int32(0)      # ring entries this CTA has used
        kv_loads = cutlass.Int32(0)  # tiles whose K / V this CTA used
        k = cutlass.Int32(0)
        tile = self._next_tile(k, w, hand, False)
        while tile < w["n_tiles"]:
            kvb, g, h, b, first, end, lo, n = self._work(tile, w)
            count = cutlass.min(cutlass.max(mKVCounts[kvb], 0), BLOCK)
            accdV.fill(0.0)
            if n > 0:
                sel = self._list(w, kvb, h, b, lo)
                kv_full.wait(0, kv_loads % 2)
                self._load_kv_operand(a_K)
                last = first - 1  # the list rule inside the group's query blocks [first, end)
                for j in cutlass.range(n, unroll=1):
                    e = used + j
                    s = e % S
                    entry = self._entry(sel, window, j)
                    valid = cutlass.Int32(0)
                    if (entry > last) & (entry < end):
                        last = entry
                        valid = count
                    qdo_full.wait(s, (e // S) % 2)
                    cute.nvgpu.warpgroup.fence()
                    self._gemm_k(mma_s, accS, a_K.fragment, a_K.slot, tSrQdO, 2 * s)
                    cute.nvgpu.warpgroup.commit_group()
                    for ci in cutlass.range_constexpr(n_cols):
                        lse2 = sLSE[cS_rc[0, ci][1], s] * LOG2_E
                        if lse2 == -cutlass.Float32.inf:  # a row that saw nothing: P = 0
                            lse2 = cutlass.Float32.inf
                        stat[ci] = lse2
                    cute.nvgpu.warpgroup.wait_group(1)  # dV_{j-1} retired: this warpgroup is done with slot j - 1
                    if j >= 1:
                        self._release(qdo_empty, (e - 1) % S)
                    cute.nvgpu.warpgroup.wait_group(0)
                    for ri in cutlass.range_constexpr(n_rows):
                        row_ok = cS_rc[ri, 0][0] < valid
                        for ci in cutlass.range_constexpr(n_cols):
                            p = cute.math.exp2(cute.math.fma(P[ri, ci], c, -stat[ci]), fastmath=True)
                            P[ri, ci] = p if row_ok else cutlass.Float32(0.0)
                    pb = j % 2
                    if cutlass.const_expr(self.p_rounded):  # rounded before the wait: off its path
                        rP_as_S.store(accS.load().to(dt))
                    if j >= 2:  # P_{j-2} was read from buffer pb
                        cute.arch.barrier(barrier_id=P_FREE[0] + pb * (P_FREE[1] - P_FREE[0]),
                                          number_of_threads=2 * WG)
                    if cutlass.const_expr(self.p_rounded):
                        rP8 = _regs_8(rP)
                        for i in cutlass.range_constexpr(cute.size(rP8, mode=[1])):
                            cute.autovec_copy(rP8[None, i], sP[None, i, t, pb])
                    else:
                        for i in cutlass.range_constexpr(cute.size(flatS)):
                            sP[i, t, pb] = flatS[i]
                    cute.arch.barrier_arrive(barrier_id=P_READY[0] + pb * (P_READY[1] - P_READY[0]),
                                             number_of_threads=2 * WG)
                    if cutlass.const_expr(not self.p_rounded):
                        rP_as_S.store(accS.load().to(dt))
                    cute.nvgpu.warpgroup.fence()
                    cute.gemm(mma_kv, accdV, rP, tKVrQdO_t[None, None, None, 2 * s + 1], accdV)
                    cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                used, kv_loads = self._tile_done(qdo_empty, kv_empty, used, n, kv_loads)
            if cutlass.const_expr(self.persistent):  # warpgroup 2 has read this tile's P (buffers free)
                cute.arch.barrier(barrier_id=TILE_DONE, number_of_threads=2 * WG)
            self._write_kv_grad(accdV, 0, thr_kv, gdV4, mdVPool, mKVCounts, kvb, g, h, b, t, w, cutlass.Float32(1.0))
            k += 1
            tile = self._next_tile(k, w, hand, False)

    @cute.jit
    def _tile_done(self, qdo_empty, kv_empty, used, n, kv_loads):
        """A compute warpgroup's wgmmas of a tile of n entries all retired: persistent, its release of the
        tile's last ring slot and of K / V (not persistent the CTA ends: nothing waits for them).
        Returns the updated (ring entries used, K / V tiles used)."""
        if cutlass.const_expr(self.persistent):
            self._release(qdo_empty, (used + n - 1) % self.stages)
            self._release(kv_empty, 0)
        return used + n, kv_loads + 1

    @cute.jit
    def _write_kv_grad(self, acc, which: cutlass.Constexpr, thr_kv, gOut4, mPool, mKVCounts, kvb, g, h, b, t, w,
                       scale):
        """The epilogue of dV (which 0, scale 1) or dK (which 1, the softmax scale) from this warpgroup's
        fp32 accumulator: the other query groups' partial sums joined (`_join_groups`; only the last
        group's CTA goes on), the pooling gradient added (VSA; one rounding), stored in the input dtype."""
        D = self.head_dim
        writes = cutlass.Boolean(True)
        if cutlass.const_expr(self.q_group_blocks > 0):
            if w["groups"] > 1:
                writes = self._join_groups(acc, w, g, which, kvb, h, b, t)
        if writes:
            gOut = cute.local_tile(gOut4[None, None, h, b], (BLOCK, D), (kvb, 0))
            rOut = cute.make_rmem_tensor_like(acc, self.dtype)
            if cutlass.const_expr(self.pool_grads):
                cKV_rc = rows_cols(thr_kv.partition_C(cute.make_identity_tensor((BLOCK, D))))
                _pooling_grad(mPool[b, h, kvb, None], mKVCounts[kvb], self.ignore_padding, rows_cols(acc), cKV_rc,
                              scale)
                rOut.store(acc.load().to(self.dtype))
            elif cutlass.const_expr(which == 1):
                rOut.store((acc.load() * scale).to(self.dtype))
            else:
                rOut.store(acc.load().to(self.dtype))
            cute.autovec_copy(rOut, thr_kv.partition_C(gOut))

    # ---- warpgroup 2: dP^T, dS^T, dQ, dK ----------------------------------------------------------
    @cute.jit
    def _take_p(self, sP, rPf, rPr, pb, t):
        """Wait until P_j is in buffer pb and read it: into rPf (fp32), or p_rounded into rPr."""
        cute.arch.barrier(barrier_id=P_READY[0] + pb * (P_READY[1] - P_READY[0]), number_of_threads=2 * WG)
        if cutlass.const_expr(self.p_rounded):
            r8 = _regs_8(rPr)
            for i in cutlass.range_constexpr(cute.size(r8, mode=[1])):
                cute.autovec_copy(sP[None, i, t, pb], r8[None, i])
        else:
            flat = cute.make_tensor(rPf.iterator, cute.make_layout(cute.size(rPf)))
            for i in cutlass.range_constexpr(cute.size(flat)):
                flat[i] = sP[i, t, pb]

    @cute.jit
    def _dp_dq_dk(self, t, window, kv_full, kv_empty, qdo_full, qdo_empty, sKV, sQdO, sdS, sDelta, sP, sdQ, mma_s,
                  mma_kv, mma_dq, mDQacc, gdK4, mKVCounts, mdKPool, scale, w, hand):
        S = self.stages
        D = self.head_dim
        dt = self.dtype
        n_q = w["n_q"]
        thr_s = mma_s.get_slice(t)
        thr_kv = mma_kv.get_slice(t)
        thr_dq = mma_dq.get_slice(t)
        tSrQdO = mma_s.make_fragment_B(thr_s.partition_B(sQdO))        # [.., 2s + 1] dO
        a_V = self._kv_operand(mma_s, thr_s, sKV, 1, self.v_in_regs, t)  # V for dP^T
        tKVrQdO_t = mma_kv.make_fragment_B(thr_kv.partition_B(_transposed(sQdO)))  # [.., 2s] Q^T
        tDQrdS = mma_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tDQrK_t = mma_dq.make_fragment_B(thr_dq.partition_B(_transposed(sKV)))   # [.., 0] K^T
        tSsdS = thr_s.partition_C(_transposed(sdS))                    # dS^T as the accumulator holds it
        accdP = cute.make_rmem_tensor(thr_s.partition_shape_C((BLOCK, BLOCK)), cutlass.Float32)
        accdK = cute.make_rmem_tensor(thr_kv.partition_shape_C((BLOCK, D)), cutlass.Float32)
        accdQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((BLOCK, D)), cutlass.Float32)
        rdS = cute.make_rmem_tensor(thr_kv.partition_shape_A((BLOCK, BLOCK)), dt)
        rdS_as_S = cute.make_tensor(rdS.iterator, accdP.layout)
        rPf = cute.make_rmem_tensor_like(accdP)  # P^T as warpgroup 1 formed it, in the same register order
        rPr = cute.make_rmem_tensor_like(accdP, dt)  # p_rounded: as it came, in the input dtype
        Pf = rows_cols(rPf)
        cS_rc = rows_cols(thr_s.partition_C(cute.make_identity_tensor((BLOCK, BLOCK))))
        n_cols = cute.size(rows_cols(accdP), mode=[1])
        stat = cute.make_rmem_tensor(cute.make_layout(n_cols), cutlass.Float32)
        mma_kv.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        dS = rows_cols(accdP)
        used = cutlass.Int32(0)      # ring entries this CTA has used (and dQ tiles it has sent)
        kv_loads = cutlass.Int32(0)  # tiles whose K / V this CTA used
        k = cutlass.Int32(0)
        tile = self._next_tile(k, w, hand, False)
        while tile < w["n_tiles"]:
            kvb, g, h, b, _, _, lo, n = self._work(tile, w)
            accdK.fill(0.0)
            if n > 0:
                sel = self._list(w, kvb, h, b, lo)
                kv_full.wait(0, kv_loads % 2)
                self._load_kv_operand(a_V)
                for j in cutlass.range(n, unroll=1):
                    e = used + j
                    s = e % S
                    qb = self._clamp(self._entry(sel, window, j), n_q)
                    qdo_full.wait(s, (e // S) % 2)
                    cute.nvgpu.warpgroup.fence()
                    self._gemm_k(mma_s, accdP, a_V.fragment, a_V.slot, tSrQdO, 2 * s + 1)
                    cute.nvgpu.warpgroup.commit_group()
                    for ci in cutlass.range_constexpr(n_cols):
                        stat[ci] = sDelta[cS_rc[0, ci][1], s]
                    cute.nvgpu.warpgroup.wait_group(1)  # dK_{j-1} retired: this warpgroup is done with slot j - 1
                    if j >= 1:
                        self._release(qdo_empty, (e - 1) % S)
                    pb = j % 2
                    if cutlass.const_expr(self.p_early):  # under dP_j
                        self._take_p(sP, rPf, rPr, pb, t)
                    cute.nvgpu.warpgroup.wait_group(0)
                    if cutlass.const_expr(not self.p_early):
                        self._take_p(sP, rPf, rPr, pb, t)
                    if cutlass.const_expr(self.p_rounded):
                        rPf.store(rPr.load().to(cutlass.Float32))
                    for ri in cutlass.range_constexpr(cute.size(dS, mode=[0])):
                        for ci in cutlass.range_constexpr(n_cols):
                            dS[ri, ci] = Pf[ri, ci] * (dS[ri, ci] - stat[ci])
                    if j + 2 < n:
                        cute.arch.barrier_arrive(barrier_id=P_FREE[0] + pb * (P_FREE[1] - P_FREE[0]),
                                                 number_of_threads=2 * WG)
                    rdS_as_S.store(accdP.load().to(dt))
                    cute.autovec_copy(rdS_as_S, tSsdS)  # dQ_{j-1}, its last reader, retired at step j - 1
                    cute.arch.fence_view_async_shared()  # dS in shared memory, visible to the wgmma
                    cute.arch.barrier(barrier_id=DS_STORED, number_of_threads=WG)
                    cute.nvgpu.warpgroup.fence()
                    self._gemm_k(mma_dq, accdQ, tDQrdS, None, tDQrK_t, 0)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.gemm(mma_kv, accdK, rdS, tKVrQdO_t[None, None, None, 2 * s], accdK)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)  # dQ_j; dK_j runs on under the next dP
                    rq = _regs_4(accdQ)
                    if cutlass.const_expr(self.dq_bulk):
                        if e >= 1:  # the reduction of the entry before has read the staging
                            cute.arch.barrier(barrier_id=DQ_EMPTY, number_of_threads=WG + 32)
                        cute.autovec_copy(rq, sdQ[None, None, t])
                        cute.arch.fence_view_async_shared()  # visible to the bulk reduction (async proxy)
                        cute.arch.barrier_arrive(barrier_id=DQ_FULL, number_of_threads=WG + 32)
                    else:
                        gAcc = cute.make_tensor(mDQacc[b, h, qb, None].iterator, _staging_layout(D))
                        for k4 in cutlass.range_constexpr(cute.size(rq, mode=[1])):
                            _red_add_v4_f32(gAcc[None, k4, t].iterator, rq[0, k4], rq[1, k4], rq[2, k4], rq[3, k4])
                cute.nvgpu.warpgroup.wait_group(0)  # the last dK
                used, kv_loads = self._tile_done(qdo_empty, kv_empty, used, n, kv_loads)
            if cutlass.const_expr(self.persistent):  # this tile's P all read: warpgroup 1 may reuse the buffers
                cute.arch.barrier(barrier_id=TILE_DONE, number_of_threads=2 * WG)
            self._write_kv_grad(accdK, 1, thr_kv, gdK4, mdKPool, mKVCounts, kvb, g, h, b, t, w, scale)
            k += 1
            tile = self._next_tile(k, w, hand, False)
        if cutlass.const_expr(self.dq_bulk):
            if used > 0:  # the last reduction has read the staging (the arrival every send makes)
                cute.arch.barrier(barrier_id=DQ_EMPTY, number_of_threads=WG + 32)
