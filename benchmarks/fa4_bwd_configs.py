"""FA4's sm_90 backward tile configurations for the cute backend (issue 21 step 4: 256-token blocks).

FA4's interface picks the sm_90 backward's configuration from the head dim alone
(`flash_attn.cute.interface._tile_size_bwd_sm90`): at head dim 128 FA3's 80-row tile, or 64 rows where
the sparse query block (128 or 256 tokens for the cute backend) is not a multiple of 80, which is every
VSA call. Nothing in its interface takes another one on sm_90. This probe replaces that function for
the duration of each candidate (a benchmark's experiment, not the package's path) and:

  --cpu   compiles each candidate's main kernel for sm_90a (no GPU) and prints ptxas's registers and
          spills, so that only clean candidates take GPU time;
  (GPU)   times the cute backend's fine backward (`block_sparse_attn_from_indices`, random lists of
          exactly top-k blocks) with each candidate against FA4's own choice and cuDNN's 128-token
          kernel, in rounds, and checks each candidate's gradients against FA4's own choice's.

    FLASH_ATTENTION_NUM_SMS=132 PYTHONPATH=. python3 benchmarks/fa4_bwd_configs.py --cpu
    PYTHONPATH=. python3 benchmarks/fa4_bwd_configs.py [--shapes 720p-256,480p-256] [--only fa4,mdq2]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import statistics
import sys
import time

# FA4's field names: name -> overrides of its own configuration (`fa4`)
CANDIDATES = {
    "fa4": {},
    "mdq2": dict(AtomLayoutMdQ=2),
    "ndkv1": dict(AtomLayoutNdKV=1),
    "dq-swap": dict(dQ_swapAB=True),
    "dkv-swap": dict(dKV_swapAB=True),
    "sdp-noswap": dict(SdP_swapAB=False),
    "dq-single-wg": dict(dQ_single_wg=True),
    "pds1": dict(num_stages_PdS=1),
    "q1do1": dict(num_stages_Q=1, num_stages_dO=1),
    "m128": dict(m_block_size=128, AtomLayoutMdQ=2),
    "m128-sdp2": dict(m_block_size=128, SdP_swapAB=False, AtomLayoutMSdP=2, AtomLayoutMdQ=2),
}
SHAPES = {  # name: (B, H, S, D, block, top-k), bench.py's
    "480p-256": (1, 12, 39936, 128, 256, 20),
    "720p-256": (1, 40, 92160, 128, 256, 45),
}


_MAIN_CACHES = {}  # candidate -> its own compile cache of FA4's backward (its key omits some fields)


@contextlib.contextmanager
def fa4_config(name: str):
    """FA4's interface configures its sm_90 backward as candidate `name` (overrides on its own
    choice) and keeps the compiled backward in that candidate's cache."""
    from flash_attn.cute import interface

    from vsa_core.backends import cute_backend
    real, cache = interface._tile_size_bwd_sm90, interface._flash_attn_bwd.compile_cache
    default = cute_backend.BACKWARD_CONFIG
    overrides = CANDIDATES[name]
    interface._tile_size_bwd_sm90 = lambda *a, **k: dataclasses.replace(real(*a, **k), **overrides)
    interface._flash_attn_bwd.compile_cache = _MAIN_CACHES.setdefault(name, {})
    cute_backend.BACKWARD_CONFIG = {}  # the candidate alone, not the backend's default on top of it
    try:
        yield
    finally:
        interface._tile_size_bwd_sm90 = real
        interface._flash_attn_bwd.compile_cache = cache
        cute_backend.BACKWARD_CONFIG = default


def compile_main_kernel(name: str, block: int) -> str:
    """ptxas's registers / spills of the main backward kernel FA4 configures as candidate `name`."""
    import cutlass.cute as cute
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vsa_core.backends import cute_backend
    from vsa_jax.fa4_call import Fa4Backward, compiles_taken
    cfg = Fa4Backward(1, 2, 4 * block, 4 * block, 128, "bfloat16", "bshd", block, 128 ** -0.5, True)
    taken = []
    with cute_backend._FA4_LOCK, fa4_config(name), compiles_taken(taken), FakeTensorMode():
        b = {n: torch.empty(shape, dtype=getattr(torch, dt), device="cuda") for n, (shape, dt) in cfg.buffers().items()}
        cute_backend.fa4_backward_call(b, layout=cfg.layout, softmax_scale=cfg.softmax_scale, block_elems=block)
    (kernel, *args), _ = next(t for t in taken if type(t[0][0]).__name__ == "FlashAttentionBackwardSm90")
    # ptxas's report goes to the process's stderr (fd 2): capture it through a pipe
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    try:
        cute.compile(kernel, *args, options="--gpu-arch sm_90a remarks{ptx}")
    finally:
        os.dup2(saved, 2)
        os.close(w)
        err = os.read(r, 1 << 20).decode(errors="replace")
        os.close(r)
    regs = re.findall(r"Used (\d+) registers", err)
    spills = re.findall(r"(\d+) bytes spill stores", err)
    return f"{','.join(regs)} registers, {','.join(spills)} bytes spilled"


