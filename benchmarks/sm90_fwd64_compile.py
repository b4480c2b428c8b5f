"""Compiles each variant of our sm_90 64-token-block forward (vsa_core/backends/sm90_fwd64.py) for
sm_90a on the CPU (no GPU needed) and prints ptxas's registers / spills and the shared memory.

    mkdir -p /tmp/cute-dump
    CUTE_DSL_ARCH=sm_90a python benchmarks/sm90_fwd64_compile.py [variant ...]

(a python with nvidia-cutlass-dsl 4.8.1, numpy and triton; CUTE_DSL_ARCH is set here when missing). Shapes and strides are
symbolic (fake tensors), so one compile covers every B, H, S, list capacity and layout.
"""

from __future__ import annotations

import sys

from sm90_compile_report import compile_report, report_table

import cutlass  # noqa: E402  (after sm90_compile_report: it sets CUTE_DSL_ARCH)
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402

from vsa_core.backends.sm90_fwd64 import BlockSparseFwd64Sm90  # noqa: E402

VARIANTS = {
    # name: constructor arguments
    "simple-k1v2": dict(k_stages=1, v_stages=2),
    "simple-k2v2": dict(k_stages=2, v_stages=2),
    "simple-k1v2-d64": dict(k_stages=1, v_stages=2, head_dim=64),
    "simple-k1v2-fp16": dict(k_stages=1, v_stages=2, dtype=cutlass.Float16),
    "simple-k1v2-vsa": dict(k_stages=1, v_stages=2, has_coarse=True, has_gate=True, store_fine=True),
    "ws-c2-k2v2": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True),
    "ws-c2-k2v2-pingpong": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True),
    "simple-k2v2-qregs": dict(k_stages=2, v_stages=2, q_in_regs=True),
    "ws-c2-k2v2-qregs": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, q_in_regs=True),
    "ws-c2-k2v2-pp-qregs": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True,
                                q_in_regs=True),
    "simple-k1v2-lazy": dict(k_stages=1, v_stages=2, lazy_rescale=True),
    "ws-c2-k2v2-pp-lazy": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True,
                               lazy_rescale=True),
    "simple-k2v2-qregs-lazy": dict(k_stages=2, v_stages=2, q_in_regs=True, lazy_rescale=True),
    "ws-c2-k2v2-pp-qregs-lazy": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True,
                                     q_in_regs=True, lazy_rescale=True),
    "ws-c3-k1v2-lazy": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True),
    "ws-c3-k1v2-lazy-persistent": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                                       persistent_ctas=132),
    "ws-c3-k1v2-lazy-tma-store": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                                      tma_store=True),
    "ws-c3-k1v2-lazy-persistent-tma-store": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                                 lazy_rescale=True, persistent_ctas=132, tma_store=True),
    "ws-c3-k1v2-lazy-vsa-persistent": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                           lazy_rescale=True, has_coarse=True, has_gate=True, store_fine=True,
                                           persistent_ctas=132),
    "simple-k1v2-lazy-window": dict(k_stages=1, v_stages=2, lazy_rescale=True, list_in_smem=True),
    "ws-c3-k1v2-lazy-window": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                                   list_in_smem=True),
    "ws-c3-k1v2-lazy-window-vsa": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                       lazy_rescale=True, list_in_smem=True, has_coarse=True, has_gate=True,
                                       store_fine=True),
    "ws-c3-k1v2": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True),
    "ws-c2-k2v2-vsa": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, has_coarse=True,
                           has_gate=True, store_fine=True),
    # the sm90 backend's forward before tma_store, and (the -tma-store- rows) sm90_backend.FORWARD, in each
    # epilogue it runs with
    "ws-c3-k1v2-lazy-vsa": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                                has_coarse=True, has_gate=True, store_fine=True),
    "ws-c3-k1v2-lazy-vsa-nogate-inference": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                                 lazy_rescale=True, has_coarse=True),
    "ws-c3-k1v2-lazy-d64-fp16": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                                     head_dim=64, dtype=cutlass.Float16),
    "ws-c3-k1v2-lazy-tma-store-vsa": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                          lazy_rescale=True, tma_store=True, has_coarse=True, has_gate=True,
                                          store_fine=True),
    "ws-c3-k1v2-lazy-tma-store-vsa-nogate-inference": dict(k_stages=1, v_stages=2, consumers=3,
                                                           warp_specialized=True, lazy_rescale=True, tma_store=True,
                                                           has_coarse=True),
    "ws-c3-k1v2-lazy-tma-store-d64-fp16": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                               lazy_rescale=True, tma_store=True, head_dim=64,
                                               dtype=cutlass.Float16),
    # shared KV rings (one K and one V ring for the CTA, filled in union order)
    "ws-c2-k5v7-shared-lazy": dict(k_stages=5, v_stages=7, consumers=2, warp_specialized=True, lazy_rescale=True,
                                   shared_kv=True),
    "ws-c3-k4v7-shared-lazy": dict(k_stages=4, v_stages=7, consumers=3, warp_specialized=True, lazy_rescale=True,
                                   shared_kv=True),
    "ws-c3-k2v4-shared-lazy": dict(k_stages=2, v_stages=4, consumers=3, warp_specialized=True, lazy_rescale=True,
                                   shared_kv=True),
    "ws-c3-k1v1-shared": dict(k_stages=1, v_stages=1, consumers=3, warp_specialized=True, shared_kv=True),
    "ws-c3-k4v7-shared-vsa": dict(k_stages=4, v_stages=7, consumers=3, warp_specialized=True, lazy_rescale=True,
                                  shared_kv=True, has_coarse=True, has_gate=True, store_fine=True),
    # 2-CTA clusters, the tiles of a pair of neighbouring query blocks' shared blocks multicast
    "ws-c3-k1v2-lazy-tma-store-pairs": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                            lazy_rescale=True, tma_store=True, cluster_pairs=True),
    "ws-c3-k1v2-lazy-tma-store-pairs-vsa": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                                lazy_rescale=True, tma_store=True, cluster_pairs=True,
                                                has_coarse=True, has_gate=True, store_fine=True),
    # FORWARD with the load order and the L2 hints (q_first, v_first, consumer_k, l2_hints), VSA epilogue
    "ws-c3-k1v2-lazy-tma-store-vsa-rf-qvkh": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                                  lazy_rescale=True, tma_store=True, rescale_first=True,
                                                  has_coarse=True, has_gate=True, store_fine=True, q_first=True,
                                                  v_first=True, consumer_k=True, l2_hints=True),
    # FORWARD's VSA epilogue keeping out's rounding residual (AttnProblem.fine_residual "rounding")
    "ws-c3-k1v2-lazy-tma-store-vsa-rf-rounding": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                                      lazy_rescale=True, tma_store=True, rescale_first=True,
                                                      has_coarse=True, has_gate=True, store_fine=True,
                                                      fine_rounding=True),
    "ws-c3-k1v2-lazy-tma-store-nogate-rf-rounding-d64-fp16": dict(
        k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, tma_store=True,
        rescale_first=True, has_coarse=True, store_fine=True, fine_rounding=True, head_dim=64, dtype=cutlass.Float16),
    "simple-k1v2-lazy-tma-store-rf-hints": dict(k_stages=1, v_stages=2, lazy_rescale=True, tma_store=True,
                                                rescale_first=True, l2_hints=True),
    "ws-c3-k1v2-lazy-tma-store-rf-k": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                           lazy_rescale=True, tma_store=True, rescale_first=True, consumer_k=True),
    "ws-c3-k1v2-lazy-tma-store-rf": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                         lazy_rescale=True, tma_store=True, rescale_first=True),
    "ws-c3-k1v2-lazy-tma-store-vsa-rf": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                             lazy_rescale=True, tma_store=True, has_coarse=True, has_gate=True,
                                             store_fine=True, rescale_first=True),
    "ws-c3-k1v2-lazy-tma-store-pairs-rf": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                               lazy_rescale=True, tma_store=True, cluster_pairs=True,
                                               rescale_first=True),
    "ws-c3-k1v2-lazy-tma-store-rf-qregs": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                               lazy_rescale=True, tma_store=True, rescale_first=True,
                                               q_in_regs=True),
    "ws-c2-k2v2-pp-qregs-lazy-rf": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True,
                                        q_in_regs=True, lazy_rescale=True, rescale_first=True),
    "ws-c2-k2v2-qregs-lazy-tma-store-rf": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True,
                                               q_in_regs=True, lazy_rescale=True, tma_store=True,
                                               rescale_first=True),
    "ws-c2-k3v3-qregs-lazy-tma-store-rf": dict(k_stages=3, v_stages=3, consumers=2, warp_specialized=True,
                                               q_in_regs=True, lazy_rescale=True, tma_store=True,
                                               rescale_first=True),
    "ws-c3-k1v2-lazy-tma-store-qregs": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                            lazy_rescale=True, tma_store=True, q_in_regs=True),
    "ws-c3-k1v2-lazy-tma-store-pairs-qregs": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True,
                                                  lazy_rescale=True, tma_store=True, cluster_pairs=True,
                                                  q_in_regs=True),
    "ws-c2-k2v3-lazy-tma-store-pairs": dict(k_stages=2, v_stages=3, consumers=2, warp_specialized=True,
                                            lazy_rescale=True, tma_store=True, cluster_pairs=True),
}


