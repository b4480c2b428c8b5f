"""Splitting a call over the devices its arrays are sharded across, along batch and heads.

Attention is independent per batch element and per head, so a call on arrays split over
the batch and/or heads axes runs as one local call per device on its own slice. Given how
each array's dimensions are split over the axes of a device mesh (the frontend reads that
from its arrays: `vsa_jax.spmd`), `plan_split` decides the split of the call, q's, or
raises a ValueError naming the argument whose sharding the op cannot partition along.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

Axes = Tuple[str, ...]  # the mesh axes one array dimension is split over, major to minor


@dataclass(frozen=True)
class Split:
    """How a call is split: q's batch and heads axes over these mesh axes."""

    mesh: object  # the frontend's mesh; `mesh.shape[axis]` is an axis' size
    batch: Axes
    heads: Axes

    def dims(self, kind: str, ndim: int) -> Tuple[Axes, ...]:
        """The mesh axes of each dimension of an argument or result. kind: "bhsd" / "bshd"
        (token arrays in that layout), "bh" (batch and heads leading: selections, lse),
        "replicated"."""
        dims = [()] * ndim
        if kind != "replicated":
            dims[0], dims[2 if kind == "bshd" else 1] = self.batch, self.heads
        return tuple(dims)

    @property
    def axis_names(self) -> frozenset:
        return frozenset(self.batch + self.heads)


def _size(mesh, axes: Axes) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def plan_split(layout: str, block_elems: int, arrays: dict) -> Optional[Split]:
    """The split of a call; None when nothing is split.

    arrays: name -> (shape, kind, sharding) or None for an absent argument; kind as in
    `Split.dims`, sharding (mesh, per-dimension axes) or None (not split); "q" is the model."""
    q_shape, _, found = arrays["q"]
    if found is None:
        others = [n for n, a in arrays.items() if a is not None and a[2] is not None]
        if others:
            raise ValueError(f"{others[0]} is split over devices but q is not: shard q, k, v (and the gate) "
                             "alike over the batch and/or heads axes")
        return None
    mesh, dims = found
    heads_dim = 2 if layout == "bshd" else 1
    split = Split(mesh, dims[0], dims[heads_dim])
    for name, given in arrays.items():
        if given is None:
            continue
        shape, kind, got = given
        ndim = len(shape)
        x_dims = got[1] if got is not None else ((),) * ndim
        if got is not None and got[0] != mesh:
            raise ValueError(f"{name} is sharded over another mesh than q ({got[0]} vs {mesh})")
        want = split.dims(kind, ndim)
        for dim, (have, need) in enumerate(zip(x_dims, want)):
            if have == need:
                continue
            what = _dim_name(kind, dim)
            if kind in ("bhsd", "bshd") and what == "sequence":
                local = shape[dim] // _size(mesh, have)
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
    for what, axes, size in (("batch", split.batch, q_shape[0]), ("heads", split.heads, q_shape[heads_dim])):
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
