"""The launch plan (vsa_core.plan) and the native JAX launch path (vsa_jax.native).

CPU: the plan's contents (launch sequence, buffers, grids, host TMA descriptors) and its
schedule onto custom calls, which launch the default picks, the jitted program's custom calls
(lowered, not run), compiling every launch to a cubin for sm_90 (in a subprocess: the compiler
cannot run under TRITON_INTERPRET) with its native parameters checked against the kernel's
launch ABI (PTX) and TMA metadata, jaxlib's parameters built from them (a stand-in jaxlib
module), and that recording patches nothing.
GPU: native == callback == torch bit for bit (out and grads, under jit), also under XLA
command buffers (CUDA graphs) with fresh inputs on every replay.
"""

import functools
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
from common import (Case, assert_close, compile_in_subprocess, from_layout, make_inputs, reference,
                    skip_if_interpreter_broken, skip_unavailable, to_layout)
from vsa_core import plan as core_plan, stages
from vsa_core.backends import triton_backend as T
from vsa_core.config import LaunchConfig, config, from_environment, overridden
from vsa_core.problem import AttnProblem
from vsa_jax import native

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

POOL, COARSE_FWD, SPARSE_FWD = "block_mean_pool_qkv_kernel", "coarse_attn_fwd_kernel", "sparse_attn_fwd_kernel"
TOPK = stages.TOPK_KERNELS[stages.TOPK_ALGORITHM]
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
    # TMA as configured: K and V as host descriptors over the whole k and v buffers (`_tiles`)
    tma = config().tma
    assert sparse.arg("USE_TMA").value is tma
    for name in ("K", "V"):
        arg = sparse.arg(name)
        if not tma:
            assert arg.kind == "buffer"
            continue
        assert arg == core_plan.Arg(name, "descriptor", core_plan.Descriptor(
            name.lower(), (p.batch, p.heads, p.kv_len, p.head_dim), (*p.token_strides(p.kv_len), 1),
            (1, 1, sparse.arg("BLOCK_N").value, p.head_dim), "zero"))
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
    launch configuration are the same before and after; with TMA on, the plan's kernels take
    host descriptors, recorded as their buffer and geometry."""
    from vsa_core import stage_kernels as K
    kernel_type = type(K.topk_select_kernel)
    getitem = kernel_type.__getitem__
    with overridden(tma=True, autotune=True) as before:
        plan = _plan("forward", PROBLEMS[0])
        assert kernel_type.__getitem__ is getitem and config() is before
    sparse = next(launch for launch in plan.launches if launch.kernel_name == SPARSE_FWD)
    assert sparse.arg("USE_TMA").value is True
    assert [(a.name, a.value.buffer) for a in sparse.args if a.kind == "descriptor"] == [("K", "k"), ("V", "v")]


@pytest.mark.parametrize("p", PROBLEMS[:2], ids=["E64-gate", "E128-bshd"])
def test_backward_plan_records_host_descriptors(p, launch_config):
    """With TMA on the backward's dQ kernel takes K and V, the dK/dV kernel Q and dO, as host
    descriptors over the whole buffers (their logical (B, H, S, D) views from the first element),
    their block rows the launch's tile; with TMA off the same arguments are plain buffers."""
    for tma in (True, False):
        launch_config(tma=tma)
        launches = {l.kernel_name: l for l in _plan("backward", p).launches}
        for kernel, names, tile, seq_len in (("sparse_attn_bwd_dq_kernel", ("K", "V"), "BLOCK_N", p.kv_len),
                                             ("sparse_attn_bwd_dkdv_kernel", ("Q", "DOUT"), "BLOCK_M", p.q_len)):
            launch = launches[kernel]
            assert launch.arg("USE_TMA").value is tma
            for name in names:
                arg = launch.arg(name)
                if not tma:
                    assert arg.kind == "buffer" and arg.value == name.lower()
                    continue
                shape, dtype = core_plan.backward_inputs(p)[name.lower()]
                assert arg.kind == "descriptor" and arg.value.buffer == name.lower()
                assert shape == p.token_shape(seq_len)
                d = arg.value
                assert d.shape == (p.batch, p.heads, seq_len, p.head_dim) and d.strides[-1] == 1
                assert d.block_shape == (1, 1, launch.arg(tile).value, p.head_dim) and d.padding == "zero"
                # the descriptor's elements are exactly the buffer's (a bijection onto 0 .. numel-1)
                offsets = sum(np.ix_(*(np.arange(n) * s for n, s in zip(d.shape, d.strides))))
                assert np.array_equal(np.sort(offsets, axis=None), np.arange(np.prod(shape))), (kernel, name)


# ---- the JAX executor (CPU: lowered, not run) ----------------------------------------------------
def _cpu():
    return jax.devices("cpu")[0]