def cpu_report(names, blocks=(128, 256)) -> None:
    os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
    print("| candidate | overrides | " + " | ".join(f"{b}-token blocks" for b in blocks) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in blocks) + " |")
    for name in names:
        cells = []
        for block in blocks:
            t = time.time()
            try:
                cells.append(f"{compile_main_kernel(name, block)} ({time.time() - t:.0f} s)")
            except Exception as e:  # a candidate FA4 refuses (an assert) or the compiler rejects
                cells.append(f"{type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}")
        print(f"| {name} | {CANDIDATES[name] or 'FA4 own'} | " + " | ".join(cells) + " |", flush=True)


def gpu_report(names, shapes, rounds: int) -> None:
    import torch
    import triton.testing

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peers import cudnn_bsa
    from vsa_torch import block_sparse_attn_from_indices
    print(f"{torch.cuda.get_device_name()}, fine backward of the cute backend, ms (do_bench medians), {rounds} rounds")
    for shape in shapes:
        B, H, S, D, E, topk = SHAPES[shape]
        n = S // E
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_()
        scores = torch.rand(B, H, n, n, device="cuda", generator=g)
        idx = scores.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32).contiguous()
        counts = torch.full((B, H, n), topk, dtype=torch.int32, device="cuda")
        sizes = torch.full((n,), E, dtype=torch.int32, device="cuda")
        block_map = torch.zeros(B, H, n, n, dtype=torch.bool, device="cuda").scatter_(-1, idx.long(), True)

        def backward_of(forward):
            out = forward()
            return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        calls, grads = {}, {}
        for name in names:
            with fa4_config(name):
                try:
                    call = backward_of(lambda: block_sparse_attn_from_indices(
                        q, k, v, idx, counts, sizes, E, backend="cute")[0])
                    grads[name] = call()
                    torch.cuda.synchronize()
                except Exception as e:
                    print(f"  {shape} {name}: {type(e).__name__}: {str(e)[:120]}")
                    continue
            calls[name] = call
        label, cudnn_fwd, why = cudnn_bsa(block_map, E)
        if cudnn_fwd is not None:
            calls[label] = backward_of(lambda: cudnn_fwd(q, k, v))
        else:
            print(f"  {shape}: no cuDNN peer ({why})")
        ref = grads.get("fa4")
        for name, g_ in grads.items():
            if ref is not None and name != "fa4":
                err = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(g_, ref)]
                print(f"  {shape} {name} vs fa4: rel-L2 dq/dk/dv " + " ".join(f"{e:.1e}" for e in err))
        times = {name: [] for name in calls}
        # do_bench runs as many calls as fit in `rep` ms: at least 10 each, or one 100 ms call at 720p-256
        # is the whole measurement (and moved by 14% between rounds). One warm call of the first
        # candidate, in its own configuration (outside it FA4 would compile its own, and time that)
        first, call = next(iter(calls.items()))
        with fa4_config(first) if first in CANDIDATES else contextlib.nullcontext():
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
        rep = min(max(60.0, 10e3 * (time.perf_counter() - start)), 3000.0)
        for _ in range(rounds):
            for name, call in calls.items():
                with fa4_config(name) if name in CANDIDATES else contextlib.nullcontext():
                    times[name].append(triton.testing.do_bench(call, warmup=rep / 10, rep=rep, return_mode="median"))
        base = statistics.median(times["fa4"]) if "fa4" in times else None
        flops = 2.5 * 4 * B * H * D * S * topk * E
        for name, t in times.items():
            ms = statistics.median(t)
            rel = f" / fa4 (time) {ms / base:.3f}" if base else ""
            print(f"  {shape} {name}: {' '.join(f'{x:.3f}' for x in t)} -> {ms:.3f} ms, "
                  f"{flops / ms / 1e9:.0f} TFLOPS{rel}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="compile each candidate for sm_90a and print ptxas's figures")
    ap.add_argument("--only", default=",".join(CANDIDATES), help="comma-separated candidates (default: all)")
    ap.add_argument("--shapes", default="720p-256,480p-256")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        ap.error(f"unknown candidates {unknown}; known: {list(CANDIDATES)}")
    if args.cpu:
        cpu_report(names)
    else:
        gpu_report(names, args.shapes.split(","), args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
