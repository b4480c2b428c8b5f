"""What the backends on an optional NVIDIA library (cute, cudnn, sm90) share in their
`unavailable_reason`: the GPU check first, the library last.

The library is imported on the first call that gets that far and never at `import vsa_core`
(a missing or broken install makes its backend unavailable, with the error as the reason, and
breaks nothing else), once per process: `unavailable_reason` runs on every call whose backend
is resolved. The GPU and shape checks come before it so that a call the backend could not run
anyway does not import the library.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

from ..runtime import DeviceInfo


def library_probe(load: Callable[[], Optional[str]]) -> Callable[[], Optional[str]]:
    """`load` (a function that imports a backend's library and returns None, or why the library
    it found cannot be used) as the backend's cached probe: None when the library can be used,
    else why not, an exception raised by `load` as "Type: message"."""

    @functools.lru_cache(maxsize=None)
    @functools.wraps(load)
    def probe() -> Optional[str]:
        try:
            return load()
        except Exception as e:  # ImportError, or a cutlass-dsl / CUDA setup that fails at import
            return f"{type(e).__name__}: {e}"

    return probe


def gpu_reason(device: DeviceInfo, runs_on: Callable[[Tuple[int, int]], bool], kernels: str) -> Optional[str]:
    """None when `device` is an NVIDIA GPU whose compute capability satisfies `runs_on`, else why
    not; `kernels` says what the backend's kernels run on ("its kernels are sm_90a code
    (H100/H200)"), followed by this GPU's architecture."""
    if device.kind != "cuda":
        return f"it runs on NVIDIA GPUs only, the tensors are on {device.kind}"
    cap = tuple(device.capability or (0, 0))
    if not runs_on(cap):
        return f"{kernels}; this GPU is sm_{cap[0]}{cap[1]}"
    return None


def library_reason(library: str, error: Optional[str], install_hint: str) -> Optional[str]:
    """None when `error` (a `library_probe`'s answer) is None, else that `library` cannot be used,
    why, and what to install."""
    if error is None:
        return None
    return f"{library} cannot be used ({error}); install it: {install_hint}"
