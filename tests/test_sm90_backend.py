"""The sm90 backend: our own CuTe DSL kernels for 64-token blocks (`vsa_core.backends.sm90_backend`).

CPU (CI): availability reasons, and that importing the frontends imports no CuTe DSL.
GPU (`-m gpu`, sm_90 with nvidia-cutlass-dsl installed; skipped otherwise): whole VSA forward and
backward against the float64 reference and against the Triton backend (partial and empty tiles,
Sq != Skv, gate, BHSD/BSHD, fp16, head dim 64, x16 logits at the reference's own tolerance: the
fine output is kept in fp32 from the accumulators), and the checks shared with the cudnn backend
(empty rows, the current stream, torch <-> JAX, bad lists under compile / jit).
"""

import zlib

import pytest

from common import Case, assert_close, make_inputs, reference
from test_cudnn_backend import (H200, _problem, check_bad_lists_under_compile, check_current_stream,
                                check_empty_rows, check_torch_and_jax, require_backend)
from test_torch_vsa import run_torch
from vsa_core.backends import BACKENDS, REGISTRY, sm90_backend
from vsa_core.runtime import DeviceInfo


# ---- availability (CPU) ------------------------------------------------------------------
def test_registered():
    assert REGISTRY["sm90"] == "vsa_core.backends.sm90_backend" and BACKENDS["sm90"] is sm90_backend


@pytest.mark.parametrize("kw, device, expect", [
    (dict(), DeviceInfo("cpu"), "NVIDIA GPUs only"),
    (dict(), DeviceInfo("cuda", 0, (8, 0)), "sm_80"),
    (dict(), DeviceInfo("cuda", 0, (10, 0)), "sm_100"),
    (dict(block_elems=128), H200, "128-token blocks"),
    (dict(head_dim=96), H200, "head dim 96"),
    (dict(dtype="float32"), H200, "float32"),
])
def test_unavailable_reasons(kw, device, expect, monkeypatch):
    monkeypatch.setattr(sm90_backend, "_kernels_import_error", lambda: None)
    reason = sm90_backend.unavailable_reason(_problem(**kw), device)
    assert reason is not None and expect in reason, reason


def test_available_on_h200_for_its_shapes(monkeypatch):
    monkeypatch.setattr(sm90_backend, "_kernels_import_error", lambda: None)
    for kw in (dict(), dict(dtype="float16"), dict(head_dim=64), dict(layout="bshd"), dict(training=False)):
        assert sm90_backend.unavailable_reason(_problem(**kw), H200) is None, kw


def test_missing_cutlass_names_what_to_install(monkeypatch):
    monkeypatch.setattr(sm90_backend, "_kernels_import_error", lambda: "ModuleNotFoundError: No module named 'cutlass'")
    reason = sm90_backend.unavailable_reason(_problem(), H200)
    assert "No module named 'cutlass'" in reason and sm90_backend.INSTALL_HINT in reason


def test_its_cute_steps_are_found_through_the_registry():
    """The eager launcher runs a step by the function its backend module declares (every backend
    with steps: sm90, cute, cudnn); an unknown step names the known ones."""
    from vsa_core.backends import cudnn_backend, cute_backend, cute_step
    assert cute_step("sm90_fwd64") is sm90_backend.launch_forward64
    assert cute_step("sm90_bwd64") is sm90_backend.launch_backward64
    assert cute_step("fa4_fwd") is cute_backend.launch_fa4_forward
    assert cute_step("fa4_bwd") is cute_backend.launch_fa4_backward
    assert cute_step("cudnn_fwd") is cudnn_backend.launch_cudnn_forward
    assert cute_step("cudnn_bwd") is cudnn_backend.launch_cudnn_backward
    known = "'cudnn_bwd', 'cudnn_fwd', 'fa4_bwd', 'fa4_fwd', 'sm90_bwd64', 'sm90_fwd64'"
    with pytest.raises(ValueError, match=rf"unknown CuTe DSL launch step 'sm90_fwd32' \(known: \[{known}\]\)"):
        cute_step("sm90_fwd32")


# ---- on the GPU ------------------------------------------------------------------------------
SM90_CASES = [
    Case(head_dim=128),                                                             # partial + empty tiles
    Case(head_dim=128, layout="bshd"),
    Case(block=(4, 4, 4), head_dim=128, gate=False),
    Case(head_dim=128, n_q_blocks=5, n_kv_blocks=2, topk=1),                        # Sq > Skv
    Case(head_dim=128, n_q_blocks=2, n_kv_blocks=6, topk=3, layout="bshd"),         # Sq < Skv
    Case(head_dim=128, topk=4),                                                     # all KV blocks (one empty)
    Case(head_dim=128, topk=9, n_q_blocks=2),                                       # topk clamped
    Case(head_dim=128, partial_q=False, partial_kv=False, batch=1),
    Case(head_dim=128, scale=16.0),                                                 # x16 logits
    Case(head_dim=64),
    Case(head_dim=64, dtype="float16", layout="bshd", gate=False),
    Case(head_dim=128, dtype="float16", scale=4.0),
    Case(head_dim=128, n_q_blocks=9, n_kv_blocks=11, topk=5, batch=1, heads=3),     # longer lists, 3 consumers
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: c.id())
def test_sm90_matches_float64_reference(case):
    require_backend("sm90", case)
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()))
    assert_close(case, run_torch(case, inputs, backend="sm90"), reference(case, inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_CASES[:4], ids=lambda c: c.id())
def test_sm90_matches_triton(case):
    require_backend("sm90", case)
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()) + 1)
    assert_close(case, run_torch(case, inputs, backend="sm90"), run_torch(case, inputs, backend="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_sm90_block_sparse_attn_with_empty_rows(layout):
    check_empty_rows("sm90", layout, 64)


@pytest.mark.gpu
def test_sm90_runs_on_the_current_stream():
    check_current_stream("sm90")


@pytest.mark.gpu
def test_sm90_torch_and_jax():
    check_torch_and_jax("sm90", Case(head_dim=128))


@pytest.mark.gpu
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_sm90_bad_lists_under_compile_equal_clean_lists(frontend):
    check_bad_lists_under_compile("sm90", frontend, 64)
