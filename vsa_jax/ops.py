"""JAX glue: `jax.custom_vjp` functions whose forward and backward are
`buffer_callback`s over `vsa_core.ops`.

Each callback runs inside the compiled XLA program on XLA's own buffers: the inputs,
and outputs + workspaces declared from the problem's buffer tables (so XLA allocates
everything; the callback allocates nothing). The core sees the buffers as
`DeviceBuffer`s (their addresses; no torch) and launches on XLA's CUDA stream
(`ctx.stream`), so the kernels are ordered with the surrounding XLA ops without any
synchronisation.
Inputs are only read; nothing is kept past the callback.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from vsa_core import ops as core_ops
from vsa_core.api import op_statics
from vsa_core.backends import backend_named
from vsa_core.config import config
from vsa_core.problem import AttnProblem
from vsa_core.replay import CapturingLauncher, Replay
from vsa_core.runtime import BufferAdapter, DeviceBuffer, DeviceInfo
from vsa_core.spec import (AXES, PUBLIC_NAMES, OpStatics, backward_arguments, backward_inputs, forward_arguments,
                           forward_inputs, forward_results, input_gradients)

from . import native as _native
from . import spmd as _spmd
from .devices import cuda_device, device_info, device_info_of  # noqa: F401  (device_info_of: read by tests, the demo)

_DLPACK_CPU = 1  # kDLCPU
_CPU = DeviceInfo("cpu")


def _shape_dtypes(specs: dict, input_dtype) -> dict:
    return {name: jax.ShapeDtypeStruct(shape, input_dtype if dt == "input" else jnp.dtype(dt))
            for name, (shape, dt) in specs.items()}


def _device_buffer(buf) -> DeviceBuffer:
    """A buffer_callback buffer as the launchers read it: its address, dtype and shape. Host
    buffers are read through numpy (zero-copy), device buffers through
    __cuda_array_interface__."""
    kind, index = buf.__dlpack_device__()
    dtype = np.dtype(buf.dtype).name
    if kind == _DLPACK_CPU:
        return DeviceBuffer(np.asarray(buf).ctypes.data, dtype, buf.shape, _CPU, owner=buf)
    return DeviceBuffer(buf.__cuda_array_interface__["data"][0], dtype, buf.shape, cuda_device(index), owner=buf)


class JaxBuffers(BufferAdapter):
    """XLA's buffers as DeviceBuffers; launches on XLA's stream (`raw_cuda_launches`)."""

    def views(self, buffers) -> dict:
        return {name: buf if buf is None or isinstance(buf, DeviceBuffer) else _device_buffer(buf)
                for name, buf in buffers.items()}


JAX_BUFFERS = JaxBuffers()


def _stream(ctx, q) -> Optional[int]:
    """XLA's CUDA stream; None on the CPU, where `ctx.stream` raises."""
    return None if q.__dlpack_device__()[0] == _DLPACK_CPU else ctx.stream


