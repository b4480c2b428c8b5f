"""The coarse forward's top-k selection, old kernel against new, with the pooling and coarse
attention around it for the stage's total (issue 21 stage 1).

    PYTHONPATH=. python3 benchmarks/coarse_fwd_bench.py                        # H200: 480p-64, 480p-256
    PYTHONPATH=. python3 benchmarks/coarse_fwd_bench.py --dtype float16
    PYTHONPATH=. python3 benchmarks/coarse_fwd_bench.py --compile              # CPU: sm_90 registers / spills
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/coarse_fwd_bench.py --device cpu --tiny   # plumbing

Per shape (bf16 or fp16, BHSD, x16 q / k activations as benchmarks/coarse_bench.py, full blocks):
- pooling (`stages.block_mean_pool_qkv`); GB/s = the bytes of q, k and v read once over the time
  (several blocks per program were tried and measured slower: benchmarks/results/2026-12-03-h200-session13);
- top-k selection (`stages.topk_select`, scores rounded to the input dtype as `vsa_core.ops`
  ranks them): algorithm "threshold" (`topk_select_kernel`) against "packed"
  (`topk_select_packed_kernel`);
- the coarse attention between them (the scores the selection ranks), for the stage's total.
Times are triton.testing.do_bench medians (ms). The new selection must equal the old one bit for
bit (index lists, slots past the counts included, counts and mask rows): a row that differs says
so, and the exit status is 1.
A table goes to stdout and, with $OUT set, to $OUT/coarse_fwd_bench.log.

--compile (no GPU) compiles the same launches for sm_90 and prints registers, spilled bytes and
shared memory of each kernel; tests/test_topk_select.py uses its `compile_stage`.
"""

from __future__ import annotations

import argparse
import os
import sys

SHAPES = {
    # name: (B, H, S, D, E, topk)
    "480p-64": (1, 12, 39936, 128, 64, 62),
    "480p-256": (1, 12, 39936, 128, 256, 20),
    "tiny": (1, 2, 1024, 64, 64, 4),  # --tiny: a plumbing check under TRITON_INTERPRET=1
}
LINES = []


def say(msg=""):
    print(msg, flush=True)
    LINES.append(msg)


