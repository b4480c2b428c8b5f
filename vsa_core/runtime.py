"""Device buffers and streams: the one place where the core touches a framework.

Triton launches kernels on objects with `data_ptr()` and reads the current CUDA
stream through torch, so the core views every buffer it is handed (a torch tensor,
or anything with `__dlpack__`, such as the buffers of a JAX buffer_callback) as a
torch tensor, zero-copy, and launches under the caller's stream.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Triton's interpreter keeps global state while it runs a kernel (it patches the
# `triton.language` functions for the duration of a launch), so two threads
# interpreting at once break each other. That happens as soon as a process holds
# several CPU devices: XLA runs each device's buffer callback on its own thread
# (XLA_FLAGS=--xla_force_host_platform_device_count=N). CPU launches therefore
# take this process-wide lock; GPU launches (compiled kernels) never do.
_INTERPRETER_LOCK = threading.RLock()


def as_tensor(buf) -> torch.Tensor:
    """Zero-copy torch view of a device buffer (DLPack)."""
    if buf is None or isinstance(buf, torch.Tensor):
        return buf
    return torch.from_dlpack(buf)


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    index: int = 0
    capability: Optional[Tuple[int, int]] = None

    @staticmethod
    def of(tensor: torch.Tensor) -> "DeviceInfo":
        if tensor.device.type == "cuda":
            idx = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
            return DeviceInfo("cuda", idx, torch.cuda.get_device_capability(idx))
        return DeviceInfo(tensor.device.type)


def launch_stream(stream: Optional[int], device: torch.device):
    """Context under which Triton launches go to `device` and to `stream` (a raw
    cudaStream_t handle; None keeps the framework's current stream, as PyTorch wants;
    JAX passes XLA's stream).

    Triton launches on torch's *current* device, not the tensors' device, so a call on
    cuda:1 while cuda:0 is current must switch device first. On the CPU (the Triton
    interpreter) the context holds the interpreter lock: one call's launches at a time
    per process.
    """
    if device.type != "cuda":
        return _INTERPRETER_LOCK
    scope = contextlib.ExitStack()
    scope.enter_context(torch.cuda.device(device))
    if stream is not None:
        scope.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)))
    return scope
