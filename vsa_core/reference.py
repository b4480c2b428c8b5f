"""Float64 reference of the whole operator (coarse branch, selection, fine branch, gate),
forward and gradients.

Plain numpy in float64 on the host, no framework: inputs are BHSD arrays (anything
`np.asarray` takes; any frontend's arrays are converted by the caller) and so are the
results. The gradients are written out (the chain rule of each step below, next to its
forward), so that both frontends' tests compare against the same exact values without an
autodiff framework. This is the specification in executable form: read it to know what
the kernels compute.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .problem import PREFIX_MODES, check_padding, check_softmax_scale, resolve_softmax_scale


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("<class '", "").split(".")[-1].rstrip("'>")


def round_to_dtype(x, dtype) -> np.ndarray:
    """float64 values rounded to `dtype` ("bfloat16", "float16" or "float32"; a framework
    dtype such as torch.bfloat16 is read by its name), returned as float64. bfloat16
    rounds to nearest even from float32, as the frameworks' casts do."""
    name = _dtype_name(dtype)
    x = np.asarray(x, np.float64)
    if name in ("float32", "float16"):
        return x.astype(name).astype(np.float64)
    if name != "bfloat16":
        raise ValueError(f"round_to_dtype: unsupported dtype {dtype!r}")
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32).astype(np.float64)


def valid_tokens(counts, block_elems: int) -> np.ndarray:
    """Bool [S]: token j of the tile-ordered sequence is valid (among the first counts[j // E]
    of its block); the rest is padding."""
    counts = np.clip(np.asarray(counts, np.int64), 0, block_elems)
    return np.arange(counts.size * block_elems) % block_elems < np.repeat(counts, block_elems)


def _block_mean(x, counts, block_elems: int, round_to) -> np.ndarray:
    """Sum of each block's E rows / its count (FastVideo's mean), 0 for an empty block;
    rounded to `round_to` like the kernels' stored means. The padded rows are summed too:
    with zeros there (padding="zeros") this is the mean of the valid tokens; under
    padding="ignore" the caller zeroed them first (`_valid_only`)."""
    B, H, S, D = x.shape
    total = x.reshape(B, H, S // block_elems, block_elems, D).sum(axis=3)
    counts = np.clip(counts, 0, block_elems).astype(np.float64)[:, None]
    mean = np.where(counts > 0, total / np.maximum(counts, 1), 0.0)
    return mean if round_to is None else round_to_dtype(mean, round_to)


def _block_mean_grad(dmean, counts, block_elems: int) -> np.ndarray:
    """Gradient of `_block_mean` to every row of the block, padded rows included (the sum
    reads them): dmean / count (the rounding passes the gradient straight through)."""
    counts = np.clip(counts, 0, block_elems)
    scale = np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0)[:, None]
    return np.repeat(dmean * scale, block_elems, axis=2)


def _valid_only(x, counts, block_elems: int):
    """x (BHSD) with its padded rows replaced by 0 (None stays None): what padding="ignore"
    reads, so that nothing in the padding, NaN or inf included, reaches a result."""
    if x is None:
        return None
    return np.where(valid_tokens(counts, block_elems)[:, None], x, 0.0)


def _masked_softmax(scores, keep):
    """Softmax over the last axis restricted to `keep`; rows with nothing kept give 0 and lse -inf."""
    scores = np.where(keep, scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    expo = np.where(keep, np.exp(scores - peak), 0.0)
    total = expo.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(np.where(total > 0, total, 1.0))[..., 0] + peak[..., 0], -np.inf)
    probs = np.where(total > 0, expo / np.where(total > 0, total, 1.0), 0.0)
    return probs, lse


def _softmax_grad(probs, dprobs):
    return probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))


def _t(x):
    return np.swapaxes(x, -1, -2)


def _scale(softmax_scale, head_dim: int) -> float:
    """The scores' scale, checked as the frontends check it: 1/sqrt(D) for None."""
    check_softmax_scale(softmax_scale)
    return resolve_softmax_scale(softmax_scale, head_dim)


_LARGEST = {"bfloat16": 3.3895313892515355e38, "float16": 65504.0}


