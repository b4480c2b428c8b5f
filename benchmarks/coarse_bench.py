"""Times the coarse stage of VSA with exact fp32 dots ("ieee", the default) and with the
old TF32 dots, at the standard video shapes (GPU only).

    PYTHONPATH=. python3 benchmarks/coarse_bench.py                 # both precisions
    PYTHONPATH=. python3 benchmarks/coarse_bench.py --precision ieee

Stages timed (CUDA events via triton.testing.do_bench, median):
- forward: block-mean pooling of q, k, v + coarse attention forward + top-k selection;
- backward: coarse attention backward (dq_c kernel + dk_c/dv_c kernel).
Also prints each precision's error in the coarse gradients against a float64 torch
computation on the same pooled inputs at x16 activations. A table goes to stdout and,
with $OUT set, to $OUT/coarse_bench.log.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from vsa_core.backends import triton_backend as T
from vsa_core.problem import describe_attention

SHAPES = {
    # name: (B, H, S, D, E, topk)
    "480p-64": (1, 12, 39936, 128, 64, 62),
    "720p-256": (1, 40, 92160, 128, 256, 45),
}
DTYPES = {"float32": torch.float32, "int32": torch.int32, "int8": torch.int8}


def buffers(p, q, k, v, counts):
    b = {name: torch.empty(shape, device="cuda", dtype=q.dtype if dt == "input" else DTYPES[dt])
         for name, (shape, dt) in {**p.forward_buffers(), **p.backward_buffers()}.items()}
    b.update(q=q, k=k, v=v, kv_counts=counts, q_counts=counts)
    b["dout_coarse"].normal_()
    return b


def forward_stage(p, b):
    T.block_mean_pool(p, b["q"], b["q_counts"], b["q_pool"], p.q_len)
    T.block_mean_pool(p, b["k"], b["kv_counts"], b["k_pool"], p.kv_len)
    T.block_mean_pool(p, b["v"], b["kv_counts"], b["v_pool"], p.kv_len)
    T.coarse_forward(p, b["q_pool"], b["k_pool"], b["v_pool"], b["kv_counts"], b["scores"], b["out_coarse"],
                     b["lse_coarse"])
    T.topk_select(p, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"])


def backward_stage(p, b):
    T.coarse_backward(p, b["q_pool"], b["k_pool"], b["v_pool"], b["kv_counts"], b["out_coarse"], b["lse_coarse"],
                      b["dout_coarse"], b["dq_pool"], b["dk_pool"], b["dv_pool"])


def coarse_errors(p, b):
    """Relative errors of out_c, dq_c, dk_c, dv_c against float64 autograd on the pooled inputs."""
    qc, kc, vc = (b[n].double().requires_grad_() for n in ("q_pool", "k_pool", "v_pool"))
    s = qc @ kc.transpose(-1, -2) / math.sqrt(p.head_dim)
    out = torch.softmax(s, dim=-1) @ vc
    out.backward(b["dout_coarse"].double())
    res = {}
    for name, got, want in (("out_c", b["out_coarse"], out), ("dq_c", b["dq_pool"], qc.grad),
                            ("dk_c", b["dk_pool"], kc.grad), ("dv_c", b["dv_pool"], vc.grad)):
        want = want.detach()
        res[name] = ((got.double() - want).norm() / want.norm()).item()
    return res


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=["ieee", "tf32", "both"], default="both")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("coarse_bench.py needs a CUDA GPU")
    from triton.testing import do_bench

    precisions = ["tf32", "ieee"] if args.precision == "both" else [args.precision]
    dtype = getattr(torch, args.dtype)
    lines = [f"coarse stage, {torch.cuda.get_device_name()}, {args.dtype}, x16 activations, "
             f"configs {T.COARSE_CONFIGS}",
             f"{'shape':10s} {'precision':9s} {'fwd ms':>8s} {'bwd ms':>8s} "
             f"{'out_c err':>10s} {'dq_c err':>10s} {'dk_c err':>10s} {'dv_c err':>10s}"]
    print("\n".join(lines), flush=True)
    for shape, (B, H, S, D, E, topk) in SHAPES.items():
        torch.manual_seed(0)
        q, k, v = (16 * torch.randn(B, H, S, D, device="cuda", dtype=dtype) if i < 2 else
                   torch.randn(B, H, S, D, device="cuda", dtype=dtype) for i in range(3))
        counts = torch.full((S // E,), E, dtype=torch.int32, device="cuda")
        p = describe_attention(q, k, v, block_size=E, layout="bhsd", kv_counts=counts, q_counts=counts, topk=topk)
        b = buffers(p, q, k, v, counts)
        for precision in precisions:
            T.COARSE_DOT_PRECISION = precision
            forward_stage(p, b)
            backward_stage(p, b)
            torch.cuda.synchronize()
            ms_fwd = do_bench(lambda: forward_stage(p, b), warmup=25, rep=100, return_mode="median")
            ms_bwd = do_bench(lambda: backward_stage(p, b), warmup=25, rep=100, return_mode="median")
            err = coarse_errors(p, b)
            line = (f"{shape:10s} {precision:9s} {ms_fwd:8.3f} {ms_bwd:8.3f} "
                    + " ".join(f"{err[n]:10.2e}" for n in ("out_c", "dq_c", "dk_c", "dv_c")))
            print(line, flush=True)
            lines.append(line)
    T.COARSE_DOT_PRECISION = os.environ.get("VSA_COARSE_PRECISION", "ieee")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "coarse_bench.log"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
