"""The sm90 backward's host side: a configuration -> its kernel object (`backward_kernel`: the base
kernel of `sm90_bwd64` or the split one of `sm90_bwd64_split`, for the eager launcher and the JAX
native call alike), the launch's checks, its compilation once per configuration and dtype, and the
launch itself on torch tensors (`prepare_backward64`: dq_accum zeroed, the main kernel, the dQ
postprocess). The kernels and how they work: `sm90_bwd64`'s docstring."""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute

from .sm90_bwd64 import BLOCK, BlockSparseBwd64Sm90, DqPostprocess
from .sm90_bwd64_groups import CHUNK_MAX, flags_in_use, group_blocks, group_workspace_shapes
from .sm90_bwd64_split import BlockSparseBwd64Sm90Split
from .sm90_common import (broadcast_dims, compile_for_torch, cute_tensor, cutlass_dtype, layout_key, remember,
                          resident_ctas)


def grid_chunk(device_ordinal: Optional[int]) -> int:
    """The split kernel's grid chunk on a device (`BlockSparseBwd64Sm90Split._tile`); None: CHUNK_MAX,
    for a launch built before its device is known (XLA lowers without one). The chunk orders the grid
    only: the results are the same for any chunk."""
    if device_ordinal is None:
        return CHUNK_MAX
    return min(CHUNK_MAX, resident_ctas(device_ordinal))


def launch_chunk(config: dict, n_kv: int, device_ordinal: Optional[int]) -> int:
    """The split kernel's run-time chunk for `config`: with head_sweep a head's KV blocks (every query
    group runs over the whole head before the next: Q / dO / dQ of a group come into L2 once a head),
    else the device's `grid_chunk`."""
    return n_kv if config.get("head_sweep") else grid_chunk(device_ordinal)


# ---- host launcher ------------------------------------------------------------------------------
# As the forward's (sm90_fwd64): a launch calls the compiled functions with the torch tensors themselves
# (`sm90_common.compile_for_torch`, TVM-FFI), its checks run once per problem (`_PLANS`, keyed by the
# options and `layout_key` of every tensor), and the kernels are built once per configuration and dtype
# (`_COMPILED`): shapes and strides are run-time values of one build.
MAIN_ARGS = ("q", "k", "v", "dout", "lse", "delta", "dq_accum", "dk", "dv", "inv_idx", "inv_num", "kv_counts",
             "dk_pool", "dv_pool", "dkv_partial", "group_flags")  # the main kernel's tensor arguments, in order
# the ones read with 16-byte alignment (TMA, bulk copies, vector stores); the rest 4
ALIGN16_ARGS = frozenset({"q", "k", "v", "dout", "lse", "delta", "dq_accum", "dk", "dv", "dkv_partial"})
# the split kernel's options: refused without split=True (`check_config`)
SPLIT_OPTIONS = ("dq_bulk", "q_group_bytes", "persistent", "head_sweep", "k_in_regs", "v_in_regs", "p_early",
                 "p_rounded", "l2_hints")
SPLIT_ONLY = (f"sm90_bwd64: {', '.join(SPLIT_OPTIONS[:-1])} and {SPLIT_OPTIONS[-1]} are options of the split "
              "kernel (give split=True)")
_COMPILED = {}  # compile key (configuration, dtype, broadcast dims) -> (main kernel, dQ postprocess), compiled
_PLANS = {}     # problem key -> the compiled pair of a problem whose checks passed


def _layout_of(x):
    """"bhsd" / "bshd" when the [B, H, S, D] view x is that contiguous layout (what the Triton
    preprocess addresses), else None."""
    B, H, S, D = x.shape
    if x.stride() == (H * S * D, S * D, D, 1):
        return "bhsd"
    if x.stride() == (S * H * D, D, H * D, 1):
        return "bshd"
    return None


