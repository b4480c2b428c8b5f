"""What a frontend does with a call, written once over a small adapter.

`vsa_call` / `block_sparse_call` are the whole of a public function: the argument checks
(`vsa_core.api`), the value checks and coercions below, and the frontend's operator
(`FrontendAdapter.attend`).

The value checks of `vsa_core.problem` read host values; the coercions give the operator
int32 arrays on q's device. Both frontends need the same rules (which values are checked
when, what is cached, which argument an error names), and only the adapter knows its array
type: whether a value is concrete (not a tracer, not under torch.compile), how to read it on
the host, whether it can change without a new object (the cache's version token), and how to
make an int32 array on q's device.

Value checks read the host. A concrete array already checked and not changed since (the same
object with the same version token) is not read again, so steady-state eager calls do not
synchronise; an array the adapter gives no token (host memory that can change in place, e.g.
numpy or a torch tensor aliasing it) is checked on every call.
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, Optional

import numpy as np

from .api import prepare_block_sparse, prepare_vsa
from .problem import (AttnProblem, check_count_values, check_index_values, check_offsets, check_prefix_values,
                      check_varlen_selection)
from .runtime import DeviceInfo

_CACHE_LIMIT = 256


class FrontendAdapter:
    """One frontend's array type and operator, as the checks, coercions and calls below need them."""

    array_types: tuple = ()  # what the public functions take as arrays, named as `array_kind`
    array_kind = "an array"
    offsets_are_arrays = False  # whether the packed calls' offsets must be array_types too (not lists)

    def __init__(self):
        self._checked: dict = {}
        self._problems: dict = {}  # call_key -> the problem its checks gave (`known_problem`)

    def require(self, **arrays) -> None:
        """TypeError naming the first argument that is not one of the frontend's arrays (None: absent)."""
        for name, x in arrays.items():
            if x is not None and not isinstance(x, self.array_types):
                raise TypeError(f"{name} must be {self.array_kind}, got {type(x).__name__}")

    # ---- what a frontend implements -------------------------------------------------------
    def counts_array(self, name: str, counts):
        """Counts as the problem's shape and dtype checks read them (TypeError naming `name`
        for what cannot be counts)."""
        raise NotImplementedError

    def concrete(self, *xs) -> bool:
        """Whether the values of xs can be read on the host now (not traced)."""
        raise NotImplementedError

    def host(self, x) -> np.ndarray:
        raise NotImplementedError

    def version(self, x) -> Optional[Hashable]:
        """A token that changes whenever x's values can have changed; None: no such token
        (x is checked on every call)."""
        raise NotImplementedError

    def as_array(self, x):
        """A list or numpy array as the frontend's own array (its arrays as they are)."""
        raise NotImplementedError

    def is_integer(self, x) -> bool:
        raise NotImplementedError

    def int32(self, x, like):
        """x as a contiguous int32 array on like's device."""
        raise NotImplementedError

    def device_info(self, x) -> DeviceInfo:
        raise NotImplementedError

    def operands(self, packed: bool, **arrays) -> dict:
        """The arrays as the operator takes them (None kept); packed: [total, ...] as a batch
        of one, [1, total, ...]."""
        raise NotImplementedError

    def attend(self, p: AttnProblem, backend: str, named: dict) -> tuple:
        """(out, lse) of the frontend's operator on the inputs of a checked call (named as
        `vsa_core.spec.forward_inputs` says), `backend` resolved on q's device; lse is not
        differentiable."""
        raise NotImplementedError

    def call_key(self, statics: tuple, *arrays) -> Optional[Hashable]:
        """A key of everything the argument checks and the problem of a call read (the
        arrays' types, shapes, strides, dtypes and devices, the static arguments), or None
        where a call cannot be memoized (traced arrays, host lists). By default None: JAX
        checks once per trace anyway."""
        return None

    def check_devices(self, like, **arrays) -> None:
        """Raises for an array on another device than q (`like`), naming it. By default none
        can be: JAX places the operands itself."""

    def count_values(self, x) -> np.ndarray:
        """What `check_count_values` reads of counts: by default the values themselves."""
        return self.host(x)

    def counts_readable(self, name: str, counts, like) -> bool:
        """Whether counts' values are checked in this call (a frontend may refuse the call)."""
        return self.concrete(counts)

    def index_lists_valid(self, block_indices, block_counts, n_kv_blocks: int) -> Optional[bool]:
        """True when the lists are known valid without a host read of them (None: not known;
        False: invalid, the host check then finds the first offender for the message)."""
        return None

    # ---- the check-once cache ---------------------------------------------------------------
    def check_once(self, arrays: tuple, what: Hashable, check: Callable[[], None]) -> None:
        tokens = tuple(self.version(x) for x in arrays)
        cacheable = None not in tokens
        key = (tuple(id(x) for x in arrays), what)
        if cacheable:
            seen = self._checked.get(key)
            if seen is not None and seen[1] == tokens and all(r() is x for r, x in zip(seen[0], arrays)):
                return
        check()
        if cacheable:
            if len(self._checked) > _CACHE_LIMIT:
                self._checked.clear()
            self._checked[key] = (tuple(weakref.ref(x) for x in arrays), tokens)


    def known_problem(self, key: Optional[Hashable]) -> Optional[AttnProblem]:
        """The problem a call with the same `call_key` was checked to have (None: not known),
        so a repeated call skips the argument checks: they read nothing the key leaves out."""
        return None if key is None else self._problems.get(key)

    def remember_problem(self, key: Optional[Hashable], p: AttnProblem) -> None:
        if key is not None:
            if len(self._problems) > _CACHE_LIMIT:
                self._problems.clear()
            self._problems[key] = p


