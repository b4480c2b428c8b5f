"""`softmax_scale` (issue 24, item 3): one scale of the scores q k^T for the coarse and the fine
branch, keyword-only on every public attention function of both frontends, None meaning
1/sqrt(D).

- the float64 reference: a scale s is the default scale on q multiplied by s*sqrt(D) (an
  identity that holds exactly for every step: block means are linear, the selection ranks
  scores that all scale alike), so the scale reaches both branches and every gradient;
- both frontends against the float64 reference with s = 0.3 and 2/sqrt(D) (out, dq, dk, dv,
  dgate): VSA (BHSD, BSHD, fp16), block-sparse attention (map and lists, lse included),
  varlen (VSA and block-sparse), a prefix, Ulysses (JAX on 2 host devices, torch on gloo),
  jit over sharded arrays; torch == JAX bit for bit where both run on the same kind of device;
- torch.compile with the scale as an argument of the compiled function; the JAX native path's
  launch plan carries it into every attention kernel;
- None is 1/sqrt(D) bit for bit (the same problem, so the same kernels and the same caches);
- bad values raise TypeError / ValueError naming softmax_scale, in identical words in both
  frontends, from every function;
- GPU (`-m gpu`): the cute (FA4) and cudnn backends with a non-default scale against float64.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import vsa_jax
import vsa_jax.parallel
import vsa_torch
import vsa_torch.parallel
from common import Case, assert_close, make_inputs, reference, require_jax_gpu, to_layout
from frontends import TORCH_DEVICE, run_jax_vjp, run_torch
from vsa_core import reference as R
from vsa_core.api import prepare_block_sparse, prepare_vsa
from vsa_core.backends import BackendUnavailableError

GPU = torch.cuda.is_available()
DEVICE = TORCH_DEVICE
# torch and JAX on the same kind of device: the same kernels on the same launches, equal bits
SAME_DEVICE = GPU == (jax.default_backend() == "gpu")
BF16 = torch.bfloat16


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


# ---- the float64 reference -------------------------------------------------------------------
def test_reference_scale_equals_rescaled_queries():
    """out(q; s) = out(c q; 1/sqrt(D)) with c = s sqrt(D), and by the chain rule dq(q; s) =
    c dq(c q; 1/sqrt(D)), dk, dv and dgate unchanged: for the coarse branch, the selection and
    the fine branch alike. The scale also changes the result (by far more than any tolerance)."""
    case = Case(batch=1, n_q_blocks=4, n_kv_blocks=4, topk=2)
    x = {n: np.asarray(a, np.float64) for n, a in make_inputs(case, seed=3).items()}  # c * q exact to float64
    D = case.head_dim
    for s in (0.3, 2.0 / math.sqrt(D), 0.05):
        c = s * math.sqrt(D)
        args = dict(gate=x["gate"], dout=x["dout"])
        got = R.video_sparse_attn_reference(x["q"], x["k"], x["v"], x["kv_counts"], x["q_counts"], case.topk,
                                            case.E, softmax_scale=s, **args)
        want = R.video_sparse_attn_reference(c * x["q"], x["k"], x["v"], x["kv_counts"], x["q_counts"], case.topk,
                                             case.E, **args)
        np.testing.assert_array_equal(got[1], want[1])  # the same selection
        np.testing.assert_allclose(got[2], want[2], rtol=1e-12, atol=0)  # the same (scaled) coarse scores
        np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12)
        for name in ("dk", "dv", "dgate"):
            np.testing.assert_allclose(got[3][name], want[3][name], rtol=1e-10, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(got[3]["dq"], c * want[3]["dq"], rtol=1e-10, atol=1e-12)
        default = R.video_sparse_attn_reference(x["q"], x["k"], x["v"], x["kv_counts"], x["q_counts"], case.topk,
                                                case.E, **args)
        assert np.linalg.norm(got[0] - default[0]) > 0.1 * np.linalg.norm(default[0])

        bm = got[1]
        out, lse, grads = R.block_sparse_attn_reference(x["q"], x["k"], x["v"], bm, x["kv_counts"], case.E,
                                                        dout=x["dout"], softmax_scale=s)
        out_w, lse_w, grads_w = R.block_sparse_attn_reference(c * x["q"], x["k"], x["v"], bm, x["kv_counts"],
                                                              case.E, dout=x["dout"])
        np.testing.assert_allclose(out, out_w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, lse_w, rtol=1e-12, atol=0)
        np.testing.assert_allclose(grads["dq"], c * grads_w["dq"], rtol=1e-10, atol=1e-12)
        for name in ("dk", "dv"):
            np.testing.assert_allclose(grads[name], grads_w[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_reference_none_is_inverse_sqrt_d():
    case = Case(batch=1)
    x = make_inputs(case, seed=4)
    default = 1 / math.sqrt(case.head_dim)
    np.testing.assert_array_equal(R.coarse_scores(x["q"], x["k"], x["kv_counts"], x["q_counts"], case.E),
                                  R.coarse_scores(x["q"], x["k"], x["kv_counts"], x["q_counts"], case.E,
                                                  softmax_scale=default))
    args = (x["q"], x["k"], x["v"], x["kv_counts"], x["q_counts"], case.topk, case.E)
    a = R.video_sparse_attn_reference(*args, gate=x["gate"], dout=x["dout"])
    b = R.video_sparse_attn_reference(*args, gate=x["gate"], dout=x["dout"], softmax_scale=default)
    for i in range(3):
        np.testing.assert_array_equal(a[i], b[i])
    for n in a[3]:
        np.testing.assert_array_equal(a[3][n], b[3][n])
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite Python float"):
        R.video_sparse_attn_reference(*args, softmax_scale=-1.0)


# ---- VSA, both frontends, against the float64 reference ----------------------------------------
# q and k x4 (Case.scale): the block means' scores are then large enough that the coarse
# softmax is not near-uniform, so a coarse branch on another scale fails the bounds too
# (seen: 1/sqrt(D) in the coarse kernels alone left the default-size cases within them); the gate
# makes dgate = dout * out_coarse a direct check of the coarse output
SCALED_CASES = [
    Case(batch=1, scale=4.0, softmax_scale=0.3),                                        # gate, partial + empty
    Case(batch=1, block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3, layout="bshd", scale=4.0,
         softmax_scale=2.0 / math.sqrt(128)),
    Case(batch=1, heads=1, block=(4, 4, 4), dtype="float16", n_q_blocks=5, n_kv_blocks=4, scale=4.0,
         softmax_scale=0.3),
]


@pytest.mark.parametrize("case", SCALED_CASES, ids=lambda c: c.id())
def test_vsa_matches_float64_reference(case):
    x = make_inputs(case, _seed("vsa", case.id()))
    want = reference(case, x)
    got_torch = run_torch(case, x, backend="triton")
    assert_close(case, got_torch, want)
    got_jax = run_jax_vjp(case, x, backend="triton")
    assert_close(case, got_jax, want)
    if SAME_DEVICE:
        for n in got_torch:
            assert np.array_equal(got_torch[n], got_jax[n]), n


def test_none_is_inverse_sqrt_d_bitwise():
    """Leaving softmax_scale out, None and 1/sqrt(D) are one problem: the same bits, forward
    and backward, in both frontends; an int scale is held as a float (the kernels take a float)."""
    case = Case(batch=1, n_q_blocks=2, n_kv_blocks=3)
    x = make_inputs(case, seed=5, margin=None)
    runs = [run_torch(dataclasses.replace(case, softmax_scale=s), x, backend="triton")
            for s in (None, 1.0 / math.sqrt(case.head_dim))]
    runs += [run_jax_vjp(dataclasses.replace(case, softmax_scale=s), x, backend="triton")
             for s in (None, 1.0 / math.sqrt(case.head_dim))]
    for n in runs[0]:
        assert np.array_equal(runs[0][n], runs[1][n]), n
        assert np.array_equal(runs[2][n], runs[3][n]), n
    # the keyword left out
    q, k, v = (torch.from_numpy(x[n]).to(DEVICE, BF16) for n in ("q", "k", "v"))
    out = vsa_torch.video_sparse_attn(q, k, v, x["kv_counts"], x["q_counts"], case.topk, case.block,
                                      torch.from_numpy(x["gate"]).to(DEVICE, BF16))
    assert np.array_equal(out.float().cpu().numpy(), runs[0]["out"])

    q = np.zeros((1, 2, 128, 64), np.float32).astype(jnp.bfloat16)
    counts = np.full(2, 64)
    ways = ({}, dict(softmax_scale=None), dict(softmax_scale=0.125), dict(softmax_scale=np.float64(0.125)))
    problems = {prepare_vsa(q, q, q, counts, counts, 1, 64, **kw).problem for kw in ways}
    assert len(problems) == 1 and type(problems.pop().softmax_scale) is float
    p = prepare_block_sparse(q, q, q, counts, 64, block_map=np.ones((1, 2, 2, 2), bool), softmax_scale=1).problem
    assert type(p.softmax_scale) is float and p.softmax_scale == 1.0


# ---- block-sparse attention ------------------------------------------------------------------------
def _block_map(case: Case, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bm = rng.random((case.batch, case.heads, case.n_q_blocks, case.n_kv_blocks)) < 0.6
    bm[..., 0] = True        # every query block sees a non-empty block...
    bm[0, 0, 1, :] = False   # ...but one: out 0, lse -inf
    return bm


def _lists(bm: np.ndarray):
    idx = np.zeros(bm.shape, np.int32)
    num = bm.sum(-1).astype(np.int32)
    for pos in np.ndindex(*bm.shape[:-1]):
        sel = np.flatnonzero(bm[pos])
        idx[pos][:len(sel)] = sel
    return idx, num


def _bsa_reference(case: Case, x: dict, bm: np.ndarray):
    t = {n: R.round_to_dtype(x[n], case.dtype) for n in ("q", "k", "v", "dout")}
    out, lse, grads = R.block_sparse_attn_reference(t["q"], t["k"], t["v"], bm, x["kv_counts"], case.E,
                                                    dout=t["dout"], softmax_scale=case.softmax_scale)
    return {"out": out, **grads}, lse


def _run_bsa_torch(case: Case, x: dict, bm, lists: bool, backend: str = "triton", device: str = DEVICE):
    dtype = getattr(torch, case.dtype)
    q, k, v = (torch.from_numpy(to_layout(x[n], case.layout)).to(device, dtype).requires_grad_()
               for n in ("q", "k", "v"))
    kw = dict(layout=case.layout, backend=backend, softmax_scale=case.softmax_scale)
    if lists:
        idx, num = (torch.from_numpy(a).to(device) for a in _lists(bm))
        out, lse = vsa_torch.block_sparse_attn_from_indices(q, k, v, idx, num, x["kv_counts"], case.block, **kw)
    else:
        out, lse = vsa_torch.block_sparse_attn(q, k, v, torch.from_numpy(bm).to(device), x["kv_counts"], case.block,
                                               **kw)
    out.backward(torch.from_numpy(to_layout(x["dout"], case.layout)).to(device, dtype))
    got = {n: to_layout(t.detach().float().cpu().numpy(), case.layout)
           for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
    return got, lse.cpu().numpy()


def _run_bsa_jax(case: Case, x: dict, bm, lists: bool, backend: str = "triton"):
    dtype = jnp.dtype(case.dtype)
    sel = tuple(jnp.asarray(a) for a in _lists(bm)) if lists else (jnp.asarray(bm),)

    @jax.jit
    def run(q, k, v, dout, sel):
        def f(q, k, v):
            kw = dict(layout=case.layout, backend=backend, softmax_scale=case.softmax_scale)
            if lists:
                return vsa_jax.block_sparse_attn_from_indices(q, k, v, *sel, x["kv_counts"], case.block, **kw)
            return vsa_jax.block_sparse_attn(q, k, v, sel[0], x["kv_counts"], case.block, **kw)
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

    res = run(*(jnp.asarray(to_layout(x[n], case.layout), dtype) for n in ("q", "k", "v", "dout")), sel)
    got = {n: to_layout(np.asarray(r, np.float32), case.layout)
           for n, r in zip(("out", "dq", "dk", "dv"), (res[0],) + res[2:])}
    return got, np.asarray(res[1])


def _check_lse(lse: np.ndarray, want: np.ndarray) -> None:
    """Natural-log lse of the scaled scores (|lse| up to ~10 here): the kernels' fp32 dot products
    of bf16 values and fp32 exp2 / log2 put it within 2e-6 of float64 on the CPU; the bound
    (1e-4 relative and absolute, as the GPU backend tests compare lse) leaves room for the GPU's
    approximate exp2 / log2 and fails a wrong scale, which moves lse by O(1)."""
    finite = np.isfinite(want)
    assert (np.isfinite(lse) == finite).all() and (lse[~finite] == want[~finite]).all()
    np.testing.assert_allclose(lse[finite], want[finite], rtol=1e-4, atol=1e-4)


BSA_CASES = [Case(batch=1, n_q_blocks=3, n_kv_blocks=4, softmax_scale=0.3),
             Case(batch=1, n_q_blocks=3, n_kv_blocks=4, layout="bshd", softmax_scale=2.0 / 8)]


@pytest.mark.parametrize("case", BSA_CASES, ids=lambda c: c.id())
def test_block_sparse_matches_float64_reference(case):
    """Map and lists, both frontends: out, dq, dk, dv and lse against float64."""
    x = make_inputs(case, _seed("bsa", case.id()), margin=None)
    bm = _block_map(case, _seed("bsa-map", case.id()))
    want, want_lse = _bsa_reference(case, x, bm)
    results = [_run_bsa_torch(case, x, bm, lists=False), _run_bsa_torch(case, x, bm, lists=True),
               _run_bsa_jax(case, x, bm, lists=False), _run_bsa_jax(case, x, bm, lists=True)]
    for got, lse in results:
        assert_close(case, got, want)
        _check_lse(lse, want_lse)
    if SAME_DEVICE:
        for n in want:
            assert np.array_equal(results[0][0][n], results[2][0][n]), n
        assert np.array_equal(results[0][1], results[2][1])


# ---- varlen ------------------------------------------------------------------------------------------
def _varlen_inputs(cases, seed):
    """Per-sequence inputs (batch 1, BHSD) and the packed stream [S, H, D] with its offsets."""
    seqs = [make_inputs(c, seed * 101 + i) for i, c in enumerate(cases)]
    x = {n: np.concatenate([s[n][0].transpose(1, 0, 2) for s in seqs]) for n in ("q", "k", "v", "gate", "dout")}
    for n in ("q_counts", "kv_counts"):
        x[n] = np.concatenate([s[n] for s in seqs])
    x["cu_q"] = (np.concatenate([[0], np.cumsum([c.n_q_blocks for c in cases])]) * 64).astype(np.int32)
    x["cu_k"] = (np.concatenate([[0], np.cumsum([c.n_kv_blocks for c in cases])]) * 64).astype(np.int32)
    return seqs, x


def _packed(refs):
    return {n: np.concatenate([r[n][0].transpose(1, 0, 2) for r in refs]) for n in refs[0]}


def test_vsa_varlen_matches_float64_reference():
    """Three sequences (Sq != Skv, an empty and a partial block), scale 0.3: each sequence matches
    its own float64 reference; torch (eager) and JAX (jit, offsets traced) agree bit for bit."""
    s = 0.3
    cases = [Case(batch=1, heads=1, topk=2, n_q_blocks=nq, n_kv_blocks=nk, softmax_scale=s)
             for nq, nk in ((2, 4), (1, 2), (2, 1))]
    seqs, x = _varlen_inputs(cases, _seed("varlen"))
    want = _packed([reference(c, xs) for c, xs in zip(cases, seqs)])

    q, k, v, gate = (torch.from_numpy(x[n]).to(DEVICE, BF16).requires_grad_() for n in ("q", "k", "v", "gate"))
    out = vsa_torch.video_sparse_attn_varlen(q, k, v, *(torch.from_numpy(x[n]).to(DEVICE) for n in ("cu_q", "cu_k")),
                                             torch.from_numpy(x["kv_counts"]), torch.from_numpy(x["q_counts"]), 2, 64,
                                             gate, softmax_scale=s)
    out.backward(torch.from_numpy(x["dout"]).to(DEVICE, BF16))
    got = {n: t.detach().float().cpu().numpy() for n, t in
           (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("dgate", gate.grad))}
    assert_close(cases[0], got, want)

    @jax.jit
    def run(q, k, v, gate, dout, cu_q, cu_k, kv_counts, q_counts):
        def f(q, k, v, gate):
            return vsa_jax.video_sparse_attn_varlen(q, k, v, cu_q, cu_k, kv_counts, q_counts, 2, 64, gate,
                                                    softmax_scale=s)
        out, vjp = jax.vjp(f, q, k, v, gate)
        return (out,) + vjp(dout)

    res = run(*(jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "gate", "dout")),
              *(jnp.asarray(x[n], jnp.int32) for n in ("cu_q", "cu_k", "kv_counts", "q_counts")))
    got_jax = dict(zip(("out", "dq", "dk", "dv", "dgate"), (np.asarray(r, np.float32) for r in res)))
    assert_close(cases[0], got_jax, want)
    if SAME_DEVICE:
        for n in got:
            assert np.array_equal(got[n], got_jax[n]), n


def test_block_sparse_varlen_matches_float64_reference():
    """block_sparse_attn_varlen (map) and _from_indices (lists), both frontends, scale 2/sqrt(D),
    against the float64 fine attention of the packed stream (the map stays in each sequence)."""
    s = 2.0 / 8
    cases = [Case(batch=1, heads=2, n_q_blocks=nq, n_kv_blocks=nk) for nq, nk in ((2, 3), (1, 2))]
    _, x = _varlen_inputs(cases, _seed("bsa-varlen"))
    q_seq = np.repeat([0, 1], [c.n_q_blocks for c in cases])
    kv_seq = np.repeat([0, 1], [c.n_kv_blocks for c in cases])
    rng = np.random.default_rng(8)
    bm = (rng.random((2, len(q_seq), len(kv_seq))) < 0.7) & (q_seq[:, None] == kv_seq[None, :])
    bm[:, np.arange(len(q_seq)), np.searchsorted(kv_seq, q_seq)] = True
    idx, num = _lists(bm)

    t = {n: R.round_to_dtype(x[n], "bfloat16").transpose(1, 0, 2)[None] for n in ("q", "k", "v", "dout")}
    out, want_lse, grads = R.block_sparse_attn_reference(t["q"], t["k"], t["v"], bm[None], x["kv_counts"], 64,
                                                         dout=t["dout"], softmax_scale=s)
    want = {"out": out[0].transpose(1, 0, 2), **{n: g[0].transpose(1, 0, 2) for n, g in grads.items()}}

    results = []
    for lists in (False, True):
        q, k, v = (torch.from_numpy(x[n]).to(DEVICE, BF16).requires_grad_() for n in ("q", "k", "v"))
        cu = [torch.from_numpy(x[n]).to(DEVICE) for n in ("cu_q", "cu_k")]
        if lists:
            o, lse = vsa_torch.block_sparse_attn_varlen_from_indices(
                q, k, v, *cu, torch.from_numpy(idx).to(DEVICE), torch.from_numpy(num).to(DEVICE), x["kv_counts"], 64,
                softmax_scale=s)
        else:
            o, lse = vsa_torch.block_sparse_attn_varlen(q, k, v, *cu, torch.from_numpy(bm).to(DEVICE), x["kv_counts"],
                                                        64, softmax_scale=s)
        o.backward(torch.from_numpy(x["dout"]).to(DEVICE, BF16))
        results.append(({n: a.detach().float().cpu().numpy() for n, a in
                         (("out", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}, lse.cpu().numpy()))

        def f(q, k, v, cu_q, cu_k):
            if lists:
                return vsa_jax.block_sparse_attn_varlen_from_indices(q, k, v, cu_q, cu_k, idx, num, x["kv_counts"],
                                                                     64, softmax_scale=s)
            return vsa_jax.block_sparse_attn_varlen(q, k, v, cu_q, cu_k, bm, x["kv_counts"], 64, softmax_scale=s)

        def run(q, k, v, dout, cu_q, cu_k):
            (o, lse), vjp = jax.vjp(lambda q, k, v: f(q, k, v, cu_q, cu_k), q, k, v)
            return (o, lse) + vjp((dout, jnp.zeros_like(lse)))
        res = jax.jit(run)(*(jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "dout")),
                           *(jnp.asarray(x[n]) for n in ("cu_q", "cu_k")))
        results.append((dict(zip(("out", "dq", "dk", "dv"), (np.asarray(r, np.float32) for r in (res[0],) + res[2:]))),
                        np.asarray(res[1])))
    for got, lse in results:
        assert_close(cases[0], got, want)
        _check_lse(lse, want_lse[0])


# ---- a prefix ------------------------------------------------------------------------------------------
def test_prefix_matches_float64_reference():
    """Two prefix blocks ("compete"), scale 0.3, both frontends against float64 (the selection
    ranks the scaled scores, rounded after the scale: drawn for this scale's ranking)."""
    from test_prefix import CASE, draw
    case = dataclasses.replace(CASE, softmax_scale=0.3)
    P, mode = 2, "compete"
    x = draw(case, P, mode, _seed("prefix"))
    t = {n: R.round_to_dtype(x[n], case.dtype) for n in ("q", "k", "v", "gate", "dout")}
    out, _, _, grads = R.video_sparse_attn_reference(
        t["q"], t["k"], t["v"], x["kv_counts"], x["q_counts"], case.topk, case.E, gate=t["gate"],
        round_to=case.dtype, dout=t["dout"], prefix_blocks=P, prefix_mode=mode, softmax_scale=case.softmax_scale)
    want = {"out": out, **grads}
    got_torch = run_torch(case, x, backend="triton", prefix_blocks=P, prefix_mode=mode)
    got_jax = run_jax_vjp(case, x, backend="triton", prefix_blocks=P, prefix_mode=mode)
    assert_close(case, got_torch, want)
    assert_close(case, got_jax, want)
    if SAME_DEVICE:
        for n in got_torch:
            assert np.array_equal(got_torch[n], got_jax[n]), n


# ---- torch.compile --------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_matches_eager():
    """The scale as an argument of the compiled function: Dynamo traces a float argument
    symbolically once its value changes (torch's default specialize_float=False), so the
    checks must trace too (comparisons, no math.isfinite); each value equals eager."""
    case = Case(batch=1, heads=1, n_q_blocks=2, n_kv_blocks=2, topk=1)
    x = make_inputs(case, seed=9, margin=None)
    counts = [torch.from_numpy(x[n]).to(DEVICE) for n in ("kv_counts", "q_counts")]

    def attend(q, k, v, softmax_scale):
        return vsa_torch.video_sparse_attn(q, k, v, *counts, case.topk, case.block, softmax_scale=softmax_scale)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    dout = torch.from_numpy(x["dout"]).to(DEVICE, BF16)
    for s in (0.3, 2.0 / 8):
        results = []
        for fn in (attend, compiled):
            q, k, v = (torch.from_numpy(x[n]).to(DEVICE, BF16).requires_grad_() for n in ("q", "k", "v"))
            out = fn(q, k, v, s)
            results.append([out.detach(), *torch.autograd.grad(out, (q, k, v), dout)])
        for eager, comp in zip(*results):
            torch.testing.assert_close(comp, eager, rtol=0, atol=0)


# ---- Ulysses ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_ulysses_jax_on_mesh():
    """2 devices: bitwise the one-device call with the same scale, and the float64 reference."""
    from test_jax_vsa import jax_args, to_numpy
    from test_parallel_jax import assert_bitwise, mesh_of, out_and_grads
    case = Case(batch=1, heads=2, n_q_blocks=4, n_kv_blocks=4, layout="bshd", softmax_scale=0.3)
    x = make_inputs(case, _seed("ulysses-jax"))
    args = jax_args(case, x)
    # the scaled one-device call (test_parallel_jax's one_device takes no scale)
    want = dict(zip(("out", "dq", "dk", "dv", "dgate"), jax.jit(out_and_grads(
        lambda q, k, v, gate: vsa_jax.video_sparse_attn_bshd(q, k, v, x["kv_counts"], x["q_counts"], case.topk,
                                                             case.block, gate, softmax_scale=case.softmax_scale),
        case))(*args)))
    want = {n: np.asarray(a) for n, a in want.items()}
    assert_close(case, to_numpy(case, want), reference(case, x))
    mesh = mesh_of()

    def attend(q, k, v, gate):
        return vsa_jax.parallel.ulysses_video_sparse_attn_on_mesh(
            q, k, v, x["kv_counts"], x["q_counts"], case.topk, case.block, gate, mesh=mesh, axis_name="sp",
            softmax_scale=case.softmax_scale)
    assert_bitwise(jax.jit(out_and_grads(attend, case))(*args), want, "ulysses with softmax_scale")


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_jax_jit_over_sharded_arrays(monkeypatch):
    """jit over arrays sharded over the heads (vsa_jax.spmd splits the call per device): every
    device's problem holds the scale; bitwise the one-device call."""
    from jax.sharding import NamedSharding
    from test_jax_spmd import assert_bitwise, mesh_of, out_and_grads_fn, split_spec
    from test_jax_vsa import jax_args
    from vsa_jax import ops as jax_ops
    case = Case(batch=2, heads=2, n_q_blocks=2, n_kv_blocks=3, softmax_scale=0.3)
    x = make_inputs(case, _seed("spmd"))
    args = jax_args(case, x)
    fn = jax.jit(out_and_grads_fn(case, x["kv_counts"], x["q_counts"]))
    want = [np.asarray(a) for a in fn(*args)]
    seen, real_run = [], jax_ops._run

    def spy_run(stage, p, impl, **inputs):
        seen.append(p)
        return real_run(stage, p, impl, **inputs)
    monkeypatch.setattr(jax_ops, "_run", spy_run)
    mesh, spec = mesh_of(), split_spec(case.layout, "heads")
    got = fn(*(jax.device_put(a, NamedSharding(mesh, spec)) for a in args))
    assert seen and {(p.heads, p.softmax_scale) for p in seen} == {(1, 0.3)}
    assert_bitwise(got, want, "jit over the heads")


@pytest.mark.skipif(GPU, reason="the CPU run (Triton interpreter); test_parallel_torch's NCCL test covers GPUs")
def test_ulysses_torch_gloo(tmp_path, monkeypatch):
    """2 ranks on gloo: bitwise the one-device call with the same scale, and the float64 reference."""
    from test_parallel_torch import check_against_one_device, spawn
    case = Case(batch=1, heads=2, n_q_blocks=2, n_kv_blocks=2, topk=1, layout="bshd", softmax_scale=0.3)
    ranks = spawn(tmp_path, monkeypatch, "gloo", [(case, "auto", {}, "zeros")])
    assert len(check_against_one_device(case, {}, ranks, 0)) == 5  # the interpreter is deterministic


# ---- the keyword on every public attention function; bad values -----------------------------------------------
ATTENTION = ("video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
             "video_sparse_attn_varlen", "block_sparse_attn_varlen", "block_sparse_attn_varlen_from_indices")


def test_every_attention_function_takes_the_keyword():
    fns = [getattr(lib, name) for lib in (vsa_torch, vsa_jax) for name in ATTENTION]
    fns += [vsa_torch.parallel.ulysses_video_sparse_attn, vsa_jax.parallel.ulysses_video_sparse_attn,
            vsa_jax.parallel.ulysses_video_sparse_attn_on_mesh]
    for fn in fns:
        param = inspect.signature(fn).parameters.get("softmax_scale")
        assert param is not None and param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None, \
            f"{fn.__module__}.{fn.__name__}"
        if fn is not vsa_torch.video_sparse_attn_bshd and fn is not vsa_jax.video_sparse_attn_bshd:  # "as ... but"
            assert "softmax_scale" in inspect.getdoc(fn), f"{fn.__module__}.{fn.__name__} does not document it"
    # every public name of the frontends that computes attention is in the list above
    computes = {n for n in vsa_torch.__all__ if "attn" in n}
    assert computes == set(ATTENTION) and {n for n in vsa_jax.__all__ if "attn" in n} == set(ATTENTION)


def _calls(lib):
    """Each attention function of `lib` with valid arguments, taking softmax_scale."""
    if lib == "torch":
        t = lambda *shape: torch.zeros(*shape, dtype=BF16)  # noqa: E731
        ints = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
        bool_map = lambda *shape: torch.ones(*shape, dtype=torch.bool)  # noqa: E731
        m = vsa_torch
    else:
        t = lambda *shape: jnp.zeros(shape, jnp.bfloat16)  # noqa: E731
        ints = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
        bool_map = lambda *shape: jnp.ones(shape, bool)  # noqa: E731
        m = vsa_jax
    x, packed, c = t(1, 1, 128, 64), t(128, 1, 64), np.full(2, 64)
    cu = ints([0, 128])
    idx, num = ints(np.zeros((1, 1, 2, 1))), ints(np.ones((1, 1, 2)))
    return {
        "video_sparse_attn": lambda s: m.video_sparse_attn(x, x, x, c, c, 1, 64, softmax_scale=s),
        "video_sparse_attn_bshd": lambda s: m.video_sparse_attn_bshd(*(t(1, 128, 1, 64),) * 3, c, c, 1, 64,
                                                                     softmax_scale=s),
        "block_sparse_attn": lambda s: m.block_sparse_attn(x, x, x, bool_map(1, 1, 2, 2), c, 64, softmax_scale=s),
        "block_sparse_attn_from_indices": lambda s: m.block_sparse_attn_from_indices(x, x, x, idx, num, c, 64,
                                                                                     softmax_scale=s),
        "video_sparse_attn_varlen": lambda s: m.video_sparse_attn_varlen(packed, packed, packed, cu, cu, c, c, 1, 64,
                                                                         softmax_scale=s),
        "block_sparse_attn_varlen": lambda s: m.block_sparse_attn_varlen(packed, packed, packed, cu, cu,
                                                                         bool_map(1, 2, 2), c, 64, softmax_scale=s),
        "block_sparse_attn_varlen_from_indices": lambda s: m.block_sparse_attn_varlen_from_indices(
            packed, packed, packed, cu, cu, idx[0], num[0], c, 64, softmax_scale=s),
    }


BAD = [(0, ValueError), (0.0, ValueError), (-1, ValueError), (-0.5, ValueError), (float("nan"), ValueError),
       (float("inf"), ValueError), (10 ** 400, ValueError), ("0.3", TypeError), (True, TypeError),
       (np.array(0.3), TypeError), ([0.3], TypeError)]


@pytest.mark.parametrize("value, error", BAD, ids=lambda v: repr(v)[:12])
def test_bad_values_name_softmax_scale_in_both_frontends(value, error):
    words = {}
    for lib in ("torch", "jax"):
        for name, call in _calls(lib).items():
            with pytest.raises(error, match="softmax_scale must be a positive finite Python float") as info:
                call(value)
            words[lib, name] = str(info.value)
    assert len(set(words.values())) == 1, words  # one message, every function, both frontends
    # a tensor / traced scale is refused as well (it must be static)
    with pytest.raises(TypeError, match="softmax_scale"):
        _calls("torch")["video_sparse_attn"](torch.tensor(0.3))
    with pytest.raises(TypeError, match="softmax_scale"):
        jax.jit(lambda s: _calls("jax")["video_sparse_attn"](s)).trace(0.3)


def test_bad_values_from_the_ulysses_helpers():
    """Checked before any collective: JAX at trace time inside shard_map; torch on a
    one-rank gloo group (the checks run before the group size matters)."""
    import socket

    import torch.distributed as dist
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    c = np.full(2, 64)
    messages = []
    if len(jax.devices()) >= 2:
        mesh = jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2])
        spec = P(None, "sp")
        x = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16, sharding=NamedSharding(mesh, spec))

        def attend(q, k, v):
            return vsa_jax.parallel.ulysses_video_sparse_attn(q, k, v, c, c, 1, 64, axis_name="sp", softmax_scale=0)
        with pytest.raises(ValueError, match="softmax_scale") as info:
            jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)).trace(x, x, x)
        messages.append(str(info.value))
        with pytest.raises(ValueError, match="softmax_scale") as info:
            vsa_jax.parallel.ulysses_video_sparse_attn_on_mesh(*(jnp.zeros((1, 128, 2, 64), jnp.bfloat16),) * 3, c, c,
                                                               1, 64, mesh=mesh, axis_name="sp", softmax_scale=0)
        messages.append(str(info.value))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        x = torch.zeros(1, 128, 2, 64, dtype=BF16)
        with pytest.raises(ValueError, match="softmax_scale") as info:
            vsa_torch.parallel.ulysses_video_sparse_attn(x, x, x, c, c, 1, 64, softmax_scale=0)
        messages.append(str(info.value))
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError) as info:
        vsa_torch.video_sparse_attn(*(torch.zeros(1, 1, 128, 64, dtype=BF16),) * 3, c, c, 1, 64, softmax_scale=0)
    assert set(messages) == {str(info.value)}


