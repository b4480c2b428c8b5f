"""vsa_jax.cudnn_call: cuDNN BSA's sm_90 forward and backward (CuTe DSL kernels) as XLA custom calls, no torch.

On the CPU (no GPU, no NVIDIA driver): the module and the kernel class import with torch blocked;
jax.jit traces the call to cutlass.jax's primitive (its lowering rule exists for "cuda" only, so
the CPU backend cannot lower it); lowered for CUDA through jax.export (cross-platform lowering,
still on the CPU, torch blocked) it compiles the kernel for sm_90a and is one
stablehlo.custom_call to the CuTe DSL runtime's FFI handler, the compiled object inlined.
On an H100/H200 (`gpu` tests): the call's values against a float64 reference with torch blocked,
and under XLA command buffers the custom call is inside a command buffer and replays equal to a
run without them; the cudnn backend's stages natively under jit(vjp) against torch, float64, the
callback under command buffers, and with torch blocked.

    pytest tests/test_jax_cudnn_call.py -v            # CPU: 6 pass, the gpu ones skip
    (GPU machine: the same command; needs nvidia-cudnn-frontend[cutedsl]==1.32.0, nvidia-cutlass-dsl==4.8.1, jax[cuda])
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from test_import_boundaries import native_vjp_script, run_without_torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if any(importlib.util.find_spec(m) is None for m in ("jax", "cutlass", "cudnn")):
    pytest.skip("needs jax, nvidia-cutlass-dsl 4.8.1 and nvidia-cudnn-frontend 1.32.0", allow_module_level=True)

SHAPES = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from vsa_jax import cudnn_call, cutlass_common

    def shapes(layout, B=1, H=2, S=1024, D=128, C=4, dtype=jnp.bfloat16):
        n = S // 64
        tok = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
        return ((jax.ShapeDtypeStruct(tok, dtype),) * 3
                + (jax.ShapeDtypeStruct((B, H, n, C), jnp.int32), jax.ShapeDtypeStruct((B, H, n), jnp.int32),
                   jax.ShapeDtypeStruct((n,), jnp.int32)))
    """)


def test_imports_without_torch():
    run_without_torch(textwrap.dedent("""
        from vsa_jax import cudnn_call
        assert cudnn_call.library_error() is None, cudnn_call.library_error()
        cudnn_call._Adapter  # noqa: B018
        from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import BlockSparseAttnForwardSm90Blk64  # noqa: F401
        assert cudnn_call.library_error("backward") is None, cudnn_call.library_error("backward")
        # the backend takes 64-token blocks (JAX's native calls); what cuDNN's torch wrapper runs, not
        from vsa_core.backends import cudnn_backend
        from vsa_core.problem import AttnProblem
        from vsa_core.runtime import DeviceInfo
        h200 = DeviceInfo("cuda", 0, (9, 0))
        p = lambda **kw: AttnProblem(**{**dict(batch=1, heads=2, q_len=512, kv_len=512, head_dim=128, block_elems=64,
                                               dtype="bfloat16", topk=2, training=True), **kw})
        assert cudnn_backend.unavailable_reason(p(), h200) is None, cudnn_backend.unavailable_reason(p(), h200)
        reason = cudnn_backend.unavailable_reason(p(block_elems=128), h200)
        assert "torch wrapper" in reason and "128-token" in reason, reason
        """), "cpu")


def test_traces_to_the_cutlass_call_primitive():
    """Under jit the call is one cutlass_call_inner equation (the FFI target named in its params),
    after the small clamp/broadcast of the block sizes; the CPU backend has no lowering for it."""
    run_without_torch(SHAPES + textwrap.dedent("""
        for layout in ("bhsd", "bshd"):
            f = lambda *a: cudnn_call.cudnn_sm90_forward(*a, layout=layout)
            jaxpr = jax.jit(f).trace(*shapes(layout)).jaxpr
            text = str(jaxpr)
            assert "cutlass_call_inner" in text and "ffi_call_target=CuteDSLRT_NvJaxCutlassCall_v2" in text, text
            assert [(a.shape, a.dtype) for a in jaxpr.out_avals] == [(shapes(layout)[0].shape, jnp.bfloat16),
                                                                     ((1, 2, 1024), jnp.float32)], jaxpr.out_avals
        try:
            jax.jit(f).lower(*shapes("bshd"))
        except NotImplementedError as e:
            assert "cutlass_call_inner" in str(e) and "cpu" in str(e), e
        else:
            raise AssertionError("the CPU backend lowered a CUDA-only primitive")
        """), "cpu")


