"""The sm90 backend's CuTe DSL launches replayed as XLA custom calls (issue 23), with no torch
and no Python per call.

A recorded plan (`vsa_core.plan`) names each of the backend's own launches as a
`CuteLaunch`: the step ("sm90_fwd64": the forward kernel; "sm90_bwd64": the backward's main
kernel and its dQ postprocess), its buffers by argument name and its statics. `call` turns one
into one `cutlass.jax.cutlass_call` (nvidia-cutlass-dsl's public JAX bridge; design note:
benchmarks/results/2026-12-02-jax-cute-design.md) of an adapter that builds the kernels'
[B, H, S, D] views from the FFI buffers (`TensorSpec.mode`: BSHD is a permutation of the compact
array, no copy) and calls our kernel classes (`sm90_fwd64.BlockSparseFwd64Sm90`,
`sm90_bwd64.BlockSparseBwd64Sm90` + `DqPostprocess`) on XLA's stream, as the eager launch
(`sm90_backend.launch_forward64` / `launch_backward64`) does on torch's:

- same kernel classes, same constructor arguments (the statics), the scale as an fp32 value
  (so scale * log2(e) is the same fp32 product), same placeholders for absent features;
- the buffers the step writes in place are aliased (`input_output_aliases`), the ones born there
  are results; the dQ accumulator (and the query groups' flags where read), which the eager launch
  zeroes, is handed in as XLA zeros (donated); padding="zeros"'s full query counts are an XLA constant;
- compiled at lowering, once per (step, statics, shapes): `compile_key` skips re-tracing the
  adapter on a second lowering; `allow_cuda_graph=True` (XLA may capture it in a command buffer).
"""

from __future__ import annotations

import functools
from typing import Dict, Tuple

import jax
import jax.numpy as jnp

from .cutlass_common import arrange, versions

BLOCK = 64
GPU_ARCH = "sm_90a"
STEPS = ("sm90_fwd64", "sm90_bwd64")
TOKEN_ARGS = frozenset({"q", "k", "v", "out", "gate", "out_fine", "dout", "dq", "dk", "dv"})
# the pointer alignment each argument gets, as the eager launchers assume it (`sm90_common.cute_tensor`
# of the TMA / vector operands at 16 bytes, the rest at 4)
_ALIGN16 = {"sm90_fwd64": TOKEN_ARGS, "sm90_bwd64": TOKEN_ARGS | {"lse", "delta", "dq_accum", "dkv_partial"}}


def zeroed(launch, statics: dict, current: Dict[str, jax.Array]) -> frozenset:
    """The buffers `launch` needs zeroed on entry (its eager launch zeroes them itself): the backward's
    dQ accumulator, and its query groups' flags where the kernel reads them (`flags_in_use`)."""
    if launch.step != "sm90_bwd64":
        return frozenset()
    from vsa_core.backends.sm90_bwd64_groups import flags_in_use
    config = statics["config"]
    n_q = current[launch.buffer("lse")].shape[2] // BLOCK  # lse [B, H, Sq]
    flags = flags_in_use(n_q, statics["head_dim"], config.get("q_group_bytes", 0), config.get("persistent", False))
    return frozenset({"dq_accum", "group_flags"} if flags else {"dq_accum"})


def _spec(step: str, arg: str, layout: str):
    from cutlass.jax import TensorSpec
    mode = (0, 2, 1, 3) if arg in TOKEN_ARGS and layout == "bshd" else None  # [B, S, H, D] as [B, H, S, D]
    return TensorSpec(mode=mode, ptr_assumed_align=16 if arg in _ALIGN16[step] else 4)


