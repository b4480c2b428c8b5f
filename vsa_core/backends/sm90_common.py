"""What our sm_90 CuTe DSL kernels (sm90_fwd64, sm90_bwd64) share: the (row, col) view of a
wgmma accumulator fragment, TMA loads with an L2 policy, and the host side: compiling for calls
with torch tensors (TVM-FFI) and the per-problem key of the launches' checks."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def rows_cols(t: cute.Tensor) -> cute.Tensor:
    """(row, col) view of an m64 wgmma accumulator fragment ((2, 2, V), M, N): the fragment's
    modes are (col pair, row half, col group); rows are (row half, M), cols ((pair, group), N)."""
    l = t.layout
    s, d = l.shape, l.stride
    mn = cute.make_layout(((s[0][1], s[1]), ((s[0][0], s[0][2]), s[2])),
                          stride=((d[0][1], d[1]), ((d[0][0], d[0][2]), d[2])))
    return cute.make_tensor(t.iterator, mn)


# L2 eviction policies of a TMA load (`tma_load`): the 64-bit descriptors `createpolicy.fractional`
# makes for the whole line at that priority (as CUTLASS's sm_90 cache hints spell them)
EVICT_FIRST = 0x12F0000000000000
EVICT_LAST = 0x14F0000000000000


def tma_load(atom, src, dst, mbar, policy=None):
    """A TMA load completing on `mbar`; with an L2 policy (EVICT_FIRST / EVICT_LAST) when given."""
    if policy is None:
        cute.copy(atom, src, dst, tma_bar_ptr=mbar)
    else:
        cute.copy(atom, src, dst, tma_bar_ptr=mbar, cache_policy=cutlass.Int64(policy))


def cutlass_dtype(t):
    """The CuTe element type of a bf16 / fp16 torch tensor."""
    import torch
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[t.dtype]


def cute_tensor(t, align=16, leading_dim=None):
    """A torch tensor as a CuTe tensor with dynamic strides (contiguous along `leading_dim`, default
    the last dim), no copy: the compile-time example of a TVM-FFI argument (`compile_for_torch`). Its
    type is the element type, the rank, the leading dim, the broadcast dims (`broadcast_dims`) and
    `align` (bytes; None: the element's); shapes and the other strides are run-time values."""
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t.detach(), assumed_align=align, enable_tvm_ffi=True).mark_layout_dynamic(
        leading_dim=t.dim() - 1 if leading_dim is None else leading_dim)


def compile_for_torch(kernel, examples, *scalars):
    """`kernel` compiled to be called with torch tensors in place of the CuTe tensors `examples`
    (`cute_tensor`s), then `scalars` (their compile-time examples: Float32, a fake stream).

    Through TVM-FFI (`--enable-tvm-ffi`) the compiled function reads each tensor's address, shape and
    strides in its C host code and checks there what the build assumed (dtype, rank, the contiguous
    leading dim, alignment, device type), so a launch converts nothing in Python. The default calling
    convention instead takes CuTe tensors, and building one per tensor per call (DLPack export and a
    descriptor) was most of a launch's host time. The device code is the same either way."""
    import cutlass.cute as cute
    return cute.compile(kernel, *examples, *scalars, options="--enable-tvm-ffi")


_SM_COUNTS = {}


def resident_ctas(device_ordinal: int = 0) -> int:
    """The CTAs of a one-CTA-per-SM kernel resident at once on a device: its SM count (CUDA driver,
    no framework; cached per device)."""
    count = _SM_COUNTS.get(device_ordinal)
    if count is None:
        import cuda.bindings.driver as cuda
        err, dev = cuda.cuDeviceGet(device_ordinal)
        if err == cuda.CUresult.CUDA_SUCCESS:
            err, count = cuda.cuDeviceGetAttribute(
                cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: the SM count of device {device_ordinal}: {err}")
        count = _SM_COUNTS[device_ordinal] = int(count)
    return count


def broadcast_dims(tensors) -> tuple:
    """Which dims of each tensor have stride 0. The one part of a `cute_tensor`'s type that depends on
    the strides: a zero stride (a broadcast dim) stays static in it, and the compiled function then
    takes only that stride there, so a compile key holds this besides dtype and configuration."""
    return tuple(tuple(st == 0 for st in t.stride()) for t in tensors)


def layout_key(*tensors):
    """What a launch's checks read of its tensors besides their contents and addresses: shape, strides,
    dtype and whether the start is 16-byte aligned (None for an absent tensor). Calls with equal keys
    pass or fail the same checks, so a problem's checks run once per key (they read no device)."""
    return tuple([None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0) for t in tensors])


PLAN_LIMIT = 1024  # problems a launcher keeps checked; a process that sees ever new shapes starts over


def remember(plans: dict, key, value):
    """plans[key] = value, emptying `plans` first when it holds PLAN_LIMIT problems; returns value."""
    if len(plans) >= PLAN_LIMIT:
        plans.clear()
    plans[key] = value
    return value
