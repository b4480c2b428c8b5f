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
from vsa_core.api import prepare_block_sparse, prepare_vsa
from vsa_core.backends import BackendUnavailableError
from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes
from vsa_core.problem import block_elements

from . import ops as _ops

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "video_sparse_attn_varlen", "block_sparse_attn_varlen", "block_sparse_attn_varlen_from_indices",
           "pack_block_indices", "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata",
           "BackendUnavailableError", "__version__"]


def _require_tensors(**tensors):
    for name, t in tensors.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
         backend, layout, prefix_blocks, prefix_mode, softmax_scale, padding) -> Tensor:
    _require_tensors(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    variable_block_sizes = _ops.counts_tensor("variable_block_sizes", variable_block_sizes)
    q_variable_block_sizes = _ops.counts_tensor("q_variable_block_sizes", q_variable_block_sizes)
    p = prepare_vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                    layout=layout, backend=backend, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                    softmax_scale=softmax_scale, padding=padding).problem
    _ops.check_devices(q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    E = p.block_elems
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, E)
    q_counts = _ops.as_counts("q_variable_block_sizes", q_variable_block_sizes, q, E)
    gate = compress_attn_weight.contiguous() if compress_attn_weight is not None else None
    return _ops.attend(p, backend, dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), kv_counts=kv_counts,
                                        q_counts=q_counts, gate=gate))[0]


def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes, topk: int,
                      block_size=64, compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto",
                      prefix_blocks: int = 0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                      padding: str = "zeros") -> Tensor:
    """Video Sparse Attention on `[B, H, S, D]` tensors (a drop-in for FastVideo's).

    q: `[B, H, Sq, D]`; k, v: `[B, H, Skv, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`),
    bf16 or fp16 (all the same dtype), head dim D 64 or 128, Sq and Skv multiples of the
    block's token count E (64, 128 or 256; they may differ). Tokens are in tile order:
    block i is tile i of `build_vsa_metadata`, its `variable_block_sizes[i]` valid tokens
    first, then padding (`to_tiled` / `from_tiled` convert from / to raw (t, h, w) order).
    `variable_block_sizes` counts the valid tokens of each KV block (length Skv / E),
    `q_variable_block_sizes` those of each query block (length Sq / E); for
    self-attention on one video pass `meta.variable_block_sizes` as both.
    `compress_attn_weight` (the gate): q's shape and dtype, or None.
    Returns out: q's shape and dtype, `[B, H, Sq, D]`, in tile order.

    Coarse branch: attention between block means; selection: for each query block the
    `topk` KV blocks with the highest coarse scores; fine branch: attention restricted
    to the selected blocks' valid tokens. Returns out_coarse * compress_attn_weight +
    out_fine (out_coarse + out_fine without a gate). Differentiable in q, k, v and the gate.

    `padding`, what the rows of a block past its count mean:
    - "zeros" (the default): FastVideo's function exactly, gradients included. The padded
      rows of q, k, v and the gate must hold zeros (`to_tiled` writes them): a block mean
      is the sum of all E rows divided by the valid count, so its gradient reaches every
      row of the block; padded query rows are computed like any row (their output is
      out_fine + gate * out_coarse, and `dout` there counts); padded KV rows are masked as
      keys and get only the pooling gradient.
    - "ignore": the padded rows are never read, whatever they hold (NaN and inf included:
      a reused or uninitialised buffer); the padded output rows are exactly 0 (`dout` there
      is ignored) and every padded row of the gradients is exactly 0. The cute and cudnn
      backends then copy the tensors they read with the padded rows zeroed (K, V forward;
      Q, K, V, dout backward).
    With zeros in the padding both give the same valid output rows.

    `topk` (an int >= 1) larger than the number of KV blocks is clamped to it (every
    non-empty block is then selected); empty blocks (count 0) are never selected, so a
    row may get fewer than `topk`. Ranking uses the fp32 coarse scores, ties to the
    lower block index. `block_size`: E as an int, or the (t, h, w) tile of
    `build_vsa_metadata` (ints; t*h*w must be 64, 128 or 256). Counts: 1-D integer
    arrays (numpy, torch or lists), values in [0, E].
        `backend`: "auto", "triton", "cute" or "cudnn" (VSA_BACKEND in the environment replaces "auto").
    `variable_block_sizes` / `q_variable_block_sizes` values must lie in [0, E]: eager calls
    raise ValueError otherwise; under torch.compile they are not checked and act as clamped
    to [0, E] (above E a full block, below 0 an empty one).
    `prefix_blocks` (a Python int, static), `prefix_mode`: mixed modality (joint attention
    over `[text | ... | video]`, Sq == Skv): the first `prefix_blocks` blocks hold the
    non-video tokens. Their query blocks attend every non-empty KV block; a video query
    block attends, with "exempt", every prefix block plus its top-`topk` video blocks, with
    "compete", its top-(`topk` + `prefix_blocks`) blocks of all. Coarse branch and gate as
    without a prefix (`vsa_core.reference.prefix_topk_mask`).
    `softmax_scale` (a positive finite Python float, static: under torch.compile each value
    compiles its own graph; None: 1/sqrt(D), as in FastVideo, flash-attn and SDPA) multiplies
    the scores q k^T before the softmax. One scale serves both branches, as in FastVideo: the
    coarse attention between the block means (and so the scores the top-k ranks) and the fine
    attention.
    """
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bhsd", prefix_blocks, prefix_mode, softmax_scale, padding)


