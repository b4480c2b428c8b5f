"""Launchers of the Triton kernels on caller-provided buffers.

Launch configurations live here. On a GPU each attention kernel is autotuned over a
short list keyed on the problem's shape (first entry = the default when
VSA_AUTOTUNE=0); under the interpreter there is one fixed small config.

CPU tensors run the same kernels under Triton's interpreter: each launch picks the
kernels module by the tensors' device (`kernels_for`; see `vsa_core.interpreter`).
"""

from __future__ import annotations

import math
import os
import threading

import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import triton_kernels as K
from ..interpreter import interpreted_kernels
from ..problem import AttnProblem
from ..runtime import INTERPRETING, caller_stream, torch_loaded
from .base import FineBackward, FineForward

name = "triton"

AUTOTUNE = os.environ.get("VSA_AUTOTUNE", "1") != "0" and not INTERPRETING
# K/V (forward, dQ) and Q/dO (dK/dV) tiles through tensor descriptors (TMA on Hopper);
# VSA_TMA=0 falls back to pointer loads. The interpreter runs the descriptor path too.
USE_TMA = os.environ.get("VSA_TMA", "1") != "0"
# Precision of the coarse kernels' products with fp32 operands (P@V forward; dP, dQ, dK, dV
# backward). "ieee": exact fp32 products (bf16 parts on the tensor cores, `_coarse_dot` in
# triton_kernels). "tf32" cuts the fp32 operands to 10-bit mantissas, which measured 5e-2
# relative error in dK at x16 activations (the coarse softmax is sharp there and
# rowsum(dO_c * out_c) cancels against dP): VSA_COARSE_PRECISION=tf32 runs it for comparisons
# only (benchmarks/coarse_bench.py, the TF32 detector of tests/test_coarse_precision.py); the
# interpreter computes fp32 whatever this says.
COARSE_DOT_PRECISION = os.environ.get("VSA_COARSE_PRECISION", "ieee")


def interpreted(x) -> bool:
    """True when kernels on x run under the interpreter (CPU tensors, or TRITON_INTERPRET=1).
    "meta" buffers (vsa_core.plan records a GPU launch plan with them) are not: the plan
    needs the compiled kernels and their GPU constexprs."""
    return INTERPRETING or x.device.type == "cpu"


def kernels_for(x):
    """The kernels module for tensors on x's device: compiled for CUDA (and meta), interpreted
    for the CPU."""
    if not interpreted(x):
        return K
    return K if INTERPRETING else interpreted_kernels()  # under TRITON_INTERPRET=1 K is interpreted already

# Triton's Autotuner keeps the current call's arguments on the kernel object (`self.nargs`,
# read by the config's pre_hook and cleared after the launch), so two threads launching
# the same tuned kernel at once can swap or clear each other's arguments. That happens
# with several GPUs in one process: XLA runs each device's buffer callback on its own
# thread. Tuned launches therefore take this lock (held for a launch's host work only).
_AUTOTUNER_LOCK = threading.Lock()


