"""The cuDNN backend (cuDNN frontend's block-sparse attention, `cudnn.BSA`).

CPU (CI): availability reasons, the measured "auto" table and its fall-through, and that
importing the frontends imports no cuDNN / CuTe DSL.
GPU (`-m gpu`, sm_90 with nvidia-cudnn-frontend 1.32.0 installed; skipped otherwise):
backend="cudnn" against the float64 reference and backend="triton" (partial and empty
tiles, Sq != Skv, gate, BHSD/BSHD, large logits), block_sparse_attn with empty rows,
the forward-only cases in inference, streams, and torch <-> JAX parity.
"""

import dataclasses
import zlib

import numpy as np
import pytest
import torch

import vsa_torch
from common import Case, assert_close, errors, make_inputs, reference, require_jax_gpu, skip_unavailable, to_layout
from test_torch_vsa import run_torch
from vsa_core.backends import (BACKENDS, BackendUnavailableError, auto_table, cudnn_backend, resolve_backend,
                               triton_backend)
from vsa_core.problem import AttnProblem
from vsa_core.runtime import DeviceInfo
from vsa_torch.ops import device_info

HAS_CUDA = torch.cuda.is_available()
H200 = DeviceInfo("cuda", 0, (9, 0))


def _cudnn_imports(monkeypatch, error, wrapper="same", torch=None):
    """cuDNN frontend's kernel classes import with `error` (None: they import), its torch wrapper
    with `wrapper` (by default the same), torch with `torch`."""
    monkeypatch.setattr(cudnn_backend, "_kernels_import_error", lambda: error)
    monkeypatch.setattr(cudnn_backend, "_wrapper_import_error", lambda: error if wrapper == "same" else wrapper)
    monkeypatch.setattr(cudnn_backend, "_torch_import_error", lambda: torch)


def test_without_torch_64_token_blocks_are_available_for_jax_native_calls(monkeypatch):
    """No torch (a `vsa[jax,cudnn]` install): cuDNN's kernel classes import, its torch wrapper does
    not. JAX's native calls run the classes at 64-token blocks, so the backend takes those; 128-token
    blocks and a static prefix's forward go through the wrapper: refused, naming it and torch."""
    no_torch = "ModuleNotFoundError: No module named 'torch'"
    _cudnn_imports(monkeypatch, None, wrapper=no_torch, torch=no_torch)
    assert cudnn_backend.unavailable_reason(_problem(), H200) is None
    for kw, why in ((dict(block_elems=128), "128-token blocks"), (dict(prefix_blocks=1, topk=2), "static prefix")):
        reason = cudnn_backend.unavailable_reason(_problem(**kw), H200)
        assert reason is not None and why in reason and no_torch in reason and "torch" in reason, reason
    with pytest.raises(RuntimeError, match="only JAX's native calls"):
        cudnn_backend._cudnn()
    # torch present but the wrapper broken: refused everywhere (the torch frontend's backward needs it)
    _cudnn_imports(monkeypatch, None, wrapper="ImportError: broken", torch=None)
    assert "broken" in cudnn_backend.unavailable_reason(_problem(), H200)


def _problem(**kw) -> AttnProblem:
    base = dict(batch=1, heads=2, q_len=256, kv_len=512, head_dim=128, block_elems=64, dtype="bfloat16",
                topk=2, has_gate=True)
    base.update(kw)
    return AttnProblem(**base)


# ---- availability (CPU) ------------------------------------------------------------------
def test_unavailable_on_cpu_with_reason():
    reason = cudnn_backend.unavailable_reason(_problem(), DeviceInfo("cpu"))
    assert reason is not None and "NVIDIA GPUs only" in reason and "cpu" in reason


@pytest.mark.parametrize("kw, device, expect", [
    (dict(), DeviceInfo("cuda", 0, (8, 0)), "sm_80"),
    (dict(), DeviceInfo("cuda", 0, (10, 0)), "sm_100"),
    (dict(block_elems=256, q_len=512), H200, "256-token blocks"),
    (dict(dtype="float16"), H200, "backward needs bfloat16"),
    (dict(head_dim=64), H200, "head dim 64"),
])
def test_unavailable_reasons(kw, device, expect, monkeypatch):
    _cudnn_imports(monkeypatch, None)
    reason = cudnn_backend.unavailable_reason(_problem(**kw), device)
    assert reason is not None and expect in reason, reason


