"""vsa_jax over several devices: jax.shard_map (with its default type checks) and jit over
sharded arrays, split over the batch or the heads, forward and gradients, bit for bit equal to
the same call on one device (and close to the float64 reference).

CPU: two host devices (conftest sets XLA_FLAGS=--xla_force_host_platform_device_count=2), whose
buffer callbacks run on two threads; the core serialises the Triton interpreter. GPU: needs two
GPUs (each shard runs the same Triton kernels on its own device)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import vsa_jax
from common import Case, assert_close, make_inputs, reference, skip_unavailable
from test_jax_vsa import jax_args, to_numpy, vsa_fn

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")

CASE = Case(batch=2, heads=2, n_q_blocks=2, n_kv_blocks=3)
NAMES = ("out", "dq", "dk", "dv", "dgate")


def mesh_of(axis_type=AxisType.Explicit):
    return jax.make_mesh((2,), ("x",), axis_types=(axis_type,), devices=jax.devices()[:2])


def split_spec(layout: str, over: str) -> P:
    """The PartitionSpec that splits the batch or the heads axis over mesh axis "x"."""
    axis = 0 if over == "batch" else (1 if layout == "bhsd" else 2)
    return P(*([None] * axis + ["x"]))


def out_and_grads_fn(case: Case, kv_counts, q_counts, **kw):
    f = vsa_fn(case, kv_counts, q_counts, **kw)

    def out_and_grads(q, k, v, gate, dout):
        out, vjp = jax.vjp(f, q, k, v, gate)
        return (out,) + vjp(dout)
    return out_and_grads


def assert_bitwise(got, want, what):
    for name, g, w in zip(NAMES, got, want):
        g, w = np.asarray(g), np.asarray(w)
        diff = np.abs(g.astype(np.float32) - w.astype(np.float32)).max()
        assert np.array_equal(g, w), f"{what}: {name} differs, max diff {diff:.3e}"


def one_device(case, inputs, args):
    """The reference run: the same function, jitted on one device."""
    fn = out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"])
    want = [np.asarray(x) for x in jax.jit(fn)(*args)]
    got = dict(zip(NAMES, want))
    if not case.gate:
        del got["dgate"]
    assert_close(case, to_numpy(case, got), reference(case, inputs))
    return want


# ---- shard_map ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout,over", [("bhsd", "heads"), ("bhsd", "batch"), ("bshd", "heads")])
def test_shard_map_forward_and_grad_equal_one_device(layout, over):
    """jax.vjp inside shard_map (check_vma on, the default): each device runs the op on its
    shard; the counts are numpy constants (invariant over the mesh), the arrays vary."""
    case = Case(batch=2, heads=2, n_q_blocks=2, n_kv_blocks=3, layout=layout)
    inputs = make_inputs(case, seed=61)
    args = jax_args(case, inputs)
    want = one_device(case, inputs, args)

    mesh, spec = mesh_of(), split_spec(layout, over)
    fn = out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"])
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5))
    got = sharded(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in args))
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    assert_bitwise(got, want, f"shard_map over {over}")


def test_shard_map_grad_of_a_loss_with_traced_counts():
    """jax.grad of a scalar loss inside shard_map, the counts passed in (replicated, traced)
    and one input (v) replicated while q, k, gate are split over the heads: JAX sums v's
    per-device gradients (the transpose of the cast that makes v vary like q)."""
    case = CASE
    inputs = make_inputs(case, seed=62)
    q, k, v, gate, dout = jax_args(case, inputs)
    kv_counts, q_counts = (jnp.asarray(inputs[n], jnp.int32) for n in ("kv_counts", "q_counts"))
    v_shared = v[:, :1]  # one head of v for both heads (broadcast below), so dv sums both heads

    def loss(q, k, v1, gate, dout, kv_counts, q_counts):
        v = jnp.broadcast_to(v1, q.shape[:2] + v1.shape[2:])
        out = vsa_jax.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    want = jax.jit(grad)(q, k, v_shared, gate, dout, kv_counts, q_counts)

    mesh, spec, rep = mesh_of(), P(None, "x"), P()

    # the loss is per device; v's gradient comes out invariant, summed over the devices
    sharded = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(spec, spec, rep, spec, spec, rep, rep),
                                    out_specs=(spec, spec, rep, spec)))
    place = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    got = sharded(place(q, spec), place(k, spec), place(v_shared, rep), place(gate, spec), place(dout, spec),
                  place(kv_counts, rep), place(q_counts, rep))
    for name, g, w in zip(("dq", "dk", "dv", "dgate"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name == "dv":  # a sum of two bf16 per-device partials: one rounding apart at most
            np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2)
        else:
            assert np.array_equal(g, w), name


def test_shard_map_block_sparse_attn():
    """block_sparse_attn (bool map, sharded like q) inside shard_map: out, lse and grads."""
    case = CASE
    inputs = make_inputs(case, seed=63)
    q, k, v, _, dout = jax_args(case, inputs)
    block_map = jnp.asarray(np.random.default_rng(64).random((2, 2, case.n_q_blocks, case.n_kv_blocks)) < 0.6)

    def fn(q, k, v, block_map, dout):
        (out, lse), vjp = jax.vjp(lambda q, k, v: vsa_jax.block_sparse_attn(q, k, v, block_map,
                                                                          inputs["kv_counts"], case.E), q, k, v)
        return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

    want = jax.jit(fn)(q, k, v, block_map, dout)
    mesh, spec = mesh_of(), P(None, "x")
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5))
    got = sharded(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, block_map, dout)))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w)), name


# ---- jit over sharded arrays (explicit mesh axes) -----------------------------------------
@pytest.fixture
def local_problems(monkeypatch):
    """The AttnProblems the callbacks ran with (their shapes are the per-device shapes)."""
    from vsa_jax import ops

    seen, real_run = [], ops._run

    def spy_run(stage, p, impl, **inputs):
        seen.append(p)
        return real_run(stage, p, impl, **inputs)

    monkeypatch.setattr(ops, "_run", spy_run)
    return seen


@pytest.mark.parametrize("layout,over", [("bhsd", "heads"), ("bhsd", "batch"), ("bshd", "heads"),
                                         ("bshd", "batch")])
def test_jit_over_sharded_arrays_splits_and_equals_one_device(layout, over, local_problems):
    """jax.jit(jax.value_and_grad) on arrays sharded over the batch or the heads (an explicit
    mesh: jax.make_mesh's default): the op runs per device on its slice (each callback sees
    half the batch or half the heads: nothing is gathered), the output keeps the inputs'
    sharding, and out and the gradients equal the one-device call bit for bit."""
    case = Case(batch=2, heads=2, n_q_blocks=2, n_kv_blocks=3, layout=layout)
    inputs = make_inputs(case, seed=71)
    args = jax_args(case, inputs)
    f = vsa_fn(case, inputs["kv_counts"], inputs["q_counts"])

    def loss(q, k, v, gate, dout):
        out = f(q, k, v, gate)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = step(*args)
    want = [np.asarray(x) for x in (out, *grads)]
    assert_close(case, to_numpy(case, dict(zip(NAMES, want))), reference(case, inputs))
    assert {(p.batch, p.heads) for p in local_problems} == {(2, 2)}
    local_problems.clear()

    mesh, spec = mesh_of(), split_spec(layout, over)
    (_, out), grads = step(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in args))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    assert_bitwise((out, *grads), want, f"jit over {over}")
    halves = (1, 2) if over == "batch" else (2, 1)
    assert local_problems and {(p.batch, p.heads) for p in local_problems} == {halves}


def test_jit_over_arrays_sharded_over_batch_and_heads_on_a_2d_mesh(local_problems):
    """Batch over mesh axis "y" (size 1 here: 2 devices) and heads over "x", both at once:
    the split names both axes; results equal one device bit for bit."""
    case = CASE
    inputs = make_inputs(case, seed=75)
    args = jax_args(case, inputs)
    fn = jax.jit(out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"]))
    want = [np.asarray(x) for x in fn(*args)]
    mesh = jax.make_mesh((1, 2), ("y", "x"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:2])
    spec = P("y", "x")
    local_problems.clear()
    got = fn(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in args))
    assert {(p.batch, p.heads) for p in local_problems} == {(2, 1)}
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    assert_bitwise(got, want, "jit over batch and heads")


def test_jit_over_sharded_arrays_block_sparse_attn_from_indices(local_problems):
    """block_sparse_attn_from_indices with q, k, v and the lists sharded over the heads."""
    case = CASE
    inputs = make_inputs(case, seed=72)
    q, k, v, _, dout = jax_args(case, inputs)
    rng = np.random.default_rng(73)
    block_map = rng.random((2, 2, case.n_q_blocks, case.n_kv_blocks)) < 0.6
    idx = np.zeros((2, 2, case.n_q_blocks, case.n_kv_blocks), np.int32)
    for b, h, i in np.ndindex(*block_map.shape[:3]):
        sel = np.flatnonzero(block_map[b, h, i])
        idx[b, h, i, :sel.size] = sel
    num = block_map.sum(-1).astype(np.int32)

    @jax.jit
    def fn(q, k, v, idx, num, dout):
        (out, lse), vjp = jax.vjp(lambda q, k, v: vsa_jax.block_sparse_attn_from_indices(
            q, k, v, idx, num, inputs["kv_counts"], case.E), q, k, v)
        return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

    args = (q, k, v, jnp.asarray(idx), jnp.asarray(num), dout)
    want = fn(*args)
    mesh = mesh_of()
    local_problems.clear()
    got = fn(*(jax.device_put(x, NamedSharding(mesh, P(None, "x"))) for x in args))
    assert {p.heads for p in local_problems} == {1}
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x")), 3)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w)), name


def _sharded(shape, spec, mesh):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))


BAD_SPLITS = {
    # name: (q's shape, q's spec, k's spec (None: q's), words of the message)
    "sequence split mid-block": ((1, 2, 192, 64), P(None, None, "x"), None,
                                 r"q is sharded along its sequence axis .*96 tokens per shard, which splits the "
                                 r"64-token blocks"),
    "sequence split on blocks": ((1, 2, 256, 64), P(None, None, "x"), None,
                                 r"q is sharded along its sequence axis .*128 tokens per shard\): video sparse "
                                 r"attention partitions over batch and heads only"),
    "head dim split": ((1, 2, 128, 64), P(None, None, None, "x"), None,
                       r"q may be split over its batch and heads axes only, got its head dim axis over mesh axes \('x',\)"),
    "k split unlike q": ((2, 2, 128, 64), P("x"), P(None, "x"),
                         r"k must be split like q \(batch over mesh axes \('x',\), heads over no mesh axis"),
    "k split, q not": ((2, 2, 128, 64), P(), P("x"), r"k is split over devices but q is not"),
    "heads not divisible": ((1, 3, 128, 64), P(None, "x"), None, r"does not evenly divide the dimension size 3"),
}


@pytest.mark.parametrize("name", BAD_SPLITS)
def test_bad_sharding_raises_at_trace_time(name):
    """Shardings the op cannot partition along raise while tracing (eval_shape: no data, no
    kernel), naming the argument. Heads (or batch) that the mesh axis does not divide are
    refused by JAX itself when the sharded type is formed, also at trace time."""
    shape, q_spec, k_spec, words = BAD_SPLITS[name]
    mesh = mesh_of()
    counts = np.full(shape[2] // 64, 64)
    with pytest.raises(ValueError, match=words):
        q = _sharded(shape, q_spec, mesh)
        k = _sharded(shape, k_spec if k_spec is not None else q_spec, mesh)
        jax.eval_shape(lambda q, k: vsa_jax.video_sparse_attn(q, k, k, counts, counts, 1), q, k)


def test_shard_map_splitting_a_block_raises_at_trace_time():
    """Inside shard_map each device sees its shard: a sequence split that cuts a block
    leaves a local length that is no multiple of the block, refused while tracing."""
    mesh = mesh_of()
    q = _sharded((1, 2, 192, 64), P(None, None, "x"), mesh)
    counts = np.full(3, 64)
    f = jax.shard_map(lambda q: vsa_jax.video_sparse_attn(q, q, q, counts, counts, 1), mesh=mesh,
                      in_specs=P(None, None, "x"), out_specs=P(None, None, "x"))
    with pytest.raises(ValueError, match="q sequence length must be a positive multiple of the block size 64, "
                                         "got 96"):
        jax.eval_shape(f, q)


def test_auto_axes_under_jit_are_not_split():
    """Documented limit: with auto mesh axes (jax.sharding.Mesh's default) the sharding is
    chosen after tracing, so the call is not split (but still correct)."""
    case = CASE
    inputs = make_inputs(case, seed=74)
    q, k, v, gate, _ = jax_args(case, inputs)
    f = jax.jit(vsa_fn(case, inputs["kv_counts"], inputs["q_counts"]))
    want = np.asarray(f(q, k, v, gate))
    mesh = mesh_of(AxisType.Auto)
    got = f(*(jax.device_put(x, NamedSharding(mesh, P(None, "x"))) for x in (q, k, v, gate)))
    assert np.array_equal(np.asarray(got), want)


# ---- two GPUs -----------------------------------------------------------------------------
GPU_CASES = {
    "triton": Case(block=64, head_dim=128, n_q_blocks=32, n_kv_blocks=32, batch=1, heads=4, topk=8),
    "cute": Case(block=128, head_dim=128, n_q_blocks=16, n_kv_blocks=16, batch=1, heads=4, topk=4),
}


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2, reason="needs 2 GPUs in jax")
@pytest.mark.parametrize("how", ["shard_map", "jit"])
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_two_gpus_heads_split_equal_one_gpu(backend, how):
    """2 x GPU, heads split (S = 2048 tokens): each GPU runs its heads on its own stream.
    Triton: bit for bit equal to one GPU (the autotuner's key has no batch/heads, so both
    run the same tile config). FA4: dQ within tolerance (atomics), the rest bit for bit.
    The inputs skip make_inputs' top-k margin: with 128 rows of 32 blocks a draw almost never
    has every row's margin above 1e-4, and this test compares two runs of the same kernels,
    not the reference (the tests on small cases compare one GPU with the reference)."""
    from vsa_core.backends import BackendUnavailableError

    case = GPU_CASES[backend]
    inputs = make_inputs(case, seed=81, margin=None)
    args = jax_args(case, inputs)
    fn = out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"], backend=backend)
    try:
        want = [np.asarray(x) for x in jax.jit(fn)(*args)]
    except BackendUnavailableError as e:
        skip_unavailable(backend, f"{backend} backend unavailable: {e}")
    assert all(np.isfinite(np.asarray(w, np.float32)).all() for w in want), "non-finite values on one GPU"

    mesh, spec = mesh_of(), P(None, "x")
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
    if how == "shard_map":
        run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5))
    else:
        run = jax.jit(fn)
    for _ in range(2):  # the second call reuses the compiled kernels and the executable
        got = [np.asarray(x) for x in run(*placed)]
        for name, g, w in zip(NAMES, got, want):
            if backend == "cute" and name == "dq":
                assert_close(case, {name: g.astype(np.float32)}, {name: w.astype(np.float64)})
            else:
                diff = np.abs(g.astype(np.float32) - w.astype(np.float32)).max()
                assert np.array_equal(g, w), f"{name}: max diff {diff:.3e}"
