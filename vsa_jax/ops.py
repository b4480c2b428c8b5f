"""JAX glue: `jax.custom_vjp` functions whose forward and backward are
`buffer_callback`s over `vsa_core.ops`.

Each callback runs inside the compiled XLA program on XLA's own buffers: the inputs,
and outputs + workspaces declared from the problem's buffer tables (so XLA allocates
everything; the callback allocates nothing). The core views the buffers as torch
tensors through DLPack and launches on XLA's CUDA stream (`ctx.stream`), so the
kernels are ordered with the surrounding XLA ops without any synchronisation.
Inputs are only read; nothing is kept past the callback.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from vsa_core import ops as core_ops
from vsa_core.backends import resolve_backend
from vsa_core.problem import AttnProblem, check_count_values, describe_attention
from vsa_core.runtime import DeviceInfo

_DTYPES = {"float32": jnp.float32, "int32": jnp.int32, "int8": jnp.int8}
_DLPACK_CPU = 1  # kDLCPU


def _shape_dtypes(specs: dict, input_dtype) -> dict:
    return {name: jax.ShapeDtypeStruct(shape, input_dtype if dt == "input" else _DTYPES[dt])
            for name, (shape, dt) in specs.items()}


# ---- devices, backends, counts (trace time) ----------------------------------------------
def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def device_info(x) -> DeviceInfo:
    """DeviceInfo of the device q lives on; under tracing (no device yet) the default device."""
    device = None
    if isinstance(x, jax.Array) and not _is_tracer(x):
        device = next(iter(x.devices()))
    if device is None:
        device = jax.config.jax_default_device
        if device is None or isinstance(device, str):
            device = jax.devices(device)[0]
    if device.platform in ("gpu", "cuda"):
        cc = getattr(device, "compute_capability", None)
        capability = tuple(int(c) for c in str(cc).split(".")[:2]) if cc else None
        return DeviceInfo("cuda", getattr(device, "local_hardware_id", None) or 0, capability)
    return DeviceInfo(device.platform)


def backend_for(backend, p: AttnProblem, q):
    return resolve_backend(backend, p, device_info(q))


def require_counts(**counts) -> None:
    """Counts must be numpy or JAX arrays (or lists of ints): a torch tensor here would
    otherwise fail deep inside numpy without naming the argument."""
    for name, c in counts.items():
        if c is not None and not isinstance(c, (jax.Array, np.ndarray, list, tuple)):
            raise TypeError(f"{name} must be a 1-D integer numpy or JAX array (or a list of ints), "
                            f"got {type(c).__module__}.{type(c).__name__}")


def as_counts(name: str, counts, block_elems: int) -> jax.Array:
    """Any integer array -> int32 jax array. The values ([0, E]) are checked when they
    are known here (numpy, a concrete jax.Array); under jit they are tracers and only
    their shape and dtype (checked by describe_attention) are known."""
    if not hasattr(counts, "dtype"):
        counts = np.asarray(counts)
    if np.dtype(counts.dtype).kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {counts.dtype}")
    if not _is_tracer(counts):
        check_count_values(name, np.asarray(counts), block_elems)
    return jnp.asarray(counts, dtype=jnp.int32)


# ---- the callbacks ------------------------------------------------------------------------
def _stream(ctx, q) -> Optional[int]:
    """XLA's CUDA stream; None on the CPU, where `ctx.stream` raises."""
    return None if q.__dlpack_device__()[0] == _DLPACK_CPU else ctx.stream


@functools.lru_cache(maxsize=None)
def _callback(stage: str, p: AttnProblem, impl):
    """One callback object per (stage, problem, backend): jit caches key on it, so
    eager (un-jitted) calls of the same problem reuse the compiled executable."""
    run = core_ops.forward if stage == "forward" else core_ops.backward

    def callback(ctx, outputs: dict, inputs: dict) -> None:
        run(p, impl, {**inputs, **outputs}, stream=_stream(ctx, inputs["q"]))

    # vmap_method="sequential": under jax.vmap the callback runs once per mapped element
    # (a scan over the mapped axis) on slices that have exactly the shapes `p` was
    # described with. The kernels' buffers are fixed by `p`, so "broadcast_all" /
    # "expand_dims" (one call on arrays with an extra leading axis) would hand them
    # arrays they do not describe; folding the axis into the batch would also be wrong
    # when the counts or the selection differ per element.
    specs = p.forward_buffers() if stage == "forward" else p.backward_buffers()
    dtype = jnp.dtype(p.dtype)
    return buffer_callback(callback, _shape_dtypes(specs, dtype), vmap_method="sequential")


