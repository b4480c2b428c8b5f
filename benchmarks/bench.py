"""VSA benchmark harness: our kernels (per backend, per frontend) against peers on the same sparsity.

    PYTHONPATH=. python3 benchmarks/bench.py --out bench_out            # standard shapes, GPU
    PYTHONPATH=. python3 benchmarks/bench.py --device cpu --custom 1,2,256,64,64,2 --reps 1 --out /tmp/b

See benchmarks/README.md for what is measured and how FLOPs are counted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]
from vsa_core.backends import NAMES as BACKEND_NAMES  # noqa: E402  (imports neither triton nor torch)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for results.json and results.png")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a plumbing check under TRITON_INTERPRET=1 (GPU-only peers skipped)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated names: small, 480p-64, 480p-256, 720p-256, 720p-64 (default: all on cuda, "
                        "none when --custom is given or on cpu)")
    p.add_argument("--custom", action="append", default=[], metavar="B,H,S,D,E,topk",
                   help="an extra shape (repeatable); E is the tokens per block")
    p.add_argument("--sparsity", type=float, default=None,
                   help="override topk of every shape: topk = round((1 - sparsity) * number of KV blocks)")
    p.add_argument("--only", choices=("fine", "vsa"), default=None,
                   help="run only the fine stage (block_sparse_attn) or only the whole VSA; peers always run")
    p.add_argument("--backends", default=",".join(BACKEND_NAMES), help="our fine-stage backends to run")
    p.add_argument("--frontends", default="eager,compile,jax",
                   help="eager (PyTorch), compile (torch.compile), jax (jax.jit)")
    p.add_argument("--peers", default="flex,sdpa,fa4,cudnn",
                   help="flex (same block map), sdpa (dense), fa4 (dense), cudnn (cuDNN BSA, same block map)")
    p.add_argument("--reps", type=int, default=None,
                   help="cuda: do_bench runs per measurement, median of their medians (default 1); "
                        "cpu: timed calls per measurement (default 3)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench rep in ms (default 200, --quick 50)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warmup in ms (default 25, --quick 10)")
    p.add_argument("--quick", action="store_true", help="shorter measurements (rep 50 ms)")
    p.add_argument("--tol", type=float, default=2e-2,
                   help="relative-norm error bound of out and grads; a row above it is FAIL (bf16: 2e-2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--padding", default="zeros", choices=("zeros", "ignore"),
                   help="padding= of our calls (ignore: padded rows read as 0 by a select, the cost of NaN safety)")
    return p.parse_args(argv)


# ---- environment: must be decided before torch / triton / jax are imported ----------------
# The Triton interpreter is chosen when triton is first imported; JAX must not preallocate
# most of the GPU that torch (and the dense peers) need.
if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import peers  # noqa: E402
from vsa_torch import block_sparse_attn, video_sparse_attn  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---- shapes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    B: int
    H: int
    S: int
    D: int
    E: int       # tokens per block
    topk: int    # selected KV blocks per query block
    prefix: int = 0  # leading non-video blocks (issue 18: dense rows; video rows take them all, "exempt")

    @property
    def n_blocks(self) -> int:
        return self.S // self.E

    @property
    def sparsity(self) -> float:
        return 1.0 - self.topk / self.n_blocks

    def sparse_flops(self) -> float:
        """Forward FLOPs of the fine stage: QK^T and PV over topk blocks of E keys per query;
        with a prefix the real ones: its query blocks dense (every block), each video query
        block over the prefix blocks plus its topk video blocks."""
        n, P = self.n_blocks, self.prefix
        attended_blocks = P * n + (n - P) * (self.topk + P)  # over all query blocks; P = 0: n * topk
        return 4.0 * self.B * self.H * self.D * self.E * self.E * attended_blocks

    def dense_flops(self) -> float:
        return 4.0 * self.B * self.H * self.D * self.S * self.S

    def describe(self) -> str:
        return (f"{self.name}: B{self.B} H{self.H} S{self.S} D{self.D} E{self.E} topk {self.topk}/"
                f"{self.n_blocks} ({100 * self.sparsity:.1f}% sparse)"
                + (f", {self.prefix} prefix blocks (dense rows, exempt)" if self.prefix else ""))


STANDARD_SHAPES = {
    # launch overhead dominates
    "small": Shape("small", 1, 2, 4096, 128, 64, 8),
    # Wan 480p latent 21x30x52 -> 39936 tokens
    "480p-64": Shape("480p-64", 1, 12, 39936, 128, 64, 62),
    "480p-256": Shape("480p-256", 1, 12, 39936, 128, 256, 20),
    # the same video after a 512-token text prompt (8 prefix blocks, issue 18); plain VSA on the
    # same length for the TFLOPS comparison: --custom 1,12,40448,128,64,62
    "480p-64-prefix8": Shape("480p-64-prefix8", 1, 12, 39936 + 512, 128, 64, 62, prefix=8),
    # 720p latent, 40 heads
    "720p-256": Shape("720p-256", 1, 40, 92160, 128, 256, 45),
    # the same at VSA's default 64-token blocks, top-144 of 1440 (90% sparse, as 480p-64)
    "720p-64": Shape("720p-64", 1, 40, 92160, 128, 64, 144),
}


def select_shapes(args) -> List[Shape]:
    if args.shapes:
        names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    elif args.custom or args.device == "cpu":
        names = []
    else:
        names = list(STANDARD_SHAPES)
    unknown = [n for n in names if n not in STANDARD_SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {list(STANDARD_SHAPES)}")
    shapes = [STANDARD_SHAPES[n] for n in names]
    for text in args.custom:
        B, H, S, D, E, topk = (int(x) for x in text.split(","))
        shapes.append(Shape(f"custom-B{B}H{H}S{S}D{D}E{E}", B, H, S, D, E, topk))
    if args.device == "cpu" and not shapes:
        shapes = [Shape("tiny", 1, 2, 256, 64, 64, 2)]
    if args.sparsity is not None:
        shapes = [Shape(s.name, s.B, s.H, s.S, s.D, s.E, max(1, round((1 - args.sparsity) * s.n_blocks)), s.prefix)
                  for s in shapes]
    for s in shapes:
        if s.S % s.E or not 1 <= s.topk <= s.n_blocks:
            raise SystemExit(f"bad shape {s}: S must be a multiple of E and 1 <= topk <= S/E")
    return shapes


# ---- timing ------------------------------------------------------------------------------
class Timer:
    """Median milliseconds of a call that leaves its work done or queued on the device.

    cuda: triton.testing.do_bench (L2 flushed before each call, each call timed with
    CUDA events, median), `reps` runs of it, median of medians. cpu: wall clock."""

    def __init__(self, device: str, reps: int, rep_ms: float, warmup_ms: float):
        self.device, self.reps, self.rep_ms, self.warmup_ms = device, reps, rep_ms, warmup_ms

    def __call__(self, fn: Callable) -> float:
        if self.device == "cuda":
            runs = [triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
                    for _ in range(self.reps)]
            return float(statistics.median(runs))
        fn()
        times = []
        for _ in range(self.reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return float(statistics.median(times))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()  # the whole device: JAX's streams too


def steady_ms(fn: Callable, device: str, budget_ms: float) -> float:
    """Wall milliseconds per call of `fn` issued back to back, the way a training loop
    issues them: host work (Python, dispatch, JAX's callback) overlaps the device's, so
    this is max(host cost, device time) per call. Unlike do_bench (device events around
    each call) it treats eager PyTorch and jitted JAX alike. The per-call host overhead
    shows where the device time is short (the `small` shape)."""
    fn()
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    n = max(5, min(1000, int(budget_ms / max((time.perf_counter() - t) * 1e3, 1e-3))))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t) * 1e3 / n


_FLUSH = {}


def latency_ms(fn: Callable, device: str, reps: int = 30) -> float:
    """Median wall milliseconds of one call `fn` alone, from issuing it to the device finishing
    it, with the device idle and L2 flushed before (what one inference call sees). Unlike
    do_bench's events on torch's stream, it times eager PyTorch and jitted JAX alike: host
    dispatch, device time and the wait for the result, both frameworks."""
    flush = _FLUSH.get("buf")
    if flush is None:
        flush = _FLUSH["buf"] = torch.empty(256 * 2 ** 20 // 4, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return float(statistics.median(times))


# ---- one contender: forward and forward+backward as timeable calls ----------------------
@dataclass
class Contender:
    """`fwd()` runs the forward (returns out), `fwd_bwd()` the forward and the backward
    (returns the input grads); `to_torch` turns their results into torch tensors to check.
    `make_bwd()` runs one forward and returns a call that runs the backward alone from what
    that forward saved, for timing the backward directly."""
    fwd: Callable
    fwd_bwd: Callable
    to_torch: Callable = lambda x: x
    # the same calls without waiting for the result (JAX: async dispatch), for steady_ms
    fwd_async: Optional[Callable] = None
    fwd_bwd_async: Optional[Callable] = None
    make_bwd: Optional[Callable[[], Callable]] = None


def torch_contender(forward: Callable, inputs: tuple, dout) -> Contender:
    # autograd.grad returns the grads without accumulating into .grad, so every call does
    # the same work; the forward runs with grad enabled (training mode), as in fwd_bwd.
    def make_bwd():
        out = forward(*inputs)  # the graph is kept (retain_graph) and its backward replayed
        return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)

    return Contender(fwd=lambda: forward(*inputs),
                     fwd_bwd=lambda: torch.autograd.grad(forward(*inputs), inputs, dout),
                     make_bwd=make_bwd)


def jax_contender(forward: Callable, inputs_jax: tuple, dout_jax, device: str) -> Contender:
    import jax

    def grads(dout, *xs):
        # vjp with the same cotangent as torch's autograd.grad(out, inputs, dout)
        _, pullback = jax.vjp(forward, *xs)
        return pullback(dout)

    fwd_jit, fwd_bwd_jit = jax.jit(forward), jax.jit(grads)
    # the forward with its residuals (jax.vjp's pullback is a pytree of them) and, apart,
    # the pullback alone: the backward timed from saved residuals, as torch's retained graph
    vjp_jit = jax.jit(lambda *xs: jax.vjp(forward, *xs)[1])
    pullback_jit = jax.jit(lambda pullback, dout: pullback(dout))

    def make_bwd():
        pullback = jax.block_until_ready(vjp_jit(*inputs_jax))
        return wait_then(lambda: pullback_jit(pullback, dout_jax))

    def wait_then(fn):
        # JAX runs on its own stream: let do_bench's cache flush (torch's stream) finish
        # first, then block until JAX is done so the end event lands after its work.
        def call():
            if device == "cuda":
                torch.cuda.current_stream().synchronize()
            return jax.block_until_ready(fn())
        return call

    return Contender(fwd=wait_then(lambda: fwd_jit(*inputs_jax)),
                     fwd_bwd=wait_then(lambda: fwd_bwd_jit(dout_jax, *inputs_jax)),
                     to_torch=jax_to_torch,
                     fwd_async=lambda: fwd_jit(*inputs_jax),
                     fwd_bwd_async=lambda: fwd_bwd_jit(dout_jax, *inputs_jax),
                     make_bwd=make_bwd)


def jax_to_torch(x):
    if isinstance(x, (tuple, list)):
        return type(x)(jax_to_torch(t) for t in x)
    try:
        return torch.from_dlpack(x)
    except Exception:  # e.g. a dtype or device DLPack does not carry: copy through the host
        return torch.from_numpy(np.asarray(x, dtype=np.float32))


def torch_to_jax(t):
    import jax
    import jax.numpy as jnp
    t = t.detach()
    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:
        return jnp.asarray(t.float().cpu().numpy()).astype(jnp.dtype(str(t.dtype).replace("torch.", "")))


# ---- results -----------------------------------------------------------------------------
@dataclass
class Row:
    shape: str
    stage: str            # "fine" (block_sparse_attn), "vsa" (video_sparse_attn) or "peer"
    name: str             # e.g. "triton/compile", "flex (blocks@256)"
    backend: Optional[str] = None
    frontend: Optional[str] = None
    dense: bool = False   # FLOPs counted densely (dense peers)
    flops_fwd: float = 0.0
    fwd_ms: Optional[float] = None
    fwd_bwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    bwd_method: Optional[str] = None  # "direct" (backward alone), or "fwd+bwd - fwd" where that failed
    fwd_tflops: Optional[float] = None
    bwd_tflops: Optional[float] = None
    fwd_steady_ms: Optional[float] = None      # see steady_ms: back-to-back calls, wall clock
    fwd_bwd_steady_ms: Optional[float] = None
    fwd_latency_ms: Optional[float] = None     # see latency_ms: one call alone, issue to done, wall clock
    fwd_bwd_latency_ms: Optional[float] = None
    first_call_s: Optional[float] = None   # first forward + backward: compilation and autotuning
    errors: Dict[str, float] = field(default_factory=dict)
    check_against: Optional[str] = None
    status: str = "ok"    # ok | FAIL | skipped: why | error: why
    note: Optional[str] = None  # e.g. a peer whose backward failed (forward still timed)
    speedup_fwd_vs_best_peer: Optional[float] = None
    speedup_bwd_vs_best_peer: Optional[float] = None

    @property
    def usable(self) -> bool:
        return self.status == "ok" and self.fwd_ms is not None


@torch.no_grad()
def rel_err(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def compare(values, reference, names) -> Dict[str, float]:
    return {n: rel_err(a, b) for n, a, b in zip(names, values, reference)}


def measure(row: Row, c: Contender, timer: Timer, device: str, tol: float, reference=None,
            check_against=None, names=("out", "dq", "dk", "dv"), forward_only_ok=False):
    """Fills `row`: first call, check against `reference` (out, grads...), then the timings.

    Backward time: the backward alone, timed directly (`Contender.make_bwd`: one forward
    outside the timed region, then only the backward from what it saved: torch's retained
    graph, JAX's pullback over its residuals, both frameworks the same way). Where a
    contender cannot replay its backward (a compiled graph that frees its saved tensors),
    median(forward + backward) - median(forward), and `bwd_method` says so.
    `forward_only_ok` (peers): a failing backward leaves a note and the forward timing
    instead of an error."""
    try:
        t = time.perf_counter()
        out = c.fwd()
        sync(device)
        values = [c.to_torch(out)]
        del out
        try:
            grads = c.fwd_bwd()
            sync(device)
            values += list(c.to_torch(grads))
            del grads
        except Exception as e:
            if not forward_only_ok:
                raise
            row.note = f"backward failed: {type(e).__name__}: {first_line(e)}"
            log(f"  {row.stage:4s} {row.name:28s} {row.note}")
        row.first_call_s = time.perf_counter() - t
        if reference is not None:
            row.errors = compare(values, reference, names)
            row.check_against = check_against
            if not all(math.isfinite(e) and e <= tol for e in row.errors.values()):
                row.status = "FAIL"
        row.fwd_ms = timer(c.fwd)
        row.fwd_tflops = row.flops_fwd / (row.fwd_ms * 1e-3) / 1e12 if row.fwd_ms else None
        if row.note is None:
            row.fwd_bwd_ms = timer(c.fwd_bwd)
            row.bwd_ms, row.bwd_method = time_backward(c, timer, device), "direct"
            if row.bwd_ms is None:
                row.bwd_ms, row.bwd_method = max(row.fwd_bwd_ms - row.fwd_ms, 0.0), "fwd+bwd - fwd"
            row.bwd_tflops = 2.5 * row.flops_fwd / (row.bwd_ms * 1e-3) / 1e12 if row.bwd_ms else None
        if row.stage != "peer" and device == "cuda":
            row.fwd_steady_ms = steady_ms(c.fwd_async or c.fwd, device, timer.rep_ms)
            row.fwd_bwd_steady_ms = steady_ms(c.fwd_bwd_async or c.fwd_bwd, device, timer.rep_ms)
            # the blocking calls: JAX's async dispatch may enqueue its work after the call returns
            row.fwd_latency_ms = latency_ms(c.fwd, device)
            row.fwd_bwd_latency_ms = latency_ms(c.fwd_bwd, device)
        log(f"  {row.stage:4s} {row.name:28s} fwd {row.fwd_ms:9.3f} ms  bwd {fmt(row.bwd_ms, '9.3f')} ms  "
            f"({row.bwd_method or '-'})  first call {row.first_call_s:6.1f} s  {fmt_err(row)}  {row.status}")
        return values
    except Exception as e:
        # a backend that says it cannot run here (no GPU, not installed) is skipped, not an error
        kind = "skipped" if type(e).__name__ == "BackendUnavailableError" else "error"
        row.status = f"{kind}: {type(e).__name__}: {first_line(e)}"
        log(f"  {row.stage:4s} {row.name:28s} {row.status}")
        if os.environ.get("VSA_BENCH_TRACEBACK"):
            traceback.print_exc()
        if device == "cuda":
            torch.cuda.empty_cache()
        return None


def time_backward(c: Contender, timer: Timer, device: str) -> Optional[float]:
    """Median ms of the backward alone (see measure), or None where the contender cannot
    replay it."""
    if c.make_bwd is None:
        return None
    bwd = None
    try:
        bwd = c.make_bwd()
        bwd()
        sync(device)
        return timer(bwd)
    except Exception as e:
        log(f"    backward alone cannot be replayed ({type(e).__name__}: {first_line(e)}): fwd+bwd - fwd")
        return None
    finally:
        del bwd
        if device == "cuda":
            torch.cuda.empty_cache()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else "")[:240]


def fmt_err(row: Row) -> str:
    if not row.errors:
        return "err    n/a"
    return f"err {max(row.errors.values()):.1e}"


# ---- one shape ---------------------------------------------------------------------------
def load_jax(device: str):
    """vsa_jax and jax, or (None, why not)."""
    try:
        import jax
        import vsa_jax
        want = "gpu" if device == "cuda" else "cpu"
        if jax.default_backend() != want:
            return None, f"jax's default backend is {jax.default_backend()}, not {want}"
        return vsa_jax, None
    except Exception as e:
        return None, f"vsa_jax/jax does not import ({type(e).__name__}: {first_line(e)})"


def random_block_map(shape: Shape, gen, device) -> "torch.Tensor":
    """Exactly topk KV blocks per query-block row, chosen uniformly at random; with a prefix
    (P blocks) the selection of prefix_mode "exempt": prefix rows dense, video rows the P
    prefix blocks plus topk video blocks."""
    B, H, n, P = shape.B, shape.H, shape.n_blocks, shape.prefix
    scores = torch.rand(B, H, n, n, generator=gen, device=device)
    chosen = scores[..., P:].topk(shape.topk, dim=-1).indices + P
    block_map = torch.zeros(B, H, n, n, dtype=torch.bool, device=device).scatter_(-1, chosen, True)
    block_map[..., :P] = True
    block_map[..., :P, :] = True
    return block_map


@dataclass
class Inputs:
    """One shape's random inputs, shared by every contender (JAX gets zero-copy views)."""
    shape: Shape
    q: "torch.Tensor"
    k: "torch.Tensor"
    v: "torch.Tensor"
    gate: "torch.Tensor"       # VSA's compress_attn_weight
    dout: "torch.Tensor"       # output gradient of every backward
    block_map: "torch.Tensor"  # bool [B, H, nQ, nKV] for the fine stage and the peers
    counts: "torch.Tensor"     # valid tokens per block: all E
    jax: Optional[dict] = None

    @staticmethod
    def random(shape: Shape, device: str, seed: int) -> "Inputs":
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        B, H, S, D = shape.B, shape.H, shape.S, shape.D

        def randn(grad):
            x = torch.randn(B, H, S, D, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
            return x.requires_grad_(grad)

        return Inputs(shape, q=randn(True), k=randn(True), v=randn(True), gate=randn(True), dout=randn(False),
                      block_map=random_block_map(shape, gen, dev),
                      counts=torch.full((shape.n_blocks,), shape.E, dtype=torch.int32, device=dev))

    def add_jax(self, device: str) -> None:
        import jax.numpy as jnp
        sync(device)  # the DLPack views must see finished data
        self.jax = {n: torch_to_jax(getattr(self, n)) for n in ("q", "k", "v", "gate", "dout")}
        self.jax["block_map"] = jnp.asarray(self.block_map.cpu().numpy())  # small; concrete under jit
        self.jax["counts"] = self.counts.cpu().numpy()


def our_contender(stage: str, backend: str, frontend: str, x: Inputs, jax_mod, device: str,
                  padding: str = "zeros") -> Contender:
    """Our `stage` ("fine": block_sparse_attn, "vsa": video_sparse_attn) through one frontend."""
    E, topk, prefix = x.shape.E, x.shape.topk, x.shape.prefix
    if frontend == "jax":
        j = x.jax
        if stage == "fine":
            def forward(q, k, v):
                return jax_mod.block_sparse_attn(q, k, v, j["block_map"], j["counts"], E, backend=backend,
                                                 padding=padding)[0]
            return jax_contender(forward, (j["q"], j["k"], j["v"]), j["dout"], device)

        def forward(q, k, v, gate):
            return jax_mod.video_sparse_attn(q, k, v, j["counts"], j["counts"], topk, E,
                                             compress_attn_weight=gate, backend=backend, prefix_blocks=prefix,
                                             padding=padding)
        return jax_contender(forward, (j["q"], j["k"], j["v"], j["gate"]), j["dout"], device)

    # the map and counts are arguments, not closure constants, so torch.compile sees them as inputs
    if stage == "fine":
        def forward(q, k, v, block_map, counts):
            return block_sparse_attn(q, k, v, block_map, counts, E, backend=backend, padding=padding)[0]
        extra, inputs = (x.block_map, x.counts), (x.q, x.k, x.v)
    else:
        def forward(q, k, v, gate, counts):
            return video_sparse_attn(q, k, v, counts, counts, topk, E, compress_attn_weight=gate, backend=backend,
                                     prefix_blocks=prefix, padding=padding)
        extra, inputs = (x.counts,), (x.q, x.k, x.v, x.gate)
    if frontend == "compile":
        forward = torch.compile(forward, dynamic=False, fullgraph=True)
    elif frontend != "eager":
        raise ValueError(f"unknown frontend {frontend!r} (eager, compile, jax)")
    return torch_contender(lambda *xs: forward(*xs, *extra), inputs, x.dout)


def run_peers(x: Inputs, args, timer: Timer, rows: List[Row]):
    """Times the peers; returns the fine stage's reference (out, dq, dk, dv) and its name."""
    device, shape = args.device, x.shape
    q, k, v, dout = x.q, x.k, x.v, x.dout
    names = [p.strip() for p in args.peers.split(",") if p.strip()]
    # FlexAttention on the same block map is the fine stage's reference. Small shapes also
    # get an exact one (masked fp32 SDPA), which checks flex itself.
    exact_ref = None
    if shape.B * shape.H * shape.S ** 2 <= 2 ** 28:
        exact_ref = peers.masked_reference(q, k, v, dout, x.block_map, shape.E)
    ref, ref_name = exact_ref, ("masked fp32 sdpa" if exact_ref is not None else None)
    if "flex" in names:
        def try_fwd_bwd(forward):
            torch.autograd.grad(forward(q, k, v), (q, k, v), dout)
        t = time.perf_counter()
        label, forward, failures = peers.make_flex(x.block_map, shape.E, shape.S, try_fwd_bwd)
        for f in failures:
            log(f"  peer flex variant failed: {f}")
        row = Row(shape.name, "peer", f"flex ({label})" if label else "flex", flops_fwd=shape.sparse_flops())
        rows.append(row)
        if forward is None:
            row.status = "error: " + "; ".join(failures)
        else:
            values = measure(row, torch_contender(forward, (q, k, v), dout), timer, device, args.tol,
                             exact_ref, ref_name)
            row.first_call_s = time.perf_counter() - t  # includes building the masks, compiling
            if values is not None and row.status == "ok":
                ref, ref_name = values, "flex"
    if "sdpa" in names:
        row = Row(shape.name, "peer", "sdpa-flash (dense)", dense=True, flops_fwd=shape.dense_flops())
        rows.append(row)
        measure(row, torch_contender(peers.sdpa_flash_dense, (q, k, v), dout), timer, device, args.tol,
                forward_only_ok=True)
    if "fa4" in names:
        row = Row(shape.name, "peer", "fa4 (dense)", dense=True, flops_fwd=shape.dense_flops())
        rows.append(row)
        forward, why = peers.fa4_dense() if device == "cuda" else (None, "GPU only")
        if forward is None:
            row.status = f"skipped: {why}"
            log(f"  peer fa4 skipped: {why}")
        else:
            # FA4 takes [B, S, H, D]: give it tensors stored that way, viewed as [B, H, S, D]
            def bshd(t, grad=True):
                return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(grad)
            c = torch_contender(forward, (bshd(q), bshd(k), bshd(v)), bshd(dout, False))
            measure(row, c, timer, device, args.tol, forward_only_ok=True)
    if "cudnn" in names:
        label, forward, why = peers.cudnn_bsa(x.block_map, shape.E) if device == "cuda" else (None, None, "GPU only")
        row = Row(shape.name, "peer", label or "cudnn-bsa", flops_fwd=shape.sparse_flops())
        rows.append(row)
        if forward is None:
            row.status = f"skipped: {why}"
            log(f"  peer cudnn-bsa skipped: {why}")
        else:
            measure(row, torch_contender(forward, (q, k, v), dout), timer, device, args.tol, ref, ref_name,
                    forward_only_ok=True)
    return ref, ref_name


def run_shape(shape: Shape, args, timer: Timer, jax_mod, jax_reason) -> List[Row]:
    device = args.device
    log(f"== {shape.describe()}")
    x = Inputs.random(shape, device, args.seed)
    rows: List[Row] = []
    fine_ref, fine_ref_name = run_peers(x, args, timer, rows)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    frontends = [f.strip() for f in args.frontends.split(",") if f.strip()]
    if "jax" in frontends and jax_mod is not None:
        x.add_jax(device)
    for stage in [s for s in ("fine", "vsa") if args.only in (None, s)]:
        # no peer computes VSA: each vsa row is checked against the first one that ran
        vsa_ref, vsa_ref_name = None, None
        for backend in backends:
            for frontend in frontends:
                row = Row(shape.name, stage, f"{backend}/{frontend}", backend=backend, frontend=frontend,
                          flops_fwd=shape.sparse_flops())
                rows.append(row)
                if frontend == "jax" and jax_mod is None:
                    row.status = f"skipped: {jax_reason}"
                    log(f"  {stage:4s} {row.name:28s} {row.status}")
                    continue
                c = our_contender(stage, backend, frontend, x, jax_mod, device, args.padding)
                if stage == "fine":
                    measure(row, c, timer, device, args.tol, fine_ref, fine_ref_name)
                else:
                    values = measure(row, c, timer, device, args.tol, vsa_ref, vsa_ref_name,
                                     names=("out", "dq", "dk", "dv", "dgate"))
                    if vsa_ref is None and values is not None and row.status == "ok":
                        vsa_ref, vsa_ref_name = values, row.name
                del c
                if device == "cuda":
                    torch.cuda.empty_cache()
    add_speedups(rows)
    return rows


def add_speedups(rows: List[Row]) -> None:
    """Speedup of each of our rows over the fastest usable peer (per direction)."""
    peer_rows = [r for r in rows if r.stage == "peer" and r.usable]
    if not peer_rows:
        return
    best_fwd = min(r.fwd_ms for r in peer_rows)
    best_bwd = min((r.bwd_ms for r in peer_rows if r.bwd_ms), default=None)
    for r in rows:
        if r.stage != "peer" and r.usable:
            r.speedup_fwd_vs_best_peer = best_fwd / r.fwd_ms if r.fwd_ms else None
            r.speedup_bwd_vs_best_peer = best_bwd / r.bwd_ms if best_bwd and r.bwd_ms else None


def fastest_ours(rows: List[Row]) -> List[dict]:
    """Per shape and stage, our fastest row that passed its check, forward and backward."""
    best = []
    for key in sorted({(r.shape, r.stage) for r in rows if r.stage in ("fine", "vsa")}):
        ok = [r for r in rows if (r.shape, r.stage) == key and r.usable]
        if not ok:
            continue
        f = min(ok, key=lambda r: r.fwd_ms)
        b = min((r for r in ok if r.bwd_ms is not None), key=lambda r: r.bwd_ms, default=None)
        best.append(dict(shape=key[0], stage=key[1], fwd=f.name, fwd_ms=f.fwd_ms,
                         bwd=b.name if b else None, bwd_ms=b.bwd_ms if b else None))
    return best


def coarse_shares(rows: List[Row]) -> List[dict]:
    """Share of the whole VSA forward (and backward) not spent in the fine stage:
    1 - t(block_sparse_attn) / t(video_sparse_attn), same backend and frontend."""
    shares = []
    fine = {(r.shape, r.name): r for r in rows if r.stage == "fine" and r.usable}
    for r in rows:
        f = fine.get((r.shape, r.name))
        if r.stage == "vsa" and r.usable and f is not None:
            shares.append(dict(shape=r.shape, contender=r.name,
                               fwd_share=1 - f.fwd_ms / r.fwd_ms,
                               bwd_share=(1 - f.bwd_ms / r.bwd_ms) if r.bwd_ms else None))
    return shares


# ---- output ------------------------------------------------------------------------------
def fmt(x, spec):
    """format(x, spec), or a dash as wide as the spec's width."""
    width = int(spec.split(".")[0] or 0)
    return format(x, spec) if x is not None else "-".rjust(width)


def print_table(shapes: List[Shape], rows: List[Row], shares: List[dict], best: List[dict]) -> None:
    head = (f"{'stage':5s} {'contender':28s} {'fwd ms':>9s} {'TFLOPS':>7s} {'bwd ms':>9s} {'TFLOPS':>7s} "
            f"{'xpeer fwd':>9s} {'bwd':>6s} {'err':>8s}  status")
    for shape in shapes:
        print(f"\n== {shape.describe()}")
        print(head)
        for r in (r for r in rows if r.shape == shape.name):
            if r.status.startswith("skipped") or r.status.startswith("error"):
                print(f"{r.stage:5s} {r.name:28s} {r.status[:90]}")
                continue
            err = max(r.errors.values()) if r.errors else None
            name = r.name + (" *dense" if r.dense else "")
            print(f"{r.stage:5s} {name:28s} {fmt(r.fwd_ms, '9.3f')} {fmt(r.fwd_tflops, '7.1f')} "
                  f"{fmt(r.bwd_ms, '9.3f')} {fmt(r.bwd_tflops, '7.1f')} "
                  f"{fmt(r.speedup_fwd_vs_best_peer, '8.2f') + 'x' if r.speedup_fwd_vs_best_peer else '        -'} "
                  f"{fmt(r.speedup_bwd_vs_best_peer, '5.2f') + 'x' if r.speedup_bwd_vs_best_peer else '     -'} "
                  f"{fmt(err, '8.1e')}  {r.status}" + (f" ({r.note[:60]})" if r.note else "")
                  + (" (bwd = fwd+bwd - fwd)" if r.bwd_method == "fwd+bwd - fwd" else ""))
        for b in (b for b in best if b["shape"] == shape.name):
            print(f"      fastest ours, {b['stage']}: fwd {b['fwd']} {b['fwd_ms']:.3f} ms"
                  + (f", bwd {b['bwd']} {b['bwd_ms']:.3f} ms" if b["bwd"] else ""))
        for s in (s for s in shares if s["shape"] == shape.name):
            print(f"      coarse+selection share of VSA, {s['contender']}: fwd {100 * s['fwd_share']:.0f}%"
                  + (f", bwd {100 * s['bwd_share']:.0f}%" if s["bwd_share"] is not None else ""))
        steady = {(r.stage, r.backend, r.frontend): r for r in rows
                  if r.shape == shape.name and r.usable and r.fwd_steady_ms}
        for (stage, backend, frontend), r in steady.items():
            eager = steady.get((stage, backend, "eager"))
            line = (f"      steady (back-to-back calls) {stage} {r.name}: fwd {r.fwd_steady_ms:.3f} ms, "
                    f"fwd+bwd {fmt(r.fwd_bwd_steady_ms, '.3f')} ms; one call alone, issue to done: fwd "
                    f"{fmt(r.fwd_latency_ms, '.3f')} ms, fwd+bwd {fmt(r.fwd_bwd_latency_ms, '.3f')} ms")
            if frontend != "eager" and eager is not None and r.fwd_bwd_steady_ms and eager.fwd_bwd_steady_ms:
                line += (f"  vs eager: fwd {100 * (r.fwd_steady_ms / eager.fwd_steady_ms - 1):+.1f}%, "
                         f"fwd+bwd {100 * (r.fwd_bwd_steady_ms / eager.fwd_bwd_steady_ms - 1):+.1f}%")
            print(line)
    print_ratios(shapes, rows)
    print("\nbwd: the backward alone, timed from a forward's saved state (torch: retained graph; jax: the "
          "pullback over the vjp residuals), except rows marked (bwd = fwd+bwd - fwd).")
    print("xpeer: speedup over the fastest peer (time of peer / ours). *dense: FLOPs counted densely. "
          "err: max relative-norm error of out and grads (fine: vs flex, or exact masked fp32 where flex "
          "cannot run; vsa: vs the first VSA row; flex: vs exact where the shape is small).")


def print_ratios(shapes: List[Shape], rows: List[Row]) -> None:
    """time(frontend) / time(eager) of the same stage and backend: device times (do_bench),
    steady back-to-back wall times and one call's latency; below 1.00 the frontend is faster."""
    lines = []
    for shape in shapes:
        ours = {(r.stage, r.backend, r.frontend): r for r in rows
                if r.shape == shape.name and r.stage != "peer" and r.usable}
        for (stage, backend, frontend), r in ours.items():
            eager = ours.get((stage, backend, "eager"))
            if frontend == "eager" or eager is None:
                continue

            def ratio(a, b):
                return f"{a / b:6.2f}" if a and b else "     -"
            lines.append(f"{shape.name:9s} {stage:4s} {backend:7s} {frontend:8s} {ratio(r.fwd_ms, eager.fwd_ms)} "
                         f"{ratio(r.bwd_ms, eager.bwd_ms)} {ratio(r.fwd_bwd_ms, eager.fwd_bwd_ms)} "
                         f"    {ratio(r.fwd_steady_ms, eager.fwd_steady_ms)} "
                         f"    {ratio(r.fwd_bwd_steady_ms, eager.fwd_bwd_steady_ms)}"
                         f"      {ratio(r.fwd_latency_ms, eager.fwd_latency_ms)}"
                         f"      {ratio(r.fwd_bwd_latency_ms, eager.fwd_bwd_latency_ms)}")
    if lines:
        print("\n== time / eager time (same stage and backend; < 1: faster than eager PyTorch)")
        print(f"{'shape':9s} {'stage':4s} {'backend':7s} {'frontend':8s} {'fwd':>6s} {'bwd':>6s} {'f+b':>6s} "
              f"{'steady fwd':>10s} {'steady f+b':>10s} {'latency fwd':>11s} {'latency f+b':>11s}")
        for line in lines:
            print(line)


def versions() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "numpy": np.__version__}
    try:
        import jax
        info["jax"] = jax.__version__
    except Exception:
        info["jax"] = None
    info["fa4"] = peers.fa4_version()
    info["cudnn_frontend"] = peers.cudnn_version()
    return info


def git_commit() -> Optional[str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except Exception:
        return os.environ.get("VSA_COMMIT")


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def save_chart(path: str, shapes: List[Shape], rows: List[Row]) -> Optional[str]:
    """TFLOPS per contender, forward and backward, one panel per shape, with dense FA4's forward and
    backward as reference lines where it ran (the speed a sparse kernel is measured against); a panel
    says so where no contender ran. Returns why there is no chart (matplotlib missing), else None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no chart: matplotlib unavailable ({type(e).__name__})"
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        ax.set_title(shape.describe(), fontsize=8)
        shown = [r for r in rows if r.shape == shape.name and r.fwd_tflops is not None]
        if not shown:  # every contender skipped or failed here: an empty panel that says so
            ax.text(0.5, 0.5, "no contender ran", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        labels = [f"{r.stage}: {r.name}" + (" *dense" if r.dense else "") + (" FAIL" if r.status == "FAIL" else "")
                  for r in shown]
        y = np.arange(len(shown))
        ax.barh(y - 0.2, [r.fwd_tflops for r in shown], 0.4, label="forward")
        ax.barh(y + 0.2, [r.bwd_tflops or 0 for r in shown], 0.4, label="backward")
        dense = next((r for r in shown if r.stage == "peer" and r.name.startswith("fa4")), None)
        if dense is not None:
            ax.axvline(dense.fwd_tflops, color="C0", linestyle="--", linewidth=1, label="dense FA4 forward")
            if dense.bwd_tflops:
                ax.axvline(dense.bwd_tflops, color="C1", linestyle="--", linewidth=1, label="dense FA4 backward")
        ax.set_yticks(y, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOPS (higher is better; sparse FLOPs, backward 2.5x)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available; use --device cpu for the plumbing check")
    os.makedirs(args.out, exist_ok=True)
    quick = args.quick
    timer = Timer(args.device,
                  reps=args.reps or (1 if args.device == "cuda" else 3),
                  rep_ms=args.rep_ms or (50 if quick else 200),
                  warmup_ms=args.warmup_ms or (10 if quick else 25))
    # one compiled graph per shape and contender: more than the default recompile limit
    for limit in ("cache_size_limit", "recompile_limit"):  # renamed across torch versions
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    shapes = select_shapes(args)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=device_name(args.device),
                device_kind=args.device, git_commit=git_commit(), versions=versions(),
                triton_interpret=os.environ.get("TRITON_INTERPRET"), argv=sys.argv[1:])
    log(f"device {meta['device']}, commit {meta['git_commit']}, versions {meta['versions']}")
    jax_mod, jax_reason = (None, "not requested")
    if "jax" in args.frontends:
        jax_mod, jax_reason = load_jax(args.device)
        if jax_mod is None:
            log(f"JAX rows skipped: {jax_reason}")

    rows: List[Row] = []
    for shape in shapes:
        try:
            rows += run_shape(shape, args, timer, jax_mod, jax_reason)
        except Exception as e:  # e.g. out of memory building the inputs: keep the other shapes
            log(f"shape {shape.name} failed: {type(e).__name__}: {first_line(e)}")
            rows.append(Row(shape.name, "all", "-", status=f"error: {type(e).__name__}: {first_line(e)}"))
        if args.device == "cuda":
            torch.cuda.empty_cache()

    shares, best = coarse_shares(rows), fastest_ours(rows)
    print_table(shapes, rows, shares, best)
    result = dict(meta=meta,
                  config=dict(rep_ms=timer.rep_ms, warmup_ms=timer.warmup_ms, reps=timer.reps, tol=args.tol,
                              dtype="bfloat16", padding=args.padding,
                              backward_method="the backward alone from a forward's saved state (rows' bwd_method; "
                                              "'fwd+bwd - fwd' where it could not be replayed)",
                              flops="fwd 4*B*H*D*Sq*topk*E (dense peers 4*B*H*D*Sq*Skv); bwd 2.5x fwd"),
                  shapes=[dict(asdict(s), sparsity=s.sparsity, sparse_flops_fwd=s.sparse_flops(),
                               dense_flops_fwd=s.dense_flops()) for s in shapes],
                  rows=[asdict(r) for r in rows], coarse_share=shares, fastest_ours=best)
    json_path = os.path.join(args.out, "results.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    chart_note = save_chart(os.path.join(args.out, "results.png"), shapes, rows)
    log(f"wrote {json_path}" + (f"; {chart_note}" if chart_note else f" and {args.out}/results.png"))
    failed = [r for r in rows if r.status == "FAIL"]
    if failed:
        log(f"{len(failed)} rows FAIL the correctness bound {args.tol}: " + ", ".join(
            f"{r.shape}/{r.stage}/{r.name}" for r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
