"""CuTe backend: FlashAttention-4's block-sparse kernels (flash-attn-4) for the fine stage.

Same contract as the Triton backend (`base.FineStageBackend`: `sparse_forward` /
`sparse_backward` on the buffers of `AttnProblem.forward_buffers` / `backward_buffers`, same outputs), run
by `flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd` on sm_90 for
128- and 256-token blocks, head dim 64 or 128. FA4 is imported lazily: importing
vsa_core never needs it.

How our problem maps onto FA4 (flash-attn-4 4.0.0b36, read from its source):
- Sparse block size (E, 128): one of our query blocks is one FA4 query block (FA4
  splits it into its own 128/64/80-row tiles, `q_subtile_factor`), and each of our
  KV blocks is E/128 FA4 KV tiles of 128 tokens (on sm_90 the sparse KV block must
  equal tile_n = 128). A 128-token sub-block is listed as "full" when all its tokens
  are valid, as "mask" when it is partly filled (the mask_mod in `_cute_mask` then
  drops its padded tail, reading per-sub-block counts from an aux tensor), and not
  at all when it is empty (e.g. the second half of a 256-token block holding
  <= 128 tokens). Lists are built on the device by Triton kernels, no host sync:
  query-owned for the forward (from sel_idx/sel_num), KV-owned for the backward
  (from inv_idx/inv_num; the KV sub-block decides full vs mask, so the two lists
  share one index tensor).
- Layout: FA4 takes (B, S, H, D) with a contiguous last dim and 16-byte aligned
  strides, and keeps such strided views without copying (`maybe_contiguous`), so
  BHSD tensors go in as `.transpose(1, 2)` views: no copy, either layout. Outputs
  (out, dq, dk, dv) are written straight into our buffers through the same views.
- lse: FA4 writes (B, H, Sq) fp32 natural-log lse, -inf for a row that sees nothing
  (out 0 there): exactly our `lse` buffer, passed as `lse=`. With the coarse branch and
  padding="ignore", `mix_coarse` then sets the padded query rows' lse to +inf (and their
  out to 0), so FA4's backward gives them probability exp2(S - inf) = 0: their q and dO
  reach no gradient (FA4 resets only a -inf lse, to 0, before the backward).
- Coarse mixing: FA4 writes only the fine output, in the input dtype. It goes into
  `out`, then `mix_coarse_kernel` turns `out` into out_fine + gate * out_c in place
  and, training, fills the `out_fine` buffer (q's dtype, `AttnProblem.fine_residual`:
  FA4 has no fp32 output, so the backward's delta = rowsum(dO * out_fine) is
  FlashAttention's recipe, not the Triton backend's fp32 one; see the note there
  on its cost at large logits).
- Backward delta: FA4's backward forms its own delta' = rowsum(O * dO) - dlse from
  the O it is given. We give it O = `out` (the final output, input dtype, what we
  have) and dlse = rowsum(out * dO) - delta (our delta, computed by the core's
  preprocess), written in place over the `delta` workspace, so FA4 uses exactly our
  delta. Without the coarse branch out is the fine output and dlse is left out.
- Pooling gradients (VSA): FA4 writes dq/dk/dv of the fine branch; then
  `add_block_grad_kernel` adds dq_pool/q_count, dk_pool/kv_count, dv_pool/kv_count
  in place (one more bf16 rounding than the Triton backend's fused add); padding="ignore":
  to the valid rows only, 0 written to the padded ones.
- padding="ignore": FA4 masks the padded keys with a select on the scores, but multiplies
  the padded rows of V (P @ V), K (dS @ K), Q (dS^T @ Q) and dO (P^T @ dO) by zero weights,
  and 0 * inf is NaN. So under "ignore" it reads copies with the padded rows written 0
  (`valid_rows_copy`): K and V in the forward, Q, K, V and dO in the backward. That is one
  extra read and write of each of those tensors per call (allocated on the current
  stream like the lists); padding="zeros" copies nothing.
- Streams: FA4's kernels are compiled against TVM-FFI's environment stream, and
  each call with torch CUDA tensors sets that to torch's current stream of the
  tensors' device (tvm_ffi function.pxi, DLPack exchange API `current_work_stream`),
  which is the caller's (under JAX, `runtime.caller_stream` makes XLA's stream
  torch's current one). Nothing else to do.

Launches and allocation: FA4's forward and backward run as the steps "fa4_fwd" / "fa4_bwd"
(`launcher.cute`, declared in `CUTE_STEPS`), each a call of FA4's interface on torch views of its
buffers; the lists, the sub-block counts and the copies are Triton launches into scratch buffers
from `launcher.workspace` (declared in `workspaces(stage, problem)`), so a captured stage replays
(`vsa_core.replay`) like the Triton backend's. FA4's backward allocates its own scratch (fp32 dq
accumulator, lse_log2, dpsum) inside its step, from torch's caching allocator on the current
stream; under JAX's callback everything here comes from torch's caching allocator. Under JAX on
an sm_90 device both plans run natively instead (`vsa_jax.fa4_call`: the steps "fa4_fwd" / "fa4_bwd"
as cutlass_calls of the kernel objects FA4's interface configures in `fa4_forward_call` /
`fa4_backward_call`, the workspaces XLA buffers, FA4's backward scratch outputs of its call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Optional

import triton

from ..problem import AttnProblem
from ..runtime import DeviceInfo, caller_stream
from ..stages import add_block_grad, mix_coarse, valid_rows_input, valid_rows_workspaces
from . import cute_kernels as K
from .availability import gpu_reason, library_probe, library_reason
from .base import FineBackward, FineForward

name = "cute"
replayable = True  # its launches: Triton list builders and copies, two CuTe DSL steps (FA4), on the call's buffers
INSTALL_HINT = ("pip install 'vsa[cute]' (flash-attn-4==4.0.0b36, nvidia-cutlass-dsl==4.8.1, "
                "quack-kernels==0.6.5)")

FA4_KINDS = ("full", "mask")  # FA4's two forward lists: KV tiles with every token valid, partly filled ones
KV_TILE = 128  # FA4's KV tile (tile_n) on sm_90 for head dims <= 128: the sparse KV block size
HEAD_DIMS = (64, 128)
BLOCK_ELEMS = (128, 256)


# The CuTe DSL keeps per-compile state on a process-wide singleton (e.g. the launches
# pending while a kernel body is traced), so two threads compiling FA4 kernels at once
# corrupt each other ("TypeError: 'NoneType' object is not iterable" in cutlass_dsl's
# `_track_deferred_kernel_launches`). That happens as soon as one process drives several
# GPUs from threads: XLA runs each device's buffer callback on its own thread (a JAX
# Mesh over 2 GPUs). Every FA4 call therefore holds this lock for its host work (the
# compile on first use, then the cache lookup and the asynchronous launch).
_FA4_LOCK = threading.RLock()

# FA4's sm_90 backward configuration for our calls: overrides of FA4's own choice (its interface fixes
# it from the head dim alone: at head dim 128 a 64-row tile for every block size we take); {} runs
# FA4's own. Only fields of FA4's compile key (`BACKWARD_CONFIG_FIELDS`): a kernel compiled with the
# overrides is then cached under its own key, apart from FA4's own choice.
# The default swaps dQ's GEMM: faster than FA4's own in most measured rounds at 256-token blocks, with
# out / dK / dV bitwise FA4's own (benchmarks/fa4_bwd_configs.py times the candidates against FA4's own
# and cuDNN's kernel; the rounds are in benchmarks/results/, the `fa4bwd` files).
BACKWARD_CONFIG: dict = {"dQ_swapAB": True}
BACKWARD_CONFIG_FIELDS = frozenset({"m_block_size", "n_block_size", "num_stages_Q", "num_stages_dO", "SdP_swapAB",
                                    "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP", "AtomLayoutNdKV", "AtomLayoutMdQ"})


# ---- availability --------------------------------------------------------------------------
@library_probe
def _fa4_import_error() -> Optional[str]:
    """None when FA4's CuTe interface imports, else the error (imported once, on demand)."""
    import flash_attn.cute.interface  # noqa: F401
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401

    from . import _cute_mask  # noqa: F401


