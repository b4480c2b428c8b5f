"""Checks and times our sm_90 64-token-block backward (vsa_core/backends/sm90_bwd64.py) on one H200.

    PYTHONPATH=. python3 benchmarks/sm90_bwd64_check.py [--no-timing] [--variants=s2,red,redov]   # logs, JSON to $OUT

Needs the CuTe stack (nvidia-cutlass-dsl 4.8.1; nvidia-cudnn-frontend 1.32 for the cuDNN row:
../shared/device/pack-cute.sh), like sm90_fwd64_check.py. Every case and every row runs in its own
try/except, so one failure does not hide the others.

1. The float64 reference used here (a gathered block-sparse backward in torch float64 on the GPU,
   `reference`) is first checked against vsa_core.reference (dense, numpy) on a small case.
2. Correctness at small shapes with fresh random inputs (randn, never zeros): full lists, partial
   and empty KV blocks, empty query rows and KV blocks nobody selected, Sq != Skv both ways, B2 H2,
   BHSD and BSHD, a long KV-owned list (ring wrap-around), padded query rows (lse +inf, q and dout
   zeroed there, as a VSA forward under padding="ignore" and `valid_rows_copy` leave them),
   inverse lists the list rule must clean, x16 logits, softmax_scale, head dim 64, fp16. lse and
   out come from the float64 forward; delta from the Triton preprocess. dq, dk, dv are poisoned
   with NaN first, so an element the kernels do not write fails. Compared with the float64
   reference (rel-L2) and with the Triton backward (rel-L2 between the two).
   Bound: rel-L2 < 1e-2 per gradient (3e-2 at x16 logits). P and dS are rounded to bf16 (fp16) before
   their GEMMs, as in the Triton kernels and FlashAttention, a relative 2^-9 (2^-12) per element that
   averages down over the 64-row sums (measured ~3e-3 with bf16); the outputs are rounded once
   more; everything else is fp32. At x16 logits the softmax is near one-hot and dP - delta
   cancels, so dS's relative rounding error grows (the forward's note: ~7e-3 with an fp32 out).
3. The real shape, B1 H12 S39936 D128 top-62 (random lists of exactly 62 ascending blocks per row,
   all blocks full, bf16): ours, the Triton backward and cuDNN BSA's backward against the float64
   reference (all 12 heads), then timed (triton.testing.do_bench, median). TFLOPS on sparse FLOPs
   2.5 * 4 * B * H * D * Sq * topk * 64 / t. Printed as a table, last, with the variants' predictions.

Every variant of VARIANTS (constructor options of the one kernel class; `s2` is the default
configuration) runs every small case and the real shape; dk and dv must stay bitwise equal to the
Triton backward's at the real shape (the variants change only the dQ path and the GEMM order).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from vsa_core import reference as R  # noqa: E402

OUT = os.environ.get("OUT")
LINES = []
E = 64
DEV = "cuda"
GRADS = ("dq", "dk", "dv")
# name: (prepare_backward64 options, prediction). Predictions are reasoning from the compiler's output
# (benchmarks/sm90_bwd64_compile.py, SASS), not measurements.
VARIANTS = {
    "s2": (dict(stages=2, dq_red=False, dk_overlap=False), "dQ staged in the Q/dO slot (32 KiB st.shared), one bulk reduction per pair"),
    "red": (dict(stages=2, dq_red=True, dk_overlap=False),
            "dQ by 16 red.global.add.v4.f32 per thread from the registers: -64 KiB smem traffic per pair "
            "(224 -> 160 KiB, the smem floor 1792 -> 1280 clk/pair), 3 -> 2 barriers; ~+5-12% if smem/barriers bind, "
            "a loss if L2 vector reductions are slower than bulk ones"),
    "redov": (dict(stages=2, dq_red=True, dk_overlap=True),
              "the default: red + dQ issued before dK, dK left in flight under the next S/dP (no wait_group(0) per step): "
              "the reds overlap dK and the tensor pipe goes dK_j -> S_j+1 without a gap; ~+3-8% over red"),
    "redovL": (dict(stages=2, dq_red=True, dk_overlap=True, list_in_smem=True),
               "redov with the list's first 256 entries in shared memory (list_in_smem): ncu's top stall in redov "
               "is the refill's TMA waiting on the global load of its list entry"),
    "split3": (dict(stages=3, split=True),
               "sm90_bwd64_split: a producer warpgroup and two cooperating warpgroups (S^T, P^T, dV | dP^T, dS, dQ, dK) "
               "a pair apart, 1 CTA/SM: each one's elementwise work under the other's wgmmas; cuDNN's split "
               "(5005 us main kernel against our 5318)"),
    "split2": (dict(stages=2, split=True), "split3 with a 2-slot Q/dO ring"),
    "split3L": (dict(stages=3, split=True, list_in_smem=True), "split3 with the list window in shared memory"),
    "split3LB": (dict(stages=3, split=True, list_in_smem=True, dq_bulk=True),
                 "split3L with dQ staged in shared memory and sent by the producer's warp 1 (one bulk reduction)"),
    "split3B": (dict(stages=3, split=True, dq_bulk=True),
                "split3 with dq_bulk and without the list window (split3L lost to split3: the window costs the split)"),
    "split2B": (dict(stages=2, split=True, dq_bulk=True), "split3B with a 2-slot Q/dO ring"),
    "split3BG": (dict(stages=3, split=True, dq_bulk=True, q_group_bytes=32 << 20),
                 "split3B with query groups of a 32 MiB working set (sm90_backend.BACKWARD)"),
}
ACTIVE = ["redov", "s2", "red"]  # the default first (its row + preprocess is timed too)


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)
    if OUT:  # written as it goes: a run killed by a hang or a fault keeps its log
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "sm90_bwd64_check.log"), "a") as f:
            f.write(msg + "\n")


def bwd64():
    from vsa_core.backends import sm90_bwd64_launch
    return sm90_bwd64_launch


# ---- the float64 reference -----------------------------------------------------------------------
def reference(q, k, v, dout, mask, kv_counts, scale, q_valid=None):
    """Block-sparse attention forward and backward in float64 on the GPU, per (batch, head) with the
    selected KV blocks of each query block gathered. mask [B, H, nQ, nKV] bool; kv_counts [nKV] (valid
    keys at each block's start); q_valid [Sq] bool: rows outside it see nothing (P = 0, lse +inf).
    Returns float64 out, lse, dq, dk, dv ([B, H, S, D]; lse [B, H, Sq])."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    nq, nkv = Sq // E, Skv // E
    f = lambda x: x.to(DEV, torch.float64)  # noqa: E731
    q64, k64, v64, do64 = f(q), f(k), f(v), f(dout)
    mask = mask.to(DEV)
    kvc = torch.as_tensor(kv_counts, device=DEV).clamp(0, E)
    res = {n: torch.zeros(B, H, s, D, dtype=torch.float64, device=DEV)
           for n, s in (("out", Sq), ("dq", Sq), ("dk", Skv), ("dv", Skv))}
    res["lse"] = torch.empty(B, H, Sq, dtype=torch.float64, device=DEV)
    ar = torch.arange(E, device=DEV)
    for b in range(B):
        for h in range(H):
            m = mask[b, h]
            cnt = m.sum(1)
            L = max(int(cnt.max()), 1)
            order = torch.sort((~m).to(torch.int8), dim=1, stable=True).indices[:, :L]  # selected blocks first
            listed = torch.arange(L, device=DEV)[None, :] < cnt[:, None]
            key_ok = (listed[:, :, None] & (ar[None, None, :] < kvc[order][:, :, None])).reshape(nq, 1, L * E)
            Kb = k64[b, h].view(nkv, E, D)[order].reshape(nq, L * E, D)
            Vb = v64[b, h].view(nkv, E, D)[order].reshape(nq, L * E, D)
            Qb, dOb = q64[b, h].view(nq, E, D), do64[b, h].view(nq, E, D)
            s = (Qb @ Kb.transpose(1, 2) * scale).masked_fill(~key_ok, -math.inf)
            lse = torch.logsumexp(s, -1)
            p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
            if q_valid is not None:
                ok = q_valid.to(DEV).view(nq, E)
                p = p * ok[..., None]
                lse = torch.where(ok, lse, math.inf)
            o = p @ Vb
            delta = (dOb * o).sum(-1, keepdim=True)
            ds = p * (dOb @ Vb.transpose(1, 2) - delta)
            res["out"][b, h] = o.reshape(Sq, D)
            res["lse"][b, h] = lse.reshape(Sq)
            res["dq"][b, h] = (ds @ Kb * scale).reshape(Sq, D)
            # unlisted slots of `order` carry P = dS = 0: their adds are exact zeros
            res["dk"][b, h].view(nkv, E, D).index_add_(
                0, order.reshape(-1), (ds.transpose(1, 2) @ Qb * scale).view(nq * L, E, D))
            res["dv"][b, h].view(nkv, E, D).index_add_(0, order.reshape(-1), (p.transpose(1, 2) @ dOb).view(nq * L, E, D))
    return res


def check_reference() -> bool:
    """The gathered reference against vsa_core.reference's dense one (numpy float64)."""
    g = torch.Generator().manual_seed(7)
    B, H, nq, nkv, D = 1, 2, 3, 4, 64
    q, k, v, do = (torch.randn(B, H, n * E, D, generator=g, dtype=torch.float64) for n in (nq, nkv, nkv, nq))
    mask = torch.rand(B, H, nq, nkv, generator=g) < 0.5
    mask[0, 0, 0] = False
    kvc = np.array([64, 17, 0, 40])
    scale = 0.7 / math.sqrt(D)
    ours = reference(q, k, v, do, mask, kvc, scale)
    _, lse, grads = R.block_sparse_attn_reference(q.numpy(), k.numpy(), v.numpy(), mask.numpy(), kvc, E,
                                                  dout=do.numpy(), softmax_scale=scale)
    err = max(float(np.abs(ours[n].cpu().numpy() - grads[n]).max()) for n in GRADS)
    fin = np.isfinite(lse)
    same_inf = np.array_equal(np.isfinite(ours["lse"].cpu().numpy()), fin)
    err = max(err, float(np.abs(ours["lse"].cpu().numpy()[fin] - lse[fin]).max()))
    ok = err < 1e-9 and same_inf
    say(f"  gathered float64 reference vs vsa_core.reference: max abs {err:.1e}  {'ok' if ok else 'FAIL'}")
    return ok


# ---- inputs ---------------------------------------------------------------------------------------
def lists_from_mask(mask):
    """Query-owned (sel) and KV-owned (inv) ascending lists of a [B, H, nQ, nKV] bool mask."""
    def lists(m):
        idx = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32).contiguous()
        return idx, m.sum(-1, dtype=torch.int32).contiguous()
    sel_idx, sel_num = lists(mask)
    inv_idx, inv_num = lists(mask.transpose(2, 3))
    return sel_idx, sel_num, inv_idx, inv_num


