"""Backend registry: which implementation runs the fine (block-sparse) stage.

The coarse branch and the sparse metadata always run on the Triton kernels; a
backend provides `sparse_forward(p, FineForward)` / `sparse_backward(p, FineBackward)`
for the fine stage, plus `unavailable_reason(problem, device)` (None when it can run):
the `FineStageBackend` protocol of `base.py`. `backend="auto"`
takes the first available backend of `auto_table.auto_order(problem, device)`: the
fastest first, per (architecture, block size, head dim, dtype), from a measured table,
DEFAULT_ORDER for shapes it has no entry for; `VSA_BACKEND` in the environment
replaces "auto". Asking for a backend by name that cannot run raises
BackendUnavailableError with the reason.
"""

from __future__ import annotations

import functools
from typing import Optional

import os

from ..problem import AttnProblem
from ..runtime import INTERPRETING, DeviceInfo
from . import cudnn_backend, cute_backend, triton_backend
from .auto_table import auto_order

BACKENDS = {"triton": triton_backend, "cute": cute_backend, "cudnn": cudnn_backend}


class BackendUnavailableError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _interpreter_broken() -> Optional[str]:
    """Why Triton's interpreter cannot run here, or None. Triton 3.6's interpreter converts
    shape-(1,) arrays with int(), an error since numpy 2.4 (seen on the H200 machine: triton
    3.6.0, numpy 2.5.2); with numpy < 2.4 it runs, and so do 3.7 - 3.9 with any numpy (CI runs
    a subset on the lowest allowed Triton). The kernels avoid the interpreter's other numpy 2
    trap (an unsigned all-ones filled with the Python int -1: no `~` on unsigned ints)."""
    import numpy
    import triton
    tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
    nv = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    if tv <= (3, 6) and nv >= (2, 4):
        return (f"CPU tensors run under Triton's interpreter, which in triton {triton.__version__} fails with "
                f"numpy {numpy.__version__} (>= 2.4): use triton >= 3.7 or numpy < 2.4 for CPU tensors")
    return None


def _triton_unavailable(problem: AttnProblem, device: DeviceInfo):
    # CPU tensors run the same kernels under Triton's interpreter (slow; for testing)
    if device.kind == "cuda" or INTERPRETING:
        return None
    if device.kind == "cpu":
        return _interpreter_broken()
    return (f"the triton backend runs on CUDA tensors (or, slowly, on CPU tensors under Triton's "
            f"interpreter), got {device.kind} tensors")


triton_backend.unavailable_reason = _triton_unavailable


def check_backend_name(backend) -> None:
    """TypeError / ValueError naming `backend` unless it is "auto" or a registered name."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {('auto',) + tuple(BACKENDS)}, got {backend!r}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + tuple(BACKENDS)}, got {backend!r}")


def backend_named(name: str):
    """The backend module registered as `name` (a resolved name: `OpStatics.backend`)."""
    return BACKENDS[name]


def resolve_backend(backend: str, problem: AttnProblem, device: DeviceInfo, arrays: str = "CPU tensors",
                    gpu: str = "CUDA tensors"):
    """The backend module that runs `problem` on `device`. CPU arrays warn once per process
    that they run under the interpreter (`arrays` / `gpu` name the frontend's arrays)."""
    impl = _resolve(backend, problem, device)
    if device.kind == "cpu" and impl is triton_backend and not INTERPRETING:
        from ..interpreter import warn_interpreted
        warn_interpreted(arrays, gpu)
    return impl


def _resolve(backend: str, problem: AttnProblem, device: DeviceInfo):
    check_backend_name(backend)
    if backend == "auto":
        backend = os.environ.get("VSA_BACKEND", "auto") or "auto"
    if backend == "auto":
        reasons = []
        for candidate in auto_order(problem, device):
            reason = BACKENDS[candidate].unavailable_reason(problem, device)
            if reason is None:
                return BACKENDS[candidate]
            reasons.append(f"{candidate}: {reason}")
        raise BackendUnavailableError("no backend can run this call: " + "; ".join(reasons))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + tuple(BACKENDS)}, got {backend!r}")
    reason = BACKENDS[backend].unavailable_reason(problem, device)
    if reason is not None:
        raise BackendUnavailableError(f"backend={backend!r} cannot run this call: {reason}")
    return BACKENDS[backend]
