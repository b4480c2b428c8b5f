"""The public functions of vsa_torch: each is the core's call path (`vsa_core.frontend`) over
this frontend's adapter (`vsa_torch.adapter`); their docstrings are the core's (`vsa_core.docs`)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from vsa_core import frontend as F
from vsa_core.docs import documented
from vsa_core.metadata import VSAMetadata

from .adapter import TORCH


@documented("torch")
def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes, topk: int,
                      block_size=64, compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto",
                      prefix_blocks: int = 0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                      padding: str = "zeros") -> Tensor:
    return F.vsa_call(TORCH, q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                      compress_attn_weight, backend=backend, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                      softmax_scale=softmax_scale, padding=padding)


@documented("torch")
def video_sparse_attn_bshd(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes,
                           topk: int, block_size=64, compress_attn_weight: Optional[Tensor] = None, *,
                           backend: str = "auto", prefix_blocks: int = 0, prefix_mode: str = "exempt",
                           softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tensor:
    return F.vsa_call(TORCH, q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                      compress_attn_weight, layout="bshd", backend=backend, prefix_blocks=prefix_blocks,
                      prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding)


@documented("torch")
def block_sparse_attn(q: Tensor, k: Tensor, v: Tensor, block_map: Tensor, variable_block_sizes, block_size=64,
                      *, layout: str = "bhsd", backend: str = "auto", softmax_scale: Optional[float] = None,
                      padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    return F.block_sparse_call(TORCH, q, k, v, variable_block_sizes, block_size, block_map=block_map, layout=layout,
                               backend=backend, softmax_scale=softmax_scale, padding=padding)


@documented("torch")
def block_sparse_attn_from_indices(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_counts: Tensor,
                                   variable_block_sizes, block_size=64, *, layout: str = "bhsd",
                                   backend: str = "auto", softmax_scale: Optional[float] = None,
                                   padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    return F.block_sparse_call(TORCH, q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                               block_counts=block_counts, layout=layout, backend=backend,
                               softmax_scale=softmax_scale, padding=padding)


# ---- packed variable-length sequences ------------------------------------------------------
@documented("torch")
def video_sparse_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             variable_block_sizes, q_variable_block_sizes, topk: int, block_size=64,
                             compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto",
                             prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tensor:
    return F.vsa_call(TORCH, q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                      compress_attn_weight, backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale,
                      padding=padding)


@documented("torch")
def block_sparse_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             block_map: Tensor, variable_block_sizes, block_size=64, *, backend: str = "auto",
                             softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    return F.block_sparse_call(TORCH, q, k, v, variable_block_sizes, block_size, block_map=block_map,
                               backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               softmax_scale=softmax_scale, padding=padding)


@documented("torch")
def block_sparse_attn_varlen_from_indices(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                          cu_seqlens_k: Tensor, block_indices: Tensor, block_counts: Tensor,
                                          variable_block_sizes, block_size=64, *, backend: str = "auto",
                                          softmax_scale: Optional[float] = None, padding: str = "zeros"
                                          ) -> Tuple[Tensor, Tensor]:
    return F.block_sparse_call(TORCH, q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                               block_counts=block_counts, backend=backend, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, padding=padding)


@documented("torch")
def pack_block_indices(block_indices_list, block_counts_list, kv_blocks_per_sequence) -> Tuple[Tensor, Tensor]:
    offsets = F.packed_list_offsets(block_indices_list, block_counts_list, kv_blocks_per_sequence)
    idx = [t[0] if t.dim() == 4 else t for t in block_indices_list]
    num = [t[0] if t.dim() == 3 else t for t in block_counts_list]
    capacity = max(t.shape[-1] for t in idx)
    packed = [torch.nn.functional.pad(t.to(torch.int32) + off, (0, capacity - t.shape[-1]))
              for t, off in zip(idx, offsets)]
    return torch.cat(packed, dim=1), torch.cat([t.to(torch.int32) for t in num], dim=1)


@documented("torch")
def to_tiled(x: Tensor, meta: VSAMetadata, dim: int = -2) -> Tensor:
    dim = meta.token_axis("x", x.shape, dim, tiled=False)
    shape = list(x.shape)
    shape[dim] = meta.padded_len
    out = x.new_zeros(shape)
    src = torch.as_tensor(meta.tiled_from_raw, device=x.device)
    dst = torch.as_tensor(meta.non_pad_index, device=x.device)
    return out.index_copy(dim, dst, x.index_select(dim, src))


@documented("torch")
def from_tiled(x: Tensor, meta: VSAMetadata, dim: int = -2) -> Tensor:
    dim = meta.token_axis("x", x.shape, dim, tiled=True)
    idx = torch.as_tensor(meta.non_pad_index[meta.raw_from_tiled], device=x.device)
    return x.index_select(dim, idx)
