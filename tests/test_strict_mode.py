"""Strict mode (VSA_REQUIRE_BACKENDS, tests/common.py): with a GPU, a test that would skip
because a required backend is missing fails instead; a backend that is installed but does
not take the case still skips; without a GPU nothing changes."""

import pytest
import torch

import common


@pytest.fixture
def gpu_machine(monkeypatch):
    """As on a GPU machine whose FA4 is not installed (this one has no flash_attn)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common, "missing", lambda name: "No module named 'flash_attn'" if name == "cute" else None)


def test_missing_required_backend_fails(gpu_machine, monkeypatch):
    monkeypatch.setattr(common, "REQUIRED_BACKENDS", frozenset({"cute", "cudnn"}))
    with pytest.raises(pytest.fail.Exception, match="strict mode .*cute is missing: No module named 'flash_attn'"):
        common.skip_unavailable("cute", "cute backend unavailable: flash_attn.cute cannot be imported")


def test_installed_backend_that_does_not_take_the_case_skips(gpu_machine, monkeypatch):
    monkeypatch.setattr(common, "REQUIRED_BACKENDS", frozenset({"cute", "cudnn"}))
    with pytest.raises(pytest.skip.Exception, match="256-token blocks"):
        common.skip_unavailable("cudnn", "256-token blocks: cuDNN BSA's sm_90 kernels take blocks of (64, 128)")
    common.skip_unavailable("cudnn", None)  # it can run: nothing happens


def test_without_strict_mode_or_without_a_gpu_a_missing_backend_skips(gpu_machine, monkeypatch):
    monkeypatch.setattr(common, "REQUIRED_BACKENDS", frozenset())
    with pytest.raises(pytest.skip.Exception):
        common.skip_unavailable("cute", "cute backend unavailable")
    monkeypatch.setattr(common, "REQUIRED_BACKENDS", frozenset({"cute"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception):
        common.skip_unavailable("cute", "cute backend unavailable")