def _mlir_string(text: str, name: str) -> bytes:
    """The bytes of attribute `name = "..."` in MLIR text (\\XX hex escapes, \\\\ and \\")."""
    start = text.index(f'{name} = "') + len(name) + 4
    out, i = bytearray(), start
    while text[i] != '"':
        if text[i] == "\\":
            nxt = text[i + 1]
            if nxt in '\\"':
                out.append(ord(nxt))
                i += 2
            else:
                out.append(int(text[i + 1:i + 3], 16))
                i += 3
        else:
            out += text[i].encode()
            i += 1
    return bytes(out)


def test_lowers_for_cuda_to_one_custom_call_with_an_sm90a_kernel(tmp_path):
    """Lowered for CUDA on this host (jax.export, torch blocked, no driver): the kernel compiles
    for sm_90a and the program is one typed-FFI custom call to the CuTe DSL runtime whose
    attributes carry the compiled host object (ELF x86-64 relocatable) with the sm_90 cubin."""
    out = run_without_torch(SHAPES + textwrap.dedent(f"""
        import re
        for layout in ("bhsd", "bshd"):
            f = lambda *a: cudnn_call.cudnn_sm90_forward(*a, layout=layout)
            with cutlass_common.compile_without_gpu():
                text = cutlass_common.lower_for_cuda(f, *shapes(layout))
            calls = re.findall(r"stablehlo\\.custom_call @(\\w+)", text)
            assert calls == ["CuteDSLRT_NvJaxCutlassCall_v2"], calls
            open(r"{tmp_path}/" + layout + ".mlir", "w").write(text)
        print("LOWERED")
        """), "cpu", {"CUTE_DSL_ARCH": "sm_90a"})
    assert "LOWERED" in out
    for layout in ("bhsd", "bshd"):
        text = open(tmp_path / f"{layout}.mlir").read()
        line = next(ln for ln in text.splitlines() if "stablehlo.custom_call" in ln)
        assert "mhlo.backend_config = {key = " in line and "operand_layouts" in line and "result_layouts" in line
        module = _mlir_string(line, "module")
        assert module[:4] == b"\x7fELF" and module[16] == 1, "a relocatable host object"  # e_type ET_REL
        cubin = module.find(b"\x7fELF", 1)
        assert cubin > 0 and int.from_bytes(module[cubin + 18:cubin + 20], "little") == 190, "an embedded CUDA ELF"
        assert (int.from_bytes(module[cubin + 48:cubin + 52], "little") >> 8) & 0xFF == 90, "compiled for sm_90"
        assert b"-arch sm_90a" in module
        assert "tensor<1x2x16x4xi32>" in line and ("tensor<1x2x1024x128xbf16>" if layout == "bhsd"
                                                    else "tensor<1x1024x2x128xbf16>") in line


def test_arguments_are_checked_at_trace_time():
    import jax
    import jax.numpy as jnp
    from vsa_jax import cudnn_call
    q = jax.ShapeDtypeStruct((1, 2, 1000, 128), jnp.bfloat16)
    i4, i3, i1 = (jax.ShapeDtypeStruct(s, jnp.int32) for s in ((1, 2, 15, 4), (1, 2, 15), (15,)))
    with pytest.raises(ValueError, match="multiple of 64"):
        jax.jit(cudnn_call.cudnn_sm90_forward).trace(q, q, q, i4, i3, i1)
    q = jax.ShapeDtypeStruct((1, 2, 1024, 128), jnp.float32)
    with pytest.raises(TypeError, match="bfloat16"):
        jax.jit(cudnn_call.cudnn_sm90_forward).trace(q, q, q, i4, i3, i1)