def test_the_launch_device_is_the_array_s_else_the_default_device():
    """The launch is chosen for the device a call runs on as tracing knows it: a concrete array's
    own device (an eager call), whatever the default; a tracer's (under jit), JAX's default device:
    the default backend's first, or the one `jax.default_device` names. On a CPU or a GPU host."""
    on_cpu = jax.device_put(jnp.zeros(2), _cpu())
    default = jax.devices()[0]
    assert native.launch_device(on_cpu).kind == "cpu"
    assert native.launch_device().kind == native.launch_device(None).kind == (
        "cuda" if default.platform in ("gpu", "cuda") else "cpu")
    traced = []
    with jax.default_device(_cpu()):
        assert native.launch_device().kind == "cpu"
        jax.jit(lambda x: traced.append(native.launch_device(x)) or x).lower(on_cpu)
    assert [d.kind for d in traced] == ["cpu"]
    if default.platform in ("gpu", "cuda"):
        on_gpu = jax.device_put(jnp.zeros(2), default)
        with jax.default_device(_cpu()):
            device = native.launch_device(on_gpu)
        assert device.kind == "cuda" and device.capability is not None


def test_the_default_launch_is_native_on_cuda_for_the_stages_that_have_a_native_path(monkeypatch, launch_config):
    """"auto" (the default): native for the Triton and sm90 backends and the cudnn backend at
    64-token blocks (on sm_90) on a CUDA device (the Triton backend with TMA on only where jaxlib
    encodes host TMA descriptors, on sm_90 or newer), the callback for the other library stages,
    for calls on the CPU, and when asked for."""
    from vsa_core.backends import sm90_backend
    assert from_environment({}).jax_launch == LaunchConfig().jax_launch == "auto"
    launch_config(jax_launch=LaunchConfig().jax_launch, tma=False)
    on_cpu = jax.device_put(jnp.zeros(2), _cpu())
    # CPU arrays (their own device, whatever the default), or traced with the CPU the default device
    assert not native.selected(T, on_cpu) and not native.selected(sm90_backend, on_cpu)
    with jax.default_device(_cpu()):
        assert not native.selected(T) and not native.selected(sm90_backend)
    capability = {"now": 90}
    asked = []
    # the call's device as a CUDA one of capability["now"]
    monkeypatch.setattr(native, "_cuda_capability", lambda device: asked.append(device) or capability["now"])
    assert native.selected(T, on_cpu) and native.selected(sm90_backend)
    assert asked[0].kind == "cpu" and asked[1] == native.launch_device()  # asked about the call's device
    cudnn, cute = types.SimpleNamespace(name="cudnn"), types.SimpleNamespace(name="cute")
    e64, e128 = (AttnProblem(batch=1, heads=2, q_len=256, kv_len=256, head_dim=128, block_elems=e, dtype="bfloat16",
                             topk=2) for e in (64, 128))
    # cute's forward and backward where FA4 and cutlass.jax import
    from vsa_jax import fa4_call
    for stage in ("forward", "backward"):
        assert native.selected(cute, stage=stage, p=e128) is (fa4_call.library_error() is None)
        assert not native.selected(cute, stage=stage, p=e64)
    # cudnn's stages at 64-token blocks where its kernel calls import (cuDNN frontend, cutlass.jax)
    from vsa_jax import cudnn_call
    for stage in ("forward", "backward"):
        assert native.selected(cudnn, stage=stage, p=e64) is (cudnn_call.library_error(stage) is None)
        assert not native.selected(cudnn, stage=stage, p=e128)
    capability["now"] = 100  # its kernels are compiled for sm_90a only
    assert not native.selected(cudnn, stage="forward", p=e64) and "sm_90a" in native.unavailable_reason("cudnn", 100)
    assert not native.selected(cute, stage="forward", p=e128) and "sm_90a" in native.unavailable_reason("cute", 100)
    assert not native.selected(cute, stage="backward", p=e128)
    capability["now"] = 90
    launch_config(tma=True)
    for takes in (False, True):  # a jaxlib without and with host TMA descriptors
        monkeypatch.setattr(native, "jaxlib_takes_host_descriptors", lambda: takes)
        assert native.selected(T) is takes and native.selected(sm90_backend)
        reason = native.unavailable_reason("triton", 90)
        assert (reason is None) is takes and (takes or "jaxlib >= 0.11.2" in reason), reason
    capability["now"] = 80  # below sm_90 Triton lowers descriptors to pointers: no plan of those
    assert not native.selected(T) and "sm_80" in native.unavailable_reason("triton", 80)
    launch_config(tma=False)
    assert native.selected(T)
    launch_config(jax_launch="callback")
    assert not native.selected(T) and not native.selected(sm90_backend)
    with pytest.raises(ValueError, match="launch"):
        vsa_jax.set_launch("graph")


