"""Argument checking and buffer shapes, shared by every frontend.

Frontends describe their arrays by shape and dtype name only, so these checks run
before any kernel (at trace time under jax.jit, eagerly in PyTorch) and raise the
same `ValueError` / `TypeError` everywhere. The buffer tables say which output and
workspace buffers a call needs; each frontend allocates them its own way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import numpy as np

SUPPORTED_DTYPES = ("bfloat16", "float16")
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_ELEMS = (64, 128, 256)
LAYOUTS = ("bhsd", "bshd")

BlockSize = Union[int, Sequence[int]]


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16, jnp.bfloat16, np.dtype('float16') -> 'float16', ..."""
    name = getattr(dtype, "name", None) or str(dtype)
    return str(name).replace("torch.", "")


def block_elements(block_size: BlockSize) -> int:
    """Tokens per block for an int or a (t, h, w) tile."""
    if isinstance(block_size, (bool, np.bool_)):
        raise TypeError(f"block_size must be an int or a (t, h, w) tuple of ints, got {block_size!r}")
    if isinstance(block_size, (int, np.integer)):
        elems = int(block_size)
    else:
        try:
            items = tuple(block_size)
        except TypeError:
            raise TypeError(f"block_size must be an int or a (t, h, w) tuple of ints, got {block_size!r}") from None
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in items):
            # a float would be truncated by int(): refuse it rather than run another tile
            raise TypeError(f"block_size must be an int or a (t, h, w) tuple of ints, got {block_size!r}")
        dims = tuple(int(x) for x in items)
        if len(dims) != 3 or min(dims) < 1:
            raise ValueError(f"block_size as a tile must be 3 positive ints (t, h, w), got {block_size!r}")
        elems = math.prod(dims)
    if elems not in SUPPORTED_BLOCK_ELEMS:
        raise ValueError(f"block_size must hold {SUPPORTED_BLOCK_ELEMS} tokens per block, got {block_size!r} "
                         f"({elems} tokens)")
    return elems


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale as a Python float: 1/sqrt(head_dim) for None (the kernels take a float
    argument: an int would be compiled as an integer, 1 even as a constant)."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def check_softmax_scale(softmax_scale) -> None:
    """None, or a positive finite Python float / int (static: not an array, not a bool)."""
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, (int, float, np.integer,
                                                                                       np.floating)):
        raise TypeError(_bad_scale(softmax_scale))
    try:
        value = float(softmax_scale)
    except OverflowError:  # an int beyond float range
        value = math.inf
    # comparisons rather than math.isfinite: under torch.compile the value may be symbolic
    if not 0 < value < math.inf:  # NaN fails both
        raise ValueError(_bad_scale(softmax_scale))


def _bad_scale(softmax_scale) -> str:
    return f"softmax_scale must be a positive finite Python float (None: 1/sqrt(D)), got {softmax_scale!r}"


