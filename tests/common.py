"""Shared test cases, inputs and the comparison with the float64 reference.

Both frontends' parity tests draw their inputs here (numpy, float32 before the cast),
run them through their own API and hand back numpy results, so the PyTorch and JAX
tests check the same cases with the same tolerances.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

try:  # torch is optional: the JAX tests also run where only vsa[jax] is installed (CI's second venv)
    import torch
except ImportError:
    torch = None

from vsa_core import reference as R
from vsa_core.backends import NAMES as BACKEND_NAMES, library_error
from vsa_core.problem import resolve_softmax_scale

# ---- strict mode --------------------------------------------------------------------------
# VSA_REQUIRE_BACKENDS=cute,cudnn,sm90,jax (benchmarks/gpu_session.sh sets it): on a machine with a
# GPU, a test that would skip because one of these is missing fails instead, so a GPU run
# without FA4, cuDNN frontend or JAX's CUDA plugin cannot pass as green. A backend that is
# installed but does not take a case (a block size, head dim or dtype it has no kernel for)
# still skips, with its reason. Without a GPU the GPU tests skip as usual.
# the backends that call a library (every registered one but triton), and JAX's GPU plugin
STRICT_NAMES = tuple(n for n in BACKEND_NAMES if n != "triton") + ("jax",)
REQUIRED_BACKENDS = frozenset(n.strip() for n in os.environ.get("VSA_REQUIRE_BACKENDS", "").split(",") if n.strip())
if REQUIRED_BACKENDS - set(STRICT_NAMES):
    raise ValueError(f"VSA_REQUIRE_BACKENDS must name some of {STRICT_NAMES}, got {sorted(REQUIRED_BACKENDS)}")


def strict(name: str) -> bool:
    """True when `name` (cute, cudnn, jax) must be present: strict mode and a GPU."""
    return name in REQUIRED_BACKENDS and _has_gpu()


def _has_gpu() -> bool:
    return torch.cuda.is_available() if torch is not None else os.path.exists("/dev/nvidia0")


def missing(name: str) -> Optional[str]:
    """Why `name`'s library cannot be used on this machine's GPU (None when it can)."""
    if name in BACKEND_NAMES:
        return library_error(name)
    if name == "jax":
        import jax
        return None if jax.default_backend() == "gpu" else f"jax has no GPU backend ({jax.default_backend()})"
    return None


def skip_unavailable(name: str, reason: Optional[str]) -> None:
    """Skips the test with `reason` (None: returns) because `name` cannot run it here; in strict
    mode fails instead when `name` itself is missing (not installed, no GPU plugin)."""
    if reason is None:
        return
    if strict(name) and missing(name) is not None:
        pytest.fail(f"strict mode (VSA_REQUIRE_BACKENDS={','.join(sorted(REQUIRED_BACKENDS))}): {name} is "
                    f"missing: {missing(name)}; the test would have skipped with: {reason}", pytrace=False)
    pytest.skip(reason)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_in_subprocess(script: str, timeout: int = 1200, unset=(), **env_vars):
    """`script` run by this Python in a process of its own without Triton's interpreter (the
    compiler cannot run under TRITON_INTERPRET), with the repository importable and `REPO` set;
    `unset`: more variables it runs without, `env_vars`: variables it runs with. Returns the
    finished process (its stdout and stderr as text)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *unset)}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.update(env_vars)
    return subprocess.run([sys.executable, "-c", f"REPO = {REPO!r}\n" + script], env=env, capture_output=True,
                          text=True, timeout=timeout)


def skip_if_interpreter_broken() -> None:
    """Skips a test that runs CPU arrays under Triton's interpreter where it cannot run here
    (triton 3.6 with numpy >= 2.4: the GPU machine's versions), with the backend's reason."""
    from vsa_core.backends.triton_backend import _interpreter_broken
    reason = _interpreter_broken()
    if reason is not None:
        pytest.skip(reason)


def require_jax_gpu() -> None:
    """Skips unless JAX runs on the GPU (fails in strict mode with `jax` required)."""
    skip_unavailable("jax", missing("jax"))


