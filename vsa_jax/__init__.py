"""JAX frontend of Video Sparse Attention (same functions and arguments as vsa_torch).

    from vsa_jax import video_sparse_attn
    out = video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk=32,
                            block_size=(4, 4, 4), compress_attn_weight=gate)

q, k, v are `[B, H, S, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`) in tile-contiguous
token order (see `build_vsa_metadata` / `to_tiled` / `from_tiled`), bf16 or fp16, D 64
or 128; S is a multiple of the block's token count E (64, 128 or 256).

Works under jax.jit, jax.grad / jax.vjp (gradients to q, k, v and the gate) and
jax.vmap. Arguments are checked at trace time and raise the same ValueError /
TypeError as vsa_torch; the count values ([0, E]) are checked when the counts are
concrete (numpy or a jax.Array outside jit), not when they are traced.

Arrays on the CPU run the same Triton kernels under Triton's interpreter (slow; for
tests and small checks; a warning says so once per process). `topk` larger than the
number of KV blocks is clamped to it. The top-k ranking uses the fp32 coarse scores
(FastVideo ranks bf16-rounded scores: near-ties may pick other blocks).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from vsa_core import __version__
from vsa_core.backends import BackendUnavailableError
from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes
from vsa_core.problem import block_elements, check_block_map, check_index_lists, describe_attention

from . import ops as _ops

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata",
           "BackendUnavailableError", "__version__"]


def _require_arrays(**arrays):
    for name, x in arrays.items():
        if x is not None and not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax.Array, got {type(x).__name__}")


def _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
         backend, layout) -> jax.Array:
    _require_arrays(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    _ops.require_counts(variable_block_sizes=variable_block_sizes, q_variable_block_sizes=q_variable_block_sizes)
    p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                           q_counts=q_variable_block_sizes, topk=topk, gate=compress_attn_weight)
    impl = _ops.backend_for(backend, p, q)
    E = block_elements(block_size)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, E)
    q_counts = _ops.as_counts("q_variable_block_sizes", q_variable_block_sizes, E)
    return _ops.vsa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_counts, q_counts,
                    None if compress_attn_weight is None else jnp.asarray(compress_attn_weight),
                    int(topk), E, layout, impl)


def video_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes, q_variable_block_sizes,
                      topk: int, block_size=64, compress_attn_weight: Optional[jax.Array] = None, *,
                      backend: str = "auto") -> jax.Array:
    """Video Sparse Attention on `[B, H, S, D]` arrays (a drop-in for FastVideo's).

    Coarse branch: attention between block means; selection: for each query block the
    `topk` KV blocks with the highest coarse scores; fine branch: attention restricted
    to the selected blocks' valid tokens. Returns out_coarse * compress_attn_weight +
    out_fine (out_coarse + out_fine without a gate). Differentiable in q, k, v and the gate.

    `topk` (an int >= 1) larger than the number of KV blocks is clamped to it (every
    non-empty block is then selected); empty blocks (count 0) are never selected, so a
    row may get fewer than `topk`. Ranking uses the fp32 coarse scores, ties to the
    lower block index. `block_size`: E as an int, or the (t, h, w) tile of
    `build_vsa_metadata` (ints; t*h*w must be 64, 128 or 256). Counts: 1-D integer
    numpy or JAX arrays (or lists), values in [0, E].
    `backend`: "auto", "triton" or "cute" (VSA_BACKEND in the environment replaces "auto").
    `topk`, `block_size` and `backend` are static (Python values, not traced).
    """
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bhsd")


def video_sparse_attn_bshd(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes,
                           q_variable_block_sizes, topk: int, block_size=64,
                           compress_attn_weight: Optional[jax.Array] = None, *, backend: str = "auto"
                           ) -> jax.Array:
    """`video_sparse_attn` on `[B, S, H, D]` arrays (no transpose is made)."""
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bshd")


def block_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, block_map: jax.Array, variable_block_sizes,
                      block_size=64, *, layout: str = "bhsd", backend: str = "auto"
                      ) -> Tuple[jax.Array, jax.Array]:
    """Attention of each query block to the KV blocks set in `block_map` (bool
    `[B, H, nQ, nKV]`), restricted to their valid tokens. Returns (out, lse): lse is
    the natural-log logsumexp of the scaled scores, fp32 `[B, H, Sq]` (-inf for a query
    block with nothing selected). Gradients flow through out (lse is not differentiable)."""
    _require_arrays(q=q, k=k, v=v, block_map=block_map)
    _ops.require_counts(variable_block_sizes=variable_block_sizes)
    p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                           selection="block_map")
    check_block_map(block_map, p)
    impl = _ops.backend_for(backend, p, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    return _ops.bsa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_counts, jnp.asarray(block_map),
                    None, None, p.block_elems, layout, impl)


def block_sparse_attn_from_indices(q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array,
                                   block_counts: jax.Array, variable_block_sizes, block_size=64, *,
                                   layout: str = "bhsd", backend: str = "auto") -> Tuple[jax.Array, jax.Array]:
    """`block_sparse_attn` with the selection given as lists: `block_indices`
    `[B, H, nQ, capacity]` int32 holds, for each query block, `block_counts[b, h, i]`
    ascending KV block indices (entries past the count are ignored)."""
    _require_arrays(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    _ops.require_counts(variable_block_sizes=variable_block_sizes)
    p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                           selection="indices")
    check_index_lists(block_indices, block_counts, p)
    impl = _ops.backend_for(backend, p, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    return _ops.bsa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_counts, None, jnp.asarray(block_indices),
                    jnp.asarray(block_counts), p.block_elems, layout, impl)


def to_tiled(x: jax.Array, meta: VSAMetadata, dim: int = -2) -> jax.Array:
    """Raw (T, H, W row-major) tokens along `dim` -> padded tile-contiguous order (zero padding)."""
    dim = dim % x.ndim
    shape = list(x.shape)
    shape[dim] = meta.padded_len
    slots = (slice(None),) * dim + (meta.non_pad_index,)
    return jnp.zeros(shape, x.dtype).at[slots].set(jnp.take(x, meta.tiled_from_raw, axis=dim))


def from_tiled(x: jax.Array, meta: VSAMetadata, dim: int = -2) -> jax.Array:
    """Padded tile-contiguous order along `dim` -> raw token order (padding dropped)."""
    return jnp.take(x, meta.non_pad_index[meta.raw_from_tiled], axis=dim % x.ndim)
