"""The op boundary, written once: what a frontend's operator takes, keeps and returns.

A call crosses into the core as two things: its arrays, named by the tables below, and
one `OpStatics`, the frozen, hashable record of everything static about the call (the
resolved backend and the clamped topk included). A frontend's operator is one function of
the two: a torch custom op takes the arrays as a tensor list and the statics encoded as a
string; a JAX custom_vjp takes them as a tuple and the statics as its one static argument.
Inside the operator the problem (`AttnProblem`, which also holds the shapes) is rebuilt from
the statics and the arrays' shapes (`op_problem`): under `vsa_jax.spmd` those are a
device's shard, not the caller's arrays.

The tables, per stage:
- `forward_inputs(statics)`: the forward's arrays, in the order the operator takes them
  (only those the call has: no None padding);
- `forward_results(p)`: what the forward returns, which is also what it keeps for the
  backward (`out` first; the stage's other buffers are workspaces the backward does not read);
- `backward_inputs(statics)`: the forward inputs the backward reads (then `dout` and the
  forward's results);
- `gradients(statics)`: each differentiable input with the name of its gradient buffer.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from .backends import fine_residual
from .problem import AttnProblem, dtype_name


@dataclass(frozen=True)
class OpStatics:
    """Everything static about one call: with the arrays' shapes and dtype it fixes the
    problem, and so the kernels, the buffer tables and the caches keyed on them."""

    selection: str       # "topk" (VSA), "block_map" or "indices" (AttnProblem.selection)
    layout: str          # "bhsd" or "bshd" (packed calls: "bshd", batch 1)
    block_elems: int     # E, tokens per block
    backend: str         # the resolved fine-stage backend's name (never "auto")
    softmax_scale: float  # resolved: 1/sqrt(D) when the caller passed None
    padding: str
    topk: Optional[int] = None  # VSA: clamped to the number of KV blocks
    has_gate: bool = False
    training: bool = True  # the forward keeps what the backward needs
    varlen: bool = False   # packed sequences: the offsets cu_seqlens_q / cu_seqlens_k are inputs
    list_capacity: Optional[int] = None
    prefix_blocks: int = 0
    prefix_mode: str = "exempt"
    seq_prefix: bool = False  # packed VSA: per-sequence prefix counts are an input

    @classmethod
    def of(cls, p: AttnProblem, backend: str, training: bool = True) -> "OpStatics":
        """The statics of a checked problem (`vsa_core.api.prepare_*`) run by `backend`."""
        return cls(selection=p.selection, layout=p.layout, block_elems=p.block_elems, backend=backend,
                   softmax_scale=p.softmax_scale, padding=p.padding, topk=p.topk, has_gate=p.has_gate,
                   training=training, varlen=p.varlen, list_capacity=p.list_capacity,
                   prefix_blocks=p.prefix_blocks, prefix_mode=p.prefix_mode, seq_prefix=p.seq_prefix)

    @property
    def is_vsa(self) -> bool:
        return self.selection == "topk"

    def encode(self) -> str:
        """The statics as a string (a torch custom op's argument); `decode` inverts it."""
        return _encode(self)

    @staticmethod
    def decode(text: str) -> "OpStatics":
        return _decode(text)


@functools.lru_cache(maxsize=1024)
def _encode(statics: OpStatics) -> str:
    return repr(dataclasses.astuple(statics))  # repr round-trips every field, floats included


@functools.lru_cache(maxsize=1024)
def _decode(text: str) -> OpStatics:
    return OpStatics(*ast.literal_eval(text))


# ---- the tables -----------------------------------------------------------------------------
# name of each differentiable input -> its gradient buffer (`AttnProblem.backward_buffers`)
GRADIENTS = {"q": "dq", "k": "dk", "v": "dv", "gate": "dgate"}
# the argument of the public functions that each input comes from (error messages name it)
PUBLIC_NAMES = {"q": "q", "k": "k", "v": "v", "kv_counts": "variable_block_sizes",
                "q_counts": "q_variable_block_sizes", "gate": "compress_attn_weight", "block_map": "block_map",
                "given_idx": "block_indices", "given_num": "block_counts", "cu_seqlens_q": "cu_seqlens_q",
                "cu_seqlens_k": "cu_seqlens_k", "seq_prefix": "prefix_blocks"}
# how each input's leading axes run, for splitting a call over devices along batch and heads:
# "tokens" (the layout's [B, H, S, D] / [B, S, H, D]), "bh" ([B, H, ...]: selections and lse),
# "blocks" (one entry per block, the same for every batch element and head)
AXES = {"q": "tokens", "k": "tokens", "v": "tokens", "gate": "tokens", "out": "tokens", "kv_counts": "blocks",
        "q_counts": "blocks", "block_map": "bh", "given_idx": "bh", "given_num": "bh", "lse": "bh"}
# buffers of the forward's table that it does not return: the top-k scores workspace
# ([B, H, nQ, nKV] fp32, the largest) and the packed blocks' sequence ids, which the
# backward recomputes (two tiny launches) rather than keeps
FORWARD_WORKSPACES = ("scores", "q_seq", "kv_seq")


@functools.lru_cache(maxsize=1024)
def forward_inputs(statics: OpStatics) -> Tuple[str, ...]:
    """The forward's input arrays, in operator order, as `vsa_core.ops.forward` names them."""
    names = ["q", "k", "v", "kv_counts"]
    if statics.is_vsa:
        names += ["q_counts"] + ["gate"] * statics.has_gate
    elif statics.selection == "block_map":
        names += ["block_map"]
    else:  # the caller's lists; the forward writes the lists it runs to sel_idx / sel_num
        names += ["given_idx", "given_num"]
    if statics.varlen:
        names += ["cu_seqlens_q", "cu_seqlens_k"]
    if statics.seq_prefix:
        names += ["seq_prefix"]
    return tuple(names)


@functools.lru_cache(maxsize=1024)
def backward_inputs(statics: OpStatics) -> Tuple[str, ...]:
    """The forward inputs the backward reads (the caller's index lists and the prefix counts
    are not: the forward's results and the statics carry what it needs of them)."""
    return tuple(n for n in forward_inputs(statics) if n not in ("given_idx", "given_num", "seq_prefix"))


@functools.lru_cache(maxsize=1024)
def forward_results(p: AttnProblem) -> Tuple[str, ...]:
    """What the forward returns and keeps for the backward: its buffer table without the
    workspaces; `out` first (the one differentiable result)."""
    return tuple(n for n in p.forward_buffers() if n not in FORWARD_WORKSPACES)


@functools.lru_cache(maxsize=1024)
def workspaces(stage: str, statics: OpStatics, p: AttnProblem) -> Tuple[str, ...]:
    """The buffers of a stage's table whose contents do not outlive it: the forward's
    FORWARD_WORKSPACES, the backward's buffers other than the gradients."""
    if stage == "forward":
        return tuple(n for n in p.forward_buffers() if n in FORWARD_WORKSPACES)
    grads = set(gradients(statics).values())
    return tuple(n for n in p.backward_buffers() if n not in grads)


def gradients(statics: OpStatics) -> Dict[str, str]:
    """Differentiable forward input -> its gradient buffer, in input order."""
    return {n: GRADIENTS[n] for n in forward_inputs(statics) if n in GRADIENTS}


def op_problem(statics: OpStatics, inputs: Mapping) -> AttnProblem:
    """The problem of an operator call whose arguments `vsa_core.api.prepare_*` checked:
    the statics with the shapes and dtype of the named inputs (q, k; the offsets' length
    for packed calls). Equal to the problem `prepare_*` returned for the same arrays (the
    caches keyed on problems rely on it); a cache hit per call, not a second check."""
    cu = inputs.get("cu_seqlens_q")
    n_seqs = 0 if cu is None else int(cu.shape[0]) - 1
    q, k = inputs["q"], inputs["k"]
    return _op_problem(statics, _ints(q.shape), _ints(k.shape), dtype_name(q.dtype), n_seqs)


def _ints(shape) -> Tuple[int, ...]:
    # under torch.compile a size may arrive symbolic (unhashable); the checks made it concrete already
    return tuple(int(s) for s in shape)


@functools.lru_cache(maxsize=1024)
def _op_problem(s: OpStatics, q_shape, k_shape, dtype: str, n_seqs: int) -> AttnProblem:
    if s.layout == "bhsd":
        batch, heads, q_len, head_dim = q_shape
        kv_len = k_shape[2]
    else:
        batch, q_len, heads, head_dim = q_shape
        kv_len = k_shape[1]
    return AttnProblem(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                       block_elems=s.block_elems, dtype=dtype, layout=s.layout, topk=s.topk, has_gate=s.has_gate,
                       selection=s.selection, training=s.training, n_seqs=n_seqs, list_capacity=s.list_capacity,
                       prefix_blocks=s.prefix_blocks, prefix_mode=s.prefix_mode, seq_prefix=s.seq_prefix,
                       softmax_scale=s.softmax_scale, padding=s.padding, fine_residual=fine_residual(s.backend))


# ---- an operator's arguments, named ---------------------------------------------------------------
def forward_arguments(statics: OpStatics, arrays) -> Tuple[AttnProblem, Dict]:
    """The problem and the named inputs of a forward on `arrays` (in `forward_inputs` order)."""
    named = dict(zip(forward_inputs(statics), arrays))
    return op_problem(statics, named), named


def backward_arguments(statics: OpStatics, kept, results, dout) -> Tuple[AttnProblem, Dict]:
    """The problem and the named inputs of a backward: `kept` in `backward_inputs` order, the
    forward's `results` in `forward_results` order, and dout."""
    named = dict(zip(backward_inputs(statics), kept))
    p = op_problem(statics, named)
    return p, {"dout": dout, **named, **dict(zip(forward_results(p), results))}


def input_gradients(statics: OpStatics, grads: Mapping) -> Tuple:
    """One entry per forward input: its gradient from the backward's buffers `grads`, None
    for an input that has none (the integer arrays)."""
    return tuple(grads[GRADIENTS[n]] if n in GRADIENTS else None for n in forward_inputs(statics))
