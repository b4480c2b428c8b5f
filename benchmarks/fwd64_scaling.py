"""Where the 64-token forward's time goes: per tile or per query block.

Times the sm90 forward's variants and cuDNN's blk64 forward at several list lengths (random
ascending lists of exactly `topk` full blocks, B1 H12 S39936 D128 bf16) and fits
ms = fixed + per_tile * topk by least squares. `per_tile` is the steady main loop (what L2
reads and the step's schedule cost); `fixed` is what a query block costs whatever its list:
prologue (Q and first K/V loads), epilogue (normalise, store), and CTA turnaround. A kernel
that trails cuDNN on `fixed` gains from a persistent schedule or a cheaper epilogue; one that
trails on `per_tile` from its main loop. The kernels are timed in turns, `--rounds` times each
(one kernel's clock or L2 state does not land on one row), and each row takes the median.

    PYTHONPATH=. python3 benchmarks/fwd64_scaling.py [--topks 16,31,62,124] [--variants ws3L,k1v2L] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_fwd64_check import VARIANTS, timing_problem  # noqa: E402

E = 64


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=150, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--topks", default="16,31,62,124")
    ap.add_argument("--variants", default="ws3L,ws3LP,k1v2L")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from vsa_core.backends.sm90_fwd64 import prepare_forward64
    topks = [int(t) for t in args.topks.split(",")]
    names = args.variants.split(",")
    rows = {n: [] for n in names + ["cuDNN"]}
    for topk in topks:
        q, k, v, idx, num, counts = timing_problem(topk=topk)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        calls = {n: prepare_forward64(q, k, v, out, lse, idx, num, counts, **VARIANTS[n]) for n in names}
        try:
            from cudnn import BSA
            calls["cuDNN"] = lambda: BSA.block_sparse_attention_forward(q, k, v, idx, topk, sparse_block_size=E)
        except Exception as e:  # noqa: BLE001 - a missing peer is a row of dashes, not a failed run
            print(f"cuDNN: {type(e).__name__}: {e}")
        for call in calls.values():
            call()
        times = {n: [] for n in calls}
        for _ in range(args.rounds):
            for n, call in calls.items():
                times[n].append(bench(call))
        for n in rows:
            rows[n].append(float(np.median(times[n])) if n in times else float("nan"))
        print(f"top-{topk}: " + ", ".join(f"{n} {' / '.join(f'{t:.3f}' for t in ts)}" for n, ts in times.items()),
              flush=True)
        del q, k, v, idx, num, counts, out, lse, calls
        torch.cuda.empty_cache()
    nq = 12 * 39936 // E
    print(f"\nB1 H12 S39936 D128 E64, random lists; ms per call (median) at top-{topks}")
    print(f"| kernel | {' | '.join(f'top-{t} ms' for t in topks)} | fixed us | per tile per query block | fixed share at top-62 |")
    print("| --- |" + " --- |" * (len(topks) + 3))
    for n, ms in rows.items():
        if any(np.isnan(ms)):
            print(f"| {n} | " + " | ".join("-" for _ in topks) + " | - | - | - |")
            continue
        slope, fixed = np.polyfit(topks, ms, 1)
        share = fixed / (fixed + slope * 62)
        print(f"| {n} | " + " | ".join(f"{m:.3f}" for m in ms) +
              f" | {fixed * 1e3:.1f} | {slope * 1e6 / nq:.3f} ns | {share:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
