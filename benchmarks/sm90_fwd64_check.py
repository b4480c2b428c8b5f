"""Checks and times our sm_90 64-token-block forward (vsa_core/backends/sm90_fwd64.py) on one H200.

    PYTHONPATH=. python3 benchmarks/sm90_fwd64_check.py [--no-timing] [--only=k1v2,ws3L]   # logs, JSON to $OUT
    PYTHONPATH=. python3 benchmarks/sm90_fwd64_check.py --only=ws3L,ws2S,ws3S --quick   # the shared-KV run, ~2 min

--quick leaves out the cases that need compiles of their own (head dim 64, fp16, inference epilogue)
and the timing rows beside the variants and cuDNN (per-call conversion, BSHD, vsa's backends).

Needs the CuTe stack (nvidia-cutlass-dsl 4.8.1; nvidia-cudnn-frontend 1.32 for the cuDNN rows:
../shared/device/pack-cute.sh). Every variant and every row runs in its own try/except, so one
failure does not hide the others.

1. correctness at small shapes against the float64 reference (vsa_core/reference.py) with fresh
   random inputs: partial and empty KV blocks, empty query rows (count 0), nQ != nKV both ways,
   B2 H2, BHSD and BSHD, a long list (ring wrap-around), lists the list rule must clean
   (repeats, out of order, out of range, count past capacity), x16 logits, and the VSA epilogue
   (out = out_fine + gate * out_coarse, fp32 out_fine, padded query rows 0 / lse +inf).
   Outputs are poisoned with NaN first, so a row the kernel does not write fails.
   Bounds: out is bf16 (fp16) and P is rounded to bf16 before PV, each a relative rounding of
   2^-8 (2^-11) per element that averages down over a row: rel-L2 of out < 1e-2. lse is fp32
   throughout (exact fp32 dot products of the same bf16 inputs, ex2.approx, the FFMA's rounding of
   m * c): abs error ~1e-5, bound 1e-3 (5e-3 at x16 logits, whose |s| reach ~100).
2. timing at B1 H12 S39936 D128 top-62 (random lists of exactly 62 ascending blocks per row, all
   blocks full, bf16): our variants, cuDNN frontend BSA called directly, and vsa's triton and cudnn
   backends through vsa_torch.block_sparse_attn_from_indices; triton.testing.do_bench (median).
   TFLOPS = 4 * B * H * D * Sq * topk * 64 / t. Printed as a table, last.
3. shared KV (the `S` variants, shared_kv=True: one K and one V ring per CTA filled in the order of
   the union of its query blocks' lists): the union step (`stages.shared_kv_lists`) against its
   numpy reference, and a second list source for the timing, "smooth": VSA's own selection
   (pooling, coarse attention, top-k: `vsa_core.stages`) over the spatially smooth synthetic field
   of benchmarks/stage_breakdown.py (`inputs(shape, smooth=True)`) at 480p-64 (B1 H12 video
   (24, 52, 32), tile (4, 4, 4), top-62). Per source it prints the union / topk ratio per group
   size (2, 3: the K/V tiles a shared-KV CTA loads per query block, over topk), then TFLOPS of
   the variants and cuDNN; a shared variant's time includes its union step (timed alone too).
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
# the sm90 backend's FORWARD ("ws3LTrf" below), for the variants built on it
FORWARD_FLAGS = dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, tma_store=True,
                     rescale_first=True)
VARIANTS = {  # name: launcher keywords (the first runs every case; L = lazy_rescale, q = q_in_regs)
    "k1v2": dict(k_stages=1, v_stages=2),
    "k1v2L": dict(k_stages=1, v_stages=2, lazy_rescale=True),
    "k2v2qL": dict(k_stages=2, v_stages=2, q_in_regs=True, lazy_rescale=True),
    "ws2ppL": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True, lazy_rescale=True),
    "ws2ppqL": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True, q_in_regs=True,
                    lazy_rescale=True),
    "ws3": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True),
    "ws3L": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True),
    # P = persistent: one CTA per SM, each consumer walking its share of the query blocks
    "ws3LP": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, persistent=True),
    # T = tma_store: out through shared memory and one TMA store per query block
    "ws3LT": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, tma_store=True),
    "ws3LPT": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, persistent=True,
                   tma_store=True),
    # W = list_in_smem: each consumer's list entries and counts from a shared-memory window
    "k1v2LW": dict(k_stages=1, v_stages=2, lazy_rescale=True, list_in_smem=True),
    "ws3LW": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, list_in_smem=True),
    # S = shared_kv: one K and one V ring per CTA, filled in union order (rings sized to the shared memory)
    "ws2S": dict(k_stages=5, v_stages=7, consumers=2, warp_specialized=True, lazy_rescale=True, shared_kv=True),
    "ws3S": dict(k_stages=4, v_stages=7, consumers=3, warp_specialized=True, lazy_rescale=True, shared_kv=True),
    "ws3Sk2v4": dict(k_stages=2, v_stages=4, consumers=3, warp_specialized=True, lazy_rescale=True,
                     shared_kv=True),
    # C = cluster_pairs: 2-CTA clusters, neighbouring query blocks' shared K/V tiles multicast
    "ws3LTC": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, tma_store=True,
                   cluster_pairs=True),
    # rf = rescale_first: the step's O rescale between the row maxima and the exponentials, P converted at
    # the top of the next step (no exponentials computed twice)
    # the load order and the L2 hints on FORWARD (ws3LTrf): q = q_first, v = v_first, k = consumer_k,
    # h = l2_hints
    # cuDNN's shape (one warpgroup, 3 CTAs an SM) with FORWARD's flags that the simple kernel has, and
    # FORWARD persistent
    "k1v2LTrf": dict(k_stages=1, v_stages=2, lazy_rescale=True, tma_store=True, rescale_first=True),
    "k1v2LTrfh": dict(k_stages=1, v_stages=2, lazy_rescale=True, tma_store=True, rescale_first=True, l2_hints=True),
    "ws3LPTrf": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, persistent=True,
                     tma_store=True, rescale_first=True),
    "ws3LTrf-q": dict(FORWARD_FLAGS, q_first=True),
    "ws3LTrf-v": dict(FORWARD_FLAGS, v_first=True),
    "ws3LTrf-k": dict(FORWARD_FLAGS, consumer_k=True),
    "ws3LTrf-h": dict(FORWARD_FLAGS, l2_hints=True),
    "ws3LTrf-qvkh": dict(FORWARD_FLAGS, q_first=True, v_first=True, consumer_k=True, l2_hints=True),
    "ws3LTrf": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, tma_store=True,
                    rescale_first=True),
    "ws3LTCrf": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, tma_store=True,
                     cluster_pairs=True, rescale_first=True),
    # q = q_in_regs with rf at 2 consumers (240 registers: no spills; at 3 consumers ptxas spills and
    # serialises the wgmmas): QK^T reads only K from shared memory
    "ws2ppqLrf": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True, q_in_regs=True,
                      lazy_rescale=True, rescale_first=True),
    "ws2qLTrf": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, q_in_regs=True, lazy_rescale=True,
                     tma_store=True, rescale_first=True),
    "ws2qLTrfk3v3": dict(k_stages=3, v_stages=3, consumers=2, warp_specialized=True, q_in_regs=True,
                         lazy_rescale=True, tma_store=True, rescale_first=True),
    "ws2LTCk2v3": dict(k_stages=2, v_stages=3, consumers=2, warp_specialized=True, lazy_rescale=True,
                       tma_store=True, cluster_pairs=True),
}


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)
    if OUT:  # written as it goes: a run killed by a hang or a fault keeps its log
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "sm90_fwd64_check.log"), "a") as f:
            f.write(msg + "\n")


def fwd64():
    from vsa_core.backends import sm90_fwd64
    return sm90_fwd64.sparse_forward64


# ---- inputs ---------------------------------------------------------------------------------
def make_case(seed, B=2, H=2, nq=4, nkv=4, cap=4, D=128, dtype=torch.bfloat16, layout="bhsd", scale=1.0,
              kv_counts=None, counts=None, lists=None, coarse=False, q_counts=None):
    g = torch.Generator().manual_seed(seed)
    dev = DEV
    Sq, Skv = nq * E, nkv * E

    def tok(S):
        x = (torch.randn(B, H, S, D, generator=g) * math.sqrt(scale)).to(dtype)
        if layout == "bshd":  # stored [B, S, H, D]; the kernel gets the [B, H, S, D] view
            return x.transpose(1, 2).contiguous().to(dev).transpose(1, 2)
        return x.to(dev)

    q, k, v = tok(Sq), tok(Skv), tok(Skv)
    if kv_counts is None:
        kv_counts = torch.randint(0, E + 1, (nkv,), generator=g)
        kv_counts[0] = E
    kv_counts = torch.as_tensor(kv_counts, dtype=torch.int32)
    if lists is None:
        idx = torch.stack([torch.randperm(nkv, generator=g)[:cap].sort().values if cap <= nkv else
                           torch.cat([torch.arange(nkv), torch.full((cap - nkv,), nkv - 1)])
                           for _ in range(B * H * nq)]).reshape(B, H, nq, cap)
        if counts is None:
            counts = torch.randint(0, min(cap, nkv) + 1, (B, H, nq), generator=g)
            counts.view(-1)[0] = 0  # an empty row
            counts.view(-1)[-1] = min(cap, nkv)
    else:
        idx = torch.as_tensor(lists)
    idx = idx.to(torch.int32)
    counts = torch.as_tensor(counts, dtype=torch.int32)
    case = dict(q=q, k=k, v=v, sel_idx=idx.to(dev), sel_num=counts.to(dev), kv_counts=kv_counts.to(dev))
    if coarse:
        if q_counts is None:
            q_counts = torch.randint(1, E + 1, (nq,), generator=g)
        case["q_counts"] = torch.as_tensor(q_counts, dtype=torch.int32).to(dev)
        case["gate"] = tok(Sq)
        case["out_coarse"] = torch.randn(B, H, nq, D, generator=g).to(dev)
    return case


def reference(case, gate=True):
    q, k, v = (case[n].float().cpu().numpy() for n in ("q", "k", "v"))
    nkv = k.shape[2] // E
    bmap = R.index_lists_to_block_map(case["sel_idx"].cpu().numpy(), case["sel_num"].cpu().numpy(), nkv)
    out, lse = R.block_sparse_attn_reference(q, k, v, bmap, case["kv_counts"].cpu().numpy(), E)
    if "out_coarse" not in case:
        return dict(out=out, lse=lse)
    qc = np.clip(case["q_counts"].cpu().numpy(), 0, E)
    valid = (np.arange(q.shape[2]) % E) < np.repeat(qc, E)  # [Sq]
    fine = np.where(valid[None, None, :, None], out, 0.0)
    coarse = np.repeat(case["out_coarse"].double().cpu().numpy(), E, axis=2)
    g = case["gate"].double().cpu().numpy() if gate else 1.0
    mixed = fine + np.where(valid[None, None, :, None], g * coarse, 0.0)
    return dict(out=mixed, lse=np.where(valid[None, None, :], lse, np.inf), out_fine=fine)


def run_ours(case, variant, gate=True, store_fine=True):
    q = case["q"]
    B, H, Sq, D = q.shape
    out = torch.empty_like(q)
    if q.stride(1) != Sq * D:  # BSHD input: BSHD output
        out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    kw = dict(VARIANTS[variant])
    res = dict(out=out, lse=lse)
    if "out_coarse" in case:
        kw.update(q_counts=case["q_counts"], out_coarse=case["out_coarse"], gate=case["gate"] if gate else None)
        if store_fine:
            out_fine = torch.full((B, H, Sq, D), float("nan"), dtype=torch.float32, device=q.device)
            kw["out_fine"] = out_fine
            res["out_fine"] = out_fine
    fwd64()(q, case["k"], case["v"], out, lse, case["sel_idx"], case["sel_num"], case["kv_counts"], **kw)
    torch.cuda.synchronize()
    return res


def compare(got, ref, lse_bound):
    errs = {}
    for name, r in ref.items():
        g = got[name].double().cpu().numpy()
        if name == "lse":
            fin = np.isfinite(r)
            same_inf = np.array_equal(np.isfinite(g), fin) and np.array_equal(g[~fin], r[~fin])
            e = float(np.max(np.abs(g[fin] - r[fin]))) if fin.any() else 0.0
            errs[name] = e if same_inf else float("inf")
            continue
        if not np.isfinite(g).all():
            errs[name] = float("nan")
            continue
        den = np.linalg.norm(r)
        errs[name] = float(np.linalg.norm(g - r) / den) if den > 0 else float(np.abs(g).max())
    ok = all((e < lse_bound if n == "lse" else e < 1e-2) for n, e in errs.items())
    return ok, errs


BAD_LISTS = dict(  # repeats, out of order, out of range, negative; counts up to past the capacity
    lists=[[[[3, 1, 3, 9, -2, 5], [0, 0, 1, 2, 2, 6]], [[5, 4, 3, 2, 1, 0], [-1, 2, 7, 7, 1, 3]]]],
    counts=[[[9, 6], [6, -3]]], B=1, H=2, nq=2, nkv=7, cap=6)

CASES = [
    # (label, make_case keywords, run keywords)
    ("B2H2 nq4 nkv4 partial/empty", dict(), {}),
    ("B2H2 bshd", dict(layout="bshd"), {}),
    ("B1H2 nq3 nkv7 cap5", dict(B=1, nq=3, nkv=7, cap=5), {}),
    ("B2H1 nq5 nkv2 (Sq>Skv)", dict(H=1, nq=5, nkv=2, cap=2), {}),
    ("B1H1 long list nkv40", dict(B=1, H=1, nq=2, nkv=40, cap=40, counts=[[[40, 33]]]), {}),
    ("x16 logits", dict(scale=16.0), {}),
    ("bad lists (list rule)", BAD_LISTS, {}),
    ("all kv blocks empty", dict(kv_counts=[0, 0, 0, 0]), {}),
    ("head dim 64", dict(D=64), {}),
    ("fp16", dict(dtype=torch.float16), {}),
    ("vsa gate + out_fine", dict(coarse=True, q_counts=[64, 17, 1, 40]), {}),
    ("vsa no gate, inference", dict(coarse=True), dict(gate=False, store_fine=False)),
    ("vsa bshd", dict(coarse=True, layout="bshd"), {}),
    ("B1H1 nq1 (one query block)", dict(B=1, H=1, nq=1, nkv=3, cap=3, counts=[[[3]]]), {}),
    # shared KV: unions with long gaps between a block's own tiles (drains), nQ not a multiple of 2 or 3
    ("B1H2 nq7 nkv48 cap12 (gaps)", dict(B=1, nq=7, nkv=48, cap=12), {}),
    ("B1H1 nq5 identical lists", dict(B=1, H=1, nq=5, nkv=9, cap=9, lists=[[[list(range(9))] * 5]],
                                      counts=[[[9, 4, 9, 0, 7]]]), {}),
]
# cases that need their own compile (dtype, head dim, epilogue): the other variants skip them
MAIN_ONLY = ("head dim 64", "fp16", "vsa no gate, inference")


def shared_lists(sel_idx, sel_num, n_kv, group):
    """(union_idx, union_num, own_pos, own_num) of `stages.shared_kv_lists` on the GPU."""
    from vsa_core import stages
    from vsa_core.launch import eager_launcher
    B, H, nq, cap = sel_idx.shape
    ng = -(-nq // group)
    out = [torch.empty((B, H, ng, group * cap), dtype=torch.int32, device=sel_idx.device),
           torch.empty((B, H, ng), dtype=torch.int32, device=sel_idx.device),
           torch.empty((B, H, nq, cap), dtype=torch.int32, device=sel_idx.device),
           torch.empty((B, H, nq), dtype=torch.int32, device=sel_idx.device)]
    stages.shared_kv_lists(eager_launcher, sel_idx.contiguous(), sel_num.contiguous(), n_kv, group, *out)
    return out


def check_shared_lists(sel_idx, sel_num, n_kv, group) -> bool:
    """The union step on the GPU against its numpy reference (counted slots only)."""
    union, union_num, own_pos, own_num = [t.cpu().numpy() for t in shared_lists(sel_idx, sel_num, n_kv, group)]
    ref_union, ref_union_num, ref_pos, ref_num = R.shared_kv_lists_reference(
        sel_idx.cpu().numpy(), sel_num.cpu().numpy(), n_kv, group)
    if not (np.array_equal(union_num, ref_union_num) and np.array_equal(own_num, ref_num)):
        return False
    unions_ok = all(np.array_equal(union[r][:ref_union_num[r]], ref_union[r][:ref_union_num[r]])
                    for r in np.ndindex(*ref_union_num.shape))
    positions_ok = all(np.array_equal(own_pos[r][:ref_num[r]], ref_pos[r][:ref_num[r]])
                       for r in np.ndindex(*ref_num.shape))
    return unions_ok and positions_ok


def check_small(quick: bool = False) -> list:
    results = []
    if any(kw.get("shared_kv") for kw in VARIANTS.values()):
        say("== shared_kv_lists (Triton, GPU) vs its numpy reference")
        for label, mk in (("B2H2 nq5 nkv9 cap4", dict(H=2, nq=5, nkv=9, cap=4)), ("bad lists", BAD_LISTS)):
            for group in (2, 3):
                try:
                    case = make_case(77, **mk)
                    ok = check_shared_lists(case["sel_idx"], case["sel_num"], case["k"].shape[2] // E, group)
                    say(f"  lists {label} group {group}: {'ok' if ok else 'FAIL'}")
                    results.append(dict(case=f"lists {label} group {group}", ok=ok))
                except Exception as e:
                    say(f"  lists {label} group {group}: ERROR {type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc()
                    results.append(dict(case=f"lists {label} group {group}", ok=False, error=str(e)))
    say("== correctness vs float64 reference (rel-L2 of out / out_fine < 1e-2; lse max abs < 1e-3, 5e-3 at x16)")
    for vi, variant in enumerate(VARIANTS):
        for i, (label, mk, rk) in enumerate(CASES):
            if (vi > 0 or quick) and label in MAIN_ONLY:
                continue
            name = f"{variant:7s} {label}"
            try:
                case = make_case(1000 + i, **mk)
                got = run_ours(case, variant, **rk)
                ref = reference(case, gate=rk.get("gate", True))
                if not rk.get("store_fine", True):
                    ref.pop("out_fine", None)
                ok, errs = compare(got, ref, 5e-3 if mk.get("scale", 1.0) > 1 else 1e-3)
                say(f"  {name:42s} " + "  ".join(f"{n} {e:.1e}" for n, e in errs.items()) + f"  {'ok' if ok else 'FAIL'}")
                results.append(dict(case=name, errors=errs, ok=ok))
            except Exception as e:
                say(f"  {name:42s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                traceback.print_exc()
                results.append(dict(case=name, ok=False, error=f"{type(e).__name__}: {e}"))
    return results


# ---- timing -------------------------------------------------------------------------------------
def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def timing_problem(B=1, H=12, S=39936, D=128, topk=62, dev="cuda"):
    """The timed problem (also sm90_fwd64_profile's): bf16 q, k, v [B, H, S, D], random lists of
    exactly `topk` ascending blocks per query block, every block full."""
    dev = torch.device(dev)
    n = S // E
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=gen, device=dev).to(torch.bfloat16) for _ in range(3))
    idx = torch.rand(B, H, n, n, generator=gen, device=dev).topk(topk, dim=-1).indices.sort(dim=-1).values
    idx = idx.to(torch.int32).contiguous()
    num = torch.full((B, H, n), topk, dtype=torch.int32, device=dev)
    counts = torch.full((n,), E, dtype=torch.int32, device=dev)
    return q, k, v, idx, num, counts


def smooth_problem():
    """The 480p-64 problem of benchmarks/stage_breakdown.py on its smooth (video-like) synthetic
    field, with VSA's own lists over it (pooling, coarse attention, top-k: `vsa_core.stages`)."""
    import stage_breakdown
    from vsa_core import stages
    from vsa_core.launch import eager_launcher
    from vsa_core.problem import AttnProblem
    shape = stage_breakdown.SHAPES["480p-64"]
    B, H, video, D, tile, topk = shape
    meta, q, k, v, _gate = stage_breakdown.inputs(shape, smooth=True, seed=1)
    S = q.shape[2]
    counts = torch.as_tensor(meta.variable_block_sizes, device="cuda").to(torch.int32)
    p = AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=int(np.prod(tile)),
                    dtype="bfloat16", topk=topk)
    dtypes = {"input": q.dtype, "float32": torch.float32, "int32": torch.int32, "int8": torch.int8}
    b = {name: torch.empty(shp, dtype=dtypes[dt], device="cuda") for name, (shp, dt) in p.forward_buffers().items()}
    stages.block_mean_pool_qkv(eager_launcher, p, q, k, v, counts, counts, b["q_pool"], b["k_pool"], b["v_pool"])
    stages.coarse_forward(eager_launcher, p, b["q_pool"], b["k_pool"], b["v_pool"], counts, b["scores"],
                          b["out_coarse"], b["lse_coarse"])
    stages.topk_select(eager_launcher, p, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"])
    torch.cuda.synchronize()
    return q, k, v, b["sel_idx"].contiguous(), b["sel_num"].contiguous(), counts


def time_source(source: str, quick: bool = False, B=1, H=12, S=39936, D=128, topk=62) -> list:
    """Times the variants on one list source: "random" (`timing_problem`) or "smooth" (`smooth_problem`)."""
    dev = torch.device("cuda")
    if source == "random":
        q, k, v, idx, num, counts = timing_problem(B, H, S, D, topk)
    else:
        q, k, v, idx, num, counts = smooth_problem()
    B, H, S, D = q.shape
    n = S // E
    topk = idx.shape[-1]
    flops = 4.0 * D * E * E * float(num.sum())
    say(f"\n== timing [{source} lists]: B{B} H{H} S{S} D{D} E{E} top-{topk}/{n}, bf16 (median ms; TFLOPS on sparse FLOPs)")
    for group in (2, 3):
        union_num = shared_lists(idx, num, n, group)[1]
        say(f"  union of {group} neighbours / topk: {float(union_num.float().mean()) / topk:.3f}   "
            f"(K/V tiles loaded per query block: {float(union_num.sum()) / float(num.sum()):.3f} of one per entry)")
    rows, outs = [], {}

    def row(name, fn, get_out=None, row_flops=flops):
        name = f"[{source}] {name}"
        try:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            ms = bench(fn)
            entry = dict(name=name, ms=ms, tflops=row_flops / ms / 1e9, first_call_s=first)
            if get_out is not None:
                outs[name] = get_out().float()
            rows.append(entry)
            say(f"  {name:42s} {ms:8.3f} ms {row_flops / ms / 1e9:6.0f} TFLOPS  (first call {first:.1f} s)")
        except Exception as e:
            rows.append(dict(name=name, error=f"{type(e).__name__}: {e}"))
            say(f"  {name:42s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            traceback.print_exc()
        finally:
            torch.cuda.empty_cache()

    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    held = {}

    def prepared(variant):
        """The launch prepared once (compiled on the first call): the kernel without the per-call
        conversion of the tensors (a shared variant's union step included)."""
        def call():
            if variant not in held:
                from vsa_core.backends.sm90_fwd64 import prepare_forward64
                held[variant] = prepare_forward64(q, k, v, out, lse, idx, num, counts, **VARIANTS[variant])
            held[variant]()
        return call

    for variant, kw in VARIANTS.items():
        row(f"ours sm90_fwd64 {variant}", prepared(variant), lambda: out.clone())
        if (kw.get("shared_kv") or kw.get("cluster_pairs")) and variant in held:
            row(f"  {variant} lists step alone", held[variant].lists_only, row_flops=0.0)
    first = next(iter(VARIANTS))
    if source == "random" and not quick:
        row(f"ours sm90_fwd64 {first} per call",
            lambda: fwd64()(q, k, v, out, lse, idx, num, counts, **VARIANTS[first]))
        qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))  # BSHD storage
        out_t = torch.empty_like(qt)
        row(f"ours sm90_fwd64 {first} bshd",
            lambda: fwd64()(qt, kt, vt, out_t, lse, idx, num, counts, **VARIANTS[first]))
        del qt, kt, vt, out_t
    try:
        from cudnn import BSA
        res = {}

        def cudnn_fixed():
            res["o"] = BSA.block_sparse_attention_forward(q, k, v, idx, topk, sparse_block_size=E)["o_tensor"]

        def cudnn_var():
            res["o"] = BSA.block_sparse_attention_forward(q, k, v, idx, None, counts, num, sparse_block_size=E,
                                                          allow_empty_block_nums=True)["o_tensor"]

        row("cuDNN BSA direct (fixed count)", cudnn_fixed, lambda: res["o"])
        if source == "random" and not quick:
            row("cuDNN BSA direct (counts, sizes)", cudnn_var)
    except Exception as e:
        say(f"  cuDNN BSA direct: skipped ({type(e).__name__}: {e})")
    try:
        import vsa_torch
        for backend in ("triton", "cudnn") if source == "random" and not quick else ("triton",):
            hold = {}

            def vsa_call(backend=backend, hold=hold):
                with torch.no_grad():
                    hold["o"] = vsa_torch.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E,
                                                                         backend=backend)[0]

            row(f"vsa {backend} from_indices", vsa_call, lambda hold=hold: hold["o"])
    except Exception as e:
        say(f"  vsa backends: skipped ({type(e).__name__}: {e})")
    ref_name = next((f"[{source}] {n}" for n in ("vsa triton from_indices", "cuDNN BSA direct (fixed count)")
                     if f"[{source}] {n}" in outs), None)
    if ref_name:
        for name, o in outs.items():
            if name != ref_name:
                err = float((o - outs[ref_name]).norm() / outs[ref_name].norm())
                say(f"  rel-L2 {name} vs {ref_name}: {err:.1e}  {'ok' if err < 1e-2 else 'FAIL'}")
                rows.append(dict(name=f"rel-L2 {name}", error_vs_ref=err, ok=err < 1e-2))
    return rows


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
    result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=torch.cuda.get_device_name())
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("--only=")), None)
    if only:  # e.g. --only=k1v2,ws3L
        for name in list(VARIANTS):
            if name not in only.split(","):
                del VARIANTS[name]
    quick = "--quick" in argv
    result["correctness"] = check_small(quick)
    ok = all(r.get("ok") for r in result["correctness"])
    if "--no-timing" not in argv:
        result["timing"] = []
        for source in ("random", "smooth"):
            try:
                result["timing"] += time_source(source, quick)
            except Exception as e:  # a source that cannot be built: say why, keep the other
                say(f"  timing [{source}]: ERROR {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
        ok = ok and all(r.get("ok", True) for r in result["timing"])
        say("\n| row | ms | TFLOPS |\n| --- | --- | --- |")
        for r in result["timing"]:
            if "ms" in r:
                say(f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} |")
            elif "error" in r:
                say(f"| {r['name']} | error | - |")
    say(f"\ncorrectness: {'all ok' if ok else 'FAILURES'}")
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "sm90_fwd64_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
