"""Padding semantics (issue 24, item 4): block i holds `variable_block_sizes[i]` valid tokens
at its start, the rest of the block is padding, and `padding=` says what that means.

- "zeros" (the default): FastVideo's function exactly, gradients included. Block means sum
  all E rows and divide by the valid count (their gradient reaches every row, padded ones
  too); padded query rows are computed like any row (output, lse, dq, with dout on every
  row); padded KV rows are masked as keys and get only the pooling gradient. Tested with
  nonzero (finite) values in the padding, which this mode reads: a kernel that skipped
  the padded rows would fail here.
- "ignore": the padded rows are never read, NaN and inf included; the padded rows of the
  output and of every gradient are exactly 0.

Each mode against the float64 reference (`vsa_core.reference`), whose chain rule is checked
against torch autograd of the same function written out independently; both frontends,
torch == JAX bit for bit on the Triton kernels; block_sparse_attn, packed sequences and
prefixes too; every backend on the GPU."""

import math

import numpy as np
import pytest
import torch

from common import (Case, assert_close, make_inputs, reference, selection_is_clear, skip_unavailable)
from frontends import TORCH_DEVICE, run_jax_vjp, run_torch, seed_of
from test_reference_matrix import _unavailable
from vsa_core import reference as R

# the interpreter computes the padded rows of NaN / inf inputs too (then dropped by the selects)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

RUNNERS = {"torch": run_torch, "jax": run_jax_vjp}
TOKENS = {"q": "q_counts", "gate": "q_counts", "k": "kv_counts", "v": "kv_counts", "dout": "q_counts",
          "out": "q_counts", "dq": "q_counts", "dgate": "q_counts", "dk": "kv_counts", "dv": "kv_counts"}
NON_FINITE = (np.nan, np.inf, -np.inf)


def _padded(inputs: dict, name: str, E: int) -> np.ndarray:
    """Bool [S]: the padded tokens of `name`'s sequence."""
    return ~R.valid_tokens(inputs[TOKENS[name]], E)


def with_finite_padding(inputs: dict, E: int, seed: int, names=("q", "k", "v", "gate", "dout")) -> dict:
    """The same inputs with random finite values in every padded row of `names`."""
    rng = np.random.default_rng(seed)
    junk = dict(inputs)
    for name in names:
        x = inputs[name].copy()
        pad = _padded(inputs, name, E)
        x[:, :, pad] = rng.standard_normal(x[:, :, pad].shape).astype(np.float32)
        junk[name] = x
    return junk


def with_non_finite_padding(inputs: dict, E: int, names=("q", "k", "v", "gate", "dout")) -> dict:
    """The same inputs with NaN, inf and -inf (by row) in every padded row of `names`."""
    junk = dict(inputs)
    for name in names:
        x = inputs[name].copy()
        rows = np.flatnonzero(_padded(inputs, name, E))
        for i, row in enumerate(rows):
            x[:, :, row] = NON_FINITE[i % 3]
        junk[name] = x
    return junk


def zeros_inputs(case: Case, seed: int) -> dict:
    """Inputs with finite junk in the padding of q, k, v and the gate (which padding="zeros"
    reads), redrawn until the top-k of the junk-laden means is unambiguous."""
    inputs = make_inputs(case, seed=seed)
    for attempt in range(50):
        junk = with_finite_padding(inputs, case.E, seed + 1000 * attempt)
        if selection_is_clear(junk, case):
            return junk
    raise AssertionError("no draw with an unambiguous selection")


def assert_padded_rows_zero(got: dict, inputs: dict, E: int) -> None:
    for name, x in got.items():
        pad = x[:, :, _padded(inputs, name, E)]
        assert not pad.any(), f"{name}: padded rows hold {np.abs(pad).max():.3g}, not 0"


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    for name in a:
        assert np.array_equal(a[name], b[name]), f"{name}: {what}"