class _TunedKernel:
    """An attention kernel with its candidate tile configs, as
    (BLOCK_M, BLOCK_N, num_warps, num_stages), best default first.

    Tiles must not straddle two blocks, so a config fits only if BLOCK_M and BLOCK_N
    divide the block's token count E. With autotuning (GPU, VSA_AUTOTUNE != 0) Triton
    times the fitting configs once per key; otherwise the first fitting one runs.
    `tiled_args` names the descriptor arguments and the tile size ("BLOCK_M"/"BLOCK_N")
    of their rows; their block shape is set to match the config before each launch.
    """

    INTERPRETER_CONFIG = (64, 64, 4, 1)

    def __init__(self, kernel, candidates, key, tiled_args):
        self.kernel = kernel
        self.candidates = [self.INTERPRETER_CONFIG] if INTERPRETING else candidates
        self.tiled_args = tiled_args
        self.forced = None  # a config to run regardless of tuning (benchmarks/kernel_sweep.py)
        self.tuned = None
        if AUTOTUNE:
            configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s,
                                     pre_hook=self._set_block_shapes)
                       for m, n, w, s in candidates]
            self.tuned = triton.autotune(configs=configs, key=key,
                                         prune_configs_by={"early_config_prune": self._prune})(kernel)

    @staticmethod
    def _fits(E, m, n):
        return E % m == 0 and E % n == 0

    def _prune(self, configs, named_args, **kwargs):
        E = kwargs["BLOCK_ELEMS"]
        return [c for c in configs if self._fits(E, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])]

    def _set_block_shapes(self, nargs):
        for name, tile in self.tiled_args.items():
            desc = nargs[name]
            if isinstance(desc, TensorDescriptor):
                desc.block_shape = [1, 1, nargs[tile], desc.shape[-1]]

    def __call__(self, grid, like, *args, **kwargs):
        """Launches on args; `like` (a tensor of the call) decides compiled or interpreted."""
        E = kwargs["BLOCK_ELEMS"]
        kernel = self.kernel
        if interpreted(like):
            kernel = getattr(kernels_for(like), self.kernel.fn.__name__)
            m, n, w, s = self.INTERPRETER_CONFIG
        else:
            # Triton's autotuner times the candidates with torch (events on torch's current
            # stream, an L2 flush): a process without torch (vsa_jax alone) runs the default
            # config; under a raw-stream launch (JAX) torch's current stream is made that stream,
            # so the timed kernels and the events share it
            if (self.forced is None and self.tuned is not None and torch_loaded()
                    and sum(self._fits(E, m, n) for m, n, _, _ in self.candidates) > 1):
                with _AUTOTUNER_LOCK, caller_stream():
                    self.tuned[grid](*args, **kwargs)
                return
            m, n, w, s = self.forced or next(c for c in self.candidates if self._fits(E, c[0], c[1]))
        meta = {"BLOCK_M": m, "BLOCK_N": n}
        self._set_block_shapes({**dict(zip(kernel.arg_names, args)), **meta})
        kernel[grid(meta)](*args, **kwargs, **meta, num_warps=w, num_stages=s)


def _tiles(p: AttnProblem, x, seq_len: int):
    """A descriptor over x's logical (B, H, S, D) view (block shape set per config),
    or x itself for pointer loads."""
    if not USE_TMA or x.data_ptr() % 16:
        return x
    return TensorDescriptor(x, [p.batch, p.heads, seq_len, p.head_dim], [*p.token_strides(seq_len), 1],
                            [1, 1, 16, p.head_dim])


_KEY = ["BLOCK_ELEMS", "HEAD_DIM", "HAS_COARSE", "q_len", "IGNORE_PADDING"]

_sparse_fwd = _TunedKernel(
    K.sparse_attn_fwd_kernel,
    [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 4)], _KEY,
    {"K": "BLOCK_N", "V": "BLOCK_N"})
_sparse_bwd_dq = _TunedKernel(
    K.sparse_attn_bwd_dq_kernel,
    [(64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2)], _KEY,
    {"K": "BLOCK_N", "V": "BLOCK_N"})
_sparse_bwd_dkdv = _TunedKernel(
    K.sparse_attn_bwd_dkdv_kernel,
    [(64, 64, 4, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3)], _KEY + ["n_kv_blocks"],
    {"Q": "BLOCK_M", "DOUT": "BLOCK_M"})

# Coarse kernels by head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward and of
# the backward's P / dS tiles, (BLOCK_M, BLOCK_K, BLOCK_D, num_warps, num_stages) of its
# gradient contractions. BLOCK_M 64 keeps the fwd's Q@K^T scores (what the selection ranks) on
# wgmma (below 64 rows Triton moved to mma.sync and ptxas to 32 registers and a 5 KB stack).
# The backward tiles the whole pooled score matrix (and its gradient products) so the grid has
# enough programs for the chip (a row band per program left most SMs idle at one head's
# 624 x 624 blocks). benchmarks/coarse_sweep.py times the candidates on a GPU;
# benchmarks/coarse_smem.py compiles every config for a GPU target and checks its shared memory
# against the architecture's limit.
COARSE_CONFIGS = {
    64: {"fwd": (64, 32, 4, 3), "ds": (64, 64, 4, 2), "grads": (64, 32, 64, 4, 3)},
    128: {"fwd": (64, 32, 4, 3), "ds": (64, 64, 4, 2), "grads": (64, 32, 64, 4, 3)},
}
COARSE_INTERPRETER_CONFIG = {"fwd": (16, 16, 4, 1), "ds": (16, 16, 4, 1), "grads": (16, 16, 32, 4, 1)}
# bf16 parts of a pooled (input dtype) value in the coarse dots: bf16 is one, fp16 two
_INPUT_PARTS = {"bfloat16": 1, "float16": 2}


