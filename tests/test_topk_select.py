"""The top-k selection kernels (`stages.TOPK_ALGORITHMS`: "threshold", one counting pass per key
bit over 32-bit keys; "packed", 16-bit keys two to a word) against a numpy reference of their
semantics: per row the min(topk, finite scores) highest scores, ties to the lower index, -inf
(empty KV blocks) never taken; and the packed kernel against the threshold kernel bit for bit,
in every mode. CPU: Triton interpreter."""

import numpy as np
import pytest
import torch

from vsa_core import reference as R
from vsa_core import stages
from vsa_core.launch import eager_launcher
from vsa_core.problem import AttnProblem

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference_topk(scores: np.ndarray, topk: int):
    """(ascending index lists, counts, 0/1 mask) by sorting: score descending, index ascending."""
    rows, n = scores.shape
    cols = np.broadcast_to(np.arange(n), scores.shape)
    order = np.lexsort((cols, -scores.astype(np.float64)), axis=-1)
    k = np.minimum(topk, (scores > -np.inf).sum(-1))
    mask = np.zeros(scores.shape, np.int8)
    lists = []
    for r in range(rows):
        picked = np.sort(order[r, :k[r]])
        mask[r, picked] = 1
        lists.append(picked)
    return lists, k, mask


def run_kernel(scores: np.ndarray, topk: int, scores_rounded_to: str = "float32", algorithm: str = None):
    rows, n = scores.shape
    p = AttnProblem(batch=1, heads=1, q_len=64 * rows, kv_len=64 * n, head_dim=64, block_elems=64,
                    dtype="bfloat16", topk=min(topk, n))
    cap = p.select_capacity
    sel_idx = torch.full((1, 1, rows, cap), -7, dtype=torch.int32, device=DEV)
    sel_num = torch.full((1, 1, rows), -7, dtype=torch.int32, device=DEV)
    sel_mask = torch.full((1, 1, rows, n), 7, dtype=torch.int8, device=DEV)
    s = torch.from_numpy(np.ascontiguousarray(scores, np.float32)).reshape(1, 1, rows, n).to(DEV)
    stages.topk_select(eager_launcher, p, s, sel_idx, sel_num, sel_mask, scores_rounded_to=scores_rounded_to,
                       algorithm=algorithm)
    return sel_idx.cpu().numpy().reshape(rows, cap), sel_num.cpu().numpy().reshape(rows), \
        sel_mask.cpu().numpy().reshape(rows, n)


def check(scores: np.ndarray, topk: int, scores_rounded_to: str = "float32", algorithm: str = None):
    """The kernel's lists, counts and mask rows are the sorting reference's; list slots past a
    row's count are left as they were (-7)."""
    lists, k, mask = reference_topk(scores, topk)
    idx, num, got_mask = run_kernel(scores, topk, scores_rounded_to, algorithm)
    np.testing.assert_array_equal(num, k)
    np.testing.assert_array_equal(got_mask, mask)
    for r, want in enumerate(lists):
        np.testing.assert_array_equal(idx[r, :num[r]], want, err_msg=f"row {r}")
        assert (idx[r, num[r]:] == -7).all(), f"row {r}: a slot past the count was written"


def _rows(rng, rows, n, kind):
    if kind == "random":
        return rng.standard_normal((rows, n)).astype(np.float32)
    if kind == "ties":        # a handful of distinct values: most scores tie with others
        return rng.integers(-2, 3, (rows, n)).astype(np.float32) * 0.5
    if kind == "signed-zero":  # -0.0 and +0.0 compare equal: they tie, lower index first
        s = rng.choice(np.array([-0.0, 0.0, 1.0, -1.0], np.float32), (rows, n))
        return s
    if kind == "tiny":        # subnormals and values one ulp apart: the bit order must hold there too
        base = np.float32(1e-39)
        return (rng.integers(-3, 4, (rows, n)) * base).astype(np.float32)
    if kind == "extreme":     # large magnitudes of both signs, +inf, and -inf (empty blocks)
        s = rng.standard_normal((rows, n)).astype(np.float32) * 1e30
        s[rng.random((rows, n)) < 0.2] = -np.inf
        s[rng.random((rows, n)) < 0.05] = np.inf
        return s
    raise ValueError(kind)


