"""Backend registry: which implementation runs the fine (block-sparse) stage.

The coarse branch and the sparse metadata always run on the Triton kernels; a
backend provides `sparse_forward(launcher, p, FineForward)` / `sparse_backward(launcher, p,
FineBackward)` for the fine stage, plus `unavailable_reason(problem, device)` (None when it can run):
the `FineStageBackend` protocol of `base.py`. A backend with CuTe DSL launches of its own declares
them in its module's `CUTE_STEPS` (step -> its eager function), which `Launcher.cute` finds
here (`cute_step`). `backend="auto"`
takes the first available backend of `auto_table.auto_order(problem, device)`: the
fastest first, per (architecture, block size, head dim, dtype), from a measured table,
DEFAULT_ORDER for shapes it has no entry for; the configured backend (`VSA_BACKEND`,
`vsa_core.config`) replaces "auto". Asking for a backend by name that cannot run raises
BackendUnavailableError with the reason.

`REGISTRY` (`registry.py`) is the one list of backends (the frontends' docstrings, the tests, demo.py and
the benchmarks read it): a new backend is its module, one line there and its measured
`auto_table` rows. Backend modules are imported on first use, so a backend whose module
does not import (a broken library install) is unavailable with that error as its reason
instead of breaking `import vsa_core`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Optional

from ..config import config
from ..problem import AttnProblem
from ..runtime import INTERPRETING, DeviceInfo
from .auto_table import auto_order

from .registry import CHOICES, FINE_OUTPUT_IN_INPUT_DTYPE, NAMES, REGISTRY  # noqa: F401 (the registry's names)


def fine_residual(name: str) -> str:
    """`AttnProblem.fine_residual` of backend `name`: "input" (a library's fine output) or "rounding"
    (our kernels': out's rounding residual)."""
    return "input" if name in FINE_OUTPUT_IN_INPUT_DTYPE else "rounding"


def names_text(names=CHOICES) -> str:
    """'"auto", "triton", "cute" or "cudnn"': the names as a docstring or a message lists them."""
    quoted = [f'"{n}"' for n in names]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


class _Backends(Mapping):
    """REGISTRY's modules by name, each imported when first asked for."""

    def __getitem__(self, name):
        return importlib.import_module(REGISTRY[name])

    def __iter__(self):
        return iter(REGISTRY)

    def __len__(self):
        return len(REGISTRY)


BACKENDS = _Backends()


@functools.lru_cache(maxsize=None)
def import_error(name: str) -> Optional[str]:
    """Why backend `name`'s module does not import (None when it does)."""
    try:
        BACKENDS[name]
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def library_error(name: str) -> Optional[str]:
    """Why the library behind backend `name` cannot be used on this machine (None when it can, or
    when it calls none): its module's `library_error()`, or the module's own import error."""
    err = import_error(name)
    if err is not None:
        return err
    probe = getattr(BACKENDS[name], "library_error", None)
    return probe() if probe is not None else None


def unavailable_reason(name: str, problem: AttnProblem, device: DeviceInfo) -> Optional[str]:
    """None when backend `name` can run `problem` on `device`, else why not."""
    err = import_error(name)
    if err is not None:
        return f"its module {REGISTRY[name]} does not import ({err})"
    return BACKENDS[name].unavailable_reason(problem, device)


_STEP_OWNERS = {}  # CuTe DSL launch step -> the backend module that declares it


def cute_step(step: str):
    """The eager function of CuTe DSL launch `step` (`Launcher.cute`): the entry of the
    `CUTE_STEPS` of the registered backend module that declares it. The owner is looked up
    once; the function is read from the module's table on every call."""
    module = _STEP_OWNERS.get(step)
    if module is None:
        module = _STEP_OWNERS[step] = _step_owner(step)
    return module.CUTE_STEPS[step]


def _step_owner(step: str):
    known, broken = [], []
    for name in REGISTRY:
        err = import_error(name)
        if err is not None:
            broken.append(f"{name}: {err}")
            continue
        steps = getattr(BACKENDS[name], "CUTE_STEPS", {})
        if step in steps:
            return BACKENDS[name]
        known.extend(steps)
    unread = f"; backend modules that do not import: {'; '.join(broken)}" if broken else ""
    raise ValueError(f"unknown CuTe DSL launch step {step!r} (known: {sorted(known)}){unread}")


class BackendUnavailableError(RuntimeError):
    pass


def check_backend_name(backend) -> None:
    """TypeError / ValueError naming `backend` unless it is "auto" or a registered name."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {CHOICES}, got {backend!r}")
    if backend != "auto" and backend not in REGISTRY:
        raise ValueError(f"backend must be one of {CHOICES}, got {backend!r}")


def backend_named(name: str):
    """The backend module registered as `name` (a resolved name: `OpStatics.backend`)."""
    return BACKENDS[name]


def resolve_backend(backend: str, problem: AttnProblem, device: DeviceInfo, arrays: str = "CPU tensors",
                    gpu: str = "CUDA tensors"):
    """The backend module that runs `problem` on `device`. CPU arrays warn once per process
    that they run under the interpreter (`arrays` / `gpu` name the frontend's arrays)."""
    impl = _resolve(backend, problem, device)
    if device.kind == "cpu" and impl.name == "triton" and not INTERPRETING:
        from ..interpreter import warn_interpreted
        warn_interpreted(arrays, gpu)
    return impl


def _resolve(backend: str, problem: AttnProblem, device: DeviceInfo):
    check_backend_name(backend)
    if backend == "auto":
        backend = config().backend
    if backend == "auto":
        reasons = []
        for candidate in auto_order(problem, device):
            reason = unavailable_reason(candidate, problem, device)
            if reason is None:
                return BACKENDS[candidate]
            reasons.append(f"{candidate}: {reason}")
        raise BackendUnavailableError("no backend can run this call: " + "; ".join(reasons))
    if backend not in REGISTRY:
        raise ValueError(f"backend must be one of {CHOICES}, got {backend!r}")
    reason = unavailable_reason(backend, problem, device)
    if reason is not None:
        raise BackendUnavailableError(f"backend={backend!r} cannot run this call: {reason}")
    return BACKENDS[backend]