def backward_delta(out, dout, delta=None):
    """delta = rowsum(dout * out) [B, H, Sq] fp32 by the Triton preprocess (our kernel for it), or by
    torch for views the preprocess does not address (strides other than BHSD / BSHD contiguous)."""
    import torch
    from ..problem import AttnProblem
    from .. import stages  # the preprocess is a shared stage
    from ..launch import eager_launcher

    B, H, Sq, D = dout.shape
    if delta is None:
        delta = torch.empty(B, H, Sq, dtype=torch.float32, device=dout.device)
    layout = _layout_of(dout)
    if layout is None or _layout_of(out) != layout:
        delta.copy_((dout.float() * out.float()).sum(-1))
        return delta
    p = AttnProblem(batch=B, heads=H, q_len=Sq, kv_len=Sq, head_dim=D, block_elems=BLOCK,
                    dtype=str(dout.dtype).replace("torch.", ""), layout=layout, selection="indices")
    raw = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(1, 2))
    stages.backward_preprocess(eager_launcher, p, raw(out), raw(dout), delta)
    return delta


def check_config(config: dict) -> None:
    """ValueError unless `config` (`prepare_backward64`'s options) is one the kernels have: run by the
    eager launcher's checks and by `backward_kernel`, so both frontends refuse the same."""
    if any(config.get(name) for name in SPLIT_OPTIONS) and not config.get("split"):
        raise ValueError(SPLIT_ONLY)
    if config.get("q_group_bytes") and config.get("list_in_smem"):
        raise ValueError("sm90_bwd64: q_group_bytes and list_in_smem do not go together (the groups read the list "
                         "from global memory)")
    if config.get("persistent") and config.get("list_in_smem"):
        raise ValueError("sm90_bwd64: persistent and list_in_smem do not go together (the list window is filled "
                         "once per CTA)")
    if config.get("head_sweep") and config.get("persistent"):
        raise ValueError("sm90_bwd64: head_sweep sets the grid's chunk to a head's KV blocks; it does not go with "
                         "persistent (whose chunk is the grid's size)")
    if config.get("stages", 2) < 2:
        raise ValueError(f"sm90_bwd64 needs stages >= 2 (the Q / dO ring), got {config['stages']}")


def backward_kernel(dtype, head_dim: int, *, stages: int = 2, dq_red: bool = True, dk_overlap: bool = True,
                    split: bool = False, list_in_smem: bool = False, dq_bulk: bool = False, q_group_bytes: int = 0,
                    persistent: bool = False, head_sweep: bool = False, k_in_regs: bool = False,
                    v_in_regs: bool = False, p_early: bool = False, p_rounded: bool = False, l2_hints: bool = False,
                    pool_grads: bool = False, ignore_padding: bool = False):
    """The main kernel of one configuration (`prepare_backward64`'s options; `split` picks
    `sm90_bwd64_split`, whose dq_red and dk_overlap are its own): the one place a configuration
    becomes a kernel object, for the eager launcher and the JAX native call alike. head_sweep is the
    launch's chunk (`launch_chunk`), not part of the build."""
    check_config(dict(stages=stages, split=split, list_in_smem=list_in_smem, dq_bulk=dq_bulk,
                      q_group_bytes=q_group_bytes, persistent=persistent, head_sweep=head_sweep, k_in_regs=k_in_regs,
                      v_in_regs=v_in_regs, p_early=p_early, p_rounded=p_rounded, l2_hints=l2_hints))
    flags = dict(pool_grads=pool_grads, ignore_padding=ignore_padding, list_in_smem=list_in_smem)
    if split:
        return BlockSparseBwd64Sm90Split(dtype, head_dim, stages, dq_bulk=dq_bulk,
                                         q_group_blocks=group_blocks(q_group_bytes, head_dim), persistent=persistent,
                                         k_in_regs=k_in_regs, v_in_regs=v_in_regs, p_early=p_early,
                                         p_rounded=p_rounded, l2_hints=l2_hints, **flags)
    return BlockSparseBwd64Sm90(dtype, head_dim, stages, dq_red=dq_red, dk_overlap=dk_overlap, **flags)


def sparse_backward64(q, k, v, out, dout, lse, dq, dk, dv, inv_idx, inv_num, kv_counts, **options):
    """Runs the backward once on torch CUDA tensors, on torch's current stream; `delta` (optional) is
    computed from out and dout when not given (`prepare_backward64` has the arguments)."""
    delta = options.pop("delta", None)
    if delta is None:
        delta = backward_delta(out, dout)
    prepare_backward64(q, k, v, dout, lse, delta, dq, dk, dv, inv_idx, inv_num, kv_counts, **options)()


