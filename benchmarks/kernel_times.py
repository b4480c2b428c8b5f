"""GPU time per kernel of whole-VSA forward calls, by torch.profiler (CUDA activity only).

Unlike benchmarks/stage_breakdown.py, whose CUDA events around each launch function also count
the GPU waiting for the host between two launches (small stages issued one after another read
their host time), these are the kernels' own times.

    PYTHONPATH=. python3 benchmarks/kernel_times.py [--backend cudnn] [--shape 480p-64] [--calls 5] [--backward] [--ops]

--backward times forward + backward calls (a random dout), so the backward's kernels show too.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import vsa_torch  # noqa: E402
from stage_breakdown import SHAPES, inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cudnn")
    ap.add_argument("--shape", default="480p-64", choices=tuple(SHAPES))
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--backward", action="store_true", help="forward + backward calls")
    ap.add_argument("--ops", action="store_true",
                    help="also list the host-side torch ops that launched work (fills, copies) with their shapes")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    _, _, _, _, tile, topk = shape
    meta, q, k, v, gate = inputs(shape, smooth=False)
    for x in (q, k, v, gate):
        x.requires_grad_(True)  # training: the forward keeps what the backward needs
    counts = torch.as_tensor(meta.variable_block_sizes, device="cuda")

    dout = torch.randn_like(q)

    def call():
        out = vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk=topk, block_size=tile,
                                          compress_attn_weight=gate, backend=args.backend)
        if args.backward:
            torch.autograd.grad(out, (q, k, v, gate), dout)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA] + [torch.profiler.ProfilerActivity.CPU] * args.ops
    with torch.profiler.profile(activities=activities, record_shapes=args.ops) as prof:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    what = "forward + backward" if args.backward else "forward"
    print(f"{args.shape} backend={args.backend}: {args.calls} {what} calls (divide the totals by {args.calls})")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=70))
    if args.ops:  # which torch calls the fills and copies come from: their input shapes
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="cuda_time_total", row_limit=30, max_name_column_width=40, max_shapes_column_width=80))


if __name__ == "__main__":
    main()
