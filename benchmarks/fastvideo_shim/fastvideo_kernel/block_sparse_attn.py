"""FastVideo's `fastvideo_kernel.block_sparse_attn` (64-token blocks) over vsa_torch."""

import torch

import vsa_torch

from . import backend_for

BLOCK = 64


def _map_to_index(block_map: torch.Tensor):
    """A bool block map [B, H, nQ, nKV] (or [H, nQ, nKV]) -> (q2k_idx int32 [B, H, nQ, nKV], ascending
    selected KV blocks first; q2k_num int32 [B, H, nQ])."""
    if block_map.dim() == 3:
        block_map = block_map.unsqueeze(0)
    selected = block_map.to(torch.bool)
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)  # selected first, each run ascending
    return order.to(torch.int32).contiguous(), selected.sum(-1).to(torch.int32).contiguous()


def _block_map(block_map: torch.Tensor) -> torch.Tensor:
    return (block_map.unsqueeze(0) if block_map.dim() == 3 else block_map).to(torch.bool)


def block_sparse_attn(q, k, v, block_map, variable_block_sizes):
    """-> (out, lse); vsa's lse is the natural-log logsumexp (FastVideo's kernels return other
    scalings of it, which its tests do not compare)."""
    return vsa_torch.block_sparse_attn(q, k, v, _block_map(block_map), variable_block_sizes, BLOCK,
                                       backend=backend_for(BLOCK))


def block_sparse_attn_from_indices(q, k, v, q2k_idx, q2k_num, variable_block_sizes):
    return vsa_torch.block_sparse_attn_from_indices(q, k, v, q2k_idx.to(torch.int32), q2k_num.to(torch.int32),
                                                    variable_block_sizes, BLOCK, backend=backend_for(BLOCK))


def block_sparse_attn_triton(q, k, v, q2k_idx, q2k_num, variable_block_sizes):
    """FastVideo's Triton custom op: vsa's triton backend."""
    return vsa_torch.block_sparse_attn_from_indices(q, k, v, q2k_idx.to(torch.int32), q2k_num.to(torch.int32),
                                                    variable_block_sizes, BLOCK, backend="triton")
