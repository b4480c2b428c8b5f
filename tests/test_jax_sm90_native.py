"""The sm90 backend natively under JAX (issue 23): its CuTe DSL launches recorded in the plan
(`Launcher.cute` -> `vsa_core.plan.CuteLaunch`) and replayed as cutlass.jax custom calls
(`vsa_jax.sm90_call`), its workspaces named by the plan.

CPU: what the plans record (the cute step's buffers by argument name, its statics, the
backend's workspaces and where the schedule bears them); that the eager launch hands the
kernels' launchers what the backend handed them before the seam (launchers stubbed, torch CPU
tensors); and, where nvidia-cutlass-dsl and jax are installed (with torch blocked), that the
native stages lower for CUDA to one triton_kernel_call_ffi per Triton launch plus one CuTe DSL
custom call with the kernels compiled for sm_90a.
GPU (H100 / H200, `gpu`): native == callback == torch bit for bit for out (lse), dk, dv (and
dgate), dq within one rounding of the fp32 atomics' order, all close to the float64 reference:
both layouts, padding "zeros" and "ignore" (NaN / inf in the padding), a gate (VSA),
block_sparse_attn_from_indices; and a JAX-only process (torch blocked) running it.

    pytest tests/test_jax_sm90_native.py            # CPU; the lowering tests need jax + nvidia-cutlass-dsl
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
import types
import zlib

import numpy as np
import pytest

from common import Case, assert_close, compile_in_subprocess, make_inputs, reference, require_jax_gpu
from test_import_boundaries import native_vjp_script, run_without_torch
from vsa_core import plan as core_plan, stages
from vsa_core.backends import sm90_backend, sm90_bwd64_groups
from vsa_core.launch import Launcher
from vsa_core.problem import AttnProblem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUTE_JAX = all(importlib.util.find_spec(m) is not None for m in ("jax", "cutlass"))
HAS_TORCH = importlib.util.find_spec("torch") is not None

FORWARD_TRITON = ["block_mean_pool_qkv_kernel", "coarse_attn_fwd_kernel", stages.TOPK_KERNELS[stages.TOPK_ALGORITHM]]
BACKWARD_GROUPS = ("dkv_partial", "group_flags")  # the sm90 backward's query groups' workspaces
BACKWARD_TRITON = ["columns_to_lists_kernel", "sparse_attn_bwd_preprocess_kernel", "coarse_attn_bwd_ds_kernel",
                   "coarse_attn_bwd_grads_kernel"]


def _vsa(**kw) -> AttnProblem:
    base = dict(batch=1, heads=2, q_len=256, kv_len=320, head_dim=128, block_elems=64, dtype="bfloat16", topk=2,
                has_gate=True)
    base.update(kw)
    return AttnProblem(**base)


def _indices(**kw) -> AttnProblem:
    return _vsa(selection="indices", topk=None, has_gate=False, list_capacity=3, **kw)


def _inputs(stage: str, p: AttnProblem) -> dict:
    if p.is_vsa:
        return core_plan.forward_inputs(p) if stage == "forward" else core_plan.backward_inputs(p)
    B, H, nq, nk = p.batch, p.heads, p.n_q_blocks, p.n_kv_blocks
    fwd = {"q": (p.token_shape(p.q_len), "input"), "k": (p.token_shape(p.kv_len), "input"),
           "v": (p.token_shape(p.kv_len), "input"), "kv_counts": ((nk,), "int32")}
    if stage == "forward":
        return {**fwd, "given_idx": ((B, H, nq, 3), "int32"), "given_num": ((B, H, nq), "int32")}
    return {"dout": (p.token_shape(p.q_len), "input"), **fwd,
            **{n: s for n, s in p.forward_buffers().items() if n in ("out", "lse", "sel_idx", "sel_num")}}


def _plan(stage: str, p: AttnProblem):
    return core_plan.record_plan(stage, p, _inputs(stage, p), sm90_backend)


# ---- the plan (CPU) ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_vsa_forward_plan_records_the_cute_step(padding, layout):
    p = _vsa(padding=padding, layout=layout)
    plan = _plan("forward", p)
    ignore = padding == "ignore"
    assert [l.kernel_name for l in plan.launches] == (FORWARD_TRITON + ["valid_rows_copy_kernel"] * 2 * ignore
                                                      + ["sm90_fwd64"])
    cute = plan.launches[-1]
    assert cute.kind == "cute" and all(l.kind == "triton" for l in plan.launches[:-1])
    kv = "_valid" if ignore else ""
    want = dict(q="q", k="k" + kv, v="v" + kv, out="out", lse="lse", sel_idx="sel_idx", sel_num="sel_num",
                kv_counts="kv_counts", out_coarse="out_coarse", gate="gate", out_fine="out_fine")
    if ignore:
        want["q_counts"] = "q_counts"  # under "zeros" the launch brings full counts of its own
    assert dict(cute.args) == want
    assert cute.statics_dict() == dict(dtype="bfloat16", head_dim=128, layout=layout, softmax_scale=p.softmax_scale,
                                       has_coarse=True, has_gate=True, store_fine=True, ignore_padding=ignore,
                                       fine_rounding=True, config=sm90_backend.FORWARD)
    assert plan.backend == "sm90" and plan.workspaces == sm90_backend.workspaces("forward", p)
    assert set(plan.workspaces) == ({"k_valid", "v_valid"} if ignore else set())
    if ignore:
        copies = [l for l in plan.launches if l.kernel_name == "valid_rows_copy_kernel"]
        assert [l.buffers for l in copies] == [("k", "k_valid", "kv_counts"), ("v", "v_valid", "kv_counts")]
    _check_schedule(plan)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_vsa_backward_plan_records_the_cute_step(padding, layout):
    p = _vsa(padding=padding, layout=layout)
    plan = _plan("backward", p)
    ignore = padding == "ignore"
    assert [l.kernel_name for l in plan.launches] == (BACKWARD_TRITON + ["valid_rows_copy_kernel"] * 4 * ignore
                                                      + ["sm90_bwd64"])
    cute = plan.launches[-1]
    v = "_valid" if ignore else ""
    assert dict(cute.args) == dict(q="q" + v, k="k" + v, v="v" + v, dout="dout" + v, lse="lse", delta="delta", dq="dq",
                                   dk="dk", dv="dv", inv_idx="inv_idx", inv_num="inv_num", kv_counts="kv_counts",
                                   dq_accum="dq_accum", dq_pool="dq_pool", dk_pool="dk_pool", dv_pool="dv_pool",
                                   q_counts="q_counts", dkv_partial="dkv_partial", group_flags="group_flags")
    assert cute.statics_dict() == dict(dtype="bfloat16", head_dim=128, layout=layout, softmax_scale=p.softmax_scale,
                                       pool_grads=True, ignore_padding=ignore, config=sm90_backend.BACKWARD)
    assert plan.workspaces["dq_accum"] == ((1, 2, 4, 64 * 128), "float32")
    # the query groups' workspaces: one group at this size (partial sums never read), the ring's counters
    assert plan.workspaces["dkv_partial"] == ((4,), "float32")
    ring = sm90_bwd64_groups.ring_slots(p.n_kv_blocks, sm90_backend.BACKWARD.get("head_sweep", False))
    assert plan.workspaces["group_flags"] == ((ring + 1, 2), "int32")
    assert set(plan.workspaces) == {"dq_accum", *BACKWARD_GROUPS} | ({"q_valid", "dout_valid", "k_valid", "v_valid"}
                                                                      if ignore else set())
    steps = _check_schedule(plan)
    for name in ("dq_accum", "group_flags"):
        assert name in steps[-1].results[:steps[-1].n_param_results], f"{name} born at the cute step (zeroed there)"


@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_block_sparse_plans_have_no_coarse_branch(padding):
    p = _indices(padding=padding)
    fwd, bwd = _plan("forward", p), _plan("backward", p)
    assert fwd.launches[0].kernel_name == "clean_lists_kernel"
    fa, ba = dict(fwd.launches[-1].args), dict(bwd.launches[-1].args)
    assert not {"q_counts", "gate", "out_coarse", "out_fine"} & set(fa)
    assert not {"q_counts", "dq_pool", "dk_pool", "dv_pool"} & set(ba)
    assert fwd.launches[-1].statics_dict()["has_coarse"] is False
    assert bwd.launches[-1].statics_dict()["pool_grads"] is False
    # no query counts: only the padded KV rows are known, so only K and V are copied
    copied = {"k_valid", "v_valid"} if padding == "ignore" else set()
    assert set(fwd.workspaces) == copied and set(bwd.workspaces) == copied | {"dq_accum", *BACKWARD_GROUPS}
    for plan in (fwd, bwd):
        _check_schedule(plan)


def test_inference_forward_keeps_no_fine_output():
    cute = _plan("forward", _vsa(training=False)).launches[-1]
    assert "out_fine" not in dict(cute.args) and cute.statics_dict()["store_fine"] is False


def _check_schedule(plan):
    """Every buffer (the table's and the backend's workspaces) born once; a step's operands exist
    before it; aliases pair equal buffers; a cute step bears only buffers it takes."""
    steps = core_plan.schedule(plan)
    born = []
    for step, launch in zip(steps, plan.launches):
        assert all(b in plan.inputs or b in born for b in step.operands), launch.kernel_name
        assert not set(step.results) & set(plan.inputs)
        for operand, result in step.aliases:
            assert step.operands[operand] == step.results[result]
        aliased = {step.results[r] for _, r in step.aliases}
        new = [b for b in step.results if b not in aliased]
        assert not set(new) & set(born), launch.kernel_name
        born += new
        if launch.kind == "cute":
            assert sorted(step.operands + step.results[:step.n_param_results]) == sorted(launch.buffers)
            assert len(step.results) == step.n_param_results + len(step.aliases)
        else:
            assert step.operands + step.results[:step.n_param_results] == launch.buffers
    assert sorted(born) == sorted({**plan.buffers, **plan.workspaces})
    return steps


_COMPILE_TRITON = textwrap.dedent("""
    from vsa_core import plan as P
    from vsa_core.backends import sm90_backend, sm90_bwd64_groups
    from vsa_core.problem import AttnProblem
    p = AttnProblem(batch=1, heads=2, q_len=256, kv_len=320, head_dim=128, block_elems=64, dtype="bfloat16", topk=2,
                    has_gate=True, padding="ignore", layout="bshd")
    for stage, inputs in (("forward", P.forward_inputs(p)), ("backward", P.backward_inputs(p))):
        plan = P.record_plan(stage, p, inputs, sm90_backend)
        for launch in plan.launches:
            if launch.kind == "triton":
                c = P.compile_launch(launch, plan, 90)
                assert c.cubin[:4] == b"\\x7fELF", launch.kernel_name
                assert tuple(x[1] for x in c.params if x[0] == "buffer") == launch.buffers, launch.kernel_name
                print("COMPILED", stage, c.name)
    """)


def test_sm90_plans_triton_launches_compile_for_sm90():
    """The Triton launches of the sm90 plans (padding="ignore": the valid-rows copies on the
    backend's workspaces too) compile to sm_90 cubins (a subprocess without the interpreter)."""
    proc = compile_in_subprocess(_COMPILE_TRITON)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("COMPILED forward") == 5 and proc.stdout.count("COMPILED backward") == 8, proc.stdout


# ---- the eager launch (CPU, launchers stubbed) ------------------------------------------------
class _NoTriton(Launcher):
    """The eager launcher with the Triton launches recorded, not run."""

    def __init__(self):
        self.triton_launches = []

    def triton(self, kernel, grid, *args, **meta):
        self.triton_launches.append(args)


def _stub_launchers(monkeypatch):
    calls = []

    def prepare(kind):
        def prepare_fn(*args, **kwargs):
            calls.append((kind, args, kwargs))
            return lambda: calls.append((kind, "launched"))
        return prepare_fn

    monkeypatch.setitem(sys.modules, "vsa_core.backends.sm90_fwd64",
                        types.SimpleNamespace(prepare_forward64=prepare("fwd")))
    monkeypatch.setitem(sys.modules, "vsa_core.backends.sm90_bwd64_launch",
                        types.SimpleNamespace(prepare_backward64=prepare("bwd")))
    return calls


def _torch_buffers(p: AttnProblem, specs: dict) -> dict:
    import torch
    return {n: torch.zeros(s, dtype=getattr(torch, p.dtype if d == "input" else d)) for n, (s, d) in specs.items()}


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_eager_forward_hands_the_launcher_what_the_backend_did(padding, layout, monkeypatch):
    """The arguments of `prepare_forward64` through `launcher.cute` are those the backend passed
    it before the seam: [B, H, S, D] views of the buffers (BSHD transposed, no copy), the
    valid-rows copies under "ignore", full query counts under "zeros", the configuration."""
    from vsa_core.backends.base import FineForward
    calls = _stub_launchers(monkeypatch)
    p = _vsa(padding=padding, layout=layout)
    b = _torch_buffers(p, {**_inputs("forward", p), **p.forward_buffers()})
    launcher = _NoTriton()
    sm90_backend.sparse_forward(launcher, p, FineForward(**{f.name: b.get(f.name) for f in
                                                            dataclasses.fields(FineForward)}))
    (kind, args, kwargs), launched = calls
    assert kind == "fwd" and launched == ("fwd", "launched")
    view = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(1, 2))
    q, k, v, out, lse, sel_idx, sel_num, kv_counts = args
    for got, name in ((q, "q"), (out, "out")):
        assert got.shape == view(b[name]).shape and got.data_ptr() == b[name].data_ptr()
    if padding == "ignore":
        copies = launcher.triton_launches
        assert len(copies) == 2 and copies[0][0] is b["k"] and copies[1][0] is b["v"]
        assert k.data_ptr() == copies[0][1].data_ptr() and v.data_ptr() == copies[1][1].data_ptr()
        assert kwargs["q_counts"] is b["q_counts"]
    else:
        assert not launcher.triton_launches and k.data_ptr() == b["k"].data_ptr()
        assert kwargs["q_counts"].tolist() == [64] * p.n_q_blocks
    assert lse is b["lse"] and sel_idx is b["sel_idx"] and sel_num is b["sel_num"] and kv_counts is b["kv_counts"]
    assert kwargs["out_coarse"] is b["out_coarse"] and kwargs["gate"].data_ptr() == b["gate"].data_ptr()
    assert kwargs["out_fine"].data_ptr() == b["out_fine"].data_ptr()
    assert kwargs["softmax_scale"] == p.softmax_scale
    assert {n: kwargs[n] for n in sm90_backend.FORWARD} == sm90_backend.FORWARD


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_eager_backward_hands_the_launcher_what_the_backend_did(padding, monkeypatch):
    from vsa_core.backends.base import FineBackward
    calls = _stub_launchers(monkeypatch)
    p = _vsa(padding=padding, layout="bshd")
    b = _torch_buffers(p, {**_inputs("backward", p), **p.backward_buffers()})
    launcher = _NoTriton()
    sm90_backend.sparse_backward(launcher, p, FineBackward(**{f.name: b.get(f.name) for f in
                                                              dataclasses.fields(FineBackward)}))
    (kind, args, kwargs), launched = calls
    assert kind == "bwd" and launched == ("bwd", "launched")
    q, k, v, dout, lse, delta, dq, dk, dv, inv_idx, inv_num, kv_counts = args
    assert lse is b["lse"] and delta is b["delta"] and inv_idx is b["inv_idx"] and inv_num is b["inv_num"]
    assert dq.data_ptr() == b["dq"].data_ptr() and dq.shape == b["dq"].transpose(1, 2).shape
    acc = kwargs["dq_accum"]
    assert tuple(acc.shape) == (1, 2, 4, 64 * 128) and str(acc.dtype) == "torch.float32"
    assert kwargs["ignore_padding"] is (padding == "ignore") and kwargs["q_counts"] is b["q_counts"]
    assert all(kwargs[n] is b[n] for n in ("dq_pool", "dk_pool", "dv_pool"))
    copies = launcher.triton_launches
    if padding == "ignore":
        assert [c[0] is b[n] for c, n in zip(copies, ("q", "dout", "k", "v"))] == [True] * 4
        assert [x.data_ptr() for x in (q, dout, k, v)] == [c[1].data_ptr() for c in copies]
    else:
        assert not copies and q.data_ptr() == b["q"].data_ptr()
    assert {n: kwargs[n] for n in sm90_backend.BACKWARD} == sm90_backend.BACKWARD


