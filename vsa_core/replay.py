"""A stage's launches kept once and replayed on new buffers: the thin eager path.

An eager call re-derives every launch from the problem: the stage functions build each
kernel's arguments, Triton binds and specializes them and looks its binary up. For a
problem seen before all of that gives the same result except the buffers' addresses.
`CapturingLauncher` runs a stage's launches exactly as the eager launcher does and keeps
each one as a `TritonStep`: the compiled kernel Triton returned, the grid, and every
argument as a constant or as (buffer name, byte offset) into the call's named buffers
(a TMA descriptor as its base's buffer and its geometry). A backend's own CuTe DSL launch
(`launcher.cute`) is kept as a `CuteStep`: the step, its statics, and each buffer as
(buffer name, byte offset, geometry); its scratch buffers (`launcher.workspace`) become
workspaces of the replay. `Replay.run` then launches those binaries on another call's
buffers with one Python call per launch, and calls each CuTe DSL step's function again on
views of the new buffers (the step does its per-call host work itself: its checks, its
compiled kernel's lookup).

A capture is valid only for calls that would make the same launches: the same problem and
statics, the same buffer shapes, strides and dtypes, the same 16-byte alignment of every
buffer (Triton specializes pointers on it), the same device and launch configuration, the same
buffers being one object (a launch's pointer is named by the first name of its object). The
frontend keys its replays on exactly that (`vsa_torch.ops`). A stage is captured only when
every launch went through this launcher to memory the call's buffers (or its workspaces)
hold (`Replay` is then returned; otherwise the reason it cannot be): a backend that launches
anything else (a library call outside `launcher.cute`) is never replayed, only run.

Autotuning times candidate tiles through the launcher the first time a problem is seen; a
frontend therefore captures on a later call, when the tile store already answers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple

from .backends import cute_step
from .launch import Launcher
from .triton_shim import compiled_launcher

_WORKSPACE_ALIGN = 256  # each workspace buffer starts as aligned as an allocation of its own would


class _Address:
    """What a TMA descriptor reads of its base: the address and the element type."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype):
        self._ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._ptr


@dataclass(frozen=True)
class TritonStep:
    """One launch: `runner(*args, stream=...)` of the compiled kernel on `grid`
    (`triton_shim.compiled_launcher`), with the arguments `constants` except at `pointers`
    ((position, buffer name, byte offset): a pointer parameter) and `descriptors` ((position,
    buffer name, byte offset, descriptor fields): a TMA descriptor rebuilt on the new address)."""

    name: str
    runner: Any
    constants: Tuple[Any, ...]
    pointers: Tuple[Tuple[int, str, int], ...]
    descriptors: Tuple[Tuple[int, str, int, Any], ...]

    def launch(self, addresses: Mapping[str, int], stream: int) -> None:
        args = list(self.constants)
        for i, name, offset in self.pointers:
            args[i] = addresses[name] + offset
        for i, name, offset, desc in self.descriptors:
            args[i] = _rebased(desc, _Address(addresses[name] + offset, desc.base.dtype))
        self.runner(*args, stream=stream)


@dataclass(frozen=True)
class CuteStep:
    """One of a backend's CuTe DSL launches (`Launcher.cute`): the step's eager function
    (`vsa_core.backends.cute_step`) called with `statics` on buffers built by the replay's
    `view` from `args`: (argument, buffer name, byte offset, shape, strides, dtype) each (the
    name None for an argument passed as None)."""

    name: str
    statics: Tuple[Tuple[str, Any], ...]
    args: Tuple[Tuple[str, str, int, tuple, tuple, Any], ...]

    def launch(self, addresses: Mapping[str, int], stream: int, view=None) -> None:
        if view is None:
            raise ValueError(f"replaying CuTe DSL step {self.name} needs a view of the buffers (Replay.needs_views)")
        buffers = {arg: None if name is None else view(name, offset, shape, strides, dtype)
                   for arg, name, offset, shape, strides, dtype in self.args}
        cute_step(self.name)(buffers, **dict(self.statics))


