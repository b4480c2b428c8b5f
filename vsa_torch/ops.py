"""PyTorch glue: torch.library custom ops over `vsa_core.ops`, with autograd and fake
(meta) implementations so that torch.compile(fullgraph=True) traces through them.

Every op allocates the buffers the core's problem table names, hands them to the
core, and returns them; the core launches on torch's current stream.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from vsa_core import ops as core_ops
from vsa_core.api import op_problem
from vsa_core.backends import resolve_backend
from vsa_core.problem import (AttnProblem, check_count_values, check_index_values, check_offsets, check_prefix_values,
                              check_varlen_selection, resolve_softmax_scale)
from vsa_core.runtime import BufferAdapter, DeviceInfo

_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int8": torch.int8}


def device_info(t: Tensor) -> DeviceInfo:
    if t.device.type == "cuda":
        idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return DeviceInfo("cuda", idx, torch.cuda.get_device_capability(idx))
    return DeviceInfo(t.device.type)


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
    return {name: torch.empty(shape, dtype=like.dtype if dt == "input" else _DTYPES[dt], device=like.device)
            for name, (shape, dt) in specs.items()}


def _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, selection, training=True,
             cu_q: Optional[Tensor] = None, list_capacity: Optional[int] = None, prefix_blocks: int = 0,
             prefix_mode: str = "exempt", seq_prefix: Optional[Tensor] = None,
             softmax_scale: Optional[float] = None, padding: str = "zeros") -> AttnProblem:
    """The problem inside an op. The frontend checked the call and built it once
    (`vsa_core.api.prepare_*`); a custom op takes only tensors and scalars, so here it is
    rebuilt from the shapes and statics: a cache hit (`op_problem`), not a second check.
    Packed sequences (cu_q given) arrive as BSHD with batch 1: the problem gets n_seqs."""
    return op_problem(q, k, block_elems=block_elems, layout=layout, selection=selection, topk=topk,
                      has_gate=gate is not None, training=training, cu_seqlens_q=cu_q, list_capacity=list_capacity,
                      prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, seq_prefix=seq_prefix,
                      softmax_scale=softmax_scale, padding=padding)


# Value checks read the values on the host. A device tensor already checked and not
# modified since (same object, same version counter) is not read again, so steady-state
# eager calls do not synchronise. Host tensors are checked on every call: reading them
# costs no device sync, and one that aliases numpy memory (torch.from_numpy) can change
# through numpy without torch's version counter seeing it.
_checked: dict = {}


def _check_once(tensors: Tuple[Tensor, ...], what, check) -> None:
    cacheable = all(t.device.type != "cpu" for t in tensors)
    key = (tuple(id(t) for t in tensors), what)
    versions = tuple(t._version for t in tensors)
    if cacheable:
        seen = _checked.get(key)
        if seen is not None and all(r() is t for r, t in zip(seen[0], tensors)) and seen[1] == versions:
            return
    check()
    if cacheable:
        if len(_checked) > 256:
            _checked.clear()
        _checked[key] = (tuple(weakref.ref(t) for t in tensors), versions)


def check_counts_once(name: str, counts: Tensor, block_elems: int) -> None:
    def check():
        lo, hi = (int(x) for x in torch.aminmax(counts.to(torch.int64)))  # one device sync
        check_count_values(name, np.array([lo, hi]), block_elems)

    _check_once((counts,), (name, block_elems), check)


def check_index_lists_once(block_indices: Tensor, block_counts: Tensor, n_kv_blocks: int) -> None:
    """ValueError naming block_indices / block_counts for counts outside [0, capacity] and
    listed entries out of [0, nKV), repeated or out of order. On the device the rows are
    checked there and one flag comes back (one sync per new or modified pair of lists)."""
    def check():
        idx, num = block_indices, block_counts
        if idx.device.type != "cpu":
            cap = idx.shape[-1]
            num64 = num.to(torch.int64)
            live = torch.arange(cap, device=idx.device) < num64.clamp(0, cap)[..., None]
            bad = ((num64 < 0) | (num64 > cap)).any()
            bad |= (live & ((idx < 0) | (idx >= n_kv_blocks))).any()
            bad |= (live[..., 1:] & (idx[..., 1:] <= idx[..., :-1])).any()
            if not bool(bad):
                return
            idx, num = idx.cpu(), num.cpu()  # bad lists only: find the first offender for the message
        check_index_values(idx.numpy(), num.numpy(), n_kv_blocks)

    _check_once((block_indices, block_counts), n_kv_blocks, check)


def check_offsets_once(name: str, cu: Tensor, total: int, block_elems: int) -> None:
    """Eager value checks of packed offsets (a host read, once per tensor version); skipped
    under torch.compile, where the kernels read them on the device only."""
    if not torch.compiler.is_compiling():
        _check_once((cu,), (name, total, block_elems),
                    lambda: check_offsets(name, cu.cpu().numpy(), total, block_elems))


def check_selection_once(p: AttnProblem, cu_q: Tensor, cu_k: Tensor, block_map=None, block_indices=None,
                         block_counts=None) -> None:
    """Eager: a packed selection may list only blocks of each query block's own sequence."""
    if torch.compiler.is_compiling():
        return
    given = [t for t in (block_map, block_indices, block_counts) if t is not None]

    def host(t):
        return None if t is None else t.cpu().numpy()
    _check_once((cu_q, cu_k, *given), ("selection", p),
                lambda: check_varlen_selection(p, host(cu_q), host(cu_k), host(block_map), host(block_indices),
                                               host(block_counts)))


