"""Times the KV-owned list building of the backward (`stages.columns_to_lists`) per column tile,
against one column per program (`compact_mask_kernel` down a column, the way it ran before), and
checks that every variant builds the same lists and counts (GPU only).

    PYTHONPATH=. python3 benchmarks/columns_bench.py [--blocks 624] [--heads 12] [--density 0.1]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from vsa_core import stages as S  # noqa: E402
from vsa_core.launch import eager_launcher  # noqa: E402
from vsa_core.problem import AttnProblem  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=624)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--density", type=float, default=0.1)
    a = ap.parse_args()
    n, H = a.blocks, a.heads
    p = AttnProblem(batch=1, heads=H, q_len=64 * n, kv_len=64 * n, head_dim=128, block_elems=64, dtype="bfloat16",
                    topk=max(1, int(a.density * n)))
    g = torch.Generator("cuda").manual_seed(0)
    mask = (torch.rand(1, H, n, n, device="cuda", generator=g) < a.density).to(torch.int8)
    want = [m.nonzero().flatten() for m in mask[0].transpose(-1, -2).reshape(-1, n)]

    def column_per_program(idx, num):
        eager_launcher.triton(S.kernels_for(mask).compact_mask_kernel, (n, H), mask, idx, num, None, None, n, n,
                              n * n, 1, n, idx.shape[-1], N_PAD=S._pow2(n), num_warps=4)

    def tiled(tile):
        def run(idx, num):
            saved, S.COLUMNS_TILE = S.COLUMNS_TILE, tile
            try:
                S.columns_to_lists(eager_launcher, p, mask, idx, num)
            finally:
                S.COLUMNS_TILE = saved
        return run

    rows = [("one column per program (before)", column_per_program)]
    rows += [(f"columns_to_lists COLS={c} ROWS={r}" + (" (default)" if (c, r) == S.COLUMNS_TILE else ""), tiled((c, r)))
             for c, r in ((32, 128), (32, 64), (16, 128), (32, 32), (64, 64))]
    print(f"KV-owned lists from a [1, {H}, {n}, {n}] mask, density {a.density}: us per call (do_bench median)")
    for name, fn in rows:
        idx = torch.full((1, H, n, n), -7, dtype=torch.int32, device="cuda")
        num = torch.full((1, H, n), -7, dtype=torch.int32, device="cuda")
        try:
            fn(idx, num)
            flat_idx, flat_num = idx[0].reshape(-1, n), num[0].reshape(-1)
            same = all(int(flat_num[i]) == len(w) and torch.equal(flat_idx[i, :len(w)].long(), w)
                       for i, w in enumerate(want))
            us = do_bench(lambda: fn(idx, num), warmup=20, rep=100, return_mode="median") * 1e3
            print(f"  {name:<40} {us:8.1f}  lists {'equal' if same else 'DIFFER'}")
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            print(f"  {name:<40} failed: {type(e).__name__}: {str(e)[:160]}")


if __name__ == "__main__":
    main()