# ---- the float64 reference -------------------------------------------------------------------
def autograd_vsa(x: dict, q_counts, kv_counts, topk: int, E: int, padding: str) -> dict:
    """The two functions written out in float64 torch (no code shared with vsa_core.reference),
    differentiated by autograd against x["dout"]. "zeros": FastVideo's `video_sparse_attn` (means
    = sum of all E rows / count, softmax over the non-empty KV blocks, top-k, fine attention of
    every query row over the selected blocks' valid keys, out = out_c * gate + out_s); "ignore":
    the same on the inputs with their padded rows replaced by 0, padded output rows 0."""
    q, k, v, gate = (torch.tensor(x[n], dtype=torch.float64, requires_grad=True) for n in ("q", "k", "v", "gate"))
    B, H, Sq, D = q.shape
    q_ok = torch.tensor(R.valid_tokens(q_counts, E))[:, None]
    kv_ok = torch.tensor(R.valid_tokens(kv_counts, E))[:, None]
    qq, kk, vv, gg = q, k, v, gate
    if padding == "ignore":
        qq, gg = (torch.where(q_ok, t, torch.zeros(())) for t in (q, gate))
        kk, vv = (torch.where(kv_ok, t, torch.zeros(())) for t in (k, v))

    def mean(t, counts):
        c = torch.tensor(np.asarray(counts), dtype=torch.float64)[:, None]
        total = t.reshape(B, H, -1, E, D).sum(3)
        return torch.where(c > 0, total / c.clamp(min=1), torch.zeros(()))

    qc, kc, vc = mean(qq, q_counts), mean(kk, kv_counts), mean(vv, kv_counts)
    scores = (qc @ kc.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.tensor(np.asarray(kv_counts) == 0),
                                                                      -math.inf)
    out_c = (torch.softmax(scores, -1) @ vc).repeat_interleave(E, dim=2)
    order = torch.sort(-scores.detach(), dim=-1, stable=True).indices  # ties: the lower index first
    ranks = torch.argsort(order, dim=-1)
    chosen = (ranks < topk) & torch.isfinite(scores.detach())
    allowed = chosen.repeat_interleave(E, 2).repeat_interleave(E, 3) & kv_ok[:, 0]
    logits = (qq @ kk.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, -math.inf)
    out_s = torch.softmax(logits, -1) @ vv
    out = out_c * gg + out_s
    if padding == "ignore":
        out = torch.where(q_ok, out, torch.zeros(()))
    dout = torch.tensor(x["dout"], dtype=torch.float64)
    if padding == "ignore":
        dout = torch.where(q_ok, dout, torch.zeros(()))  # never read: NaN there must not reach anything
    out.backward(dout)
    return {"out": out.detach().numpy(), "dq": q.grad.numpy(), "dk": k.grad.numpy(), "dv": v.grad.numpy(),
            "dgate": gate.grad.numpy()}


@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_reference_is_the_chain_rule_of_the_function(padding):
    """reference.py's hand-written gradients equal autograd of the function written out
    independently, with random values in every padded row (NaN / inf as well for "ignore")
    and a random dout on every row; partial query and KV blocks and an empty KV block."""
    rng = np.random.default_rng(5)
    E, B, H, D = 16, 2, 2, 8
    q_counts, kv_counts = np.array([16, 5, 11]), np.array([16, 7, 0, 9])
    x = {n: rng.standard_normal((B, H, len(c) * E, D))
         for n, c in (("q", q_counts), ("k", kv_counts), ("v", kv_counts), ("gate", q_counts), ("dout", q_counts))}
    if padding == "ignore":
        x = with_non_finite_padding({**x, "q_counts": q_counts, "kv_counts": kv_counts}, E)
    want = autograd_vsa(x, q_counts, kv_counts, 2, E, padding)
    out, _, _, grads = R.video_sparse_attn_reference(x["q"], x["k"], x["v"], kv_counts, q_counts, 2, E, gate=x["gate"],
                                                     dout=x["dout"], padding=padding)
    got = {"out": out, **grads}
    for name, w in want.items():
        assert np.isfinite(got[name]).all(), name
        np.testing.assert_allclose(got[name], w, rtol=1e-10, atol=1e-12, err_msg=name)
    if padding == "zeros":  # the padded rows carry output and gradients (FastVideo's function)
        q_pad = ~R.valid_tokens(q_counts, E)
        kv_pad = ~R.valid_tokens(kv_counts, E) & np.repeat(kv_counts > 0, E)  # an empty block: no pooling gradient
        for name, pad in (("out", q_pad), ("dq", q_pad), ("dgate", q_pad), ("dk", kv_pad), ("dv", kv_pad)):
            assert np.abs(got[name][:, :, pad]).min() > 0, name