def make_case(seed, B=2, H=2, nq=4, nkv=4, cap=4, D=128, dtype=torch.bfloat16, layout="bhsd", scale=1.0,
              kv_counts=None, density=None, q_counts=None, bad_inv=False, softmax_scale=None):
    g = torch.Generator().manual_seed(seed)
    Sq, Skv = nq * E, nkv * E

    def tok(S):
        x = (torch.randn(B, H, S, D, generator=g) * math.sqrt(scale)).to(dtype)
        if layout == "bshd":  # stored [B, S, H, D]; the kernel gets the [B, H, S, D] view
            return x.transpose(1, 2).contiguous().to(DEV).transpose(1, 2)
        return x.to(DEV)

    q, k, v, do = tok(Sq), tok(Skv), tok(Skv), tok(Sq)
    if kv_counts is None:
        kv_counts = torch.randint(0, E + 1, (nkv,), generator=g)
        kv_counts[0] = E
    kv_counts = torch.as_tensor(kv_counts, dtype=torch.int32)
    if density is None:  # up to `cap` random blocks per query block, one empty row
        mask = torch.zeros(B, H, nq, nkv, dtype=torch.bool)
        for r in range(B * H * nq):
            c = int(torch.randint(0, min(cap, nkv) + 1, (1,), generator=g))
            mask.view(-1, nkv)[r, torch.randperm(nkv, generator=g)[:c]] = True
        mask.view(-1, nkv)[0] = False
        mask.view(-1, nkv)[-1, :min(cap, nkv)] = True
    else:
        mask = torch.rand(B, H, nq, nkv, generator=g) < density
    q_valid = None
    if q_counts is not None:  # padded query rows: zeroed inputs, lse +inf (VSA, padding="ignore")
        q_counts = torch.as_tensor(q_counts)
        q_valid = (torch.arange(Sq) % E) < torch.repeat_interleave(q_counts, E)
        keep = q_valid.to(DEV)[None, None, :, None]
        q = torch.where(keep, q, torch.zeros((), dtype=dtype, device=DEV))
        do = torch.where(keep, do, torch.zeros((), dtype=dtype, device=DEV))
        if layout == "bshd":
            q, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, do))
    sm_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    ref = reference(q, k, v, do, mask, kv_counts, sm_scale, q_valid)
    sel_idx, sel_num, inv_idx, inv_num = lists_from_mask(mask)
    case = dict(q=q, k=k, v=v, dout=do, mask=mask, kv_counts=kv_counts.to(DEV), sel_idx=sel_idx.to(DEV),
                sel_num=sel_num.to(DEV), inv_idx=inv_idx.to(DEV), inv_num=inv_num.to(DEV), ref=ref, layout=layout,
                softmax_scale=sm_scale, dtype=dtype,
                lse=ref["lse"].float().contiguous(), out=ref["out"].float().contiguous())
    if layout == "bshd":  # the forward writes out in the call's layout
        case["out"] = ref["out"].float().transpose(1, 2).contiguous().transpose(1, 2)
    if bad_inv:  # what the list rule must clean: a repeat, entries out of range, counts past the capacity
        idx, num = case["inv_idx"].cpu(), case["inv_num"].cpu()
        width = idx.shape[-1] + 4
        bad = torch.full(idx.shape[:-1] + (width,), -1, dtype=torch.int32)
        bad_num = torch.empty_like(num)
        for r in range(num.numel()):
            c = int(num.view(-1)[r])
            entries = idx.view(-1, idx.shape[-1])[r, :c].tolist()
            entries = entries[:1] + entries + [nq + 3, -2, 10 ** 6]  # the first one twice, then junk
            bad.view(-1, width)[r, :len(entries)] = torch.tensor(entries, dtype=torch.int32)
            bad_num.view(-1)[r] = len(entries) + (100 if r % 2 else 0)  # odd rows: past the capacity
        case["inv_idx_kernel"] = bad.to(DEV).contiguous()
        case["inv_num_kernel"] = bad_num.to(DEV).contiguous()
    return case


