"""Mixed-modality VSA (issue 18): `prefix_blocks` / `prefix_mode` (FastVideo's H3 backend).

- the float64 reference's selection (`prefix_topk_mask`) against a row-by-row restatement
  of the rule, and its prefix_blocks = 0 identity with plain VSA;
- the selection kernel's lists (dense prefix rows, exempt / compete) against the reference,
  with ties, -inf (empty blocks) and clamping;
- both frontends x the triton backend, forward and gradients, against the float64
  reference: prefix_blocks 0..4, both modes (CPU: Triton's interpreter);
- torch == JAX bit for bit (same kernels, same launches);
- varlen: per-sequence prefixes (an int, or one per sequence, traced under jax.jit) against
  each sequence's own reference and bit for bit against per-sequence calls;
- bad values: ValueError / TypeError naming the argument.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import vsa_jax
import vsa_torch
from common import Case, assert_close, compile_in_subprocess, make_inputs, selection_is_clear
from frontends import run_jax_vjp, run_torch
from vsa_core import reference as R
from vsa_core.backends import BackendUnavailableError
from vsa_core import stages
from vsa_core.launch import eager_launcher
from vsa_core.problem import AttnProblem

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# torch and JAX on the same kind of device (both on the CPU, or both on the GPU): their results are bitwise equal
SAME_DEVICE = GPU == (jax.default_backend() == "gpu")
MODES = ("exempt", "compete")


# ---- the float64 reference's rule ------------------------------------------------------------
def rule_by_rows(scores: np.ndarray, topk: int, P: int, mode: str) -> np.ndarray:
    """The selection restated one row at a time, by sorting (independent of topk_mask)."""
    n_q, n_kv = scores.shape
    out = np.zeros(scores.shape, bool)
    for i in range(n_q):
        finite = np.isfinite(scores[i])
        if i < P:
            out[i] = finite
            continue
        cols = [j for j in range(n_kv) if finite[j] and (mode == "compete" or j >= P)]
        cols.sort(key=lambda j: (-scores[i, j], j))
        k = topk + P if mode == "compete" else topk
        out[i, cols[:k]] = True
        if mode == "exempt":
            out[i, :P] |= finite[:P]
    return out


def random_scores(rng, n_q, n_kv, ties: bool) -> np.ndarray:
    s = rng.integers(-2, 3, (n_q, n_kv)).astype(np.float32) * 0.5 if ties else \
        rng.standard_normal((n_q, n_kv)).astype(np.float32)
    s[:, rng.random(n_kv) < 0.2] = -np.inf  # empty KV blocks, prefix ones included
    return s


@pytest.mark.parametrize("mode", MODES)
def test_reference_rule(mode):
    rng = np.random.default_rng(len(mode))
    for trial in range(40):
        n = int(rng.integers(1, 9))
        P, topk = int(rng.integers(0, n + 1)), int(rng.integers(1, n + 2))
        s = random_scores(rng, n, n, ties=trial % 2 == 0)
        got = R.prefix_topk_mask(s[None, None], topk, P, mode)[0, 0]
        np.testing.assert_array_equal(got, rule_by_rows(s, topk, P, mode), err_msg=f"P={P} topk={topk}\n{s}")
        if P == 0:
            np.testing.assert_array_equal(got, R.topk_mask(s[None, None], topk)[0, 0])


def test_reference_modes_differ_and_prefix_rows_are_dense():
    """A video row whose best blocks are video blocks: "exempt" adds the prefix blocks,
    "compete" spends the budget on its best blocks; prefix rows take every non-empty block."""
    s = np.array([[0.0, 1.0, 2.0, 3.0, 4.0]] * 3, np.float32)
    s[:, 2] = -np.inf  # an empty video block
    exempt = R.prefix_topk_mask(s, 1, 2, "exempt")
    compete = R.prefix_topk_mask(s, 1, 2, "compete")
    assert exempt[0].tolist() == exempt[1].tolist() == [True, True, False, True, True]
    assert exempt[2].tolist() == [True, True, False, False, True]
    assert compete[2].tolist() == [False, True, False, True, True]


# ---- the selection kernel -----------------------------------------------------------------------
def run_select(scores: np.ndarray, topk: int, P: int, mode: str):
    n_q, n_kv = scores.shape
    p = AttnProblem(batch=1, heads=1, q_len=64 * n_q, kv_len=64 * n_kv, head_dim=64, block_elems=64,
                    dtype="bfloat16", topk=min(topk, n_kv), prefix_blocks=P, prefix_mode=mode if P else "exempt")
    cap = p.select_capacity
    assert cap == (n_kv if P else min(topk, n_kv))
    sel_idx = torch.full((1, 1, n_q, cap), -7, dtype=torch.int32, device=DEVICE)
    sel_num = torch.full((1, 1, n_q), -7, dtype=torch.int32, device=DEVICE)
    sel_mask = torch.full((1, 1, n_q, n_kv), 7, dtype=torch.int8, device=DEVICE)
    s = torch.from_numpy(np.ascontiguousarray(scores)).reshape(1, 1, n_q, n_kv).to(DEVICE)
    stages.topk_select(eager_launcher, p, s, sel_idx, sel_num, sel_mask)
    return (sel_idx.cpu().numpy()[0, 0], sel_num.cpu().numpy()[0, 0], sel_mask.cpu().numpy()[0, 0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_selection_kernel_matches_reference(mode, ties):
    rng = np.random.default_rng([len(mode), ties])
    for n, P, topk in ((6, 0, 2), (6, 1, 2), (6, 4, 1), (6, 6, 3), (9, 3, 20), (7, 2, 4), (37, 4, 9),
                          (100, 3, 9), (100, 70, 9)):  # 100: a main tile of 64 and a tail
        s = random_scores(rng, n, n, ties)
        want = R.prefix_topk_mask(s, min(topk, n), P, mode)
        idx, num, mask = run_select(s, topk, P, mode)
        np.testing.assert_array_equal(mask, want.astype(np.int8), err_msg=f"n={n} P={P} topk={topk}")
        np.testing.assert_array_equal(num, want.sum(-1))
        for r in range(n):
            np.testing.assert_array_equal(idx[r, :num[r]], np.flatnonzero(want[r]), err_msg=f"row {r}")


# ---- both frontends against the float64 reference -------------------------------------------
def draw(case: Case, P: int, mode: str, seed: int, margin: float = 1.0) -> dict:
    """Inputs on which every kernel selects what the reference does (`selection_is_clear`,
    the prefix rule's ranked cells)."""
    for attempt in range(50):
        x = make_inputs(case, seed * 100 + attempt, margin=None)
        if selection_is_clear(x, case, margin=margin, prefix_blocks=P, prefix_mode=mode):
            return x
    raise RuntimeError("could not draw inputs with an unambiguous selection")


def prefix_reference(case: Case, x: dict, P: int, mode: str) -> dict:
    t = {n: R.round_to_dtype(x[n], case.dtype) for n in ("q", "k", "v", "gate", "dout")}
    out, _, _, grads = R.video_sparse_attn_reference(
        t["q"], t["k"], t["v"], x["kv_counts"], x["q_counts"], case.topk, case.E,
        gate=t["gate"] if case.gate else None, round_to=case.dtype, dout=t["dout"], prefix_blocks=P, prefix_mode=mode)
    return {"out": out, **grads}


# 6 blocks (block 2 empty, 1 and 5 partial): P up to 4 leaves 2 video blocks. P = 0 is the
# plain problem in either mode (test_prefix_zero_is_plain_vsa_in_both_modes): run once.
CASE = Case(n_q_blocks=6, n_kv_blocks=6, batch=1, heads=1, topk=1)
FRONTEND_CASES = [(P, mode, dataclasses.replace(CASE, layout="bshd", gate=False) if P % 2 else CASE)
                  for P in range(5) for mode in MODES if P or mode == "exempt"]
RUNNERS = {"torch": run_torch, "jax": run_jax_vjp}


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("P, mode, case", FRONTEND_CASES, ids=[f"P{P}-{m}" for P, m, _ in FRONTEND_CASES])
@pytest.mark.parametrize("frontend", list(RUNNERS))
def test_matches_float64_reference(frontend, P, mode, case):
    x = draw(case, P, mode, _seed(P, mode))
    got = RUNNERS[frontend](case, x, backend="triton", prefix_blocks=P, prefix_mode=mode)
    assert_close(case, got, prefix_reference(case, x, P, mode))


GPU_CASE = Case(block=128, head_dim=128, n_q_blocks=6, n_kv_blocks=6, batch=1, heads=2, topk=1)
# cuDNN's blk64 forward (its own prefix-rows call on a side stream) in both layouts, two batches
GPU_CASES = [GPU_CASE, dataclasses.replace(GPU_CASE, block=64, batch=2, layout="bshd")]


@pytest.mark.gpu
@pytest.mark.parametrize("P, mode", [(P, m) for P in range(5) for m in MODES], ids=lambda x: str(x))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"E{c.E}-{c.layout}")
@pytest.mark.parametrize("backend", ["cute", "cudnn", "sm90"])
@pytest.mark.parametrize("frontend", list(RUNNERS))
def test_gpu_backends_match_float64_reference(frontend, backend, case, P, mode):
    """The CuTe fine stages (FA4, cuDNN BSA, ours) on the prefix lists: D 128, bf16 (a shape they
    run forward and backward; FA4 skips 64-token blocks and ours 128-token ones, saying why)."""
    if frontend == "jax" and jax.default_backend() != "gpu":
        pytest.skip("jax has no GPU backend")
    x = draw(case, P, mode, _seed("gpu", P, mode, case.E))
    try:
        got = RUNNERS[frontend](case, x, backend=backend, prefix_blocks=P, prefix_mode=mode)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    assert_close(case, got, prefix_reference(case, x, P, mode))


