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
        [--ablate triton,sm90] [--profile triton,sm90]

--ablate times fwd+grad again with the backward's replayed launches skipped, then with the backward
replaced by an empty one (`ablated`): the differences are the launches' host time, the rest of the
backward's Python, and the engine's cost for the operator's node (against `python`'s floor).

--profile runs cProfile over the forward calls (on this thread), then over the eager operator's
backward (on the engine's device thread), and prints the functions with the most own time per call:
which of our Python lines the host time is (cProfile's per-call overhead inflates small functions;
read the ranking, not the sum).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import threading

import torch
import torch.nn.functional as F

from host_cost import per_call_ms, training_inputs  # benchmarks/ is the script's directory
from vsa_torch import video_sparse_attn


def rows_for(name, call, inputs, dout, calls):
    def node():
        out = call()  # kept alive: a Python node's grad_fn holds its node only weakly
        if name in ("sdpa", "python"):  # one gradient: the node's one output
            out.grad_fn(dout) if name == "sdpa" else out.grad_fn.apply(dout)
        else:  # the eager operator's node: its backward (dout, and None for lse)
            out.grad_fn.apply(dout, None)

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


@contextlib.contextmanager
def ablated(what: str):
    """The eager operator with part of its backward taken out (`--ablate`), to place its host time:
    "no-launches": the backward's replayed launches skipped (on the engine's thread only, so the
    forward still launches); "empty": the backward replaced by one that allocates the gradients and
    does nothing else (the `_PythonNode` floor, in the operator's own node: its outputs, saved
    tensors and gradient count)."""
    from vsa_core import replay
    from vsa_torch import ops
    if what == "no-launches":
        real = replay.Replay.launch

        def launch(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                real(self, *args, **kwargs)
        replay.Replay.launch = launch
        try:
            yield
        finally:
            replay.Replay.launch = real
    elif what == "empty":
        real = ops._EagerOperator.backward

        def backward(ctx, dout, _):
            return (None, *(None if g is None else torch.empty_like(dout) for g in ctx.call.gradients))
        ops._EagerOperator.backward = staticmethod(backward)
        try:
            yield
        finally:
            ops._EagerOperator.backward = staticmethod(real)
    else:
        raise ValueError(f"--ablate: {what!r} is none of no-launches, empty")


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
    p.add_argument("--ablate", default="", metavar="BACKENDS",
                   help="also time fwd+grad of each with the backward's launches skipped and with an empty backward")
    p.add_argument("--profile", default="", metavar="BACKENDS",
                   help="cProfile the forward and the backward of each (comma-separated)")
    a = p.parse_args()
    q, k, v, gate, counts, dout, E, topk = training_inputs(a.shape)
    B, H, S, D = q.shape
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
    for name in filter(None, a.ablate.split(",")):
        call, inputs = calls[name]
        print(f"\n{name}: fwd+grad with part of the backward taken out, ms per call ({a.calls} calls, one sync)")
        print(f"  {'whole backward':<28} {dict(table[name])['fwd+grad']:8.3f}" if name in table else "")
        for what in ("no-launches", "empty"):
            with ablated(what):
                ms = per_call_ms(lambda: torch.autograd.grad(call(), inputs, dout), a.calls)
            print(f"  {what + ' backward':<28} {ms:8.3f}")
    for name in filter(None, a.profile.split(",")):
        profile_python(name, *calls[name], dout, a.calls)
    for name in filter(None, a.trace.split(",")):
        trace(calls[name][0], dout, name)


def profile_python(name, call, inputs, dout, calls: int, rows: int = 18):
    """cProfile of `calls` training steps: the forward's functions, then the backward's (the
    eager operator's backward on the engine's thread; the profiler is enabled inside it)."""
    from vsa_torch import ops
    for _ in range(5):
        torch.autograd.grad(call(), inputs, dout)
    torch.cuda.synchronize()
    forward = cProfile.Profile()
    for _ in range(calls):
        forward.enable()
        out = call()
        forward.disable()
        torch.autograd.grad(out, inputs, dout)
    torch.cuda.synchronize()
    backward, real = cProfile.Profile(), ops._EagerOperator.backward

    def profiled(ctx, *grads):
        backward.enable()
        try:
            return real(ctx, *grads)
        finally:
            backward.disable()
    ops._EagerOperator.backward = staticmethod(profiled)
    try:
        for _ in range(calls):
            torch.autograd.grad(call(), inputs, dout)
        torch.cuda.synchronize()
    finally:
        ops._EagerOperator.backward = staticmethod(real)
    for stage, prof in (("forward", forward), ("backward", backward)):
        stats = pstats.Stats(prof).stats  # (file, line, function) -> (primitive calls, calls, own, cumulative, callers)
        total = sum(own for _, _, own, _, _ in stats.values())
        print(f"\n{name} {stage} under cProfile: {1e6 * total / calls:.1f} us of own time a call; the most:")
        print(f"  {'own us':>8} {'cum us':>8} {'calls':>6}  function")
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]
        for (file, line, function), (_, n, own, cum, _) in top:
            where = "builtin" if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line}"
            print(f"  {1e6 * own / calls:8.1f} {1e6 * cum / calls:8.1f} {n / calls:6.1f}  {function} ({where})")


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
