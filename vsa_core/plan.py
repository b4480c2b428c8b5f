"""A call described as data: the launch plan of one stage (forward or backward) of one problem.

`record_plan` runs the very launchers the eager path runs (`vsa_core.ops.forward` /
`backward`), but hands them placeholder buffers (`DeviceBuffer`s on a "meta" device, with
no memory) and a `RecordingLauncher` (`vsa_core.launch`), which records each Triton launch
instead of running it: the kernel, its grid, each argument
as a named buffer (an input, an output/workspace of the problem's buffer table, or a
workspace of the backend's own table), a host TMA descriptor over such a buffer (`Descriptor`),
a scalar or a constexpr, and num_warps/num_stages.
A backend's own CuTe DSL launches (`Launcher.cute`) are recorded as a `CuteLaunch`: the
step's name, its buffers by argument name, its statics. The plan is built once per
problem, at trace time; an executor (`vsa_jax.native`) replays it with no Python per call.

The recording launcher runs under the current configuration. It cannot time tile candidates
(it runs nothing), so each attention kernel takes the tile config the shared store
(`vsa_core.autotune.TILES`) holds for its key, the one every eager call of the same problem,
torch's or JAX's, runs; a key with no choice yet takes the default and is listed in
`LaunchPlan.untuned`, for a caller that can time to tune it (`triton_backend.tune`) and record
again. With TMA on the attention kernels take host TMA descriptors, as in an eager launch; a
descriptor's bytes embed its buffer's address, which only exists at run time, so the plan keeps
its buffer and geometry (`Descriptor`) and the executor has it encoded at each launch (jaxlib's
Triton call does, from the buffer it passes: `vsa_jax.native`). Nothing of Triton is patched, so
eager launches on other threads are unaffected.

`compile_launch` compiles one recorded launch for a CUDA target through Triton's own
specialization (`JITFunction.warmup`), so the binary comes from the same Triton source,
with the same signature and attributes, as an eager launch with the same arguments: a
descriptor argument compiles as the same `TensorDescriptor` torch passes, so both frontends run
one binary.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

from triton.tools.tensor_descriptor import TensorDescriptor

from .autotune import TILES
from .config import LaunchConfig, config
from .launch import Launcher
from .problem import AttnProblem
from .runtime import DeviceBuffer, DeviceInfo, Dtype
from .spec import forward_results

_META = DeviceInfo("meta")  # placeholders: compiled (not interpreted) kernels, nothing launched
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@dataclass(frozen=True)
class Arg:
    """One kernel parameter: kind "buffer" (value = buffer name), "descriptor" (value = a
    `Descriptor`), "scalar" (a Python int, float or bool passed at run time) or "constexpr"
    (compiled in; None for an absent pointer)."""

    name: str
    kind: str
    value: Any


@dataclass(frozen=True)
class Descriptor:
    """A host TMA descriptor argument (Triton's `TensorDescriptor`) of a recorded launch: over the
    plan buffer `buffer` from its first element, with the descriptor's shape, strides (elements)
    and block shape as the launcher set them, and its padding ("zero" or "nan": what a read past
    the shape gives). The executor builds the descriptor itself from the buffer it passes."""

    buffer: str
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    block_shape: Tuple[int, ...]
    padding: str


@dataclass(frozen=True)
class Launch:
    kernel: Any  # the triton JITFunction (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: Tuple[int, int, int]
    args: Tuple[Arg, ...]
    options: Tuple[Tuple[str, int], ...]  # num_warps, num_stages (as the launcher gave them)

    @property
    def kernel_name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    @property
    def buffers(self) -> Tuple[str, ...]:
        """The buffers of the pointer and descriptor arguments, in parameter order (what a custom
        call hands the kernel, one buffer per such parameter)."""
        return tuple(a.value if a.kind == "buffer" else a.value.buffer for a in self.args
                     if a.kind in ("buffer", "descriptor"))

    def arg(self, name: str) -> Arg:
        return next(a for a in self.args if a.name == name)

    @property
    def kind(self) -> str:
        return "triton"


@dataclass(frozen=True)
class CuteLaunch:
    """One of a backend's own CuTe DSL launches (its module's `CUTE_STEPS`): `Launcher.cute(step,
    buffers, **statics)` with the buffers as plan names. The argument names are the step's; the
    statics hold a dict as a sorted tuple of its items (`statics_dict` gives them back)."""

    step: str
    args: Tuple[Tuple[str, str], ...]  # (argument name, buffer name), in the order the backend gave them
    statics: Tuple[Tuple[str, Any], ...]

    kind = "cute"

    @property
    def kernel_name(self) -> str:
        return self.step

    @property
    def buffers(self) -> Tuple[str, ...]:
        return tuple(b for _, b in self.args)

    def buffer(self, arg: str) -> str:
        return dict(self.args)[arg]

    def statics_dict(self) -> dict:
        return {n: dict(v) if isinstance(v, _FrozenDict) else v for n, v in self.statics}


class _FrozenDict(tuple):
    """A dict static as a hashable tuple of its sorted items."""


def _frozen(value):
    return _FrozenDict(sorted(value.items())) if isinstance(value, dict) else value


@dataclass(frozen=True)
class LaunchPlan:
    stage: str  # "forward" or "backward"
    problem: AttnProblem
    inputs: Dict[str, Tuple[Tuple[int, ...], str]]  # read-only buffers: name -> (shape, dtype)
    buffers: Dict[str, Tuple[Tuple[int, ...], str]]  # outputs + workspaces (the stage's buffer table)
    launches: Tuple[Any, ...]  # Launch (Triton) or CuteLaunch
    backend: str = "triton"
    # the backend's own workspaces (its `workspaces(stage, problem)`): born and used inside the plan only
    workspaces: Dict[str, Tuple[Tuple[int, ...], str]] = dataclasses.field(default_factory=dict)
    # tile store keys that had no choice when recorded (their launches took the default config)
    untuned: Tuple[Tuple, ...] = ()

    @property
    def all_buffers(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """Every buffer the launches may take: inputs, the stage's table, the backend's workspaces."""
        return {**self.inputs, **self.buffers, **self.workspaces}


@dataclass(frozen=True)
class Step:
    """How one launch maps onto a custom call whose buffers are its operands followed by
    its results, consumed in that order by the kernel's pointer parameters.

    operands: buffers that exist before the launch, in parameter order (a CuTe DSL launch:
    in the order of its arguments); results: first
    the buffers born here that the kernel takes (a suffix of its pointer parameters),
    then the operands that are not inputs (updated in place: result i aliases operand j
    for (j, i) in `aliases`), then buffers born here for later launches only."""

    operands: Tuple[str, ...]
    results: Tuple[str, ...]
    aliases: Tuple[Tuple[int, int], ...]
    n_param_results: int  # how many leading results the kernel takes as parameters


# ---- recording ------------------------------------------------------------------------------
class RecordingLauncher(Launcher):
    """A launcher that records each launch instead of running it (`record_plan` passes it to
    `vsa_core.ops`), under the configuration current when it was made. The attention kernels
    take the shared store's tile configs (a key without one: the default, listed in `untuned`);
    a host TMA descriptor is recorded as a `Descriptor` (see the module doc)."""

    def __init__(self, names_by_id: Mapping[int, str], workspaces: Mapping[str, DeviceBuffer] = None):
        self.names_by_id = names_by_id
        self.workspaces = dict(workspaces or {})
        self.launches = []
        self.untuned = []
        self._config = config()

    @property
    def config(self) -> LaunchConfig:
        return self._config

    @property
    def runs_kernels(self) -> bool:
        return False

    def stored_tile(self, key, candidates):
        if TILES.chosen(key) is None and key not in self.untuned:
            self.untuned.append(key)
        return super().stored_tile(key, candidates)

    def triton(self, kernel, grid, *args, **kwargs) -> None:
        options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
        signature = inspect.signature(kernel.fn)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        constexpr_names = _constexpr_names(kernel, signature)
        recorded = []
        for name, value in bound.arguments.items():
            if name in constexpr_names:
                recorded.append(Arg(name, "constexpr", value))
            elif isinstance(value, DeviceBuffer):
                recorded.append(Arg(name, "buffer", self._buffer_name(kernel, name, value)))
            elif isinstance(value, TensorDescriptor):
                recorded.append(Arg(name, "descriptor", self._descriptor(kernel, name, value)))
            elif value is None:
                recorded.append(Arg(name, "constexpr", None))  # Triton compiles an absent pointer in
            elif isinstance(value, (bool, int, float)):
                recorded.append(Arg(name, "scalar", value))
            else:
                raise NotImplementedError(f"{kernel.fn.__name__}: argument {name} of type {type(value).__name__} "
                                          "cannot be replayed")
        if callable(grid):
            grid = grid(dict(bound.arguments))
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.launches.append(Launch(kernel, grid, tuple(recorded), tuple(sorted(options.items()))))

    def _buffer_name(self, kernel, name: str, value: DeviceBuffer) -> str:
        if id(value) not in self.names_by_id:
            raise RuntimeError(f"{kernel.fn.__name__}: argument {name} is not a buffer of the plan")
        return self.names_by_id[id(value)]

    def _descriptor(self, kernel, name: str, desc: TensorDescriptor) -> Descriptor:
        """`desc` as a `Descriptor`. A replay builds it from the address of the buffer the launch
        gets, so it must start at a plan buffer's first element (its base is the buffer itself,
        not a view) and stay inside that buffer."""
        if not isinstance(desc.base, DeviceBuffer):
            raise NotImplementedError(f"{kernel.fn.__name__}: descriptor {name} is over a "
                                      f"{type(desc.base).__name__}, not a buffer of the plan")
        buffer = self._buffer_name(kernel, name, desc.base)
        if getattr(desc, "round_f32_to_tf32", False):
            raise NotImplementedError(f"{kernel.fn.__name__}: descriptor {name} rounds to tf32, "
                                      "which a plan does not carry")
        shape, strides = tuple(int(s) for s in desc.shape), tuple(int(s) for s in desc.strides)
        last = sum((n - 1) * s for n, s in zip(shape, strides))
        if last >= desc.base.numel():
            raise RuntimeError(f"{kernel.fn.__name__}: descriptor {name} reaches element {last} of {buffer}, "
                               f"which has {desc.base.numel()}")
        return Descriptor(buffer, shape, strides, tuple(int(b) for b in desc.block_shape), desc.padding)

    def cute(self, step: str, buffers: dict, **statics) -> None:
        """Records a `CuteLaunch`; every buffer must be one of the plan's."""
        args = []
        for arg, value in buffers.items():
            if id(value) not in self.names_by_id:
                raise RuntimeError(f"{step}: argument {arg} is not a buffer of the plan")
            args.append((arg, self.names_by_id[id(value)]))
        self.launches.append(CuteLaunch(step, tuple(args), tuple(sorted((n, _frozen(v)) for n, v in statics.items()))))

    def workspace(self, name: str, shape, dtype: str, like):
        """The plan's placeholder for the backend's workspace `name` (declared in its table)."""
        buf = self.workspaces.get(name)
        if buf is None:
            raise RuntimeError(f"workspace {name} is not in the backend's workspace table")
        if buf.shape != tuple(shape) or buf.dtype != (like.dtype if dtype == "input" else dtype):
            raise RuntimeError(f"workspace {name}: {tuple(shape)} {dtype} asked, {buf.shape} {buf.dtype} declared")
        return buf


