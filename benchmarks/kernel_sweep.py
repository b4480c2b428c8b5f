"""Times every candidate tile config of the Triton fine-stage kernels at one shape
(GPU only): the data behind the autotune lists in vsa_core/backends/triton_backend.py.

    PYTHONPATH=. python3 benchmarks/kernel_sweep.py --shape 1,12,39936,128,64,62
"""

import argparse
import math

import torch
from triton.testing import do_bench

from vsa_core import ops
from vsa_core.backends import triton_backend as T
from vsa_core.problem import describe_attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,12,39936,128,64,62", help="B,H,S,D,E,topk")
    args = ap.parse_args()
    B, H, S, D, E, topk = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    n = S // E
    counts = torch.full((n,), E, dtype=torch.int32, device="cuda")
    # a random selection with exactly topk blocks per query block
    scores = torch.rand(B, H, n, n, device="cuda")
    block_map = torch.zeros(B, H, n, n, dtype=torch.bool, device="cuda")
    block_map.scatter_(-1, scores.topk(topk, dim=-1).indices, True)
    p = describe_attention(q, k, v, block_size=E, layout="bhsd", kv_counts=counts, selection="block_map")
    fwd_bufs = {name: torch.empty(shape, device="cuda", dtype={"input": q.dtype, "float32": torch.float32,
                                                                "int32": torch.int32, "int8": torch.int8}[dt])
                for name, (shape, dt) in {**p.forward_buffers(), **p.backward_buffers()}.items()}
    bufs = dict(q=q, k=k, v=v, kv_counts=counts, block_map=block_map, dout=dout, **fwd_bufs)
    ops.forward(p, T, bufs)
    ops.backward(p, T, bufs)
    flops = 4.0 * B * H * D * S * topk * E
    b = bufs
    qs, ks = p.token_strides(p.q_len), p.token_strides(p.kv_len)
    scale = 1 / math.sqrt(D)
    scale_log2 = math.log2(math.e) * scale
    print(f"shape B{B} H{H} S{S} D{D} E{E} topk{topk}")
    for name, tk, launch, mult in [
        ("fwd", T._sparse_fwd, lambda m, nn, w, s: T.K.sparse_attn_fwd_kernel[(S // m, B * H)](
            q, k, v, b["out"], b["lse"], b["sel_idx"], b["sel_num"], counts, None, None, None, *qs, *ks,
            H, S, n, b["sel_idx"].shape[-1], scale_log2, BLOCK_ELEMS=E, HEAD_DIM=D, BLOCK_M=m, BLOCK_N=nn,
            HAS_COARSE=False, HAS_GATE=False, STORE_FINE=False, UPCAST=False, num_warps=w, num_stages=s), 1.0),
        ("bwd_dq", T._sparse_bwd_dq, lambda m, nn, w, s: T.K.sparse_attn_bwd_dq_kernel[(S // m, B * H)](
            q, k, v, dout, b["lse"], b["delta"], b["dq"], b["sel_idx"], b["sel_num"], counts, None, None,
            *qs, *ks, H, S, n, b["sel_idx"].shape[-1], scale_log2, scale, BLOCK_ELEMS=E, HEAD_DIM=D,
            BLOCK_M=m, BLOCK_N=nn, HAS_COARSE=False, UPCAST=False, num_warps=w, num_stages=s), 1.0),
        ("bwd_dkdv", T._sparse_bwd_dkdv, lambda m, nn, w, s: T.K.sparse_attn_bwd_dkdv_kernel[(S // nn, B * H)](
            q, k, v, dout, b["lse"], b["delta"], b["dk"], b["dv"], b["inv_idx"], b["inv_num"], counts, None,
            None, *qs, *ks, H, S, n, b["inv_idx"].shape[-1], scale_log2, scale, BLOCK_ELEMS=E, HEAD_DIM=D,
            BLOCK_M=m, BLOCK_N=nn, HAS_COARSE=False, UPCAST=False, num_warps=w, num_stages=s), 1.5),
    ]:
        for m, nn, w, s in tk.candidates:
            if E % m or E % nn:
                continue
            try:
                ms = do_bench(lambda: launch(m, nn, w, s), warmup=50, rep=200, return_mode="median")
                print(f"  {name:9s} M{m:<4d}N{nn:<4d}w{w} s{s}  {ms:7.3f} ms  {mult * flops / ms / 1e9:6.0f} TFLOPS",
                      flush=True)
            except Exception as e:  # e.g. out of shared memory for a config on this GPU
                print(f"  {name:9s} M{m:<4d}N{nn:<4d}w{w} s{s}  failed: {type(e).__name__}: {str(e)[:80]}")


if __name__ == "__main__":
    main()
