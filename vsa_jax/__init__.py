# The package docstring is written once for both frontends, in the core (vsa_core.docs.PACKAGE).
from vsa_core import __version__
from vsa_core.backends import BackendUnavailableError
from vsa_core.docs import package_doc
from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes

from .attention import (video_sparse_attn, video_sparse_attn_bshd, block_sparse_attn,
                        block_sparse_attn_from_indices, video_sparse_attn_varlen, block_sparse_attn_varlen,
                        block_sparse_attn_varlen_from_indices, pack_block_indices, to_tiled, from_tiled)
from . import parallel  # noqa: F401  (vsa_jax.parallel: sequence parallelism)
from .native import set_launch

__doc__ = package_doc("jax")
__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "video_sparse_attn_varlen", "block_sparse_attn_varlen", "block_sparse_attn_varlen_from_indices",
           "pack_block_indices", "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata",
           "BackendUnavailableError", "__version__", "set_launch"]
