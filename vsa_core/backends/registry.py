"""The one list of fine-stage backends: name -> the module that implements it.

A module of names only, importing nothing of vsa_core, so that the launch configuration
(`vsa_core.config`, which checks a configured backend name) and the backend resolution
(`vsa_core.backends`, which reads the configuration) both read it without importing each
other. A new backend is its module, one line here and its measured `auto_table` rows.
"""

from __future__ import annotations

from typing import Tuple

# name -> the module that implements `base.FineStageBackend`
REGISTRY = {
    "triton": "vsa_core.backends.triton_backend",
    "cute": "vsa_core.backends.cute_backend",
    "cudnn": "vsa_core.backends.cudnn_backend",
    "sm90": "vsa_core.backends.sm90_backend",
}

NAMES: Tuple[str, ...] = tuple(REGISTRY)
CHOICES: Tuple[str, ...] = ("auto",) + NAMES

# the backends whose fine kernel writes its output in q's dtype only (a library kernel): the fine
# output kept for the backward (`out_fine`) is then q's dtype too; the others keep out's rounding
# residual (`AttnProblem.fine_residual`)
FINE_OUTPUT_IN_INPUT_DTYPE = frozenset({"cute", "cudnn"})
