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

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from vsa_core.sequence_parallel import check_ulysses_shards

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
    check_ulysses_shards(q, k, v, compress_attn_weight, variable_block_sizes, q_variable_block_sizes,
                         block_size=block_size, topk=topk, group_size=P)
    if P == 1:
        return video_sparse_attn_bshd(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                                      compress_attn_weight, backend=backend)
    inputs = [q, k, v] + ([compress_attn_weight] if compress_attn_weight is not None else [])
    moved = _AllToAll.apply(group, True, *inputs)
    gate = moved[3] if compress_attn_weight is not None else None
    out = video_sparse_attn_bshd(moved[0], moved[1], moved[2], variable_block_sizes, q_variable_block_sizes,
                                 topk, block_size, gate, backend=backend)
    return _AllToAll.apply(group, False, out)[0]
