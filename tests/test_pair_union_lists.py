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


def test_check_script_pair_lists_on_cpu(monkeypatch):
    """benchmarks/sm90_fwd64_check.py imports without a GPU, its pair variants are well formed, and
    its check of the pair step (the GPU run's first section) passes on CPU tensors (the interpreter)."""
    from vsa_core.backends.triton_backend import _interpreter_broken
    if _interpreter_broken():  # triton 3.6 with numpy >= 2.4 (the GPU machine's versions)
        pytest.skip(_interpreter_broken())
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "sm90_fwd64_check.py")
    spec = importlib.util.spec_from_file_location("sm90_fwd64_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "DEV", "cpu")
    pairs = [name for name, kw in check.VARIANTS.items() if kw.get("pair")]
    assert "wsP" in pairs and all(check.VARIANTS[n].get("consumers") == 2 and check.VARIANTS[n].get("warp_specialized")
                                  for n in pairs)
    for mk in (dict(H=2, nq=5, nkv=9, cap=4), check.BAD_LISTS, dict(B=1, nq=7, nkv=24, cap=16)):
        case = check.make_case(78, **mk)
        assert check.check_pair_lists(case["sel_idx"], case["sel_num"], case["k"].shape[2] // check.E)
    for label, mk, _ in check.CASES:  # every case builds (the correctness loop's inputs) on the CPU
        check.make_case(1, **mk)
