"""One launch of each named sm_90 64-token forward (ours, cuDNN's) at 480p-64 inside a profiler range,
for Nsight Compute:

    ncu --clock-control none --profile-from-start off --set full --import-source yes \
        -o $OUT/fwd64 python3 benchmarks/sm90_fwd64_profile.py k1v2L ws3L cudnn

Every kernel is compiled and run once before the range opens, so the range holds exactly one launch
per name (cuDNN's call launches only its forward kernel once its graph is built). Inputs are those of
sm90_fwd64_check.time_source("random"): B1 H12 S39936 D128 top-62 (`--topk=N` for another list
length), random ascending lists, bf16; `--smooth`: sm90_fwd64_check.time_source("smooth")'s (VSA's own
selection over a smooth synthetic field, where neighbouring query blocks' lists overlap).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import sm90_fwd64_check as check  # noqa: E402

E = 64


def main(names, topk: int = 62, smooth: bool = False) -> None:
    B, H, S = 1, 12, 39936
    if smooth:
        q, k, v, idx, num, counts = check.smooth_problem()
        topk = idx.shape[-1]
    else:
        q, k, v, idx, num, counts = check.timing_problem(B, H, S, 128, topk)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    calls = []
    for name in names:
        if name == "cudnn":
            from cudnn import BSA
            calls.append((name, lambda: BSA.block_sparse_attention_forward(q, k, v, idx, topk, sparse_block_size=E)))
        else:
            from vsa_core.backends.sm90_fwd64 import prepare_forward64
            calls.append((name, prepare_forward64(q, k, v, out, lse, idx, num, counts, **check.VARIANTS[name])))
    profile_calls(calls)


def profile_calls(calls) -> None:
    """Runs each (name, fn) twice (compile, build graphs, warm), then once each inside the profiler
    range, each in an NVTX range of its name."""
    for _, fn in calls:
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in calls:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(name for name, _ in calls), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    topk = [int(a.split("=", 1)[1]) for a in args if a.startswith("--topk=")]
    main([a for a in args if not a.startswith("--")] or ["k1v2L", "ws3L", "cudnn"], *topk[-1:], smooth="--smooth" in args)
