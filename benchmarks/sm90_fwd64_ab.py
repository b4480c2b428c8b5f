"""A/B timing of sm_90 64-token forward variants in one process, interleaved round by round, so that
clock and thermal drift between rows does not decide the comparison:

    PYTHONPATH=. python3 benchmarks/sm90_fwd64_ab.py ws3LT ws3LTrf [--rounds=7] [--smooth]

Variants are sm90_fwd64_check.VARIANTS names ("cudnn": cuDNN BSA called directly); inputs as its
timing ("random") or smooth problem at 480p-64. Prints each variant's per-round do_bench medians,
the median over rounds, and each variant's median ratio to the first one, round by round.
"""

from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import triton  # noqa: E402

import sm90_fwd64_check as check  # noqa: E402


def main(argv) -> None:
    names = [a for a in argv if not a.startswith("--")]
    rounds = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--rounds=")), 7)
    smooth = "--smooth" in argv
    q, k, v, idx, num, counts = check.smooth_problem() if smooth else check.timing_problem()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    calls = {}
    for name in names:
        if name == "cudnn":
            from cudnn import BSA
            topk = idx.shape[-1]
            calls[name] = lambda: BSA.block_sparse_attention_forward(q, k, v, idx, topk, sparse_block_size=check.E)
        else:
            from vsa_core.backends.sm90_fwd64 import prepare_forward64
            calls[name] = prepare_forward64(q, k, v, out, lse, idx, num, counts, **check.VARIANTS[name])
        calls[name]()
    torch.cuda.synchronize()
    times = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            times[n].append(triton.testing.do_bench(calls[n], warmup=10, rep=100, return_mode="median"))
    print(f"{'smooth' if smooth else 'random'} lists, {rounds} rounds, {torch.cuda.get_device_name()}")
    for n in names:
        ratios = [a / b for a, b in zip(times[n], times[names[0]])]
        print(f"  {n:12s} median {statistics.median(times[n]):.3f} ms  rounds "
              + " ".join(f"{t:.3f}" for t in times[n])
              + f"  / {names[0]}: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
