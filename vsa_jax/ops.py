"""JAX glue: `jax.custom_vjp` functions whose forward and backward are
`buffer_callback`s over `vsa_core.ops`.

Each callback runs inside the compiled XLA program on XLA's own buffers: the inputs,
and outputs + workspaces declared from the problem's buffer tables (so XLA allocates
everything; the callback allocates nothing). The core sees the buffers as
`DeviceBuffer`s (their addresses; no torch) and launches on XLA's CUDA stream
(`ctx.stream`), so the kernels are ordered with the surrounding XLA ops without any
synchronisation.
Inputs are only read; nothing is kept past the callback.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from vsa_core import ops as core_ops
from vsa_core.api import op_problem
from vsa_core.backends import resolve_backend
from vsa_core.problem import (AttnProblem, check_count_values, check_index_values, check_offsets, check_prefix_values,
                              check_varlen_selection, resolve_softmax_scale)
from vsa_core.runtime import BufferAdapter, DeviceBuffer, DeviceInfo

from . import native as _native

_DTYPES = {"float32": jnp.float32, "int32": jnp.int32, "int8": jnp.int8}
_DLPACK_CPU = 1  # kDLCPU
_CPU = DeviceInfo("cpu")


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
    return device_info_of(device)


def device_info_of(device) -> DeviceInfo:
    if device.platform in ("gpu", "cuda"):
        cc = getattr(device, "compute_capability", None)
        capability = tuple(int(c) for c in str(cc).split(".")[:2]) if cc else None
        return DeviceInfo("cuda", getattr(device, "local_hardware_id", None) or 0, capability)
    return DeviceInfo(device.platform)


def backend_for(backend, p: AttnProblem, q):
    return resolve_backend(backend, p, device_info(q), arrays="JAX arrays on the CPU", gpu="arrays on a GPU")


# Value checks read the values on the host. A concrete jax.Array is immutable, so one
# already checked (the same object) is not read again: steady-state eager calls do not
# synchronise. numpy arrays are checked on every call (they can change in place).
_checked: dict = {}


def _check_once(arrays: tuple, what, check) -> None:
    cacheable = all(isinstance(x, jax.Array) for x in arrays)
    key = (tuple(id(x) for x in arrays), what)
    if cacheable:
        seen = _checked.get(key)
        if seen is not None and all(r() is x for r, x in zip(seen, arrays)):
            return
    check()
    if cacheable:
        if len(_checked) > 256:
            _checked.clear()
        _checked[key] = tuple(weakref.ref(x) for x in arrays)


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
    their shape and dtype (checked by describe_attention) are known: the kernels then
    clamp them to [0, E]."""
    if not hasattr(counts, "dtype"):
        counts = np.asarray(counts)
    if np.dtype(counts.dtype).kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {counts.dtype}")
    if not _is_tracer(counts):
        _check_once((counts,), (name, block_elems),
                    lambda: check_count_values(name, np.asarray(counts), block_elems))
    return jnp.asarray(counts, dtype=jnp.int32)


def check_index_lists(block_indices, block_counts, n_kv_blocks: int) -> None:
    """ValueError naming block_indices / block_counts for bad values, when both are
    concrete; traced lists are bounded by the kernels instead (see vsa_core.triton_kernels)."""
    if _is_tracer(block_indices) or _is_tracer(block_counts):
        return
    _check_once((block_indices, block_counts), n_kv_blocks,
                lambda: check_index_values(np.asarray(block_indices), np.asarray(block_counts), n_kv_blocks))


# ---- the callbacks ------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cuda_device(index: int) -> DeviceInfo:
    """DeviceInfo (with its capability) of the CUDA device with this ordinal."""
    for device in jax.local_devices():
        if device.platform in ("gpu", "cuda") and getattr(device, "local_hardware_id", None) == index:
            return device_info_of(device)
    raise RuntimeError(f"no local JAX GPU has CUDA ordinal {index}")


