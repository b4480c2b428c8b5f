"""The pair unions of sm90_fwd64's pair variant (`stages.pair_union_lists`, the Triton kernel
`pair_union_lists_kernel`) against the numpy reference `reference.pair_union_lists_reference`:
the ascending union of two neighbouring query blocks' lists by the list rule and each entry's
membership. CPU (Triton's interpreter) or GPU."""

import numpy as np
import pytest
import torch

from vsa_core import reference as R
from vsa_core import stages
from vsa_core.launch import eager_launcher

from test_shared_kv_lists import _lists


def _run(idx, num, nkv, device):
    B, H, nq, cap = idx.shape
    n_pairs = -(-nq // 2)
    sel_idx, sel_num = torch.tensor(idx, device=device), torch.tensor(num, device=device)
    union_idx = torch.full((B, H, n_pairs, 2 * cap), -1, dtype=torch.int32, device=device)
    union_mask = torch.full((B, H, n_pairs, 2 * cap), -1, dtype=torch.int32, device=device)
    union_num = torch.full((B, H, n_pairs), -7, dtype=torch.int32, device=device)
    stages.pair_union_lists(eager_launcher, sel_idx, sel_num, nkv, union_idx, union_mask, union_num)
    return [t.cpu().numpy().astype(np.int64) for t in (union_idx, union_mask, union_num)]


@pytest.mark.parametrize("case", [
    (2, 2, 5, 9, 4, False),    # nQ odd: the last pair has no B
    (1, 2, 6, 7, 6, True),     # lists the rule must clean
    (2, 1, 7, 8, 5, True),     # bad lists and nQ odd
    (1, 1, 4, 40, 30, False),  # long lists, unions up to 40
    (1, 1, 3, 90, 70, True),   # capacity past one chunk (CH 64): the rule and the positions across chunks
], ids=["nq5", "bad-lists", "bad-nq7", "long", "chunked"])
def test_pair_union_lists_match_reference(case):
    B, H, nq, nkv, cap, bad = case
    idx, num = _lists(11 + nq + cap, B, H, nq, nkv, cap, bad)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got_idx, got_mask, got_num = _run(idx, num, nkv, device)
    union_idx, union_mask, union_num = R.pair_union_lists_reference(idx, num, nkv)
    np.testing.assert_array_equal(got_num, union_num)
    for row in np.ndindex(*union_num.shape):  # slots past the counts are not written: compare the counted ones
        n = union_num[row]
        np.testing.assert_array_equal(got_idx[row][:n], union_idx[row][:n])
        np.testing.assert_array_equal(got_mask[row][:n], union_mask[row][:n])
        assert np.all(np.diff(got_idx[row][:n]) > 0) and np.all((got_mask[row][:n] >= 1) & (got_mask[row][:n] <= 3))
    assert (union_mask == 3).any() or bad  # the clean cases exercise entries both blocks hold
