"""One tile config per (kernel, problem), shared by every caller in the process.

`TILES` holds the tile config each attention kernel of the Triton backend runs for a
problem key. The key is built from plain values only (`tile_key`: the dtype as its
canonical name, "bfloat16", never a framework's dtype object), so a torch call and a JAX
call of the same problem read the same entry: the first call to reach a key times the
candidates (on a GPU, with autotuning on) and every later call, from either frontend, runs
the config it chose. Triton's own `@triton.autotune` keys on the arguments' `str(dtype)`
("torch.bfloat16" for torch, "bfloat16" for a DeviceBuffer): each frontend then timed and
chose on its own and the two could run different tiles, so bitwise different results.

Without timing (autotune off, no GPU, the interpreter) the caller runs the first candidate,
the default, without asking the store. A launcher that runs nothing (a recorded launch plan,
`vsa_core.plan`) reads the store's choice, or takes the default and reports the key untuned.
"""

from __future__ import annotations

import numbers
import threading
from typing import Callable, Dict, Sequence, Tuple

import numpy as np

from .problem import dtype_name

Tile = Tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
Key = Tuple

def _plain(name: str, value):
    """value as a Python bool, int, float, str or None (numpy scalars included), else TypeError."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"tile_key: {name} must be a plain value (int, bool, float, str, None), got {type(value).__name__}")


def tile_key(kernel_name: str, dtype, **values) -> Key:
    """(kernel name, dtype name, (name, value), ...) in name order: the same for the same
    problem from any frontend. `dtype` may be a framework dtype or its name; the values
    must be plain values (Python or numpy scalars; TypeError otherwise, naming it)."""
    dtype = getattr(dtype, "dtype", dtype)  # a scalar type (jnp.bfloat16) names its dtype
    return (kernel_name, dtype_name(dtype)) + tuple(sorted((n, _plain(n, v)) for n, v in values.items()))


class TileStore:
    """The chosen tile config of each key (see the module doc)."""

    def __init__(self):
        self._chosen: Dict[Key, Tile] = {}
        # held while a key is timed: two threads (XLA runs each device's buffer callback on its
        # own) must not time the same key at once and choose differently
        self._lock = threading.Lock()

    def chosen(self, key: Key):
        """The tile config chosen for `key`, or None when none was timed yet."""
        return self._chosen.get(key)

    def choose(self, key: Key, candidates: Sequence[Tile], time: Callable[[Tile], float]) -> Tile:
        """The config of `key`: the one chosen before, else the fastest candidate by `time`
        (ms of one candidate; inf for one that cannot run), stored. A single candidate is
        returned untimed."""
        if not candidates:
            raise ValueError(f"no tile config fits {key}")
        tile = self._chosen.get(key)
        if tile is not None:
            return tile
        if len(candidates) == 1:
            return candidates[0]
        with self._lock:
            if key not in self._chosen:
                timings = {c: time(c) for c in candidates}
                self._chosen[key] = min(candidates, key=lambda c: timings[c])  # ties: the earlier
            return self._chosen[key]

    def entries(self) -> Dict[Key, Tile]:
        """A copy of every (key, chosen config) so far."""
        return dict(self._chosen)

    def clear(self) -> None:
        with self._lock:
            self._chosen.clear()


TILES = TileStore()


def median_ms(launch: Callable[[], None]) -> float:
    """Median time of `launch` in ms with Triton's benchmark (events on torch's current
    stream, L2 flushed between runs); inf when the config cannot run on this GPU (too much
    shared memory, a compile-time assertion, ptxas failing), as Triton's autotuner does."""
    import triton.testing
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    try:
        return float(triton.testing.do_bench(launch, return_mode="median"))
    except (OutOfResources, CompileTimeAssertionFailure, PTXASError):
        return float("inf")
