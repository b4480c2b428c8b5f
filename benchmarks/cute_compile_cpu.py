"""Compiles the sm90 backend's CuTe DSL kernels for sm_90a on a machine without a GPU, through the
production host path, and reports what the cubin says: registers per thread, spills, stack, shared
memory, SASS instruction count. For kernel work on a CPU-only machine: compile errors, register /
shared-memory budgets and the SASS, with no GPU.

    PYTHONPATH=. python benchmarks/cute_compile_cpu.py [--kernels fwd,bwd] [--epilogue vsa] [--out DIR]

(a python with nvidia-cutlass-dsl 4.8.1, apache-tvm-ffi, torch (CPU build is enough), numpy and triton; cuobjdump /
nvdisasm are taken from PATH, nvidia-cuda-nvdisasm's wheel or triton's.)

How: CUTE_DSL_ARCH=sm_90a, CUTE_DSL_KEEP=cubin, CUTE_DSL_DUMP_DIR and CUTE_DSL_COMPILER_OPT=remarks{ptx}
(ptxas -v) are set before cutlass is imported; CPU torch tensors of the problem's shapes (allocated,
never touched) go through the backend's own `prepare_forward64` / `prepare_backward64` (the same
CuTe views, `from_dlpack(...).mark_layout_dynamic`, and kernel arguments, sm90_backend.FORWARD /
BACKWARD) with torch's current-stream query stubbed out; the launch callables they return are never
called. The layouts are dynamic, so one cubin covers every B, H, S. (sm90_fwd64_compile.py's fake
tensors carry other stride types / divisibility hints: same registers, not quite the same SASS.)
Files land in --out (default $OUT, else /tmp/cute-cpu): <kernel>.sm_90a.cubin, <kernel>.sm_90a.sass
(nvdisasm -c) and ptxas.txt (ptxas's report; on a compile error it is printed before the traceback).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def tool(name):
    """cuobjdump / nvdisasm: PATH, else nvidia-cuda-nvdisasm's wheel (CUDA 13, no ELF-format warning on
    these cubins), else triton's bundled copy (CUDA 12.8)."""
    import triton
    nvidia = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    site = os.path.dirname(os.path.dirname(triton.__file__))
    for p in [shutil.which(name), os.path.join(site, "nvidia", "cu13", "bin", name), os.path.join(nvidia, name)]:
        if p and os.path.exists(p):
            return p
    return None


def resource_usage(cubin):
    """{kernel: {REG, STACK, SHARED, LOCAL, ...}} from cuobjdump --dump-resource-usage."""
    out = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True, text=True,
                         check=True).stdout
    res, name = {}, None
    for line in out.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
        elif name and "REG:" in line:
            res[name] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}
    return res


def sass_count(cubin, sass_path):
    """Instructions per kernel in the cubin (nvdisasm, NOPs counted apart); writes the listing."""
    text = subprocess.run([tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    with open(sass_path, "w") as f:
        f.write(text)
    counts, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line) or re.match(r"\s*\.section\s+\.text\.([^,\s]+)", line)
        if m:
            name = m.group(1)
            counts.setdefault(name, [0, 0])
        elif name and re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line):
            counts[name][0] += 1
            counts[name][1] += bool(re.search(r"\bNOP\b", line))
    return counts


