"""vsa_jax.fa4_call: the cute backend's forward and backward (FA4's sm_90 block-sparse kernels) as XLA
custom calls.

On the CPU (no GPU, no NVIDIA driver; FA4's cross-compilation settings FLASH_ATTENTION_NUM_SMS=132,
FLASH_ATTENTION_ARCH=sm_90 and CUTE_DSL_ARCH=sm_90a): FA4's interface configures the forward's kernel
object and the backward's three (preprocess, main kernel, dQ postprocess) from fake tensors and is left
as it was; lowered for CUDA through jax.export (cross-platform lowering, on the CPU) the forward compiles
for sm_90a and is one stablehlo.custom_call to the CuTe DSL runtime's FFI handler, alone or inside the
cute backend's forward stage; the backward stage is the same, one CuTe DSL call running FA4's three
kernels, with the stage's Triton launches as Triton custom calls; the whole VSA vjp holds the two CuTe
calls and no callback; the default launch takes both stages on an sm_90 device.
On an H100/H200 (`gpu` tests): the native forward equals the torch eager forward bit for bit (out and
lse of block_sparse_attn; out and dgate of VSA under jit(vjp), whose backward runs natively too: dq, dk,
dv within the reference tolerance of torch's, FA4 reducing dQ with fp32 atomics), close to the float64
reference; the jitted vjp holds the two CuTe custom calls and no callback; under XLA command buffers
the custom calls are inside a command buffer and replays equal the callback.

    pytest tests/test_jax_fa4_call.py -v     # CPU: the gpu ones skip
    (GPU machine: the same command; needs flash-attn-4==4.0.0b36, nvidia-cutlass-dsl==4.8.1, jax[cuda], torch)
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if any(importlib.util.find_spec(m) is None for m in ("jax", "torch", "cutlass", "flash_attn")):
    pytest.skip("needs jax, torch, nvidia-cutlass-dsl 4.8.1 and flash-attn-4 4.0.0b36", allow_module_level=True)

from vsa_jax import fa4_call  # noqa: E402

if fa4_call.library_error() is not None:
    pytest.skip(f"FA4's forward cannot be taken here: {fa4_call.library_error()}", allow_module_level=True)

# FA4's (its SM count, and the kernel family its backward interface reads from the device) and the CuTe DSL's
CROSS_COMPILE = {"FLASH_ATTENTION_NUM_SMS": "132", "FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a"}
CUTE_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"


def run_lowering(code: str) -> str:
    """`code` in a fresh python with JAX on the CPU and the cross-compilation settings; its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    env.update(JAX_PLATFORMS="cpu", **CROSS_COMPILE)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


