"""What our sm_90 CuTe DSL kernels (sm90_fwd64, sm90_bwd64) share: the (row, col) view of a
wgmma accumulator fragment, and the host side's torch tensor -> CuTe tensor conversion."""

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


def cutlass_dtype(t):
    """The CuTe element type of a bf16 / fp16 torch tensor."""
    import torch
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[t.dtype]


def cute_tensor(t, align=16):
    """A torch tensor as a CuTe tensor with dynamic strides (its last dim contiguous), no copy."""
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)
