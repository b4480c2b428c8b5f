"""The torch eager frontend's own host time per call, measurable without a GPU.

`host_cost.py` times whole calls on the GPU. This script profiles N calls of
`vsa_torch.video_sparse_attn` (forward, and forward+backward) with cProfile and takes out the
stages' own work: `vsa_core.ops.forward` / `backward` (on the CPU: the Triton interpreter
running the kernels) and `vsa_core.replay.Replay.run` (on the GPU: the replayed launches).
What is left is the frontend: the checks' memo, the statics, the autograd Function, the
allocations, the replay key; the layer issue 22 item 6 thins.

Reported per call: that remainder (ms, under the profiler, so larger than the real cost but
in proportion to it), the torch.empty calls, and the frontend functions by own time
(vsa_torch.*, vsa_core frontend / spec / api / ops / replay; C functions by the frontend
function that called them).

    PYTHONPATH=. python3 benchmarks/frontend_cost.py [--calls 50] [--shape 1,1,128,64,64,1] [--top 25]

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 is set here when
torch sees no CUDA device), so the default shape is tiny: the frontend's work does not depend
on the shape, the interpreter's does. With a GPU (--device cuda) the warm path is the replay.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported (by vsa_core)

import torch  # noqa: E402

from vsa_torch import video_sparse_attn  # noqa: E402

_FRONTEND = ("vsa_torch" + os.sep, os.path.join("vsa_core", "frontend.py"), os.path.join("vsa_core", "spec.py"),
             os.path.join("vsa_core", "api.py"), os.path.join("vsa_core", "replay.py"))
# the stages' own work: its cumulative time is not the frontend's
# (`Replay.run` / `Replay.launch`; "launch" also names `TritonStep.launch`, which only they call)
_STAGES = ((os.path.join("vsa_core", "ops.py"), "forward"), (os.path.join("vsa_core", "ops.py"), "backward"),
           (os.path.join("vsa_core", "replay.py"), "run"), (os.path.join("vsa_core", "replay.py"), "launch"))


def _is_frontend(func) -> bool:
    filename = func[0]
    return any(part in filename for part in _FRONTEND)


def _is_stage(func) -> bool:
    return any(func[0].endswith(path) and func[2] == name for path, name in _STAGES)


def profile(step, calls: int):
    for _ in range(3):  # first calls tune, capture: the steady state comes after
        step()
    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(calls)])
    return pstats.Stats(prof).stats


def count_calls(step, calls: int) -> float:
    """Function calls (Python and C) per call outside the stages' own work, each stage call
    counted once: the frontend's layers as a number that does not depend on the machine (the
    calling thread's only: autograd runs a CUDA backward on a thread of its own)."""
    from vsa_core import ops
    from vsa_core.replay import Replay
    stage_codes = {ops.forward.__code__, ops.backward.__code__, Replay.run.__code__, Replay.launch.__code__}
    depth, made = 0, 0

    def hook(frame, event, arg):
        nonlocal depth, made
        if event == "call":
            if not depth:
                made += 1
            if frame.f_code in stage_codes:
                depth += 1
        elif event == "return":
            if frame.f_code in stage_codes:
                depth -= 1
        elif event == "c_call" and not depth:
            made += 1

    for _ in range(3):
        step()
    sys.setprofile(hook)
    try:
        for _ in range(calls):
            step()
    finally:
        sys.setprofile(None)
    return made / calls


def _inside_stages(stats: dict) -> set:
    """The stages and every function that only they (or functions only they call) call."""
    inside = {f for f in stats if _is_stage(f)}
    grown = True
    while grown:
        grown = False
        for func, (_, _, _, _, callers) in stats.items():
            if func not in inside and callers and all(c in inside for c in callers):
                inside.add(func)
                grown = True
    return inside


def report(title: str, stats: dict, calls: int, top: int) -> None:
    total = max(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "<lambda>")
    # a stage's time as its callers outside the stages saw it (Replay.run calls Replay.launch)
    stages = sum(edge[3] for f, (_, _, _, _, callers) in stats.items() if _is_stage(f)
                 for caller, edge in callers.items() if not _is_stage(caller))
    inside = _inside_stages(stats)
    own = {}
    for func, (_, _, _, _, callers) in stats.items():
        if func in inside or not (_is_frontend(func) or func[0] == "~"):
            continue
        for caller, edge in callers.items():  # a C function: for the frontend functions that called it
            if caller not in inside and (func[0] != "~" or _is_frontend(caller)):
                nc0, tt0 = own.get(func, (0, 0.0))
                own[func] = (nc0 + edge[1], tt0 + edge[2])
    empties = sum(nc for (_, _, name), (_, nc, _, _, _) in stats.items()
                  if name == "<built-in method torch.empty>")
    print(f"\n{title}: {calls} calls")
    print(f"  per call: everything {total * 1e3 / calls:.3f} ms, the stages' own work {stages * 1e3 / calls:.3f} ms, "
          f"the rest (frontend) {(total - stages) * 1e3 / calls:.3f} ms")
    print(f"  frontend functions' own time {sum(tt for _, tt in own.values()) * 1e3 / calls:.3f} ms per call; "
          f"torch.empty calls per call: {empties / calls:g}")
    print(f"  {'own ms/call':>11} {'calls/call':>10}  function")
    for func, (nc, tt) in sorted(own.items(), key=lambda kv: -kv[1][1])[:top]:
        name = func[2] if func[0] == "~" else f"{_short(func[0])}:{func[1]}({func[2]})"
        print(f"  {tt * 1e3 / calls:11.4f} {nc / calls:10.2f}  {name}")


def _short(filename: str) -> str:
    for root in ("vsa_torch", "vsa_core"):
        i = filename.rfind(os.sep + root + os.sep)
        if i >= 0:
            return filename[i + 1:]
    return filename


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1,1,128,64,64,1", metavar="B,H,S,D,E,topk")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="triton")
    a = p.parse_args()
    B, H, S, D, E, topk = map(int, a.shape.split(","))
    gen = torch.Generator().manual_seed(0)

    def tensor(grad=True):
        t = torch.randn(B, H, S, D, generator=gen).to(a.device, torch.bfloat16)
        return t.requires_grad_(grad)

    q, k, v, gate = tensor(), tensor(), tensor(), tensor()
    dout = tensor(grad=False)
    counts = torch.full((S // E,), E, device=a.device, dtype=torch.int32)

    def call():
        return video_sparse_attn(q, k, v, counts, counts, topk, E, gate, backend=a.backend)

    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    print(f"{a.device}, backend {a.backend}, B{B} H{H} S{S} D{D} E{E} top-{topk}, python {sys.version.split()[0]}, "
          f"torch {torch.__version__}")
    for title, step in (("forward", lambda: call().detach()), ("forward+backward", lambda: call().backward(dout))):
        report(title, profile(step, a.calls), a.calls, a.top)
        sync()
        print(f"  function calls per call outside the stages: {count_calls(step, a.calls):.0f}")
        sync()


if __name__ == "__main__":
    main()