@pytest.mark.parametrize("P, mode", [(2, "exempt")])  # compete: test_varlen_per_sequence_prefixes
@pytest.mark.skipif(not SAME_DEVICE, reason="torch has a GPU, jax has not")
def test_torch_equals_jax_bitwise(P, mode):
    case = dataclasses.replace(CASE, topk=2)
    x = draw(case, P, mode, _seed("parity", P, mode))
    got_t = run_torch(case, x, backend="triton", prefix_blocks=P, prefix_mode=mode)
    got_j = run_jax_vjp(case, x, backend="triton", prefix_blocks=P, prefix_mode=mode)
    for n in got_t:
        assert np.array_equal(got_t[n], got_j[n]), f"{n}: max |torch - jax| = {np.abs(got_t[n] - got_j[n]).max()}"


def test_prefix_zero_is_plain_vsa_in_both_modes():
    case = dataclasses.replace(CASE, n_q_blocks=3, n_kv_blocks=3)
    x = make_inputs(case, seed=11, margin=None)
    plain = run_torch(case, x, backend="triton")
    for mode in MODES:
        got = run_torch(case, x, backend="triton", prefix_blocks=0, prefix_mode=mode)
        for n in plain:
            assert np.array_equal(got[n], plain[n]), n


# ---- varlen: a prefix per sequence --------------------------------------------------------------
def make_pack(blocks, prefixes, seed, mode="exempt", heads=1):
    """Sequences with as many query as KV blocks, each with its own inputs; packed [S, H, D]."""
    cases = [dataclasses.replace(CASE, n_q_blocks=n, n_kv_blocks=n, heads=heads) for n in blocks]
    seqs = [draw(c, P, mode, seed + i) for i, (c, P) in enumerate(zip(cases, prefixes))]
    x = {n: np.concatenate([s[n][0].transpose(1, 0, 2) for s in seqs]) for n in ("q", "k", "v", "gate", "dout")}
    for n in ("q_counts", "kv_counts"):
        x[n] = np.concatenate([s[n] for s in seqs])
    x["cu"] = (np.concatenate([[0], np.cumsum(blocks)]) * 64).astype(np.int32)
    return cases, seqs, x