def _stub_compiling(monkeypatch):
    """Compiling the Triton launches stubbed out (no CUDA here): each kernel call's opaque is its
    name. The native programs go to a cache of the test's own, so none built here outlives it and
    none built before answers it."""
    monkeypatch.setattr(native.core_plan, "compile_launch",
                        lambda launch, plan, capability: types.SimpleNamespace(name=launch.kernel_name))
    monkeypatch.setattr(native, "_kernel_call", lambda compiled, capability: compiled.name.encode())
    monkeypatch.setattr(native, "native_program", functools.lru_cache(maxsize=None)(native.native_program.__wrapped__))


def _lowered_default_program(monkeypatch, launch_config, tma: bool, cuda: bool, mapped: bool = False):
    """The jitted forward + backward (Triton backend) lowered under the default launch: on the
    call's device taken for a CUDA sm_90 one when `cuda` (compiling stubbed out), else on CPU
    arrays with the CPU the default device (a GPU host's too); `mapped`: under jax.vmap over two
    draws. Returns the program's text and the launch plans the native launch runs (one per stage:
    a plan tuned at trace time, on a GPU host, is recorded twice, once untuned)."""
    launch_config(jax_launch=LaunchConfig().jax_launch, tma=tma)
    plans = []
    tuned = native.tuned_plan
    monkeypatch.setattr(native, "tuned_plan", lambda *args: plans.append(tuned(*args)) or plans[-1])
    if cuda:
        monkeypatch.setattr(native, "_cuda_capability", lambda device: 90)
    _stub_compiling(monkeypatch)
    case = Case(batch=1, heads=2, n_q_blocks=2, n_kv_blocks=3)
    with jax.default_device(None if cuda else _cpu()):
        inputs, args = _small_case_args(case)
        fn = _grad_fn(case, inputs)
        if mapped:
            args = [jnp.stack([x, x * 2]) for x in args]
            fn = jax.vmap(fn)
        return jax.jit(fn).lower(*args).as_text(), plans