# ---- lowered for CUDA on the CPU (jax + nvidia-cutlass-dsl, torch blocked) ---------------------
LOWER = textwrap.dedent("""
    import re, types
    import jax, jax.numpy as jnp
    import cutlass.jax
    from vsa_core import plan as P
    from vsa_core.backends import cudnn_backend, fine_residual, sm90_backend
    from vsa_core.problem import AttnProblem
    from vsa_jax import native
    from vsa_jax.cutlass_common import compile_without_gpu
    BACKEND = globals().get("BACKEND", "sm90")
    backend_module = {"sm90": sm90_backend, "cudnn": cudnn_backend}[BACKEND]

    # no CUDA here: the Triton launches are stubbed (test_jax_native compiles them), the CuTe DSL
    # kernels compile for real (for sm_90a, CUTE_DSL_ARCH)
    native._capability = lambda device: 90
    native.core_plan.compile_launch = lambda launch, plan, cap: types.SimpleNamespace(name=launch.kernel_name)
    native._kernel_call = lambda compiled, cap: compiled.name.encode()

    def lowered(stage, p, inputs, mapped=False):
        names = list(inputs)
        args = [jax.ShapeDtypeStruct(s, jnp.dtype(p.dtype if d == "input" else d)) for s, d in inputs.values()]
        fn = lambda *xs: native.run(stage, p, dict(zip(names, xs)), BACKEND)
        if mapped:  # a leading axis of 2 on q only: each element runs alone (a loop)
            args[0] = jax.ShapeDtypeStruct((2, *args[0].shape), args[0].dtype)
            fn = jax.vmap(fn, in_axes=(0,) + (None,) * (len(args) - 1))
        checks = [*cutlass.jax.get_export_disabled_safety_checks(),
                  jax.export.DisabledSafetyCheck.custom_call(native.FFI_TARGET)]
        with compile_without_gpu():
            exported = jax.export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=checks)(*args)
        return exported.mlir_module()

    from vsa_core.spec import forward_results

    def stage_inputs(stage, p):
        if p.is_vsa:
            return P.forward_inputs(p) if stage == "forward" else P.backward_inputs(p)
        tok = {"q": (p.token_shape(p.q_len), "input"), "k": (p.token_shape(p.kv_len), "input"),
               "v": (p.token_shape(p.kv_len), "input"), "kv_counts": ((p.n_kv_blocks,), "int32")}
        if stage == "forward":
            lists = (p.batch, p.heads, p.n_q_blocks)
            return {**tok, "given_idx": (lists + (p.select_capacity,), "int32"), "given_num": (lists, "int32")}
        kept = {n: spec for n, spec in p.forward_buffers().items() if n in forward_results(p)}
        return {"dout": (p.token_shape(p.q_len), "input"), **tok, **kept}

    for stage, padding, layout, extra in CASES:
        kw = dict(batch=1, heads=2, q_len=256, kv_len=320, head_dim=128, block_elems=64, dtype="bfloat16",
                  topk=2, has_gate=True, padding=padding, layout=layout, fine_residual=fine_residual(BACKEND))
        kw.update(extra)
        p = AttnProblem(**kw)
        inputs = stage_inputs(stage, p)
        plan = P.record_plan(stage, p, inputs, backend_module)
        text = lowered(stage, p, inputs)
        calls = re.findall(r"stablehlo\\.custom_call @(\\w+)", text)
        n_triton = sum(l.kind == "triton" for l in plan.launches)
        assert sorted(calls) == sorted([native.FFI_TARGET] * n_triton + ["CuteDSLRT_NvJaxCutlassCall_v2"]), calls
        assert "callback" not in text
        line = next(ln for ln in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall_v2" in ln)
        assert "output_operand_aliases" in line and "-arch sm_90a" in line
        D, dt = p.head_dim, {"bfloat16": "bf16", "float16": "f16"}[p.dtype]
        tok = f"1x256x2x{D}x{dt}" if layout == "bshd" else f"1x2x256x{D}x{dt}"
        assert f"tensor<{tok}>" in line, line[-2000:]
        if stage == "backward" and BACKEND == "sm90":
            assert f"tensor<1x2x4x{64 * D}xf32>" in line  # the dQ accumulator, handed in (zeroed)
        print("LOWERED", stage, padding, layout, n_triton)
        if padding == "zeros" and not extra:  # not mapped (native.run without the callback to fall back on)
            try:
                lowered(stage, p, inputs, mapped=True)
            except NotImplementedError as e:
                assert "vmap" in str(e) and "set_launch('callback')" in str(e), e
                print("REFUSED under vmap")
    """)


