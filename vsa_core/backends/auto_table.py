"""The order in which backend="auto" tries the backends: fastest first, per
(architecture, block size, head dim, dtype), as measured by benchmarks/bench.py.

Each entry is a measurement, not a guess: it says where its numbers come from. A key
that is not here falls back to DEFAULT_ORDER; a backend that cannot run a call (not
installed, or the call is outside what it supports, e.g. a backward it cannot do)
falls through to the next one, with its reason kept for the error message when none can.
Update the entries from a benchmark run (fine stage, forward and backward TFLOPS) and
say so in the comment.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ..problem import AttnProblem
from ..runtime import DeviceInfo

# the order before any table entry existed: FA4 CuTe where it runs, Triton everywhere
DEFAULT_ORDER: Tuple[str, ...] = ("cute", "triton")

# (arch, tokens per block E, head dim, dtype) -> backends, fastest first
TABLE = {
    # H200 (sm_90), bf16, D=128, fine stage of our backends, fwd / bwd TFLOPS on sparse FLOPs,
    # benchmarks/cudnn_check.py, 2026-11-30 (benchmarks/results/2026-11-30-h200x2-final):
    # 480p-64 (B1 H12 S39936, top-62): cudnn 512 / 406, triton 404 / 387. FA4 (cute) does not
    # take 64-token blocks.
    # Our sm90 kernels, whole VSA (benchmarks/bench.py --quick, benchmarks/results/2026-12-02-h200-session5):
    # fwd / bwd ms cudnn 1.983 / 6.354, sm90 1.996 / 6.252, triton 2.345 / 6.349 (fine stage cudnn
    # 574 / 405 TFLOPS, sm90 562 / 402, triton 468 / 394): a tie with cuDNN, ahead of triton.
    # Whole VSA since the sm90 forward mixes in its epilogue and launches through TVM-FFI
    # (benchmarks/bench.py --quick, benchmarks/results/2026-12-03-h200-session13, eager):
    # fwd / bwd ms sm90 1.926 / 6.118, cudnn 1.981 / 6.265: sm90 first.
    # Training at every length: our backward's time / cuDNN's on an H100 (benchmarks/sm90_bwd64_ab.py,
    # benchmarks/results/2026-12-07-session26/bwdlen.txt), by query blocks per head: 624: 0.934,
    # 780: 0.906, 912: 0.870, 1176: 0.981, 1440: 0.939 (H4) and 0.932 (H40). (Before the backward swept
    # heads, cuDNN's was faster past ~900 query blocks and took training calls there.)
    ("sm_90", 64, 128, "bfloat16"): ("sm90", "cudnn", "triton"),
    # H200 (sm_90), bf16, D=128, benchmarks/bench.py, 2026-11-29 (benchmarks/results/
    # 2026-11-29-h200): 480p-256 (top-20) fine cute 705 / 522, triton 425 / 392; 720p-256
    # (B1 H40 S92160, top-45) cute 635 / 527, triton 431 / 374. The cudnn backend does not take
    # 256-token blocks. (Whole VSA at 720p-256 on 2026-11-30, benchmarks/ulysses_bench.py's
    # 1-GPU column: cute 36.6 ms fwd, 146.2 ms fwd+bwd; triton 54.8 / 200.3 the day before.)
    ("sm_90", 256, 128, "bfloat16"): ("cute", "triton"),
}


def arch_of(device: DeviceInfo) -> Optional[str]:
    if device.kind != "cuda" or device.capability is None:
        return None
    return f"sm_{device.capability[0]}{device.capability[1]}"


def auto_order(problem: AttnProblem, device: DeviceInfo) -> Tuple[str, ...]:
    key = (arch_of(device), problem.block_elems, problem.head_dim, problem.dtype)
    return TABLE.get(key, DEFAULT_ORDER)
