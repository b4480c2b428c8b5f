"""cuDNN backend: NVIDIA cuDNN frontend's block-sparse attention (`cudnn.BSA`) for the fine stage.

Same contract as the Triton and CuTe backends (`base.FineStageBackend`: `sparse_forward` /
`sparse_backward` on the buffers of `AttnProblem.forward_buffers` / `backward_buffers`, same outputs). The
kernels are CuTe DSL kernels shipped in nvidia-cudnn-frontend 1.32.0 (no libcudnn
call); the package is imported lazily: importing vsa_core never needs it.

What it runs (read from nvidia-cudnn-frontend 1.32.0, python/cudnn/block_sparse_attention/):
- forward: at E = 64 the sm_90 "blk64" kernel that `_interface.bsa_attn_fwd` (the function
  behind the public `block_sparse_attention_forward`, which has no `out=`/`lse=` arguments)
  runs, compiled and called here with the arguments that function gives it
  (`_blk64_forward`: its Python wrapper's per-call conversions were most of the host time),
  writing out and lse straight into ours through strided views, either layout; at E = 128
  (the sm_90 "blk128" kernel, which allocates its outputs) `bsa_attn_fwd` itself, with
  sparse_block_size = E, and out and lse are copied into our buffers.
- backward: at E = 64 the two kernel classes that the public `block_sparse_attention_backward`
  runs there (`cudnn_kernels.Blk64Backward`: its K-to-Q lists rebuilt from the query-owned lists
  on every call, then its sm_90 blk64 backward), constructed as that wrapper does and called
  without it (`_blk64_backward`), in workspaces of the plan (`blk64_backward_workspaces`), the same
  class under JAX (`vsa_jax.cudnn_call`); at E = 128 the wrapper itself, with dq/dk/dv given
  (`dq_tensor=...`). Gradients are written into our buffers, either layout. CuTe kernels with
  atomics: the order of the K-to-Q lists, and hence dK/dV's summation order, and dQ's atomic adds,
  are not deterministic run to run.
- selection: our own. `sel_idx` [B, H, nQ, capacity] (ascending, int32) and `sel_num`
  [B, H, nQ] go in as q2k_block_index / q2k_block_nums, and `kv_counts` (valid tokens
  at the start of each block) as block_sizes [nKV]: the kernels mask KV tokens at or past
  a block's size. cuDNN reads these as given, so they must be in bounds: the lists are
  ours (top-k, from a block map, or a caller's lists rewritten by `clean_lists_kernel`
  in `vsa_core.ops.forward`: ascending, in [0, nKV), counts within the capacity), and
  kv_counts are clamped to [0, E] here (one [nKV] int32 copy per call; a count above E
  would let the last block's tokens run past the end of K/V). Nothing is synchronised
  with the host.
  `allow_empty_block_nums=True`: a query block with no (or only empty) blocks gives
  out 0 and lse -inf (the kernel's "empty-safe" finaliser; without it such rows are NaN).
- lse: natural-log fp32 [B, H, Sq], -inf where a row sees nothing: our contract as is.
  The backward takes it back in the same form (it converts to log2 itself). With the
  coarse branch and padding="ignore", `mix_coarse` sets the padded query rows' lse to +inf
  (out and out_fine to 0 there), so the backward's probabilities are 0 on those rows.
- coarse mixing (VSA): like the CuTe backend, `mix_coarse` turns the fine output in
  `out` into out_fine + gate * out_c in place and, training, keeps the fine output
  (`out_fine`, in q's dtype: `AttnProblem.fine_residual`, the values cuDNN wrote).
- backward delta: cuDNN's backward forms delta = rowsum(O * dO) from the O it is given
  and has no dlse input. With the coarse branch we give it O = out_fine (the fine
  output's own values, in q's dtype), so its delta is our rowsum(dO * out_fine) up to
  summation order: FlashAttention's recipe from a bf16 O, as in the CuTe backend.
- pooling gradients (VSA): cuDNN writes dq/dk/dv of the fine branch; then
  `add_block_grad` adds dq_pool/q_count, dk_pool/kv_count, dv_pool/kv_count in place
  (padding="ignore": to the valid rows only, 0 to the padded ones).
- padding="ignore": the kernels mask the padded keys (past block_sizes) in the scores but
  multiply the padded rows of V, K, Q and dO by zero weights in P @ V, dS @ K, dS^T @ Q and
  P^T @ dO (0 * inf is NaN), so under "ignore" they read copies with the padded rows
  written 0 (`valid_rows_copy`): K and V in the forward, Q, K, V and dO in the backward; one
  extra read and write of each per call. padding="zeros" copies nothing.
- a static prefix (`prefix_blocks` > 0, not packed): the dense prefix query rows run as a
  forward call of their own on a high-priority stream, concurrently with the call over the
  other rows, so that their long tiles start first instead of forming the tail of cuDNN's
  grid (`_prefix_first_forward` says why; the backward is one call as without a prefix).
- streams: every cuDNN BSA launch goes to `torch.cuda.current_stream()` of the current
  device, which is the caller's (under JAX, `runtime.caller_stream` makes XLA's stream
  torch's current one; the backend's arguments are torch views of XLA's buffers), except
  the prefix rows' forward: a high-priority stream that waits for the caller's before and
  that the caller's waits for after (also under CUDA graph capture: a fork and a join).

What it supports (sm_90 only: the architecture this is wired and tested for): forward
bf16/fp16, head dim 64/128, 64- and 128-token blocks; backward bf16 and head dim 128
only (one KV head per query head: always ours). A call that may need a backward
(`problem.training`, which the frontends set whenever gradients may be asked for) is
refused where the backward cannot run, so training never mixes two backends; inference
(torch.no_grad or no input requiring grad) of fp16 or head dim 64 runs the forward here.
256-token blocks are not handled (the CuTe backend is faster there).

Launches and allocation: cuDNN's forward and backward run as the steps "cudnn_fwd" / "cudnn_bwd"
(`launcher.cute`, declared in `CUTE_STEPS`), each on torch views of its buffers; the copies of
padding="ignore" and the coarse mix are Triton launches (the copies into scratch buffers from
`launcher.workspace`, declared in `workspaces(stage, problem)`), so a captured stage replays
(`vsa_core.replay`) like the Triton backend's. Inside its steps this backend and cuDNN's wrappers
allocate (on the current stream, torch's caching allocator): the clamped block sizes and their
[B, H, nKV] copy per forward, the clamped block sizes per backward (at E = 128 the wrapper's K-to-Q
lists and fp32 workspace too); with a static prefix also a copy of the counts and the prefix rows'
lists, out and lse per forward.
"""

