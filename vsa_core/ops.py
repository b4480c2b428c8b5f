"""The operators as sequences of launches on caller-provided buffers.

This is the single entry point both frontends call. Each function takes the
problem (from `vsa_core.api.prepare_*` / `vsa_core.spec.op_problem`), the resolved backend, a dict of buffers
(inputs, outputs and workspaces named as in `AttnProblem.forward_buffers` /
`backward_buffers`), the stream to launch on and the frontend's `BufferAdapter`
(`vsa_core.runtime`: how its buffers and stream reach the launchers; the default takes
torch tensors or `DeviceBuffer`s as they are), and the launcher every Triton launch goes
through (`vsa_core.launch`; `eager_launcher` by default, `vsa_core.plan` records with its
own). It allocates nothing, never synchronises, and writes every element of every output.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from . import stages as S
from .backends.base import FineBackward, FineForward
from .launch import Launcher, eager_launcher
from .problem import AttnProblem
from .runtime import RAW_BUFFERS, BufferAdapter


# (field name, required) of each contract, read once: this runs on every call
_FIELDS = {c: tuple((f.name, f.default is dataclasses.MISSING) for f in dataclasses.fields(c))
           for c in (FineForward, FineBackward)}


def _fine_args(contract, b: dict):
    """The backend's typed arguments (FineForward / FineBackward), built once from the buffers
    of the same names: a required buffer that is missing raises KeyError naming it; an
    optional one (None in the buffers, or absent) stays None."""
    return contract(*[b[name] if required else b.get(name) for name, required in _FIELDS[contract]])


def _sequence_ids(launcher: Launcher, p: AttnProblem, b: dict) -> None:
    """Packed sequences: the sequence id of every query and KV block, from the offsets
    cu_seqlens_q / cu_seqlens_k (device inputs, never read on the host)."""
    if p.varlen:
        S.block_seq_ids(launcher, p, b["cu_seqlens_q"], b["q_seq"], p.n_q_blocks)
        S.block_seq_ids(launcher, p, b["cu_seqlens_k"], b["kv_seq"], p.n_kv_blocks)


def forward(p: AttnProblem, backend, buffers: Mapping, stream: Optional[int] = None,
            adapter: BufferAdapter = RAW_BUFFERS, launcher: Launcher = eager_launcher) -> None:
    """VSA (p.selection == "topk") or block-sparse attention forward.

    Inputs: q, k, v, kv_counts, and q_counts (+ gate; + seq_prefix when p.seq_prefix) for VSA, block_map or
    given_idx/given_num (the caller's lists) for the block-sparse variants; packed
    sequences (p.varlen) also cu_seqlens_q/cu_seqlens_k. Given lists are not trusted:
    the forward writes the lists it runs to sel_idx/sel_num (the entries that count by
    the rule of `vsa_core.reference.index_lists_to_block_map`, packed: of each query's
    own sequence only), so every backend, cuDNN's included, reads clean lists, and the
    backward takes those. Outputs: p.forward_buffers().
    """
    b = adapter.views(buffers)
    with adapter.launch_scope(b["q"], stream):
        _sequence_ids(launcher, p, b)
        if p.is_vsa:
            S.block_mean_pool_qkv(launcher, p, b["q"], b["k"], b["v"], b["q_counts"], b["kv_counts"], b["q_pool"],
                                  b["k_pool"], b["v_pool"])
            S.coarse_forward(launcher, p, b["q_pool"], b["k_pool"], b["v_pool"], b["kv_counts"], b["scores"],
                             b["out_coarse"], b["lse_coarse"], q_seq=b.get("q_seq"), kv_seq=b.get("kv_seq"))
            S.topk_select(launcher, p, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"], q_seq=b.get("q_seq"),
                          cu_seqlens_q=b.get("cu_seqlens_q"), cu_seqlens_k=b.get("cu_seqlens_k"),
                          seq_prefix=b.get("seq_prefix"), scores_rounded_to=p.dtype)
        elif p.selection == "block_map":
            S.rows_to_lists(launcher, p, b["block_map"], b["sel_idx"], b["sel_num"], b.get("q_seq"), b.get("kv_seq"))
        else:  # given lists: the entries that count by the rule (packed: of the query's own sequence)
            S.clean_lists(launcher, p, b["given_idx"], b["given_num"], b["sel_idx"], b["sel_num"], b.get("q_seq"),
                          b.get("kv_seq"))
        backend.sparse_forward(launcher, p, _fine_args(FineForward, b))


def backward(p: AttnProblem, backend, buffers: Mapping, stream: Optional[int] = None,
             adapter: BufferAdapter = RAW_BUFFERS, launcher: Launcher = eager_launcher) -> None:
    """Gradients of `forward`. Inputs: the forward's inputs and outputs plus dout.
    Outputs: p.backward_buffers() (dq, dk, dv, dgate with a gate; the rest are workspaces)."""
    b = adapter.views(buffers)
    with adapter.launch_scope(b["q"], stream):
        if p.is_vsa:
            _sequence_ids(launcher, p, b)
            block_mask = b["sel_mask"]
        elif p.selection == "block_map" and not p.varlen:
            block_mask = b["block_map"]
        else:
            block_mask = b["sel_mask"]
            S.lists_to_mask(launcher, p, b["sel_idx"], b["sel_num"], block_mask)
        S.columns_to_lists(launcher, p, block_mask, b["inv_idx"], b["inv_num"])
        S.backward_preprocess(launcher, p, b["out_fine"] if p.is_vsa else b["out"], b["dout"], b["delta"],
                              gate=b.get("gate"), out_coarse=b.get("out_coarse"), dgate=b.get("dgate"),
                              dout_coarse=b.get("dout_coarse"), q_counts=b.get("q_counts"), out=b["out"])
        if p.is_vsa:
            S.coarse_backward(launcher, p, b["q_pool"], b["k_pool"], b["v_pool"], b["kv_counts"], b["out_coarse"],
                              b["lse_coarse"], b["dout_coarse"], b["dq_pool"], b["dk_pool"], b["dv_pool"],
                              b["p_coarse"], b["ds_coarse"],
                              q_seq=b.get("q_seq"), kv_seq=b.get("kv_seq"))
        backend.sparse_backward(launcher, p, _fine_args(FineBackward, b))