# ||x - ref|| / ||ref|| and max|x - ref| / max|ref| bounds, per dtype.
# bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3): the inputs are exact in the
# reference, the kernels round the block means, P before P@V and dS before dS@K, and
# the outputs, each adding ~2e-3 relative, so a correct kernel lands near 5e-3 (seen:
# 4e-3 .. 8e-3). The bound 2e-2 fails any real bug (a wrong block, mask or scale
# gives errors of order 1e-1 .. 1). fp16 has 3 more bits: 8x tighter.
TOLERANCE = {
    "bfloat16": dict(rel=2e-2, max_rel=6e-2),
    "float16": dict(rel=3e-3, max_rel=1e-2),
}


@dataclass(frozen=True)
class Case:
    block: object = 64            # int E or (t, h, w) tile
    head_dim: int = 64
    n_q_blocks: int = 3
    n_kv_blocks: int = 4
    batch: int = 2
    heads: int = 2
    topk: int = 2
    gate: bool = True
    layout: str = "bhsd"
    dtype: str = "bfloat16"
    scale: float = 1.0            # multiplies q and k: 16 makes the logits large
    partial_q: bool = True        # some query blocks hold fewer than E valid tokens
    partial_kv: bool = True       # some KV blocks are partial, one is empty
    softmax_scale: Optional[float] = None  # the call's softmax_scale (None: the default 1/sqrt(D))

    @property
    def E(self) -> int:
        return int(np.prod(self.block)) if not isinstance(self.block, int) else self.block

    def id(self) -> str:
        return "-".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != f.default) or "default"


CASES = [
    Case(),
    Case(block=(4, 4, 4), gate=False),
    Case(block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3, batch=1),
    Case(block=(4, 8, 8), n_q_blocks=2, n_kv_blocks=2, batch=1, heads=1, topk=1),
    Case(topk=1),
    Case(topk=4),                                         # topk = all KV blocks
    Case(topk=9, n_q_blocks=2),                           # topk above nKV is clamped
    Case(n_q_blocks=5, n_kv_blocks=2, topk=1),            # Sq > Skv
    Case(head_dim=128, layout="bshd"),
    Case(layout="bshd", gate=False, partial_q=False),
    Case(scale=16.0),
    Case(dtype="float16"),
    Case(dtype="float16", head_dim=128, block=128, n_q_blocks=2, n_kv_blocks=2, batch=1, scale=4.0),
    Case(partial_q=False, partial_kv=False, batch=1),
]


def counts_for(n_blocks: int, E: int, partial: bool, rng, allow_empty: bool) -> np.ndarray:
    counts = np.full(n_blocks, E, np.int64)  # int64, as FastVideo passes them
    if partial:
        counts[-1] = rng.integers(1, E)      # a partial last tile, as at a video edge
        if n_blocks > 2:
            counts[1] = rng.integers(1, E)
        if allow_empty and n_blocks > 3:
            counts[2] = 0                    # an empty KV block: never selected, out of the softmax
    return counts


def _zero_padding(x: np.ndarray, counts: np.ndarray, E: int) -> None:
    """x is BHSD; callers zero the padded tail of every block."""
    for i, n in enumerate(counts):
        x[:, :, i * E + n:(i + 1) * E] = 0


def _reference_scores(inputs: dict, case: Case, padding: str = "zeros") -> np.ndarray:
    """The coarse scores [B, H, nQ, nKV] the reference ranks (block means and scores rounded to
    the case's dtype, `R.ranked_scores`; -inf for empty KV blocks)."""
    q, k = (R.round_to_dtype(inputs[n], case.dtype) for n in ("q", "k"))
    return R.coarse_scores(q, k, inputs["kv_counts"], inputs["q_counts"], case.E, case.dtype,
                           padding, softmax_scale=case.softmax_scale)


U32 = 2.0 ** -24  # fp32 unit roundoff


def _ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """An upper bound on the spacing of `dtype` values next to x (two ulps of its binade)."""
    bits = {"bfloat16": 8, "float16": 11}[dtype]
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -24)))
    return 2.0 ** (e + 2 - bits)