def fake_args(dtype, D, fine_rounding=False):
    i32 = lambda: cute.sym_int32()  # noqa: E731
    div8 = lambda: cute.sym_int32(divisibility=8)  # noqa: E731
    B, H, S, SK, NQ, NKV, CAP = i32(), i32(), cute.sym_int32(divisibility=64), cute.sym_int32(divisibility=64), i32(), i32(), i32()

    def tok(seq):  # [B, H, S, D], any batch/head/token strides (multiples of 8), D contiguous
        return make_fake_tensor(dtype, (B, H, seq, D), (div8(), div8(), div8(), 1), assumed_align=16)

    def f32(shape):
        return make_fake_tensor(cutlass.Float32, shape, tuple(i32() for _ in shape[:-1]) + (1,), assumed_align=4)

    def i32t(shape):
        return make_fake_tensor(cutlass.Int32, shape, tuple(i32() for _ in shape[:-1]) + (1,), assumed_align=4)

    q, k, v, o = tok(S), tok(SK), tok(SK), tok(S)
    lse = f32((B, H, S))
    sel_idx, sel_num, kv_counts, q_counts = i32t((B, H, NQ, CAP)), i32t((B, H, NQ)), i32t((NKV,)), i32t((NQ,))
    gate = tok(S)
    out_c = f32((B, H, NQ, D))
    div4 = lambda: cute.sym_int32(divisibility=4)  # noqa: E731
    if fine_rounding:  # out's rounding residual, in the input dtype
        out_fine = make_fake_tensor(dtype, (B, H, S, D), (div8(), div8(), div8(), 1), assumed_align=16)
    else:
        out_fine = make_fake_tensor(cutlass.Float32, (B, H, S, D), (div4(), div4(), div4(), 1), assumed_align=16)
    NG, UCAP = i32(), i32()
    union_idx, union_num = i32t((B, H, NG, UCAP)), i32t((B, H, NG))  # shared_kv (placeholders otherwise)
    return [q, k, v, o, lse, sel_idx, sel_num, kv_counts, q_counts, gate, out_c, out_fine, union_idx, union_num]


def compile_variant(name, kw):
    kernel = BlockSparseFwd64Sm90(**kw)
    args = fake_args(kw.get("dtype", cutlass.BFloat16), kw.get("head_dim", 128), kw.get("fine_rounding", False))
    return compile_report(kernel, args)


def main(argv):
    return report_table(VARIANTS, compile_variant, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
