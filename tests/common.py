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

# ---- strict mode --------------------------------------------------------------------------
# VSA_REQUIRE_BACKENDS=cute,cudnn,jax (benchmarks/gpu_session.sh sets it): on a machine with a
# GPU, a test that would skip because one of these is missing fails instead, so a GPU run
# without FA4, cuDNN frontend or JAX's CUDA plugin cannot pass as green. A backend that is
# installed but does not take a case (a block size, head dim or dtype it has no kernel for)
# still skips, with its reason. Without a GPU the GPU tests skip as usual.
STRICT_NAMES = ("cute", "cudnn", "jax")
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
    if name == "cute":
        from vsa_core.backends import cute_backend
        return cute_backend._fa4_import_error()
    if name == "cudnn":
        from vsa_core.backends import cudnn_backend
        return cudnn_backend._cudnn_import_error()
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
    """float64 coarse scores [B, H, nQ, nKV] of the block means rounded to the case's dtype
    (-inf for empty KV blocks), as the reference ranks them."""
    q, k = (R.round_to_dtype(inputs[n], case.dtype) for n in ("q", "k"))
    return R.coarse_scores(q, k, inputs["kv_counts"], inputs["q_counts"], case.E, case.dtype,
                           padding, softmax_scale=case.softmax_scale)


def _selection_margin(inputs: dict, case: Case) -> float:
    """Smallest gap, over all rows, between the last selected and first unselected
    coarse score (float64 scores of the rounded block means)."""
    s = _reference_scores(inputs, case)
    finite = np.where(np.isfinite(s), s, -np.inf)
    ordered = -np.sort(-finite, axis=-1)
    k = min(case.topk, case.n_kv_blocks)
    if k >= ordered.shape[-1]:
        return np.inf
    gap = ordered[..., k - 1] - ordered[..., k]
    return float(np.nanmin(np.where(np.isfinite(gap), gap, np.inf)))


DRAWS = 50


def make_inputs(case: Case, seed: int, margin: Optional[float] = 1e-4) -> dict:
    """Fresh random inputs (float32 numpy, BHSD). Redraws (up to DRAWS times) until the top-k
    choice is unambiguous by `margin`, far above the kernels' rounding of the scores (1e-5):
    near-ties would let a correct kernel pick another block than the reference. Cases with
    many rows and close scores (E 256 at x1: block means of 256 tokens score within ~1e-2 of
    each other) may never get there; then the last draw comes back marked `near_ties` with
    the margin, and `reference` takes the kernel's own selection once it has checked that it
    is a top-k of the float64 scores up to that margin (`checked_kernel_selection`).
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
        if margin is None or _selection_margin(x, case) > margin:
            return x
    x["near_ties"] = margin
    return x


def kernel_selection(case: Case, inputs: dict, device: str, padding: str = "zeros") -> np.ndarray:
    """The blocks the kernels select for these inputs (bool [B, H, nQ, nKV]): the pooling,
    coarse forward and top-k launches of `vsa_core.ops.forward`, on `device`. Selection always
    runs on these Triton kernels, whatever the fine stage's backend and the frontend."""
    from vsa_core.api import prepare_vsa
    from vsa_core.backends import triton_backend as T
    if torch is None:
        raise RuntimeError("a near-tie draw needs the kernel's selection, read here through torch (not installed)")
    dtype = getattr(torch, case.dtype)
    q, k, v = (torch.from_numpy(to_layout(inputs[n], case.layout)).to(device, dtype) for n in ("q", "k", "v"))
    kv_counts, q_counts = (torch.from_numpy(inputs[n]).to(device, torch.int32) for n in ("kv_counts", "q_counts"))
    p = prepare_vsa(q, k, v, kv_counts, q_counts, case.topk, case.block, layout=case.layout,
                    softmax_scale=case.softmax_scale, padding=padding).problem
    b = {name: torch.empty(shape, device=device, dtype=dtype if kind == "input" else getattr(torch, kind))
         for name, (shape, kind) in p.forward_buffers().items()}
    T.block_mean_pool_qkv(p, q, k, v, q_counts, kv_counts, b["q_pool"], b["k_pool"], b["v_pool"])
    T.coarse_forward(p, b["q_pool"], b["k_pool"], b["v_pool"], kv_counts, b["scores"], b["out_coarse"],
                     b["lse_coarse"])
    T.topk_select(p, b["scores"], b["sel_idx"], b["sel_num"], b["sel_mask"])
    return b["sel_mask"].bool().cpu().numpy()


def check_top_k(scores: np.ndarray, selected: np.ndarray, topk: int, margin: float) -> None:
    """`selected` picks, in every row, min(topk, finite scores) blocks with finite scores, and
    no unselected block scores more than `margin` above the lowest selected one."""
    finite = np.isfinite(scores)
    want = np.minimum(topk, finite.sum(-1))
    assert (selected.sum(-1) == want).all(), "the kernel selected a wrong number of blocks in some row"
    assert not (selected & ~finite).any(), "the kernel selected an empty block"
    lowest_in = np.where(selected, scores, np.inf).min(-1)
    highest_out = np.where(~selected & finite, scores, -np.inf).max(-1)
    worst = float(np.max(highest_out - lowest_in))
    assert worst <= margin, f"the kernel's selection passes over a block scoring {worst:.2e} higher (margin {margin})"


def checked_kernel_selection(case: Case, inputs: dict, padding: str = "zeros") -> np.ndarray:
    """The kernel's selection on these inputs, checked to be a top-k of the float64 scores
    up to the draw's margin (see make_inputs)."""
    selected = kernel_selection(case, inputs, "cuda" if _has_gpu() else "cpu", padding)
    check_top_k(_reference_scores(inputs, case, padding), selected, case.topk, inputs["near_ties"])
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