# ---- the checks and coercions, once for both frontends ---------------------------------------
def as_counts(fe: FrontendAdapter, name: str, counts, like, block_elems: int):
    """Per-block token counts -> int32 on q's device; the values ([0, E]) checked where they
    are known (traced counts are clamped to [0, E] by the kernels)."""
    counts = fe.as_array(counts)
    if not fe.is_integer(counts):
        raise TypeError(f"{name} must be an integer array, got dtype {counts.dtype}")
    if fe.counts_readable(name, counts, like):
        fe.check_once((counts,), (name, block_elems),
                      lambda: check_count_values(name, fe.count_values(counts), block_elems))
    return fe.int32(counts, like)


def check_index_lists(fe: FrontendAdapter, block_indices, block_counts, n_kv_blocks: int) -> None:
    """ValueError naming block_indices / block_counts for bad values, where they are known;
    traced lists are bounded by the kernels instead (see vsa_core.stage_kernels)."""
    if not fe.concrete(block_indices, block_counts):
        return

    def check():
        if not fe.index_lists_valid(block_indices, block_counts, n_kv_blocks):
            check_index_values(fe.host(block_indices), fe.host(block_counts), n_kv_blocks)
    fe.check_once((block_indices, block_counts), n_kv_blocks, check)


def as_offsets(fe: FrontendAdapter, name: str, cu, like, total: int, block_elems: int):
    """Packed offsets as int32 on q's device (dtype and shape checked by describe_varlen); the
    values checked where they are known. Traced offsets are read on the device only: one
    compiled call then serves every packing of the same totals."""
    if fe.concrete(cu):
        fe.check_once((cu,), (name, total, block_elems), lambda: check_offsets(name, fe.host(cu), total, block_elems))
    return fe.int32(cu, like)


def as_prefix(fe: FrontendAdapter, p: AttnProblem, prefix_blocks, like, cu_q, cu_k):
    """Packed calls: per-sequence prefix counts (p.seq_prefix; the problem checked their shape
    and dtype) as int32 on q's device, None for an int (static in the problem). Their values
    (an int's too) are checked against the offsets where all are known."""
    if not p.has_prefix:
        return None
    counts = fe.as_array(prefix_blocks) if p.seq_prefix else None
    given = (cu_q, cu_k) + ((counts,) if p.seq_prefix else ())
    if fe.concrete(*given):
        fe.check_once(given, ("prefix_blocks", p.prefix_blocks, p.block_elems),
                      lambda: check_prefix_values(fe.host(counts) if p.seq_prefix else p.prefix_blocks,
                                                  fe.host(cu_q), fe.host(cu_k), p.block_elems))
    return fe.int32(counts, like) if p.seq_prefix else None