def test_forward_only_cases_run_in_inference(monkeypatch):
    """fp16 and head dim 64 have a cuDNN forward but no backward on sm_90: refused when a
    backward may follow (training), accepted for inference."""
    _cudnn_imports(monkeypatch, None)
    for kw in (dict(dtype="float16"), dict(head_dim=64), dict(dtype="float16", head_dim=64, block_elems=128)):
        assert cudnn_backend.unavailable_reason(_problem(**kw, training=True), H200) is not None
        assert cudnn_backend.unavailable_reason(_problem(**kw, training=False), H200) is None


def test_available_on_h200_when_cudnn_imports(monkeypatch):
    _cudnn_imports(monkeypatch, None)
    for E in (64, 128):
        for layout in ("bhsd", "bshd"):
            assert cudnn_backend.unavailable_reason(_problem(block_elems=E, layout=layout), H200) is None


def test_missing_cudnn_names_what_to_install(monkeypatch):
    _cudnn_imports(monkeypatch, "ModuleNotFoundError: No module named 'cudnn'")
    reason = cudnn_backend.unavailable_reason(_problem(), H200)
    assert "No module named 'cudnn'" in reason and cudnn_backend.INSTALL_HINT in reason


def test_importing_the_frontends_does_not_import_cudnn():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = ("import sys, vsa_core, vsa_core.backends, vsa_torch; "
            "print(any(m.split('.')[0] in ('cudnn', 'cutlass', 'flash_attn') for m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env, cwd=root)
    assert res.stdout.strip() == "False"


# ---- the "auto" table (CPU) ------------------------------------------------------------------
def test_auto_table_keys_name_registered_backends():
    from vsa_core.backends import BACKENDS
    for key, order in auto_table.TABLE.items():
        arch, E, D, dtype = key
        assert arch.startswith("sm_") and E in (64, 128, 256) and D in (64, 128) and dtype in ("bfloat16", "float16")
        assert order and all(name in BACKENDS for name in order), (key, order)
    assert all(name in BACKENDS for name in auto_table.DEFAULT_ORDER)


def test_auto_order_per_key_and_default():
    assert auto_table.auto_order(_problem(), H200) == ("sm90", "cudnn", "triton")
    assert auto_table.auto_order(_problem(block_elems=256, q_len=512), H200)[0] == "cute"
    # no entry (another arch, dtype, head dim, or no GPU): the order before the table
    for p, dev in ((_problem(), DeviceInfo("cuda", 0, (10, 0))), (_problem(dtype="float16"), H200),
                   (_problem(head_dim=64), H200), (_problem(), DeviceInfo("cpu"))):
        assert auto_table.auto_order(p, dev) == auto_table.DEFAULT_ORDER


def test_auto_order_ignores_length_and_training():
    """The measured order holds at every length, in training and in inference."""
    key = ("sm_90", 64, 128, "bfloat16")
    for n in (1, 624, 1440, 4096):
        long = _problem(q_len=n * 64, kv_len=n * 64)
        assert auto_table.auto_order(long, H200) == auto_table.TABLE[key]
        assert auto_table.auto_order(dataclasses.replace(long, training=False), H200) == auto_table.TABLE[key]


def test_auto_takes_sm90_where_measured_fastest_and_falls_through(monkeypatch):
    from vsa_core.backends import sm90_backend
    monkeypatch.setattr(sm90_backend, "_kernels_import_error", lambda: None)
    _cudnn_imports(monkeypatch, None)
    assert resolve_backend("auto", _problem(), H200) is sm90_backend
    monkeypatch.setattr(sm90_backend, "_kernels_import_error", lambda: "ModuleNotFoundError: No module named 'cutlass'")
    assert resolve_backend("auto", _problem(), H200) is cudnn_backend  # not installed: the next one
    _cudnn_imports(monkeypatch, "ModuleNotFoundError: No module named 'cudnn'")
    assert resolve_backend("auto", _problem(), H200) is triton_backend


def test_auto_error_lists_every_reason(monkeypatch):
    from vsa_core.backends import sm90_backend
    _cudnn_imports(monkeypatch, "ModuleNotFoundError: No module named 'cudnn'")
    monkeypatch.setattr(sm90_backend, "_kernels_import_error", lambda: "ModuleNotFoundError: No module named 'cutlass'")
    monkeypatch.setattr(triton_backend, "unavailable_reason", lambda p, d: "not here")
    with pytest.raises(BackendUnavailableError,
                       match=r"sm90: .*No module named 'cutlass'.*; cudnn: .*No module named 'cudnn'.*; triton: not here"):
        resolve_backend("auto", _problem(), H200)


def test_explicit_cudnn_raises_with_reason(monkeypatch):
    _cudnn_imports(monkeypatch, None)
    with pytest.raises(BackendUnavailableError, match="backend='cudnn' cannot run this call: .*256-token"):
        resolve_backend("cudnn", _problem(block_elems=256, q_len=512), H200)


# ---- cuDNN BSA on the GPU -------------------------------------------------------------------
def backend_reason(backend: str, case: Case, training: bool = True):
    """Why `backend` cannot run `case` on this machine (None when it can)."""
    if not HAS_CUDA:
        return "needs an NVIDIA GPU"
    p = _problem(block_elems=case.E, head_dim=case.head_dim, dtype=case.dtype, q_len=case.n_q_blocks * case.E,
                 kv_len=case.n_kv_blocks * case.E, training=training)
    return BACKENDS[backend].unavailable_reason(p, device_info(torch.empty(0, device="cuda")))


def require_backend(backend: str, case: Case, training: bool = True):
    reason = backend_reason(backend, case, training)
    skip_unavailable(backend, reason and f"{backend} backend unavailable: {reason}")


def _require_cudnn(case: Case, training: bool = True):
    require_backend("cudnn", case, training)


# bf16, head dim 128 (its sm_90 backward), 64- and 128-token blocks
CUDNN_CASES = [
    Case(head_dim=128),                                                             # E64, partial + empty tiles
    Case(head_dim=128, layout="bshd"),
    Case(block=(4, 4, 4), head_dim=128, gate=False),
    Case(head_dim=128, n_q_blocks=5, n_kv_blocks=2, topk=1),                        # Sq > Skv
    Case(head_dim=128, n_q_blocks=2, n_kv_blocks=6, topk=3, layout="bshd"),         # Sq < Skv
    Case(head_dim=128, topk=4),                                                     # all KV blocks (one empty)
    Case(head_dim=128, topk=9, n_q_blocks=2),                                       # topk clamped
    Case(head_dim=128, partial_q=False, partial_kv=False, batch=1),
    Case(block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3, batch=1),            # E128
    Case(block=128, head_dim=128, n_q_blocks=3, n_kv_blocks=5, topk=2, gate=False, layout="bshd"),
    Case(block=(2, 8, 8), head_dim=128, n_q_blocks=4, n_kv_blocks=3, topk=2),       # 128-token tile, Sq > Skv
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDNN_CASES, ids=lambda c: c.id())
def test_cudnn_matches_float64_reference(case):
    _require_cudnn(case)
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()))
    assert_close(case, run_torch(case, inputs, backend="cudnn"), reference(case, inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDNN_CASES, ids=lambda c: c.id())
def test_cudnn_matches_triton(case):
    _require_cudnn(case)
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()) + 1)
    assert_close(case, run_torch(case, inputs, backend="cudnn"), run_torch(case, inputs, backend="triton"))


