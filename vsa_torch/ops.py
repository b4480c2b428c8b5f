"""PyTorch glue: torch.library custom ops over `vsa_core.ops`, with autograd and fake
(meta) implementations so that torch.compile(fullgraph=True) traces through them.

Every op allocates the buffers the core's problem table names, hands them to the
core, and returns them; the core launches on torch's current stream.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from vsa_core import ops as core_ops
from vsa_core.backends import resolve_backend
from vsa_core.problem import AttnProblem, check_count_values, describe_attention
from vsa_core.runtime import DeviceInfo

_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int8": torch.int8}


def _alloc(specs: dict, like: Tensor) -> dict:
    return {name: torch.empty(shape, dtype=like.dtype if dt == "input" else _DTYPES[dt], device=like.device)
            for name, (shape, dt) in specs.items()}


def _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, selection, training=True
             ) -> AttnProblem:
    return describe_attention(q, k, v, block_size=block_elems, layout=layout, kv_counts=kv_counts,
                              q_counts=q_counts, topk=topk, gate=gate, selection=selection, training=training)


# Value checks of the count arrays read them on the host; a tensor already checked and
# not modified since (same object, same version counter) is not read again.
_checked: dict = {}


def check_counts_once(name: str, counts: Tensor, block_elems: int) -> None:
    key = (id(counts), block_elems)
    seen = _checked.get(key)
    if seen is not None and seen[0]() is counts and seen[1] == counts._version:
        return
    lo, hi = (int(x) for x in torch.aminmax(counts.to(torch.int64)))
    check_count_values(name, torch.tensor([lo, hi]).numpy(), block_elems)
    if len(_checked) > 256:
        _checked.clear()
    _checked[key] = (weakref.ref(counts), counts._version)


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


@torch.library.custom_op("vsa::video_sparse_attn_fwd", mutates_args=())
def _vsa_fwd(q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, q_counts: Tensor, gate: Optional[Tensor],
             topk: int, block_elems: int, layout: str, backend: str, training: bool) -> List[Tensor]:
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training)
    impl = resolve_backend(backend, p, DeviceInfo.of(q))
    out = _vsa_outputs(p, q)
    core_ops.forward(p, impl, dict(q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts, gate=gate,
                                   **{n: t for n, t in out.items() if n in p.forward_buffers()}))
    return [out[n] for n in _VSA_OUTPUTS]


@_vsa_fwd.register_fake
def _(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, backend, training):
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training)
    out = _vsa_outputs(p, q)
    return [out[n] for n in _VSA_OUTPUTS]


@torch.library.custom_op("vsa::video_sparse_attn_bwd", mutates_args=())
def _vsa_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, q_counts: Tensor,
             gate: Optional[Tensor], residuals: List[Tensor], topk: int, block_elems: int, layout: str,
             backend: str) -> List[Tensor]:
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk")
    impl = resolve_backend(backend, p, DeviceInfo.of(q))
    grads = _alloc(p.backward_buffers(), q)
    core_ops.backward(p, impl, dict(dout=dout.contiguous(), q=q, k=k, v=v, kv_counts=kv_counts,
                                    q_counts=q_counts, gate=gate, **dict(zip(_VSA_SAVED, residuals)), **grads))
    return [grads["dq"], grads["dk"], grads["dv"], grads.get("dgate", q.new_empty(0))]


@_vsa_bwd.register_fake
def _(dout, q, k, v, kv_counts, q_counts, gate, residuals, topk, block_elems, layout, backend):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(q) if gate is not None else q.new_empty(0)]


def _vsa_setup(ctx, inputs, output):
    q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, backend, training = inputs
    saved = dict(zip(_VSA_OUTPUTS, output))
    ctx.save_for_backward(q, k, v, kv_counts, q_counts, gate, *(saved[n] for n in _VSA_SAVED))
    ctx.static = (topk, block_elems, layout, backend)
    ctx.mark_non_differentiable(*output[1:])


def _vsa_backward(ctx, grads):
    q, k, v, kv_counts, q_counts, gate, *residuals = ctx.saved_tensors
    dq, dk, dv, dgate = _vsa_bwd(grads[0], q, k, v, kv_counts, q_counts, gate, residuals, *ctx.static)
    return dq, dk, dv, None, None, (dgate if gate is not None else None), None, None, None, None, None


torch.library.register_autograd("vsa::video_sparse_attn_fwd", _vsa_backward, setup_context=_vsa_setup)


# ---- block-sparse attention with a given selection --------------------------------------
@torch.library.custom_op("vsa::block_sparse_attn_fwd", mutates_args=())
def _bsa_fwd(q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, block_map: Optional[Tensor],
             sel_idx: Optional[Tensor], sel_num: Optional[Tensor], block_elems: int, layout: str,
             backend: str) -> List[Tensor]:
    selection = "block_map" if block_map is not None else "indices"
    p = _problem(q, k, v, kv_counts, None, None, None, block_elems, layout, selection)
    impl = resolve_backend(backend, p, DeviceInfo.of(q))
    out = _alloc(p.forward_buffers(), q)
    bufs = dict(q=q, k=k, v=v, kv_counts=kv_counts, block_map=block_map, **out)
    if sel_idx is not None:
        bufs.update(sel_idx=sel_idx, sel_num=sel_num)
    core_ops.forward(p, impl, bufs)
    if block_map is None:
        return [out["out"], out["lse"]]
    return [out["out"], out["lse"], out["sel_idx"], out["sel_num"]]


@_bsa_fwd.register_fake
def _(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, backend):
    selection = "block_map" if block_map is not None else "indices"
    p = _problem(q, k, v, kv_counts, None, None, None, block_elems, layout, selection)
    out = _alloc(p.forward_buffers(), q)
    return [out[n] for n in ("out", "lse", "sel_idx", "sel_num") if n in out]


@torch.library.custom_op("vsa::block_sparse_attn_bwd", mutates_args=())
def _bsa_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, kv_counts: Tensor, block_map: Optional[Tensor],
             sel_idx: Tensor, sel_num: Tensor, out: Tensor, lse: Tensor, block_elems: int, layout: str,
             backend: str) -> List[Tensor]:
    selection = "block_map" if block_map is not None else "indices"
    p = _problem(q, k, v, kv_counts, None, None, None, block_elems, layout, selection)
    impl = resolve_backend(backend, p, DeviceInfo.of(q))
    grads = _alloc(p.backward_buffers(), q)
    core_ops.backward(p, impl, dict(dout=dout.contiguous(), q=q, k=k, v=v, kv_counts=kv_counts,
                                    block_map=block_map, sel_idx=sel_idx, sel_num=sel_num, out=out, lse=lse,
                                    **grads))
    return [grads["dq"], grads["dk"], grads["dv"]]


@_bsa_bwd.register_fake
def _(dout, q, k, v, kv_counts, block_map, sel_idx, sel_num, out, lse, block_elems, layout, backend):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _bsa_setup(ctx, inputs, output):
    q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, backend = inputs
    if block_map is not None:
        sel_idx, sel_num = output[2], output[3]
    ctx.save_for_backward(q, k, v, kv_counts, block_map, sel_idx, sel_num, output[0], output[1])
    ctx.static = (block_elems, layout, backend)
    ctx.mark_non_differentiable(*output[1:])


def _bsa_backward(ctx, grads):
    dq, dk, dv = _bsa_bwd(grads[0], *ctx.saved_tensors, *ctx.static)
    return dq, dk, dv, None, None, None, None, None, None, None


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
    if not torch.compiler.is_compiling():
        check_counts_once(name, counts, block_elems)
    return counts.to(device=like.device, dtype=torch.int32)


def check_devices(like: Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != like.device:
            raise ValueError(f"{name} must be on q's device ({like.device}), got {t.device}")


def vsa_forward(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, backend) -> Tensor:
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, gate))
    return _vsa_fwd(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, backend, training)[0]


def bsa_forward(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, backend
                ) -> Tuple[Tensor, Tensor]:
    res = _bsa_fwd(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, backend)
    return res[0], res[1]
