"""Argument checking and buffer shapes, shared by every frontend.

Frontends describe their arrays by shape and dtype name only, so these checks run
before any kernel (at trace time under jax.jit, eagerly in PyTorch) and raise the
same `ValueError` / `TypeError` everywhere. The buffer tables say which output and
workspace buffers a call needs; each frontend allocates them its own way.
"""

from __future__ import annotations

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
        return self.topk if self.topk is not None else self.n_kv_blocks

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
                bufs["out_fine"] = (self.token_shape(self.q_len), "float32")
        elif self.selection == "block_map":
            bufs.update({
                "sel_idx": ((B, H, nq, nk), "int32"),
                "sel_num": ((B, H, nq), "int32"),
            })
        return bufs

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
            })
            if self.has_gate:
                bufs["dgate"] = (self.token_shape(self.q_len), "input")
        elif self.selection == "indices":
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


def _check_counts(name: str, counts, n_blocks: int):
    if counts is None:
        raise ValueError(f"{name} is required: a 1-D integer array of {n_blocks} per-block valid-token counts")
    if not hasattr(counts, "shape"):
        counts = np.asarray(counts)
    shape = _shape(counts)
    if shape != (n_blocks,):
        raise ValueError(f"{name} must have shape ({n_blocks},) (one count per block), got {shape}")
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


def describe_attention(q, k, v, *, block_size: BlockSize, layout: str, kv_counts, q_counts=None,
                       topk=None, gate=None, selection: str = "topk", training: bool = True) -> AttnProblem:
    """Checks the arguments of a call (anything with .shape and .dtype) and returns its problem."""
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
    for name, s in (("q", sq), ("k", sk)):
        if s < E or s % E:
            raise ValueError(f"{name} sequence length must be a positive multiple of the block size {E}, got {s}")
    _check_counts("variable_block_sizes", kv_counts, sk // E)
    has_gate = False
    vsa = selection == "topk"
    if vsa:
        _check_counts("q_variable_block_sizes", q_counts, sq // E)
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
    return AttnProblem(batch=bq, heads=hq, q_len=sq, kv_len=sk, head_dim=dq, block_elems=E, dtype=dt,
                       layout=layout, topk=topk if vsa else None, has_gate=has_gate,
                       selection=selection, training=training)


def check_block_map(block_map, problem: AttnProblem) -> None:
    want = (problem.batch, problem.heads, problem.n_q_blocks, problem.n_kv_blocks)
    if _shape(block_map) != want:
        raise ValueError(f"block_map must have shape [B, H, nQ, nKV] = {want}, got {_shape(block_map)}")
    if dtype_name(block_map.dtype) != "bool":
        raise TypeError(f"block_map must be a bool array, got dtype {dtype_name(block_map.dtype)}")


def check_index_lists(sel_idx, sel_num, problem: AttnProblem) -> None:
    nq = problem.n_q_blocks
    lead = (problem.batch, problem.heads, nq)
    if len(_shape(sel_idx)) != 4 or _shape(sel_idx)[:3] != lead or _shape(sel_idx)[3] < 1:
        raise ValueError(f"block_indices must have shape [B, H, nQ, capacity] with [B, H, nQ] = {lead}, "
                         f"got {_shape(sel_idx)}")
    if _shape(sel_num) != lead:
        raise ValueError(f"block_counts must have shape [B, H, nQ] = {lead}, got {_shape(sel_num)}")
    for name, x in (("block_indices", sel_idx), ("block_counts", sel_num)):
        if dtype_name(x.dtype) != "int32":
            raise TypeError(f"{name} must be int32, got dtype {dtype_name(x.dtype)}")
