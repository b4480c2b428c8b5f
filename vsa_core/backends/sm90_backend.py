"""sm90 backend: our own CuTe DSL kernels for 64-token blocks on sm_90 (H100 / H200).

Same contract as the other backends (`base.FineStageBackend`). The kernels are ours:
`sm90_fwd64` (the forward, its warp-specialized configuration `FORWARD`) and `sm90_bwd64`
(the KV-major backward, `BACKWARD`: its split kernel, `sm90_bwd64_split`); their module docstrings say how they work, and
benchmarks/sm90_fwd64_check.py / sm90_bwd64_check.py check every configuration against
float64 and time them.

What this module adds to the kernels:
- The coarse branch (VSA) is mixed in the forward kernel's epilogue: `out` is written once
  as out_fine + gate * out_coarse, and training keeps out's rounding residual in q's dtype
  (`out_fine`, `AttnProblem.fine_residual` "rounding"), from which the backward's delta forms the
  fp32 fine output. No separate mix pass, unlike the library backends (cute, cudnn).
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
- Streams: eagerly the launches go to torch's current stream, which is the caller's
  (`runtime.caller_stream`: under JAX's callback path, XLA's stream made torch's current one;
  the buffers are torch views of XLA's through DLPack). Natively under JAX, XLA's stream through
  the CuTe DSL runtime's FFI handler, no torch.

Launches and allocation: the kernels run through `launcher.cute("sm90_fwd64" / "sm90_bwd64",
buffers, **statics)` (`vsa_core.launch`; the steps declared in `CUTE_STEPS`). Eagerly each is one call
of the compiled kernel with the torch tensors themselves (TVM-FFI; the checks once per problem: the
"host launcher" notes in sm90_fwd64). The copies of padding="ignore" are Triton launches
(`valid_rows_copy`), and the scratch buffers beyond the stage's buffer table, the copies and
the backward's fp32 dQ accumulator ([B, H, nQ, 64 * D], zeroed by the backward launch), are
declared in `workspaces(stage, problem)` and come from `launcher.workspace`: eagerly torch's
caching allocator on the current stream, in a recorded plan (`vsa_core.plan`) buffers it
names, so `vsa_jax.native` replays the whole stage as XLA custom calls (`vsa_jax.sm90_call`).
The full query counts of padding="zeros" are a constant of the forward launch (cached per
device and size eagerly). The buffer tables stay backend-independent.

What it supports: sm_90 only (the kernels use sm_90a's wgmma and TMA), 64-token blocks,
head dim 64 or 128, bf16 or fp16, forward and backward. dq is not bitwise deterministic run
to run (the order of its fp32 reductions varies); out, lse, dk and dv are (with query groups too:
their partial sums are added in group order).
"""

from __future__ import annotations

import threading
from typing import Optional

from ..problem import AttnProblem
from ..runtime import DeviceInfo, caller_stream
from ..stages import valid_rows_input, valid_rows_workspaces
from .availability import gpu_reason, library_probe, library_reason
from .base import FineBackward, FineForward
from .sm90_bwd64_groups import group_workspace_shapes

name = "sm90"
replayable = True  # its launches: Triton copies and two CuTe DSL steps, on the call's buffers and workspaces
INSTALL_HINT = "pip install 'vsa[sm90]' (nvidia-cutlass-dsl==4.8.1, apache-tvm-ffi)"

BLOCK_ELEMS = 64
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
# warp-specialized: a producer warpgroup and 3 consumer warpgroups, each on its own query block,
# with lazy rescaling, out leaving through shared memory by one TMA store per tile
# (`sm90_fwd64.BlockSparseFwd64Sm90`; "ws3LT" in the check script)
FORWARD = dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True, tma_store=True,
               rescale_first=True)
# the GEMMs split over two cooperating warpgroups and a producer, a 3-slot Q / dO ring, dQ staged
# in shared memory and sent as one bulk reduction (`sm90_bwd64_split`; "split3B" in the check script),
# each KV block's list split into query groups of at most a 32 MiB working set (`sm90_bwd64`, "Query
# groups": one group up to 512 query blocks at D128), every group over a whole head before the next
# (head_sweep), K / V in the compute warpgroups' registers, P handed over early and in the input dtype,
# L2 hints on the loads (`sm90_bwd64`, "Handing P over"; "kvpr" in the A/B)
BACKWARD = dict(stages=3, split=True, dq_bulk=True, q_group_bytes=32 << 20, head_sweep=True, k_in_regs=True,
                v_in_regs=True, p_early=True, p_rounded=True, l2_hints=True)

# The CuTe DSL keeps per-compile state on a process-wide singleton, so two threads compiling at
# once (one per GPU under a JAX mesh) corrupt each other: every call holds this for its host work.
_COMPILE_LOCK = threading.RLock()


@library_probe
def _kernels_import_error() -> Optional[str]:
    """None when our CuTe DSL kernel modules import (nvidia-cutlass-dsl present) and TVM-FFI, which the
    eager launches are compiled for (`sm90_common.compile_for_torch`), does; else the error."""
    import tvm_ffi  # noqa: F401

    from . import sm90_bwd64_launch, sm90_fwd64  # noqa: F401


