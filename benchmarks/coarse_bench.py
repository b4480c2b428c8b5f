"""Times the coarse stage of VSA before and after the issue-9 changes, and the whole VSA
against its fine stage (GPU only).

    PYTHONPATH=. python3 benchmarks/coarse_bench.py                     # 480p-64 and 480p-256
    PYTHONPATH=. python3 benchmarks/coarse_bench.py --shapes 480p-64 --skip-vsa
    PYTHONPATH=. python3 benchmarks/coarse_bench.py --precision tf32x3  # data only: the coarse dots stay "ieee"

1. coarse stage (CUDA events, triton.testing.do_bench, median), "before" and "after":
   - forward: block-mean pooling of q, k, v + coarse attention forward + top-k selection;
   - backward: coarse attention backward (P / dS tiles, then the dq_c, dk_c, dv_c products);
   - the selection alone.
   "before" is the code as of 29bb075 (main, 2026-11-30): 64x64 tiles for every coarse kernel
   (dK/dV at 1 stage for D=128), three pooling launches, and the selection with 64-bit keys at
   4 warps per row (a copy of that kernel below). "after" is the code as it is. Also checks
   that both pick the same blocks and prints the largest difference of out_c / lse_c / the
   coarse gradients between them, and each one's error against float64 (x16 activations).
2. whole VSA (video_sparse_attn) against its fine stage (block_sparse_attn on the same block
   map) per backend (triton and cudnn; --backends triton,cudnn,cute adds FA4), forward and backward; targets
   <= 1.10x / 1.05x. backward = median(fwd+bwd) - median(fwd).
A table goes to stdout and, with $OUT set, to $OUT/coarse_bench.log.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import triton
import triton.language as tl

from vsa_core import stages as S
from vsa_core.config import config, configure
from vsa_core.launch import eager_launcher
from vsa_core.problem import describe_attention

SHAPES = {
    # name: (B, H, S, D, E, topk)
    "480p-64": (1, 12, 39936, 128, 64, 62),
    "480p-256": (1, 12, 39936, 128, 256, 20),
    "720p-256": (1, 40, 92160, 128, 256, 45),
    "tiny": (1, 2, 1024, 64, 64, 4),  # --device cpu: a plumbing check under TRITON_INTERPRET=1
}
DEVICE = "cuda"
DTYPES = {"float32": torch.float32, "int32": torch.int32, "int8": torch.int8}
# the coarse forward's config of 29bb075, as (BLOCK_M, BLOCK_N, num_warps, num_stages); that
# code's backward kernels (a row band or a column band per program) are gone since issue 21:
# "before" runs today's backward (their times, 1.05-1.10 ms at 480p-64, are in
# results/2026-12-01-h200/)
BEFORE_CONFIGS = {D: dict(configs, fwd=(64, 64, 4, 3)) for D, configs in S.COARSE_CONFIGS.items()}
LINES = []


def say(msg=""):
    print(msg, flush=True)
    LINES.append(msg)


@triton.jit
def _select_before_kernel(SCORES, SEL_IDX, SEL_NUM, SEL_MASK, n_kv, topk, idx_capacity, N_PAD: tl.constexpr):
    """topk_select_kernel as of 29bb075 (64-bit keys), for timing."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N_PAD)
    in_range = cols < n_kv
    scores = tl.load(SCORES + row * n_kv + cols, mask=in_range, other=float("-inf"))
    n_finite = tl.sum((scores > float("-inf")).to(tl.int32), axis=0)
    k_eff = tl.minimum(topk, n_finite)
    bits = tl.where(scores == 0.0, 0.0, scores).to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    threshold = tl.full([], -2147483648, tl.int64)
    step = tl.full([], 1, tl.int64) << 31
    for _ in range(0, 32):
        candidate = threshold + step
        threshold = tl.where(tl.sum((key >= candidate).to(tl.int32), axis=0) >= k_eff, candidate, threshold)
        step = step >> 1
    above = key > threshold
    ties = (key == threshold).to(tl.int32)
    need = k_eff - tl.sum(above.to(tl.int32), axis=0)
    chosen = (above | ((ties > 0) & (tl.cumsum(ties, axis=0) <= need))).to(tl.int32)
    slot = tl.cumsum(chosen, axis=0) - 1
    tl.store(SEL_IDX + row * idx_capacity + slot, cols, mask=chosen > 0)
    tl.store(SEL_NUM + row, k_eff)
    tl.store(SEL_MASK + row * n_kv + cols, chosen.to(tl.int8), mask=in_range)


