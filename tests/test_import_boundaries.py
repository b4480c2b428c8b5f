"""Import boundaries: the core and the JAX frontend run without torch.

Each check runs in a fresh Python process in which torch cannot be imported (a meta-path
finder refuses it, so the check holds whether or not torch is installed) and asserts that
torch never loaded. The numeric check runs the real Triton kernels (under Triton's
interpreter on the CPU, compiled on a GPU) through jax.jit and jax.grad and compares them
with the float64 reference.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import HAS_CUDA
from common import skip_if_interpreter_broken

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this process (import of {name})")
            return None

    sys.meta_path.insert(0, NoTorch())
    """)

TORCH_NEVER_LOADED = textwrap.dedent("""
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, f"torch was loaded: {loaded[:5]}"
    print("NO TORCH OK")
    """)

JIT_GRAD = textwrap.dedent("""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import vsa_jax
    from common import Case, assert_close, make_inputs, reference

    case = Case(batch=1, heads=2, n_q_blocks=2, n_kv_blocks=3, topk=2)
    inputs = make_inputs(case, seed=17)
    dtype = jnp.dtype(case.dtype)
    q, k, v, gate, dout = (jnp.asarray(inputs[n], dtype) for n in ("q", "k", "v", "gate", "dout"))
    kv_counts, q_counts = (jnp.asarray(inputs[n], jnp.int32) for n in ("kv_counts", "q_counts"))

    def loss(q, k, v, gate):
        out = vsa_jax.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate,
                                        backend=BACKEND)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, gate)
    got = {n: np.asarray(x, np.float32) for n, x in zip(("out", "dq", "dk", "dv", "dgate"), (out, *grads))}
    assert_close(case, got, reference(case, inputs))
    print("JIT GRAD OK on", jax.default_backend())
    """)


