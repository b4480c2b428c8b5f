"""Sequence-parallel VSA (Ulysses) on P GPUs against one GPU: forward and forward+backward.

    PYTHONPATH=. python3 benchmarks/ulysses_bench.py                    # 720p-256 on 2 GPUs, torch + JAX
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/ulysses_bench.py --frontends torch
    PYTHONPATH=. python3 benchmarks/ulysses_bench.py --frontends jax
    PYTHONPATH=. python3 benchmarks/ulysses_bench.py --device cpu       # plumbing check (gloo, interpreter)

PyTorch runs P processes (spawned here, or started by torchrun) over NCCL; JAX runs one
process over a P-device Mesh. For each frontend and backend it times, with every block
full and random bf16 inputs:
- 1 GPU: `video_sparse_attn_bshd` on the whole sequence, all H heads;
- P GPUs: `ulysses_video_sparse_attn` on [B, S/P, H, D] shards (the slowest rank's time);
- local: the VSA that each rank runs between the exchanges ([B, S, H/P, D], no collective);
- a2a: the exchanges alone, the same tensors: forward = q, k, v, gate to heads + out back;
  forward+backward adds dout to heads + dq, dk, dv, dgate back;
and reports the all-to-all share (a2a / P-GPU time), the exchange time hidden behind
compute (local + a2a - P-GPU time: 0 when nothing overlaps) and the scaling efficiency
t(1 GPU) / (P * t(P GPUs)). Torch runs the P-GPU call on the default process group and
(--nccl-priority high) on a group whose NCCL stream has high priority; --profile adds,
per backend, one profiled forward+backward on rank 0 and prints how long the NCCL
kernels and the compute kernels ran and how much of that was at the same time. JAX
compiles with XLA's latency-hiding scheduler (--jax-lhs 1, the default), without which
XLA keeps each all-to-all's start and done together and nothing overlaps. It also checks
that the P-GPU output equals the 1-GPU output bitwise. Times are milliseconds per call
issued back to back (a training loop's rate). Results go to OUT/ulysses.json (--out,
default $OUT, else none).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO]

SHAPES = {  # name: (B, H, S, D, E, topk)
    "720p-256": (1, 40, 92160, 128, 256, 45),
    "480p-256": (1, 12, 39936, 128, 256, 20),
    "tiny": (1, 2, 256, 64, 64, 2),  # the CPU plumbing check
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help=f"one of {list(SHAPES)} (default 720p-256; cpu: tiny)")
    p.add_argument("--custom", default=None, metavar="B,H,S,D,E,topk", help="a shape of your own instead")
    p.add_argument("--gpus", type=int, default=2, help="P, the devices the sequence is split over")
    p.add_argument("--frontends", default="torch,jax")
    p.add_argument("--backends", default="triton,cute")
    p.add_argument("--chunks", default="1,4",
                   help="VSA_ULYSSES_CHUNKS settings to time (1: no overlap of the exchanges with compute)")
    p.add_argument("--nccl-priority", default="normal,high",
                   help="torch: NCCL stream priorities to time the P-GPU call with (normal: the default group; "
                        "high: a group made with is_high_priority_stream=True), each with every --chunks")
    p.add_argument("--profile", type=int, default=1, help="torch: profile one forward+backward per backend (1/0)")
    p.add_argument("--jax-lhs", type=int, default=1,
                   help="JAX: --xla_gpu_enable_latency_hiding_scheduler=true (1) or XLA's default (0)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 10; cpu 1)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per number, median taken")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for ulysses.json")
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = 1 if args.device == "cpu" else 10
    if args.device == "cpu":
        args.repeats = 1
    return args


# ---- environment: decided before torch / triton / jax are imported ---------------------------
if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={ARGS.gpus}".strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if ARGS.device == "cuda" and ARGS.jax_lhs and "xla_gpu_enable_latency_hiding_scheduler" not in \
            os.environ.get("XLA_FLAGS", ""):
        # lets XLA move each all-to-all's start before, and its done after, other chunks' VSA
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_gpu_enable_latency_hiding_scheduler=true").strip()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from vsa_core.config import configure  # noqa: E402


@dataclass
class Row:
    frontend: str
    backend: str
    stage: str            # "fwd" or "fwd+bwd"
    chunks: int           # VSA_ULYSSES_CHUNKS of the P-GPU run
    variant: str          # torch: NCCL stream priority of the group; jax: "lhs" or "default" scheduler
    one_ms: float         # 1 GPU, whole sequence
    many_ms: float        # P GPUs, Ulysses
    local_ms: float       # each rank's VSA on H/P heads, no exchange
    a2a_ms: float         # the exchanges alone
    bitwise: Optional[bool] = None  # P-GPU output (fwd) / grads (fwd+bwd) == 1 GPU's
    note: str = ""
    local_chunked_ms: Optional[float] = None  # torch: the local VSA run chunk by chunk, as the P-GPU call does

    def efficiency(self, P: int) -> float:
        return self.one_ms / (P * self.many_ms)

    def hidden_ms(self) -> float:
        """Exchange time hidden behind compute: 0 when the P-GPU call is compute then exchanges."""
        return self.local_ms + self.a2a_ms - self.many_ms


def shape_of(args):
    if args.custom:
        return tuple(int(x) for x in args.custom.split(","))
    return SHAPES[args.shape or ("tiny" if args.device == "cpu" else "720p-256")]


def log(msg: str) -> None:
    print(msg, flush=True)


def backend_reason(backend: str, shape, device: str) -> Optional[str]:
    """Why `backend` cannot run this shape here (None: it can)."""
    from vsa_core.backends import BACKENDS
    from vsa_core.problem import AttnProblem
    from vsa_core.runtime import DeviceInfo
    from vsa_torch.ops import device_info
    B, H, S, D, E, topk = shape
    p = AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=E, dtype="bfloat16",
                    layout="bshd", topk=topk, has_gate=True)
    dev = device_info(torch.empty(0, device=device)) if device == "cuda" else DeviceInfo("cpu")
    return BACKENDS[backend].unavailable_reason(p, dev)


def median_ms(run_timed: Callable[[], float], repeats: int) -> float:
    return float(statistics.median(run_timed() for _ in range(repeats)))


# ---- PyTorch: P processes --------------------------------------------------------------------
def torch_rank(rank: int, P: int, args, port: Optional[int], out_file: str) -> None:
    from vsa_torch import video_sparse_attn_bshd
    from vsa_core.sequence_parallel import head_chunks
    from vsa_torch.parallel import _Exchange, _store_heads, ulysses_video_sparse_attn

    cuda = args.device == "cuda"
    if port is not None:  # spawned here, not by torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(P))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    groups = {"normal": None}  # NCCL stream priority -> process group (None: the default group)
    for priority in args.nccl_priority.split(","):
        if priority == "high" and cuda:
            try:
                options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
                groups["high"] = dist.new_group(list(range(P)), backend="nccl", pg_options=options)
            except Exception as e:  # every rank fails alike
                log(f"rank {rank}: no high-priority NCCL group: {type(e).__name__}: {e}")
    B, H, S, D, E, topk = shape_of(args)
    s, hp = S // P, H // P
    # on the device: host counts would be copied to the GPU with a stream sync on every call,
    # which keeps the host from queueing the next call's work (and its exchanges) early
    counts = torch.full((S // E,), E, dtype=torch.int32, device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> Callable[[], float]:
        """ms per call, calls back to back, every rank started together; the slowest rank's."""
        def run():
            sync()
            dist.barrier()
            sync()
            t = time.perf_counter()
            for _ in range(args.iters):
                fn()
            sync()
            ms = torch.tensor([(time.perf_counter() - t) * 1e3 / args.iters], device=dev)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            return ms.item()
        fn()  # warm-up: compilation, autotuning, NCCL setup
        return run

    gen = torch.Generator(device=dev).manual_seed(0)  # the same full inputs on every rank

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.bfloat16)

    full = [randn(B, S, H, D).requires_grad_() for _ in range(4)]  # q, k, v, gate
    dout = randn(B, S, H, D)
    shards = [x.detach()[:, rank * s:(rank + 1) * s].clone().requires_grad_() for x in full]
    dout_shard = dout[:, rank * s:(rank + 1) * s].contiguous()
    heads = [x.detach()[:, :, :hp].clone().requires_grad_() for x in full]  # local: H/P heads, all tokens
    dout_heads = dout[:, :, :hp].contiguous()

    rows = []
    for backend in args.backends.split(","):
        reason = backend_reason(backend, (B, H, S, D, E, topk), args.device)
        if reason is not None:
            rows.append(dict(frontend="torch", backend=backend, skipped=reason))
            continue

        def one(*xs):
            return video_sparse_attn_bshd(*xs[:3], counts, counts, topk, E, xs[3], backend=backend)

        def many(*xs, group=None):
            return ulysses_video_sparse_attn(*xs[:3], counts, counts, topk, E, xs[3], backend=backend, group=group)

        def fwd_bwd(f, xs, g, **kw):
            return lambda: torch.autograd.grad(f(*xs, **kw), xs, g)

        fwd_inputs = [x.detach() for x in shards]
        all_heads = (0, hp)

        dests = [torch.empty_like(x) for x in fwd_inputs]  # where the results land, as in the P-GPU call

        def a2a_fwd():
            _Exchange(fwd_inputs, None, P, all_heads, to_heads=True).finish()
            _store_heads(dests[0], _Exchange([heads[0].detach()], None, P, all_heads, to_heads=False).finish()[0],
                         all_heads)

        def a2a_fwd_bwd():
            a2a_fwd()
            _Exchange([dout_shard], None, P, all_heads, to_heads=True).finish()
            for dest, recv in zip(dests, _Exchange([x.detach() for x in heads], None, P, all_heads,
                                                   to_heads=False).finish()):
                _store_heads(dest, recv, all_heads)

        def local_chunked(stage: str, chunks: int):
            """The local VSA chunk by chunk (contiguous chunk inputs made beforehand)."""
            parts = [([x.detach()[:, :, a:b].clone().requires_grad_() for x in full], dout[:, :, a:b].contiguous())
                      for a, b in head_chunks(hp, chunks)]
            if stage == "fwd":
                return lambda: [one(*xs) for xs, _ in parts]
            return lambda: [torch.autograd.grad(one(*xs), xs, g) for xs, g in parts]

        # correctness: the gathered P-GPU results against the 1-GPU ones
        out_one = one(*full)
        grads_one = torch.autograd.grad(out_one, full, dout)
        out_many = many(*shards)
        grads_many = torch.autograd.grad(out_many, shards, dout_shard)

        def gathered(x):
            parts = [torch.empty_like(x) for _ in range(P)]
            dist.all_gather(parts, x.contiguous())
            return torch.cat(parts, dim=1)
        out_equal = torch.equal(gathered(out_many.detach()), out_one.detach())
        grads_equal = all(torch.equal(gathered(g), w) for g, w in zip(grads_many, grads_one))
        del out_one, grads_one, out_many, grads_many

        for stage, f_one, many_in, f_local, f_a2a, equal in (
                ("fwd", lambda: one(*full), lambda g: (lambda: many(*shards, group=g)), lambda: one(*heads),
                 a2a_fwd, out_equal),
                ("fwd+bwd", fwd_bwd(one, full, dout), lambda g: fwd_bwd(many, shards, dout_shard, group=g),
                 fwd_bwd(one, heads, dout_heads), a2a_fwd_bwd, grads_equal)):
            ms = {name: median_ms(timed(fn), args.repeats)
                  for name, fn in (("one", f_one), ("local", f_local), ("a2a", f_a2a))}
            local_of = {1: ms["local"]}
            for priority, group in groups.items():
                for chunks in args.chunks.split(","):
                    n = len(head_chunks(hp, int(chunks)))
                    if n not in local_of:
                        local_of[n] = median_ms(timed(local_chunked(stage, n)), args.repeats)
                    configure(ulysses_chunks=int(chunks))
                    ms["many"] = median_ms(timed(many_in(group)), args.repeats)
                    rows.append(asdict(Row("torch", backend, stage, int(chunks), priority, ms["one"], ms["many"],
                                           ms["local"], ms["a2a"], bitwise=equal, local_chunked_ms=local_of[n])))
                    if rank == 0:
                        log(f"torch {backend} {stage} chunks {chunks} nccl {priority}: {ms}, local chunked "
                            f"{local_of[n]:.2f}")
        if args.profile and cuda:
            chunks = args.chunks.split(",")[-1]
            configure(ulysses_chunks=int(chunks))
            for priority, group in groups.items():
                summary = profile_overlap(fwd_bwd(many, shards, dout_shard, group=group), dist.barrier,
                                          rank == 0)
                if rank == 0:
                    log(f"profile torch {backend} fwd+bwd chunks {chunks} nccl {priority} (rank 0): {summary}")
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def profile_overlap(fn: Callable, barrier: Callable, report: bool) -> str:
    """Runs fn once (after a warm-up) under the profiler and reports from the GPU kernel
    timeline how long NCCL kernels and the other (compute) kernels ran, and for how long
    both ran at the same time. Every rank runs fn; `report` ranks analyse."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    barrier()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        if not report:
            return ""
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        kernels = [(e["ts"], e["ts"] + e["dur"], "nccl" in e["name"].lower()) for e in events
                   if e.get("cat") == "kernel" and e.get("ph") == "X"]
    except Exception as e:  # the profiler is a diagnostic: never fail the benchmark for it
        return f"profile failed: {type(e).__name__}: {e}"
    finally:
        barrier()
    if not kernels:
        return "no kernels in the trace"

    def union(intervals):
        merged = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    comm = union([(a, b) for a, b, nccl in kernels if nccl])
    compute = union([(a, b) for a, b, nccl in kernels if not nccl])
    both = sum(max(0.0, min(b1, b2) - max(a1, a2)) for a1, b1 in comm for a2, b2 in compute)
    span = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    busy = sum(b - a for a, b in union([(a, b) for a, b, _ in kernels]))
    ms = lambda us: f"{us / 1e3:.2f}"  # noqa: E731
    return (f"kernel span {ms(span)} ms, GPU busy {ms(busy)}, NCCL kernels {ms(sum(b - a for a, b in comm))} "
            f"({sum(1 for *_, n in kernels if n)} kernels), compute {ms(sum(b - a for a, b in compute))}, "
            f"NCCL and compute at the same time {ms(both)} ms")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torch(args, P: int) -> List[dict]:
    out_file = os.path.join(tempfile.mkdtemp(), "torch_rows.json")
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank
        torch_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, out_file)
        if int(os.environ["RANK"]) != 0:
            return []
    else:
        mp.spawn(torch_rank, args=(P, args, free_port(), out_file), nprocs=P)
    with open(out_file) as f:
        return json.load(f)


# ---- JAX: one process, a P-device Mesh ---------------------------------------------------------
def run_jax(args, P: int) -> List[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Spec

    from vsa_jax import video_sparse_attn_bshd
    from vsa_jax.parallel import _heads_to_sequence, _sequence_to_heads, ulysses_video_sparse_attn_on_mesh

    if len(jax.devices()) < P:
        return [dict(frontend="jax", backend=b, skipped=f"JAX sees {len(jax.devices())} devices, needs {P}")
                for b in args.backends.split(",")]
    B, H, S, D, E, topk = shape_of(args)
    hp = H // P
    counts = np.full(S // E, E, np.int32)
    lhs = "xla_gpu_enable_latency_hiding_scheduler=true" in os.environ.get("XLA_FLAGS", "")
    scheduler = "lhs" if lhs else "default"
    log(f"JAX: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    mesh = jax.make_mesh((P,), ("sp",), devices=jax.devices()[:P])
    tokens = NamedSharding(mesh, Spec(None, "sp"))
    one_device = jax.devices()[0]

    keys = jax.random.split(jax.random.key(0), 5)
    full = [jax.device_put(jax.random.normal(k, (B, S, H, D), jnp.bfloat16), one_device) for k in keys]
    sharded = [jax.device_put(x, tokens) for x in full]
    heads = [x[:, :, :hp] for x in full]

    def timed(fn) -> Callable[[], float]:
        jax.block_until_ready(fn())  # compile and warm up

        def run():
            t = time.perf_counter()
            for _ in range(args.iters):
                result = fn()
            jax.block_until_ready(result)
            return (time.perf_counter() - t) * 1e3 / args.iters
        return run

    def with_grads(attend):
        def f(q, k, v, gate, dout):
            _, pullback = jax.vjp(attend, q, k, v, gate)
            return pullback(dout)
        return jax.jit(f)

    def exchange(seq_xs, head_xs):
        """seq_xs to heads, head_xs back to the sequence, alone."""
        return ([_sequence_to_heads(x, "sp") for x in seq_xs], [_heads_to_sequence(x, "sp") for x in head_xs])
    exchange = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=Spec(None, "sp"), out_specs=Spec(None, "sp")))
    # stand-ins for out (forward) and dq, dk, dv, dgate (backward) in the heads layout:
    # [B, S, H/P, D] on each device, [B, P*S, H/P, D] globally
    in_heads = [jax.device_put(jnp.zeros((B, P * S, hp, D), jnp.bfloat16), tokens) for _ in range(4)]

    def a2a_fwd():
        return exchange(sharded[:4], in_heads[:1])

    def a2a_fwd_bwd():
        return a2a_fwd(), exchange(sharded[4:], in_heads)

    rows = []
    for backend in args.backends.split(","):
        reason = backend_reason(backend, (B, H, S, D, E, topk), args.device)
        if reason is not None:
            rows.append(dict(frontend="jax", backend=backend, skipped=reason))
            continue

        def one(q, k, v, gate):
            return video_sparse_attn_bshd(q, k, v, counts, counts, topk, E, gate, backend=backend)

        def many_of():  # a new function for each ulysses_chunks setting (read when traced)
            def many(q, k, v, gate):
                return ulysses_video_sparse_attn_on_mesh(q, k, v, counts, counts, topk, E, gate, mesh=mesh,
                                                         axis_name="sp", backend=backend)
            return many

        one_fwd, one_bwd = jax.jit(one), with_grads(one)
        base = {}  # stage -> one, local, a2a (measured once, not per chunks setting)
        for chunks in args.chunks.split(","):
            configure(ulysses_chunks=int(chunks))
            many_fwd, many_bwd = jax.jit(many_of()), with_grads(many_of())
            out_equal = bool(np.array_equal(np.asarray(many_fwd(*sharded[:4])), np.asarray(one_fwd(*full[:4]))))
            grads_equal = all(np.array_equal(np.asarray(g), np.asarray(w))
                              for g, w in zip(many_bwd(*sharded), one_bwd(*full)))
            for stage, f_one, f_many, f_local, f_a2a, equal in (
                    ("fwd", lambda: one_fwd(*full[:4]), lambda: many_fwd(*sharded[:4]),
                     lambda: one_fwd(*heads[:4]), a2a_fwd, out_equal),
                    ("fwd+bwd", lambda: one_bwd(*full), lambda: many_bwd(*sharded), lambda: one_bwd(*heads),
                     a2a_fwd_bwd, grads_equal)):
                if stage not in base:
                    base[stage] = {name: median_ms(timed(fn), args.repeats)
                                   for name, fn in (("one", f_one), ("local", f_local), ("a2a", f_a2a))}
                ms = dict(base[stage], many=median_ms(timed(f_many), args.repeats))
                rows.append(asdict(Row("jax", backend, stage, int(chunks), scheduler, ms["one"], ms["many"],
                                       ms["local"], ms["a2a"], equal)))
                log(f"jax {backend} {stage} chunks {chunks} {scheduler}: {ms}")
    return rows


# ---- report ------------------------------------------------------------------------------------
def print_table(rows: List[dict], P: int, shape) -> None:
    B, H, S, D, E, topk = shape
    log(f"\nUlysses VSA, B{B} H{H} S{S} D{D} E{E} topk {topk}, bf16, every block full: 1 device vs {P}")
    head = (f"| frontend | backend | stage | chunks | variant | 1 dev ms | {P} dev ms | speedup | efficiency "
            f"| local ms | local chunked | a2a ms | local + a2a | hidden ms | P-dev == 1-dev |")
    log(head)
    log("|" + " --- |" * (head.count("|") - 1))
    for r in rows:
        if "skipped" in r:
            log(f"| {r['frontend']} | {r['backend']} | skipped: {r['skipped']} |")
            continue
        row = Row(**r)
        log(f"| {row.frontend} | {row.backend} | {row.stage} | {row.chunks} | {row.variant} | {row.one_ms:.2f} "
            f"| {row.many_ms:.2f} | {row.one_ms / row.many_ms:.2f}x | {100 * row.efficiency(P):.1f}% "
            f"| {row.local_ms:.2f} | {'-' if row.local_chunked_ms is None else f'{row.local_chunked_ms:.2f}'} "
            f"| {row.a2a_ms:.2f} | {row.local_ms + row.a2a_ms:.2f} | {row.hidden_ms():.2f} "
            f"| {'bitwise' if row.bitwise else 'NO'} |")
    log("efficiency = t(1 device) / (P * t(P devices)); local = each device's VSA on H/P heads with no "
        "exchange; local chunked = the same, chunk by chunk as the P-device call runs it (what chunking "
        "costs the compute); a2a = the exchanges alone (fwd: q, k, v, gate, out; fwd+bwd: also dout, dq, dk, dv, "
        "dgate); hidden = local + a2a - P-dev (the exchange time overlapped with compute, 0 when "
        "none is); variant: torch's NCCL stream priority (normal: the default group; high: "
        "is_high_priority_stream), JAX's scheduler (lhs: --xla_gpu_enable_latency_hiding_scheduler=true); "
        "the last column: output (fwd) or gradients (fwd+bwd) of the P-device run, gathered, "
        "equal the 1-device ones bit for bit (Triton autotunes per process, so a rank may pick another "
        "tile config than the 1-device run: VSA_AUTOTUNE=0 for a bitwise check; FA4's dQ is not "
        "reproducible even on one device). chunks: VSA_ULYSSES_CHUNKS, head chunks whose exchanges "
        "overlap the other chunks' compute (1: none).")


def main(args) -> int:
    P = args.gpus
    shape = shape_of(args)
    if shape[1] % P or shape[2] % (P * shape[4]):
        raise SystemExit(f"shape {shape}: H must divide by P={P} and S by P*E")
    if args.device == "cuda" and torch.cuda.device_count() < P and "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"needs {P} GPUs, found {torch.cuda.device_count()}")
    rows = []
    frontends = args.frontends.split(",")
    if "torch" in frontends:
        rows += run_torch(args, P)
        if "LOCAL_RANK" in os.environ and int(os.environ["RANK"]) != 0:
            return 0
    if "jax" in frontends:
        if "LOCAL_RANK" in os.environ:
            log("(JAX skipped under torchrun: run it as a plain process, --frontends jax)")
        else:
            rows += run_jax(args, P)
    print_table(rows, P, shape)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        info = dict(shape=dict(zip("B H S D E topk".split(), shape)), devices=P, iters=args.iters,
                    device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    rows=rows)
        with open(os.path.join(args.out, "ulysses.json"), "w") as f:
            json.dump(info, f, indent=1)
    return 0 if all(r.get("bitwise", True) is not False or r["backend"] == "cute" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
