"""What the sm_90 compile scripts (sm90_fwd64_compile.py, sm90_bwd64_compile.py) share: compiling one
CuTe DSL kernel for sm_90a on the CPU with ptxas's report captured, and the table of registers / spills /
shared memory per variant. They need nvidia-cutlass-dsl, numpy and triton (vsa_core imports it), no
GPU and no torch."""

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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402


def compile_report(kernel, args, scalars=None) -> dict:
    """Compiles kernel(*args, *scalars, stream) for sm_90a (scalars: the softmax scale unless given) and
    returns ptxas's figures (lists: one entry per kernel of the compile), the compiler's warnings and
    the whole report."""
    scalars = (cutlass.Float32(0.088),) if scalars is None else scalars
    buf = io.StringIO()
    t = time.time()
    # ptxas's report goes to the process's stderr (fd 2): capture it through a pipe
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        with contextlib.redirect_stdout(buf):
            cute.compile(kernel, *args, *scalars, make_fake_stream(use_tvm_ffi_env_stream=False),
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
                # ptxas reports serialised wgmmas (C7514: a pipeline that waits after every GEMM) as
                # "info", not as a warning; they cost more than most warnings do
                warnings=[ln for ln in text.splitlines() if "warning" in ln.lower() or "C7514" in ln],
                smem=getattr(kernel, "smem_bytes", 0), ctas_per_sm=getattr(kernel, "ctas_per_sm", 0), report=text)


def report_table(variants: dict, compile_variant, names) -> int:
    """Compiles each named variant (all when none are named) with compile_variant(name, kwargs)
    -> compile_report's dict and prints one row each; VERBOSE=1 adds the reports. Returns the
    exit status: 1 when a compile failed."""
    names = names or list(variants)
    width = max(len(n) for n in names)
    print(f"{'variant':{width}s} {'regs':>5s} {'spill st/ld':>12s} {'stack':>6s} {'smem KiB':>9s} {'CTAs/SM':>8s} {'s':>5s}")
    failed = 0
    for name in names:
        try:
            r = compile_variant(name, variants[name])
            spills = ",".join(r["spill_stores"]) + "/" + ",".join(r["spill_loads"])
            print(f"{name:{width}s} {','.join(r['regs']):>5s} {spills:>12s} {','.join(r['stack']):>6s} "
                  f"{r['smem'] / 1024:9.1f} {r['ctas_per_sm']:8d} {r['seconds']:5.1f}", flush=True)
            for line in r["warnings"]:
                print(f"    {line.strip()[:300]}")
            if os.environ.get("VERBOSE"):
                print(r["report"])
        except Exception as e:
            failed += 1
            print(f"{name:{width}s} FAILED {type(e).__name__}: {str(e)[:3000]}", flush=True)
            if os.environ.get("VERBOSE"):
                traceback.print_exc()
    return 1 if failed else 0
