"""CuTe backend: FlashAttention-4's block-sparse kernels (flash-attn-4) for the fine stage."""

from __future__ import annotations

from ..problem import AttnProblem
from ..runtime import DeviceInfo

name = "cute"
INSTALL_HINT = ("pip install 'vsa[cute]' (flash-attn-4==4.0.0b36, nvidia-cutlass-dsl==4.8.1, "
                "quack-kernels==0.6.5)")


def unavailable_reason(problem: AttnProblem, device: DeviceInfo):
    if device.kind != "cuda":
        return f"it runs on NVIDIA GPUs only, the tensors are on {device.kind}"
    return "not implemented yet"