@pytest.mark.skipif(not HAS_CUTE_JAX, reason="needs jax and nvidia-cutlass-dsl 4.8.1")
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_native_stage_lowers_to_triton_calls_and_one_cute_call(stage):
    cases = [(stage, "zeros", "bhsd", {}), (stage, "ignore", "bshd", {})]
    out = run_without_torch(f"CASES = {cases!r}\n" + LOWER, "cpu", {"CUTE_DSL_ARCH": "sm_90a"})
    assert out.count("LOWERED") == 2 and out.count("REFUSED under vmap") == 1, out


VARIANTS = {  # each a specialization of the kernel classes the GPU tests run
    "indices": dict(selection="indices", topk=None, has_gate=False, list_capacity=3),
    "fp16-d64-no-gate": dict(dtype="float16", head_dim=64, has_gate=False),
    "inference": dict(training=False),
}


@pytest.mark.skipif(not HAS_CUTE_JAX, reason="needs jax and nvidia-cutlass-dsl 4.8.1")
@pytest.mark.parametrize("variant", VARIANTS)
def test_native_variants_lower(variant):
    """Block-sparse lists (no coarse branch, no pooling gradients), fp16 at head dim 64 without a
    gate, inference (no fine output kept): the kernels compile for sm_90a inside the custom call."""
    extra = VARIANTS[variant]
    stages = ("forward",) if extra.get("training") is False else ("forward", "backward")
    cases = [(stage, "ignore" if variant == "indices" else "zeros", "bshd", extra) for stage in stages]
    out = run_without_torch(f"CASES = {cases!r}\n" + LOWER, "cpu", {"CUTE_DSL_ARCH": "sm_90a"})
    assert out.count("LOWERED") == len(stages), out