# ---- CPU ---------------------------------------------------------------------------------------
KERNEL = textwrap.dedent("""
    import cutlass.cute
    from flash_attn.cute import interface
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from vsa_core.backends._cute_mask import vsa_kv_tail_mask
    from vsa_jax import fa4_call

    def size(cache):  # FA4's JITCache keeps its entries in `.cache`
        return len(getattr(cache, "cache", cache))

    caches = {f: (f.compile_cache, size(f.compile_cache)) for f in vars(interface).values()
              if hasattr(f, "compile_cache")}
    assert interface._flash_attn_fwd in caches
    for E, D, layout in ((128, 128, "bhsd"), (256, 64, "bshd")):
        cfg = fa4_call.Fa4Forward(1, 2, 4 * E, 3 * E, D, "bfloat16", layout, E, 3 * E // 128, D ** -0.5)
        got = fa4_call.configured_forward(cfg)
        k = got.kernel
        assert type(k) is FlashAttentionForwardSm90 and k.mask_mod is vsa_kv_tail_mask and k.tile_n == 128
        assert k.q_subtile_factor * k.tile_m == E, (k.q_subtile_factor, k.tile_m)
        assert got.names[:6] == ("mQ", "mK", "mV", "mO", "mLSE", "softmax_scale") and got.names[-1] == "stream"
        assert all(v is None for _, v in got.fixed), got.fixed   # no varlen, paging, window or sink
        assert got.options == "" and got.aux_scalars is None
        print("KERNEL", E, D, layout, k.tile_m, k.q_subtile_factor)
        for has_dlse in (True, False):
            cfg = fa4_call.Fa4Backward(1, 2, 4 * E, 3 * E, D, "bfloat16", layout, E, D ** -0.5, has_dlse)
            got = fa4_call.configured_backward(cfg)
            pre, main, post = (x.kernel for x in got.kernels)
            assert [type(x).__name__ for x in (pre, main, post)] == ["FlashAttentionBackwardPreprocess",
                "FlashAttentionBackwardSm90", "FlashAttentionBackwardPostprocess"]
            assert main.mask_mod is vsa_kv_tail_mask and main.tile_n == 128 and not main.deterministic
            assert main.q_subtile_factor * main.tile_m == E, (main.q_subtile_factor, main.tile_m)
            assert main.qhead_per_kvhead == 1  # dK / dV written directly, no fp32 accumulators for them
            assert ("mdLSE", "dlse") in got.kernels[0].tensors if has_dlse else "mdLSE" not in dict(got.kernels[0].tensors)
            assert dict(got.kernels[2].tensors) == {"mdQaccum": "dq_accum", "mdQ": "dq"}
            assert [x.scalar for x in got.kernels] == [("softmax_scale", 1.0), ("softmax_scale", D ** -0.5),
                                                       ("scale", D ** -0.5)]
            assert all(v is None for x in got.kernels for _, v in x.fixed), [x.fixed for x in got.kernels]
            assert all(x.options == "" for x in got.kernels) and got.aux_scalars is None
            S = 4 * E
            assert dict(got.scratch) == {"lse_log2": ((1, 2, S), "float32"), "dpsum": ((1, 2, S), "float32"),
                                         "dq_accum": ((1, 2, S * D), "float32")}, got.scratch
            print("BACKWARD", E, D, layout, has_dlse, main.tile_m, main.q_subtile_factor)
    assert interface.cute is cutlass.cute
    assert all(f.compile_cache is cache and size(cache) == n for f, (cache, n) in caches.items())
    """)


def test_the_kernels_are_fa4_s_own_and_fa4_is_left_as_it_was():
    """configured_forward takes the FlashAttentionForwardSm90 that FA4's interface builds for the
    torch launch's call (our mask_mod, its q subtiling of our E-token query blocks, its 128-token KV
    tile), with the arguments it compiles it with; configured_backward takes the three objects its
    backward interface compiles (preprocess, FlashAttentionBackwardSm90, dQ postprocess) and FA4's
    scratch shapes (log2 lse, dPsum, fp32 dQ accumulator), with and without dlse; the interface's
    `cute` and compile caches are FA4's own again after, and nothing was compiled into them."""
    out = run_lowering(KERNEL)
    assert out.count("KERNEL") == 2 and out.count("BACKWARD") == 4, out


BACKWARD_CONFIG = textwrap.dedent("""
    import pytest
    from flash_attn.cute import interface
    from vsa_core.backends import cute_backend
    from vsa_jax import fa4_call

    own = interface._tile_size_bwd_sm90
    for config in ((), (("dQ_swapAB", True),)):
        cfg = fa4_call.Fa4Backward(1, 2, 512, 384, 128, "bfloat16", "bhsd", 128, 128 ** -0.5, True, config)
        main = fa4_call.configured_backward(cfg).kernels[1].kernel
        assert type(main).__name__ == "FlashAttentionBackwardSm90"
        assert main.dQ_swapAB is bool(config), (config, main.dQ_swapAB)   # FA4's own at D128: 64 rows, no swap
        assert main.tile_m == 64 and main.tile_n == 128
        assert interface._tile_size_bwd_sm90 is own   # the selector is FA4's own again after the call
    with pytest.raises(ValueError, match="BACKWARD_CONFIG.*num_stages_PdS"):
        with cute_backend._backward_configured({"num_stages_PdS": 1}):   # not in FA4's compile key
            pass
    assert interface._tile_size_bwd_sm90 is own
    print("CONFIGURED")
    """)