@dataclass(frozen=True)
class AttnProblem:
    """Everything that fixes the kernels' shapes for one call."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    block_elems: int
    dtype: str
    layout: str = "bhsd"
    topk: Optional[int] = None
    has_gate: bool = False
    # how the KV blocks are chosen: "topk" (VSA), or given as a "block_map" / as "indices"
    selection: str = "topk"
    # the forward keeps what the backward needs (VSA: the fine branch's own output)
    training: bool = True
    # packed variable-length sequences (varlen): the number of sequences N packed along the
    # (single) batch's sequence axis, 0 when not packed. Block i of the stream belongs to one
    # sequence; attention never crosses sequences. The offsets themselves are a device input.
    n_seqs: int = 0
    # row length of given index lists that the call copies ("indices" selection)
    list_capacity: Optional[int] = None
    # mixed modality (VSA, Sq == Skv): the first prefix_blocks blocks (packed: of every
    # sequence) hold non-video tokens; their query rows are dense, and video rows take the
    # prefix KV blocks by prefix_mode (`vsa_core.reference.prefix_topk_mask`). seq_prefix
    # (packed only): the counts come per sequence as the device input "seq_prefix" [N] int32
    # instead. No prefix: prefix_blocks 0, seq_prefix False, prefix_mode "exempt".
    prefix_blocks: int = 0
    prefix_mode: str = "exempt"
    seq_prefix: bool = False
    # the scale of the scores q k^T in both branches (coarse and fine), a Python float; None
    # at construction becomes 1/sqrt(head_dim), so a call that leaves it out and one that
    # passes 1/sqrt(head_dim) are the same problem (the same caches, the same compiled calls)
    softmax_scale: Optional[float] = None
    # the padded rows of each block (past its count): "zeros" or "ignore" (PADDINGS)
    padding: str = "zeros"
    # what VSA training keeps of the fine output for the backward's delta = rowsum(dO * out_fine), in
    # `out_fine`: "rounding" where the fine kernel has it in fp32 (triton, sm90): out's rounding
    # residual (out in fp32 minus out rounded, in q's dtype), from which the backward forms the fp32
    # fine output as out + residual - gate * out_coarse (fp32's accuracy at half its bytes: a bf16
    # fine output costs dq / dk 2-3x their error where the logits are large); "input" (the
    # fine output in q's dtype) where a library writes it in q's dtype anyway (cute, cudnn); "float32"
    # (the fine output in fp32). Set from the backend (`backends.fine_residual`).
    fine_residual: str = "rounding"

    def __post_init__(self):
        object.__setattr__(self, "softmax_scale", resolve_softmax_scale(self.softmax_scale, self.head_dim))

    @property
    def has_prefix(self) -> bool:
        return self.prefix_blocks > 0 or self.seq_prefix

    @property
    def varlen(self) -> bool:
        return self.n_seqs > 0

    @property
    def n_q_blocks(self) -> int:
        return self.q_len // self.block_elems

    @property
    def n_kv_blocks(self) -> int:
        return self.kv_len // self.block_elems

    @property
    def is_vsa(self) -> bool:
        return self.selection == "topk"

    @property
    def select_capacity(self) -> int:
        """Row length of the query-owned index lists."""
        if self.topk is not None:
            # a prefix query row is dense: up to every KV block (the counts are device data)
            return self.n_kv_blocks if self.has_prefix else self.topk
        return self.list_capacity if self.list_capacity is not None else self.n_kv_blocks

    def token_shape(self, seq_len: int) -> Tuple[int, ...]:
        if self.layout == "bhsd":
            return (self.batch, self.heads, seq_len, self.head_dim)
        return (self.batch, seq_len, self.heads, self.head_dim)

    def token_strides(self, seq_len: int) -> Tuple[int, int, int]:
        """(batch, head, sequence) element strides of a contiguous token tensor."""
        d = self.head_dim
        if self.layout == "bhsd":
            return (self.heads * seq_len * d, seq_len * d, d)
        return (seq_len * self.heads * d, d, self.heads * d)

    # ---- buffer tables: name -> (shape, dtype); dtype "input" means q's dtype ----
    def forward_buffers(self) -> dict:
        B, H, D = self.batch, self.heads, self.head_dim
        nq, nk = self.n_q_blocks, self.n_kv_blocks
        bufs = {
            "out": (self.token_shape(self.q_len), "input"),
            "lse": ((B, H, self.q_len), "float32"),
        }
        if self.is_vsa:
            bufs.update({
                "q_pool": ((B, H, nq, D), "input"),
                "k_pool": ((B, H, nk, D), "input"),
                "v_pool": ((B, H, nk, D), "input"),
                "out_coarse": ((B, H, nq, D), "float32"),
                "lse_coarse": ((B, H, nq), "float32"),
                "scores": ((B, H, nq, nk), "float32"),
                "sel_idx": ((B, H, nq, self.select_capacity), "int32"),
                "sel_num": ((B, H, nq), "int32"),
                "sel_mask": ((B, H, nq, nk), "int8"),
            })
            if self.training:
                bufs["out_fine"] = (self.token_shape(self.q_len),
                                    "float32" if self.fine_residual == "float32" else "input")
        else:
            # lists from the map, or the given lists as the rule reads them (varlen: kept to each
            # query's own sequence); the backward takes these
            bufs.update({
                "sel_idx": ((B, H, nq, self.select_capacity), "int32"),
                "sel_num": ((B, H, nq), "int32"),
            })
        if self.varlen:
            bufs.update(self._seq_id_buffers())
        return bufs

    def _seq_id_buffers(self) -> dict:
        """Sequence id of every query / KV block of the packed stream (computed on the device)."""
        return {"q_seq": ((self.n_q_blocks,), "int32"), "kv_seq": ((self.n_kv_blocks,), "int32")}

    def backward_buffers(self) -> dict:
        B, H, D = self.batch, self.heads, self.head_dim
        nq, nk = self.n_q_blocks, self.n_kv_blocks
        bufs = {
            "dq": (self.token_shape(self.q_len), "input"),
            "dk": (self.token_shape(self.kv_len), "input"),
            "dv": (self.token_shape(self.kv_len), "input"),
            "delta": ((B, H, self.q_len), "float32"),
            "inv_idx": ((B, H, nk, nq), "int32"),
            "inv_num": ((B, H, nk), "int32"),
        }
        if self.is_vsa:
            bufs.update({
                "dout_coarse": ((B, H, nq, D), "float32"),
                "dq_pool": ((B, H, nq, D), "float32"),
                "dk_pool": ((B, H, nk, D), "float32"),
                "dv_pool": ((B, H, nk, D), "float32"),
                # the coarse backward's P and dS (fp32 workspaces of `coarse_backward`)
                "p_coarse": ((B, H, nq, nk), "float32"),
                "ds_coarse": ((B, H, nq, nk), "float32"),
            })
            if self.has_gate:
                bufs["dgate"] = (self.token_shape(self.q_len), "input")
            if self.varlen:
                bufs.update(self._seq_id_buffers())
        elif self.selection == "indices" or self.varlen:
            bufs["sel_mask"] = ((B, H, nq, nk), "int8")
        return bufs


def _shape(x) -> Tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _split_token_shape(name: str, shape, layout: str):
    if len(shape) != 4:
        want = "[B, H, S, D]" if layout == "bhsd" else "[B, S, H, D]"
        raise ValueError(f"{name} must be a rank-4 tensor {want}, got shape {tuple(shape)}")
    if layout == "bhsd":
        b, h, s, d = shape
    else:
        b, s, h, d = shape
    return b, h, s, d


def _check_counts(name: str, counts, n_blocks: int, seq_name: str, seq_len: int, block_size: BlockSize,
                  block_size_hint: bool = True):
    """One count per block of `seq_name`. `block_size_hint`: whether a wrong length may be a wrong
    block_size rather than wrong counts (not for counts checked after others agreed with it)."""
    if counts is None:
        raise ValueError(f"{name} is required: a 1-D integer array of {n_blocks} per-block valid-token counts")
    if not hasattr(counts, "shape"):
        counts = np.asarray(counts)
    shape = _shape(counts)
    if shape != (n_blocks,):
        message = (f"{name} must have shape ({n_blocks},) (one count per block: {seq_name}'s {seq_len} tokens in "
                   f"{seq_len // n_blocks}-token blocks (block_size={block_size!r}) are {n_blocks} blocks), "
                   f"got {shape}")
        if block_size_hint and len(shape) == 1 and shape[0] >= 1 and seq_len % shape[0] == 0 \
                and seq_len // shape[0] in SUPPORTED_BLOCK_ELEMS:
            message += (f": {shape[0]} counts make {seq_len // shape[0]}-token blocks of {seq_name}, so if the "
                        f"counts are right, block_size is not: pass the block_size the counts were built for "
                        f"(meta.tile_size of build_vsa_metadata)")
        raise ValueError(message)
    name_of_dtype = dtype_name(counts.dtype)
    try:
        kind = np.dtype(name_of_dtype).kind
    except TypeError:
        kind = "?"
    if kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {name_of_dtype}")


def check_count_values(name: str, values: np.ndarray, block_elems: int) -> None:
    """Counts must lie in [0, E]. Frontends call this where the values are known on the host."""
    values = np.asarray(values)
    if values.size and (values.min() < 0 or values.max() > block_elems):
        bad = values[(values < 0) | (values > block_elems)][0]
        raise ValueError(f"{name} values must lie in [0, {block_elems}] (tokens per block), found {int(bad)}")


def _layout_hint(shape, layout: str, block_elems: int, selection: str) -> str:
    """A hint when the other layout would fit (its sequence axis a multiple of E), naming what
    takes that layout: the VSA functions come one per layout, the block-sparse ones take `layout`."""
    if len(shape) != 4:
        return ""
    other_seq = shape[1] if layout == "bhsd" else shape[2]
    if other_seq < block_elems or other_seq % block_elems:
        return ""
    read, other = ("[B, H, S, D]", "[B, S, H, D]") if layout == "bhsd" else ("[B, S, H, D]", "[B, H, S, D]")
    if selection == "topk":
        use = "video_sparse_attn_bshd" if layout == "bhsd" else "video_sparse_attn"
    else:
        use = "layout='bshd'" if layout == "bhsd" else "layout='bhsd' (the default)"
        use = f"the same function with {use}"
    return f" (shape {tuple(shape)}: {read} is read here; for {other} data use {use})"


PREFIX_MODES = ("exempt", "compete")
# What the padded rows of each block (past its count) mean: "zeros" (FastVideo's function:
# they hold zeros, are summed into the block means and computed like any row), "ignore"
# (never read: any contents, NaN included; their outputs and gradients are 0).
PADDINGS = ("zeros", "ignore")


def check_padding(padding) -> str:
    if not isinstance(padding, str) or padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    return padding


def check_prefix_mode(prefix_mode) -> str:
    if not isinstance(prefix_mode, str) or prefix_mode not in PREFIX_MODES:
        raise ValueError(f"prefix_mode must be one of {PREFIX_MODES}, got {prefix_mode!r}")
    return prefix_mode


def per_sequence_prefix(prefix_blocks) -> bool:
    """Packed calls: whether `prefix_blocks` gives one count per sequence (an array or a list)
    rather than one static int for all (a 0-d array is not an int: it is refused as one)."""
    return isinstance(prefix_blocks, (list, tuple)) or len(getattr(prefix_blocks, "shape", ())) > 0


def _check_prefix_int(prefix_blocks, n_q: int, n_kv: int, what: str) -> int:
    """A static prefix count: a Python int in [0, blocks of the sequence]; > 0 needs Sq == Skv."""
    if isinstance(prefix_blocks, (bool, np.bool_)) or not isinstance(prefix_blocks, (int, np.integer)):
        raise TypeError(f"prefix_blocks must be a Python int, got {prefix_blocks!r}")
    P = int(prefix_blocks)
    if P < 0:
        raise ValueError(f"prefix_blocks must be >= 0, got {P}")
    if P > 0 and n_q != n_kv:
        raise ValueError(f"prefix_blocks > 0 needs q and k of the same length (joint self-attention), got "
                         f"{n_q} query and {n_kv} KV blocks{what}")
    if P > n_q:
        raise ValueError(f"prefix_blocks ({P}) must not exceed the number of blocks of the sequence ({n_q}{what})")
    return P


def describe_attention(q, k, v, *, block_size: BlockSize, layout: str, kv_counts, q_counts=None,
                       topk=None, gate=None, selection: str = "topk", training: bool = True,
                       prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale=None, padding: str = "zeros",
                       layout_hint: bool = True) -> AttnProblem:
    """Checks the arguments of a call (anything with .shape and .dtype) and returns its problem.
    `layout_hint`: whether a wrong sequence length may suggest the other layout (not for calls
    that take one layout only: packed, sequence-parallel)."""
    check_padding(padding)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    E = block_elements(block_size)
    bq, hq, sq, dq = _split_token_shape("q", _shape(q), layout)
    bk, hk, sk, dk = _split_token_shape("k", _shape(k), layout)
    bv, hv, sv, dv = _split_token_shape("v", _shape(v), layout)
    for name, (b, h, d) in (("k", (bk, hk, dk)), ("v", (bv, hv, dv))):
        if (b, h, d) != (bq, hq, dq):
            raise ValueError(f"{name} must match q in batch, heads and head dim {(bq, hq, dq)}, got {(b, h, d)}")
    if sv != sk:
        raise ValueError(f"v must have the same sequence length as k ({sk}), got {sv}")
    if bq < 1 or hq < 1:
        raise ValueError(f"q must have batch >= 1 and heads >= 1, got shape {_shape(q)}")
    dt = dtype_name(q.dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"q must have dtype in {SUPPORTED_DTYPES}, got {dt}")
    for name, x in (("k", k), ("v", v)):
        if dtype_name(x.dtype) != dt:
            raise TypeError(f"{name} must have the same dtype as q ({dt}), got {dtype_name(x.dtype)}")
    if dq not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim (last axis of q) must be one of {SUPPORTED_HEAD_DIMS}, got {dq}")
    for name, s, shape in (("q", sq, _shape(q)), ("k", sk, _shape(k))):
        if s < E or s % E:
            raise ValueError(f"{name} sequence length must be a positive multiple of the block size {E}, got {s}"
                             f"{_layout_hint(shape, layout, E, selection) if layout_hint else ''}")
    _check_counts("variable_block_sizes", kv_counts, sk // E, "k", sk, block_size)
    has_gate = False
    vsa = selection == "topk"
    if vsa:
        # variable_block_sizes agreed with block_size: a wrong length here is the counts' own
        _check_counts("q_variable_block_sizes", q_counts, sq // E, "q", sq, block_size, block_size_hint=False)
        if isinstance(topk, (bool, np.bool_)) or not isinstance(topk, (int, np.integer)):
            raise TypeError(f"topk must be a Python int, got {topk!r}")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        topk = min(int(topk), sk // E)  # clamped to the number of KV blocks, as documented
        if gate is not None:
            if _shape(gate) != _shape(q):
                raise ValueError(f"compress_attn_weight must have q's shape {_shape(q)}, got {_shape(gate)}")
            if dtype_name(gate.dtype) != dt:
                raise TypeError(f"compress_attn_weight must have q's dtype ({dt}), got {dtype_name(gate.dtype)}")
            has_gate = True
    prefix = {}
    if vsa:
        check_prefix_mode(prefix_mode)
        P = _check_prefix_int(prefix_blocks, sq // E, sk // E, "")
        if P:  # no prefix: the plain problem, whatever the mode
            prefix = dict(prefix_blocks=P, prefix_mode=prefix_mode)
    check_softmax_scale(softmax_scale)
    return AttnProblem(batch=bq, heads=hq, q_len=sq, kv_len=sk, head_dim=dq, block_elems=E, dtype=dt,
                       layout=layout, topk=topk if vsa else None, has_gate=has_gate,
                       selection=selection, training=training, **prefix, softmax_scale=softmax_scale, padding=padding)


def check_block_map(block_map, problem: AttnProblem) -> None:
    """Packed sequences (problem.varlen) take the map without the batch axis: [H, nQ, nKV]."""
    want = (problem.batch, problem.heads, problem.n_q_blocks, problem.n_kv_blocks)
    axes = "[B, H, nQ, nKV]"
    if problem.varlen:
        want, axes = want[1:], "[H, nQ, nKV]"
    if _shape(block_map) != want:
        raise ValueError(f"block_map must have shape {axes} = {want}, got {_shape(block_map)}")
    if dtype_name(block_map.dtype) != "bool":
        raise TypeError(f"block_map must be a bool array, got dtype {dtype_name(block_map.dtype)}")


def check_index_lists(sel_idx, sel_num, problem: AttnProblem) -> None:
    """Packed sequences (problem.varlen) take the lists without the batch axis: [H, nQ, capacity]."""
    nq = problem.n_q_blocks
    lead, axes = (problem.batch, problem.heads, nq), "[B, H, nQ]"
    if problem.varlen:
        lead, axes = lead[1:], "[H, nQ]"
    rank = len(lead) + 1
    if len(_shape(sel_idx)) != rank or _shape(sel_idx)[:-1] != lead or _shape(sel_idx)[-1] < 1:
        raise ValueError(f"block_indices must have shape {axes[:-1]}, capacity] with {axes} = {lead}, "
                         f"got {_shape(sel_idx)}")
    if _shape(sel_num) != lead:
        raise ValueError(f"block_counts must have shape {axes} = {lead}, got {_shape(sel_num)}")
    for name, x in (("block_indices", sel_idx), ("block_counts", sel_num)):
        if dtype_name(x.dtype) != "int32":
            raise TypeError(f"{name} must be int32, got dtype {dtype_name(x.dtype)}")


def check_index_values(block_indices: np.ndarray, block_counts: np.ndarray, n_kv_blocks: int) -> None:
    """Values of index lists known on the host: each count in [0, capacity], and the
    first `count` entries of each row strictly ascending KV block indices in [0, nKV).

    Frontends call this in eager mode; under jit / compile the kernels apply the rule of
    `vsa_core.reference.index_lists_to_block_map` instead (nothing out of bounds is read).
    """
    idx = np.asarray(block_indices).astype(np.int64, copy=False)
    num = np.asarray(block_counts).astype(np.int64, copy=False)
    capacity = idx.shape[-1]
    bad = (num < 0) | (num > capacity)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_counts values must lie in [0, {capacity}] (the capacity of block_indices), "
                         f"found {int(num[at])} at [b, h, i] = {list(at)}")
    live = np.arange(capacity) < num[..., None]
    bad = live & ((idx < 0) | (idx >= n_kv_blocks))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_indices entries (the first block_counts of each row) must be KV block indices "
                         f"in [0, {n_kv_blocks}), found {int(idx[at])} at [b, h, i, j] = {list(at)}")
    bad = live[..., 1:] & (idx[..., 1:] <= idx[..., :-1])
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        what = "a repeat" if idx[at[:-1] + (at[-1] + 1,)] == idx[at] else "out of order"
        raise ValueError(f"block_indices rows must be strictly ascending (no repeats) within their count, found "
                         f"{int(idx[at[:-1] + (at[-1] + 1,)])} after {int(idx[at])} ({what}) at [b, h, i] = "
                         f"{list(at[:-1])}")


# ---- packed variable-length sequences ---------------------------------------------------
class _Batched:
    """Shape/dtype view of a [total, H, D] array as [1, total, H, D] (BSHD with B = 1)."""

    def __init__(self, x):
        self.shape = (1,) + _shape(x)
        self.dtype = x.dtype


def _check_offsets_shape(name: str, cu) -> int:
    if cu is None or not hasattr(cu, "shape"):
        raise TypeError(f"{name} must be an int32 array [N + 1] of token offsets, got {type(cu).__name__}")
    shape = _shape(cu)
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name} must have shape [N + 1] with N >= 1 sequences, got {shape}")
    if dtype_name(cu.dtype) != "int32":
        raise TypeError(f"{name} must be int32, got dtype {dtype_name(cu.dtype)}")
    return shape[0] - 1


def describe_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, block_size: BlockSize, kv_counts, q_counts=None,
                    topk=None, gate=None, selection: str = "topk", training: bool = True,
                    list_capacity: Optional[int] = None, prefix_blocks=0,
                    prefix_mode: str = "exempt", softmax_scale=None, padding: str = "zeros") -> AttnProblem:
    """Checks a packed call (q, gate [total_q, H, D]; k, v [total_k, H, D]; offsets int32
    [N + 1]) by shape and dtype, and returns its problem: BSHD with batch 1 and n_seqs = N.
    The offsets' values are checked by `check_offsets` where they are known on the host.
    `prefix_blocks`: an int (every sequence) or an integer array [N] (per sequence; its
    values are checked by `check_prefix_values` where they are known)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(_shape(x)) != 3:
            raise ValueError(f"{name} must be a rank-3 packed tensor [total, H, D], got shape {_shape(x)}")
    if gate is not None and _shape(gate) != _shape(q):
        raise ValueError(f"compress_attn_weight must have q's shape {_shape(q)}, got {_shape(gate)}")
    n = _check_offsets_shape("cu_seqlens_q", cu_seqlens_q)
    n_k = _check_offsets_shape("cu_seqlens_k", cu_seqlens_k)
    if n != n_k:
        raise ValueError(f"cu_seqlens_k must describe as many sequences as cu_seqlens_q ({n}), got {n_k} "
                         f"(shape {_shape(cu_seqlens_k)})")
    p = describe_attention(_Batched(q), _Batched(k), _Batched(v), block_size=block_size, layout="bshd",
                           kv_counts=kv_counts, q_counts=q_counts, topk=topk,
                           gate=None if gate is None else _Batched(gate), selection=selection, training=training,
                           softmax_scale=softmax_scale, padding=padding, layout_hint=False)
    p = dataclasses.replace(p, n_seqs=n, list_capacity=list_capacity)
    if selection != "topk":
        return p
    # the prefix of a packed call: an int for every sequence, or one count per sequence
    check_prefix_mode(prefix_mode)
    if per_sequence_prefix(prefix_blocks):
        per_seq = prefix_blocks if hasattr(prefix_blocks, "shape") else np.asarray(prefix_blocks)
        if _shape(per_seq) != (n,):
            raise ValueError(f"prefix_blocks as an array must have shape ({n},) (one count per sequence), got "
                             f"{_shape(per_seq)}")
        try:
            kind = np.dtype(dtype_name(per_seq.dtype)).kind
        except TypeError:
            kind = "?"
        if kind not in "iu":
            raise TypeError(f"prefix_blocks as an array must be integers, got dtype {dtype_name(per_seq.dtype)}")
        return dataclasses.replace(p, prefix_mode=prefix_mode, seq_prefix=True)
    P = _check_prefix_int(prefix_blocks, p.n_q_blocks, p.n_kv_blocks, " in the packed stream")
    return dataclasses.replace(p, prefix_blocks=P, prefix_mode=prefix_mode) if P else p


