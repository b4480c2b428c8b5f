"""What a new user meets first (issue 8, section 3): the README's snippet as pasted, CPU
tensors without any setup, torch.compile on the metadata's own numpy counts, errors that
name the argument, and the package basics."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import vsa_jax
import vsa_torch
from common import Case, assert_close, make_inputs, reference
from vsa_core.backends import BackendUnavailableError, resolve_backend
from vsa_core.problem import AttnProblem
from vsa_core.runtime import DeviceInfo

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    use = text[text.index("## Use"):]
    return use[use.index("```python\n") + len("```python\n"):use.index("```\n", use.index("```python"))]


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path without TRITON_INTERPRET")
def test_readme_snippet_runs_as_pasted_on_cpu_tensors():
    """In a fresh process without TRITON_INTERPRET: the snippet runs, the kernels run under
    the interpreter by themselves, one warning says so (two calls, still one warning), and
    the result equals the same call under TRITON_INTERPRET=1 bit for bit."""
    check = readme_snippet() + "\n".join([
        "",
        "import os, sys, warnings",
        "assert out.shape == (1, 2, T * H * W, 64) and torch.isfinite(out).all()",
        "with warnings.catch_warnings(record=True) as caught:",
        "    warnings.simplefilter('always')",
        "    again = from_tiled(video_sparse_attn(q, k, v, meta.variable_block_sizes, meta.variable_block_sizes,",
        "                                         topk=4, block_size=meta.tile_size, compress_attn_weight=gate), meta)",
        "assert not [w for w in caught if 'interpreter' in str(w.message)], 'warned twice'",
        "assert torch.equal(again, out)",
        "torch.save(out, sys.argv[1])",
    ])
    results = {}
    for interpret in ("", "1"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        path = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"vsa_snippet_{os.getpid()}_{interpret or 0}.pt"
        torch.manual_seed(0)
        run = subprocess.run([sys.executable, "-W", "default", "-c", "import torch; torch.manual_seed(0)\n" + check,
                              str(path)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        warned = run.stderr.count("run the Triton kernels under Triton's interpreter")
        assert warned == (0 if interpret else 1), run.stderr[-3000:]
        results[interpret] = torch.load(path)
        path.unlink()
    assert torch.equal(results[""], results["1"])


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path without TRITON_INTERPRET")
def test_jax_cpu_arrays_run_without_setup():
    """vsa_jax on CPU arrays in a fresh process without TRITON_INTERPRET: forward and
    gradients against the float64 reference, one warning."""
    script = "\n".join([
        "import sys, jax",
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})",
        "from common import Case, make_inputs, reference, assert_close",
        "from test_jax_vsa import jax_args, to_numpy, vsa_fn",
        "case = Case(batch=1)",
        "x = make_inputs(case, 3)",
        "q, k, v, gate, dout = jax_args(case, x)",
        "out, vjp = jax.vjp(vsa_fn(case, x['kv_counts'], x['q_counts']), q, k, v, gate)",
        "dq, dk, dv, dgate = vjp(dout)",
        "assert_close(case, to_numpy(case, dict(out=out, dq=dq, dk=dk, dv=dv, dgate=dgate)), reference(case, x))",
    ])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-W", "default", "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("run the Triton kernels under Triton's interpreter") == 1, run.stderr[-3000:]


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU path without TRITON_INTERPRET")
def test_cpu_call_leaves_triton_language_to_the_gpu_compiler():
    """A CPU (interpreted) call, then a kernel compiled for sm_90 in the same process: the
    interpreter's patches of triton.language must be gone by then. Seen on the H200 before
    the fix: after any CPU test in a pytest worker, every later GPU kernel failed to compile
    ("'value' object has no attribute 'dtype'"). Compiling needs no GPU (Triton ships ptxas)."""
    script = "\n".join([
        "import sys, numpy as np, torch, vsa_torch",
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})",
        "from coarse_smem import compile_report",
        "q, k = (torch.randn(1, 1, 128, 64, dtype=torch.bfloat16) for _ in range(2))",
        "c = np.array([64, 64])",
        "vsa_torch.video_sparse_attn(q, k, k.clone(), c, c, 1, 64)",
        "print('shared', compile_report('fwd', 64, (64, 16), 8, 1, 'ieee', 90)[0])",
    ])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert run.returncode == 0 and "shared" in run.stdout, run.stderr[-3000:]


def test_other_devices_are_refused_with_a_reason(monkeypatch):
    from vsa_core import backends
    from vsa_core.backends import triton_backend
    monkeypatch.setattr(backends, "INTERPRETING", False)  # as in a process without TRITON_INTERPRET
    monkeypatch.setattr(triton_backend, "INTERPRETING", False)
    p = AttnProblem(batch=1, heads=1, q_len=128, kv_len=128, head_dim=64, block_elems=64, dtype="bfloat16", topk=1)
    broken = triton_backend._interpreter_broken()
    if broken is None:
        assert resolve_backend("triton", p, DeviceInfo("cpu")).name == "triton"
    else:  # CPU tensors need Triton's interpreter, which this triton + numpy cannot run: the call says so
        with pytest.raises(BackendUnavailableError, match=re.escape(broken)):
            resolve_backend("triton", p, DeviceInfo("cpu"))
    with pytest.raises(BackendUnavailableError, match="runs on CUDA tensors .* got mps tensors"):
        resolve_backend("triton", p, DeviceInfo("mps"))


def test_torch_compile_fullgraph_accepts_numpy_counts():
    """The README's inputs: meta.variable_block_sizes is a numpy array. The compiled op runs
    the same kernels on the same inputs as the eager one (inductor cannot look inside the
    custom op, and nothing else is in the graph), and the triton backend's kernels are
    deterministic (no atomics): the output and the gradients to q, k, v and the gate are
    equal bit for bit. (A loss reduced inside the compiled graph would not be: inductor sums
    in another order.)"""
    meta = vsa_torch.build_vsa_metadata((6, 8, 8), (4, 4, 4))
    assert isinstance(meta.variable_block_sizes, np.ndarray)
    torch.manual_seed(1)
    q, k, v, gate, dout = (vsa_torch.to_tiled(torch.randn(1, 2, meta.num_tokens, 64), meta).to(DEVICE, BF16)
                           for _ in range(5))

    def attn(q, k, v, gate):
        return vsa_torch.video_sparse_attn(q, k, v, meta.variable_block_sizes, meta.variable_block_sizes, 3,
                                           meta.tile_size, gate, backend="triton")

    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    results = []
    for fn in (attn, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, gate)]
        out = fn(*leaves)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, eager, comp in zip(("out", "dq", "dk", "dv", "dgate"), *results):
        assert torch.isfinite(eager).all() and eager.abs().max() > 0, name
        assert torch.equal(comp, eager), f"{name}: max |compiled - eager| = {(comp - eager).abs().max().item():.3e}"


def test_torch_compile_at_new_shapes_recompiles_for_each():
    """A compiled model called at a second shape: torch.compile then traces the shapes as symbols
    (automatic dynamic shapes; dynamic=True does so from the first call). The op's statics need
    concrete shapes, so each shape gets its own graph, equal bit for bit to the eager call."""
    meta = vsa_torch.build_vsa_metadata((4, 4, 8), (4, 4, 4))
    torch.manual_seed(2)

    def attn(q, k, v):
        return vsa_torch.video_sparse_attn(q, k, v, meta.variable_block_sizes, meta.variable_block_sizes, 1,
                                           meta.tile_size, backend="triton")

    backend = "aot_eager" if DEVICE == "cpu" else "inductor"
    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = torch.compile(attn, fullgraph=True, backend=backend, dynamic=dynamic)
        for batch in (1, 2):
            q, k, v = (vsa_torch.to_tiled(torch.randn(batch, 2, meta.num_tokens, 64), meta).to(DEVICE, BF16)
                       for _ in range(3))
            assert torch.equal(compiled(q, k, v), attn(q, k, v)), (dynamic, batch)


# ---- errors that name the argument --------------------------------------------------------
def _small():
    case = Case(batch=1, heads=1, n_q_blocks=2, n_kv_blocks=3, gate=False)
    x = make_inputs(case, seed=5)
    return case, x


def test_torch_huge_topk_is_clamped_like_jax():
    """topk >= 2^63 does not fit the op schema's int64: it is clamped to the number of KV
    blocks first (as documented, and as vsa_jax does), so it equals topk = nKV."""
    case, x = _small()
    q, k, v = (torch.from_numpy(x[n]).to(DEVICE, BF16) for n in ("q", "k", "v"))
    counts = (x["kv_counts"], x["q_counts"])
    huge = vsa_torch.video_sparse_attn(q, k, v, *counts, 2 ** 63, 64)
    exact = vsa_torch.video_sparse_attn(q, k, v, *counts, case.n_kv_blocks, 64)
    assert torch.equal(huge, exact)
    # and that result is the reference's with every non-empty block selected
    ref = reference(dataclasses.replace(case, topk=case.n_kv_blocks), x)
    assert_close(case, {"out": huge.float().cpu().numpy()}, {"out": ref["out"]})


@pytest.mark.parametrize("backend, exc, words", [(None, TypeError, "backend must be a string"),
                                                 (3, TypeError, "backend must be a string"),
                                                 ("fast", ValueError, "backend must be one of")])
def test_torch_bad_backend_names_the_argument(backend, exc, words):
    _, x = _small()
    q, k, v = (torch.from_numpy(x[n]).to(DEVICE, BF16) for n in ("q", "k", "v"))
    with pytest.raises(exc, match=words):
        vsa_torch.video_sparse_attn(q, k, v, x["kv_counts"], x["q_counts"], 2, backend=backend)
    bm = torch.ones(1, 1, 2, 3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(exc, match=words):
        vsa_torch.block_sparse_attn(q, k, v, bm, x["kv_counts"], backend=backend)


def test_jax_bad_backend_names_the_argument():
    _, x = _small()
    q = jnp.asarray(x["q"], jnp.bfloat16)
    with pytest.raises(TypeError, match="backend must be a string"):
        vsa_jax.video_sparse_attn(q, q, q, x["kv_counts"][:2], x["q_counts"], 2, backend=None)


def test_jax_given_torch_counts_names_the_argument():
    _, x = _small()
    q, k = jnp.asarray(x["q"], jnp.bfloat16), jnp.asarray(x["k"], jnp.bfloat16)
    with pytest.raises(TypeError, match=r"variable_block_sizes must be a 1-D integer numpy or JAX array.*torch"):
        vsa_jax.video_sparse_attn(q, k, k, torch.from_numpy(x["kv_counts"]), x["q_counts"], 2)
    with pytest.raises(TypeError, match=r"q_variable_block_sizes must be .*torch"):
        vsa_jax.video_sparse_attn(q, k, k, x["kv_counts"], torch.from_numpy(x["q_counts"]), 2)


@pytest.mark.parametrize("block_size", [(4.0, 4, 4), (4, 4.5, 4), (4, 4, True), "444"])
def test_non_int_block_size_names_the_argument(block_size):
    """A float inside the tile was truncated silently; now both frontends refuse it."""
    _, x = _small()
    q = torch.from_numpy(x["q"]).to(DEVICE, BF16)
    k = torch.from_numpy(x["k"]).to(DEVICE, BF16)
    with pytest.raises(TypeError, match="block_size must be an int or a \\(t, h, w\\) tuple of ints"):
        vsa_torch.video_sparse_attn(q, k, k, x["kv_counts"], x["q_counts"], 2, block_size)
    qj, kj = jnp.asarray(x["q"], jnp.bfloat16), jnp.asarray(x["k"], jnp.bfloat16)
    with pytest.raises(TypeError, match="block_size must be an int or a \\(t, h, w\\) tuple of ints"):
        vsa_jax.video_sparse_attn(qj, kj, kj, x["kv_counts"], x["q_counts"], 2, block_size)


def test_torch_counts_that_are_not_arrays_name_the_argument():
    _, x = _small()
    q = torch.from_numpy(x["q"]).to(DEVICE, BF16)
    k = torch.from_numpy(x["k"]).to(DEVICE, BF16)
    with pytest.raises(TypeError, match="variable_block_sizes must be a 1-D integer array"):
        vsa_torch.video_sparse_attn(q, k, k, "64,64,64", x["q_counts"], 2)


# ---- package basics -------------------------------------------------------------------------
def test_package_basics():
    for frontend in (vsa_torch, vsa_jax):
        assert re.match(r"\d+(\.\d+)*", frontend.__version__), frontend.__version__
        assert frontend.BackendUnavailableError is BackendUnavailableError
        assert "BackendUnavailableError" in frontend.__all__
    assert vsa_torch.__version__ == vsa_jax.__version__
    for package in ("vsa_core", "vsa_torch", "vsa_jax"):
        assert (ROOT / package / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "[project.urls]" in pyproject and 'py.typed' in pyproject


def test_docs_state_clamping_and_ranking_precision():
    readme = (ROOT / "README.md").read_text()
    assert "clamped" in readme and "scores rounded to the input dtype" in readme
    for fn in (vsa_torch.video_sparse_attn, vsa_jax.video_sparse_attn):
        assert "clamped" in fn.__doc__ and "coarse scores rounded to the input" in fn.__doc__


def test_demo_docstring_matches_its_video():
    demo = (ROOT / "demo.py").read_text()
    assert 'default=(5, 8, 8)' in demo and "5x8x8" in demo and "4x8x8" not in demo


def test_ci_runs_the_lowest_triton_allowed():
    """The Triton range's lower end (pyproject.toml) is the version .ci/run installs for its
    second, short run (the main run takes the newest allowed): moving one moves the other."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    lowest = re.search(r'"triton>=([0-9.]+),<[0-9.]+"', pyproject).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    pinned = re.search(r"triton==([0-9.]+)", ci).group(1)
    assert pinned.startswith(lowest + "."), (lowest, pinned)
    assert f"triton.__version__ == '{pinned}'" in ci