def test_the_cudnn_stages_lower_to_triton_calls_and_one_cute_call():
    """The cudnn backend's VSA forward and backward as native stages (their plans recorded, the
    Triton launches stubbed, torch blocked): one triton_kernel_call_ffi per Triton launch and one
    CuTe DSL call of cuDNN's kernels compiled for sm_90a (the backward's: its K-to-Q lists, then
    its backward kernel, in one call), both layouts and paddings (padding "ignore" reads the
    valid-rows copies, XLA buffers of the plan); no callback."""
    from test_jax_sm90_native import LOWER
    cases = [(stage, padding, layout, {}) for stage in ("forward", "backward")
             for padding, layout in (("zeros", "bhsd"), ("ignore", "bshd"))]
    out = run_without_torch(f"BACKEND = 'cudnn'\nCASES = {cases!r}\n" + LOWER, "cpu", {"CUTE_DSL_ARCH": "sm_90a"})
    assert out.count("LOWERED") == 4, out


def test_the_blk64_backward_works_in_workspaces_of_the_plan():
    """What cuDNN's torch wrapper allocates per backward are workspaces of the plan, sized by its
    rules (a 384-query-block bucket, as cuDNN's own rule says; a workspace of dPsum, log2 lse, the
    dQ accumulator and the dK / dV accumulators per (B, H), rows rounded up to 64), the dK / dV
    accumulators starting after every (B, H)'s first three fields."""
    from cudnn.block_sparse_attention.csrc.bwd.sm90_blk64.bsa_bwd_sm90 import sm90_bwd_auto_bucketed_k2q_size_blocks
    from vsa_core.backends import cudnn_backend
    from vsa_core.problem import AttnProblem
    p = AttnProblem(batch=2, heads=3, q_len=832, kv_len=960, head_dim=128, block_elems=64, dtype="bfloat16", topk=5)
    assert sm90_bwd_auto_bucketed_k2q_size_blocks(p.n_q_blocks) == cudnn_backend.BUCKET_BLOCKS == 384
    table = cudnn_backend.workspaces("backward", p)
    assert table["k2q_offsets"] == ((2, 3, 1, 16), "int32") and table["k2q_counts"] == ((2, 3, 1, 15), "int32")
    assert table["k2q_indices"] == ((2, 3, 13 * p.select_capacity), "int32")
    assert table["bwd_workspace"] == ((2, 3, 2 * 832 + 832 * 128 + 2 * 960 * 128), "float32")
    assert cudnn_backend.dkv_accumulators_start(p) == 6 * (2 * 832 + 832 * 128)
    assert set(cudnn_backend.workspaces("forward", p)) == set()
    assert "bwd_workspace" not in cudnn_backend.workspaces("backward", AttnProblem(**{**vars(p), "block_elems": 128,
                                                                                       "q_len": 896, "kv_len": 1024}))


def test_the_native_stages_of_the_cudnn_backend():
    from vsa_core.problem import AttnProblem
    from vsa_jax import cudnn_call, native

    def p(**kw):
        base = dict(batch=1, heads=2, q_len=512, kv_len=512, head_dim=128, block_elems=64, dtype="bfloat16", topk=2)
        return AttnProblem(**{**base, **kw})

    assert native.has_native("cudnn", "forward", p()) and native.has_native("cudnn", "backward", p())
    for stage in ("forward", "backward"):
        assert "128-token" in cudnn_call.native_reason(p(block_elems=128), stage=stage)
        assert "sm_90a" in cudnn_call.native_reason(p(), capability=100, stage=stage)
    # the forward with a static prefix runs the prefix rows as a call of their own; its backward does not
    assert "stream of their own" in cudnn_call.native_reason(p(prefix_blocks=2, topk=2))
    assert cudnn_call.native_reason(p(prefix_blocks=2, topk=2), stage="backward") is None
    assert cudnn_call.native_reason(p(head_dim=64, dtype="float16")) is None
    for other in (dict(head_dim=64), dict(dtype="float16")):  # cuDNN's backward: bf16, head dim 128
        assert "head dim 128 in bfloat16" in cudnn_call.native_reason(p(**other), stage="backward")