def raw(x, layout):
    """The tensor in its storage layout, as the Triton launchers address it."""
    return x.transpose(1, 2) if layout == "bshd" else x


def alloc_grads(case):
    q, k = case["q"], case["k"]
    if case["layout"] == "bshd":
        new = lambda x: torch.full((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), math.nan, dtype=x.dtype,  # noqa: E731
                                   device=DEV).transpose(1, 2)
    else:
        new = lambda x: torch.full_like(x, math.nan)  # noqa: E731
    return dict(dq=new(q), dk=new(k), dv=new(k))


def run_ours(case, variant="s2"):
    g = alloc_grads(case)
    delta = bwd64().backward_delta(case["out"], case["dout"])
    bwd64().sparse_backward64(case["q"], case["k"], case["v"], case["out"], case["dout"], case["lse"],
                              g["dq"], g["dk"], g["dv"], case.get("inv_idx_kernel", case["inv_idx"]),
                              case.get("inv_num_kernel", case["inv_num"]), case["kv_counts"], delta=delta,
                              softmax_scale=case["softmax_scale"], **VARIANTS[variant][0])
    torch.cuda.synchronize()
    return g


def problem(case):
    from vsa_core.problem import AttnProblem
    q, k = case["q"], case["k"]
    B, H, Sq, D = q.shape
    return AttnProblem(batch=B, heads=H, q_len=Sq, kv_len=k.shape[2], head_dim=D, block_elems=E,
                       dtype=str(q.dtype).replace("torch.", ""), layout=case["layout"], selection="indices",
                       softmax_scale=case["softmax_scale"])