def _constexpr_names(kernel, signature) -> set:
    params = getattr(kernel, "params", None)
    if params is not None:  # JITFunction
        return {p.name for p in params if p.is_constexpr}
    import triton.language as tl  # InterpretedFunction: read the annotations
    return {n for n, prm in signature.parameters.items()
            if prm.annotation is tl.constexpr or "constexpr" in str(prm.annotation)}


def _placeholder(shape, dtype: str, problem: AttnProblem) -> DeviceBuffer:
    """A buffer of this shape and dtype at address 0 (16-byte aligned, as Triton assumes
    of a pointer it specializes), never read or written."""
    return DeviceBuffer(0, problem.dtype if dtype == "input" else dtype, shape, _META)


def record_plan(stage: str, problem: AttnProblem, inputs: Mapping[str, Tuple[Tuple[int, ...], str]],
                backend=None) -> LaunchPlan:
    """The launch plan of `stage` ("forward" / "backward") on `backend` (a backend module;
    the Triton backend by default).

    `inputs`: the stage's input buffers by name (as `vsa_core.ops` names them) with their
    shape and dtype name ("input" = q's dtype). The backend's own workspaces (its optional
    `workspaces(stage, problem)` table) become buffers of the plan."""
    from . import ops
    from .backends import triton_backend

    if stage not in ("forward", "backward"):
        raise ValueError(f"stage must be 'forward' or 'backward', got {stage!r}")
    backend = backend or triton_backend
    table = problem.forward_buffers() if stage == "forward" else problem.backward_buffers()
    declared = getattr(backend, "workspaces", None)
    workspaces = {n: (tuple(s), d) for n, (s, d) in (declared(stage, problem) if declared else {}).items()}
    inputs = {n: (tuple(s), d) for n, (s, d) in inputs.items()}
    both = set(inputs) & set(table)
    if both:
        raise ValueError(f"buffers {sorted(both)} are both inputs and outputs of the {stage}")
    clash = set(workspaces) & (set(inputs) | set(table))
    if clash:
        raise ValueError(f"{backend.name} workspaces {sorted(clash)} clash with the {stage}'s buffers")
    placeholders = {n: _placeholder(s, d, problem) for n, (s, d) in {**inputs, **table, **workspaces}.items()}
    recorder = RecordingLauncher({id(t): n for n, t in placeholders.items()},
                                 {n: placeholders[n] for n in workspaces})
    run = ops.forward if stage == "forward" else ops.backward
    run(problem, backend, placeholders, launcher=recorder)
    return LaunchPlan(stage, problem, inputs, dict(table), tuple(recorder.launches), backend.name, workspaces,
                      tuple(recorder.untuned))


