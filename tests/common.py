"""Shared test cases, inputs and the comparison with the float64 reference.

Both frontends' parity tests draw their inputs here (numpy, float32 before the cast),
run them through their own API and hand back numpy results, so the PyTorch and JAX
tests check the same cases with the same tolerances.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vsa_core import reference as R

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


def _selection_margin(inputs: dict, case: Case) -> float:
    """Smallest gap, over all rows, between the last selected and first unselected
    coarse score (float64 scores of the rounded block means)."""
    t = {n: torch.from_numpy(inputs[n]).double() for n in ("q", "k")}
    round_to = getattr(torch, case.dtype)
    s = R.coarse_scores(t["q"].to(round_to).double(), t["k"].to(round_to).double(),
                        torch.from_numpy(inputs["kv_counts"]), torch.from_numpy(inputs["q_counts"]), case.E,
                        round_to).numpy()
    finite = np.where(np.isfinite(s), s, -np.inf)
    ordered = -np.sort(-finite, axis=-1)
    k = min(case.topk, case.n_kv_blocks)
    if k >= ordered.shape[-1]:
        return np.inf
    gap = ordered[..., k - 1] - ordered[..., k]
    return float(np.nanmin(np.where(np.isfinite(gap), gap, np.inf)))


def make_inputs(case: Case, seed: int, margin: Optional[float] = 1e-4) -> dict:
    """Fresh random inputs (float32 numpy, BHSD). Redraws until the top-k choice is
    unambiguous by `margin`, far above the kernels' rounding of the scores (1e-5): near-ties
    would let a correct kernel pick another block than the reference. `margin=None` takes the
    first draw: for tests that compare two runs of our own kernels (bit for bit) and not the
    reference, where large cases (many rows) would almost never pass the margin."""
    for attempt in range(50 if margin is not None else 1):
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
    raise RuntimeError("could not draw inputs with an unambiguous top-k selection")


def to_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """BHSD -> the case's layout (BSHD swaps axes 1 and 2)."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bshd" else x


from_layout = to_layout  # the swap is its own inverse


def reference(case: Case, inputs: dict) -> dict:
    """float64 out and gradients (BHSD numpy) on the inputs rounded to the case's dtype."""
    round_to = getattr(torch, case.dtype)
    t = {n: torch.from_numpy(inputs[n]).to(round_to).double().requires_grad_()
         for n in ("q", "k", "v", "gate")}
    out, _, _ = R.video_sparse_attn_reference(
        t["q"], t["k"], t["v"], inputs["kv_counts"], inputs["q_counts"], case.topk, case.E,
        gate=t["gate"] if case.gate else None, round_to=round_to)
    dout = torch.from_numpy(inputs["dout"]).to(round_to).double()
    out.backward(dout)
    res = {"out": out.detach().numpy(), "dq": t["q"].grad.numpy(), "dk": t["k"].grad.numpy(),
           "dv": t["v"].grad.numpy()}
    if case.gate:
        res["dgate"] = t["gate"].grad.numpy()
    return res


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
