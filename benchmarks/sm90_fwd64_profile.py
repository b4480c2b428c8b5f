"""One launch of each named sm_90 64-token forward (ours, cuDNN's) at 480p-64 inside a profiler range,
for Nsight Compute:

    ncu --clock-control none --profile-from-start off --set full --import-source yes \
        -o $OUT/fwd64 python3 benchmarks/sm90_fwd64_profile.py k1v2L ws3L cudnn

Every kernel is compiled and run once before the range opens, so the range holds exactly one launch
per name (cuDNN's call launches only its forward kernel once its graph is built). Inputs are those of
sm90_fwd64_check.time_shape: B1 H12 S39936 D128 top-62, random ascending lists, bf16.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import sm90_fwd64_check as check  # noqa: E402

E = 64


def main(names) -> None:
    B, H, S, D, topk = 1, 12, 39936, 128, 62
    dev = torch.device("cuda")
    n = S // E
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=gen, device=dev).to(torch.bfloat16) for _ in range(3))
    idx = torch.rand(B, H, n, n, generator=gen, device=dev).topk(topk, dim=-1).indices.sort(dim=-1).values
    idx = idx.to(torch.int32).contiguous()
    num = torch.full((B, H, n), topk, dtype=torch.int32, device=dev)
    counts = torch.full((n,), E, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    calls = []
    for name in names:
        if name == "cudnn":
            from cudnn import BSA
            calls.append((name, lambda: BSA.block_sparse_attention_forward(q, k, v, idx, topk, sparse_block_size=E)))
        else:
            from vsa_core.backends.sm90_fwd64 import prepare_forward64
            calls.append((name, prepare_forward64(q, k, v, out, lse, idx, num, counts, **check.VARIANTS[name])))
    for _, fn in calls:  # compile, build graphs, warm
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
    print("profiled:", ", ".join(names), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["k1v2L", "ws3L", "cudnn"])