def _mean_error(x: np.ndarray, counts: np.ndarray, E: int, dtype: str) -> np.ndarray:
    """|kernel's block mean - reference's| bound per component [B, H, n, D]: 0 unless the mean
    lies within the fp32 error of its sum and division ((E + 2) u times the mean of |x|) of a
    rounding boundary of `dtype`, where the two may round to neighbouring values (one ulp)."""
    B, H, S, D = x.shape
    c = np.maximum(np.clip(counts, 0, E), 1).astype(np.float64)[:, None]
    exact = x.reshape(B, H, S // E, E, D).sum(3) / c
    err = (E + 2) * U32 * np.abs(x).reshape(B, H, S // E, E, D).sum(3) / c
    ambiguous = R.round_to_dtype(exact - err, dtype) != R.round_to_dtype(exact + err, dtype)
    return np.where(ambiguous, _ulp(exact, dtype), 0.0)


def ranked_bounds(inputs: dict, case: Case, padding: str = "zeros", margin: float = 1.0):
    """(lo, hi) [B, H, nQ, nKV]: bounds of the ranked coarse scores a kernel can compute for
    these inputs (-inf for empty KV blocks), `margin` times the rounding it may differ by
    from the float64 reference: a block mean may round to the neighbouring value where it
    is within its fp32 sum's error of a rounding boundary (`_mean_error`), and each dot
    accumulates in fp32 (2 D u times the sum of its products' magnitudes; the tensor cores'
    accumulation included). Ranking (`R.ranked_scores`) is monotone in the dot, so the
    bounds are the ranked scores of the dot's bounds."""
    E, dt = case.E, case.dtype
    q, k = (R.round_to_dtype(inputs[n], dt) for n in ("q", "k"))
    kv_counts, q_counts = inputs["kv_counts"], inputs["q_counts"]
    if padding == "ignore":  # what "ignore" reads
        q = np.where(R.valid_tokens(q_counts, E)[:, None], q, 0.0)
        k = np.where(R.valid_tokens(kv_counts, E)[:, None], k, 0.0)
    dots = R.coarse_dots(q, k, kv_counts, q_counts, E, dt)
    qm, km = (np.abs(R._block_mean(x, c, E, dt)) for x, c in ((q, q_counts), (k, kv_counts)))
    dq, dk = _mean_error(q, q_counts, E, dt), _mean_error(k, kv_counts, E, dt)
    t = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    slack = dq @ t(km + dk) + qm @ t(dk) + 2 * case.head_dim * U32 * (qm @ t(km))
    scale = resolve_softmax_scale(case.softmax_scale, case.head_dim)
    empty = (np.asarray(kv_counts) <= 0)[None, None, None, :]
    return tuple(np.where(empty, -np.inf, R.ranked_scores(dots + sign * margin * slack, scale, dt))
                 for sign in (-1, 1))


def _reference_selection(scores: np.ndarray, topk: int, n_kv: int, prefix_blocks: int, prefix_mode: str):
    """(selection, ranked): the reference's selection of these scores, and which (row, column)
    cells it ranks (prefix rows are dense; "exempt" forces the prefix columns)."""
    k = min(topk, n_kv)
    if not prefix_blocks:
        return R.topk_mask(scores, k), np.ones(scores.shape[-2:], bool)
    P, n_q = prefix_blocks, scores.shape[-2]
    ranked = np.broadcast_to((np.arange(n_q) >= P)[:, None], (n_q, n_kv)).copy()
    if prefix_mode == "exempt":
        ranked[:, :P] = False
    return R.prefix_topk_mask(scores, k, P, prefix_mode), ranked


def _certainly_above(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Bool [..., nKV, nKV]: cell (a, b) when block a ranks above block b in its row for every
    score within the bounds (a's lowest above b's highest, or equal to it at a lower index:
    ties go to the lower index)."""
    idx = np.arange(lo.shape[-1])
    lo_a, hi_b = lo[..., :, None], hi[..., None, :]
    return (lo_a > hi_b) | ((lo_a == hi_b) & (idx[:, None] < idx[None, :]))


def _pairs(selected: np.ndarray, ranked: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """Bool [..., nKV, nKV]: cell (j, i) for a selected block j and an unselected non-empty
    block i that the row ranks against each other."""
    return (selected & ranked)[..., :, None] & (~selected & ranked & finite)[..., None, :]


def selection_is_clear(inputs: dict, case: Case, padding: str = "zeros", margin: float = 1.0,
                       prefix_blocks: int = 0, prefix_mode: str = "exempt") -> bool:
    """Whether every kernel selects what the reference does on these inputs: each selected
    block ranks above each unselected one for every score within `ranked_bounds`."""
    lo, hi = ranked_bounds(inputs, case, padding, margin)
    selected, ranked = _reference_selection(_reference_scores(inputs, case, padding), case.topk, case.n_kv_blocks,
                                            prefix_blocks, prefix_mode)
    return not (_pairs(selected, ranked, np.isfinite(lo)) & ~_certainly_above(lo, hi)).any()


DRAWS = 50


def make_inputs(case: Case, seed: int, margin: Optional[float] = 1.0) -> dict:
    """Fresh random inputs (float32 numpy, BHSD). Redraws (up to DRAWS times) until the top-k
    choice is the same for every score within `margin` times the rounding a kernel's ranked
    scores may differ by from the reference's (`ranked_bounds`, `selection_is_clear`): there a
    correct kernel could pick another block than the reference. Cases with many rows may
    never get there; then the last draw comes back marked `near_ties` with the margin, and
    `reference` takes the kernel's own selection once it has checked that it is a top-k of
    the reference's scores within those bounds (`checked_kernel_selection`).
    `margin=None` takes the first draw: for tests that compare two runs of our own kernels
    (bit for bit) and not the reference."""
    for attempt in range(DRAWS if margin is not None else 1):
        rng = np.random.default_rng([seed, attempt])
        E, D, B, H = case.E, case.head_dim, case.batch, case.heads
        sq, skv = case.n_q_blocks * E, case.n_kv_blocks * E
        q_counts = counts_for(case.n_q_blocks, E, case.partial_q, rng, allow_empty=False)
        kv_counts = counts_for(case.n_kv_blocks, E, case.partial_kv, rng, allow_empty=True)
        x = {
            "q": rng.standard_normal((B, H, sq, D), np.float32) * case.scale,
            "k": rng.standard_normal((B, H, skv, D), np.float32) * case.scale,
            "v": rng.standard_normal((B, H, skv, D), np.float32),
            "gate": rng.standard_normal((B, H, sq, D), np.float32),
            "dout": rng.standard_normal((B, H, sq, D), np.float32),
            "q_counts": q_counts, "kv_counts": kv_counts,
        }
        _zero_padding(x["q"], q_counts, E)
        _zero_padding(x["k"], kv_counts, E)
        _zero_padding(x["v"], kv_counts, E)
        if margin is None or selection_is_clear(x, case, margin=margin):
            return x
    x["near_ties"] = margin
    return x


def kernel_selection(case: Case, inputs: dict, device: str, padding: str = "zeros") -> np.ndarray:
    """The blocks the kernels select for these inputs (bool [B, H, nQ, nKV]): the pooling,
    coarse forward and top-k launches of `vsa_core.ops.forward`, on `device`. Selection always
    runs on these Triton kernels, whatever the fine stage's backend and the frontend."""
    from vsa_core.api import prepare_vsa
    from vsa_core import stages as S
    from vsa_core.launch import eager_launcher
    if torch is None:
        raise RuntimeError("a near-tie draw needs the kernel's selection, read here through torch (not installed)")
    dtype = getattr(torch, case.dtype)
    q, k, v = (torch.from_numpy(to_layout(inputs[n], case.layout)).to(device, dtype) for n in ("q", "k", "v"))
    kv_counts, q_counts = (torch.from_numpy(inputs[n]).to(device, torch.int32) for n in ("kv_counts", "q_counts"))
    p = prepare_vsa(q, k, v, kv_counts, q_counts, case.topk, case.block, layout=case.layout,
                    softmax_scale=case.softmax_scale, padding=padding).problem
    b = {name: torch.empty(shape, device=device, dtype=dtype if kind == "input" else getattr(torch, kind))
         for name, (shape, kind) in p.forward_buffers().items()}
    S.block_mean_pool_qkv(eager_launcher, p, q, k, v, q_counts, kv_counts, b["q_pool"], b["k_pool"], b["v_pool"])
    S.coarse_forward(eager_launcher, p, b["q_pool"], b["k_pool"], b["v_pool"], kv_counts, b["scores"], b["out_coarse"],
                     b["lse_coarse"])
    S.topk_select(eager_launcher, p, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"])
    return b["sel_mask"].bool().cpu().numpy()


def check_top_k(bounds, selected: np.ndarray, topk: int) -> None:
    """`selected` picks, in every row, min(topk, non-empty blocks) non-empty blocks, and no
    unselected block ranks above a selected one for every score within `bounds` ((lo, hi)
    from `ranked_bounds`; equal bounds: the exact rule, ties to the lower index)."""
    lo, hi = bounds
    finite = np.isfinite(lo)
    want = np.minimum(topk, finite.sum(-1))
    assert (selected.sum(-1) == want).all(), "the kernel selected a wrong number of blocks in some row"
    assert not (selected & ~finite).any(), "the kernel selected an empty block"
    ranked = np.ones(lo.shape[-2:], bool)
    passed = _pairs(selected, ranked, finite) & np.swapaxes(_certainly_above(lo, hi), -1, -2)
    assert not passed.any(), "the kernel's selection passes over a block that ranks above a selected one"


def checked_kernel_selection(case: Case, inputs: dict, padding: str = "zeros") -> np.ndarray:
    """The kernel's selection on these inputs, checked to be a top-k of the reference's ranked
    scores within the draw's margin (see make_inputs)."""
    selected = kernel_selection(case, inputs, "cuda" if _has_gpu() else "cpu", padding)
    check_top_k(ranked_bounds(inputs, case, padding, inputs["near_ties"]), selected, case.topk)
    return selected


def to_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """BHSD -> the case's layout (BSHD swaps axes 1 and 2)."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bshd" else x


from_layout = to_layout  # the swap is its own inverse


def reference(case: Case, inputs: dict, padding: str = "zeros") -> dict:
    """float64 out and gradients (BHSD numpy) on the inputs rounded to the case's dtype."""
    x = {n: R.round_to_dtype(inputs[n], case.dtype) for n in ("q", "k", "v", "gate", "dout")}
    # near-tie draws (make_inputs): the kernel's selection, once checked to be a top-k
    block_map = checked_kernel_selection(case, inputs, padding) if inputs.get("near_ties") else None
    out, _, _, grads = R.video_sparse_attn_reference(
        x["q"], x["k"], x["v"], inputs["kv_counts"], inputs["q_counts"], case.topk, case.E,
        gate=x["gate"] if case.gate else None, round_to=case.dtype, block_map=block_map, dout=x["dout"],
        softmax_scale=case.softmax_scale, padding=padding)
    return {"out": out, **grads}


def errors(x: np.ndarray, ref: np.ndarray):
    x = np.asarray(x, np.float64)
    assert np.isfinite(x).all(), "non-finite values in the kernel's result"
    diff = x - ref
    return (np.linalg.norm(diff) / np.linalg.norm(ref), np.abs(diff).max() / np.abs(ref).max())


def assert_close(case: Case, got: dict, ref: dict, tolerance: Optional[dict] = None) -> dict:
    """Compares every result in `ref` (BHSD) with `got` (BHSD); returns the errors.
    `tolerance`: per-result bounds {name: dict(rel=, max_rel=)} replacing TOLERANCE's."""
    report = {}
    for name, want in ref.items():
        tol = (tolerance or {}).get(name, TOLERANCE[case.dtype])
        rel, max_rel = errors(got[name], want)
        report[name] = rel
        assert rel < tol["rel"] and max_rel < tol["max_rel"], (
            f"{name}: relative error {rel:.2e} (bound {tol['rel']:.0e}), max error {max_rel:.2e} "
            f"(bound {tol['max_rel']:.0e}) for {case.id()}")
    return report


class CompiledStandIn:
    """Stands for a compiled CuTe DSL kernel in the host launchers' CPU tests (`compile_for_torch`
    replaced by `record_compiles`): keeps what it was built from and records its calls (the
    arguments after the tensors: scale, stream)."""

    def __init__(self, kernel, examples, scalars):
        self.kernel, self.examples, self.scalars, self.calls = kernel, examples, scalars, []

    def __call__(self, *args):
        self.calls.append(args)


def record_compiles(compiled: list):
    """A `compile_for_torch` that appends a `CompiledStandIn` to `compiled` instead of compiling."""
    def compile_for_torch(kernel, examples, *scalars):
        compiled.append(CompiledStandIn(kernel, examples, scalars))
        return compiled[-1]
    return compile_for_torch