# the dumped cubins' names hold the kernel class: short names for the files and the table
SHORT = {"BlockSparseFwd64Sm90": "sm90_fwd64", "BlockSparseBwd64Sm90": "sm90_bwd64",
         "DqPostprocess": "sm90_bwd64_dq_post"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="fwd,bwd", help="comma-separated: fwd, bwd (default both)")
    ap.add_argument("--epilogue", default="vsa", choices=["vsa", "vsa-inference", "plain"],
                    help="forward epilogue: vsa (coarse + gate + out_fine, training), vsa-inference (coarse, "
                         "no gate / out_fine), plain (fine stage only); the backward takes pooling grads "
                         "unless plain")
    ap.add_argument("--shape", default="1,12,39936,128,64,62", help="B,H,S,D,block,topk (default 480p-64)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/cute-cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = out
    os.environ["CUTE_DSL_COMPILER_OPT"] = "remarks{ptx}"  # ptxas -v: registers, spills per kernel

    import torch
    # the prepare functions ask torch for the current stream (for the launch they return, never called)
    torch.cuda.current_stream = lambda *args, **kw: types.SimpleNamespace(cuda_stream=0)
    import cutlass.cute as cute
    from vsa_core.backends import sm90_backend, sm90_bwd64_launch, sm90_fwd64
    kernels = []  # the kernel objects compiled (their smem_bytes: the dynamic shared memory they launch with)
    compile_ = cute.compile

    def compile_recorded(kernel, *args, **kw):
        kernels.append(kernel)
        return compile_(kernel, *args, **kw)
    cute.compile = compile_recorded

    B, H, S, D, E, K = (int(x) for x in a.shape.split(","))
    assert E == 64, "the sm90 kernels take 64-token blocks"
    dt = dict(bf16=torch.bfloat16, fp16=torch.float16)[a.dtype]
    nb = S // E
    tok = lambda: torch.empty(B, H, S, D, dtype=dt)  # noqa: E731
    f32 = lambda *s: torch.empty(*s, dtype=torch.float32)  # noqa: E731
    i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
    coarse = a.epilogue != "plain"
    train = a.epilogue == "vsa"
    for f in glob.glob(os.path.join(out, "*.cubin")) + glob.glob(os.path.join(out, "*.sass")):
        os.remove(f)

    log = os.path.join(out, "ptxas.txt")  # ptxas's report (and the DSL's diagnostics) go to fd 2: into this file
    saved = os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    ok = False
    try:
        for kern in a.kernels.split(","):
            if kern == "fwd":
                extra = dict(q_counts=i32(nb), out_coarse=f32(B, H, nb, D), gate=tok() if train else None,
                             out_fine=f32(B, H, S, D) if train else None) if coarse else {}
                sm90_fwd64.prepare_forward64(tok(), tok(), tok(), tok(), f32(B, H, S), i32(B, H, nb, K),
                                             i32(B, H, nb), i32(nb), **extra, **sm90_backend.FORWARD)
            elif kern == "bwd":
                extra = dict(dq_pool=f32(B, H, nb, D), dk_pool=f32(B, H, nb, D), dv_pool=f32(B, H, nb, D),
                             q_counts=i32(nb)) if coarse else {}
                sm90_bwd64_launch.prepare_backward64(tok(), tok(), tok(), tok(), f32(B, H, S), f32(B, H, S), tok(), tok(),
                                              tok(), i32(B, H, nb, nb), i32(B, H, nb), i32(nb), **extra,
                                              **sm90_backend.BACKWARD)
            else:
                raise SystemExit(f"unknown kernel {kern!r}")
        ok = True
    finally:
        os.dup2(saved, 2)
        os.close(fd)
        with open(log) as f:
            report = f.read()
        if not ok:  # a compile error: the whole log, then the traceback
            sys.stderr.write(report)
    spills = {}  # ptxas -v: "Compiling entry function 'X'" ... "N bytes spill stores, M bytes spill loads"
    for m in re.finditer(r"entry function '([^']+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads", report,
                         re.S):
        spills[m.group(1)] = (int(m.group(2)), int(m.group(3)))

    print(f"sm_90a, {a.dtype}, B{B} H{H} S{S} D{D} E{E} top-{K}, forward epilogue {a.epilogue}; files in {out}")
    print(f"{'kernel':22s} {'regs':>4s} {'setmaxnreg':>10s} {'spill st/ld':>11s} {'stack':>5s} {'static smem':>11s} "
          f"{'dyn smem':>9s} {'SASS':>6s} {'NOP':>4s}")
    for cubin in sorted(glob.glob(os.path.join(out, "*.cubin"))):
        cls = next((k for k in SHORT if k in os.path.basename(cubin)), None)
        if cls is None:
            continue
        short = os.path.join(out, SHORT[cls] + ".sm_90a")
        os.replace(cubin, short + ".cubin")
        cubin = short + ".cubin"
        sass = sass_count(cubin, short + ".sass")
        with open(short + ".sass") as f:
            regs = re.findall(r"USETMAXREG\.\S+ (?:\S+, )?(0x[0-9a-f]+)", f.read())
        maxnreg = "/".join(str(int(x, 16)) for x in regs)
        dyn = next((k.smem_bytes for k in kernels if type(k).__name__ in cls and hasattr(k, "smem_bytes")), 0)
        for name, ru in resource_usage(cubin).items():
            st, ld = spills.get(name, ("?", "?"))
            n, nops = sass.get(name, ("?", "?"))
            print(f"{SHORT[cls]:22s} {ru.get('REG', 0):4d} {maxnreg or '-':>10s} {f'{st}/{ld}':>11s} "
                  f"{ru.get('STACK', 0):5d} {ru.get('SHARED', 0):11d} {dyn:9d} {n:>6} {nops:>4}")
    print("regs: ptxas's per-thread count (the launch's; warp-specialized kernels then move to the setmaxnreg "
          "budgets, producer/consumer); smem in bytes, dyn = the kernel's smem_bytes (its shared storage)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
