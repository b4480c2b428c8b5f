"""vsa_jax against the float64 reference and against vsa_torch (CPU: Triton interpreter
inside XLA's buffer callbacks; GPU: the compiled kernels on XLA's stream)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vsa_jax
from common import CASES, Case, assert_close, make_inputs, reference, require_jax_gpu
from frontends import jax_args, run_jax_grad, run_torch, seed_of, to_numpy, torch, vsa_fn, vsa_torch
from vsa_core.reference import block_sparse_attn_reference, round_to_dtype

# torch is optional here: without it (a vsa[jax] install, CI's second venv) the comparisons
# with vsa_torch skip and everything else runs
needs_torch = pytest.mark.skipif(torch is None, reason="compares with vsa_torch (torch not installed)")

# ---- parity -------------------------------------------------------------------------------
# (the float64 reference over CASES, for each frontend and backend: test_reference_matrix.py)


@needs_torch
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id())
def test_matches_torch_bitwise_on_triton(case):
    """backend="triton": same kernels, same launches, same inputs, and every Triton kernel
    here is deterministic (no atomics: dQ is owned by query tiles, dK/dV by KV tiles), so
    vsa_torch (with grad) and jit(grad) of vsa_jax agree bit for bit in out, dq, dk, dv and
    dgate (neither frontend computes anything: they only allocate and launch). On the GPU
    too: both run in this process, so the Triton autotuner's cached choice of tile config
    is the same for both (a fresh process may pick another config, i.e. another summation
    order: then the two differ by rounding only, within the reference tolerance)."""
    inputs = make_inputs(case, seed=seed_of(case))
    got_jax, got_torch = run_jax_grad(case, inputs, "triton"), run_torch(case, inputs, "triton")
    assert got_jax.keys() == got_torch.keys()
    for name in got_torch:
        diff = np.abs(got_jax[name] - got_torch[name]).max()
        assert np.array_equal(got_jax[name], got_torch[name]), f"{name}: max |jax - torch| = {diff:.3e}"


CUTE_PARITY_CASES = [c for c in CASES if c.E in (128, 256)] + [Case(block=256, head_dim=128, n_q_blocks=2,
                                                                     n_kv_blocks=3, layout="bshd")]


@needs_torch
@pytest.mark.gpu
@pytest.mark.parametrize("case", CUTE_PARITY_CASES, ids=lambda c: c.id())
def test_matches_torch_on_cute(case):
    """backend="cute" (FA4's fine stage): what is and is not bitwise.
    - out and dgate: bitwise (FA4's forward writes each output tile once; dgate comes
      from our deterministic Triton preprocess kernel);
    - dq, dk, dv: FA4's backward accumulates dQ with atomics (the order of the adds
      changes from run to run), so the two frontends agree within the reference
      tolerance of each other, not bitwise; dk and dv are compared the same way
      (their determinism is FA4's business, not promised here)."""
    from test_cute_backend import _require_cute
    require_jax_gpu()
    _require_cute(case)
    inputs = make_inputs(case, seed=seed_of(case))
    got_jax, got_torch = run_jax_grad(case, inputs, "cute"), run_torch(case, inputs, "cute")
    assert got_jax.keys() == got_torch.keys()
    for name in ("out", "dgate"):
        if name in got_torch:
            assert np.array_equal(got_jax[name], got_torch[name]), name
    assert_close(case, {n: got_jax[n] for n in ("dq", "dk", "dv")}, {n: got_torch[n] for n in ("dq", "dk", "dv")})


def test_inference_output_equals_training_forward():
    """The primal (no gradient: nothing kept for a backward) and the forward of a vjp
    run different buffer tables but the same arithmetic."""
    case = Case()
    inputs = make_inputs(case, seed=11)
    f = vsa_fn(case, inputs["kv_counts"], inputs["q_counts"])
    q, k, v, gate, _ = jax_args(case, inputs)
    out_inference = jax.jit(f)(q, k, v, gate)
    out_training, _ = jax.jit(lambda *a: jax.vjp(f, *a))(q, k, v, gate)
    assert np.array_equal(np.asarray(out_inference), np.asarray(out_training))


# ---- transformations ----------------------------------------------------------------------
def test_vmap_over_a_leading_axis():
    """vmap over q, k, v, gate, dout and the counts themselves (different per element):
    each slice equals the un-mapped call on that element, forward and gradients. Under the
    default launch on a GPU the mapped call runs the callback (the native launches are not
    mapped: vsa_jax.native._not_under_vmap), each element alone the native launch."""
    case = Case(batch=1, heads=1, n_q_blocks=2, n_kv_blocks=4)
    elems = [make_inputs(case, seed=s) for s in (21, 22)]
    assert not np.array_equal(elems[0]["kv_counts"], elems[1]["kv_counts"])

    def out_and_grads(q, k, v, gate, dout, kv_counts, q_counts):
        out, vjp = jax.vjp(vsa_fn(case, kv_counts, q_counts), q, k, v, gate)
        return (out,) + vjp(dout)

    per_elem = [jax_args(case, e) + [jnp.asarray(e["kv_counts"], jnp.int32), jnp.asarray(e["q_counts"], jnp.int32)]
                for e in elems]
    batched = [jnp.stack([per_elem[0][i], per_elem[1][i]]) for i in range(7)]
    mapped = jax.jit(jax.vmap(out_and_grads))(*batched)
    single = jax.jit(out_and_grads)
    for j in range(2):
        want = single(*per_elem[j])
        for name, got_all, w in zip(("out", "dq", "dk", "dv", "dgate"), mapped, want):
            assert np.array_equal(np.asarray(got_all[j]), np.asarray(w)), f"vmap element {j}: {name}"
    # and against the reference, for good measure
    assert_close(case, to_numpy(case, dict(zip(("out", "dq", "dk", "dv", "dgate"), (m[1] for m in mapped)))),
                 reference(case, elems[1]))


def test_jit_with_donated_inputs():
    """Donating q, k, v, gate lets XLA reuse their memory after the call; the callback
    only reads its inputs, so the results equal those of a call without donation."""
    case = Case(batch=1)
    inputs = make_inputs(case, seed=31)
    f = vsa_fn(case, inputs["kv_counts"], inputs["q_counts"])
    q, k, v, gate, dout = jax_args(case, inputs)

    def out_and_grads(q, k, v, gate):
        out, vjp = jax.vjp(f, q, k, v, gate)
        return (out,) + vjp(dout)

    want = [np.asarray(x) for x in jax.jit(out_and_grads)(q, k, v, gate)]
    donating = jax.jit(out_and_grads, donate_argnums=(0, 1, 2, 3))
    for _ in range(2):  # a second call on fresh copies reuses the first call's freed buffers
        copies = [jnp.array(x, copy=True) for x in (q, k, v, gate)]
        got = donating(*copies)
        for name, g, w in zip(("out", "dq", "dk", "dv", "dgate"), got, want):
            assert np.array_equal(np.asarray(g), w), name
        assert all(c.is_deleted() for c in copies)  # XLA took the donated buffers (CPU and GPU)


def test_training_loop_compiles_once():
    """A jitted SGD step (parameters donated) runs several steps with one trace and one
    compilation; the loss goes down."""
    case = Case(batch=1, heads=1, n_q_blocks=2, n_kv_blocks=3, partial_kv=False)
    inputs = make_inputs(case, seed=41)
    q, k, v, gate, dout = jax_args(case, inputs)
    traces = []

    def loss(params, target):
        traces.append(1)  # runs only when the step is traced
        out = vsa_jax.video_sparse_attn(*params, inputs["kv_counts"], inputs["q_counts"], case.topk,
                                        case.block, gate)
        return jnp.mean((out.astype(jnp.float32) - target) ** 2)

    @jax.jit
    def step(params, target):
        value, grads = jax.value_and_grad(loss)(params, target)
        return value, jax.tree.map(lambda p, g: (p.astype(jnp.float32) - 20.0 * g).astype(p.dtype), params, grads)

    step = jax.jit(step.__wrapped__, donate_argnums=0)
    params, target = (q, k, v), dout.astype(jnp.float32)
    losses = []
    for _ in range(4):
        value, params = step(params, target)
        losses.append(float(value))
    assert len(traces) == 1 and step._cache_size() == 1
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


# ---- argument checks ----------------------------------------------------------------------
def _spec(shape, dtype="bfloat16"):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


BAD_CALLS = {
    # name: (override of the default arguments, exception, words of the message)
    "q dtype": (dict(q=_spec((1, 2, 128, 64), "float32")), TypeError, "q must have dtype"),
    "k shape": (dict(k=_spec((1, 2, 128, 128))), ValueError, "k must match q"),
    "v length": (dict(v=_spec((1, 2, 64, 64))), ValueError, "v must have the same sequence length"),
    "q rank": (dict(q=_spec((2, 128, 64))), ValueError, "q must be a rank-4"),
    "kv counts dtype": (dict(kv_counts=_spec((2,), "float32")), TypeError,
                        "variable_block_sizes must be an integer array"),
    "q counts shape": (dict(q_counts=_spec((3,), "int32")), ValueError, "q_variable_block_sizes must have shape"),
    "gate shape": (dict(gate=_spec((1, 2, 64, 64))), ValueError, "compress_attn_weight must have q's shape"),
    "topk type": (dict(topk=2.0), TypeError, "topk must be a Python int"),
    "block size": (dict(block_size=32), ValueError, "block_size must hold"),
    "backend": (dict(backend="nope"), ValueError, "backend must be one of"),
}


@needs_torch
@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_arguments_raise_at_trace_time(name):
    """Raised while tracing abstract arrays (eval_shape: no data, no kernel), with the
    same exception and message as vsa_torch on arrays of those shapes and dtypes."""
    override, exc, words = BAD_CALLS[name]
    args = dict(q=_spec((1, 2, 128, 64)), k=_spec((1, 2, 128, 64)), v=_spec((1, 2, 128, 64)),
                kv_counts=_spec((2,), "int32"), q_counts=_spec((2,), "int32"), gate=_spec((1, 2, 128, 64)),
                topk=1, block_size=64, backend="auto")
    args.update(override)
    arrays = {n: a for n, a in args.items() if isinstance(a, jax.ShapeDtypeStruct)}
    static = {n: a for n, a in args.items() if n not in arrays}

    def call(lib, **arrays):
        a = {**arrays, **static}
        return lib.video_sparse_attn(a["q"], a["k"], a["v"], a["kv_counts"], a["q_counts"], a["topk"],
                                     a["block_size"], a["gate"], backend=a["backend"])

    with pytest.raises(exc, match=words) as jax_error:
        jax.eval_shape(lambda **a: call(vsa_jax, **a), **arrays)
    to_torch = {n: torch.zeros(a.shape, dtype=getattr(torch, a.dtype.name)) for n, a in arrays.items()}
    with pytest.raises(exc) as torch_error:
        call(vsa_torch, **to_torch)
    assert str(jax_error.value) == str(torch_error.value)


def test_concrete_count_values_are_checked():
    q = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
    good, bad = np.array([64, 3]), np.array([64, 65])
    with pytest.raises(ValueError, match=r"variable_block_sizes values must lie in \[0, 64\].*, found 65"):
        vsa_jax.video_sparse_attn(q, q, q, bad, good, 1)
    with pytest.raises(ValueError, match=r"q_variable_block_sizes values must lie in \[0, 64\].*, found -1"):
        jax.jit(lambda q: vsa_jax.video_sparse_attn(q, q, q, good, np.array([-1, 3]), 1)).trace(q)
    with pytest.raises(TypeError, match="q must be a jax.Array, got list"):
        vsa_jax.video_sparse_attn([[1.0]], q, q, good, good, 1)
    with pytest.raises(TypeError, match="block_map must be a bool array"):
        jax.eval_shape(lambda q: vsa_jax.block_sparse_attn(q, q, q, jnp.zeros((1, 1, 2, 2), jnp.int32), good), q)
    with pytest.raises(TypeError, match="block_indices must be int32"):
        vsa_jax.block_sparse_attn_from_indices(q, q, q, jnp.zeros((1, 1, 2, 2), jnp.int8),
                                               jnp.zeros((1, 1, 2), jnp.int32), good)


# ---- block-sparse attention ---------------------------------------------------------------
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_block_sparse_attn_matches_reference(layout):
    """block_sparse_attn (bool map) and block_sparse_attn_from_indices (lists with junk
    past each count) against the float64 reference: out, lse and dq, dk, dv."""
    case = Case(n_q_blocks=3, n_kv_blocks=4, layout=layout)
    inputs = make_inputs(case, seed=51)
    E, B, H, nq, nk = case.E, case.batch, case.heads, case.n_q_blocks, case.n_kv_blocks
    rng = np.random.default_rng(52)
    block_map = rng.random((B, H, nq, nk)) < 0.5
    block_map[0, 0, 0] = False   # a query block that sees nothing: out 0, lse -inf
    block_map[0, 1, 1] = True    # one that sees everything (the empty KV block too)
    capacity = nk + 1
    idx = np.full((B, H, nq, capacity), 77, np.int32)  # junk past the count must be ignored
    num = block_map.sum(-1).astype(np.int32)
    for b, h, i in np.ndindex(B, H, nq):
        sel = np.flatnonzero(block_map[b, h, i])
        idx[b, h, i, :sel.size] = sel

    q, k, v, _, dout = jax_args(case, inputs)
    kv_counts = inputs["kv_counts"]

    def by_map(q, k, v):
        return vsa_jax.block_sparse_attn(q, k, v, jnp.asarray(block_map), kv_counts, E, layout=layout)

    def by_lists(q, k, v):
        return vsa_jax.block_sparse_attn_from_indices(q, k, v, jnp.asarray(idx), jnp.asarray(num), kv_counts, E,
                                                      layout=layout)

    # the float64 reference on the rounded inputs
    x = {n: round_to_dtype(inputs[n], "bfloat16") for n in ("q", "k", "v", "dout")}
    ref_out, ref_lse, ref_grads = block_sparse_attn_reference(x["q"], x["k"], x["v"], block_map, kv_counts, E,
                                                              dout=x["dout"])
    ref = {"out": ref_out, **ref_grads}

    results = []
    for fn in (by_map, by_lists):
        @jax.jit
        def run(q, k, v, dout):
            (out, lse), vjp = jax.vjp(fn, q, k, v)
            return out, lse, vjp((dout, jnp.ones_like(lse)))  # lse's cotangent is ignored (stop_gradient)

        out, lse, (dq, dk, dv) = run(q, k, v, dout)
        got = to_numpy(case, {"out": out, "dq": dq, "dk": dk, "dv": dv})
        assert_close(case, got, ref)
        lse, want_lse = np.asarray(lse), ref_lse
        assert np.array_equal(np.isinf(lse), np.isinf(want_lse))
        finite = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=0, atol=2e-2)
        assert (got["out"][0, 0, :E] == 0).all()
        results.append(got)
    for name in ref:
        assert np.array_equal(results[0][name], results[1][name]), f"map vs lists: {name}"


