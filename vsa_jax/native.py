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

The CuTe DSL launches of a plan (`CuteLaunch`es) become one `cutlass.jax.cutlass_call` each:
the sm90 backend's kernels (`vsa_jax.sm90_call`), whose workspaces (the valid-rows copies of
padding="ignore", the backward's dQ accumulator) are XLA buffers born in the plan like the
stage's own, so the sm90 backend runs natively with no torch; cuDNN's sm_90 forward and
backward for 64-token blocks (`vsa_jax.cudnn_call`), so the cudnn backend runs natively too; and
FA4's sm_90 forward and backward (`vsa_jax.fa4_call`: the objects FA4's interface configures, taken
at trace time with torch), so the cute backend runs natively too.

The default (`jax_launch` "auto", `vsa_core.config`, read at trace time: a function already
jitted keeps the path it was traced with): the stages that have a native path (`has_native`:
every stage of the Triton and sm90 backends, the cudnn backend's at 64-token blocks, the cute
backend's on sm_90) run natively on a CUDA device; the others (cuDNN's 128-token blocks and its
forward with a static prefix), calls on the CPU (the interpreter) and the cases `unavailable_reason` names take the callback (buffer_callback over vsa_core.ops), in
every mode. The two stages of one call may so take different paths. "On a CUDA
device" is the device the call runs on as far as tracing knows it (`launch_device`): a concrete
array's own (eager calls), else JAX's default device (`jax.default_device`), the device the
frontends resolve `backend="auto"` on too. Under jax.vmap the native launches are not mapped
(`_not_under_vmap`): "auto" runs the mapped stage through the callback.
`set_launch("native")` asks for this path wherever a stage has one, or an error; `set_launch("callback")`
for the callback.