def _device_buffer(buf) -> DeviceBuffer:
    """A buffer_callback buffer as the launchers read it: its address, dtype and shape. Host
    buffers are read through numpy (zero-copy), device buffers through
    __cuda_array_interface__."""
    kind, index = buf.__dlpack_device__()
    dtype = np.dtype(buf.dtype).name
    if kind == _DLPACK_CPU:
        return DeviceBuffer(np.asarray(buf).ctypes.data, dtype, buf.shape, _CPU, owner=buf)
    return DeviceBuffer(buf.__cuda_array_interface__["data"][0], dtype, buf.shape, _cuda_device(index), owner=buf)


class JaxBuffers(BufferAdapter):
    """XLA's buffers as DeviceBuffers; launches on XLA's stream (`raw_cuda_launches`)."""

    def views(self, buffers) -> dict:
        return {name: None if buf is None else _device_buffer(buf) for name, buf in buffers.items()}


JAX_BUFFERS = JaxBuffers()


def _stream(ctx, q) -> Optional[int]:
    """XLA's CUDA stream; None on the CPU, where `ctx.stream` raises."""
    return None if q.__dlpack_device__()[0] == _DLPACK_CPU else ctx.stream


@functools.lru_cache(maxsize=None)
def _callback(stage: str, p: AttnProblem, impl):
    """One callback object per (stage, problem, backend): jit caches key on it, so
    eager (un-jitted) calls of the same problem reuse the compiled executable."""
    run = core_ops.forward if stage == "forward" else core_ops.backward

    def callback(ctx, outputs: dict, inputs: dict) -> None:
        run(p, impl, {**inputs, **outputs}, stream=_stream(ctx, inputs["q"]), adapter=JAX_BUFFERS)

    # vmap_method="sequential": under jax.vmap the callback runs once per mapped element
    # (a scan over the mapped axis) on slices that have exactly the shapes `p` was
    # described with. The kernels' buffers are fixed by `p`, so "broadcast_all" /
    # "expand_dims" (one call on arrays with an extra leading axis) would hand them
    # arrays they do not describe; folding the axis into the batch would also be wrong
    # when the counts or the selection differ per element.
    specs = p.forward_buffers() if stage == "forward" else p.backward_buffers()
    dtype = jnp.dtype(p.dtype)
    return buffer_callback(callback, _shape_dtypes(specs, dtype), vmap_method="sequential")