def test_tiling_helpers_match_numpy_metadata():
    meta = vsa_jax.build_vsa_metadata((3, 5, 9), (2, 4, 8))
    x = np.random.default_rng(0).standard_normal((2, meta.num_tokens, 8)).astype(np.float32)
    tiled = vsa_jax.to_tiled(jnp.asarray(x), meta, dim=1)
    assert np.array_equal(np.asarray(tiled), meta.to_tiled(x, axis=1))
    assert np.array_equal(np.asarray(vsa_jax.from_tiled(tiled, meta, dim=1)), x)
    assert np.array_equal(vsa_jax.variable_block_sizes((3, 5, 9), (2, 4, 8)), meta.variable_block_sizes)


# ---- GPU ----------------------------------------------------------------------------------
@pytest.mark.parametrize("launch", ["callback", "native"])
@pytest.mark.parametrize("case", [CASES[0], CASES[8]], ids=lambda c: c.id())
@pytest.mark.gpu
def test_gpu_kernels_run_on_xla_stream(case, launch, monkeypatch, launch_config):
    """jit(f) with XLA ops right before and after each launch and no synchronisation: correct
    results need the kernels on XLA's stream. The callback: a spy also checks that the fine
    kernels were launched while Triton's active driver answered the stream XLA handed over.
    The native launch: jaxlib's Triton custom calls, which launch on the stream XLA gives their
    FFI handler (the program holds them and no callback, and no callback ran)."""
    from triton.runtime import driver

    from vsa_core.backends import triton_backend
    from vsa_jax import native
    from vsa_jax import ops as jax_ops

    launch_config(jax_launch=launch)
    seen = []
    real_scope, real_sparse_forward = jax_ops.JAX_BUFFERS.launch_scope, triton_backend.sparse_forward

    def spy_scope(like, stream):
        seen.append(("given", stream))
        return real_scope(like, stream)

    def spy_sparse_forward(*args, **kwargs):
        device = driver.active.get_current_device()
        seen.append(("current", driver.active.get_current_stream(device)))
        return real_sparse_forward(*args, **kwargs)

    monkeypatch.setattr(jax_ops.JAX_BUFFERS, "launch_scope", spy_scope)
    monkeypatch.setattr(triton_backend, "sparse_forward", spy_sparse_forward)

    inputs = make_inputs(case, seed=seed_of(case))
    q, k, v, gate, dout = jax_args(case, inputs)
    f = vsa_fn(case, inputs["kv_counts"], inputs["q_counts"], backend="triton")

    @jax.jit
    def pipeline(q, k, v, gate, dout):
        # XLA ops right before and after each launch; the scalings by powers of 2 are exact
        q2, k2 = q * 2, k * 2
        g = lambda q2, k2, v, gate: f(q2 * 0.5, k2 * 0.5, v, gate) * 2  # noqa: E731
        out, vjp = jax.vjp(g, q2, k2, v, gate)
        dq2, dk2, dv, dgate = vjp(dout * 0.5)
        return out * 0.5, dq2 * 2, dk2 * 2, dv, dgate

    text = pipeline.lower(q, k, v, gate, dout).as_text()
    assert (f"@{native.FFI_TARGET}" in text) == (launch == "native") and ("callback" in text) == (launch == "callback")
    for i in range(3):
        out, dq, dk, dv, dgate = pipeline(q, k, v, gate, dout)
        got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
        if case.gate:
            got["dgate"] = dgate
        assert_close(case, to_numpy(case, got), reference(case, inputs))
        if i == 0 and launch == "native":
            del seen[:]  # the native launch records (and may tune) its plans when traced: Python then
    given = {s for tag, s in seen if tag == "given"}
    current = {s for tag, s in seen if tag == "current"}
    if launch == "native":
        assert not seen, seen  # no Python ran since: no callback, no eager launch
    else:
        assert None not in given and current and current <= given, seen