SHARD_MAP = textwrap.dedent("""
    import re, types
    import jax, jax.numpy as jnp
    import cutlass.jax
    from jax.sharding import NamedSharding, PartitionSpec as PS
    from vsa_core import plan as P
    from vsa_core.backends import sm90_backend, sm90_bwd64_groups
    from vsa_core.problem import AttnProblem
    from vsa_jax import native, ops
    from vsa_jax.cutlass_common import compile_without_gpu

    native._capability = lambda device: 90
    native.core_plan.compile_launch = lambda launch, plan, cap: types.SimpleNamespace(name=launch.kernel_name)
    native._kernel_call = lambda compiled, cap: compiled.name.encode()
    native.set_launch("native")

    def problem(heads):
        return AttnProblem(batch=1, heads=heads, q_len=256, kv_len=320, head_dim=128, block_elems=64,
                           dtype="bfloat16", topk=2, has_gate=True)

    p = problem(2)  # each device's heads
    inputs = P.forward_inputs(problem(4))
    names = list(inputs)
    mesh = jax.make_mesh((2,), ("x",))
    specs = tuple(PS(None, "x") if len(s) == 4 else PS() for s, _ in inputs.values())
    args = [jax.ShapeDtypeStruct(s, jnp.dtype(p.dtype if d == "input" else d), sharding=NamedSharding(mesh, sp))
            for (s, d), sp in zip(inputs.values(), specs)]

    def local(*xs):  # vsa_jax.ops._run: results typed as varying like the inputs (check_vma on)
        return ops._run("forward", p, sm90_backend, **dict(zip(names, xs)))["out"]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=PS(None, "x")))
    checks = [*cutlass.jax.get_export_disabled_safety_checks(),
              jax.export.DisabledSafetyCheck.custom_call(native.FFI_TARGET)]
    with compile_without_gpu():
        text = jax.export.export(fn, platforms=("cuda",), disabled_checks=checks)(*args).mlir_module()
    calls = re.findall(r"stablehlo\\.custom_call @(\\w+)", text)
    assert calls == [native.FFI_TARGET] * 3 + ["CuteDSLRT_NvJaxCutlassCall_v2"], calls
    print("LOWERED under shard_map")
    """)


