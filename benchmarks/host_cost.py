"""Host time per call of torch eager: N back-to-back calls at a small shape, one sync, divided by N.

At the small shape (default B1 H2 S4096 D128 E64 top-16) the GPU work per call is a few tens of
microseconds, so the launch queue never fills and the wall time of N issued calls is the host's
Python, dispatch and launch cost. Printed next to SDPA's at the same shape (the floor a user
compares against). Issue 22's targets: <= 0.15 ms forward and <= 0.5 ms forward+backward.

    PYTHONPATH=. python3 benchmarks/host_cost.py [--backends triton,cudnn,auto] [--calls 200]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vsa_torch import video_sparse_attn


def per_call_ms(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) * 1e3 / calls


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="triton,cudnn,auto")
    p.add_argument("--shape", default="1,2,4096,128,64,16", metavar="B,H,S,D,E,topk")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--profile", default=None, metavar="BACKEND",
                   help="also print where the host time of BACKEND's forward+backward goes (cProfile)")
    a = p.parse_args()
    B, H, S, D, E, topk = map(int, a.shape.split(","))
    gen = torch.Generator("cuda").manual_seed(0)

    def leaf():
        return torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v = leaf(), leaf(), leaf()
    gate = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    counts = torch.full((S // E,), E, device="cuda", dtype=torch.int32)
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)

    rows = []

    def measure(name, call):
        fwd = per_call_ms(lambda: call().detach(), a.calls)
        both = per_call_ms(lambda: call().backward(dout), a.calls)
        rows.append((name, fwd, both))

    measure("sdpa", lambda: F.scaled_dot_product_attention(q, k, v))
    for backend in a.backends.split(","):
        try:
            measure(backend, lambda: video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=backend))
        except Exception as e:  # a backend this machine lacks: say why, time the others
            print(f"{backend}: {type(e).__name__}: {str(e).splitlines()[0]}")
    print(f"host time per call, ms (B{B} H{H} S{S} D{D} E{E} top-{topk}, {a.calls} calls, one sync)")
    print(f"{'row':<8} {'fwd':>8} {'fwd+bwd':>8}")
    for name, fwd, both in rows:
        print(f"{name:<8} {fwd:8.3f} {both:8.3f}")
    if a.profile:
        import cProfile
        import pstats

        def step():
            video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=a.profile).backward(dout)

        prof = cProfile.Profile()
        prof.runcall(lambda: [step() for _ in range(a.calls)])
        torch.cuda.synchronize()
        print(f"\n{a.profile}: forward+backward, {a.calls} calls (cProfile)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(28)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
