"""The shared stages, on caller-provided buffers: what `vsa_core.ops` runs around every
backend's fine stage (pooling, coarse attention, top-k selection, list building and
cleaning, the backward's preprocess) and the epilogues of the backends whose fine stage is a
library kernel (coarse mix, pooled-gradient add, valid-row copy).

Their kernels are `vsa_core.stage_kernels`; launch configurations live here. Each stage
takes the launcher its launches go through first (`vsa_core.launch`). CPU tensors
run the same kernels under Triton's interpreter: each launch picks the kernels module by
the tensors' device (`kernels_for`, which the backends use for their own kernels too; see
`vsa_core.interpreter`).
"""

from __future__ import annotations

import triton

from . import stage_kernels as K
from .interpreter import interpreted_kernels
from .problem import AttnProblem
from .runtime import INTERPRETING

# Precision of the coarse kernels' products with fp32 operands (P@V forward; dP, dQ, dK, dV
# backward): the launcher's `config.coarse_precision`. "ieee" (the default): exact fp32 products
# (bf16 parts on the tensor cores, `_coarse_dot` in stage_kernels). "tf32" cuts the fp32 operands
# to 10-bit mantissas, which measured 5e-2 relative error in dK at x16 activations (the coarse
# softmax is sharp there and rowsum(dO_c * out_c) cancels against dP): VSA_COARSE_PRECISION=tf32
# runs it for comparisons only (benchmarks/coarse_bench.py, the TF32 detector of
# tests/test_coarse_precision.py); the interpreter computes fp32 whatever this says.


def interpreted(x) -> bool:
    """True when kernels on x run under the interpreter (CPU tensors, or TRITON_INTERPRET=1).
    "meta" buffers (vsa_core.plan records a GPU launch plan with them) are not: the plan
    needs the compiled kernels and their GPU constexprs."""
    return INTERPRETING or x.device.type == "cpu"


def kernels_for(x, kernels=K):
    """`kernels` (a module of Triton kernels: the stages' by default, a backend's own) for
    tensors on x's device: compiled for CUDA (and meta), interpreted for the CPU."""
    if not interpreted(x):
        return kernels
    # under TRITON_INTERPRET=1 the module is interpreted already
    return kernels if INTERPRETING else interpreted_kernels(kernels)


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


def _coarse_config(launcher, p: AttnProblem, x, stage: str):
    """(kernels module, launch options) of one coarse kernel for tensors like x."""
    config = COARSE_INTERPRETER_CONFIG[stage] if interpreted(x) else COARSE_CONFIGS[p.head_dim][stage]
    *tiles, warps, stages = config
    names = ("BLOCK_M", "BLOCK_K", "BLOCK_D") if stage == "grads" else ("BLOCK_M", "BLOCK_N")
    return kernels_for(x), dict(zip(names, tiles), HEAD_DIM=p.head_dim,
                                DOT_PRECISION=launcher.config.coarse_precision, UPCAST=interpreted(x),
                                INPUT_PARTS=_INPUT_PARTS[p.dtype], num_warps=warps, num_stages=stages)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _bh(p: AttnProblem) -> int:
    return p.batch * p.heads


def _ignore(p: AttnProblem) -> bool:
    """The kernels' IGNORE_PADDING: padding="ignore" (padded rows never read into a result)."""
    return p.padding == "ignore"


def block_mean_pool(launcher, p: AttnProblem, x, counts, pooled, seq_len: int):
    sb, sh, ss = p.token_strides(seq_len)
    n_blocks = seq_len // p.block_elems
    launcher.triton(kernels_for(x).block_mean_pool_kernel, (n_blocks, _bh(p)),
        x, counts, pooled, sb, sh, ss, p.heads, n_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=min(64, p.block_elems), IGNORE_PADDING=_ignore(p))


# Pooling: (token rows per load, num_warps). It reads q, k and v once: few warps per block with
# many blocks in flight reach the memory bandwidth (benchmarks/coarse_sweep.py measures it)
POOL_CONFIG = (64, 2)