The Triton attention kernels run the tile configs of the shared store (`vsa_core.autotune.TILES`),
as every eager call, torch's or the callback's, does: the first to reach a problem times the
candidates, the others run its choice, so the paths agree bit for bit. A plan recorded before any
call of its problem was timed (`LaunchPlan.untuned`) is tuned here, at trace time, on the GPU
(`triton_backend.tune`: the eager launcher timing the kernels on buffers of its own), and recorded
again: simpler than jaxlib's autotuned kernel call, whose choice (made by XLA at the first run)
torch could not read. With TMA on (`config.tma`) they take host TMA descriptors, as torch's launch
does, so both run one binary: the plan keeps each descriptor's buffer and geometry
(`vsa_core.plan.Descriptor`) and jaxlib's Triton call encodes the descriptor at each launch, on
the host, from the buffer it passes (`create_tma_descriptor_parameter`, jaxlib >= 0.11.2; passed
by value like a pointer, nothing allocated, so command buffers replay it as they do pointers).
Where that cannot be (an older jaxlib; a GPU below sm_90, where Triton lowers descriptors to
pointers with a launch ABI of its own), "auto" keeps the callback for the Triton backend with TMA
on (`unavailable_reason`) and "native" fails saying why, rather than run other kernels than torch.
"""

from __future__ import annotations

import functools
import zlib
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from vsa_core import plan as core_plan
from vsa_core.config import JAX_LAUNCH_MODES, config, configure
from vsa_core.problem import AttnProblem

from vsa_core.runtime import DeviceInfo

from .devices import device_info

LAUNCH_MODES = JAX_LAUNCH_MODES
FFI_TARGET = "triton_kernel_call_ffi"


def set_launch(mode: str) -> None:
    """Selects how later traced calls launch the kernels: "auto" (the default: native where the
    backend and device allow, else the callback), "native" or "callback"."""
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {mode!r}")
    configure(jax_launch=mode)


def launch_mode() -> str:
    return config().jax_launch


# The stages each backend can run natively; the others keep the callback in every mode. cudnn's and
# cute's stages run natively where their kernel calls can take the problem (`native_reason` of
# `cudnn_call` / `fa4_call`).
NATIVE_STAGES = {"triton": ("forward", "backward"), "sm90": ("forward", "backward"), "cudnn": ("forward", "backward"),
                 "cute": ("forward", "backward")}
# backend -> the module whose `native_reason(p, stage=)` says when a problem keeps the callback
_REASONS = {"cudnn": "cudnn_call", "cute": "fa4_call"}
# step of a CuTe DSL launch -> the module that replays it as a cutlass_call
_CUTE_CALLS = {"sm90_fwd64": "sm90_call", "sm90_bwd64": "sm90_call", "cudnn_fwd": "cudnn_call", "cudnn_bwd": "cudnn_call",
               "fa4_fwd": "fa4_call", "fa4_bwd": "fa4_call"}
# backends whose native kernels are compiled for sm_90a only
_SM90A_ONLY = {"cudnn": "cuDNN's blk64 kernels are compiled for sm_90a",
               "cute": "FA4's kernels run natively as its sm_90 ones, compiled for sm_90a"}


def has_native(backend: str, stage: str, p: Optional[AttnProblem] = None) -> bool:
    """Whether `stage` of `backend` has a native path (for problem `p`, when given)."""
    if stage not in NATIVE_STAGES.get(backend, ()):
        return False
    if backend in _REASONS and p is not None:
        return native_reason(backend, stage, p) is None
    return True


def native_reason(backend: str, stage: str, p: AttnProblem) -> Optional[str]:
    """Why `stage` of `backend` on problem `p` has no native path (whatever the device), or None."""
    if stage not in NATIVE_STAGES.get(backend, ()):
        return f"the {backend} backend's {stage} has no native path"
    if backend not in _REASONS:
        return None
    import importlib
    return importlib.import_module(f"{__package__}.{_REASONS[backend]}").native_reason(p, stage=stage)


def selected(impl, like=None, stage: str = "forward", p: Optional[AttnProblem] = None) -> bool:
    """True when `stage` of a call on the array `like` launches natively: the stage has a native
    path (`has_native`: Triton's and sm90's stages, cudnn's at 64-token blocks, cute's; the
    others keep the callback) and "native" is selected, or "auto" is (the default) and the call runs on a
    CUDA device (`launch_device`) where nothing stands in the way (`unavailable_reason`)."""
    mode = launch_mode()
    name = getattr(impl, "name", None)
    if mode == "callback" or not has_native(name, stage, p):
        return False
    if mode == "native":
        return True
    capability = _cuda_capability(launch_device(like))
    return capability is not None and unavailable_reason(name, capability) is None


_NO_HOST_DESCRIPTORS = (
    "with TMA on the Triton kernels take host TMA descriptors, which jaxlib {}'s Triton call cannot encode "
    "(jaxlib >= 0.11.2 can: gpu_triton.create_tma_descriptor_parameter); VSA_TMA=0 runs pointer loads")


def unavailable_reason(backend: str, capability: Optional[int] = None) -> Optional[str]:
    """Why `backend` cannot launch natively here (on a CUDA device of `capability`, when given), or None."""
    if backend in _SM90A_ONLY and capability is not None and capability != 90:
        return f"{_SM90A_ONLY[backend]} (the device is sm_{capability})"
    if backend != "triton" or not config().tma:
        return None
    if not jaxlib_takes_host_descriptors():
        return _NO_HOST_DESCRIPTORS.format(jaxlib_version())
    if capability is not None and capability < 90:
        return (f"with TMA on sm_{capability} Triton lowers the kernels' descriptors to pointers, a launch "
                "a plan does not replay (TMA needs sm_90 or newer); VSA_TMA=0 runs pointer loads")
    return None


@functools.lru_cache(maxsize=None)
def jaxlib_takes_host_descriptors() -> bool:
    """Whether jaxlib's Triton call encodes host TMA descriptors (jaxlib >= 0.11.2); False without
    jaxlib's CUDA Triton module."""
    from jax._src.lib import gpu_triton

    return getattr(gpu_triton, "create_tma_descriptor_parameter", None) is not None