def _rebased(desc, base):
    """desc on another base of the same alignment, without re-running its constructor's
    checks (they passed at capture, and nothing they read has changed: the replay's key holds
    the base's alignment and the geometry is the captured one)."""
    out = object.__new__(type(desc))
    out.__dict__.update(desc.__dict__)
    out.base = base
    return out


@dataclass(frozen=True)
class Replay:
    """A stage's launches in order. `buffers`: the names whose addresses they read from the
    call's buffers; `workspace`: (name, byte offset) of the buffers that live in one
    workspace allocation instead (`workspace_bytes` long), whose contents do not outlive the
    stage."""

    steps: Tuple[Any, ...]  # TritonStep, CuteStep
    buffers: Tuple[str, ...]
    workspace: Tuple[Tuple[str, int], ...] = ()
    workspace_bytes: int = 0

    @property
    def workspace_names(self) -> frozenset:
        return frozenset(n for n, _ in self.workspace)

    @property
    def needs_views(self) -> bool:
        """Whether a step needs framework views of the buffers (a CuTe DSL step), not only
        their addresses."""
        return any(isinstance(s, CuteStep) for s in self.steps)

    def run(self, buffers: Mapping[str, Any], stream: int, workspace: int = 0, view=None) -> None:
        """Launches every step on `buffers` (name -> anything with `data_ptr()`) and the
        workspace allocation at address `workspace`, on `stream`."""
        addresses = {n: buffers[n].data_ptr() for n in self.buffers}
        for name, offset in self.workspace:
            addresses[name] = workspace + offset
        self.launch(addresses, stream, view)

    def launch(self, addresses: Mapping[str, int], stream: int, view=None) -> None:
        """Launches every step on buffers given by address (name -> int; the workspace's
        names included): for a frontend that knows addresses without an object per buffer
        (buffers placed in one allocation of its own). `view(name, byte offset, shape,
        strides, dtype)`: a framework buffer over that memory, for the CuTe DSL steps
        (`needs_views`)."""
        for step in self.steps:
            if isinstance(step, CuteStep):
                step.launch(addresses, stream, view)
            else:
                step.launch(addresses, stream)


