"""Sequence parallelism for VSA with JAX collectives (Ulysses: head-parallel all-to-all).

Each of the P devices along a mesh axis holds a contiguous slice of the tile-ordered
sequence, `[B, S/P, H, D]`, device i of the axis holding tokens [i*S/P, (i+1)*S/P).
VSA works per head, so `jax.lax.all_to_all` trades every device's sequence shard of all
heads for the whole sequence of H/P heads, VSA runs on those unchanged, and a second
all-to-all trades the output back. Each head is computed whole on one device by the same
kernels as on one device, so output and gradients equal the single-device VSA.

Inside `jax.shard_map` (the sequence axis split over mesh axis "sp"):

    out = ulysses_video_sparse_attn(q, k, v, counts, counts, 45, (4, 8, 8), gate, axis_name="sp")

or in one line on global arrays (jit-able, differentiable):

    mesh = jax.make_mesh((jax.device_count(),), ("sp",))
    out = ulysses_video_sparse_attn_on_mesh(q, k, v, counts, counts, 45, (4, 8, 8), gate,
                                            mesh=mesh, axis_name="sp")

The data moves only through JAX's collectives (XLA's all-to-all: NCCL between GPUs), so
the same code runs across hosts (multi-controller JAX with a global mesh).

Each device's heads go through in chunks (VSA_ULYSSES_CHUNKS, default 4, read when traced),
so that one chunk's all-to-all can overlap another chunk's VSA. Whether it does is XLA's
schedule: its default GPU scheduler puts every all-to-all's start and done together (no
overlap); `XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true`, set before JAX starts,
lets it start a chunk's exchange before, and wait for it after, other chunks' VSA. The VSA
custom calls are not side-effecting, so nothing else pins the order.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from vsa_core.sequence_parallel import prepare_on_mesh, prepare_ulysses

from .adapter import JAX
from .attention import video_sparse_attn_bshd

__all__ = ["ulysses_video_sparse_attn", "ulysses_video_sparse_attn_on_mesh"]


def _sequence_to_heads(x, axis_name, heads=None):
    """[B, S/P, H, D] on each device -> [B, S, h, D] for the chunk [h0, h1) of every device's
    H/P heads (default: all of them): device p receives its heads p*H/P + [h0, h1), the
    sequence gathered in device order along the axis (tiled: chunk i goes to device i)."""
    B, s, H, D = x.shape
    P = jax.lax.axis_size(axis_name)
    h0, h1 = heads or (0, H // P)
    x = x.reshape(B, s, P, H // P, D)[:, :, :, h0:h1].reshape(B, s, P * (h1 - h0), D)
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_sequence(x, axis_name):
    """[B, S, h, D] -> [B, S/P, P, h, D]: this device's sequence shard of every device's chunk."""
    B, S, h, D = x.shape
    P = jax.lax.axis_size(axis_name)
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True).reshape(B, S // P, P, h, D)


def ulysses_video_sparse_attn(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes,
                              q_variable_block_sizes, topk: int, block_size=64,
                              compress_attn_weight: Optional[jax.Array] = None, *, axis_name,
                              backend: str = "auto", prefix_blocks: int = 0, prefix_mode: str = "exempt",
                              softmax_scale: Optional[float] = None, padding: str = "zeros") -> jax.Array:
    """`video_sparse_attn_bshd` with the sequence sharded over mesh axis `axis_name`; call it
    inside `jax.shard_map` (or any context where `axis_name` is bound).

    q, k, v and the gate are this device's contiguous shard `[B, S/P, H, D]` of the
    tile-ordered sequence (S/P a multiple of the block's token count; q and k may have
    different lengths). The counts describe the whole sequence (replicated). H must be
    divisible by P. Returns this device's shard `[B, S/P, H, D]` of the output.
    Differentiable in q, k, v and the gate (the all-to-all's transpose is the reverse one).
    `prefix_blocks` (a static int) / `prefix_mode`: mixed-modality prefix blocks at the start
    of the whole sequence, as in `video_sparse_attn` (Sq == Skv; the prefix may span several
    devices' shards). After the exchange each device holds whole sequences of its heads, so
    the selection is the one-device selection.
    `softmax_scale` as in `video_sparse_attn` (one scale for the coarse and the fine branch).
    `padding` as in `video_sparse_attn`.
    """
    statics = dict(prefix_blocks=prefix_blocks, prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding)
    call = prepare_ulysses(JAX, q, k, v, compress_attn_weight, variable_block_sizes, q_variable_block_sizes,
                           group_size=jax.lax.axis_size(axis_name), block_size=block_size, topk=topk, **statics)
    if call is None:
        return video_sparse_attn_bshd(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                                      compress_attn_weight, backend=backend, **statics)
    # chunks of heads, each exchanged and computed on its own, so that XLA can overlap one
    # chunk's all-to-all with another's VSA
    outs = []
    for heads in call.chunks:
        qh, kh, vh = (_sequence_to_heads(x, axis_name, heads) for x in (q, k, v))
        gh = None if compress_attn_weight is None else _sequence_to_heads(compress_attn_weight, axis_name, heads)
        out = video_sparse_attn_bshd(qh, kh, vh, call.kv_counts, call.q_counts, topk, block_size, gh,
                                     backend=backend, **statics)
        outs.append(_heads_to_sequence(out, axis_name))
    B, s, H, D = q.shape
    return jnp.concatenate(outs, axis=3).reshape(B, s, H, D)


def _place(x, mesh: Mesh, spec: P):
    """x laid out as `spec` on `mesh`, eagerly or under jit: jax.reshard for Explicit mesh
    axes, a sharding constraint for Auto ones (each refuses the other kind); otherwise
    (mixed axis types) left to shard_map."""
    kinds = {mesh.axis_types[mesh.axis_names.index(a)] for a in spec if a is not None}
    if kinds <= {AxisType.Explicit}:
        return jax.reshard(x, NamedSharding(mesh, spec))
    if kinds == {AxisType.Auto}:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return x


def ulysses_video_sparse_attn_on_mesh(q: jax.Array, k: jax.Array, v: jax.Array, variable_block_sizes,
                                      q_variable_block_sizes, topk: int, block_size=64,
                                      compress_attn_weight: Optional[jax.Array] = None, *, mesh: Mesh,
                                      axis_name: str, batch_axis_name: Optional[str] = None,
                                      backend: str = "auto", prefix_blocks: int = 0,
                                      prefix_mode: str = "exempt", softmax_scale: Optional[float] = None,
                                      padding: str = "zeros") -> jax.Array:
    """`video_sparse_attn_bshd` on global `[B, S, H, D]` arrays, run sequence-parallel over
    mesh axis `axis_name` (the sequence split into equal contiguous shards along it, e.g.
    arrays placed with `NamedSharding(mesh, P(None, axis_name))`; others are resharded).
    `batch_axis_name`: a mesh axis that also splits the batch (data parallelism), or None;
    `padding` as in `video_sparse_attn`.
    Returns the global output, sharded like the inputs. Works eagerly, under jax.jit and
    jax.grad; a thin wrapper of `jax.shard_map` over `ulysses_video_sparse_attn`.
    `prefix_blocks` / `prefix_mode` / `softmax_scale`: as in `ulysses_video_sparse_attn`."""
    kv_counts, q_counts = prepare_on_mesh(JAX, q, k, v, compress_attn_weight, variable_block_sizes,
                                          q_variable_block_sizes, mesh_shape=mesh.shape, axis_name=axis_name,
                                          batch_axis_name=batch_axis_name, block_size=block_size)
    tokens, replicated = P(batch_axis_name, axis_name), P()
    attend = functools.partial(ulysses_video_sparse_attn, topk=topk, block_size=block_size, axis_name=axis_name,
                               backend=backend, prefix_blocks=prefix_blocks, prefix_mode=prefix_mode,
                               softmax_scale=softmax_scale, padding=padding)

    def run(q, k, v, kv_counts, q_counts, gate=None):
        return attend(q, k, v, kv_counts, q_counts, compress_attn_weight=gate)
    gate = () if compress_attn_weight is None else (compress_attn_weight,)
    args = (q, k, v, kv_counts, q_counts) + gate
    specs = (tokens,) * 3 + (replicated,) * 2 + (tokens,) * len(gate)
    placed = (_place(jnp.asarray(x), mesh, spec) for x, spec in zip(args, specs))
    return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=tokens)(*placed)
