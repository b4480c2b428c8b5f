"""Without a GPU the Triton kernels run under Triton's interpreter: the variable must be
set before triton is first imported, hence here, before anything imports vsa_core."""

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# two CPU devices, so the SPMD tests (shard_map, sharded jit) run without a GPU; XLA reads
# the flag when jax first creates its CPU backend, so it is set before anything imports jax
_HOST_DEVICES = "--xla_force_host_platform_device_count=2"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _HOST_DEVICES).strip()
# the repo root, for runs without an install (the GPU machine: PYTHONPATH-free pytest from tests/)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_cuda() -> bool:
    """torch's answer where torch is installed (it does not import triton); without torch
    (a vsa[jax] install), whether the NVIDIA driver exposes a device."""
    try:
        import torch
    except ImportError:
        return os.path.exists("/dev/nvidia0")
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")
    import common  # noqa: F401  (checks VSA_REQUIRE_BACKENDS before any test runs)


def pytest_report_header(config):
    from common import REQUIRED_BACKENDS
    if REQUIRED_BACKENDS:
        return (f"strict mode: VSA_REQUIRE_BACKENDS={','.join(sorted(REQUIRED_BACKENDS))} "
                + ("(a test that would skip for one of them missing fails)" if HAS_CUDA else "(no GPU: no effect)"))
    return None


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def launch_config():
    """`launch_config(**changes)` changes the launch configuration (`vsa_core.config`) for the
    rest of the test; the configuration before it comes back at teardown."""
    import contextlib

    from vsa_core.config import overridden

    with contextlib.ExitStack() as scopes:
        yield lambda **changes: scopes.enter_context(overridden(**changes))