@pytest.mark.skipif(not HAS_CUTE_JAX, reason="needs jax and nvidia-cutlass-dsl 4.8.1")
def test_native_forward_lowers_inside_shard_map():
    """Inside jax.shard_map (check_vma on, heads split over 2 devices) the native sm90 forward
    type-checks and lowers for CUDA: each device's plan, one CuTe DSL call."""
    out = run_without_torch(SHARD_MAP, "cpu", {"CUTE_DSL_ARCH": "sm_90a",
                                           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert "LOWERED under shard_map" in out


DEFAULT_LOWER = textwrap.dedent("""
    import re, types
    import jax, jax.numpy as jnp
    import cutlass.jax
    from vsa_core import plan as P
    from vsa_core.backends import sm90_backend, sm90_bwd64_groups
    from vsa_core.config import LaunchConfig, config
    from vsa_core.problem import AttnProblem
    from vsa_jax import native, ops
    from vsa_jax.cutlass_common import compile_without_gpu

    assert config().jax_launch == LaunchConfig().jax_launch  # the default launch, nothing set
    # the default device as a CUDA sm_90 one; the Triton launches' compiling stubbed (no CUDA here)
    native._cuda_capability = lambda device: 90
    native.core_plan.compile_launch = lambda launch, plan, cap: types.SimpleNamespace(name=launch.kernel_name)
    native._kernel_call = lambda compiled, cap: compiled.name.encode()

    p = AttnProblem(batch=1, heads=2, q_len=256, kv_len=320, head_dim=128, block_elems=64, dtype="bfloat16",
                    topk=2, has_gate=True)
    for stage in ("forward", "backward"):
        inputs = P.forward_inputs(p) if stage == "forward" else P.backward_inputs(p)
        names = list(inputs)
        args = [jax.ShapeDtypeStruct(s, jnp.dtype(p.dtype if d == "input" else d)) for s, d in inputs.values()]
        fn = lambda *xs: ops._run(stage, p, sm90_backend, **dict(zip(names, xs)))  # where the launch is chosen
        checks = [*cutlass.jax.get_export_disabled_safety_checks(),
                  jax.export.DisabledSafetyCheck.custom_call(native.FFI_TARGET)]
        with compile_without_gpu():
            text = jax.export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=checks)(*args).mlir_module()
        calls = re.findall(r"stablehlo\\.custom_call @(\\w+)", text)
        n_triton = sum(l.kind == "triton" for l in P.record_plan(stage, p, inputs, sm90_backend).launches)
        assert sorted(calls) == sorted([native.FFI_TARGET] * n_triton + ["CuteDSLRT_NvJaxCutlassCall_v2"]), calls
        assert "callback" not in text
        print("DEFAULT LOWERED", stage, n_triton)
    """)


@pytest.mark.skipif(not HAS_CUTE_JAX, reason="needs jax and nvidia-cutlass-dsl 4.8.1")
def test_the_default_launch_lowers_sm90_to_custom_calls_only():
    """With no launch set (the default) on a CUDA device, the sm90 forward and backward lower for
    CUDA to their Triton custom calls and one CuTe DSL custom call each, no Python callback."""
    env = {"CUTE_DSL_ARCH": "sm_90a", "VSA_JAX_LAUNCH": ""}
    out = run_without_torch(DEFAULT_LOWER, "cpu", env)
    assert out.count("DEFAULT LOWERED") == 2, out


def test_native_selects_the_native_stages_in_native_mode(launch_config):
    from vsa_jax import native
    launch_config(jax_launch="native")
    assert native.selected(sm90_backend) and native.selected(types.SimpleNamespace(name="triton"))
    assert native.selected(types.SimpleNamespace(name="cudnn"), stage="backward")
    cute = types.SimpleNamespace(name="cute")  # FA4's forward and backward (fa4_call)
    assert native.selected(cute) and native.selected(cute, stage="backward")
    launch_config(jax_launch="callback")
    assert not native.selected(sm90_backend)


# ---- GPU: native == callback == torch ---------------------------------------------------------
GPU_CASES = [Case(head_dim=128), Case(head_dim=128, layout="bshd"), Case(head_dim=64, dtype="float16", layout="bshd",
                                                                          gate=False),
             Case(head_dim=128, n_q_blocks=9, n_kv_blocks=11, topk=5, batch=1, heads=3)]
# one rounding of q's dtype: dq is the fp32 sum of per-KV-block partials whose order the atomics
# change run to run (each order within a few fp32 ulps of the sum), then rounded once, so two runs
# differ by at most one ulp of the rounded value (spacing 2^-7 relative in bf16, 2^-10 in fp16),
# plus an fp32 cancellation floor where the sum is near 0
_DQ_ULP = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def assert_dq_within_reduction_order(case, got, want, what):
    a, b = got["dq"].astype(np.float64), want["dq"].astype(np.float64)
    bound = _DQ_ULP[case.dtype] * np.maximum(np.abs(a), np.abs(b)) + 2.0 ** -16 * np.abs(b).max()
    worst = np.max(np.abs(a - b) - bound)
    assert worst <= 0, f"dq: {what} differ by more than the reduction order allows (excess {worst:.3e})"


def _bitwise(got, want, names, what):
    for name in names:
        diff = np.abs(got[name] - want[name]).max()
        assert np.array_equal(got[name], want[name]), f"{name}: max |{what}| = {diff:.3e}"


def _require_sm90_jax(case):
    from test_cudnn_backend import require_backend
    require_jax_gpu()
    require_backend("sm90", case)


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id())
def test_gpu_native_matches_callback_and_torch(case, padding, launch_config):
    """VSA forward + backward: native == callback == torch bit for bit (out, dk, dv, dgate), dq
    within the atomics' reduction order, all close to float64. "ignore" with NaN / inf in every
    padded row of q, k, v, the gate and dout (the valid-rows copies are what the kernels read)."""
    from frontends import run_jax_vjp, run_torch
    from test_padding import with_non_finite_padding
    _require_sm90_jax(case)
    launch_config(autotune=False)  # the plan runs the Triton stages' default tiles; so do the others
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()) + 23)
    if padding == "ignore":
        inputs = with_non_finite_padding(inputs, case.E)
    launch_config(jax_launch="native")
    native_got = run_jax_vjp(case, inputs, backend="sm90", padding=padding)
    launch_config(jax_launch="callback")
    callback_got = run_jax_vjp(case, inputs, backend="sm90", padding=padding)
    torch_got = run_torch(case, inputs, backend="sm90", padding=padding)
    assert_close(case, native_got, reference(case, inputs, padding))
    exact = ["out", "dk", "dv"] + ["dgate"] * case.gate
    for other, got in (("native - callback", callback_got), ("native - torch", torch_got)):
        _bitwise(native_got, got, exact, other)
        assert_dq_within_reduction_order(case, native_got, got, other)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