def test_the_backward_configuration_overrides_fa4_s_own_for_the_call_only():
    """cute_backend.BACKWARD_CONFIG reaches FA4's backward through its one call site
    (`fa4_backward_call`): with dQ_swapAB the main kernel FA4 builds swaps dQ's GEMM, without it it is
    FA4's own (64 rows at head dim 128, no swap); FA4's selector is its own again after; a field FA4's
    compile key does not hold is refused (its kernel would be cached as FA4's own)."""
    assert "CONFIGURED" in run_lowering(BACKWARD_CONFIG)


def test_the_native_stages_of_the_cute_backend():
    from vsa_core.problem import AttnProblem
    from vsa_jax import native

    def p(**kw):
        base = dict(batch=1, heads=2, q_len=512, kv_len=512, head_dim=128, block_elems=128, dtype="bfloat16", topk=2)
        return AttnProblem(**{**base, **kw})

    for stage in ("forward", "backward"):
        assert native.has_native("cute", stage, p()) and native.has_native("cute", stage, p(block_elems=256))
        assert native.has_native("cute", stage) and native.native_reason("cute", stage, p()) is None
        assert fa4_call.native_reason(p(head_dim=64, dtype="float16"), stage=stage) is None
        assert "blocks" in fa4_call.native_reason(p(block_elems=64), stage=stage)
        assert "sm_90a" in fa4_call.native_reason(p(), capability=100, stage=stage)
    assert "sm_90a" in native.unavailable_reason("cute", 100)
    assert native.unavailable_reason("cute", 90) is None


def test_arguments_are_checked_at_trace_time():
    """Wrong shapes are refused before FA4 is asked for a kernel."""
    import jax
    import jax.numpy as jnp
    q = jax.ShapeDtypeStruct((1, 2, 1024, 128), jnp.bfloat16)
    idx, num, sub = (jax.ShapeDtypeStruct(s, jnp.int32) for s in ((1, 2, 4, 8), (1, 2, 4), (8,)))
    f = lambda *a: fa4_call.fa4_forward(*a, block_elems=256)  # noqa: E731
    with pytest.raises(ValueError, match="mask_idx must be int32"):
        jax.jit(f).trace(q, q, q, idx, num, jax.ShapeDtypeStruct((1, 2, 4, 9), jnp.int32), num, sub)
    with pytest.raises(ValueError, match="sub_counts must be int32"):
        jax.jit(f).trace(q, q, q, idx, num, idx, num, jax.ShapeDtypeStruct((4,), jnp.int32))
    with pytest.raises(ValueError, match="blocks of"):
        idx, num = jax.ShapeDtypeStruct((1, 2, 16, 8), jnp.int32), jax.ShapeDtypeStruct((1, 2, 16), jnp.int32)
        jax.jit(lambda *a: fa4_call.fa4_forward(*a, block_elems=64)).trace(q, q, q, idx, num, idx, num, sub)


FORWARD_LOWER = textwrap.dedent("""
    import re
    import jax, jax.numpy as jnp
    from vsa_jax import fa4_call
    from vsa_jax.cutlass_common import compile_without_gpu, lower_for_cuda

    for E, D, layout in ((128, 128, "bhsd"), (256, 64, "bshd")):
        B, H, S, C = 1, 2, 1024, 6
        tok = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
        lists = (jax.ShapeDtypeStruct((B, H, S // E, C), jnp.int32), jax.ShapeDtypeStruct((B, H, S // E), jnp.int32))
        args = (jax.ShapeDtypeStruct(tok, jnp.bfloat16),) * 3 + lists * 2 + (jax.ShapeDtypeStruct((S // 128,), jnp.int32),)
        f = lambda *a: fa4_call.fa4_forward(*a, block_elems=E, layout=layout)
        with compile_without_gpu():
            text = lower_for_cuda(f, *args)
        calls = re.findall(r"stablehlo\\.custom_call @(\\w+)", text)
        assert calls == ["CuteDSLRT_NvJaxCutlassCall_v2"], calls
        assert "callback" not in text
        line = next(ln for ln in text.splitlines() if "stablehlo.custom_call" in ln)
        assert "-arch sm_90a" in line
        assert "tensor<%s>" % "x".join(map(str, tok + ("bf16",))) in line, line[-2000:]
        assert "tensor<1x2x%dx6xi32>" % (S // E) in line and "tensor<1x2x1024xf32>" in line, line[-2000:]
        print("LOWERED", E, layout)
    """)