def run_triton(case):
    from vsa_core.backends import triton_backend as T
    from vsa_core.launch import eager_launcher
    p, L = problem(case), case["layout"]
    g = alloc_grads(case)
    delta = bwd64().backward_delta(case["out"], case["dout"])
    q, k, v, do = (raw(case[n], L) for n in ("q", "k", "v", "dout"))
    T.sparse_backward_dq(eager_launcher, p, q, k, v, case["lse"], do, delta, raw(g["dq"], L), case["sel_idx"],
                         case["sel_num"], case["kv_counts"])
    T.sparse_backward_dkdv(eager_launcher, p, q, k, v, case["lse"], do, delta, raw(g["dk"], L), raw(g["dv"], L),
                           case["inv_idx"], case["inv_num"], case["kv_counts"])
    torch.cuda.synchronize()
    return g


def rel(got, ref):
    g = got.double()
    if not torch.isfinite(g).all():
        return float("nan")
    den = float(ref.norm())
    return float((g - ref).norm() / den) if den > 0 else float(g.abs().max())


CASES = [
    # (label, make_case keywords)
    ("B2H2 nq4 nkv4 partial/empty", dict()),
    ("B2H2 full lists, full blocks", dict(kv_counts=[64] * 4, density=1.0)),
    ("B2H2 bshd", dict(layout="bshd")),
    ("B1H2 nq3 nkv7 cap5 (Sq<Skv)", dict(B=1, nq=3, nkv=7, cap=5)),
    ("B2H1 nq5 nkv2 (Sq>Skv)", dict(H=1, nq=5, nkv=2, cap=2)),
    ("B1H1 long inv list nq40 nkv2", dict(B=1, H=1, nq=40, nkv=2, cap=2, density=0.9)),
    ("padded query rows (q_counts)", dict(q_counts=[64, 17, 1, 40])),
    ("padded query rows bshd", dict(q_counts=[5, 64, 33, 0], layout="bshd")),
    ("x16 logits", dict(scale=16.0)),
    ("softmax_scale 0.3", dict(softmax_scale=0.3)),
    ("bad inverse lists (list rule)", dict(B=1, H=2, nq=5, nkv=4, cap=4, bad_inv=True)),
    ("all kv blocks empty", dict(kv_counts=[0, 0, 0, 0])),
    ("B1H1 nq1 (one query block)", dict(B=1, H=1, nq=1, nkv=3, cap=3)),
    ("head dim 64", dict(D=64)),
    ("fp16", dict(dtype=torch.float16)),
]


