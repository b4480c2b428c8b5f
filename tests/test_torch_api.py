"""vsa_torch: block_sparse_attn variants, torch.compile, bad input, and metadata glue."""

import re
import zlib

import numpy as np
import pytest
import torch

import vsa_torch
from common import Case, assert_close, make_inputs
from vsa_core import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


def _qkv(case: Case, inputs: dict, requires_grad=True):
    return [torch.from_numpy(inputs[n]).to(DEVICE, BF16).requires_grad_(requires_grad) for n in ("q", "k", "v")]


def _random_block_map(case: Case, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    bm = rng.random((case.batch, case.heads, case.n_q_blocks, case.n_kv_blocks)) < 0.5
    bm[0, 0, 0, :] = False  # a query block with nothing selected: out 0, lse -inf, no NaN
    return torch.from_numpy(bm)


def _bsa_reference(case, inputs, block_map):
    x = {n: R.round_to_dtype(inputs[n], "bfloat16") for n in ("q", "k", "v", "dout")}
    out, lse, grads = R.block_sparse_attn_reference(x["q"], x["k"], x["v"], np.asarray(block_map),
                                                    inputs["kv_counts"], case.E, dout=x["dout"])
    return {"out": out, **grads}, lse


def _grads(out, q, k, v, inputs):
    out.backward(torch.from_numpy(inputs["dout"]).to(DEVICE, BF16))
    return {n: t.detach().float().cpu().numpy() for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad),
                                                              ("dv", v.grad))}


@pytest.mark.parametrize("case", [Case(), Case(block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3, batch=1)],
                         ids=lambda c: c.id())
def test_block_sparse_attn_matches_reference(case):
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()))
    block_map = _random_block_map(case, 5)
    q, k, v = _qkv(case, inputs)
    out, lse = vsa_torch.block_sparse_attn(q, k, v, block_map.to(DEVICE), inputs["kv_counts"], case.block)
    ref, ref_lse = _bsa_reference(case, inputs, block_map)
    assert_close(case, _grads(out, q, k, v, inputs), ref)
    lse = lse.cpu().numpy()
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == finite).all()
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)  # fp32 logsumexp


def test_block_sparse_attn_from_indices_equals_block_map():
    case = Case()
    inputs = make_inputs(case, seed=21)
    block_map = _random_block_map(case, 6)
    nk = case.n_kv_blocks
    # ascending lists padded with junk past the count (must be ignored)
    idx = torch.full(block_map.shape, 1000, dtype=torch.int32)
    num = block_map.sum(-1).to(torch.int32)
    for pos in np.ndindex(*block_map.shape[:3]):
        sel = torch.nonzero(block_map[pos]).flatten()
        idx[pos][: len(sel)] = sel.to(torch.int32)
    q, k, v = _qkv(case, inputs)
    out_a, lse_a = vsa_torch.block_sparse_attn_from_indices(q, k, v, idx.to(DEVICE), num.to(DEVICE),
                                                            inputs["kv_counts"], case.block)
    got_a = _grads(out_a, q, k, v, inputs)
    q2, k2, v2 = _qkv(case, inputs)
    out_b, lse_b = vsa_torch.block_sparse_attn(q2, k2, v2, block_map.to(DEVICE), inputs["kv_counts"], case.block)
    got_b = _grads(out_b, q2, k2, v2, inputs)
    assert nk == block_map.shape[-1]
    for name in got_a:  # the same kernels on the same lists: bitwise equal
        np.testing.assert_array_equal(got_a[name], got_b[name], err_msg=name)
    torch.testing.assert_close(lse_a, lse_b, rtol=0, atol=0)


def test_torch_compile_fullgraph_matches_eager():
    case = Case(batch=1)
    inputs = make_inputs(case, seed=31)
    kv_counts = torch.from_numpy(inputs["kv_counts"]).to(DEVICE)
    q_counts = torch.from_numpy(inputs["q_counts"]).to(DEVICE)
    gate = torch.from_numpy(inputs["gate"]).to(DEVICE, BF16)

    def attend(q, k, v):
        return vsa_torch.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate)

    # the op's output and gradients, not a reduction of them: inductor may sum in another order
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    dout = torch.from_numpy(inputs["dout"]).to(DEVICE, BF16)
    results = []
    for fn in (attend, compiled):
        q, k, v = _qkv(case, inputs)
        out = fn(q, k, v)
        results.append([out.detach(), *torch.autograd.grad(out, (q, k, v), dout)])
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)


# ---- bad input: a clear error naming the argument, before any kernel runs -------------
def _good():
    q = torch.randn(1, 2, 128, 64, dtype=BF16)
    k = torch.randn(1, 2, 192, 64, dtype=BF16)
    return dict(q=q, k=k, v=k.clone(), variable_block_sizes=torch.tensor([64, 64, 10]),
                q_variable_block_sizes=torch.tensor([64, 64]), topk=2, block_size=64)