def _round_saturating(x, dtype) -> np.ndarray:
    """round_to_dtype, with values beyond the dtype's largest finite one clamped to it."""
    top = _LARGEST[dtype]
    return round_to_dtype(np.clip(x, -top, top), dtype)


def ranked_scores(dots, scale: float, dtype=None) -> np.ndarray:
    """The scores the top-k selection ranks, from the coarse dots q_c . k_c (block means
    already rounded to the input dtype). For bf16 / fp16 inputs they are FastVideo's
    scores, `torch.matmul(q_c, k_c^T) / sqrt(D)` in the input dtype: the dot rounded to
    the dtype (a matmul's fp32 accumulation, then one rounding), times the scale as an fp32
    number (CUDA torch divides by a Python float as a multiply by its fp32 reciprocal, the
    same number for D 64 and 128), rounded to the dtype again; beyond the dtype's range they
    saturate at its largest finite value (an overflow to -inf would read as an empty
    block). So scores that differ by less than the rounding tie, and a tie goes to the lower
    KV-block index (`topk_mask`), as in FastVideo's selection kernel (and CUDA torch.topk,
    which takes tied values in index order). Any other dtype (None, "float32"): dots * scale."""
    dots = _f64(dots)
    name = None if dtype is None else _dtype_name(dtype)
    if name not in _LARGEST:
        return dots * scale
    return _round_saturating(_round_saturating(dots, name) * float(np.float32(scale)), name)


def coarse_dots(q, k, kv_counts, q_counts, block_elems: int, round_to=None, padding: str = "zeros"):
    """q_c k_c^T [B, H, nQ, nKV]: the dots of the block means (rounded to `round_to`), unscaled."""
    check_padding(padding)
    q, k = _f64(q), _f64(k)
    kv_counts, q_counts = np.asarray(kv_counts, np.int64), np.asarray(q_counts, np.int64)
    if padding == "ignore":
        q, k = _valid_only(q, q_counts, block_elems), _valid_only(k, kv_counts, block_elems)
    qc = _block_mean(q, q_counts, block_elems, round_to)
    kc = _block_mean(k, kv_counts, block_elems, round_to)
    return qc @ _t(kc)


def coarse_scores(q, k, kv_counts, q_counts, block_elems: int, round_to=None, padding: str = "zeros", *,
                  softmax_scale=None) -> np.ndarray:
    """The scores the selection ranks [B, H, nQ, nKV]: the block means' dots times
    `softmax_scale` (None: 1/sqrt(D)), rounded as `ranked_scores` says for a bf16 / fp16
    `round_to`; -inf for empty KV blocks."""
    dots = coarse_dots(q, k, kv_counts, q_counts, block_elems, round_to, padding)
    s = ranked_scores(dots, _scale(softmax_scale, np.shape(q)[-1]), round_to)
    return np.where((np.asarray(kv_counts) <= 0)[None, None, None, :], -np.inf, s)


def topk_mask(scores, topk: int) -> np.ndarray:
    """Bool [B, H, nQ, nKV]: the topk highest finite scores per row, ties to the lower index."""
    s = np.asarray(scores, np.float64)
    n_kv = s.shape[-1]
    cols = np.broadcast_to(np.arange(n_kv), s.shape)
    order = np.lexsort((cols, -s), axis=-1)  # by score descending, then index ascending
    ranks = np.argsort(order, axis=-1)  # inverse permutation: rank of each column
    return (ranks < topk) & np.isfinite(s)


