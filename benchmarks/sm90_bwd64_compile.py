"""Compiles each variant of our sm_90 64-token-block backward (vsa_core/backends/sm90_bwd64.py) and its
dQ postprocess for sm_90a on the CPU (no GPU needed) and prints ptxas's registers / spills and the
shared memory.

    mkdir -p /tmp/cute-dump
    CUTE_DSL_ARCH=sm_90a python benchmarks/sm90_bwd64_compile.py [variant ...]

(a python with nvidia-cutlass-dsl 4.8.1, numpy and triton; CUTE_DSL_ARCH is set here when missing). Shapes and strides are
symbolic (fake tensors), so one compile covers every B, H, S, list capacity and layout.
"""

from __future__ import annotations

import sys

from sm90_compile_report import compile_report, report_table

import cutlass  # noqa: E402  (after sm90_compile_report: it sets CUTE_DSL_ARCH)
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402

from vsa_core.backends import sm90_bwd64 as MOD  # noqa: E402
from vsa_core.backends import sm90_bwd64_launch  # noqa: E402

VARIANTS = {
    # name: constructor arguments
    "s2": dict(stages=2, dq_red=False, dk_overlap=False),
    "s3": dict(stages=3, dq_red=False, dk_overlap=False),
    "s2-d64": dict(stages=2, dq_red=False, dk_overlap=False, head_dim=64),
    "s2-fp16": dict(stages=2, dq_red=False, dk_overlap=False, dtype=cutlass.Float16),
    "red": dict(stages=2, dq_red=True, dk_overlap=False),
    "red-d64": dict(stages=2, dq_red=True, dk_overlap=False, head_dim=64),
    "red-fp16": dict(stages=2, dq_red=True, dk_overlap=False, dtype=cutlass.Float16),
    "redov": dict(stages=2),  # the default: dq_red + dk_overlap
    "redov-d64": dict(stages=2, head_dim=64),
    "redov-list": dict(stages=2, list_in_smem=True),
    "redov-list-pool": dict(stages=2, list_in_smem=True, pool_grads=True),
    "redov-fp16": dict(stages=2, dtype=cutlass.Float16),
    "redov-pool": dict(stages=2, pool_grads=True),  # the sm90 backend's VSA backward
    "redov-pool-ignore": dict(stages=2, pool_grads=True, ignore_padding=True),
    "split-s2": dict(split=True, stages=2),  # two cooperating warpgroups + a producer (sm90_bwd64_split)
    "split-s3": dict(split=True, stages=3),
    "split-s3-pool": dict(split=True, stages=3, pool_grads=True),
    "split-s3-list": dict(split=True, stages=3, list_in_smem=True),
    "split-s3-list-bulk": dict(split=True, stages=3, list_in_smem=True, dq_bulk=True),
    "split-s3-list-bulk-pool": dict(split=True, stages=3, list_in_smem=True, dq_bulk=True, pool_grads=True),
    "split-s3-d64": dict(split=True, stages=3, head_dim=64),
    "split-s3-bulk": dict(split=True, stages=3, dq_bulk=True),
    "split-s3-bulk-pool": dict(split=True, stages=3, dq_bulk=True, pool_grads=True),
    "split-s3-bulk-pool-ignore": dict(split=True, stages=3, dq_bulk=True, pool_grads=True, ignore_padding=True),
    "split-s3-bulk-d64": dict(split=True, stages=3, dq_bulk=True, head_dim=64),
    "split-s3-bulk-fp16": dict(split=True, stages=3, dq_bulk=True, dtype=cutlass.Float16),
    "split-s2-bulk": dict(split=True, stages=2, dq_bulk=True),
    # query groups (a 20 MiB working set per group)
    "split-s3-bulk-groups": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20),
    "split-s3-bulk-groups-pool": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20, pool_grads=True),
    # persistent: one CTA per SM taking tiles from a counter
    "split-s3-bulk-persist": dict(split=True, stages=3, dq_bulk=True, persistent=True),
    "split-s3-bulk-groups-persist": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20, persistent=True),
    "split-s3-bulk-groups-persist-pool": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20,
                                              persistent=True, pool_grads=True),
    "split-s3-bulk-groups-kregs": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20, k_in_regs=True),
    "split-s3-bulk-groups-kregs-pool": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20, k_in_regs=True,
                                            pool_grads=True),
    "split-s3-bulk-groups-vregs": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20, v_in_regs=True),
    "split-s3-bulk-groups-kvregs": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20, k_in_regs=True,
                                        v_in_regs=True),
    "split-s3-bulk-groups-kvregs-persist-pool": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=20 << 20,
                                                     k_in_regs=True, v_in_regs=True, persistent=True, pool_grads=True),
    "split-s3-groups-persist": dict(split=True, stages=3, q_group_bytes=20 << 20, persistent=True),
    "post": dict(postprocess=True),
    "post-d64": dict(postprocess=True, head_dim=64),
    "post-pool-ignore": dict(postprocess=True, pool_grads=True, ignore_padding=True),
    # head_sweep is the launch's chunk, not the build: the sweeping default builds as "kvpr" below
    "split-hints": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, l2_hints=True),
    "split-p-early": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, p_early=True),
    "split-p-rounded": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, p_rounded=True),
    # hints, p_early, p_rounded, K / V in registers: the sm90 backend's BACKWARD on branch kvpr
    "kvpr": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, k_in_regs=True, v_in_regs=True,
                 p_early=True, p_rounded=True, l2_hints=True),
    "kvpr-pool": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, k_in_regs=True, v_in_regs=True,
                      p_early=True, p_rounded=True, l2_hints=True, pool_grads=True),
    "kvpr-d64-pool": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, k_in_regs=True,
                          v_in_regs=True, p_early=True, p_rounded=True, l2_hints=True, pool_grads=True, head_dim=64),
    "kvpr-fp16-pool-ignore": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, k_in_regs=True,
                                  v_in_regs=True, p_early=True, p_rounded=True, l2_hints=True, pool_grads=True,
                                  ignore_padding=True, dtype=cutlass.Float16),
    "kvpr-persist-pool": dict(split=True, stages=3, dq_bulk=True, q_group_bytes=32 << 20, k_in_regs=True,
                              v_in_regs=True, p_early=True, p_rounded=True, l2_hints=True, persistent=True,
                              pool_grads=True),
}


