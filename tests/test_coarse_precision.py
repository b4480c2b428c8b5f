"""The coarse branch's precision (issue 8, section 2; issue 15).

The coarse kernels multiply fp32 tiles (P@V forward; dP, dQ, dK, dV backward). On the GPU
Triton runs such a `tl.dot` as TF32 (inputs cut to 10-bit mantissas) unless told otherwise;
the launch configuration's `coarse_precision` ("ieee" by default, read from
VSA_COARSE_PRECISION once: `vsa_core.config`) makes them exact fp32. The CPU interpreter computes fp32
whatever that says.

1. The coarse stage alone (`test_coarse_stage_*`): pooled q, k, v (bf16 / fp16 values) and an
   fp32 dO_c through `coarse_forward` / `coarse_backward`, against float64 autograd of the
   same inputs. The whole op cannot show the difference: its bf16 / fp16 outputs and its fine
   branch carry errors (1e-3 .. 1e-2) far above what TF32 does to the coarse gradients once
   they are spread over a block's tokens. Each test computes two error levels from the
   float64 reference on its own inputs: a model of the kernels' dataflow run in float32 (the
   fp32 level), and the same model in float64 with every fp32 operand that the kernels pass
   to `tl.dot` rounded to TF32 (the TF32 level; the hardware's TF32 inputs, rounded or
   truncated, are at least that far off). TF32 keeps 13 mantissa bits fewer than fp32; the
   levels come out 30 .. 1000x apart (the fp32 rounding of exp() at large scores is common to
   both). Each result's bound is their geometric mean, so exact fp32 dots pass with a margin
   and TF32 dots fail:

       python -m pytest -q -m gpu tests/test_coarse_precision.py                     # passes
       VSA_COARSE_PRECISION=tf32 python -m pytest -q -m gpu tests/test_coarse_precision.py -k coarse_stage
                                                                                     # every test fails

   (`benchmarks/gpu_session.sh checks` runs the second and requires that every test fails.)
   The CPU variant checks the interpreter's coarse stage against the same bounds.
2. The whole op at x16 activations (`test_x16_*`, GPU) against the float64 reference at the
   usual tolerances: end-to-end accuracy at large logits, not a TF32 detector.
"""

import math
import os
import zlib

import numpy as np
import pytest
import torch

from common import Case, assert_close, make_inputs, reference
from test_torch_vsa import run_torch
from vsa_core.backends import triton_backend
from vsa_core.config import config
from vsa_core.launch import eager_launcher
from vsa_core import stages as S
from vsa_core.problem import AttnProblem

HAS_CUDA = torch.cuda.is_available()


# ---- 1. the coarse stage -----------------------------------------------------------------
def tf32(x: torch.Tensor) -> torch.Tensor:
    """x (float64) through fp32 and then TF32 (10 explicit mantissa bits, round to nearest,
    ties to even), back as float64."""
    bits = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.view(torch.float32).double()


def coarse_model(qc, kc, vc, valid, dout, dtype, rnd):
    """out_c, dq_c, dk_c, dv_c of softmax(qc kc^T / sqrt(D)) vc over the valid KV blocks, as the
    coarse kernels compute them: in `dtype` arithmetic, with `rnd` applied to every operand the
    kernels pass to an fp32 `tl.dot` (qc, kc, vc hold bf16 / fp16 values: exact in TF32).
    [H, n, D] tensors; `valid` bool [n_kv]."""
    qc, kc, vc, dout = (t.to(dtype) for t in (qc, kc, vc, dout))
    scale = 1.0 / math.sqrt(qc.shape[-1])
    s = (qc @ kc.transpose(-1, -2) * scale).masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l_sum = p.sum(-1, keepdim=True)
    out = (rnd(p).to(dtype) @ vc) / l_sum                                  # forward: P @ V
    p = torch.exp(s - (m + torch.log(l_sum)))                              # the backward's P, from lse
    delta = (dout * out).sum(-1, keepdim=True)
    r_do = rnd(dout).to(dtype)
    ds = p * (r_do @ vc.transpose(-1, -2) - delta)                         # dP = dO_c V^T
    return {"out_c": out,
            "dq_c": (rnd(ds).to(dtype) @ kc) * scale,                      # dQ = dS K
            "dk_c": (rnd(ds).to(dtype).transpose(-1, -2) @ qc) * scale,    # dK = dS^T Q
            "dv_c": rnd(p).to(dtype).transpose(-1, -2) @ r_do}             # dV = P^T dO_c