def test_the_forward_lowers_for_cuda_to_one_cute_call_compiled_for_sm90a():
    """fa4_forward lowered for CUDA on this host (jax.export, no driver): FA4's kernel compiles for
    sm_90a and the program is one typed-FFI custom call to the CuTe DSL runtime, no callback; both
    layouts, 128- and 256-token blocks."""
    out = run_lowering(FORWARD_LOWER)
    assert out.count("LOWERED") == 2, out


STAGE_LOWER = textwrap.dedent("""
    import re, types
    import jax, jax.numpy as jnp
    import cutlass.jax
    from vsa_core import plan as P
    from vsa_core.backends import cute_backend, fine_residual
    from vsa_core.config import LaunchConfig, config
    from vsa_core.problem import AttnProblem
    from vsa_jax import native, ops
    from vsa_jax.cutlass_common import compile_without_gpu

    assert config().jax_launch == LaunchConfig().jax_launch  # the default launch, nothing set
    # no CUDA here: the Triton launches are stubbed (test_jax_native compiles them), FA4's kernel
    # compiles for real (for sm_90a, CUTE_DSL_ARCH); the call's device as an sm_90 one
    native._capability = lambda device: 90
    native._cuda_capability = lambda device: 90
    native.core_plan.compile_launch = lambda launch, plan, cap: types.SimpleNamespace(name=launch.kernel_name)
    native._kernel_call = lambda compiled, cap: compiled.name.encode()
    checks = [*cutlass.jax.get_export_disabled_safety_checks(), jax.export.DisabledSafetyCheck.custom_call(native.FFI_TARGET)]

    def lowered(fn, args):
        with compile_without_gpu():
            return jax.export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=checks)(*args).mlir_module()

    CASES = [("zeros", "bhsd", 128, 128, True), ("ignore", "bshd", 256, 64, False)]
    for padding, layout, E, D, gate in CASES:
        p = AttnProblem(batch=1, heads=2, q_len=3 * E, kv_len=4 * E, head_dim=D, block_elems=E, dtype="bfloat16",
                        topk=2, has_gate=gate, padding=padding, layout=layout, fine_residual=fine_residual("cute"))
        for stage in ("forward", "backward"):
            inputs = (P.forward_inputs if stage == "forward" else P.backward_inputs)(p)
            names = list(inputs)
            args = [jax.ShapeDtypeStruct(s, jnp.dtype(p.dtype if d == "input" else d)) for s, d in inputs.values()]
            n_triton = sum(l.kind == "triton" for l in P.record_plan(stage, p, inputs, cute_backend).launches)
            want = sorted([native.FFI_TARGET] * n_triton + ["CuteDSLRT_NvJaxCutlassCall_v2"])
            # the stage natively, and the stage as the default launch picks it (ops._run)
            for how, fn in (("native.run", lambda *xs: native.run(stage, p, dict(zip(names, xs)), "cute")),
                            ("default", lambda *xs: ops._run(stage, p, cute_backend, **dict(zip(names, xs))))):
                text = lowered(fn, args)
                calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
                assert sorted(calls) == want, (how, calls)
                assert "callback" not in text, how
                line = next(ln for ln in text.splitlines() if "CuteDSLRT_NvJaxCutlassCall_v2" in ln)
                assert "-arch sm_90a" in line
                tok = f"1x{3 * E}x2x{D}xbf16" if layout == "bshd" else f"1x2x{3 * E}x{D}xbf16"
                assert f"tensor<{tok}>" in line, line[-2000:]
                if stage == "backward":  # FA4's scratch: outputs of the call (log2 lse, dPsum, dQ accumulator)
                    assert line.count(f"tensor<1x2x{3 * E}xf32>") >= 3 and f"tensor<1x2x{3 * E * D}xf32>" in line
                print("LOWERED", stage, how, padding, layout, E, n_triton)
            assert native.selected(cute_backend, stage=stage, p=p)

    # the whole VSA vjp (the frontends' custom_vjp): both stages natively, two CuTe calls, no callback
    from vsa_core.spec import OpStatics, forward_inputs
    E, D = 128, 128
    s = OpStatics(selection="topk", layout="bhsd", block_elems=E, backend="cute", softmax_scale=D ** -0.5,
                  padding="zeros", topk=2, has_gate=True)
    p = AttnProblem(batch=1, heads=2, q_len=3 * E, kv_len=4 * E, head_dim=D, block_elems=E, dtype="bfloat16",
                    topk=2, has_gate=True, fine_residual=fine_residual("cute"))
    shapes = P.forward_inputs(p)
    args = [jax.ShapeDtypeStruct(shapes[n][0], jnp.dtype(p.dtype if shapes[n][1] == "input" else shapes[n][1]))
            for n in forward_inputs(s)]

    def vjp(*xs):
        out, back = jax.vjp(lambda *a: ops._attend(s, a)[0], *xs)
        return out, back(out)
    text = lowered(vjp, args)
    calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    assert calls.count("CuteDSLRT_NvJaxCutlassCall_v2") == 2 and set(calls) == {native.FFI_TARGET,
                                                                                "CuteDSLRT_NvJaxCutlassCall_v2"}, calls
    assert "callback" not in text
    print("LOWERED vjp")
    """)


