"""CPU-side estimate of the cudnn backend's host time per forward at 64-token blocks (no GPU): the
backend's fine-stage forward (`cudnn_backend.sparse_forward`, fine stage only: no coarse mix, padding
"zeros") on CPU torch tensors of a problem's shapes, timed per call.

    PYTHONPATH=.:<cuDNN frontend 1.32.0> python benchmarks/cudnn_host_cpu.py [--shape 1,2,4096,128,64,16]

As in sm90_host_cpu.py, the kernel is replaced by a host-only CuTe DSL function of the same signature,
compiled from the same arguments with the same options by the same `cute.compile` call, so the argument
passing is the real one: the CuTe tensors that cuDNN's wrapper builds through DLPack per call, or the
torch tensors TVM-FFI takes in C. Left out: the device's work and the driver's. cuDNN frontend's
wrapper refuses CPU tensors, so for it `is_cuda` reads True and the device queries answer sm_90 (it
launches nothing here). Any commit's backend can be measured with this file: PYTHONPATH=<that tree>.
"""

import argparse
import contextlib
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_host_cpu import report  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,2,4096,128,64,16", help="B,H,S,D,block,topk (host_cost.py's default)")
    ap.add_argument("--calls", type=int, default=500, help="calls per round")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    B, H, S, D, E, K = (int(x) for x in a.shape.split(","))
    assert E == 64, "the blk64 forward"

    import cutlass
    import cutlass.cute as cute
    import torch
    torch.cuda.current_stream = lambda *args, **kw: types.SimpleNamespace(cuda_stream=0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.nvtx.range = lambda *args, **kw: contextlib.nullcontext()
    torch.Tensor.is_cuda = property(lambda self: True)  # cuDNN's wrapper asserts it; nothing runs on a device
    from cudnn.block_sparse_attention import _interface
    _interface._get_device_arch = lambda: 90

    @cute.jit
    def host_only_9(a0: cute.Tensor, a1: cute.Tensor, a2: cute.Tensor, a3: cute.Tensor, a4: cute.Tensor,
                    a5: cute.Tensor, a6: cute.Tensor, a7: cute.Tensor, a8: cute.Tensor, scale: cutlass.Float32,
                    stream):
        pass

    real_compile = cute.compile
    cute.compile = lambda kernel, *args, **options: real_compile(host_only_9, *args, **options)

    from vsa_core.backends import cudnn_backend
    from vsa_core.backends.base import FineForward
    from vsa_core.launch import eager_launcher
    from vsa_core.problem import AttnProblem

    def aligned(shape, dtype):  # cuDNN's TMA loads take 128-byte aligned starts (CPU allocations are 64)
        n = 1
        for x in shape:
            n *= x
        flat = torch.zeros(n + 128, dtype=dtype)
        skip = (-flat.data_ptr() % 128) // flat.element_size()
        return flat[skip:skip + n].view(shape)

    nb = S // E
    p = AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=E, dtype="bfloat16", topk=K)
    tok = lambda: aligned((B, H, S, D), torch.bfloat16)  # noqa: E731
    args = FineForward(q=tok(), k=tok(), v=tok(), out=tok(), lse=torch.zeros(B, H, S),
                       sel_idx=torch.zeros(B, H, nb, K, dtype=torch.int32),
                       sel_num=torch.zeros(B, H, nb, dtype=torch.int32),
                       kv_counts=torch.full((nb,), E, dtype=torch.int32))

    def step():
        cudnn_backend.sparse_forward(eager_launcher, p, args)

    from importlib.metadata import version
    print(f"cudnn backend fine-stage forward, host time per call on this CPU (B{B} H{H} S{S} D{D} E{E} top-{K}, "
          f"{a.rounds} rounds of {a.calls} calls; nvidia-cudnn-frontend {version('nvidia-cudnn-frontend')}, "
          f"{'our TVM-FFI build' if hasattr(cudnn_backend, '_blk64_forward') else 'cuDNN wrapper'})")
    report("forward", step, a.rounds, a.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
