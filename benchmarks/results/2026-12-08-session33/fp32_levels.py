"""The fp32 model's error levels of test_coarse_precision's bf16-D64-std2 case on this host's CPU BLAS
(torch.matmul at each float32 matmul precision and thread count) and without BLAS (the test's model
since session 33). Run from the repository root: python3 benchmarks/results/2026-12-08-session33/fp32_levels.py"""
import os
import sys, zlib, numpy as np, torch
sys.path.insert(0, "tests")
import test_coarse_precision as T
print({k: v for k, v in os.environ.items() if k.startswith(("ONEDNN", "DNNL", "MKL", "OMP_"))})
print("torch", torch.__version__, "threads", torch.get_num_threads(), "precision", torch.get_float32_matmul_precision(),
      "mkldnn", torch.backends.mkldnn.is_available(), getattr(torch.backends.mkldnn, "matmul", None) and torch.backends.mkldnn.matmul.fp32_precision)
dtype, head_dim, heads, n_q, n_kv, std = "bfloat16", 64, 3, 150, 90, 2.0
rng = np.random.default_rng(zlib.crc32(f"{dtype}-{head_dim}-{n_q}-{n_kv}".encode()))
def randn(n, s):
    return (torch.from_numpy(rng.standard_normal((heads, n, head_dim), np.float32)) * s).to(getattr(torch, dtype))
qc, kc, vc = randn(n_q, std), randn(n_kv, std), randn(n_kv, 1.0)
dout = torch.from_numpy(rng.standard_normal((heads, n_q, head_dim), np.float32))
counts = torch.from_numpy(rng.integers(1, 65, n_kv))
counts[torch.from_numpy(rng.choice(n_kv, max(1, n_kv // 10), replace=False))] = 0
valid = counts > 0
exact = T.exact_coarse(qc, kc, vc, valid, dout)
for prec in ("highest", "high", "medium"):
    torch.set_float32_matmul_precision(prec)
    for th in (1, 16):
        torch.set_num_threads(th)
        T.fp32_matmul_without_blas, saved = torch.matmul, T.fp32_matmul_without_blas  # the host's BLAS
        f = T.coarse_model(qc, kc, vc, valid, dout, torch.float32, lambda t: t)
        T.fp32_matmul_without_blas = saved
        print(prec, th, {n: f"{T.rel(f[n], w):.2e}" for n, w in exact.items()}, flush=True)
f = T.coarse_model(qc, kc, vc, valid, dout, torch.float32, lambda t: t)
print("without BLAS", {n: f"{T.rel(f[n], w):.2e}" for n, w in exact.items()})