def library_error() -> Optional[str]:
    """Why this backend's library cannot be used here (None when it can): for strict test runs."""
    return _fa4_import_error()


def unavailable_reason(problem: AttnProblem, device: DeviceInfo):
    reason = gpu_reason(device, lambda cap: cap[0] in (9, 10),
                        "FA4's block-sparse kernels run on sm_90 (H100/H200) or sm_100 (B200)")
    if reason is not None:
        return reason
    if problem.block_elems not in BLOCK_ELEMS:
        return (f"{problem.block_elems}-token blocks stay on Triton (FA4's sparse KV tile is {KV_TILE} tokens; "
                f"the cute backend takes blocks of {BLOCK_ELEMS} tokens)")
    if problem.head_dim not in HEAD_DIMS:
        return f"head dim {problem.head_dim} is not supported by the cute backend (only {HEAD_DIMS})"
    if device.capability[0] == 10 and problem.block_elems == 128:
        # sm_100 runs two 128-row query tiles per CTA (q_stage 2) once Sq > 128, and FA4 then
        # requires the sparse query block to be a multiple of 256.
        return "on sm_100 FA4 needs 256-token query blocks; 128-token blocks stay on Triton"
    return library_reason("flash_attn.cute (FlashAttention-4)", _fa4_import_error(), INSTALL_HINT)