def _coarse_config(p: AttnProblem, x, stage: str):
    """(kernels module, launch options) of one coarse kernel for tensors like x."""
    config = COARSE_INTERPRETER_CONFIG[stage] if interpreted(x) else COARSE_CONFIGS[p.head_dim][stage]
    *tiles, warps, stages = config
    names = ("BLOCK_M", "BLOCK_K", "BLOCK_D") if stage == "grads" else ("BLOCK_M", "BLOCK_N")
    return kernels_for(x), dict(zip(names, tiles), HEAD_DIM=p.head_dim, DOT_PRECISION=COARSE_DOT_PRECISION,
                                UPCAST=interpreted(x), INPUT_PARTS=_INPUT_PARTS[p.dtype], num_warps=warps,
                                num_stages=stages)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _bh(p: AttnProblem) -> int:
    return p.batch * p.heads


def _ignore(p: AttnProblem) -> bool:
    """The kernels' IGNORE_PADDING: padding="ignore" (padded rows never read into a result)."""
    return p.padding == "ignore"


def block_mean_pool(p: AttnProblem, x, counts, pooled, seq_len: int):
    sb, sh, ss = p.token_strides(seq_len)
    n_blocks = seq_len // p.block_elems
    kernels_for(x).block_mean_pool_kernel[(n_blocks, _bh(p))](
        x, counts, pooled, sb, sh, ss, p.heads, n_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=min(64, p.block_elems), IGNORE_PADDING=_ignore(p))


# Pooling: (token rows per load, num_warps). It reads q, k and v once: few warps per block with
# many blocks in flight reach the memory bandwidth (benchmarks/coarse_sweep.py measures it)
POOL_CONFIG = (64, 2)


def block_mean_pool_qkv(p: AttnProblem, q, k, v, q_counts, kv_counts, q_pool, k_pool, v_pool):
    """block_mean_pool of q, k and v in one launch."""
    rows, warps = POOL_CONFIG
    kernels_for(q).block_mean_pool_qkv_kernel[(p.n_q_blocks + 2 * p.n_kv_blocks, _bh(p))](
        q, k, v, q_counts, kv_counts, q_pool, k_pool, v_pool, *p.token_strides(p.q_len),
        *p.token_strides(p.kv_len), p.heads, p.n_q_blocks, p.n_kv_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=min(rows, p.block_elems), IGNORE_PADDING=_ignore(p),
        num_warps=warps)


def coarse_forward(p: AttnProblem, q_pool, k_pool, v_pool, kv_counts, scores, out_coarse, lse_coarse,
                   q_seq=None, kv_seq=None):
    """Coarse attention, and into `scores` the scores the selection ranks (rounded to the
    input dtype as FastVideo's are: `coarse_attn_fwd_kernel`). q_seq / kv_seq (packed
    sequences): sequence id per block; other sequences' KV blocks are masked like empty ones."""
    kernels, opts = _coarse_config(p, q_pool, "fwd")
    kernels.coarse_attn_fwd_kernel[(triton.cdiv(p.n_q_blocks, opts["BLOCK_M"]), _bh(p))](
        q_pool, k_pool, v_pool, kv_counts, scores, out_coarse, lse_coarse, q_seq, kv_seq,
        p.n_q_blocks, p.n_kv_blocks, p.softmax_scale, VARLEN=q_seq is not None, RANK_DTYPE=p.dtype, **opts)