def exact_coarse(qc, kc, vc, valid, dout):
    """float64 autograd of the coarse attention (the reference's formula)."""
    q, k, v = (t.double().requires_grad_() for t in (qc, kc, vc))
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~valid, float("-inf"))
    out = torch.softmax(s, -1) @ v
    out.backward(dout.double())
    return {"out_c": out.detach(), "dq_c": q.grad, "dk_c": k.grad, "dv_c": v.grad}


def run_coarse_stage(qc, kc, vc, counts, dout, device):
    """coarse_forward + coarse_backward (as vsa_core.ops launches them) on the pooled [H, n, D]
    tensors (batch 1); the fp32 results as float64 [H, n, D]."""
    H, nq, D = qc.shape
    nk = kc.shape[1]
    p = AttnProblem(batch=1, heads=H, q_len=nq * 64, kv_len=nk * 64, head_dim=D, block_elems=64,
                    dtype=str(qc.dtype).removeprefix("torch."), topk=1)
    q_pool, k_pool, v_pool, dout_c = (t[None].to(device).contiguous() for t in (qc, kc, vc, dout))
    kv_counts = counts.to(device, torch.int32)
    f32 = dict(device=device, dtype=torch.float32)
    scores, lse = torch.empty(1, H, nq, nk, **f32), torch.empty(1, H, nq, **f32)
    out, dq = torch.empty(1, H, nq, D, **f32), torch.empty(1, H, nq, D, **f32)
    dk, dv = torch.empty(1, H, nk, D, **f32), torch.empty(1, H, nk, D, **f32)
    S.coarse_forward(eager_launcher, p, q_pool, k_pool, v_pool, kv_counts, scores, out, lse)
    workspaces = torch.empty(1, H, nq, nk, **f32), torch.empty(1, H, nq, nk, **f32)
    S.coarse_backward(eager_launcher, p, q_pool, k_pool, v_pool, kv_counts, out, lse, dout_c, dq, dk, dv, *workspaces)
    return {n: t[0].double().cpu() for n, t in (("out_c", out), ("dq_c", dq), ("dk_c", dk), ("dv_c", dv))}


def rel(x, ref) -> float:
    return float((x.double() - ref).norm() / ref.norm())


# (dtype, head dim, heads, query blocks, KV blocks, std of the pooled q and k): std 4 makes the
# coarse softmax sharp (scores of std 16), as block means of x16 activations whose neighbouring
# tokens are alike (`correlated` below); std 1 is a mild softmax. The sharper the softmax, the
# larger |scores| and the fp32 rounding of exp() that no dot precision changes: there the two
# levels of out_c are ~30x apart, of the gradients ~250x; at std 1 .. 2 ~300 .. 900x
STAGE_CASES = [
    pytest.param("float16", 128, 2, 96, 160, 4.0, marks=pytest.mark.gpu, id="fp16-D128-std4"),
    pytest.param("bfloat16", 128, 2, 64, 200, 3.0, marks=pytest.mark.gpu, id="bf16-D128-std3"),
    pytest.param("bfloat16", 64, 3, 150, 90, 2.0, marks=pytest.mark.gpu, id="bf16-D64-std2"),
    pytest.param("float16", 128, 2, 256, 256, 1.0, marks=pytest.mark.gpu, id="fp16-D128-std1"),
    pytest.param("bfloat16", 64, 1, 6, 10, 4.0, marks=pytest.mark.skipif(HAS_CUDA, reason="the CPU variant"),
                 id="cpu-bf16-D64-std4"),
]
# the levels must be this far apart for a case to tell the precisions apart: the bound is then
# >= sqrt(20) = 4.5x above the fp32 level and as far below the TF32 level
MIN_LEVEL_RATIO = 20


