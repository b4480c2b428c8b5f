"""Sequence-parallel (Ulysses) calls: the checks and the preparation both frontends share.

With the sequence sharded over P devices, each holds `[B, S/P, H, D]` (BSHD) of the
tile-ordered sequence; a head-parallel all-to-all turns that into the whole sequence
of H/P heads, `[B, S, H/P, D]`, on which the ordinary VSA runs. These checks look at
this device's shards (anything with .shape and .dtype) before any collective, and
describe the problem each device then runs; `prepare_ulysses` / `prepare_on_mesh` add the
argument types and the counts' coercion over the frontend's adapter (`vsa_core.frontend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import numpy as np

from .config import config
from .frontend import FrontendAdapter, as_counts
from .problem import AttnProblem, block_elements, describe_attention

# each device's H/P heads go through the exchanges and VSA in this many chunks, so that
# one chunk's transfers overlap another's computation (the configured `ulysses_chunks`,
# VSA_ULYSSES_CHUNKS: vsa_core.config, replaces it)
DEFAULT_CHUNKS = 4


def head_chunks(heads_per_device: int, chunks: Optional[int] = None) -> List[Tuple[int, int]]:
    """[h0, h1) ranges splitting a device's heads into `chunks` near-equal parts (default:
    the configured `ulysses_chunks`, else DEFAULT_CHUNKS; fewer when there are fewer heads). A chunk
    stands for the same range in every device's heads: device p's global heads
    p*H/P + [h0, h1)."""
    if chunks is None:
        chunks = config().ulysses_chunks or DEFAULT_CHUNKS
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    n = min(chunks, heads_per_device)
    bounds = [round(i * heads_per_device / n) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _num_blocks(name: str, counts) -> int:
    shape = tuple(counts.shape) if hasattr(counts, "shape") else np.shape(counts)
    if len(shape) != 1:
        raise ValueError(f"{name} must be a 1-D array of per-block token counts of the whole sequence, "
                         f"got shape {tuple(shape)}")
    return int(shape[0])


def check_ulysses_shards(q, k, v, gate, kv_counts, q_counts, *, block_size, topk, group_size: int,
                         prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale=None,
                         padding: str = "zeros") -> AttnProblem:
    """Checks this device's shards against the group size and the counts (which describe
    the whole sequence); returns the problem each device runs after the exchange (its
    prefix_blocks / prefix_mode normalised: the whole sequence's, as on one device, since
    after the exchange each device holds whole sequences of its heads).

    The counts being the same everywhere, the check that they cover `group_size` shards
    of this device's length also proves that every device holds a shard of that length."""
    P = group_size
    for name, x in (("q", q), ("k", k), ("v", v), ("compress_attn_weight", gate)):
        if x is not None and len(x.shape) != 4:
            raise ValueError(f"{name} must be this device's shard [B, S/P, H, D], got shape {tuple(x.shape)}")
    E = block_elements(block_size)
    heads = int(q.shape[2])
    if heads % P:
        raise ValueError(f"q has {heads} heads, not divisible by the group size {P} "
                         f"(Ulysses gives each device H/P whole heads)")
    for name, x, counts_name, counts in (("q", q, "q_variable_block_sizes", q_counts),
                                         ("k", k, "variable_block_sizes", kv_counts)):
        shard = int(x.shape[1])
        if shard < E or shard % E:
            raise ValueError(f"{name}'s shard holds {shard} tokens, not a whole number of {E}-token blocks "
                             f"(each device must hold whole blocks of the tile order)")
        n_blocks = _num_blocks(counts_name, counts)
        if n_blocks * E != P * shard:
            raise ValueError(f"{counts_name} describes {n_blocks} blocks = {n_blocks * E} tokens, but "
                             f"{P} devices x {shard}-token {name} shards hold {P * shard}: the counts must "
                             f"cover the whole sequence and every device must hold an equal shard")
    if int(v.shape[1]) != int(k.shape[1]):
        raise ValueError(f"v's shard must have k's length ({int(k.shape[1])}), got {int(v.shape[1])}")

    def after_exchange(x):  # [B, s, H, D] -> [B, P*s, H/P, D]
        B, s, H, D = (int(n) for n in x.shape)
        return SimpleNamespace(shape=(B, P * s, H // P, D), dtype=x.dtype)

    return describe_attention(after_exchange(q), after_exchange(k), after_exchange(v), block_size=block_size,
                              layout="bshd", kv_counts=kv_counts, q_counts=q_counts, topk=topk,
                              gate=None if gate is None else after_exchange(gate), prefix_blocks=prefix_blocks,
                              prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding, layout_hint=False)


@dataclass(frozen=True)
class UlyssesCall:
    """A checked sequence-parallel call of a group of several devices."""

    problem: AttnProblem  # what each device runs after the exchange
    kv_counts: Any        # the counts as int32 arrays on q's device (values checked where known)
    q_counts: Any
    chunks: List[Tuple[int, int]]  # `head_chunks` of each device's H/P heads


def prepare_ulysses(fe: FrontendAdapter, q, k, v, gate, kv_counts, q_counts, *, group_size: int, block_size, topk,
                    prefix_blocks=0, prefix_mode: str = "exempt", softmax_scale=None,
                    padding: str = "zeros") -> Optional[UlyssesCall]:
    """Checks a `ulysses_video_sparse_attn` call on this device's shards (`check_ulysses_shards`);
    None for a group of one device, whose call is the one-device `video_sparse_attn_bshd` of
    the arguments as they are."""
    fe.require(q=q, k=k, v=v, compress_attn_weight=gate)
    p = check_ulysses_shards(q, k, v, gate, kv_counts, q_counts, block_size=block_size, topk=topk,
                             group_size=group_size, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                             softmax_scale=softmax_scale, padding=padding)
    if group_size == 1:
        return None
    fe.check_devices(q, k=k, v=v, compress_attn_weight=gate)
    return UlyssesCall(p, as_counts(fe, "variable_block_sizes", kv_counts, q, p.block_elems),
                       as_counts(fe, "q_variable_block_sizes", q_counts, q, p.block_elems),
                       head_chunks(int(q.shape[2]) // group_size))


def prepare_on_mesh(fe: FrontendAdapter, q, k, v, gate, kv_counts, q_counts, *, mesh_shape, axis_name: str,
                    batch_axis_name: Optional[str], block_size) -> Tuple[Any, Any]:
    """Checks a sequence-parallel call on global `[B, S, H, D]` arrays over mesh axis
    `axis_name` (`mesh_shape`: axis name -> size) before it is split; returns the counts as
    int32 arrays (their values checked where known)."""
    fe.require(q=q, k=k, v=v, compress_attn_weight=gate)
    if axis_name not in mesh_shape:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh_shape)}")
    if batch_axis_name is not None and batch_axis_name not in mesh_shape:
        raise ValueError(f"batch_axis_name {batch_axis_name!r} is not an axis of the mesh {dict(mesh_shape)}")
    group_size = mesh_shape[axis_name]
    for name, x in (("q", q), ("k", k)):
        if len(x.shape) == 4 and x.shape[1] % group_size:
            raise ValueError(f"{name}'s sequence length {x.shape[1]} does not split into {group_size} equal shards "
                             f"over mesh axis {axis_name!r}")
    E = block_elements(block_size)
    return (as_counts(fe, "variable_block_sizes", kv_counts, q, E),
            as_counts(fe, "q_variable_block_sizes", q_counts, q, E))