def check_offsets(name: str, values, total: int, block_elems: int) -> None:
    """Value checks of one offsets array (host values): starts at 0, non-decreasing
    (an empty sequence is allowed), every offset a multiple of E, the last one the total."""
    values = np.asarray(values, np.int64)
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(values[0])}")
    steps = np.diff(values)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing (ascending token offsets), got {int(values[i])} then "
                         f"{int(values[i + 1])} at position {i}")
    bad = values % block_elems != 0
    if bad.any():
        raise ValueError(f"{name} values must be multiples of the block size {block_elems} (each sequence is "
                         f"padded to whole blocks), found {int(values[np.argmax(bad)])}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {int(values[-1])}")


def block_sequence_ids(offsets, n_blocks: int, block_elems: int) -> np.ndarray:
    """Host version of the device kernel: the sequence id of each block."""
    starts = np.arange(n_blocks, dtype=np.int64) * block_elems
    return np.searchsorted(np.asarray(offsets, np.int64)[1:], starts, side="right")


def check_varlen_selection(p: AttnProblem, cu_q, cu_k, block_map=None, block_indices=None,
                           block_counts=None) -> None:
    """Host check of a packed selection: every listed KV block must belong to the query
    block's own sequence (and lie in range). The kernels ignore such entries; eager calls
    reject them."""
    q_seq = block_sequence_ids(cu_q, p.n_q_blocks, p.block_elems)
    kv_seq = block_sequence_ids(cu_k, p.n_kv_blocks, p.block_elems)
    if block_map is not None:  # [H, nQ, nKV]
        cross = np.asarray(block_map, bool) & (q_seq[:, None] != kv_seq[None, :])
        if cross.any():
            h, i, j = (int(x) for x in np.argwhere(cross)[0])
            raise ValueError(f"block_map selects KV block {j} (sequence {kv_seq[j]}) for query block {i} "
                             f"(sequence {q_seq[i]}) of head {h}: a query block may select only blocks of "
                             "its own sequence")
        return
    idx = np.asarray(block_indices, np.int64)
    num = np.asarray(block_counts, np.int64)
    if (num < 0).any() or (num > idx.shape[-1]).any():
        raise ValueError(f"block_counts values must lie in [0, {idx.shape[-1]}] (the lists' capacity)")
    listed = np.arange(idx.shape[-1]) < num[..., None]
    if ((idx < 0) | (idx >= p.n_kv_blocks))[listed].any():
        raise ValueError(f"block_indices values must lie in [0, {p.n_kv_blocks}) (KV blocks of the packed stream)")
    own = kv_seq[np.clip(idx, 0, p.n_kv_blocks - 1)] == q_seq[None, :, None]  # idx: [H, nQ, capacity]
    cross = listed & ~own
    if cross.any():
        h, i, slot = (int(x) for x in np.argwhere(cross)[0])
        j = int(idx[h, i, slot])
        raise ValueError(f"block_indices lists KV block {j} (sequence {kv_seq[j]}) for query block {i} "
                         f"(sequence {q_seq[i]}) of head {h}: a query block may select only blocks of its own "
                         "sequence")


