"""Partitioning a call over the devices its arrays are sharded across.

Attention is independent per batch element and per head, so a call on arrays split over
the batch and/or heads axes runs as one local call per device on its own slice, with no
communication. With explicit sharding (`jax.make_mesh`'s default axis type) the split
is part of each array's type (`jax.typeof(q).sharding`), under `jax.jit` and eagerly
alike, so the frontend wraps the op in a `jax.shard_map` over exactly the mesh axes that
split q's batch and heads axes.

Inside, each device sees local shapes; the shard_map is differentiable (the op's
custom_vjp runs per device, see `ops._vary_alike` for the typing of its results) and
the kernels are the same as on one device, so the result equals the one-device call
bit for bit.

Why a shard_map and not a `custom_partitioning` rule: the shard_map is decided at trace
time from the arrays' types, so a sharding the op cannot honour (a split sequence or
head dim, k sharded unlike q) raises a ValueError naming the argument at trace time
(a partition rule runs inside XLA's partitioner, at compile time); it composes with
jax.grad / vmap like any JAX code (custom_partitioning does not differentiate: the
forward and the backward stage would each need a rule); and it works with the
buffer_callback launch path, which custom_partitioning does not: the per-shard
computation a partition rule returns is lowered into a separate module, so the host
callback that buffer_callback registers with the module being lowered is lost
(jax 0.10 on CPU, 2 devices: the process segfaults when the partitioned callback runs).
What it cannot see: under jit with *auto* axes (`jax.sharding.Mesh`'s default) the
sharding is chosen after tracing by the partitioner, so such a call is not split here
(XLA gathers its inputs onto every device; the result is still correct); use an
explicit mesh (`jax.make_mesh`, `jax.set_mesh`) or `jax.shard_map` there. A native
launch path (a typed FFI custom call, no Python callback) could add a partition rule
for auto axes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vsa_core import device_split
from vsa_core.device_split import Axes, Split

def _axes(entry) -> Axes:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: Axes):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def visible_sharding(x) -> Optional[Tuple[object, tuple]]:
    """(mesh, per-dimension axes) of x when its type says how it is split over devices
    (explicit mesh axes), else None. Auto axes (decided after tracing) and manual axes
    (inside a shard_map, where x is already the local shard) are not listed."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
        dims = tuple(tuple(a for a in _axes(e) if a in explicit) for e in sharding.spec)
        if any(dims):
            return mesh, dims + ((),) * (x.ndim - len(dims))
    return None


def plan_split(layout: str, block_elems: int, arrays: dict) -> Optional[Split]:
    """The split of a call, from its arrays' visible shardings (`vsa_core.device_split.plan_split`);
    arrays: name -> (array or None, kind)."""
    return device_split.plan_split(layout, block_elems, {
        n: None if x is None else (tuple(x.shape), kind, visible_sharding(x)) for n, (x, kind) in arrays.items()})


def _spec(split: Split, kind: str, ndim: int) -> P:
    if kind == "replicated":
        return P()
    return P(*(_entry(axes) for axes in split.dims(kind, ndim)))


def run_split(fn, split: Split, args: tuple, kinds: tuple, out_kinds):
    """fn(*args) inside a shard_map of `split` (None args pass through, unsplit).

    out_kinds: the kind of fn's result, or a tuple of kinds for a tuple of results."""
    present = [i for i, x in enumerate(args) if x is not None]

    def local(*xs):
        full = list(args)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full)

    in_specs = tuple(_spec(split, kinds[i], args[i].ndim) for i in present)
    # results have the ranks of their kinds: token arrays 4, "bh" arrays 3 (lse)
    rank = {"bhsd": 4, "bshd": 4, "bh": 3, "replicated": 0}
    if isinstance(out_kinds, tuple):
        out_specs = tuple(_spec(split, k, rank[k]) for k in out_kinds)
    else:
        out_specs = _spec(split, out_kinds, rank[out_kinds])
    return jax.shard_map(local, mesh=split.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=split.axis_names)(*(args[i] for i in present))