BAD_INPUTS = [
    ("q", lambda a: a["q"][0], ValueError, "q must be a rank-4"),
    ("k batch", lambda a: a["k"].expand(2, -1, -1, -1), ValueError, "k must match q"),
    ("v length", lambda a: a["v"][:, :, :128], ValueError, "v must have the same sequence length"),
    ("q length", lambda a: a["q"][:, :, :100], ValueError, "q sequence length must be a positive multiple"),
    ("dtype", lambda a: a["q"].float(), TypeError, "q must have dtype"),
    ("k dtype", lambda a: a["k"].half(), TypeError, "k must have the same dtype"),
    ("head dim", lambda a: a["q"][..., :32], ValueError, "head dim"),
    ("counts length", lambda a: torch.tensor([64, 64]), ValueError, "variable_block_sizes must have shape (3,)"),
    ("counts dtype", lambda a: torch.tensor([64.0, 64.0, 1.0]), TypeError, "variable_block_sizes must be an integer"),
    ("counts value", lambda a: torch.tensor([64, 65, 1]), ValueError, "variable_block_sizes values must lie in"),
    ("negative count", lambda a: torch.tensor([64, -1, 1]), ValueError, "variable_block_sizes values must lie in"),
    ("q counts", lambda a: torch.tensor([64, 64, 64]), ValueError, "q_variable_block_sizes must have shape (2,)"),
    ("topk", lambda a: 0, ValueError, "topk must be >= 1"),
    ("topk type", lambda a: 2.0, TypeError, "topk must be a Python int"),
    ("block size", lambda a: 32, ValueError, "block_size must hold"),
    ("block tile", lambda a: (4, 4), ValueError, "block_size as a tile must be 3"),
    ("gate shape", lambda a: torch.randn(1, 2, 64, 64, dtype=BF16), ValueError, "compress_attn_weight must have q's shape"),
]
_TARGET = {"k batch": "k", "v length": "v", "q length": "q", "dtype": "q", "k dtype": "k", "head dim": "q",
           "counts length": "variable_block_sizes", "counts dtype": "variable_block_sizes",
           "counts value": "variable_block_sizes", "negative count": "variable_block_sizes",
           "q counts": "q_variable_block_sizes", "topk": "topk", "topk type": "topk", "block size": "block_size",
           "block tile": "block_size", "gate shape": "compress_attn_weight", "q": "q"}


@pytest.mark.parametrize("label,make,exc,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(label, make, exc, message):
    args = _good()
    target = _TARGET[label]
    if label == "head dim":
        args["k"], args["v"] = args["k"][..., :32], args["v"][..., :32]
    args[target] = make(args)
    with pytest.raises(exc, match=re.escape(message)):
        vsa_torch.video_sparse_attn(args.pop("q"), args.pop("k"), args.pop("v"), **{
            k: args[k] for k in ("variable_block_sizes", "q_variable_block_sizes", "topk", "block_size")},
            compress_attn_weight=args.get("compress_attn_weight"))


def test_bad_backend_names():
    a = _good()
    with pytest.raises(ValueError, match="backend must be one of"):
        vsa_torch.video_sparse_attn(a["q"], a["k"], a["v"], a["variable_block_sizes"],
                                    a["q_variable_block_sizes"], 2, backend="cuda")


def test_block_map_errors():
    a = _good()
    with pytest.raises(ValueError, match="block_map must have shape"):
        vsa_torch.block_sparse_attn(a["q"], a["k"], a["v"], torch.ones(1, 2, 2, 2, dtype=torch.bool),
                                    a["variable_block_sizes"])
    with pytest.raises(TypeError, match="block_map must be a bool"):
        vsa_torch.block_sparse_attn(a["q"], a["k"], a["v"], torch.ones(1, 2, 2, 3), a["variable_block_sizes"])


@pytest.mark.gpu
def test_tensors_on_different_devices():
    a = _good()
    with pytest.raises(ValueError, match="k must be on q's device"):
        vsa_torch.video_sparse_attn(a["q"].cuda(), a["k"], a["v"].cuda(), a["variable_block_sizes"],
                                    a["q_variable_block_sizes"], 2)


def test_to_tiled_round_trip_and_counts():
    meta = vsa_torch.build_vsa_metadata((5, 6, 7), (4, 4, 4))
    # Away from zero by construction, so "valid tokens are nonzero" below tells them from padding
    # (randn itself returns an exact 0 now and then).
    x = (torch.rand(2, 3, 5 * 6 * 7, 8) + 0.5) * torch.randint(0, 2, (2, 3, 5 * 6 * 7, 8)).mul(2).sub(1)
    tiled = vsa_torch.to_tiled(x, meta)
    assert tiled.shape[2] == meta.padded_len
    torch.testing.assert_close(vsa_torch.from_tiled(tiled, meta), x, rtol=0, atol=0)
    E = meta.block_elems
    for i, n in enumerate(meta.variable_block_sizes):
        assert torch.all(tiled[:, :, i * E + n:(i + 1) * E] == 0)  # padding is zero
        assert torch.all(tiled[:, :, i * E:i * E + n] != 0)        # valid tokens at the start
