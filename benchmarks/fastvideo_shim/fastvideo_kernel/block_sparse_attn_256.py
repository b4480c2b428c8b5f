"""FastVideo's `fastvideo_kernel.block_sparse_attn_256` (128- and 256-token blocks) over vsa_torch."""

import vsa_torch

from . import backend_for
from .block_sparse_attn import _block_map


def _attention(block: int, layout: str):
    def attention(q, k, v, block_map, variable_block_sizes):
        """-> (out, lse [B, H, Sq]) with `block`-token blocks."""
        return vsa_torch.block_sparse_attn(q, k, v, _block_map(block_map), variable_block_sizes, block, layout=layout,
                                           backend=backend_for(block))
    attention.__name__ = f"block_sparse_attn_{block}" + ("_bshd" if layout == "bshd" else "")
    return attention


block_sparse_attn_128 = _attention(128, "bhsd")
block_sparse_attn_128_bshd = _attention(128, "bshd")
block_sparse_attn_256 = _attention(256, "bhsd")
block_sparse_attn_256_bshd = _attention(256, "bshd")
