"""The one entry both frontends call per user call: check the arguments, build the problem.

`prepare_vsa` / `prepare_block_sparse` take the user's arrays (anything with .shape and
.dtype: torch tensors, jax arrays or tracers, numpy) and static arguments, run every
shape / dtype / name check of `vsa_core.problem` once, and return a `PreparedCall`: the
problem (with its normalised static arguments: tokens per block E, topk clamped to the
number of KV blocks, the layout) and the checked backend name. The value checks of the
arrays known on the host and the operator's inputs follow in `vsa_core.frontend`, over the
frontend's adapter (what only it knows: its array types, devices, host reads).

`op_statics` then resolves the backend for the arrays' device and returns the call's
`vsa_core.spec.OpStatics`, the one static argument of the frontend's operator; inside it the
problem is rebuilt from the statics and the arrays' shapes (`vsa_core.spec.op_problem`: a
cache hit, with no checks: they ran here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .backends import check_backend_name, resolve_backend
from .problem import AttnProblem, BlockSize, check_block_map, check_index_lists, describe_attention, describe_varlen
from .runtime import DeviceInfo
from .spec import OpStatics


@dataclass(frozen=True)
class PreparedCall:
    problem: AttnProblem  # .block_elems, .topk (clamped), .layout: the ops' static arguments
    backend: str          # "auto" or a registered backend name (checked)


def _as_shaped(x):
    """Offsets given as a list become a numpy array (anything with .shape and .dtype stays)."""
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)


def prepare_vsa(q, k, v, kv_counts, q_counts, topk, block_size: BlockSize, gate=None, *, layout: str = "bhsd",
                backend: str = "auto", cu_seqlens_q=None, cu_seqlens_k=None, prefix_blocks=0,
                prefix_mode: str = "exempt", softmax_scale=None, padding: str = "zeros") -> PreparedCall:
    """Checks a `video_sparse_attn` call ([B, H, S, D] / [B, S, H, D]; packed [total, H, D]
    when the offsets cu_seqlens_q / cu_seqlens_k are given) and returns its problem.
    `prefix_blocks` / `prefix_mode`: mixed-modality prefix (packed: an int or an array of one
    count per sequence, whose values the frontend checks with `check_prefix_values`).
    `softmax_scale`: None (1/sqrt(D)) or a positive finite float, for both branches; the
    problem holds it resolved (a float).
    `padding`: "zeros" or "ignore" (`vsa_core.problem.PADDINGS`), a static of the problem."""
    check_backend_name(backend)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=kv_counts,
                               q_counts=q_counts, topk=topk, gate=gate, prefix_blocks=prefix_blocks,
                               prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding)
    else:
        p = describe_varlen(q, k, v, _as_shaped(cu_seqlens_q), _as_shaped(cu_seqlens_k), block_size=block_size,
                            kv_counts=kv_counts, q_counts=q_counts, topk=topk, gate=gate,
                            prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding)
    return PreparedCall(p, backend)


def prepare_block_sparse(q, k, v, kv_counts, block_size: BlockSize, *, block_map=None, block_indices=None,
                         block_counts=None, layout: str = "bhsd", backend: str = "auto", cu_seqlens_q=None,
                         cu_seqlens_k=None, softmax_scale=None, padding: str = "zeros") -> PreparedCall:
    """Checks a block-sparse call with the selection as a bool map or as index lists (one of
    the two) and returns its problem; packed when the offsets are given."""
    check_backend_name(backend)
    selection = "block_map" if block_map is not None else "indices"
    capacity = None if block_map is not None else int(block_indices.shape[-1])
    if cu_seqlens_q is None and cu_seqlens_k is None:
        p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=kv_counts,
                               selection=selection, softmax_scale=softmax_scale, padding=padding)
        p = dataclasses.replace(p, list_capacity=capacity)
    else:
        p = describe_varlen(q, k, v, _as_shaped(cu_seqlens_q), _as_shaped(cu_seqlens_k), block_size=block_size,
                            kv_counts=kv_counts, selection=selection, list_capacity=capacity,
                            softmax_scale=softmax_scale, padding=padding)
    if block_map is not None:
        check_block_map(block_map, p)
    else:
        check_index_lists(block_indices, block_counts, p)
    return PreparedCall(p, backend)


def op_statics(p: AttnProblem, backend: str, device: DeviceInfo, *, training: bool = True,
               arrays: str = "CPU tensors", gpu: str = "CUDA tensors") -> OpStatics:
    """The statics of a checked call on `device`: `backend` ("auto" or a name) resolved to the
    backend that runs it (BackendUnavailableError says why none can); `training`: whether the
    forward keeps what the backward needs. `arrays` / `gpu` name the frontend's arrays in the
    warning that CPU arrays run under Triton's interpreter."""
    # Backends refuse by the problem's `training` (a forward-only library kernel runs in inference).
    impl = resolve_backend(backend, dataclasses.replace(p, training=training), device, arrays=arrays, gpu=gpu)
    return OpStatics.of(p, impl.name, training=training)
