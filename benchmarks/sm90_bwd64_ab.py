"""Our 64-token backward (sm90_backend.BACKWARD) against cuDNN BSA's, timed in one process and
interleaved round by round, at shapes of equal work whose per-head working set differs:

    PYTHONPATH=. python3 benchmarks/sm90_bwd64_ab.py [--rounds=5] [--shapes=12x39936,24x19968,48x9984]

A shape HxS is B1, H heads, S tokens, D128, top-62 random lists (sm90_fwd64_check.timing_problem):
the same (query block, KV block) pairs in total for the three defaults. What differs is how much of a
head the CTAs running at once touch: Q and dO (32 KiB) and the fp32 dQ accumulator (32 KiB) per query
block, 40 MB per head at S 39936, 10 MB at S 9984, against an L2 of two 25 MB partitions. Prints each
shape's per-round times and the median ratio of ours to cuDNN's.
"""

from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import triton  # noqa: E402

from sm90_bwd64_profile import backward_calls  # noqa: E402


def main(argv) -> None:
    rounds = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--rounds=")), 5)
    shapes = next((a.split("=", 1)[1] for a in argv if a.startswith("--shapes=")), "12x39936,24x19968,48x9984")
    print(f"{torch.cuda.get_device_name()}, {rounds} rounds, ms (do_bench medians)")
    for shape in shapes.split(","):
        H, S = (int(x) for x in shape.split("x"))
        calls = backward_calls(["backend", "cudnn"], H=H, S=S)
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        times = {n: [] for n in calls}
        for _ in range(rounds):
            for n, fn in calls.items():
                times[n].append(triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median"))
        ratio = statistics.median(a / b for a, b in zip(times["backend"], times["cudnn"]))
        print(f"  H{H} S{S}: ours " + " ".join(f"{t:.3f}" for t in times["backend"])
              + "  cuDNN " + " ".join(f"{t:.3f}" for t in times["cudnn"])
              + f"  ours / cuDNN (time) median {ratio:.3f}", flush=True)
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
