"""Packed variable-length sequences (varlen), both frontends: against per-sequence calls of
the BSHD API and against the float64 reference, traced offsets under jax.jit, selections
that cross sequences, bad input.

Each sequence's inputs come from `common.make_inputs` (a batch-1 case per sequence: fresh
random values, partial blocks, an empty KV block when it has 4+, an unambiguous top-k),
and are packed one after the other along the token axis as `[total, H, D]`.

What equals what, and why: the packed call runs the same kernels on the same tokens. The
fine stage sees the same query tiles and the same selected KV blocks (shifted by the
sequence's block offset). The coarse stage runs over all packed blocks, the other sequences'
blocks masked to exact zeros: when a sequence's blocks span more than one coarse tile (16
blocks under the interpreter, 64 on the GPU) or start mid-tile, the online softmax and the
gradient sums group its terms differently, so out_coarse / the pooled gradients (hence out,
dq, dk, dv, dgate) may differ in the last bits; under the interpreter even within one tile,
since its dots are BLAS matmuls whose summation order depends on the operands' length. On
the CPU the comparison with per-sequence calls is therefore to fp32 rounding (1e-6 of the
largest value); on the GPU the autotuner may also pick another fine-stage tile config for
another q_len (its key), so there it is by tolerance.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import vsa_jax
import vsa_torch
from common import Case, assert_close, make_inputs, reference, skip_unavailable
from vsa_core import reference as R
from vsa_core.api import prepare_block_sparse
from vsa_torch import ops as torch_ops

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Pack:
    q_blocks: tuple            # query blocks per sequence
    kv_blocks: tuple           # KV blocks per sequence
    block: object = 64
    head_dim: int = 64
    heads: int = 2
    topk: int = 2
    gate: bool = True

    @property
    def E(self) -> int:
        return int(np.prod(self.block))

    def case(self, i: int) -> Case:
        return Case(block=self.block, head_dim=self.head_dim, n_q_blocks=self.q_blocks[i],
                    n_kv_blocks=self.kv_blocks[i], batch=1, heads=self.heads, topk=self.topk, gate=self.gate)

    def id(self) -> str:
        return "-".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if f.name in ("q_blocks", "kv_blocks") or getattr(self, f.name) != f.default)


PACKS = [
    # 3 sequences, Sq != Skv per sequence; sequence 0 has an empty KV block (4 blocks), sequence
    # 2 a single KV block (topk 2 > its block count: clamped to 1)
    Pack(q_blocks=(2, 1, 3), kv_blocks=(4, 2, 1)),
    # 5 sequences of one to four blocks, no gate
    Pack(q_blocks=(1, 2, 1, 1, 2), kv_blocks=(1, 1, 4, 2, 1), topk=3, gate=False, heads=1),
    # a single sequence (N = 1), 128-token tiles, head dim 128
    Pack(q_blocks=(2,), kv_blocks=(3,), block=(4, 4, 8), head_dim=128, heads=1, topk=1),
    # 256-token blocks
    Pack(q_blocks=(1, 2), kv_blocks=(2, 1), block=256, heads=1, topk=1, gate=False),
]


def seed_of(pack: Pack) -> int:
    return zlib.crc32(pack.id().encode())


def packed(x: np.ndarray) -> np.ndarray:
    """BHSD [1, H, S, D] -> [S, H, D]."""
    return np.ascontiguousarray(x[0].transpose(1, 0, 2))


def make_pack(pack: Pack, seed: int) -> dict:
    """Per-sequence inputs, and the packed stream with its offsets and counts."""
    seqs = [make_inputs(pack.case(i), seed=seed * 101 + i) for i in range(len(pack.q_blocks))]
    E = pack.E
    x = {n: np.concatenate([packed(s[n]) for s in seqs]) for n in ("q", "k", "v", "gate", "dout")}
    x["q_counts"] = np.concatenate([s["q_counts"] for s in seqs])
    x["kv_counts"] = np.concatenate([s["kv_counts"] for s in seqs])
    x["cu_q"] = (np.concatenate([[0], np.cumsum(pack.q_blocks)]) * E).astype(np.int32)
    x["cu_k"] = (np.concatenate([[0], np.cumsum(pack.kv_blocks)]) * E).astype(np.int32)
    x["seqs"] = seqs
    return x


def pack_reference(pack: Pack, x: dict, padding: str = "zeros") -> dict:
    """float64 reference, sequence by sequence, packed like the inputs."""
    refs = [reference(pack.case(i), s, padding) for i, s in enumerate(x["seqs"])]
    return {n: np.concatenate([packed(r[n]) for r in refs]) for n in refs[0]}


def _tol_case(pack: Pack) -> Case:
    return pack.case(0)


# ---- runners: each returns packed numpy float32 results -----------------------------------
def run_torch_varlen(pack: Pack, x: dict, backend: str = "auto", **kw) -> dict:
    q, k, v, gate = (torch.from_numpy(x[n]).to(DEVICE, BF16).requires_grad_() for n in ("q", "k", "v", "gate"))
    out = vsa_torch.video_sparse_attn_varlen(
        q, k, v, torch.from_numpy(x["cu_q"]).to(DEVICE), torch.from_numpy(x["cu_k"]).to(DEVICE),
        torch.from_numpy(x["kv_counts"]), torch.from_numpy(x["q_counts"]), pack.topk, pack.block,
        gate if pack.gate else None, backend=backend, **kw)
    out.backward(torch.from_numpy(x["dout"]).to(DEVICE, BF16))
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if pack.gate:
        got["dgate"] = gate.grad
    return {n: t.detach().float().cpu().numpy() for n, t in got.items()}


def run_torch_per_sequence(pack: Pack, x: dict, backend: str = "auto") -> dict:
    """video_sparse_attn_bshd on each sequence alone ([1, S_i, H, D]), results packed."""
    E = pack.E
    parts = {n: [] for n in ("out", "dq", "dk", "dv", "dgate")}
    for i in range(len(pack.q_blocks)):
        qs, ks = slice(x["cu_q"][i], x["cu_q"][i + 1]), slice(x["cu_k"][i], x["cu_k"][i + 1])
        q, gate, dout = (torch.from_numpy(x[n][qs][None]).to(DEVICE, BF16) for n in ("q", "gate", "dout"))
        k, v = (torch.from_numpy(x[n][ks][None]).to(DEVICE, BF16) for n in ("k", "v"))
        for t in (q, k, v, gate):
            t.requires_grad_()
        out = vsa_torch.video_sparse_attn_bshd(
            q, k, v, torch.from_numpy(x["kv_counts"][ks.start // E:ks.stop // E]),
            torch.from_numpy(x["q_counts"][qs.start // E:qs.stop // E]), pack.topk, pack.block,
            gate if pack.gate else None, backend=backend)
        out.backward(dout)
        for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("dgate", gate.grad)):
            if t is not None:
                parts[n].append(t[0].detach().float().cpu().numpy())
    return {n: np.concatenate(p) for n, p in parts.items() if p}


def run_jax_varlen(pack: Pack, x: dict, **kw) -> dict:
    """jit(vjp) with the offsets and counts traced (jit arguments); `kw`: static keywords."""
    @jax.jit
    def run(q, k, v, gate, dout, cu_q, cu_k, kv_counts, q_counts):
        def f(q, k, v, gate):
            return vsa_jax.video_sparse_attn_varlen(q, k, v, cu_q, cu_k, kv_counts, q_counts, pack.topk, pack.block,
                                                    gate if pack.gate else None, **kw)
        out, vjp = jax.vjp(f, q, k, v, gate)
        return (out,) + vjp(dout)

    args = [jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "gate", "dout")]
    res = run(*args, *(jnp.asarray(x[n], jnp.int32) for n in ("cu_q", "cu_k", "kv_counts", "q_counts")))
    got = dict(zip(("out", "dq", "dk", "dv", "dgate"), (np.asarray(r, np.float32) for r in res)))
    if not pack.gate:
        del got["dgate"]
    return got


def assert_equal_or_close(got: dict, want: dict, what: str) -> None:
    """Equal to 1e-6 of the largest value on the CPU, 1e-2 on the GPU (see the module docstring).

    The CPU bound is fp32 rounding, not bitwise: the interpreter's dots are numpy matmuls, and
    BLAS groups a dot's terms by the operand's length and alignment, which differ between the
    packed and the per-sequence call where other sequences' blocks add exact zeros (seen: one
    dk differing by 4e-8 on one machine, equal on another). A wrong block, mask or sequence
    gives differences of the order of the values themselves."""
    assert got.keys() == want.keys()
    for n in want:
        finite = np.isfinite(want[n])  # lse is -inf for a query block with nothing selected
        assert (np.isfinite(got[n]) == finite).all() and (got[n][~finite] == want[n][~finite]).all(), f"{what}: {n}"
        if not finite.any():
            continue
        scale = np.abs(want[n][finite]).max()
        np.testing.assert_allclose(got[n][finite], want[n][finite], rtol=0, atol=(1e-2 if GPU else 1e-6) * scale,
                                   err_msg=f"{what}: {n}")


# ---- VSA -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pack", PACKS, ids=lambda p: p.id())
def test_vsa_varlen_torch(pack):
    x = make_pack(pack, seed_of(pack))
    got = run_torch_varlen(pack, x)
    assert_close(_tol_case(pack), got, pack_reference(pack, x))
    assert_equal_or_close(got, run_torch_per_sequence(pack, x), "packed vs per-sequence")


@pytest.mark.parametrize("pack", PACKS[:3], ids=lambda p: p.id())
def test_vsa_varlen_jax_matches_torch(pack):
    """jit(vjp) of vsa_jax with traced offsets and counts: bitwise the torch call (same
    kernels, same launches), and hence the reference."""
    x = make_pack(pack, seed_of(pack))
    got_jax, got_torch = run_jax_varlen(pack, x), run_torch_varlen(pack, x)
    assert got_jax.keys() == got_torch.keys()
    for n in got_torch:
        assert np.array_equal(got_jax[n], got_torch[n]), f"{n}: max |jax - torch| = " \
            f"{np.abs(got_jax[n] - got_torch[n]).max():.3e}"
    assert_close(_tol_case(pack), got_jax, pack_reference(pack, x))


def test_jax_one_compile_serves_two_packings():
    """The offsets are traced: two packings of the same totals (3 query and 3 KV blocks)
    run one trace; each matches its own float64 reference."""
    traces = []

    @jax.jit
    def run(q, k, v, gate, dout, cu_q, cu_k, kv_counts, q_counts):
        traces.append(1)

        def f(q, k, v, gate):
            return vsa_jax.video_sparse_attn_varlen(q, k, v, cu_q, cu_k, kv_counts, q_counts, 1, 64, gate)
        out, vjp = jax.vjp(f, q, k, v, gate)
        return (out,) + vjp(dout)

    for i, pack in enumerate((Pack(q_blocks=(1, 2), kv_blocks=(2, 1), heads=1, topk=1),
                              Pack(q_blocks=(2, 1), kv_blocks=(1, 2), heads=1, topk=1))):
        x = make_pack(pack, seed=70 + i)
        res = run(*(jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "gate", "dout")),
                  *(jnp.asarray(x[n], jnp.int32) for n in ("cu_q", "cu_k", "kv_counts", "q_counts")))
        got = dict(zip(("out", "dq", "dk", "dv", "dgate"), (np.asarray(r, np.float32) for r in res)))
        assert_close(_tol_case(pack), got, pack_reference(pack, x))
    assert len(traces) == 1


def test_empty_sequences():
    """Repeated offsets: sequence 1 has a query block but no KV block (its output is 0, no
    NaN), sequence 2 KV blocks but no query (their gradients are 0); sequence 0 is unaffected."""
    E, rng = 64, np.random.default_rng(5)
    cu_q, cu_k = torch.tensor([0, 64, 128, 128], dtype=torch.int32), torch.tensor([0, 64, 64, 192], dtype=torch.int32)
    q, k, v = (torch.from_numpy(rng.standard_normal((n, 1, 64), np.float32)).to(DEVICE, BF16).requires_grad_()
               for n in (128, 192, 192))
    full = torch.full((3,), E)
    out = vsa_torch.video_sparse_attn_varlen(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), full, full[:2], 2, E)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert (out[64:] == 0).all() and (k.grad[64:] == 0).all() and (v.grad[64:] == 0).all()
    alone = vsa_torch.video_sparse_attn_bshd(q[:64][None].detach(), k[:64][None].detach(), v[:64][None].detach(),
                                             full[:1], full[:1], 2, E)[0]
    assert_equal_or_close({"out": out[:64].detach().float().cpu().numpy()}, {"out": alone.float().cpu().numpy()},
                          "sequence 0 packed with empty sequences vs alone")


def test_torch_compile_fullgraph_matches_eager():
    pack = Pack(q_blocks=(1, 1), kv_blocks=(1, 2), heads=1, topk=1)
    x = make_pack(pack, seed=80)
    cu_q, cu_k = (torch.from_numpy(x[n]).to(DEVICE) for n in ("cu_q", "cu_k"))
    counts = [torch.from_numpy(x[n]).to(DEVICE) for n in ("kv_counts", "q_counts")]
    gate = torch.from_numpy(x["gate"]).to(DEVICE, BF16)

    def attend(q, k, v):
        return vsa_torch.video_sparse_attn_varlen(q, k, v, cu_q, cu_k, *counts, pack.topk, pack.block, gate)

    # the op's output and gradients, not a reduction of them: inductor may sum in another order
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    dout = torch.from_numpy(x["dout"]).to(DEVICE, BF16)
    results = []
    for fn in (attend, compiled):
        q, k, v = (torch.from_numpy(x[n]).to(DEVICE, BF16).requires_grad_() for n in ("q", "k", "v"))
        out = fn(q, k, v)
        results.append([out.detach(), *torch.autograd.grad(out, (q, k, v), dout)])
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)


# ---- block-sparse attention over packed sequences ------------------------------------------
def same_sequence_blocks(pack: Pack, x: dict) -> np.ndarray:
    """Bool [nQ, nKV]: query block i and KV block j belong to the same packed sequence."""
    q_seq = np.searchsorted(x["cu_q"][1:], np.arange(sum(pack.q_blocks)) * pack.E, side="right")
    kv_seq = np.searchsorted(x["cu_k"][1:], np.arange(sum(pack.kv_blocks)) * pack.E, side="right")
    return q_seq[:, None] == kv_seq[None, :]


def own_sequence_map(pack: Pack, x: dict, seed: int) -> np.ndarray:
    """Random bool [H, nQ, nKV] map over the packed blocks, only within each sequence; one
    query block selects nothing (out 0, lse -inf)."""
    rng = np.random.default_rng(seed)
    own = same_sequence_blocks(pack, x)
    nq, nk = own.shape
    bm = (rng.random((pack.heads, nq, nk)) < 0.6) & own
    bm[:, np.arange(nq), np.argmax(own, axis=1)] = True  # every query block sees something...
    bm[0, 0, :] = False                                            # ...but one
    return bm


def map_to_lists(bm: np.ndarray, capacity: int, junk: int = 1000):
    idx = np.full(bm.shape[:-1] + (capacity,), junk, np.int32)  # junk past the count: ignored
    num = bm.sum(-1).astype(np.int32)
    for pos in np.ndindex(*bm.shape[:-1]):
        sel = np.flatnonzero(bm[pos])
        idx[pos][:len(sel)] = sel
    return idx, num


def bsa_reference(pack: Pack, x: dict, bm: np.ndarray) -> dict:
    """float64 fine attention of the whole packed stream under the (own-sequence) map."""
    t = {n: R.round_to_dtype(x[n], "bfloat16").transpose(1, 0, 2)[None] for n in ("q", "k", "v", "dout")}
    out, lse, grads = R.block_sparse_attn_reference(t["q"], t["k"], t["v"], np.asarray(bm)[None], x["kv_counts"],
                                                    pack.E, dout=t["dout"])
    res = {"out": out[0].transpose(1, 0, 2)}
    res.update({n: g[0].transpose(1, 0, 2) for n, g in grads.items()})
    return res, lse[0]


def run_torch_bsa(pack: Pack, x: dict, bm=None, lists=None, check=True, backend="auto", padding="zeros") -> dict:
    q, k, v = (torch.from_numpy(x[n]).to(DEVICE, BF16).requires_grad_() for n in ("q", "k", "v"))
    cu_q, cu_k = (torch.from_numpy(x[n]).to(DEVICE) for n in ("cu_q", "cu_k"))
    if not check:  # the op below the eager value checks: what torch.compile runs
        counts = torch.from_numpy(x["kv_counts"]).to(DEVICE, torch.int32)
        if bm is None:
            idx, num = (torch.from_numpy(a).to(DEVICE) for a in lists)
            given = dict(block_indices=idx, block_counts=num)
            selection = dict(given_idx=idx[None], given_num=num[None])
        else:
            given = dict(block_map=torch.from_numpy(bm).to(DEVICE))
            selection = dict(block_map=given["block_map"][None])
        p = prepare_block_sparse(q, k, v, counts, pack.block, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, padding=padding,
                                 **given).problem
        out, lse, *_ = torch_ops.attend(p, backend, dict(q=q[None], k=k[None], v=v[None], kv_counts=counts,
                                                         cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **selection))
        out, lse = out[0], lse[0]
    elif bm is not None:
        out, lse = vsa_torch.block_sparse_attn_varlen(q, k, v, cu_q, cu_k, torch.from_numpy(bm).to(DEVICE),
                                                      x["kv_counts"], pack.block, backend=backend, padding=padding)
    else:
        out, lse = vsa_torch.block_sparse_attn_varlen_from_indices(
            q, k, v, cu_q, cu_k, *(torch.from_numpy(a).to(DEVICE) for a in lists), x["kv_counts"], pack.block,
            backend=backend, padding=padding)
    out.backward(torch.from_numpy(x["dout"]).to(DEVICE, BF16))
    return {n: t.detach().float().cpu().numpy() for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad),
                                                             ("dv", v.grad), ("lse", lse))}


def run_jax_bsa(pack: Pack, x: dict, bm=None, lists=None, jit=True, padding="zeros") -> dict:
    def run(q, k, v, dout, cu_q, cu_k, sel):
        def f(q, k, v):
            if bm is not None:
                return vsa_jax.block_sparse_attn_varlen(q, k, v, cu_q, cu_k, sel[0], x["kv_counts"], pack.block,
                                                        padding=padding)
            return vsa_jax.block_sparse_attn_varlen_from_indices(q, k, v, cu_q, cu_k, sel[0], sel[1],
                                                                 x["kv_counts"], pack.block, padding=padding)
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

    args = [jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "dout")]
    cu = [jnp.asarray(x[n]) for n in ("cu_q", "cu_k")]
    sel = (jnp.asarray(bm),) if bm is not None else tuple(jnp.asarray(a) for a in lists)
    res = (jax.jit(run) if jit else run)(*args, *cu, sel)
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (np.asarray(r, np.float32) for r in res)))


def test_block_sparse_varlen_matches_per_sequence_and_reference():
    pack = PACKS[0]
    x = make_pack(pack, seed=90)
    bm = own_sequence_map(pack, x, seed=91)
    got = run_torch_bsa(pack, x, bm=bm)
    ref, ref_lse = bsa_reference(pack, x, bm)
    assert_close(_tol_case(pack), {n: got[n] for n in ref}, ref)
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(got["lse"]) == finite).all()
    np.testing.assert_allclose(got["lse"][finite], ref_lse[finite], rtol=1e-4, atol=1e-4)

    # per sequence: block_sparse_attn on [1, S_i, H, D] with the sequence's own map
    E, per = pack.E, {n: [] for n in ("out", "dq", "dk", "dv", "lse")}
    for i in range(len(pack.q_blocks)):
        qs, ks = slice(x["cu_q"][i], x["cu_q"][i + 1]), slice(x["cu_k"][i], x["cu_k"][i + 1])
        q, dout = (torch.from_numpy(x[n][qs][None]).to(DEVICE, BF16) for n in ("q", "dout"))
        k, v = (torch.from_numpy(x[n][ks][None]).to(DEVICE, BF16) for n in ("k", "v"))
        for t in (q, k, v):
            t.requires_grad_()
        local = bm[:, qs.start // E:qs.stop // E, ks.start // E:ks.stop // E]
        out, lse = vsa_torch.block_sparse_attn(q, k, v, torch.from_numpy(local)[None].to(DEVICE),
                                               x["kv_counts"][ks.start // E:ks.stop // E], pack.block, layout="bshd")
        out.backward(dout)
        for n, t in (("out", out[0]), ("dq", q.grad[0]), ("dk", k.grad[0]), ("dv", v.grad[0]), ("lse", lse[0])):
            per[n].append(t.detach().float().cpu().numpy())
    per = {n: np.concatenate(p, axis=-1 if n == "lse" else 0) for n, p in per.items()}
    # the fine stage alone: the same kernels on the same tiles and lists -> bitwise (on the GPU
    # the autotuner may choose another tile config for another q_len: by tolerance there)
    assert_equal_or_close(got, per, "packed vs per-sequence block_sparse_attn")

    # the same selection as index lists (junk past the counts), and through JAX
    lists = map_to_lists(bm, capacity=max(pack.kv_blocks) + 1)
    assert_equal_or_close(run_torch_bsa(pack, x, lists=lists), got, "lists vs map")
    assert_equal_or_close(run_jax_bsa(pack, x, bm=bm), got, "jax map vs torch map")
    assert_equal_or_close(run_jax_bsa(pack, x, lists=lists), got, "jax lists vs torch map")


def test_pack_block_indices_from_per_sequence_lists():
    """FastVideo's per-sequence lists (local indices, [1, H, nQ_i, C_i]) packed by
    pack_block_indices select exactly the blocks of the packed map (both frontends)."""
    pack = PACKS[0]
    x = make_pack(pack, seed=93)
    bm = own_sequence_map(pack, x, seed=94)
    cq, ck = np.cumsum((0,) + pack.q_blocks), np.cumsum((0,) + pack.kv_blocks)
    local = [map_to_lists(bm[:, cq[i]:cq[i + 1], ck[i]:ck[i + 1]], capacity=pack.kv_blocks[i], junk=0)
             for i in range(len(pack.q_blocks))]
    for frontend, to in ((vsa_torch, torch.from_numpy), (vsa_jax, jnp.asarray)):
        idx, num = frontend.pack_block_indices([to(a[None]) for a, _ in local], [to(n[None]) for _, n in local],
                                               list(pack.kv_blocks))
        idx, num = np.asarray(idx), np.asarray(num)
        assert idx.shape == (pack.heads, sum(pack.q_blocks), max(pack.kv_blocks))
        rebuilt = np.zeros_like(bm)
        for h, i in np.ndindex(*num.shape):
            rebuilt[h, i, idx[h, i, :num[h, i]]] = True
        np.testing.assert_array_equal(rebuilt, bm)


def test_cross_sequence_selection_rejected_eagerly_and_ignored_under_jit():
    pack = Pack(q_blocks=(1, 2), kv_blocks=(2, 1), heads=1)
    x = make_pack(pack, seed=95)
    bm = own_sequence_map(pack, x, seed=96)
    bad_map = bm.copy()
    bad_map[0, 1, 0] = True           # query block 1 (sequence 1) selects KV block 0 (sequence 0)
    lists = map_to_lists(bm, capacity=3)
    bad_lists = map_to_lists(bad_map, capacity=3)
    bad_lists[0][0, 2, bad_lists[1][0, 2]] = 7   # an out-of-range entry too
    bad_lists[1][0, 2] += 1

    cu = [torch.from_numpy(x[n]) for n in ("cu_q", "cu_k")]
    q, k, v = (torch.from_numpy(x[n]).to(BF16) for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=r"block_map selects KV block 0 \(sequence 0\) for query block 1"):
        vsa_torch.block_sparse_attn_varlen(q, k, v, *cu, torch.from_numpy(bad_map), x["kv_counts"], 64)
    with pytest.raises(ValueError, match="block_indices"):
        vsa_torch.block_sparse_attn_varlen_from_indices(q, k, v, *cu, *map(torch.from_numpy, bad_lists),
                                                        x["kv_counts"], 64)
    with pytest.raises(ValueError, match="block_map selects"):
        run_jax_bsa(pack, x, bm=bad_map, jit=False)
    with pytest.raises(ValueError, match="block_indices"):
        run_jax_bsa(pack, x, lists=bad_lists, jit=False)

    # where they cannot be checked (jit, the ops under torch.compile) they are ignored
    want = run_torch_bsa(pack, x, bm=bm)
    assert_equal_or_close(run_jax_bsa(pack, x, bm=bad_map), want, "jax, map with a cross entry")
    assert_equal_or_close(run_jax_bsa(pack, x, lists=bad_lists), want, "jax, lists with cross/out-of-range entries")
    assert_equal_or_close(run_torch_bsa(pack, x, bm=bad_map, check=False), want, "torch ops, map")
    assert_equal_or_close(run_torch_bsa(pack, x, lists=bad_lists, check=False), want, "torch ops, lists")
    assert_equal_or_close(run_torch_bsa(pack, x, lists=lists), want, "torch, clean lists")


# ---- bad input: a clear error naming the argument, before any kernel runs -------------------
def _good():
    """2 sequences: 2 + 1 query blocks, 1 + 2 KV blocks of 64 tokens."""
    rng = np.random.default_rng(0)
    return dict(q=rng.standard_normal((192, 2, 64), np.float32), k=rng.standard_normal((192, 2, 64), np.float32),
                cu_seqlens_q=np.array([0, 128, 192], np.int32), cu_seqlens_k=np.array([0, 64, 192], np.int32),
                variable_block_sizes=np.array([64, 64, 10]), q_variable_block_sizes=np.array([64, 64, 64]))


BAD_INPUTS = [
    ("cu_seqlens_q", np.array([0, 192, 128], np.int32), ValueError, "cu_seqlens_q must be non-decreasing"),
    ("cu_seqlens_k", np.array([0, 100, 192], np.int32), ValueError, "cu_seqlens_k values must be multiples of"),
    ("cu_seqlens_q", np.array([64, 128, 192], np.int32), ValueError, "cu_seqlens_q must start at 0"),
    ("cu_seqlens_k", np.array([0, 64, 128], np.int32), ValueError, "cu_seqlens_k must end at the packed length 192"),
    ("cu_seqlens_k", np.array([0, 192], np.int32), ValueError,
     "cu_seqlens_k must describe as many sequences as cu_seqlens_q (2)"),
    ("cu_seqlens_q", np.array([0, 128, 192], np.int64), TypeError, "cu_seqlens_q must be int32"),
    ("cu_seqlens_q", np.array([[0, 128, 192]], np.int32), ValueError, "cu_seqlens_q must have shape [N + 1]"),
    ("variable_block_sizes", np.array([64, 64]), ValueError, "variable_block_sizes must have shape (3,)"),
    ("q_variable_block_sizes", np.array([64, 64, 64, 64]), ValueError, "q_variable_block_sizes must have shape (3,)"),
    ("q", np.zeros((1, 192, 2, 64), np.float32), ValueError, "q must be a rank-3 packed tensor [total, H, D]"),
    ("gate", np.zeros((128, 2, 64), np.float32), ValueError, "compress_attn_weight must have q's shape (192, 2, 64)"),
]


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("name,value,exc,message", BAD_INPUTS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(frontend, name, value, exc, message):
    args = _good()
    args[name] = value
    if frontend == "torch":
        conv = {n: torch.from_numpy(a) for n, a in args.items()}
        for n in ("q", "k", "gate"):
            if n in conv:
                conv[n] = conv[n].to(BF16)
        fn = vsa_torch.video_sparse_attn_varlen
    else:
        conv = {n: jnp.asarray(a) if a.dtype != np.int64 else a for n, a in args.items()}
        for n in ("q", "k", "gate"):
            if n in conv:
                conv[n] = conv[n].astype(jnp.bfloat16)
        fn = vsa_jax.video_sparse_attn_varlen
    with pytest.raises(exc, match=re.escape(message)):
        fn(conv["q"], conv["k"], conv["k"], conv["cu_seqlens_q"], conv["cu_seqlens_k"], conv["variable_block_sizes"],
           conv["q_variable_block_sizes"], 2, 64, conv.get("gate"))


def test_jit_checks_only_shapes_of_traced_offsets():
    """Under jit the offsets are tracers: shape and dtype are still checked at trace time."""
    a = _good()
    q, k = (jnp.asarray(a[n], jnp.bfloat16) for n in ("q", "k"))

    def f(cu_q, cu_k):
        return vsa_jax.video_sparse_attn_varlen(q, k, k, cu_q, cu_k, a["variable_block_sizes"],
                                                a["q_variable_block_sizes"], 2, 64)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k must describe as many sequences")):
        jax.jit(f).lower(jnp.asarray(a["cu_seqlens_q"]), jnp.zeros(4, jnp.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        jax.jit(f).lower(jnp.zeros(3, jnp.float32), jnp.asarray(a["cu_seqlens_k"]))
    jax.jit(f).lower(jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32))  # values unknown: no error


def test_block_sparse_varlen_shapes():
    a = _good()
    q, k = (torch.from_numpy(a[n]).to(BF16) for n in ("q", "k"))
    cu = [torch.from_numpy(a[n]) for n in ("cu_seqlens_q", "cu_seqlens_k")]
    with pytest.raises(ValueError, match=re.escape("block_map must have shape [H, nQ, nKV] = (2, 3, 3)")):
        vsa_torch.block_sparse_attn_varlen(q, k, k, *cu, torch.ones(1, 2, 3, 3, dtype=torch.bool),
                                           a["variable_block_sizes"])
    with pytest.raises(ValueError, match=re.escape("block_counts must have shape [H, nQ] = (2, 3)")):
        vsa_torch.block_sparse_attn_varlen_from_indices(q, k, k, *cu, torch.zeros(2, 3, 2, dtype=torch.int32),
                                                        torch.zeros(2, 2, dtype=torch.int32), a["variable_block_sizes"])


# ---- GPU: both backends at larger shapes ---------------------------------------------------
GPU_PACKS = [
    ("triton", Pack(q_blocks=(9, 5, 20, 2), kv_blocks=(12, 5, 18, 1), head_dim=128, topk=6)),
    ("triton", Pack(q_blocks=(3, 6, 1), kv_blocks=(4, 2, 7), block=128, head_dim=128, topk=3)),
    ("cute", Pack(q_blocks=(3, 6, 1), kv_blocks=(4, 2, 7), block=128, head_dim=128, topk=3)),
    ("cute", Pack(q_blocks=(2, 5, 1), kv_blocks=(3, 2, 6), block=256, head_dim=128, topk=2, gate=False)),
    ("cute", Pack(q_blocks=(4, 1), kv_blocks=(2, 5), block=256, head_dim=64, topk=4)),
]


def _skip_unless_backend_runs(backend: str, pack: Pack) -> None:
    """Skips (strict mode: fails) when `backend` cannot run the pack's problem here; only
    BackendUnavailableError means that: any other error is a bug in the test or the code."""
    from vsa_core.backends import BackendUnavailableError, resolve_backend
    from vsa_core.problem import describe_attention
    from vsa_torch.ops import device_info
    # one whole block of the pack's E, D and dtype, BSHD [1, E, H, D]: what the backends decide on
    one_block = torch.empty(1, pack.E, pack.heads, pack.head_dim, dtype=BF16)
    probe = describe_attention(one_block, one_block, one_block, block_size=pack.block, layout="bshd",
                               kv_counts=np.array([pack.E]), q_counts=np.array([pack.E]), topk=1,
                               gate=one_block if pack.gate else None)
    try:
        resolve_backend(backend, probe, device_info(torch.empty(1, device="cuda")))
    except BackendUnavailableError as e:
        skip_unavailable(backend, str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("backend,pack", GPU_PACKS, ids=[f"{b}-{p.id()}" for b, p in GPU_PACKS])
def test_vsa_varlen_gpu_backends(backend, pack):
    _skip_unless_backend_runs(backend, pack)
    x = make_pack(pack, seed_of(pack))
    got = run_torch_varlen(pack, x, backend=backend)
    assert_close(_tol_case(pack), got, pack_reference(pack, x))
    assert_equal_or_close(got, run_torch_per_sequence(pack, x, backend=backend), "packed vs per-sequence")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,pack", GPU_PACKS, ids=[f"{b}-{p.id()}" for b, p in GPU_PACKS])
def test_block_sparse_varlen_gpu_backends(backend, pack):
    """The fine stage alone with each backend: map and lists, against the float64 reference;
    cross-sequence entries dropped (torch ops below the eager check)."""
    _skip_unless_backend_runs(backend, pack)
    x = make_pack(pack, seed_of(pack))
    bm = own_sequence_map(pack, x, seed=7)
    ref, _ = bsa_reference(pack, x, bm)
    got = run_torch_bsa(pack, x, bm=bm, backend=backend)
    assert_close(_tol_case(pack), {n: got[n] for n in ref}, ref)
    lists = map_to_lists(bm, capacity=max(pack.kv_blocks) + 1)
    assert_equal_or_close(run_torch_bsa(pack, x, lists=lists, backend=backend), got, "lists vs map")
    # entries in other sequences only: an own-sequence entry would change the answer
    crossed = bm | ((np.random.default_rng(8).random(bm.shape) < 0.3) & ~same_sequence_blocks(pack, x))
    assert (crossed != bm).any()
    assert_equal_or_close(run_torch_bsa(pack, x, bm=crossed, check=False, backend=backend), got, "cross entries")