from __future__ import annotations

import threading
from typing import Optional

from ..problem import AttnProblem
from ..runtime import DeviceInfo, caller_stream
from ..stages import add_block_grad, mix_coarse, valid_rows_input, valid_rows_workspaces
from .availability import gpu_reason, library_probe, library_reason
from .base import FineBackward, FineForward

name = "cudnn"
replayable = True  # its launches: Triton copies and mixes, two steps calling cuDNN BSA, on the call's buffers
TESTED_VERSION = "1.32.0"
INSTALL_HINT = "pip install 'vsa[cudnn]' (nvidia-cudnn-frontend[cutedsl]==1.32.0, nvidia-cutlass-dsl==4.8.1)"

BLOCK_ELEMS = (64, 128)         # cuDNN BSA's sparse block sizes on sm_90; our blocks map one to one
BACKWARD_DTYPE = "bfloat16"     # its sm_90 backward: bf16, head dim 128
BACKWARD_HEAD_DIM = 128
ALIGN = 128                     # its sm_90 blk64 forward compiles q/k/v/out with assumed_align=128 (bytes)


# ---- availability --------------------------------------------------------------------------
@library_probe
def _kernels_import_error() -> Optional[str]:
    """None when cuDNN frontend's sm_90 blk64 kernel classes import (CuTe DSL, no torch), else the error."""
    import cudnn
    version = getattr(cudnn, "__version__", "?")
    if version != TESTED_VERSION:
        # we compile its kernel classes with the arguments its wrappers give them (`_blk64_forward`,
        # vsa_jax.cudnn_call): only the tested version is trusted
        return f"nvidia-cudnn-frontend {version} is installed, the cudnn backend is tested with {TESTED_VERSION}"
    from cudnn.block_sparse_attention.csrc.bwd.bucketed_k2q_csr import BucketedK2QCsrUniversal  # noqa: F401
    from cudnn.block_sparse_attention.csrc.bwd.sm90_blk64.bsa_bwd_sm90 import (  # noqa: F401
        BlockSparseAttnBackwardSm90Blk64)
    from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import (  # noqa: F401
        BlockSparseAttnForwardSm90Blk64)
    return None


@library_probe
def _wrapper_import_error() -> Optional[str]:
    """None when cuDNN frontend's torch wrapper of BSA imports (it needs torch), else the error."""
    from cudnn.block_sparse_attention import _interface  # noqa: F401  (compiles nothing yet)
    from cudnn.block_sparse_attention import api  # noqa: F401
    return None


@library_probe
def _torch_import_error() -> Optional[str]:
    import torch  # noqa: F401
    return None


def _cudnn_import_error() -> Optional[str]:
    """None when everything this backend's eager launches import does, else the first error."""
    return _kernels_import_error() or _wrapper_import_error()


def library_error() -> Optional[str]:
    """Why this backend's library cannot be used here (None when it can): for strict test runs."""
    return _cudnn_import_error()