def _unpack(refs):
    return {n: np.concatenate([r[n][0].transpose(1, 0, 2) for r in refs]) for n in refs[0]}


def run_torch_varlen(x, topk, prefix, mode):
    q, k, v, gate = (torch.from_numpy(x[n]).to(DEVICE, torch.bfloat16).requires_grad_()
                     for n in ("q", "k", "v", "gate"))
    cu = torch.from_numpy(x["cu"]).to(DEVICE)
    out = vsa_torch.video_sparse_attn_varlen(q, k, v, cu, cu, torch.from_numpy(x["kv_counts"]),
                                             torch.from_numpy(x["q_counts"]), topk, 64, gate, prefix_blocks=prefix,
                                             prefix_mode=mode)
    out.backward(torch.from_numpy(x["dout"]).to(DEVICE, torch.bfloat16))
    return {n: t.detach().float().cpu().numpy() for n, t in
            (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("dgate", gate.grad))}


def run_jax_varlen(x, topk, prefix, mode):
    """jit(vjp) with the offsets, counts and (an array) the prefix counts traced."""
    per_seq = not isinstance(prefix, int)

    @jax.jit
    def run(q, k, v, gate, dout, cu, kv_counts, q_counts, prefix_arr):
        def f(q, k, v, gate):
            return vsa_jax.video_sparse_attn_varlen(q, k, v, cu, cu, kv_counts, q_counts, topk, 64, gate,
                                                    prefix_blocks=prefix_arr if per_seq else prefix,
                                                    prefix_mode=mode)
        out, vjp = jax.vjp(f, q, k, v, gate)
        return (out,) + vjp(dout)

    res = run(*(jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "gate", "dout")),
              *(jnp.asarray(x[n], jnp.int32) for n in ("cu", "kv_counts", "q_counts")),
              jnp.asarray(prefix if per_seq else 0, jnp.int32))
    return dict(zip(("out", "dq", "dk", "dv", "dgate"), (np.asarray(r, np.float32) for r in res)))


