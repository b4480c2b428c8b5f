"""Compiles each variant of our sm_90 64-token-block forward (vsa_core/backends/sm90_fwd64.py) for
sm_90a on the CPU (no GPU needed) and prints ptxas's registers / spills and the shared memory.

    mkdir -p /tmp/cute-dump
    CUTE_DSL_ARCH=sm_90a python benchmarks/sm90_fwd64_compile.py [variant ...]

(a python with nvidia-cutlass-dsl 4.8.1; CUTE_DSL_ARCH is set here when missing). Shapes and strides are
symbolic (fake tensors), so one compile covers every B, H, S, list capacity and layout.
"""

from __future__ import annotations

import io
import os
import re
import sys
import time
import contextlib
import traceback

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor  # noqa: E402


def _load_module():
    """The kernel module by path: vsa_core.backends' __init__ imports Triton, which this compile-only
    environment need not have."""
    import importlib.util
    path = os.path.join(os.path.dirname(HERE), "vsa_core", "backends", "sm90_fwd64.py")
    spec = importlib.util.spec_from_file_location("sm90_fwd64", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BlockSparseFwd64Sm90 = _load_module().BlockSparseFwd64Sm90

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
    "ws-c3-k1v2": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True),
    "ws-c2-k2v2-vsa": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, has_coarse=True,
                           has_gate=True, store_fine=True),
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
}


def fake_args(dtype, D):
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
    out_fine = make_fake_tensor(cutlass.Float32, (B, H, S, D), (i32(), i32(), i32(), 1), assumed_align=4)
    NG, UCAP = i32(), i32()
    union_idx, union_num = i32t((B, H, NG, UCAP)), i32t((B, H, NG))  # shared_kv (placeholders otherwise)
    return [q, k, v, o, lse, sel_idx, sel_num, kv_counts, q_counts, gate, out_c, out_fine, union_idx, union_num]


def compile_variant(name, kw):
    kernel = BlockSparseFwd64Sm90(**kw)
    args = fake_args(kw.get("dtype", cutlass.BFloat16), kw.get("head_dim", 128))
    buf = io.StringIO()
    t = time.time()
    # ptxas's report goes to the process's stderr (fd 2): capture it through a pipe
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        with contextlib.redirect_stdout(buf):
            cute.compile(kernel, *args, cutlass.Float32(0.088), make_fake_stream(use_tvm_ffi_env_stream=False),
                         options="--gpu-arch sm_90a remarks{ptx}")
    finally:
        os.dup2(saved, 2)
        os.close(w)
        err = os.read(r, 1 << 20).decode(errors="replace")
        os.close(r)
    text = buf.getvalue() + err
    regs = re.findall(r"Used (\d+) registers", text)
    spill_st = re.findall(r"(\d+) bytes spill stores", text)
    spill_ld = re.findall(r"(\d+) bytes spill loads", text)
    stack = re.findall(r"(\d+) bytes stack frame", text)
    return dict(seconds=time.time() - t, regs=regs, spill_stores=spill_st, spill_loads=spill_ld, stack=stack,
                smem=kernel.smem_bytes, ctas_per_sm=kernel.ctas_per_sm, report=text)


def main(argv):
    names = argv or list(VARIANTS)
    print(f"{'variant':22s} {'regs':>5s} {'spill st/ld':>12s} {'stack':>6s} {'smem KiB':>9s} {'CTAs/SM':>8s} {'s':>5s}")
    failed = 0
    for name in names:
        try:
            r = compile_variant(name, VARIANTS[name])
            print(f"{name:22s} {','.join(r['regs']):>5s} {','.join(r['spill_stores']) + '/' + ','.join(r['spill_loads']):>12s} "
                  f"{','.join(r['stack']):>6s} {r['smem'] / 1024:9.1f} {r['ctas_per_sm']:8d} {r['seconds']:5.1f}", flush=True)
            if os.environ.get("VERBOSE"):
                print(r["report"])
        except Exception as e:
            failed += 1
            print(f"{name:22s} FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
            if os.environ.get("VERBOSE"):
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