# ---- helpers ------------------------------------------------------------------------------
def _sub(p: AttnProblem) -> int:
    return p.block_elems // KV_TILE


def _rows(p: AttnProblem) -> int:
    return min(64, p.block_elems)


def sub_block_counts(launcher, p: AttnProblem, kv_counts: torch.Tensor, out: torch.Tensor) -> None:
    """out[n] (int32, n_kv_blocks * E/128) = valid tokens of 128-token KV sub-block n."""
    n_sub = p.n_kv_blocks * _sub(p)
    launcher.triton(K.kv_sub_counts_kernel, (triton.cdiv(n_sub, 256),), kv_counts, out, n_sub, SUB=_sub(p),
                    TILE=KV_TILE, BLOCK=256)


def forward_lists(launcher, p: AttnProblem, sel_idx, sel_num, kv_counts, full_idx, full_num, mask_idx,
                  mask_num) -> None:
    """FA4's query-owned full/mask lists ([B, H, nQ, C] int32, C = min(cap, nKV) * E/128) and
    their counts ([B, H, nQ]) from our per-query-block lists (bounded: see vsa_core.stage_kernels)."""
    cap = sel_idx.shape[-1]
    sub = _sub(p)
    launcher.triton(K.fa4_fwd_lists_kernel, (p.batch * p.heads * p.n_q_blocks,),
        sel_idx, sel_num, kv_counts, full_idx, full_num, mask_idx, mask_num, p.n_kv_blocks, cap,
        full_idx.shape[-1],
        SUB=sub, TILE=KV_TILE, SLOTS=max(16, triton.next_power_of_2(cap * sub)), num_warps=4)


def backward_lists(launcher, p: AttnProblem, inv_idx, inv_num, kv_counts, idx, full_num, mask_num) -> None:
    """FA4's KV-owned lists per 128-token sub-block: idx [B, H, nKV*E/128, nQ] (shared by the
    full and mask lists; pass inv_idx itself when E == 128: nothing is copied) and the
    full/mask counts [B, H, nKV*E/128] (buffers of their own: a recorded plan names whole buffers)."""
    sub = _sub(p)
    launcher.triton(K.fa4_bwd_lists_kernel, (p.n_kv_blocks * sub, p.batch * p.heads),
        inv_idx, inv_num, kv_counts, idx, full_num, mask_num, p.n_kv_blocks, inv_idx.shape[-1],
        SUB=sub, TILE=KV_TILE, Q_PAD=max(16, triton.next_power_of_2(inv_idx.shape[-1])),
        COPY_IDX=idx is not inv_idx, num_warps=4)