class CapturingLauncher(Launcher):
    """Launches like the eager launcher and keeps each launch for `Replay` (module doc).
    `buffers`: the call's named buffers (inputs, outputs, workspaces) as the launches get them;
    `workspaces`: those whose contents do not outlive the stage, which a replay places in one
    allocation."""

    def __init__(self, buffers: Mapping[str, Any], workspaces: Sequence[str] = ()):
        self._workspaces = {n: _nbytes(buffers[n]) for n in workspaces if buffers.get(n) is not None}
        self._regions = []
        self._names = {}  # id(buffer) -> its first name (the frontend keys on which names share an object)
        for name, b in buffers.items():
            if b is not None and hasattr(b, "data_ptr"):
                start = b.data_ptr()
                self._regions.append((start, start + _nbytes(b), name))
                self._names.setdefault(id(b), name)
        self._steps = []
        self._held = []  # the workspaces this capture allocated: alive until the stage is done
        self._unreplayable: Optional[str] = None

    def triton(self, kernel, grid, *args, **meta) -> None:
        compiled = kernel[grid](*args, **meta)
        if self._unreplayable is None:
            self._keep(kernel, compiled, grid, args, meta)

    def cute(self, step: str, buffers: dict, **statics) -> None:
        super().cute(step, buffers, **statics)
        if self._unreplayable is not None:
            return
        args = []
        for arg, x in buffers.items():
            if x is None:
                args.append((arg, None, 0, None, None, None))
                continue
            place = self._place(x)
            if place is None:
                return self._refuse(f"{step}'s {arg} is memory outside the call's buffers")
            strides = x.stride() if callable(getattr(x, "stride", None)) else None
            args.append((arg, *place, tuple(x.shape), None if strides is None else tuple(strides), x.dtype))
        self._steps.append(CuteStep(step, tuple(statics.items()), tuple(args)))

    def workspace(self, name: str, shape, dtype: str, like):
        """The eager workspace, which the replay places in its workspace allocation."""
        x = super().workspace(name, shape, dtype, like)
        if any(r[2] == name for r in self._regions):
            self._refuse(f"workspace {name} is asked for twice")
            return x
        start = x.data_ptr()
        self._workspaces[name] = _nbytes(x)
        self._regions.append((start, start + _nbytes(x), name))
        self._names.setdefault(id(x), name)
        self._held.append(x)
        return x

    def replay(self) -> Tuple[Optional[Replay], Optional[str]]:
        """(the replay, None), or (None, why the stage cannot be replayed)."""
        if self._unreplayable is not None:
            return None, self._unreplayable
        used = sorted({n for s in self._steps for n in _buffer_names(s)})
        workspace, size = [], 0
        for name in used:
            if name in self._workspaces:
                size = -(-size // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
                workspace.append((name, size))
                size += self._workspaces[name]
        in_workspace = {n for n, _ in workspace}
        return Replay(tuple(self._steps), tuple(n for n in used if n not in in_workspace), tuple(workspace),
                      size), None

    def _refuse(self, why: str) -> None:
        self._unreplayable = why
        self._steps = []

    def _keep(self, kernel, compiled, grid, args, meta) -> None:
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
        if not hasattr(compiled, "__getitem__") or not hasattr(compiled, "function"):
            return self._refuse(f"{name} did not return a compiled kernel (Triton's interpreter?)")
        if callable(grid):
            return self._refuse(f"{name} was launched with a grid function")
        signature = _signature(kernel)
        kwargs = {k: v for k, v in meta.items() if k in signature.parameters}  # the rest: launch options
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        constants, pointers, descriptors = [], [], []
        for i, (arg_name, value) in enumerate(bound.arguments.items()):
            constants.append(value)
            if _is_descriptor(value):
                place = self._place(value.base)
                if place is None:
                    return self._refuse(f"{name}'s {arg_name} describes memory outside the call's buffers")
                # its geometry only: a replay kept for later calls must not keep this call's
                # buffer alive (a CUDA-graph recording's pool counts every live allocation)
                descriptors.append((i, *place, _rebased(value, _Address(0, value.base.dtype))))
                constants[i] = None
            elif hasattr(value, "data_ptr"):
                place = self._place(value)
                if place is None:
                    return self._refuse(f"{name}'s {arg_name} is memory outside the call's buffers")
                pointers.append((i, *place))
                constants[i] = None
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self._steps.append(TritonStep(name, compiled_launcher(compiled, grid3), tuple(constants), tuple(pointers),
                                      tuple(descriptors)))

    def _place(self, x) -> Optional[Tuple[str, int]]:
        """(buffer name, byte offset) of x: x is a buffer, or a view inside exactly one buffer.
        None otherwise (outside every buffer, or where distinct buffers overlap: another call's
        buffers need not overlap the same way)."""
        if id(x) in self._names:
            return self._names[id(x)], 0
        ptr = x.data_ptr()
        end = ptr + _nbytes(x)
        inside = [(name, ptr - start) for start, stop, name in self._regions if start <= ptr and end <= stop]
        return inside[0] if len(inside) == 1 else None


def _buffer_names(step):
    if isinstance(step, CuteStep):
        return [a[1] for a in step.args if a[1] is not None]
    return [p[1] for p in step.pointers] + [d[1] for d in step.descriptors]


def _nbytes(x) -> int:
    """Bytes from x's first element to one past its last (any strides)."""
    shape = tuple(x.shape)
    if any(s == 0 for s in shape):
        return 0
    stride = x.stride() if callable(getattr(x, "stride", None)) else None
    itemsize = x.element_size() if callable(getattr(x, "element_size", None)) else x.dtype.itemsize
    if stride is None:
        n = 1
        for s in shape:
            n *= s
        return n * itemsize
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * itemsize


def _is_descriptor(x) -> bool:
    return type(x).__name__ == "TensorDescriptor" and hasattr(x, "base") and hasattr(x, "block_shape")


_SIGNATURES = {}


def _signature(kernel) -> inspect.Signature:
    fn = kernel.fn
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(fn)
    return sig

