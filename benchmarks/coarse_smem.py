"""Shared memory of the coarse kernels' launch configs, compiled for a GPU target
without running anything (no GPU needed; Triton's bundled ptxas does the last step).

    PYTHONPATH=. python3 benchmarks/coarse_smem.py               # sm_90, the configs in use
    PYTHONPATH=. python3 benchmarks/coarse_smem.py --arch 80 --precision tf32

Prints bytes, registers and spilled bytes per kernel and head dim for
`stages.COARSE_CONFIGS` and exits 1 if one exceeds the shared-memory limit of a block
on that architecture (the issue-8 failure: 262656 > 232448 bytes on sm_90). Each compile
takes seconds to half a minute.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles the kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vsa_core import stage_kernels as K  # noqa: E402
from vsa_core import stages as S  # noqa: E402
from vsa_core.config import COARSE_PRECISIONS, config  # noqa: E402

# largest dynamic shared memory of one block, bytes
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
KERNELS = {"fwd": K.coarse_attn_fwd_kernel, "ds": K.coarse_attn_bwd_ds_kernel, "grads": K.coarse_attn_bwd_grads_kernel}
TILE_NAMES = {"fwd": ("BLOCK_M", "BLOCK_N"), "ds": ("BLOCK_M", "BLOCK_N"), "grads": ("BLOCK_M", "BLOCK_K", "BLOCK_D")}
FP32_BUFFERS = ("SCORES", "OUT_C", "LSE_C", "DOUT_C", "DQ_C", "DK_C", "DV_C", "P_C", "DS_C")
SCALARS = {"n_q": "i32", "n_kv": "i32", "sm_scale": "fp32"}


def compile_report(stage, head_dim, tiles, warps, stages, precision, arch, dtype="bf16"):
    """(shared bytes, registers, spilled bytes) of one coarse kernel config compiled for sm_<arch>."""
    kernel = KERNELS[stage]
    constexprs = dict(zip(TILE_NAMES[stage], tiles), HEAD_DIM=head_dim, DOT_PRECISION=precision, UPCAST=False,
                      INPUT_PARTS=1 if dtype == "bf16" else 2)
    if stage != "grads":
        constexprs["VARLEN"] = False
    if stage == "fwd":  # the scores the selection ranks, rounded to the input dtype
        constexprs["RANK_DTYPE"] = "bfloat16" if dtype == "bf16" else "float16"
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in SCALARS:
            signature[name] = SCALARS[name]
        elif name in ("KV_COUNTS", "Q_SEQ", "KV_SEQ"):
            signature[name] = "*i32"
        else:
            signature[name] = "*fp32" if name in FP32_BUFFERS else f"*{dtype}"
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    regs, spills = ptxas_usage(compiled.asm["ptx"], arch)
    return compiled.metadata.shared, regs, spills


def ptxas_usage(ptx: str, arch: int):
    """(registers, spill-store bytes) that Triton's bundled ptxas reports for the PTX (the
    numbers a loaded kernel would show as n_regs / n_spills, without a GPU)."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        ptxas = get_ptxas(arch).path  # the signature differs between Triton releases
    except TypeError:
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        suffix = "a" if arch >= 90 else ""
        report = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", path, "-o",
                                 os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return regs, spills


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMIT))
    parser.add_argument("--precision", default=config().coarse_precision, choices=list(COARSE_PRECISIONS))
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--sweep", metavar="STAGE=TILES/WARPS/STAGES,...",
                        help="report these configs instead, e.g. ds=64x64/8/2,grads=64x8x64/4/2 (D=128)")
    args = parser.parse_args()
    if args.sweep:
        for item in args.sweep.split(","):
            stage, config = item.split("=")
            tiles, warps, n_stages = config.split("/")
            tiles = [int(t) for t in tiles.split("x")]
            used, regs, spills = compile_report(stage, 128, tiles, int(warps), int(n_stages), args.precision, args.arch,
                                                dtype=args.dtype)
            print(f"  D=128 {stage:5s} {config}: {used:7d} bytes, {regs} registers, {spills} spilled bytes", flush=True)
        return
    limit = SMEM_LIMIT[args.arch]
    ok = True
    print(f"sm_{args.arch} (limit {limit} bytes), precision {args.precision}, triton {triton.__version__}")
    for head_dim, stages in S.COARSE_CONFIGS.items():
        for stage, (*tiles, warps, n_stages) in stages.items():
            used, regs, spills = compile_report(stage, head_dim, tiles, warps, n_stages, args.precision, args.arch,
                                                dtype=args.dtype)
            ok &= used <= limit
            print(f"  D={head_dim:<4d} {stage:5s} {'x'.join(map(str, tiles))} warps {warps} stages {n_stages}: "
                  f"{used:7d} bytes {'ok' if used <= limit else 'OVER'}, {regs} registers, {spills} spilled bytes",
                  flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
