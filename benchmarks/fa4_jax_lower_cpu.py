"""Probe (issue 23, the cute backend under JAX): can FA4's sm_90 block-sparse kernels, configured as our
cute backend configures them, run as `cutlass.jax.cutlass_call`s? On a CPU host, no GPU:

1. FA4's forward: its interface (`flash_attn.cute.interface._flash_attn_fwd`, called as
   `cute_backend.launch_fa4_forward` calls it, on CPU torch tensors of the problem's shapes) builds
   and configures its `FlashAttentionForwardSm90` and hands it to `cute.compile`, where it is taken
   (the compile is not run). An adapter then calls that same object on cutlass_call's tensors (q, k,
   v, out as [B, S, H, D] views of either layout through `TensorSpec.mode`; the full / mask lists and
   counts as `BlockSparseTensors`; the KV sub-block counts as the mask's aux tensor), and the jitted
   function is lowered for CUDA (jax.export): the kernel compiles for sm_90a and the program is one
   custom call to the CuTe DSL runtime.
2. FA4's backward: the kernel objects its interface compiles (preprocess, main, postprocess) and
   their argument kinds, taken the same way: what a JAX version has to hand them (FA4 allocates the
   fp32 dQ accumulator, log2 lse and dPsum itself: they would be workspaces of the plan).

    FLASH_ATTENTION_NUM_SMS=132 CUTE_DSL_ARCH=sm_90a JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/fa4_jax_lower_cpu.py

FA4's interface refuses CPU tensors and asks the device for its capability, so while it configures
the kernels `is_cuda` reads True and the device answers sm_90; nothing runs on a device. On a GPU
host the configuration would come from the same call on CUDA tensors of the shapes (FA4's layouts
are run-time values: its tile choice reads the shapes) or from FA4's own tile selectors. Torch is
needed only there, at trace time: the cute extra brings it (FA4 imports it).
"""

import contextlib
import functools
import re
import sys
import types


@contextlib.contextmanager
def sm90_answers():
    """FA4's interface on CPU tensors, as on an sm_90 GPU: `is_cuda` True, capability (9, 0), stream 0."""
    import torch
    saved = (torch.cuda.current_stream, torch.cuda.current_device, torch.cuda.get_device_capability,
             torch.Tensor.is_cuda)
    torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(cuda_stream=0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        (torch.cuda.current_stream, torch.cuda.current_device, torch.cuda.get_device_capability,
         torch.Tensor.is_cuda) = saved


@contextlib.contextmanager
def compiles_taken(into: list):
    """FA4's `cute.compile` calls recorded in `into` as (kernel object, arguments); each returns a no-op,
    kept in empty stand-ins of FA4's compile caches (so a later call compiles for real)."""
    from flash_attn.cute import interface
    real = interface.cute.compile
    caches = {f: f.compile_cache for f in vars(interface).values() if hasattr(f, "compile_cache")}
    for f in caches:
        f.compile_cache = {}
    interface.cute.compile = lambda *args, **kw: into.append(args) or (lambda *a, **k: None)
    try:
        yield
    finally:
        interface.cute.compile = real
        for f, cache in caches.items():
            f.compile_cache = cache


def configured_forward(B, S, H, D, E, C):
    """FA4's FlashAttentionForwardSm90 as its interface configures it for our forward ([B, S, H, D]
    bf16, E-token query blocks over 128-token KV tiles, lists of width C, our KV-tail mask_mod)."""
    import torch

    from vsa_core.backends import cute_backend
    fa_fwd, _, BlockSparse, mask_mod = cute_backend._fa4()
    nq = S // E
    q, k, v, out = (torch.zeros(B, S, H, D, dtype=torch.bfloat16) for _ in range(4))
    idx, num = torch.zeros(2, B, H, nq, C, dtype=torch.int32), torch.zeros(2, B, H, nq, dtype=torch.int32)
    lists = BlockSparse(mask_block_cnt=num[1], mask_block_idx=idx[1], full_block_cnt=num[0], full_block_idx=idx[0],
                        block_size=(E, cute_backend.KV_TILE))
    taken = []
    with sm90_answers(), compiles_taken(taken):
        fa_fwd(q, k, v, softmax_scale=D ** -0.5, mask_mod=mask_mod, block_sparse_tensors=lists,
               aux_tensors=[torch.zeros(S // cute_backend.KV_TILE, dtype=torch.int32)], out=out,
               lse=torch.zeros(B, H, S), return_lse=True, _arch=90)
    (kernel, *_), = taken
    return kernel


class ForwardAdapter:
    """cutlass_call's (stream, inputs, outputs) -> FA4's forward object, called with the arguments its
    interface compiles it with (`_flash_attn_fwd`, sm_90 branch, no varlen / paging / sink / split)."""

    def __init__(self, kernel, scale: float):
        self.kernel, self.scale = kernel, scale

    def __call__(self, stream, q, k, v, full_idx, full_num, mask_idx, mask_num, sub_counts, out, lse):
        import cutlass
        from flash_attn.cute.block_sparsity import BlockSparseTensors
        from flash_attn.cute.utils import AuxData
        scale = cutlass.Float32(cutlass.Float32(self.scale).ir_value())
        lists = BlockSparseTensors(mask_num, mask_idx, full_num, full_idx)
        self.kernel(q, k, v, out, lse, scale, None, None, None, None, None, None, None, None, lists,
                    AuxData([sub_counts], None), None, None, stream)


def fa4_forward(q, k, v, idx, num, sub_counts, *, block: int, layout: str):
    """FA4's block-sparse forward as one cutlass_call: (out, lse)."""
    import cutlass.jax
    import jax
    import jax.numpy as jnp
    from cutlass.jax import TensorSpec
    B, S, H, D = q.shape if layout == "bshd" else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    kernel = configured_forward(B, S, H, D, block, idx.shape[-1])
    tokens = TensorSpec(mode=(0, 2, 1, 3) if layout == "bhsd" else None, ptr_assumed_align=16)
    int32 = TensorSpec(ptr_assumed_align=4)
    call = cutlass.jax.cutlass_call(
        ForwardAdapter(kernel, D ** -0.5),
        output_shape_dtype=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, S), jnp.float32)),
        input_spec=(tokens,) * 3 + (int32,) * 4 + (TensorSpec(),), output_spec=(tokens, int32),
        compile_options="--gpu-arch=sm_90a", allow_cuda_graph=True)
    return call(q, k, v, idx[0], num[0], idx[1], num[1], sub_counts)