def test_gpu_native_query_groups_match_torch(persistent, monkeypatch, launch_config):
    """The backward with several query groups (one query block each: 7 groups), as the grid or
    persistent, under JAX's native call and torch: dk, dv and dgate bit for bit (the partial sums
    are added in group order in both), dq within the reduction order, close to float64. A shape no
    other test runs, so no plan recorded with the default configuration is reused."""
    from frontends import run_jax_vjp, run_torch
    case = Case(head_dim=128, n_q_blocks=7, n_kv_blocks=6, topk=3, batch=1, heads=2)
    _require_sm90_jax(case)
    monkeypatch.setitem(sm90_backend.BACKWARD, "q_group_bytes", 64 * 128 * 8)
    monkeypatch.setitem(sm90_backend.BACKWARD, "persistent", persistent)
    if persistent:  # its chunk is the grid's size: no head sweep
        monkeypatch.setitem(sm90_backend.BACKWARD, "head_sweep", False)
    assert sm90_bwd64_groups.groups_of(case.n_q_blocks, 128, sm90_backend.BACKWARD["q_group_bytes"]) == 7
    launch_config(autotune=False)
    inputs = make_inputs(case, seed=31 + persistent)
    launch_config(jax_launch="native")
    native_got = run_jax_vjp(case, inputs, backend="sm90")
    torch_got = run_torch(case, inputs, backend="sm90")
    assert_close(case, native_got, reference(case, inputs))
    _bitwise(native_got, torch_got, ["out", "dk", "dv", "dgate"], "native - torch")
    assert_dq_within_reduction_order(case, native_got, torch_got, "native - torch")


