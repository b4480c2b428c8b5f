"""Bad values in index lists and per-block counts, both frontends.

Eager calls raise ValueError naming the argument. Under torch.compile / jax.jit nothing
is checked before launch; the kernels bound every value instead, and the result is the
documented one: counts clamped to [0, capacity] / [0, E], and a list entry counts only if
it is in [0, nKV) and greater than the last counted entry of its row
(`vsa_core.reference.index_lists_to_block_map`). All bad rows go into one call (one row
per case, plus valid rows), so forward and backward see all of them at once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vsa_core.runtime import INTERPRETING
import torch

import vsa_jax
import vsa_torch
from common import Case, assert_close, make_inputs, skip_if_interpreter_broken
from vsa_core import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
CASE = Case(batch=2, heads=3, n_q_blocks=2, n_kv_blocks=4, gate=False)  # 12 list rows
E, NK, CAP = CASE.E, CASE.n_kv_blocks, 4
ROWS = list(np.ndindex(CASE.batch, CASE.heads, CASE.n_q_blocks))


def _entry(value):
    def bad(idx, num, row):
        idx[row][:3], num[row] = (0, value, 3), 3
    return bad


def _row(entries, count):
    def bad(idx, num, row):
        idx[row][:len(entries)], num[row] = entries, count
    return bad


# (label, the argument the error names, how the row is spoiled)
BAD_LISTS = [
    ("index nKV", "block_indices", _entry(NK)),
    ("index -1", "block_indices", _entry(-1)),
    ("index -2^20", "block_indices", _entry(-2**20)),
    ("index 2^20", "block_indices", _entry(2**20)),
    ("index 2^31-1", "block_indices", _entry(2**31 - 1)),
    ("count capacity+1", "block_counts", _row((0, 1, 2, 3), CAP + 1)),
    ("count 2^16", "block_counts", _row((0, 1, 3, 2), 2**16)),   # the last entry is out of order too
    ("count -1", "block_counts", _row((0, 1), -1)),
    ("duplicate", "block_indices", _row((1, 1, 3), 3)),
    ("unsorted", "block_indices", _row((3, 0, 1), 3)),
]


def good_lists():
    """[B, H, nQ, CAP] int32 lists (ascending, junk past the count) and their counts."""
    idx = np.full((CASE.batch, CASE.heads, CASE.n_q_blocks, CAP), 99, np.int32)
    num = np.zeros(idx.shape[:3], np.int32)
    for n, row in enumerate(ROWS):
        chosen = [j for j in range(NK) if (n + j) % 3]  # varied, ascending
        idx[row][:len(chosen)], num[row] = chosen, len(chosen)
    return idx, num


def lists_with(bad_cases):
    """Good lists with row n spoiled by bad_cases[n]."""
    idx, num = good_lists()
    for row, (_, _, spoil) in zip(ROWS, bad_cases):
        spoil(idx, num, row)
    return idx, num


def kept_lists(idx, num):
    """The lists of what the kernels keep: ascending, no repeats, in range."""
    block_map = R.index_lists_to_block_map(idx, num, NK)
    out = np.zeros_like(idx)
    for row in ROWS:
        chosen = np.flatnonzero(block_map[row])
        out[row][:chosen.size] = chosen
    return out, block_map.sum(-1).astype(np.int32), block_map


def test_rule_of_the_reference():
    idx = np.array([[3, 0, 1, 5, 4, -1, 4, 6]], np.int32)
    got = R.index_lists_to_block_map(idx, np.array([7]), 6)[0]
    assert np.flatnonzero(got).tolist() == [3, 5]  # 0, 1 below 3; 4 below 5; -1 out; 6 past the count
    assert not R.index_lists_to_block_map(idx, np.array([-3]), 6).any()
    assert R.index_lists_to_block_map(idx, np.array([2**16]), 7)[0].nonzero()[0].tolist() == [3, 5, 6]


# ---- eager: a ValueError naming the argument, before any kernel ---------------------------
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("label,name,spoil", BAD_LISTS, ids=[c[0] for c in BAD_LISTS])
def test_eager_bad_lists_raise(frontend, label, name, spoil):
    idx, num = good_lists()
    spoil(idx, num, ROWS[5])
    q = np.zeros((CASE.batch, CASE.heads, CASE.n_q_blocks * E, 64), np.float32)
    k = np.zeros((CASE.batch, CASE.heads, NK * E, 64), np.float32)
    counts = np.full(NK, E)
    where = ", ".join(str(i) for i in ROWS[5])
    with pytest.raises(ValueError, match=rf"^{name} .*\[b, h, i.*\] = \[{where}"):
        if frontend == "torch":
            t = [torch.from_numpy(x).to(DEVICE, BF16) for x in (q, k, k)]
            vsa_torch.block_sparse_attn_from_indices(*t, torch.from_numpy(idx).to(DEVICE),
                                                     torch.from_numpy(num).to(DEVICE), counts, E)
        else:
            a = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, k)]
            vsa_jax.block_sparse_attn_from_indices(*a, jnp.asarray(idx), jnp.asarray(num), counts, E)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("name,value", [("variable_block_sizes", E + 1), ("variable_block_sizes", -1),
                                        ("q_variable_block_sizes", 2**16), ("q_variable_block_sizes", -2**31)])
def test_eager_bad_counts_raise(frontend, name, value):
    counts = {"variable_block_sizes": np.full(NK, E), "q_variable_block_sizes": np.full(2, E)}
    counts[name][1] = value
    q = np.zeros((1, 1, 2 * E, 64), np.float32)
    k = np.zeros((1, 1, NK * E, 64), np.float32)
    lib, conv = ((vsa_torch, lambda x: torch.from_numpy(x).to(DEVICE, BF16)) if frontend == "torch"
                 else (vsa_jax, lambda x: jnp.asarray(x, jnp.bfloat16)))
    with pytest.raises(ValueError, match=rf"^{name} values must lie in \[0, {E}\].*found {value}"):
        lib.video_sparse_attn(conv(q), conv(k), conv(k), counts["variable_block_sizes"],
                              counts["q_variable_block_sizes"], 2, E)


# ---- compiled / jitted: bounded by the kernels, the documented result ---------------------
def _reference(inputs, block_map):
    x = {n: R.round_to_dtype(inputs[n], "bfloat16") for n in ("q", "k", "v", "dout")}
    out, _, grads = R.block_sparse_attn_reference(x["q"], x["k"], x["v"], block_map, inputs["kv_counts"], E,
                                                  dout=x["dout"])
    return {"out": out, **grads}


def test_torch_compile_bounds_bad_lists():
    """Every bad row at once under torch.compile: equal (bitwise) to an eager call on the
    lists the rule keeps, and forward and gradients match the float64 reference of that
    selection (so the backward drops exactly what the forward drops)."""
    inputs = make_inputs(CASE, seed=81)
    idx, num = lists_with(BAD_LISTS)
    kept_idx, kept_num, block_map = kept_lists(idx, num)
    dout = torch.from_numpy(inputs["dout"]).to(DEVICE, BF16)

    def run(q, k, v, idx, num, kv_counts):
        out, lse = vsa_torch.block_sparse_attn_from_indices(q, k, v, idx, num, kv_counts, E)
        return out, lse

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    results = []
    for fn, lists in ((compiled, (idx, num)), (run, (kept_idx, kept_num))):
        q, k, v = (torch.from_numpy(inputs[n]).to(DEVICE, BF16).requires_grad_() for n in ("q", "k", "v"))
        out, lse = fn(q, k, v, *(torch.from_numpy(x).to(DEVICE) for x in lists),
                      torch.from_numpy(inputs["kv_counts"]).to(DEVICE))
        out.backward(dout)
        results.append({"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad})
    for name, want in results[1].items():
        assert torch.equal(results[0][name], want), name
    got = {n: x.detach().float().cpu().numpy() for n, x in results[0].items() if n != "lse"}
    assert_close(CASE, got, _reference(inputs, block_map))


def test_jax_jit_bounds_bad_lists():
    """The same under jax.jit (lists and counts traced)."""
    inputs = make_inputs(CASE, seed=82)
    idx, num = lists_with(BAD_LISTS)
    kept_idx, kept_num, block_map = kept_lists(idx, num)

    @jax.jit
    def run(q, k, v, dout, idx, num, kv_counts):
        def f(q, k, v):
            return vsa_jax.block_sparse_attn_from_indices(q, k, v, idx, num, kv_counts, E)
        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, *vjp((dout, jnp.zeros_like(lse)))

    args = [jnp.asarray(inputs[n], jnp.bfloat16) for n in ("q", "k", "v", "dout")]
    counts = jnp.asarray(inputs["kv_counts"], jnp.int32)
    bad = run(*args, jnp.asarray(idx), jnp.asarray(num), counts)
    clean = run(*args, jnp.asarray(kept_idx), jnp.asarray(kept_num), counts)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, x, y in zip(names, bad, clean):
        assert np.array_equal(np.asarray(x), np.asarray(y)), name
    got = {n: np.asarray(x, np.float32) for n, x in zip(names, bad) if n != "lse"}
    assert_close(CASE, got, _reference(inputs, block_map))


BAD_COUNTS = dict(kv=np.array([E + 5, -3, 2**20, 7]), q=np.array([-2**31, E + 1]))
CLAMPED_COUNTS = {n: np.clip(c, 0, E) for n, c in BAD_COUNTS.items()}


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_compiled_counts_act_clamped(frontend):
    """variable_block_sizes / q_variable_block_sizes outside [0, E] under compile / jit:
    the same result as the values clamped to [0, E], forward and gradients."""
    case = Case(batch=1, n_q_blocks=2, n_kv_blocks=4, topk=2)
    inputs = make_inputs(case, seed=83)
    names = ("q", "k", "v", "gate")
    results = []
    if frontend == "torch":
        def run(q, k, v, gate, kv_counts, q_counts):
            return vsa_torch.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, E, gate)

        compiled = torch.compile(run, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
        for fn, counts in ((compiled, BAD_COUNTS), (run, CLAMPED_COUNTS)):
            x = [torch.from_numpy(inputs[n]).to(DEVICE, BF16).requires_grad_() for n in names]
            out = fn(*x, *(torch.from_numpy(counts[n]).to(DEVICE) for n in ("kv", "q")))
            out.backward(torch.from_numpy(inputs["dout"]).to(DEVICE, BF16))
            results.append([out.detach()] + [t.grad for t in x])
        pairs = [(a.float().cpu().numpy(), b.float().cpu().numpy()) for a, b in zip(*results)]
    else:
        @jax.jit
        def run(q, k, v, gate, dout, kv_counts, q_counts):
            def f(q, k, v, gate):
                return vsa_jax.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, E, gate)
            out, vjp = jax.vjp(f, q, k, v, gate)
            return out, *vjp(dout)

        x = [jnp.asarray(inputs[n], jnp.bfloat16) for n in names + ("dout",)]
        for counts in (BAD_COUNTS, CLAMPED_COUNTS):
            results.append(run(*x, *(jnp.asarray(counts[n], jnp.int32) for n in ("kv", "q"))))
        pairs = [(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(*results)]
    for name, (a, b) in zip(("out", "dq", "dk", "dv", "dgate"), pairs):
        assert np.isfinite(a).all() and np.array_equal(a, b), name


# ---- the value checks see every change of host memory ------------------------------------
def test_torch_host_values_are_checked_every_call():
    """Counts and lists that alias numpy memory are re-checked after a change made
    through numpy (torch's version counter does not see it). CPU tensors on purpose (they
    alias numpy), on a GPU machine too: they run under the interpreter there
    (vsa_core.interpreter), with or without TRITON_INTERPRET."""
    if not INTERPRETING:
        skip_if_interpreter_broken()
    inputs = make_inputs(Case(batch=1, heads=1, n_q_blocks=1, n_kv_blocks=2), seed=84)
    q, k, v = (torch.from_numpy(inputs[n]).to(BF16) for n in ("q", "k", "v"))
    counts = np.array([E, 5])
    idx, num = np.array([[[[0, 1]]]], np.int32), np.array([[[2]]], np.int32)
    t_counts, t_idx, t_num = torch.from_numpy(counts), torch.from_numpy(idx), torch.from_numpy(num)
    with torch.no_grad():
        vsa_torch.block_sparse_attn_from_indices(q, k, v, t_idx, t_num, t_counts, E)
        counts[1] = E + 1
        with pytest.raises(ValueError, match="variable_block_sizes values"):
            vsa_torch.block_sparse_attn_from_indices(q, k, v, t_idx, t_num, t_counts, E)
        counts[1] = 5
        idx[0, 0, 0, 1] = 2
        with pytest.raises(ValueError, match="block_indices entries"):
            vsa_torch.block_sparse_attn_from_indices(q, k, v, t_idx, t_num, t_counts, E)
        idx[0, 0, 0, 1] = 1
        num[()] = 3
        with pytest.raises(ValueError, match="block_counts values"):
            vsa_torch.block_sparse_attn_from_indices(q, k, v, t_idx, t_num, t_counts, E)


def test_jax_numpy_values_are_checked_every_call():
    inputs = make_inputs(Case(batch=1, heads=1, n_q_blocks=1, n_kv_blocks=2), seed=85)
    q, k, v = (jnp.asarray(inputs[n], jnp.bfloat16) for n in ("q", "k", "v"))
    counts = np.array([E, 5])
    idx, num = np.array([[[[0, 1]]]], np.int32), np.array([[[2]]], np.int32)
    vsa_jax.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E)
    idx[0, 0, 0, 1] = 0
    with pytest.raises(ValueError, match="block_indices rows must be strictly ascending.*a repeat"):
        vsa_jax.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E)
    idx[0, 0, 0, 1] = 1
    counts[0] = -1
    with pytest.raises(ValueError, match="variable_block_sizes values"):
        vsa_jax.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E)


@pytest.mark.gpu
def test_cuda_lists_rechecked_after_in_place_change():
    """A CUDA pair checked once is not read again until it changes (version counter)."""
    inputs = make_inputs(Case(batch=1, heads=1, n_q_blocks=1, n_kv_blocks=2), seed=86)
    q, k, v = (torch.from_numpy(inputs[n]).to("cuda", BF16) for n in ("q", "k", "v"))
    idx = torch.tensor([[[[0, 1]]]], dtype=torch.int32, device="cuda")
    num = torch.tensor([[[2]]], dtype=torch.int32, device="cuda")
    counts = torch.tensor([E, 5], device="cuda")
    for _ in range(2):
        vsa_torch.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E)
    idx[0, 0, 0, 1] = NK * 1000
    with pytest.raises(ValueError, match="block_indices entries"):
        vsa_torch.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E)
    idx[0, 0, 0, 1] = 1
    num.fill_(-1)
    with pytest.raises(ValueError, match="block_counts values"):
        vsa_torch.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E)


@pytest.mark.parametrize("E_fa4", [128, 256])
def test_fa4_lists_apply_the_rule(E_fa4):
    """The CuTe backend's list builder (a Triton kernel: runs without FA4) keeps what the
    rule keeps, on random garbage lists and counts; out-of-range token counts act clamped."""
    from vsa_core.backends import cute_backend
    from vsa_core.launch import eager_launcher
    from vsa_core.problem import AttnProblem

    rng = np.random.default_rng(E_fa4)
    B, H, nq, nk, cap = 2, 2, 3, 5, 7
    p = AttnProblem(batch=B, heads=H, q_len=nq * E_fa4, kv_len=nk * E_fa4, head_dim=64, block_elems=E_fa4,
                    dtype="bfloat16", selection="indices")
    pool = np.array([-2**31, -2**20, -1, nk, nk + 1, 2**20, 2**31 - 1] + list(range(nk)) * 3)
    idx = rng.choice(pool, (B, H, nq, cap)).astype(np.int32)
    num = rng.choice(np.array([-2**31, -1, 0, 2, 4, cap, cap + 1, 2**16]), (B, H, nq)).astype(np.int32)
    counts = np.array([E_fa4 + 9, -2**31, 100, 2**31 - 1, -4], np.int32)
    block_map = R.index_lists_to_block_map(idx, num, nk)
    sub, width = E_fa4 // 128, min(cap, nk) * (E_fa4 // 128)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)  # noqa: E731
    out_idx = torch.full((2, B, H, nq, width), -1, dtype=torch.int32, device=DEVICE)
    out_num = torch.full((2, B, H, nq), -1, dtype=torch.int32, device=DEVICE)
    cute_backend.forward_lists(eager_launcher, p, t(idx), t(num), t(counts), out_idx[0], out_num[0], out_idx[1],
                               out_num[1])
    sub_counts = torch.full((nk * sub,), -1, dtype=torch.int32, device=DEVICE)
    cute_backend.sub_block_counts(eager_launcher, p, t(counts), sub_counts)
    clamped = np.clip(counts, 0, E_fa4)
    sc = np.array([min(max(int(clamped[n // sub]) - (n % sub) * 128, 0), 128) for n in range(nk * sub)])
    np.testing.assert_array_equal(sub_counts.cpu().numpy(), sc)
    out_idx, out_num = out_idx.cpu().numpy(), out_num.cpu().numpy()
    for row in np.ndindex(B, H, nq):
        subs = [j * sub + s for j in np.flatnonzero(block_map[row]) for s in range(sub)]
        full = [n for n in subs if sc[n] == 128]
        part = [n for n in subs if 0 < sc[n] < 128]
        assert out_num[(0,) + row] == len(full) and out_num[(1,) + row] == len(part), row
        assert list(out_idx[(0,) + row][:len(full)]) == full and list(out_idx[(1,) + row][:len(part)]) == part


@pytest.mark.parametrize("packed", [False, True], ids=["lists", "packed"])
def test_clean_lists_apply_the_rule(packed):
    """The list cleaner (run on given lists before every backend; cuDNN reads lists as
    given) writes exactly the rule's lists on random garbage lists and counts: ascending,
    in range, counts within the capacity, 0 past the count. Packed: entries of another
    sequence are dropped first, then the rule."""
    from vsa_core.backends import triton_backend
    from vsa_core.launch import eager_launcher
    from vsa_core import stages
    from vsa_core.problem import AttnProblem

    rng = np.random.default_rng(7 + packed)
    B, H, nq, nk, cap = (1 if packed else 2), 3, 4, 6, 9
    p = AttnProblem(batch=B, heads=H, q_len=nq * E, kv_len=nk * E, head_dim=64, block_elems=E, dtype="bfloat16",
                    layout="bshd", selection="indices", n_seqs=2 if packed else 0, list_capacity=cap)
    pool = np.array([-2**31, -2**20, -1, nk, nk + 1, 2**20, 2**31 - 1] + list(range(nk)) * 4)
    idx = rng.choice(pool, (B, H, nq, cap)).astype(np.int32)
    idx[0, 0, 0] = np.arange(cap) % nk  # an ascending row, then a wrap-around
    num = rng.choice(np.array([-2**31, -1, 0, 2, 5, cap, cap + 1, 2**16]), (B, H, nq)).astype(np.int32)
    num[0, 0, 0] = cap
    q_seq, kv_seq = np.array([0, 0, 1, 1]), np.array([0, 0, 0, 1, 1, 1])

    def expected(row):
        entries = idx[row][:int(np.clip(num[row], 0, cap))]
        if packed:
            entries = [j for j in entries if 0 <= j < nk and kv_seq[j] == q_seq[row[-1]]]
        lists = np.array([list(entries) or [0]], np.int32)
        return np.flatnonzero(R.index_lists_to_block_map(lists, np.array([len(entries)]), nk)[0])

    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int32)).to(DEVICE)  # noqa: E731
    out_idx = torch.full((B, H, nq, cap), -7, dtype=torch.int32, device=DEVICE)
    out_num = torch.full((B, H, nq), -7, dtype=torch.int32, device=DEVICE)
    seqs = (t(q_seq), t(kv_seq)) if packed else (None, None)
    stages.clean_lists(eager_launcher, p, t(idx), t(num), out_idx, out_num, *seqs)
    out_idx, out_num = out_idx.cpu().numpy(), out_num.cpu().numpy()
    kept = 0
    for row in np.ndindex(B, H, nq):
        want = expected(row)
        kept += want.size
        assert out_num[row] == want.size, row
        assert out_idx[row][:want.size].tolist() == want.tolist(), row
        assert (out_idx[row][want.size:] == 0).all(), row
    assert kept > 10  # the garbage leaves something to keep