def block_mean_pool_qkv(launcher, p: AttnProblem, q, k, v, q_counts, kv_counts, q_pool, k_pool, v_pool):
    """block_mean_pool of q, k and v in one launch."""
    rows, warps = POOL_CONFIG
    launcher.triton(kernels_for(q).block_mean_pool_qkv_kernel, (p.n_q_blocks + 2 * p.n_kv_blocks, _bh(p)),
        q, k, v, q_counts, kv_counts, q_pool, k_pool, v_pool, *p.token_strides(p.q_len),
        *p.token_strides(p.kv_len), p.heads, p.n_q_blocks, p.n_kv_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=min(rows, p.block_elems), IGNORE_PADDING=_ignore(p),
        num_warps=warps)


def coarse_forward(launcher, p: AttnProblem, q_pool, k_pool, v_pool, kv_counts, scores, out_coarse, lse_coarse,
                   q_seq=None, kv_seq=None):
    """Coarse attention, and into `scores` the scores the selection ranks (rounded to the
    input dtype as FastVideo's are: `coarse_attn_fwd_kernel`). q_seq / kv_seq (packed
    sequences): sequence id per block; other sequences' KV blocks are masked like empty ones."""
    kernels, opts = _coarse_config(launcher, p, q_pool, "fwd")
    launcher.triton(kernels.coarse_attn_fwd_kernel, (triton.cdiv(p.n_q_blocks, opts["BLOCK_M"]), _bh(p)),
        q_pool, k_pool, v_pool, kv_counts, scores, out_coarse, lse_coarse, q_seq, kv_seq,
        p.n_q_blocks, p.n_kv_blocks, p.softmax_scale, VARLEN=q_seq is not None, RANK_DTYPE=p.dtype, **opts)