# ---- varying manual axes (jax.shard_map with check_vma) -------------------------------------
# Inside shard_map every value's type says over which manual mesh axes it varies (its
# "vma"). A buffer_callback's results carry none (they are typed as invariant), but
# each device computes its own values: they vary exactly as the inputs do. So the
# inputs are first made to vary alike (outside the custom_vjp, where JAX's own
# transpose of the cast sums the gradient of an input that did not vary), and every
# callback result is cast to that common vma.
def _vma(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying; later versions: aval.vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary(x, axes: frozenset):
    """x, cast to vary over `axes` (a superset of its own vma)."""
    missing = tuple(a for a in axes if a not in _vma(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _vary_alike(*xs):
    """The arrays of xs (None kept), each cast to vary over the union of their vmas."""
    axes = frozenset().union(*(_vma(x) for x in xs if x is not None))
    return tuple(None if x is None else _vary(x, axes) for x in xs)


def _run(stage: str, p: AttnProblem, impl, **inputs) -> dict:
    """Runs one stage; returns every output and workspace of its buffer table, typed
    as varying like its inputs (which vary alike, see _vary_alike). launch="native"
    replays the stage's launch plan as XLA custom calls (no Python per call)."""
    inputs = {n: x for n, x in inputs.items() if x is not None}
    axes = frozenset().union(*(_vma(x) for x in inputs.values()))
    if _native.selected(impl):
        results = _native.run(stage, p, inputs)
    else:
        results = _callback(stage, p, impl)(inputs)
    return {n: _vary(x, axes) for n, x in results.items()}


def _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, selection, training=True, cu_q=None,
             list_capacity=None, prefix=(0, "exempt"), seq_prefix=None, softmax_scale=None, padding="zeros"):
    """The problem inside the custom_vjp (at trace time). The frontend checked the call
    (`vsa_core.api.prepare_*`); here it is rebuilt from the shapes and statics, a cache hit
    (`op_problem`): under vsa_jax.spmd the shapes are a device's shard, not the caller's.
    Packed sequences (cu_q given) arrive as BSHD with batch 1: the problem gets n_seqs."""
    return op_problem(q, k, block_elems=block_elems, layout=layout, selection=selection, topk=topk,
                      has_gate=gate is not None, training=training, cu_seqlens_q=cu_q, list_capacity=list_capacity,
                      prefix_blocks=prefix[0], prefix_mode=prefix[1], seq_prefix=seq_prefix,
                      softmax_scale=softmax_scale, padding=padding)


def as_prefix(p: AttnProblem, prefix_blocks, cu_q, cu_k):
    """Packed calls: per-sequence prefix counts (p.seq_prefix; the problem checked their shape
    and dtype) as an int32 jax array, None for an int (static in the problem). Their values
    (an int's too) are checked against the offsets when all are concrete; under jit they are
    read on the device only."""
    if not p.has_prefix:
        return None
    if not any(_is_tracer(x) for x in (prefix_blocks, cu_q, cu_k)):
        check_prefix_values(np.asarray(prefix_blocks) if p.seq_prefix else p.prefix_blocks, np.asarray(cu_q),
                            np.asarray(cu_k), p.block_elems)
    return jnp.asarray(prefix_blocks, dtype=jnp.int32) if p.seq_prefix else None


def as_offsets(name: str, cu, total: int, block_elems: int) -> jax.Array:
    """Packed offsets as an int32 jax array (dtype and shape checked by describe_varlen). Their
    values are checked where they are known (numpy, a concrete jax.Array); under jit they are
    tracers: one compiled call then serves every packing of the same totals."""
    if not _is_tracer(cu):
        check_offsets(name, np.asarray(cu), total, block_elems)
    return jnp.asarray(cu, dtype=jnp.int32)


def check_selection(p: AttnProblem, cu_q, cu_k, block_map=None, block_indices=None, block_counts=None) -> None:
    """A packed selection may list only blocks of each query block's own sequence: checked
    when everything is concrete; under jit the kernels ignore the other entries."""
    given = [x for x in (cu_q, cu_k, block_map, block_indices, block_counts) if x is not None]
    if any(_is_tracer(x) for x in given):
        return

    def host(x):
        return None if x is None else np.asarray(x)
    check_varlen_selection(p, host(cu_q), host(cu_k), host(block_map), host(block_indices), host(block_counts))


# ---- VSA ----------------------------------------------------------------------------------
# topk, block_elems, layout, the resolved backend module, prefix = (prefix_blocks,
# prefix_mode), softmax_scale (the problem's resolved float) and padding are static (hashable).
# cu_q / cu_k: the packed sequences' int32 offsets (None when not packed), traced like the
# counts; seq_prefix: their per-sequence prefix counts (int32 [N], or None).
def vsa(q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, topk, block_elems, layout, impl, seq_prefix=None,
        prefix=(0, "exempt"), *, softmax_scale: Optional[float] = None, padding="zeros"):
    q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix = _vary_alike(q, k, v, kv_counts, q_counts, gate,
                                                                            cu_q, cu_k, seq_prefix)
    return _vsa(q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix, topk, block_elems, layout, impl,
                tuple(prefix), resolve_softmax_scale(softmax_scale, q.shape[-1]), padding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13, 14, 15))
def _vsa(q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix, topk, block_elems, layout, impl, prefix,
         softmax_scale, padding):
    """Primal (no gradient asked for): the inference forward, nothing kept for a backward."""
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training=False, cu_q=cu_q,
                 prefix=prefix, seq_prefix=seq_prefix, softmax_scale=softmax_scale, padding=padding)
    return _run("forward", p, impl, q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts, gate=gate,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_prefix=seq_prefix)["out"]


