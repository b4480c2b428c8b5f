"""Our sm_90 backward for 64-token blocks (vsa_core/backends/sm90_bwd64.py, CuTe DSL; not a backend yet).

GPU only (`-m gpu`, sm_90 with nvidia-cutlass-dsl 4.8.1; skipped otherwise): dq, dk, dv against the
float64 reference (vsa_core.reference, given the float64 forward's lse and out) with fresh random
inputs, outputs poisoned with NaN first: partial and empty KV blocks, empty query rows, KV blocks
nobody selected, nQ != nKV, BSHD, a long KV-owned list, padded query rows (lse +inf, q and dout
zeroed there), softmax_scale. Bound: P and dS are rounded to bf16 before their GEMMs and the
gradients once more on output (as in the Triton backward, which measures ~6e-3 on these cases):
rel-L2 < 1e-2. The wider matrix, the comparison with the Triton backward and the timing are in
benchmarks/sm90_bwd64_check.py.
"""

import math
import zlib

import numpy as np
import pytest
import torch

from vsa_core import reference as R

E = 64
# The two kernels behind `prepare_backward64`, each as the sm90 backend would configure it (the
# backend's BACKWARD is one of them: test_backend_backward_is_tested)
CONFIGS = {"one-warpgroup": dict(stages=2, dq_red=True, dk_overlap=True),
           "split": dict(stages=3, split=True, dq_bulk=True)}


def _backward():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("cutlass")
    from vsa_core.backends import sm90_bwd64
    return sm90_bwd64


def _lists(mask):
    idx = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32).contiguous()
    return idx, mask.sum(-1, dtype=torch.int32).contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 2, 4, 4, "bhsd", None, None), (1, 2, 3, 7, "bshd", None, None),
                                   (2, 1, 5, 2, "bhsd", None, None), (1, 1, 40, 2, "bhsd", None, None),
                                   (2, 2, 4, 4, "bhsd", [64, 17, 1, 40], None),
                                   (1, 2, 4, 3, "bshd", None, 0.3)],
                         ids=["nq4-nkv4", "bshd-nq3-nkv7", "sq-gt-skv", "long-inv-list", "padded-q-rows",
                              "bshd-scale"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sm90_bwd64_matches_float64_reference(shape, config):
    M = _backward()
    B, H, nq, nkv, layout, q_counts, softmax_scale = shape
    g = torch.Generator().manual_seed(zlib.crc32(repr(shape).encode()))
    D = 128
    q, k, v, do = (torch.randn(B, H, n * E, D, generator=g, dtype=torch.float64) for n in (nq, nkv, nkv, nq))
    kv_counts = torch.randint(0, E + 1, (nkv,), generator=g)
    kv_counts[0] = E
    mask = torch.rand(B, H, nq, nkv, generator=g) < 0.6
    mask.view(-1, nkv)[0] = False  # an empty query row
    valid = None
    if q_counts is not None:  # padded query rows: inputs zeroed, lse +inf (VSA forward, padding="ignore")
        valid = (torch.arange(nq * E) % E) < torch.repeat_interleave(torch.tensor(q_counts), E)
        q, do = (x * valid[None, None, :, None] for x in (q, do))
    q, k, v, do = (x.to(torch.bfloat16) for x in (q, k, v, do))
    out, lse, ref = R.block_sparse_attn_reference(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                                  mask.numpy(), kv_counts.numpy(), E, dout=do.double().numpy(),
                                                  softmax_scale=softmax_scale)
    if valid is not None:
        lse = np.where(valid.numpy()[None, None, :], lse, np.inf)

    def dev(x):  # the [B, H, S, D] view of a tensor stored in the layout
        x = torch.as_tensor(x)
        if layout == "bshd" and x.dim() == 4:
            return x.transpose(1, 2).contiguous().cuda().transpose(1, 2)
        return x.contiguous().cuda()

    qd, kd, vd, dod = (dev(x) for x in (q, k, v, do))
    out_d, lse_d = dev(torch.from_numpy(out).float()), dev(torch.from_numpy(lse).float())
    grads = {n: dev(torch.full(x.shape, math.nan, dtype=torch.bfloat16)) for n, x in (("dq", q), ("dk", k), ("dv", k))}
    inv_idx, inv_num = _lists(mask.transpose(2, 3))
    M.sparse_backward64(qd, kd, vd, out_d, dod, lse_d, grads["dq"], grads["dk"], grads["dv"], inv_idx.cuda(),
                        inv_num.cuda(), kv_counts.to(torch.int32).cuda(), softmax_scale=softmax_scale,
                        **CONFIGS[config])
    torch.cuda.synchronize()
    for name, r in ref.items():
        got = grads[name].double().cpu().numpy()
        assert np.isfinite(got).all(), f"{name}: non-finite (an unwritten, poisoned element?)"
        den = np.linalg.norm(r)
        err = np.linalg.norm(got - r) / den if den > 0 else np.abs(got).max()
        assert err < 1e-2, f"{name}: rel-L2 {err:.2e}"


def test_backend_backward_is_tested():
    from vsa_core.backends import sm90_backend
    assert sm90_backend.BACKWARD in CONFIGS.values(), "the sm90 backend's BACKWARD is not among CONFIGS"
