"""Every frontend x every backend against the float64 reference, over the shared CASES.

torch: `video_sparse_attn` with autograd; jax: jit(vjp) with the counts traced. Backends:
"triton" everywhere (CPU: the interpreter); "cute" (FA4), "cudnn" (cuDNN BSA) and "sm90" (ours, 64-token blocks) on a GPU,
each cell skipped with the backend's own reason where it cannot run the case (block size,
head dim, dtype, architecture, a missing package). Test ids read
`test_matches_float64_reference[<frontend>-<backend>-<case>]`.
"""

import jax.numpy as jnp
import pytest

from common import CASES, Case, assert_close, make_inputs, reference, require_jax_gpu, skip_unavailable
from frontends import TORCH_DEVICE, run_jax_vjp, run_torch, seed_of, torch
from vsa_core.backends import BackendUnavailableError, resolve_backend
from vsa_core.problem import AttnProblem
from vsa_core.runtime import DeviceInfo

RUNNERS = {"torch": run_torch, "jax": run_jax_vjp}

BACKENDS = [
    pytest.param("triton", id="triton"),
    pytest.param("cute", id="cute", marks=pytest.mark.gpu),
    pytest.param("cudnn", id="cudnn", marks=pytest.mark.gpu),
    pytest.param("sm90", id="sm90", marks=pytest.mark.gpu),
]


def _device(frontend: str) -> DeviceInfo:
    if frontend == "torch":
        from vsa_torch.ops import device_info as torch_device_info
        return torch_device_info(torch.empty(0, device=TORCH_DEVICE))
    from vsa_jax.ops import device_info
    return device_info(jnp.zeros(()))


def _unavailable(case: Case, backend: str, frontend: str):
    """Why `backend` cannot run this case's training call here (None when it can)."""
    p = AttnProblem(batch=case.batch, heads=case.heads, q_len=case.n_q_blocks * case.E,
                    kv_len=case.n_kv_blocks * case.E, head_dim=case.head_dim, block_elems=case.E, dtype=case.dtype,
                    layout=case.layout, topk=case.topk, has_gate=case.gate)
    try:
        resolve_backend(backend, p, _device(frontend))
    except BackendUnavailableError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id())
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("frontend", list(RUNNERS))
def test_matches_float64_reference(frontend, backend, case):
    if frontend == "torch" and torch is None:
        pytest.skip("torch is not installed (a vsa[jax] install)")
    if frontend == "jax" and backend != "triton":
        require_jax_gpu()
    skip_unavailable(backend, _unavailable(case, backend, frontend))
    if backend in ("cute", "cudnn") and case.scale != 1.0:
        # FA4 and cuDNN form the backward's delta from the output in q's dtype (FlashAttention's
        # recipe), which at large logits is outside this tolerance by design; their own test files
        # check those cases against a wider bound (test_*_large_logits_within_flash_attention_precision)
        pytest.skip(f"large logits (scale {case.scale}) on {backend}: see its large-logits test")
    inputs = make_inputs(case, seed=seed_of(case))
    assert_close(case, RUNNERS[frontend](case, inputs, backend=backend), reference(case, inputs))
