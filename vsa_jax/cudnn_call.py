"""cuDNN's sm_90 block-sparse forward and backward for 64-token blocks as XLA custom calls: no
torch and no Python per call (issue 23).

The cudnn backend's forward (`cudnn_backend.sparse_forward`) launches cuDNN frontend 1.32's
`BlockSparseAttnForwardSm90Blk64` (a CuTe DSL kernel class) as the step "cudnn_fwd". Under JAX
the stage's launch plan (`vsa_core.plan`) names that step as a `CuteLaunch`, and `call` turns it
into one `cutlass.jax.cutlass_call` (nvidia-cutlass-dsl's public JAX bridge, the one cuDNN's own
SM100 JAX BSA uses; design note: benchmarks/results/2026-12-02-jax-cute-design.md) of an adapter
that calls the kernel class as the torch path does (`cudnn_backend._blk64_forward`):

- the same constructor arguments (`allow_empty_block_nums=True`: an empty row gives out 0, lse
  -inf; per-block valid-token counts; one split), the same views of the buffers (the kernel reads
  Q/K/O as (S, D, H, B) and V as (D, S, H, B): permutations of the compact arrays through
  `TensorSpec.mode`, no copy) with the same assumed alignment (128 bytes on the token arrays,
  which XLA's buffers meet: cutlass.jax itself assumes 256), the scale as an fp32 run-time value,
  so torch and JAX run one binary and agree bit for bit;
- the block sizes (`kv_counts` clamped to [0, 64], broadcast to [B, H, nKV], as the torch path
  expands them) are formed by XLA right before the call;
- compiled at lowering, once per (statics, shapes); `allow_cuda_graph=True` (XLA may capture it in
  a command buffer).

The backward (`cudnn_backend.sparse_backward`, step "cudnn_bwd") is one cutlass_call of
`cudnn_kernels.Blk64Backward`, the class the torch path compiles: cuDNN's `BucketedK2QCsrUniversal`
builds the K-to-Q lists from the query-owned ones, then its `BlockSparseAttnBackwardSm90Blk64`
(preprocess, main kernel, postprocess) writes dq, dk, dv. What cuDNN's torch wrapper allocates per
call are workspaces of the plan (`cudnn_backend.blk64_backward_workspaces`), XLA buffers here: the
per-bucket counts and the fp32 workspace are handed in as XLA zeros and donated (the torch launch
zeroes only the workspace's dK/dV accumulators; the preprocess writes the rest), the lists' other
buffers are born in the call; the block sizes are broadcast to [B, nKV] by XLA.

What keeps the buffer callback (`native_reason`): 128-token blocks (kernels that allocate their
outputs), the forward that runs a static prefix's rows on a stream of their own.

`cudnn_sm90_forward` is the same kernel as a standalone JAX function (out, lse), for the tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from vsa_core.backends.cudnn_backend import BACKWARD_DTYPE, BACKWARD_HEAD_DIM, BLK64_BACKWARD_ZEROED

from .cutlass_common import arrange, versions

BLOCK = 64                      # the sm_90 blk64 kernel: 64-token query and KV blocks
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
GPU_ARCH = "sm_90a"             # compiled for this arch whatever the host has (cuDNN's SM100 JAX BSA: sm_100a)
TOKEN_ALIGN = 128               # bytes: what cuDNN's torch path assumes for q/k/v/out (TMA)
TESTED = {"nvidia-cudnn-frontend": "1.32.0", "nvidia-cutlass-dsl": "4.8.1"}
STEPS = ("cudnn_fwd", "cudnn_bwd")
BACKWARD_TOKENS = frozenset({"q", "k", "v", "o", "dout", "dq", "dk", "dv"})

# Logical mode order the kernel wants, as a permutation of the JAX array's dimensions (TensorSpec
# mode: logical mode i = array dim mode[i]; no data moves). The kernel reads Q/K/O as
# (S, D, H, B) with D contiguous and V as (D, S, H, B): the permutations cuDNN's torch path
# applies to BHSD tensors before from_dlpack (_interface.py, _bsa_attn_fwd_sm90_blk64).
_QKO_MODE = {"bhsd": (2, 3, 1, 0), "bshd": (1, 3, 2, 0)}
_V_MODE = {"bhsd": (3, 2, 1, 0), "bshd": (3, 1, 2, 0)}
_MODE3 = (2, 1, 0)       # lse [B,H,S] -> (S,H,B); counts [B,H,nQ] -> (nQ,H,B); block sizes [B,H,nKV]
_MODE4 = (3, 2, 1, 0)    # lists [B,H,nQ,C] -> (C,nQ,H,B)
_MODES = {"q": _QKO_MODE, "k": _QKO_MODE, "out": _QKO_MODE, "v": _V_MODE}


def library_error(stage: str = "forward") -> Optional[str]:
    """None when the kernel classes of `stage` and the JAX bridge import (no torch needed), else why not."""
    try:
        import cutlass.jax
        if not cutlass.jax.is_available():
            return "cutlass.jax (nvidia-cutlass-dsl's JAX bridge) is not available with this jax"
        if stage == "forward":
            from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import (  # noqa: F401
                BlockSparseAttnForwardSm90Blk64)
        else:
            from cudnn.block_sparse_attention.csrc.bwd.bucketed_k2q_csr import BucketedK2QCsrUniversal  # noqa: F401
            from cudnn.block_sparse_attention.csrc.bwd.sm90_blk64.bsa_bwd_sm90 import (  # noqa: F401
                BlockSparseAttnBackwardSm90Blk64)
    except Exception as e:  # ImportError, or a CUDA-python / DSL setup that fails at import
        return f"{type(e).__name__}: {e}"
    return None


def native_reason(p, capability: Optional[int] = None, stage: str = "forward") -> Optional[str]:
    """Why `stage` ("forward" / "backward") of the cudnn backend on problem `p` cannot run as this
    module's custom call (on a CUDA device of `capability`, when given), or None."""
    from vsa_core.backends.cudnn_backend import prefix_first
    if capability is not None and capability != 90:
        return f"cuDNN's blk64 kernels are compiled for sm_90a (the device is sm_{capability})"
    if p.block_elems != BLOCK:
        return f"{p.block_elems}-token blocks: cuDNN's kernels for them allocate their own outputs"
    if stage == "forward":
        if p.head_dim not in HEAD_DIMS or p.dtype not in DTYPES:
            return f"cuDNN's blk64 forward takes head dim {HEAD_DIMS} in {DTYPES} (got {p.head_dim}, {p.dtype})"
        if prefix_first(p):
            return "a static prefix's dense rows run as a call of their own, on a stream of their own"
    elif p.head_dim != BACKWARD_HEAD_DIM or p.dtype != BACKWARD_DTYPE:
        return (f"cuDNN's blk64 backward takes head dim {BACKWARD_HEAD_DIM} in {BACKWARD_DTYPE} "
                f"(got {p.head_dim}, {p.dtype})")
    return library_error(stage)


