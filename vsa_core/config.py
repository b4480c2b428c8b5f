"""The launch configuration: every setting vsa reads from the environment, in one place.

The environment is read once, when `config()` is first called (the first launch, or the
first traced call), not at each call: setting a variable later in the same process has no
effect. Change a setting at run time with `configure(**changes)` (process-wide) or, for a
block of code (tests, benchmarks), `with overridden(**changes):`.

Variables (field of `LaunchConfig` in brackets):

- `VSA_AUTOTUNE` [autotune]: "0" runs each attention kernel's default tile config; otherwise
  (the default) the Triton backend times the candidate configs once per problem on a GPU
  (`vsa_core.autotune.TILES`). The interpreter always runs its one small config.
- `VSA_TMA` [tma]: "0" makes the Triton attention kernels load K/V (forward, dQ) and Q/dO
  (dK/dV) tiles with pointer loads instead of tensor descriptors (TMA on Hopper).
- `VSA_COARSE_PRECISION` [coarse_precision]: precision of the coarse kernels' products with
  fp32 operands, "ieee" (the default: exact fp32 products) or "tf32" (for comparisons only,
  see `vsa_core.stages`). The interpreter computes fp32 whatever this says.
- `VSA_BACKEND` [backend]: the backend that `backend="auto"` stands for ("auto": the
  measured order of `vsa_core.backends.auto_table`).
- `VSA_ULYSSES_CHUNKS` [ulysses_chunks]: head chunks per device in the Ulysses sequence
  parallel ops (`vsa_core.sequence_parallel.DEFAULT_CHUNKS` when unset).
- `VSA_JAX_LAUNCH` [jax_launch]: how vsa_jax launches a stage, read when a call is traced.
  "auto" (the default): as XLA custom calls (`vsa_jax.native`, no Python per call) for the
  stages that have them (every stage of the Triton and sm90 backends, the cudnn stages at
  64-token blocks, the cute forward on sm_90: `vsa_jax.native.has_native`) on a CUDA device (the
  device of concrete arrays, else JAX's default device: `vsa_jax.native.launch_device`); a
  `buffer_callback` (Python per call) for the other stages (the cute backward; cudnn's 128-token
  blocks and its forward with a static prefix: no custom calls yet), on the CPU (the interpreter),
  under jax.vmap (the native launches are not mapped), and for the Triton backend with TMA on
  (`tma`) where a custom call cannot pass its kernels the host TMA descriptors torch's launch
  passes (jaxlib < 0.11.2; a GPU below sm_90).
  "native": custom calls wherever a stage has them, or an error saying why not; "callback": always
  the callback. Both
  launches run the same compiled kernels on the tile configs of the shared store
  (`vsa_core.autotune.TILES`), so they, and torch, agree bit for bit; a native launch traced
  before any call of its problem was timed tunes it then, on the GPU
  (`vsa_core.backends.triton_backend.tune`).

`forced_tiles` and `replay` have no variable: benchmarks set them to run one tile config of an
attention kernel regardless of tuning, and to time the stages' launch functions on every call.
TRITON_INTERPRET is not read here: Triton reads it when it is first imported
(`vsa_core.runtime.INTERPRETING`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

COARSE_PRECISIONS = ("ieee", "tf32")
JAX_LAUNCH_MODES = ("auto", "native", "callback")

# the environment variable of each field read from it
ENVIRONMENT = {
    "autotune": "VSA_AUTOTUNE",
    "tma": "VSA_TMA",
    "coarse_precision": "VSA_COARSE_PRECISION",
    "backend": "VSA_BACKEND",
    "ulysses_chunks": "VSA_ULYSSES_CHUNKS",
    "jax_launch": "VSA_JAX_LAUNCH",
}


@dataclass(frozen=True)
class LaunchConfig:
    autotune: bool = True
    tma: bool = True
    coarse_precision: str = "ieee"
    backend: str = "auto"
    ulysses_chunks: Optional[int] = None  # None: sequence_parallel.DEFAULT_CHUNKS
    jax_launch: str = "auto"
    # ((kernel name, (BLOCK_M, BLOCK_N, num_warps, num_stages)), ...): tiles run regardless of tuning
    forced_tiles: Tuple[Tuple[str, Tuple[int, int, int, int]], ...] = ()
    # False: the torch eager operator runs every call through the stages' launch functions instead of
    # replaying its recorded launches (`vsa_torch.ops`): for benchmarks that time those functions
    replay: bool = True

    def __post_init__(self):
        for name in ("autotune", "tma", "replay"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LaunchConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.coarse_precision not in COARSE_PRECISIONS:
            raise ValueError(f"LaunchConfig.coarse_precision must be one of {COARSE_PRECISIONS}, "
                             f"got {self.coarse_precision!r}")
        from .backends.registry import CHOICES
        if self.backend not in CHOICES:
            raise ValueError(f"LaunchConfig.backend must be one of {CHOICES}, got {self.backend!r}")
        chunks = self.ulysses_chunks
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"LaunchConfig.ulysses_chunks must be an int >= 1 or None, got {chunks!r}")
        if self.jax_launch not in JAX_LAUNCH_MODES:
            raise ValueError(f"LaunchConfig.jax_launch must be one of {JAX_LAUNCH_MODES}, got {self.jax_launch!r}")
        tiles = self.forced_tiles
        if not isinstance(tiles, tuple) or not all(
                isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], tuple) and len(entry[1]) == 4 for entry in tiles):
            raise TypeError("LaunchConfig.forced_tiles must be a tuple of (kernel name, (BLOCK_M, BLOCK_N, "
                            f"num_warps, num_stages)) pairs, got {tiles!r}")

    def forced_tile(self, kernel_name: str) -> Optional[Tuple[int, int, int, int]]:
        """The tile config `forced_tiles` sets for this kernel, or None."""
        return dict(self.forced_tiles).get(kernel_name)


def from_environment(environ=None) -> LaunchConfig:
    """The configuration the variables of `environ` (default: os.environ) describe; a value
    that does not parse raises ValueError naming its variable."""
    environ = os.environ if environ is None else environ

    def text(field: str) -> str:
        return environ.get(ENVIRONMENT[field], "").strip()

    chunks = text("ulysses_chunks")
    try:
        ulysses_chunks = int(chunks) if chunks else None
    except ValueError:
        raise ValueError(f"VSA_ULYSSES_CHUNKS must be an int >= 1, got {chunks!r}") from None
    values = dict(autotune=text("autotune") != "0", tma=text("tma") != "0",
                  coarse_precision=text("coarse_precision") or "ieee", backend=text("backend") or "auto",
                  ulysses_chunks=ulysses_chunks, jax_launch=text("jax_launch") or "auto")
    try:
        return LaunchConfig(**values)
    except (TypeError, ValueError) as e:  # name the variable the user set, not only the field
        field = next(f for f in ENVIRONMENT if f"LaunchConfig.{f} " in str(e))
        raise type(e)(f"{ENVIRONMENT[field]}: {e}") from None


_lock = threading.Lock()
_current: Optional[LaunchConfig] = None


def config() -> LaunchConfig:
    """The current configuration (read from the environment on the first call)."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = from_environment()
    return _current


def configure(**changes) -> LaunchConfig:
    """Replaces fields of the current configuration (process-wide) and returns the new one.
    An unknown field or a bad value raises, naming the field; nothing changes then."""
    global _current
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"LaunchConfig has no field {', '.join(unknown)} (fields: {', '.join(sorted(fields))})")
    updated = dataclasses.replace(config(), **changes)
    with _lock:
        _current = updated
    return updated


@contextlib.contextmanager
def overridden(**changes):
    """`configure(**changes)` for the duration of the block, then the configuration before it."""
    before = config()
    try:
        yield configure(**changes)
    finally:
        global _current
        with _lock:
            _current = before