def delta_to_dlse(launcher, p: AttnProblem, out, dout, delta) -> None:
    rows = _rows(p)
    launcher.triton(K.delta_to_dlse_kernel, (p.q_len // rows, p.batch * p.heads),
        out, dout, delta, *p.token_strides(p.q_len), p.heads, p.q_len,
        HEAD_DIM=p.head_dim, ROWS=rows, num_warps=4)


def _fa4():
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    from ._cute_mask import vsa_kv_tail_mask
    return _flash_attn_fwd, _flash_attn_bwd, BlockSparseTensorsTorch, vsa_kv_tail_mask


# ---- the workspaces ---------------------------------------------------------------------------
def _forward_width(p: AttnProblem) -> int:
    return min(p.select_capacity, p.n_kv_blocks) * _sub(p)  # FA4 wants at most nKV*E/128 columns


def workspaces(stage: str, p: AttnProblem) -> dict:
    """What this backend's launches use beyond the stage's buffer table (name -> (shape, dtype)),
    each from `launcher.workspace`: FA4's lists (forward: full and mask [B, H, nQ, C] and their
    counts [B, H, nQ], four buffers of their own, which a recorded plan can hand a CuTe DSL launch
    whole; backward: the KV-owned index [B, H, nKV*E/128, nQ] (inv_idx
    itself at E = 128) and the full and mask counts [B, H, nKV*E/128]), the valid tokens of
    each 128-token KV sub-block, and the copies of padding="ignore" (`stages.valid_rows_input`)."""
    B, H, nq, n_sub = p.batch, p.heads, p.n_q_blocks, p.n_kv_blocks * _sub(p)
    table = valid_rows_workspaces(stage, p)
    table["fa4_sub_counts"] = ((n_sub,), "int32")
    if stage == "forward":
        for kind in FA4_KINDS:
            table[f"fa4_{kind}_idx"] = ((B, H, nq, _forward_width(p)), "int32")
            table[f"fa4_{kind}_num"] = ((B, H, nq), "int32")
    else:
        if _sub(p) != 1:
            table["fa4_idx"] = ((B, H, n_sub, nq), "int32")
        for kind in FA4_KINDS:
            table[f"fa4_{kind}_num"] = ((B, H, n_sub), "int32")
    return table


def _workspace(launcher, p: AttnProblem, stage: str, name: str, like):
    shape, dtype = workspaces(stage, p)[name]
    return launcher.workspace(name, shape, dtype, like)


# ---- the fine stage -------------------------------------------------------------------------
def sparse_forward(launcher, p: AttnProblem, a: FineForward):
    """FA4's lists and the padding copies (Triton launches into workspaces), FA4's forward (step
    "fa4_fwd"), then the coarse mix."""
    q, kv_counts = a.q, a.kv_counts
    lists = {f"{kind}_{n}": _workspace(launcher, p, "forward", f"fa4_{kind}_{n}", q)
             for kind in FA4_KINDS for n in ("idx", "num")}
    sub_counts = _workspace(launcher, p, "forward", "fa4_sub_counts", q)
    sub_block_counts(launcher, p, kv_counts, sub_counts)
    forward_lists(launcher, p, a.sel_idx, a.sel_num, kv_counts, lists["full_idx"], lists["full_num"],
                  lists["mask_idx"], lists["mask_num"])
    # padding="ignore": FA4 multiplies the padded V rows by P = 0 (0 * inf = NaN); padded
    # query rows stay in their own rows, which mix_coarse overwrites
    k, v = (valid_rows_input(launcher, p, "forward", n, x, kv_counts) for n, x in (("k", a.k), ("v", a.v)))
    launcher.cute("fa4_fwd", dict(q=q, k=k, v=v, out=a.out, lse=a.lse, **lists, sub_counts=sub_counts),
                  layout=p.layout, softmax_scale=p.softmax_scale, block_elems=p.block_elems)
    if a.out_coarse is not None:
        mix_coarse(launcher, p, a.out, a.lse, a.out_coarse, a.q_counts, gate=a.gate, out_fine=a.out_fine)


def launch_fa4_forward(buffers: dict, *, layout: str, softmax_scale: float, block_elems: int):
    """The "fa4_fwd" launch on framework buffers (`CUTE_STEPS`): FA4's block-sparse forward of q, k, v
    into out and lse with the full / mask lists and counts (full_idx, full_num, mask_idx, mask_num) and
    the KV sub-block counts, on the caller's stream. FA4 allocates nothing here."""
    from ._torch_views import as_torch_buffers
    with caller_stream():
        b = as_torch_buffers(buffers, "lse")
        with _FA4_LOCK:
            fa4_forward_call(b, layout=layout, softmax_scale=softmax_scale, block_elems=block_elems)


def fa4_forward_call(b: dict, *, layout: str, softmax_scale: float, block_elems: int, **interface_args) -> None:
    """FA4's interface called on the torch tensors `b` (the "fa4_fwd" buffers) as that step calls it:
    the one place both frontends configure FA4's forward from, so they run one kernel. `interface_args`:
    more arguments of `_flash_attn_fwd` (`vsa_jax.fa4_call` names the arch it compiles for)."""
    fa_fwd, _, BlockSparse, mask_mod = _fa4()
    lists = BlockSparse(mask_block_cnt=b["mask_num"], mask_block_idx=b["mask_idx"], full_block_cnt=b["full_num"],
                        full_block_idx=b["full_idx"], block_size=(block_elems, KV_TILE))
    t = {n: b[n] if layout == "bshd" else b[n].transpose(1, 2) for n in ("q", "k", "v", "out")}
    fa_fwd(t["q"], t["k"], t["v"], softmax_scale=softmax_scale, mask_mod=mask_mod, block_sparse_tensors=lists,
           aux_tensors=[b["sub_counts"]], out=t["out"], lse=b["lse"], return_lse=True, **interface_args)


def sparse_backward(launcher, p: AttnProblem, a: FineBackward):
    """dq, dk, dv of the fine stage by FA4 (KV-owned lists from inv_idx/inv_num; step "fa4_bwd"),
    then the pooling gradients. `delta` (a workspace) is overwritten with FA4's dlse."""
    if a.out is None:
        raise ValueError("the cute backend's backward needs the forward output `out`")
    q, kv_counts = a.q, a.kv_counts
    idx = a.inv_idx if _sub(p) == 1 else _workspace(launcher, p, "backward", "fa4_idx", q)
    nums = {f"{kind}_num": _workspace(launcher, p, "backward", f"fa4_{kind}_num", q) for kind in FA4_KINDS}
    sub_counts = _workspace(launcher, p, "backward", "fa4_sub_counts", q)
    sub_block_counts(launcher, p, kv_counts, sub_counts)
    backward_lists(launcher, p, a.inv_idx, a.inv_num, kv_counts, idx, nums["full_num"], nums["mask_num"])
    # padding="ignore": what FA4 multiplies by zero weights is read as 0
    q, dout = (valid_rows_input(launcher, p, "backward", n, x, a.q_counts) for n, x in (("q", q), ("dout", a.dout)))
    k, v = (valid_rows_input(launcher, p, "backward", n, x, kv_counts) for n, x in (("k", a.k), ("v", a.v)))
    buffers = dict(q=q, k=k, v=v, out=a.out, dout=dout, lse=a.lse, dq=a.dq, dk=a.dk, dv=a.dv, idx=idx, **nums,
                   sub_counts=sub_counts)
    if a.out_coarse is not None:
        # `out` holds out_fine + gate * out_c: make FA4's rowsum(out * dO) - dlse equal our delta
        delta_to_dlse(launcher, p, a.out, dout, a.delta)
        buffers["dlse"] = a.delta
    launcher.cute("fa4_bwd", buffers, layout=p.layout, softmax_scale=p.softmax_scale, block_elems=p.block_elems,
                  config=BACKWARD_CONFIG)
    if a.dq_pool is not None:
        add_block_grad(launcher, p, a.dq, a.dq_pool, a.q_counts, p.q_len)
        add_block_grad(launcher, p, a.dk, a.dk_pool, kv_counts, p.kv_len)
        add_block_grad(launcher, p, a.dv, a.dv_pool, kv_counts, p.kv_len)


def launch_fa4_backward(buffers: dict, *, layout: str, softmax_scale: float, block_elems: int,
                        config: Optional[dict] = None):
    """The "fa4_bwd" launch on framework buffers (`CUTE_STEPS`): FA4's block-sparse backward into dq,
    dk, dv with the KV-owned lists (idx shared by the full and mask lists; full_num, mask_num) and,
    with the coarse branch, dlse, on the caller's stream. FA4 allocates its own scratch (fp32 dq
    accumulator, lse_log2, dpsum) from torch's caching allocator on that stream. `config`: overrides of
    FA4's own backward configuration (`BACKWARD_CONFIG`)."""
    from ._torch_views import as_torch_buffers
    with caller_stream():
        b = as_torch_buffers(buffers, "lse")
        with _FA4_LOCK:
            fa4_backward_call(b, layout=layout, softmax_scale=softmax_scale, block_elems=block_elems, config=config)


def fa4_backward_call(b: dict, *, layout: str, softmax_scale: float, block_elems: int,
                      config: Optional[dict] = None) -> None:
    """FA4's backward interface called on the torch tensors `b` (the "fa4_bwd" buffers) as that step
    calls it: the one place both frontends configure FA4's backward from (`vsa_jax.fa4_call` takes the
    kernels it compiles here), so they run the same kernels. `config`: overrides of FA4's own
    configuration (`BACKWARD_CONFIG`; None or empty: FA4's own)."""
    _, fa_bwd, BlockSparse, mask_mod = _fa4()
    lists = BlockSparse(mask_block_cnt=b["mask_num"], mask_block_idx=b["idx"], full_block_cnt=b["full_num"],
                        full_block_idx=b["idx"], block_size=(block_elems, KV_TILE))
    t = {n: b[n] if layout == "bshd" else b[n].transpose(1, 2) for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}
    with _backward_configured(config or {}):
        fa_bwd(t["q"], t["k"], t["v"], t["out"], t["dout"], b["lse"], softmax_scale=softmax_scale, mask_mod=mask_mod,
               aux_tensors=[b["sub_counts"]], block_sparse_tensors=lists, dlse=b.get("dlse"), dq=t["dq"], dk=t["dk"],
               dv=t["dv"])


@contextlib.contextmanager
def _backward_configured(overrides: dict):
    """FA4's interface configures the sm_90 backward with `overrides` on its own choice for the duration
    of one call (the caller holds `_FA4_LOCK`, as every FA4 call of ours does); nothing when there are
    none. Upstream gap: FA4's backward interface takes no configuration from its caller on sm_90 (its
    selector `_tile_size_bwd_sm90` reads the head dim and the sparse block size only), so this shim
    swaps that selector in and back out, and changes nothing else of FA4's."""
    if not overrides:
        yield
        return
    unknown = set(overrides) - BACKWARD_CONFIG_FIELDS
    if unknown:
        raise ValueError(f"cute backend: BACKWARD_CONFIG overrides {sorted(unknown)}, which FA4's compile key does "
                         f"not hold (a kernel compiled with them would be cached as FA4's own); allowed: "
                         f"{sorted(BACKWARD_CONFIG_FIELDS)}")
    from flash_attn.cute import interface
    own = interface._tile_size_bwd_sm90
    interface._tile_size_bwd_sm90 = lambda *args, **kwargs: dataclasses.replace(own(*args, **kwargs), **overrides)
    try:
        yield
    finally:
        interface._tile_size_bwd_sm90 = own


# The CuTe DSL launches of this backend (`launcher.cute(step, buffers, **statics)`, found through the
# registry: `vsa_core.backends.cute_step`): step -> its eager function on framework buffers.
CUTE_STEPS = {"fa4_fwd": launch_fa4_forward, "fa4_bwd": launch_fa4_backward}