ALGORITHMS = stages.TOPK_ALGORITHMS


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("kind", ["random", "ties", "signed-zero", "tiny", "extreme"])
@pytest.mark.parametrize("n, topk", [(7, 3), (16, 16), (37, 9), (37, 40)])
def test_topk_matches_sorting_reference(kind, n, topk, algorithm):
    rng = np.random.default_rng([n, topk, len(kind)])
    check(_rows(rng, 6, n, kind), topk, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["random", "ties", "signed-zero", "tiny", "extreme"])
def test_topk_of_rounded_scores_skips_their_zero_bits(kind, dtype, algorithm):
    """Scores that are values of a narrower dtype (what the coarse forward writes) ranked on
    their high bits only select what the sorting reference selects. Random scores rounded to
    the dtype tie far more often than fp32 ones, and one-ulp neighbours of the dtype must
    still order: both are in the draws."""
    rng = np.random.default_rng([len(kind), len(dtype)])
    s = torch.from_numpy(_rows(rng, 8, 37, kind)).to(getattr(torch, dtype))
    ulp_apart = (s[0].clone().view(torch.int16) + torch.arange(37, dtype=torch.int16) % 2).view(s.dtype)
    s[0] = torch.where(s[0].isfinite() & ulp_apart.isfinite(), ulp_apart, s[0])  # no inf made NaN
    rounded = s.float().numpy()
    assert (rounded.view(np.uint32) & np.uint32((1 << {"bfloat16": 16, "float16": 13}[dtype]) - 1) == 0).all()
    for topk in (1, 9, 37):
        check(rounded, topk, scores_rounded_to=dtype, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("kind", ["random", "ties", "extreme"])
@pytest.mark.parametrize("rounded_to", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [150, 624, 1030])
def test_wide_rows_across_the_main_and_tail_tiles(n, rounded_to, kind, algorithm):
    """Rows read as a power-of-two main tile and a tail tile (624: 512 + 128 columns, the tail
    part padding): picks on both sides of the seam, ties across it taken in index order."""
    rng = np.random.default_rng([n, len(rounded_to), len(kind)])
    s = _rows(rng, 3, n, kind)
    if rounded_to == "bfloat16":
        s = torch.from_numpy(s).to(torch.bfloat16).float().numpy()
    if kind == "ties":  # a value tied on both sides of the seam, some of it taken, some not
        s[0, :] = -1.0
        s[0, [3, 200 % n, n - 1]] = 2.0
        s[0, [5, (n // 2) | 1, n - 2]] = 0.5
    for topk in (1, 5, 62):
        check(s, topk, scores_rounded_to=rounded_to, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_blocks_are_never_taken_and_k_is_clamped(algorithm):
    rng = np.random.default_rng(3)
    s = rng.standard_normal((5, 12)).astype(np.float32)
    s[:, ::3] = -np.inf                 # 4 empty KV blocks per row: 8 finite scores
    s[1] = -np.inf                      # a row with nothing to take
    s[2, :] = 0.25                      # a row of one value: the lowest indices of its 8 finite scores
    s[2, ::3] = -np.inf
    s[3, 5] = np.float32(-3.4e38)       # the most negative finite score is still taken before -inf
    check(s, 10, algorithm=algorithm)
    check(s, 8, algorithm=algorithm)
    check(s, 3, algorithm=algorithm)


# ---- the packed kernel: every width and mode --------------------------------------------------
def _as_values_of(s: np.ndarray, dtype: str) -> np.ndarray:
    """s rounded to `dtype` and back to fp32 (as the coarse forward writes the scores it ranks)."""
    if dtype == "float32":
        return s.astype(np.float32)
    return torch.from_numpy(s.astype(np.float32)).to(getattr(torch, dtype)).float().numpy()


def _three_rows(rng, n: int, dtype: str) -> np.ndarray:
    """Values of `dtype`: random scores with a fifth of them -inf; five values (ties all over,
    across the main / tail seam) with -inf and +inf among them; n consecutive values of the
    dtype (one ulp apart) in random order, which a key that drops a bit of the dtype ties."""
    a = rng.standard_normal(n).astype(np.float32) * 4
    a[rng.random(n) < 0.2] = -np.inf
    b = rng.integers(-2, 3, n).astype(np.float32) * 0.75
    b[rng.random(n) < 0.1] = -np.inf
    b[rng.random(n) < 0.02] = np.inf
    steps = rng.permutation(n)
    if dtype == "float16":
        c = (steps + 0x3C00).astype(np.uint16).view(np.float16).astype(np.float32)
    else:  # from 1.0 up, one ulp of bf16 (the 16th bit) or of fp32 apart
        c = (0x3F800000 + (steps << (16 if dtype == "bfloat16" else 0))).astype(np.uint32).view(np.float32)
    return np.stack([_as_values_of(a, dtype), _as_values_of(b, dtype), c])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_packed_selects_the_reference_set_at_every_width(dtype):
    """Widths from 1 (one column, the rest of both tiles padding) to 2000 (several quads per thread,
    a tail tile a quarter of the main one), k from 1 to past the finite count; scores of each
    ranking dtype (fp32: a search of the keys' high 16 bits, then of the low 16 in its bucket),
    neighbouring values of the dtype among them (`_three_rows`)."""
    rng = np.random.default_rng([len(dtype), 3])
    for n in (1, 2, 3, 5, 16, 17, 33, 64, 65, 100, 256, 624, 1025, 2000):
        s = _three_rows(rng, n, dtype)
        for topk in sorted({1, min(62, n), n}):
            check(s, topk, scores_rounded_to=dtype, algorithm="packed")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["random", "ties", "extreme"])
def test_packed_equals_threshold_bit_for_bit(kind, dtype):
    """Both kernels leave the same buffers, list slots past the counts (not written) included: 624
    columns (480p-64's row: a main tile of 512, a tail of 112 and 16 padding) and 37."""
    rng = np.random.default_rng([len(kind), len(dtype)])
    for n, topk in ((624, 62), (37, 9)):
        s = _as_values_of(_rows(rng, 3, n, kind), dtype)
        got, want = (run_kernel(s, topk, dtype, algorithm) for algorithm in ("packed", "threshold"))
        for name, g, w in zip(("sel_idx", "sel_num", "sel_mask"), got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"{name}, {n} columns")


def test_packed_takes_ties_in_index_order_past_2_16_columns():
    """From 2^16 columns on the count word is int64 (a row's tie count no longer fits 16 bits):
    70000 scores, 40 higher, 70 empty and the rest (more than 2^16) tied, take their ties from
    the lowest index."""
    rng = np.random.default_rng(16)
    s = np.ones((1, 70000), np.float32)
    s[0, rng.choice(70000, 40, replace=False)] = 2.0
    s[0, ::1000] = -np.inf
    check(s, 50, scores_rounded_to="bfloat16", algorithm="packed")


def _select_prefix(scores, topk, P, mode, dtype, algorithm, seqs=None):
    """(lists, counts, mask rows) of a prefix selection: `seqs` (packed sequences): their lengths
    in blocks, P an int or one per sequence."""
    n_q, n_kv = scores.shape
    per_sequence = isinstance(P, (list, tuple))
    p = AttnProblem(batch=1, heads=1, q_len=64 * n_q, kv_len=64 * n_kv, head_dim=64, block_elems=64,
                    dtype="bfloat16", topk=min(topk, n_kv), prefix_blocks=0 if per_sequence else P,
                    prefix_mode=mode, n_seqs=len(seqs) if seqs else 0, seq_prefix=per_sequence)
    extra = {}
    if seqs:
        cu = torch.tensor(np.concatenate([[0], np.cumsum(seqs)]) * 64, dtype=torch.int32, device=DEV)
        extra = dict(q_seq=torch.tensor(np.repeat(np.arange(len(seqs)), seqs), dtype=torch.int32, device=DEV),
                     cu_seqlens_q=cu, cu_seqlens_k=cu)
        if per_sequence:
            extra["seq_prefix"] = torch.tensor(P, dtype=torch.int32, device=DEV)
    cap = p.select_capacity
    sel_idx = torch.full((1, 1, n_q, cap), -7, dtype=torch.int32, device=DEV)
    sel_num = torch.full((1, 1, n_q), -7, dtype=torch.int32, device=DEV)
    sel_mask = torch.full((1, 1, n_q, n_kv), 7, dtype=torch.int8, device=DEV)
    s = torch.from_numpy(np.ascontiguousarray(scores, np.float32)).reshape(1, 1, n_q, n_kv).to(DEV)
    stages.topk_select(eager_launcher, p, s, sel_idx, sel_num, sel_mask, scores_rounded_to=dtype,
                       algorithm=algorithm, **extra)
    return sel_idx.cpu().numpy()[0, 0], sel_num.cpu().numpy()[0, 0], sel_mask.cpu().numpy()[0, 0]


def _check_mask(got, want: np.ndarray, what: str):
    idx, num, mask = got
    np.testing.assert_array_equal(mask, want.astype(np.int8), err_msg=what)
    np.testing.assert_array_equal(num, want.sum(-1), err_msg=what)
    for r in range(want.shape[0]):
        np.testing.assert_array_equal(idx[r, :num[r]], np.flatnonzero(want[r]), err_msg=f"{what}, row {r}")
        assert (idx[r, num[r]:] == -7).all(), f"{what}, row {r}: a slot past the count was written"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["exempt", "compete"])
def test_packed_prefix_selection_matches_the_reference(mode, dtype):
    """Dense prefix rows, prefix columns forced in ("exempt") or ranked with P more taken
    ("compete"), ties and -inf among them; P of every column, and k past the finite count."""
    rng = np.random.default_rng([len(mode), len(dtype)])
    for P, topk in ((3, 4), (21, 2), (1, 30)):
        s = rng.integers(-2, 3, (8, 21)).astype(np.float32) * 0.5 + (rng.random((8, 21)) < 0.3)
        s[:, rng.random(21) < 0.2] = -np.inf
        s = _as_values_of(s, dtype)
        want = R.prefix_topk_mask(s, min(topk, 21), min(P, 8), mode)
        _check_mask(_select_prefix(s, topk, min(P, 8), mode, dtype, "packed"), want, f"P={P} topk={topk}")


@pytest.mark.parametrize("per_sequence", [True, False], ids=["P-per-sequence", "P-int"])
@pytest.mark.parametrize("mode", ["exempt", "compete"])
def test_packed_prefix_of_packed_sequences(mode, per_sequence):
    """Packed sequences of 5 and 3 blocks, the other sequence's blocks -inf (as the coarse forward
    writes them): each query block's prefix is its own sequence's first P blocks. The reference
    per sequence, and the threshold kernel's buffers bit for bit."""
    rng = np.random.default_rng([len(mode), per_sequence])
    seqs, P = (5, 3), ([2, 1] if per_sequence else 2)
    s = np.full((8, 8), -np.inf, np.float32)
    want = np.zeros((8, 8), bool)
    for i, (a, b) in enumerate(((0, 5), (5, 8))):
        s[a:b, a:b] = _as_values_of(rng.integers(-2, 3, (b - a, b - a)) * 0.5, "bfloat16")
        want[a:b, a:b] = R.prefix_topk_mask(s[a:b, a:b], 2, P[i] if per_sequence else P, mode)
    got = _select_prefix(s, 2, P, mode, "bfloat16", "packed", seqs=seqs)
    _check_mask(got, want, "packed")
    for g, w in zip(got, _select_prefix(s, 2, P, mode, "bfloat16", "threshold", seqs=seqs)):
        np.testing.assert_array_equal(g, w)


def test_bad_algorithm_and_dtype_are_refused():
    p = AttnProblem(batch=1, heads=1, q_len=64, kv_len=64, head_dim=64, block_elems=64, dtype="bfloat16", topk=1)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        stages.topk_select(eager_launcher, p, None, None, None, None, algorithm="radix")
    with pytest.raises(ValueError, match="scores_rounded_to must be one of"):
        stages.topk_select(eager_launcher, p, None, None, None, None, scores_rounded_to="int8")


_PACKED_COMPILE_SCRIPT = """
import os, sys
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from coarse_fwd_bench import compile_stage, compile_figures
from vsa_core import stages as S
from vsa_core.problem import AttnProblem
cases = [  # (problem arguments, ranking dtypes, spills allowed)
    (dict(q_len=39936, kv_len=39936, block_elems=64, topk=62), ("bfloat16", "float16", "float32"), False),  # 480p-64
    (dict(q_len=39936, kv_len=39936, block_elems=256, topk=20), ("bfloat16",), False),  # 480p-256
    (dict(q_len=64 * 5, kv_len=64 * 8192, block_elems=64, topk=8), ("bfloat16",), False),  # 8 warps a row
    # int64 count words: 256 keys a thread, which both kernels spill (the row is held in registers)
    (dict(q_len=64 * 5, kv_len=64 * 70000, block_elems=64, topk=8), ("bfloat16",), True),
    (dict(q_len=64 * 7, kv_len=64 * 7, block_elems=64, topk=2, prefix_blocks=2, prefix_mode="compete"),
     ("bfloat16", "float32"), False),
    (dict(q_len=64 * 8, kv_len=64 * 8, block_elems=64, topk=2, n_seqs=2, seq_prefix=True), ("float16",), False),
]
for kw, dtypes, may_spill in cases:
    p = AttnProblem(batch=1, heads=12, head_dim=128, dtype="bfloat16", **kw)
    for dtype in dtypes:
        name, compiled = compile_stage(S.topk_select, p, algorithm="packed", scores_rounded_to=dtype)
        assert name == "topk_select_packed_kernel" and compiled.asm["cubin"][:4] == b"\\x7fELF"
        regs, spills, shared = compile_figures(compiled)
        assert may_spill or spills == 0, (kw, dtype, regs, spills)
        print(p.n_kv_blocks, dtype, "registers", regs, "spilled", spills, "shared", shared)
print("OK")
"""


def test_packed_kernel_compiles_for_sm90_without_spills():
    """480p-64 (every ranking dtype), 480p-256, rows of 8192 columns (8 warps), a prefix and packed
    sequences with per-sequence prefixes: each compiles to an sm_90 cubin with no spilled
    register; a row of 70000 (int64 count words) compiles. CPU, in a subprocess without the
    interpreter."""
    from common import compile_in_subprocess
    proc = compile_in_subprocess(_PACKED_COMPILE_SCRIPT, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]


# ---- the whole selection path: ranked on the scores rounded to the input dtype ----------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_selection_ranks_scores_rounded_to_the_input_dtype(dtype):
    """Pooling, coarse scores and top-k (the launches every frontend and backend runs) select
    what the float64 reference ranks: FastVideo's scores, rounded to the input dtype after the
    dot and again after the scale (`reference.ranked_scores`), ties to the lower KV-block index.
    Ties on purpose: KV block j holds one random vector in all its tokens (its mean exactly):
    block 0's with the magnitude of its first j components one ulp larger, their signs those
    of the query means', so the fp32 scores rise with j by far less than a rounding; most of
    them round to one value, where the fp32 ranking would take the higher indices instead."""
    from common import Case, _reference_scores, kernel_selection, selection_is_clear

    case = Case(n_q_blocks=4, n_kv_blocks=8, batch=1, heads=2, topk=3, dtype=dtype, partial_q=False,
                partial_kv=False)
    E, D = case.E, case.head_dim
    adversarial = 0
    for attempt in range(20):
        rng = np.random.default_rng([17, len(dtype), attempt])
        q = rng.standard_normal((1, case.heads, case.n_q_blocks * E, D)).astype(np.float32)
        q += np.repeat(rng.standard_normal((1, case.heads, 1, D)), q.shape[2], axis=2)  # means with one sign
        q = R.round_to_dtype(q, dtype)
        sign = np.sign(q.reshape(1, case.heads, -1, E, D).sum((2, 3)))[:, :, None, :]  # [1, H, 1, D]
        base = R.round_to_dtype(rng.uniform(0.5, 2.0, (1, case.heads, 1, D)) * sign, dtype)
        blocks = [np.repeat(_ulps_up(base, j, dtype), E, axis=2) for j in range(case.n_kv_blocks)]
        k = np.concatenate(blocks, axis=2)
        x = {"q": q, "k": k, "v": rng.standard_normal(k.shape), "q_counts": np.full(case.n_q_blocks, E),
             "kv_counts": np.full(case.n_kv_blocks, E)}
        assert (q != 0).all() and (k != 0).all()
        if not selection_is_clear(x, case):
            continue
        ranked = _reference_scores(x, case)
        want = R.topk_mask(ranked, case.topk)
        dots = R.coarse_dots(q, k, x["kv_counts"], x["q_counts"], E, dtype)
        by_fp32 = R.topk_mask(dots.astype(np.float32) * np.float32(1 / np.sqrt(D)), case.topk)
        adversarial += int((want != by_fp32).any(-1).sum())
        np.testing.assert_array_equal(kernel_selection(case, x, DEV), want)
    assert adversarial > 0, "no draw had a row where the rounded ranking differs from the fp32 one"


def _ulps_up(base: np.ndarray, j: int, dtype: str) -> np.ndarray:
    """base (values of dtype) with the magnitude of its first j components one ulp larger."""
    if dtype == "float16":
        m = base.astype(np.float16)
        m[..., :j] = np.nextafter(m[..., :j], np.copysign(np.float16(np.inf), m[..., :j]))
        return m.astype(np.float64)
    bits = base.astype(np.float32).view(np.uint32).copy()
    bits[..., :j] += np.uint32(1 << 16)  # the next bf16 magnitude (sign bit untouched)
    return bits.view(np.float32).astype(np.float64)


# ---- the backward's KV-owned lists from the selection mask (columns_to_lists) ------------------
def _columns_mask(rng, B, H, nq, nk, density):
    mask = (rng.random((B, H, nq, nk)) < density).astype(np.int8)
    mask[0, 0, :, 0] = 0  # a column no query block takes
    mask[0, 0, :, nk - 1] = 1  # a column every query block takes
    mask[-1, -1, :, nk // 2] = 0
    mask[-1, -1, :, 1] = 1
    return mask


def _column_lists(mask, kernel):
    """(IDX, NUM) the backward's list stage writes for the mask, by `kernel` ("tiles": the
    stage's columns_to_lists; "lines": compact_mask_kernel a column at a time, as before),
    on buffers filled with -7 so that whatever a kernel leaves unwritten shows."""
    B, H, nq, nk = mask.shape
    p = AttnProblem(batch=B, heads=H, q_len=64 * nq, kv_len=64 * nk, head_dim=64, block_elems=64,
                    dtype="bfloat16", topk=1)
    m = torch.from_numpy(mask).to(DEV)
    idx = torch.full((B, H, nk, nq), -7, dtype=torch.int32, device=DEV)
    num = torch.full((B, H, nk), -7, dtype=torch.int32, device=DEV)
    if kernel == "tiles":
        stages.columns_to_lists(eager_launcher, p, m, idx, num)
    else:
        eager_launcher.triton(stages.kernels_for(m).compact_mask_kernel, (nk, B * H), m, idx, num, None, None, nk,
                              nq, nq * nk, 1, nk, nq, N_PAD=stages._pow2(nq), num_warps=4)
    return idx.cpu().numpy(), num.cpu().numpy()


@pytest.mark.parametrize("dtype", ["int8", "bool"])  # the selection mask; a caller's block map
@pytest.mark.parametrize("density", [0.1, 0.9])
@pytest.mark.parametrize("B, H, nq, nk", [(1, 2, 37, 45), (2, 1, 130, 19), (1, 2, 5, 70)],
                         ids=["37x45", "130x19", "5x70"])
def test_columns_to_lists_match_flatnonzero(B, H, nq, nk, density, dtype):
    """Each KV block's list is the ascending query blocks of its mask column, its count their
    number, slots past the count unwritten: across column tiles (nKV not a multiple of the
    tile, a last partial tile), across row chunks (nQ 130 > 128) and with columns no or every
    query block takes; bit for bit what compact_mask_kernel wrote a column at a time."""
    mask = _columns_mask(np.random.default_rng([nq, nk, int(10 * density)]), B, H, nq, nk, density)
    mask = mask.astype(dtype)
    idx, num = _column_lists(mask, "tiles")
    for b, h, j in np.ndindex(B, H, nk):
        want = np.flatnonzero(mask[b, h, :, j])
        assert num[b, h, j] == len(want), (b, h, j)
        np.testing.assert_array_equal(idx[b, h, j, :len(want)], want, err_msg=f"column {(b, h, j)}")
        assert (idx[b, h, j, len(want):] == -7).all(), f"column {(b, h, j)}: slots past the count written"
    assert num[0, 0, 0] == 0 and num[0, 0, nk - 1] == nq
    old_idx, old_num = _column_lists(mask, "lines")
    np.testing.assert_array_equal(num, old_num)
    np.testing.assert_array_equal(idx, old_idx)


_COLUMNS_COMPILE_SCRIPT = """
import os, sys
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from coarse_smem import ptxas_usage
from vsa_core import plan as P
from vsa_core.problem import AttnProblem
for nq, nk in ((4, 5), (624, 624), (4000, 700)):
    p = AttnProblem(batch=1, heads=12, q_len=64 * nq, kv_len=64 * nk, head_dim=64, block_elems=64, dtype="bfloat16",
                    topk=min(32, nk))
    plan = P.record_plan("backward", p, P.backward_inputs(p))
    launch = next(l for l in plan.launches if l.kernel_name == "columns_to_lists_kernel")
    c = P.compile_launch(launch, plan, 90)
    assert c.cubin[:4] == b"\\x7fELF"
    regs, spills = ptxas_usage(c.ptx, 90)
    assert spills == 0, (nq, nk, regs, spills)
    print(nq, nk, launch.grid, "registers", regs, "spilled", spills)
print("OK")
"""


def test_columns_to_lists_kernel_compiles_for_sm90():
    """The tile kernel compiles to an sm_90 cubin without spills for a few blocks, nKV a
    multiple of 16 (16-byte row loads) and nQ in the thousands (many row steps). CPU, in a
    subprocess without the interpreter."""
    from common import compile_in_subprocess
    proc = compile_in_subprocess(_COLUMNS_COMPILE_SCRIPT, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_row_tiles_cover_the_row_and_refuse_what_the_packed_counts_cannot_hold():
    """A main power-of-two tile and a tail tile that together hold every column, never wider
    than one padded tile; 2^17 KV blocks and more are refused with the argument named (a
    packed count lane holds fewer than 2^16 words)."""
    for n in (1, 7, 16, 17, 37, 600, 624, 1000, 1024, 1025, 5000, (1 << 17) - 1):
        half, tail = stages.topk_tiles(n)
        assert 2 * (half + tail) >= n and half & (half - 1) == 0 and tail & (tail - 1) == 0
        assert 2 * (half + tail) <= 2 * max(16, 1 << (n - 1).bit_length()), n
    assert stages.topk_tiles(624) == (256, 64)
    with pytest.raises(ValueError, match="kv_len / block_size"):
        stages.topk_tiles(1 << 17)
