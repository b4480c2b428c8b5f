"""Checks for sequence-parallel (Ulysses) calls, shared by both frontends.

With the sequence sharded over P devices, each holds `[B, S/P, H, D]` (BSHD) of the
tile-ordered sequence; a head-parallel all-to-all turns that into the whole sequence
of H/P heads, `[B, S, H/P, D]`, on which the ordinary VSA runs. These checks look at
this device's shards (anything with .shape and .dtype) before any collective, and
describe the problem each device then runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional, Tuple

import numpy as np

from .config import config
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
