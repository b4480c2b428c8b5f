"""CPU-side estimate of the sm90 backend's host time per launch (no GPU): the backend's eager
launches (`sm90_backend.launch_forward64` / `launch_backward64`, what `launcher.cute` runs) on CPU
torch tensors of a problem's shapes, timed per call.

    PYTHONPATH=. python benchmarks/sm90_host_cpu.py [--shape 1,2,4096,128,64,16] [--calls 500] [--rounds 9]

Everything the host does per launch is timed except what needs the device: each kernel is replaced
by a host-only CuTe DSL function of the same signature, compiled from the same arguments with the
same options by the same `cute.compile` call (so the argument passing is the real one: CuTe tensors
built from DLPack in Python with the default calling convention, the torch tensors taken in C by
TVM-FFI with `--enable-tvm-ffi`). Left out: the real host function's own work (TMA descriptors,
the launch) and the driver's, the same either way, and the backward's zeroing of its dQ
accumulator (a fill launched on the GPU). The launches run on CPU tensors, so the numbers
are estimates for this machine's CPU; `benchmarks/host_cost.py` measures the real thing on the GPU.
Any commit's backend can be measured with this file: PYTHONPATH=<that tree> python <this file>.
"""

import argparse
import sys
import time
import types


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,2,4096,128,64,16", help="B,H,S,D,block,topk (host_cost.py's default)")
    ap.add_argument("--calls", type=int, default=500, help="calls per round")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv)
    B, H, S, D, E, K = (int(x) for x in a.shape.split(","))
    assert E == 64, "the sm90 kernels take 64-token blocks"

    import cutlass
    import cutlass.cute as cute
    import torch
    torch.cuda.current_stream = lambda *args, **kw: types.SimpleNamespace(cuda_stream=0)  # CPU torch

    @cute.jit
    def host_only_14(a0: cute.Tensor, a1: cute.Tensor, a2: cute.Tensor, a3: cute.Tensor, a4: cute.Tensor,
                     a5: cute.Tensor, a6: cute.Tensor, a7: cute.Tensor, a8: cute.Tensor, a9: cute.Tensor,
                     a10: cute.Tensor, a11: cute.Tensor, a12: cute.Tensor, a13: cute.Tensor, scale: cutlass.Float32,
                     stream):
        pass

    @cute.jit
    def host_only_16(a0: cute.Tensor, a1: cute.Tensor, a2: cute.Tensor, a3: cute.Tensor, a4: cute.Tensor,
                     a5: cute.Tensor, a6: cute.Tensor, a7: cute.Tensor, a8: cute.Tensor, a9: cute.Tensor,
                     a10: cute.Tensor, a11: cute.Tensor, a12: cute.Tensor, a13: cute.Tensor, a14: cute.Tensor,
                     a15: cute.Tensor, scale: cutlass.Float32, chunk: cutlass.Int32, stream):
        pass

    @cute.jit
    def host_only_4(a0: cute.Tensor, a1: cute.Tensor, a2: cute.Tensor, a3: cute.Tensor, scale: cutlass.Float32,
                    stream):
        pass

    real_compile = cute.compile

    def compile_host_only(kernel, *args, **options):
        """The kernel's stand-in, compiled from the kernel's own arguments and options."""
        n = sum(1 for x in args if hasattr(x, "mark_layout_dynamic"))
        return real_compile({14: host_only_14, 16: host_only_16, 4: host_only_4}[n], *args, **options)
    cute.compile = compile_host_only

    from vsa_core.backends import sm90_backend, sm90_common
    sm90_common._SM_COUNTS.setdefault(0, 132)  # an H100 / H200's SMs (no CUDA driver here)
    from vsa_core.problem import AttnProblem
    problem = AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=E, dtype="bfloat16", topk=K,
                          has_gate=True, padding="ignore")
    nb = S // E
    tok = lambda: torch.zeros(B, H, S, D, dtype=torch.bfloat16)  # noqa: E731
    f32 = lambda *s: torch.zeros(*s, dtype=torch.float32)  # noqa: E731
    i32 = lambda *s: torch.zeros(*s, dtype=torch.int32)  # noqa: E731
    # VSA, training (gate, out_fine as out's rounding residual, pooling gradients), padding="ignore", BHSD: the buffers the backend hands
    fwd = dict(q=tok(), k=tok(), v=tok(), out=tok(), lse=f32(B, H, S), sel_idx=i32(B, H, nb, K), sel_num=i32(B, H, nb),
               kv_counts=i32(nb), out_coarse=f32(B, H, nb, D), q_counts=i32(nb), gate=tok(), out_fine=tok())
    bwd = dict(q=tok(), k=tok(), v=tok(), dout=tok(), lse=f32(B, H, S), delta=f32(B, H, S),
               dq=tok(), dk=tok(), dv=tok(),
               inv_idx=i32(B, H, nb, nb), inv_num=i32(B, H, nb), kv_counts=i32(nb), dq_accum=f32(B, H, nb, E * D),
               dq_pool=f32(B, H, nb, D), dk_pool=f32(B, H, nb, D), dv_pool=f32(B, H, nb, D), q_counts=i32(nb))
    for name, (shape, dtype) in sm90_backend.workspaces("backward", problem).items():
        if name not in bwd and not name.endswith("_valid"):  # the query groups' workspaces
            bwd[name] = torch.zeros(*shape, dtype=getattr(torch, "float32" if dtype == "float32" else dtype))
    # the dQ accumulator's zeroing is an asynchronous fill on the GPU, a 4 MiB memset here: left out
    bwd["dq_accum"].zero_ = lambda: bwd["dq_accum"]
    statics = dict(dtype="bfloat16", head_dim=D, layout="bhsd", softmax_scale=D ** -0.5)
    steps = {
        "sm90_fwd64": lambda: sm90_backend.launch_forward64(fwd, **statics, has_coarse=True, has_gate=True,
                                                            store_fine=True, ignore_padding=True,
                                                            fine_rounding=problem.fine_residual == "rounding",
                                                            config=sm90_backend.FORWARD),
        "sm90_bwd64": lambda: sm90_backend.launch_backward64(bwd, **statics, pool_grads=True, ignore_padding=True,
                                                             config=sm90_backend.BACKWARD),
    }
    from importlib.metadata import version
    tvm = "TVM-FFI" if hasattr(sm90_common, "compile_for_torch") else "default"
    print(f"sm90 backend host time per launch on this CPU (B{B} H{H} S{S} D{D} E{E} top-{K}, VSA training, "
          f"{a.rounds} rounds of {a.calls} calls; nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}, "
          f"calling convention: {tvm})")
    for name, step in steps.items():
        report(name, step, a.rounds, a.calls)
    return 0


def report(name: str, step, rounds: int, calls: int) -> None:
    """Prints step's time per call after one untimed call (it compiles): the fastest and the median of
    `rounds` rounds of `calls` calls, which together show how noisy the machine is."""
    step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    times.sort()
    print(f"{name:12s} {times[0]:8.1f} us fastest round, {times[len(times) // 2]:8.1f} us median")


if __name__ == "__main__":
    sys.exit(main())