def run_without_torch(code: str, platform: str, extra_env=None, interpret: bool = False) -> str:
    """`code` in a fresh python where torch cannot be imported (JAX_PLATFORMS=platform, `extra_env`
    added, Triton's interpreter with `interpret`); asserts it exits cleanly and never loaded torch; its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = platform
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, "-c", NO_TORCH + code + TORCH_NEVER_LOADED], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and "NO TORCH OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def native_vjp_script(backend: str, seed: int) -> str:
    """A JAX-only process's check of a backend's native launches: jit(vjp) forward and backward, both
    layouts, close to the float64 reference; prints "NATIVE <BACKEND> OK"."""
    return textwrap.dedent(f"""
        import jax
        from common import Case, assert_close, make_inputs, reference
        from frontends import run_jax_vjp
        import vsa_jax
        assert jax.default_backend() == "gpu"
        vsa_jax.set_launch("native")
        for case in (Case(head_dim=128), Case(head_dim=128, layout="bshd", gate=False)):
            inputs = make_inputs(case, seed={seed})
            assert_close(case, run_jax_vjp(case, inputs, backend={backend!r}), reference(case, inputs))
        print("NATIVE {backend.upper()} OK")
        """)


def test_core_imports_without_torch():
    run_without_torch(textwrap.dedent("""
        import vsa_core, vsa_core.ops, vsa_core.plan, vsa_core.reference, vsa_core.interpreter, vsa_core.api
        from vsa_core.backends import BACKENDS, REGISTRY
        assert set(BACKENDS) == set(REGISTRY) and "triton" in REGISTRY
        """), "cpu")


def test_jax_frontend_imports_without_torch():
    run_without_torch("import vsa_jax, vsa_jax.parallel, vsa_jax.native, vsa_jax.spmd\n", "cpu")


def test_blocked_torch_is_really_blocked():
    """The guard itself: importing torch in the guarded process fails."""
    with pytest.raises(AssertionError, match="torch is blocked"):
        run_without_torch("import torch\n", "cpu")


NO_JAX = NO_TORCH.replace('name == "torch" or name.startswith("torch.")',
                         'name.split(".")[0] in ("torch", "jax", "jaxlib")').replace("NoTorch", "NoFramework")



def test_core_alone_runs_on_numpy_buffers():
    """No frontend at all (torch and JAX blocked): the core's forward and backward launch the
    real kernels (Triton's interpreter) on numpy float16 arrays handed over as DeviceBuffers,
    equal to the float64 reference."""
    skip_if_interpreter_broken()
    run_without_torch(NO_JAX + textwrap.dedent("""
        import dataclasses
        import numpy as np
        from common import Case, assert_close, make_inputs, reference
        from vsa_core import ops
        from vsa_core.api import prepare_vsa
        from vsa_core.backends import triton_backend
        from vsa_core.runtime import host_buffer

        case = Case(batch=1, heads=2, n_q_blocks=2, n_kv_blocks=3, topk=2, dtype="float16")
        x = make_inputs(case, seed=23)
        host = {n: x[n].astype(np.float16) for n in ("q", "k", "v", "gate", "dout")}
        host.update(kv_counts=x["kv_counts"].astype(np.int32), q_counts=x["q_counts"].astype(np.int32))
        p = prepare_vsa(host["q"], host["k"], host["v"], host["kv_counts"], host["q_counts"], case.topk, case.block,
                        host["gate"]).problem
        p = dataclasses.replace(p, training=True)

        def alloc(table):
            return {n: np.empty(shape, np.float16 if dt == "input" else dt) for n, (shape, dt) in table.items()}

        fwd = alloc(p.forward_buffers())
        inputs = {n: host[n] for n in ("q", "k", "v", "gate", "kv_counts", "q_counts")}
        ops.forward(p, triton_backend, {n: host_buffer(a) for n, a in {**inputs, **fwd}.items()})
        bwd = alloc(p.backward_buffers())
        saved = {n: a for n, a in fwd.items() if n != "scores"}
        ops.backward(p, triton_backend, {n: host_buffer(a) for n, a in
                                         {"dout": host["dout"], **inputs, **saved, **bwd}.items()})
        got = {"out": fwd["out"], "dq": bwd["dq"], "dk": bwd["dk"], "dv": bwd["dv"], "dgate": bwd["dgate"]}
        assert_close(case, {n: a.astype(np.float32) for n, a in got.items()}, reference(case, x))
        assert not any(m.split(".")[0] in ("jax", "jaxlib") for m in sys.modules), "jax was loaded"
        """), "cpu")


def test_demo_runs_without_torch():
    """demo.py where torch is missing (CI runs this file in a vsa[jax] venv too): the JAX
    frontend, its default there, against the numpy float64 reference; `--frontend torch` is a
    usage error that says why."""
    skip_if_interpreter_broken()
    out = run_without_torch(textwrap.dedent(f"""
        import contextlib, io, runpy

        def demo(*args):
            sys.argv = ["demo.py", *args]
            try:
                runpy.run_path({os.path.join(REPO, "demo.py")!r}, run_name="__main__")
            except SystemExit as e:
                return e.code
            return 0

        assert demo("--video", "4,4,8", "--topk", "1", "--heads", "1", "--no-bench") == 0
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert demo("--frontend", "torch") == 2
        assert err.getvalue().splitlines()[-1] == ("demo.py: error: argument --frontend: torch is not installed "
                                                   "(a vsa[jax] install): use --frontend jax"), err.getvalue()
        """), "cpu")
    assert "vsa demo (jax, backend auto, CPU, Triton interpreter)" in out and ": PASS" in out, out


def test_native_plan_records_and_compiles_without_torch():
    """The JAX native path's trace-time work, torch blocked: the forward's launch plan recorded
    on placeholder buffers and each launch compiled to an sm_90 cubin (no GPU needed)."""
    run_without_torch(textwrap.dedent("""
        from vsa_core import plan as P
        from vsa_core.problem import AttnProblem
        p = AttnProblem(batch=1, heads=2, q_len=256, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16",
                        topk=2, has_gate=True)
        plan = P.record_plan("forward", p, P.forward_inputs(p))
        for launch in plan.launches:
            assert P.compile_launch(launch, plan, 90).cubin[:4] == b"\\x7fELF", launch.kernel_name
        """), "cpu")


@pytest.mark.parametrize("interpret", [False, True], ids=["interpreted-twins", "TRITON_INTERPRET"])
def test_jax_jit_grad_on_cpu_without_torch(interpret):
    """jit + grad through the Triton kernels under the interpreter, torch blocked: both ways the
    CPU runs them (a process that imported triton normally, and TRITON_INTERPRET=1)."""
    skip_if_interpreter_broken()
    out = run_without_torch("BACKEND = 'triton'\n" + JIT_GRAD, "cpu", interpret=interpret)
    assert "JIT GRAD OK on cpu" in out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("launch", ["callback", "native"])
def test_jax_jit_grad_on_gpu_without_torch(launch):
    """The Triton backend on the GPU from a process where torch is blocked: through the buffer
    callback (compiled kernels launched on XLA's stream by vsa_core.runtime.raw_cuda_launches)
    and natively (the launch plan as XLA custom calls)."""
    out = run_without_torch(f"BACKEND = 'triton'\nimport vsa_jax\nvsa_jax.set_launch({launch!r})\n" + JIT_GRAD, "cuda")
    assert "JIT GRAD OK on gpu" in out
