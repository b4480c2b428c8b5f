"""The launch seam: every kernel launch of the core goes through a `Launcher`.

The stage functions (`vsa_core.stages`) and each backend's `sparse_forward` /
`sparse_backward` take the launcher as their first argument and launch with
`launcher.triton(kernel, grid, *args, **meta)`; a backend's own CuTe DSL launches go through
`launcher.cute(step, buffers, **statics)` (each step declared in its backend module's
`CUTE_STEPS`, found through the backend registry: `vsa_core.backends.cute_step`), and the
scratch buffers a backend needs beyond the stage's buffer table come from
`launcher.workspace(name, shape, dtype, like)` (each named in the backend's
`workspaces(stage, problem)` table). `vsa_core.ops` passes the launcher down from its
`launcher` argument. `eager_launcher` launches at once under the current
configuration (`vsa_core.config`). Another launcher changes what a launch does without
touching Triton or the kernels: `vsa_core.plan.RecordingLauncher` records the launches of a
stage instead of running them (the tile configs the shared store chose; a TMA descriptor as
its buffer and geometry), and hands out its own placeholders as the workspaces.
"""

from __future__ import annotations

from .autotune import TILES
from .backends import cute_step
from .config import LaunchConfig, config


class Launcher:
    """Launches each kernel at once: `kernel[grid](*args, **meta)`, the CuTe DSL step's function
    (`vsa_core.backends.cute_step`) on `buffers`."""

    @property
    def config(self) -> LaunchConfig:
        """The settings the launches read (autotune, TMA, coarse precision, forced tiles)."""
        return config()

    @property
    def runs_kernels(self) -> bool:
        """Whether a launch runs (so that tile candidates can be timed through it)."""
        return True

    def stored_tile(self, key, candidates):
        """For a launcher that runs nothing (so cannot time candidates): the tile config the shared
        store (`vsa_core.autotune.TILES`) chose for `key`, else the default, candidates[0]."""
        chosen = TILES.chosen(key)
        return candidates[0] if chosen is None else chosen

    def triton(self, kernel, grid, *args, **meta) -> None:
        kernel[grid](*args, **meta)

    def cute(self, step: str, buffers: dict, **statics) -> None:
        """One of a backend's own CuTe DSL launches (the `CUTE_STEPS` its module declares): `buffers`
        maps the launch's argument names to the buffers it reads or writes (workspaces included),
        `statics` are its compile-time configuration."""
        cute_step(step)(buffers, **statics)

    def workspace(self, name: str, shape, dtype: str, like):
        """An uninitialised scratch buffer of `shape` and `dtype` ("input": like's dtype) for
        this call's launches, on like's device: the entry `name` of the backend's workspace
        table. Eagerly a torch tensor from torch's caching allocator on the caller's stream (the
        backends that declare workspaces run through torch eagerly)."""
        global _empty
        if _empty is None:
            from .backends._torch_views import empty as _empty
        return _empty(shape, dtype, like)


_empty = None  # `_torch_views.empty`, imported on first use (torch loads then)


eager_launcher = Launcher()