# ---- GPU: the library backends with a non-default scale ----------------------------------------------------
GPU_CASES = [  # (backend, case): shapes both frontends can run forward and backward there
    ("cute", Case(block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3, batch=1, softmax_scale=0.3)),
    ("cute", Case(block=256, n_q_blocks=2, n_kv_blocks=4, topk=2, layout="bshd", softmax_scale=2.0 / 8)),
    ("cudnn", Case(head_dim=128, softmax_scale=0.3)),
    ("cudnn", Case(block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3, batch=1, layout="bshd",
                   softmax_scale=2.0 / math.sqrt(128))),
]


def _require(backend: str, case: Case, training: bool = True) -> None:
    if backend == "cute":
        from test_cute_backend import _require_cute
        _require_cute(case)
    else:
        from test_cudnn_backend import _require_cudnn
        _require_cudnn(case, training)


@pytest.mark.gpu
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("backend, case", GPU_CASES, ids=[f"{b}-{c.id()}" for b, c in GPU_CASES])
def test_gpu_backends_match_float64_reference(frontend, backend, case):
    _require(backend, case)
    if frontend == "jax":
        require_jax_gpu()
    x = make_inputs(case, _seed("gpu", backend, case.id()))
    try:
        got = (run_torch if frontend == "torch" else run_jax_vjp)(case, x, backend=backend)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    assert_close(case, got, reference(case, x))