# ---- compiling a stage's launch for a GPU target without a GPU ---------------------------------
def compile_stage(stage, problem, arch: int = 90, **kwargs):
    """Compiles the one launch that `stage` (a `vsa_core.stages` function: block_mean_pool_qkv or
    topk_select) makes for `problem`, for sm_<arch>, with the arguments an eager launch on GPU
    buffers would pass (placeholder buffers, so scalar arguments specialize as they would).
    Returns (kernel name, Triton's compiled kernel: .asm["ttgir" / "ptx" / "cubin"], .metadata)."""
    from triton.backends.compiler import GPUTarget

    from vsa_core import plan as P
    from vsa_core.launch import Launcher
    from vsa_core.runtime import DeviceBuffer
    from vsa_core.triton_shim import compile_for_target, mock_pointer

    class Capture(Launcher):
        calls = []

        def triton(self, kernel, grid, *args, **meta):
            self.calls.append((kernel, grid, args, meta))

    def buffer(shape, dtype):
        return DeviceBuffer(0, problem.dtype if dtype == "input" else dtype, shape, P._META)

    table = {**P.forward_inputs(problem), **problem.forward_buffers()}
    b = {name: buffer(shape, dtype) for name, (shape, dtype) in table.items()}
    launcher = Capture()
    if stage.__name__ == "block_mean_pool_qkv":
        stage(launcher, problem, b["q"], b["k"], b["v"], b["q_counts"], b["kv_counts"], b["q_pool"], b["k_pool"],
              b["v_pool"], **kwargs)
    elif stage.__name__ == "topk_select":
        extra = {}
        if problem.has_prefix and problem.varlen:
            extra = dict(q_seq=buffer((problem.n_q_blocks,), "int32"), cu_seqlens_q=buffer((problem.n_seqs + 1,), "int32"),
                         cu_seqlens_k=buffer((problem.n_seqs + 1,), "int32"))
        if problem.seq_prefix:
            extra["seq_prefix"] = buffer((problem.n_seqs,), "int32")
        stage(launcher, problem, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"], **extra, **kwargs)
    else:
        raise ValueError(f"compile_stage takes block_mean_pool_qkv or topk_select, got {stage.__name__}")
    (kernel, grid, args, meta), = launcher.calls
    args = [mock_pointer(a.dtype) if isinstance(a, DeviceBuffer) else a for a in args]
    return kernel.fn.__name__, compile_for_target(kernel, args, grid, meta, GPUTarget("cuda", arch, 32))


def compile_figures(compiled, arch: int = 90):
    """(registers, spilled bytes, shared bytes) of a compiled kernel, as ptxas reports them."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from coarse_smem import ptxas_usage
    regs, spills = ptxas_usage(compiled.asm["ptx"], arch)
    return regs, spills, compiled.metadata.shared


def problem_of(shape: str, dtype: str, device: str = "meta"):
    from vsa_core.problem import AttnProblem
    B, H, S, D, E, topk = SHAPES[shape]
    return AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=E, dtype=dtype, topk=topk)


def compile_table(shapes, dtype):
    from vsa_core import stages as ST
    say(f"sm_90 compile (no GPU), {dtype}: registers / spilled bytes / shared bytes")
    say(f"{'shape':9s} {'kernel':38s} {'variant':10s} {'regs':>5s} {'spills':>7s} {'shared':>7s}")
    ok = True
    for shape in shapes:
        p = problem_of(shape, dtype)
        rows = [(ST.block_mean_pool_qkv, {}, "")]
        rows += [(ST.topk_select, dict(algorithm=a, scores_rounded_to=dtype), a) for a in ST.TOPK_ALGORITHMS]
        for stage, kwargs, label in rows:
            name, compiled = compile_stage(stage, p, **kwargs)
            regs, spills, shared = compile_figures(compiled)
            ok &= spills == 0
            say(f"{shape:9s} {name:38s} {label:10s} {regs:5d} {spills:7d} {shared:7d}")
    return ok


# ---- timing on the device --------------------------------------------------------------------
def bench_shape(shape, args, do_bench, device):
    import torch

    from vsa_core import stages as ST
    from vsa_core.launch import eager_launcher
    from vsa_core.problem import describe_attention

    B, H, S, D, E, topk = SHAPES[shape]
    dt = getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k = (16 * torch.randn(B, H, S, D, generator=gen) for _ in range(2))
    v = torch.randn(B, H, S, D, generator=gen)
    q, k, v = (x.to(device, dt) for x in (q, k, v))
    counts = torch.full((S // E,), E, dtype=torch.int32, device=device)
    p = describe_attention(q, k, v, block_size=E, layout="bhsd", kv_counts=counts, q_counts=counts, topk=topk)

    def empty(name):
        shape_, kind = p.forward_buffers()[name]
        return torch.empty(shape_, device=device, dtype=dt if kind == "input" else getattr(torch, kind))

    ok = True
    read_bytes = (q.numel() + k.numel() + v.numel()) * q.element_size()
    base = [empty(n) for n in ("q_pool", "k_pool", "v_pool")]
    ST.block_mean_pool_qkv(eager_launcher, p, q, k, v, counts, counts, *base)
    t_pool = do_bench(lambda: ST.block_mean_pool_qkv(eager_launcher, p, q, k, v, counts, counts, *base))
    say(f"{shape:9s} {'pool':6s} {'':10s} {t_pool:8.4f} {'':>8s} {'':>7s} {read_bytes / t_pool / 1e6:7.0f}")
    # coarse attention: the scores the selection ranks
    scores, out_c, lse_c = empty("scores"), empty("out_coarse"), empty("lse_coarse")
    ST.coarse_forward(eager_launcher, p, *base, counts, scores, out_c, lse_c)
    t_coarse = do_bench(lambda: ST.coarse_forward(eager_launcher, p, *base, counts, scores, out_c, lse_c))
    say(f"{shape:9s} {'coarse':6s} {'':10s} {t_coarse:8.4f}")
    # top-k selection: the same buffers' contents from both algorithms, unwritten slots included
    results, times = {}, {}
    for algorithm in ST.TOPK_ALGORITHMS:
        sel = [empty(n) for n in ("sel_idx", "sel_num", "sel_mask")]
        for t in sel:
            t.fill_(-7)

        def select():
            ST.topk_select(eager_launcher, p, scores, *sel, scores_rounded_to=p.dtype, algorithm=algorithm)
        select()
        results[algorithm] = [t.clone() for t in sel]
        times[algorithm] = do_bench(select)
    old, new = ST.TOPK_ALGORITHMS
    same = all(torch.equal(a, b) for a, b in zip(results[old], results[new]))
    ok &= same
    ok &= bool((results[new][1] == p.topk).all())  # every block full: exactly topk per row
    say(f"{shape:9s} {'top-k':6s} {old:10s} {times[old]:8.4f}")
    say(f"{shape:9s} {'top-k':6s} {new:10s} {times[new]:8.4f} {times[old] / times[new]:7.2f}x {str(same):>7s}")
    before = t_pool + t_coarse + times[old]
    after = t_pool + t_coarse + min(times.values())
    say(f"{shape:9s} {'total':6s} {'fastest':10s} {after:8.4f} {before / after:7.2f}x          (was {before:.4f})")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="480p-64,480p-256", help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--rep-ms", type=float, default=200)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape only (with --device cpu: plumbing)")
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 and report (no GPU)")
    args = parser.parse_args()
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    if args.compile:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("--compile compiles the kernels: unset TRITON_INTERPRET")
        ok = compile_table(shapes, args.dtype)
    else:
        import torch
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit("coarse_fwd_bench.py needs a CUDA GPU (or --device cpu --tiny, or --compile)")
        if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--device cpu runs the kernels under the interpreter: set TRITON_INTERPRET=1")

        def do_bench(fn):
            if args.device == "cpu":
                import time
                start = time.perf_counter()
                fn()
                return (time.perf_counter() - start) * 1e3
            from triton.testing import do_bench as _do_bench
            return _do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median")

        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
        say(f"coarse forward stages, {name}, {args.dtype}, x16 q/k activations, BHSD; ms (median), "
            f"speedup over the old kernel, new == old bit for bit, GB/s read (pooling)")
        say(f"{'shape':9s} {'stage':6s} {'variant':10s} {'ms':>8s} {'speedup':>8s} {'same':>7s} {'GB/s':>7s}")
        ok = True
        for shape in shapes:
            ok &= bench_shape(shape, args, do_bench, args.device)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "coarse_fwd_bench.log"), "w") as f:
            f.write("\n".join(LINES) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
