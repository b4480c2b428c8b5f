"""Times every candidate tile config of the Triton fine-stage kernels at one shape
(GPU only): the data behind the autotune lists in vsa_core/backends/triton_backend.py.

    PYTHONPATH=. python3 benchmarks/kernel_sweep.py --shape 1,12,39936,128,64,62

Backward TFLOPS count each kernel's share of the 2.5x convention as the whole: read
the backward total (dq + dkdv time) from the last line.
"""

import argparse

import torch
from triton.testing import do_bench

from vsa_core import ops
from vsa_core.backends import triton_backend as T
from vsa_core.backends.base import FineForward
from vsa_core.config import config, overridden
from vsa_core.launch import eager_launcher
from vsa_core.problem import describe_attention

DTYPES = {"input": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "int8": torch.int8}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,12,39936,128,64,62", help="B,H,S,D,E,topk")
    args = ap.parse_args()
    B, H, S, D, E, topk = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    n = S // E
    counts = torch.full((n,), E, dtype=torch.int32, device="cuda")
    scores = torch.rand(B, H, n, n, device="cuda")  # random selection, exactly topk per row
    block_map = torch.zeros(B, H, n, n, dtype=torch.bool, device="cuda")
    block_map.scatter_(-1, scores.topk(topk, dim=-1).indices, True)
    p = describe_attention(q, k, v, block_size=E, layout="bhsd", kv_counts=counts, selection="block_map")
    b = {name: torch.empty(shape, device="cuda", dtype=DTYPES[dt])
         for name, (shape, dt) in {**p.forward_buffers(), **p.backward_buffers()}.items()}
    b.update(q=q, k=k, v=v, kv_counts=counts, block_map=block_map, dout=dout)
    ops.forward(p, T, b)
    ops.backward(p, T, b)
    flops = 4.0 * B * H * D * S * topk * E
    print(f"shape B{B} H{H} S{S} D{D} E{E} topk{topk}  (VSA_TMA={int(config().tma)})")
    runs = {
        "fwd": (T._sparse_fwd, lambda: T.sparse_forward(
            eager_launcher, p, FineForward(q, k, v, b["out"], b["lse"], b["sel_idx"], b["sel_num"], counts))),
        "bwd_dq": (T._sparse_bwd_dq, lambda: T.sparse_backward_dq(
            eager_launcher, p, q, k, v, b["lse"], dout, b["delta"], b["dq"], b["sel_idx"], b["sel_num"], counts)),
        "bwd_dkdv": (T._sparse_bwd_dkdv, lambda: T.sparse_backward_dkdv(
            eager_launcher, p, q, k, v, b["lse"], dout, b["delta"], b["dk"], b["dv"], b["inv_idx"], b["inv_num"],
            counts)),
    }
    best = {}
    for name, (kernel, launch) in runs.items():
        for cfg in kernel.candidates:
            if E % cfg[0] or E % cfg[1]:
                continue
            try:
                with overridden(forced_tiles=((kernel.name, cfg),)):
                    ms = do_bench(launch, warmup=50, rep=200, return_mode="median")
            except Exception as e:  # e.g. out of shared memory for a config on this GPU
                print(f"  {name:9s} {cfg}  failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            best[name] = min(best.get(name, ms), ms)
            tflops = (flops if name == "fwd" else 2.5 * flops) / ms / 1e9
            print(f"  {name:9s} M{cfg[0]:<4d}N{cfg[1]:<4d}w{cfg[2]} s{cfg[3]}  {ms:8.3f} ms  {tflops:6.0f}", flush=True)
    bwd = best.get("bwd_dq", 0) + best.get("bwd_dkdv", 0)
    print(f"best: fwd {best.get('fwd', 0):.3f} ms = {flops / best.get('fwd', 1) / 1e9:.0f} TFLOPS; "
          f"bwd {bwd:.3f} ms = {2.5 * flops / max(bwd, 1e-9) / 1e9:.0f} TFLOPS")


if __name__ == "__main__":
    main()