def prepare_backward64(q, k, v, dout, lse, delta, dq, dk, dv, inv_idx, inv_num, kv_counts, *,
                       softmax_scale: Optional[float] = None, stages: int = 2, dq_red: bool = True,
                       dk_overlap: bool = True, dq_accum=None, dq_pool=None, dk_pool=None, dv_pool=None,
                       q_counts=None, ignore_padding: bool = False, split: bool = False,
                       list_in_smem: bool = False, dq_bulk: bool = False, q_group_bytes: int = 0,
                       persistent: bool = False, head_sweep: bool = False, k_in_regs: bool = False,
                       v_in_regs: bool = False, p_early: bool = False, p_rounded: bool = False,
                       l2_hints: bool = False, dkv_partial=None, group_flags=None,
                       grid_chunk_blocks: Optional[int] = None):
    """Checks the arguments, compiles on first use of a configuration, and returns a callable that
    launches the backward on torch's current stream at the time of this call: dq_accum zeroed, the
    main kernel, the dQ postprocess (the tensors' CuTe views are built once here: timing the callable
    leaves the per-call host conversion out).

    q, k, v, dout, dq, dk, dv (bf16 / fp16): [B, H, S, D] views, BHSD or a BSHD tensor transposed;
    lse, delta [B, H, Sq] fp32; inv_idx [B, H, nKV, capacity], inv_num [B, H, nKV], kv_counts [nKV]
    int32. dq_accum: an fp32 workspace [B, H, nQ, 64 * D] (allocated here when not given).
    VSA: dq_pool [B, H, nQ, D], dk_pool / dv_pool [B, H, nKV, D] fp32 and q_counts [nQ] int32 (all or
    none): the mean pooling's gradients, dx_pool[block] / count added to every row of the block (to
    its valid rows only with ignore_padding), in the dQ postprocess and the dK / dV epilogue.
    split: the GEMMs over two cooperating warpgroups and a producer (`sm90_bwd64_split`; dq_red and
    dk_overlap are its own, `stages` its Q / dO ring; dq_bulk its dQ through a staging buffer;
    q_group_bytes its query groups' working-set budget, 0 for none: dkv_partial and group_flags are
    their workspaces, `group_workspace_shapes`, allocated here when not given; group_flags is zeroed
    by the launch where the kernel reads it, `flags_in_use`; grid_chunk_blocks: the grid's chunk,
    `grid_chunk` of the device unless given (tests: a small one runs the ring of partial sums over many
    generations); head_sweep: the chunk is a head's KV blocks (`launch_chunk`; the ring holds one
    head); persistent: at most that many CTAs, each taking tiles from a counter; k_in_regs / v_in_regs:
    warpgroup 1's S^T = K Q^T reads K, warpgroup 2's dP^T = V dO^T reads V from registers, loaded once a tile;
    p_early: warpgroup 2 reads P under its dP; p_rounded: P handed over in the input dtype (dS from the
    rounded P); l2_hints: Q / dO loads evict_last, K / V evict_first)."""
    import cuda.bindings.driver as cuda
    import torch

    B, H, Sq, D = q.shape
    if dq_accum is None:
        dq_accum = torch.empty(B, H, Sq // BLOCK, BLOCK * D, dtype=torch.float32, device=q.device)
    n_kv = k.shape[2] // BLOCK
    shapes = group_workspace_shapes(Sq // BLOCK, n_kv, D, q_group_bytes, head_sweep)
    if dkv_partial is None:
        dkv_partial = torch.empty(shapes["dkv_partial"][0], dtype=torch.float32, device=q.device)
    if group_flags is None:
        group_flags = torch.empty(shapes["group_flags"][0], dtype=torch.int32, device=q.device)
    config = dict(stages=stages, dq_red=dq_red, dk_overlap=dk_overlap, split=split, list_in_smem=list_in_smem,
                  dq_bulk=dq_bulk, q_group_bytes=q_group_bytes, persistent=persistent, head_sweep=head_sweep,
                  k_in_regs=k_in_regs, v_in_regs=v_in_regs, p_early=p_early, p_rounded=p_rounded, l2_hints=l2_hints)
    zero_flags = flags_in_use(Sq // BLOCK, D, q_group_bytes, persistent)
    pool_grads = dq_pool is not None
    ignore_padding = bool(ignore_padding and pool_grads)
    tensors = (q, k, v, dout, lse, delta, dq, dk, dv, inv_idx, inv_num, kv_counts, dq_accum, dq_pool, dk_pool, dv_pool,
               q_counts, dkv_partial, group_flags)
    key = (tuple(config.values()), ignore_padding, layout_key(*tensors))
    fns = _PLANS.get(key)
    if fns is None:
        _check_backward64(*tensors, config, shapes)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    lists = [inv_idx.contiguous(), inv_num.contiguous(), kv_counts.contiguous()]
    placeholder = lse  # never read when pool_grads is off
    pool_kv = [dk_pool.contiguous(), dv_pool.contiguous()] if pool_grads else [placeholder, placeholder]
    pool_q = [dq_pool.contiguous(), q_counts.contiguous()] if pool_grads else [placeholder, placeholder]
    main_args = [q, k, v, dout, lse, delta, dq_accum, dk, dv, *lists, *pool_kv, dkv_partial, group_flags]
    post_args = [dq_accum, dq, *pool_q]
    if fns is None:
        fns = remember(_PLANS, key, _compiled_backward64(main_args, post_args, pool_grads, ignore_padding, config))
    main_fn, post_fn = fns
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    if grid_chunk_blocks is None:
        chunk = launch_chunk(config, n_kv, q.device.index or 0)
    elif head_sweep:
        raise ValueError("sm90_bwd64: head_sweep sets the grid's chunk (a head's KV blocks); give no grid_chunk_blocks")
    elif not 1 <= grid_chunk_blocks <= CHUNK_MAX:
        raise ValueError(f"sm90_bwd64 needs grid_chunk_blocks in [1, {CHUNK_MAX}] (got {grid_chunk_blocks})")
    else:
        chunk = grid_chunk_blocks

    def launch():
        dq_accum.zero_()
        if zero_flags:
            group_flags.zero_()
        main_fn(*main_args, scale, chunk, stream)
        post_fn(*post_args, scale, stream)

    launch.keep_alive = main_args + [dq] + pool_q  # the contiguous copies the calls read
    return launch


def _check_backward64(q, k, v, dout, lse, delta, dq, dk, dv, inv_idx, inv_num, kv_counts, dq_accum, dq_pool, dk_pool,
                      dv_pool, q_counts, dkv_partial, group_flags, config: dict, group_shapes: dict):
    """ValueError unless the tensors are what the kernels read (shapes, dtypes, strides, alignment) and
    the configuration is one the kernels have."""
    import torch

    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    toks = dict(q=q, k=k, v=v, dout=dout, dq=dq, dk=dk, dv=dv)
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in toks.values()):
        raise ValueError("sm90_bwd64 needs q, k, v, dout, dq, dk, dv of one dtype, bf16 or fp16 (got "
                         + ", ".join(f"{n} {t.dtype}" for n, t in toks.items()) + ")")
    if (D not in (64, 128) or k.shape != (B, H, Skv, D) or v.shape != k.shape or dk.shape != k.shape
            or dv.shape != k.shape or dout.shape != q.shape or dq.shape != q.shape):
        raise ValueError("sm90_bwd64 needs q/dout/dq [B, H, Sq, D] and k/v/dk/dv [B, H, Skv, D] with D 64 or 128 (got "
                         + ", ".join(f"{n} {tuple(t.shape)}" for n, t in toks.items()) + ")")
    if Sq % BLOCK or Skv % BLOCK:
        raise ValueError(f"sm90_bwd64 needs sequence lengths that are multiples of {BLOCK} (got q {Sq}, kv {Skv})")
    nq, nkv = Sq // BLOCK, Skv // BLOCK
    check_config(config)
    expect = dict(lse=((B, H, Sq), torch.float32), delta=((B, H, Sq), torch.float32),
                  dq_accum=((B, H, nq, BLOCK * D), torch.float32),
                  inv_idx=((B, H, nkv, inv_idx.shape[-1]), torch.int32), inv_num=((B, H, nkv), torch.int32),
                  kv_counts=((nkv,), torch.int32))
    expect.update({n: (shape, getattr(torch, dtype)) for n, (shape, dtype) in group_shapes.items()})
    given = dict(lse=lse, delta=delta, dq_accum=dq_accum, inv_idx=inv_idx, inv_num=inv_num, kv_counts=kv_counts,
                 dkv_partial=dkv_partial, group_flags=group_flags)
    pools = (dq_pool, dk_pool, dv_pool, q_counts)
    pool_grads = dq_pool is not None
    if any((x is None) == pool_grads for x in pools):
        raise ValueError("sm90_bwd64: dq_pool, dk_pool, dv_pool and q_counts come together (all or none)")
    if pool_grads:
        expect.update(dq_pool=((B, H, nq, D), torch.float32), dk_pool=((B, H, nkv, D), torch.float32),
                      dv_pool=((B, H, nkv, D), torch.float32), q_counts=((nq,), torch.int32))
        given.update(dq_pool=dq_pool, dk_pool=dk_pool, dv_pool=dv_pool, q_counts=q_counts)
    for name, (shape, dtype) in expect.items():
        t = given[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"sm90_bwd64 needs {name} {list(shape)} {dtype} (got {list(t.shape)} {t.dtype})")
    for name in ("lse", "delta", "dq_accum", "dkv_partial"):
        t = given[name]
        if t.stride(-1) != 1 or any(st % 4 for st in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"sm90_bwd64 needs {name} with a contiguous last dimension, strides in multiples of 4 "
                             "elements and a 16-byte aligned start (bulk copies)")
    if not (dkv_partial.is_contiguous() and group_flags.is_contiguous()):
        raise ValueError("sm90_bwd64 needs dkv_partial and group_flags contiguous")
    if dq_accum.stride(2) != BLOCK * D:
        raise ValueError("sm90_bwd64 needs dq_accum's query blocks contiguous ([B, H, nQ, 64 * D])")
    for name, t in toks.items():
        if t.stride(-1) != 1 or any(st % 8 for st in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"sm90_bwd64 needs {name} with a contiguous head dim, strides in multiples of 8 "
                             "elements and a 16-byte aligned start (TMA)")


def _compiled_backward64(main_args: list, post_args: list, pool_grads: bool, ignore_padding: bool, config: dict):
    """The main kernel and the dQ postprocess of `config` for the dtype and head dim of q = main_args[0],
    compiled on first use with the call's arguments as examples (their CuTe types hold dtype, rank and
    alignment, which the configuration fixes, and the broadcast dims, `broadcast_dims`: one build serves
    every shape and every layout without broadcast dims). Alignment:
    16 bytes for the token tensors, lse, delta, dq_accum (TMA, bulk copies) and dkv_partial (vector
    stores), 4 for the rest."""
    q = main_args[0]
    D = q.shape[3]
    key = (q.dtype, D, pool_grads, ignore_padding, *config.values(), broadcast_dims(main_args + post_args))
    fns = _COMPILED.get(key)
    if fns is None:
        main = backward_kernel(cutlass_dtype(q), D, **config, pool_grads=pool_grads, ignore_padding=ignore_padding)
        post = DqPostprocess(cutlass_dtype(q), D, pool_grads=pool_grads, ignore_padding=ignore_padding)
        fake_stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False)
        main_c = [cute_tensor(t, 16 if name in ALIGN16_ARGS else 4) for name, t in zip(MAIN_ARGS, main_args)]
        post_c = [cute_tensor(post_args[0]), cute_tensor(post_args[1]), *(cute_tensor(t, 4) for t in post_args[2:])]
        fns = _COMPILED[key] = (compile_for_torch(main, main_c, cutlass.Float32(1.0), cutlass.Int32(1), fake_stream),
                                compile_for_torch(post, post_c, cutlass.Float32(1.0), fake_stream))
    return fns
