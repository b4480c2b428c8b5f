"""The launch plan (vsa_core.plan) and the native JAX launch path (vsa_jax.native).

CPU: the plan's contents (launch sequence, buffers, grids) and its schedule onto custom
calls, the jitted program's custom calls (lowered, not run), compiling every launch to a
cubin for sm_90 (in a subprocess: the compiler cannot run under TRITON_INTERPRET), and
that the callback path stays the default and is untouched by recording.
GPU: native == callback == torch bit for bit (out and grads, under jit), also under XLA
command buffers (CUDA graphs) with fresh inputs on every replay.
"""

import os
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import vsa_jax
import vsa_torch
from common import Case, assert_close, from_layout, make_inputs, reference, skip_unavailable, to_layout
from vsa_core import plan as core_plan
from vsa_core.backends import triton_backend as T
from vsa_core.config import config, from_environment, overridden
from vsa_core.problem import AttnProblem
from vsa_jax import native

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

POOL, COARSE_FWD, TOPK, SPARSE_FWD = ("block_mean_pool_qkv_kernel", "coarse_attn_fwd_kernel", "topk_select_kernel",
                                      "sparse_attn_fwd_kernel")
BACKWARD_KERNELS = ["columns_to_lists_kernel", "sparse_attn_bwd_preprocess_kernel", "coarse_attn_bwd_ds_kernel",
                    "coarse_attn_bwd_grads_kernel", "sparse_attn_bwd_dq_kernel", "sparse_attn_bwd_dkdv_kernel"]

PROBLEMS = [
    AttnProblem(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16", topk=2,
                has_gate=True),
    AttnProblem(batch=2, heads=3, q_len=384, kv_len=256, head_dim=128, block_elems=128, dtype="float16", topk=1,
                layout="bshd"),
    AttnProblem(batch=1, heads=2, q_len=512, kv_len=512, head_dim=64, block_elems=64, dtype="bfloat16", topk=3,
                training=False),
]


def _plan(stage, p):
    inputs = core_plan.forward_inputs(p) if stage == "forward" else core_plan.backward_inputs(p)
    return core_plan.record_plan(stage, p, inputs)