@pytest.mark.gpu
def test_cudnn_large_logits_within_flash_attention_precision():
    """cuDNN's backward forms delta from a bf16 O (FlashAttention's recipe, as the CuTe
    backend): at x16 logits dQ/dK lose accuracy against the Triton backend's fp32 out
    (measured for FA4: 3.7e-2 vs 7e-3). Checked against a bound that still fails a wrong
    block, mask or scale (errors of order 1e-1 .. 1)."""
    case = Case(head_dim=128, scale=16.0)
    _require_cudnn(case)
    inputs = make_inputs(case, seed=17)
    got, ref = run_torch(case, inputs, backend="cudnn"), reference(case, inputs)
    for name, want in ref.items():
        rel, _ = errors(got[name], want)
        assert rel < (2e-2 if name in ("out", "dv", "dgate") else 8e-2), (name, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [Case(dtype="float16", head_dim=128, scale=4.0), Case(head_dim=64),
                                  Case(dtype="float16", block=128, n_q_blocks=2, n_kv_blocks=3, layout="bshd")],
                         ids=lambda c: c.id())
def test_cudnn_forward_only_cases_in_inference(case):
    """fp16 / head dim 64: cuDNN's forward runs under no_grad (and is refused in training)."""
    _require_cudnn(case, training=False)
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()))
    dtype = getattr(torch, case.dtype)
    q, k, v, gate = (torch.from_numpy(to_layout(inputs[n], case.layout)).to("cuda", dtype)
                     for n in ("q", "k", "v", "gate"))
    fn = vsa_torch.video_sparse_attn if case.layout == "bhsd" else vsa_torch.video_sparse_attn_bshd
    counts = (torch.from_numpy(inputs["kv_counts"]), torch.from_numpy(inputs["q_counts"]))
    with torch.no_grad():
        out = fn(q, k, v, *counts, case.topk, case.block, gate, backend="cudnn")
    got = {"out": to_layout(out.float().cpu().numpy(), case.layout)}
    assert_close(case, got, {"out": reference(case, inputs)["out"]})
    with pytest.raises(BackendUnavailableError, match="backward"):
        fn(q.requires_grad_(), k, v, *counts, case.topk, case.block, gate, backend="cudnn")