def jaxlib_version() -> str:
    from jax._src.lib import version_str
    return version_str


# ---- trace time ----------------------------------------------------------------------------------
def launch_device(like=None) -> DeviceInfo:
    """The device a call on the array `like` runs on, as the launch is chosen: a concrete array's
    own device (an eager call); a tracer has none yet (under jit the device is only known when the
    program is lowered), so then, as without `like`, JAX's default device (`jax.default_device`,
    else the default backend's first), the device the frontends resolve the backend on too. A
    jitted call on CPU arrays on a host with a GPU is traced under `jax.default_device(cpu)`."""
    return device_info(like)


def _cuda_capability(device: DeviceInfo) -> Optional[int]:
    """The compute capability (major * 10 + minor) of `device`, None when it is no CUDA device."""
    if device.kind != "cuda" or device.capability is None:
        return None
    major, minor = device.capability
    return major * 10 + minor


def _capability(device: DeviceInfo) -> int:
    capability = _cuda_capability(device)
    if capability is None:
        raise RuntimeError(f"launch='native' needs a CUDA device (the call runs on {device.kind}); "
                           "use the callback launch on the CPU: vsa_jax.set_launch('callback')")
    return capability


def kernel_params(compiled: core_plan.CompiledLaunch) -> Tuple[Tuple, ...]:
    """The parameters of jaxlib's Triton call of `compiled`, as plain tuples, in the order of the
    kernel's launch ABI (Triton's nvidia launcher, 3.6 - 3.9):
    - ("array", ptr_divisibility) per pointer argument;
    - ("scalar", value, type) per run-time scalar;
    - per host TMA descriptor argument ("tma", elem_type, elem_size, swizzle, shape, strides,
      box, oob_fill): the CUtensorMap's fields as Triton's launcher encodes them (host element
      type, the box = the compiled kernel's block_size, which may be narrower than the
      descriptor's block shape, e.g. 64 columns of a 128-wide head under the 128-byte swizzle;
      a "nan" padding fills out-of-bounds reads with NaN), then the descriptor's shape, one
      ("scalar", dim, "i32") per dim, and its strides, one ("scalar", stride, "i64") per dim.
    jaxlib hands the call's buffers to the "array" and "tma" entries in order (a descriptor's
    base address is its buffer's) and appends the kernel's global scratch and profiling pointers."""
    from vsa_core.triton_shim import tma_host_dtype

    params = []
    for param in compiled.params:
        if param[0] == "buffer":
            params.append(("array", param[2]))
        elif param[0] == "scalar":
            _, value, kind = param
            params.append(("scalar", bool(value) if kind == "i1" else value, kind))
        elif param[0] == "descriptor":
            _, desc, tma = param
            if tma.get("fp4_padded") or tma.get("is_im2col"):
                raise NotImplementedError(f"{compiled.name}: descriptor of {desc.buffer} is fp4-padded or im2col")
            params.append(("tma", tma_host_dtype(tma["elem_type"]), tma["elem_size"], tma["swizzle"], desc.shape,
                           desc.strides, tuple(tma["block_size"]), 1 if desc.padding == "nan" else 0))
            params += [("scalar", n, "i32") for n in desc.shape]
            params += [("scalar", s, "i64") for s in desc.strides]
        else:
            raise ValueError(f"{compiled.name}: unknown parameter kind {param[0]!r}")
    return tuple(params)