def test_the_cute_stages_lower_to_triton_calls_and_one_cute_call_each():
    """The cute backend's VSA forward and backward as native stages (their plans recorded, the Triton
    launches stubbed), through native.run and through the default launch on an sm_90 device: one
    triton_kernel_call_ffi per Triton launch (lists, sub-block counts, padding="ignore"'s copies, the
    coarse mix; the backward's lists, dlse, pooling gradients) and one CuTe DSL call compiled for
    sm_90a (the forward: FA4's forward kernel; the backward: its preprocess, main kernel and dQ
    postprocess, FA4's scratch born in the call); no callback. The whole VSA vjp: both stages, two
    CuTe calls, no callback."""
    out = run_lowering(STAGE_LOWER)
    assert out.count("LOWERED") == 9, out


# ---- GPU (H100/H200) ---------------------------------------------------------------------------
def _cute_jax_case(case):
    from common import require_jax_gpu
    from test_cute_backend import _require_cute
    require_jax_gpu()
    _require_cute(case)


NATIVE_CASES = ["bhsd-128", "bshd-256", "sq-ne-skv"]


def _native_case(name):
    from common import Case
    return {"bhsd-128": Case(block=128, head_dim=128, n_q_blocks=3, n_kv_blocks=4),
            "bshd-256": Case(block=256, n_q_blocks=2, n_kv_blocks=4, layout="bshd"),
            "sq-ne-skv": Case(block=128, head_dim=128, n_q_blocks=5, n_kv_blocks=3, topk=2, heads=3)}[name]


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
@pytest.mark.parametrize("name", NATIVE_CASES)
def test_gpu_native_cute_equals_torch(name, padding, launch_config):
    """VSA on the cute backend under jit(vjp), default launch: both stages natively (FA4's forward
    kernel, then its three backward kernels, as cutlass_calls). out and dgate equal torch's bit for bit
    (one kernel object, the same Triton stages); dq, dk, dv (FA4's backward reduces dQ with fp32
    atomics, in a varying order) within the reference tolerance of torch's, and everything close
    to float64. "ignore" with NaN / inf in every padded row."""
    import zlib

    from common import make_inputs
    from frontends import check_jax_vjp_against_torch
    from test_padding import with_non_finite_padding
    case = _native_case(name)
    _cute_jax_case(case)
    launch_config(autotune=False, jax_launch="auto")
    inputs = make_inputs(case, seed=zlib.crc32(name.encode()) + 7)
    if padding == "ignore":
        inputs = with_non_finite_padding(inputs, case.E)
    check_jax_vjp_against_torch(case, inputs, "cute", padding)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("E", [128, 256])