def check(launch) -> None:
    """NotImplementedError for a CuTe DSL launch this module cannot replay."""
    if launch.step not in STEPS:
        raise NotImplementedError(f"no native replay of CuTe DSL launch {launch.step!r}")
    stage = "forward" if launch.step == "cudnn_fwd" else "backward"
    why = native_reason(launch.statics_dict()["problem"], stage=stage)
    if why is not None:
        raise NotImplementedError(f"{launch.step} has no native replay here: {why}")


@dataclasses.dataclass(frozen=True)
class Sm90Blk64Forward:
    """One compiled forward specialization (shapes are added by cutlass_call's own cache key)."""
    head_dim: int
    dtype: str
    layout: str
    softmax_scale: float


@dataclasses.dataclass(frozen=True)
class Sm90Blk64Backward:
    """One compiled backward specialization; `capacity`: the lists' width."""
    head_dim: int
    dtype: str
    layout: str
    softmax_scale: float
    capacity: int


def _fp32_value(x: float):
    """`x` as an fp32 IR value, like the torch path's run-time argument: the kernels' host code then
    forms scale * log2(e) as an fp32 product (on a Python constant the DSL multiplies in double)."""
    import cutlass
    return cutlass.Float32(cutlass.Float32(x).ir_value())


def _cutlass_dtype(name: str):
    import cutlass
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


