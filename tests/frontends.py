"""Running a Case through each frontend: out and the gradients (q, k, v and, with a gate,
the gate) as float32 numpy arrays in BHSD order, comparable with `common.reference`.

Shared by the per-frontend test files and the frontend x backend matrix
(test_reference_matrix.py)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np

import vsa_jax
from common import Case, from_layout, to_layout

try:  # torch is optional: the JAX tests also run where only vsa[jax] is installed (CI's second venv)
    import torch

    import vsa_torch
    TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
except ImportError:
    torch = vsa_torch = None
    TORCH_DEVICE = None
JAX_GPU = jax.default_backend() == "gpu"


def seed_of(case: Case) -> int:
    return zlib.crc32(case.id().encode())


def vsa_fn(case: Case, kv_counts, q_counts, **kw):
    """f(q, k, v, gate) -> out for the case's layout and static arguments."""
    fn = vsa_jax.video_sparse_attn if case.layout == "bhsd" else vsa_jax.video_sparse_attn_bshd

    def f(q, k, v, gate):
        return fn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate if case.gate else None,
                  softmax_scale=case.softmax_scale, **kw)
    return f


def jax_args(case: Case, inputs: dict):
    dtype = jnp.dtype(case.dtype)
    return [jnp.asarray(to_layout(inputs[n], case.layout), dtype) for n in ("q", "k", "v", "gate", "dout")]


def to_numpy(case: Case, got: dict) -> dict:
    return {n: from_layout(np.asarray(x, np.float32), case.layout) for n, x in got.items()}


def run_jax_vjp(case: Case, inputs: dict, backend: str = "auto", **kw) -> dict:
    """jit(vjp) with the counts traced (passed as jit arguments); `kw`: more static keyword
    arguments of the call (prefix_blocks, prefix_mode)."""
    @jax.jit
    def run(q, k, v, gate, dout, kv_counts, q_counts):
        out, vjp = jax.vjp(vsa_fn(case, kv_counts, q_counts, backend=backend, **kw), q, k, v, gate)
        return out, vjp(dout)

    q, k, v, gate, dout = jax_args(case, inputs)
    out, (dq, dk, dv, dgate) = run(q, k, v, gate, dout, jnp.asarray(inputs["kv_counts"], jnp.int32),
                                   jnp.asarray(inputs["q_counts"], jnp.int32))
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if case.gate:
        got["dgate"] = dgate
    return to_numpy(case, got)


def check_jax_vjp_against_torch(case: Case, inputs: dict, backend: str, padding: str) -> None:
    """jit(vjp) on `backend` (the default launch) against torch eager on it: both frontends close to the
    float64 reference; out and dgate (one forward kernel, the same Triton stages) bit for bit; dq, dk, dv
    within the reference tolerance of torch's (libraries' backwards reduce dQ with fp32 atomics, in a
    varying order)."""
    from common import assert_close, reference
    got = run_jax_vjp(case, inputs, backend=backend, padding=padding)
    want = run_torch(case, inputs, backend=backend, padding=padding)
    assert_close(case, got, reference(case, inputs, padding))
    for n in ("out", "dgate"):
        assert np.array_equal(got[n], want[n]), f"{n}: max |jax - torch| = {np.abs(got[n] - want[n]).max():.3e}"
    assert_close(case, {n: got[n] for n in ("dq", "dk", "dv")},
                 {n: np.asarray(want[n], np.float64) for n in ("dq", "dk", "dv")})


def run_jax_grad(case: Case, inputs: dict, backend: str = "auto") -> dict:
    """jit(grad) of sum(out * dout) (whose cotangent of out is exactly dout), with out
    from the same (training) forward as an aux output; the counts are numpy constants
    (their values checked at trace time)."""
    f = vsa_fn(case, inputs["kv_counts"], inputs["q_counts"], backend=backend)
    q, k, v, gate, dout = jax_args(case, inputs)

    def loss(q, k, v, gate):
        out = f(q, k, v, gate)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (dq, dk, dv, dgate), out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, gate)
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if case.gate:
        got["dgate"] = dgate
    return to_numpy(case, got)


def run_torch(case: Case, inputs: dict, backend: str = "auto", device: str = TORCH_DEVICE, **kw) -> dict:
    dtype = getattr(torch, case.dtype)

    def tensor(name):
        return torch.from_numpy(to_layout(inputs[name], case.layout)).to(device=device, dtype=dtype)

    q, k, v, gate = (tensor(n).requires_grad_() for n in ("q", "k", "v", "gate"))
    fn = vsa_torch.video_sparse_attn if case.layout == "bhsd" else vsa_torch.video_sparse_attn_bshd
    out = fn(q, k, v, torch.from_numpy(inputs["kv_counts"]), torch.from_numpy(inputs["q_counts"]), case.topk,
             case.block, gate if case.gate else None, backend=backend, softmax_scale=case.softmax_scale, **kw)
    out.backward(tensor("dout"))
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if case.gate:
        got["dgate"] = gate.grad
    return {n: from_layout(t.detach().float().cpu().numpy(), case.layout) for n, t in got.items()}
