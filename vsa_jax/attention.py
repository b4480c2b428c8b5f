"""The public functions of vsa_jax: each is the core's call path (`vsa_core.frontend`) over
this frontend's adapter (`vsa_jax.adapter`); their docstrings are the core's (`vsa_core.docs`)."""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from vsa_core.metadata import VSAMetadata
from vsa_core import frontend as F
from vsa_core.docs import documented

from .adapter import JAX


@documented("jax")
def video_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes, q_variable_block_sizes,
                      topk: int, block_size=64, compress_attn_weight: Optional[jax.Array] = None, *,
                      backend: str = "auto", prefix_blocks: int = 0, prefix_mode: str = "exempt",
                      softmax_scale: Optional[float] = None, padding: str = "zeros") -> jax.Array:
    return F.vsa_call(JAX, q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                      compress_attn_weight, backend=backend, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                      softmax_scale=softmax_scale, padding=padding)


@documented("jax")
def video_sparse_attn_bshd(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes,
                           q_variable_block_sizes, topk: int, block_size=64,
                           compress_attn_weight: Optional[jax.Array] = None, *, backend: str = "auto",
                           prefix_blocks: int = 0, prefix_mode: str = "exempt",
                           softmax_scale: Optional[float] = None, padding: str = "zeros") -> jax.Array:
    return F.vsa_call(JAX, q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                      compress_attn_weight, layout="bshd", backend=backend, prefix_blocks=prefix_blocks,
                      prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding)


@documented("jax")
def block_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, block_map: jax.Array, variable_block_sizes,
                      block_size=64, *, layout: str = "bhsd", backend: str = "auto",
                      softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    return F.block_sparse_call(JAX, q, k, v, variable_block_sizes, block_size, block_map=block_map, layout=layout,
                               backend=backend, softmax_scale=softmax_scale, padding=padding)


@documented("jax")
def block_sparse_attn_from_indices(q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array,
                                   block_counts: jax.Array, variable_block_sizes, block_size=64, *,
                                   layout: str = "bhsd", backend: str = "auto", softmax_scale: Optional[float] = None,
                                   padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    return F.block_sparse_call(JAX, q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                               block_counts=block_counts, layout=layout, backend=backend,
                               softmax_scale=softmax_scale, padding=padding)


# ---- packed variable-length sequences ------------------------------------------------------
@documented("jax")
def video_sparse_attn_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                             variable_block_sizes, q_variable_block_sizes, topk: int, block_size=64,
                             compress_attn_weight: Optional[jax.Array] = None, *, backend: str = "auto",
                             prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> jax.Array:
    return F.vsa_call(JAX, q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                      compress_attn_weight, backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale,
                      padding=padding)


@documented("jax")
def block_sparse_attn_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                             block_map: jax.Array, variable_block_sizes, block_size=64, *, backend: str = "auto",
                             softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    return F.block_sparse_call(JAX, q, k, v, variable_block_sizes, block_size, block_map=block_map,
                               backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               softmax_scale=softmax_scale, padding=padding)


@documented("jax")
def block_sparse_attn_varlen_from_indices(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                                          block_indices: jax.Array, block_counts: jax.Array, variable_block_sizes,
                                          block_size=64, *, backend: str = "auto",
                                          softmax_scale: Optional[float] = None, padding: str = "zeros"
                                          ) -> Tuple[jax.Array, jax.Array]:
    return F.block_sparse_call(JAX, q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                               block_counts=block_counts, backend=backend, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, padding=padding)


@documented("jax")
def pack_block_indices(block_indices_list, block_counts_list, kv_blocks_per_sequence
                       ) -> Tuple[jax.Array, jax.Array]:
    offsets = F.packed_list_offsets(block_indices_list, block_counts_list, kv_blocks_per_sequence)
    idx = [jnp.asarray(t)[0] if jnp.ndim(t) == 4 else jnp.asarray(t) for t in block_indices_list]
    num = [jnp.asarray(t)[0] if jnp.ndim(t) == 3 else jnp.asarray(t) for t in block_counts_list]
    capacity = max(t.shape[-1] for t in idx)
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
