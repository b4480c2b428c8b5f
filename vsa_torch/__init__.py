"""PyTorch frontend of Video Sparse Attention.

    from vsa_torch import video_sparse_attn
    out = video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk=32,
                            block_size=(4, 4, 4), compress_attn_weight=gate)

q, k, v are `[B, H, S, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`) in tile-contiguous
token order (see `build_vsa_metadata` / `to_tiled` / `from_tiled`), bf16 or fp16, D 64
or 128; S is a multiple of the block's token count E (64, 128 or 256).

CPU tensors run the same Triton kernels under Triton's interpreter (slow; for tests and
small checks; a warning says so once per process). The top-k ranking uses the fp32
coarse scores (FastVideo ranks bf16-rounded scores: near-ties may pick other blocks).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from vsa_core import __version__
from vsa_core.backends import BackendUnavailableError, check_backend_name
from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes
from vsa_core.problem import check_block_map, check_index_lists, describe_attention

from . import ops as _ops

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata",
           "BackendUnavailableError", "__version__"]


def _require_tensors(**tensors):
    for name, t in tensors.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
         backend, layout) -> Tensor:
    _require_tensors(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    check_backend_name(backend)
    variable_block_sizes = _ops.counts_tensor("variable_block_sizes", variable_block_sizes)
    q_variable_block_sizes = _ops.counts_tensor("q_variable_block_sizes", q_variable_block_sizes)
    p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                           q_counts=q_variable_block_sizes, topk=topk, gate=compress_attn_weight)
    _ops.check_devices(q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    E = p.block_elems
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, E)
    q_counts = _ops.as_counts("q_variable_block_sizes", q_variable_block_sizes, q, E)
    gate = compress_attn_weight.contiguous() if compress_attn_weight is not None else None
    # p.topk: clamped to the number of KV blocks (any Python int is accepted)
    return _ops.vsa_forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_counts, q_counts, gate,
                            p.topk, E, layout, backend)


def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes, topk: int,
                      block_size=64, compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto"
                      ) -> Tensor:
    """Video Sparse Attention on `[B, H, S, D]` tensors (a drop-in for FastVideo's).

    Coarse branch: attention between block means; selection: for each query block the
    `topk` KV blocks with the highest coarse scores; fine branch: attention restricted
    to the selected blocks' valid tokens. Returns out_coarse * compress_attn_weight +
    out_fine (out_coarse + out_fine without a gate). Differentiable in q, k, v and the gate.

    `topk` (an int >= 1) larger than the number of KV blocks is clamped to it (every
    non-empty block is then selected); empty blocks (count 0) are never selected, so a
    row may get fewer than `topk`. Ranking uses the fp32 coarse scores, ties to the
    lower block index. `block_size`: E as an int, or the (t, h, w) tile of
    `build_vsa_metadata` (ints; t*h*w must be 64, 128 or 256). Counts: 1-D integer
    arrays (numpy, torch or lists), values in [0, E].
    `backend`: "auto", "triton" or "cute" (VSA_BACKEND in the environment replaces "auto").
    """
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bhsd")


def video_sparse_attn_bshd(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes,
                           topk: int, block_size=64, compress_attn_weight: Optional[Tensor] = None, *,
                           backend: str = "auto") -> Tensor:
    """`video_sparse_attn` on `[B, S, H, D]` tensors (no transpose is made)."""
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bshd")


def block_sparse_attn(q: Tensor, k: Tensor, v: Tensor, block_map: Tensor, variable_block_sizes, block_size=64,
                      *, layout: str = "bhsd", backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """Attention of each query block to the KV blocks set in `block_map` (bool
    `[B, H, nQ, nKV]`), restricted to their valid tokens. Returns (out, lse): lse is
    the natural-log logsumexp of the scaled scores, fp32 `[B, H, Sq]` (-inf for a query
    block with nothing selected). Gradients flow through out (lse is not differentiable)."""
    _require_tensors(q=q, k=k, v=v, block_map=block_map)
    check_backend_name(backend)
    variable_block_sizes = _ops.counts_tensor("variable_block_sizes", variable_block_sizes)
    p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                           selection="block_map")
    check_block_map(block_map, p)
    _ops.check_devices(q, k=k, v=v, block_map=block_map)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, p.block_elems)
    return _ops.bsa_forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_counts, block_map.contiguous(),
                            None, None, p.block_elems, layout, backend)


def block_sparse_attn_from_indices(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_counts: Tensor,
                                   variable_block_sizes, block_size=64, *, layout: str = "bhsd",
                                   backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """`block_sparse_attn` with the selection given as lists: `block_indices`
    `[B, H, nQ, capacity]` int32 holds, for each query block, `block_counts[b, h, i]`
    ascending KV block indices (entries past the count are ignored)."""
    _require_tensors(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    check_backend_name(backend)
    variable_block_sizes = _ops.counts_tensor("variable_block_sizes", variable_block_sizes)
    p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                           selection="indices")
    check_index_lists(block_indices, block_counts, p)
    _ops.check_devices(q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, p.block_elems)
    return _ops.bsa_forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_counts, None,
                            block_indices.contiguous(), block_counts.contiguous(), p.block_elems, layout, backend)


def to_tiled(x: Tensor, meta: VSAMetadata, dim: int = -2) -> Tensor:
    """Raw (T, H, W row-major) tokens along `dim` -> padded tile-contiguous order."""
    dim = dim % x.dim()
    shape = list(x.shape)
    shape[dim] = meta.padded_len
    out = x.new_zeros(shape)
    src = torch.as_tensor(meta.tiled_from_raw, device=x.device)
    dst = torch.as_tensor(meta.non_pad_index, device=x.device)
    return out.index_copy(dim, dst, x.index_select(dim, src))


def from_tiled(x: Tensor, meta: VSAMetadata, dim: int = -2) -> Tensor:
    """Padded tile-contiguous order along `dim` -> raw token order (padding dropped)."""
    idx = torch.as_tensor(meta.non_pad_index[meta.raw_from_tiled], device=x.device)
    return x.index_select(dim % x.dim(), idx)