# ---- VSA --------------------------------------------------------------------------------
_VSA_OUTPUTS = ("out", "lse", "q_pool", "k_pool", "v_pool", "out_coarse", "lse_coarse", "scores",
                "sel_idx", "sel_num", "sel_mask", "out_fine")
# what the backward reads: all but the top-k scores workspace ([B, H, nQ, nKV] fp32, 330 MB
# at 720p with 64-token blocks), which is freed after the forward
_VSA_SAVED = tuple(n for n in _VSA_OUTPUTS if n != "scores")


def _vsa_outputs(p: AttnProblem, q: Tensor) -> dict:
    out = _alloc(p.forward_buffers(), q)
    out.setdefault("out_fine", q.new_empty(0))  # inference: nothing kept for a backward
    return out


# seq_prefix: packed sequences' per-sequence prefix counts (int32 [N]); prefix_blocks /
# prefix_mode: the static prefix; softmax_scale: the problem's resolved scale (a float);
# padding: "zeros" / "ignore" (see AttnProblem). No defaults: the dispatcher leaves out
# trailing arguments equal to their defaults, which autograd's input structure then lacks.
@torch.library.custom_op("vsa::video_sparse_attn_fwd", mutates_args=())
def _vsa_fwd(q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, q_counts: Tensor, gate: Optional[Tensor],
             cu_q: Optional[Tensor], cu_k: Optional[Tensor], topk: int, block_elems: int, layout: str, backend: str,
             training: bool, seq_prefix: Optional[Tensor], prefix_blocks: int, prefix_mode: str,
             softmax_scale: float, padding: str) -> List[Tensor]:
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training, cu_q,
                 prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, seq_prefix=seq_prefix,
                 softmax_scale=softmax_scale, padding=padding)
    impl = resolve_backend(backend, p, device_info(q))
    out = _vsa_outputs(p, q)
    core_ops.forward(p, impl, dict(q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts, gate=gate,
                                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_prefix=seq_prefix,
                                   **{n: t for n, t in out.items() if n in p.forward_buffers()}), adapter=TORCH_BUFFERS)
    return [out[n] for n in _VSA_OUTPUTS]


@_vsa_fwd.register_fake
def _(q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, topk, block_elems, layout, backend, training, seq_prefix,
      prefix_blocks, prefix_mode, softmax_scale, padding):
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training, cu_q,
                 prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, seq_prefix=seq_prefix,
                 softmax_scale=softmax_scale, padding=padding)
    out = _vsa_outputs(p, q)
    return [out[n] for n in _VSA_OUTPUTS]


@torch.library.custom_op("vsa::video_sparse_attn_bwd", mutates_args=())
def _vsa_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, q_counts: Tensor,
             gate: Optional[Tensor], cu_q: Optional[Tensor], cu_k: Optional[Tensor], residuals: List[Tensor],
             topk: int, block_elems: int, layout: str, backend: str, seq_prefix: Optional[Tensor], prefix_blocks: int,
             prefix_mode: str, softmax_scale: float, padding: str) -> List[Tensor]:
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", cu_q=cu_q,
                 prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, seq_prefix=seq_prefix,
                 softmax_scale=softmax_scale, padding=padding)
    impl = resolve_backend(backend, p, device_info(q))
    grads = _alloc(p.backward_buffers(), q)
    core_ops.backward(p, impl, dict(dout=dout.contiguous(), q=q, k=k, v=v, kv_counts=kv_counts,
                                    q_counts=q_counts, gate=gate, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    **dict(zip(_VSA_SAVED, residuals)), **grads), adapter=TORCH_BUFFERS)
    return [grads["dq"], grads["dk"], grads["dv"], grads.get("dgate", q.new_empty(0))]