def video_sparse_attn_bshd(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes,
                           topk: int, block_size=64, compress_attn_weight: Optional[Tensor] = None, *,
                           backend: str = "auto", prefix_blocks: int = 0, prefix_mode: str = "exempt",
                           softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tensor:
    """`video_sparse_attn` on `[B, S, H, D]` tensors (no transpose is made)."""
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bshd", prefix_blocks, prefix_mode, softmax_scale, padding)


def block_sparse_attn(q: Tensor, k: Tensor, v: Tensor, block_map: Tensor, variable_block_sizes, block_size=64,
                      *, layout: str = "bhsd", backend: str = "auto", softmax_scale: Optional[float] = None,
                      padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    """Attention of each query block to the KV blocks set in `block_map` (bool
    `[B, H, nQ, nKV]`), restricted to their valid tokens, on the scores q k^T times
    `softmax_scale` (a positive finite Python float; None: 1/sqrt(D)). Returns (out, lse):
    lse is the natural-log logsumexp of the scaled scores, fp32 `[B, H, Sq]` (-inf for a
    query block with nothing selected). Gradients flow through out (lse is not differentiable).
    Every query row is computed; the padded KV rows (past `variable_block_sizes`) are
    masked as keys and get zero gradients. `padding="zeros"` (FastVideo's kernels) still
    multiplies them by zero weights, so they must be finite; "ignore" never reads them
    (NaN / inf there change nothing)."""
    _require_tensors(q=q, k=k, v=v, block_map=block_map)
    variable_block_sizes = _ops.counts_tensor("variable_block_sizes", variable_block_sizes)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_map=block_map, layout=layout,
                             backend=backend, softmax_scale=softmax_scale, padding=padding).problem
    _ops.check_devices(q, k=k, v=v, block_map=block_map)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, p.block_elems)
    out, lse, *_ = _ops.attend(p, backend, dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                                                kv_counts=kv_counts, block_map=block_map.contiguous()))
    return out, lse


def block_sparse_attn_from_indices(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, block_counts: Tensor,
                                   variable_block_sizes, block_size=64, *, layout: str = "bhsd",
                                   backend: str = "auto", softmax_scale: Optional[float] = None,
                                   padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    """`block_sparse_attn` with the selection given as lists: `block_indices`
    `[B, H, nQ, capacity]` int32 holds, for each query block, `block_counts[b, h, i]`
    strictly ascending KV block indices (entries past the count are ignored);
    `softmax_scale` as in `block_sparse_attn`.

    Eager calls check the values and raise ValueError naming `block_indices` /
    `block_counts` (a CUDA pair is checked on the device once, then again only after it
    is modified). Under torch.compile nothing is checked, and the kernels never read out
    of bounds: a count is clamped to [0, capacity], and an entry counts only if it is in
    [0, nKV) and greater than the last counted entry of its row (repeats and entries out
    of order are dropped; `vsa_core.reference.index_lists_to_block_map`), in the forward
    and the backward alike."""
    _require_tensors(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    variable_block_sizes = _ops.counts_tensor("variable_block_sizes", variable_block_sizes)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                             block_counts=block_counts, layout=layout, backend=backend,
                             softmax_scale=softmax_scale, padding=padding).problem
    _ops.check_devices(q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    if not torch.compiler.is_compiling():  # compiled: the kernels bound the lists instead
        _ops.check_index_lists_once(block_indices, block_counts, p.n_kv_blocks)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, p.block_elems)
    out, lse, *_ = _ops.attend(p, backend, dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                                                kv_counts=kv_counts, given_idx=block_indices.contiguous(),
                                                given_num=block_counts.contiguous()))
    return out, lse