@pytest.mark.gpu
def test_cudnn_inference_output_equals_training_forward():
    case = Case(head_dim=128)
    _require_cudnn(case)
    inputs = make_inputs(case, seed=11)
    args = [torch.from_numpy(inputs[n]).to("cuda", torch.bfloat16) for n in ("q", "k", "v")]
    counts = (torch.from_numpy(inputs["kv_counts"]), torch.from_numpy(inputs["q_counts"]))
    gate = torch.from_numpy(inputs["gate"]).to("cuda", torch.bfloat16)
    with torch.no_grad():
        out_inference = vsa_torch.video_sparse_attn(*args, *counts, case.topk, case.block, gate, backend="cudnn")
    grads = [a.clone().requires_grad_() for a in args]
    out_training = vsa_torch.video_sparse_attn(*grads, *counts, case.topk, case.block, gate, backend="cudnn")
    assert torch.equal(out_inference, out_training.detach())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("E", [64, 128])
def test_cudnn_block_sparse_attn_with_empty_rows(layout, E):
    check_empty_rows("cudnn", layout, E)


def check_empty_rows(backend: str, layout: str, E: int):
    """A query block with nothing selected, and one that selected only the empty KV block:
    out 0 and lse -inf there (cuDNN's empty-safe path; ours by the kernels' own rule), as the
    Triton backend."""
    case = Case(block=E, head_dim=128, n_q_blocks=3, n_kv_blocks=4, layout=layout)
    require_backend(backend, case)
    inputs = make_inputs(case, seed=5)
    assert inputs["kv_counts"][2] == 0
    rng = np.random.default_rng(9)
    block_map = torch.from_numpy(rng.random((case.batch, case.heads, 3, 4)) < 0.5)
    block_map[0, 0, 0, :] = False
    block_map[0, 1, 1, :] = False
    block_map[0, 1, 1, 2] = True  # only the empty block

    def run(name):
        q, k, v = (torch.from_numpy(to_layout(inputs[n], layout)).to("cuda", torch.bfloat16).requires_grad_()
                   for n in ("q", "k", "v"))
        out, lse = vsa_torch.block_sparse_attn(q, k, v, block_map.cuda(), inputs["kv_counts"], E, layout=layout,
                                               backend=name)
        out.backward(torch.from_numpy(to_layout(inputs["dout"], layout)).to("cuda", torch.bfloat16))
        res = {n: to_layout(t.detach().float().cpu().numpy(), layout)
               for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
        return res, lse.cpu().numpy()

    (got, lse), (want, want_lse) = run(backend), run("triton")
    assert_close(case, got, want)
    assert np.isneginf(lse[0, 0, :E]).all() and np.isneginf(lse[0, 1, E:2 * E]).all()
    assert (got["out"][0, 0, :E] == 0).all() and (got["out"][0, 1, E:2 * E] == 0).all()
    finite = np.isfinite(want_lse)
    assert (np.isfinite(lse) == finite).all()
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_cudnn_runs_on_the_current_stream():
    check_current_stream("cudnn")


def check_current_stream(backend: str):
    """Under a side stream the results match the default stream's (the backend launches on
    torch's current stream; a kernel on another stream would race)."""
    case = Case(head_dim=128, n_q_blocks=4, n_kv_blocks=6, topk=3)
    require_backend(backend, case)
    inputs = make_inputs(case, seed=21)
    want = run_torch(case, inputs, backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = run_torch(case, inputs, backend=backend)
    torch.cuda.synchronize()
    assert_close(case, got, want)


@pytest.mark.gpu
def test_auto_takes_sm90_at_64_token_blocks_on_h200():
    from vsa_core.backends import sm90_backend
    case = Case(head_dim=128)
    _require_cudnn(case)
    if sm90_backend.library_error() is not None:
        pytest.fail(f"sm90 is missing: {sm90_backend.library_error()}")
    p = _problem(block_elems=64, head_dim=128)
    device = device_info(torch.empty(0, device="cuda"))
    assert resolve_backend("auto", p, device) is sm90_backend
    # training at 720p-64's length (1440 query blocks): sm90 still
    long = _problem(block_elems=64, head_dim=128, q_len=1440 * 64, kv_len=1440 * 64)
    assert resolve_backend("auto", long, device) is sm90_backend


@pytest.mark.gpu
@pytest.mark.parametrize("case", [Case(head_dim=128), Case(block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3,
                                                            layout="bshd")], ids=lambda c: c.id())
def test_cudnn_torch_and_jax(case):
    check_torch_and_jax("cudnn", case)


def check_torch_and_jax(backend: str, case: Case):
    """The same kernels through both frontends: the forward (no atomics) bit for bit, the
    gradients within the reference tolerance (cuDNN's backward adds dQ with atomics and builds
    its K-to-Q lists with atomics, ours reduces dQ with atomics: not bitwise reproducible)."""
    require_jax_gpu()
    require_backend(backend, case)
    import jax
    import jax.numpy as jnp
    from test_jax_vsa import jax_args, to_numpy, vsa_fn
    inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()) + 2)
    f = vsa_fn(case, inputs["kv_counts"], inputs["q_counts"], backend=backend)
    q, k, v, gate, dout = jax_args(case, inputs)

    def loss(q, k, v, gate):
        out = f(q, k, v, gate)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (dq, dk, dv, dgate), out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, gate)
    got_jax = to_numpy(case, dict(out=out, dq=dq, dk=dk, dv=dv, **({"dgate": dgate} if case.gate else {})))
    out_inference = to_numpy(case, {"out": jax.jit(f)(q, k, v, gate)})["out"]
    got_torch = run_torch(case, inputs, backend=backend)
    assert np.array_equal(got_jax["out"], got_torch["out"])
    assert np.array_equal(out_inference, got_torch["out"])
    assert_close(case, got_jax, got_torch)


