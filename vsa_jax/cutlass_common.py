"""What the CuTe DSL custom calls share (`vsa_jax.sm90_call`, `vsa_jax.cudnn_call`): a plan step's
buffers as `cutlass.jax.cutlass_call` arguments, lowering for CUDA on any host, and compiling on a
host with no GPU (tests).

A step's buffers become the call's arguments as `vsa_core.plan.Step` lays them out: its operands
(buffers that exist before it) are the call's inputs; the buffers it writes that are born there
are the call's own outputs; the operands it may update in place are outputs aliased to their
inputs (`input_output_aliases`). Each CuTe DSL launch names its buffers by argument name
(`CuteLaunch.args`), and the adapters read them by those names.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, FrozenSet, List, Tuple

import jax
import jax.numpy as jnp

FFI_TARGET = "CuteDSLRT_NvJaxCutlassCall_v2"  # the CuTe DSL runtime's typed FFI handler (cutlass.jax)


@dataclasses.dataclass
class CallArgs:
    """One step as a cutlass_call: input argument names and their arrays, the names of the
    outputs born in the call (the adapter gets these after the inputs), every result's argument
    name in result order, and (input index, result index) aliases."""

    in_args: List[str]
    in_arrays: List[jax.Array]
    out_args: List[str]
    result_args: Tuple[str, ...]
    aliases: List[Tuple[int, int]]

    def add_input(self, arg: str, array: jax.Array) -> None:
        self.in_args.append(arg)
        self.in_arrays.append(array)


def arrange(launch, step, current: Dict[str, jax.Array], result_types: tuple,
            zeroed: FrozenSet[str] = frozenset()) -> CallArgs:
    """The cutlass_call arguments of plan step `step` of CuTe DSL launch `launch` on the arrays
    `current` (buffer name -> array). `zeroed`: argument names the launch needs zeroed on entry (its
    eager launch zeroes them): handed in as XLA zeros, donated to the result."""
    arg_of = {}
    for arg, buf in launch.args:
        if buf in arg_of:
            raise NotImplementedError(f"{launch.step} takes buffer {buf} twice ({arg_of[buf]}, {arg})")
        arg_of[buf] = arg
    if len(step.results) != step.n_param_results + len(step.aliases):
        raise NotImplementedError(f"{launch.step}: results that the launch does not take")
    args = CallArgs([arg_of[b] for b in step.operands], [current[b] for b in step.operands], [],
                    tuple(arg_of[b] for b in step.results), list(step.aliases))
    for index, buf in enumerate(step.results[:step.n_param_results]):
        if arg_of[buf] in zeroed:
            args.aliases.append((len(args.in_arrays), index))
            args.add_input(arg_of[buf], jnp.zeros(result_types[index].shape, result_types[index].dtype))
        else:
            args.out_args.append(arg_of[buf])
    return args


def versions() -> tuple:
    """The versions a compiled adapter depends on besides its own code (part of its compile key)."""
    from importlib.metadata import version
    return (("nvidia-cutlass-dsl", version("nvidia-cutlass-dsl")),)


def lower_for_cuda(fn, *args):
    """StableHLO text of jax.jit(fn) lowered for CUDA on any host (jax.export's cross-platform
    lowering): compiles the CuTe kernels, needs no GPU. For tests and inspection."""
    import cutlass.jax
    exported = jax.export.export(jax.jit(fn), platforms=("cuda",),
                                 disabled_checks=cutlass.jax.get_export_disabled_safety_checks())(*args)
    return exported.mlir_module()


SM90_MAX_SMEM_PER_SM = 233472  # bytes (228 KiB): cudaDevAttrMaxSharedMemoryPerMultiprocessor on H100/H200


@contextlib.contextmanager
def compile_without_gpu():
    """For compiling on a host with no NVIDIA driver only (tests, compile checks): a kernel whose
    launch asks for several CTAs per SM makes CuTe DSL ask the driver for the shared memory per
    SM, which is answered here with sm_90's value. Never used on a GPU."""
    import cutlass.base_dsl.runtime.cuda as helpers
    original = helpers.get_device_attribute
    attr = helpers.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR

    def get_device_attribute(attribute, device_id=0):
        return SM90_MAX_SMEM_PER_SM if attribute == attr else original(attribute, device_id)

    helpers.get_device_attribute = get_device_attribute
    try:
        yield
    finally:
        helpers.get_device_attribute = original