# ---- the plan (CPU) ---------------------------------------------------------------------------
@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: f"E{p.block_elems}-{p.layout}-{'train' if p.training else 'infer'}")
def test_forward_plan_contents(p):
    plan = _plan("forward", p)
    assert [l.kernel_name for l in plan.launches] == [POOL, COARSE_FWD, TOPK, SPARSE_FWD]
    bh = p.batch * p.heads
    pool, coarse, topk, sparse = plan.launches
    assert pool.buffers == ("q", "k", "v", "q_counts", "kv_counts", "q_pool", "k_pool", "v_pool")
    assert pool.grid == (p.n_q_blocks + 2 * p.n_kv_blocks, bh, 1)
    assert coarse.buffers == ("q_pool", "k_pool", "v_pool", "kv_counts", "scores", "out_coarse", "lse_coarse")
    assert coarse.grid[1:] == (bh, 1)
    assert topk.buffers == ("scores", "sel_idx", "sel_num", "sel_mask") and topk.grid == (bh * p.n_q_blocks, 1, 1)
    assert topk.arg("topk").value == p.topk
    gate = ("gate",) if p.has_gate else ()
    fine = "out_fine" if p.training else "lse"  # lse stands in for the absent out_fine (never written)
    assert sparse.buffers == ("q", "k", "v", "out", "lse", "sel_idx", "sel_num", "kv_counts", "q_counts", *gate,
                              "out_coarse", fine)
    assert sparse.arg("store_fine").value == int(p.training)
    block_m = sparse.arg("BLOCK_M").value
    assert p.block_elems % block_m == 0 and sparse.grid == (p.q_len // block_m, bh, 1)
    assert sparse.arg("USE_TMA").value is False  # pointer loads: a replay has no host descriptors
    assert set(plan.buffers) == set(p.forward_buffers())
    # strides as the launcher computes them for the layout
    assert sparse.arg("stride_qs").value == p.token_strides(p.q_len)[2]


@pytest.mark.parametrize("p", PROBLEMS[:2], ids=["E64-gate", "E128-bshd"])
def test_backward_plan_contents(p):
    plan = _plan("backward", p)
    assert [l.kernel_name for l in plan.launches] == BACKWARD_KERNELS
    lists, pre, coarse_ds, coarse_grads, dq, dkdv = plan.launches
    assert coarse_ds.buffers[-2:] == ("p_coarse", "ds_coarse")
    assert coarse_grads.buffers == ("q_pool", "k_pool", "dout_coarse", "p_coarse", "ds_coarse", "dq_pool", "dk_pool",
                                    "dv_pool")
    cols = lists.arg("COLS").value
    assert lists.buffers == ("sel_mask", "inv_idx", "inv_num") and lists.grid == (-(-p.n_kv_blocks // cols),
                                                                                  p.batch * p.heads, 1)
    assert dq.buffers[:7] == ("q", "k", "v", "dout", "lse", "delta", "dq")
    assert dkdv.buffers[6:8] == ("dk", "dv")
    assert dkdv.grid == (p.kv_len // dkdv.arg("BLOCK_N").value, p.batch * p.heads, 1)
    assert set(plan.buffers) == set(p.backward_buffers())
    assert "scores" not in plan.inputs


@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_plan_compiles_the_padding_in(padding):
    """The padding mode is a static of the problem: every pooling and fine-stage launch of
    the plan carries it as the constexpr IGNORE_PADDING (so the native path runs it too)."""
    import dataclasses
    p = dataclasses.replace(PROBLEMS[0], padding=padding)
    for stage in ("forward", "backward"):
        launches = [l for l in _plan(stage, p).launches if l.kernel_name.startswith(("sparse_", "block_mean"))]
        assert len(launches) == (2 if stage == "forward" else 3)
        for launch in launches:
            assert launch.arg("IGNORE_PADDING") == core_plan.Arg("IGNORE_PADDING", "constexpr", padding == "ignore")


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: f"E{p.block_elems}-{p.layout}-{'train' if p.training else 'infer'}")
def test_schedule_feeds_each_kernel_its_buffers(stage, p):
    """Each custom call hands its buffers (operands, then results) to the kernel's pointer
    parameters in order; every output/workspace is born once, inputs are never results,
    and in-place results alias the operand of the same buffer."""
    if stage == "backward" and not p.training:
        pytest.skip("no backward for an inference forward")
    plan = _plan(stage, p)
    steps = core_plan.schedule(plan)
    assert len(steps) == len(plan.launches)
    born = []
    for step, launch in zip(steps, plan.launches):
        assert step.operands + step.results[:step.n_param_results] == launch.buffers
        assert not set(step.results) & set(plan.inputs)
        for operand, result in step.aliases:
            assert step.operands[operand] == step.results[result]
        aliased = {step.results[r] for _, r in step.aliases}
        new = [b for b in step.results if b not in aliased]
        assert not set(new) & set(born), f"{launch.kernel_name} re-allocates {set(new) & set(born)}"
        born += new
        # an operand is an input or was born before
        assert all(b in plan.inputs or b in born for b in step.operands)
    assert sorted(born) == sorted(plan.buffers)


def test_recording_patches_nothing():
    """Recording goes through its own launcher: Triton's kernel classes and the process's
    launch configuration are the same before and after, and the plan still takes the
    default tiles with pointer loads while the configuration asks for TMA and autotuning."""
    from vsa_core import stage_kernels as K
    kernel_type = type(K.topk_select_kernel)
    getitem = kernel_type.__getitem__
    with overridden(tma=True, autotune=True) as before:
        plan = _plan("forward", PROBLEMS[0])
        assert kernel_type.__getitem__ is getitem and config() is before
    sparse = next(launch for launch in plan.launches if launch.kernel_name == SPARSE_FWD)
    assert sparse.arg("USE_TMA").value is False


# ---- the JAX executor (CPU: lowered, not run) ----------------------------------------------------
def test_callback_stays_the_default(launch_config):
    assert from_environment({}).jax_launch == "callback"
    launch_config(jax_launch=from_environment({}).jax_launch)
    assert native.launch_mode() == "callback"
    assert not native.selected(T)
    with pytest.raises(ValueError, match="launch"):
        vsa_jax.set_launch("graph")


def _small_case_args(case):
    inputs = make_inputs(case, seed=7)
    dtype = jnp.dtype(case.dtype)
    arrays = [jnp.asarray(to_layout(inputs[n], case.layout), dtype) for n in ("q", "k", "v", "gate", "dout")]
    return inputs, arrays


def _grad_fn(case, inputs, backend="triton"):
    fn = vsa_jax.video_sparse_attn if case.layout == "bhsd" else vsa_jax.video_sparse_attn_bshd

    def loss(q, k, v, gate, dout):
        out = fn(q, k, v, inputs["kv_counts"], inputs["q_counts"], case.topk, case.block,
                 gate if case.gate else None, backend=backend, softmax_scale=case.softmax_scale)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


def test_native_on_cpu_raises_a_clear_error(launch_config):
    launch_config(jax_launch="native")
    case = Case(batch=1, heads=1, n_q_blocks=2, n_kv_blocks=2)
    inputs, (q, k, v, gate, dout) = _small_case_args(case)
    if jax.default_backend() == "gpu":
        pytest.skip("CPU behaviour")
    with pytest.raises(RuntimeError, match="CUDA device"):
        jax.jit(_grad_fn(case, inputs)).lower(q, k, v, gate, dout)


def test_native_program_is_one_custom_call_per_launch(monkeypatch, launch_config):
    """Traced with compiling stubbed out (no CUDA here): forward + backward lower to the
    plans' launches as triton_kernel_call_ffi custom calls with in-place aliases, and no
    Python callback."""
    launch_config(jax_launch="native")
    monkeypatch.setattr(native, "_capability", lambda: 90)
    monkeypatch.setattr(native.core_plan, "compile_launch",
                        lambda launch, plan, capability: types.SimpleNamespace(name=launch.kernel_name))
    monkeypatch.setattr(native, "_kernel_call", lambda compiled, capability: compiled.name.encode())
    native.native_program.cache_clear()
    try:
        case = Case(batch=1, heads=2, n_q_blocks=2, n_kv_blocks=3)
        inputs, (q, k, v, gate, dout) = _small_case_args(case)
        text = jax.jit(_grad_fn(case, inputs)).lower(q, k, v, gate, dout).as_text()
    finally:
        native.native_program.cache_clear()
    assert text.count(f"@{native.FFI_TARGET}") == 10, text.count(f"@{native.FFI_TARGET}")
    for name in [POOL, COARSE_FWD, TOPK, SPARSE_FWD] + BACKWARD_KERNELS:
        assert name in text
    assert "output_operand_aliases" in text
    assert "callback" not in text


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_native_program_under_shard_map_is_typed_and_lowers(monkeypatch, launch_config):
    """Native launches inside jax.shard_map (check_vma on) over 2 devices, heads split, traced
    and lowered with compiling stubbed out (no CUDA here): the custom calls' results are
    typed as varying like the inputs (vsa_jax.ops._run), so the out_specs type-check, and
    each device runs the plan of its local shapes (heads / 2)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from test_jax_spmd import mesh_of, out_and_grads_fn

    launch_config(jax_launch="native")
    monkeypatch.setattr(native, "_capability", lambda: 90)
    monkeypatch.setattr(native.core_plan, "compile_launch",
                        lambda launch, plan, capability: types.SimpleNamespace(name=launch.kernel_name))
    monkeypatch.setattr(native, "_kernel_call", lambda compiled, capability: compiled.name.encode())
    seen = []
    record = native.core_plan.record_plan
    monkeypatch.setattr(native.core_plan, "record_plan", lambda stage, p, inputs, *backend: seen.append(p) or
                        record(stage, p, inputs, *backend))
    native.native_program.cache_clear()
    try:
        case = Case(batch=1, heads=4, n_q_blocks=2, n_kv_blocks=3)
        inputs, args = _small_case_args(case)
        fn = out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"], backend="triton")
        mesh, spec = mesh_of(), P(None, "x")
        sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5))
        text = sharded.lower(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in args)).as_text()
    finally:
        native.native_program.cache_clear()
    assert text.count(f"@{native.FFI_TARGET}") == 10, text.count(f"@{native.FFI_TARGET}")
    assert "callback" not in text
    assert seen and all(p.heads == case.heads // 2 for p in seen), [p.heads for p in seen]


# ---- compiling for sm_90 (CPU, in a subprocess without the interpreter) -------------------------
_COMPILE_SCRIPT = textwrap.dedent(r"""
    import re
    from vsa_core import plan as P
    from vsa_core.problem import AttnProblem

    def compile_all(p, kernels=None):
        for stage, inputs in (("forward", P.forward_inputs(p)), ("backward", P.backward_inputs(p))):
            plan = P.record_plan(stage, p, inputs)
            for launch in plan.launches:
                if kernels is not None and not launch.kernel_name.startswith(kernels):
                    continue
                c = P.compile_launch(launch, plan, 90)
                assert c.cubin[:4] == b"\x7fELF", launch.kernel_name
                assert ".target sm_90a" in c.ptx, launch.kernel_name
                assert tuple(x[1] for x in c.params if x[0] == "buffer") == launch.buffers, launch.kernel_name
                assert c.global_scratch_size == 0, launch.kernel_name
                # the kernel's ABI: our run-time parameters in order, then the two pointers
                # (global scratch, profiling) that jaxlib's KernelCall::Launch appends
                entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", c.ptx, re.S).group(1)
                ptx_types = re.findall(r"\.param\s+\.(\w+)", entry)
                want = [{"buffer": "u64", "i32": "u32", "i64": "u64", "fp32": "f32"}[x[0] if x[0] == "buffer" else x[2]]
                        for x in c.params] + ["u64", "u64"]
                assert ptx_types == want, (launch.kernel_name, ptx_types, want)
                scalars = [x for x in c.params if x[0] == "scalar"]
                print(stage, c.name, c.num_warps, c.shared_mem_bytes, len(c.cubin), len(scalars))

    p = dict(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16", topk=2,
             has_gate=True)
    compile_all(AttnProblem(**p))
    # padding="ignore" changes only the pooling and fine-stage kernels: those once more
    compile_all(AttnProblem(**p, padding="ignore"), kernels=("sparse_", "block_mean"))
    print("OK")
""")


def test_every_launch_compiles_to_a_cubin_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("forward") == 4 + 2 and proc.stdout.count("backward") == 6 + 3


# ---- GPU: native == callback == torch ---------------------------------------------------------
GPU_CASES = [Case(), Case(head_dim=128, layout="bshd", gate=False), Case(block=128, n_q_blocks=2, n_kv_blocks=3,
                                                                        batch=1, dtype="float16"),
             Case(batch=1, scale=4.0, softmax_scale=0.3)]


@pytest.fixture
def fixed_configs(launch_config):
    """Every path runs the attention kernels' default tile config (the plan cannot
    autotune; autotuning may pick another summation order)."""
    launch_config(autotune=False)


def _run_jax(case, inputs, mode, launch_config):
    launch_config(jax_launch=mode)
    dtype = jnp.dtype(case.dtype)
    q, k, v, gate, dout = (jnp.asarray(to_layout(inputs[n], case.layout), dtype) for n in ("q", "k", "v", "gate",
                                                                                         "dout"))
    fn = jax.jit(_grad_fn(case, inputs))
    text = fn.lower(q, k, v, gate, dout).as_text()
    assert (native.FFI_TARGET in text) == (mode == "native")
    (dq, dk, dv, dgate), out = fn(q, k, v, gate, dout)
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if case.gate:
        got["dgate"] = dgate
    return {n: from_layout(np.asarray(x, np.float32), case.layout) for n, x in got.items()}


def _run_torch(case, inputs):
    dtype = getattr(torch, case.dtype)

    def tensor(name):
        return torch.from_numpy(to_layout(inputs[name], case.layout)).to(TORCH_DEVICE, dtype)

    q, k, v, gate = (tensor(n).requires_grad_() for n in ("q", "k", "v", "gate"))
    fn = vsa_torch.video_sparse_attn if case.layout == "bhsd" else vsa_torch.video_sparse_attn_bshd
    out = fn(q, k, v, torch.from_numpy(inputs["kv_counts"]), torch.from_numpy(inputs["q_counts"]), case.topk,
             case.block, gate if case.gate else None, backend="triton", softmax_scale=case.softmax_scale)
    out.backward(tensor("dout"))
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if case.gate:
        got["dgate"] = gate.grad
    return {n: from_layout(t.detach().float().cpu().numpy(), case.layout) for n, t in got.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("eager_tma", [False, True], ids=["eager-pointer-loads", "eager-tma"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id())
def test_native_matches_callback_and_torch_bitwise(case, eager_tma, fixed_configs, launch_config):
    """The native path runs pointer loads; the eager paths run them too ("eager-pointer-loads")
    or TMA descriptors (the default, "eager-tma": same arithmetic, other loads)."""
    launch_config(tma=eager_tma)
    inputs = make_inputs(case, seed=11)
    got_native = _run_jax(case, inputs, "native", launch_config)
    got_callback = _run_jax(case, inputs, "callback", launch_config)
    got_torch = _run_torch(case, inputs)
    assert_close(case, got_native, reference(case, inputs))
    for name in got_torch:
        for other, got in (("callback", got_callback), ("torch", got_torch)):
            diff = np.abs(got_native[name] - got[name]).max()
            assert np.array_equal(got_native[name], got[name]), f"{name}: max |native - {other}| = {diff:.3e}"


@pytest.mark.gpu
def test_native_under_xla_command_buffers():
    """In a fresh process (XLA reads its flags once) with command buffers on for custom
    calls: three replays with new inputs, each equal bit for bit to the callback path and
    close to the reference, and XLA's optimized HLO has the native custom calls inside a
    command buffer (the script exits nonzero otherwise)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + os.path.join(REPO, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "native_cmdbuf_check.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0 and "ALL EQUAL" in proc.stdout and "inside command buffers: none" not in proc.stdout, (
        proc.stdout[-4000:] + proc.stderr[-4000:])


@pytest.mark.gpu
def test_native_runs_no_python_per_call(fixed_configs, monkeypatch, launch_config):
    """Once compiled, the native program never calls back into vsa_core: with the operators
    replaced by a function that raises, new inputs (and counts, traced) still run, and right
    (the callback path would fail)."""
    launch_config(jax_launch="native")
    case = Case(batch=1)
    dtype = jnp.dtype(case.dtype)

    def loss(q, k, v, gate, dout, kv_counts, q_counts):
        out = vsa_jax.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate,
                                        backend="triton")
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    def call(inputs):
        arrays = [jnp.asarray(inputs[n], dtype) for n in ("q", "k", "v", "gate", "dout")]
        counts = [jnp.asarray(inputs[n], jnp.int32) for n in ("kv_counts", "q_counts")]
        (dq, dk, dv, dgate), out = jax.block_until_ready(fn(*arrays, *counts))
        return {n: np.asarray(x, np.float32) for n, x in
                {"out": out, "dq": dq, "dk": dk, "dv": dv, "dgate": dgate}.items()}

    first = call(make_inputs(case, seed=5))

    def no_python(*_, **__):
        raise AssertionError("Python ran during a native call")

    from vsa_core import ops as core_ops
    monkeypatch.setattr(core_ops, "forward", no_python)
    monkeypatch.setattr(core_ops, "backward", no_python)
    fresh = make_inputs(case, seed=6)
    again = call(fresh)
    assert_close(case, again, reference(case, fresh))
    assert not np.array_equal(first["out"], again["out"])


