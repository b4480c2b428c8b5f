"""How much the KV-block lists of neighbouring query blocks overlap, and what a fine kernel that
serves a group of G query blocks from the union of their lists would save in K/V tile loads.

    PYTHONPATH=. python3 benchmarks/list_overlap.py                            # 480p-64, top-62, CPU
    PYTHONPATH=. python3 benchmarks/list_overlap.py --shape 480p-256           # tile (4, 8, 8), top-20
    PYTHONPATH=. python3 benchmarks/list_overlap.py --topk 32 --noise 0.3,3 --device cuda

Why: the sm_90 fine kernels are bound by L2 read bandwidth, since every (query block, KV
block) pair of the selection loads that KV block's K and V tiles once. The way past that
ceiling is reuse: one CTA (or a 2-CTA cluster sharing loads by TMA multicast) serving G query
blocks walks the union of their G lists and loads each KV block in it once. The K/V loads
left are then union / (G * topk) of today's (the "load" figure below; 1.0 = no saving). It
pays only if neighbouring query blocks pick similar KV blocks.

What: the coarse selection as `vsa_core.reference` defines it, in float32 torch: the mean of
q and of k over each block's valid tokens, scores = q_mean @ k_mean^T / sqrt(D), top-k per
query block (empty KV blocks excluded; ties are irrelevant for these statistics). Groups are
(a) G consecutive query blocks in block numbering, and (b) boxes of gt x gh x gw neighbouring
tiles. Blocks are numbered row-major over the tile grid (t, h, w) (`vsa_core.metadata`), so
consecutive blocks are neighbours along w and a consecutive group of G <= tiles-along-w that
divides it is the box 1 x 1 x G; boxes in t or h are spatial neighbours the numbering puts
far apart. Only groups that fit whole in the grid are counted (the column "blocks" says how
many query blocks that covers); figures are means over groups, heads and seeds.

Inputs come from `stage_breakdown.inputs`: i.i.d. randn q / k (no structure), and its smooth
field (noise * randn + 3.0 * a trilinearly upsampled low-frequency randn over (t, h, w)) at
several noise weights. Both are synthetic: a trained video model's activations are what
decides, and are not here. The column "indep." is the exact expectation for independent
uniformly random lists, n * (1 - (1 - k / n) ** G).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from stage_breakdown import SHAPES, inputs  # noqa: E402

# (label, box (gt, gh, gw)); None: G consecutive block numbers
GROUPS = [("1", 1, (1, 1, 1))]
GROUPS += [(f"{G} consecutive", G, None) for G in (2, 4, 8)]
GROUPS += [(f"{'x'.join(map(str, box))} (t,h,w)", math.prod(box), box)
           for box in ((1, 1, 2), (1, 2, 1), (2, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 4),
                       (2, 2, 2), (1, 2, 4), (1, 4, 2), (2, 1, 4), (1, 1, 8))]


def group_index(num_tiles, G, box):
    """int64 [groups, G] of query-block numbers, only groups that fit whole in the grid."""
    n = math.prod(num_tiles)
    if box is None:
        return torch.arange(n // G * G).reshape(-1, G)
    grid = torch.arange(n).reshape(num_tiles)
    cut = [nt // b * b for nt, b in zip(num_tiles, box)]
    grid = grid[:cut[0], :cut[1], :cut[2]]
    (gt, gh, gw), (ct, ch, cw) = box, cut
    grid = grid.reshape(ct // gt, gt, ch // gh, gh, cw // gw, gw).permute(0, 2, 4, 1, 3, 5)
    return grid.reshape(-1, G)


def selection(q, k, counts, E, topk):
    """Bool [B*H, nQ, nKV]: the top-k KV blocks of each query block (float32, valid-token means)."""
    B, H, S, D = q.shape
    n = S // E
    cnt = counts.clamp(0, E).to(torch.float32)[:, None]

    def pool(x):  # padded rows are zero (to_tiled), so sum / count is the mean of the valid tokens
        total = x.float().reshape(B * H, n, E, D).sum(2)
        return torch.where(cnt > 0, total / cnt.clamp_min(1), 0.0)

    scores = pool(q) @ pool(k).transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill((counts <= 0)[None, None, :], -math.inf)
    k_eff = min(topk, int((counts > 0).sum()))
    mask = torch.zeros_like(scores, dtype=torch.bool)
    return mask.scatter_(-1, scores.topk(k_eff, dim=-1).indices, True), k_eff


def union_sizes(mask, idx):
    """Mean over heads and groups of |union of the group's lists|."""
    return mask[:, idx].any(dim=2).sum(-1).float().mean().item()


def measure(shape_name, topk, kinds, seeds, device):
    """The markdown table of one shape."""
    B, H, video, D, tile, default_topk = SHAPES[shape_name]
    shape = (B, H, video, D, tile, topk or default_topk)
    table = {}  # kind -> [mean union per group row]
    for label, smooth, noise in kinds:
        rows = None
        for seed in seeds:
            meta, q, k = inputs(shape, smooth, seed=seed, device=device, noise=noise, fields=2)
            counts = torch.as_tensor(meta.variable_block_sizes, device=device)
            mask, k_eff = selection(q, k, counts, meta.block_elems, shape[-1])
            got = [union_sizes(mask, group_index(meta.num_tiles, G, box).to(device)) if box_fits(meta, box)
                   else math.nan for _, G, box in GROUPS]
            rows = got if rows is None else [a + b for a, b in zip(rows, got)]
        table[label] = [r / len(seeds) for r in rows]

    n = math.prod(meta.num_tiles)
    lines = [f"**{shape_name}**: video {video}, tile {tile}, grid (t,h,w) {meta.num_tiles} = {n} blocks, "
             f"top-{k_eff}, B{B} H{H} D{D}, seeds {seeds}. "
             f"Cells: mean union size of the group's lists / load = union / (G * {k_eff}).", ""]
    lines.append("| group | G | blocks | indep. | " + " | ".join(label for label, _, _ in kinds) + " |")
    lines.append("| --- " * (4 + len(kinds)) + "|")
    for i, (name, G, box) in enumerate(GROUPS):
        if not box_fits(meta, box):
            continue
        covered = group_index(meta.num_tiles, G, box).numel()
        indep = n * (1 - (1 - k_eff / n) ** G)
        cells = [f"{indep:.1f} / {indep / (G * k_eff):.2f}"]
        cells += [f"{table[label][i]:.1f} / {table[label][i] / (G * k_eff):.2f}" for label, _, _ in kinds]
        lines.append(f"| {name} | {G} | {covered} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def box_fits(meta, box):
    return box is None or all(b <= nt for b, nt in zip(box, meta.num_tiles))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="480p-64", help=f"comma-separated, of {tuple(SHAPES)}")
    ap.add_argument("--topk", type=int, default=None, help="default: the shape's (62 at 480p-64, 20 at 480p-256)")
    ap.add_argument("--noise", default="0.3,1,3", help="noise weights of the smooth inputs (low field weight 3.0)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; each draws all heads anew")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    kinds = [("randn", False, 0.0)] + [(f"smooth {float(w):g}", True, float(w)) for w in args.noise.split(",")]
    text = "\n\n".join(measure(name, args.topk, kinds, seeds, args.device) for name in args.shape.split(","))
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "list_overlap.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
