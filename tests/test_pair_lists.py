"""The pair lists of sm90_fwd64's cluster_pairs variant (`stages.pair_lists`, the Triton kernel
`pair_lists_kernel`) against the numpy reference `reference.pair_lists_reference`: each list of a
pair of neighbouring query blocks by the list rule, the blocks both count first at the same
positions in both lists. CPU (Triton's interpreter) or GPU."""

import numpy as np
import pytest
import torch

from vsa_core import reference as R
from vsa_core import stages
from vsa_core.launch import eager_launcher


def _lists(seed, B, H, nq, nkv, cap, bad):
    rng = np.random.default_rng(seed)
    if bad:  # repeats, out of order, out of range, negative; counts past the capacity and negative
        idx = rng.integers(-3, nkv + 3, size=(B, H, nq, cap))
        num = rng.integers(-2, cap + 3, size=(B, H, nq))
    else:  # ascending lists of random lengths, some empty, drawn from few blocks so that pairs share
        idx = np.sort(np.stack([rng.permutation(nkv)[:cap] for _ in range(B * H * nq)]), -1).reshape(B, H, nq, cap)
        num = rng.integers(0, cap + 1, size=(B, H, nq))
        num.reshape(-1)[0] = 0
    return idx.astype(np.int32), num.astype(np.int32)


@pytest.mark.parametrize("case", [
    (2, 2, 5, 9, 4, False),    # odd nQ: the last block's mate is past the end
    (1, 2, 6, 7, 6, True),     # lists the rule must clean
    (1, 1, 4, 40, 30, False),  # long lists
    (1, 1, 3, 90, 70, True),   # capacity past one chunk (CH 64): the rule and the counts across chunks
], ids=["nq5", "bad-lists", "long", "chunked"])
def test_pair_lists_match_reference(case):
    B, H, nq, nkv, cap, bad = case
    idx, num = _lists(11 + nq, B, H, nq, nkv, cap, bad)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pair_idx = torch.full((B, H, nq, cap), 123, dtype=torch.int32, device=device)  # every slot is written
    pair_num = torch.full((B, H, nq), -7, dtype=torch.int32, device=device)
    shared_num = torch.full((B, H, -(-nq // 2)), -7, dtype=torch.int32, device=device)
    stages.pair_lists(eager_launcher, torch.tensor(idx, device=device), torch.tensor(num, device=device), nkv,
                      pair_idx, pair_num, shared_num)
    want_idx, want_num, want_shared = R.pair_lists_reference(idx, num, nkv)
    np.testing.assert_array_equal(shared_num.cpu().numpy(), want_shared)
    np.testing.assert_array_equal(pair_num.cpu().numpy(), want_num)
    np.testing.assert_array_equal(pair_idx.cpu().numpy(), want_idx)
    assert want_shared.sum() > 0, "the draw must have pairs that share blocks, or the test shows little"
    # a pair's shared blocks sit at the same positions in both lists
    for b, h, p in np.ndindex(*want_shared.shape):
        s = want_shared[b, h, p]
        if 2 * p + 1 < nq:
            np.testing.assert_array_equal(want_idx[b, h, 2 * p, :s], want_idx[b, h, 2 * p + 1, :s])
