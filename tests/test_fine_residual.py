"""What VSA training keeps of the fine output for the backward's delta = rowsum(dO * out_fine)
(`AttnProblem.fine_residual`): our kernels (triton, sm90) keep out's rounding residual in q's dtype
and the backward forms the fp32 fine output from out + residual - gate * out_coarse.

Where the logits are large (q, k x16) the softmax is near one-hot and dP - delta cancels, so the
rounding of the fine output reaches dq / dk. The residual must give the fp32 fine output's gradients
up to its own rounding (AGREE); a fine output rounded to bf16 (FlashAttention's recipe, what the cudnn
and cute backends keep) must not, which shows the agreement bound can fail. Both forms stay within
BOUND of float64. Measured on the GPU and on the CPU: `benchmarks/fine_residual_precision.py` (the
Triton interpreter truncates fp32 -> bf16, so on the CPU a bf16 fine output costs more than on a GPU,
which rounds to nearest even).
"""

import zlib

import pytest

from common import Case, errors, make_inputs, reference
from frontends import run_torch
from test_cudnn_backend import require_backend

import vsa_core.spec as spec
import vsa_torch.ops
from vsa_core.backends import fine_residual

BOUND = 1.5e-2  # dq / dk rel-L2 against float64 at x16 logits
AGREE = 2e-3  # dq / dk rel-L2 between the residual's gradients and the fp32 fine output's
LARGE_LOGITS = Case(head_dim=128, scale=16.0)
SEED = 62


def _grad_errors(case, backend, seed=SEED):
    inputs = make_inputs(case, seed=seed)
    got, ref = run_torch(case, inputs, backend=backend), reference(case, inputs)
    return {name: errors(got[name], ref[name])[0] for name in ("out", "dq", "dk", "dv", "dgate")}


def _forget_problems():
    """The operator problems and the torch eager calls built on them (each holds its problem)."""
    spec._op_problem.cache_clear()
    vsa_torch.ops._STATICS.clear()


@pytest.fixture
def residual_kept_as(monkeypatch):
    """Makes every backend keep `fine_residual` (the problems and calls built before forgotten)."""
    def use(kind):
        monkeypatch.setattr(spec, "fine_residual", lambda name: kind)
        _forget_problems()
    yield use
    _forget_problems()


def test_our_kernels_keep_the_rounding_residual():
    assert fine_residual("triton") == fine_residual("sm90") == "rounding"
    assert fine_residual("cudnn") == fine_residual("cute") == "input"


def test_rounding_residual_keeps_fp32_accuracy_at_large_logits():
    err = _grad_errors(LARGE_LOGITS, "triton")
    assert err["dq"] < BOUND and err["dk"] < BOUND, err


def test_agreement_fails_a_bf16_fine_output(residual_kept_as):
    inputs = make_inputs(LARGE_LOGITS, seed=SEED)
    residual_kept_as("float32")
    fp32 = run_torch(LARGE_LOGITS, inputs, backend="triton")
    residual_kept_as("input")
    bf16 = run_torch(LARGE_LOGITS, inputs, backend="triton")
    assert max(errors(bf16[n], fp32[n])[0] for n in ("dq", "dk")) > AGREE


@pytest.mark.parametrize("case", [LARGE_LOGITS, Case(head_dim=128, gate=False, scale=16.0),
                                  Case(head_dim=128, layout="bshd")], ids=lambda c: c.id())
def test_rounding_residual_and_fp32_fine_output_agree(case, residual_kept_as):
    """The two forms of the fine output give the backward the same values up to the residual's
    own rounding (2^-9 of 2^-9 of out)."""
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()))
    rounding = run_torch(case, inputs, backend="triton")
    residual_kept_as("float32")
    fp32 = run_torch(case, inputs, backend="triton")
    assert errors(rounding["out"], fp32["out"])[0] < 1e-6  # the forward's out is the same either way
    for name in ("dq", "dk", "dv"):
        assert errors(rounding[name], fp32[name])[0] < AGREE, name


@pytest.mark.gpu
def test_sm90_rounding_residual_at_large_logits():
    require_backend("sm90", LARGE_LOGITS)
    err = _grad_errors(LARGE_LOGITS, "sm90")
    assert err["dq"] < BOUND and err["dk"] < BOUND, err


@pytest.mark.gpu
def test_sm90_rounding_residual_and_fp32_fine_output_agree(residual_kept_as):
    """On the GPU the sm90 forward's two forms give the backward the same gradients up to the residual's
    own rounding (a bf16 fine output would not: `test_agreement_fails_a_bf16_fine_output`)."""
    require_backend("sm90", LARGE_LOGITS)
    inputs = make_inputs(LARGE_LOGITS, seed=SEED)
    rounding = run_torch(LARGE_LOGITS, inputs, backend="sm90")
    residual_kept_as("float32")
    fp32 = run_torch(LARGE_LOGITS, inputs, backend="sm90")
    assert errors(rounding["out"], fp32["out"])[0] < 1e-6
    for name in ("dq", "dk", "dv"):
        assert errors(rounding[name], fp32[name])[0] < AGREE, name
