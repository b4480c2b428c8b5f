"""vsa_jax.parallel (Ulysses with jax.lax.all_to_all) on 2 devices (CPU: two host devices,
see conftest; GPU: two GPUs), with shard_map's default checks. Output and gradients, put
back together, must equal the single-device VSA on the full sequence bitwise (each head
runs whole on one device through the same kernels) and the float64 reference within the
usual tolerance; bad shards raise ValueError at trace time. With prefix blocks
(prefix_blocks / prefix_mode, spanning one or both devices' shards) the same holds against
the one-device call with the same prefix."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vsa_jax
from common import Case, assert_close, make_inputs, reference, skip_unavailable
from test_jax_vsa import jax_args, to_numpy
from vsa_jax.parallel import ulysses_video_sparse_attn, ulysses_video_sparse_attn_on_mesh

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")

NAMES = ("out", "dq", "dk", "dv", "dgate")
CASES = [
    Case(batch=1, heads=2, n_q_blocks=4, n_kv_blocks=4, layout="bshd"),   # gate, partial and empty blocks
    Case(batch=2, heads=6, n_q_blocks=2, n_kv_blocks=4, topk=3, gate=False, layout="bshd", dtype="float16",
         block=(4, 4, 4)),                                                # Sq != Skv, 3 heads per device
]


# a prefix on device 0's shard only, and one across both devices' shards (2 blocks each)
PREFIX_CASE = Case(batch=1, heads=2, n_q_blocks=4, n_kv_blocks=4, layout="bshd", topk=1)
PREFIXES = [dict(prefix_blocks=1, prefix_mode="exempt"), dict(prefix_blocks=3, prefix_mode="compete")]


def seed_of(case: Case) -> int:
    return zlib.crc32(case.id().encode())


def prefix_id(prefix: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in prefix.items()) or "no-prefix"


def inputs_of(case: Case, prefix: dict, seed: int) -> dict:
    """With a prefix, a draw whose selection has no near-tie (test_prefix's; that module
    imports torch, so only the prefix tests load it)."""
    if prefix:
        from test_prefix import draw
        return draw(case, prefix["prefix_blocks"], prefix["prefix_mode"], seed)
    return make_inputs(case, seed)


def reference_of(case: Case, prefix: dict, inputs: dict) -> dict:
    if prefix:
        from test_prefix import prefix_reference
        return prefix_reference(case, inputs, prefix["prefix_blocks"], prefix["prefix_mode"])
    return reference(case, inputs)


def mesh_of():
    return jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2])


def out_and_grads(attend, case: Case):
    """(out, dq, dk, dv[, dgate]) of attend(q, k, v, gate) with cotangent dout."""
    def run(q, k, v, gate, dout):
        if not case.gate:
            out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, None), q, k, v)
        else:
            out, vjp = jax.vjp(attend, q, k, v, gate)
        return (out,) + vjp(dout)
    return run


def one_device(case: Case, inputs: dict, args, backend="auto", prefix=None) -> dict:
    """The single-device VSA on the full sequence (jitted on device 0), checked against
    the float64 reference."""
    prefix = prefix or {}

    def attend(q, k, v, gate):
        return vsa_jax.video_sparse_attn_bshd(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk,
                                              case.block, gate, backend=backend, **prefix)
    got = dict(zip(NAMES, jax.jit(out_and_grads(attend, case))(*args)))
    got = {n: np.asarray(x) for n, x in got.items()}
    assert_close(case, to_numpy(case, got), reference_of(case, prefix, inputs))
    return got


def assert_bitwise(got, want: dict, what: str, names=None):
    got = {n: np.asarray(x) for n, x in zip(NAMES, got)}
    assert set(got) == set(want)
    for name in names or want:
        g, w = got[name], want[name]
        assert np.array_equal(g, w), (f"{what}: {name} differs from one device, max diff "
                                      f"{np.abs(g.astype(np.float32) - w.astype(np.float32)).max():.3e}")


# ---- the one-line helper on global arrays --------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id())
def test_on_mesh_under_jit_equals_one_device(case):
    inputs = make_inputs(case, seed_of(case))
    args = jax_args(case, inputs)
    want = one_device(case, inputs, args)

    mesh = mesh_of()

    def attend(q, k, v, gate):
        return ulysses_video_sparse_attn_on_mesh(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk,
                                                 case.block, gate, mesh=mesh, axis_name="sp")
    tokens = NamedSharding(mesh, P(None, "sp"))
    got = jax.jit(out_and_grads(attend, case))(*(jax.device_put(x, tokens) for x in args))
    assert got[0].sharding.is_equivalent_to(tokens, 4)
    assert_bitwise(got, want, "ulysses_video_sparse_attn_on_mesh")


@pytest.mark.parametrize("prefix", PREFIXES, ids=prefix_id)
def test_prefix_on_mesh_under_jit_equals_one_device(prefix):
    """Prefix blocks at the start of the whole sequence: output and gradients (the gate's
    too: it is resharded with q, k and v) equal the one-device call with the same prefix."""
    case = PREFIX_CASE
    inputs = inputs_of(case, prefix, seed_of(case))
    args = jax_args(case, inputs)
    want = one_device(case, inputs, args, prefix=prefix)
    mesh = mesh_of()

    def attend(q, k, v, gate):
        return ulysses_video_sparse_attn_on_mesh(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk,
                                                 case.block, gate, mesh=mesh, axis_name="sp", **prefix)
    tokens = NamedSharding(mesh, P(None, "sp"))
    got = jax.jit(out_and_grads(attend, case))(*(jax.device_put(x, tokens) for x in args))
    assert_bitwise(got, want, f"ulysses_video_sparse_attn_on_mesh with {prefix_id(prefix)}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_on_mesh_ignore_padding_with_non_finite_shards():
    """padding="ignore" through the all-to-alls: NaN / inf in every padded row of the shards
    gives bit for bit the single-device results of zero padding."""
    from test_padding import with_non_finite_padding
    case = CASES[0]
    inputs = make_inputs(case, seed_of(case))
    mesh = mesh_of()

    def attend_on(sharded):
        def attend(q, k, v, gate):
            kw = dict(mesh=mesh, axis_name="sp") if sharded else {}
            fn = ulysses_video_sparse_attn_on_mesh if sharded else vsa_jax.video_sparse_attn_bshd
            return fn(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk, case.block, gate, padding="ignore",
                      **kw)
        return attend
    want = jax.jit(out_and_grads(attend_on(False), case))(*jax_args(case, inputs))
    tokens = NamedSharding(mesh, P(None, "sp"))
    junk = jax_args(case, with_non_finite_padding(inputs, case.E))
    got = jax.jit(out_and_grads(attend_on(True), case))(*(jax.device_put(x, tokens) for x in junk))
    assert_bitwise(got, {n: np.asarray(x) for n, x in zip(NAMES, want)}, "ulysses with padding='ignore'")
    assert_close(case, to_numpy(case, dict(zip(NAMES, got))), reference(case, inputs, "ignore"))


def test_on_mesh_eager_forward_equals_one_device():
    """Eager (un-jitted) call on unsharded arrays: the helper reshards them itself."""
    case = CASES[0]
    inputs = make_inputs(case, seed_of(case) + 1)
    q, k, v, gate, _ = jax_args(case, inputs)
    got = ulysses_video_sparse_attn_on_mesh(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk,
                                            case.block, gate, mesh=mesh_of(), axis_name="sp")
    want = vsa_jax.video_sparse_attn_bshd(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk,
                                          case.block, gate)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    assert_close(case, to_numpy(case, {"out": got}), {"out": reference(case, inputs)["out"]})


def test_on_mesh_with_a_batch_axis():
    """A 2-D mesh ("dp" x "sp" = 1 x 2): the batch split over "dp", the sequence over "sp"."""
    case = Case(batch=2, heads=2, n_q_blocks=2, n_kv_blocks=2, topk=1, layout="bshd")
    inputs = make_inputs(case, seed_of(case))
    q, k, v, gate, _ = jax_args(case, inputs)
    mesh = jax.make_mesh((1, 2), ("dp", "sp"), devices=jax.devices()[:2])
    run = jax.jit(lambda q, k, v, gate: ulysses_video_sparse_attn_on_mesh(
        q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk, case.block, gate, mesh=mesh, axis_name="sp",
        batch_axis_name="dp"))
    got = run(q, k, v, gate)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "sp")), 4)
    want = vsa_jax.video_sparse_attn_bshd(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk, case.block,
                                          gate)
    assert np.array_equal(np.asarray(got), np.asarray(want))


# ---- inside the user's own shard_map ---------------------------------------------------------
def test_grad_of_a_loss_inside_shard_map_with_traced_counts():
    """jax.grad of a per-device loss inside jax.shard_map (default checks), the counts passed
    in replicated and traced: gradients equal those of the one-device loss."""
    case = CASES[0]
    inputs = make_inputs(case, seed_of(case) + 2)
    q, k, v, gate, dout = jax_args(case, inputs)
    kv_counts, q_counts = (jnp.asarray(inputs[n], jnp.int32) for n in ("kv_counts", "q_counts"))

    def loss_of(attend):
        def loss(q, k, v, gate, dout, kv_counts, q_counts):
            out = attend(q, k, v, kv_counts, q_counts, case.topk, case.block, gate)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2, 3))

    want = jax.jit(loss_of(vsa_jax.video_sparse_attn_bshd))(q, k, v, gate, dout, kv_counts, q_counts)

    mesh, tokens, rep = mesh_of(), P(None, "sp"), P()
    sharded_grad = loss_of(lambda *a: ulysses_video_sparse_attn(*a, axis_name="sp"))
    run = jax.jit(jax.shard_map(sharded_grad, mesh=mesh, in_specs=(tokens,) * 5 + (rep, rep),
                                out_specs=(tokens,) * 4))
    place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    got = run(*(place(x, tokens) for x in (q, k, v, gate, dout)), place(kv_counts, rep), place(q_counts, rep))
    for name, g, w in zip(("dq", "dk", "dv", "dgate"), got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w)), name


# ---- bad shards ----------------------------------------------------------------------------------
def _trace_in_shard_map(seq_len: int, heads: int, n_blocks: int, **kw):
    """Traces ulysses_video_sparse_attn in a shard_map over global [1, seq_len, heads, 64] arrays."""
    mesh, spec = mesh_of(), P(None, "sp")
    x = jax.ShapeDtypeStruct((1, seq_len, heads, 64), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    counts = np.full(n_blocks, 64)

    def attend(q, k, v):
        return ulysses_video_sparse_attn(q, k, v, counts, counts, 1, 64, axis_name="sp", **kw)
    jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)).trace(x, x, x)


@pytest.mark.parametrize("seq_len, heads, n_blocks, match", [
    (128, 3, 2, "q has 3 heads, not divisible by the group size 2"),
    (192, 2, 3, "q's shard holds 96 tokens, not a whole number of 64-token blocks"),
    (128, 2, 3, "q_variable_block_sizes describes 3 blocks = 192 tokens, but 2 devices x 64-token q shards"),
])
def test_bad_shards_raise_at_trace_time(seq_len, heads, n_blocks, match):
    with pytest.raises(ValueError, match=match):
        _trace_in_shard_map(seq_len, heads, n_blocks)


@pytest.mark.parametrize("seq_len, n_blocks, kw, match", [
    (128, 2, dict(prefix_blocks=3), r"prefix_blocks \(3\) must not exceed the number of blocks of the sequence \(2\)"),
    (128, 2, dict(prefix_blocks=1, prefix_mode="dense"), r"prefix_mode must be one of \('exempt', 'compete'\)"),
    (128, 2, dict(prefix_blocks=-1), "prefix_blocks must be >= 0, got -1"),
])
def test_bad_prefixes_raise_at_trace_time(seq_len, n_blocks, kw, match):
    """The words of video_sparse_attn (and of the torch helper: tests/test_parallel_torch.py)."""
    with pytest.raises(ValueError, match=match):
        _trace_in_shard_map(seq_len, 2, n_blocks, **kw)


def test_on_mesh_bad_arguments():
    x = jnp.zeros((1, 192, 2, 64), jnp.bfloat16)
    counts = np.full(3, 64)
    with pytest.raises(ValueError, match="does not split into 2 equal shards"):
        ulysses_video_sparse_attn_on_mesh(x[:, :129], x[:, :129], x[:, :129], counts, counts, 1, mesh=mesh_of(),
                                          axis_name="sp")
    with pytest.raises(ValueError, match="axis_name 'seq' is not an axis of the mesh"):
        ulysses_video_sparse_attn_on_mesh(x, x, x, counts, counts, 1, mesh=mesh_of(), axis_name="seq")
    with pytest.raises(ValueError, match=r"variable_block_sizes values must lie in \[0, 64\]"):
        ulysses_video_sparse_attn_on_mesh(x, x, x, np.full(3, 65), counts, 1, mesh=mesh_of(), axis_name="sp")


# ---- GPU: both backends ----------------------------------------------------------------------------
GPU_JOBS = [  # (case, backend, prefix keywords)
    (Case(batch=1, heads=4, n_q_blocks=8, n_kv_blocks=8, topk=3, layout="bshd"), "triton", {}),
    (Case(block=128, batch=1, heads=4, n_q_blocks=6, n_kv_blocks=6, topk=3, layout="bshd", head_dim=128), "cute",
     {}),
    (Case(block=256, batch=2, heads=2, n_q_blocks=4, n_kv_blocks=4, topk=2, layout="bshd"), "cute", {}),
    # prefixes across both devices' shards (4 and 3 blocks each)
    (Case(batch=1, heads=4, n_q_blocks=8, n_kv_blocks=8, topk=2, layout="bshd"), "triton",
     dict(prefix_blocks=5, prefix_mode="exempt")),
    (Case(block=128, batch=1, heads=4, n_q_blocks=6, n_kv_blocks=6, topk=2, layout="bshd", head_dim=128), "cute",
     dict(prefix_blocks=4, prefix_mode="compete")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("job", range(len(GPU_JOBS)),
                         ids=lambda j: f"{GPU_JOBS[j][1]}-{GPU_JOBS[j][0].id()}-{prefix_id(GPU_JOBS[j][2])}")
def test_gpu_on_mesh_equals_one_device(job):
    case, backend, prefix = GPU_JOBS[job]
    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX on 2 GPUs")
    if backend == "cute":
        from test_cute_backend import _cute_reason
        reason = _cute_reason(case)
        skip_unavailable("cute", reason and f"cute backend unavailable: {reason}")
    inputs = inputs_of(case, prefix, seed_of(case))
    args = jax_args(case, inputs)
    want = one_device(case, inputs, args, backend=backend, prefix=prefix)
    again = one_device(case, inputs, args, backend=backend, prefix=prefix)
    # bitwise wherever one device reproduces its own bits (FA4's dQ sums fp32 atomics in a
    # varying order); every result is within the reference's tolerance either way
    reproducible = [n for n in want if np.array_equal(want[n], again[n])]
    assert "out" in reproducible

    mesh = mesh_of()

    def attend(q, k, v, gate):
        return ulysses_video_sparse_attn_on_mesh(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk,
                                                 case.block, gate, mesh=mesh, axis_name="sp", backend=backend,
                                                 **prefix)
    tokens = NamedSharding(mesh, P(None, "sp"))
    got = jax.jit(out_and_grads(attend, case))(*(jax.device_put(x, tokens) for x in args))
    assert_bitwise(got, want, f"{backend} on 2 GPUs", names=reproducible)
    assert_close(case, to_numpy(case, {n: np.asarray(x) for n, x in zip(NAMES, got)}),
                 reference_of(case, prefix, inputs))
