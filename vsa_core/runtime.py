"""Device buffers and streams: how a frontend's arrays and streams reach the launchers.

The core imports no framework. A frontend hands `vsa_core.ops` its buffers and stream
through a `BufferAdapter`: `views` turns each buffer into what the launchers and Triton
read (an object with `data_ptr()`, `dtype`, `shape` and `device.type`), and
`launch_scope` makes the launches of one call go to the right device and stream. The
base adapter here takes buffers that already are such views (torch tensors,
`DeviceBuffer`s) and launches on a raw `cudaStream_t` through `raw_cuda_launches`;
`vsa_torch` launches under torch's device and stream contexts instead, `vsa_jax` wraps
XLA's buffers as `DeviceBuffer`s and launches on XLA's stream.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Triton's interpreter keeps global state while it runs a kernel (it patches the
# `triton.language` functions for the duration of a launch), so two threads
# interpreting at once break each other. That happens as soon as a process holds
# several CPU devices: XLA runs each device's buffer callback on its own thread
# (XLA_FLAGS=--xla_force_host_platform_device_count=N). CPU launches therefore
# take this process-wide lock; GPU launches (compiled kernels) never do.
_INTERPRETER_LOCK = threading.RLock()


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu" ("meta": a launch plan's placeholders, vsa_core.plan)
    index: int = 0
    capability: Optional[Tuple[int, int]] = None

    @property
    def type(self) -> str:  # read like torch.device.type by the launchers
        return self.kind


class Dtype(str):
    """A dtype by name ("bfloat16", ...), as Triton reads a pointer's element type
    (`str(dtype)`), with the `itemsize` its TensorDescriptor checks strides with."""

    _ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "int8": 1,
                 "uint8": 1, "bool": 1}

    def __new__(cls, name: str):
        name = str(name).replace("torch.", "")
        if name not in cls._ITEMSIZE:
            raise TypeError(f"unsupported buffer dtype {name}")
        obj = super().__new__(cls, name)
        obj.itemsize = cls._ITEMSIZE[name]
        return obj

    @property
    def is_floating_point(self) -> bool:
        return self.startswith(("float", "bfloat"))


class DeviceBuffer:
    """A contiguous buffer at a raw address: what the launchers and Triton need of an
    array (`data_ptr()`, `dtype`, `shape`, `stride()`, `device`), with no framework.

    On the CPU it also answers the few tensor methods Triton's interpreter calls on a
    pointer argument (`untyped_storage`, `cpu`, `new_empty`, `set_`, `storage_offset`,
    `size`, `copy_`; triton/runtime/interpreter.py, GridExecutor): the interpreter copies
    each argument's storage to the host, runs on the copy and copies it back; a host
    buffer is its own host copy, so the kernels read and write it in place. `owner`
    keeps the memory alive and, where it has `__dlpack__`, lets a backend that needs a
    framework tensor (cute, cudnn: torch) view it.
    """

    __slots__ = ("_ptr", "dtype", "shape", "device", "owner")

    def __init__(self, ptr: int, dtype, shape, device: DeviceInfo, owner=None):
        self._ptr = int(ptr)
        self.dtype = dtype if isinstance(dtype, Dtype) else Dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.device = device
        self.owner = owner

    def data_ptr(self) -> int:
        return self._ptr

    def stride(self, dim: Optional[int] = None):
        strides, step = [], 1
        for size in reversed(self.shape):
            strides.append(step)
            step *= size
        strides = tuple(reversed(strides))
        return strides if dim is None else strides[dim]

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return self.dtype.itemsize

    def __repr__(self) -> str:
        return f"DeviceBuffer({self.dtype}, {self.shape}, {self.device.kind}:{self.device.index}, {self._ptr:#x})"

    # ---- what a framework tensor view needs (backends that call torch libraries) ----
    def __dlpack__(self, *args, **kwargs):
        return self.owner.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.owner.__dlpack_device__()

    # ---- what Triton's interpreter calls (host memory: the buffer is its own host copy) ----
    def untyped_storage(self) -> "DeviceBuffer":
        return self

    def cpu(self) -> "DeviceBuffer":
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.shape

    def new_empty(self, *shape, device=None, **kwargs) -> "DeviceBuffer":
        return DeviceBuffer(0, self.dtype, (0,), self.device, None)

    def set_(self, storage: "DeviceBuffer", offset: int, size, stride) -> "DeviceBuffer":
        self._ptr = storage.data_ptr() + int(offset) * self.dtype.itemsize
        self.shape = tuple(size)
        self.owner = storage.owner
        return self

    def copy_(self, other) -> "DeviceBuffer":
        if other.data_ptr() != self.data_ptr():
            raise RuntimeError("DeviceBuffer.copy_: the interpreter computed on another copy of a host buffer")
        return self


def host_buffer(array, dtype=None) -> DeviceBuffer:
    """A DeviceBuffer over a C-contiguous numpy array (its memory, zero-copy)."""
    if not array.flags.c_contiguous:
        raise ValueError("host_buffer needs a C-contiguous array")
    return DeviceBuffer(array.ctypes.data, dtype or array.dtype.name, array.shape, DeviceInfo("cpu"), array)


# ---- launching on a raw stream without a framework ---------------------------------------
_current = threading.local()  # (device index, capability, stream) of this thread's raw launches


def current_raw_launch() -> Optional[Tuple[int, Tuple[int, int], int]]:
    """(device index, capability, cudaStream_t) while this thread runs `raw_cuda_launches`."""
    return getattr(_current, "launch", None)


@contextlib.contextmanager
def raw_cuda_launches(index: int, capability: Tuple[int, int], stream: int):
    """Triton launches on this thread go to device `index` (compute capability
    `capability`) and the raw `cudaStream_t` `stream`.

    Where torch is already loaded, Triton's own driver reads the device and stream from
    torch, so they are made torch's current ones for the duration (no second driver in a
    process that also launches from torch); without torch, through `triton_shim.install_stream_driver`."""
    saved = current_raw_launch()
    _current.launch = (int(index), tuple(capability), int(stream))
    try:
        if torch_loaded():
            with caller_stream():
                yield
        else:
            # Triton's driver reads device and stream from torch or nowhere: installed once, it
            # reads them from this scope (`triton_shim.install_stream_driver`)
            from .triton_shim import install_stream_driver
            install_stream_driver(current_raw_launch)
            yield
    finally:
        _current.launch = saved


def caller_stream():
    """Inside `raw_cuda_launches` (JAX): torch's current device and stream become the
    scope's, for launches that go through torch (Triton's driver where torch is loaded, the
    libraries of the cute and cudnn backends); elsewhere torch's own are the caller's already.
    Called only where torch is loaded."""
    launch = current_raw_launch()
    if launch is None:
        return contextlib.nullcontext()
    import torch  # loaded already: the callers run where torch is

    index, _, stream = launch
    scope = contextlib.ExitStack()
    scope.enter_context(torch.cuda.device(index))
    scope.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream, device=torch.device("cuda", index))))
    return scope


class BufferAdapter:
    """How a frontend's buffers and stream reach the launchers (see the module doc).

    This base adapter takes buffers that already are launch views (torch tensors,
    DeviceBuffers): CPU launches take the interpreter lock; CUDA launches with a raw
    stream go there (`raw_cuda_launches`, the DeviceBuffer's device must carry its
    capability), without one to Triton's current device and stream."""

    def views(self, buffers: Mapping) -> dict:
        return dict(buffers)

    def launch_scope(self, like, stream: Optional[int]):
        device = like.device
        if device.type == "cpu":
            return _INTERPRETER_LOCK
        if device.type == "cuda" and stream is not None:
            if not isinstance(device, DeviceInfo) or device.capability is None:
                raise ValueError("a launch on a raw stream needs DeviceBuffers whose device carries its capability")
            return raw_cuda_launches(device.index, device.capability, stream)
        return contextlib.nullcontext()


RAW_BUFFERS = BufferAdapter()


def torch_loaded() -> bool:
    """Whether torch is imported in this process (the core never imports it itself)."""
    return sys.modules.get("torch") is not None
