"""PyTorch glue: torch.library custom ops over `vsa_core.ops`, with autograd and fake
(meta) implementations so that torch.compile(fullgraph=True) traces through them.

Every op allocates the buffers the core's problem table names, hands them to the
core, and returns them; the core launches on torch's current stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from vsa_core import ops as core_ops
from vsa_core.api import op_statics
from vsa_core.backends import backend_named
from vsa_core.backends._torch_views import viewer
from vsa_core.config import config
from vsa_core.problem import AttnProblem
from vsa_core.replay import CapturingLauncher, Replay
from vsa_core.runtime import BufferAdapter, DeviceInfo
from vsa_core.spec import (GRADIENTS, OpStatics, backward_arguments, backward_inputs, forward_arguments, forward_inputs,
                           forward_results, gradients, op_problem, workspaces)


def device_info(t: Tensor) -> DeviceInfo:
    return _device_info(t.device.type, t.device.index)


def _device_info(device_type: str, device_index: Optional[int]) -> DeviceInfo:
    if device_type == "cuda":
        index = device_index if device_index is not None else torch.cuda.current_device()
        return DeviceInfo("cuda", index, torch.cuda.get_device_capability(index))
    return DeviceInfo(device_type)


class TorchBuffers(BufferAdapter):
    """torch tensors go to the launchers as they are. Triton launches on torch's *current*
    device and stream, not the tensors' device, so a call on cuda:1 while cuda:0 is current
    switches device first; a given raw stream becomes torch's current one."""

    def launch_scope(self, like: Tensor, stream: Optional[int]):
        device = like.device
        if device.type != "cuda":
            return super().launch_scope(like, stream)  # the interpreter lock
        scope = contextlib.ExitStack()
        scope.enter_context(torch.cuda.device(device))
        if stream is not None:
            scope.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)))
        return scope


TORCH_BUFFERS = TorchBuffers()


def _alloc(specs: dict, like: Tensor) -> dict:
    return {name: torch.empty(shape, dtype=like.dtype if dt == "input" else getattr(torch, dt), device=like.device)
            for name, (shape, dt) in specs.items()}


# ---- the thin eager path: a stage's launches replayed (`vsa_core.replay`) -------------------
# Replay key -> a `Replay`, the reason the stage cannot be replayed (str), or True: seen once,
# captured on the next call (the first call of a problem may time tile candidates through its
# launcher, which a capture must not keep).
_REPLAYS: dict = {}
_REPLAY_LIMIT = 512


def _replay_key(stage: str, s: OpStatics, arrays) -> tuple:
    """Everything a stage's launches depend on besides the buffers' addresses: the statics,
    the launch configuration, and the arrays' descriptions (`_described`)."""
    return (stage, s, config(), *_described(arrays))


def _described(arrays) -> tuple:
    """(each array's shape, strides, dtype, device and 16-byte alignment in one flat tuple,
    None for an absent array; which arrays are one object, None when all are distinct): a
    capture names a buffer by its object (the same counts passed for both counts, say)."""
    described, ids = [], []
    for t in arrays:
        if t is None:
            described.append(None)
        else:
            described += (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)
            ids.append(id(t))
    return tuple(described), _aliases(ids)


def _aliases(ids) -> Optional[tuple]:
    """For each object id, the position of its first occurrence; None when all are distinct."""
    if len(set(ids)) == len(ids):
        return None
    first = {}
    return tuple(first.setdefault(i, n) for n, i in enumerate(ids))


@functools.lru_cache(maxsize=1024)
def _stage_table(p: AttnProblem, stage: str, dtype: torch.dtype) -> Tuple[Tuple[str, tuple, torch.dtype], ...]:
    """(name, shape, torch dtype) of each buffer the stage allocates (its table in `p`)."""
    table = p.forward_buffers() if stage == "forward" else p.backward_buffers()
    return tuple((n, shape, dtype if dt == "input" else getattr(torch, dt)) for n, (shape, dt) in table.items())