def prefix_topk_mask(scores, topk: int, prefix_blocks: int, prefix_mode: str = "exempt") -> np.ndarray:
    """Selection of mixed-modality VSA (Sq == Skv): the first `prefix_blocks` blocks on the
    query side and on the key side hold non-video tokens (a text prompt, keyframes, audio).

    - prefix query rows are dense: every finite score (every non-empty KV block);
    - video query rows, "exempt": every finite prefix column, plus the `topk` highest
      finite video columns (ranked among the video columns only);
      "compete": the `topk + prefix_blocks` highest finite columns of all;
    ranking, ties (to the lower index) and clamping as in `topk_mask`. prefix_blocks 0 is
    plain VSA in both modes (FastVideo's H3 backend: `num_prefix_tiles`, `exempt`)."""
    if prefix_mode not in PREFIX_MODES:
        raise ValueError(f"prefix_mode must be one of {PREFIX_MODES}, got {prefix_mode!r}")
    s = np.asarray(scores, np.float64)
    n_q, n_kv = s.shape[-2:]
    P = int(prefix_blocks)
    assert 0 <= P <= min(n_q, n_kv), (P, n_q, n_kv)
    finite = np.isfinite(s)
    prefix_col = np.arange(n_kv) < P
    if prefix_mode == "exempt":
        mask = topk_mask(np.where(prefix_col, -np.inf, s), topk) | (finite & prefix_col)
    else:
        mask = topk_mask(s, topk + P)
    dense_row = (np.arange(n_q) < P)[:, None]
    return np.where(dense_row, finite, mask)


def index_lists_to_block_map(block_indices, block_counts, n_kv_blocks: int) -> np.ndarray:
    """Bool [B, H, nQ, nKV] of the blocks a list selects, by the kernels' rule for lists
    that eager mode would reject (under jit / compile): the count is clamped to
    [0, capacity], and an entry counts only if it is in [0, nKV) and greater than the
    last entry counted in its row (so repeats and entries out of order are dropped)."""
    idx = np.asarray(block_indices, dtype=np.int64)
    num = np.clip(np.asarray(block_counts, dtype=np.int64), 0, idx.shape[-1])
    out = np.zeros(idx.shape[:-1] + (n_kv_blocks,), bool)
    for row in np.ndindex(*idx.shape[:-1]):
        last = -1
        for entry in idx[row][: num[row]]:
            if last < entry < n_kv_blocks:
                out[row + (entry,)] = True
                last = entry
    return out