@_vsa_bwd.register_fake
def _(dout, q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, residuals, topk, block_elems, layout, backend,
      seq_prefix, prefix_blocks, prefix_mode, softmax_scale, padding):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(q) if gate is not None else q.new_empty(0)]


def _vsa_setup(ctx, inputs, output):
    (q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, topk, block_elems, layout, backend, training, seq_prefix,
     prefix_blocks, prefix_mode, softmax_scale, padding) = inputs
    saved = dict(zip(_VSA_OUTPUTS, output))
    ctx.save_for_backward(q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix,
                          *(saved[n] for n in _VSA_SAVED))
    ctx.static = (topk, block_elems, layout, backend)
    ctx.prefix = (prefix_blocks, prefix_mode, softmax_scale, padding)
    ctx.mark_non_differentiable(*output[1:])


def _vsa_backward(ctx, grads):
    q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix, *residuals = ctx.saved_tensors
    dq, dk, dv, dgate = _vsa_bwd(grads[0], q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, residuals, *ctx.static,
                                 seq_prefix, *ctx.prefix)
    return (dq, dk, dv, None, None, (dgate if gate is not None else None)) + (None,) * 12


torch.library.register_autograd("vsa::video_sparse_attn_fwd", _vsa_backward, setup_context=_vsa_setup)


# ---- block-sparse attention with a given selection --------------------------------------
def _bsa_problem(q, k, v, kv_counts, block_map, sel_idx, cu_q, block_elems, layout, softmax_scale,
                 padding) -> AttnProblem:
    selection = "block_map" if block_map is not None else "indices"
    capacity = sel_idx.shape[-1] if block_map is None else None
    return _problem(q, k, v, kv_counts, None, None, None, block_elems, layout, selection, cu_q=cu_q,
                    list_capacity=capacity, softmax_scale=softmax_scale, padding=padding)


@torch.library.custom_op("vsa::block_sparse_attn_fwd", mutates_args=())
def _bsa_fwd(q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, block_map: Optional[Tensor],
             sel_idx: Optional[Tensor], sel_num: Optional[Tensor], cu_q: Optional[Tensor], cu_k: Optional[Tensor],
             block_elems: int, layout: str, backend: str, softmax_scale: float, padding: str) -> List[Tensor]:
    """Returns out, lse and the lists the forward ran: from a block map, or the given lists
    as the kernels' rule reads them (ascending, in range; packed: own sequence only)."""
    p = _bsa_problem(q, k, v, kv_counts, block_map, sel_idx, cu_q, block_elems, layout, softmax_scale, padding)
    impl = resolve_backend(backend, p, device_info(q))
    out = _alloc(p.forward_buffers(), q)
    bufs = dict(q=q, k=k, v=v, kv_counts=kv_counts, block_map=block_map, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                **out)
    if sel_idx is not None:
        bufs.update(given_idx=sel_idx, given_num=sel_num)  # the forward writes the lists it runs to sel_idx
    core_ops.forward(p, impl, bufs, adapter=TORCH_BUFFERS)
    return [out[n] for n in ("out", "lse", "sel_idx", "sel_num") if n in out]


@_bsa_fwd.register_fake
def _(q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, block_elems, layout, backend, softmax_scale,
      padding):
    p = _bsa_problem(q, k, v, kv_counts, block_map, sel_idx, cu_q, block_elems, layout, softmax_scale, padding)
    out = _alloc(p.forward_buffers(), q)
    return [out[n] for n in ("out", "lse", "sel_idx", "sel_num") if n in out]


@torch.library.custom_op("vsa::block_sparse_attn_bwd", mutates_args=())
def _bsa_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, block_map: Optional[Tensor],
             sel_idx: Tensor, sel_num: Tensor, out: Tensor, lse: Tensor, cu_q: Optional[Tensor],
             cu_k: Optional[Tensor], block_elems: int, layout: str, backend: str, softmax_scale: float,
             padding: str) -> List[Tensor]:
    p = _bsa_problem(q, k, v, kv_counts, block_map, sel_idx, cu_q, block_elems, layout, softmax_scale, padding)
    impl = resolve_backend(backend, p, device_info(q))
    grads = _alloc(p.backward_buffers(), q)
    core_ops.backward(p, impl, dict(dout=dout.contiguous(), q=q, k=k, v=v, kv_counts=kv_counts,
                                    block_map=block_map, sel_idx=sel_idx, sel_num=sel_num, out=out, lse=lse,
                                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **grads), adapter=TORCH_BUFFERS)
    return [grads["dq"], grads["dk"], grads["dv"]]


