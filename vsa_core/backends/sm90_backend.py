"""sm90 backend: our own CuTe DSL kernels for 64-token blocks on sm_90 (H100 / H200).

Same contract as the other backends (`base.FineStageBackend`). The kernels are ours:
`sm90_fwd64` (the forward, its warp-specialized configuration `FORWARD`) and `sm90_bwd64`
(the KV-major backward, `BACKWARD`); their module docstrings say how they work, and
benchmarks/sm90_fwd64_check.py / sm90_bwd64_check.py check every configuration against
float64 and time them.

What this module adds to the kernels:
- The coarse branch (VSA) is mixed in the forward kernel's epilogue: `out` is written once
  as out_fine + gate * out_coarse, and training keeps the fine output in fp32 (`out_fine`,
  from the accumulators) for the backward's delta. No separate mix pass, unlike the
  library backends (cute, cudnn).
- Padding. The epilogue writes the query rows past `q_counts` as out 0, out_fine 0, lse
  +inf: padding="ignore"'s rows. Under padding="zeros" those rows are computed like any
  row, so the epilogue gets full counts (every row valid). Both kernels mask the padded
  keys in the scores but multiply padded rows of V, K, Q and dO by zero weights (0 * inf
  is NaN), so under "ignore" they read copies with the padded rows written 0
  (`valid_rows_copy`): K and V in the forward, Q, K, V and dO in the backward, as the
  library backends do.
- The pooling gradients (VSA) are added where the gradients are formed: dq in the dQ
  postprocess, dk and dv in the backward's epilogue (one rounding to q's dtype, no extra pass).
- Layouts: the kernels take [B, H, S, D] views with any strides; BSHD buffers are passed
  transposed (no copy).
- Streams: the launches go to torch's current stream, which is the caller's
  (`runtime.caller_stream`: under JAX, XLA's stream made torch's current one; the
  buffers are torch views of XLA's through DLPack).

Allocation: the backward's fp32 dQ workspace ([B, H, nQ, 64 * D], zeroed per call), the
full query counts of padding="zeros" (cached per device and size) and the copies of
padding="ignore" come from torch's caching allocator on the current stream; none is
declared in the buffer tables, which stay backend-independent.

What it supports: sm_90 only (the kernels use sm_90a's wgmma and TMA), 64-token blocks,
head dim 64 or 128, bf16 or fp16, forward and backward. dq is not bitwise deterministic run
to run (the order of its fp32 reductions varies); out, lse, dk and dv are.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

from ..problem import AttnProblem
from ..runtime import DeviceInfo, caller_stream
from ..stages import valid_rows_copy
from .base import FineBackward, FineForward

name = "sm90"
INSTALL_HINT = "pip install 'vsa[sm90]' (nvidia-cutlass-dsl==4.8.1)"

BLOCK_ELEMS = 64
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
# warp-specialized: a producer warpgroup and 3 consumer warpgroups, each on its own query block,
# with lazy rescaling (`sm90_fwd64.BlockSparseFwd64Sm90`; "ws3L" in the check script)
FORWARD = dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True)
# dQ by vector reductions from registers, dK left in flight under the next step ("redov")
BACKWARD = dict(stages=2, dq_red=True, dk_overlap=True)

# The CuTe DSL keeps per-compile state on a process-wide singleton, so two threads compiling at
# once (one per GPU under a JAX mesh) corrupt each other: every call holds this for its host work.
_COMPILE_LOCK = threading.RLock()


@functools.lru_cache(maxsize=None)
def _kernels_import_error() -> Optional[str]:
    """None when our CuTe DSL kernel modules import (nvidia-cutlass-dsl present), else the error."""
    try:
        from . import sm90_bwd64, sm90_fwd64  # noqa: F401
    except Exception as e:  # ImportError, or a cutlass-dsl / CUDA setup that fails at import
        return f"{type(e).__name__}: {e}"
    return None


def library_error() -> Optional[str]:
    """Why this backend's library cannot be used here (None when it can): for strict test runs."""
    return _kernels_import_error()