# ---- packed variable-length sequences ------------------------------------------------------
def _varlen_offsets(p, q, cu_seqlens_q, cu_seqlens_k):
    """Offsets on q's device; eagerly their values are checked (once per tensor version)."""
    cu_q = _ops.as_offsets("cu_seqlens_q", cu_seqlens_q, q)
    cu_k = _ops.as_offsets("cu_seqlens_k", cu_seqlens_k, q)
    _ops.check_offsets_once("cu_seqlens_q", cu_seqlens_q, p.q_len, p.block_elems)
    _ops.check_offsets_once("cu_seqlens_k", cu_seqlens_k, p.kv_len, p.block_elems)
    return cu_q, cu_k


def video_sparse_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             variable_block_sizes, q_variable_block_sizes, topk: int, block_size=64,
                             compress_attn_weight: Optional[Tensor] = None, *, backend: str = "auto",
                             prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tensor:
    """VSA over packed variable-length sequences, one call for all of them.

    q, compress_attn_weight: `[total_q, H, D]`; k, v: `[total_k, H, D]`: the sequences one
    after the other, each in its own tile order and padded to whole blocks. `cu_seqlens_q`,
    `cu_seqlens_k`: int32 `[N + 1]` token offsets (0, ..., total; multiples of the block's
    token count E). The counts cover every block of the packed stream (length total / E).
    Sequence i's queries see only sequence i's keys: its own coarse attention, its own
    top-k (at most its number of non-empty KV blocks), its own fine attention, i.e. the
    result of `video_sparse_attn_bshd` on each sequence alone. The offsets are read on the
    device (no host sync in the kernels; eager calls check their values once per tensor).
    `prefix_blocks`: an int (every sequence's first blocks) or one count per sequence (an
    integer tensor [N], read on the device like the offsets; a sequence with a prefix has
    as many query as KV blocks); `prefix_mode`, `softmax_scale` and `padding` as in `video_sparse_attn`.
    """
    _require_tensors(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k)
    if isinstance(prefix_blocks, (list, tuple)):
        prefix_blocks = torch.as_tensor(prefix_blocks)
    p = prepare_vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                    backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale,
                    padding=padding).problem
    _ops.check_devices(q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, p.block_elems)
    q_counts = _ops.as_counts("q_variable_block_sizes", q_variable_block_sizes, q, p.block_elems)
    cu_q, cu_k = _varlen_offsets(p, q, cu_seqlens_q, cu_seqlens_k)
    seq_prefix = _ops.as_prefix(p, prefix_blocks, q, cu_q, cu_k)
    gate = compress_attn_weight.contiguous()[None] if compress_attn_weight is not None else None
    out = _ops.attend(p, backend, dict(q=q.contiguous()[None], k=k.contiguous()[None], v=v.contiguous()[None],
                                       kv_counts=kv_counts, q_counts=q_counts, gate=gate, cu_seqlens_q=cu_q,
                                       cu_seqlens_k=cu_k, seq_prefix=seq_prefix))[0]
    return out[0]


def block_sparse_attn_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             block_map: Tensor, variable_block_sizes, block_size=64, *, backend: str = "auto",
                             softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tuple[Tensor, Tensor]:
    """Block-sparse attention over packed sequences (the packing of `video_sparse_attn_varlen`)
    with the selection as a bool `[H, nQ, nKV]` map over the packed blocks (nQ = total_q / E,
    nKV = total_k / E). A query block may select only blocks of its own sequence: eagerly
    anything else raises ValueError; under torch.compile such entries are ignored (never
    attended). Returns (out `[total_q, H, D]`, lse fp32 `[H, total_q]`); `softmax_scale` and
    `padding` as in `block_sparse_attn`."""
    _require_tensors(q=q, k=k, v=v, block_map=block_map, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_map=block_map, backend=backend,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             softmax_scale=softmax_scale, padding=padding).problem
    _ops.check_devices(q, k=k, v=v, block_map=block_map)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, p.block_elems)
    cu_q, cu_k = _varlen_offsets(p, q, cu_seqlens_q, cu_seqlens_k)
    _ops.check_selection_once(p, cu_seqlens_q, cu_seqlens_k, block_map=block_map)
    out, lse, *_ = _ops.attend(p, backend, dict(q=q.contiguous()[None], k=k.contiguous()[None],
                                                v=v.contiguous()[None], kv_counts=kv_counts,
                                                block_map=block_map.contiguous()[None], cu_seqlens_q=cu_q,
                                                cu_seqlens_k=cu_k))
    return out[0], lse[0]


