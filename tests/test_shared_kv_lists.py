"""The shared-KV lists of sm90_fwd64's shared_kv variants (`stages.shared_kv_lists`, the Triton
kernel `shared_kv_lists_kernel`) against the numpy reference `reference.shared_kv_lists_reference`:
unions of neighbouring query blocks' lists by the list rule and each block's positions in its
group's union. CPU (Triton's interpreter) or GPU."""

import numpy as np
import pytest
import torch

from vsa_core import reference as R
from vsa_core import stages
from vsa_core.launch import eager_launcher
from common import skip_if_interpreter_broken


def _lists(seed, B, H, nq, nkv, cap, bad):
    rng = np.random.default_rng(seed)
    if bad:  # repeats, out of order, out of range, negative; counts past the capacity and negative
        idx = rng.integers(-3, nkv + 3, size=(B, H, nq, cap))
        num = rng.integers(-2, cap + 3, size=(B, H, nq))
    else:  # clean ascending lists of random lengths, some empty
        idx = np.sort(np.stack([rng.permutation(nkv)[:cap] for _ in range(B * H * nq)]), -1).reshape(B, H, nq, cap)
        num = rng.integers(0, cap + 1, size=(B, H, nq))
        num.reshape(-1)[0] = 0
    return idx.astype(np.int32), num.astype(np.int32)


def _run(idx, num, nkv, group, device):
    B, H, nq, cap = idx.shape
    ng = -(-nq // group)
    sel_idx, sel_num = torch.tensor(idx, device=device), torch.tensor(num, device=device)
    union_idx = torch.full((B, H, ng, group * cap), -1, dtype=torch.int32, device=device)
    union_num = torch.full((B, H, ng), -7, dtype=torch.int32, device=device)
    own_pos = torch.full((B, H, nq, cap), -1, dtype=torch.int32, device=device)
    own_num = torch.full((B, H, nq), -7, dtype=torch.int32, device=device)
    stages.shared_kv_lists(eager_launcher, sel_idx, sel_num, nkv, group, union_idx, union_num, own_pos, own_num)
    return [t.cpu().numpy().astype(np.int64) for t in (union_idx, union_num, own_pos, own_num)]


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("case", [
    (2, 2, 5, 9, 4, False),    # nQ not a multiple of the group
    (1, 2, 6, 7, 6, True),     # lists the rule must clean
    (1, 1, 4, 40, 30, False),  # long lists, unions up to 40
    (1, 1, 3, 90, 70, True),  # capacity past one chunk (CH 64): the rule and the counts across chunks
], ids=["nq5", "bad-lists", "long", "chunked"])
def test_shared_kv_lists_match_reference(group, case):
    B, H, nq, nkv, cap, bad = case
    idx, num = _lists(7 * group + nq, B, H, nq, nkv, cap, bad)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got_union, got_union_num, got_pos, got_num = _run(idx, num, nkv, group, device)
    union, union_num, pos, own_num = R.shared_kv_lists_reference(idx, num, nkv, group)
    np.testing.assert_array_equal(got_union_num, union_num)
    np.testing.assert_array_equal(got_num, own_num)
    for row in np.ndindex(*union_num.shape):  # slots past the counts are not written: compare the counted ones
        np.testing.assert_array_equal(got_union[row][:union_num[row]], union[row][:union_num[row]])
    for row in np.ndindex(*own_num.shape):
        np.testing.assert_array_equal(got_pos[row][:own_num[row]], pos[row][:own_num[row]])


def test_check_script_lists_step_on_cpu(monkeypatch):
    """benchmarks/sm90_fwd64_check.py imports without a GPU, and its check of the union step
    (the GPU run's first section) passes on CPU tensors (the interpreter)."""
    skip_if_interpreter_broken()
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "sm90_fwd64_check.py")
    spec = importlib.util.spec_from_file_location("sm90_fwd64_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    monkeypatch.setattr(check, "DEV", "cpu")
    for mk in (dict(H=2, nq=5, nkv=9, cap=4), check.BAD_LISTS):
        case = check.make_case(77, **mk)
        for group in (2, 3):
            assert check.check_shared_lists(case["sel_idx"], case["sel_num"], case["k"].shape[2] // check.E, group)
