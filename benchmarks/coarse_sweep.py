"""The coarse stage's launch configs, checked and timed on the GPU (one run).

    PYTHONPATH=. python3 benchmarks/coarse_sweep.py [--shapes 480p-64,720p-256]

For each shape: pooled q, k, v (bf16, std 2) and an fp32 dO_c; every candidate config of
the coarse backward's two kernels (P / dS tiles, then the gradient contractions), of the
coarse forward and of the block-mean pooling, each timed alone (do_bench median) with the
others at their defaults; every candidate's coarse gradients are checked against float64
autograd (relative L2 error under 1e-5: exact fp32 dots land near 1e-7, TF32 near 1e-3).
Prints one table per kernel, fastest first; with $OUT set also writes $OUT/coarse_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from vsa_core import stages as ST  # noqa: E402
from vsa_core.launch import eager_launcher  # noqa: E402
from vsa_core.problem import AttnProblem  # noqa: E402

SHAPES = {"480p-64": (12, 39936, 64), "720p-256": (40, 92160, 256), "480p-256": (12, 39936, 256),
          "tiny": (2, 1280, 64)}  # tiny: `--device cpu` (the interpreter, one config per kernel) checks the plumbing
CANDIDATES = {
    "ds": [(64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 16, 4, 2)],
    "grads": [(64, 32, 64, 4, 2), (64, 32, 128, 8, 2), (64, 64, 64, 8, 2), (64, 16, 128, 8, 2), (64, 32, 64, 4, 3),
              (64, 64, 128, 8, 2), (128, 32, 64, 8, 2), (64, 32, 128, 4, 3), (64, 32, 128, 4, 2)],
    "fwd": [(64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4)],
}
POOL_CANDIDATES = [(64, 2), (64, 1), (32, 2), (32, 1), (64, 4)]
TOL = 1e-5


def exact(qc, kc, vc, valid, dout):
    q, k, v = (t.double().requires_grad_() for t in (qc, kc, vc))
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~valid, float("-inf"))
    out = torch.softmax(s, -1) @ v
    out.backward(dout.double())
    return {"out_c": out.detach(), "dq_c": q.grad, "dk_c": k.grad, "dv_c": v.grad}


def rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="480p-64,720p-256")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    if dev == "cpu":
        for c in (CANDIDATES, ):
            for st in c:
                c[st] = c[st][:1]
        POOL_CANDIDATES[1:] = []
        global do_bench
        do_bench = lambda fn, **kw: (fn(), 0.0)[1]  # noqa: E731 - the interpreter: run once, no timing
    results = {}
    defaults = {st: ST.COARSE_CONFIGS[128][st] for st in ("ds", "grads", "fwd")}
    for shape in args.shapes.split(","):
        H, S, E = SHAPES[shape]
        n = S // E
        D = 128
        p = AttnProblem(batch=1, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=E, dtype="bfloat16", topk=1)
        g = torch.Generator(device=dev).manual_seed(0)
        qc, kc, vc = ((2 * torch.randn(1, H, n, D, device=dev, generator=g)).bfloat16() for _ in range(3))
        dout = torch.randn(1, H, n, D, device=dev, generator=g)
        counts = torch.full((n,), E, dtype=torch.int32, device=dev)
        counts[3] = 0  # one empty block: masked in every kernel
        f32 = dict(device=dev, dtype=torch.float32)
        b = {"scores": torch.empty(1, H, n, n, **f32), "out": torch.empty(1, H, n, D, **f32),
             "lse": torch.empty(1, H, n, **f32), "dq": torch.empty(1, H, n, D, **f32),
             "dk": torch.empty(1, H, n, D, **f32), "dv": torch.empty(1, H, n, D, **f32),
             "P": torch.empty(1, H, n, n, **f32), "dS": torch.empty(1, H, n, n, **f32)}

        def fwd():
            ST.coarse_forward(eager_launcher, p, qc, kc, vc, counts, b["scores"], b["out"], b["lse"])

        def bwd():
            ST.coarse_backward(eager_launcher, p, qc, kc, vc, counts, b["out"], b["lse"], dout, b["dq"], b["dk"],
                              b["dv"], b["P"], b["dS"])

        ref = exact(qc[0], kc[0], vc[0], counts.bool(), dout[0])
        rows = {}
        for stage, cands in CANDIDATES.items():
            for cand in cands:
                ST.COARSE_CONFIGS[128] = dict(defaults, **{stage: cand})
                name = f"{stage} {cand}"
                try:
                    for t in b.values():
                        t.fill_(float("nan"))
                    fwd()
                    bwd()
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    err = max(rel(b[k][0], ref[k + "_c"]) for k in ("out", "dq", "dk", "dv"))
                    ms = do_bench(fwd if stage == "fwd" else bwd, warmup=10, rep=50, return_mode="median")
                    rows[name] = {"ms": ms, "err": err, "ok": err < TOL}
                except Exception as e:  # noqa: BLE001 - one failing config must not hide the rest
                    rows[name] = {"ms": float("nan"), "err": float("nan"), "ok": False, "error": repr(e)[:200]}
                print(f"{shape} {name}: {rows[name]}", flush=True)
        ST.COARSE_CONFIGS[128] = dict(defaults)
        # pooling of q, k, v (bf16 token tensors of the shape)
        q, k, v = (torch.randn(1, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        pools = [torch.empty(1, H, n, D, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        ref_pool = q.view(1, H, n, E, D).float().mean(3)
        saved = ST.POOL_CONFIG
        for cand in POOL_CANDIDATES:
            ST.POOL_CONFIG = cand
            ST.block_mean_pool_qkv(eager_launcher, p, q, k, v, counts, counts, *pools)
            keep = counts.bool()[None, None, :, None]
            err = rel(pools[0].float() * keep, ref_pool * keep)
            ms = do_bench(lambda: ST.block_mean_pool_qkv(eager_launcher, p, q, k, v, counts, counts, *pools),
                          warmup=10, rep=50, return_mode="median")
            gbs = 3 * q.numel() * 2 / ms / 1e6 if ms else 0.0
            rows[f"pool {cand}"] = {"ms": ms, "err": err, "ok": err < 1e-2, "GB/s": gbs}
            print(f"{shape} pool {cand}: {rows[f'pool {cand}']}", flush=True)
        ST.POOL_CONFIG = saved
        results[shape] = rows
        del q, k, v, pools, b
        torch.cuda.empty_cache()
    print("\n| shape | kernel config | ms | max rel err vs float64 | ok |")
    print("| --- | --- | --- | --- | --- |")
    for shape, rows in results.items():
        for name, r in sorted(rows.items(), key=lambda kv: (kv[0].split()[0], kv[1]["ms"])):
            print(f"| {shape} | {name} | {r['ms']:.4f} | {r['err']:.2e} | {r['ok']} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "coarse_sweep.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
