"""The public functions of vsa_jax: each checks its call in the core (`vsa_core.api`), gets
the operator's inputs from the core over this frontend's adapter (`vsa_core.frontend`) and
runs the operator (`vsa_jax.ops`). Their docstrings are
the core's (`vsa_core.docs`)."""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from vsa_core.metadata import VSAMetadata
from vsa_core import frontend as F
from vsa_core.api import prepare_block_sparse, prepare_vsa
from vsa_core.docs import documented
from vsa_core.spec import AXES, PUBLIC_NAMES, forward_inputs

from . import ops as _ops
from . import spmd as _spmd
from .adapter import JAX


def _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
         backend, layout, prefix_blocks, prefix_mode, softmax_scale, padding) -> jax.Array:
    JAX.require(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    variable_block_sizes = JAX.counts_array("variable_block_sizes", variable_block_sizes)
    q_variable_block_sizes = JAX.counts_array("q_variable_block_sizes", q_variable_block_sizes)
    p = prepare_vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                    layout=layout, backend=backend, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                    softmax_scale=softmax_scale, padding=padding).problem
    statics = _ops.statics_for(p, backend, q)
    return _split_call(statics, F.vsa_inputs(JAX, p, q, k, v, variable_block_sizes, q_variable_block_sizes,
                                             compress_attn_weight))[0]


# the spmd split's kind of each axes class of `vsa_core.spec.AXES`
_SPLIT_KINDS = {"bh": "bh", "blocks": "replicated"}


def _split_call(statics, named):
    """(out, lse) of the op, split over the devices when the arrays are sharded over batch /
    heads (see vsa_jax.spmd); on one device (or inside a shard_map) the plain call."""
    names = forward_inputs(statics)
    kinds = tuple(_SPLIT_KINDS.get(AXES[n], statics.layout) for n in names)
    args = tuple(named[n] for n in names)
    split = _spmd.plan_split(statics.layout, statics.block_elems,
                             {PUBLIC_NAMES[n]: (x, kind) for n, x, kind in zip(names, args, kinds)})
    if split is None:
        return _ops.attend(statics, named)
    return _spmd.run_split(lambda *xs: _ops.attend(statics, dict(zip(names, xs))), split, args, kinds,
                           (statics.layout, "bh"))


@documented("jax")
def video_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes, q_variable_block_sizes,
                      topk: int, block_size=64, compress_attn_weight: Optional[jax.Array] = None, *,
                      backend: str = "auto", prefix_blocks: int = 0, prefix_mode: str = "exempt",
                      softmax_scale: Optional[float] = None, padding: str = "zeros") -> jax.Array:
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bhsd", prefix_blocks, prefix_mode, softmax_scale, padding)


@documented("jax")
def video_sparse_attn_bshd(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes,
                           q_variable_block_sizes, topk: int, block_size=64,
                           compress_attn_weight: Optional[jax.Array] = None, *, backend: str = "auto",
                           prefix_blocks: int = 0, prefix_mode: str = "exempt",
                           softmax_scale: Optional[float] = None, padding: str = "zeros") -> jax.Array:
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bshd", prefix_blocks, prefix_mode, softmax_scale, padding)


@documented("jax")
def block_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, block_map: jax.Array, variable_block_sizes,
                      block_size=64, *, layout: str = "bhsd", backend: str = "auto",
                      softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    JAX.require(q=q, k=k, v=v, block_map=block_map)
    variable_block_sizes = JAX.counts_array("variable_block_sizes", variable_block_sizes)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_map=block_map, layout=layout,
                             backend=backend, softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, q, k, v, variable_block_sizes, block_map=block_map)


def _bsa(p, backend, q, k, v, kv_counts, **selection) -> Tuple[jax.Array, jax.Array]:
    """Block-sparse attention with the selection as a map or as lists; split over the devices
    like _vsa when not packed."""
    statics = _ops.statics_for(p, backend, q)
    named = F.block_sparse_inputs(JAX, p, q, k, v, kv_counts, **selection)
    if p.varlen:
        out, lse = _ops.attend(statics, named)
        return out[0], jax.lax.stop_gradient(lse[0])
    out, lse = _split_call(statics, named)
    return out, jax.lax.stop_gradient(lse)


