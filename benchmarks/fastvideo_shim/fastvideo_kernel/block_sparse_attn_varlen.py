"""FastVideo's `fastvideo_kernel.block_sparse_attn_varlen` over vsa_torch's packed call.

FastVideo packs the valid tokens only ([total, H, D], offsets of valid tokens) with lists per
sequence; vsa packs whole blocks. This places each sequence's valid tokens into its blocks
(differentiably), packs the lists (`vsa_torch.pack_block_indices`), runs
`block_sparse_attn_varlen_from_indices` once and gathers the valid rows back.
"""

import torch

import vsa_torch

from . import backend_for

BLOCK_SIZE = 64


def _padded_positions(block_sizes, block_size: int, device) -> torch.Tensor:
    """Row of every valid token in the padded stream: block b's tokens at b * E + [0, size_b)."""
    sizes = block_sizes.to(device=device, dtype=torch.int64)
    starts = torch.arange(sizes.numel(), device=device) * block_size
    first = torch.cumsum(sizes, 0) - sizes  # each block's first token among the valid ones
    token = torch.arange(int(sizes.sum()), device=device)
    block = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes)
    return starts[block] + token - first[block]


def block_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, q2k_idx_list, q2k_num_list,
                             variable_block_sizes_list, q_variable_block_sizes_list=None, block_size=BLOCK_SIZE):
    device = q.device
    n_seqs = cu_seqlens_q.shape[0] - 1
    q_sizes = [q_variable_block_sizes_list[i] if q_variable_block_sizes_list is not None
               else torch.full((q2k_num_list[i].shape[-1],), block_size, dtype=torch.int32) for i in range(n_seqs)]
    kv_sizes = list(variable_block_sizes_list)
    q_blocks = [int(s.numel()) for s in q_sizes]
    kv_blocks = [int(s.numel()) for s in kv_sizes]
    pos_q = _padded_positions(torch.cat([s.to(device) for s in q_sizes]), block_size, device)
    pos_kv = _padded_positions(torch.cat([s.to(device) for s in kv_sizes]), block_size, device)

    def pad(x, n_blocks, pos):
        return x.new_zeros((n_blocks * block_size,) + tuple(x.shape[1:])).index_copy(0, pos, x)

    qp = pad(q, sum(q_blocks), pos_q)
    kp, vp = (pad(x, sum(kv_blocks), pos_kv) for x in (k, v))

    def offsets(blocks):
        return torch.tensor([0] + blocks, device=device).cumsum(0).mul(block_size).to(torch.int32)
    idx, num = vsa_torch.pack_block_indices(q2k_idx_list, q2k_num_list, kv_blocks)
    counts = torch.cat([s.to(device=device, dtype=torch.int32) for s in kv_sizes])
    out, _ = vsa_torch.block_sparse_attn_varlen_from_indices(qp, kp, vp, offsets(q_blocks), offsets(kv_blocks), idx,
                                                              num, counts, block_size, backend=backend_for(block_size))
    return out.index_select(0, pos_q)