def needs_wrapper(problem: AttnProblem) -> bool:
    """Whether a call of `problem` needs cuDNN's torch wrapper in every frontend: its 128-token
    kernels and the forward that runs a static prefix apart are called through it. The rest runs
    the kernel classes directly: torch's eager launches, and JAX's native calls with no torch
    (`vsa_jax.cudnn_call`)."""
    return problem.block_elems != 64 or prefix_first(problem)


def unavailable_reason(problem: AttnProblem, device: DeviceInfo):
    reason = gpu_reason(device, lambda cap: cap[0] == 9,
                        "the cudnn backend runs cuDNN BSA's sm_90 kernels (H100/H200)")
    if reason is not None:
        return reason
    if problem.block_elems not in BLOCK_ELEMS:
        return (f"{problem.block_elems}-token blocks: cuDNN BSA's sm_90 kernels take blocks of {BLOCK_ELEMS} tokens "
                "(256-token blocks run on the cute or triton backend)")
    if problem.training and (problem.dtype != BACKWARD_DTYPE or problem.head_dim != BACKWARD_HEAD_DIM):
        return (f"cuDNN BSA's sm_90 backward needs {BACKWARD_DTYPE} and head dim {BACKWARD_HEAD_DIM} "
                f"(got {problem.dtype}, head dim {problem.head_dim}) and this call may need a backward; "
                "its forward runs in inference (torch.no_grad(), or no input requiring grad)")
    library = "cuDNN frontend's block-sparse attention"
    error = _kernels_import_error()
    if error is None and _torch_import_error() is not None and not needs_wrapper(problem):
        return None  # no torch, so a JAX call: its native calls run the kernel classes (vsa_jax.cudnn_call)
    if error is None and needs_wrapper(problem):
        why = "128-token blocks" if problem.block_elems != 64 else "a static prefix's forward"
        return library_reason(f"{library} (its torch wrapper, which runs {why})", _wrapper_import_error(),
                              INSTALL_HINT + " and torch")
    return library_reason(library, error or _wrapper_import_error(), INSTALL_HINT)


def _eager_launch_error(error: str) -> RuntimeError:
    return RuntimeError(
        f"the cudnn backend's eager launches run on torch tensors and call cuDNN frontend's torch wrapper "
        f"({error}); without torch only JAX's native calls run this backend (64-token blocks, no static prefix "
        "in the forward; vsa_jax.set_launch('auto' or 'native'), not under jax.vmap)")


def _cudnn():
    """cuDNN's torch wrapper (forward, backward), or a RuntimeError saying what runs without it."""
    error = _wrapper_import_error()
    if error is not None:
        raise _eager_launch_error(error)
    from cudnn.block_sparse_attention import _interface, api
    return _interface.bsa_attn_fwd, api.block_sparse_attention_backward


def _check_aligned(**tensors) -> None:
    for arg, t in tensors.items():
        if t.data_ptr() % ALIGN:
            raise ValueError(f"the cudnn backend needs {arg} to start at a {ALIGN}-byte aligned address "
                             f"(cuDNN BSA's TMA loads assume it); got address {t.data_ptr():#x}")


def _block_sizes(p: AttnProblem, kv_counts):
    """kv_counts clamped to [0, E] (values are not checked under jit / compile; cuDNN reads
    them as given)."""
    return kv_counts.clamp(0, p.block_elems)


# ---- the fine stage -------------------------------------------------------------------------
def sparse_forward(launcher, p: AttnProblem, a: FineForward):
    """The padding copies (Triton launches into workspaces), cuDNN's forward (step "cudnn_fwd"),
    then the coarse mix."""
    # padding="ignore": the kernel multiplies the padded V rows by P = 0 (0 * inf = NaN)
    k, v = (valid_rows_input(launcher, p, "forward", n, x, a.kv_counts) for n, x in (("k", a.k), ("v", a.v)))
    launcher.cute("cudnn_fwd", dict(q=a.q, k=k, v=v, out=a.out, lse=a.lse, sel_idx=a.sel_idx, sel_num=a.sel_num,
                                    kv_counts=a.kv_counts), problem=p)
    if a.out_coarse is not None:
        mix_coarse(launcher, p, a.out, a.lse, a.out_coarse, a.q_counts, gate=a.gate, out_fine=a.out_fine)