@pytest.mark.parametrize("dtype, head_dim, heads, n_q, n_kv, std", STAGE_CASES)
def test_coarse_stage_is_fp32_accurate(dtype, head_dim, heads, n_q, n_kv, std):
    """Every coarse result (out_c, dq_c, dk_c, dv_c) below the geometric mean of its fp32 and
    TF32 error levels (module docstring); the levels are checked to be >= MIN_LEVEL_RATIO
    apart, so that the case tells the two precisions apart."""
    rng = np.random.default_rng(zlib.crc32(f"{dtype}-{head_dim}-{n_q}-{n_kv}".encode()))

    def randn(n, s):
        x = torch.from_numpy(rng.standard_normal((heads, n, head_dim), np.float32)) * s
        return x.to(getattr(torch, dtype))

    qc, kc, vc = randn(n_q, std), randn(n_kv, std), randn(n_kv, 1.0)
    dout = torch.from_numpy(rng.standard_normal((heads, n_q, head_dim), np.float32))
    counts = torch.from_numpy(rng.integers(1, 65, n_kv))
    counts[torch.from_numpy(rng.choice(n_kv, max(1, n_kv // 10), replace=False))] = 0  # empty KV blocks
    valid = counts > 0

    exact = exact_coarse(qc, kc, vc, valid, dout)
    fp32_model = coarse_model(qc, kc, vc, valid, dout, torch.float32, lambda t: t)
    tf32_model = coarse_model(qc, kc, vc, valid, dout, torch.float64, tf32)
    got = run_coarse_stage(qc, kc, vc, counts, dout, "cuda" if HAS_CUDA else "cpu")
    lines, over = [], []
    for name, want in exact.items():
        fp32_level, tf32_level, err = rel(fp32_model[name], want), rel(tf32_model[name], want), rel(got[name], want)
        bound = math.sqrt(fp32_level * tf32_level)
        lines.append(f"{name} {err:.2e} (fp32 level {fp32_level:.2e}, TF32 level {tf32_level:.2e}, bound {bound:.2e})")
        assert tf32_level > MIN_LEVEL_RATIO * fp32_level, f"this case cannot tell TF32 from fp32: {lines[-1]}"
        if not err < bound:
            over.append(lines[-1])
    print(f"coarse dots {config().coarse_precision}: " + "; ".join(lines))
    assert not over, f"coarse dots ({config().coarse_precision}) above the fp32 level: " + "; ".join(over)


def test_tf32_model_rounds_to_10_mantissa_bits():
    """The TF32 model itself: 1 + 2^-10 is kept, 1 + 2^-11 ties to even (1), 1 + 3 * 2^-11
    rounds up; sign and exponent are kept."""
    x = torch.tensor([1 + 2**-10, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 3 * 2**-11) * 2**40, 0.0], dtype=torch.float64)
    want = torch.tensor([1 + 2**-10, 1.0, 1 + 2**-9, -(1 + 2**-9) * 2**40, 0.0], dtype=torch.float64)
    assert torch.equal(tf32(x), want)
    y = torch.randn(10000, dtype=torch.float64)
    assert ((tf32(y) - y).abs() <= y.abs() * 2**-11).all()


# ---- 2. the whole op at x16 ------------------------------------------------------------------
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


def test_coarse_dots_are_exact_fp32_by_default():
    """The launch options the coarse kernels get on the GPU: exact fp32 products, and
    configs within the shared memory the comments in vsa_core.stages measured."""
    assert config().coarse_precision == (os.environ.get("VSA_COARSE_PRECISION") or "ieee")
    assert set(S.COARSE_CONFIGS) == {64, 128}
    for head_dim, stages in S.COARSE_CONFIGS.items():
        assert set(stages) == {"fwd", "ds", "grads"}
        for *tiles, warps, n_stages in stages.values():
            assert min(tiles) >= 16 and warps >= 1 and n_stages >= 1
        assert head_dim % stages["grads"][2] == 0  # BLOCK_D splits the head dim