def _kernel_call(compiled: core_plan.CompiledLaunch, capability: int) -> bytes:
    """The zlib-compressed TritonAnyKernelCall proto that triton_kernel_call_ffi reads."""
    from jax._src.lib import gpu_triton  # importing it registers the FFI target with XLA

    if getattr(gpu_triton, "TritonKernel", None) is None:
        raise RuntimeError("jaxlib has no CUDA Triton support (install jax[cuda]); use the callback launch")
    if compiled.global_scratch_size:  # jaxlib would allocate it per launch, which no command buffer can hold
        raise NotImplementedError(f"{compiled.name} needs {compiled.global_scratch_size} bytes of global scratch "
                                  "per CTA, which the native launch does not give")
    params = kernel_params(compiled)
    if any(p[0] == "tma" for p in params) and not hasattr(gpu_triton, "create_tma_descriptor_parameter"):
        raise RuntimeError(f"launch='native' of {compiled.launch.kernel_name}: "
                           + _NO_HOST_DESCRIPTORS.format(jaxlib_version()))
    kernel = gpu_triton.TritonKernel(compiled.name, compiled.num_warps, compiled.num_ctas,
                                     compiled.shared_mem_bytes, compiled.ptx, "", capability)
    call = gpu_triton.TritonKernelCall(kernel, *compiled.launch.grid, [_jaxlib_param(gpu_triton, p) for p in params])
    return zlib.compress(call.to_proto(compiled.launch.kernel_name, b""))


def _jaxlib_param(gpu_triton, param: Tuple):
    """jaxlib's parameter object of one `kernel_params` entry."""
    if param[0] == "array":
        return gpu_triton.create_array_parameter(0, param[1])
    if param[0] == "scalar":
        return gpu_triton.create_scalar_parameter(param[1], param[2])
    _, elem_type, elem_size, swizzle, shape, strides, box, oob_fill = param
    create = gpu_triton.create_tma_descriptor_parameter
    # jaxlib 0.11.2 derives the element size from the type; jax-triton passes it to a later one
    size = {"elem_size_bytes": elem_size} if "elem_size_bytes" in (create.__doc__ or "") else {}
    return create(elem_type=elem_type, swizzle=swizzle, shape=list(shape), strides=list(strides),
                  block_shape=list(box), oob_fill=oob_fill, **size)


def tuned_plan(stage: str, p: AttnProblem, inputs, backend, device: DeviceInfo) -> core_plan.LaunchPlan:
    """The launch plan of `stage`, its attention kernels on the tile configs the shared store chose.
    Keys no call has timed yet are timed first on `device`, the GPU the call runs on, as the first
    eager call of the problem would have (lowered on a host without one: the defaults, as an eager
    call that cannot time takes them)."""
    plan = core_plan.record_plan(stage, p, inputs, backend)
    if plan.untuned and device.kind == "cuda":
        tune = getattr(backend, "tune", None)
        if tune is None:
            raise RuntimeError(f"the {backend.name} plan has untimed tile configs and the backend no `tune`")
        tune(p, device.index)
        plan = core_plan.record_plan(stage, p, inputs, backend)
        if plan.untuned:
            raise RuntimeError(f"{backend.name}.tune left tile store keys without a choice: {plan.untuned}")
    return plan


@functools.lru_cache(maxsize=None)
def native_program(stage: str, p: AttnProblem, inputs: Tuple[Tuple[str, Tuple[int, ...], str], ...],
                   capability: int, backend: str = "triton", launch_config=None,
                   device: DeviceInfo = DeviceInfo("cpu")):
    """(plan, steps, kernel calls) of one stage of one problem on `backend`, compiled for
    `capability` and tuned on `device` (the call's), built once per launch configuration
    (`launch_config`: the current one, its key here); a CuTe DSL launch has no kernel call here
    (it compiles when its cutlass_call lowers)."""
    from vsa_core.backends import backend_named

    plan = tuned_plan(stage, p, {n: (s, d) for n, s, d in inputs}, backend_named(backend), device)
    steps = core_plan.schedule(plan)
    calls = []
    for launch in plan.launches:
        if launch.kind == "cute":
            _cute_call(launch).check(launch)
            calls.append(None)
        else:
            calls.append(_kernel_call(core_plan.compile_launch(launch, plan, capability), capability))
    return plan, steps, tuple(calls)