@pytest.mark.gpu
def test_gpu_native_program_has_no_callback(launch_config):
    """The jitted native program holds the CuTe DSL custom calls (forward, backward) and no callback."""
    import jax
    from frontends import jax_args, vsa_fn
    case = Case(head_dim=128)
    _require_sm90_jax(case)
    launch_config(jax_launch="native")
    inputs = make_inputs(case, seed=3)
    f = vsa_fn(case, inputs["kv_counts"], inputs["q_counts"], backend="sm90")
    q, k, v, gate, dout = jax_args(case, inputs)
    text = jax.jit(lambda *a: jax.vjp(f, *a)[1](dout)).lower(q, k, v, gate).as_text()
    assert text.count("CuteDSLRT_NvJaxCutlassCall_v2") >= 2 and "callback" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_gpu_native_block_sparse_from_indices(layout, padding, launch_config):
    """block_sparse_attn_from_indices (no coarse branch): out, lse, dk, dv bit for bit native ==
    callback == torch, dq within the reduction order, all close to float64 (the lists' block map)."""
    import jax
    import jax.numpy as jnp
    import torch

    import vsa_jax
    import vsa_torch
    from common import from_layout, to_layout
    from vsa_core import reference as R
    case = Case(head_dim=128, gate=False, layout=layout, n_q_blocks=4, n_kv_blocks=5)
    _require_sm90_jax(case)
    launch_config(autotune=False)
    E = case.E
    inputs = make_inputs(case, seed=61 + (layout == "bshd") + 2 * (padding == "ignore"), margin=None)
    if padding == "ignore":  # NaN / inf in the padded K and V rows: never read
        from test_padding import with_non_finite_padding
        inputs = with_non_finite_padding(inputs, E, names=("k", "v"))
    rng = np.random.default_rng(7)
    cap = 3
    idx = np.sort(np.stack([[[rng.choice(case.n_kv_blocks, cap, replace=False) for _ in range(case.n_q_blocks)]
                             for _ in range(case.heads)] for _ in range(case.batch)]), -1).astype(np.int32)
    num = rng.integers(0, cap + 1, (case.batch, case.heads, case.n_q_blocks)).astype(np.int32)
    counts = inputs["kv_counts"]
    names = ("out", "lse", "dq", "dk", "dv")

    def jax_run(mode):
        launch_config(jax_launch=mode)

        @jax.jit  # traced afresh per mode: the launch mode is read at trace time
        def run(q, k, v, dout):
            def f(q, k, v):
                return vsa_jax.block_sparse_attn_from_indices(q, k, v, jnp.asarray(idx), jnp.asarray(num),
                                                              jnp.asarray(counts), E, layout=layout, backend="sm90",
                                                              padding=padding)
            (out, lse), vjp = jax.vjp(f, q, k, v)
            return out, lse, *vjp((dout, jnp.zeros_like(lse)))

        args = [jnp.asarray(to_layout(inputs[n], layout), jnp.bfloat16) for n in ("q", "k", "v", "dout")]
        res = [np.asarray(x, np.float32) for x in run(*args)]
        return {n: (x if n == "lse" else from_layout(x, layout)) for n, x in zip(names, res)}

    got_native, got_callback = jax_run("native"), jax_run("callback")
    q, k, v = (torch.from_numpy(to_layout(inputs[n], layout)).to("cuda", torch.bfloat16).requires_grad_()
               for n in "qkv")
    out, lse = vsa_torch.block_sparse_attn_from_indices(q, k, v, torch.from_numpy(idx).cuda(),
                                                        torch.from_numpy(num).cuda(), torch.from_numpy(counts).cuda(),
                                                        E, layout=layout, backend="sm90", padding=padding)
    out.backward(torch.from_numpy(to_layout(inputs["dout"], layout)).to("cuda", torch.bfloat16))
    got_torch = {n: (t.detach().float().cpu().numpy() if n == "lse" else
                     from_layout(t.detach().float().cpu().numpy(), layout))
                 for n, t in zip(names, (out, lse, q.grad, k.grad, v.grad))}
    x = {n: R.round_to_dtype(inputs[n], "bfloat16") for n in ("q", "k", "v", "dout")}
    block_map = R.index_lists_to_block_map(idx, num, case.n_kv_blocks)
    ref_out, _, ref_grads = R.block_sparse_attn_reference(x["q"], x["k"], x["v"], block_map, counts, E,
                                                          dout=x["dout"], padding=padding)
    assert_close(case, {n: got_native[n] for n in ("out", "dq", "dk", "dv")}, {"out": ref_out, **ref_grads})
    for other, got in (("native - callback", got_callback), ("native - torch", got_torch)):
        _bitwise(got_native, got, ("out", "lse", "dk", "dv"), other)
        assert_dq_within_reduction_order(case, got_native, got, other)


@pytest.mark.gpu
def test_gpu_native_sm90_runs_with_torch_blocked():
    """`vsa[jax,sm90]` without torch: the native sm90 forward and backward (jit(vjp), both layouts)
    in a process where torch cannot be imported, close to the float64 reference."""
    if not HAS_CUTE_JAX:
        pytest.skip("needs jax and nvidia-cutlass-dsl")
    out = run_without_torch(native_vjp_script("sm90", seed=5), "cuda")
    assert "NATIVE SM90 OK" in out