# ---- scheduling onto custom calls -------------------------------------------------------------
def schedule(plan: LaunchPlan) -> Tuple[Step, ...]:
    """One Step per launch (see `Step`). A buffer is born (allocated, uninitialized, like
    an output of the callback path) as a result of the first launch that takes it, when
    it sits in the suffix of that launch's pointer parameters that follows every existing
    buffer; otherwise (and for table buffers no launch takes) it is born, unused, by the
    first launch, and passed as an operand from then on. A CuTe DSL launch takes its buffers
    by name, in any order: its existing buffers are its operands, the others are born there.
    The backend's workspaces are born like the table's buffers."""
    launches = plan.launches
    if not launches:
        raise ValueError(f"the {plan.stage} plan has no launch")
    inputs = set(plan.inputs)
    owned = {**plan.buffers, **plan.workspaces}

    def buffers_of(launch, existing):
        bufs = launch.buffers
        if launch.kind == "cute":
            return tuple(b for b in bufs if b in existing) + tuple(b for b in bufs if b not in existing)
        return bufs

    def split(bufs, existing):
        """(leading existing part, suffix of not-yet-existing buffers) or None if interleaved."""
        i = len(bufs)
        while i > 0 and bufs[i - 1] not in existing:
            i -= 1
        head, tail = bufs[:i], bufs[i:]
        if any(b not in existing for b in head):
            return None
        return head, tail

    # which buffers the first launch must bear in advance
    existing = set(inputs)
    early = []
    for launch in launches:
        bufs = buffers_of(launch, existing)
        if split(bufs, existing) is None:
            i = len(bufs)
            while i > 0 and bufs[i - 1] not in existing:
                i -= 1
            early += [b for b in bufs[:i] if b not in existing and b not in early]
            existing.update(bufs[:i])
        existing.update(bufs)
    early += [b for b in owned if b not in existing and b not in early]

    steps = []
    existing = set(inputs)
    for index, launch in enumerate(launches):
        bufs = buffers_of(launch, existing)
        parts = split(bufs, existing)
        if parts is None:
            raise NotImplementedError(f"launch {index} ({launch.kernel_name}) takes a new buffer before an "
                                      "existing one")
        head, tail = parts
        if len(set(tail)) != len(tail):
            raise NotImplementedError(f"launch {index} ({launch.kernel_name}) takes a new buffer twice")
        born_extra = tuple(b for b in early if b not in existing and b not in tail) if index == 0 else ()
        if born_extra and launch.kind == "cute":
            raise NotImplementedError(f"{launch.step} is the first launch and would bear buffers it does not take")
        in_place, aliases, seen = [], [], set()
        for j, b in enumerate(head):
            if b not in inputs and b not in seen:
                seen.add(b)
                aliases.append((j, len(tail) + len(in_place)))
                in_place.append(b)
        steps.append(Step(tuple(head), tuple(tail) + tuple(in_place) + born_extra, tuple(aliases), len(tail)))
        existing.update(tail)
        existing.update(born_extra)
    missing = [b for b in owned if b not in existing]
    if missing:
        raise RuntimeError(f"buffers {missing} are never allocated")
    return tuple(steps)


