"""Sequence parallelism for VSA over torch.distributed (Ulysses: head-parallel all-to-all).

Each of the P ranks of a process group holds a contiguous slice of the tile-ordered
sequence, `[B, S/P, H, D]`, rank r holding tokens [r*S/P, (r+1)*S/P). VSA works per
head, so an all-to-all trades every rank's sequence shard of all heads for the whole
sequence of H/P heads, VSA runs on those unchanged, and a second all-to-all trades the
output back. Each head is computed whole on one rank by the same kernels as on one
device, so output and gradients equal the single-device VSA on the full sequence.

    import torch.distributed as dist
    from vsa_torch.parallel import ulysses_video_sparse_attn
    dist.init_process_group("nccl")                  # torchrun --nproc_per_node P ...
    out = ulysses_video_sparse_attn(q, k, v, counts, counts, topk=45, block_size=(4, 8, 8),
                                    compress_attn_weight=gate)      # [B, S/P, H, D] shards

The data moves only through torch.distributed collectives (NCCL on GPUs, gloo on the
CPU), so the same code runs across nodes. Gradients flow through the collectives: the
backward of an all-to-all is the reverse all-to-all.

Every rank must make the same calls with the same shapes (as with any collective). The
counts describe the whole sequence and must be the same on every rank; then the check
that they cover P shards of this rank's length also proves every rank's shard has that
length (a check across ranks would cost a collective and a host sync per call).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from vsa_core.problem import block_elements, describe_attention

from . import _require_tensors, video_sparse_attn_bshd

__all__ = ["ulysses_video_sparse_attn"]


# ---- the two all-to-alls ------------------------------------------------------------------
def _sequence_to_heads(recv: Tensor, P: int) -> Tensor:
    """Post-processing of the seq->heads exchange: recv[p] is rank p's sequence shard of
    this rank's heads, [P, B, s, H/P, D] -> [B, P*s, H/P, D] (a view when B == 1)."""
    _, B, s, hp, D = recv.shape
    return recv.transpose(0, 1).reshape(B, P * s, hp, D)


def _heads_to_sequence(recv: Tensor, P: int) -> Tensor:
    """recv[p] is this rank's sequence shard of rank p's heads: [P, B, s, H/P, D] -> [B, s, H, D]."""
    _, B, s, hp, D = recv.shape
    return recv.permute(1, 2, 0, 3, 4).reshape(B, s, P * hp, D)