@pytest.mark.gpu
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("backend, case", [
    ("cute", Case(block=128, n_q_blocks=3, n_kv_blocks=4, softmax_scale=0.3)),
    ("cute", Case(block=256, n_q_blocks=2, n_kv_blocks=3, layout="bshd", softmax_scale=2.0 / 8)),
    ("cudnn", Case(block=64, head_dim=128, n_q_blocks=3, n_kv_blocks=4, softmax_scale=0.3)),
    ("cudnn", Case(block=128, head_dim=128, n_q_blocks=3, n_kv_blocks=4, layout="bshd",
                   softmax_scale=2.0 / math.sqrt(128))),
], ids=lambda x: x if isinstance(x, str) else x.id())
def test_gpu_block_sparse_matches_float64_reference(frontend, backend, case):
    """out, dq, dk, dv and lse (natural log, of the scaled scores) of block_sparse_attn."""
    _require(backend, case)
    if frontend == "jax":
        require_jax_gpu()
    x = make_inputs(case, _seed("gpu-bsa", backend, case.id()), margin=None)
    bm = _block_map(case, _seed("gpu-bsa-map", case.id()))
    want, want_lse = _bsa_reference(case, x, bm)
    if frontend == "torch":
        got, lse = _run_bsa_torch(case, x, bm, lists=False, backend=backend, device="cuda")
    else:
        got, lse = _run_bsa_jax(case, x, bm, lists=False, backend=backend)
    assert_close(case, got, want)
    _check_lse(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [Case(dtype="float16", head_dim=128, softmax_scale=0.3),
                                  Case(head_dim=64, block=128, n_q_blocks=2, n_kv_blocks=3, softmax_scale=0.3)],
                         ids=lambda c: c.id())