def test_reference_modes_agree_on_the_valid_outputs_of_zero_padding():
    """With zeros in the padding both modes give the same valid output rows (the means are
    the valid tokens' means either way); "ignore" zeroes the padded ones."""
    case = Case(batch=1)
    inputs = make_inputs(case, seed=seed_of(case))
    zeros, ignore = reference(case, inputs, "zeros"), reference(case, inputs, "ignore")
    valid = R.valid_tokens(inputs["q_counts"], case.E)
    np.testing.assert_allclose(ignore["out"][:, :, valid], zeros["out"][:, :, valid], rtol=1e-12, atol=1e-12)
    assert_padded_rows_zero(ignore, inputs, case.E)


def test_reference_ignore_reads_nothing_of_the_padding():
    case = Case(batch=1)
    inputs = make_inputs(case, seed=seed_of(case))
    clean, dirty = reference(case, inputs, "ignore"), reference(case, with_non_finite_padding(inputs, case.E), "ignore")
    assert_bitwise(dirty, clean, "changed with NaN / inf in the padding")


# ---- the Triton kernels, both frontends (CPU: the interpreter) ----------------------------------
CPU_CASES = [Case(batch=1), Case(batch=1, heads=1, layout="bshd", gate=False, n_q_blocks=4, n_kv_blocks=3)]


def _triton_or_skip(case: Case):
    for frontend in RUNNERS:
        skip_unavailable("triton", _unavailable(case, "triton", frontend))


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id())
def test_zeros_is_fastvideos_function(case):
    """padding="zeros" (the default in torch, explicit in JAX) with nonzero values in the
    padding, which it reads: out and every gradient match the float64 reference of FastVideo's
    function; torch and JAX agree bit for bit."""
    _triton_or_skip(case)
    inputs = zeros_inputs(case, seed_of(case))
    got = run_torch(case, inputs, backend="triton")
    assert_close(case, got, reference(case, inputs, "zeros"))
    assert_bitwise(run_jax_vjp(case, inputs, backend="triton", padding="zeros"), got, "jax != torch")


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id())
def test_ignore_never_reads_the_padding(case):
    """padding="ignore" with NaN, inf and -inf in the padded rows of q, k, v, the gate and
    dout: every result finite, padded rows exactly 0, bit for bit the results of zero padding,
    and the float64 reference of "ignore"; torch and JAX agree bit for bit."""
    _triton_or_skip(case)
    inputs = make_inputs(case, seed=seed_of(case))
    junk = with_non_finite_padding(inputs, case.E)
    got = run_torch(case, junk, backend="triton", padding="ignore")
    assert_padded_rows_zero(got, inputs, case.E)
    assert_close(case, got, reference(case, junk, "ignore"))
    assert_bitwise(got, run_torch(case, inputs, backend="triton", padding="ignore"), "changed with NaN in the padding")
    assert_bitwise(run_jax_vjp(case, junk, backend="triton", padding="ignore"), got, "jax != torch")