@pytest.mark.gpu
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("E", [64, 128])
def test_cudnn_bad_lists_under_compile_equal_clean_lists(frontend, E):
    check_bad_lists_under_compile("cudnn", frontend, E)


def check_bad_lists_under_compile(backend: str, frontend: str, E: int):
    """Under torch.compile / jax.jit (nothing checked before launch) every bad list row of
    test_bad_values at once, and KV counts outside [0, E], must give the result of the lists
    the rule keeps and the clamped counts (the forward cleans given lists before any backend;
    cuDNN's kernels read lists and block sizes as given, so the cudnn backend clamps the
    counts; ours clamp them in the kernels). Forward bit for bit, gradients within tolerance
    (both backwards use atomics), and close to the float64 reference of the kept selection."""
    from test_bad_values import BAD_LISTS, kept_lists, lists_with
    from vsa_core import reference as R

    case = Case(block=E, head_dim=128, batch=2, heads=3, n_q_blocks=2, n_kv_blocks=4, gate=False)
    require_backend(backend, case)
    inputs = make_inputs(case, seed=91, margin=None)  # the selection is given: no top-k margin needed
    idx, num = lists_with(BAD_LISTS)
    kept_idx, kept_num, block_map = kept_lists(idx, num)
    bad_counts = inputs["kv_counts"].copy()
    bad_counts[0], bad_counts[-1] = -3, E + 7  # past the end of K/V if read as given
    clamped = np.clip(bad_counts, 0, E)
    names = ("out", "lse", "dq", "dk", "dv")
    if frontend == "torch":
        def run(q, k, v, idx, num, counts):
            return vsa_torch.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E, backend=backend)

        results = []
        for fn, lists, counts in ((torch.compile(run, fullgraph=True), (idx, num), bad_counts),
                                  (run, (kept_idx, kept_num), clamped)):
            q, k, v = (torch.from_numpy(inputs[n]).to("cuda", torch.bfloat16).requires_grad_() for n in "qkv")
            out, lse = fn(q, k, v, *(torch.from_numpy(x).cuda() for x in lists), torch.from_numpy(counts).cuda())
            out.backward(torch.from_numpy(inputs["dout"]).to("cuda", torch.bfloat16))
            results.append([x.detach().float().cpu().numpy() for x in (out, lse, q.grad, k.grad, v.grad)])
    else:
        require_jax_gpu()
        import jax
        import jax.numpy as jnp

        import vsa_jax

        @jax.jit
        def run(q, k, v, dout, idx, num, counts):
            def f(q, k, v):
                return vsa_jax.block_sparse_attn_from_indices(q, k, v, idx, num, counts, E, backend=backend)
            (out, lse), vjp = jax.vjp(f, q, k, v)
            return out, lse, *vjp((dout, jnp.zeros_like(lse)))

        args = [jnp.asarray(inputs[n], jnp.bfloat16) for n in ("q", "k", "v", "dout")]
        results = [[np.asarray(x, np.float32) for x in run(*args, *(jnp.asarray(a, jnp.int32) for a in lists))]
                   for lists in ((idx, num, bad_counts), (kept_idx, kept_num, clamped))]
    bad, clean = (dict(zip(names, r)) for r in results)
    for name in ("out", "lse"):
        assert np.array_equal(bad[name], clean[name]), name
    grads = {n: bad[n] for n in ("dq", "dk", "dv")}
    assert_close(case, grads, {n: clean[n].astype(np.float64) for n in grads})
    x = {n: R.round_to_dtype(inputs[n], "bfloat16") for n in ("q", "k", "v", "dout")}
    out, _, ref_grads = R.block_sparse_attn_reference(x["q"], x["k"], x["v"], block_map, clamped, E, dout=x["dout"])
    assert_close(case, {n: bad[n] for n in ("out", "dq", "dk", "dv")}, {"out": out, **ref_grads})


