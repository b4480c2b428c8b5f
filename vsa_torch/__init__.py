"""PyTorch frontend of Video Sparse Attention.

    from vsa_torch import video_sparse_attn
    out = video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk=32,
                            block_size=(4, 4, 4), compress_attn_weight=gate)

q, k, v are `[B, H, S, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`) in tile-contiguous
token order (see `build_vsa_metadata` / `to_tiled` / `from_tiled`), bf16 or fp16, D 64
or 128; S is a multiple of the block's token count E (64, 128 or 256).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes
from vsa_core.problem import block_elements, check_block_map, check_index_lists, describe_attention

from . import ops as _ops

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata"]


def _require_tensors(**tensors):
    for name, t in tensors.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
         backend, layout) -> Tensor:
    _require_tensors(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                       q_counts=q_variable_block_sizes, topk=topk, gate=compress_attn_weight)
    _ops.check_devices(q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    E = block_elements(block_size)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, E)
    q_counts = _ops.as_counts("q_variable_block_sizes", q_variable_block_sizes, q, E)
    gate = compress_attn_weight.contiguous() if compress_attn_weight is not None else None
    return _ops.vsa_forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_counts, q_counts, gate,
                            int(topk), E, layout, backend)


def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes, topk: int,
                      block_size=64, compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto"
                      ) -> Tensor:
    """Video Sparse Attention on `[B, H, S, D]` tensors (a drop-in for FastVideo's).

    Coarse branch: attention between block means; selection: for each query block the
    `topk` KV blocks with the highest coarse scores; fine branch: attention restricted
    to the selected blocks' valid tokens. Returns out_coarse * compress_attn_weight +
    out_fine (out_coarse + out_fine without a gate). Differentiable in q, k, v and the gate.
    `backend`: "auto", "triton", "cute" or "cudnn" (VSA_BACKEND in the environment replaces "auto").
    `variable_block_sizes` / `q_variable_block_sizes` values must lie in [0, E]: eager calls
    raise ValueError otherwise; under torch.compile they are not checked and act as clamped
    to [0, E] (above E a full block, below 0 an empty one).
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
    strictly ascending KV block indices (entries past the count are ignored).

    Eager calls check the values and raise ValueError naming `block_indices` /
    `block_counts` (a CUDA pair is checked on the device once, then again only after it
    is modified). Under torch.compile nothing is checked, and the kernels never read out
    of bounds: a count is clamped to [0, capacity], and an entry counts only if it is in
    [0, nKV) and greater than the last counted entry of its row (repeats and entries out
    of order are dropped; `vsa_core.reference.index_lists_to_block_map`), in the forward
    and the backward alike."""
    _require_tensors(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    p = describe_attention(q, k, v, block_size=block_size, layout=layout, kv_counts=variable_block_sizes,
                           selection="indices")
    check_index_lists(block_indices, block_counts, p)
    _ops.check_devices(q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    if not torch.compiler.is_compiling():  # compiled: the kernels bound the lists instead
        _ops.check_index_lists_once(block_indices, block_counts, p.n_kv_blocks)
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


from . import parallel  # noqa: E402,F401  (vsa_torch.parallel: sequence parallelism; needs the names above)