def check_selection(fe: FrontendAdapter, p: AttnProblem, cu_q, cu_k, block_map=None, block_indices=None,
                    block_counts=None) -> None:
    """A packed selection may list only blocks of each query block's own sequence: checked
    where everything is known; traced, the kernels ignore the other entries."""
    given = tuple(x for x in (cu_q, cu_k, block_map, block_indices, block_counts) if x is not None)
    if not fe.concrete(*given):
        return

    def host(x):
        return None if x is None else fe.host(x)
    fe.check_once(given, ("selection", p),
                  lambda: check_varlen_selection(p, host(cu_q), host(cu_k), host(block_map), host(block_indices),
                                                 host(block_counts)))


def device_info(platform: str, index: Optional[int] = 0, capability=None) -> DeviceInfo:
    """DeviceInfo from a frontend's device facts: the platform ("cuda", or JAX's "gpu"), the
    CUDA ordinal and the compute capability (a (major, minor) pair or JAX's "9.0")."""
    if platform not in ("gpu", "cuda"):
        return DeviceInfo(platform)
    if capability and not isinstance(capability, (tuple, list)):
        capability = str(capability).split(".")[:2]
    return DeviceInfo("cuda", index or 0, tuple(int(c) for c in capability) if capability else None)



# ---- a checked call's operator inputs ----------------------------------------------------------
def vsa_inputs(fe: FrontendAdapter, p: AttnProblem, q, k, v, kv_counts, q_counts, gate=None, *, cu_seqlens_q=None,
               cu_seqlens_k=None, prefix_blocks=0) -> dict:
    """The operator's inputs (named as `vsa_core.spec.forward_inputs`) of a VSA call that
    `vsa_core.api.prepare_vsa` checked: the values checked, the integer arrays coerced."""
    fe.check_devices(q, k=k, v=v, compress_attn_weight=gate)
    named = dict(kv_counts=as_counts(fe, "variable_block_sizes", kv_counts, q, p.block_elems),
                 q_counts=as_counts(fe, "q_variable_block_sizes", q_counts, q, p.block_elems))
    if p.varlen:
        named.update(_packed_offsets(fe, p, q, cu_seqlens_q, cu_seqlens_k),
                     seq_prefix=as_prefix(fe, p, prefix_blocks, q, cu_seqlens_q, cu_seqlens_k))
    return {**fe.operands(p.varlen, q=q, k=k, v=v, gate=gate), **named}


def block_sparse_inputs(fe: FrontendAdapter, p: AttnProblem, q, k, v, kv_counts, *, block_map=None,
                        block_indices=None, block_counts=None, cu_seqlens_q=None, cu_seqlens_k=None) -> dict:
    """The operator's inputs of a block-sparse call that `vsa_core.api.prepare_block_sparse`
    checked (the selection a map or index lists)."""
    fe.check_devices(q, k=k, v=v, block_map=block_map, block_indices=block_indices, block_counts=block_counts)
    if block_indices is not None and not p.varlen:
        check_index_lists(fe, block_indices, block_counts, p.n_kv_blocks)
    named = dict(kv_counts=as_counts(fe, "variable_block_sizes", kv_counts, q, p.block_elems))
    if p.varlen:
        named.update(_packed_offsets(fe, p, q, cu_seqlens_q, cu_seqlens_k))
        check_selection(fe, p, cu_seqlens_q, cu_seqlens_k, block_map=block_map, block_indices=block_indices,
                        block_counts=block_counts)
    selection = (dict(block_map=block_map) if block_map is not None
                 else dict(given_idx=block_indices, given_num=block_counts))
    return {**fe.operands(p.varlen, q=q, k=k, v=v, **selection), **named}


def _packed_offsets(fe: FrontendAdapter, p: AttnProblem, q, cu_seqlens_q, cu_seqlens_k) -> dict:
    return dict(cu_seqlens_q=as_offsets(fe, "cu_seqlens_q", cu_seqlens_q, q, p.q_len, p.block_elems),
                cu_seqlens_k=as_offsets(fe, "cu_seqlens_k", cu_seqlens_k, q, p.kv_len, p.block_elems))


