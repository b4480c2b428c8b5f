"""The contract of a fine-stage backend: what `vsa_core.ops` hands it, and what it provides.

The core runs the shared stages (pooling, coarse attention, selection, lists) on the
Triton kernels and leaves the block-sparse fine attention to a backend. `ops` builds
one `FineForward` / `FineBackward` per launch sequence from the buffer dict (fields named
as the buffers of `AttnProblem.forward_buffers` / `backward_buffers`), so a backend reads
buffers by name and a new buffer is one new field here, not a new argument threaded
through every backend. Fields that only some problems have are `Optional` (None when
absent): the coarse branch (VSA) and the gate.

The argument objects are built on every call (host cost counts: issue 12), so they are
slotted dataclasses, not frozen ones: a frozen dataclass's __init__ sets each field through
object.__setattr__ and measured ~3x slower here for 22 fields. Backends read them only.

Backends are modules (`triton_backend`, `cute_backend`, `cudnn_backend`) that satisfy
`FineStageBackend` structurally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

from ..problem import AttnProblem
from ..runtime import DeviceInfo

Buffer = Any  # a launch view of a caller's buffer: a torch tensor or a vsa_core.runtime.DeviceBuffer


@dataclass(slots=True)
class FineForward:
    """Buffers of the fine forward. Writes `out` and `lse`; with the coarse branch
    (`out_coarse` given) `out` is out_fine + gate * out_coarse, and `out_fine` (training
    only) keeps the fine output for the backward, in `p.fine_residual` (fp32 from the
    kernels' accumulators, or q's dtype where a library writes only that). Padding (`p.padding`): under
    "zeros" the padded query rows (past `q_counts`) are computed like any row; under
    "ignore" no padded row of q, k, v or the gate may reach a result (NaN / inf included),
    and with the coarse branch (VSA) the padded query rows must end with out 0, out_fine 0
    and lse +inf (the Triton kernel writes them so; the library backends through
    `triton_backend.mix_coarse`, after handing their library `valid_rows_copy`s): any
    backward's P = exp(S - lse) is then 0 there, so those rows feed no gradient."""

    q: Buffer
    k: Buffer
    v: Buffer
    out: Buffer
    lse: Buffer
    sel_idx: Buffer   # query-owned lists [B, H, nQ, capacity], ascending
    sel_num: Buffer   # their counts [B, H, nQ]
    kv_counts: Buffer
    q_counts: Optional[Buffer] = None    # VSA
    gate: Optional[Buffer] = None        # VSA with a gate
    out_coarse: Optional[Buffer] = None  # VSA
    out_fine: Optional[Buffer] = None    # VSA, training


@dataclass(slots=True)
class FineBackward:
    """Buffers of the fine backward. Writes dq, dk, dv (with the coarse branch also
    adding the pooling gradients dq_pool / dk_pool / dv_pool spread over each block's
    tokens: every token of the block under padding "zeros", the valid ones under "ignore").
    `delta` = rowsum(dout * out_fine) comes from the core's preprocess (under "ignore" 0 on
    the padded query rows of a VSA call, whose dout is ignored); a backend may overwrite it
    (a workspace). Under "ignore" nothing of the padded rows of q, k, v, dout may reach a
    result, and the padded rows of dq, dk, dv (past q_counts / kv_counts) must end exactly
    0 (the library backends: `triton_backend.add_block_grad` writes them so)."""

    q: Buffer
    k: Buffer
    v: Buffer
    out: Buffer
    lse: Buffer
    dout: Buffer
    delta: Buffer
    dq: Buffer
    dk: Buffer
    dv: Buffer
    sel_idx: Buffer   # query-owned lists
    sel_num: Buffer
    inv_idx: Buffer   # KV-owned lists [B, H, nKV, nQ] (from the same selection)
    inv_num: Buffer
    kv_counts: Buffer
    q_counts: Optional[Buffer] = None    # VSA
    gate: Optional[Buffer] = None        # VSA with a gate
    out_coarse: Optional[Buffer] = None  # VSA
    out_fine: Optional[Buffer] = None    # VSA
    dq_pool: Optional[Buffer] = None     # VSA
    dk_pool: Optional[Buffer] = None     # VSA
    dv_pool: Optional[Buffer] = None     # VSA


@runtime_checkable
class FineStageBackend(Protocol):
    """What a fine-stage backend provides (a module satisfies it structurally).

    Optional: `replayable = True` when every launch of its fine stage goes through the
    launcher passed in (`launcher.triton`, `launcher.cute`) and touches only the call's named
    buffers and the scratch buffers it got from `launcher.workspace` (no library call outside a
    step, no allocation of its own), so that a captured stage can be replayed
    (`vsa_core.replay`); absent means False. `CUTE_STEPS`: the CuTe DSL launches it runs through `launcher.cute(step,
    buffers, **statics)`, step -> the function that runs the step eagerly on the buffers
    (`vsa_core.backends.cute_step` finds it there)."""

    name: str

    def unavailable_reason(self, problem: AttnProblem, device: DeviceInfo) -> Optional[str]:
        """None when the backend can run `problem` on `device`, else why not."""

    def sparse_forward(self, launcher, p: AttnProblem, args: FineForward) -> None:
        """The fine forward; its Triton launches go through `launcher` (`vsa_core.launch`)."""

    def sparse_backward(self, launcher, p: AttnProblem, args: FineBackward) -> None:
        """The fine backward; its Triton launches go through `launcher`."""
