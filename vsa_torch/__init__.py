"""PyTorch frontend of Video Sparse Attention.

    from vsa_torch import video_sparse_attn
    out = video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk=32,
                            block_size=(4, 4, 4), compress_attn_weight=gate)

q, k, v are `[B, H, S, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`) in tile-contiguous
token order (see `build_vsa_metadata` / `to_tiled` / `from_tiled`), bf16 or fp16, D 64
or 128; S is a multiple of the block's token count E (64, 128 or 256).

CPU tensors run the same Triton kernels under Triton's interpreter (slow; for tests and
small checks; a warning says so once per process). The top-k ranks the coarse scores
rounded to the input dtype, as FastVideo does (ties to the lower block index).
"""

from vsa_core import __version__
from vsa_core.backends import BackendUnavailableError
from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes

from .attention import (video_sparse_attn, video_sparse_attn_bshd, block_sparse_attn,
                        block_sparse_attn_from_indices, video_sparse_attn_varlen, block_sparse_attn_varlen,
                        block_sparse_attn_varlen_from_indices, pack_block_indices, to_tiled, from_tiled)
from . import parallel  # noqa: F401  (vsa_torch.parallel: sequence parallelism)

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "video_sparse_attn_varlen", "block_sparse_attn_varlen", "block_sparse_attn_varlen_from_indices",
           "pack_block_indices", "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata",
           "BackendUnavailableError", "__version__"]
