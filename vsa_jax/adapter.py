"""JAX's adapter for the core's value checks and coercions (`vsa_core.frontend`), and the
devices the arrays live on (read by the callbacks, the native launches and the backends)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vsa_core import frontend
from vsa_core.runtime import DeviceInfo


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def default_device():
    """The device a traced call will run on (a tracer has none yet)."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        device = jax.devices(device)[0]
    return device


def device_info_of(device) -> DeviceInfo:
    return frontend.device_info(device.platform, getattr(device, "local_hardware_id", None),
                                getattr(device, "compute_capability", None))


class JaxFrontend(frontend.FrontendAdapter):
    """JAX and numpy arrays."""

    arrays, gpu = "JAX arrays on the CPU", "arrays on a GPU"
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
        """DeviceInfo of the device x lives on; under tracing (no device yet) the default device."""
        if isinstance(x, jax.Array) and not is_tracer(x):
            return device_info_of(next(iter(x.devices())))
        return device_info_of(default_device())


JAX = JaxFrontend()
