"""Probe (issue 23, the cute backend under JAX), on a CPU host, no GPU:

1. FA4's forward as the JAX frontend runs it natively (`vsa_jax/fa4_call.py`): FA4's interface,
   called as the torch launch calls it on fake tensors of the problem's shapes, configures its
   `FlashAttentionForwardSm90`, which is taken where the interface hands it to `cute.compile` and
   called by a cutlass_call adapter; the jitted function is lowered for CUDA (jax.export): the kernel
   compiles for sm_90a and the program is one custom call to the CuTe DSL runtime, both layouts.
2. FA4's backward: the kernel objects its interface compiles for our backward (preprocess, main,
   postprocess) and their argument kinds, taken the same way (`fa4_call.configured_backward` runs them
   in one cutlass_call; FA4's fp32 dQ accumulator, log2 lse and dPsum are outputs of that call).

    FLASH_ATTENTION_NUM_SMS=132 CUTE_DSL_ARCH=sm_90a JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/fa4_jax_lower_cpu.py

FLASH_ATTENTION_NUM_SMS and CUTE_DSL_ARCH are FA4's and the CuTe DSL's cross-compilation settings
(the SM count FA4's interface reads from the device otherwise; the arch to compile for);
FLASH_ATTENTION_ARCH (set to sm_90 here unless given) picks the backward's kernel family, which
its interface otherwise reads from the device.
"""

import functools
import os
import re
import sys


def backward_kernels(B, S, H, D, E):
    """The kernel objects FA4's interface compiles for our backward, with their argument kinds."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vsa_core.backends import cute_backend
    from vsa_jax.fa4_call import compiles_taken
    _, fa_bwd, BlockSparse, mask_mod = cute_backend._fa4()
    n_sub, nq = S // cute_backend.KV_TILE, S // E
    taken = []
    with cute_backend._FA4_LOCK, compiles_taken(taken), FakeTensorMode():
        q, k, v, out, dout, dq, dk, dv = (torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
                                          for _ in range(8))
        idx = torch.empty(B, H, n_sub, nq, dtype=torch.int32, device="cuda")
        full_num, mask_num = (torch.empty(B, H, n_sub, dtype=torch.int32, device="cuda") for _ in range(2))
        lists = BlockSparse(mask_block_cnt=mask_num, mask_block_idx=idx, full_block_cnt=full_num,
                            full_block_idx=idx, block_size=(E, cute_backend.KV_TILE))
        fa_bwd(q, k, v, out, dout, torch.empty(B, H, S, device="cuda"), softmax_scale=D ** -0.5, mask_mod=mask_mod,
               aux_tensors=[torch.empty(n_sub, dtype=torch.int32, device="cuda")], block_sparse_tensors=lists,
               dlse=None, dq=dq, dk=dk, dv=dv)
    return [(type(args[0]).__name__, [type(a).__name__ for a in args[1:]]) for args, _ in taken]


def main() -> int:
    os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
    import jax
    import jax.numpy as jnp

    from vsa_jax import fa4_call
    from vsa_jax.cutlass_common import compile_without_gpu, lower_for_cuda
    B, S, H, D, E, C = 1, 1024, 2, 128, 256, 4
    for layout in ("bshd", "bhsd"):
        tokens = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
        lists = (jax.ShapeDtypeStruct((B, H, S // E, C), jnp.int32), jax.ShapeDtypeStruct((B, H, S // E), jnp.int32))
        args = (jax.ShapeDtypeStruct(tokens, jnp.bfloat16),) * 3 + lists * 2 + (
            jax.ShapeDtypeStruct((S // 128,), jnp.int32),)
        with compile_without_gpu():
            text = lower_for_cuda(functools.partial(fa4_call.fa4_forward, block_elems=E, layout=layout), *args)
        calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
        line = next(ln for ln in text.splitlines() if "CuteDSLRT" in ln)
        print(f"forward, {layout}: custom calls {calls}, compiled for sm_90a: {'-arch sm_90a' in line}")
    for name, kinds in backward_kernels(B, S, H, D, E):
        print(f"backward: {name}({', '.join(kinds)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
