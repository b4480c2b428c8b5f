"""Float64 reference of the whole operator (coarse branch, selection, fine branch, gate).

Written with plain torch float64 ops on the CPU so that autograd gives the exact
gradients the kernels are compared with. Inputs are BHSD; any frontend's arrays are
converted by the tests. This is the specification in executable form: read it to
know what the kernels compute.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch


def valid_tokens(counts, block_elems: int) -> torch.Tensor:
    """Bool [S]: token j of the tile-ordered sequence is valid (among the first counts[j // E]
    of its block); the rest is padding."""
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.int64).clamp(0, block_elems)
    return torch.arange(counts.numel() * block_elems) % block_elems < counts.repeat_interleave(block_elems)


def _block_mean(x: torch.Tensor, counts: torch.Tensor, block_elems: int, round_to) -> torch.Tensor:
    """Mean of each block's valid tokens: the padded tail is not read (nor given a gradient)."""
    B, H, S, D = x.shape
    x = torch.where(valid_tokens(counts, block_elems)[:, None], x, torch.zeros((), dtype=x.dtype))
    total = x.reshape(B, H, S // block_elems, block_elems, D).sum(dim=3)
    counts = counts.to(x.dtype)[:, None]
    mean = torch.where(counts > 0, total / counts.clamp_min(1), torch.zeros_like(total))
    if round_to is not None:  # the kernels store means in the input dtype; gradient passes straight through
        mean = mean + (mean.to(round_to).to(mean.dtype) - mean).detach()
    return mean


def _masked_softmax(scores: torch.Tensor, keep: torch.Tensor):
    """Softmax over the last axis restricted to `keep`; rows with nothing kept give 0 and lse -inf."""
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe[..., None]).masked_fill(~keep, 0.0)
    return probs, lse


def coarse_scores(q, k, kv_counts, q_counts, block_elems: int, round_to=None) -> torch.Tensor:
    """Scaled block-mean scores [B, H, nQ, nKV], -inf for empty KV blocks."""
    qc = _block_mean(q, q_counts, block_elems, round_to)
    kc = _block_mean(k, kv_counts, block_elems, round_to)
    s = qc @ kc.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.masked_fill((kv_counts == 0)[None, None, None, :], float("-inf"))


def topk_mask(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Bool [B, H, nQ, nKV]: the topk highest finite scores per row, ties to the lower index."""
    s = scores.detach().cpu().numpy()
    n_kv = s.shape[-1]
    cols = np.broadcast_to(np.arange(n_kv), s.shape)
    order = np.lexsort((cols, -s), axis=-1)  # by score descending, then index ascending
    ranks = np.argsort(order, axis=-1)  # inverse permutation: rank of each column
    return torch.from_numpy((ranks < topk) & np.isfinite(s))


PREFIX_MODES = ("exempt", "compete")


def prefix_topk_mask(scores: torch.Tensor, topk: int, prefix_blocks: int, prefix_mode: str = "exempt"
                     ) -> torch.Tensor:
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
    n_q, n_kv = scores.shape[-2:]
    P = int(prefix_blocks)
    assert 0 <= P <= min(n_q, n_kv), (P, n_q, n_kv)
    finite = torch.isfinite(scores)
    prefix_col = torch.arange(n_kv) < P
    if prefix_mode == "exempt":
        video = topk_mask(scores.masked_fill(prefix_col, float("-inf")), topk)
        mask = video | (finite & prefix_col)
    else:
        mask = topk_mask(scores, topk + P)
    dense_row = (torch.arange(n_q) < P)[:, None]
    return torch.where(dense_row, finite, mask)


def index_lists_to_block_map(block_indices, block_counts, n_kv_blocks: int) -> torch.Tensor:
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
    return torch.from_numpy(out)


def block_sparse_attn_reference(q, k, v, block_map, kv_counts, block_elems: int):
    """Fine branch: each query sees the valid tokens of its block's selected KV blocks.

    Returns (out, lse) with lse the natural-log logsumexp of the scaled scores.
    """
    Sq, Skv = q.shape[2], k.shape[2]
    in_block = torch.arange(Skv) % block_elems
    token_valid = in_block < kv_counts.repeat_interleave(block_elems)
    keep = block_map.repeat_interleave(block_elems, dim=2).repeat_interleave(block_elems, dim=3)
    keep = keep & token_valid[None, None, None, :]
    assert keep.shape[2:] == (Sq, Skv)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    probs, lse = _masked_softmax(s, keep)
    return probs @ v, lse


def video_sparse_attn_reference(q, k, v, kv_counts, q_counts, topk: int, block_elems: int,
                                gate: Optional[torch.Tensor] = None, round_to=None,
                                block_map: Optional[torch.Tensor] = None, prefix_blocks: int = 0,
                                prefix_mode: str = "exempt"):
    """VSA forward in float64. Returns (out, block_map used, coarse scores).

    Padding: only the valid tokens of each block (the first q_counts[i] / kv_counts[i])
    are read, so the padded tails of q, k, v and the gate cannot change the result or
    the valid tokens' gradients; the padded output rows are exactly 0, so they have no
    gradient to give (the padded rows' gradients are 0, and dout there is ignored).

    `round_to` (e.g. torch.bfloat16) models the kernels' cast of the block means to
    the input dtype. `block_map` overrides the selection (the tests pass the kernel's
    selection once they have checked it is a valid top-k of these scores).
    `prefix_blocks` / `prefix_mode`: mixed-modality selection (`prefix_topk_mask`); the
    coarse branch and the gate do not depend on them.
    """
    kv_counts = torch.as_tensor(np.asarray(kv_counts), dtype=torch.int64)
    q_counts = torch.as_tensor(np.asarray(q_counts), dtype=torch.int64)
    qc = _block_mean(q, q_counts, block_elems, round_to)
    kc = _block_mean(k, kv_counts, block_elems, round_to)
    vc = _block_mean(v, kv_counts, block_elems, round_to)
    scores = qc @ kc.transpose(-1, -2) / math.sqrt(q.shape[-1])
    kv_ok = (kv_counts > 0)[None, None, None, :].expand_as(scores)
    probs, _ = _masked_softmax(scores, kv_ok)
    out_coarse = (probs @ vc).repeat_interleave(block_elems, dim=2)
    scores = scores.masked_fill(~kv_ok, float("-inf"))
    if block_map is None and prefix_blocks:
        assert q.shape[2] == k.shape[2], "prefix blocks need Sq == Skv (joint self-attention)"
        block_map = prefix_topk_mask(scores, min(topk, k.shape[2] // block_elems), prefix_blocks, prefix_mode)
    elif block_map is None:
        block_map = topk_mask(scores, min(topk, k.shape[2] // block_elems))
    out_fine, _ = block_sparse_attn_reference(q, k, v, block_map, kv_counts, block_elems)
    out = out_coarse * gate + out_fine if gate is not None else out_coarse + out_fine
    out = torch.where(valid_tokens(q_counts, block_elems)[:, None], out, torch.zeros((), dtype=out.dtype))
    return out, block_map, scores.detach()
