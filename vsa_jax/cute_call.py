"""CuTe DSL kernels as XLA custom calls, with no torch and no Python per call (prototype, issue 23).

The first kernel wired this way is cuDNN frontend 1.32's sm_90 block-sparse forward with 64-token
blocks (`BlockSparseAttnForwardSm90Blk64`, the kernel the cudnn backend runs at E = 64): through
nvidia-cutlass-dsl 4.8.1's `cutlass.jax.cutlass_call`, the public bridge cuDNN's own SM100 JAX BSA
uses (`cudnn.jax.call` is a thin wrapper over it). What happens (design note:
benchmarks/results/2026-12-02-jax-cute-design.md):

- at trace time `cutlass_call` binds a primitive; at lowering (jit's first call for a shape, on
  the host, no GPU needed) CuTe DSL traces our `@cute.jit` adapter below over XLA FFI buffer
  descriptors, compiles it for sm_90a and emits one `stablehlo.custom_call` to the CuTe DSL
  runtime's typed FFI handler (`CuteDSLRT_NvJaxCutlassCall_v2`), the compiled object (host
  launcher + cubin) inlined in the call's attributes;
- when XLA instantiates the executable, the runtime loads that object once; each call runs the
  host launcher in C++ on XLA's stream (the FFI `PlatformStream`): no Python, no torch, and the
  handler is the CUDA-graph-capturable variant (`allow_cuda_graph=True`), so XLA may put it in a
  command buffer;
- the outputs (out, lse) are XLA buffers, results of the custom call.

Scope of this prototype: forward only (no VJP is defined: cutlass_call has none; the frontend
wraps forward and backward custom calls in its own jax.custom_vjp), both layouts, bf16/fp16,
head dim 64/128, query-owned lists with counts (`allow_empty_block_nums=True`: an empty row
gives out 0, lse -inf) and per-block valid-token counts (block_sizes). Not wired in
`vsa_jax` yet: nothing calls this module but its tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

BLOCK = 64                      # the sm_90 blk64 kernel: 64-token query and KV blocks
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
GPU_ARCH = "sm_90a"             # compiled for this arch whatever the host has (cuDNN's SM100 JAX BSA: sm_100a)
TOKEN_ALIGN = 128               # bytes: what cuDNN's torch path assumes for q/k/v/out (TMA)
TESTED = {"nvidia-cudnn-frontend": "1.32.0", "nvidia-cutlass-dsl": "4.8.1"}

# Logical mode order the kernel wants, as a permutation of the JAX array's dimensions (TensorSpec
# mode: logical mode i = array dim mode[i]; no data moves). The kernel reads Q/K/O as
# (S, D, H, B) with D contiguous and V as (D, S, H, B): the permutations cuDNN's torch path
# applies to BHSD tensors before from_dlpack (_interface.py, _bsa_attn_fwd_sm90_blk64).
_QKO_MODE = {"bhsd": (2, 3, 1, 0), "bshd": (1, 3, 2, 0)}
_V_MODE = {"bhsd": (3, 2, 1, 0), "bshd": (3, 1, 2, 0)}
_MODE3 = (2, 1, 0)       # lse [B,H,S] -> (S,H,B); counts [B,H,nQ] -> (nQ,H,B); block sizes [B,H,nKV]
_MODE4 = (3, 2, 1, 0)    # lists [B,H,nQ,C] -> (C,nQ,H,B)


def library_error() -> Optional[str]:
    """None when the kernel class and the JAX bridge import (no torch needed), else why not."""
    try:
        import cutlass.jax
        if not cutlass.jax.is_available():
            return "cutlass.jax (nvidia-cutlass-dsl's JAX bridge) is not available with this jax"
        from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import (  # noqa: F401
            BlockSparseAttnForwardSm90Blk64)
    except Exception as e:  # ImportError, or a CUDA-python / DSL setup that fails at import
        return f"{type(e).__name__}: {e}"
    return None


@dataclasses.dataclass(frozen=True)
class Sm90Blk64Forward:
    """One compiled specialization (shapes are added by cutlass_call's own cache key)."""
    head_dim: int
    dtype: str
    layout: str
    softmax_scale: float


@functools.lru_cache(maxsize=None)
def _adapter_class():
    """The @cute.jit adapter (defined on first use: importing this module needs no CuTe DSL)."""
    import cutlass
    import cutlass.cute as cute
    from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import BlockSparseAttnForwardSm90Blk64

    class Adapter:
        """cutlass_call's calling convention (stream, *inputs, *outputs) -> the kernel's
        (q, k, v, o, lse, lists, counts, block_sizes, split_offsets, scale, stream)."""

        def __init__(self, cfg: Sm90Blk64Forward):
            dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.dtype]
            self.kernel = BlockSparseAttnForwardSm90Blk64(
                gqa_ratio=1, head_dim=cfg.head_dim, value_dim=cfg.head_dim, blocksparse_blocksize_q=BLOCK,
                blocksparse_blocksize_k=BLOCK, dtype=dtype, acc_dtype=cutlass.Float32, has_block_sizes=True,
                num_splits=1, allow_empty_block_nums=True)
            self.scale = cfg.softmax_scale

        @cute.jit
        def __call__(self, stream, q, k, v, sel_idx, sel_num, block_sizes, out, lse):
            # split offsets are read only with num_splits > 1: sel_num stands in (as in cuDNN's torch path)
            self.kernel(q, k, v, out, lse, sel_idx, sel_num, block_sizes, sel_num, self.scale, stream)

    return Adapter


