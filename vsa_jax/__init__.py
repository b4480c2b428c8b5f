"""JAX frontend of Video Sparse Attention (same functions and arguments as vsa_torch).

    from vsa_jax import video_sparse_attn
    out = video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk=32,
                            block_size=(4, 4, 4), compress_attn_weight=gate)

q, k, v are `[B, H, S, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`) in tile-contiguous
token order (see `build_vsa_metadata` / `to_tiled` / `from_tiled`), bf16 or fp16, D 64
or 128; S is a multiple of the block's token count E (64, 128 or 256).

Works under jax.jit, jax.grad / jax.vjp (gradients to q, k, v and the gate) and
jax.vmap, and over several devices: inside jax.shard_map (each device runs its shard),
and under jax.jit on arrays sharded over the batch and/or heads with explicit mesh axes
(`jax.make_mesh`'s default), where the call is split per device (see vsa_jax/spmd.py).
Arguments are checked at trace time and raise the same ValueError / TypeError as
vsa_torch; the values of the counts ([0, E]) and of index lists are checked when they are
concrete (numpy or a jax.Array outside jit). Traced values are not checked; the kernels
bound them instead (out-of-range counts act as clamped to [0, E]; index lists: see
`block_sparse_attn_from_indices`), so no value reads out of bounds.

Arrays on the CPU run the same Triton kernels under Triton's interpreter (slow; for
tests and small checks; a warning says so once per process). `topk` larger than the
number of KV blocks is clamped to it. The top-k ranks the coarse scores rounded to the
input dtype, as FastVideo does (ties to the lower block index).
"""

from vsa_core import __version__
from vsa_core.backends import BackendUnavailableError
from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes

from .attention import (video_sparse_attn, video_sparse_attn_bshd, block_sparse_attn,
                        block_sparse_attn_from_indices, video_sparse_attn_varlen, block_sparse_attn_varlen,
                        block_sparse_attn_varlen_from_indices, pack_block_indices, to_tiled, from_tiled)
from . import parallel  # noqa: F401  (vsa_jax.parallel: sequence parallelism)
from .native import set_launch

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "video_sparse_attn_varlen", "block_sparse_attn_varlen", "block_sparse_attn_varlen_from_indices",
           "pack_block_indices", "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata",
           "BackendUnavailableError", "__version__", "set_launch"]