def library_error() -> Optional[str]:
    """Why this backend's library cannot be used here (None when it can): for strict test runs."""
    return _kernels_import_error()


def unavailable_reason(problem: AttnProblem, device: DeviceInfo):
    reason = gpu_reason(device, lambda cap: cap == (9, 0), "its kernels are sm_90a code (H100/H200)")
    if reason is not None:
        return reason
    if problem.block_elems != BLOCK_ELEMS:
        return f"{problem.block_elems}-token blocks: its kernels take {BLOCK_ELEMS}-token blocks"
    if problem.head_dim not in HEAD_DIMS:
        return f"head dim {problem.head_dim}: its kernels take head dims {HEAD_DIMS}"
    if problem.dtype not in DTYPES:
        return f"{problem.dtype}: its kernels take {' or '.join(DTYPES)}"
    return library_reason("its CuTe DSL kernels", _kernels_import_error(), INSTALL_HINT)


def _bhsd(layout: str, x):
    """A token buffer of `layout` as the kernels' [B, H, S, D] view (no copy)."""
    return None if x is None else (x if layout == "bhsd" else x.transpose(1, 2))


_FULL_COUNTS = {}  # (device, n blocks) -> int32 [n] of BLOCK_ELEMS: padding="zeros" computes every row


def _full_counts(like, n: int):
    import torch
    key = (like.device, n)
    counts = _FULL_COUNTS.get(key)
    if counts is None:
        counts = _FULL_COUNTS[key] = torch.full((n,), BLOCK_ELEMS, dtype=torch.int32, device=like.device)
    return counts


# ---- the workspaces ---------------------------------------------------------------------------
def _dq_accum_shape(p: AttnProblem):
    return (p.batch, p.heads, p.n_q_blocks, BLOCK_ELEMS * p.head_dim)


def _group_shapes(p: AttnProblem) -> dict:
    return group_workspace_shapes(p.n_q_blocks, p.n_kv_blocks, p.head_dim, BACKWARD["q_group_bytes"],
                                  BACKWARD.get("head_sweep", False))


def workspaces(stage: str, p: AttnProblem) -> dict:
    """What this backend's launches use beyond the stage's buffer table (name -> (shape, dtype)),
    each from `launcher.workspace`: the padded-rows-zeroed copies of padding="ignore"
    ("<name>_valid", `stages.valid_rows_input`), the backward's fp32 dQ accumulator
    ([B, H, nQ, 64 * D], which the sm90_bwd64 launch zeroes before its main kernel) and its query
    groups' partial sums and flags (`sm90_bwd64_groups.group_workspace_shapes`; the flags zeroed by the
    launch too)."""
    table = valid_rows_workspaces(stage, p)
    if stage == "backward":
        table["dq_accum"] = (_dq_accum_shape(p), "float32")
        table.update(_group_shapes(p))
    return table


# ---- the fine stage -------------------------------------------------------------------------
def _statics(p: AttnProblem) -> dict:
    return dict(dtype=p.dtype, head_dim=p.head_dim, layout=p.layout, softmax_scale=p.softmax_scale)


def sparse_forward(launcher, p: AttnProblem, a: FineForward):
    k, v = (valid_rows_input(launcher, p, "forward", n, x, a.kv_counts) for n, x in (("k", a.k), ("v", a.v)))
    buffers = dict(q=a.q, k=k, v=v, out=a.out, lse=a.lse, sel_idx=a.sel_idx, sel_num=a.sel_num,
                   kv_counts=a.kv_counts)
    has_coarse = a.out_coarse is not None
    ignore_padding = p.padding == "ignore"
    if has_coarse:
        buffers["out_coarse"] = a.out_coarse
        if ignore_padding:  # under "zeros" the launch takes full counts (every row valid)
            buffers["q_counts"] = a.q_counts
        if a.gate is not None:
            buffers["gate"] = a.gate
        if a.out_fine is not None:
            buffers["out_fine"] = a.out_fine
    launcher.cute("sm90_fwd64", buffers, **_statics(p), has_coarse=has_coarse, has_gate=a.gate is not None,
                  store_fine=has_coarse and a.out_fine is not None, ignore_padding=ignore_padding,
                  fine_rounding=has_coarse and p.fine_residual == "rounding", config=FORWARD)


