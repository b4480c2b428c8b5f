"""Host time per call of torch eager: N back-to-back calls at a small shape, one sync, divided by N.

At the small shape (default B1 H2 S4096 D128 E64 top-16) the GPU work per call is a few tens of
microseconds, so the launch queue never fills and the wall time of N issued calls is the host's
Python, dispatch and launch cost. Printed next to SDPA's at the same shape (the floor a user
compares against). Issue 22's targets: <= 0.15 ms forward and <= 0.5 ms forward+backward.

    PYTHONPATH=. python3 benchmarks/host_cost.py [--backends triton,cudnn,auto] [--calls 200]
    PYTHONPATH=. python3 benchmarks/host_cost.py --backends cudnn --layers cudnn   # where it goes, by layer

--layers BACKEND times the forward's layers one by one, each on buffers built once: the public call;
the core's launch sequence (`vsa_core.ops.forward`, no frontend: no checks, no custom op, no
allocation); that sequence replayed (`vsa_core.replay`: what the eager path runs once a problem's
launches are captured; "-" and the reason for a backend that cannot be replayed); the backend's
fine stage alone (`sparse_forward`); one shared stage (the pooling: one Triton launch through the
launch seam). The differences between the rows are each layer's own cost.
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


def training_inputs(shape: str):
    """q, k, v, gate (bf16 leaves that require grad), the full per-block counts, dout, E and top-k of a
    "B,H,S,D,E,topk" shape, on the GPU (seeded)."""
    B, H, S, D, E, topk = map(int, shape.split(","))
    gen = torch.Generator("cuda").manual_seed(0)

    def leaf():
        return torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v, gate = leaf(), leaf(), leaf(), leaf()
    counts = torch.full((S // E,), E, device="cuda", dtype=torch.int32)
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, gate, counts, dout, E, topk


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="triton,cudnn,auto")
    p.add_argument("--shape", default="1,2,4096,128,64,16", metavar="B,H,S,D,E,topk")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--layers", default=None, metavar="BACKEND",
                   help="also time BACKEND's forward layer by layer (public call, core, fine stage, one launch)")
    p.add_argument("--profile", default=None, metavar="BACKEND",
                   help="also print where the host time of BACKEND's forward+backward goes (cProfile)")
    a = p.parse_args()
    q, k, v, gate, counts, dout, E, topk = training_inputs(a.shape)
    B, H, S, D = q.shape

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
    if a.layers:
        time_layers(a.layers, q, k, v, gate, counts, topk, E, a.calls)
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


def time_layers(backend, q, k, v, gate, counts, topk, E, calls):
    """The forward's host time per layer (training: the forward keeps what the backward needs)."""
    from vsa_core import ops as core_ops
    from vsa_core import stages
    from vsa_core.api import op_statics
    from vsa_core.backends import backend_named
    from vsa_core.backends.base import FineForward
    from vsa_core.launch import eager_launcher
    from vsa_core.problem import AttnProblem
    from vsa_core.spec import op_problem
    from vsa_torch.ops import TORCH_BUFFERS, _alloc, device_info

    B, H, S, D = q.shape
    p0 = AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=E, dtype="bfloat16", topk=topk,
                     has_gate=True)
    statics = op_statics(p0, backend, device_info(q))
    named = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "kv_counts": counts, "q_counts": counts,
             "gate": gate.detach()}
    p = op_problem(statics, named)
    impl = backend_named(statics.backend)
    buffers = {**named, **_alloc(p.forward_buffers(), q)}
    core_ops.forward(p, impl, buffers, adapter=TORCH_BUFFERS)  # the fine stage's lists are now there
    fine = FineForward(**{f: buffers.get(f) for f in FineForward.__dataclass_fields__})
    from vsa_core.replay import CapturingLauncher
    capture = CapturingLauncher(buffers)
    core_ops.forward(p, impl, buffers, adapter=TORCH_BUFFERS, launcher=capture)
    replay, why = capture.replay()
    if not getattr(impl, "replayable", False):  # its fine stage does more than the launches captured
        replay, why = None, f"the {statics.backend} backend's fine stage is not replayable"
    workspace = view = None
    if replay is not None:  # as vsa_torch.ops runs a replay: one workspace allocation, views for CuTe DSL steps
        from vsa_core.backends._torch_views import viewer
        workspace = torch.empty(replay.workspace_bytes, dtype=torch.uint8, device=q.device)
        bases = {n: (t, 0) for n, t in buffers.items() if t is not None}
        bases.update((n, (workspace, offset)) for n, offset in replay.workspace)
        view = viewer(bases) if replay.needs_views else None
    rows = [
        ("public call", lambda: video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=backend)),
        ("core ops.forward", lambda: core_ops.forward(p, impl, buffers, adapter=TORCH_BUFFERS)),
        ("core launches replayed", (lambda: replay.run(buffers, torch.cuda.current_stream().cuda_stream,
                                                        workspace.data_ptr(), view))
         if replay is not None else None),
        ("fine stage alone", lambda: impl.sparse_forward(eager_launcher, p, fine)),
        ("one launch (pooling)", lambda: stages.block_mean_pool_qkv(
            eager_launcher, p, buffers["q"], buffers["k"], buffers["v"], counts, counts, buffers["q_pool"],
            buffers["k_pool"], buffers["v_pool"])),
    ]
    print(f"\n{statics.backend}: the forward's host time by layer, ms per call ({calls} calls, one sync)")
    with torch.no_grad():
        for name, fn in rows:
            if fn is None:
                print(f"  {name:<22} {'-':>8}  ({why})")
            else:
                print(f"  {name:<22} {per_call_ms(fn, calls):8.3f}")


if __name__ == "__main__":
    main()