def fake_args(dtype, D):
    i32 = lambda: cute.sym_int32()  # noqa: E731
    div8 = lambda: cute.sym_int32(divisibility=8)  # noqa: E731
    div4 = lambda: cute.sym_int32(divisibility=4)  # noqa: E731
    B, H, NQ, NKV, CAP = i32(), i32(), i32(), i32(), i32()
    S, SK = cute.sym_int32(divisibility=64), cute.sym_int32(divisibility=64)

    def tok(seq):  # [B, H, S, D], any batch/head/token strides (multiples of 8), D contiguous
        return make_fake_tensor(dtype, (B, H, seq, D), (div8(), div8(), div8(), 1), assumed_align=16)

    def i32t(shape):
        return make_fake_tensor(cutlass.Int32, shape, tuple(i32() for _ in shape[:-1]) + (1,), assumed_align=4)

    stat = lambda: make_fake_tensor(cutlass.Float32, (B, H, S), (div4(), div4(), 1), assumed_align=16)  # noqa: E731
    dq_acc = make_fake_tensor(cutlass.Float32, (B, H, NQ, 64 * D), (div4(), div4(), 64 * D, 1), assumed_align=16)
    pool = lambda n: make_fake_tensor(cutlass.Float32, (B, H, n, D), (i32(), i32(), i32(), 1), assumed_align=4)  # noqa: E731
    return dict(dq_pool=pool(NQ), k_pool=pool(NKV), v_pool=pool(NKV), q_counts=i32t((NQ,)),q=tok(S), k=tok(SK), v=tok(SK), do=tok(S), lse=stat(), delta=stat(), dq_acc=dq_acc, dk=tok(SK),
                dv=tok(SK), inv_idx=i32t((B, H, NKV, CAP)), inv_num=i32t((B, H, NKV)), kv_counts=i32t((NKV,)),
                dq=tok(S), partial=make_fake_tensor(cutlass.Float32, (i32(),), (1,), assumed_align=16),
                flags=i32t((i32(), 2)))


def compile_variant(name, kw):
    kw = dict(kw)
    post = kw.pop("postprocess", False)
    dtype, D = kw.get("dtype", cutlass.BFloat16), kw.get("head_dim", 128)
    a = fake_args(dtype, D)
    flags = {n: kw.pop(n) for n in ("pool_grads", "ignore_padding") if n in kw}
    if post:
        kernel = MOD.DqPostprocess(dtype, D, **flags)
        args = [a["dq_acc"], a["dq"], a["dq_pool"], a["q_counts"]]
    else:
        kw.pop("dtype", None), kw.pop("head_dim", None)
        kernel = sm90_bwd64_launch.backward_kernel(dtype, D, **kw, **flags)
        args = [a[n] for n in ("q", "k", "v", "do", "lse", "delta", "dq_acc", "dk", "dv", "inv_idx", "inv_num",
                               "kv_counts", "k_pool", "v_pool", "partial", "flags")]
        return compile_report(kernel, args, (cutlass.Float32(0.088), cutlass.Int32(132)))
    return compile_report(kernel, args)


def main(argv):
    return report_table(VARIANTS, compile_variant, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