@pytest.mark.parametrize("name", ["q", "k", "v", "gate", "dout"])
def test_ignore_each_input_alone(name):
    """NaN / inf in the padding of one input at a time (the gap issue 15 left: 0 * inf in the
    fine kernels' masked products), torch."""
    case = Case(batch=1, heads=1)
    inputs = make_inputs(case, seed=seed_of(case))
    got = run_torch(case, with_non_finite_padding(inputs, case.E, names=(name,)), backend="triton", padding="ignore")
    assert_bitwise(got, run_torch(case, inputs, backend="triton", padding="ignore"),
                   f"changed with NaN / inf in the padding of {name}")


def test_prefix_ignore_never_reads_the_padding():
    """A prefix (dense rows) does not change what "ignore" reads; "zeros" matches its reference."""
    from test_prefix import draw, prefix_reference
    case = Case(batch=1, heads=1, n_q_blocks=3, n_kv_blocks=3, topk=1)
    inputs = draw(case, 1, "exempt", seed_of(case))
    junk = with_non_finite_padding(inputs, case.E)
    got = run_torch(case, junk, backend="triton", padding="ignore", prefix_blocks=1)
    assert_padded_rows_zero(got, inputs, case.E)
    assert_bitwise(got, run_torch(case, inputs, backend="triton", padding="ignore", prefix_blocks=1), "prefix")
    zeros = run_jax_vjp(case, inputs, backend="triton", prefix_blocks=1)
    assert_close(case, zeros, prefix_reference(case, inputs, 1, "exempt"))


# ---- block_sparse_attn: every query row computed, the padded KV rows masked ------------------
def _bsa_inputs(seed: int):
    rng = np.random.default_rng(seed)
    E, B, H, D, nq, nk = 64, 1, 2, 64, 2, 3
    counts = np.array([64, 23, 40])
    x = {n: rng.standard_normal((B, H, s * E, D)).astype(np.float32)
         for n, s in (("q", nq), ("k", nk), ("v", nk), ("dout", nq))}
    for n in ("k", "v"):
        x[n][:, :, ~R.valid_tokens(counts, E)] = 0
    bm = rng.random((B, H, nq, nk)) < 0.6
    bm[..., 1] = True  # every query block sees a partial block
    return x, counts, bm, E


def _run_bsa(frontend: str, x: dict, counts, bm, E: int, padding: str) -> dict:
    if frontend == "torch":
        import vsa_torch
        q, k, v = (torch.from_numpy(x[n]).to(TORCH_DEVICE, torch.bfloat16).requires_grad_() for n in ("q", "k", "v"))
        out, _ = vsa_torch.block_sparse_attn(q, k, v, torch.from_numpy(bm).to(TORCH_DEVICE), counts, E,
                                             backend="triton", padding=padding)
        out.backward(torch.from_numpy(x["dout"]).to(TORCH_DEVICE, torch.bfloat16))
        return {n: t.detach().float().cpu().numpy() for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad),
                                                                 ("dv", v.grad))}
    import jax
    import jax.numpy as jnp

    import vsa_jax
    q, k, v, dout = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "dout"))

    def f(q, k, v):
        return vsa_jax.block_sparse_attn(q, k, v, jnp.asarray(bm), counts, E, backend="triton", padding=padding)[0]
    out, vjp = jax.vjp(f, q, k, v)
    return {n: np.asarray(t, np.float32) for n, t in zip(("out", "dq", "dk", "dv"), (out,) + vjp(dout))}