# ---- a public function's call, once for both frontends ------------------------------------------
def vsa_call(fe: FrontendAdapter, q, k, v, kv_counts, q_counts, topk, block_size, gate=None, *, layout: str = "bhsd",
             backend: str = "auto", cu_seqlens_q=None, cu_seqlens_k=None, prefix_blocks=0,
             prefix_mode: str = "exempt", softmax_scale=None, padding: str = "zeros"):
    """out of a `video_sparse_attn*` call (packed when the offsets are given): the arguments
    checked, the integer arrays coerced, the frontend's operator run."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    key = fe.call_key(("vsa", topk, block_size, layout, backend, prefix_blocks, prefix_mode, softmax_scale, padding),
                      q, k, v, gate, kv_counts, q_counts, cu_seqlens_q, cu_seqlens_k)
    p = fe.known_problem(key)
    if p is None:
        fe.require(q=q, k=k, v=v, compress_attn_weight=gate, **_typed_offsets(fe, cu_seqlens_q, cu_seqlens_k))
    if not packed:
        kv_counts = fe.counts_array("variable_block_sizes", kv_counts)
        q_counts = fe.counts_array("q_variable_block_sizes", q_counts)
    elif isinstance(prefix_blocks, (list, tuple)):
        prefix_blocks = fe.as_array(prefix_blocks)
    if p is None:
        p = prepare_vsa(q, k, v, kv_counts, q_counts, topk, block_size, gate, layout=layout, backend=backend,
                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, prefix_blocks=prefix_blocks,
                        prefix_mode=prefix_mode, softmax_scale=softmax_scale, padding=padding).problem
        fe.remember_problem(key, p)
    named = vsa_inputs(fe, p, q, k, v, kv_counts, q_counts, gate, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, prefix_blocks=prefix_blocks)
    out, _ = fe.attend(p, backend, named)
    return out[0] if p.varlen else out


def block_sparse_call(fe: FrontendAdapter, q, k, v, kv_counts, block_size, *, block_map=None, block_indices=None,
                      block_counts=None, layout: str = "bhsd", backend: str = "auto", cu_seqlens_q=None,
                      cu_seqlens_k=None, softmax_scale=None, padding: str = "zeros"):
    """(out, lse) of a `block_sparse_attn*` call, the selection a map or index lists (packed
    when the offsets are given)."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    selection = (dict(block_map=block_map) if block_map is not None
                 else dict(block_indices=block_indices, block_counts=block_counts))
    key = fe.call_key(("block_sparse", block_size, layout, backend, softmax_scale, padding), q, k, v, kv_counts,
                      block_map, block_indices, block_counts, cu_seqlens_q, cu_seqlens_k)
    p = fe.known_problem(key)
    if p is None:
        fe.require(q=q, k=k, v=v, **selection, **_typed_offsets(fe, cu_seqlens_q, cu_seqlens_k))
    if not packed:
        kv_counts = fe.counts_array("variable_block_sizes", kv_counts)
    if p is None:
        p = prepare_block_sparse(q, k, v, kv_counts, block_size, layout=layout, backend=backend,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softmax_scale=softmax_scale,
                                 padding=padding, **selection).problem
        fe.remember_problem(key, p)
    named = block_sparse_inputs(fe, p, q, k, v, kv_counts, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                **selection)
    out, lse = fe.attend(p, backend, named)
    return (out[0], lse[0]) if p.varlen else (out, lse)


def _typed_offsets(fe: FrontendAdapter, cu_seqlens_q, cu_seqlens_k) -> dict:
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k) if fe.offsets_are_arrays else {}


def packed_list_offsets(block_indices_list, block_counts_list, kv_blocks_per_sequence) -> list:
    """`pack_block_indices`: each sequence's first KV block in the packed stream, the three
    lists checked to have one entry per sequence."""
    if not (len(block_indices_list) == len(block_counts_list) == len(kv_blocks_per_sequence)):
        raise ValueError("block_indices_list, block_counts_list and kv_blocks_per_sequence must have one entry per "
                         f"sequence, got {len(block_indices_list)}, {len(block_counts_list)}, "
                         f"{len(kv_blocks_per_sequence)}")
    offsets = [0]
    for n in kv_blocks_per_sequence[:-1]:
        offsets.append(offsets[-1] + int(n))
    return offsets
