"""Our top-k selection against the one FastVideo's 256-token forward tests build as their
reference (`fastvideo-kernel/tests/test_vsa256_forward*.py`): randn q, k in bf16, block means
of 256 tokens rounded to bf16, `torch.matmul(q_c, k_c^T) / sqrt(D)` in bf16, `torch.topk`.
On a GPU that is CUDA torch.topk itself (ties to the lower index: it takes tied values in
index order); on the CPU (whose torch.topk breaks ties otherwise) the same scores ranked by
that rule. Counts the query-block rows whose selected set differs, over fresh draws:

    PYTHONPATH=. python3 benchmarks/fastvideo_selection_check.py [--draws 20] [--device cuda]

0 differing rows is the expected result; ranking the unrounded fp32 scores instead differs in
about one draw in four (the `fp32` column, computed from the same means)."""

import argparse
import math

import numpy as np
import torch

from vsa_core.api import prepare_vsa
from vsa_core import stages as S
from vsa_core.launch import eager_launcher


def fastvideo_selection(q, k, E: int, topk: int):
    """FastVideo's reference construction: (selection mask [B, H, nQ, nKV], bf16 scores, means)."""
    B, H, S, D = q.shape
    qc = (q.view(B, H, S // E, E, D).float().sum(3) / E).to(q.dtype)
    kc = (k.view(B, H, k.shape[2] // E, E, D).float().sum(3) / E).to(k.dtype)
    scores = torch.matmul(qc, kc.transpose(-2, -1)) / (D ** 0.5)
    if scores.is_cuda:
        idx = torch.topk(scores, topk, dim=-1).indices
    else:  # CUDA torch.topk's rule: the highest values, tied ones in index order
        idx = torch.sort(-scores.float(), dim=-1, stable=True).indices[..., :topk]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True), qc, kc


def our_selection(q, k, E: int, topk: int):
    """The pooling, coarse and top-k launches of vsa_core.ops.forward: the selection mask."""
    q_counts = torch.full((q.shape[2] // E,), E, dtype=torch.int32, device=q.device)
    kv_counts = torch.full((k.shape[2] // E,), E, dtype=torch.int32, device=q.device)
    p = prepare_vsa(q, k, k, kv_counts, q_counts, topk, E).problem
    b = {n: torch.empty(shape, device=q.device, dtype=q.dtype if kind == "input" else getattr(torch, kind))
         for n, (shape, kind) in p.forward_buffers().items()}
    S.block_mean_pool_qkv(eager_launcher, p, q, k, k, q_counts, kv_counts, b["q_pool"], b["k_pool"], b["v_pool"])
    S.coarse_forward(eager_launcher, p, b["q_pool"], b["k_pool"], b["v_pool"], kv_counts, b["scores"], b["out_coarse"],
                     b["lse_coarse"])
    S.topk_select(eager_launcher, p, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"])
    return b["sel_mask"].bool()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    E, topk, H, D = 256, 2, 8, 128  # the tests' case: 8 heads, D 128, top-2
    for n_q, n_kv in ((8, 8), (8, 12)):  # test_vsa256_forward_qk_equal / _qk_diff (and _cross)
        rows = ours = fp32 = 0
        for seed in range(args.draws):
            g = torch.Generator(device=args.device).manual_seed(1000 * n_kv + seed)
            q, k = (torch.randn(1, H, n * E, D, generator=g, device=args.device).to(torch.bfloat16)
                    for n in (n_q, n_kv))
            want, qc, kc = fastvideo_selection(q, k, E, topk)
            got = our_selection(q, k, E, topk)
            unrounded = (qc.double() @ kc.double().transpose(-2, -1)).float() * np.float32(1 / math.sqrt(D))
            by_fp32 = torch.zeros_like(want).scatter_(
                -1, torch.sort(-unrounded, dim=-1, stable=True).indices[..., :topk], True)
            rows += want[..., 0].numel()
            ours += int((got != want).any(-1).sum())
            fp32 += int((by_fp32 != want).any(-1).sum())
        print(f"{n_q} x {n_kv} blocks, {args.draws} draws on {args.device}: {rows} rows, "
              f"ours differ in {ours}, fp32 ranking in {fp32}")


if __name__ == "__main__":
    main()