def launch_cudnn_forward(buffers: dict, *, problem: AttnProblem):
    """The "cudnn_fwd" launch on framework buffers (`CUTE_STEPS`): cuDNN BSA's forward of q, k, v into
    out and lse with the lists sel_idx / sel_num and the clamped kv_counts, on the caller's stream
    (the prefix rows on a stream of their own: `_prefix_first_forward`). Checks the 128-byte
    alignment of q, k, v and out on every call (a replay's key holds only 16)."""
    if _torch_import_error() is not None:  # JAX's callback path (launch "callback", jax.vmap) with no torch
        raise _eager_launch_error(_torch_import_error())
    from ._torch_views import as_torch_buffers  # torch loads with this backend's first call
    p = problem
    with caller_stream():
        b = as_torch_buffers(buffers, "lse")
        q, k, v, out, lse, sel_idx, sel_num = (b[n] for n in ("q", "k", "v", "out", "lse", "sel_idx", "sel_num"))
        _check_aligned(q=q, k=k, v=v, out=out)
        block_sizes = _block_sizes(p, b["kv_counts"])
        if prefix_first(p):
            _prefix_first_forward(p, q, k, v, out, lse, sel_idx, sel_num, block_sizes)
        else:
            _bsa_forward(p, q, k, v, out, lse, sel_idx, sel_num, block_sizes)


def prefix_first(p: AttnProblem) -> bool:
    """Whether the forward runs a static prefix's dense query rows as a call of their own, on a
    stream of their own (`_prefix_first_forward`), rather than as one call over every row."""
    return bool(p.prefix_blocks) and not p.varlen and p.prefix_blocks < p.n_q_blocks


def _bsa_forward(p: AttnProblem, q, k, v, out, lse, sel_idx, sel_num, block_sizes):
    """cuDNN BSA's forward of the query rows of q into out / lse (views of ours, or None:
    it allocates them); returns its (out, lse)."""
    if p.block_elems == 64 and out is not None and lse is not None:
        _blk64_forward(p, q, k, v, out, lse, sel_idx, sel_num, block_sizes)
        return out, lse
    bsa_fwd, _ = _cudnn()
    direct = p.block_elems == 64 and out is not None  # the blk64 forward writes into a given out/lse
    o, m = bsa_fwd(q, k, v, sel_idx, sel_idx.shape[-1], block_sizes, q2k_block_nums=sel_num,
                   allow_empty_block_nums=True, softmax_scale=p.softmax_scale, return_lse=True,
                   out=out if direct else None, lse=lse if direct else None, layout=p.layout, kv_splits=1,
                   sparse_block_size=p.block_elems)
    if out is not None and not direct:
        out.copy_(o)
        lse.copy_(m)
    return o, m


# ---- the blk64 forward, called without cuDNN's Python wrapper -------------------------------------
# `_interface._bsa_attn_fwd_sm90_blk64` (1.32.0) converts its 9 tensors to CuTe tensors through DLPack
# on every call (its kernel is compiled for CuTe tensor arguments), allocates an lse that
# `bsa_attn_fwd` then copies into ours, and builds the kernel object again: most of the backend's
# host time per forward. Here the same kernel class with the same constructor arguments is compiled
# from the same CuTe tensor types for TVM-FFI calls (`sm90_common.compile_for_torch`), and each call
# passes the same tensors (permuted views of ours, the contiguous lists, block_sizes expanded to
# [B, H, nKV]), only with our lse written directly. One build per dtype, head dims and broadcast dims
# (shapes and strides are run-time values); the argument checks run once per problem, except the
# 128-byte alignment of q, k, v, out: `launch_cudnn_forward` checks it per call, and so does the build.
_BLK64_BUILDS = {}  # (dtype, head dim, broadcast dims) -> compiled function
_BLK64_PLANS = {}   # `layout_key` of the arguments -> the compiled function (the checks passed)
# The CuTe DSL keeps per-compile state on a process-wide singleton (see sm90_backend): a build holds this,
# so threads driving several GPUs (a JAX mesh) do not compile at once.
_BUILD_LOCK = threading.Lock()

# the wrapper's CuTe views of q, k, v, out, lse, the lists, their counts and the block sizes ([B, H, nKV]):
# (permutation of our tensor, alignment in bytes (None: the element's), leading dim); the 9th argument,
# the split offsets, is the counts' view again
_BLK64_VIEWS = (((2, 3, 1, 0), ALIGN, 1), ((2, 3, 1, 0), ALIGN, 1), ((3, 2, 1, 0), ALIGN, 0), ((2, 3, 1, 0), ALIGN, 1),
                ((2, 1, 0), 4, 0), ((3, 2, 1, 0), None, 0), ((2, 1, 0), None, 0), ((2, 1, 0), None, 0))