def block_sparse_attn_varlen_from_indices(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                          cu_seqlens_k: Tensor, block_indices: Tensor, block_counts: Tensor,
                                          variable_block_sizes, block_size=64, *, backend: str = "auto",
                                          softmax_scale: Optional[float] = None, padding: str = "zeros"
                                          ) -> Tuple[Tensor, Tensor]:
    """`block_sparse_attn_varlen` with the selection as lists: `block_indices` int32
    `[H, nQ, capacity]` holds, for each query block of the packed stream, `block_counts[h, i]`
    ascending indices of KV blocks of the packed stream (of its own sequence; entries past
    the count are ignored); `softmax_scale` as in `block_sparse_attn`."""
    _require_tensors(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                             block_counts=block_counts, backend=backend, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, padding=padding).problem
    _ops.check_devices(q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, q, p.block_elems)
    cu_q, cu_k = _varlen_offsets(p, q, cu_seqlens_q, cu_seqlens_k)
    _ops.check_selection_once(p, cu_seqlens_q, cu_seqlens_k, block_indices=block_indices,
                              block_counts=block_counts)
    out, lse, *_ = _ops.attend(p, backend, dict(q=q.contiguous()[None], k=k.contiguous()[None],
                                                v=v.contiguous()[None], kv_counts=kv_counts,
                                                given_idx=block_indices.contiguous()[None],
                                                given_num=block_counts.contiguous()[None], cu_seqlens_q=cu_q,
                                                cu_seqlens_k=cu_k))
    return out[0], lse[0]


def pack_block_indices(block_indices_list, block_counts_list, kv_blocks_per_sequence) -> Tuple[Tensor, Tensor]:
    """Per-sequence index lists (FastVideo's `q2k_idx_list` / `q2k_num_list`: `[1, H, nQ_i, C_i]`
    or `[H, nQ_i, C_i]` local KV block indices and `[1, H, nQ_i]` / `[H, nQ_i]` counts) -> the
    packed lists of `block_sparse_attn_varlen_from_indices` (`[H, nQ, max C_i]` indices into the
    packed KV blocks, `[H, nQ]` counts). `kv_blocks_per_sequence`: each sequence's number of KV
    blocks (Python ints, e.g. the lengths of its `variable_block_sizes`). Device ops only."""
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


def to_tiled(x: Tensor, meta: VSAMetadata, dim: int = -2) -> Tensor:
    """Raw (T, H, W row-major) tokens along `dim` -> padded tile-contiguous order.

    x holds `meta.num_tokens` tokens along `dim` (the default -2 fits `[B, H, S, D]`; use
    dim=1 for `[B, S, H, D]`, dim=0 for packed `[S, H, D]`); the result holds
    `meta.padded_len` (each tile's valid tokens first, zeros after them). Another length
    raises ValueError."""
    dim = meta.token_axis("x", x.shape, dim, tiled=False)
    shape = list(x.shape)
    shape[dim] = meta.padded_len
    out = x.new_zeros(shape)
    src = torch.as_tensor(meta.tiled_from_raw, device=x.device)
    dst = torch.as_tensor(meta.non_pad_index, device=x.device)
    return out.index_copy(dim, dst, x.index_select(dim, src))


def from_tiled(x: Tensor, meta: VSAMetadata, dim: int = -2) -> Tensor:
    """Padded tile-contiguous order along `dim` -> raw token order (padding dropped).

    x holds `meta.padded_len` tokens along `dim` (default -2: `[B, H, S, D]`; dim=1 for
    `[B, S, H, D]`); the result holds `meta.num_tokens`. Another length raises ValueError."""
    dim = meta.token_axis("x", x.shape, dim, tiled=True)
    idx = torch.as_tensor(meta.non_pad_index[meta.raw_from_tiled], device=x.device)
    return x.index_select(dim, idx)


from . import parallel  # noqa: E402,F401  (vsa_torch.parallel: sequence parallelism; needs the names above)