def check_prefix_values(prefix_blocks, cu_q, cu_k, block_elems: int) -> None:
    """Host check of packed prefix counts (an int or one per sequence) against the offsets:
    sequence i's count in [0, its blocks], and a sequence with a prefix has as many query as
    KV tokens (joint self-attention). Frontends call it where the values are known; under
    jit / compile the kernel reads them on the device (a count above the sequence makes it
    all prefix, below 0 none)."""
    cu_q, cu_k = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    n = len(cu_q) - 1
    counts = np.broadcast_to(np.asarray(prefix_blocks, np.int64), (n,))
    q_blocks, kv_blocks = np.diff(cu_q) // block_elems, np.diff(cu_k) // block_elems
    for i in range(n):
        P = int(counts[i])
        if P < 0:
            raise ValueError(f"prefix_blocks must be >= 0, got {P} for sequence {i}")
        if P > 0 and q_blocks[i] != kv_blocks[i]:
            raise ValueError(f"prefix_blocks > 0 needs a sequence's q and k of the same length (joint "
                             f"self-attention): sequence {i} has {q_blocks[i]} query and {kv_blocks[i]} KV blocks")
        if P > q_blocks[i]:
            raise ValueError(f"prefix_blocks ({P}) must not exceed the number of blocks of sequence {i} "
                             f"({q_blocks[i]})")