@documented("jax")
def block_sparse_attn_from_indices(q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array,
                                   block_counts: jax.Array, variable_block_sizes, block_size=64, *,
                                   layout: str = "bhsd", backend: str = "auto", softmax_scale: Optional[float] = None,
                                   padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    JAX.require(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    variable_block_sizes = JAX.counts_array("variable_block_sizes", variable_block_sizes)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                             block_counts=block_counts, layout=layout, backend=backend,
                             softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, q, k, v, variable_block_sizes, block_indices=block_indices, block_counts=block_counts)


# ---- packed variable-length sequences ------------------------------------------------------
@documented("jax")
def video_sparse_attn_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                             variable_block_sizes, q_variable_block_sizes, topk: int, block_size=64,
                             compress_attn_weight: Optional[jax.Array] = None, *, backend: str = "auto",
                             prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> jax.Array:
    JAX.require(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    p = prepare_vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                    backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale,
                    padding=padding).problem
    statics = _ops.statics_for(p, backend, q)
    named = F.vsa_inputs(JAX, p, q, k, v, variable_block_sizes, q_variable_block_sizes, compress_attn_weight,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, prefix_blocks=prefix_blocks)
    return _ops.attend(statics, named)[0][0]


@documented("jax")
def block_sparse_attn_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                             block_map: jax.Array, variable_block_sizes, block_size=64, *, backend: str = "auto",
                             softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    JAX.require(q=q, k=k, v=v, block_map=block_map)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_map=block_map, backend=backend,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, q, k, v, variable_block_sizes, block_map=block_map, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k)


@documented("jax")
def block_sparse_attn_varlen_from_indices(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                                          block_indices: jax.Array, block_counts: jax.Array, variable_block_sizes,
                                          block_size=64, *, backend: str = "auto",
                                          softmax_scale: Optional[float] = None, padding: str = "zeros"
                                          ) -> Tuple[jax.Array, jax.Array]:
    JAX.require(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                             block_counts=block_counts, backend=backend, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, q, k, v, variable_block_sizes, block_indices=block_indices, block_counts=block_counts,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


@documented("jax")
def pack_block_indices(block_indices_list, block_counts_list, kv_blocks_per_sequence
                       ) -> Tuple[jax.Array, jax.Array]:
    if not (len(block_indices_list) == len(block_counts_list) == len(kv_blocks_per_sequence)):
        raise ValueError("block_indices_list, block_counts_list and kv_blocks_per_sequence must have one entry per "
                         f"sequence, got {len(block_indices_list)}, {len(block_counts_list)}, "
                         f"{len(kv_blocks_per_sequence)}")
    idx = [jnp.asarray(t)[0] if jnp.ndim(t) == 4 else jnp.asarray(t) for t in block_indices_list]
    num = [jnp.asarray(t)[0] if jnp.ndim(t) == 3 else jnp.asarray(t) for t in block_counts_list]
    capacity = max(t.shape[-1] for t in idx)
    offsets = np.concatenate([[0], np.cumsum([int(n) for n in kv_blocks_per_sequence])[:-1]])
    packed = [jnp.pad(t.astype(jnp.int32) + int(off), ((0, 0), (0, 0), (0, capacity - t.shape[-1])))
              for t, off in zip(idx, offsets)]
    return jnp.concatenate(packed, axis=1), jnp.concatenate([t.astype(jnp.int32) for t in num], axis=1)


@documented("jax")
def to_tiled(x: jax.Array, meta: VSAMetadata, dim: int = -2) -> jax.Array:
    dim = meta.token_axis("x", x.shape, dim, tiled=False)  # shapes are static: free under jit
    shape = list(x.shape)
    shape[dim] = meta.padded_len
    slots = (slice(None),) * dim + (meta.non_pad_index,)
    return jnp.zeros(shape, x.dtype).at[slots].set(jnp.take(x, meta.tiled_from_raw, axis=dim))


@documented("jax")
def from_tiled(x: jax.Array, meta: VSAMetadata, dim: int = -2) -> jax.Array:
    dim = meta.token_axis("x", x.shape, dim, tiled=True)
    return jnp.take(x, meta.non_pad_index[meta.raw_from_tiled], axis=dim)
