"""The top-k selection kernel (one threshold pass over the scores' bit patterns) against a
numpy reference of its semantics: per row the min(topk, finite scores) highest scores,
ties to the lower index, -inf (empty KV blocks) never taken. CPU: Triton interpreter."""

import numpy as np
import pytest
import torch

from vsa_core.backends import triton_backend
from vsa_core.problem import AttnProblem

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference_topk(scores: np.ndarray, topk: int):
    """(ascending index lists, counts, 0/1 mask) by sorting: score descending, index ascending."""
    rows, n = scores.shape
    cols = np.broadcast_to(np.arange(n), scores.shape)
    order = np.lexsort((cols, -scores.astype(np.float64)), axis=-1)
    k = np.minimum(topk, (scores > -np.inf).sum(-1))
    mask = np.zeros(scores.shape, np.int8)
    lists = []
    for r in range(rows):
        picked = np.sort(order[r, :k[r]])
        mask[r, picked] = 1
        lists.append(picked)
    return lists, k, mask


def run_kernel(scores: np.ndarray, topk: int):
    rows, n = scores.shape
    p = AttnProblem(batch=1, heads=1, q_len=64 * rows, kv_len=64 * n, head_dim=64, block_elems=64,
                    dtype="bfloat16", topk=min(topk, n))
    cap = p.select_capacity
    sel_idx = torch.full((1, 1, rows, cap), -7, dtype=torch.int32, device=DEV)
    sel_num = torch.full((1, 1, rows), -7, dtype=torch.int32, device=DEV)
    sel_mask = torch.full((1, 1, rows, n), 7, dtype=torch.int8, device=DEV)
    s = torch.from_numpy(np.ascontiguousarray(scores, np.float32)).reshape(1, 1, rows, n).to(DEV)
    triton_backend.topk_select(p, s, sel_idx, sel_num, sel_mask)
    return sel_idx.cpu().numpy().reshape(rows, cap), sel_num.cpu().numpy().reshape(rows), \
        sel_mask.cpu().numpy().reshape(rows, n)


def check(scores: np.ndarray, topk: int):
    lists, k, mask = reference_topk(scores, topk)
    idx, num, got_mask = run_kernel(scores, topk)
    np.testing.assert_array_equal(num, k)
    np.testing.assert_array_equal(got_mask, mask)
    for r, want in enumerate(lists):
        np.testing.assert_array_equal(idx[r, :num[r]], want, err_msg=f"row {r}")


def _rows(rng, rows, n, kind):
    if kind == "random":
        return rng.standard_normal((rows, n)).astype(np.float32)
    if kind == "ties":        # a handful of distinct values: most scores tie with others
        return rng.integers(-2, 3, (rows, n)).astype(np.float32) * 0.5
    if kind == "signed-zero":  # -0.0 and +0.0 compare equal: they tie, lower index first
        s = rng.choice(np.array([-0.0, 0.0, 1.0, -1.0], np.float32), (rows, n))
        return s
    if kind == "tiny":        # subnormals and values one ulp apart: the bit order must hold there too
        base = np.float32(1e-39)
        return (rng.integers(-3, 4, (rows, n)) * base).astype(np.float32)
    if kind == "extreme":     # large magnitudes of both signs, +inf, and -inf (empty blocks)
        s = rng.standard_normal((rows, n)).astype(np.float32) * 1e30
        s[rng.random((rows, n)) < 0.2] = -np.inf
        s[rng.random((rows, n)) < 0.05] = np.inf
        return s
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "ties", "signed-zero", "tiny", "extreme"])
@pytest.mark.parametrize("n, topk", [(7, 3), (16, 16), (37, 9), (37, 40)])
def test_topk_matches_sorting_reference(kind, n, topk):
    rng = np.random.default_rng([n, topk, len(kind)])
    check(_rows(rng, 6, n, kind), topk)


def test_empty_blocks_are_never_taken_and_k_is_clamped():
    rng = np.random.default_rng(3)
    s = rng.standard_normal((5, 12)).astype(np.float32)
    s[:, ::3] = -np.inf                 # 4 empty KV blocks per row: 8 finite scores
    s[1] = -np.inf                      # a row with nothing to take
    s[2, :] = 0.25                      # a row of one value: the lowest indices of its 8 finite scores
    s[2, ::3] = -np.inf
    s[3, 5] = np.float32(-3.4e38)       # the most negative finite score is still taken before -inf
    check(s, 10)
    check(s, 8)
    check(s, 3)