def test_gpu_cudnn_inference_forward_matches_float64_reference(case):
    """cuDNN's forward-only cases (fp16, head dim 64) with a scale, under no_grad."""
    _require("cudnn", case, training=False)
    x = make_inputs(case, _seed("gpu-cudnn-inference", case.id()))
    dtype = getattr(torch, case.dtype)
    q, k, v, gate = (torch.from_numpy(to_layout(x[n], case.layout)).to("cuda", dtype) for n in ("q", "k", "v", "gate"))
    with torch.no_grad():
        out = vsa_torch.video_sparse_attn(q, k, v, torch.from_numpy(x["kv_counts"]), torch.from_numpy(x["q_counts"]),
                                          case.topk, case.block, gate, backend="cudnn",
                                          softmax_scale=case.softmax_scale)
    assert_close(case, {"out": out.float().cpu().numpy()}, {"out": reference(case, x)["out"]})


# ---- the JAX native path's launch plan (recorded on the CPU) -------------------------------------------------
def test_native_plan_carries_the_scale():
    """Every attention kernel of the recorded plan (replayed with no Python per call) takes the
    problem's scale: the coarse kernels s, the fine ones s * log2(e) (their softmax runs on exp2)
    and s; the GPU replay itself is in test_jax_native (GPU_CASES has a scaled case)."""
    from vsa_core import plan as core_plan
    from vsa_core.problem import AttnProblem
    s = 0.3
    p = AttnProblem(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16", topk=2,
                    has_gate=True, softmax_scale=s)
    seen = {}
    for stage, inputs in (("forward", core_plan.forward_inputs(p)), ("backward", core_plan.backward_inputs(p))):
        for launch in core_plan.record_plan(stage, p, inputs).launches:
            names = {a.name for a in launch.args}
            for arg in ("sm_scale", "qk_scale_log2"):
                if arg in names:
                    seen[launch.kernel_name, arg] = launch.arg(arg).value
    log2 = s * math.log2(math.e)
    assert seen == {("coarse_attn_fwd_kernel", "sm_scale"): s, ("sparse_attn_fwd_kernel", "qk_scale_log2"): log2,
                    ("coarse_attn_bwd_ds_kernel", "sm_scale"): s, ("coarse_attn_bwd_grads_kernel", "sm_scale"): s,
                    ("sparse_attn_bwd_dq_kernel", "qk_scale_log2"): log2, ("sparse_attn_bwd_dq_kernel", "sm_scale"): s,
                    ("sparse_attn_bwd_dkdv_kernel", "qk_scale_log2"): log2, ("sparse_attn_bwd_dkdv_kernel", "sm_scale"): s}