class _Replays:
    """A callback's stage launches, captured once per key and replayed after (`vsa_core.replay`):
    on a CUDA device, for a backend that declares itself replayable, with `config().replay` on.
    The key holds what a capture depends on besides the problem (fixed per callback): the launch
    configuration, the device, each buffer's 16-byte alignment and which buffers share an
    address. The first call of a key runs (and may time tile candidates), the second captures,
    the rest replay: the Triton launches by address, the CuTe DSL steps on torch views of XLA's
    buffers, the backend's workspaces in one torch allocation on XLA's stream."""

    LIMIT = 64

    def __init__(self, stage: str, p: AttnProblem, impl):
        self.run = core_ops.forward if stage == "forward" else core_ops.backward
        self.p, self.impl = p, impl
        self.entries: dict = {}

    def __call__(self, buffers: dict, stream: Optional[int]) -> None:
        b = JAX_BUFFERS.views(buffers)
        q = b["q"]
        if stream is None or not getattr(self.impl, "replayable", False) or not config().replay:
            return self.run(self.p, self.impl, b, stream=stream, adapter=JAX_BUFFERS)
        present = [(n, x) for n, x in b.items() if x is not None]
        ptrs = [x.data_ptr() for _, x in present]
        first = {}
        key = (config(), q.device.index, tuple(n for n, _ in present), tuple(ptr % 16 == 0 for ptr in ptrs),
               tuple(first.setdefault(ptr, i) for i, ptr in enumerate(ptrs)))
        entry = self.entries.get(key)
        if isinstance(entry, Replay):
            return self._replay(entry, b, stream)
        if entry is True:
            launcher = CapturingLauncher(b)  # the stage's own workspaces are XLA's buffers, as every call's
            self.run(self.p, self.impl, b, stream=stream, adapter=JAX_BUFFERS, launcher=launcher)
            replay, why = launcher.replay()
            self.entries[key] = replay if replay is not None else why
            return None
        self.run(self.p, self.impl, b, stream=stream, adapter=JAX_BUFFERS)
        if entry is None:
            if len(self.entries) >= self.LIMIT:
                self.entries.clear()
            self.entries[key] = True
        return None

    @staticmethod
    def _replay(entry: Replay, b: dict, stream: int) -> None:
        addresses = {n: b[n].data_ptr() for n in entry.buffers}
        with JAX_BUFFERS.launch_scope(b["q"], stream):
            space, view = None, None
            if entry.workspace_bytes or entry.needs_views:
                from vsa_core.backends._torch_views import empty, viewer  # torch: the backends that need it
                space = empty((max(entry.workspace_bytes, 1),), "uint8", b["q"])  # on XLA's stream
                for name, offset in entry.workspace:
                    addresses[name] = space.data_ptr() + offset
                if entry.needs_views:
                    bases = {n: (x, 0) for n, x in b.items() if x is not None}
                    bases.update((n, (space, offset)) for n, offset in entry.workspace)
                    view = viewer(bases)
            entry.launch(addresses, stream, view)


def callback_replays() -> list:
    """Every callback's replays (for tests): (stage, problem, backend name, {key: entry})."""
    return [(stage, p, impl.name, cb.replays.entries) for (stage, p, impl), cb in _CALLBACKS.items()]


_CALLBACKS: dict = {}


@functools.lru_cache(maxsize=None)
def _callback(stage: str, p: AttnProblem, impl):
    """One callback object per (stage, problem, backend): jit caches key on it, so
    eager (un-jitted) calls of the same problem reuse the compiled executable."""
    replays = _Replays(stage, p, impl)

    def callback(ctx, outputs: dict, inputs: dict) -> None:
        replays({**inputs, **outputs}, _stream(ctx, inputs["q"]))

    # vmap_method="sequential": under jax.vmap the callback runs once per mapped element
    # (a scan over the mapped axis) on slices that have exactly the shapes `p` was
    # described with. The kernels' buffers are fixed by `p`, so "broadcast_all" /
    # "expand_dims" (one call on arrays with an extra leading axis) would hand them
    # arrays they do not describe; folding the axis into the batch would also be wrong
    # when the counts or the selection differ per element.
    specs = p.forward_buffers() if stage == "forward" else p.backward_buffers()
    dtype = jnp.dtype(p.dtype)
    wrapped = buffer_callback(callback, _shape_dtypes(specs, dtype), vmap_method="sequential")
    callback.replays = replays
    _CALLBACKS[(stage, p, impl)] = callback
    return wrapped