@pytest.mark.parametrize("mode", MODES)
def test_varlen_per_sequence_prefixes(mode):
    """Three sequences with prefixes 2, 0 and 1: each matches its own float64 reference;
    torch (eager) and JAX (jit, prefixes traced) agree bit for bit."""
    blocks, prefixes, topk = (4, 3, 3), [2, 0, 1], 1
    cases, seqs, x = make_pack(blocks, prefixes, _seed("varlen", mode), mode)
    want = _unpack([prefix_reference(c, s, P, mode) for c, s, P in zip(cases, seqs, prefixes)])
    got = run_torch_varlen(x, topk, torch.tensor(prefixes, dtype=torch.int32), mode)
    assert_close(cases[0], got, want)
    got_jax = run_jax_varlen(x, topk, np.array(prefixes, np.int32), mode)
    assert_close(cases[0], got_jax, want)
    for n in got:
        assert np.array_equal(got[n], got_jax[n]) or not SAME_DEVICE, n


def test_varlen_int_prefix_equals_per_sequence_calls():
    """An int prefix applies to every sequence: the packed call equals per-sequence
    video_sparse_attn_bshd calls (bitwise on the CPU, see test_varlen.py for why)."""
    blocks, P, topk = (3, 4), 2, 1
    cases, seqs, x = make_pack(blocks, [P, P], _seed("varlen-int"), "compete")
    got = run_torch_varlen(x, topk, P, "compete")
    parts = {n: [] for n in got}
    for i, c in enumerate(cases):
        sl = slice(x["cu"][i], x["cu"][i + 1])
        q, k, v, gate = (torch.from_numpy(x[n][sl][None]).to(DEVICE, torch.bfloat16).requires_grad_()
                         for n in ("q", "k", "v", "gate"))
        counts = torch.from_numpy(seqs[i]["kv_counts"])
        out = vsa_torch.video_sparse_attn_bshd(q, k, v, counts, torch.from_numpy(seqs[i]["q_counts"]), topk, 64, gate,
                                               prefix_blocks=P, prefix_mode="compete")
        out.backward(torch.from_numpy(x["dout"][sl][None]).to(DEVICE, torch.bfloat16))
        for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("dgate", gate.grad)):
            parts[n].append(t[0].detach().float().cpu().numpy())
    for n in got:
        want = np.concatenate(parts[n])
        if GPU:
            np.testing.assert_allclose(got[n], want, rtol=0, atol=1e-2 * np.abs(want).max(), err_msg=n)
        else:
            assert np.array_equal(got[n], want), n


# ---- bad values ----------------------------------------------------------------------------------
def _qkv(n_q=3, n_kv=3, lib="torch"):
    if lib == "torch":
        q = torch.zeros(1, 1, n_q * 64, 64, dtype=torch.bfloat16, device=DEVICE)
        k = torch.zeros(1, 1, n_kv * 64, 64, dtype=torch.bfloat16, device=DEVICE)
        return q, k, torch.full((n_kv,), 64, device=DEVICE), torch.full((n_q,), 64, device=DEVICE)
    q = jnp.zeros((1, 1, n_q * 64, 64), jnp.bfloat16)
    k = jnp.zeros((1, 1, n_kv * 64, 64), jnp.bfloat16)
    return q, k, np.full(n_kv, 64), np.full(n_q, 64)


