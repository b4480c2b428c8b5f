"""Video Sparse Attention in one run.

On a GPU: times vsa_torch.video_sparse_attn forward and backward at a 480p video
shape against dense attention (torch SDPA) and checks a small case against the float64
reference. On the CPU: runs a small case through the same Triton kernels under Triton's
interpreter (vsa does that by itself for CPU tensors, with a warning that it is slow)
and checks it against the float64 reference.
"""

import sys

import numpy as np
import torch

import vsa_torch
from vsa_core import reference as R

ON_GPU = torch.cuda.is_available()

DEVICE = "cuda" if ON_GPU else "cpu"


def check_small_case() -> bool:
    """A 5x8x8-token video latent in 4x4x4 tiles (64 tokens; the second time row of tiles
    holds 1 of 4 frames: partial tiles), gate on."""
    torch.manual_seed(0)
    meta = vsa_torch.build_vsa_metadata((5, 8, 8), (4, 4, 4))
    B, H, D, topk = 1, 2, 64, 2
    raw = [torch.randn(B, H, meta.num_tokens, D) for _ in range(4)]
    q, k, v, gate = (vsa_torch.to_tiled(x, meta).to(DEVICE, torch.bfloat16) for x in raw)
    counts = torch.from_numpy(meta.variable_block_sizes)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, gate)]
    out = vsa_torch.video_sparse_attn(*leaves[:3], counts, counts, topk, meta.tile_size, leaves[3])
    dout = torch.randn_like(out)
    out.backward(dout)
    host = [t.detach().cpu().double().numpy() for t in (q, k, v, gate, dout)]
    ref, _, _, ref_grads = R.video_sparse_attn_reference(*host[:3], meta.variable_block_sizes,
                                                         meta.variable_block_sizes, topk, meta.block_elems,
                                                         gate=host[3], round_to="bfloat16", dout=host[4])
    ok = True
    print(f"check vs float64 reference ({DEVICE}{', Triton interpreter' if not ON_GPU else ''}):")
    for name, got, want in [("out", out, ref)] + [(f"d{n}", a.grad, ref_grads[f"d{n}"])
                                                   for n, a in zip(("q", "k", "v", "gate"), leaves)]:
        got = got.detach().cpu().double().numpy()
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        ok &= err < 2e-2
        print(f"  {name:6s} relative error {err:.2e} {'ok' if err < 2e-2 else 'FAIL'}")
    return ok


def time_480p():
    from triton.testing import do_bench

    B, H, S, D, E, topk = 1, 12, 39936, 128, 64, 62
    n = S // E
    q, k, v, gate = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    counts = torch.full((n,), E, dtype=torch.int32, device="cuda")
    leaves = [t.requires_grad_() for t in (q, k, v, gate)]
    dout = torch.randn_like(q)

    def fwd():
        return vsa_torch.video_sparse_attn(*leaves[:3], counts, counts, topk, E, leaves[3])

    def fwd_bwd():
        torch.autograd.grad(fwd(), leaves, dout)

    with torch.no_grad():
        ms_fwd = do_bench(lambda: vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk, E, gate),
                          return_mode="median")
    ms_all = do_bench(fwd_bwd, return_mode="median")
    flops = 4.0 * B * H * D * S * topk * E
    dense = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    with torch.no_grad():
        ms_dense = do_bench(dense, return_mode="median")
    print(f"480p, B{B} H{H} S{S} D{D}, 64-token blocks, top-{topk} of {n} ({100 * topk / n:.0f}% dense), bf16:")
    print(f"  VSA forward (inference) {ms_fwd:7.3f} ms  {flops / ms_fwd / 1e9:6.0f} TFLOPS (sparse FLOPs)")
    print(f"  VSA forward + backward  {ms_all:7.3f} ms  {3.5 * flops / ms_all / 1e9:6.0f} TFLOPS")
    print(f"  dense SDPA forward      {ms_dense:7.3f} ms  ({ms_dense / ms_fwd:.1f}x the VSA forward)")


if __name__ == "__main__":
    ok = check_small_case()
    if ON_GPU:
        time_480p()
    sys.exit(0 if ok else 1)