def coarse_backward(p: AttnProblem, q_pool, k_pool, v_pool, kv_counts, out_coarse, lse_coarse, dout_coarse,
                    dq_pool, dk_pool, dv_pool, p_coarse, ds_coarse, q_seq=None, kv_seq=None):
    """dq_c, dk_c, dv_c (fp32) of the coarse attention in two launches: P and dS tile by tile
    into the fp32 workspaces p_coarse / ds_coarse ([B, H, nQ, nKV]), then their products."""
    scale = p.softmax_scale
    kernels, opts = _coarse_config(p, q_pool, "ds")
    grid = (triton.cdiv(p.n_q_blocks, opts["BLOCK_M"]), triton.cdiv(p.n_kv_blocks, opts["BLOCK_N"]), _bh(p))
    kernels.coarse_attn_bwd_ds_kernel[grid](
        q_pool, k_pool, v_pool, kv_counts, out_coarse, lse_coarse, dout_coarse, p_coarse, ds_coarse, q_seq, kv_seq,
        p.n_q_blocks, p.n_kv_blocks, scale, VARLEN=q_seq is not None, **opts)
    kernels, opts = _coarse_config(p, q_pool, "grads")
    grid = (triton.cdiv(max(p.n_q_blocks, p.n_kv_blocks), opts["BLOCK_M"]), 3 * (p.head_dim // opts["BLOCK_D"]),
            _bh(p))
    kernels.coarse_attn_bwd_grads_kernel[grid](
        q_pool, k_pool, dout_coarse, p_coarse, ds_coarse, dq_pool, dk_pool, dv_pool, p.n_q_blocks, p.n_kv_blocks,
        scale, **opts)


def select_warps(n_pad: int) -> int:
    """Warps per score row of the top-k selection: its 32 counting passes are each a
    reduction over the row, and within one warp a reduction needs no barrier (shuffles
    only), so a row gets one warp up to 1024 scores (32 per thread), more beyond."""
    return min(8, max(1, n_pad // 1024))


_PREFIX_MODES = {"exempt": 1, "compete": 2}


def topk_select(p: AttnProblem, scores, sel_idx, sel_num, sel_mask, num_warps=None, q_seq=None, cu_seqlens_q=None,
                cu_seqlens_k=None, seq_prefix=None):
    """Query-owned lists of the top-k selection; with a prefix (p.has_prefix) the dense prefix
    rows and the prefix columns too. Packed sequences with a prefix need the query blocks'
    sequence ids and the offsets (each sequence's prefix starts at its first block), and
    p.seq_prefix the per-sequence counts."""
    n_pad = _pow2(p.n_kv_blocks)
    varlen = p.has_prefix and p.varlen
    if varlen and (q_seq is None or cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("a packed prefix selection needs q_seq, cu_seqlens_q and cu_seqlens_k")
    if p.seq_prefix and seq_prefix is None:
        raise ValueError("this problem takes per-sequence prefix counts: seq_prefix is required")
    kernels_for(scores).topk_select_kernel[(_bh(p) * p.n_q_blocks,)](
        scores, sel_idx, sel_num, sel_mask, q_seq if varlen else None, cu_seqlens_q if varlen else None,
        cu_seqlens_k if varlen else None, seq_prefix if p.seq_prefix else None,
        p.n_q_blocks, p.n_kv_blocks, p.topk, p.select_capacity, p.prefix_blocks, max(p.n_seqs, 1),
        N_PAD=n_pad, PREFIX_MODE=_PREFIX_MODES[p.prefix_mode] if p.has_prefix else 0, VARLEN=varlen,
        PER_SEQ_PREFIX=p.seq_prefix, BLOCK_ELEMS=p.block_elems, num_warps=num_warps or select_warps(n_pad))


def rows_to_lists(p: AttnProblem, block_mask, sel_idx, sel_num, q_seq=None, kv_seq=None):
    """Query-owned lists from a [B, H, nQ, nKV] mask (one line per query block); with the
    sequence ids (packed sequences) blocks of another sequence are left out."""
    nq, nk = p.n_q_blocks, p.n_kv_blocks
    kernels_for(block_mask).compact_mask_kernel[(nq, _bh(p))](
        block_mask, sel_idx, sel_num, q_seq, kv_seq, nq, nk, nq * nk, nk, 1, sel_idx.shape[-1], N_PAD=_pow2(nk),
        SAME_SEQ=q_seq is not None, num_warps=4)


def columns_to_lists(p: AttnProblem, block_mask, inv_idx, inv_num):
    """KV-owned (inverse) lists from a [B, H, nQ, nKV] mask (one line per KV block)."""
    nq, nk = p.n_q_blocks, p.n_kv_blocks
    kernels_for(block_mask).compact_mask_kernel[(nk, _bh(p))](
        block_mask, inv_idx, inv_num, None, None, nk, nq, nq * nk, 1, nk, inv_idx.shape[-1], N_PAD=_pow2(nq),
        num_warps=4)


def block_seq_ids(p: AttnProblem, cu_seqlens, seq, n_blocks: int):
    """seq[i] (int32) = the sequence of block i, from the int32 token offsets [N + 1]."""
    kernels_for(seq).block_seq_ids_kernel[(triton.cdiv(n_blocks, 256),)](
        cu_seqlens, seq, n_blocks, p.n_seqs, BLOCK_ELEMS=p.block_elems, BLOCK=256, num_warps=4)


def clean_lists(p: AttnProblem, given_idx, given_num, sel_idx, sel_num, q_seq=None, kv_seq=None):
    """The caller's lists as the kernels' rule reads them (`clean_lists_kernel`): ascending,
    in range, counts within the capacity; with the sequence ids (packed sequences) the
    entries outside the query block's own sequence dropped too."""
    cap = given_idx.shape[-1]
    kernels_for(sel_idx).clean_lists_kernel[(_bh(p) * p.n_q_blocks,)](
        given_idx, given_num, q_seq, kv_seq, sel_idx, sel_num, p.n_q_blocks, p.n_kv_blocks, cap,
        SLOTS=_pow2(cap), SAME_SEQ=q_seq is not None, num_warps=4)


# ---- the fine stage: the part a backend provides ---------------------------------------
def _scales(p: AttnProblem):
    """(scale * log2(e), scale): the fine kernels' softmax runs on exp2."""
    return math.log2(math.e) * p.softmax_scale, p.softmax_scale


def _first_blocks(p: AttnProblem) -> int:
    """Blocks of each head whose tiles the fine kernels run first: a static prefix's (its dense
    query rows; the prefix KV blocks the video rows take). Packed sequences start theirs at each
    sequence's first block, in no fixed place: they keep the plain order."""
    return p.prefix_blocks if p.has_prefix and not p.varlen else 0


def sparse_forward(p: AttnProblem, a: FineForward):
    q, k, v, out, lse, sel_idx, sel_num, kv_counts = a.q, a.k, a.v, a.out, a.lse, a.sel_idx, a.sel_num, a.kv_counts
    gate, out_coarse, out_fine = a.gate, a.out_coarse, a.out_fine
    _sparse_fwd(
        lambda meta: (p.q_len // meta["BLOCK_M"], _bh(p)), q,
        q, _tiles(p, k, p.kv_len), _tiles(p, v, p.kv_len), out, lse, sel_idx, sel_num, kv_counts, a.q_counts, gate,
        out_coarse, out_fine if out_fine is not None else lse,  # lse: a placeholder never written
        *p.token_strides(p.q_len), *p.token_strides(p.kv_len),
        p.heads, p.q_len, p.n_q_blocks, p.n_kv_blocks, sel_idx.shape[-1], _scales(p)[0],
        int(out_fine is not None), _first_blocks(p),
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, HAS_COARSE=out_coarse is not None,
        HAS_GATE=gate is not None, UPCAST=interpreted(q), USE_TMA=USE_TMA, IGNORE_PADDING=_ignore(p))


def backward_preprocess(p: AttnProblem, out_fine, dout, delta, gate=None, out_coarse=None, dgate=None,
                        dout_coarse=None, q_counts=None):
    """delta for the fine backward; with the coarse branch also dgate and dout_coarse
    (padding="ignore": dout of the padded query rows, past q_counts, read as 0)."""
    kernels_for(dout).sparse_attn_bwd_preprocess_kernel[(p.n_q_blocks, _bh(p))](
        dout, out_fine, gate, out_coarse, delta, dgate, dout_coarse, q_counts, *p.token_strides(p.q_len),
        p.heads, p.q_len, p.n_q_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=min(64, p.block_elems),
        HAS_COARSE=out_coarse is not None, HAS_GATE=gate is not None, IGNORE_PADDING=_ignore(p))


def sparse_backward_dq(p: AttnProblem, q, k, v, lse, dout, delta, dq, sel_idx, sel_num, kv_counts,
                       q_counts=None, dq_pool=None):
    _sparse_bwd_dq(
        lambda meta: (p.q_len // meta["BLOCK_M"], _bh(p)), q,
        q, _tiles(p, k, p.kv_len), _tiles(p, v, p.kv_len), dout, lse, delta, dq, sel_idx, sel_num, kv_counts,
        q_counts, dq_pool, *p.token_strides(p.q_len), *p.token_strides(p.kv_len),
        p.heads, p.q_len, p.n_q_blocks, p.n_kv_blocks, sel_idx.shape[-1], *_scales(p), _first_blocks(p),
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, HAS_COARSE=dq_pool is not None, UPCAST=interpreted(q),
        USE_TMA=USE_TMA, IGNORE_PADDING=_ignore(p))


def sparse_backward_dkdv(p: AttnProblem, q, k, v, lse, dout, delta, dk, dv, inv_idx, inv_num, kv_counts,
                         dk_pool=None, dv_pool=None, q_counts=None):
    _sparse_bwd_dkdv(
        lambda meta: (p.kv_len // meta["BLOCK_N"], _bh(p)), k,
        _tiles(p, q, p.q_len), k, v, _tiles(p, dout, p.q_len), lse, delta, dk, dv, inv_idx, inv_num, kv_counts,
        dk_pool, dv_pool, q_counts, *p.token_strides(p.q_len), *p.token_strides(p.kv_len),
        p.heads, p.q_len, p.n_kv_blocks, inv_idx.shape[-1], *_scales(p), _first_blocks(p),
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, HAS_COARSE=dk_pool is not None, UPCAST=interpreted(q),
        USE_TMA=USE_TMA, IGNORE_PADDING=_ignore(p))


def sparse_backward(p: AttnProblem, a: FineBackward):
    """Fine-stage dQ (query-owned) and dK/dV (KV-owned), no atomics. Given the pooling
    gradients (fp32 per block), each kernel adds grad/count to its tokens as it writes."""
    sparse_backward_dq(p, a.q, a.k, a.v, a.lse, a.dout, a.delta, a.dq, a.sel_idx, a.sel_num, a.kv_counts,
                       a.q_counts, a.dq_pool)
    sparse_backward_dkdv(p, a.q, a.k, a.v, a.lse, a.dout, a.delta, a.dk, a.dv, a.inv_idx, a.inv_num, a.kv_counts,
                         a.dk_pool, a.dv_pool, a.q_counts)


def lists_to_mask(p: AttnProblem, sel_idx, sel_num, block_mask):
    kernels_for(sel_idx).lists_to_mask_kernel[(_bh(p) * p.n_q_blocks,)](
        sel_idx, sel_num, block_mask, p.n_kv_blocks, sel_idx.shape[-1], N_PAD=_pow2(p.n_kv_blocks), num_warps=4)


# ---- epilogues of the backends whose fine stage is a library kernel (cute, cudnn) ----------
def _epilogue_rows(p: AttnProblem) -> int:
    return min(64, p.block_elems)


def mix_coarse(p: AttnProblem, out, lse, out_coarse, q_counts, gate=None, out_fine=None) -> None:
    """`out` holds the library's fine output: turns it into out_fine + gate * out_c (or
    + out_c) in place; with `out_fine`, keeps the fine output in fp32 for the backward.
    padding="ignore": the padded query rows (past q_counts) get out 0, out_fine 0 and lse
    +inf (in place in the library's `lse`), so the library's backward takes nothing from them."""
    rows = _epilogue_rows(p)
    K.mix_coarse_kernel[(p.q_len // rows, _bh(p))](
        out, lse, gate, out_coarse, out_fine, q_counts, *p.token_strides(p.q_len), p.heads, p.q_len, p.n_q_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=rows,
        HAS_GATE=gate is not None, STORE_FINE=out_fine is not None, IGNORE_PADDING=_ignore(p), num_warps=4)


def add_block_grad(p: AttnProblem, x, pooled, counts, seq_len: int) -> None:
    """x[token] += pooled[its block] / counts[block] for every token of the block, in place:
    the mean pooling's gradient added to a library's fine-stage gradient; padding="ignore":
    to the valid tokens only, the padded ones (past counts) set to exactly 0."""
    rows = _epilogue_rows(p)
    K.add_block_grad_kernel[(seq_len // rows, _bh(p))](
        x, pooled, counts, *p.token_strides(seq_len), p.heads, seq_len // p.block_elems,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=rows, IGNORE_PADDING=_ignore(p), num_warps=4)


def valid_rows_copy(p: AttnProblem, x, counts, seq_len: int):
    """A copy of token tensor x (the problem's layout) with the padded rows of each block
    (past counts) written 0, or x itself under padding="zeros": what a library kernel reads
    under padding="ignore", since it multiplies padded rows by zero weights (0 * inf is
    NaN). Allocated like x (torch: the backends that call libraries hold torch tensors)."""
    if not _ignore(p):
        return x
    y = x.new_empty(x.shape)
    rows = _epilogue_rows(p)
    K.valid_rows_copy_kernel[(seq_len // rows, _bh(p))](
        x, y, counts, *p.token_strides(seq_len), p.heads,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=rows, num_warps=4)
    return y
