"""Native launches for JAX on GPU: a stage's launch plan replayed as XLA custom calls.

At trace time the stage's launch plan (`vsa_core.plan`) is recorded once per problem,
each launch is compiled by Triton (the same kernel source and specialization the torch
path compiles) for the device's compute capability, and the jitted program gets one
custom call per launch to jaxlib's built-in `triton_kernel_call_ffi`: a typed XLA FFI
handler that launches the kernel's PTX (compiled to a cubin once, when XLA instantiates
the program) on the device's own XLA stream, marked command-buffer compatible (so XLA can
capture it into a CUDA graph). No Python runs per call.

Every output and workspace of the stage is an XLA buffer: it is born as a result of the
first launch that takes it, and passed on to later launches with an input/output alias
(updated in place), as `vsa_core.plan.schedule` lays out.

The sm90 backend's own CuTe DSL launches (`CuteLaunch`es of its plans) become one
`cutlass.jax.cutlass_call` each (`vsa_jax.sm90_call`), its workspaces (the valid-rows copies
of padding="ignore", the backward's dQ accumulator) XLA buffers born in the plan like the
stage's own: the sm90 backend runs natively with no torch.

Selected with `set_launch("native")` or VSA_JAX_LAUNCH=native (the configured `jax_launch`,
`vsa_core.config`, read at trace time: a function already jitted keeps the path it was traced with); "callback" (buffer_callback
over vsa_core.ops) stays the default, the CPU (interpreter) path and the fallback. The
Triton and sm90 backends run natively; the cute (FA4) and cudnn backends stay on the callback path.
"""

from __future__ import annotations

import functools
import zlib
from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from vsa_core import plan as core_plan
from vsa_core.config import JAX_LAUNCH_MODES, config, configure
from vsa_core.problem import AttnProblem

from .devices import default_device, device_info_of

LAUNCH_MODES = JAX_LAUNCH_MODES
FFI_TARGET = "triton_kernel_call_ffi"


def set_launch(mode: str) -> None:
    """Selects how later traced calls launch the kernels: "callback" or "native"."""
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {mode!r}")
    configure(jax_launch=mode)


def launch_mode() -> str:
    return config().jax_launch


NATIVE_BACKENDS = ("triton", "sm90")


def selected(impl) -> bool:
    """True when this call launches natively: "native" is selected and the backend has a
    replayable plan (Triton, sm90; the library backends keep the callback)."""
    return launch_mode() == "native" and getattr(impl, "name", None) in NATIVE_BACKENDS


# ---- trace time ----------------------------------------------------------------------------------
def _capability() -> int:
    device = default_device()
    if device.platform not in ("gpu", "cuda"):
        raise RuntimeError(f"launch='native' needs a CUDA device (got {device.platform}); "
                           "use the callback launch on the CPU")
    major, minor = device_info_of(device).capability
    return major * 10 + minor


def _kernel_call(compiled: core_plan.CompiledLaunch, capability: int) -> bytes:
    """The zlib-compressed TritonAnyKernelCall proto that triton_kernel_call_ffi reads."""
    from jax._src.lib import gpu_triton  # importing it registers the FFI target with XLA

    if getattr(gpu_triton, "TritonKernel", None) is None:
        raise RuntimeError("jaxlib has no CUDA Triton support (install jax[cuda]); use the callback launch")
    if compiled.global_scratch_size:
        raise NotImplementedError(f"{compiled.name} needs a global scratch buffer")
    kernel = gpu_triton.TritonKernel(compiled.name, compiled.num_warps, compiled.num_ctas,
                                     compiled.shared_mem_bytes, compiled.ptx, "", capability)
    params = []
    for param in compiled.params:
        if param[0] == "buffer":
            params.append(gpu_triton.create_array_parameter(0, param[2]))
        else:
            _, value, kind = param
            value = bool(value) if kind == "i1" else value
            params.append(gpu_triton.create_scalar_parameter(value, kind))
    call = gpu_triton.TritonKernelCall(kernel, *compiled.launch.grid, params)
    return zlib.compress(call.to_proto(compiled.launch.kernel_name, b""))


@functools.lru_cache(maxsize=None)
def native_program(stage: str, p: AttnProblem, inputs: Tuple[Tuple[str, Tuple[int, ...], str], ...],
                   capability: int, backend: str = "triton"):
    """(plan, steps, kernel calls) of one stage of one problem on `backend`, built once; a CuTe
    DSL launch has no kernel call here (it compiles when its cutlass_call lowers)."""
    from vsa_core.backends import backend_named

    plan = core_plan.record_plan(stage, p, {n: (s, d) for n, s, d in inputs}, backend_named(backend))
    steps = core_plan.schedule(plan)
    calls = []
    for launch in plan.launches:
        if launch.kind == "cute":
            from . import sm90_call
            sm90_call.check(launch)
            calls.append(None)
        else:
            calls.append(_kernel_call(core_plan.compile_launch(launch, plan, capability), capability))
    return plan, steps, tuple(calls)


def _result_type(spec, p: AttnProblem):
    shape, dtype = spec
    return jax.ShapeDtypeStruct(shape, jnp.dtype(p.dtype if dtype == "input" else dtype))


def run(stage: str, p: AttnProblem, inputs: Dict[str, jax.Array], backend: str = "triton") -> Dict[str, jax.Array]:
    """Same contract as the callback path: every output and workspace of the stage's table."""
    described = tuple(sorted((n, tuple(int(s) for s in x.shape), jnp.dtype(x.dtype).name)
                             for n, x in inputs.items()))
    plan, steps, calls = native_program(stage, p, described, _capability(), backend)
    current = dict(inputs)
    specs = plan.all_buffers
    for launch, step, call in zip(plan.launches, steps, calls):
        result_types = tuple(_result_type(specs[n], p) for n in step.results)
        if launch.kind == "cute":
            from . import sm90_call
            results = sm90_call.call(launch, step, current, result_types)
        else:
            operands = [current[n] for n in step.operands]
            results = jax.ffi.ffi_call(FFI_TARGET, result_types, input_output_aliases=dict(step.aliases),
                                       vmap_method="sequential")(*operands, opaque=call)
        current.update(zip(step.results, results))
    return {n: current[n] for n in plan.buffers}