def _blk64_forward(p: AttnProblem, q, k, v, out, lse, sel_idx, sel_num, block_sizes):
    """cuDNN's sm_90 blk64 forward (the kernel `bsa_attn_fwd` runs for 64-token blocks with out given,
    kv_splits=1, allow_empty_block_nums=True, block_sizes and q2k_block_nums given) of q's rows into
    out and lse, on torch's current stream of q's device."""
    import cuda.bindings.driver as cuda
    import torch

    from .sm90_common import layout_key, remember
    bhsd = (lambda x: x) if p.layout == "bhsd" else (lambda x: x.transpose(1, 2))
    q, k, v, out = bhsd(q), bhsd(k), bhsd(v), bhsd(out)
    key = layout_key(q, k, v, out, lse, sel_idx, sel_num, block_sizes)
    fn = _BLK64_PLANS.get(key)
    if fn is None:
        _check_blk64(q, k, v, out, lse, sel_idx, sel_num, block_sizes)
    B, H = q.shape[:2]
    sizes = block_sizes[None, None, :].expand(B, H, -1).contiguous()  # as the wrapper expands them
    tensors = (q, k, v, out, lse, sel_idx.contiguous(), sel_num.contiguous(), sizes)
    args = [t.permute(*perm) for t, (perm, _, _) in zip(tensors, _BLK64_VIEWS)]
    args.append(args[6])  # the split offsets' place (unused at kv_splits=1): the counts, as the wrapper passes
    if fn is None:
        with _BUILD_LOCK:
            fn = remember(_BLK64_PLANS, key, _blk64_build(q, args))
    fn(*args, p.softmax_scale, cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))


def _check_blk64(q, k, v, out, lse, sel_idx, sel_num, block_sizes):
    """What `bsa_attn_fwd` and `_bsa_attn_fwd_sm90_blk64` assert of these arguments (ValueError)."""
    import torch
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    nq, nkv = Sq // 64, -(-Skv // 64)
    problems = [
        q.dtype not in (torch.float16, torch.bfloat16) and "q must be bf16 or fp16",
        not (q.dtype == k.dtype == v.dtype == out.dtype) and "q, k, v, out of one dtype",
        (k.shape[:2] != (B, H) or v.shape[:3] != k.shape[:3] or k.shape[3] != D) and "k, v [B, H, Skv, D]",
        (D not in (64, 96, 128) or v.shape[3] not in (64, 96, 128)) and "head dims 64, 96 or 128",
        out.shape != (B, H, Sq, v.shape[3]) and "out [B, H, Sq, Dv]",
        any(t.stride(-1) != 1 for t in (q, k, v, out)) and "a contiguous head dim",
        Sq % 64 and "Sq a multiple of 64",
        (lse.shape != (B, H, Sq) or lse.dtype != torch.float32 or lse.stride(-1) != 1) and "lse [B, H, Sq] fp32",
        (sel_idx.dtype != torch.int32 or sel_idx.shape[:3] != (B, H, nq)) and "q2k_block_index [B, H, nQ, C] int32",
        (sel_num.dtype != torch.int32 or sel_num.shape != (B, H, nq)) and "q2k_block_nums [B, H, nQ] int32",
        (block_sizes.dtype != torch.int32 or block_sizes.shape != (nkv,)) and "block_sizes [nKV] int32",
    ]
    bad = [x for x in problems if x]
    if bad:
        raise ValueError(f"the cudnn backend's blk64 forward needs {', '.join(bad)}")


def _blk64_build(q, args):
    """cuDNN's sm_90 blk64 forward kernel for q's dtype and head dim, compiled on first use with `args`
    (this call's, as `_blk64_forward` passes them) as examples: the wrapper's CuTe views of them."""
    import cutlass
    import cutlass.cute as cute
    from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import BlockSparseAttnForwardSm90Blk64

    from .sm90_common import broadcast_dims, compile_for_torch, cute_tensor, cutlass_dtype
    key = (q.dtype, q.shape[3], args[2].shape[0], broadcast_dims(args))
    fn = _BLK64_BUILDS.get(key)
    if fn is None:
        kernel = BlockSparseAttnForwardSm90Blk64(
            gqa_ratio=1, head_dim=q.shape[3], value_dim=args[2].shape[0], blocksparse_blocksize_q=64,
            blocksparse_blocksize_k=64, dtype=cutlass_dtype(q), acc_dtype=cutlass.Float32, has_block_sizes=True,
            num_splits=1, allow_empty_block_nums=True)
        views = [cute_tensor(t, align, lead) for t, (_, align, lead) in zip(args[:8], _BLK64_VIEWS)]
        views.append(views[6])  # the wrapper passes its counts' CuTe tensor as the split offsets too
        fn = _BLK64_BUILDS[key] = compile_for_torch(kernel, views, cutlass.Float32(1.0),
                                                     cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False))
    return fn


_PREFIX_STREAMS = {}  # device index -> its high-priority stream for the dense prefix rows


