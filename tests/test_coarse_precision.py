"""The coarse branch's gradients at large activations (issue 8, section 2).

The coarse kernels multiply fp32 tiles (P@V forward; dP, dQ, dK, dV backward). On the GPU
Triton runs such a `tl.dot` as TF32 (10-bit mantissas) unless told otherwise; the CPU
interpreter computes true fp32, so only the GPU tests here can see the difference. At x16
activations the coarse softmax is sharp, dP - rowsum(dO_c * out_c) cancels, and TF32
measured 5.0e-2 relative error in dK (fp16, E128, bound 3e-3) and 2.6e-2 in dQ (bf16,
E256, bound 2e-2) on an H200; with exact fp32 (input_precision="ieee") 3.3e-4.

To check that these tests can fail, run them with the old dots:
`VSA_COARSE_PRECISION=tf32 python -m pytest -q -m gpu tests/test_coarse_precision.py`.
"""

import os
import zlib

import numpy as np
import pytest

from common import TOLERANCE, Case, assert_close, errors, make_inputs, reference
from test_torch_vsa import run_torch
from vsa_core.backends import triton_backend


def correlated(case: Case, inputs: dict, seed: int, weight: float = 0.3) -> dict:
    """Adds a per-block common vector to the valid tokens of q, k (times the case's scale)
    and v, as neighbouring video tokens are alike: the block means then carry the scale
    and the coarse softmax is sharp. The padded tails stay zero."""
    rng = np.random.default_rng([seed, 99])
    E = case.E
    for name, counts in (("q", inputs["q_counts"]), ("k", inputs["kv_counts"]), ("v", inputs["kv_counts"])):
        x = inputs[name]
        gain = weight * (case.scale if name != "v" else 1.0)
        for i, n in enumerate(counts):
            common = rng.standard_normal((x.shape[0], x.shape[1], 1, x.shape[3])).astype(np.float32)
            x[:, :, i * E:i * E + n] += gain * common
    return inputs


X16_CASES = [
    # the failures: fp16 E128 (dK) and bf16 E256 (dQ), D = 128, x16
    Case(block=128, head_dim=128, dtype="float16", scale=16.0, n_q_blocks=4, n_kv_blocks=8, batch=1, heads=2,
         topk=3),
    Case(block=(4, 4, 8), head_dim=128, dtype="float16", scale=16.0, n_q_blocks=3, n_kv_blocks=6, batch=1,
         heads=2, topk=2, layout="bshd"),
    Case(block=256, head_dim=128, dtype="bfloat16", scale=16.0, n_q_blocks=4, n_kv_blocks=8, batch=1, heads=2,
         topk=3),
    Case(block=256, head_dim=128, dtype="bfloat16", scale=16.0, n_q_blocks=3, n_kv_blocks=5, batch=1, heads=2,
         topk=2, gate=False),
    Case(block=64, head_dim=128, dtype="float16", scale=16.0, n_q_blocks=8, n_kv_blocks=16, batch=1, heads=2,
         topk=4),
    # more blocks: a longer coarse softmax and more terms in each coarse dot product
    Case(block=128, head_dim=128, dtype="float16", scale=16.0, n_q_blocks=12, n_kv_blocks=24, batch=1, heads=2,
         topk=6),
    Case(block=256, head_dim=128, dtype="bfloat16", scale=16.0, n_q_blocks=8, n_kv_blocks=12, batch=1, heads=2,
         topk=4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("structured", [False, True], ids=["iid", "block-correlated"])
@pytest.mark.parametrize("case", X16_CASES, ids=lambda c: c.id())
def test_x16_gradients_match_float64_reference(case, structured):
    """Triton backend (the coarse branch is the same for cute), three seeds per case."""
    for seed in range(3):
        seed = zlib.crc32(f"{case.id()}-{seed}".encode())
        inputs = make_inputs(case, seed)
        if structured:
            inputs = correlated(case, inputs, seed)
        assert_close(case, run_torch(case, inputs, backend="triton"), reference(case, inputs))


@pytest.mark.gpu
def test_x16_fp16_coarse_gradient_error_is_fp32_sized():
    """Tighter than the tolerance table: with exact fp32 coarse products the fp16 x16 case
    lands near 3e-4 (the issue's measurement after the fix); TF32 gave 5e-2. The bound,
    2e-3, sits well between."""
    case = X16_CASES[0]
    worst = 0.0
    for seed in range(3):
        inputs = make_inputs(case, seed)
        got, ref = run_torch(case, inputs, backend="triton"), reference(case, inputs)
        worst = max(worst, *(errors(got[n], ref[n])[0] for n in ("dq", "dk", "dv")))
    assert worst < 2e-3 < TOLERANCE["float16"]["rel"], worst


def test_coarse_dots_are_exact_fp32_by_default():
    """The launch options the coarse kernels get on the GPU: exact fp32 products, and
    configs within the shared memory the comments in triton_backend measured."""
    assert triton_backend.COARSE_DOT_PRECISION == os.environ.get("VSA_COARSE_PRECISION", "ieee")
    assert set(triton_backend.COARSE_CONFIGS) == {64, 128}
    for head_dim, stages in triton_backend.COARSE_CONFIGS.items():
        assert set(stages) == {"fwd", "dq", "dkdv"}
        for block_m, block_n, warps, n_stages in stages.values():
            assert block_m >= 16 and block_n >= 16 and warps >= 1 and n_stages >= 1
    # D=128 dK/dV: 16 query rows per step at 2 stages (78 KB); 64 rows at 3 stages measured
    # 229888 bytes, at sm_90's limit
    assert triton_backend.COARSE_CONFIGS[128]["dkdv"][0] == 16 and triton_backend.COARSE_CONFIGS[128]["dkdv"][3] <= 2
