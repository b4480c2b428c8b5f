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

from dataclasses import dataclass
from typing import Optional, Tuple

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

Axes = Tuple[str, ...]  # the mesh axes one array dimension is split over, major to minor


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


@dataclass(frozen=True)
class Split:
    """How a call is split: q's batch and heads axes over these mesh axes."""

    mesh: object
    batch: Axes
    heads: Axes

    def spec(self, kind: str, ndim: int) -> P:
        """The PartitionSpec of an argument or result. kind: "bhsd" / "bshd" (token arrays
        in that layout), "bh" (batch and heads leading: selections, lse), "replicated"."""
        if kind == "replicated":
            return P()
        heads_dim = 2 if kind == "bshd" else 1
        entries = [None] * ndim
        entries[0], entries[heads_dim] = _entry(self.batch), _entry(self.heads)
        return P(*entries)

    @property
    def axis_names(self) -> frozenset:
        return frozenset(self.batch + self.heads)


def _size(mesh, axes: Axes) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def plan_split(layout: str, block_elems: int, arrays: dict) -> Optional[Split]:
    """The split of a call, from its arrays' visible shardings; None when nothing is split.

    arrays: name -> (array or None, kind) with kind as in `Split.spec`; "q" is the model.
    Raises ValueError (naming the argument) for a sharding the op cannot partition along."""
    q = arrays["q"][0]
    found = visible_sharding(q)
    if found is None:
        others = [n for n, (x, _) in arrays.items() if x is not None and visible_sharding(x) is not None]
        if others:
            raise ValueError(f"{others[0]} is split over devices but q is not: shard q, k, v (and the gate) "
                             "alike over the batch and/or heads axes")
        return None
    mesh, dims = found
    heads_dim = 2 if layout == "bshd" else 1
    split = Split(mesh, dims[0], dims[heads_dim])
    for name, (x, kind) in arrays.items():
        if x is None:
            continue
        got = visible_sharding(x)
        x_dims = got[1] if got is not None else ((),) * x.ndim
        if got is not None and got[0] != mesh:
            raise ValueError(f"{name} is sharded over another mesh than q ({got[0]} vs {mesh})")
        want = tuple(_axes(e) for e in split.spec(kind, x.ndim)) + ((),) * x.ndim
        for dim, (have, need) in enumerate(zip(x_dims, want)):
            if have == need:
                continue
            what = _dim_name(kind, dim)
            if kind in ("bhsd", "bshd") and what == "sequence":
                local = x.shape[dim] // _size(mesh, have)
                splits = f", which splits the {block_elems}-token blocks" if local % block_elems else ""
                raise ValueError(
                    f"{name} is sharded along its sequence axis ({_over(have)}, {local} tokens per shard"
                    f"{splits}): "
                    "video sparse attention partitions over batch and heads only (a query block may select "
                    "any KV block); replicate the sequence axis (jax.sharding.reshard) or use sequence "
                    "parallelism (all-to-all to a heads split)")
            if kind == "replicated":
                raise ValueError(f"{name} must be replicated over the devices, got its axis {dim} split over "
                                 f"{_over(have)}")
            if name == "q":
                raise ValueError(f"q may be split over its batch and heads axes only, got its {what} axis over "
                                 f"{_over(have)}")
            raise ValueError(f"{name} must be split like q (batch over {_over(split.batch)}, heads over "
                             f"{_over(split.heads)}, nothing else split), got its {what} axis over {_over(have)}")
    for what, axes, size in (("batch", split.batch, q.shape[0]), ("heads", split.heads, q.shape[heads_dim])):
        n = _size(mesh, axes)
        if size % n:
            raise ValueError(f"q's {what} axis ({size}) must be divisible by the number of devices it is split "
                             f"over ({n}, mesh axes {axes})")
    return split


def _over(axes: Axes) -> str:
    return f"mesh axes {axes}" if axes else "no mesh axis"


def _dim_name(kind: str, dim: int) -> str:
    if kind == "bhsd":
        return ("batch", "heads", "sequence", "head dim")[dim]
    if kind == "bshd":
        return ("batch", "sequence", "heads", "head dim")[dim]
    return ("batch", "heads")[dim] if dim < 2 else f"axis {dim}"


def run_split(fn, split: Split, args: tuple, kinds: tuple, out_kinds):
    """fn(*args) inside a shard_map of `split` (None args pass through, unsplit).

    out_kinds: the kind of fn's result, or a tuple of kinds for a tuple of results."""
    present = [i for i, x in enumerate(args) if x is not None]

    def local(*xs):
        full = list(args)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full)

    in_specs = tuple(split.spec(kinds[i], args[i].ndim) for i in present)
    # results have the ranks of their kinds: token arrays 4, "bh" arrays 3 (lse)
    rank = {"bhsd": 4, "bshd": 4, "bh": 3, "replicated": 0}
    if isinstance(out_kinds, tuple):
        out_specs = tuple(split.spec(k, rank[k]) for k in out_kinds)
    else:
        out_specs = split.spec(out_kinds, rank[out_kinds])
    return jax.shard_map(local, mesh=split.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=split.axis_names)(*(args[i] for i in present))