@_bsa_bwd.register_fake
def _(dout, q, k, v, kv_counts, block_map, sel_idx, sel_num, out, lse, cu_q, cu_k, block_elems, layout, backend,
      softmax_scale, padding):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _bsa_setup(ctx, inputs, output):
    (q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, block_elems, layout, backend, softmax_scale,
     padding) = inputs
    if len(output) == 4:  # the lists the forward ran: the backward runs the same
        sel_idx, sel_num = output[2], output[3]
    ctx.save_for_backward(q, k, v, kv_counts, block_map, sel_idx, sel_num, output[0], output[1], cu_q, cu_k)
    ctx.static = (block_elems, layout, backend, softmax_scale, padding)
    ctx.mark_non_differentiable(*output[1:])


def _bsa_backward(ctx, grads):
    dq, dk, dv = _bsa_bwd(grads[0], *ctx.saved_tensors, *ctx.static)
    return (dq, dk, dv) + (None,) * 11


torch.library.register_autograd("vsa::block_sparse_attn_fwd", _bsa_backward, setup_context=_bsa_setup)


def counts_tensor(name: str, counts) -> Tensor:
    """Counts as a tensor before anything reads their shape or dtype: torch.compile traces
    a numpy array (e.g. `meta.variable_block_sizes`) as a tensor and cannot read the
    array's own attributes, while torch.as_tensor of it traces."""
    if isinstance(counts, Tensor):
        return counts
    try:
        return torch.as_tensor(counts)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a 1-D integer array (numpy, torch or a list of ints), "
                        f"got {type(counts).__name__}") from None


def as_counts(name: str, counts, like: Tensor, block_elems: int) -> Tensor:
    """Any integer array -> int32 tensor on q's device, values checked."""
    if not isinstance(counts, Tensor):
        counts = torch.as_tensor(counts)
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer array, got dtype {counts.dtype}")
    if torch.compiler.is_compiling():
        pass  # traced: values unknown (torch.compile checks nothing on the host per call)
    elif like.is_cuda and torch.cuda.is_current_stream_capturing():
        # CUDA-graph capture: a host read of device counts or a copy of host counts to the
        # device synchronises, which breaks the capture. The values were checked on the
        # eager warm-up call that capture needs anyway; shapes and dtypes still are.
        if not counts.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor while a CUDA graph is being captured (host "
                             f"counts would be copied to the device with a synchronisation), got {counts.device}")
    else:
        check_counts_once(name, counts, block_elems)
    return counts.to(device=like.device, dtype=torch.int32)


def check_devices(like: Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != like.device:
            raise ValueError(f"{name} must be on q's device ({like.device}), got {t.device}")


def vsa_forward(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, backend, cu_q=None, cu_k=None,
                seq_prefix=None, prefix_blocks: int = 0, prefix_mode: str = "exempt", *,
                softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tensor:
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, gate))
    return _vsa_fwd(q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, topk, block_elems, layout, backend, training,
                    seq_prefix, prefix_blocks, prefix_mode, resolve_softmax_scale(softmax_scale, q.shape[-1]), padding)[0]


def as_prefix(p: AttnProblem, prefix_blocks, like: Tensor, cu_q: Tensor, cu_k: Tensor) -> Optional[Tensor]:
    """Packed calls: per-sequence prefix counts (p.seq_prefix; the problem checked their shape
    and dtype) as int32 on q's device, None for an int (static in the problem). Eagerly their
    values (an int's too) are checked against the offsets (a host read, once per tensor
    version); under torch.compile not."""
    if not p.has_prefix:
        return None
    counts = torch.as_tensor(prefix_blocks) if p.seq_prefix else None
    if not torch.compiler.is_compiling():
        tensors = (cu_q, cu_k) + ((counts,) if p.seq_prefix else ())
        _check_once(tensors, ("prefix_blocks", p.prefix_blocks, p.block_elems),
                    lambda: check_prefix_values(counts.cpu().numpy() if p.seq_prefix else p.prefix_blocks,
                                                cu_q.cpu().numpy(), cu_k.cpu().numpy(), p.block_elems))
    return counts.to(device=like.device, dtype=torch.int32).contiguous() if p.seq_prefix else None


def bsa_forward(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, backend, cu_q=None,
                cu_k=None, *, softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    res = _bsa_fwd(q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, block_elems, layout, backend,
                   resolve_softmax_scale(softmax_scale, q.shape[-1]), padding)
    return res[0], res[1]


def as_offsets(name: str, cu: Tensor, like: Tensor) -> Tensor:
    """int32 offsets on q's device (dtype checked by describe_varlen)."""
    return cu.to(device=like.device).contiguous()
