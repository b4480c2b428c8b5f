"""Where the time of one whole-VSA call goes, stage by stage (GPU), and how much the KV lists of
neighbouring query blocks overlap (what decides a paired-query-block fine kernel's design).

    PYTHONPATH=. python3 benchmarks/stage_breakdown.py                       # 480p-64, triton + cudnn
    PYTHONPATH=. python3 benchmarks/stage_breakdown.py --shape 480p-256 --backends triton,cute

Stages are timed with CUDA events recorded around every launch function that `vsa_core.ops`
calls (pooling, coarse attention, top-k, list building, the fine stage and its epilogues),
by wrapping those functions for the duration of this script. Launches are serialised on one
stream, so an event pair measures its own kernels; a stage that contains others (a backend's
`sparse_forward` calls `mix_coarse`) is reported without them ("self" time). Each figure is
the median over `--iters` calls after warm-up. The sum of the stages is compared with the
call's own wall time (events around the whole call) so that the host gaps show.

List overlap: for the blocks selected by the kernel's own top-k, the mean Jaccard overlap
|A & B| / |A | B| of the KV lists of query blocks (i, i+1) (neighbours in tile order) and, for
comparison, of a random pair. Measured on two inputs: i.i.d. randn q/k (no structure; a lower
bound) and a spatially smooth field (low-frequency video-like q/k, synthetic): real
activations from a trained video model are the measurement that decides, and are not here.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vsa_torch  # noqa: E402
from vsa_core import stages  # noqa: E402
from vsa_core.backends import cudnn_backend, cute_backend, sm90_backend, triton_backend  # noqa: E402
from vsa_core.config import configure  # noqa: E402

SHAPES = {  # name: (B, H, video (T, H, W) in tokens, D, tile, topk)
    "480p-64": (1, 12, (24, 52, 32), 128, (4, 4, 4), 62),     # S = 39936, 624 blocks
    "480p-256": (1, 12, (24, 52, 32), 128, (4, 8, 8), 20),
    "small": (1, 2, (16, 16, 16), 128, (4, 4, 4), 8),
}
# the launch functions of the core: the shared stages (ops.py calls them as stages.<name>; the
# backends import the epilogues by name) and the Triton fine kernels' launchers
TRITON_STAGES = ("block_mean_pool_qkv", "coarse_forward", "topk_select", "coarse_backward",
                 "backward_preprocess", "columns_to_lists", "lists_to_mask", "block_seq_ids",
                 "mix_coarse", "add_block_grad", "sparse_backward_dq", "sparse_backward_dkdv")
BACKEND_STAGES = ("sparse_forward", "sparse_backward")
FORWARD_STAGES = ("block_mean_pool_qkv", "coarse_forward", "topk_select", "mix_coarse", "block_seq_ids")


class Tracer:
    """Records (name, start event, end event, depth) per wrapped call on the current stream."""

    def __init__(self):
        self.records = []
        self._open = []
        self.depth = 0
        self.active = False

    def wrap(self, name, fn):
        def traced(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            rec = [name, start, end, self.depth, []]
            parent = self._open[-1] if self._open else None
            self._open.append(rec)
            self.depth += 1
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                self.depth -= 1
                self._open.pop()
                (parent[4] if parent else self.records).append(rec)
        return traced

    def install(self):
        mods = (stages, triton_backend, cudnn_backend, cute_backend, sm90_backend)
        for mod in mods:
            for name in TRITON_STAGES + BACKEND_STAGES:
                if hasattr(mod, name):
                    label = name if name in TRITON_STAGES else f"{mod.__name__.split('.')[-1]}.{name}"
                    setattr(mod, name, self.wrap(label, getattr(mod, name)))


def self_times(recs, out):
    """ms per stage, the time of nested stages taken out of their parent."""
    for name, start, end, _depth, children in recs:
        total = start.elapsed_time(end)
        nested = sum(c[1].elapsed_time(c[2]) for c in children)
        out[name].append(total - nested)
        self_times(children, out)


def inputs(shape, smooth: bool, seed=0, device="cuda", noise=0.3, fields=4):
    """meta and `fields` tiled bf16 BHSD tensors (q, k, v, gate; drawn in that order, so fewer
    fields are the same q, k). smooth: `noise` * randn + 3.0 * a low-frequency field."""
    B, H, video, D, tile, topk = shape
    meta = vsa_torch.build_vsa_metadata(video_shape=video, tile_size=tile)
    g = torch.Generator(device=device).manual_seed(seed)
    S = int(np.prod(video))

    def field():
        x = torch.randn(B, H, S, D, device=device, generator=g)
        if smooth:  # a low-frequency field over (t, h, w) plus noise: neighbouring tokens correlate
            t, h, w = video
            low = torch.randn(B * H, D, max(1, t // 4), max(1, h // 8), max(1, w // 8), device=device, generator=g)
            low = torch.nn.functional.interpolate(low, size=(t, h, w), mode="trilinear", align_corners=False)
            x = noise * x + 3.0 * low.reshape(B, H, D, S).transpose(-1, -2)
        return vsa_torch.to_tiled(x.to(torch.bfloat16), meta)

    return (meta, *(field() for _ in range(fields)))


def breakdown(shape, backend, iters):
    B, H, video, D, tile, topk = shape
    meta, q, k, v, gate = inputs(shape, smooth=False)
    for x in (q, k, v, gate):
        x.requires_grad_(True)
    counts = torch.as_tensor(meta.variable_block_sizes, device="cuda")
    dout = torch.randn_like(q)

    def call():
        out = vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk=topk, block_size=tile,
                                          compress_attn_weight=gate, backend=backend)
        torch.autograd.grad(out, (q, k, v, gate), dout)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    per_stage = collections.defaultdict(list)
    walls = []
    TRACER.active = True
    for _ in range(iters):
        TRACER.records = []
        TRACER._open = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end))
        stage = collections.defaultdict(list)
        self_times(TRACER.records, stage)
        for name, ts in stage.items():
            per_stage[name].append(sum(ts))
    TRACER.active = False
    rows = {name: statistics.median(ts) for name, ts in per_stage.items()}
    return rows, statistics.median(walls)


def overlap(shape, smooth):
    B, H, video, D, tile, topk = shape
    meta, q, k, v, gate = inputs(shape, smooth=smooth, seed=1)
    counts = torch.as_tensor(meta.variable_block_sizes, device="cuda")
    E = int(np.prod(tile))
    n = q.shape[2] // E
    # the kernel's own selection: the fine stage alone gets it from the map; take it from the
    # block map that block_sparse_attn would be given, via the coarse scores' top-k on the host
    qp = q.float().reshape(B, H, n, E, D).mean(3)
    kp = k.float().reshape(B, H, n, E, D).mean(3)
    scores = qp @ kp.transpose(-1, -2)
    sel = scores.topk(min(topk, n), dim=-1).indices.cpu().numpy()
    sets = [[set(row) for row in sel[b, h]] for b in range(B) for h in range(H)]
    rng = np.random.default_rng(0)

    def jaccard(a, b):
        return len(a & b) / max(1, len(a | b))

    neigh = [jaccard(s[i], s[i + 1]) for s in sets for i in range(n - 1)]
    rand = [jaccard(s[i], s[j]) for s in sets for i, j in rng.integers(0, n, size=(n, 2))]
    union_pairs = [len(s[i] | s[i + 1]) for s in sets for i in range(0, n - 1, 2)]
    return {"neighbour_jaccard": float(np.mean(neigh)), "random_pair_jaccard": float(np.mean(rand)),
            "pair_union_over_topk": float(np.mean(union_pairs)) / topk}


TRACER = Tracer()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="480p-64", choices=tuple(SHAPES))
    ap.add_argument("--backends", default="triton,cudnn")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    configure(replay=False)  # a replayed call would not pass through the wrapped launch functions
    TRACER.install()
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "stages": {}, "overlap": {}}
    for backend in args.backends.split(","):
        try:
            rows, wall = breakdown(shape, backend, args.iters)
        except Exception as e:  # noqa: BLE001 (a backend that cannot run: say why, keep the others)
            print(f"{backend}: skipped ({type(e).__name__}: {e})")
            continue
        fine = {n: t for n, t in rows.items() if "sparse_" in n}
        fwd = {n: t for n, t in rows.items() if n in FORWARD_STAGES or n.endswith(".sparse_forward")}
        print(f"\n{args.shape} backend={backend}: stage self-times, ms (median of {args.iters}; fwd+bwd call)")
        for name, t in sorted(rows.items(), key=lambda kv: -kv[1]):
            print(f"  {name:36s} {t:8.3f}")
        total = sum(rows.values())
        fine_t = sum(fine.values())
        print(f"  {'sum of stages':36s} {total:8.3f}   call wall {wall:.3f} ms (host gaps {wall - total:.3f})")
        print(f"  fine kernels {fine_t:.3f} ms; everything else {total - fine_t:.3f} ms "
              f"= {100 * (total - fine_t) / fine_t:.1f}% of the fine stage")
        fwd_t, fine_fwd = sum(fwd.values()), sum(t for n, t in fine.items() if n.endswith("forward"))
        bwd_t, fine_bwd = total - fwd_t, fine_t - fine_fwd
        print(f"  forward {fwd_t:.3f} ms (fine {fine_fwd:.3f}, rest {100 * (fwd_t - fine_fwd) / fine_fwd:.1f}%); "
              f"backward {bwd_t:.3f} ms (fine {fine_bwd:.3f}, rest {100 * (bwd_t - fine_bwd) / max(fine_bwd, 1e-9):.1f}%)")
        result["stages"][backend] = {"self_ms": rows, "wall_ms": wall}
    for smooth in (False, True):
        label = "smooth" if smooth else "randn"
        result["overlap"][label] = overlap(shape, smooth)
        print(f"list overlap ({label}): {result['overlap'][label]}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"stage_breakdown_{args.shape}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