def test_gpu_native_cute_block_sparse_attn_equals_torch_bitwise(layout, E, launch_config):
    """block_sparse_attn on the cute backend, forward only: JAX's native forward (jit, default
    launch; its program holds the CuTe custom call and no callback) gives torch's eager out and lse
    bit for bit, a query block that sees nothing included (out 0, lse -inf), and both are close to
    the float64 reference."""
    import jax
    import jax.numpy as jnp
    import torch

    import vsa_jax
    import vsa_torch
    from common import Case, assert_close, make_inputs, to_layout
    from frontends import jax_args, to_numpy
    from vsa_core.reference import block_sparse_attn_reference, round_to_dtype
    case = Case(block=E, n_q_blocks=3, n_kv_blocks=4, layout=layout, head_dim=128 if E == 128 else 64)
    _cute_jax_case(case)
    launch_config(jax_launch="auto")
    inputs = make_inputs(case, seed=61 + E)
    rng = np.random.default_rng(62)
    block_map = rng.random((case.batch, case.heads, case.n_q_blocks, case.n_kv_blocks)) < 0.5
    block_map[0, 0, 0] = False  # a query block that sees nothing
    block_map[0, 1, 1] = True   # one that sees everything (the empty KV block too)
    kv_counts = inputs["kv_counts"]

    q, k, v, _, _ = jax_args(case, inputs)
    f = jax.jit(lambda q, k, v: vsa_jax.block_sparse_attn(q, k, v, jnp.asarray(block_map), kv_counts, E,
                                                          layout=layout, backend="cute"))
    text = f.lower(q, k, v).as_text()
    assert text.count(CUTE_TARGET) == 1 and "callback" not in text
    out, lse = f(q, k, v)

    tq, tk, tv = (torch.from_numpy(to_layout(inputs[n], layout)).to("cuda", torch.bfloat16) for n in ("q", "k", "v"))
    with torch.no_grad():
        t_out, t_lse = vsa_torch.block_sparse_attn(tq, tk, tv, torch.from_numpy(block_map).cuda(), kv_counts, E,
                                                   layout=layout, backend="cute")
    t_out = t_out.float().cpu().numpy()
    out = np.asarray(out.astype(jnp.float32))
    assert np.array_equal(out, t_out), f"out: max |jax - torch| = {np.abs(out - t_out).max():.3e}"
    assert np.array_equal(np.asarray(lse), t_lse.cpu().numpy()), "lse"

    x = {n: round_to_dtype(inputs[n], case.dtype) for n in ("q", "k", "v")}
    ref_out, ref_lse = block_sparse_attn_reference(x["q"], x["k"], x["v"], block_map, kv_counts, E)
    assert_close(case, to_numpy(case, {"out": out}), {"out": ref_out})
    lse = np.asarray(lse)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_gpu_native_cute_program_has_the_cute_calls_and_no_callback(launch_config):
    """The jitted forward holds FA4's forward call, the jitted vjp that and the backward's, and
    neither a callback."""
    import jax
    import jax.numpy as jnp

    from common import make_inputs
    from frontends import jax_args, vsa_fn
    case = _native_case("bhsd-128")
    _cute_jax_case(case)
    launch_config(jax_launch="auto")
    inputs = make_inputs(case, seed=4)
    f = vsa_fn(case, jnp.asarray(inputs["kv_counts"]), jnp.asarray(inputs["q_counts"]), backend="cute")
    q, k, v, gate, dout = jax_args(case, inputs)
    forward = jax.jit(f).lower(q, k, v, gate).as_text()
    assert forward.count(CUTE_TARGET) == 1 and "callback" not in forward
    both = jax.jit(lambda *a: jax.vjp(f, *a)[1](dout)).lower(q, k, v, gate).as_text()
    assert both.count(CUTE_TARGET) == 2 and "callback" not in both  # FA4's forward call and its backward's


@pytest.mark.gpu
def test_gpu_native_cute_under_xla_command_buffers():
    """tests/native_cmdbuf_check.py with the cute backend: in a fresh process with command buffers
    on for custom calls, three replays with new inputs equal the callback path (out and dgate bit
    for bit; dq, dk, dv within the reference tolerance), and every native custom call, FA4's
    included, is inside a command buffer."""
    from common import require_jax_gpu
    require_jax_gpu()
    env = dict(os.environ, VSA_CMDBUF_BACKEND="cute")
    env["PYTHONPATH"] = REPO + os.pathsep + os.path.join(REPO, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "native_cmdbuf_check.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0 and "ALL EQUAL" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