def test_library_backends_keep_the_fine_output_in_the_input_dtype():
    """out_fine (VSA training) holds what the fine kernel wrote: q's dtype for the library backends
    (cuDNN and FA4 write nothing wider); ours keep out's rounding residual, in q's dtype too."""
    import numpy as np
    from vsa_core.spec import OpStatics, op_problem
    p = _problem()
    q, k = np.zeros((1, 2, 256, 128), np.float32), np.zeros((1, 2, 512, 128), np.float32)
    for name, kept in (("cudnn", "input"), ("cute", "input"), ("triton", "rounding"), ("sm90", "rounding")):
        problem = op_problem(OpStatics.of(p, name), {"q": q, "k": k})
        assert problem.fine_residual == kept and problem.forward_buffers()["out_fine"][1] == "input", name


BLK64_BACKWARD_BUILD = """
import cutlass, cutlass.cute as cute, torch
from vsa_core.backends import cudnn_backend, sm90_common
from vsa_core.problem import AttnProblem
from vsa_jax.cutlass_common import compile_without_gpu
types = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}

def in_global_memory(x, align=16, leading_dim=None):
    stride = tuple(s if s in (0, 1) else cute.sym_int64() for s in x.stride())
    return cute.runtime.make_fake_tensor(types[x.dtype], tuple(cute.sym_int() for _ in x.shape), stride,
                                         assumed_align=align)

sm90_common.cute_tensor = in_global_memory
for layout in ("bhsd", "bshd"):
    p = AttnProblem(batch=1, heads=2, q_len=512, kv_len=640, head_dim=128, block_elems=64, dtype="bfloat16", topk=3,
                    layout=layout)
    tokens = lambda s: torch.randn(p.token_shape(s)).to(torch.bfloat16)
    b = {**{n: tokens(p.q_len) for n in ("q", "o", "dout", "dq")}, **{n: tokens(p.kv_len) for n in ("k", "v", "dk", "dv")},
         "lse": torch.randn(1, p.heads, p.q_len), "kv_counts": torch.full((p.n_kv_blocks,), 64, dtype=torch.int32),
         "sel_idx": torch.zeros(1, p.heads, p.n_q_blocks, p.select_capacity, dtype=torch.int32),
         "sel_num": torch.zeros(1, p.heads, p.n_q_blocks, dtype=torch.int32)}
    b.update({n: torch.zeros(shape, dtype=getattr(torch, dt))
              for n, (shape, dt) in cudnn_backend.blk64_backward_workspaces(p).items()})
    to_bhsd = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(1, 2))
    t = {n: to_bhsd(b[n]) if n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv") else b[n]
         for n in cudnn_backend.BLK64_BACKWARD_ARGS if n != "block_sizes"}
    t["block_sizes"] = b["kv_counts"][None].expand(1, -1)
    cudnn_backend._check_blk64_backward(p, t)
    with compile_without_gpu():
        fn = cudnn_backend._blk64_backward_build(p, [t[n] for n in cudnn_backend.BLK64_BACKWARD_ARGS])
    assert callable(fn)
assert len(cudnn_backend._BLK64_BWD_BUILDS) == 1  # one build: layouts and shapes are run-time values
try:
    cudnn_backend._check_blk64_backward(p, {**t, "k2q_indices": torch.zeros(1, 1, dtype=torch.int32)})
except ValueError as e:
    assert "the workspaces of the problem" in str(e), e
else:
    raise AssertionError("wrong workspaces passed the checks")
print("BUILT")
"""


def test_the_blk64_backward_compiles_for_sm90a_on_the_cpu():
    """The torch launch's build of cuDNN's blk64 backward (`cudnn_kernels.Blk64Backward`: its K-to-Q
    lists, then its backward kernel) compiles for sm_90a on a host with no GPU (a process of its
    own: the CuTe DSL reads CUTE_DSL_ARCH once), from the arguments `_blk64_backward` passes (token
    views of either layout, the block sizes broadcast over the batch, the plan's workspaces), after
    its checks pass. CPU tensors have no device address space, so the compile examples are CuTe
    tensors of the same types in global memory (dynamic shapes and strides, as `cute_tensor` makes
    them)."""
    import importlib.util
    import os
    import subprocess
    import sys
    if any(importlib.util.find_spec(m) is None for m in ("cutlass", "cudnn", "jax")):
        pytest.skip("needs nvidia-cutlass-dsl, nvidia-cudnn-frontend and jax")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", PYTHONPATH=repo, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", BLK64_BACKWARD_BUILD], env=env, cwd=repo, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "BUILT" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
