"""FastVideo's `fastvideo_kernel` names over vsa_torch (a test shim, not part of the package).

`benchmarks/fastvideo_tests.py` puts this directory first on PYTHONPATH and runs FastVideo's own
VSA tests (`fastvideo-kernel/tests/test_vsa*.py` of a checkout) against vsa: every name those tests
import resolves to vsa_torch with FastVideo's arguments and return values. Only the attention
entry points are here (FastVideo's metadata utilities, fused Triton helpers and other kernels are
not vsa's API). padding="zeros", vsa's default, is FastVideo's function, gradients included.

Backends follow FastVideo's switches, read at each call: FASTVIDEO_VSA_TRITON=1 (or the legacy
FASTVIDEO_KERNEL_VSA_FORCE_TRITON=1) runs backend="triton"; FASTVIDEO_VSA_CUTEDSL=1 runs "cute"
for 128- and 256-token blocks; otherwise "auto" (which vsa's own VSA_BACKEND replaces).
"""

import os

import vsa_torch

__version__ = "vsa-shim-" + vsa_torch.__version__


def backend_for(block_elems: int) -> str:
    """vsa's backend for FastVideo's environment switches (see the module docstring)."""
    if os.environ.get("FASTVIDEO_VSA_TRITON", "0") == "1" or os.environ.get("FASTVIDEO_KERNEL_VSA_FORCE_TRITON",
                                                                           "0") == "1":
        return "triton"
    if os.environ.get("FASTVIDEO_VSA_CUTEDSL", "0") == "1" and block_elems in (128, 256):
        return "cute"
    return "auto"


def _elements(block_size) -> int:
    if isinstance(block_size, int):
        return block_size
    t, h, w = block_size
    return t * h * w


def video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size=64,
                      compress_attn_weight=None):
    return vsa_torch.video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                                       compress_attn_weight, backend=backend_for(_elements(block_size)))


def video_sparse_attn_bshd(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size=64,
                           compress_attn_weight=None):
    return vsa_torch.video_sparse_attn_bshd(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size,
                                            compress_attn_weight, backend=backend_for(_elements(block_size)))


from .block_sparse_attn import block_sparse_attn, block_sparse_attn_from_indices  # noqa: E402
from .block_sparse_attn_varlen import block_sparse_attn_varlen  # noqa: E402

__all__ = ["video_sparse_attn", "video_sparse_attn_bshd", "block_sparse_attn", "block_sparse_attn_from_indices",
           "block_sparse_attn_varlen", "__version__"]
