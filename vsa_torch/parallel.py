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

The exchanges overlap the computation: each rank's H/P heads are processed in a few
chunks (VSA_ULYSSES_CHUNKS, default 4), every chunk's input exchange is started at once
(asynchronously, on NCCL's stream), chunk c's VSA runs as soon as its inputs have
arrived while the later chunks still travel, and its output travels back while chunk
c+1 computes; the backward does the same with dout and the gradients. Chunking splits
heads only, so every head is still computed whole by the same kernels. An exchange is
an all-to-all made of point-to-point transfers, all of a chunk's tensors in one NCCL
group (one kernel); the part a rank keeps is copied locally.

For the overlap, give NCCL a high-priority stream: the attention kernels fill every SM,
and a communication kernel at normal priority gets SMs only between two compute
kernels; at high priority its blocks are placed first. Either
`TORCH_NCCL_HIGH_PRIORITY=1` before the process group is made, or a group of its own:
`dist.new_group(pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))`
passed as `group=`.

Every rank must make the same calls with the same shapes (as with any collective). The
counts describe the whole sequence and must be the same on every rank; then the check
that they cover P shards of this rank's length also proves every rank's shard has that
length (a check across ranks would cost a collective and a host sync per call).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from vsa_core.sequence_parallel import prepare_ulysses

from .adapter import TORCH
from .attention import video_sparse_attn_bshd

__all__ = ["ulysses_video_sparse_attn"]


# ---- the exchanges ------------------------------------------------------------------------
# Shapes: this rank's shard x is [B, s, H, D] (s = S/P); after the exchange a rank holds
# [B, S, h, D] for a chunk of h of its H/P heads. A chunk is a range [h0, h1) inside every
# rank's H/P heads: rank p computes global heads p*H/P + [h0, h1).
#
# One exchange moves all the tensors of a chunk (q, k, v, gate; or dq, dk, dv, dgate) as
# ONE batch of point-to-point transfers (`batch_isend_irecv`: on NCCL one group, so one
# kernel, instead of one all-to-all kernel per tensor). That matters for the overlap: a
# communication kernel queued while a compute kernel still has thread blocks waiting for
# an SM starts only when that kernel's last blocks have been placed, so every separate
# collective waits for a compute kernel boundary. The part a rank keeps for itself is
# written by the packing copy straight into its receive slot: no transfer, and the
# communication kernel copies only what really crosses to another GPU.
class _Exchange:
    """All the transfers of one chunk, started asynchronously (seq->heads of the chunk
    `heads` with `to_heads`, else heads->seq); `finish()` waits for them (on NCCL a stream
    wait, no host block) and returns the receive buffers, [P, B, s, h, D] each, recv[p]
    coming from rank p."""

    def __init__(self, tensors: Sequence[Tensor], group, P: int, heads: Tuple[int, int], to_heads: bool):
        rank = dist.get_rank(group)
        peers = [p for p in range(P) if p != rank]
        self.recvs, self.sends, ops = [], [], []
        for x in tensors:
            parts = _parts(x, P, heads, to_heads)
            recv = x.new_empty((P,) + parts[0].shape)
            send = x.new_empty((len(peers),) + parts[0].shape)
            recv[rank].copy_(parts[rank])
            for i, p in enumerate(peers):
                send[i].copy_(parts[p])
                ops.append(dist.P2POp(dist.isend, send[i], group=group, group_peer=p))
                ops.append(dist.P2POp(dist.irecv, recv[p], group=group, group_peer=p))
            self.recvs.append(recv)
            self.sends.append(send)  # kept referenced until the transfers are done
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def finish(self) -> List[Tensor]:
        for work in self.works:
            work.wait()
        self.works, self.sends = [], []
        return self.recvs


def _parts(x: Tensor, P: int, heads: Tuple[int, int], to_heads: bool) -> List[Tensor]:
    """parts[p] = what rank p gets of x, [B, s, h, D] (a strided view)."""
    h0, h1 = heads
    if to_heads:  # x: [B, s, H, D]; rank p gets its heads p*H/P + [h0, h1) of this sequence shard
        B, s, H, D = x.shape
        split = x.reshape(B, s, P, H // P, D)
        return [split[:, :, p, h0:h1] for p in range(P)]
    B, S, h, D = x.shape  # x: [B, S, h, D]; rank p gets tokens [p*S/P, (p+1)*S/P)
    split = x.reshape(B, P, S // P, h, D)
    return [split[:, p] for p in range(P)]


def _sequence_of_heads(recv: Tensor) -> Tensor:
    """recv[p] = rank p's sequence shard of this rank's heads: [P, B, s, h, D] -> [B, P*s, h, D]
    (a view when B == 1)."""
    P, B, s, h, D = recv.shape
    return recv.transpose(0, 1).reshape(B, P * s, h, D)


def _store_heads(dest: Tensor, recv: Tensor, heads: Tuple[int, int]) -> None:
    """recv[p] = this rank's sequence shard of rank p's heads p*H/P + [h0, h1): written into
    dest [B, s, H, D]."""
    P, B, s, h, D = recv.shape
    dest.view(B, s, P, dest.shape[2] // P, D)[:, :, :, heads[0]:heads[1]].copy_(recv.permute(1, 2, 0, 3, 4))


# ---- the operator as one autograd Function -------------------------------------------------
class _UlyssesVSA(torch.autograd.Function):
    """Exchange, VSA and exchange back, chunk by chunk (see the module docstring); the
    backward exchanges dout, runs VSA's backward per chunk and sends the gradients back.
    `attend(q, k, v, gate)`: the public VSA function of one chunk's heads. Each chunk's heads
    are leaves of a graph of their own, so that its backward runs when its dout has arrived.
    `training`: whether a backward can follow, from the caller's grad mode and requires_grad
    (inside `forward` grad mode is off, and needs_input_grad ignores it)."""

    @staticmethod
    def forward(ctx, q, k, v, gate, attend: Callable, group, chunks, training: bool):
        P = dist.get_world_size(group)
        inputs = [q, k, v] + ([gate] if gate is not None else [])
        incoming = [_Exchange(inputs, group, P, c, to_heads=True) for c in chunks]
        out = torch.empty_like(q)
        outgoing, saved = [], []
        for c, exchange in zip(chunks, incoming):
            heads = [_sequence_of_heads(r).detach().requires_grad_(training) for r in exchange.finish()]
            with torch.set_grad_enabled(training):
                chunk_out = attend(*heads)
            outgoing.append(_Exchange([chunk_out.detach()], group, P, c, to_heads=False))
            if training:
                saved.append((heads, chunk_out))
        for c, exchange in zip(chunks, outgoing):
            _store_heads(out, exchange.finish()[0], c)
        ctx.group, ctx.chunks, ctx.saved_chunks = group, chunks, saved
        ctx.kv_shape, ctx.has_gate = k.shape, gate is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        P = dist.get_world_size(ctx.group)
        incoming = [_Exchange([dout.contiguous()], ctx.group, P, c, to_heads=True) for c in ctx.chunks]
        shapes = (dout.shape, ctx.kv_shape, ctx.kv_shape, dout.shape)[:3 + ctx.has_gate]
        grads = [dout.new_empty(shape) for shape in shapes]
        outgoing = []
        for c, exchange, (heads, chunk_out) in zip(ctx.chunks, incoming, ctx.saved_chunks):
            douth = _sequence_of_heads(exchange.finish()[0])
            chunk_grads = torch.autograd.grad(chunk_out, heads, douth)
            outgoing.append(_Exchange(list(chunk_grads), ctx.group, P, c, to_heads=False))
        for c, exchange in zip(ctx.chunks, outgoing):
            for dest, recv in zip(grads, exchange.finish()):
                _store_heads(dest, recv, c)
        ctx.saved_chunks = None
        return (*grads[:3], grads[3] if ctx.has_gate else None) + (None,) * 4


# ---- checks -------------------------------------------------------------------------------
def _group_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ulysses_video_sparse_attn needs torch.distributed: call "
                           "torch.distributed.init_process_group first (e.g. under torchrun)")
    return dist.get_world_size(group)


# ---- the operator -------------------------------------------------------------------------
def ulysses_video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, variable_block_sizes, q_variable_block_sizes,
                              topk: int, block_size=64, compress_attn_weight: Optional[Tensor] = None, *,
                              group: Optional[dist.ProcessGroup] = None, backend: str = "auto",
                              prefix_blocks: int = 0, prefix_mode: str = "exempt",
                              softmax_scale: Optional[float] = None, padding: str = "zeros") -> Tensor:
    """`video_sparse_attn_bshd` with the sequence sharded over a process group.

    q, k, v and the gate are this rank's contiguous shard `[B, S/P, H, D]` of the
    tile-ordered sequence (rank r of `group` holds the r-th slice; S/P a multiple of the
    block's token count; q and k may have different lengths). The counts describe the
    whole sequence and are the same on every rank. H must be divisible by P. Returns
    this rank's shard `[B, S/P, H, D]` of the output; differentiable in q, k, v and the gate.
    `group`: the process group (default: the whole world); `padding` as in `video_sparse_attn`
    (the padded rows travel with the shards; they are read by the rank that computes them).
    `prefix_blocks` / `prefix_mode`: mixed-modality prefix blocks at the start of the whole
    sequence, as in `video_sparse_attn` (Sq == Skv; the prefix may span several ranks'
    shards). After the exchange each rank holds whole sequences of its heads, so the
    selection is the one-device selection. `softmax_scale` as in `video_sparse_attn` (one
    scale for the coarse and the fine branch).
    """
    statics = dict(prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding)
    call = prepare_ulysses(TORCH, q, k, v, compress_attn_weight, variable_block_sizes, q_variable_block_sizes,
                           group_size=_group_size(group), block_size=block_size, topk=topk, **statics)
    if call is None:
        return video_sparse_attn_bshd(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                                      compress_attn_weight, backend=backend, **statics)

    def attend(q, k, v, gate=None):
        return video_sparse_attn_bshd(q, k, v, call.kv_counts, call.q_counts, topk, block_size, gate,
                                      backend=backend, **statics)
    gate = compress_attn_weight
    training = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, gate))
    return _UlyssesVSA.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                             None if gate is None else gate.contiguous(), attend, group, call.chunks, training)
