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
from common import Case, assert_close, make_inputs, reference
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
        assert np.array_equal(g, w), f"{what}: {name} differs, max diff {np.abs(g.astype(np.float32) - w):.3e}"


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