@pytest.mark.parametrize("frontend", list(RUNNERS))
def test_block_sparse_attn_paddings(frontend):
    """Both modes match the float64 reference; "ignore" with NaN / inf in the padded K and V
    rows gives the same bits (and zero gradients there)."""
    x, counts, bm, E = _bsa_inputs(17)
    t = {n: R.round_to_dtype(x[n], "bfloat16") for n in x}
    out, _, grads = R.block_sparse_attn_reference(t["q"], t["k"], t["v"], bm, counts, E, dout=t["dout"])
    want = {"out": out, **grads}
    case = Case()
    got = {mode: _run_bsa(frontend, x, counts, bm, E, mode) for mode in ("zeros", "ignore")}
    for mode in got:
        assert_close(case, got[mode], want)
    junk = dict(x)
    for n in ("k", "v"):
        junk[n] = with_non_finite_padding({n: x[n], "kv_counts": counts}, E, names=(n,))[n]
    assert_bitwise(_run_bsa(frontend, junk, counts, bm, E, "ignore"), got["ignore"], "changed with NaN in K / V")


# ---- packed sequences ----------------------------------------------------------------------------
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_varlen_ignore_never_reads_the_padding(frontend):
    from test_varlen import PACKS, make_pack, pack_reference, run_jax_varlen, run_torch_varlen, seed_of as pack_seed
    pack = PACKS[0]
    x = make_pack(pack, pack_seed(pack))
    junk = dict(x)
    for name in ("q", "k", "v", "gate", "dout"):  # packed [S, H, D]
        rows = np.flatnonzero(~R.valid_tokens(x[TOKENS[name]], pack.E))
        junk[name] = x[name].copy()
        for i, row in enumerate(rows):
            junk[name][row] = NON_FINITE[i % 3]
    run = run_torch_varlen if frontend == "torch" else run_jax_varlen
    clean, dirty = run(pack, x, padding="ignore"), run(pack, junk, padding="ignore")
    for name, got in dirty.items():
        pad = ~R.valid_tokens(x[TOKENS[name]], pack.E)
        assert not got[pad].any(), f"{name}: padded rows are not 0"
        np.testing.assert_array_equal(got, clean[name], err_msg=f"{name} changed with NaN in the padding")
    assert_close(pack.case(0), dirty, pack_reference(pack, x, "ignore"))


# ---- the library backends' copy, and the argument check -------------------------------------------
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_valid_rows_copy(layout):
    """What the cute and cudnn backends hand their library under "ignore": x with the padded
    rows written 0 (NaN / inf dropped); under "zeros" x itself, no copy."""
    import dataclasses

    from vsa_core import stages as S
    from vsa_core.launch import eager_launcher
    from vsa_core.problem import AttnProblem
    E, B, H, D = 128, 2, 2, 64
    counts = np.array([E, 37, 0], np.int32)
    p = AttnProblem(batch=B, heads=H, q_len=3 * E, kv_len=3 * E, head_dim=D, block_elems=E, dtype="bfloat16",
                    layout=layout, topk=1, padding="ignore")
    x = np.random.default_rng(2).standard_normal((B, H, 3 * E, D)).astype(np.float32)
    junk = with_non_finite_padding({"k": x, "kv_counts": counts}, E, names=("k",))["k"]
    in_layout = junk if layout == "bhsd" else np.ascontiguousarray(junk.transpose(0, 2, 1, 3))
    t = torch.from_numpy(in_layout).to(TORCH_DEVICE, torch.bfloat16)
    counts_t = torch.from_numpy(counts).to(TORCH_DEVICE)
    got = S.valid_rows_copy(eager_launcher, p, t, counts_t, 3 * E).float().cpu().numpy()
    got = got if layout == "bhsd" else got.transpose(0, 2, 1, 3)
    want = np.where(R.valid_tokens(counts, E)[:, None], R.round_to_dtype(x, "bfloat16"), 0.0)
    np.testing.assert_array_equal(got, want)
    assert S.valid_rows_copy(eager_launcher, dataclasses.replace(p, padding="zeros"), t, counts, 3 * E) is t