# ---- varying manual axes (jax.shard_map with check_vma) -------------------------------------
# Inside shard_map every value's type says over which manual mesh axes it varies (its
# "vma"). A buffer_callback's results carry none (they are typed as invariant), but
# each device computes its own values: they vary exactly as the inputs do. So the
# inputs are first made to vary alike (outside the custom_vjp, where JAX's own
# transpose of the cast sums the gradient of an input that did not vary), and every
# callback result is cast to that common vma.
def _vma(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying; later versions: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary(x, axes: frozenset):
    """x, cast to vary over `axes` (a superset of its own vma)."""
    missing = tuple(a for a in axes if a not in _vma(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _vary_alike(*xs):
    """The arrays of xs (None kept), each cast to vary over the union of their vmas."""
    axes = frozenset().union(*(_vma(x) for x in xs if x is not None))
    return tuple(None if x is None else _vary(x, axes) for x in xs)


def _run(stage: str, p: AttnProblem, impl, **inputs) -> dict:
    """Runs one stage; returns every output and workspace of its buffer table, typed
    as varying like its inputs (which vary alike, see _vary_alike). The native launch
    (`vsa_jax.native.selected`: by default on a CUDA device) replays the stage's launch plan as
    XLA custom calls (no Python per call); under jax.vmap the default runs the callback."""
    inputs = {n: x for n, x in inputs.items() if x is not None}
    axes = frozenset().union(*(_vma(x) for x in inputs.values()))
    if _native.selected(impl, inputs["q"], stage, p):
        results = _native.run(stage, p, inputs, impl.name, fallback=_callback(stage, p, impl))
    else:
        results = _callback(stage, p, impl)(inputs)
    return {n: _vary(x, axes) for n, x in results.items()}


# ---- the operator: one custom_vjp for every call -------------------------------------------
# The arrays are a tuple named by the core's tables (`vsa_core.spec`), the statics the one
# static argument. It returns (out, lse); lse is not differentiable (the frontends stop its
# gradient; VSA's callers drop it).
def statics_for(p: AttnProblem, backend: str, q) -> OpStatics:
    """The statics of a checked call on q's device (the backend resolved there)."""
    return op_statics(p, backend, device_info(q), arrays="JAX arrays on the CPU", gpu="arrays on a GPU")


def attend(statics: OpStatics, named: dict):
    """(out, lse) of the inputs named as `vsa_core.spec.forward_inputs(statics)` says."""
    return _attend(statics, _vary_alike(*(named[n] for n in forward_inputs(statics))))


# the spmd split's kind of each axes class of `vsa_core.spec.AXES`
_SPLIT_KINDS = {"bh": "bh", "blocks": "replicated"}


def attend_split(statics: OpStatics, named: dict):
    """`attend`, split over the devices when the arrays are sharded over batch / heads (see
    vsa_jax.spmd); on one device (or inside a shard_map) the plain call. Not for packed calls."""
    names = forward_inputs(statics)
    kinds = tuple(_SPLIT_KINDS.get(AXES[n], statics.layout) for n in names)
    args = tuple(named[n] for n in names)
    split = _spmd.plan_split(statics.layout, statics.block_elems,
                             {PUBLIC_NAMES[n]: (x, kind) for n, x, kind in zip(names, args, kinds)})
    if split is None:
        return attend(statics, named)
    return _spmd.run_split(lambda *xs: attend(statics, dict(zip(names, xs))), split, args, kinds,
                           (statics.layout, "bh"))


def _forward(statics: OpStatics, arrays: tuple, training: bool):
    s = dataclasses.replace(statics, training=training)
    p, named = forward_arguments(s, arrays)
    return s, p, named, _run("forward", p, backend_named(s.backend), **named)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(statics: OpStatics, arrays: tuple):
    """Primal (no gradient asked for): the inference forward, nothing kept for a backward."""
    results = _forward(statics, arrays, training=False)[3]
    return results["out"], results["lse"]


def _attend_fwd(statics: OpStatics, arrays: tuple):
    s, p, named, results = _forward(statics, arrays, training=True)
    kept = tuple(named[n] for n in backward_inputs(s))
    return (results["out"], results["lse"]), (kept, tuple(results[n] for n in forward_results(p)))


def _attend_bwd(statics: OpStatics, residuals, cotangents):
    s = dataclasses.replace(statics, training=True)
    kept, results = residuals
    p, named = backward_arguments(s, kept, results, cotangents[0])
    # None: no cotangent for the integer counts, offsets, selections and prefix counts (JAX
    # makes them float0 zeros)
    return (input_gradients(s, _run("backward", p, backend_named(s.backend), **named)),)


_attend.defvjp(_attend_fwd, _attend_bwd)
