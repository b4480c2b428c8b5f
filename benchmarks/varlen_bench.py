"""Packed variable-length sequences (video_sparse_attn_varlen) against the alternatives.

A pack of videos of different sizes (default: Wan latents of a 480p, a 360p and a 240p
5-second clip and a 2-second 480p clip, 64-token (4, 4, 4) tiles, shapes from
`build_vsa_metadata`) runs as:

- packed:        one `video_sparse_attn_varlen` call over the packed stream;
- per-sequence:  one `video_sparse_attn_bshd` call per video (B = 1 each);
- padded batch:  one `video_sparse_attn_bshd` call, B = number of videos, every video padded
                 to the longest (the counts are one vector for the whole batch, so the
                 shorter videos' padding is not even masked: this is the cost of padding,
                 not a correct alternative);
- single:        one `video_sparse_attn_bshd` call on one sequence of the packed total
                 length (same blocks, same counts, same topk): the same work as the pack
                 without the sequence boundaries. Target: packed >= 95% of its throughput.

Prints milliseconds (forward, forward + backward) and throughput ratios, checks the packed
output against the per-sequence one, and writes `$OUT/varlen_bench.json` when OUT is set.

    PYTHONPATH=. python3 benchmarks/varlen_bench.py                    # H200: about a minute
    PYTHONPATH=. python3 benchmarks/varlen_bench.py --frontends torch,jax
    PYTHONPATH=. python3 benchmarks/varlen_bench.py --smoke            # CPU plumbing check (interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU's memory to torch too

import triton  # noqa: E402

import vsa_torch  # noqa: E402
from vsa_core.metadata import build_vsa_metadata  # noqa: E402

# Wan latents (VAE: 8x spatial, 4x temporal; patch 1x2x2): (frames, height, width) in tokens
VIDEOS = {
    "480p": (21, 30, 52),      # 480x832, 81 frames
    "360p": (21, 22, 40),      # 352x640, 81 frames
    "240p": (21, 15, 26),      # 240x416, 81 frames
    "480p-2s": (9, 30, 52),    # 480x832, 33 frames (2 s at 16 fps)
}
SMOKE_VIDEOS = {"a": (4, 8, 8), "b": (4, 4, 6), "c": (4, 4, 4), "d": (2, 4, 8)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tile", default="4,4,4", help="tile (t,h,w); 4,4,4 = 64 tokens")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=62, help="KV blocks per query block (62 = 10%% of 480p's 624 tiles)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--frontends", default="torch", help="torch and/or jax (jitted), comma-separated")
    p.add_argument("--rep-ms", type=float, default=200.0)
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--smoke", action="store_true", help="tiny videos, H1 D64 topk 2: a CPU plumbing check")
    args = p.parse_args(argv)
    args.tile = tuple(int(x) for x in args.tile.split(","))
    if args.smoke:
        args.heads, args.head_dim, args.topk = 1, 64, 2
    return args


def timer(device: str, rep_ms: float, warmup_ms: float):
    def ms(fn) -> float:
        if device == "cuda":
            return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        fn()
        times = []
        for _ in range(2):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    return ms


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    videos = SMOKE_VIDEOS if args.smoke else VIDEOS
    metas = {name: build_vsa_metadata(shape, args.tile) for name, shape in videos.items()}
    E, H, D, topk = metas[next(iter(metas))].block_elems, args.heads, args.head_dim, args.topk
    lens = [m.padded_len for m in metas.values()]
    counts = [torch.from_numpy(m.variable_block_sizes.astype(np.int32)).to(device) for m in metas.values()]
    total = sum(lens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    all_counts = torch.cat(counts)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    # packed tokens [total, H, D]; padding tokens zeroed, as the callers of VSA must
    q, k, v, gate, dout = (randn(total, H, D) for _ in range(5))
    valid = torch.cat([torch.arange(E, device=device)[None, :] < c[:, None] for c in counts]).reshape(-1)
    for t in (q, k, v):
        t.mul_(valid[:, None, None])
    inputs = (q, k, v, gate)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}; "
          f"backend {args.backend}; H{H} D{D} E{E} topk {topk}")
    for (name, m), n in zip(metas.items(), lens):
        print(f"  {name:8s} video {m.video_shape} -> {n} tokens, {n // E} tiles")
    print(f"  packed: {total} tokens, {total // E} tiles, {len(lens)} sequences")

    def packed_fn(q, k, v, gate):
        return vsa_torch.video_sparse_attn_varlen(q, k, v, cu, cu, all_counts, all_counts, topk, args.tile, gate,
                                                  backend=args.backend)

    starts = np.concatenate([[0], np.cumsum(lens)])  # host copy: the per-sequence calls slice on the host

    def per_sequence_fn(q, k, v, gate):
        outs = []
        for i, c in enumerate(counts):
            s = slice(int(starts[i]), int(starts[i + 1]))
            outs.append(vsa_torch.video_sparse_attn_bshd(q[s][None], k[s][None], v[s][None], c, c, topk, args.tile,
                                                         gate[s][None], backend=args.backend)[0])
        return torch.cat(outs)

    longest = max(range(len(lens)), key=lambda i: lens[i])
    S_pad = lens[longest]

    def pad_batch(x):
        out = x.new_zeros(len(lens), S_pad, H, D)
        for i in range(len(lens)):
            out[i, :lens[i]] = x[int(starts[i]):int(starts[i + 1])]
        return out

    padded_inputs = tuple(pad_batch(t).requires_grad_() for t in inputs)
    padded_dout = pad_batch(dout)

    def padded_fn(q, k, v, gate):
        return vsa_torch.video_sparse_attn_bshd(q, k, v, counts[longest], counts[longest], topk, args.tile, gate,
                                                backend=args.backend)

    def single_fn(q, k, v, gate):
        return vsa_torch.video_sparse_attn_bshd(q[None], k[None], v[None], all_counts, all_counts, topk, args.tile,
                                                gate[None], backend=args.backend)[0]

    ms = timer(device, args.rep_ms, args.warmup_ms)
    grads_in = tuple(t.detach().requires_grad_() for t in inputs)
    contenders = {
        "packed (varlen)": (packed_fn, grads_in, dout),
        "per-sequence calls": (per_sequence_fn, grads_in, dout),
        "padded batch": (padded_fn, padded_inputs, padded_dout),
        "single sequence": (single_fn, grads_in, dout),
    }
    frontends = args.frontends.split(",")
    if "jax" in frontends:
        contenders.update(jax_contenders(args, inputs, dout, cu, all_counts, topk))

    # correctness: the pack against the per-sequence calls
    with torch.no_grad():
        a, b = packed_fn(*inputs).float(), per_sequence_fn(*inputs).float()
    check = float((a - b).abs().max() / b.abs().max())
    print(f"packed vs per-sequence: max |diff| / max |out| = {check:.2e}")

    results = {}
    for name, (fn, xs, g) in contenders.items():
        if name.startswith("jax"):
            fwd, fwd_bwd = fn
        else:
            fwd = (lambda fn=fn, xs=xs: fn(*xs))
            fwd_bwd = (lambda fn=fn, xs=xs, g=g: torch.autograd.grad(fn(*xs), xs, g))
        with torch.no_grad():  # the inference forward (nothing kept for a backward)
            t_fwd = ms(fwd)
        results[name] = {"fwd_ms": t_fwd, "fwd_bwd_ms": ms(fwd_bwd)}
        print(f"  timed {name}", flush=True)

    single = results["single sequence"]
    print(f"\n{'':22s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'fwd vs single':>14s} {'fwd+bwd vs single':>18s}")
    for name, r in results.items():
        r["fwd_throughput_vs_single"] = single["fwd_ms"] / r["fwd_ms"]
        r["fwd_bwd_throughput_vs_single"] = single["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        print(f"{name:22s} {r['fwd_ms']:9.3f} {r['fwd_bwd_ms']:11.3f} {r['fwd_throughput_vs_single']:13.1%} "
              f"{r['fwd_bwd_throughput_vs_single']:17.1%}")
    packed = results["packed (varlen)"]
    ok = packed["fwd_throughput_vs_single"] >= 0.95 and packed["fwd_bwd_throughput_vs_single"] >= 0.95
    print(f"\npacked vs per-sequence calls: {results['per-sequence calls']['fwd_ms'] / packed['fwd_ms']:.2f}x fwd, "
          f"{results['per-sequence calls']['fwd_bwd_ms'] / packed['fwd_bwd_ms']:.2f}x fwd+bwd; "
          f"vs padded batch: {results['padded batch']['fwd_ms'] / packed['fwd_ms']:.2f}x fwd, "
          f"{results['padded batch']['fwd_bwd_ms'] / packed['fwd_bwd_ms']:.2f}x fwd+bwd")
    print(f"target packed >= 95% of the single sequence's throughput: {'met' if ok else 'NOT met'}")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "varlen_bench.json")
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "videos": {n: list(m.video_shape) for n, m in metas.items()}, "tokens": lens,
                       "heads": H, "head_dim": D, "block_elems": E, "topk": topk, "backend": args.backend,
                       "packed_vs_per_sequence_max_rel_diff": check, "results": results}, f, indent=1)
        print(f"wrote {path}")
    return 0


def jax_contenders(args, inputs, dout, cu, counts, topk) -> dict:
    """Jitted JAX: the pack and the single sequence (fwd, fwd+bwd as blocking calls)."""
    import jax
    import jax.numpy as jnp

    import vsa_jax

    def to_jax(t):
        return jnp.asarray(t.detach().float().cpu().numpy(), jnp.bfloat16)

    xs = tuple(to_jax(t) for t in inputs)
    g = to_jax(dout)
    cu_j, counts_j = jnp.asarray(cu.cpu().numpy()), jnp.asarray(counts.cpu().numpy())

    def packed(q, k, v, gate, cu, counts):
        return vsa_jax.video_sparse_attn_varlen(q, k, v, cu, cu, counts, counts, topk, args.tile, gate,
                                                backend=args.backend)

    def single(q, k, v, gate, cu, counts):
        return vsa_jax.video_sparse_attn_bshd(q[None], k[None], v[None], counts, counts, topk, args.tile, gate[None],
                                              backend=args.backend)[0]

    out = {}
    for name, f in (("jax packed (varlen)", packed), ("jax single sequence", single)):
        fwd = jax.jit(f)

        @jax.jit
        def fwd_bwd(q, k, v, gate, cu, counts, dout, f=f):
            _, vjp = jax.vjp(lambda *a: f(*a, cu, counts), q, k, v, gate)
            return vjp(dout)

        def wait(fn):
            def call():
                if torch.cuda.is_available():
                    torch.cuda.current_stream().synchronize()
                return jax.block_until_ready(fn())
            return call
        out[name] = ((wait(lambda fwd=fwd: fwd(*xs, cu_j, counts_j)),
                      wait(lambda fwd_bwd=fwd_bwd: fwd_bwd(*xs, cu_j, counts_j, g))), None, None)
    return out


if __name__ == "__main__":
    sys.exit(main())