def _run(stage: str, p: AttnProblem, impl, **inputs) -> dict:
    """Runs one stage; returns every output and workspace of its buffer table."""
    return _callback(stage, p, impl)({n: x for n, x in inputs.items() if x is not None})


def _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, selection, training=True):
    return describe_attention(q, k, v, block_size=block_elems, layout=layout, kv_counts=kv_counts,
                              q_counts=q_counts, topk=topk, gate=gate, selection=selection, training=training)


# ---- VSA ----------------------------------------------------------------------------------
# topk, block_elems, layout and the resolved backend module are static (hashable).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def vsa(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, impl):
    """Primal (no gradient asked for): the inference forward, nothing kept for a backward."""
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training=False)
    return _run("forward", p, impl, q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts, gate=gate)["out"]


def _vsa_fwd(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, impl):
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training=True)
    res = _run("forward", p, impl, q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts, gate=gate)
    # the backward reads everything but the top-k scores workspace ([B, H, nQ, nKV] fp32)
    saved = {n: x for n, x in res.items() if n != "scores"}
    return res["out"], (q, k, v, kv_counts, q_counts, gate, saved)


def _vsa_bwd(topk, block_elems, layout, impl, residuals, dout):
    q, k, v, kv_counts, q_counts, gate, res = residuals
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training=True)
    grads = _run("backward", p, impl, dout=dout, q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts,
                 gate=gate, **res)
    # None: no cotangent for the integer counts (JAX makes them float0 zeros) nor an absent gate
    return grads["dq"], grads["dk"], grads["dv"], None, None, grads.get("dgate")


vsa.defvjp(_vsa_fwd, _vsa_bwd)


# ---- block-sparse attention with a given selection ----------------------------------------
def _bsa_problem(q, k, v, kv_counts, block_map, block_elems, layout):
    selection = "block_map" if block_map is not None else "indices"
    return _problem(q, k, v, kv_counts, None, None, None, block_elems, layout, selection)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _bsa(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, impl):
    return _bsa_fwd(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, impl)[0]


def _bsa_fwd(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, impl):
    p = _bsa_problem(q, k, v, kv_counts, block_map, block_elems, layout)
    res = _run("forward", p, impl, q=q, k=k, v=v, kv_counts=kv_counts, block_map=block_map,
               sel_idx=sel_idx, sel_num=sel_num)
    if block_map is not None:  # the forward turned the map into index lists; the backward reads them
        sel_idx, sel_num = res["sel_idx"], res["sel_num"]
    return (res["out"], res["lse"]), (q, k, v, kv_counts, block_map, sel_idx, sel_num, res["out"], res["lse"])


def _bsa_bwd(block_elems, layout, impl, residuals, cotangents):
    q, k, v, kv_counts, block_map, sel_idx, sel_num, out, lse = residuals
    dout, _ = cotangents  # lse is not differentiable (block_sparse_attn stops its gradient)
    p = _bsa_problem(q, k, v, kv_counts, block_map, block_elems, layout)
    grads = _run("backward", p, impl, dout=dout, q=q, k=k, v=v, kv_counts=kv_counts, block_map=block_map,
                 sel_idx=sel_idx, sel_num=sel_num, out=out, lse=lse)
    return grads["dq"], grads["dk"], grads["dv"], None, None, None, None


_bsa.defvjp(_bsa_fwd, _bsa_bwd)


def bsa(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, impl):
    out, lse = _bsa(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, impl)
    return out, jax.lax.stop_gradient(lse)