# ---- compiling one launch for a CUDA target ----------------------------------------------------
@dataclass(frozen=True)
class CompiledLaunch:
    launch: Launch
    name: str  # the kernel's symbol in the binary
    num_warps: int
    num_ctas: int
    shared_mem_bytes: int
    ptx: str
    cubin: bytes
    # run-time arguments in order: ("buffer", name, ptr_divisibility), ("scalar", value, type) or
    # ("descriptor", Descriptor, tma) with tma the compiled kernel's metadata of that descriptor
    # (Triton's `tensordesc_meta` entry: elem_type, elem_size, swizzle, block_size, ...)
    params: Tuple[Tuple, ...]
    # bytes of global scratch per CTA the kernel needs (0: none; the native executor has none to give)
    global_scratch_size: int


def compile_launch(launch: Launch, plan: LaunchPlan, capability: int = 90) -> CompiledLaunch:
    """Compiles `launch` for GPUTarget("cuda", capability, 32) (PTX and cubin, with
    Triton's ptxas) through `JITFunction.warmup`, as an eager launch of these arguments
    would be (buffers stand in as 16-byte aligned pointers of their dtype, descriptors as
    `TensorDescriptor`s over such pointers)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    from .triton_shim import compile_for_target, mock_pointer

    if not isinstance(launch.kernel, JITFunction):
        raise RuntimeError("compiling needs Triton's compiler: unset TRITON_INTERPRET")
    shapes = plan.all_buffers

    def pointer(buffer: str):
        dtype = shapes[buffer][1]
        return mock_pointer(Dtype(plan.problem.dtype if dtype == "input" else dtype))

    args = []
    for a in launch.args:
        if a.kind == "buffer":
            args.append(pointer(a.value))
        elif a.kind == "descriptor":
            d = a.value
            args.append(TensorDescriptor(pointer(d.buffer), list(d.shape), list(d.strides), list(d.block_shape),
                                         d.padding))
        else:
            args.append(a.value)
    compiled = compile_for_target(launch.kernel, args, launch.grid, dict(launch.options),
                                  GPUTarget("cuda", capability, 32))
    signature = compiled.src.signature
    attrs = getattr(compiled.src, "attrs", {}) or {}
    # one entry per descriptor argument, in order, where Triton lowered the descriptors to TMA (sm_90+)
    tma_meta = list(getattr(compiled.metadata, "tensordesc_meta", None) or ())
    params = []
    for index, a in enumerate(launch.args):
        kind = signature[a.name] if a.name in signature else signature[index]
        if kind == "constexpr":
            continue
        if a.kind == "buffer":
            attr = attrs.get((index,), [])
            params.append(("buffer", a.value, 16 if ["tt.divisibility", 16] in [list(x) for x in attr] else 0))
        elif a.kind == "scalar":
            value = bool(a.value) if kind == "i1" else float(a.value) if kind.startswith("fp") else int(a.value)
            params.append(("scalar", value, kind))
        elif a.kind == "descriptor":
            if not tma_meta:  # the pointer form's launch ABI differs between Triton versions
                raise NotImplementedError(
                    f"{launch.kernel_name}: descriptor {a.name} compiled without TMA for sm_{capability} (TMA needs "
                    "sm_90 or newer); a plan replays TMA descriptors only: record it with VSA_TMA=0")
            params.append(("descriptor", a.value, dict(tma_meta.pop(0))))
        else:
            raise RuntimeError(f"{launch.kernel_name}: constexpr {a.name} compiled as a run-time {kind}")
    if tma_meta:
        raise RuntimeError(f"{launch.kernel_name}: {len(tma_meta)} TMA descriptors of the kernel are not arguments")
    md = compiled.metadata
    return CompiledLaunch(launch, md.name, md.num_warps, getattr(md, "num_ctas", 1), md.shared, compiled.asm["ptx"],
                          compiled.asm["cubin"], tuple(params), getattr(md, "global_scratch_size", 0) or 0)


def forward_inputs(problem: AttnProblem) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """The forward's input buffers of a VSA problem (q, k, v, counts, gate)."""
    if not problem.is_vsa:
        raise ValueError("forward_inputs describes VSA problems (selection='topk')")
    inputs = {"q": (problem.token_shape(problem.q_len), "input"), "k": (problem.token_shape(problem.kv_len), "input"),
              "v": (problem.token_shape(problem.kv_len), "input"), "kv_counts": ((problem.n_kv_blocks,), "int32"),
              "q_counts": ((problem.n_q_blocks,), "int32")}
    if problem.has_gate:
        inputs["gate"] = (problem.token_shape(problem.q_len), "input")
    return inputs


def backward_inputs(problem: AttnProblem) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """The VSA backward's inputs: dout, the forward's inputs and what it kept (`vsa_core.spec.forward_results`)."""
    kept = {n: spec for n, spec in problem.forward_buffers().items() if n in forward_results(problem)}
    return {"dout": (problem.token_shape(problem.q_len), "input"), **forward_inputs(problem), **kept}