class _Adapter:
    """cutlass_call's calling convention (stream, *inputs, *outputs not aliased), the buffers named
    by `names`, -> the kernel's (q, k, v, out, lse, lists, counts, block sizes, split offsets,
    scale, stream). Runs inside cutlass.jax's traced wrapper."""

    def __init__(self, cfg: Sm90Blk64Forward, names: Tuple[str, ...]):
        self.cfg, self.names = cfg, names

    def __call__(self, stream, *tensors):
        import cutlass
        from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import BlockSparseAttnForwardSm90Blk64

        cfg, t = self.cfg, dict(zip(self.names, tensors))
        kernel = BlockSparseAttnForwardSm90Blk64(
            gqa_ratio=1, head_dim=cfg.head_dim, value_dim=cfg.head_dim, blocksparse_blocksize_q=BLOCK,
            blocksparse_blocksize_k=BLOCK, dtype=_cutlass_dtype(cfg.dtype), acc_dtype=cutlass.Float32,
            has_block_sizes=True, num_splits=1, allow_empty_block_nums=True)
        # the split offsets are read only with num_splits > 1: the counts stand in (as in cuDNN's torch path)
        kernel(t["q"], t["k"], t["v"], t["out"], t["lse"], t["sel_idx"], t["sel_num"], t["block_sizes"],
               t["sel_num"], _fp32_value(cfg.softmax_scale), stream)


class _BackwardAdapter:
    """cutlass_call's calling convention -> `cudnn_kernels.Blk64Backward` (the class the torch path
    compiles: cuDNN's K-to-Q lists, then its sm_90 blk64 backward) on [B, H, S, D] views."""

    def __init__(self, cfg: Sm90Blk64Backward, names: Tuple[str, ...]):
        self.cfg, self.names = cfg, names

    def __call__(self, stream, *tensors):
        from vsa_core.backends.cudnn_backend import BLK64_BACKWARD_ARGS, BUCKET_BLOCKS
        from vsa_core.backends.cudnn_kernels import Blk64Backward

        cfg, t = self.cfg, dict(zip(self.names, tensors))
        kernel = Blk64Backward(_cutlass_dtype(cfg.dtype), cfg.head_dim, cfg.capacity, BUCKET_BLOCKS)
        kernel(*(t[n] for n in BLK64_BACKWARD_ARGS), _fp32_value(cfg.softmax_scale), stream)


def _spec(cfg, arg: str):
    """The TensorSpec of argument `arg`: the forward kernel's (S, D, H, B) / (D, S, H, B) modes and
    the backward's [B, H, S, D] views of the token arrays, with the alignment cuDNN's torch path assumes."""
    from cutlass.jax import TensorSpec
    layout = cfg.layout
    if isinstance(cfg, Sm90Blk64Backward):
        if arg in BACKWARD_TOKENS:
            return TensorSpec(mode=(0, 2, 1, 3) if layout == "bshd" else None, ptr_assumed_align=16)
        return TensorSpec(ptr_assumed_align=16 if arg == "bwd_workspace" else 4)
    if arg in _MODES:
        return TensorSpec(mode=_MODES[arg][layout], ptr_assumed_align=TOKEN_ALIGN)
    return TensorSpec(mode=_MODE4 if arg == "sel_idx" else _MODE3, ptr_assumed_align=4)


@functools.lru_cache(maxsize=None)
def _callable(cfg, in_args: tuple, out_args: tuple, result_args: tuple, result_types: tuple, aliases: tuple):
    """The cutlass_call callable of one specialization (cached: one trace of it per shape)."""
    import cutlass.jax
    forward = isinstance(cfg, Sm90Blk64Forward)
    adapter = (_Adapter if forward else _BackwardAdapter)(cfg, in_args + out_args)
    return cutlass.jax.cutlass_call(
        adapter,
        output_shape_dtype=tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for shape, dt in result_types),
        input_spec=tuple(_spec(cfg, a) for a in in_args),
        output_spec=tuple(_spec(cfg, a) for a in result_args),
        input_output_aliases=dict(aliases),
        compile_options=f"--gpu-arch={GPU_ARCH}",
        # identifies the adapter and its captured state (cutlass_call adds shapes, specs and the
        # environment): a lowering that hits its cache skips regenerating the IR
        compile_key=("vsa.cudnn_sm90_blk64_" + ("fwd" if forward else "bwd"), cfg, in_args, out_args, aliases,
                     _versions()),
        allow_cuda_graph=True,
    )


def _versions() -> tuple:
    from importlib.metadata import version
    return versions() + (("nvidia-cudnn-frontend", version("nvidia-cudnn-frontend")),)