def test_import_vsa_names_the_frontends():
    """`vsa` is the distribution; `import vsa` (what a new user tries first) raises an
    ImportError naming the modules to import, which exist as named; the package ships."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", "import vsa"], env=env, capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(os.environ.get("TMPDIR", "/tmp")))
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stderr.splitlines()[-1] == (
        "ImportError: vsa is the distribution's name, not a module: import the frontend for your framework, "
        "vsa_torch (PyTorch) or vsa_jax (JAX), e.g. `from vsa_torch import video_sparse_attn` (the same names in "
        "both)"), run.stderr
    with pytest.raises(ImportError, match="import the frontend for your framework, vsa_torch .* or vsa_jax") as caught:
        import vsa  # noqa: F401
    assert caught.value.name == "vsa"
    assert vsa_torch.video_sparse_attn and vsa_jax.video_sparse_attn
    packages = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert '"vsa"' in packages.split(", "), packages


def test_bench_chart_survives_a_shape_where_nothing_ran(tmp_path, monkeypatch):
    """bench.py's chart: a shape whose every contender was skipped (seen on the H200: 720p-256 on a
    machine without FA4 or cuDNN) gets a panel that says so; before, the log-scaled empty panel
    raised inside matplotlib after the whole run."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench
    shapes = [bench.STANDARD_SHAPES["480p-64"], bench.STANDARD_SHAPES["720p-256"]]
    rows = [bench.Row("480p-64", "peer", "fa4 (dense)", dense=True, fwd_ms=1.4, fwd_tflops=676.0, bwd_tflops=571.0),
            bench.Row("480p-64", "fine", "sm90/eager", fwd_ms=1.7, fwd_tflops=559.0, bwd_tflops=413.0),
            bench.Row("720p-256", "fine", "cute/eager", status="skipped: flash_attn.cute cannot be used")]
    for case, (s, r) in {"some": (shapes, rows), "none": (shapes[1:], rows[2:])}.items():
        path = tmp_path / f"{case}.png"
        assert bench.save_chart(str(path), s, r) is None
        assert path.stat().st_size > 1000