def _run_stage(stage: str, s: OpStatics, p: AttnProblem, named: dict, arrays, workspaces) -> dict:
    """Allocates the stage's buffers and runs core_ops.forward / backward on them and the named
    inputs: replayed where a capture of the same key exists (the `workspaces`, buffers whose
    contents do not outlive the stage, then in one allocation), else run and, on the second call
    of a key, captured. Returns the buffers by name (the workspaces only off the replay path)."""
    backend = backend_named(s.backend)
    run = core_ops.forward if stage == "forward" else core_ops.backward
    like = named["q"]
    device = like.device
    table = _stage_table(p, stage, like.dtype)
    replayable = (like.is_cuda and getattr(backend, "replayable", False) and config().replay
                  and not torch.compiler.is_compiling())
    key = _replay_key(stage, s, arrays) if replayable else None
    entry = _REPLAYS.get(key) if replayable else None
    if isinstance(entry, Replay):
        skip = entry.workspace_names
        buffers = {n: torch.empty(shape, dtype=dt, device=device) for n, shape, dt in table if n not in skip}
        workspace = torch.empty(entry.workspace_bytes, dtype=torch.uint8, device=device)  # freed in stream order
        everything = {**named, **buffers}
        view = None
        if entry.needs_views:
            bases = {n: (t, 0) for n, t in everything.items() if t is not None}
            bases.update((n, (workspace, offset)) for n, offset in entry.workspace)
            view = viewer(bases)
        scope = contextlib.nullcontext() if torch.cuda.current_device() == device.index else torch.cuda.device(device)
        with scope:
            entry.run(everything, torch.cuda.current_stream(device).cuda_stream, workspace.data_ptr(), view)
        return buffers
    buffers = {n: torch.empty(shape, dtype=dt, device=device) for n, shape, dt in table}
    everything = {**named, **buffers}
    if entry is True:
        launcher = CapturingLauncher(everything, workspaces=[n for n in workspaces if n in buffers])
        run(p, backend, everything, adapter=TORCH_BUFFERS, launcher=launcher)
        replay, why = launcher.replay()
        _REPLAYS[key] = replay if replay is not None else why
        return buffers
    run(p, backend, everything, adapter=TORCH_BUFFERS)
    if replayable and entry is None:
        if len(_REPLAYS) >= _REPLAY_LIMIT:
            _REPLAYS.clear()
        _REPLAYS[key] = True
    return buffers


# ---- the eager operator's stages (`_EagerOperator`) -------------------------------------------
_RESIDUAL_ALIGN = 256  # each residual starts as aligned as an allocation of its own would


def _backward_key(forward_key: tuple, arrays) -> tuple:
    """The eager backward's replay key (`_replay_key`'s properties): the forward's key holds
    the statics and the inputs' shapes, strides, dtypes, alignment and device; out, lse and the
    residuals are the forward's own allocations, whose layout the problem fixes. What is new:
    the launch configuration now, dout's description, and which arrays are one object (dout
    may be an input or out). `arrays`: dout, the kept inputs, out, lse."""
    dout = arrays[0]
    return ("backward", forward_key, config(), dout.shape, dout.stride(), dout.dtype, dout.get_device(),
            dout.data_ptr() % 16 == 0, _aliases([id(t) for t in arrays]))


def _table(table: dict, dtype: torch.dtype, names) -> Tuple[Tuple[str, tuple, torch.dtype], ...]:
    return tuple((n, tuple(shape), dtype if dt == "input" else getattr(torch, dt))
                 for n, (shape, dt) in table.items() if n in names)