def shared_kv_lists_reference(block_indices, block_counts, n_kv_blocks: int, group: int):
    """What `stage_kernels.shared_kv_lists_kernel` writes, from the block map of the list rule:
    per group of `group` neighbouring query blocks the ascending union of their counted
    blocks (union_idx [B, H, nG, group * cap], -1 past union_num) and per query block the
    union positions of its counted blocks, ascending (own_pos [B, H, nQ, cap], -1 past
    own_num). Returns (union_idx, union_num, own_pos, own_num) as int64 arrays."""
    sel = index_lists_to_block_map(block_indices, block_counts, n_kv_blocks)  # [B, H, nQ, nKV]
    B, H, nq, _ = sel.shape
    cap = np.asarray(block_indices).shape[-1]
    n_groups = -(-nq // group)
    padded = np.zeros((B, H, n_groups * group, n_kv_blocks), bool)
    padded[:, :, :nq] = sel
    union = padded.reshape(B, H, n_groups, group, n_kv_blocks).any(axis=3)
    union_idx = np.full((B, H, n_groups, group * cap), -1, np.int64)
    own_pos = np.full((B, H, nq, cap), -1, np.int64)
    rank = np.cumsum(union, axis=-1) - 1  # a union block's position: the union blocks below it
    for b, h, g in np.ndindex(B, H, n_groups):
        blocks = np.flatnonzero(union[b, h, g])
        union_idx[b, h, g, :len(blocks)] = blocks
        for i in range(g * group, min(nq, (g + 1) * group)):
            mine = np.flatnonzero(sel[b, h, i])
            own_pos[b, h, i, :len(mine)] = rank[b, h, g, mine]
    return union_idx, union.sum(-1), own_pos, sel.sum(-1)


def pair_lists_reference(block_indices, block_counts, n_kv_blocks: int):
    """What `stage_kernels.pair_lists_kernel` writes, from the block map of the list rule: per pair of
    query blocks (2p, 2p + 1) the blocks both count, ascending, then each list's own other blocks,
    ascending (pair_idx [B, H, nQ, cap], -1 past pair_num [B, H, nQ]); shared_num [B, H, nP] the
    shared blocks per pair. Returns (pair_idx, pair_num, shared_num) as int64 arrays."""
    sel = index_lists_to_block_map(block_indices, block_counts, n_kv_blocks)  # [B, H, nQ, nKV]
    B, H, nq, _ = sel.shape
    cap = np.asarray(block_indices).shape[-1]
    pair_idx = np.full((B, H, nq, cap), -1, np.int64)
    shared_num = np.zeros((B, H, -(-nq // 2)), np.int64)
    for b, h, i in np.ndindex(B, H, nq):
        mate = i ^ 1
        other = sel[b, h, mate] if mate < nq else np.zeros(n_kv_blocks, bool)
        both = np.flatnonzero(sel[b, h, i] & other)
        own = np.flatnonzero(sel[b, h, i] & ~other)
        pair_idx[b, h, i, :len(both) + len(own)] = np.concatenate([both, own])
        shared_num[b, h, i // 2] = len(both)
    return pair_idx, sel.sum(-1), shared_num


def _fine(q, k, v, block_map, kv_counts, block_elems: int, scale: float):
    """The fine branch's probabilities, output and lse."""
    Sq, Skv = q.shape[2], k.shape[2]
    in_block = np.arange(Skv) % block_elems
    token_valid = in_block < np.repeat(kv_counts, block_elems)
    keep = np.repeat(np.repeat(np.asarray(block_map, bool), block_elems, axis=2), block_elems, axis=3)
    keep = keep & token_valid[None, None, None, :]
    assert keep.shape[2:] == (Sq, Skv)
    probs, lse = _masked_softmax(q @ _t(k) * scale, keep)
    return probs, probs @ v, lse


def _attention_grads(q, k, v, probs, dout, scale):
    """dq, dk, dv of out = softmax(q k^T * scale) v, given its probabilities."""
    dv = _t(probs) @ dout
    ds = _softmax_grad(probs, dout @ _t(v)) * scale
    return ds @ k, _t(ds) @ q, dv


def block_sparse_attn_reference(q, k, v, block_map, kv_counts, block_elems: int, dout=None, padding: str = "zeros", *,
                                softmax_scale=None):
    """Fine branch: each query sees the valid tokens of its block's selected KV blocks, with
    the scores q k^T scaled by `softmax_scale` (None: 1/sqrt(D)).

    Returns (out, lse) with lse the natural-log logsumexp of the scaled scores; given
    `dout`, (out, lse, {"dq", "dk", "dv"}) with the gradients of out against it.
    Padding: the padded KV rows are masked as keys either way (their dk, dv are 0); with
    padding="zeros" they are still multiplied in (0 * v), as FastVideo's kernels do, so
    NaN / inf there reach the output; "ignore" reads them as 0.
    """
    check_padding(padding)
    q, k, v = _f64(q), _f64(k), _f64(v)
    kv_counts = np.asarray(kv_counts, np.int64)
    scale = _scale(softmax_scale, q.shape[-1])
    if padding == "ignore":
        k, v = _valid_only(k, kv_counts, block_elems), _valid_only(v, kv_counts, block_elems)
    probs, out, lse = _fine(q, k, v, block_map, kv_counts, block_elems, scale)
    if dout is None:
        return out, lse
    dq, dk, dv = _attention_grads(q, k, v, probs, _f64(dout), scale)
    return out, lse, {"dq": dq, "dk": dk, "dv": dv}


def video_sparse_attn_reference(q, k, v, kv_counts, q_counts, topk: int, block_elems: int,
                                gate=None, round_to=None, block_map=None, dout=None, prefix_blocks: int = 0,
                                prefix_mode: str = "exempt", padding: str = "zeros", *, softmax_scale=None):
    """VSA forward in float64. Returns (out, block_map used, the coarse scores the selection
    ranks: `ranked_scores`); given `dout`, also the gradients {"dq", "dk", "dv"(, "dgate")}
    of out against it.

    Padding (block i holds q_counts[i] / kv_counts[i] valid tokens at its start, then
    padding):
    - "zeros" (FastVideo's function): each block mean is the sum of all E rows divided
      by the valid count (the mean of the valid tokens when the padding holds zeros), so
      its gradient dmean / count reaches every row of the block, padded ones included;
      padded query rows are computed like any other (they attend over the selected blocks'
      valid keys, get out_fine + gate * out_coarse, and dout there counts); padded KV rows
      are masked as keys (no fine-branch gradient) but get the pooling gradient.
    - "ignore": the padded rows of q, k, v, the gate and dout are never read (read as 0:
      NaN or inf there change nothing); the padded output rows and every padded row of
      the gradients are exactly 0.
    Empty blocks (count 0) have a zero mean and no pooling gradient; empty KV blocks are
    never selected and are left out of the coarse softmax (FastVideo divides by 0 there).

    `round_to` (e.g. "bfloat16") models the kernels' cast of the block means to the
    input dtype (the gradient passes that rounding straight through), and the rounding of
    the scores the selection ranks (`ranked_scores`; the coarse softmax takes them
    unrounded). `block_map`
    overrides the selection (the tests pass the kernel's selection once they have checked
    it is a valid top-k of these scores). `prefix_blocks` / `prefix_mode`: mixed-modality
    selection (`prefix_topk_mask`); the coarse branch and the gate do not depend on them.
    `softmax_scale` (None: 1/sqrt(D)) scales the scores of both branches, the coarse one's
    (which the selection ranks) and the fine one's.
    """
    check_padding(padding)
    q, k, v = _f64(q), _f64(k), _f64(v)
    gate = None if gate is None else _f64(gate)
    dout = None if dout is None else _f64(dout)
    kv_counts, q_counts = np.asarray(kv_counts, np.int64), np.asarray(q_counts, np.int64)
    E, scale = block_elems, _scale(softmax_scale, q.shape[-1])
    ignore = padding == "ignore"
    if ignore:  # what "ignore" reads: the valid rows, the padded ones as 0
        q, gate, dout = (_valid_only(x, q_counts, E) for x in (q, gate, dout))
        k, v = (_valid_only(x, kv_counts, E) for x in (k, v))
    qc = _block_mean(q, q_counts, E, round_to)
    kc = _block_mean(k, kv_counts, E, round_to)
    vc = _block_mean(v, kv_counts, E, round_to)
    dots = qc @ _t(kc)
    kv_ok = np.broadcast_to((kv_counts > 0)[None, None, None, :], dots.shape)
    probs_c, _ = _masked_softmax(dots * scale, kv_ok)  # the softmax of the unrounded scores
    out_coarse = np.repeat(probs_c @ vc, E, axis=2)
    scores = np.where(kv_ok, ranked_scores(dots, scale, round_to), -np.inf)
    if block_map is None and prefix_blocks:
        assert q.shape[2] == k.shape[2], "prefix blocks need Sq == Skv (joint self-attention)"
        block_map = prefix_topk_mask(scores, min(topk, k.shape[2] // E), prefix_blocks, prefix_mode)
    elif block_map is None:
        block_map = topk_mask(scores, min(topk, k.shape[2] // E))
    probs_f, out_fine, _ = _fine(q, k, v, block_map, kv_counts, E, scale)
    out = out_coarse * gate + out_fine if gate is not None else out_coarse + out_fine
    if ignore:
        out = _valid_only(out, q_counts, E)
    if dout is None:
        return out, block_map, scores
    dq, dk, dv = _attention_grads(q, k, v, probs_f, dout, scale)  # the fine branch
    dout_c = dout * gate if gate is not None else dout
    B, H, Sq, D = q.shape
    dout_c = dout_c.reshape(B, H, Sq // E, E, D).sum(axis=3)  # out_coarse repeats each block's row
    dqc, dkc, dvc = _attention_grads(qc, kc, vc, probs_c, dout_c, scale)
    grads = {"dq": dq + _block_mean_grad(dqc, q_counts, E), "dk": dk + _block_mean_grad(dkc, kv_counts, E),
             "dv": dv + _block_mean_grad(dvc, kv_counts, E)}
    if gate is not None:
        grads["dgate"] = dout * out_coarse
    if ignore:  # padded rows are inputs of nothing
        grads = {n: _valid_only(g, kv_counts if n in ("dk", "dv") else q_counts, E) for n, g in grads.items()}
    return out, block_map, scores, grads