def launch_forward64(buffers: dict, *, dtype: str, head_dim: int, layout: str, softmax_scale: float,
                     has_coarse: bool, has_gate: bool, store_fine: bool, ignore_padding: bool, config: dict,
                     fine_rounding: bool = False):
    """The "sm90_fwd64" launch on framework buffers (`CUTE_STEPS`): `prepare_forward64`
    on torch views, on the caller's stream. Buffers: q, k, v, out, lse, sel_idx, sel_num, kv_counts;
    with the coarse branch out_coarse (+ q_counts under ignore_padding, gate, out_fine)."""
    from ._torch_views import as_torch_buffers  # torch loads with this backend's first call
    from .sm90_fwd64 import prepare_forward64
    with caller_stream(), _COMPILE_LOCK:
        b = as_torch_buffers(buffers, "lse")  # lse: the frontend's in both steps
        coarse = {}
        if has_coarse:
            q = b["q"]
            q_counts = b["q_counts"] if ignore_padding else _full_counts(q, q.shape[2 if layout == "bhsd" else 1]
                                                                           // BLOCK_ELEMS)
            coarse = dict(q_counts=q_counts, out_coarse=b["out_coarse"],
                          gate=_bhsd(layout, b["gate"]) if has_gate else None,
                          out_fine=_bhsd(layout, b["out_fine"]) if store_fine else None, fine_rounding=fine_rounding)
        prepare_forward64(_bhsd(layout, b["q"]), _bhsd(layout, b["k"]), _bhsd(layout, b["v"]), _bhsd(layout, b["out"]),
                          b["lse"], b["sel_idx"], b["sel_num"], b["kv_counts"], softmax_scale=softmax_scale,
                          **coarse, **config)()


def sparse_backward(launcher, p: AttnProblem, a: FineBackward):
    """dq, dk, dv of the fine stage from the KV-owned lists and the core's delta, with the
    pooling gradients. `out`, `sel_idx`, `sel_num` are not read."""
    q, dout = (valid_rows_input(launcher, p, "backward", n, x, a.q_counts) for n, x in (("q", a.q), ("dout", a.dout)))
    k, v = (valid_rows_input(launcher, p, "backward", n, x, a.kv_counts) for n, x in (("k", a.k), ("v", a.v)))
    buffers = dict(q=q, k=k, v=v, dout=dout, lse=a.lse, delta=a.delta, dq=a.dq, dk=a.dk, dv=a.dv,
                   inv_idx=a.inv_idx, inv_num=a.inv_num, kv_counts=a.kv_counts,
                   dq_accum=launcher.workspace("dq_accum", _dq_accum_shape(p), "float32", a.q))
    for name, (shape, dtype) in _group_shapes(p).items():
        buffers[name] = launcher.workspace(name, shape, dtype, a.q)
    pool_grads = a.dq_pool is not None
    if pool_grads:  # VSA: the pooling gradients, added where dq / dk / dv are formed
        buffers.update(dq_pool=a.dq_pool, dk_pool=a.dk_pool, dv_pool=a.dv_pool, q_counts=a.q_counts)
    launcher.cute("sm90_bwd64", buffers, **_statics(p), pool_grads=pool_grads,
                  ignore_padding=pool_grads and p.padding == "ignore", config=BACKWARD)


def launch_backward64(buffers: dict, *, dtype: str, head_dim: int, layout: str, softmax_scale: float,
                      pool_grads: bool, ignore_padding: bool, config: dict):
    """The "sm90_bwd64" launch on framework buffers (`CUTE_STEPS`): dq_accum zeroed,
    the main kernel and the dQ postprocess (`prepare_backward64`) on torch views, on the caller's
    stream. Buffers: q, k, v, dout, lse, delta, dq, dk, dv, inv_idx, inv_num, kv_counts, dq_accum,
    dkv_partial, group_flags; with pool_grads dq_pool, dk_pool, dv_pool, q_counts."""
    from ._torch_views import as_torch_buffers
    from .sm90_bwd64_launch import prepare_backward64
    with caller_stream(), _COMPILE_LOCK:
        b = as_torch_buffers(buffers, "lse")  # lse: the frontend's in both steps
        pools = {}
        if pool_grads:
            pools = dict(dq_pool=b["dq_pool"], dk_pool=b["dk_pool"], dv_pool=b["dv_pool"], q_counts=b["q_counts"],
                         ignore_padding=ignore_padding)
        t = {n: _bhsd(layout, b[n]) for n in ("q", "k", "v", "dout", "dq", "dk", "dv")}
        prepare_backward64(t["q"], t["k"], t["v"], t["dout"], b["lse"], b["delta"], t["dq"], t["dk"], t["dv"],
                           b["inv_idx"], b["inv_num"], b["kv_counts"], softmax_scale=softmax_scale,
                           dq_accum=b["dq_accum"], dkv_partial=b["dkv_partial"], group_flags=b["group_flags"],
                           **pools, **config)()


# The CuTe DSL launches of this backend (`launcher.cute(step, buffers, **statics)`; the eager
# launcher finds them here through the registry, `vsa_core.backends.cute_step`): step -> the
# function that runs it eagerly on framework buffers (torch tensors or DeviceBuffers). Each does
# all the work of its launch (views, compilation on first use, the launch on the caller's
# stream), so calling it again on other buffers of the same shapes is another correct launch:
# a recorded plan keeps only the step, its buffers and its statics.
CUTE_STEPS = {"sm90_fwd64": launch_forward64, "sm90_bwd64": launch_backward64}