@pytest.mark.parametrize("jaxlib", ["host-tma", "no-host-tma"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointer-loads", "tma"])
def test_the_default_program_on_cuda_is_custom_calls_only(tma, jaxlib, monkeypatch, launch_config):
    """Under the default launch on a CUDA device the Triton forward + backward lower to the plans'
    launches as custom calls and no Python callback, with TMA on their attention kernels' plans
    holding host descriptors; with TMA on and a jaxlib that cannot encode host descriptors, the
    callback (which `unavailable_reason` names)."""
    takes = jaxlib == "host-tma"
    monkeypatch.setattr(native, "jaxlib_takes_host_descriptors", lambda: takes)
    text, plans = _lowered_default_program(monkeypatch, launch_config, tma, cuda=True)
    if tma and not takes:
        assert f"@{native.FFI_TARGET}" not in text and "callback" in text and not plans
        return
    assert text.count(f"@{native.FFI_TARGET}") == 10, text.count(f"@{native.FFI_TARGET}")
    assert "callback" not in text
    assert [plan.stage for plan in plans] == ["forward", "backward"] and not any(plan.untuned for plan in plans)
    tiled = [a.value.buffer for plan in plans for l in plan.launches for a in l.args if a.kind == "descriptor"]
    assert tiled == (["k", "v", "k", "v", "q", "dout"] if tma else []), tiled


def test_the_default_program_on_cpu_is_the_callback(monkeypatch, launch_config):
    """On the CPU (CPU arrays, the CPU the default device: on a GPU host too) the default is the callback."""
    skip_if_interpreter_broken()
    text, plans = _lowered_default_program(monkeypatch, launch_config, tma=False, cuda=False)
    assert f"@{native.FFI_TARGET}" not in text and "callback" in text and not plans


def test_the_default_program_under_vmap_is_the_callback(monkeypatch, launch_config):
    """Under jax.vmap the native launches are not mapped (one element at a time they gave wrong
    results on the GPU): on a CUDA device the default launch runs the mapped forward and backward
    through the callback, one element at a time (a loop), and no custom call of the plans."""
    text, plans = _lowered_default_program(monkeypatch, launch_config, tma=False, cuda=True, mapped=True)
    assert f"@{native.FFI_TARGET}" not in text and "callback" in text and "stablehlo.while" in text
    assert [plan.stage for plan in plans] == ["forward", "backward"]  # recorded when traced, then not run


def test_the_default_under_vmap_runs_each_element_as_the_callback_alone(monkeypatch, launch_config):
    """Run, not only lowered: on a CUDA device (the call's device taken for one, the plans'
    compiling stubbed out) the default launch under jax.vmap runs the callback for real, and each
    element of the mapped forward + backward equals the callback's call on it alone, bit for bit."""
    launch_config(jax_launch=LaunchConfig().jax_launch, tma=False)
    monkeypatch.setattr(native, "_cuda_capability", lambda device: 90)
    _stub_compiling(monkeypatch)
    plans = []
    tuned = native.tuned_plan
    monkeypatch.setattr(native, "tuned_plan", lambda *args: plans.append(tuned(*args)) or plans[-1])
    case = Case(batch=1, heads=1, n_q_blocks=2, n_kv_blocks=3)
    inputs, first = _small_case_args(case)
    second = [x * 2 if i != 3 else x for i, x in enumerate(first)]  # the gate kept in [0, 1]
    fn = _grad_fn(case, inputs)
    mapped = jax.tree.leaves(jax.jit(jax.vmap(fn))(*(jnp.stack(xs) for xs in zip(first, second))))
    assert [plan.stage for plan in plans] == ["forward", "backward"]  # the native launch was chosen
    launch_config(jax_launch="callback")
    for j, args in enumerate((first, second)):
        alone = jax.tree.leaves(jax.jit(fn)(*args))
        assert len(alone) == len(mapped) == 5
        for i, (got, want) in enumerate(zip(mapped, alone)):
            assert np.array_equal(np.asarray(got[j]), np.asarray(want)), f"vmap element {j}, result {i}"


def test_native_under_vmap_is_refused_naming_the_callback(monkeypatch, launch_config):
    """launch="native" under jax.vmap: a NotImplementedError that says how to run it (the callback)."""
    launch_config(jax_launch="native")
    monkeypatch.setattr(native, "_cuda_capability", lambda device: 90)
    _stub_compiling(monkeypatch)
    case = Case(batch=1, heads=2, n_q_blocks=2, n_kv_blocks=3)
    inputs, args = _small_case_args(case)
    with pytest.raises(NotImplementedError, match=r"vmap.*set_launch\('callback'\)"):
        jax.jit(jax.vmap(_grad_fn(case, inputs))).lower(*(jnp.stack([x, x]) for x in args))


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
    """launch="native" on the CPU (CPU arrays, the CPU the default device: on a GPU host too)."""
    skip_if_interpreter_broken()
    launch_config(jax_launch="native")
    case = Case(batch=1, heads=1, n_q_blocks=2, n_kv_blocks=2)
    with jax.default_device(_cpu()):
        inputs, (q, k, v, gate, dout) = _small_case_args(case)
        with pytest.raises(RuntimeError, match=r"CUDA device.*set_launch\('callback'\)"):
            jax.jit(_grad_fn(case, inputs)).lower(q, k, v, gate, dout)


def test_native_program_is_one_custom_call_per_launch(monkeypatch, launch_config):
    """Traced with compiling stubbed out (no CUDA here): forward + backward lower to the
    plans' launches as triton_kernel_call_ffi custom calls with in-place aliases, and no
    Python callback."""
    launch_config(jax_launch="native")
    monkeypatch.setattr(native, "_capability", lambda device: 90)
    _stub_compiling(monkeypatch)
    case = Case(batch=1, heads=2, n_q_blocks=2, n_kv_blocks=3)
    inputs, (q, k, v, gate, dout) = _small_case_args(case)
    text = jax.jit(_grad_fn(case, inputs)).lower(q, k, v, gate, dout).as_text()
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
    monkeypatch.setattr(native, "_capability", lambda device: 90)
    _stub_compiling(monkeypatch)
    seen = []
    record = native.core_plan.record_plan
    monkeypatch.setattr(native.core_plan, "record_plan", lambda stage, p, inputs, *backend: seen.append(p) or
                        record(stage, p, inputs, *backend))
    case = Case(batch=1, heads=4, n_q_blocks=2, n_kv_blocks=3)
    inputs, args = _small_case_args(case)
    fn = out_and_grads_fn(case, inputs["kv_counts"], inputs["q_counts"], backend="triton")
    mesh, spec = mesh_of(), P(None, "x")
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 5))
    text = sharded.lower(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in args)).as_text()
    assert text.count(f"@{native.FFI_TARGET}") == 10, text.count(f"@{native.FFI_TARGET}")
    assert "callback" not in text
    assert seen and all(p.heads == case.heads // 2 for p in seen), [p.heads for p in seen]


# ---- compiling for sm_90 (CPU, in a subprocess without the interpreter) -------------------------
# the kernel's launch ABI read from its PTX entry: one type per parameter, "tma" for a CUtensorMap
# passed by value (128 bytes, 64-byte aligned); what the native parameters must match, in order,
# followed by the two pointers (global scratch, profiling) jaxlib's KernelCall::Launch appends
_PTX_ABI = textwrap.dedent(r"""
    import re

    def ptx_abi(ptx):
        entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S).group(1)
        return ["tma" if re.search(r"\.align\s+64\s+\.b8\s+\w+\[128\]", decl)
                else re.search(r"\.param\s+\.(\w+)", decl).group(1) for decl in entry.split(",")]

    def native_abi(params):
        return [{"array": "u64", "tma": "tma"}.get(x[0]) or {"i32": "u32", "i64": "u64", "fp32": "f32"}[x[2]]
                for x in params] + ["u64", "u64"]
""")

_COMPILE_SCRIPT = _PTX_ABI + textwrap.dedent(r"""
    from vsa_core import plan as P
    from vsa_core.problem import AttnProblem
    from vsa_jax.native import kernel_params

    def compile_all(p, kernels=None):
        for stage, inputs in (("forward", P.forward_inputs(p)), ("backward", P.backward_inputs(p))):
            plan = P.record_plan(stage, p, inputs)
            for launch in plan.launches:
                if kernels is not None and not launch.kernel_name.startswith(kernels):
                    continue
                c = P.compile_launch(launch, plan, 90)
                assert c.cubin[:4] == b"\x7fELF", launch.kernel_name
                assert ".target sm_90a" in c.ptx, launch.kernel_name
                taken = tuple(x[1] if x[0] == "buffer" else x[1].buffer for x in c.params if x[0] != "scalar")
                assert taken == launch.buffers, launch.kernel_name
                # TMA (default on) in the attention kernels only, through host descriptors: no global scratch
                tma = any(x[0] == "descriptor" for x in c.params)
                attention = launch.kernel_name.startswith("sparse_attn_") and "preprocess" not in launch.kernel_name
                assert tma == attention, launch.kernel_name
                assert ("cp.async.bulk.tensor" in c.ptx) == tma and c.global_scratch_size == 0, launch.kernel_name
                # the kernel's ABI: the native parameters in order, then jaxlib's two pointers
                assert ptx_abi(c.ptx) == native_abi(kernel_params(c)), (launch.kernel_name, ptx_abi(c.ptx))
                scalars = [x for x in c.params if x[0] == "scalar"]
                print(stage, c.name, c.num_warps, c.shared_mem_bytes, len(c.cubin), len(scalars))

    p = dict(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16", topk=2,
             has_gate=True)
    compile_all(AttnProblem(**p))
    # padding="ignore" changes only the pooling and fine-stage kernels: those once more
    compile_all(AttnProblem(**p, padding="ignore"), kernels=("sparse_", "block_mean"))
    print("OK")
""")


def _compiling(script: str) -> subprocess.CompletedProcess:
    """`script` run in a process without the interpreter (Triton compiles there) and with JAX on the CPU."""
    return compile_in_subprocess(script, unset=("VSA_TMA",), JAX_PLATFORMS="cpu")


def test_every_launch_compiles_to_a_cubin_for_sm90():
    """Every launch of a forward and a backward plan (default configuration: TMA on) compiles for
    sm_90a; the native parameters are the kernel's PTX entry parameters, kind by kind."""
    proc = _compiling(_COMPILE_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("forward") == 4 + 2 and proc.stdout.count("backward") == 6 + 3


# ---- the attention kernels' host TMA descriptors on the native path (CPU, compiled) --------------
_TMA_SCRIPT = _PTX_ABI + textwrap.dedent(r"""
    import numpy as np
    from vsa_core import plan as P
    from vsa_core.config import configure
    from vsa_core.problem import AttnProblem
    from vsa_jax.native import kernel_params

    configure(tma=True)
    CU_TENSOR_MAP_DATA_TYPE = {"float16": 6, "bfloat16": 9}  # cuda.h's host enum
    TILED = {"sparse_attn_fwd_kernel": ("K", "V"), "sparse_attn_bwd_dq_kernel": ("K", "V"),
             "sparse_attn_bwd_dkdv_kernel": ("Q", "DOUT")}

    def check(p):
        for stage, inputs in (("forward", P.forward_inputs(p)), ("backward", P.backward_inputs(p))):
            plan = P.record_plan(stage, p, inputs)
            for launch in plan.launches:
                if launch.kernel_name not in TILED:
                    continue
                c = P.compile_launch(launch, plan, 90)
                params = kernel_params(c)
                # count and kinds: the kernel's PTX entry (Triton's launch ABI for a host descriptor:
                # the CUtensorMap by value, then its shape as i32s, then its strides as i64s)
                assert ptx_abi(c.ptx) == native_abi(params), (launch.kernel_name, ptx_abi(c.ptx), native_abi(params))
                assert c.global_scratch_size == 0 and "cp.async.bulk.tensor" in c.ptx
                # jaxlib hands the buffers to "array" and "tma" entries in order: each descriptor its own buffer
                tmas, taken = [], 0
                for i, x in enumerate(params):
                    if x[0] == "tma":  # with the 4 + 4 scalars after it
                        tmas.append((launch.buffers[taken], x, params[i + 1:i + 9]))
                    taken += x[0] in ("array", "tma")
                assert taken == len(launch.buffers)
                assert [b for b, _, _ in tmas] == [n.lower() for n in TILED[launch.kernel_name]], tmas
                descriptors = [x for x in c.params if x[0] == "descriptor"]
                for (buffer, tma, after), (_, desc, meta) in zip(tmas, descriptors):
                    _, elem_type, elem_size, swizzle, shape, strides, box, oob_fill = tma
                    seq_len = p.kv_len if buffer in ("k", "v") else p.q_len
                    # the geometry: the whole buffer, as torch's launcher describes it (`_tiles`)
                    assert desc.buffer == buffer and plan.all_buffers[buffer][0] == p.token_shape(seq_len)
                    assert shape == (p.batch, p.heads, seq_len, p.head_dim)
                    assert strides == (*p.token_strides(seq_len), 1) and oob_fill == 0
                    assert after == tuple(("scalar", n, "i32") for n in shape) + tuple(
                        ("scalar", s, "i64") for s in strides), after
                    # the compiled kernel's metadata: element type (host enum), size, swizzle and box
                    assert elem_type == CU_TENSOR_MAP_DATA_TYPE[p.dtype] and elem_size == meta["elem_size"] == 2
                    assert swizzle == meta["swizzle"] == 3  # 128-byte swizzle: rows of >= 128 bytes
                    assert box == tuple(meta["block_size"]) and box[:3] == desc.block_shape[:3]
                    assert box[3] * elem_size == 128 and p.head_dim % box[3] == 0, box  # a 128-byte swizzle row
                    print("TMA", launch.kernel_name, buffer, p.dtype, p.layout, "box", box, "block", desc.block_shape)

    check(AttnProblem(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16",
                      topk=2, has_gate=True))
    # head_dim 128: the box (64 columns) is narrower than the descriptor's block; BSHD strides; fp16
    check(AttnProblem(batch=2, heads=3, q_len=384, kv_len=256, head_dim=128, block_elems=128, dtype="float16",
                      topk=1, layout="bshd"))

    # below sm_90 Triton lowers the descriptors to pointers (a launch ABI of its own): refused
    p = AttnProblem(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16", topk=2)
    plan = P.record_plan("forward", p, P.forward_inputs(p))
    try:
        P.compile_launch(next(l for l in plan.launches if l.kernel_name in TILED), plan, 80)
    except NotImplementedError as e:
        assert "VSA_TMA=0" in str(e), e
    else:
        raise AssertionError("a descriptor compiled for sm_80 was accepted")
    print("OK")
""")


def test_native_params_of_the_tma_kernels_match_the_compiled_kernels():
    """With TMA on, the forward, dQ and dK/dV kernels compiled for sm_90a: their native parameters
    (`native.kernel_params`) are Triton's launch ABI for host descriptors, checked against the PTX
    entry (count and kind, in order), and each descriptor's fields are the compiled kernel's
    `tensordesc_meta` (host element type, element size, swizzle, box) over the whole buffer the
    custom call hands it, with torch's geometry; compiled for sm_80 a descriptor is refused."""
    proc = _compiling(_TMA_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TMA ") == 12, proc.stdout


# ---- jaxlib's parameters of a compiled launch (CPU: a stand-in jaxlib module) ---------------------
def _compiled_with_descriptor(padding="zero", global_scratch_size=0):
    """A compiled launch as `compile_launch` returns it: a pointer, a bf16 host descriptor (its
    `tensordesc_meta` entry as Triton 3.6 - 3.9 write it), two scalars."""
    desc = core_plan.Descriptor("k", (1, 2, 256, 64), (32768, 16384, 64, 1), (1, 1, 64, 64), padding)
    meta = {"elem_type": 10, "elem_size": 2, "swizzle": 3, "block_size": [1, 1, 32, 64], "fp4_padded": False,
            "is_im2col": False}
    params = (("buffer", "q", 16), ("descriptor", desc, meta), ("scalar", 7, "i32"), ("scalar", 0.5, "fp32"))
    return core_plan.CompiledLaunch(types.SimpleNamespace(kernel_name="k_kernel", grid=(4, 2, 1)), "k_kernel_0d1d",
                                    4, 1, 1024, "ptx", b"", params, global_scratch_size)


@pytest.mark.parametrize("padding", ["zero", "nan"])
def test_kernel_params_expand_a_descriptor_as_triton_s_launcher_does(padding):
    """A host descriptor becomes the CUtensorMap's fields (the host element type, 9 for bf16 where
    Triton's metadata says 10; the box of the compiled kernel, not the descriptor's block shape;
    NaN fill for "nan" padding), then its shape as i32 scalars and its strides as i64 scalars."""
    params = native.kernel_params(_compiled_with_descriptor(padding))
    shape, strides = (1, 2, 256, 64), (32768, 16384, 64, 1)
    assert params == (("array", 16),
                      ("tma", 9, 2, 3, shape, strides, (1, 1, 32, 64), int(padding == "nan")),
                      *(("scalar", n, "i32") for n in shape), *(("scalar", s, "i64") for s in strides),
                      ("scalar", 7, "i32"), ("scalar", 0.5, "fp32"))


class _StandInJaxlib(types.SimpleNamespace):
    """jaxlib's gpu_triton module as far as `_kernel_call` uses it: each factory returns what it
    was given; the kernel calls made are kept in `calls`, their proto is the name."""

    def __init__(self, host_descriptors=True, elem_size_keyword=False):
        self.calls = []

        def kernel_call(*args):
            self.calls.append(args)
            return types.SimpleNamespace(to_proto=lambda name, metadata: name.encode())

        super().__init__(
            TritonKernel=lambda *args, **kwargs: ("kernel", args, kwargs), TritonKernelCall=kernel_call,
            create_array_parameter=lambda bytes_to_zero, divisibility: ("array", bytes_to_zero, divisibility),
            create_scalar_parameter=lambda value, kind: ("scalar", value, kind))
        if host_descriptors:
            def create_tma_descriptor_parameter(**fields):
                return ("tma", fields)
            # nanobind's docstring is the signature: jaxlib 0.11.2's has no elem_size_bytes
            create_tma_descriptor_parameter.__doc__ = (
                "create_tma_descriptor_parameter(elem_type: int, " + ("elem_size_bytes: int, " if elem_size_keyword
                                                                     else "") + "swizzle: int, ...)")
            self.create_tma_descriptor_parameter = create_tma_descriptor_parameter


@pytest.mark.parametrize("elem_size_keyword", [False, True], ids=["jaxlib-0.11.2", "elem-size-keyword"])
def test_kernel_call_hands_jaxlib_the_params_in_order(elem_size_keyword, monkeypatch):
    import zlib
    from jax._src import lib
    jaxlib = _StandInJaxlib(elem_size_keyword=elem_size_keyword)
    monkeypatch.setattr(lib, "gpu_triton", jaxlib)
    assert zlib.decompress(native._kernel_call(_compiled_with_descriptor(), 90)) == b"k_kernel"
    (kernel, gx, gy, gz, params), = jaxlib.calls
    assert (gx, gy, gz) == (4, 2, 1)
    assert kernel == ("kernel", ("k_kernel_0d1d", 4, 1, 1024, "ptx", "", 90), {})  # no global scratch
    tma = dict(elem_type=9, swizzle=3, shape=[1, 2, 256, 64], strides=[32768, 16384, 64, 1],
               block_shape=[1, 1, 32, 64], oob_fill=0, **({"elem_size_bytes": 2} if elem_size_keyword else {}))
    assert params[:2] == [("array", 0, 16), ("tma", tma)]
    assert params[2:] == [("scalar", n, "i32") for n in (1, 2, 256, 64)] + [
        ("scalar", s, "i64") for s in (32768, 16384, 64, 1)] + [("scalar", 7, "i32"), ("scalar", 0.5, "fp32")]


def test_kernel_call_refuses_what_jaxlib_cannot_launch(monkeypatch):
    """A descriptor on a jaxlib without host TMA descriptors, and a kernel that needs global scratch
    (jaxlib would allocate it per launch, which a command buffer cannot hold): clear errors."""
    from jax._src import lib
    monkeypatch.setattr(lib, "gpu_triton", _StandInJaxlib(host_descriptors=False))
    with pytest.raises(RuntimeError, match=r"jaxlib >= 0\.11\.2.*VSA_TMA=0"):
        native._kernel_call(_compiled_with_descriptor(), 90)
    monkeypatch.setattr(lib, "gpu_triton", _StandInJaxlib())
    with pytest.raises(NotImplementedError, match="global scratch"):
        native._kernel_call(_compiled_with_descriptor(global_scratch_size=256), 90)


# ---- the tile configs and TMA of the native plan (CPU, compiled without the interpreter) ----------
_TILES_SCRIPT = textwrap.dedent(r"""
    import jax.numpy as jnp
    import numpy as np
    import torch  # loaded, as in a process where torch calls run: tiles come from the shared store

    from vsa_core import plan as P
    from vsa_core.autotune import TILES
    from vsa_core.backends import triton_backend as T
    from vsa_core.config import configure
    from vsa_core.launch import eager_launcher
    from vsa_core.problem import describe_attention

    B, H, D, E, NQ, NKV = 1, 2, 64, 128, 4, 4
    KERNELS = {k.name: k for k in (T._sparse_fwd, T._sparse_bwd_dq, T._sparse_bwd_dkdv)}

    def problem(zeros, counts):
        tok = lambda n: zeros((B, H, n * E, D))
        return describe_attention(tok(NQ), tok(NKV), tok(NKV), block_size=E, layout="bhsd", kv_counts=counts(NKV),
                                  q_counts=counts(NQ), topk=2, gate=tok(NQ))

    torch_p = problem(lambda s: torch.zeros(s, dtype=torch.bfloat16), lambda n: torch.full((n,), E, dtype=torch.int32))
    jax_p = problem(lambda s: jnp.zeros(s, jnp.bfloat16), lambda n: jnp.full((n,), E, jnp.int32))
    assert torch_p == jax_p

    def tuned_launches(p):
        plans = [P.record_plan(stage, p, inputs) for stage, inputs in
                 (("forward", P.forward_inputs(p)), ("backward", P.backward_inputs(p)))]
        launches = [(plan, l) for plan in plans for l in plan.launches if l.kernel_name in KERNELS]
        assert len(launches) == 3
        return [u for plan in plans for u in plan.untuned], launches

    def tile(launch):
        o = dict(launch.options)
        return (launch.arg("BLOCK_M").value, launch.arg("BLOCK_N").value, o["num_warps"], o["num_stages"])

    def fitting(kernel):
        return [c for c in kernel.candidates if kernel._fits(E, c[0], c[1])]

    for tma in (True, False):
        configure(tma=tma)
        # nothing chosen yet: the defaults, each key listed for tuning
        untuned, launches = tuned_launches(jax_p)
        assert len(untuned) == 3, untuned
        assert all(tile(l) == fitting(KERNELS[l.kernel_name])[0] for _, l in launches)
        # torch's first call of the problem chooses (here by a timing table: no GPU): the last candidate
        for _, l in launches:
            kernel = KERNELS[l.kernel_name]
            named = {a.name: a.value for a in l.args}
            assert named["USE_TMA"] is tma
            last = fitting(kernel)[-1]
            TILES.choose(kernel.store_key(torch_p, named), fitting(kernel), lambda c: 0.0 if c == last else 1.0)
        # the native plan runs the tiles torch's eager launch resolves, compiled with TMA as configured
        untuned, launches = tuned_launches(jax_p)
        assert untuned == [], untuned
        for plan, l in launches:
            kernel = KERNELS[l.kernel_name]
            eager = kernel.tile_for(eager_launcher, torch_p, None, (), {a.name: a.value for a in l.args})
            assert tile(l) == eager == fitting(kernel)[-1] != fitting(kernel)[0], (l.kernel_name, tile(l), eager)
            c = P.compile_launch(l, plan, 90)
            assert c.num_warps == eager[2], (l.kernel_name, c.num_warps, eager)
            descriptors = [x[1].buffer for x in c.params if x[0] == "descriptor"]
            assert len(descriptors) == (2 if tma else 0) and c.global_scratch_size == 0, (l.kernel_name, descriptors)
            assert ("cp.async.bulk.tensor" in c.ptx) == tma, l.kernel_name
            print("TILE", l.kernel_name, "tma" if tma else "pointer", eager, descriptors)
    print("OK")
""")


def test_native_plan_runs_torch_s_tiles_and_tma():
    """With torch loaded and autotuning on (the defaults), the native plan's attention kernels take
    the tile config the shared store holds for their key, the one torch's eager launch resolves
    for the same problem (a non-default one here: chosen as torch's first call would), and before
    any choice the default with the key listed for tuning; with TMA on they compile to TMA loads
    from host descriptors (no global scratch), with it off to pointer loads. In a subprocess: the
    compiler cannot run under TRITON_INTERPRET, which also leaves one candidate only."""
    proc = compile_in_subprocess(_TILES_SCRIPT, unset=("VSA_AUTOTUNE", "VSA_TMA"), JAX_PLATFORMS="cpu")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TILE") == 6


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
    """Every path on pointer loads ("eager-pointer-loads") or on TMA (the default, "eager-tma":
    the eager paths with host descriptors Triton's launcher encodes, the native path with the same
    descriptors jaxlib encodes at each launch, the same compiled kernels)."""
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
    calls and the default settings (the default launch, autotuned tiles, TMA): three replays
    with new inputs, each equal bit for bit to the callback path and close to the reference,
    and XLA's optimized HLO has the native custom calls inside a command buffer (the script
    exits nonzero otherwise)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VSA_AUTOTUNE", "VSA_TMA", "VSA_JAX_LAUNCH")}
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
