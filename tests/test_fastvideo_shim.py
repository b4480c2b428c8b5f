"""The name shim of benchmarks/fastvideo_tests.py (FastVideo's own tests run against vsa): each
of its entry points gives vsa's result for FastVideo's arguments (CPU: the interpreter). The
FastVideo tests themselves need CUDA; the lead's GPU run is the test of the semantics."""

import os
import sys

import numpy as np
import pytest
import torch

from common import Case, assert_close, make_inputs, reference
from frontends import TORCH_DEVICE, seed_of
from vsa_core import reference as R

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "fastvideo_shim")


@pytest.fixture(scope="module")
def fv():
    sys.path.insert(0, SHIM)
    try:
        import fastvideo_kernel
        assert "fastvideo_shim" in fastvideo_kernel.__file__
        yield fastvideo_kernel
    finally:
        sys.path.remove(SHIM)
        for name in [n for n in sys.modules if n == "fastvideo_kernel" or n.startswith("fastvideo_kernel.")]:
            del sys.modules[name]


def _t(x, grad=False):
    t = torch.from_numpy(np.ascontiguousarray(x)).to(TORCH_DEVICE, torch.bfloat16)
    return t.requires_grad_() if grad else t


def test_video_sparse_attn_is_vsa_with_zeros_padding(fv, monkeypatch):
    """FastVideo's call, its tuple block size and int32 counts: vsa's padding="zeros" result,
    gradients included (FASTVIDEO_VSA_TRITON=1 picks the triton backend, as in its tests)."""
    monkeypatch.setenv("FASTVIDEO_VSA_TRITON", "1")
    case = Case(block=(4, 4, 4), batch=1, heads=1)
    inputs = make_inputs(case, seed=seed_of(case))
    q, k, v, gate = (_t(inputs[n], grad=True) for n in ("q", "k", "v", "gate"))
    counts = [torch.from_numpy(inputs[n].astype(np.int32)).to(TORCH_DEVICE) for n in ("kv_counts", "q_counts")]
    out = fv.video_sparse_attn(q, k, v, *counts, case.topk, block_size=(4, 4, 4), compress_attn_weight=gate)
    out.backward(_t(inputs["dout"]))
    got = {n: t.detach().float().cpu().numpy() for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad),
                                                             ("dv", v.grad), ("dgate", gate.grad))}
    assert_close(case, got, reference(case, inputs))


def test_map_to_index_and_block_sparse_entry_points(fv):
    """_map_to_index gives each row's selected blocks ascending, then its count; the 64-token
    entry points (map, lists, the "triton" op) and the 128-token one agree with the float64
    fine branch."""
    from fastvideo_kernel.block_sparse_attn import _map_to_index, block_sparse_attn_triton
    from fastvideo_kernel.block_sparse_attn_256 import block_sparse_attn_128
    rng = np.random.default_rng(3)
    bm = rng.random((1, 2, 3, 4)) < 0.5
    bm[..., 0] = True
    idx, num = _map_to_index(torch.from_numpy(bm[0]))  # [H, nQ, nKV] is accepted too
    assert idx.dtype == num.dtype == torch.int32 and idx.shape == (1, 2, 3, 4)
    for row in np.ndindex(1, 2, 3):
        assert list(idx[row][:num[row]].numpy()) == list(np.flatnonzero(bm[row])), row
    for E, call in ((64, lambda *a: fv.block_sparse_attn(*a)),
                    (64, lambda q, k, v, m, c: fv.block_sparse_attn_from_indices(q, k, v, *_map_to_index(m), c)),
                    (64, lambda q, k, v, m, c: block_sparse_attn_triton(q, k, v, *_map_to_index(m), c)),
                    (128, block_sparse_attn_128)):
        counts = np.array([E, E // 3, E, 5][:4], np.int32)
        x = {n: rng.standard_normal((1, 2, s * E, 64)).astype(np.float32) for n, s in (("q", 3), ("k", 4), ("v", 4))}
        for n in ("k", "v"):
            x[n][:, :, ~R.valid_tokens(counts, E)] = 0
        q, k, v = (_t(x[n], grad=True) for n in ("q", "k", "v"))
        out, _ = call(q, k, v, torch.from_numpy(bm).to(TORCH_DEVICE), torch.from_numpy(counts).to(TORCH_DEVICE))
        dout = rng.standard_normal(out.shape).astype(np.float32)
        out.backward(_t(dout))
        t = {n: R.round_to_dtype(a, "bfloat16") for n, a in {**x, "dout": dout}.items()}
        ref_out, _, grads = R.block_sparse_attn_reference(t["q"], t["k"], t["v"], bm, counts, E, dout=t["dout"])
        got = {n: g.detach().float().cpu().numpy() for n, g in (("out", out), ("dq", q.grad), ("dk", k.grad),
                                                                 ("dv", v.grad))}
        assert_close(Case(), got, {"out": ref_out, **grads})


def test_varlen_is_the_per_sequence_call(fv):
    """FastVideo's packing (valid tokens only, per-sequence lists) through the shim equals
    block_sparse_attn_from_indices on each sequence padded to whole blocks."""
    from fastvideo_kernel.block_sparse_attn import _map_to_index
    rng = np.random.default_rng(4)
    E, H, D = 64, 2, 64
    q_sizes = [np.array([64, 20], np.int32), np.array([33], np.int32)]
    kv_sizes = [np.array([40, 64, 7], np.int32), np.array([64, 12], np.int32)]
    maps = [rng.random((H, len(qs), len(ks))) < 0.6 for qs, ks in zip(q_sizes, kv_sizes)]
    for m in maps:
        m[..., 0] = True
    qs = [rng.standard_normal((int(s.sum()), H, D)).astype(np.float32) for s in q_sizes]
    ks, vs = ([rng.standard_normal((int(s.sum()), H, D)).astype(np.float32) for s in kv_sizes] for _ in range(2))
    lists = [_map_to_index(torch.from_numpy(m).to(TORCH_DEVICE)) for m in maps]  # on q's device, as FastVideo takes them

    def cu(sizes):
        return torch.tensor(np.concatenate([[0], np.cumsum([s.sum() for s in sizes])]), dtype=torch.int32)
    out = fv.block_sparse_attn_varlen(_t(np.concatenate(qs)), _t(np.concatenate(ks)), _t(np.concatenate(vs)),
                                      cu(q_sizes), cu(kv_sizes), [i for i, _ in lists], [n for _, n in lists],
                                      [torch.from_numpy(s) for s in kv_sizes], [torch.from_numpy(s) for s in q_sizes])
    want = []
    for i in range(2):
        def padded(x, sizes):
            rows = np.flatnonzero(R.valid_tokens(sizes, E))
            p = np.zeros((1, H, len(sizes) * E, D), np.float32)
            p[0][:, rows] = x.transpose(1, 0, 2)
            return _t(p), rows
        (q, rows), (k, _), (v, _) = padded(qs[i], q_sizes[i]), padded(ks[i], kv_sizes[i]), padded(vs[i], kv_sizes[i])
        o, _ = fv.block_sparse_attn_from_indices(q, k, v, *lists[i], torch.from_numpy(kv_sizes[i]))
        want.append(o[0][:, rows].transpose(0, 1))
    torch.testing.assert_close(out, torch.cat(want), rtol=0, atol=0)