# ---- GPU (H100/H200) ---------------------------------------------------------------------------
GPU_VALUES = SHAPES + textwrap.dedent("""
    import numpy as np

    def problem(layout, B=1, H=2, S=1024, D=128, C=4, seed=0):
        rng = np.random.default_rng(seed)
        n = S // 64
        q, k, v = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(3))
        idx = np.sort(np.stack([[[rng.choice(n, C, replace=False) for _ in range(n)] for _ in range(H)]
                                for _ in range(B)]), axis=-1).astype(np.int32)
        num = rng.integers(0, C + 1, (B, H, n)).astype(np.int32)       # some rows empty
        counts = np.full(n, 64, np.int32)
        counts[-1], counts[3] = 40, 0                                  # a partial and an empty block
        return q, k, v, idx, num, counts

    def reference(q, k, v, idx, num, counts, scale):
        B, H, S, D = q.shape
        n = S // 64
        allowed = np.zeros((B, H, n, S), bool)
        for b in range(B):
            for h in range(H):
                for i in range(n):
                    for j in idx[b, h, i, :num[b, h, i]]:
                        allowed[b, h, i, j * 64: j * 64 + counts[j]] = True
        allowed = np.repeat(allowed, 64, axis=2)
        s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale
        s = np.where(allowed, s, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
        l = p.sum(-1, keepdims=True)
        out = np.where(l > 0, np.einsum("bhqk,bhkd->bhqd", p, v) / np.where(l > 0, l, 1), 0)
        lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + m[..., 0], -np.inf)
        return out, lse

    def run(layout, jit_fn=None):
        q, k, v, idx, num, counts = problem(layout)
        bf = lambda x: jnp.asarray(x, jnp.bfloat16)
        qq, kk, vv = (bf(x) if layout == "bhsd" else bf(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
        f = jit_fn or jax.jit(lambda *a: cudnn_call.cudnn_sm90_forward(*a, layout=layout))
        out, lse = f(qq, kk, vv, jnp.asarray(idx), jnp.asarray(num), jnp.asarray(counts))
        out = np.asarray(out.astype(jnp.float32))
        if layout == "bshd":
            out = out.transpose(0, 2, 1, 3)
        rq, rk, rv = (np.asarray(bf(x).astype(jnp.float32)) for x in (q, k, v))
        ref_out, ref_lse = reference(rq, rk, rv, idx, num, counts, 128 ** -0.5)
        return out, np.asarray(lse), ref_out, ref_lse
    """)


@pytest.mark.gpu
def test_gpu_values_equal_the_reference_with_torch_blocked():
    run_without_torch(GPU_VALUES + textwrap.dedent("""
        assert jax.devices()[0].platform == "gpu"
        for layout in ("bhsd", "bshd"):
            out, lse, ref_out, ref_lse = run(layout)
            assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)), layout
            fin = np.isfinite(ref_lse)
            assert np.abs(lse[fin] - ref_lse[fin]).max() < 1e-2, layout
            assert np.abs(out - ref_out).max() < 3e-2, (layout, np.abs(out - ref_out).max())
        """), "cuda")


