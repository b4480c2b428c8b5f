"""Framework-neutral core of Video Sparse Attention: metadata, argument checks,
kernel launches on raw device buffers, backend choice and a float64 reference.
Frontends (vsa_torch, vsa_jax) import this; it imports no frontend."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("vsa")  # the installed distribution's version
except _metadata.PackageNotFoundError:  # run from a source tree without an install
    __version__ = "0+unknown"

from .metadata import VSAMetadata, build_vsa_metadata, non_pad_index, tiled_from_raw, variable_block_sizes
from .problem import AttnProblem, block_elements, describe_attention

__all__ = ["__version__", "VSAMetadata", "build_vsa_metadata", "non_pad_index", "tiled_from_raw", "variable_block_sizes",
           "AttnProblem", "block_elements", "describe_attention"]