def test_kernel_call_protos_carry_the_plan():
    """jaxlib's own TritonKernelCall objects built from the compiled plan, decoded back
    (needs jaxlib's CUDA Triton module: skipped where jax has no CUDA plugin)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "") or ("cuda" if torch.cuda.is_available() else "cpu")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "native_proto_check.py")], env=env,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode == 3:
        skip_unavailable("jax", "jaxlib has no CUDA Triton module (no jax CUDA plugin installed)")
    assert proc.returncode == 0 and "PROTOS OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2, reason="needs 2 GPUs in jax")
@pytest.mark.parametrize("how", ["shard_map", "jit"])
def test_native_two_gpus_heads_split_equal_one_gpu(how, monkeypatch, launch_config):
    """The native path on 2 GPUs (heads split; shard_map, or jit over arrays sharded over
    the heads) equals the native path on 1 GPU bit for bit: out and every gradient. Both
    run the plan's fixed tile config, so only the heads per device differ."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from test_jax_spmd import NAMES, assert_bitwise, mesh_of, out_and_grads_fn
    from test_jax_vsa import jax_args

    launch_config(jax_launch="native")
    case = Case(block=64, head_dim=128, n_q_blocks=16, n_kv_blocks=16, batch=1, heads=4, topk=4)
    inputs = make_inputs(case, seed=81, margin=None)  # two runs of our kernels: no reference, no margin
    args = jax_args(case, inputs)
    fn = out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"], backend="triton")
    want = [np.asarray(x) for x in jax.jit(fn)(*args)]
    assert all(np.isfinite(np.asarray(w, np.float32)).all() for w in want)
    mesh, spec = mesh_of(), P(None, "x")
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
    fn2 = out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"], backend="triton")  # traced afresh
    run = (jax.jit(jax.shard_map(fn2, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5))
           if how == "shard_map" else jax.jit(fn2))
    text = run.lower(*placed).as_text()
    assert f"@{native.FFI_TARGET}" in text and "callback" not in text
    for _ in range(2):  # the second call replays the compiled executable
        got = [np.asarray(x) for x in run(*placed)]
        assert_bitwise(got, want, f"native, 2 GPUs ({how})")
    assert len(NAMES) == len(got)