@dataclasses.dataclass(frozen=True, eq=False)
class _EagerCall:
    """What the eager operator needs of a call, fixed by its problem, backend, device,
    grad mode and launch configuration (`_eager_call` builds it once for them): the statics,
    the operator's problem and backend, the names of its arrays, and the buffer tables of both
    stages as (name, shape, torch dtype). The residuals (the forward's results other than out
    and lse: read by the backward only) share one allocation at `residual_offsets`."""

    statics: str
    softmax_scale: float
    s: OpStatics
    p: AttnProblem
    backend: object
    replayable: bool  # the backend's stages may be replayed (on CUDA tensors)
    inputs: Tuple[str, ...]     # forward_inputs
    kept: Tuple[str, ...]       # backward_inputs
    gradients: Tuple[Optional[str], ...]  # each input's gradient buffer (None: it has none)
    forward_own: tuple          # out, lse: allocations of their own (the caller gets them)
    forward_workspaces: tuple
    residuals: tuple            # (name, byte offset, shape, torch dtype)
    residual_offsets: tuple     # (name, byte offset)
    residual_bytes: int
    backward_own: tuple         # the gradients
    backward_workspaces: tuple

    @classmethod
    def build(cls, statics: str, softmax_scale: float, named: dict) -> "_EagerCall":
        s = _statics(statics, softmax_scale)
        inputs = forward_inputs(s)
        p = op_problem(s, {n: named[n] for n in inputs})
        dtype = getattr(torch, p.dtype)
        forward, backward = p.forward_buffers(), p.backward_buffers()
        results, forward_ws, backward_ws = forward_results(p), workspaces("forward", s, p), workspaces("backward", s, p)
        residuals, size = [], 0
        for name, shape, dt in _table(forward, dtype, results[2:]):
            size = -(-size // _RESIDUAL_ALIGN) * _RESIDUAL_ALIGN
            residuals.append((name, size, shape, dt))
            size += math.prod(shape) * dt.itemsize
        size = -(-size // _RESIDUAL_ALIGN) * _RESIDUAL_ALIGN  # whole elements of every dtype (`residual_views`)
        backend = backend_named(s.backend)
        return cls(statics, softmax_scale, s, p, backend, getattr(backend, "replayable", False), inputs,
                   backward_inputs(s), tuple(GRADIENTS.get(n) for n in inputs), _table(forward, dtype, results[:2]),
                   _table(forward, dtype, forward_ws), tuple(residuals), tuple((n, o) for n, o, _, _ in residuals),
                   size, _table(backward, dtype, set(backward) - set(backward_ws)), _table(backward, dtype, backward_ws))

    def residual_views(self, block: Tensor) -> dict:
        """The residuals as contiguous tensors: views of `block` (off the replay path, which
        needs only their addresses)."""
        typed, views = {}, {}
        for n, offset, shape, dt in self.residuals:
            whole = typed.get(dt)
            if whole is None:
                whole = typed[dt] = block.view(dt)
            views[n] = whole.as_strided(shape, _contiguous_strides(shape), offset // dt.itemsize)
        return views


@functools.lru_cache(maxsize=1024)
def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _run_eager(stage: str, call: _EagerCall, named: dict, key, block: Optional[Tensor] = None):
    """`_run_stage` for the eager operator: the stage's own buffers (forward: out and lse;
    backward: the gradients) in allocations of their own, the residuals in `block` (the
    forward allocates it, the backward reads it), the workspaces in one allocation on the
    replay path. Returns (the own buffers by name, block)."""
    forward = stage == "forward"
    device = named["q"].device
    own_table, ws_table = ((call.forward_own, call.forward_workspaces) if forward
                           else (call.backward_own, call.backward_workspaces))
    own = {n: torch.empty(shape, dtype=dt, device=device) for n, shape, dt in own_table}
    if forward:
        block = torch.empty(call.residual_bytes, dtype=torch.uint8, device=device)
    entry = None if key is None else _REPLAYS.get(key)
    if isinstance(entry, Replay):
        workspace = torch.empty(entry.workspace_bytes, dtype=torch.uint8, device=device)  # freed in stream order
        addresses = {n: t.data_ptr() for n, t in named.items()}
        for n, t in own.items():
            addresses[n] = t.data_ptr()
        base = block.data_ptr()
        for n, offset in call.residual_offsets:
            addresses[n] = base + offset
        base = workspace.data_ptr()
        for n, offset in entry.workspace:
            addresses[n] = base + offset
        view = None
        if entry.needs_views:
            bases = {n: (t, 0) for n, t in named.items() if t is not None}
            bases.update((n, (t, 0)) for n, t in own.items())
            bases.update((n, (block, offset)) for n, offset in call.residual_offsets)
            bases.update((n, (workspace, offset)) for n, offset in entry.workspace)
            view = viewer(bases)
        index = device.index
        scope = contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(device)
        with scope:
            entry.launch(addresses, torch.cuda.current_stream(index).cuda_stream, view)
        return own, block
    ws = {n: torch.empty(shape, dtype=dt, device=device) for n, shape, dt in ws_table}
    everything = {**named, **own, **call.residual_views(block), **ws}
    run = core_ops.forward if forward else core_ops.backward
    if entry is True:
        launcher = CapturingLauncher(everything, workspaces=list(ws))
        run(call.p, call.backend, everything, adapter=TORCH_BUFFERS, launcher=launcher)
        replay, why = launcher.replay()
        _REPLAYS[key] = replay if replay is not None else why
        return own, block
    run(call.p, call.backend, everything, adapter=TORCH_BUFFERS)
    if key is not None and entry is None:
        if len(_REPLAYS) >= _REPLAY_LIMIT:
            _REPLAYS.clear()
        _REPLAYS[key] = True
    return own, block


# ---- the operator: one forward and one backward for every call ---------------------------
# Each takes its arrays as a tensor list named by the core's tables (`vsa_core.spec`) and the
# call's statics as a string. The list holds only the arrays the call has: autograd through a
# custom op cannot differentiate a `Tensor?[]` argument, and the statics already say which
# inputs a call has. The softmax scale travels beside the string: torch.compile traces a float
# argument of the compiled function symbolically, which no string can hold.
@functools.lru_cache(maxsize=1024)
def _statics(statics: str, softmax_scale: float) -> OpStatics:
    return dataclasses.replace(OpStatics.decode(statics), softmax_scale=float(softmax_scale))


def _forward_impl(inputs: List[Tensor], statics: str, softmax_scale: float) -> List[Tensor]:
    """Returns the forward's results (`vsa_core.spec.forward_results`: out first)."""
    s = _statics(statics, softmax_scale)
    p, named = forward_arguments(s, inputs)
    buffers = _run_stage("forward", s, p, named, inputs, workspaces("forward", s, p))
    return [buffers[n] for n in forward_results(p)]


@torch.library.custom_op("vsa::forward", mutates_args=())
def _forward(inputs: List[Tensor], statics: str, softmax_scale: float) -> List[Tensor]:
    """Returns the forward's results (`vsa_core.spec.forward_results`: out first)."""
    return _forward_impl(inputs, statics, softmax_scale)


@_forward.register_fake
def _(inputs, statics, softmax_scale):
    p, named = forward_arguments(_statics(statics, softmax_scale), inputs)
    table = p.forward_buffers()
    return list(_alloc({n: table[n] for n in forward_results(p)}, named["q"]).values())


def _backward_impl(dout: Tensor, inputs: List[Tensor], results: List[Tensor], statics: str,
                   softmax_scale: float) -> List[Tensor]:
    """The gradients (`vsa_core.spec.gradients`) from the inputs the backward reads
    (`backward_inputs`) and the forward's results."""
    s = _statics(statics, softmax_scale)
    dout = dout.contiguous()
    p, named = backward_arguments(s, inputs, results, dout)
    grads = _run_stage("backward", s, p, named, [dout, *inputs, *results], workspaces("backward", s, p))
    return [grads[g] for g in gradients(s).values()]


@torch.library.custom_op("vsa::backward", mutates_args=())
def _backward(dout: Tensor, inputs: List[Tensor], results: List[Tensor], statics: str,
              softmax_scale: float) -> List[Tensor]:
    """The gradients (`vsa_core.spec.gradients`) from the inputs the backward reads
    (`backward_inputs`) and the forward's results."""
    return _backward_impl(dout, inputs, results, statics, softmax_scale)


@_backward.register_fake
def _(dout, inputs, results, statics, softmax_scale):
    s = OpStatics.decode(statics)
    named = dict(zip(backward_inputs(s), inputs))
    return [torch.empty_like(named[n]) for n in gradients(s)]


@functools.lru_cache(maxsize=1024)
def _names(statics: str) -> Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]:
    """forward_inputs, backward_inputs and gradients of encoded statics."""
    s = OpStatics.decode(statics)
    return forward_inputs(s), backward_inputs(s), tuple(gradients(s))


def _keep_for_backward(ctx, tensors, statics: str, softmax_scale: float, output) -> None:
    """Saves the inputs the backward reads and the forward's results (of which only out is
    differentiable). The other results get no gradient: without set_materialize_grads(False)
    autograd would fill a zero tensor for each of them (out_fine is as large as out) on every
    backward, for the backward to ignore."""
    inputs, kept, _ = _names(statics)
    named = dict(zip(inputs, tensors))
    ctx.save_for_backward(*(named[n] for n in kept), *output)
    ctx.call, ctx.n_kept = (statics, softmax_scale), len(kept)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _input_gradients(ctx, dout: Optional[Tensor], backward) -> list:
    """Each forward input's gradient (None for the integer arrays), computed by `backward`:
    the custom op, or outside torch.compile its implementation. No gradient of out (None:
    out did not reach the loss) gives none for the inputs."""
    inputs, _, grad_names = _names(ctx.call[0])
    if dout is None:
        return [None] * len(inputs)
    saved = ctx.saved_tensors
    computed = dict(zip(grad_names, backward(dout, list(saved[:ctx.n_kept]), list(saved[ctx.n_kept:]), *ctx.call)))
    return [computed.get(n) for n in inputs]


def _setup_context(ctx, inputs, output):
    tensors, statics, softmax_scale = inputs
    _keep_for_backward(ctx, tensors, statics, softmax_scale, output)


def _backward_of_forward(ctx, grads):
    return _input_gradients(ctx, grads[0], _backward), None, None


torch.library.register_autograd("vsa::forward", _backward_of_forward, setup_context=_setup_context)


class _EagerOperator(torch.autograd.Function):
    """The operator outside torch.compile: the custom ops' forward and backward without
    torch.library's per-call dispatch, which costs several times what a plain
    autograd.Function does (benchmarks/host_cost.py). torch.compile traces the custom ops
    instead (`attend`). The forward takes ctx itself rather than a separate setup_context:
    with one, torch binds the arguments through inspect.signature on every call.

    Its first argument is the call's `_EagerCall` (built once per problem), so nothing static
    is re-derived per call. It returns out and lse only: the other results are residuals no
    caller sees, placed in one allocation (`_EagerCall.residuals`) that the backward gets back
    as one saved tensor; every output of an autograd Function costs autograd work per call.
    The backward's replay key is the forward's with dout's description (`_backward_key`):
    everything else the backward reads is the forward's inputs or allocated by the forward
    from the problem."""

    @staticmethod
    def forward(ctx, call: "_EagerCall", *inputs: Tensor):
        named = dict(zip(call.inputs, inputs))
        # the problem of these very arrays (a cache hit): the tables of `call` are its tables
        p = op_problem(call.s, named)
        if p is not call.p and p != call.p:
            raise RuntimeError("vsa: the eager operator's arrays are not of the problem its call was built for")
        replayable = call.replayable and inputs[0].is_cuda and config().replay
        # `call` stands for the statics and the launch configuration (its memo's key holds both)
        key = ("forward", call, *_described(inputs)) if replayable else None
        own, block = _run_eager("forward", call, named, key)
        out, lse = own["out"], own["lse"]
        ctx.save_for_backward(*(named[n] for n in call.kept), out, lse, block)
        ctx.call, ctx.key = call, key
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero tensor for lse on every backward
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients are not differentiable
    def backward(ctx, dout: Optional[Tensor], _):
        call = ctx.call
        if dout is None:  # out did not reach the loss: no gradient for the inputs
            return (None,) * (1 + len(call.inputs))
        saved = ctx.saved_tensors
        n = len(call.kept)
        kept, (out, lse, block) = saved[:n], saved[n:]
        dout = dout.contiguous()
        named = {"dout": dout, **dict(zip(call.kept, kept)), "out": out, "lse": lse}
        key = None if ctx.key is None else _backward_key(ctx.key, (dout, *kept, out, lse))
        grads, _ = _run_eager("backward", call, named, key, block)
        return (None, *(None if g is None else grads[g] for g in call.gradients))


# torch.compile traces the frontends but cannot trace backend resolution (it reads the
# environment, probes libraries, may warn), so the statics come from functions of constants
# that it calls once while tracing and whose results it keeps as constants.
@torch.compiler.assume_constant_result
def _statics_text(problem_fields: tuple, backend: str, device_type: str, device_index: Optional[int],
                  training: bool) -> str:
    p = AttnProblem(*problem_fields)
    return op_statics(p, backend, _device_info(device_type, device_index), training=training).encode()


@torch.compiler.assume_constant_result
def _input_names(statics: str) -> Tuple[str, ...]:
    return _names(statics)[0]


_SCALE_FIELD = [f.name for f in dataclasses.fields(AttnProblem)].index("softmax_scale")


_STATICS: dict = {}  # (problem, backend, device, training, launch config) -> its `_EagerCall`


def _training(named: dict) -> bool:
    """Whether the forward keeps what the backward needs: torch's grad mode and the inputs'
    requires_grad decide."""
    return torch.is_grad_enabled() and any(named.get(n) is not None and named[n].requires_grad for n in GRADIENTS)


def _resolved(p: AttnProblem, backend: str, q: Tensor, training: bool) -> Tuple[str, float]:
    fields = tuple(_concrete(f) for f in dataclasses.astuple(p))
    fields = fields[:_SCALE_FIELD] + (None,) + fields[_SCALE_FIELD + 1:]  # resolved to 1/sqrt(D) there
    return _statics_text(fields, backend, q.device.type, q.device.index, training), p.softmax_scale


def _concrete(field):
    """A problem field as a constant. torch.compile traces shapes as symbols once a compiled
    function has seen a second shape (or with dynamic=True); the statics hold concrete shapes,
    so a symbolic one is specialised here (operator.index: a guard on its value, so each shape
    gets its own graph)."""
    if field is None or isinstance(field, (str, bool, float, tuple)):
        return field
    return operator.index(field)


def statics_for(p: AttnProblem, backend: str, named: dict) -> Tuple[str, float]:
    """The encoded statics of a checked call whose inputs are `named` (torch's grad mode and
    the inputs' requires_grad decide whether the forward keeps what the backward needs), and
    its softmax scale (the statics hold a placeholder for it: see `_statics`). Eager calls
    resolve the backend once per problem and configuration."""
    if torch.compiler.is_compiling():
        return _resolved(p, backend, named["q"], _training(named))
    call = _eager_call(p, backend, named)
    return call.statics, call.softmax_scale


def _eager_call(p: AttnProblem, backend: str, named: dict) -> "_EagerCall":
    """The `_EagerCall` of an eager call (`statics_for`'s memo)."""
    q = named["q"]
    training = _training(named)
    key = (p, backend, q.device, training, config())
    call = _STATICS.get(key)
    if call is None:
        call = _EagerCall.build(*_resolved(p, backend, q, training), named)
        if len(_STATICS) >= _REPLAY_LIMIT:
            _STATICS.clear()
        _STATICS[key] = call
    return call


def attend(p: AttnProblem, backend: str, named: dict) -> List[Tensor]:
    """The forward (differentiable in out) of a checked call whose inputs are named as
    `vsa_core.spec.forward_inputs` says; returns out and lse first (compiled: every one of
    `forward_results`)."""
    if torch.compiler.is_compiling():
        statics, softmax_scale = statics_for(p, backend, named)
        return _forward([named[n] for n in _input_names(statics)], statics, softmax_scale)
    call = _eager_call(p, backend, named)
    return list(_EagerOperator.apply(call, *(named[n] for n in call.inputs)))
