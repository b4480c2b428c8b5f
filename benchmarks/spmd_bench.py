"""vsa_jax on 1 vs 2 GPUs (heads split), and the per-call host cost at the `small` shape.

    PYTHONPATH=. python3 benchmarks/spmd_bench.py              # 2 x H200: a few minutes
    PYTHONPATH=. python3 benchmarks/spmd_bench.py --smoke      # plumbing check on the CPU
                                                               # (interpreter, 2 host devices, tiny shapes)

Table 1, per shape (bf16, D 128, every block full): the whole VSA (`video_sparse_attn` with a
gate), forward (jit of the op) and forward+backward (jit of jax.vjp pulled back with a fixed
output gradient), on one GPU and on two with the heads split two ways: `jax.shard_map` over the
heads, and `jax.jit` over arrays sharded over the heads (an explicit mesh: vsa_jax splits the
call itself). Two timings per row, both wall clock:
  - steady: calls issued back to back, the way a training loop issues them (host work overlaps
    the device's), ms per call = max(host cost, device time) per call;
  - latency: one call and wait, median.
Each variant runs with both JAX launch paths (`vsa_jax.set_launch`): "callback" (the default:
a buffer_callback into vsa_core per stage) and "native" (the stage's Triton launches as XLA
custom calls, no Python per call; GPU only, Triton backend only: skipped under --smoke or
--backend cute). `x1` is the 2-GPU time over the 1-GPU time of the same launch path (ideal 0.5);
`bitwise` says whether the 2-GPU results (out, dq, dk, dv, dgate) equal the 1-GPU ones of the
same launch path bit for bit (native runs a fixed tile config, the callback autotunes: the two
paths are not compared with each other here).

Table 2, at `small` (B1 H2 S4096 E64 top-8): steady ms per call of the same op through JAX's
buffer_callback and JAX's native path (1 GPU), PyTorch eager and a PyTorch CUDA-graph replay
(torch.cuda.graph after a warm-up): the replay is the device time plus a launch, so the gap to
it is the host cost per call.
`launches` counts the CUDA kernels of one eager PyTorch call (torch.profiler).

Writes spmd_bench.json (every number, device, versions) to --out, or $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check: interpreter, tiny shapes")
    ap.add_argument("--shapes", default="small,8192,480p-64", help="comma-separated: small, 8192, 480p-64")
    ap.add_argument("--backend", default="triton", help="vsa backend for every row (triton or cute)")
    ap.add_argument("--launch", default="callback,native",
                    help="JAX launch paths to measure (native: GPU and the triton backend only)")
    ap.add_argument("--budget-ms", type=float, default=300.0, help="wall time per steady measurement")
    ap.add_argument("--reps", type=int, default=3, help="steady measurements per row (median)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for spmd_bench.json")
    return ap.parse_args(argv)


ARGS = parse_args()
# must be decided before torch / triton / jax are imported
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPUs

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vsa_jax  # noqa: E402
import vsa_torch  # noqa: E402

# name: (B, H, S, D, E, topk)
SHAPES = {
    "small": (1, 2, 4096, 128, 64, 8),
    "8192": (1, 4, 8192, 128, 64, 16),
    "480p-64": (1, 12, 39936, 128, 64, 62),
}
SMOKE_SHAPES = {"small": (1, 2, 256, 64, 64, 2), "8192": (1, 4, 256, 64, 64, 2)}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- timing ------------------------------------------------------------------------------
def steady_ms(call, wait, budget_ms: float, reps: int) -> float:
    """Median over reps of the wall ms per call of calls issued back to back (then one wait)."""
    wait(call())
    t = time.perf_counter()
    wait(call())
    n = max(1 if ARGS.smoke else 3, min(2000, int(budget_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            r = call()
        wait(r)
        runs.append((time.perf_counter() - t) * 1e3 / n)
    return float(statistics.median(runs))


def latency_ms(call, wait, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        wait(call())
        times.append((time.perf_counter() - t) * 1e3)
    return float(statistics.median(times))


def jax_wait(x):
    return jax.block_until_ready(x)


def torch_wait(_):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- table 1: JAX, 1 vs 2 devices ---------------------------------------------------------
def jax_functions(shape, backend):
    B, H, S, D, E, topk = shape
    counts = np.full(S // E, E, np.int32)

    def attention(q, k, v, gate):
        return vsa_jax.video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=backend)

    def grads(q, k, v, gate, dout):
        out, pullback = jax.vjp(attention, q, k, v, gate)
        return (out,) + pullback(dout)
    return attention, grads


def jax_inputs(shape, seed=0):
    B, H, S, D, E, topk = shape
    keys = jax.random.split(jax.random.key(seed), 5)
    return [jax.random.normal(kk, (B, H, S, D), jnp.float32).astype(jnp.bfloat16) for kk in keys]


def launch_paths(args) -> list:
    """The JAX launch paths to measure here: native needs a GPU and the Triton backend."""
    paths = [m for m in args.launch.split(",") if m]
    if "native" in paths and (jax.default_backend() != "gpu" or args.backend != "triton"):
        log(f"native launch skipped (needs a GPU and backend triton; jax: {jax.default_backend()}, "
            f"backend {args.backend})")
        paths.remove("native")
    return paths


def run_spmd(name, shape, args) -> list:
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(f"needs 2 devices, jax sees {devices}")
    x = jax_inputs(shape)
    one = [jax.device_put(t, devices[0]) for t in x]
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=devices[:2])
    spec = P(None, "x")
    two = [jax.device_put(t, NamedSharding(mesh, spec)) for t in x]
    rows = []
    for launch in launch_paths(args):
        # the path is fixed when a function is traced: fresh functions per path (JAX caches
        # traces per function object), traced (first call) while the path is selected
        vsa_jax.set_launch(launch)
        attention, grads = jax_functions(shape, args.backend)
        variants = {
            "1 device": (jax.jit(attention), jax.jit(grads), one),
            "2, shard_map": (jax.jit(jax.shard_map(attention, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)),
                             jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5)),
                             two),
            "2, jit(sharded)": (jax.jit(attention), jax.jit(grads), two),
        }
        base = {}
        try:
            for variant, (fwd, fwd_bwd, inputs) in variants.items():
                log(f"{name}: {variant}, {launch}")
                row = {"shape": name, "variant": variant, "launch": launch}
                try:
                    results = [np.asarray(r) for r in fwd_bwd(*inputs)]
                    for stage, fn, xs in (("fwd", fwd, inputs[:4]), ("fwd+bwd", fwd_bwd, inputs)):
                        call = (lambda fn=fn, xs=xs: fn(*xs))
                        row[f"{stage} steady"] = steady_ms(call, jax_wait, args.budget_ms, args.reps)
                        row[f"{stage} latency"] = latency_ms(call, jax_wait, n=2 if args.smoke else 20)
                except Exception as e:  # noqa: BLE001  (one failing path must not hide the others' rows)
                    log(f"{name}: {variant}, {launch} failed: {type(e).__name__}: {e}")
                    row["bitwise"], row["error"] = "FAILED", f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    continue
                if variant == "1 device":
                    base = {"results": results, **row}
                    row["bitwise"] = "-"
                elif base:
                    same = all(np.array_equal(a, b) for a, b in zip(results, base["results"]))
                    row["bitwise"] = "yes" if same else "NO"
                    for key in ("fwd steady", "fwd+bwd steady"):
                        row[f"{key} x1"] = row[key] / base[key]
                else:
                    row["bitwise"] = "no 1-device run"
                rows.append(row)
        finally:
            vsa_jax.set_launch("callback")
    return rows


# ---- table 2: host cost per call at the small shape ---------------------------------------
def torch_rows(shape, args) -> list:
    B, H, S, D, E, topk = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(grad):
        return torch.randn(B, H, S, D, generator=gen, device=device).to(torch.bfloat16).requires_grad_(grad)

    q, k, v, gate, dout = randn(True), randn(True), randn(True), randn(True), randn(False)
    counts = torch.full((S // E,), E, dtype=torch.int32, device=device)

    def fwd():
        with torch.no_grad():
            return vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=args.backend)

    def fwd_bwd():
        out = vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=args.backend)
        return torch.autograd.grad(out, (q, k, v, gate), dout)

    rows = []
    eager = {"variant": "torch eager"}
    for stage, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        eager[f"{stage} steady"] = steady_ms(fn, torch_wait, args.budget_ms, args.reps)
        eager[f"{stage} launches"] = count_launches(fn)
    rows.append(eager)
    if device != "cuda":
        rows.append({"variant": "torch CUDA graph", "note": "needs CUDA"})
        return rows
    graph_row = {"variant": "torch CUDA graph"}
    for stage, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph_row[f"{stage} steady"] = steady_ms(graph.replay, torch_wait, args.budget_ms, args.reps)
    rows.append(graph_row)
    return rows


def count_launches(fn):
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())
    except Exception as e:  # the profiler is a nicety here
        log(f"launch count failed: {type(e).__name__}: {e}")
        return None


def host_cost_rows(spmd_rows, shape, args) -> list:
    rows = []
    for r in spmd_rows:
        if r["shape"] == "small" and r["variant"] == "1 device" and "fwd steady" in r:
            rows.append({"variant": f"JAX {r['launch']}", "fwd steady": r["fwd steady"],
                         "fwd+bwd steady": r["fwd+bwd steady"]})
    rows += torch_rows(shape, args)
    replay = next((r for r in rows if r["variant"] == "torch CUDA graph" and "fwd steady" in r), None)
    for r in rows:
        for stage in ("fwd", "fwd+bwd"):
            if replay is not None and f"{stage} steady" in r:
                r[f"{stage} host"] = r[f"{stage} steady"] - replay[f"{stage} steady"]
    return rows


# ---- output -------------------------------------------------------------------------------
def fmt(x, spec=".3f"):
    return "-" if x is None else (format(x, spec) if isinstance(x, float) else str(x))


def print_tables(spmd_rows, host_rows, shapes):
    print(f"\n1 vs 2 devices, heads split ({jax.devices()[0].device_kind}, backend {ARGS.backend}); ms per call")
    head = ["shape", "variant", "launch", "fwd steady", "x1", "fwd latency", "f+b steady", "x1", "f+b latency",
            "bitwise"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in spmd_rows:
        B, H, S, D, E, topk = shapes[r["shape"]]
        label = f"{r['shape']} (B{B} H{H} S{S} E{E} top{topk})"
        cells = [label, r["variant"], r["launch"], fmt(r.get("fwd steady")), fmt(r.get("fwd steady x1"), ".2f"),
                 fmt(r.get("fwd latency")), fmt(r.get("fwd+bwd steady")), fmt(r.get("fwd+bwd steady x1"), ".2f"),
                 fmt(r.get("fwd+bwd latency")), r["bitwise"]]
        print("| " + " | ".join(cells) + " |")
    if host_rows:
        print("\nper-call cost at small (steady ms per call; host = steady - CUDA-graph replay)")
        head = ["path", "fwd", "fwd host", "f+b", "f+b host", "launches fwd / f+b"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in host_rows:
            launches = f"{fmt(r.get('fwd launches'))} / {fmt(r.get('fwd+bwd launches'))}" \
                if "fwd launches" in r else "-"
            cells = [r["variant"], fmt(r.get("fwd steady")), fmt(r.get("fwd host")), fmt(r.get("fwd+bwd steady")),
                     fmt(r.get("fwd+bwd host")), launches if "note" not in r else r["note"]]
            print("| " + " | ".join(cells) + " |")


def versions() -> dict:
    import triton
    return {"torch": torch.__version__, "jax": jax.__version__, "triton": triton.__version__,
            "devices": [str(d) for d in jax.devices()], "device_kind": jax.devices()[0].device_kind,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv[1:]}


def main(args) -> int:
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = [n for n in args.shapes.split(",") if n in shapes]
    spmd_rows = []
    for name in names:
        spmd_rows += run_spmd(name, shapes[name], args)
    host_rows = host_cost_rows(spmd_rows, shapes["small"], args) if "small" in names else []
    print_tables(spmd_rows, host_rows, shapes)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "spmd_bench.json")
        with open(path, "w") as f:
            json.dump({"meta": versions(), "spmd": spmd_rows, "host_cost": host_rows}, f, indent=1)
        log(f"wrote {path}")
    return 0 if all(r["bitwise"] in ("-", "yes") for r in spmd_rows) else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
