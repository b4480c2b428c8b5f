"""Where a torch eager training step's host time goes, split by what runs it (issue 22, item 6).

`host_cost.py` times the forward and the forward+backward (`out.backward(dout)`). This splits the
backward's share, at the same small shape, by timing each of these back to back (N calls, one sync,
divided by N) for each backend, for SDPA, and for a Python autograd node that launches nothing
(`_PythonNode`, the floor of any Python backward):

  fwd            the forward on inputs that require grad (keeps what the backward needs)
  fwd+grad       the forward, then torch.autograd.grad(out, inputs, dout): the engine, no .grad adds
  fwd+backward   the forward, then out.backward(dout): the engine and four in-place .grad adds
  fwd+node       the forward, then out.grad_fn's backward called on this thread (no engine: the
                 frontend's backward and its launches only)

and then, under torch.profiler (CPU and CUDA activities) for a few steps of each backend named by
--trace: the kernels per step and their summed GPU time (to show the step is host-bound), and the
host ops that take the most CPU time.

    PYTHONPATH=. python3 benchmarks/host_split.py [--backends triton,sm90] [--calls 300] [--trace sm90,triton]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from host_cost import per_call_ms  # benchmarks/ is the script's directory
from vsa_torch import video_sparse_attn


def rows_for(name, call, inputs, dout, calls):
    def node():
        grad_fn = call().grad_fn
        if name in ("sdpa", "python"):  # one gradient: the node's one output
            grad_fn(dout) if name == "sdpa" else grad_fn.apply(dout)
        else:  # the eager operator's node: its backward (dout, and None for lse)
            grad_fn.apply(dout, None)

    rows = [
        ("fwd", per_call_ms(lambda: call().detach(), calls)),
        ("fwd+grad", per_call_ms(lambda: torch.autograd.grad(call(), inputs, dout), calls)),
        ("fwd+backward", per_call_ms(lambda: call().backward(dout), calls)),
    ]
    try:
        rows.append(("fwd+node", per_call_ms(node, calls)))
    except Exception as e:  # the node's call convention differs: say so, keep the others
        print(f"{name} fwd+node: {type(e).__name__}: {str(e).splitlines()[0]}")
        rows.append(("fwd+node", float("nan")))
    return rows


class _PythonNode(torch.autograd.Function):
    """The floor of a Python autograd node on the GPU: one allocation forward, four backward, no
    kernels (the engine's hand-over to its device thread and back, the GIL, the .grad adds)."""

    @staticmethod
    def forward(ctx, q, k, v, gate):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.empty_like(dout) for _ in range(4))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="triton,sm90,cudnn")
    p.add_argument("--shape", default="1,2,4096,128,64,16", metavar="B,H,S,D,E,topk")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--trace", default="", metavar="BACKENDS", help="profile a few steps of each (comma-separated)")
    a = p.parse_args()
    B, H, S, D, E, topk = map(int, a.shape.split(","))
    gen = torch.Generator("cuda").manual_seed(0)

    def leaf():
        return torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    q, k, v, gate = leaf(), leaf(), leaf(), leaf()
    counts = torch.full((S // E,), E, device="cuda", dtype=torch.int32)
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    calls = {"sdpa": (lambda: F.scaled_dot_product_attention(q, k, v), [q, k, v]),
             "python": (lambda: _PythonNode.apply(q, k, v, gate), [q, k, v, gate])}
    for backend in a.backends.split(","):
        calls[backend] = ((lambda b=backend: video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=b)),
                          [q, k, v, gate])
    table = {}
    for name, (call, inputs) in calls.items():
        try:
            table[name] = rows_for(name, call, inputs, dout, a.calls)
        except Exception as e:  # a backend this machine lacks: say why, time the others
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
    print(f"host time per call, ms (B{B} H{H} S{S} D{D} E{E} top-{topk}, {a.calls} calls, one sync)")
    cols = [c for c, _ in next(iter(table.values()))]
    print(f"{'row':<8} " + " ".join(f"{c:>13}" for c in cols))
    for name, row in table.items():
        print(f"{name:<8} " + " ".join(f"{t:13.3f}" for _, t in row))
    for name in filter(None, a.trace.split(",")):
        trace(calls[name][0], dout, name)


def trace(call, dout, name, steps: int = 20):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        call().backward(dout)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call().backward(dout)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    n = sum(e.count for e in kernels) / steps
    gpu_us = sum(e.device_time_total for e in kernels) / steps
    print(f"\n{name}: {steps} training steps under torch.profiler: {n:.1f} GPU activities a step, "
          f"{gpu_us:.1f} us of GPU time a step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="device_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
