"""The public functions of vsa_torch: each checks its call in the core (`vsa_core.api`), gets
the operator's inputs from the core over this frontend's adapter (`vsa_core.frontend`) and
runs the operator (`vsa_torch.ops`). Their docstrings are
the core's (`vsa_core.docs`)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from vsa_core import frontend as F
from vsa_core.api import prepare_block_sparse, prepare_vsa
from vsa_core.docs import documented
from vsa_core.metadata import VSAMetadata

from . import ops as _ops
from .ops import TORCH


def _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
         backend, layout, prefix_blocks, prefix_mode, softmax_scale, padding) -> Tensor:
    TORCH.require(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    kv_counts = TORCH.counts_array("variable_block_sizes", variable_block_sizes)
    q_counts = TORCH.counts_array("q_variable_block_sizes", q_variable_block_sizes)
    p = prepare_vsa(q, k, v, kv_counts, q_counts, topk, block_size, compress_attn_weight, layout=layout,
                    backend=backend, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                    softmax_scale=softmax_scale, padding=padding).problem
    return _ops.attend(p, backend, F.vsa_inputs(TORCH, p, q, k, v, kv_counts, q_counts, compress_attn_weight))[0]


def _bsa(p, backend, named) -> Tuple[Tensor, Tensor]:
    out, lse, *_ = _ops.attend(p, backend, named)
    return (out[0], lse[0]) if p.varlen else (out, lse)


@documented("torch")
def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes, topk: int,
                      block_size=64, compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto",
                      prefix_blocks: int = 0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                      padding: str = "zeros") -> Tensor:
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bhsd", prefix_blocks, prefix_mode, softmax_scale, padding)


@documented("torch")
def video_sparse_attn_bshd(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes,
                           topk: int, block_size=64, compress_attn_weight: Optional[Tensor] = None, *,
                           backend: str = "auto", prefix_blocks: int = 0, prefix_mode: str = "exempt",
                           softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tensor:
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bshd", prefix_blocks, prefix_mode, softmax_scale, padding)


@documented("torch")
def block_sparse_attn(q: Tensor, k: Tensor, v: Tensor, block_map: Tensor, variable_block_sizes, block_size=64,
                      *, layout: str = "bhsd", backend: str = "auto", softmax_scale: Optional[float] = None,
                      padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    TORCH.require(q=q, k=k, v=v, block_map=block_map)
    kv_counts = TORCH.counts_array("variable_block_sizes", variable_block_sizes)
    p = prepare_block_sparse(q, k, v, kv_counts, block_size, block_map=block_map, layout=layout, backend=backend,
                             softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, F.block_sparse_inputs(TORCH, p, q, k, v, kv_counts, block_map=block_map))


@documented("torch")
def block_sparse_attn_from_indices(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_counts: Tensor,
                                   variable_block_sizes, block_size=64, *, layout: str = "bhsd",
                                   backend: str = "auto", softmax_scale: Optional[float] = None,
                                   padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    TORCH.require(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    kv_counts = TORCH.counts_array("variable_block_sizes", variable_block_sizes)
    p = prepare_block_sparse(q, k, v, kv_counts, block_size, block_indices=block_indices, block_counts=block_counts,
                             layout=layout, backend=backend, softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, F.block_sparse_inputs(TORCH, p, q, k, v, kv_counts, block_indices=block_indices,
                                                  block_counts=block_counts))


# ---- packed variable-length sequences ------------------------------------------------------
@documented("torch")
def video_sparse_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             variable_block_sizes, q_variable_block_sizes, topk: int, block_size=64,
                             compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto",
                             prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tensor:
    TORCH.require(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k)
    if isinstance(prefix_blocks, (list, tuple)):
        prefix_blocks = torch.as_tensor(prefix_blocks)
    p = prepare_vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                    backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale,
                    padding=padding).problem
    named = F.vsa_inputs(TORCH, p, q, k, v, variable_block_sizes, q_variable_block_sizes, compress_attn_weight,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, prefix_blocks=prefix_blocks)
    return _ops.attend(p, backend, named)[0][0]


@documented("torch")
def block_sparse_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             block_map: Tensor, variable_block_sizes, block_size=64, *, backend: str = "auto",
                             softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    TORCH.require(q=q, k=k, v=v, block_map=block_map, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_map=block_map, backend=backend,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, F.block_sparse_inputs(TORCH, p, q, k, v, variable_block_sizes, block_map=block_map,
                                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))


@documented("torch")
def block_sparse_attn_varlen_from_indices(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                          cu_seqlens_k: Tensor, block_indices: Tensor, block_counts: Tensor,
                                          variable_block_sizes, block_size=64, *, backend: str = "auto",
                                          softmax_scale: Optional[float] = None, padding: str = "zeros"
                                          ) -> Tuple[Tensor, Tensor]:
    TORCH.require(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                             block_counts=block_counts, backend=backend, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, padding=padding).problem
    return _bsa(p, backend, F.block_sparse_inputs(TORCH, p, q, k, v, variable_block_sizes,
                                                  block_indices=block_indices, block_counts=block_counts,
                                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))


@documented("torch")
def pack_block_indices(block_indices_list, block_counts_list, kv_blocks_per_sequence) -> Tuple[Tensor, Tensor]:
    if not (len(block_indices_list) == len(block_counts_list) == len(kv_blocks_per_sequence)):
        raise ValueError("block_indices_list, block_counts_list and kv_blocks_per_sequence must have one entry per "
                         f"sequence, got {len(block_indices_list)}, {len(block_counts_list)}, "
                         f"{len(kv_blocks_per_sequence)}")
    idx = [t[0] if t.dim() == 4 else t for t in block_indices_list]
    num = [t[0] if t.dim() == 3 else t for t in block_counts_list]
    capacity = max(t.shape[-1] for t in idx)
    offsets = [0]
    for n in kv_blocks_per_sequence[:-1]:
        offsets.append(offsets[-1] + int(n))
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
