"""The launch seam: every Triton kernel launch of the core goes through a `Launcher`.

The stage functions (`vsa_core.stages`) and each backend's `sparse_forward` /
`sparse_backward` take the launcher as their first argument and launch with
`launcher.triton(kernel, grid, *args, **meta)`; `vsa_core.ops` passes it down from its
`launcher` argument. `eager_launcher` launches at once under the current configuration
(`vsa_core.config`). Another launcher changes what a launch does without touching Triton:
`vsa_core.plan.RecordingLauncher` records the launches of a stage instead of running them,
with its own configuration (default tiles, pointer loads).
"""

from __future__ import annotations

from .config import LaunchConfig, config


class Launcher:
    """Launches each kernel at once: `kernel[grid](*args, **meta)`."""

    @property
    def config(self) -> LaunchConfig:
        """The settings the launches read (autotune, TMA, coarse precision, forced tiles)."""
        return config()

    @property
    def runs_kernels(self) -> bool:
        """Whether a launch runs (so that tile candidates can be timed through it)."""
        return True

    def triton(self, kernel, grid, *args, **meta) -> None:
        kernel[grid](*args, **meta)


eager_launcher = Launcher()
