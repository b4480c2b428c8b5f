"""Shared memory of the coarse kernels' launch configs, compiled for a GPU target
without running anything (no GPU needed; Triton's bundled ptxas does the last step).

    PYTHONPATH=. python3 benchmarks/coarse_smem.py               # sm_90, the configs in use
    PYTHONPATH=. python3 benchmarks/coarse_smem.py --arch 80 --precision tf32

Prints bytes per kernel and head dim for `triton_backend.COARSE_CONFIGS` and exits 1 if
one exceeds the limit of a block on that architecture (the issue-8 failure: 262656 >
232448 bytes on sm_90). Each compile takes seconds to half a minute.
"""

from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this compiles the kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vsa_core import triton_kernels as K  # noqa: E402
from vsa_core.backends import triton_backend as T  # noqa: E402

# largest dynamic shared memory of one block, bytes
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
KERNELS = {"fwd": K.coarse_attn_fwd_kernel, "dq": K.coarse_attn_bwd_dq_kernel, "dkdv": K.coarse_attn_bwd_dkdv_kernel}
FP32_BUFFERS = ("SCORES", "OUT_C", "LSE_C", "DOUT_C", "DQ_C", "DK_C", "DV_C")
SCALARS = {"n_q": "i32", "n_kv": "i32", "sm_scale": "fp32"}


def shared_bytes(kernel, head_dim, block_m, block_n, warps, stages, precision, arch, dtype="bf16") -> int:
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=False, DOT_PRECISION=precision,
                      VARLEN=False)
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
    return compiled.metadata.shared


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SMEM_LIMIT))
    parser.add_argument("--precision", default=T.COARSE_DOT_PRECISION, choices=["ieee", "tf32", "tf32x3"])
    args = parser.parse_args()
    limit = SMEM_LIMIT[args.arch]
    ok = True
    print(f"sm_{args.arch} (limit {limit} bytes), precision {args.precision}, triton {triton.__version__}")
    for head_dim, stages in T.COARSE_CONFIGS.items():
        for stage, (block_m, block_n, warps, n_stages) in stages.items():
            used = shared_bytes(KERNELS[stage], head_dim, block_m, block_n, warps, n_stages, args.precision, args.arch)
            ok &= used <= limit
            print(f"  D={head_dim:<4d} {stage:5s} {block_m}x{block_n} warps {warps} stages {n_stages}: {used:7d} bytes "
                  f"{'ok' if used <= limit else 'OVER'}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
