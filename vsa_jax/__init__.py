"""JAX frontend of Video Sparse Attention (same functions and arguments as vsa_torch).

    from vsa_jax import video_sparse_attn
    out = video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk=32,
                            block_size=(4, 4, 4), compress_attn_weight=gate)

q, k, v are `[B, H, S, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`) in tile-contiguous
token order (see `build_vsa_metadata` / `to_tiled` / `from_tiled`), bf16 or fp16, D 64
or 128; S is a multiple of the block's token count E (64, 128 or 256).

Works under jax.jit, jax.grad / jax.vjp (gradients to q, k, v and the gate) and
jax.vmap, and over several devices: inside jax.shard_map (each device runs its shard),
and under jax.jit on arrays sharded over the batch and/or heads with explicit mesh axes
(`jax.make_mesh`'s default), where the call is split per device (see vsa_jax/spmd.py).
Arguments are checked at trace time and raise the same ValueError / TypeError as
vsa_torch; the values of the counts ([0, E]) and of index lists are checked when they are
concrete (numpy or a jax.Array outside jit). Traced values are not checked; the kernels
bound them instead (out-of-range counts act as clamped to [0, E]; index lists: see
`block_sparse_attn_from_indices`), so no value reads out of bounds.

Arrays on the CPU run the same Triton kernels under Triton's interpreter (slow; for
tests and small checks; a warning says so once per process). `topk` larger than the
number of KV blocks is clamped to it. The top-k ranking uses the fp32 coarse scores
(FastVideo ranks bf16-rounded scores: near-ties may pick other blocks).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from vsa_core import __version__
from vsa_core.backends import BackendUnavailableError
from vsa_core.metadata import VSAMetadata, build_vsa_metadata, variable_block_sizes
from vsa_core.api import prepare_block_sparse, prepare_vsa
from vsa_core.spec import AXES, PUBLIC_NAMES, forward_inputs

from . import ops as _ops
from . import spmd as _spmd
from .native import set_launch

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "video_sparse_attn_varlen", "block_sparse_attn_varlen", "block_sparse_attn_varlen_from_indices",
           "pack_block_indices", "build_vsa_metadata", "variable_block_sizes", "to_tiled", "from_tiled", "VSAMetadata",
           "BackendUnavailableError", "__version__", "set_launch"]


def _require_arrays(**arrays):
    for name, x in arrays.items():
        if x is not None and not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax.Array, got {type(x).__name__}")


def _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
         backend, layout, prefix_blocks, prefix_mode, softmax_scale, padding) -> jax.Array:
    _require_arrays(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    _ops.require_counts(variable_block_sizes=variable_block_sizes, q_variable_block_sizes=q_variable_block_sizes)
    p = prepare_vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                    layout=layout, backend=backend, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                    softmax_scale=softmax_scale, padding=padding).problem
    statics = _ops.statics_for(p, backend, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    q_counts = _ops.as_counts("q_variable_block_sizes", q_variable_block_sizes, p.block_elems)
    gate = None if compress_attn_weight is None else jnp.asarray(compress_attn_weight)
    return _split_call(statics, dict(q=jnp.asarray(q), k=jnp.asarray(k), v=jnp.asarray(v), kv_counts=kv_counts,
                                     q_counts=q_counts, gate=gate))[0]


# the spmd split's kind of each axes class of `vsa_core.spec.AXES`
_SPLIT_KINDS = {"bh": "bh", "blocks": "replicated"}


def _split_call(statics, named):
    """(out, lse) of the op, split over the devices when the arrays are sharded over batch /
    heads (see vsa_jax.spmd); on one device (or inside a shard_map) the plain call."""
    names = forward_inputs(statics)
    kinds = tuple(_SPLIT_KINDS.get(AXES[n], statics.layout) for n in names)
    args = tuple(named[n] for n in names)
    split = _spmd.plan_split(statics.layout, statics.block_elems,
                             {PUBLIC_NAMES[n]: (x, kind) for n, x, kind in zip(names, args, kinds)})
    if split is None:
        return _ops.attend(statics, named)
    return _spmd.run_split(lambda *xs: _ops.attend(statics, dict(zip(names, xs))), split, args, kinds,
                           (statics.layout, "bh"))


def video_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes, q_variable_block_sizes,
                      topk: int, block_size=64, compress_attn_weight: Optional[jax.Array] = None, *,
                      backend: str = "auto", prefix_blocks: int = 0, prefix_mode: str = "exempt",
                      softmax_scale: Optional[float] = None, padding: str = "zeros") -> jax.Array:
    """Video Sparse Attention on `[B, H, S, D]` arrays (a drop-in for FastVideo's).

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
    numpy or JAX arrays (or lists), values in [0, E].
        `backend`: "auto", "triton", "cute" or "cudnn" (VSA_BACKEND in the environment replaces "auto").
    `variable_block_sizes` / `q_variable_block_sizes` values must lie in [0, E]: concrete
    values raise ValueError otherwise; traced ones are not checked and act as clamped to
    [0, E] (above E a full block, below 0 an empty one).
    `prefix_blocks` (a Python int), `prefix_mode`: mixed modality (joint attention over
    `[text | ... | video]`, Sq == Skv): the first `prefix_blocks` blocks hold the non-video
    tokens. Their query blocks attend every non-empty KV block; a video query block attends,
    with "exempt", every prefix block plus its top-`topk` video blocks, with "compete", its
    top-(`topk` + `prefix_blocks`) blocks of all. Coarse branch and gate as without a
    prefix (`vsa_core.reference.prefix_topk_mask`).
    `softmax_scale` (a positive finite Python float; None: 1/sqrt(D), as in FastVideo,
    flash-attn and SDPA) multiplies the scores q k^T before the softmax. One scale serves
    both branches, as in FastVideo: the coarse attention between the block means (and so the
    scores the top-k ranks) and the fine attention.
    `topk`, `block_size`, `backend`, `prefix_blocks`, `prefix_mode`, `softmax_scale` and `padding`
    are static (Python values, not traced).
    """
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bhsd", prefix_blocks, prefix_mode, softmax_scale, padding)


def video_sparse_attn_bshd(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes,
                           q_variable_block_sizes, topk: int, block_size=64,
                           compress_attn_weight: Optional[jax.Array] = None, *, backend: str = "auto",
                           prefix_blocks: int = 0, prefix_mode: str = "exempt",
                           softmax_scale: Optional[float] = None, padding: str = "zeros") -> jax.Array:
    """`video_sparse_attn` on `[B, S, H, D]` arrays (no transpose is made)."""
    return _vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                backend, "bshd", prefix_blocks, prefix_mode, softmax_scale, padding)


def block_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, block_map: jax.Array, variable_block_sizes,
                      block_size=64, *, layout: str = "bhsd", backend: str = "auto",
                      softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    """Attention of each query block to the KV blocks set in `block_map` (bool
    `[B, H, nQ, nKV]`), restricted to their valid tokens, on the scores q k^T times
    `softmax_scale` (a positive finite Python float, static; None: 1/sqrt(D)). Returns (out,
    lse): lse is the natural-log logsumexp of the scaled scores, fp32 `[B, H, Sq]` (-inf for
    a query block with nothing selected). Gradients flow through out (lse is not differentiable).
    Every query row is computed; the padded KV rows (past `variable_block_sizes`) are
    masked as keys and get zero gradients. `padding="zeros"` (FastVideo's kernels) still
    multiplies them by zero weights, so they must be finite; "ignore" never reads them
    (NaN / inf there change nothing)."""
    _require_arrays(q=q, k=k, v=v, block_map=block_map)
    _ops.require_counts(variable_block_sizes=variable_block_sizes)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_map=block_map, layout=layout,
                             backend=backend, softmax_scale=softmax_scale, padding=padding).problem
    statics = _ops.statics_for(p, backend, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    return _bsa(statics, q, k, v, kv_counts, block_map=jnp.asarray(block_map))


def _bsa(statics, q, k, v, kv_counts, **selection):
    """block-sparse attention with the selection as a map or as lists; split over devices like _vsa."""
    out, lse = _split_call(statics, dict(q=jnp.asarray(q), k=jnp.asarray(k), v=jnp.asarray(v), kv_counts=kv_counts,
                                         **selection))
    return out, jax.lax.stop_gradient(lse)


def block_sparse_attn_from_indices(q: jax.Array, k: jax.Array, v: jax.Array, block_indices: jax.Array,
                                   block_counts: jax.Array, variable_block_sizes, block_size=64, *,
                                   layout: str = "bhsd", backend: str = "auto", softmax_scale: Optional[float] = None,
                                   padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    """`block_sparse_attn` with the selection given as lists: `block_indices`
    `[B, H, nQ, capacity]` int32 holds, for each query block, `block_counts[b, h, i]`
    strictly ascending KV block indices (entries past the count are ignored);
    `softmax_scale` as in `block_sparse_attn`.

    Concrete lists (numpy, or jax.Arrays outside jit) are checked and bad values raise
    ValueError naming `block_indices` / `block_counts` (a jax.Array once: it is
    immutable). Traced lists are not checked, and the kernels never read out of bounds:
    a count is clamped to [0, capacity], and an entry counts only if it is in [0, nKV)
    and greater than the last counted entry of its row (repeats and entries out of order
    are dropped; `vsa_core.reference.index_lists_to_block_map`), in the forward and the
    backward alike."""
    _require_arrays(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    _ops.require_counts(variable_block_sizes=variable_block_sizes)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                             block_counts=block_counts, layout=layout, backend=backend,
                             softmax_scale=softmax_scale, padding=padding).problem
    _ops.check_index_lists(block_indices, block_counts, p.n_kv_blocks)
    statics = _ops.statics_for(p, backend, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    return _bsa(statics, q, k, v, kv_counts, given_idx=jnp.asarray(block_indices),
                given_num=jnp.asarray(block_counts))


# ---- packed variable-length sequences ------------------------------------------------------
def _varlen_offsets(p, cu_seqlens_q, cu_seqlens_k):
    return (_ops.as_offsets("cu_seqlens_q", cu_seqlens_q, p.q_len, p.block_elems),
            _ops.as_offsets("cu_seqlens_k", cu_seqlens_k, p.kv_len, p.block_elems))


def _packed(x) -> jax.Array:
    return jnp.asarray(x)[None]  # [total, H, D] -> [1, total, H, D] (BSHD, batch 1): a free reshape


def video_sparse_attn_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                             variable_block_sizes, q_variable_block_sizes, topk: int, block_size=64,
                             compress_attn_weight: Optional[jax.Array] = None, *, backend: str = "auto",
                             prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> jax.Array:
    """VSA over packed variable-length sequences, one call for all of them.

    q, compress_attn_weight: `[total_q, H, D]`; k, v: `[total_k, H, D]`: the sequences one
    after the other, each in its own tile order and padded to whole blocks. `cu_seqlens_q`,
    `cu_seqlens_k`: int32 `[N + 1]` token offsets (0, ..., total; multiples of the block's
    token count E). The counts cover every block of the packed stream (length total / E).
    Sequence i's queries see only sequence i's keys: its own coarse attention, its own
    top-k (at most its number of non-empty KV blocks), its own fine attention, i.e. the
    result of `video_sparse_attn_bshd` on each sequence alone. The offsets are read on the
    device and may be traced under jax.jit (N and the totals are static shapes), so one
    compiled step serves every packing of the same totals; their values are checked when
    they are concrete.
    `prefix_blocks`: an int (every sequence's first blocks, static) or one count per
    sequence (an integer array [N], which may be traced like the offsets; a sequence with a
    prefix has as many query as KV blocks); `prefix_mode`, `softmax_scale` and `padding` as in
    `video_sparse_attn`.
    """
    _require_arrays(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    p = prepare_vsa(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size, compress_attn_weight,
                    backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale,
                    padding=padding).problem
    statics = _ops.statics_for(p, backend, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    q_counts = _ops.as_counts("q_variable_block_sizes", q_variable_block_sizes, p.block_elems)
    cu_q, cu_k = _varlen_offsets(p, cu_seqlens_q, cu_seqlens_k)
    seq_prefix = _ops.as_prefix(p, prefix_blocks, cu_seqlens_q, cu_seqlens_k)
    gate = None if compress_attn_weight is None else _packed(compress_attn_weight)
    out, _ = _ops.attend(statics, dict(q=_packed(q), k=_packed(k), v=_packed(v), kv_counts=kv_counts,
                                       q_counts=q_counts, gate=gate, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                       seq_prefix=seq_prefix))
    return out[0]


def block_sparse_attn_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                             block_map: jax.Array, variable_block_sizes, block_size=64, *, backend: str = "auto",
                             softmax_scale: Optional[float] = None,
                             padding: str = "zeros") -> Tuple[jax.Array, jax.Array]:
    """Block-sparse attention over packed sequences (the packing of `video_sparse_attn_varlen`)
    with the selection as a bool `[H, nQ, nKV]` map over the packed blocks (nQ = total_q / E,
    nKV = total_k / E). A query block may select only blocks of its own sequence: with
    concrete arguments anything else raises ValueError; under jit such entries are ignored
    (never attended). Returns (out `[total_q, H, D]`, lse fp32 `[H, total_q]`); `softmax_scale`
    and `padding` as in `block_sparse_attn`."""
    _require_arrays(q=q, k=k, v=v, block_map=block_map)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_map=block_map, backend=backend,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             softmax_scale=softmax_scale, padding=padding).problem
    statics = _ops.statics_for(p, backend, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    cu_q, cu_k = _varlen_offsets(p, cu_seqlens_q, cu_seqlens_k)
    _ops.check_selection(p, cu_seqlens_q, cu_seqlens_k, block_map=block_map)
    out, lse = _ops.attend(statics, dict(q=_packed(q), k=_packed(k), v=_packed(v), kv_counts=kv_counts,
                                         block_map=_packed(block_map), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    return out[0], jax.lax.stop_gradient(lse[0])


def block_sparse_attn_varlen_from_indices(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q, cu_seqlens_k,
                                          block_indices: jax.Array, block_counts: jax.Array, variable_block_sizes,
                                          block_size=64, *, backend: str = "auto",
                                          softmax_scale: Optional[float] = None, padding: str = "zeros"
                                          ) -> Tuple[jax.Array, jax.Array]:
    """`block_sparse_attn_varlen` with the selection as lists: `block_indices` int32
    `[H, nQ, capacity]` holds, for each query block of the packed stream, `block_counts[h, i]`
    ascending indices of KV blocks of the packed stream (of its own sequence; entries past
    the count are ignored); `softmax_scale` as in `block_sparse_attn`."""
    _require_arrays(q=q, k=k, v=v, block_indices=block_indices, block_counts=block_counts)
    p = prepare_block_sparse(q, k, v, variable_block_sizes, block_size, block_indices=block_indices,
                             block_counts=block_counts, backend=backend, cu_seqlens_q=cu_seqlens_q,
                             cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale, padding=padding).problem
    statics = _ops.statics_for(p, backend, q)
    kv_counts = _ops.as_counts("variable_block_sizes", variable_block_sizes, p.block_elems)
    cu_q, cu_k = _varlen_offsets(p, cu_seqlens_q, cu_seqlens_k)
    _ops.check_selection(p, cu_seqlens_q, cu_seqlens_k, block_indices=block_indices, block_counts=block_counts)
    out, lse = _ops.attend(statics, dict(q=_packed(q), k=_packed(k), v=_packed(v), kv_counts=kv_counts,
                                         given_idx=_packed(block_indices), given_num=_packed(block_counts),
                                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    return out[0], jax.lax.stop_gradient(lse[0])


def pack_block_indices(block_indices_list, block_counts_list, kv_blocks_per_sequence
                       ) -> Tuple[jax.Array, jax.Array]:
    """Per-sequence index lists (FastVideo's `q2k_idx_list` / `q2k_num_list`: `[1, H, nQ_i, C_i]`
    or `[H, nQ_i, C_i]` local KV block indices and `[1, H, nQ_i]` / `[H, nQ_i]` counts) -> the
    packed lists of `block_sparse_attn_varlen_from_indices` (`[H, nQ, max C_i]` indices into the
    packed KV blocks, `[H, nQ]` counts). `kv_blocks_per_sequence`: each sequence's number of KV
    blocks (Python ints). Traceable (no host values needed but the static shapes)."""
    if not (len(block_indices_list) == len(block_counts_list) == len(kv_blocks_per_sequence)):
        raise ValueError("block_indices_list, block_counts_list and kv_blocks_per_sequence must have one entry per "
                         f"sequence, got {len(block_indices_list)}, {len(block_counts_list)}, "
                         f"{len(kv_blocks_per_sequence)}")
    idx = [jnp.asarray(t)[0] if jnp.ndim(t) == 4 else jnp.asarray(t) for t in block_indices_list]
    num = [jnp.asarray(t)[0] if jnp.ndim(t) == 3 else jnp.asarray(t) for t in block_counts_list]
    capacity = max(t.shape[-1] for t in idx)
    offsets = np.concatenate([[0], np.cumsum([int(n) for n in kv_blocks_per_sequence])[:-1]])
    packed = [jnp.pad(t.astype(jnp.int32) + int(off), ((0, 0), (0, 0), (0, capacity - t.shape[-1])))
              for t, off in zip(idx, offsets)]
    return jnp.concatenate(packed, axis=1), jnp.concatenate([t.astype(jnp.int32) for t in num], axis=1)


def to_tiled(x: jax.Array, meta: VSAMetadata, dim: int = -2) -> jax.Array:
    """Raw (T, H, W row-major) tokens along `dim` -> padded tile-contiguous order (zero padding).

    x holds `meta.num_tokens` tokens along `dim` (the default -2 fits `[B, H, S, D]`; use
    dim=1 for `[B, S, H, D]`, dim=0 for packed `[S, H, D]`); the result holds
    `meta.padded_len` (each tile's valid tokens first, zeros after them). Another length
    raises ValueError (at trace time under jit: the shapes are static)."""
    dim = meta.token_axis("x", x.shape, dim, tiled=False)  # shapes are static: free under jit
    shape = list(x.shape)
    shape[dim] = meta.padded_len
    slots = (slice(None),) * dim + (meta.non_pad_index,)
    return jnp.zeros(shape, x.dtype).at[slots].set(jnp.take(x, meta.tiled_from_raw, axis=dim))


def from_tiled(x: jax.Array, meta: VSAMetadata, dim: int = -2) -> jax.Array:
    """Padded tile-contiguous order along `dim` -> raw token order (padding dropped).

    x holds `meta.padded_len` tokens along `dim` (default -2: `[B, H, S, D]`; dim=1 for
    `[B, S, H, D]`); the result holds `meta.num_tokens`. Another length raises ValueError."""
    dim = meta.token_axis("x", x.shape, dim, tiled=True)
    return jnp.take(x, meta.non_pad_index[meta.raw_from_tiled], axis=dim)


from . import parallel  # noqa: E402,F401  (vsa_jax.parallel: sequence parallelism; needs the names above)
