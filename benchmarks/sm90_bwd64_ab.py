"""Our 64-token backward (sm90_backend.BACKWARD) against cuDNN BSA's, timed in one process and
interleaved round by round, at shapes of equal work whose per-head working set differs:

    PYTHONPATH=. python3 benchmarks/sm90_bwd64_ab.py [--rounds=5] [--shapes=12x39936,24x19968,48x9984]
        [--calls=backend,cudnn]

A shape HxS is B1, H heads, S tokens, D128, top-62 random lists (sm90_fwd64_check.timing_problem):
the same (query block, KV block) pairs in total for the three defaults. What differs is how much of a
head the CTAs running at once touch: Q and dO (32 KiB) and the fp32 dQ accumulator (32 KiB) per query
block, 40 MB per head at S 39936, 10 MB at S 9984, against an L2 of two 25 MB partitions. Prints each
shape's per-round times and the median ratio of each to cuDNN's (`--calls`: names of
sm90_bwd64_profile.backward_calls, cudnn last), and the rel-L2 of each call's dq, dk, dv against the
first call's.
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


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def main(argv) -> None:
    rounds = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--rounds=")), 5)
    shapes = next((a.split("=", 1)[1] for a in argv if a.startswith("--shapes=")), "12x39936,24x19968,48x9984")
    names = next((a.split("=", 1)[1] for a in argv if a.startswith("--calls=")), "backend,cudnn").split(",")
    print(f"{torch.cuda.get_device_name()}, {rounds} rounds, ms (do_bench medians)")
    for shape in shapes.split(","):
        H, S = (int(x) for x in shape.split("x"))
        out = {}
        calls = backward_calls(names, H=H, S=S, outputs=out)
        first = None
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            grads = [out[n].clone() for n in ("dq", "dk", "dv")]
            if first is None:
                first = grads
            else:
                print(f"  H{H} S{S} {name} vs {names[0]}: rel-L2 dq/dk/dv "
                      + " ".join(f"{_rel(g, r):.1e}" for g, r in zip(grads, first)))
        times = {n: [] for n in calls}
        for _ in range(rounds):
            for n, fn in calls.items():
                times[n].append(triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median"))
        base = names[-1]
        for n in names:
            ratio = statistics.median(a / b for a, b in zip(times[n], times[base]))
            print(f"  H{H} S{S} {n}: " + " ".join(f"{t:.3f}" for t in times[n])
                  + f"  / {base} (time) median {ratio:.3f}", flush=True)
        del calls, out, first
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