@pytest.mark.gpu
def test_gpu_runs_inside_an_xla_command_buffer_and_replays_equal():
    """With CUSTOM_CALL command buffers enabled, the compiled HLO puts the custom call inside a
    command buffer (a CUDA graph), and its replays equal a run without command buffers (a second
    process): the asserted form of issue 23's command-buffer target for this kernel."""
    code = GPU_VALUES + textwrap.dedent("""
        f = jax.jit(lambda *a: cudnn_call.cudnn_sm90_forward(*a, layout="bhsd"))
        args = [jnp.asarray(x) for x in problem("bhsd")]
        args[:3] = [x.astype(jnp.bfloat16) for x in args[:3]]
        hlo = f.lower(*args).compile().as_text()
        outs = [f(*args) for _ in range(3)]                        # the first records, the others replay
        for o in outs[1:]:
            assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(o, outs[0]))
        np.save(__OUT_PATH__, np.asarray(outs[0][0].astype(jnp.float32)))
        # the computations of the compiled module: a header line at column 0 ending in "{" up to "}"
        comps, name = {}, None
        for line in hlo.splitlines():
            if name is None and line and not line[0].isspace() and line.rstrip().endswith("{"):
                name = line.split("(")[0].split()[-1]
                comps[name] = []
            elif name is not None and line.startswith("}"):
                name = None
            elif name is not None:
                comps[name].append(line)
        holders = [n for n, body in comps.items() if any("CuteDSLRT_NvJaxCutlassCall_v2" in ln for ln in body)]
        print("HOLDERS", holders)
        print("IN COMMAND BUFFER" if any("command_buffer" in n for n in holders) else "NOT IN COMMAND BUFFER")
        """)
    import tempfile
    import numpy as np
    with tempfile.TemporaryDirectory() as d:
        cmd = os.path.join(d, "cmd.npy")
        plain = os.path.join(d, "plain.npy")
        flags = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
        out = run_without_torch(code.replace("__OUT_PATH__", repr(cmd)), "cuda", {"XLA_FLAGS": flags})
        run_without_torch(code.replace("__OUT_PATH__", repr(plain)), "cuda", {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="})
        assert "IN COMMAND BUFFER" in out, out
        assert np.array_equal(np.load(cmd), np.load(plain))


# ---- GPU: the cudnn backend's forward natively under JAX ---------------------------------------
def _cudnn_jax_case(case):
    from common import require_jax_gpu
    from test_cudnn_backend import require_backend
    require_jax_gpu()
    require_backend("cudnn", case)


NATIVE_CASES = ["bhsd", "bshd", "sq-ne-skv"]


def _native_case(name):
    from common import Case
    return {"bhsd": Case(head_dim=128), "bshd": Case(head_dim=128, layout="bshd"),
            "sq-ne-skv": Case(head_dim=128, n_q_blocks=9, n_kv_blocks=11, topk=5, heads=3)}[name]


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
@pytest.mark.parametrize("name", NATIVE_CASES)
def test_gpu_native_cudnn_equals_torch(name, padding, launch_config):
    """VSA on the cudnn backend under jit(vjp), default launch: forward and backward natively
    (cuDNN's kernels as cutlass_calls). out and dgate equal torch's bit for bit (one binary, the
    same Triton stages); dq, dk, dv (cuDNN's backward reduces them with fp32 atomics, in a varying
    order) within the reference tolerance of torch's, and everything close to float64. "ignore"
    with NaN / inf in every padded row."""
    import zlib

    from common import make_inputs
    from frontends import check_jax_vjp_against_torch
    from test_padding import with_non_finite_padding
    case = _native_case(name)
    _cudnn_jax_case(case)
    launch_config(autotune=False, jax_launch="auto")
    inputs = make_inputs(case, seed=zlib.crc32(name.encode()) + 5)
    if padding == "ignore":
        inputs = with_non_finite_padding(inputs, case.E)
    check_jax_vjp_against_torch(case, inputs, "cudnn", padding)


@pytest.mark.gpu
def test_gpu_native_cudnn_program_has_both_calls_and_no_callback(launch_config):
    import jax
    import jax.numpy as jnp

    from common import make_inputs
    from frontends import jax_args, vsa_fn
    case = _native_case("bhsd")
    _cudnn_jax_case(case)
    launch_config(jax_launch="auto")
    inputs = make_inputs(case, seed=4)
    f = vsa_fn(case, jnp.asarray(inputs["kv_counts"]), jnp.asarray(inputs["q_counts"]), backend="cudnn")
    q, k, v, gate, dout = jax_args(case, inputs)
    forward = jax.jit(f).lower(q, k, v, gate).as_text()
    assert forward.count("CuteDSLRT_NvJaxCutlassCall_v2") == 1 and "callback" not in forward
    both = jax.jit(lambda *a: jax.vjp(f, *a)[1](dout)).lower(q, k, v, gate).as_text()
    assert both.count("CuteDSLRT_NvJaxCutlassCall_v2") == 2 and "callback" not in both


@pytest.mark.gpu
def test_gpu_native_cudnn_runs_with_torch_blocked():
    """`vsa[jax,cudnn]` with torch blocked: the cudnn backend's forward and backward natively
    (jit(vjp), both layouts), close to the float64 reference."""
    from common import require_jax_gpu
    require_jax_gpu()
    out = run_without_torch(native_vjp_script("cudnn", seed=6), "cuda")
    assert "NATIVE CUDNN OK" in out


@pytest.mark.gpu
def test_gpu_native_cudnn_under_xla_command_buffers():
    """tests/native_cmdbuf_check.py with the cudnn backend: in a fresh process with command buffers
    on for custom calls, three replays with new inputs equal the callback path (dq, dk, dv within
    the reference tolerance), and every native custom call, cuDNN's included, is inside a command
    buffer."""
    from common import require_jax_gpu
    require_jax_gpu()
    env = dict(os.environ, VSA_CMDBUF_BACKEND="cudnn")
    env["PYTHONPATH"] = REPO + os.pathsep + os.path.join(REPO, "tests") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "native_cmdbuf_check.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0 and "ALL EQUAL" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