def _call(frontend: str, fn: str, padding):
    """A small call of `fn` ("video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn",
    "video_sparse_attn_varlen") of either frontend with the given `padding`."""
    if frontend == "torch":
        import vsa_torch as fe
        zeros = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
    else:
        import jax.numpy as jnp

        import vsa_jax as fe
        zeros = lambda *s: jnp.zeros(s, jnp.bfloat16)  # noqa: E731
    counts = np.array([64, 30])
    if fn == "block_sparse_attn":
        bm = np.ones((1, 1, 2, 2), bool)
        return fe.block_sparse_attn(zeros(1, 1, 128, 64), zeros(1, 1, 128, 64), zeros(1, 1, 128, 64),
                                    torch.from_numpy(bm) if frontend == "torch" else bm, counts, padding=padding)
    if fn == "video_sparse_attn_varlen":
        cu = np.array([0, 128], np.int32)
        cu = torch.from_numpy(cu) if frontend == "torch" else cu
        return fe.video_sparse_attn_varlen(zeros(128, 1, 64), zeros(128, 1, 64), zeros(128, 1, 64), cu, cu, counts,
                                           counts, 1, padding=padding)
    x = zeros(1, 1, 128, 64)
    return getattr(fe, fn)(x, x, x, counts, counts, 1, padding=padding)


@pytest.mark.parametrize("fn", ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn",
                                "video_sparse_attn_varlen"])
def test_bad_padding_names_the_argument(fn):
    """The same ValueError, naming `padding` and the choices, from both frontends, before any kernel."""
    messages = []
    for frontend in ("torch", "jax"):
        for bad in ("zero", None, 0):
            with pytest.raises(ValueError, match=r"^padding must be one of \('zeros', 'ignore'\), got ") as e:
                _call(frontend, fn, bad)
            messages.append(str(e.value))
    assert messages[:3] == messages[3:]


# ---- every backend on the GPU ------------------------------------------------------------------
# 128-token blocks and head dim 128 in bf16 run on every backend (cuDNN's backward needs
# bf16 and head dim 128, FA4 128- or 256-token blocks); then each backend's own block sizes.
GPU_CASES = [
    Case(block=128, head_dim=128, n_q_blocks=3, n_kv_blocks=4, batch=1),
    Case(block=128, head_dim=128, n_q_blocks=3, n_kv_blocks=4, layout="bshd", gate=False, heads=3),
    Case(block=64, head_dim=128, n_q_blocks=4, n_kv_blocks=5, topk=3),
    Case(block=256, head_dim=128, n_q_blocks=3, n_kv_blocks=4, batch=1, layout="bshd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id())
@pytest.mark.parametrize("backend", ["triton", "cute", "cudnn", "sm90"])
@pytest.mark.parametrize("frontend", list(RUNNERS))
def test_zeros_is_fastvideos_function_gpu(frontend, backend, case):
    skip_unavailable(backend, _unavailable(case, backend, frontend))
    inputs = zeros_inputs(case, seed_of(case))
    assert_close(case, RUNNERS[frontend](case, inputs, backend=backend, padding="zeros"),
                 reference(case, inputs, "zeros"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id())
@pytest.mark.parametrize("backend", ["triton", "cute", "cudnn", "sm90"])
@pytest.mark.parametrize("frontend", list(RUNNERS))
def test_ignore_never_reads_the_padding_gpu(frontend, backend, case):
    """NaN / inf in every padded row: finite results, padded rows 0, the reference; bit for bit
    the zero-padding results where the backend is deterministic (Triton; FA4 and cuDNN add
    gradients with atomics)."""
    skip_unavailable(backend, _unavailable(case, backend, frontend))
    inputs = make_inputs(case, seed=seed_of(case))
    junk = with_non_finite_padding(inputs, case.E)
    got = RUNNERS[frontend](case, junk, backend=backend, padding="ignore")
    assert_padded_rows_zero(got, inputs, case.E)
    assert_close(case, got, reference(case, junk, "ignore"))
    if backend == "triton":
        assert_bitwise(got, RUNNERS[frontend](case, inputs, backend=backend, padding="ignore"), "changed with NaN")