def _prefix_first_forward(p: AttnProblem, q, k, v, out, lse, sel_idx, sel_num, block_sizes):
    """The forward with a static prefix: its dense query rows (each attends every non-empty
    KV block, ~nKV / (topk + P) times a video row's work) as a call of their own on a
    high-priority stream, concurrent with the call over all rows with the prefix rows'
    counts set to 0. cuDNN's sm_90 grid is (query tile, head, batch), one CTA per tile,
    dispatched in that order (no persistent scheduler), so in one call every head's prefix
    tiles start at that head's turn and the last heads' long tiles form the tail; on the
    high-priority stream they are dispatched first and the video tiles fill the other SMs.
    The prefix rows are a leading slice of q (a view, no copy); cuDNN copies their lists
    (B x H x P rows) and allocates their out / lse, which are copied into ours once the main
    call has written its 0 / -inf there. Buffers of this stream that the side stream reads
    are freed only after the join (this stream waits for the side one before returning)."""
    import torch
    rows = p.prefix_blocks * p.block_elems
    bhsd = p.layout == "bhsd"
    prefix = (lambda x: x[:, :, :rows]) if bhsd else (lambda x: x[:, :rows])
    video_num = sel_num.clone()
    video_num[:, :, :p.prefix_blocks] = 0  # prefix rows: empty here (out 0, lse -inf), computed on the side
    main = torch.cuda.current_stream()
    side = _PREFIX_STREAMS.get(q.device.index)
    if side is None:
        side = _PREFIX_STREAMS[q.device.index] = torch.cuda.Stream(q.device, priority=-1)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        o, m = _bsa_forward(p, prefix(q), k, v, None, None, sel_idx[:, :, :p.prefix_blocks],
                            sel_num[:, :, :p.prefix_blocks], block_sizes)
    _bsa_forward(p, q, k, v, out, lse, sel_idx, video_num, block_sizes)
    side.wait_stream(main)  # after the main call's 0 / -inf in the prefix rows
    with torch.cuda.stream(side):  # o and m stay on the stream that allocated them
        prefix(out).copy_(o)
        lse[:, :, :rows].copy_(m)
    main.wait_stream(side)


def sparse_backward(launcher, p: AttnProblem, a: FineBackward):
    """dq, dk, dv of the fine stage by cuDNN (step "cudnn_bwd", from the query-owned lists: it
    builds its own K-to-Q lists), then the pooling gradients. `delta`, `inv_idx`, `inv_num` are
    not used."""
    # padding="ignore": what cuDNN multiplies by zero weights is read as 0
    q, dout = (valid_rows_input(launcher, p, "backward", n, x, a.q_counts) for n, x in (("q", a.q), ("dout", a.dout)))
    k, v = (valid_rows_input(launcher, p, "backward", n, x, a.kv_counts) for n, x in (("k", a.k), ("v", a.v)))
    if a.out_coarse is not None:
        if a.out_fine is None:
            raise ValueError("the cudnn backend's VSA backward needs the forward's fine output `out_fine`")
        o = a.out_fine  # the fine output's own values (q's dtype), for cuDNN's delta = rowsum(O * dO)
    else:
        if a.out is None:
            raise ValueError("the cudnn backend's backward needs the forward output `out`")
        o = a.out
    buffers = dict(q=q, k=k, v=v, o=o, lse=a.lse, dout=dout, dq=a.dq, dk=a.dk, dv=a.dv, sel_idx=a.sel_idx,
                   sel_num=a.sel_num, kv_counts=a.kv_counts)
    if p.block_elems == 64:  # what cuDNN's backward works in, from the plan (`blk64_backward_workspaces`)
        buffers.update({n: launcher.workspace(n, shape, dtype, a.q)
                        for n, (shape, dtype) in blk64_backward_workspaces(p).items()})
    launcher.cute("cudnn_bwd", buffers, problem=p)
    if a.dq_pool is not None:
        add_block_grad(launcher, p, a.dq, a.dq_pool, a.q_counts, p.q_len)
        add_block_grad(launcher, p, a.dk, a.dk_pool, a.kv_counts, p.kv_len)
        add_block_grad(launcher, p, a.dv, a.dv_pool, a.kv_counts, p.kv_len)


def launch_cudnn_backward(buffers: dict, *, problem: AttnProblem):
    """The "cudnn_bwd" launch on framework buffers (`CUTE_STEPS`): cuDNN BSA's backward into dq, dk, dv
    from o (the fine output), lse and dout, on the caller's stream. At 64-token blocks its kernel
    classes in the step's workspaces (`_blk64_backward`); at 128 its wrapper, which allocates its
    K-to-Q lists and fp32 accumulators there."""
    if _torch_import_error() is not None:  # JAX's callback path (launch "callback", jax.vmap) with no torch
        raise _eager_launch_error(_torch_import_error())
    from ._torch_views import as_torch_buffers
    p = problem
    if p.block_elems == 64:
        with caller_stream():
            _blk64_backward(p, as_torch_buffers(buffers, "lse"))
        return
    _, bsa_bwd = _cudnn()
    with caller_stream():
        b = as_torch_buffers(buffers, "lse")
        bsa_bwd(b["dout"], b["q"], b["k"], b["v"], b["o"], b["lse"], b["sel_idx"], None,
                _block_sizes(p, b["kv_counts"]), b["sel_num"], softmax_scale=p.softmax_scale, dq_tensor=b["dq"],
                dk_tensor=b["dk"], dv_tensor=b["dv"], sparse_block_size=p.block_elems, layout=p.layout)