def unavailable_reason(problem: AttnProblem, device: DeviceInfo):
    if device.kind != "cuda":
        return f"it runs on NVIDIA GPUs only, the tensors are on {device.kind}"
    cap = device.capability or (0, 0)
    if tuple(cap) != (9, 0):
        return f"its kernels are sm_90a code (H100/H200); this GPU is sm_{cap[0]}{cap[1]}"
    if problem.block_elems != BLOCK_ELEMS:
        return f"{problem.block_elems}-token blocks: its kernels take {BLOCK_ELEMS}-token blocks"
    if problem.head_dim not in HEAD_DIMS:
        return f"head dim {problem.head_dim}: its kernels take head dims {HEAD_DIMS}"
    if problem.dtype not in DTYPES:
        return f"{problem.dtype}: its kernels take {' or '.join(DTYPES)}"
    err = _kernels_import_error()
    if err is not None:
        return f"its CuTe DSL kernels cannot be imported ({err}); install: {INSTALL_HINT}"
    return None


def _bhsd(p: AttnProblem, x):
    """A token buffer of the problem's layout as the kernels' [B, H, S, D] view (no copy)."""
    return None if x is None else (x if p.layout == "bhsd" else x.transpose(1, 2))


_FULL_COUNTS = {}  # (device, n blocks) -> int32 [n] of BLOCK_ELEMS: padding="zeros" computes every row


def _full_counts(like, n: int):
    import torch
    key = (like.device, n)
    counts = _FULL_COUNTS.get(key)
    if counts is None:
        counts = _FULL_COUNTS[key] = torch.full((n,), BLOCK_ELEMS, dtype=torch.int32, device=like.device)
    return counts


# ---- the fine stage -------------------------------------------------------------------------
def sparse_forward(launcher, p: AttnProblem, a: FineForward):
    from ._torch_views import as_torch  # torch loads with this backend's first call
    with caller_stream(), _COMPILE_LOCK:
        _sparse_forward(launcher, p, as_torch(a))


def _sparse_forward(launcher, p: AttnProblem, a: FineForward):
    from .sm90_fwd64 import prepare_forward64
    k, v = (valid_rows_copy(launcher, p, x, a.kv_counts, p.kv_len) for x in (a.k, a.v))  # padding="ignore" only
    coarse = {}
    if a.out_coarse is not None:
        q_counts = a.q_counts if p.padding == "ignore" else _full_counts(a.q, p.n_q_blocks)
        coarse = dict(q_counts=q_counts, out_coarse=a.out_coarse, gate=_bhsd(p, a.gate),
                      out_fine=_bhsd(p, a.out_fine))
    prepare_forward64(_bhsd(p, a.q), _bhsd(p, k), _bhsd(p, v), _bhsd(p, a.out), a.lse, a.sel_idx, a.sel_num,
                      a.kv_counts, softmax_scale=p.softmax_scale, **coarse, **FORWARD)()


def sparse_backward(launcher, p: AttnProblem, a: FineBackward):
    from ._torch_views import as_torch
    with caller_stream(), _COMPILE_LOCK:
        _sparse_backward(launcher, p, as_torch(a))


def _sparse_backward(launcher, p: AttnProblem, a: FineBackward):
    """dq, dk, dv of the fine stage from the KV-owned lists and the core's delta, with the
    pooling gradients. `out`, `sel_idx`, `sel_num` are not read."""
    from .sm90_bwd64 import prepare_backward64
    q, dout = a.q, a.dout
    if a.q_counts is not None:  # padding="ignore": what the kernel multiplies by zero weights is read as 0
        q, dout = (valid_rows_copy(launcher, p, x, a.q_counts, p.q_len) for x in (q, dout))
    k, v = (valid_rows_copy(launcher, p, x, a.kv_counts, p.kv_len) for x in (a.k, a.v))
    pools = {}
    if a.dq_pool is not None:  # VSA: the pooling gradients, added where dq / dk / dv are formed
        pools = dict(dq_pool=a.dq_pool, dk_pool=a.dk_pool, dv_pool=a.dv_pool, q_counts=a.q_counts,
                     ignore_padding=p.padding == "ignore")
    prepare_backward64(_bhsd(p, q), _bhsd(p, k), _bhsd(p, v), _bhsd(p, dout), a.lse, a.delta, _bhsd(p, a.dq),
                       _bhsd(p, a.dk), _bhsd(p, a.dv), a.inv_idx, a.inv_num, a.kv_counts,
                       softmax_scale=p.softmax_scale, **pools, **BACKWARD)()