def _cute_call(launch):
    """The module that replays CuTe DSL launch `launch` as a cutlass_call (`sm90_call`, `cudnn_call`,
    `fa4_call`)."""
    import importlib
    module = _CUTE_CALLS.get(launch.step)
    if module is None:
        raise NotImplementedError(f"no native replay of CuTe DSL launch {launch.step!r}")
    return importlib.import_module(f"{__package__}.{module}")


def _result_type(spec, p: AttnProblem):
    shape, dtype = spec
    return jax.ShapeDtypeStruct(shape, jnp.dtype(p.dtype if dtype == "input" else dtype))


def run(stage: str, p: AttnProblem, inputs: Dict[str, jax.Array], backend: str = "triton",
        fallback: Optional[Callable[[Dict[str, jax.Array]], Dict[str, jax.Array]]] = None) -> Dict[str, jax.Array]:
    """Same contract as the callback path: every output and workspace of the stage's table.
    `fallback`: the callback path of the same stage (same inputs, same results), which "auto"
    runs the stage through under jax.vmap (see `_not_under_vmap`)."""
    device = launch_device(inputs.get("q", next(iter(inputs.values()))))
    described = tuple(sorted((n, tuple(int(s) for s in x.shape), jnp.dtype(x.dtype).name)
                             for n, x in inputs.items()))
    plan, steps, calls = native_program(stage, p, described, _capability(device), backend, config(), device)
    names = tuple(inputs)

    def launches(*xs) -> tuple:
        current = dict(zip(names, xs))
        specs = plan.all_buffers
        for launch, step, call in zip(plan.launches, steps, calls):
            result_types = tuple(_result_type(specs[n], p) for n in step.results)
            if launch.kind == "cute":
                results = _cute_call(launch).call(launch, step, current, result_types)
            else:
                operands = [current[n] for n in step.operands]
                results = jax.ffi.ffi_call(FFI_TARGET, result_types, input_output_aliases=dict(step.aliases))(
                    *operands, opaque=call)
            current.update(zip(step.results, results))
        return tuple(current[n] for n in plan.buffers)

    results = _not_under_vmap(launches, names, tuple(plan.buffers), launch_mode(), fallback)(
        *(inputs[n] for n in names))
    return dict(zip(plan.buffers, results))


# Under jax.vmap the native launches are not run: mapped one element at a time (a scan over the
# custom calls: vmap_method="sequential", or a lax.map around cutlass_call) they gave wrong results
# on the GPU (H200, jax 0.11.2: the Triton forward's out all zeros for element 0; the sm90 backward
# dk rows of zeros; the sm90 forward was right in the one case tested), for reasons not understood
# yet. Refused, or run through the callback, rather than answered wrongly.
_VMAP_REFUSED = ("vsa_jax: the native launch does not run under jax.vmap (mapped one element at a time, its "
                 "custom calls gave wrong results on the GPU); use vsa_jax.set_launch('callback'), or the default "
                 "'auto', which runs a vmapped call through the callback")


def _not_under_vmap(launches: Callable, names: Tuple[str, ...], results: Tuple[str, ...], mode: str,
                    fallback: Optional[Callable]) -> Callable:
    """`launches` (the stage's custom calls on the arrays named `names`) as is where nothing maps
    it; under jax.vmap, with launch "auto" and a `fallback`, the fallback (the callback path, whose
    buffer_callback maps one element at a time), else NotImplementedError naming the callback."""
    @jax.custom_batching.custom_vmap
    def stage(*xs):
        return launches(*xs)

    @stage.def_vmap
    def mapped(axis_size, in_batched, *xs):
        if mode != "auto" or fallback is None:
            raise NotImplementedError(_VMAP_REFUSED)

        def one(*xs):
            got = fallback(dict(zip(names, xs)))
            return tuple(got[n] for n in results)

        outs = jax.vmap(one, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*xs)
        return outs, tuple(True for _ in outs)

    return stage