def buffers(p, q, k, v, counts):
    b = {name: torch.empty(shape, device=DEVICE, dtype=q.dtype if dt == "input" else DTYPES[dt])
         for name, (shape, dt) in {**p.forward_buffers(), **p.backward_buffers()}.items()}
    b.update(q=q, k=k, v=v, kv_counts=counts, q_counts=counts)
    b["dout_coarse"].normal_()
    return b


def select_before(p, b):
    n_pad = max(16, triton.next_power_of_2(p.n_kv_blocks))
    _select_before_kernel[(p.batch * p.heads * p.n_q_blocks,)](
        b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"], p.n_kv_blocks, p.topk, p.select_capacity,
        N_PAD=n_pad, num_warps=4)


def select_after(p, b):
    S.topk_select(eager_launcher, p, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"])


def pool_before(p, b):
    S.block_mean_pool(eager_launcher, p, b["q"], b["q_counts"], b["q_pool"], p.q_len)
    S.block_mean_pool(eager_launcher, p, b["k"], b["kv_counts"], b["k_pool"], p.kv_len)
    S.block_mean_pool(eager_launcher, p, b["v"], b["kv_counts"], b["v_pool"], p.kv_len)


def pool_after(p, b):
    """The pooling as vsa_core.ops.forward launches it."""
    if hasattr(T, "block_mean_pool_qkv"):
        S.block_mean_pool_qkv(eager_launcher, p, b["q"], b["k"], b["v"], b["q_counts"], b["kv_counts"], b["q_pool"],
                              b["k_pool"], b["v_pool"])
    else:
        pool_before(p, b)


def coarse_forward(p, b):
    S.coarse_forward(eager_launcher, p, b["q_pool"], b["k_pool"], b["v_pool"], b["kv_counts"], b["scores"],
                     b["out_coarse"], b["lse_coarse"])


def backward_stage(p, b):
    S.coarse_backward(eager_launcher, p, b["q_pool"], b["k_pool"], b["v_pool"], b["kv_counts"], b["out_coarse"],
                      b["lse_coarse"], b["dout_coarse"], b["dq_pool"], b["dk_pool"], b["dv_pool"], b["p_coarse"],
                      b["ds_coarse"])


class Version:
    """The launches and configs of one version of the coarse stage."""

    def __init__(self, name, configs, pool, select):
        self.name, self.configs, self.pool, self.select = name, configs, pool, select

    def __enter__(self):
        self.saved = S.COARSE_CONFIGS
        S.COARSE_CONFIGS = self.configs
        return self

    def __exit__(self, *exc):
        S.COARSE_CONFIGS = self.saved

    def forward(self, p, b):
        self.pool(p, b)
        coarse_forward(p, b)
        self.select(p, b)


def coarse_errors(p, b):
    """Relative errors of out_c, dq_c, dk_c, dv_c against float64 autograd on the pooled inputs."""
    qc, kc, vc = (b[n].double().requires_grad_() for n in ("q_pool", "k_pool", "v_pool"))
    s = qc @ kc.transpose(-1, -2) * p.softmax_scale
    out = torch.softmax(s, dim=-1) @ vc
    out.backward(b["dout_coarse"].double())
    res = {}
    for name, got, want in (("out_c", b["out_coarse"], out), ("dq_c", b["dq_pool"], qc.grad),
                            ("dk_c", b["dk_pool"], kc.grad), ("dv_c", b["dv_pool"], vc.grad)):
        want = want.detach()
        res[name] = ((got.double() - want).norm() / want.norm()).item()
    return res


def coarse_stage(shape, args, do_bench):
    B, H, S, D, E, topk = SHAPES[shape]
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q, k, v = (16 * torch.randn(B, H, S, D, device=DEVICE, dtype=dtype) if i < 2 else
               torch.randn(B, H, S, D, device=DEVICE, dtype=dtype) for i in range(3))
    counts = torch.full((S // E,), E, dtype=torch.int32, device=DEVICE)
    p = describe_attention(q, k, v, block_size=E, layout="bhsd", kv_counts=counts, q_counts=counts, topk=topk)
    results = {}
    for version in (Version("before", BEFORE_CONFIGS, pool_before, select_before),
                    Version("after", S.COARSE_CONFIGS, pool_after, select_after)):
        b = buffers(p, q, k, v, counts)
        torch.manual_seed(1)
        b["dout_coarse"].normal_()
        with version:
            version.forward(p, b)
            backward_stage(p, b)
            synchronize()
            t_fwd = do_bench(lambda: version.forward(p, b))
            t_bwd = do_bench(lambda: backward_stage(p, b))
            t_pool = do_bench(lambda: version.pool(p, b))
            t_coarse = do_bench(lambda: coarse_forward(p, b))
            t_sel = do_bench(lambda: version.select(p, b))
            version.forward(p, b)
            backward_stage(p, b)
            synchronize()
        results[version.name] = (b, dict(fwd=t_fwd, bwd=t_bwd, pool=t_pool, coarse=t_coarse, select=t_sel),
                                 coarse_errors(p, b))
    before, after = results["before"], results["after"]
    same = all(torch.equal(before[0][n], after[0][n]) for n in ("sel_num", "sel_mask")) and torch.equal(
        before[0]["sel_idx"].masked_fill(~_listed(before[0]), 0), after[0]["sel_idx"].masked_fill(~_listed(after[0]), 0))
    diffs = {n: (before[0][n].float() - after[0][n].float()).abs().max().item()
             for n in ("scores", "out_coarse", "lse_coarse", "dq_pool", "dk_pool", "dv_pool")}
    for name, (_, t, err) in results.items():
        say(f"{shape:9s} {name:7s} {t['fwd']:8.3f} {t['pool']:8.3f} {t['coarse']:8.3f} {t['select']:8.3f} "
            f"{t['bwd']:8.3f}  " + " ".join(f"{err[n]:9.2e}" for n in ("out_c", "dq_c", "dk_c", "dv_c")))
    tb, ta = before[1], after[1]
    say(f"{shape:9s} saved   {tb['fwd'] - ta['fwd']:8.3f} {tb['pool'] - ta['pool']:8.3f} "
        f"{tb['coarse'] - ta['coarse']:8.3f} {tb['select'] - ta['select']:8.3f} {tb['bwd'] - ta['bwd']:8.3f}  "
        f"same selection: {same}; max |before - after|: "
        + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))
    return same


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _listed(b):
    cap = b["sel_idx"].shape[-1]
    return torch.arange(cap, device=DEVICE) < b["sel_num"][..., None]


def whole_vs_fine(shape, backends, do_bench):
    import vsa_torch
    B, H, S, D, E, topk = SHAPES[shape]
    dev = torch.device(DEVICE)
    n = S // E
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(grad=True):
        return torch.randn(B, H, S, D, generator=gen, device=dev).to(torch.bfloat16).requires_grad_(grad)

    q, k, v, gate, dout = randn(), randn(), randn(), randn(), randn(False)
    chosen = torch.rand(B, H, n, n, generator=gen, device=dev).topk(topk, dim=-1).indices
    block_map = torch.zeros(B, H, n, n, dtype=torch.bool, device=dev).scatter_(-1, chosen, True)
    counts = torch.full((n,), E, dtype=torch.int32, device=dev)

    def time_rows(forward, inputs):
        out = forward(*inputs)
        torch.autograd.grad(out, inputs, dout)
        synchronize()
        fwd = do_bench(lambda: forward(*inputs))
        both = do_bench(lambda: torch.autograd.grad(forward(*inputs), inputs, dout))
        return fwd, max(both - fwd, 1e-9)

    for backend in backends:
        try:
            f_fwd, f_bwd = time_rows(
                lambda q, k, v: vsa_torch.block_sparse_attn(q, k, v, block_map, counts, E, backend=backend)[0],
                (q, k, v))
            w_fwd, w_bwd = time_rows(
                lambda q, k, v, g: vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk, E,
                                                               compress_attn_weight=g, backend=backend),
                (q, k, v, gate))
            say(f"{shape:9s} {backend:7s} {f_fwd:8.3f} {w_fwd:8.3f} {w_fwd / f_fwd:7.3f}x   "
                f"{f_bwd:8.3f} {w_bwd:8.3f} {w_bwd / f_bwd:7.3f}x")
        except Exception as e:
            first = str(e).splitlines()[0][:150] if str(e) else ""
            say(f"{shape:9s} {backend:7s} skipped: {type(e).__name__}: {first}")
            if not type(e).__name__.startswith("BackendUnavailable"):
                traceback.print_exc()
        finally:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="480p-64,480p-256", help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--precision", choices=["ieee", "tf32", "tf32x3"], default=None,
                        help="coarse dot precision for this run (default: VSA_COARSE_PRECISION or ieee)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--backends", default="triton,cudnn",
                        help="backends of the whole-VSA / fine table (cute: add it; its first call compiles for a while)")
    parser.add_argument("--skip-vsa", action="store_true", help="only the coarse stage table")
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: TRITON_INTERPRET=1 ... --device cpu --shapes tiny --backends triton (plumbing)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("coarse_bench.py needs a CUDA GPU")
    from triton.testing import do_bench as _do_bench

    def do_bench(fn):
        if DEVICE == "cpu":
            import time
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return _do_bench(fn, warmup=20, rep=args.rep_ms, return_mode="median")

    if args.precision:
        configure(coarse_precision=args.precision)
    shapes = args.shapes.split(",")
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    say(f"coarse stage, {device_name}, {args.dtype}, precision {config().coarse_precision}, "
        f"x16 q/k activations; ms, median")
    say(f"  before: 29bb075 configs {BEFORE_CONFIGS[128]} (D=128), 3 pool launches, 64-bit selection keys, 4 warps")
    say(f"  after:  configs {S.COARSE_CONFIGS[128]} (D=128), selection warps {S.select_warps(1024)} per row "
        f"(<= 1024 blocks)")
    say(f"{'shape':9s} {'version':7s} {'fwd':>8s} {'pool':>8s} {'coarse':>8s} {'select':>8s} {'bwd':>8s}  "
        f"{'out_c err':>9s} {'dq_c err':>9s} {'dk_c err':>9s} {'dv_c err':>9s}")
    ok = True
    for shape in shapes:
        ok &= coarse_stage(shape, args, do_bench)
    if not args.skip_vsa:
        say("")
        say("whole VSA (gate, top-k) vs fine stage (block_sparse_attn, same top-k count), bf16, ms, median; "
            "targets fwd <= 1.10x, bwd <= 1.05x")
        say(f"{'shape':9s} {'backend':7s} {'fine fwd':>8s} {'vsa fwd':>8s} {'ratio':>8s}   "
            f"{'fine bwd':>8s} {'vsa bwd':>8s} {'ratio':>8s}")
        for shape in shapes:
            whole_vs_fine(shape, args.backends.split(","), do_bench)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "coarse_bench.log"), "w") as f:
            f.write("\n".join(LINES) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
