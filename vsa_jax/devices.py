"""The devices JAX arrays live on, as the core describes them (`vsa_core.runtime.DeviceInfo`)."""

from __future__ import annotations

import functools

import jax

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


def device_info(x) -> DeviceInfo:
    """DeviceInfo of the device x lives on; under tracing (no device yet) the default device."""
    if isinstance(x, jax.Array) and not is_tracer(x):
        return device_info_of(next(iter(x.devices())))
    return device_info_of(default_device())


@functools.lru_cache(maxsize=None)
def cuda_device(index: int) -> DeviceInfo:
    """DeviceInfo (with its capability) of the CUDA device with this ordinal."""
    for device in jax.local_devices():
        if device.platform in ("gpu", "cuda") and getattr(device, "local_hardware_id", None) == index:
            return device_info_of(device)
    raise RuntimeError(f"no local JAX GPU has CUDA ordinal {index}")