@pytest.mark.gpu
def test_gpu_native_sm90_under_xla_command_buffers():
    """tests/native_cmdbuf_check.py with the sm90 backend: in a fresh process with command buffers
    on for custom calls, three replays with new inputs equal the callback path (dq within the
    reference tolerance), and XLA's thunks put every native custom call, the CuTe DSL ones
    included, inside a command buffer."""
    require_jax_gpu()
    if not HAS_CUTE_JAX:
        pytest.skip("needs jax and nvidia-cutlass-dsl")
    env = dict(os.environ, VSA_CMDBUF_BACKEND="sm90")
    env["PYTHONPATH"] = REPO + os.pathsep + os.path.join(REPO, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "native_cmdbuf_check.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0 and "ALL EQUAL" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.gpu
def test_gpu_under_vmap_the_default_runs_the_callback(launch_config):
    """jax.vmap over q, k, v, gate, dout (two draws, shared counts). The native launches are not
    mapped (one element at a time the backward gave dk rows of zeros: `native._not_under_vmap`):
    launch="native" refuses, forward and backward, naming the callback; the default ("auto") runs
    the mapped stages through the callback, each element equal to the native call on it alone
    (out, dk, dv, dgate bit for bit, dq within the atomics' reduction order)."""
    import jax
    import jax.numpy as jnp
    from frontends import jax_args, vsa_fn

    from vsa_core.config import LaunchConfig
    from vsa_jax import native
    case = Case(head_dim=128, batch=1)
    _require_sm90_jax(case)
    launch_config(autotune=False)  # the plan runs the Triton stages' default tiles; so does the callback
    draws = [make_inputs(case, seed=40 + i, margin=None) for i in range(2)]
    for d in draws[1:]:
        d["kv_counts"], d["q_counts"] = draws[0]["kv_counts"], draws[0]["q_counts"]
    f = vsa_fn(case, draws[0]["kv_counts"], draws[0]["q_counts"], backend="sm90")

    def out_and_grads(q, k, v, gate, dout):
        out, vjp = jax.vjp(f, q, k, v, gate)
        return (out, *vjp(dout))
    full = [jnp.stack(xs) for xs in zip(*[jax_args(case, d) for d in draws])]
    launch_config(jax_launch="native")
    for fn, args in ((f, full[:4]), (out_and_grads, full)):
        with pytest.raises(NotImplementedError, match=r"vmap.*set_launch\('callback'\)"):
            jax.jit(jax.vmap(fn)).lower(*args)
    launch_config(jax_launch=LaunchConfig().jax_launch)
    mapped = jax.jit(jax.vmap(out_and_grads))
    text = mapped.lower(*full).as_text()
    assert "callback" in text and "CuteDSLRT_NvJaxCutlassCall_v2" not in text and native.FFI_TARGET not in text
    together = mapped(*full)
    names = ("out", "dq", "dk", "dv", "dgate")
    alone_fn = jax.jit(out_and_grads)
    for j, d in enumerate(draws):
        args = jax_args(case, d)
        assert "CuteDSLRT_NvJaxCutlassCall_v2" in alone_fn.lower(*args).as_text()  # alone: native
        got = {n: np.asarray(x[j], np.float32) for n, x in zip(names, together)}
        want = {n: np.asarray(x, np.float32) for n, x in zip(names, alone_fn(*args))}
        _bitwise(got, want, ("out", "dk", "dv", "dgate"), f"vmap element {j} - alone")
        assert_dq_within_reduction_order(case, got, want, f"vmap element {j} - alone")


@pytest.mark.gpu
def test_gpu_native_sm90_runs_no_python_per_call(monkeypatch, launch_config):
    """Once compiled, the native sm90 program never calls back into Python: with the core's
    operators and the backend's eager launches replaced by functions that raise, new inputs
    still run, and right."""
    import jax
    from frontends import jax_args, vsa_fn
    case = Case(head_dim=128, batch=1)
    _require_sm90_jax(case)
    launch_config(jax_launch="native")
    first, fresh = make_inputs(case, seed=8), make_inputs(case, seed=9)
    names = ("out", "dq", "dk", "dv", "dgate")

    @jax.jit
    def run(q, k, v, gate, dout, kv_counts, q_counts):  # the counts traced: new values need no new trace
        out, vjp = jax.vjp(vsa_fn(case, kv_counts, q_counts, backend="sm90"), q, k, v, gate)
        return (out, *vjp(dout))

    def counts(inputs):
        return [jax.numpy.asarray(inputs[n], jax.numpy.int32) for n in ("kv_counts", "q_counts")]

    run(*jax_args(case, first), *counts(first))

    def no_python(*_, **__):
        raise AssertionError("Python ran during a native call")

    from vsa_core import ops as core_ops
    for module, name in ((core_ops, "forward"), (core_ops, "backward"), (sm90_backend, "launch_forward64"),
                         (sm90_backend, "launch_backward64"), (sm90_backend, "sparse_forward"),
                         (sm90_backend, "sparse_backward")):
        monkeypatch.setattr(module, name, no_python)
    got = dict(zip(names, (np.asarray(x, np.float32) for x in run(*jax_args(case, fresh), *counts(fresh)))))
    assert_close(case, got, reference(case, fresh))  # bhsd: no layout swap


# ---- the callback path (eager launcher on XLA's buffers; launchers stubbed) ----------------------
@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_callback_path_copies_into_torch_workspaces(padding, monkeypatch):
    """vsa_jax's callback path (JAX arrays, the core on DeviceBuffers over XLA's buffers, the eager
    launcher): under padding="ignore" the valid-rows copies are Triton launches from XLA's buffers
    into torch workspaces, and the stubbed kernel launchers get torch views: K and V with the
    padded rows zeroed, the given q_counts; the backward also Q and dO zeroed and an fp32 dQ
    accumulator of its shape."""
    import jax.numpy as jnp
    from vsa_core.spec import forward_results
    from vsa_jax import ops as jax_ops
    calls = []

    def record(kind):
        def prepare(*args, **kwargs):
            keep = lambda x: x.detach().float().cpu().numpy() if hasattr(x, "detach") else x  # noqa: E731
            calls.append((kind, [keep(a) for a in args], {n: keep(v) for n, v in kwargs.items()}))
            return lambda: None
        return prepare

    monkeypatch.setitem(sys.modules, "vsa_core.backends.sm90_fwd64",
                        types.SimpleNamespace(prepare_forward64=record("fwd")))
    monkeypatch.setitem(sys.modules, "vsa_core.backends.sm90_bwd64_launch",
                        types.SimpleNamespace(prepare_backward64=record("bwd")))
    p = _vsa(q_len=128, kv_len=192, head_dim=64, padding=padding, layout="bshd")
    rng = np.random.default_rng(0)
    counts = {"q_counts": np.array([64, 40], np.int32), "kv_counts": np.array([64, 40, 0], np.int32)}
    inputs = {n: jnp.asarray(counts[n]) if d == "int32" else jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
              for n, (s, d) in core_plan.forward_inputs(p).items()}

    def valid(name, count_name):  # BHSD float32 with the padded rows zeroed under "ignore"
        x = np.asarray(inputs[name].astype(jnp.float32)).transpose(0, 2, 1, 3).copy()
        for blk, c in enumerate(counts[count_name] if padding == "ignore" else ()):
            x[:, :, blk * 64 + c:(blk + 1) * 64] = 0
        return x

    results = jax_ops._callback("forward", p, sm90_backend)(inputs)
    (_, args, kwargs), = calls
    assert np.array_equal(args[1], valid("k", "kv_counts")) and np.array_equal(args[2], valid("v", "kv_counts"))
    assert kwargs["q_counts"].tolist() == ([64, 40] if padding == "ignore" else [64, 64])
    inputs["dout"] = jnp.asarray(rng.standard_normal(inputs["q"].shape), jnp.bfloat16)
    kept = {n: results[n] for n in forward_results(p)}
    bwd_inputs = {n: x for n, x in {**inputs, **kept}.items() if n in core_plan.backward_inputs(p)}
    jax_ops._callback("backward", p, sm90_backend)(bwd_inputs)
    (_, args, kwargs) = calls[1]
    assert np.array_equal(args[0], valid("q", "q_counts")) and np.array_equal(args[3], valid("dout", "q_counts"))
    assert np.array_equal(args[1], valid("k", "kv_counts"))
    assert kwargs["dq_accum"].shape == (1, 2, 2, 64 * 64) and kwargs["ignore_padding"] is (padding == "ignore")