def _block_sizes(kv_counts, batch: int, heads: int):
    """kv_counts clamped to [0, 64] as the compact [B, H, nKV] array the forward kernel reads
    (cutlass.jax passes compact layouts only: no stride-0 view); XLA fuses the clamp and broadcast."""
    return jnp.broadcast_to(jnp.clip(kv_counts, 0, BLOCK)[None, None, :], (batch, heads, kv_counts.shape[0]))


def call(launch, step, current: Dict[str, jax.Array], result_types: tuple) -> tuple:
    """The results of plan step `step` (a `vsa_core.plan.Step`) of the "cudnn_fwd" or "cudnn_bwd"
    launch `launch`, on the arrays `current` (buffer name -> array); result_types: a
    ShapeDtypeStruct per step result."""
    check(launch)
    p = launch.statics_dict()["problem"]
    forward = launch.step == "cudnn_fwd"
    args = arrange(launch, step, current, result_types, frozenset() if forward else BLK64_BACKWARD_ZEROED)
    where = args.in_args.index("kv_counts")  # the kernels read the clamped, broadcast sizes instead
    args.in_args[where] = "block_sizes"
    if forward:
        args.in_arrays[where] = _block_sizes(args.in_arrays[where], p.batch, p.heads)
        cfg = Sm90Blk64Forward(p.head_dim, p.dtype, p.layout, float(p.softmax_scale))
    else:  # the backward reads them per batch, [B, nKV]
        clamped = jnp.clip(args.in_arrays[where], 0, BLOCK)
        args.in_arrays[where] = jnp.broadcast_to(clamped[None, :], (p.batch, clamped.shape[0]))
        cfg = Sm90Blk64Backward(p.head_dim, p.dtype, p.layout, float(p.softmax_scale), p.select_capacity)
    fn = _callable(cfg, tuple(args.in_args), tuple(args.out_args), args.result_args,
                   tuple((tuple(r.shape), jnp.dtype(r.dtype).name) for r in result_types),
                   tuple(sorted(args.aliases)))
    return tuple(fn(*args.in_arrays))


def cudnn_sm90_forward(q, k, v, sel_idx, sel_num, kv_counts, *, softmax_scale: Optional[float] = None,
                       layout: str = "bhsd"):
    """cuDNN BSA's sm_90 forward over 64-token blocks as one XLA custom call; returns (out, lse).

    q, k, v: [B, H, S, D] ("bhsd") or [B, S, H, D] ("bshd"), S a multiple of 64, one KV head per
    query head. sel_idx [B, H, S/64, C] int32: KV blocks per query block, ascending, in [0, S/64);
    sel_num [B, H, S/64] int32: how many of them count (<= C). kv_counts [S/64] int32: valid
    tokens at the start of each KV block (clamped to [0, 64] here; the kernel masks the rest).
    out: q's shape and dtype; lse [B, H, S] fp32, natural log, -inf on rows that see nothing.
    """
    if layout not in _QKO_MODE:
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one rank-4 shape, got {q.shape}, {k.shape}, {v.shape}")
    b, h, s, d = q.shape if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    dtype = jnp.dtype(q.dtype).name
    if dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must be one of {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in HEAD_DIMS or s % BLOCK:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} and S a multiple of {BLOCK}, got D={d}, S={s}")
    n = s // BLOCK
    if sel_idx.ndim != 4 or sel_idx.shape[:3] != (b, h, n) or sel_idx.dtype != jnp.int32:
        raise ValueError(f"sel_idx must be int32 [B, H, S/64, C] = [{b}, {h}, {n}, C], got {sel_idx.dtype} {sel_idx.shape}")
    if sel_num.shape != (b, h, n) or sel_num.dtype != jnp.int32:
        raise ValueError(f"sel_num must be int32 [{b}, {h}, {n}], got {sel_num.dtype} {sel_num.shape}")
    if kv_counts.shape != (n,) or kv_counts.dtype != jnp.int32:
        raise ValueError(f"kv_counts must be int32 [{n}], got {kv_counts.dtype} {kv_counts.shape}")
    cfg = Sm90Blk64Forward(d, dtype, layout, float(d ** -0.5 if softmax_scale is None else softmax_scale))
    results = ((tuple(q.shape), dtype), ((b, h, s), "float32"))
    fn = _callable(cfg, ("q", "k", "v", "sel_idx", "sel_num", "block_sizes"), ("out", "lse"), ("out", "lse"),
                   results, ())
    out, lse = fn(q, k, v, sel_idx, sel_num, _block_sizes(kv_counts, b, h))
    return out, lse
