"""CPU-side estimate of the cudnn backend's host time per call at 64-token blocks (no GPU), on CPU
torch tensors of a problem's shapes, timed per call:
- `--stage forward`: the backend's fine-stage forward (`cudnn_backend.sparse_forward`, fine stage only:
  no coarse mix, padding "zeros");
- `--stage backward`: the backward launch (the step "cudnn_bwd", `cudnn_backend.launch_cudnn_backward`,
  what a replayed torch eager call runs for it).

    PYTHONPATH=.:<cuDNN frontend 1.32.0> python benchmarks/cudnn_host_cpu.py [--stage backward] [--shape 1,2,4096,128,64,16]

As in sm90_host_cpu.py, each kernel is replaced by a host-only CuTe DSL function of the same signature,
compiled from the same arguments with the same options by the same `cute.compile` call, so the argument
passing is the real one: the CuTe tensors that cuDNN's wrapper builds through DLPack per call, or the
torch tensors TVM-FFI takes in C. Left out: the device's work and the driver's, and the backward's fills
(`zero_`: on the GPU an asynchronous memset launch, on these CPU tensors a real memset of megabytes, so it
does nothing here). cuDNN frontend's wrapper refuses CPU tensors, so for it `is_cuda` reads True and the
device queries answer sm_90 (it launches nothing here). Any commit's backend can be measured with this
file: PYTHONPATH=<that tree> (the backward: cuDNN's wrapper before ca7553a, its kernel classes since).
"""

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_host_cpu import report  # noqa: E402


def host_only(args):
    """A CuTe DSL function that does nothing, with a parameter per argument of `args` (what a kernel
    is compiled from): tensors typed as tensors, the fp32 scale as Float32, the rest untyped. Written
    to a file and imported: the DSL reads a function's source."""
    import cutlass
    params = []
    for i, x in enumerate(args):
        if hasattr(x, "mark_layout_dynamic") or type(x).__name__.endswith("Tensor"):
            params.append(f"a{i}: cute.Tensor")
        elif isinstance(x, (float, cutlass.Float32)):
            params.append(f"a{i}: cutlass.Float32")
        else:
            params.append(f"a{i}")
    path = os.path.join(tempfile.mkdtemp(prefix="host_only_"), "host_only.py")
    with open(path, "w") as f:
        f.write(f"import cutlass\nimport cutlass.cute as cute\n\n\n@cute.jit\ndef fn({', '.join(params)}):\n    pass\n")
    spec = importlib.util.spec_from_file_location("host_only", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=("forward", "backward"), default="forward")
    ap.add_argument("--shape", default="1,2,4096,128,64,16", help="B,H,S,D,block,topk (host_cost.py's default)")
    ap.add_argument("--calls", type=int, default=500, help="calls per round")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    B, H, S, D, E, K = (int(x) for x in a.shape.split(","))
    assert E == 64, "the blk64 kernels"

    import cutlass.cute as cute
    import torch
    torch.cuda.current_stream = lambda *args, **kw: types.SimpleNamespace(cuda_stream=0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = lambda *args, **kw: contextlib.nullcontext()
    torch.cuda.nvtx.range = lambda *args, **kw: contextlib.nullcontext()
    torch.Tensor.is_cuda = property(lambda self: True)  # cuDNN's wrapper asserts it; nothing runs on a device
    from cudnn.block_sparse_attention import _interface, api
    from cudnn.block_sparse_attention.csrc.bwd import bucketed_k2q_csr
    _interface._get_device_arch = lambda: 90
    api._device_arch = lambda t: 90
    bucketed_k2q_csr._device_capability = lambda index: (9, 0)

    real_compile = cute.compile
    cute.compile = lambda kernel, *args, **options: real_compile(host_only(args), *args, **options)

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
    lists = dict(sel_idx=torch.zeros(B, H, nb, p.select_capacity, dtype=torch.int32),
                 sel_num=torch.zeros(B, H, nb, dtype=torch.int32), kv_counts=torch.full((nb,), E, dtype=torch.int32))
    if a.stage == "forward":
        args = FineForward(q=tok(), k=tok(), v=tok(), out=tok(), lse=torch.zeros(B, H, S), **lists)
        kind = "our TVM-FFI build" if hasattr(cudnn_backend, "_blk64_forward") else "cuDNN wrapper"

        def step():
            cudnn_backend.sparse_forward(eager_launcher, p, args)
    else:
        buffers = dict(q=tok(), k=tok(), v=tok(), o=tok(), dout=tok(), dq=tok(), dk=tok(), dv=tok(),
                       lse=torch.zeros(B, H, S), **lists)
        workspaces = getattr(cudnn_backend, "blk64_backward_workspaces", None)
        if workspaces is not None:  # a tree whose backward works in the plan's workspaces
            buffers.update({n: aligned(shape, getattr(torch, dt)) for n, (shape, dt) in workspaces(p).items()})
        kind = "our TVM-FFI build of its kernel classes" if workspaces else "cuDNN wrapper"
        torch.Tensor.zero_ = lambda self: self  # the fills: asynchronous memsets on the GPU (see above)

        def step():
            cudnn_backend.launch_cudnn_backward(buffers, problem=p)

    from importlib.metadata import version
    print(f"cudnn backend {a.stage}, host time per call on this CPU (B{B} H{H} S{S} D{D} E{E} top-{K}, "
          f"{a.rounds} rounds of {a.calls} calls; nvidia-cudnn-frontend {version('nvidia-cudnn-frontend')}, {kind})")
    report(a.stage, step, a.rounds, a.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
