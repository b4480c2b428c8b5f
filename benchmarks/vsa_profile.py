"""One whole-VSA forward + backward (torch eager) at 480p-64 inside a profiler range, for Nsight
Compute, and a compact per-kernel table from the report:

    ncu --clock-control none --profile-from-start off --set full -f -o $OUT/vsa \
        python3 benchmarks/vsa_profile.py --backend sm90
    python3 benchmarks/vsa_profile.py --table $OUT/vsa.ncu-rep

The call runs three times first (compile, autotune, replay capture), so the range holds one
forward and one backward of the steady state. Inputs: bf16 randn x16 q, k (real activation
scale), randn v and gate, every block full (B1 H12 S39936 D128 E64 top-62).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

METRICS = {  # column: ncu metric
    "us": "gpu__time_duration.sum",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "regs": "launch__registers_per_thread",
    "occ%": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "dram%": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm%": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
}


def run(backend: str) -> None:
    import torch

    import vsa_torch

    B, H, S, D, topk = 1, 12, 39936, 128, 62
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(scale=1.0):
        return (torch.randn(B, H, S, D, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    q, k = randn(16).requires_grad_(), randn(16).requires_grad_()
    v, gate = randn().requires_grad_(), randn().requires_grad_()
    counts = torch.full((S // 64,), 64, dtype=torch.int32, device="cuda")
    dout = randn()

    def call():  # autograd.grad: .backward would add into the leaves' .grad, 4 more kernels
        out = vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk, 64, gate, backend=backend)
        torch.autograd.grad(out, (q, k, v, gate), dout)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled one forward + backward, backend", backend, flush=True)


def table(report: str) -> None:
    raw = subprocess.run(["ncu", "-i", report, "--page", "raw", "--csv", "--print-units", "base",
                          "--metrics", ",".join(METRICS.values())], check=True, capture_output=True, text=True).stdout
    rows = list(csv.reader(io.StringIO(raw)))
    header = rows[0]
    col = {name: header.index(name) if name in header else None for name in ("Kernel Name", *METRICS.values())}
    print("| kernel | " + " | ".join(METRICS) + " |")
    print("|" + " --- |" * (len(METRICS) + 1))
    total = 0.0
    for row in rows[2:]:  # rows[1]: units
        cells = []
        for column, metric in METRICS.items():
            if col[metric] is None:
                cells.append("-")
                continue
            value = float(row[col[metric]].replace(",", "") or 0)
            if column == "us":
                value /= 1e3
                total += value
            cells.append(f"{value:.1f}" if column in ("us", "occ%", "dram%", "sm%") else f"{value:.0f}")
        print(f"| {row[col['Kernel Name']][:60]} | " + " | ".join(cells) + " |")
    print(f"total kernel time {total:.1f} us")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sm90")
    ap.add_argument("--table", help="print the table of this .ncu-rep instead of running")
    args = ap.parse_args()
    table(args.table) if args.table else run(args.backend)