def coarse_backward(launcher, p: AttnProblem, q_pool, k_pool, v_pool, kv_counts, out_coarse, lse_coarse, dout_coarse,
                    dq_pool, dk_pool, dv_pool, p_coarse, ds_coarse, q_seq=None, kv_seq=None):
    """dq_c, dk_c, dv_c (fp32) of the coarse attention in two launches: P and dS tile by tile
    into the fp32 workspaces p_coarse / ds_coarse ([B, H, nQ, nKV]), then their products."""
    scale = p.softmax_scale
    kernels, opts = _coarse_config(launcher, p, q_pool, "ds")
    grid = (triton.cdiv(p.n_q_blocks, opts["BLOCK_M"]), triton.cdiv(p.n_kv_blocks, opts["BLOCK_N"]), _bh(p))
    launcher.triton(kernels.coarse_attn_bwd_ds_kernel, grid,
        q_pool, k_pool, v_pool, kv_counts, out_coarse, lse_coarse, dout_coarse, p_coarse, ds_coarse, q_seq, kv_seq,
        p.n_q_blocks, p.n_kv_blocks, scale, VARLEN=q_seq is not None, **opts)
    kernels, opts = _coarse_config(launcher, p, q_pool, "grads")
    grid = (triton.cdiv(max(p.n_q_blocks, p.n_kv_blocks), opts["BLOCK_M"]), 3 * (p.head_dim // opts["BLOCK_D"]),
            _bh(p))
    launcher.triton(kernels.coarse_attn_bwd_grads_kernel, grid,
        q_pool, k_pool, dout_coarse, p_coarse, ds_coarse, dq_pool, dk_pool, dv_pool, p.n_q_blocks, p.n_kv_blocks,
        scale, **opts)


def select_warps(n_pad: int) -> int:
    """Warps per score row of the top-k selection: its 32 counting passes are each a
    reduction over the row, and within one warp a reduction needs no barrier (shuffles
    only), so a row gets one warp up to 1024 scores (32 per thread), more beyond."""
    return min(8, max(1, n_pad // 1024))


def topk_tiles(n_kv: int) -> tuple[int, int]:
    """(HALF, TAIL_HALF) of `topk_select_kernel`: a row of n_kv scores read as a main tile of
    2 HALF columns, the largest power of two <= n_kv, and a tail tile of 2 TAIL_HALF, the
    smallest power of two >= the rest (16 columns at least each; tile widths are powers of
    two in Triton). The packed counting passes need fewer than 2^16 words per row."""
    if n_kv >= 1 << 17:
        raise ValueError(f"kv_len / block_size: the top-k selection takes fewer than 131072 KV blocks, got {n_kv}")
    main = max(16, 1 << (max(n_kv, 1).bit_length() - 1))
    return main // 2, _pow2(n_kv - main) // 2


_PREFIX_MODES = {"exempt": 1, "compete": 2}


# fp32 bits that are zero in a score rounded to the dtype (its mantissa is that much shorter)
_ROUNDED_ZERO_BITS = {"bfloat16": 16, "float16": 13, "float32": 0}


# The top-k selection kernels (`topk_select`'s `algorithm`); both select the same set:
# "threshold" (`topk_select_kernel`): 32-bit keys, the high bits one unpacked pass each, the low 15 packed;
# "packed" (`topk_select_packed_kernel`): 16-bit keys packed from the first pass, one prefix sum per tile.
TOPK_KERNELS = {"threshold": "topk_select_kernel", "packed": "topk_select_packed_kernel"}
TOPK_ALGORITHMS = tuple(TOPK_KERNELS)
TOPK_ALGORITHM = "packed"


def topk_select(launcher, p: AttnProblem, scores, sel_idx, sel_num, sel_mask, num_warps=None, q_seq=None,
                cu_seqlens_q=None, cu_seqlens_k=None, seq_prefix=None, scores_rounded_to: str = "float32",
                algorithm: str = None):
    """Query-owned lists of the top-k selection; with a prefix (p.has_prefix) the dense prefix
    rows and the prefix columns too. Packed sequences with a prefix need the query blocks'
    sequence ids and the offsets (each sequence's prefix starts at its first block), and
    p.seq_prefix the per-sequence counts. `scores_rounded_to`: the dtype every score is a
    value of (`coarse_forward` writes them rounded to p.dtype): the ranking then skips the
    bits such values leave zero; "float32" ranks any fp32 scores. `algorithm`: one of
    TOPK_ALGORITHMS (None: TOPK_ALGORITHM), the same selection by another kernel."""
    algorithm = TOPK_ALGORITHM if algorithm is None else algorithm
    if algorithm not in TOPK_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {TOPK_ALGORITHMS}, got {algorithm!r}")
    if scores_rounded_to not in _ROUNDED_ZERO_BITS:
        raise ValueError(f"scores_rounded_to must be one of {tuple(_ROUNDED_ZERO_BITS)}, got {scores_rounded_to!r}")
    half, tail_half = topk_tiles(p.n_kv_blocks)
    varlen = p.has_prefix and p.varlen
    if varlen and (q_seq is None or cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("a packed prefix selection needs q_seq, cu_seqlens_q and cu_seqlens_k")
    if p.seq_prefix and seq_prefix is None:
        raise ValueError("this problem takes per-sequence prefix counts: seq_prefix is required")
    kernels = kernels_for(scores)
    kernel = getattr(kernels, TOPK_KERNELS[algorithm])
    if algorithm == "packed":
        keys = dict(KEYS=scores_rounded_to)
    else:
        keys = dict(KEY_SHIFT=_ROUNDED_ZERO_BITS[scores_rounded_to])
    launcher.triton(kernel, (_bh(p) * p.n_q_blocks,),
        scores, sel_idx, sel_num, sel_mask, q_seq if varlen else None, cu_seqlens_q if varlen else None,
        cu_seqlens_k if varlen else None, seq_prefix if p.seq_prefix else None,
        p.n_q_blocks, p.n_kv_blocks, p.topk, p.select_capacity, p.prefix_blocks, max(p.n_seqs, 1),
        HALF=half, TAIL_HALF=tail_half, PREFIX_MODE=_PREFIX_MODES[p.prefix_mode] if p.has_prefix else 0, VARLEN=varlen,
        PER_SEQ_PREFIX=p.seq_prefix, BLOCK_ELEMS=p.block_elems, **keys,
        num_warps=num_warps or select_warps(2 * (half + tail_half)))


def rows_to_lists(launcher, p: AttnProblem, block_mask, sel_idx, sel_num, q_seq=None, kv_seq=None):
    """Query-owned lists from a [B, H, nQ, nKV] mask (one line per query block); with the
    sequence ids (packed sequences) blocks of another sequence are left out."""
    nq, nk = p.n_q_blocks, p.n_kv_blocks
    launcher.triton(kernels_for(block_mask).compact_mask_kernel, (nq, _bh(p)),
        block_mask, sel_idx, sel_num, q_seq, kv_seq, nq, nk, nq * nk, nk, 1, sel_idx.shape[-1], N_PAD=_pow2(nk),
        SAME_SEQ=q_seq is not None, num_warps=4)


# KV-owned lists: (columns, query rows) of a program's mask tile per step. The steps down the query
# axis are serial (each waits on its own loads), so they are few: 128 rows. 16 columns a program
# gives twice the programs of 32 at half the registers (benchmarks/columns_bench.py times the
# tiles; no spills on sm_90: tests/test_topk_select.py compiles it)
COLUMNS_TILE = (16, 128)


def columns_to_lists(launcher, p: AttnProblem, block_mask, inv_idx, inv_num):
    """KV-owned (inverse) lists from a [B, H, nQ, nKV] mask (one list per KV block), a
    tile of adjacent columns per program (`columns_to_lists_kernel`)."""
    nq, nk = p.n_q_blocks, p.n_kv_blocks
    cols, rows = COLUMNS_TILE
    launcher.triton(kernels_for(block_mask).columns_to_lists_kernel, (triton.cdiv(nk, cols), _bh(p)),
        block_mask, inv_idx, inv_num, nq, nk, inv_idx.shape[-1], COLS=cols, ROWS=min(rows, _pow2(nq)), num_warps=4)


def block_seq_ids(launcher, p: AttnProblem, cu_seqlens, seq, n_blocks: int):
    """seq[i] (int32) = the sequence of block i, from the int32 token offsets [N + 1]."""
    launcher.triton(kernels_for(seq).block_seq_ids_kernel, (triton.cdiv(n_blocks, 256),),
        cu_seqlens, seq, n_blocks, p.n_seqs, BLOCK_ELEMS=p.block_elems, BLOCK=256, num_warps=4)


def clean_lists(launcher, p: AttnProblem, given_idx, given_num, sel_idx, sel_num, q_seq=None, kv_seq=None):
    """The caller's lists as the kernels' rule reads them (`clean_lists_kernel`): ascending,
    in range, counts within the capacity; with the sequence ids (packed sequences) the
    entries outside the query block's own sequence dropped too."""
    cap = given_idx.shape[-1]
    launcher.triton(kernels_for(sel_idx).clean_lists_kernel, (_bh(p) * p.n_q_blocks,),
        given_idx, given_num, q_seq, kv_seq, sel_idx, sel_num, p.n_q_blocks, p.n_kv_blocks, cap,
        SLOTS=_pow2(cap), SAME_SEQ=q_seq is not None, num_warps=4)


def backward_preprocess(launcher, p: AttnProblem, out_fine, dout, delta, gate=None, out_coarse=None, dgate=None,
                        dout_coarse=None, q_counts=None, out=None):
    """delta for the fine backward; with the coarse branch also dgate and dout_coarse
    (padding="ignore": dout of the padded query rows, past q_counts, read as 0). With the coarse
    branch and `p.fine_residual` "rounding", out_fine is out's rounding residual and `out` is read."""
    rounding = out_coarse is not None and p.fine_residual == "rounding"
    launcher.triton(kernels_for(dout).sparse_attn_bwd_preprocess_kernel, (p.n_q_blocks, _bh(p)),
        dout, out_fine, gate, out_coarse, delta, dgate, dout_coarse, q_counts, out if rounding else None,
        *p.token_strides(p.q_len), p.heads, p.q_len, p.n_q_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=min(64, p.block_elems),
        HAS_COARSE=out_coarse is not None, HAS_GATE=gate is not None, IGNORE_PADDING=_ignore(p),
        FINE_ROUNDING=rounding)


def lists_to_mask(launcher, p: AttnProblem, sel_idx, sel_num, block_mask):
    launcher.triton(kernels_for(sel_idx).lists_to_mask_kernel, (_bh(p) * p.n_q_blocks,),
        sel_idx, sel_num, block_mask, p.n_kv_blocks, sel_idx.shape[-1], N_PAD=_pow2(p.n_kv_blocks), num_warps=4)


# ---- epilogues of the backends whose fine stage is a library kernel (cute, cudnn) ----------
def _epilogue_rows(p: AttnProblem) -> int:
    return min(64, p.block_elems)


def mix_coarse(launcher, p: AttnProblem, out, lse, out_coarse, q_counts, gate=None, out_fine=None) -> None:
    """`out` holds the library's fine output: turns it into out_fine + gate * out_c (or
    + out_c) in place; with `out_fine`, keeps the fine output for the backward (in out_fine's
    dtype: q's for the library backends, `AttnProblem.fine_residual`).
    padding="ignore": the padded query rows (past q_counts) get out 0, out_fine 0 and lse
    +inf (in place in the library's `lse`), so the library's backward takes nothing from them."""
    rows = _epilogue_rows(p)
    launcher.triton(K.mix_coarse_kernel, (p.q_len // rows, _bh(p)),
        out, lse, gate, out_coarse, out_fine, q_counts, *p.token_strides(p.q_len), p.heads, p.q_len, p.n_q_blocks,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=rows,
        HAS_GATE=gate is not None, STORE_FINE=out_fine is not None, IGNORE_PADDING=_ignore(p), num_warps=4)


def add_block_grad(launcher, p: AttnProblem, x, pooled, counts, seq_len: int) -> None:
    """x[token] += pooled[its block] / counts[block] for every token of the block, in place:
    the mean pooling's gradient added to a library's fine-stage gradient; padding="ignore":
    to the valid tokens only, the padded ones (past counts) set to exactly 0."""
    rows = _epilogue_rows(p)
    launcher.triton(K.add_block_grad_kernel, (seq_len // rows, _bh(p)),
        x, pooled, counts, *p.token_strides(seq_len), p.heads, seq_len // p.block_elems,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=rows, IGNORE_PADDING=_ignore(p), num_warps=4)


def valid_rows_copy(launcher, p: AttnProblem, x, counts, seq_len: int, out=None):
    """A copy of token tensor x (the problem's layout) with the padded rows of each block
    (past counts) written 0, or x itself under padding="zeros": what a library kernel reads
    under padding="ignore", since it multiplies padded rows by zero weights (0 * inf is
    NaN). Written to `out` (x's shape and dtype) when given, else allocated like x (torch: the
    backends that call libraries hold torch tensors)."""
    if not _ignore(p):
        return x
    y = x.new_empty(x.shape) if out is None else out
    rows = _epilogue_rows(p)
    launcher.triton(K.valid_rows_copy_kernel, (seq_len // rows, _bh(p)),
        x, y, counts, *p.token_strides(seq_len), p.heads,
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, ROWS=rows, num_warps=4)
    return y


# The token inputs that the backends whose kernels multiply padded rows by zero weights (sm90,
# cute, cudnn) read as `valid_rows_copy`s under padding="ignore", per stage: name -> the sequence
# it spans. The query side only with the coarse branch (VSA), whose q_counts say which rows are padded.
VALID_ROW_COPIES = {"forward": {"k": "kv", "v": "kv"}, "backward": {"q": "q", "dout": "q", "k": "kv", "v": "kv"}}


def _valid_rows_copied(stage: str, p: AttnProblem, name: str) -> bool:
    side = VALID_ROW_COPIES[stage].get(name)
    return _ignore(p) and side is not None and (p.is_vsa or side == "kv")


def _valid_rows_len(stage: str, p: AttnProblem, name: str) -> int:
    return p.q_len if VALID_ROW_COPIES[stage][name] == "q" else p.kv_len


def valid_rows_workspaces(stage: str, p: AttnProblem) -> dict:
    """The workspaces `valid_rows_input` asks for in `stage` (name -> (shape, dtype)): "<input>_valid"."""
    return {f"{n}_valid": (p.token_shape(_valid_rows_len(stage, p, n)), "input") for n in VALID_ROW_COPIES[stage]
            if _valid_rows_copied(stage, p, n)}


def valid_rows_input(launcher, p: AttnProblem, stage: str, name: str, x, counts):
    """Input `name` of `stage` as such a backend's kernels read it: x, or under padding="ignore" its
    `valid_rows_copy` in workspace "<name>_valid" (`launcher.workspace`)."""
    if not _valid_rows_copied(stage, p, name):
        return x
    seq_len = _valid_rows_len(stage, p, name)
    out = launcher.workspace(f"{name}_valid", p.token_shape(seq_len), "input", x)
    return valid_rows_copy(launcher, p, x, counts, seq_len, out=out)


# ---- the shared-KV lists of sm90_fwd64 (not an AttnProblem stage: the kernel is not a backend yet)
def shared_kv_lists(launcher, sel_idx, sel_num, n_kv_blocks: int, group: int, union_idx, union_num, own_pos, own_num):
    """For groups of `group` neighbouring query blocks (the CTAs of sm90_fwd64's shared_kv
    variants): the ascending union of their lists by the list rule and each query block's
    positions in it (`shared_kv_lists_kernel`). sel_idx [B, H, nQ, cap], sel_num [B, H, nQ]
    (contiguous int32); union_idx [B, H, nG, group * cap], union_num [B, H, nG], own_pos
    [B, H, nQ, cap], own_num [B, H, nQ] int32, nG = ceil(nQ / group)."""
    B, H, nq, cap = sel_idx.shape
    n_groups = -(-nq // group)
    launcher.triton(kernels_for(sel_idx).shared_kv_lists_kernel, (n_groups, B * H),
        sel_idx, sel_num, union_idx, union_num, own_pos, own_num, nq, n_kv_blocks, cap, n_groups,
        GROUP=group, CH=min(64, _pow2(cap)), num_warps=4)


def pair_lists(launcher, sel_idx, sel_num, n_kv_blocks: int, pair_idx, pair_num, shared_num):
    """For the pairs of neighbouring query blocks (2p, 2p + 1) of sm90_fwd64's cluster_pairs
    variant: each list by the list rule with the blocks the pair shares first, at the same
    positions in both lists (`pair_lists_kernel`). sel_idx [B, H, nQ, cap], sel_num [B, H, nQ]
    (contiguous int32); pair_idx [B, H, nQ, cap], pair_num [B, H, nQ], shared_num [B, H, nP]
    int32, nP = ceil(nQ / 2)."""
    B, H, nq, cap = sel_idx.shape
    n_pairs = -(-nq // 2)
    launcher.triton(kernels_for(sel_idx).pair_lists_kernel, (n_pairs, B * H),
        sel_idx, sel_num, pair_idx, pair_num, shared_num, nq, n_kv_blocks, cap, n_pairs,
        CH=min(64, _pow2(cap)), num_warps=4)