@pytest.mark.parametrize("lib", ["torch", "jax"])
@pytest.mark.parametrize("kw, error, match", [
    (dict(prefix_blocks=-1), ValueError, "prefix_blocks must be >= 0"),
    (dict(prefix_blocks=4), ValueError, "prefix_blocks .4. must not exceed"),
    (dict(prefix_blocks=1, prefix_mode="dense"), ValueError, "prefix_mode must be one of"),
    (dict(prefix_mode=None), ValueError, "prefix_mode must be one of"),
    (dict(prefix_blocks=1.0), TypeError, "prefix_blocks must be a Python int"),
    (dict(prefix_blocks=True), TypeError, "prefix_blocks must be a Python int"),
])
def test_bad_values(lib, kw, error, match):
    fn = vsa_torch.video_sparse_attn if lib == "torch" else vsa_jax.video_sparse_attn
    q, k, kv_counts, q_counts = _qkv(lib=lib)
    with pytest.raises(error, match=match):
        fn(q, k, k, kv_counts, q_counts, 1, 64, **kw)


@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_prefix_needs_equal_lengths(lib):
    fn = vsa_torch.video_sparse_attn if lib == "torch" else vsa_jax.video_sparse_attn
    q, k, kv_counts, q_counts = _qkv(2, 3, lib)
    with pytest.raises(ValueError, match="prefix_blocks > 0 needs q and k of the same length"):
        fn(q, k, k, kv_counts, q_counts, 1, 64, prefix_blocks=1)
    fn(q, k, k, kv_counts, q_counts, 1, 64, prefix_blocks=0)  # no prefix: Sq != Skv is fine


