"""Per-call host cost of the JAX launch paths at the `small` shape (B1 H2 S4096 D128, 64-token
blocks, top-8, with a gate): native custom calls vs the buffer_callback, with and without XLA
command buffers, and torch eager for reference.

    PYTHONPATH=. python3 benchmarks/jax_native_bench.py [--iters 300] [--backend triton]

Each row runs in its own process (XLA reads XLA_FLAGS once). Columns, per call:
  dispatch us: wall time of N back-to-back calls without waiting, / N (the host's share
               when the GPU keeps up: Python, argument handling, callbacks, launches)
  steady ms:   N back-to-back calls, then wait, / N (max of host and device time)
  latency ms:  one call and wait, median
Forward = the inference forward; step = jit(grad) (forward + backward). The native path runs
the attention kernels' default tile config with pointer loads (the plan cannot autotune nor
build host TMA descriptors); the callback and torch rows run as configured (VSA_AUTOTUNE,
VSA_TMA). Writes the table and JSON to $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPE = dict(batch=1, heads=2, seq=4096, head_dim=128, block=64, topk=8)
MODES = {
    "jax native": dict(launch="native", flags=""),
    "jax native + cmd buffers": dict(launch="native",
                                     flags="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                                           "--xla_gpu_graph_min_graph_size=1"),
    "jax callback": dict(launch="callback", flags=""),
    "torch eager": dict(launch="torch", flags=""),
}


def _time_calls(call, wait, iters):
    for _ in range(5):
        wait(call())
    start = time.perf_counter()
    for _ in range(iters):
        out = call()
    dispatched = time.perf_counter() - start
    wait(out)
    steady = time.perf_counter() - start
    latencies = []
    for _ in range(min(iters, 50)):
        t0 = time.perf_counter()
        wait(call())
        latencies.append(time.perf_counter() - t0)
    return dict(dispatch_us=dispatched / iters * 1e6, steady_ms=steady / iters * 1e3,
                latency_ms=statistics.median(latencies) * 1e3)


def worker(launch: str, iters: int, backend: str) -> dict:
    import numpy as np

    B, H, S, D, E, topk = (SHAPE[k] for k in ("batch", "heads", "seq", "head_dim", "block", "topk"))
    rng = np.random.default_rng(0)
    host = {n: rng.standard_normal((B, H, S, D), np.float32) for n in ("q", "k", "v", "gate", "dout")}
    counts = np.full(S // E, E, np.int32)
    if launch == "torch":
        import torch
        import vsa_torch
        t = {n: torch.from_numpy(x).cuda().to(torch.bfloat16) for n, x in host.items()}
        kc = torch.from_numpy(counts).cuda()
        leaf = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "gate")}

        def forward():
            with torch.no_grad():
                return vsa_torch.video_sparse_attn(t["q"], t["k"], t["v"], kc, kc, topk, E, t["gate"],
                                                   backend=backend)

        def step():
            out = vsa_torch.video_sparse_attn(leaf["q"], leaf["k"], leaf["v"], kc, kc, topk, E, leaf["gate"],
                                              backend=backend)
            return torch.autograd.grad(out, [leaf[n] for n in ("q", "k", "v", "gate")], t["dout"])

        wait = lambda _: torch.cuda.synchronize()  # noqa: E731
    else:
        import jax
        import jax.numpy as jnp
        import vsa_jax
        vsa_jax.set_launch(launch)
        a = {n: jnp.asarray(x, jnp.bfloat16) for n, x in host.items()}

        def vsa(q, k, v, gate):
            return vsa_jax.video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=backend)

        fwd = jax.jit(vsa)

        def loss(q, k, v, gate, dout):
            return jnp.sum(vsa(q, k, v, gate).astype(jnp.float32) * dout.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        forward = lambda: fwd(a["q"], a["k"], a["v"], a["gate"])  # noqa: E731
        step = lambda: grad(a["q"], a["k"], a["v"], a["gate"], a["dout"])  # noqa: E731
        wait = jax.block_until_ready
    return {"forward": _time_calls(forward, wait, iters), "step": _time_calls(step, wait, iters)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--backend", default="triton", help="the backend of every row (triton, sm90, cudnn, ...)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.iters, args.backend)))
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results, lines = {}, []
    for name, mode in MODES.items():
        env = dict(os.environ)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + mode["flags"]).strip()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode["launch"],
                               "--iters", str(args.iters), "--backend", args.backend], env=env, capture_output=True,
                              text=True, timeout=900)
        found = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            results[name] = {"error": (proc.stderr or proc.stdout)[-2000:]}
            print(f"{name}: FAILED\n{results[name]['error']}", file=sys.stderr)
            continue
        results[name] = json.loads(found[-1][len("RESULT "):])
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    lines.append(f"VSA per-call cost, backend {args.backend}, {shape}, bf16, gate, {args.iters} calls")
    lines.append(f"{'path':<26} {'stage':<8} {'dispatch us':>12} {'steady ms':>10} {'latency ms':>11}")
    for name, res in results.items():
        if "error" in res:
            lines.append(f"{name:<26} FAILED (see stderr)")
            continue
        for stage in ("forward", "step"):
            r = res[stage]
            lines.append(f"{name:<26} {stage:<8} {r['dispatch_us']:>12.1f} {r['steady_ms']:>10.3f} "
                         f"{r['latency_ms']:>11.3f}")
    table = "\n".join(lines)
    print(table)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"jax_native_bench_{args.backend}.txt"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(out, f"jax_native_bench_{args.backend}.json"), "w") as f:
            json.dump({"shape": SHAPE, "iters": args.iters, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