def _vsa_fwd(q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix, topk, block_elems, layout, impl, prefix,
             softmax_scale, padding):
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training=True, cu_q=cu_q,
                 prefix=prefix, seq_prefix=seq_prefix, softmax_scale=softmax_scale, padding=padding)
    res = _run("forward", p, impl, q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts, gate=gate,
               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_prefix=seq_prefix)
    # the backward reads everything but the top-k scores workspace ([B, H, nQ, nKV] fp32); the
    # sequence ids are recomputed there (two tiny launches) rather than kept
    saved = {n: x for n, x in res.items() if n not in ("scores", "q_seq", "kv_seq")}
    return res["out"], (q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix, saved)


def _vsa_bwd(topk, block_elems, layout, impl, prefix, softmax_scale, padding, residuals, dout):
    q, k, v, kv_counts, q_counts, gate, cu_q, cu_k, seq_prefix, res = residuals
    p = _problem(q, k, v, kv_counts, q_counts, gate, topk, block_elems, layout, "topk", training=True, cu_q=cu_q,
                 prefix=prefix, seq_prefix=seq_prefix, softmax_scale=softmax_scale, padding=padding)
    grads = _run("backward", p, impl, dout=dout, q=q, k=k, v=v, kv_counts=kv_counts, q_counts=q_counts,
                 gate=gate, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **res)
    # None: no cotangent for the integer counts, offsets and prefix counts (JAX makes them float0
    # zeros) nor an absent gate
    return grads["dq"], grads["dk"], grads["dv"], None, None, grads.get("dgate"), None, None, None


_vsa.defvjp(_vsa_fwd, _vsa_bwd)


# ---- block-sparse attention with a given selection ----------------------------------------
def _bsa_problem(q, k, v, kv_counts, block_map, sel_idx, cu_q, block_elems, layout, softmax_scale, padding):
    selection = "block_map" if block_map is not None else "indices"
    capacity = sel_idx.shape[-1] if block_map is None else None
    return _problem(q, k, v, kv_counts, None, None, None, block_elems, layout, selection, cu_q=cu_q,
                    list_capacity=capacity, softmax_scale=softmax_scale, padding=padding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13))
def _bsa(q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, block_elems, layout, impl, softmax_scale,
         padding):
    return _bsa_fwd(q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, block_elems, layout, impl,
                    softmax_scale, padding)[0]


def _bsa_fwd(q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, block_elems, layout, impl, softmax_scale,
             padding):
    p = _bsa_problem(q, k, v, kv_counts, block_map, sel_idx, cu_q, block_elems, layout, softmax_scale, padding)
    lists = {"given_idx": sel_idx, "given_num": sel_num}  # the forward writes the lists it runs to sel_idx
    res = _run("forward", p, impl, q=q, k=k, v=v, kv_counts=kv_counts, block_map=block_map,
               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **lists)
    if "sel_idx" in res:  # the lists the forward ran (from the map, or the given ones cleaned by the rule)
        sel_idx, sel_num = res["sel_idx"], res["sel_num"]
    return (res["out"], res["lse"]), (q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, res["out"],
                                      res["lse"])


def _bsa_bwd(block_elems, layout, impl, softmax_scale, padding, residuals, cotangents):
    q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, out, lse = residuals
    dout, _ = cotangents  # lse is not differentiable (block_sparse_attn stops its gradient)
    p = _bsa_problem(q, k, v, kv_counts, block_map, sel_idx, cu_q, block_elems, layout, softmax_scale, padding)
    grads = _run("backward", p, impl, dout=dout, q=q, k=k, v=v, kv_counts=kv_counts, block_map=block_map,
                 sel_idx=sel_idx, sel_num=sel_num, out=out, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return grads["dq"], grads["dk"], grads["dv"], None, None, None, None, None, None


_bsa.defvjp(_bsa_fwd, _bsa_bwd)


def bsa(q, k, v, kv_counts, block_map, sel_idx, sel_num, block_elems, layout, impl, cu_q=None, cu_k=None, *,
        softmax_scale: Optional[float] = None, padding="zeros"):
    q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k = _vary_alike(
        q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k)
    out, lse = _bsa(q, k, v, kv_counts, block_map, sel_idx, sel_num, cu_q, cu_k, block_elems, layout, impl,
                    resolve_softmax_scale(softmax_scale, q.shape[-1]), padding)
    return out, jax.lax.stop_gradient(lse)
