"""For the backends that call torch libraries (cute: flash-attn-4; cudnn: cuDNN frontend's
torch wrappers): their arguments as torch tensors, launched on the caller's stream.

Imported only when such a backend runs, so torch loads only then. Under vsa_torch the
buffers already are torch tensors on torch's current stream, and nothing changes. Under
vsa_jax they are `DeviceBuffer`s over XLA's buffers: viewed as torch tensors through
DLPack (zero-copy), and the launches go to the raw stream of the caller's
`raw_cuda_launches` scope, made torch's current stream for the duration
(`vsa_core.runtime.caller_stream`).
"""

from __future__ import annotations

import torch

from ..runtime import DeviceBuffer, caller_stream, current_raw_launch


def as_torch_buffers(buffers: dict, frontends: str) -> dict:
    """A launch's buffers (name -> buffer) with every DeviceBuffer viewed as a torch tensor (the
    same dict when there is none). `frontends` names a buffer the frontend made (never a
    workspace): one adapter made all of those, and the workspaces are torch tensors either way."""
    if not isinstance(buffers[frontends], DeviceBuffer):
        return buffers
    return {n: torch.from_dlpack(x) if isinstance(x, DeviceBuffer) else x for n, x in buffers.items()}


_DTYPES = {"float32": torch.float32, "int32": torch.int32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int8": torch.int8, "uint8": torch.uint8, "int64": torch.int64}


def empty(shape, dtype: str, like):
    """An uninitialised torch tensor of `shape` and `dtype` ("input": like's dtype) on like's
    device (a torch tensor or a DeviceBuffer), from torch's caching allocator on the caller's
    stream (`caller_stream`: under JAX, XLA's), where it is used and then freed."""
    if isinstance(like, DeviceBuffer):
        device = torch.device(like.device.kind, like.device.index) if like.device.kind == "cuda" else "cpu"
        like_dtype = _DTYPES[str(like.dtype)]
    else:
        device, like_dtype = like.device, like.dtype
    dtype = like_dtype if dtype == "input" else _DTYPES[dtype]
    if current_raw_launch() is None:  # torch's current stream is the caller's already
        return torch.empty(shape, dtype=dtype, device=device)
    with caller_stream():
        return torch.empty(shape, dtype=dtype, device=device)


def viewer(bases: dict):
    """The `view` a replay's CuTe DSL steps are given (`vsa_core.replay.CuteStep`): buffer name ->
    (buffer, byte offset of the named buffer in it) in `bases`, each buffer a torch tensor or a
    DeviceBuffer (viewed through DLPack on first use). A view of (name, byte offset, shape,
    strides, dtype) is the buffer's tensor itself where the capture saw that tensor whole, else a
    tensor over the same storage."""
    tensors = {}

    def base_of(name):
        base, start = bases[name]
        t = tensors.get(id(base))
        if t is None:
            t = tensors[id(base)] = torch.from_dlpack(base) if isinstance(base, DeviceBuffer) else base
        return t, start

    def view(name, offset, shape, strides, dtype):
        if isinstance(dtype, str):  # captured from a DeviceBuffer
            dtype = _DTYPES[dtype]
        base, start = base_of(name)
        start += offset
        if start == 0 and base.dtype == dtype and base.shape == shape and base.stride() == strides:
            return base
        storage = base.untyped_storage()
        at = base.data_ptr() + start - storage.data_ptr()
        itemsize = dtype.itemsize
        if at % itemsize:
            raise RuntimeError(f"vsa: replayed buffer {name} at byte {at} is not aligned to its {dtype}")
        return torch.empty(0, dtype=dtype, device=base.device).set_(storage, at // itemsize, shape, strides)
    return view