def backward_kernels(B, S, H, D, E):
    """The kernel objects FA4's interface compiles for our backward, with their argument kinds."""
    import torch

    from vsa_core.backends import cute_backend
    _, fa_bwd, BlockSparse, mask_mod = cute_backend._fa4()
    n_sub, nq = S // cute_backend.KV_TILE, S // E
    q, k, v, out, dout, dq, dk, dv = (torch.zeros(B, S, H, D, dtype=torch.bfloat16) for _ in range(8))
    idx, num = torch.zeros(B, H, n_sub, nq, dtype=torch.int32), torch.zeros(2, B, H, n_sub, dtype=torch.int32)
    lists = BlockSparse(mask_block_cnt=num[1], mask_block_idx=idx, full_block_cnt=num[0], full_block_idx=idx,
                        block_size=(E, cute_backend.KV_TILE))
    taken = []
    with sm90_answers(), compiles_taken(taken):
        fa_bwd(q, k, v, out, dout, torch.zeros(B, H, S), softmax_scale=D ** -0.5, mask_mod=mask_mod,
               aux_tensors=[torch.zeros(n_sub, dtype=torch.int32)], block_sparse_tensors=lists, dlse=None,
               dq=dq, dk=dk, dv=dv)
    return [(type(args[0]).__name__, [type(a).__name__ for a in args[1:]]) for args in taken]


def main() -> int:
    import jax
    import jax.numpy as jnp

    from vsa_jax.cutlass_common import compile_without_gpu, lower_for_cuda
    B, S, H, D, E, C = 1, 1024, 2, 128, 256, 4
    for layout in ("bshd", "bhsd"):
        tokens = (B, S, H, D) if layout == "bshd" else (B, H, S, D)
        args = (jax.ShapeDtypeStruct(tokens, jnp.bfloat16),) * 3 + (
            jax.ShapeDtypeStruct((2, B, H, S // E, C), jnp.int32), jax.ShapeDtypeStruct((2, B, H, S // E), jnp.int32),
            jax.ShapeDtypeStruct((S // 128,), jnp.int32))
        with compile_without_gpu():
            text = lower_for_cuda(functools.partial(fa4_forward, block=E, layout=layout), *args)
        calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
        line = next(ln for ln in text.splitlines() if "CuteDSLRT" in ln)
        print(f"forward, {layout}: custom calls {calls}, compiled for sm_90a: {'-arch sm_90a' in line}")
    for name, kinds in backward_kernels(B, S, H, D, E):
        print(f"backward: {name}({', '.join(kinds)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