def _versions() -> tuple:
    from importlib.metadata import version
    return tuple((name, version(name)) for name in sorted(TESTED))


@functools.lru_cache(maxsize=None)
def _call(cfg: Sm90Blk64Forward, q_shape: tuple, lse_shape: tuple):
    """The cutlass_call callable of one specialization (cached: one trace of it per shape)."""
    import cutlass.jax
    from cutlass.jax import TensorSpec
    tok = TensorSpec(mode=_QKO_MODE[cfg.layout], ptr_assumed_align=TOKEN_ALIGN)
    val = TensorSpec(mode=_V_MODE[cfg.layout], ptr_assumed_align=TOKEN_ALIGN)
    f32 = TensorSpec(mode=_MODE3, ptr_assumed_align=4)
    i3 = TensorSpec(mode=_MODE3, ptr_assumed_align=4)
    i4 = TensorSpec(mode=_MODE4, ptr_assumed_align=4)
    dtype = jnp.dtype(cfg.dtype)
    return cutlass.jax.cutlass_call(
        _adapter_class()(cfg),
        output_shape_dtype=(jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)),
        input_spec=(tok, tok, val, i4, i3, i3),
        output_spec=(tok, f32),
        compile_options=f"--gpu-arch={GPU_ARCH}",
        # identifies the kernel body and its captured state (cutlass_call adds shapes, specs and the
        # environment): a lowering that hits the cache skips regenerating the IR (~1.7 s measured)
        compile_key=("vsa.cudnn_sm90_blk64_fwd", cfg, _versions()),
        allow_cuda_graph=True,
    )


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
    scale = float(d ** -0.5 if softmax_scale is None else softmax_scale)
    cfg = Sm90Blk64Forward(d, dtype, layout, scale)
    # the kernel reads block sizes per (b, h) as a compact [B, H, nKV] array (cutlass.jax passes
    # compact layouts only: no stride-0 view); XLA fuses the clamp and broadcast into one small write
    sizes = jnp.broadcast_to(jnp.clip(kv_counts, 0, BLOCK)[None, None, :], (b, h, n))
    out, lse = _call(cfg, tuple(q.shape), (b, h, s))(q, k, v, sel_idx, sel_num, sizes)
    return out, lse


def lower_for_cuda(fn, *args):
    """StableHLO text of jax.jit(fn) lowered for CUDA, on any host (jax.export's cross-platform
    lowering): compiles the CuTe kernels, needs no GPU. For tests and inspection."""
    import cutlass.jax
    exported = jax.export.export(jax.jit(fn), platforms=("cuda",),
                                 disabled_checks=cutlass.jax.get_export_disabled_safety_checks())(*args)
    return exported.mlir_module()


SM90_MAX_SMEM_PER_SM = 233472  # bytes (228 KiB): cudaDevAttrMaxSharedMemoryPerMultiprocessor on H100/H200


@contextlib.contextmanager
def compile_without_gpu():
    """For compiling on a host with no NVIDIA driver only (tests, compile checks): the kernel's
    launch (min_blocks_per_mp > 1) makes CuTe DSL ask the driver for the shared memory per SM,
    which is answered here with sm_90's value. Never used on a GPU."""
    import cutlass.base_dsl.runtime.cuda as helpers
    original = helpers.get_device_attribute
    attr = helpers.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR

    def get_device_attribute(attribute, device_id=0):
        return SM90_MAX_SMEM_PER_SM if attribute == attr else original(attribute, device_id)

    helpers.get_device_attribute = get_device_attribute
    try:
        yield
    finally:
        helpers.get_device_attribute = original
