"""torch's adapter for the core's checks, coercions and call paths (`vsa_core.frontend`)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from vsa_core.frontend import FrontendAdapter
from vsa_core.problem import AttnProblem
from vsa_core.runtime import DeviceInfo

from . import ops


class TorchFrontend(FrontendAdapter):
    """torch tensors for the core's checks and coercions (`vsa_core.frontend`)."""

    array_types, array_kind = (Tensor,), "a torch.Tensor"
    offsets_are_arrays = True

    def counts_array(self, name: str, counts) -> Tensor:
        # a tensor before anything reads its shape or dtype: torch.compile traces a numpy array
        # (e.g. `meta.variable_block_sizes`) as a tensor and cannot read the array's own
        # attributes, while torch.as_tensor of it traces
        if isinstance(counts, Tensor):
            return counts
        try:
            return torch.as_tensor(counts)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a 1-D integer array (numpy, torch or a list of ints), "
                            f"got {type(counts).__name__}") from None

    def call_key(self, statics: tuple, *arrays):
        if torch.compiler.is_compiling():
            return None
        described = []
        for x in arrays:
            if x is None:
                described.append(None)
            elif isinstance(x, Tensor):
                described.append((x.shape, x.stride(), x.dtype, x.device))
            else:  # a list or numpy array: converted per call, not memoized
                return None
        types = tuple(map(type, statics))
        if _SCALAR_TYPES.issuperset(types):  # the usual call: the values and their types, no walk
            return statics, types, tuple(described)
        if not all(_plain(v) for v in statics):
            return None
        return tuple(_typed(v) for v in statics), tuple(described)

    def concrete(self, *xs) -> bool:
        return not torch.compiler.is_compiling()  # compiled: the kernels read the values on the device only

    def host(self, x) -> np.ndarray:
        return x.detach().cpu().numpy()

    def version(self, x):
        # host tensors are checked on every call: reading them costs no device sync, and one
        # that aliases numpy memory (torch.from_numpy) can change through numpy without
        # torch's version counter seeing it
        return None if x.device.type == "cpu" else x._version

    def as_array(self, x) -> Tensor:
        return x if isinstance(x, Tensor) else torch.as_tensor(x)

    def is_integer(self, x) -> bool:
        return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)

    def int32(self, x: Tensor, like: Tensor) -> Tensor:
        return x.to(device=like.device, dtype=torch.int32).contiguous()

    def device_info(self, x: Tensor) -> DeviceInfo:
        return ops.device_info(x)

    def attend(self, p: AttnProblem, backend: str, named: dict) -> tuple:
        out, lse, *_ = ops.attend(p, backend, named)
        return out, lse

    def operands(self, packed: bool, **arrays) -> dict:
        return {n: None if x is None else x.contiguous()[None] if packed else x.contiguous() for n, x in arrays.items()}

    def check_devices(self, like: Tensor, **tensors) -> None:
        for name, t in tensors.items():
            if t is not None and t.device != like.device:
                raise ValueError(f"{name} must be on q's device ({like.device}), got {t.device}")

    def count_values(self, x: Tensor) -> np.ndarray:
        return np.array([int(b) for b in torch.aminmax(x.to(torch.int64))])  # one device sync, not a copy

    def counts_readable(self, name: str, counts: Tensor, like: Tensor) -> bool:
        if torch.compiler.is_compiling():
            return False
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            # CUDA-graph capture: a host read of device counts or a copy of host counts to the
            # device synchronises, which breaks the capture. The values were checked on the
            # eager warm-up call that capture needs anyway; shapes and dtypes still are.
            if not counts.is_cuda:
                raise ValueError(f"{name} must be a CUDA tensor while a CUDA graph is being captured (host "
                                 f"counts would be copied to the device with a synchronisation), got {counts.device}")
            return False
        return True

    def index_lists_valid(self, idx: Tensor, num: Tensor, n_kv_blocks: int) -> Optional[bool]:
        """On the device the rows are checked there and one flag comes back (one sync per new
        or modified pair of lists)."""
        if idx.device.type == "cpu":
            return None
        cap = idx.shape[-1]
        num64 = num.to(torch.int64)
        live = torch.arange(cap, device=idx.device) < num64.clamp(0, cap)[..., None]
        bad = ((num64 < 0) | (num64 > cap)).any()
        bad |= (live & ((idx < 0) | (idx >= n_kv_blocks))).any()
        bad |= (live[..., 1:] & (idx[..., 1:] <= idx[..., :-1])).any()
        return not bool(bad)


# the static arguments a memo keys on by value and exact type (2 and 2.0, True and 1 key apart:
# the checks tell them apart); tuples of them are keyed element by element (`_typed`)
_SCALAR_TYPES = frozenset((type(None), bool, int, float, str))


def _plain(v) -> bool:
    """A static argument a memo may key on: its value, not its identity, is what the checks read."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, tuple) and all(_plain(x) for x in v)


def _typed(v):
    """v with its type (and its elements'), so that 2 and 2.0 or True and 1 key apart: the
    checks tell them apart."""
    return (tuple, tuple(_typed(x) for x in v)) if isinstance(v, tuple) else (type(v), v)


TORCH = TorchFrontend()