def check_small() -> list:
    results = []
    say("== correctness vs float64 (rel-L2 < 1e-2, 3e-2 at x16), and rel-L2 to the Triton backward")
    for variant in ACTIVE:
        for i, (label, mk) in enumerate(CASES):
            name = f"{variant} {label}"
            try:
                case = make_case(1000 + i, **mk)
                got = run_ours(case, variant)
                bound = 3e-2 if mk.get("scale", 1.0) > 1 else 1e-2
                errs = {n: rel(got[n], case["ref"][n]) for n in GRADS}
                ok = all(e < bound for e in errs.values())
                line = "  ".join(f"{n} {e:.1e}" for n, e in errs.items())
                tri = {}
                if not mk.get("bad_inv"):
                    t = run_triton(case)
                    tri = {n: rel(t[n], case["ref"][n]) for n in GRADS}
                    vs = {n: rel(got[n], t[n].double()) for n in GRADS}
                    line += "  | triton " + " ".join(f"{tri[n]:.1e}" for n in GRADS)
                    line += "  | ours-triton " + " ".join(f"{vs[n]:.1e}" for n in GRADS)
                say(f"  {name:38s} {line}  {'ok' if ok else 'FAIL'}")
                results.append(dict(case=name, errors=errs, triton_errors=tri, ok=ok))
            except Exception as e:
                say(f"  {name:38s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                traceback.print_exc()
                results.append(dict(case=name, ok=False, error=f"{type(e).__name__}: {e}"))
    return results


# ---- the real shape: accuracy and timing ---------------------------------------------------------
def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def real_shape(B=1, H=12, S=39936, D=128, topk=62, timing=True) -> dict:
    from vsa_core import stages
    from vsa_core.launch import eager_launcher
    from vsa_core.backends import triton_backend as T
    dev = torch.device(DEV)
    n = S // E
    flops = 2.5 * 4.0 * B * H * D * S * topk * E
    say(f"\n== B{B} H{H} S{S} D{D} E{E} top-{topk}/{n}, bf16")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, generator=gen, device=dev).to(torch.bfloat16) for _ in range(4))
    idx = torch.rand(B, H, n, n, generator=gen, device=dev).topk(topk, dim=-1).indices
    mask = torch.zeros(B, H, n, n, dtype=torch.bool, device=dev).scatter_(-1, idx, True)
    counts = torch.full((n,), E, dtype=torch.int32, device=dev)
    scale = 1.0 / math.sqrt(D)
    t0 = time.perf_counter()
    ref = reference(q, k, v, do, mask, counts, scale)
    say(f"  float64 reference: {time.perf_counter() - t0:.1f} s")
    sel_idx, sel_num, inv_idx, inv_num = lists_from_mask(mask)
    sel_idx = sel_idx[..., :topk].contiguous()
    lse = ref["lse"].float().contiguous()
    out32 = ref["out"].float().contiguous()
    out16 = out32.to(torch.bfloat16)
    del ref["out"], ref["lse"]
    delta = bwd64().backward_delta(out32, do)
    grads = {name: dict(dq=torch.full_like(q, math.nan), dk=torch.full_like(k, math.nan),
                        dv=torch.full_like(k, math.nan)) for name in ["triton", "cudnn"] + ACTIVE}
    case = dict(q=q, k=k, layout="bhsd", softmax_scale=scale)
    p = problem(case)
    calls = {}

    def ours_prepared(variant):
        held = {}

        def call():
            if "launch" not in held:
                g = grads[variant]
                held["launch"] = bwd64().prepare_backward64(q, k, v, do, lse, delta, g["dq"], g["dk"], g["dv"],
                                                            inv_idx, inv_num, counts, softmax_scale=scale,
                                                            **VARIANTS[variant][0])
            held["launch"]()
        return call

    for variant in ACTIVE:
        calls[f"ours sm90_bwd64 {variant}"] = ours_prepared(variant)
    first = f"ours sm90_bwd64 {ACTIVE[0]}"
    calls[first + " + preprocess"] = lambda: (bwd64().backward_delta(out32, do, delta), calls[first]())

    def triton_bwd():
        g = grads["triton"]
        T.sparse_backward_dq(eager_launcher, p, q, k, v, lse, do, delta, g["dq"], sel_idx, sel_num, counts)
        T.sparse_backward_dkdv(eager_launcher, p, q, k, v, lse, do, delta, g["dk"], g["dv"], inv_idx, inv_num, counts)

    calls["triton fine backward (dq + dkdv)"] = triton_bwd
    calls["triton preprocess (delta)"] = lambda: stages.backward_preprocess(eager_launcher, p, out32, do, delta)
    try:
        from cudnn.block_sparse_attention import api as cudnn_api

        def cudnn_bwd():
            g = grads["cudnn"]
            cudnn_api.block_sparse_attention_backward(do, q, k, v, out16, lse, sel_idx, None, counts, sel_num,
                                                      softmax_scale=scale, dq_tensor=g["dq"], dk_tensor=g["dk"],
                                                      dv_tensor=g["dv"], sparse_block_size=E, layout="bhsd")
        calls["cuDNN BSA backward direct"] = cudnn_bwd
    except Exception as e:
        say(f"  cuDNN BSA: skipped ({type(e).__name__}: {e})")

    result = dict(accuracy={}, timing=[])
    say("  rel-L2 to float64 (all heads):")
    for name, fn in calls.items():
        if "preprocess" in name:
            continue
        try:
            fn()
            torch.cuda.synchronize()
            key = name.split()[2] if name.startswith("ours") else name.split()[0].lower()
            errs = {g: rel(grads[key][g], ref[g]) for g in GRADS}
            result["accuracy"][name] = errs
            say(f"    {name:36s} " + "  ".join(f"{g} {e:.1e}" for g, e in errs.items()))
        except Exception as e:
            result["accuracy"][name] = dict(error=f"{type(e).__name__}: {e}")
            say(f"    {name:36s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            traceback.print_exc()
    result["bitwise_dkdv"] = {}
    for variant in ACTIVE:
        try:
            vs = {g: rel(grads[variant][g], grads["triton"][g].double()) for g in GRADS}
            same = all(torch.equal(grads[variant][g], grads["triton"][g]) for g in ("dk", "dv"))
            result["bitwise_dkdv"][variant] = same
            say(f"    ours {variant:6s} vs triton                " + "  ".join(f"{g} {e:.1e}" for g, e in vs.items())
                + f"  dk, dv bitwise equal: {'yes' if same else 'NO'}")
        except Exception as e:
            say(f"    ours {variant} vs triton: ERROR {type(e).__name__}: {e}")
    del ref
    torch.cuda.empty_cache()
    if not timing:
        return result
    say(f"  timing (median ms; TFLOPS on sparse FLOPs, backward 2.5x)")
    for name, fn in calls.items():
        try:
            ms = bench(fn)
            result["timing"].append(dict(name=name, ms=ms, tflops=flops / ms / 1e9))
            say(f"    {name:36s} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOPS")
        except Exception as e:
            result["timing"].append(dict(name=name, error=f"{type(e).__name__}: {e}"))
            say(f"    {name:36s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            traceback.print_exc()
    return result


def main(argv) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    cap = torch.cuda.get_device_capability()
    say(f"device {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}")
    try:
        import cutlass
        say(f"nvidia-cutlass-dsl {getattr(cutlass, '__version__', '?')}")
    except Exception as e:
        say(f"cutlass does not import: {type(e).__name__}: {e}")
    chosen = next((a.split("=", 1)[1] for a in argv if a.startswith("--variants=")), None)
    if chosen:
        ACTIVE[:] = [v for v in chosen.split(",") if v]
        unknown = [v for v in ACTIVE if v not in VARIANTS]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=torch.cuda.get_device_name())
    t0 = time.perf_counter()
    ok = True
    try:
        ok = check_reference()
    except Exception as e:
        say(f"  reference check ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
        ok = False
    result["correctness"] = check_small()
    ok = ok and all(r.get("ok") for r in result["correctness"])
    try:
        result["real_shape"] = real_shape(timing="--no-timing" not in argv)
        real_ok = True
        for variant in ACTIVE:
            acc = result["real_shape"]["accuracy"].get(f"ours sm90_bwd64 {variant}", {})
            real_ok = real_ok and all(isinstance(acc.get(g), float) and acc[g] < 1e-2 for g in GRADS)
        real_ok = real_ok and all(result["real_shape"].get("bitwise_dkdv", {}).get(v, False) for v in ACTIVE)
        say(f"  real shape accuracy: {'ok' if real_ok else 'FAIL'} (rel-L2 < 1e-2, dk dv bitwise = triton)")
        ok = ok and real_ok
    except Exception as e:
        say(f"  real shape ERROR {type(e).__name__}: {e}")
        traceback.print_exc()
        ok = False
    timing = result.get("real_shape", {}).get("timing", [])
    if timing:
        cudnn_ms = next((r["ms"] for r in timing if r["name"].startswith("cuDNN") and "ms" in r), None)
        say("\n| row | ms | TFLOPS | / cuDNN (target >= 1.25) |\n| --- | --- | --- | --- |")
        for r in timing:
            ratio = f"{cudnn_ms / r['ms']:.3f}" if cudnn_ms and "ms" in r else "-"
            say(f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | {ratio} |" if "ms" in r
                else f"| {r['name']} | error | - | - |")
        say("\n| variant | prediction (from the compile reports, not measured) |\n| --- | --- |")
        for v in ACTIVE:
            say(f"| {v} | {VARIANTS[v][1]} |")
    say(f"\ncorrectness: {'all ok' if ok else 'FAILURES'}  ({time.perf_counter() - t0:.0f} s)")
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "sm90_bwd64_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