@pytest.mark.parametrize("lib", ["torch", "jax"])
@pytest.mark.parametrize("cu_k, prefix, error, match", [
    ([0, 128, 192], [1, 2], ValueError, "must not exceed the number of blocks of sequence 1"),
    ([0, 128, 192], [-1, 0], ValueError, "prefix_blocks must be >= 0"),
    ([0, 128, 192], 2, ValueError, "must not exceed the number of blocks of sequence 1"),
    ([0, 64, 192], [1, 0], ValueError, "sequence 0 has 2 query and 1 KV blocks"),
    ([0, 64, 192], [0, 0], None, None),  # no prefix: Sq != Skv per sequence is fine
    ([0, 128, 192], np.int64(1), None, None),  # a numpy integer is an int (every sequence)
    ([0, 128, 192], [1, 1, 1], ValueError, r"must have shape \(2,\)"),
    ([0, 128, 192], [1.0, 0.0], TypeError, "must be integers"),
])
def test_varlen_bad_values(lib, cu_k, prefix, error, match):
    mod = vsa_torch if lib == "torch" else vsa_jax
    if lib == "torch":
        q = torch.zeros(192, 1, 64, dtype=torch.bfloat16, device=DEVICE)
        cu_q = torch.tensor([0, 128, 192], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor(cu_k, dtype=torch.int32, device=DEVICE)
        prefix = torch.tensor(prefix, device=DEVICE) if isinstance(prefix, list) else prefix
    else:
        q = jnp.zeros((192, 1, 64), jnp.bfloat16)
        cu_q, cu_k = np.array([0, 128, 192], np.int32), np.array(cu_k, np.int32)
        prefix = np.array(prefix) if isinstance(prefix, list) else prefix
    counts = np.full(3, 64)
    def call():
        return mod.video_sparse_attn_varlen(q, q, q, cu_q, cu_k, counts, counts, 1, 64, prefix_blocks=prefix)
    if error is None:
        call()
    else:
        with pytest.raises(error, match=match):
            call()


# ---- the JAX native path's launch plan (recorded on the CPU) -------------------------------------
@pytest.mark.parametrize("varlen", [False, True], ids=["plain", "varlen"])
def test_native_plan_records_the_prefix_selection(varlen):
    from vsa_core import plan as core_plan
    p = AttnProblem(batch=1, heads=2, q_len=384, kv_len=384, head_dim=64, block_elems=64, dtype="bfloat16", topk=2,
                    layout="bshd", prefix_blocks=0 if varlen else 2, prefix_mode="compete", seq_prefix=varlen,
                    n_seqs=2 if varlen else 0)
    inputs = core_plan.forward_inputs(p)
    if varlen:
        inputs.update(cu_seqlens_q=((3,), "int32"), cu_seqlens_k=((3,), "int32"), seq_prefix=((2,), "int32"))
    topk = next(l for l in core_plan.record_plan("forward", p, inputs).launches
                if l.kernel_name == stages.TOPK_KERNELS[stages.TOPK_ALGORITHM])
    extra = ("q_seq", "cu_seqlens_q", "cu_seqlens_k", "seq_prefix") if varlen else ()
    assert topk.buffers == ("scores", "sel_idx", "sel_num", "sel_mask") + extra
    assert topk.arg("PREFIX_MODE").value == 2 and topk.arg("VARLEN").value is varlen
    assert topk.arg("PER_SEQ_PREFIX").value is varlen and topk.arg("idx_capacity").value == p.n_kv_blocks
    assert p.forward_buffers()["sel_idx"][0][-1] == p.n_kv_blocks  # dense prefix rows: room for every block


# ---- torch.compile ---------------------------------------------------------------------------------
def test_torch_compile_fullgraph_matches_eager():
    """prefix_blocks static, per-sequence counts a tensor input: one full graph, equal to eager."""
    cases, seqs, x = make_pack((3, 2), [1, 2], _seed("compile"), "exempt")
    cu = torch.from_numpy(x["cu"]).to(DEVICE)
    counts = [torch.from_numpy(x[n]).to(DEVICE) for n in ("kv_counts", "q_counts")]
    prefix = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)

    def outputs(q, k, v):
        packed = vsa_torch.video_sparse_attn_varlen(q, k, v, cu, cu, *counts, 1, 64, prefix_blocks=prefix)
        plain = vsa_torch.video_sparse_attn_bshd(q[None], k[None], v[None], *counts, 1, 64, prefix_blocks=2,
                                                 prefix_mode="compete")
        return packed, plain

    # the op's outputs and gradients, not a reduction of them (inductor may sum in another order)
    compiled = torch.compile(outputs, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    gen = torch.Generator().manual_seed(0)
    results = []
    for fn in (outputs, compiled):
        q, k, v = (torch.from_numpy(x[n]).to(DEVICE, torch.bfloat16).requires_grad_() for n in ("q", "k", "v"))
        packed, plain = fn(q, k, v)
        douts = [torch.randn(o.shape, generator=gen).to(DEVICE, o.dtype) for o in (packed, plain)]
        grads = torch.autograd.grad((packed, plain), (q, k, v), douts)
        results.append([packed.detach(), plain.detach(), *grads])
        gen.manual_seed(0)
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)


# ---- the selection kernel compiles for sm_90 (CPU, in a subprocess without the interpreter) -------
_COMPILE_SCRIPT = """
from vsa_core import plan as P, stages
from vsa_core.problem import AttnProblem
for kw in (dict(prefix_blocks=1, prefix_mode="exempt"), dict(prefix_blocks=2, prefix_mode="compete", topk=1),
           dict(seq_prefix=True, n_seqs=2, prefix_mode="exempt"), dict(prefix_blocks=1, n_seqs=1, prefix_mode="compete")):
    args = dict(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16", topk=2, layout="bshd")
    args.update(kw)
    p = AttnProblem(**args)
    inputs = P.forward_inputs(p)
    if p.varlen:
        inputs.update(cu_seqlens_q=((p.n_seqs + 1,), "int32"), cu_seqlens_k=((p.n_seqs + 1,), "int32"))
        if p.seq_prefix:
            inputs["seq_prefix"] = ((p.n_seqs,), "int32")
    plan = P.record_plan("forward", p, inputs)
    launch = next(l for l in plan.launches if l.kernel_name == stages.TOPK_KERNELS[stages.TOPK_ALGORITHM])
    c = P.compile_launch(launch, plan, 90)
    assert c.cubin[:4] == b"\x7fELF"
    print(kw, "ok", len(c.cubin))
print("OK")
"""


def test_selection_kernel_compiles_for_sm90():
    """prefix 1 (Triton compiles an int argument equal to 1 in as a constant), compete, packed
    with per-sequence counts and with an int: each specialization compiles to a cubin."""
    proc = compile_in_subprocess(_COMPILE_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