def _send_buffer(x: Tensor, P: int, to_heads: bool) -> Tensor:
    """[P, B, s, H/P, D], chunk p going to rank p (contiguous: all_to_all_single splits dim 0)."""
    if to_heads:  # x: [B, s, H, D], rank p gets heads [p*H/P, (p+1)*H/P)
        B, s, H, D = x.shape
        return x.reshape(B, s, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()
    B, S, hp, D = x.shape  # x: [B, S, H/P, D], rank p gets tokens [p*S/P, (p+1)*S/P)
    return x.reshape(B, P, S // P, hp, D).transpose(0, 1).contiguous()


def _exchange(tensors: Sequence[Tensor], group, to_heads: bool) -> List[Tensor]:
    """seq->heads (`to_heads`) or heads->seq for each tensor. The all-to-alls are started
    asynchronously, so on NCCL one tensor's transfer overlaps the next one's packing copy."""
    P = dist.get_world_size(group)
    started = []
    for x in tensors:
        send = _send_buffer(x, P, to_heads)
        recv = torch.empty_like(send)
        started.append((send, recv, dist.all_to_all_single(recv, send, group=group, async_op=True)))
    unpack = _sequence_to_heads if to_heads else _heads_to_sequence
    out = []
    for send, recv, work in started:  # `send` stays referenced until its transfer is done
        work.wait()
        out.append(unpack(recv, P))
    return out


class _AllToAll(torch.autograd.Function):
    """seq->heads or heads->seq for several tensors; the backward is the reverse exchange
    of the gradients (only of the inputs that need one: every rank asks for the same ones)."""

    @staticmethod
    def forward(ctx, group, to_heads: bool, *tensors: Tensor):
        ctx.group, ctx.to_heads = group, to_heads
        return tuple(_exchange(tensors, group, to_heads))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        moved = _exchange([grads[i] for i in wanted], ctx.group, not ctx.to_heads)
        result: List[Optional[Tensor]] = [None] * len(grads)
        for i, g in zip(wanted, moved):
            result[i] = g
        return (None, None, *result)


# ---- checks -------------------------------------------------------------------------------
def _group_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ulysses_video_sparse_attn needs torch.distributed: call "
                           "torch.distributed.init_process_group first (e.g. under torchrun)")
    return dist.get_world_size(group)


def _num_blocks(name: str, counts) -> int:
    shape = tuple(counts.shape) if hasattr(counts, "shape") else np.shape(counts)
    if len(shape) != 1:
        raise ValueError(f"{name} must be a 1-D array of per-block token counts of the whole sequence, "
                         f"got shape {shape}")
    return shape[0]


def _check_shards(q, k, v, gate, kv_counts, q_counts, block_size, topk, P: int):
    """Checks this rank's shards against the group and the counts; returns the problem
    each rank runs after the exchange (described by shape only, before any collective)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("compress_attn_weight", gate)):
        if x is not None and x.dim() != 4:
            raise ValueError(f"{name} must be this rank's shard [B, S/P, H, D], got shape {tuple(x.shape)}")
    E = block_elements(block_size)
    heads = q.shape[2]
    if heads % P:
        raise ValueError(f"q has {heads} heads, not divisible by the process group's size {P} "
                         f"(Ulysses gives each rank H/P whole heads)")
    for name, x, counts_name, counts in (("q", q, "q_variable_block_sizes", q_counts),
                                         ("k", k, "variable_block_sizes", kv_counts)):
        shard = x.shape[1]
        if shard < E or shard % E:
            raise ValueError(f"{name}'s shard holds {shard} tokens on this rank, not a whole number of "
                             f"{E}-token blocks (each rank must hold whole blocks of the tile order)")
        n_blocks = _num_blocks(counts_name, counts)
        if n_blocks * E != P * shard:
            raise ValueError(f"{counts_name} describes {n_blocks} blocks = {n_blocks * E} tokens, but "
                             f"{P} ranks x {shard}-token {name} shards hold {P * shard}: the counts must "
                             f"cover the whole sequence and every rank must hold an equal shard")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v's shard must have k's length ({k.shape[1]}), got {v.shape[1]}")

    def after_exchange(x):  # [B, s, H, D] -> [B, P*s, H/P, D]
        B, s, H, D = x.shape
        return SimpleNamespace(shape=(B, P * s, H // P, D), dtype=x.dtype)

    return describe_attention(after_exchange(q), after_exchange(k), after_exchange(v), block_size=block_size,
                              layout="bshd", kv_counts=kv_counts, q_counts=q_counts, topk=topk,
                              gate=None if gate is None else after_exchange(gate))


# ---- the operator -------------------------------------------------------------------------
def ulysses_video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes,
                              topk: int, block_size=64, compress_attn_weight: Optional[Tensor] = None, *,
                              group: Optional[dist.ProcessGroup] = None, backend: str = "auto") -> Tensor:
    """`video_sparse_attn_bshd` with the sequence sharded over a process group.

    q, k, v and the gate are this rank's contiguous shard `[B, S/P, H, D]` of the
    tile-ordered sequence (rank r of `group` holds the r-th slice; S/P a multiple of the
    block's token count; q and k may have different lengths). The counts describe the
    whole sequence and are the same on every rank. H must be divisible by P. Returns
    this rank's shard `[B, S/P, H, D]` of the output; differentiable in q, k, v and the gate.
    `group`: the process group (default: the whole world).
    """
    _require_tensors(q=q, k=k, v=v, compress_attn_weight=compress_attn_weight)
    P = _group_size(group)
    _check_shards(q, k, v, compress_attn_weight, variable_block_sizes, q_variable_block_sizes, block_size,
                  topk, P)
    if P == 1:
        return video_sparse_attn_bshd(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                                      compress_attn_weight, backend=backend)
    inputs = [q, k, v] + ([compress_attn_weight] if compress_attn_weight is not None else [])
    moved = _AllToAll.apply(group, True, *inputs)
    gate = moved[3] if compress_attn_weight is not None else None
    out = video_sparse_attn_bshd(moved[0], moved[1], moved[2], variable_block_sizes, q_variable_block_sizes,
                                 topk, block_size, gate, backend=backend)
    return _AllToAll.apply(group, False, out)[0]
