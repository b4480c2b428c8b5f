"""Compiles each variant of our sm_90 64-token-block backward (vsa_core/backends/sm90_bwd64.py) and its
dQ postprocess for sm_90a on the CPU (no GPU needed) and prints ptxas's registers / spills and the
shared memory.

    mkdir -p /tmp/cute-dump
    CUTE_DSL_ARCH=sm_90a python benchmarks/sm90_bwd64_compile.py [variant ...]

(a python with nvidia-cutlass-dsl 4.8.1; CUTE_DSL_ARCH is set here when missing). Shapes and strides are
symbolic (fake tensors), so one compile covers every B, H, S, list capacity and layout.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
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
    path = os.path.join(os.path.dirname(HERE), "vsa_core", "backends", "sm90_bwd64.py")
    spec = importlib.util.spec_from_file_location("sm90_bwd64", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MOD = _load_module()

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
    "redov-fp16": dict(stages=2, dtype=cutlass.Float16),
    "post": dict(postprocess=True),
    "post-d64": dict(postprocess=True, head_dim=64),
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
    return dict(q=tok(S), k=tok(SK), v=tok(SK), do=tok(S), lse=stat(), delta=stat(), dq_acc=dq_acc, dk=tok(SK),
                dv=tok(SK), inv_idx=i32t((B, H, NKV, CAP)), inv_num=i32t((B, H, NKV)), kv_counts=i32t((NKV,)),
                dq=tok(S))


def compile_variant(name, kw):
    kw = dict(kw)
    post = kw.pop("postprocess", False)
    dtype, D = kw.get("dtype", cutlass.BFloat16), kw.get("head_dim", 128)
    a = fake_args(dtype, D)
    if post:
        kernel = MOD.DqPostprocess(dtype, D)
        args = [a["dq_acc"], a["dq"]]
    else:
        kernel = MOD.BlockSparseBwd64Sm90(**kw)
        args = [a[n] for n in ("q", "k", "v", "do", "lse", "delta", "dq_acc", "dk", "dv", "inv_idx", "inv_num",
                               "kv_counts")]
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
    return dict(seconds=time.time() - t, regs=re.findall(r"Used (\d+) registers", text),
                spill_stores=re.findall(r"(\d+) bytes spill stores", text),
                spill_loads=re.findall(r"(\d+) bytes spill loads", text),
                stack=re.findall(r"(\d+) bytes stack frame", text),
                warnings=[ln for ln in text.splitlines() if "warning" in ln.lower()],
                smem=getattr(kernel, "smem_bytes", 0), ctas_per_sm=getattr(kernel, "ctas_per_sm", 0), report=text)


def main(argv):
    names = argv or list(VARIANTS)
    print(f"{'variant':10s} {'regs':>5s} {'spill st/ld':>12s} {'stack':>6s} {'smem KiB':>9s} {'CTAs/SM':>8s} {'s':>5s}")
    failed = 0
    for name in names:
        try:
            r = compile_variant(name, VARIANTS[name])
            print(f"{name:10s} {','.join(r['regs']):>5s} {','.join(r['spill_stores']) + '/' + ','.join(r['spill_loads']):>12s} "
                  f"{','.join(r['stack']):>6s} {r['smem'] / 1024:9.1f} {r['ctas_per_sm']:8d} {r['seconds']:5.1f}", flush=True)
            for wline in r["warnings"]:
                print(f"    {wline.strip()[:300]}")
            if os.environ.get("VERBOSE"):
                print(r["report"])
        except Exception as e:
            failed += 1
            print(f"{name:10s} FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
            if os.environ.get("VERBOSE"):
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
