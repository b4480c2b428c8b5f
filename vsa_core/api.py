"""The one entry both frontends call per user call: check the arguments, build the problem.

`prepare_vsa` / `prepare_block_sparse` take the user's arrays (anything with .shape and
.dtype: torch tensors, jax arrays or tracers, numpy) and static arguments, run every
shape / dtype / name check of `vsa_core.problem` once, and return a `PreparedCall`: the
problem (with its normalised static arguments: tokens per block E, topk clamped to the
number of KV blocks, the layout) and the checked backend name. What stays in a frontend
is what only it can know: its array types, devices, and value checks of concrete arrays.

Inside the operator (a torch.library custom op, which takes only tensors and scalars;
a jax.custom_vjp, which may run on per-device shards under vsa_jax.spmd) the problem is
rebuilt from the arrays' shapes and the static arguments by `op_problem`: a cache hit
keyed on those statics, with no checks (they ran here).
"""

from __future__ import annotations

import dataclasses

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from .backends import check_backend_name
from .problem import (AttnProblem, BlockSize, check_block_map, check_index_lists, describe_attention,
                      describe_varlen, dtype_name)


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


def op_problem(q, k, *, block_elems: int, layout: str, selection: str, topk: Optional[int] = None,
               has_gate: bool = False, training: bool = True, cu_seqlens_q=None,
               list_capacity: Optional[int] = None, prefix_blocks: int = 0, prefix_mode: str = "exempt",
               seq_prefix=None, softmax_scale: Optional[float] = None, padding: str = "zeros") -> AttnProblem:
    """The problem of an operator call whose arguments `prepare_*` checked: rebuilt from q's
    and k's shapes and dtype and the static arguments. Packed sequences (cu_seqlens_q given)
    arrive as BSHD with batch 1; `seq_prefix`: their per-sequence prefix counts (an array)
    if any; `softmax_scale`: the problem's (resolved) scale. Equal to the problem `prepare_*`
    returned for the same arrays (the caches keyed on problems rely on it)."""
    n_seqs = 0 if cu_seqlens_q is None else int(cu_seqlens_q.shape[0]) - 1
    # int(): under torch.compile the static ints may arrive as SymInts, which are not hashable
    return _op_problem(_ints(q.shape), _ints(k.shape), dtype_name(q.dtype), int(block_elems), layout, selection,
                       None if topk is None else int(topk), bool(has_gate), bool(training), n_seqs,
                       None if list_capacity is None else int(list_capacity), int(prefix_blocks), str(prefix_mode),
                       seq_prefix is not None, None if softmax_scale is None else float(softmax_scale), str(padding))


def _ints(shape) -> Tuple[int, ...]:
    return tuple(int(s) for s in shape)  # also makes a traced (symbolic) size concrete, as the checks do


@functools.lru_cache(maxsize=1024)
def _op_problem(q_shape, k_shape, dtype, block_elems, layout, selection, topk, has_gate, training, n_seqs,
                list_capacity, prefix_blocks, prefix_mode, seq_prefix, softmax_scale, padding) -> AttnProblem:
    if layout == "bhsd":
        batch, heads, q_len, head_dim = q_shape
        kv_len = k_shape[2]
    else:
        batch, q_len, heads, head_dim = q_shape
        kv_len = k_shape[1]
    vsa = selection == "topk"
    return AttnProblem(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                       block_elems=block_elems, dtype=dtype, layout=layout,
                       topk=min(int(topk), kv_len // block_elems) if vsa else None, has_gate=vsa and has_gate,
                       selection=selection, training=training, n_seqs=n_seqs, list_capacity=list_capacity,
                       prefix_blocks=prefix_blocks if vsa else 0,
                       prefix_mode=prefix_mode if vsa and (prefix_blocks or seq_prefix) else "exempt",
                       seq_prefix=vsa and seq_prefix, softmax_scale=softmax_scale, padding=padding)