def workspaces(stage: str, p: AttnProblem) -> dict:
    """What this backend's launches use beyond the stage's buffer table (name -> (shape, dtype)),
    each from `launcher.workspace`: the copies of padding="ignore" (`stages.valid_rows_input`) and,
    at 64-token blocks, what cuDNN's backward works in (`blk64_backward_workspaces`)."""
    table = valid_rows_workspaces(stage, p)
    if stage == "backward" and p.block_elems == 64:
        table.update(blk64_backward_workspaces(p))
    return table


# ---- the blk64 backward, called without cuDNN's Python wrapper ----------------------------------
# `api.block_sparse_attention_backward` (1.32.0) validates its arguments, allocates the K-to-Q lists'
# buffers and an fp32 workspace with torch, and converts its tensors through DLPack on every call: most
# of the backend's host time per backward. Both frontends run its two kernel classes instead
# (`cudnn_kernels.Blk64Backward`) on workspaces of the plan; torch compiles it for TVM-FFI calls.
BUCKET_BLOCKS = 384     # query blocks per K-to-Q bucket: cuDNN 1.32.0's sm_90 rule (checked at build)
_HEAD_DIM_ROUND = 32    # the workspace rows' width rounds the head dim to this (its get_workspace_tensor)


def _padded_rows(n: int) -> int:
    return -(-n // 64) * 64


def blk64_backward_workspaces(p: AttnProblem) -> dict:
    """What cuDNN's wrapper allocates per backward, as name -> (shape, dtype): the K-to-Q lists'
    counts, offsets, cursors and entries ([B, H, buckets, ...]), and the fp32 workspace (dPsum,
    log2 lse, the dQ accumulator, the dK and dV accumulators, each field-major over B * H, rows
    rounded up to 64). "k2q_counts" and the dK / dV part of "bwd_workspace" (from
    `dkv_accumulators_start`) are zeroed before each call by the launch; the kernels write the rest."""
    B, H = p.batch, p.heads
    n_q, n_kv = _padded_rows(p.q_len) // 64, _padded_rows(p.kv_len) // 64
    groups = -(-n_q // BUCKET_BLOCKS)
    d = -(-p.head_dim // _HEAD_DIM_ROUND) * _HEAD_DIM_ROUND
    q_rows, k_rows = _padded_rows(p.q_len), _padded_rows(p.kv_len)
    return {"k2q_counts": ((B, H, groups, n_kv), "int32"),
            "k2q_local_offsets": ((B, H, groups, n_kv + 1), "int32"),
            "k2q_group_totals": ((B, H, groups), "int32"),
            "k2q_offsets": ((B, H, groups, n_kv + 1), "int32"),
            "k2q_cursors": ((B, H, groups, n_kv), "int32"),
            "k2q_indices": ((B, H, max(1, n_q * p.select_capacity)), "int32"),
            "bwd_workspace": ((B, H, 2 * q_rows + q_rows * d + 2 * k_rows * d), "float32")}


def dkv_accumulators_start(p: AttnProblem) -> int:
    """Where the dK / dV accumulators start in the flat "bwd_workspace": the kernels split it
    field-major over all B * H (every dPsum, every log2 lse, every dQ accumulator, then dK, dV)."""
    d = -(-p.head_dim // _HEAD_DIM_ROUND) * _HEAD_DIM_ROUND
    return p.batch * p.heads * (2 * _padded_rows(p.q_len) + _padded_rows(p.q_len) * d)


BLK64_BACKWARD_ZEROED = frozenset({"k2q_counts", "bwd_workspace"})  # before each call (the workspace: from
# `dkv_accumulators_start`; a caller that cannot zero a part zeroes it whole)
BLK64_BACKWARD_ARGS = ("q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "sel_idx", "sel_num", "block_sizes",
                       "k2q_counts", "k2q_local_offsets", "k2q_group_totals", "k2q_offsets", "k2q_cursors",
                       "k2q_indices", "bwd_workspace")  # `cudnn_kernels.Blk64Backward`'s tensors, in order
_BLK64_BWD_BUILDS = {}  # (dtype, head dim, capacity, broadcast dims) -> compiled function
_BLK64_BWD_PLANS = {}   # `layout_key` of the arguments -> the compiled function (the checks passed)


def _blk64_backward(p: AttnProblem, b: dict):
    """cuDNN's sm_90 blk64 backward (`cudnn_kernels.Blk64Backward`) on torch tensors `b` (the
    "cudnn_bwd" step's buffers): the counts and the dK / dV accumulators zeroed, then one call on
    torch's current stream of q's device."""
    import cuda.bindings.driver as cuda
    import torch

    from .sm90_common import layout_key, remember
    bhsd = (lambda x: x) if p.layout == "bhsd" else (lambda x: x.transpose(1, 2))
    t = {n: bhsd(b[n]) for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")}
    t.update({n: b[n] for n in BLK64_BACKWARD_ARGS if n not in t and n != "block_sizes"})
    t["block_sizes"] = _block_sizes(p, b["kv_counts"])[None].expand(p.batch, -1)  # as [B, nKV], no copy
    args = [t[n] for n in BLK64_BACKWARD_ARGS]
    key = layout_key(*args)
    fn = _BLK64_BWD_PLANS.get(key)
    if fn is None:
        _check_blk64_backward(p, t)
        with _BUILD_LOCK:
            fn = remember(_BLK64_BWD_PLANS, key, _blk64_backward_build(p, args))
    t["k2q_counts"].zero_()
    t["bwd_workspace"].view(-1)[dkv_accumulators_start(p):].zero_()
    fn(*args, p.softmax_scale, cuda.CUstream(torch.cuda.current_stream(t["q"].device).cuda_stream))


def _check_blk64_backward(p: AttnProblem, t: dict):
    """What the wrapper asserts of these arguments and the workspaces' shapes (ValueError)."""
    import torch
    B, H, Sq, D = t["q"].shape
    problems = [
        t["q"].dtype != torch.bfloat16 and "bf16 q",
        any(t[n].dtype != t["q"].dtype for n in ("k", "v", "o", "dout", "dq", "dk", "dv")) and "one dtype",
        D != BACKWARD_HEAD_DIM and f"head dim {BACKWARD_HEAD_DIM}",
        any(t[n].shape != t["q"].shape for n in ("o", "dout", "dq")) and "o, dout, dq [B, H, Sq, D]",
        any(t[n].shape != t["k"].shape or t[n].shape[:2] != (B, H) for n in ("v", "dk", "dv")) and "k, v, dk, dv [B, H, Skv, D]",
        any(x.stride(-1) != 1 for x in t.values()) and "a contiguous last dim",
        (t["lse"].shape != (B, H, Sq) or t["lse"].dtype != torch.float32) and "lse [B, H, Sq] fp32",
        any(tuple(t[n].shape) != shape or str(t[n].dtype) != f"torch.{dtype}"
            for n, (shape, dtype) in blk64_backward_workspaces(p).items()) and "the workspaces of the problem",
    ]
    bad = [x for x in problems if x]
    if bad:
        raise ValueError(f"the cudnn backend's blk64 backward needs {', '.join(bad)}")


def _blk64_backward_build(p: AttnProblem, args):
    """`cudnn_kernels.Blk64Backward` for this dtype, head dim and list width, compiled on first use
    with `args` as examples (token tensors at 16-byte alignment, the rest at 4, as the wrapper's)."""
    import cutlass
    import cutlass.cute as cute

    from .cudnn_kernels import Blk64Backward, bucket_blocks
    from .sm90_common import broadcast_dims, compile_for_torch, cute_tensor, cutlass_dtype
    capacity = p.select_capacity
    key = (args[0].dtype, p.head_dim, capacity, broadcast_dims(args))
    fn = _BLK64_BWD_BUILDS.get(key)
    if fn is None:
        if bucket_blocks(p.n_q_blocks) != BUCKET_BLOCKS:
            raise RuntimeError(f"cuDNN's K-to-Q bucket is {bucket_blocks(p.n_q_blocks)} query blocks, "
                               f"the workspaces are sized for {BUCKET_BLOCKS}")
        kernel = Blk64Backward(cutlass_dtype(args[0]), p.head_dim, capacity, BUCKET_BLOCKS)
        aligned = {"q", "k", "v", "o", "dout", "dq", "dk", "dv", "bwd_workspace"}
        views = [cute_tensor(x, 16 if n in aligned else 4) for n, x in zip(BLK64_BACKWARD_ARGS, args)]
        fn = _BLK64_BWD_BUILDS[key] = compile_for_torch(kernel, views, cutlass.Float32(1.0),
                                                         cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False))
    return fn


# The launches of this backend that are not Triton's (`launcher.cute(step, buffers, **statics)`, found
# through the registry: `vsa_core.backends.cute_step`): step -> its eager function on framework buffers.
CUTE_STEPS = {"cudnn_fwd": launch_cudnn_forward, "cudnn_bwd": launch_cudnn_backward}
