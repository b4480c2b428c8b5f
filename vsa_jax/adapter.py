"""JAX's adapter for the core's checks, coercions and call paths (`vsa_core.frontend`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vsa_core import frontend
from vsa_core.problem import AttnProblem
from vsa_core.runtime import DeviceInfo

from . import ops
from .devices import device_info, is_tracer


class JaxFrontend(frontend.FrontendAdapter):
    """JAX and numpy arrays."""

    array_types, array_kind = (jax.Array, np.ndarray), "a jax.Array"

    def counts_array(self, name: str, counts):
        # a torch tensor here would otherwise fail deep inside numpy without naming the argument
        if not isinstance(counts, (jax.Array, np.ndarray, list, tuple)):
            raise TypeError(f"{name} must be a 1-D integer numpy or JAX array (or a list of ints), "
                            f"got {type(counts).__module__}.{type(counts).__name__}")
        return counts

    def concrete(self, *xs) -> bool:
        return not any(is_tracer(x) for x in xs)  # under jit only shapes and dtypes are known

    def host(self, x) -> np.ndarray:
        return np.asarray(x)

    def version(self, x):
        return 0 if isinstance(x, jax.Array) else None  # a concrete jax.Array is immutable; numpy is not

    def as_array(self, x):
        return x if hasattr(x, "dtype") else np.asarray(x)

    def is_integer(self, x) -> bool:
        return np.dtype(x.dtype).kind in "iu"

    def int32(self, x, like) -> jax.Array:
        return jnp.asarray(x, dtype=jnp.int32)

    def operands(self, packed: bool, **arrays) -> dict:
        # packed: [total, H, D] -> [1, total, H, D] (BSHD, batch 1), a free reshape
        return {n: None if x is None else jnp.asarray(x)[None] if packed else jnp.asarray(x) for n, x in arrays.items()}

    def device_info(self, x) -> DeviceInfo:
        return device_info(x)

    def attend(self, p: AttnProblem, backend: str, named: dict) -> tuple:
        statics = ops.statics_for(p, backend, named["q"])
        # the offsets of a packed call have no batch or heads axis to split a call along
        out, lse = ops.attend(statics, named) if p.varlen else ops.attend_split(statics, named)
        return out, jax.lax.stop_gradient(lse)


JAX = JaxFrontend()
