"""PyTorch glue: torch.library custom ops over `vsa_core.ops`, with autograd and fake
(meta) implementations so that torch.compile(fullgraph=True) traces through them.

Every op allocates the buffers the core's problem table names, hands them to the
core, and returns them; the core launches on torch's current stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from vsa_core import ops as core_ops
from vsa_core.api import op_statics
from vsa_core.backends import backend_named
from vsa_core.config import config
from vsa_core.problem import AttnProblem
from vsa_core.replay import CapturingLauncher, Replay
from vsa_core.runtime import BufferAdapter, DeviceInfo
from vsa_core.spec import (GRADIENTS, OpStatics, backward_arguments, backward_inputs, forward_arguments, forward_inputs,
                           forward_results, gradients, workspaces)


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
    the launch configuration, each array's shape, strides, dtype, device and 16-byte
    alignment, and which arrays are one object (a capture names a buffer by its object: the
    same counts passed for both counts, say)."""
    described = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)
                      for t in arrays)
    first = {}
    aliases = tuple(first.setdefault(id(t), i) for i, t in enumerate(arrays) if t is not None)
    return stage, s, config(), described, aliases


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
    replayable = like.is_cuda and getattr(backend, "replayable", False) and not torch.compiler.is_compiling()
    key = _replay_key(stage, s, arrays) if replayable else None
    entry = _REPLAYS.get(key) if replayable else None
    if isinstance(entry, Replay):
        skip = entry.workspace_names
        buffers = {n: torch.empty(shape, dtype=dt, device=device) for n, shape, dt in table if n not in skip}
        workspace = torch.empty(entry.workspace_bytes, dtype=torch.uint8, device=device)  # freed in stream order
        scope = contextlib.nullcontext() if torch.cuda.current_device() == device.index else torch.cuda.device(device)
        with scope:
            entry.run({**named, **buffers}, torch.cuda.current_stream(device).cuda_stream, workspace.data_ptr())
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
    """The operator outside torch.compile: the custom ops' very forward and backward
    (`_forward_impl`, `_backward_impl`), without torch.library's per-call dispatch, which
    costs several times what a plain autograd.Function does (benchmarks/host_cost.py).
    torch.compile traces the custom ops instead (`attend`). The forward takes ctx itself
    rather than a separate setup_context: with one, torch binds the arguments through
    inspect.signature on every call."""

    @staticmethod
    def forward(ctx, statics: str, softmax_scale: float, *inputs: Tensor):
        output = tuple(_forward_impl(list(inputs), statics, softmax_scale))
        _keep_for_backward(ctx, inputs, statics, softmax_scale, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernels' gradients are not differentiable
    def backward(ctx, dout: Tensor, *_):
        return (None, None, *_input_gradients(ctx, dout, _backward_impl))


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


_STATICS: dict = {}  # (problem, backend, device, training, launch config) -> (encoded statics, softmax scale)


def statics_for(p: AttnProblem, backend: str, named: dict) -> Tuple[str, float]:
    """The encoded statics of a checked call whose inputs are `named` (torch's grad mode and
    the inputs' requires_grad decide whether the forward keeps what the backward needs), and
    its softmax scale (the statics hold a placeholder for it: see `_statics`). Eager calls
    resolve the backend once per problem and configuration."""
    q = named["q"]
    training = torch.is_grad_enabled() and any(named.get(n) is not None and named[n].requires_grad
                                               for n in GRADIENTS)
    compiling = torch.compiler.is_compiling()
    key = None if compiling else (p, backend, q.device, training, config())
    known = None if key is None else _STATICS.get(key)
    if known is not None:
        return known
    fields = dataclasses.astuple(p)
    fields = fields[:_SCALE_FIELD] + (None,) + fields[_SCALE_FIELD + 1:]  # resolved to 1/sqrt(D) there
    result = _statics_text(fields, backend, q.device.type, q.device.index, training), p.softmax_scale
    if key is not None:
        if len(_STATICS) >= _REPLAY_LIMIT:
            _STATICS.clear()
        _STATICS[key] = result
    return result


def attend(p: AttnProblem, backend: str, named: dict) -> List[Tensor]:
    """The forward (differentiable in out) of a checked call whose inputs are named as
    `vsa_core.spec.forward_inputs` says; returns `forward_results` (out, lse, ...)."""
    statics, softmax_scale = statics_for(p, backend, named)
    inputs = [named[n] for n in _input_names(statics)]
    if torch.compiler.is_compiling():
        return _forward(inputs, statics, softmax_scale)
    return list(_EagerOperator.apply(statics, softmax_scale, *inputs))