class _Adapter:
    """cutlass_call's calling convention (stream, *inputs, *outputs not aliased), the buffers named
    by `names`, -> our kernels' arguments. Runs inside cutlass.jax's traced wrapper."""

    def __init__(self, step: str, statics: dict, names: Tuple[str, ...]):
        self.step, self.statics, self.names = step, statics, names

    def __call__(self, stream, *tensors):
        import cutlass

        from vsa_core.backends import sm90_bwd64, sm90_bwd64_launch, sm90_fwd64

        s = self.statics
        t = dict(zip(self.names, tensors))
        dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[s["dtype"]]
        # an fp32 IR value, like the eager launchers' run-time argument: the kernels' host code then
        # forms scale * log2(e) as an fp32 product (on a Python constant the DSL multiplies in double)
        scale = cutlass.Float32(cutlass.Float32(s["softmax_scale"]).ir_value())
        if self.step == "sm90_fwd64":
            kernel = sm90_fwd64.BlockSparseFwd64Sm90(dtype, s["head_dim"], has_coarse=s["has_coarse"],
                                                     has_gate=s["has_gate"], store_fine=s["store_fine"],
                                                     fine_rounding=s["fine_rounding"], **s["config"])
            lse, sel_idx, sel_num = t["lse"], t["sel_idx"], t["sel_num"]
            # what the eager launcher passes for an absent feature (never read)
            kernel(t["q"], t["k"], t["v"], t["out"], lse, sel_idx, sel_num, t["kv_counts"],
                   t.get("q_counts", sel_num), t.get("gate", t["q"]), t.get("out_coarse", lse),
                   t.get("out_fine", lse), sel_idx, sel_num, scale, stream)
        else:
            flags = dict(pool_grads=s["pool_grads"], ignore_padding=s["ignore_padding"])
            main = sm90_bwd64_launch.backward_kernel(dtype, s["head_dim"], **s["config"], **flags)
            post = sm90_bwd64.DqPostprocess(dtype, s["head_dim"], **flags)
            lse = t["lse"]
            # the query groups' grid chunk: lowering knows no device, so an H100 / H200's SM count
            # (`grid_chunk(None)`; it orders the grid only, the results are the same) or, sweeping
            # heads, a head's KV blocks
            chunk = sm90_bwd64_launch.launch_chunk(s["config"], t["inv_num"].shape[2], None)
            main(t["q"], t["k"], t["v"], t["dout"], lse, t["delta"], t["dq_accum"], t["dk"], t["dv"], t["inv_idx"],
                 t["inv_num"], t["kv_counts"], t.get("dk_pool", lse), t.get("dv_pool", lse), t["dkv_partial"],
                 t["group_flags"], scale, cutlass.Int32(chunk), stream)
            post(t["dq_accum"], t["dq"], t.get("dq_pool", lse), t.get("q_counts", lse), scale, stream)


def check(launch) -> None:
    """NotImplementedError for a CuTe DSL launch this module cannot replay."""
    if launch.step not in STEPS:
        raise NotImplementedError(f"no native replay of CuTe DSL launch {launch.step!r}")
    if launch.step == "sm90_fwd64" and launch.statics_dict()["config"].get("shared_kv"):
        # its union lists are a Triton step inside the eager launcher, on buffers of its own
        raise NotImplementedError("sm90_fwd64 with shared_kv has no native replay")


@functools.lru_cache(maxsize=None)
def _callable(step: str, statics: tuple, in_args: tuple, out_args: tuple, result_args: tuple, result_types: tuple,
              aliases: tuple):
    import cutlass.jax

    from vsa_core.plan import CuteLaunch

    statics_dict = CuteLaunch(step, (), statics).statics_dict()
    layout = statics_dict["layout"]
    return cutlass.jax.cutlass_call(
        _Adapter(step, statics_dict, in_args + out_args),
        output_shape_dtype=tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for shape, dt in result_types),
        input_spec=tuple(_spec(step, a, layout) for a in in_args),
        output_spec=tuple(_spec(step, a, layout) for a in result_args),
        input_output_aliases=dict(aliases),
        compile_options=f"--gpu-arch={GPU_ARCH}",
        # the adapter is fixed by these (cutlass_call adds the shapes, specs and environment): a
        # lowering that hits its cache skips re-tracing the adapter to MLIR
        compile_key=("vsa.sm90", step, statics, in_args, out_args, aliases, versions()),
        allow_cuda_graph=True,
    )


def call(launch, step, current: Dict[str, jax.Array], result_types: tuple) -> tuple:
    """The results of plan step `step` (a `vsa_core.plan.Step`) of CuTe DSL launch `launch`, on the
    arrays `current` (buffer name -> array); result_types: a ShapeDtypeStruct per step result."""
    check(launch)
    statics = launch.statics_dict()
    args = arrange(launch, step, current, result_types, zeroed(launch, statics, current))
    if launch.step == "sm90_fwd64" and statics["has_coarse"] and not statics["ignore_padding"]:
        n_q = current[launch.buffer("sel_num")].shape[2]
        args.add_input("q_counts", jnp.full((n_q,), BLOCK, jnp.int32))  # padding="zeros": every query row valid
    fn = _callable(launch.step, launch.statics, tuple(args.in_args), tuple(args.out_args), args.result_args,
                   tuple((tuple(r.shape), jnp.dtype(r.dtype).name) for r in result_types), tuple(sorted(args.aliases)))
    return tuple(fn(*args.in_arrays))
