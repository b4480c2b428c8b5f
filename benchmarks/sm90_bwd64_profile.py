"""One launch of our sm_90 64-token backward and of cuDNN BSA's backward at 480p-64 inside a
profiler range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --set full --import-source yes \
        -o $OUT/bwd64 python3 benchmarks/sm90_bwd64_profile.py [ours] [split] [backend] [cudnn] [--shape=HxS]

Everything is compiled and run twice before the range opens, so the range holds exactly one call of
each: ours (the default configuration) and split (`sm90_bwd64_split`) are the dq_accum fill, the
main kernel and the dQ postprocess; cuDNN's is its backward's kernels. Inputs as sm90_fwd64_check.timing_problem
(B1, H12 S39936 unless --shape=HxS, D128, top-62 random ascending lists, bf16), dO random; out and lse from our forward,
delta from the Triton preprocess, the KV-owned lists from the same selection.
"""

from __future__ import annotations

import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import sm90_bwd64_check as bcheck  # noqa: E402
import sm90_fwd64_check as fcheck  # noqa: E402
import sm90_fwd64_profile as fprof  # noqa: E402

E = 64


def main(names, H=12, S=39936) -> None:
    fprof.profile_calls(list(backward_calls(names, H=H, S=S).items()))


GROUP_BYTES = 20 << 20  # "groups": query groups of a 20 MiB working set (Q, dO, fp32 dQ) each


# the split kernel's options measured one by one against "sweep" (BACKWARD with all of them off)
KVPR_FLAGS = ("k_in_regs", "v_in_regs", "p_early", "p_rounded", "l2_hints")


def backward_calls(names, B=1, H=12, S=39936, D=128, topk=62, outputs=None) -> dict:
    """name -> a callable running that backward once on the timing problem (fcheck.timing_problem's
    inputs, dO random, out / lse from our forward, delta from it, the KV-owned lists of the same
    selection): "ours", "split", "backend" (our kernels, see main's doc), "groups" (the backend's
    configuration with query groups of GROUP_BYTES; "groups<N>": of N MiB), "persist" (the backend's
    configuration, persistent; "persist<N>": with groups of N MiB; "persist0": without groups), "sweep" (the
    backend's configuration with KVPR_FLAGS off), "chunks" (sweep without head_sweep: the grid in chunks of
    resident CTAs), "kregs" / "vregs" / "kvregs" / "hints" / "pearly" / "prounded" (sweep with K / V / both in
    registers, L2 hints, P early, P rounded), "kvpr" (sweep with all of KVPR_FLAGS) or "cudnn". All write the
    same dq, dk, dv, which `outputs` (a dict) receives when given."""
    from vsa_core.backends import sm90_bwd64_launch, sm90_fwd64
    n = S // E
    q, k, v, idx, num, counts = fcheck.timing_problem(B, H, S, D, topk)
    gen = torch.Generator(device=q.device).manual_seed(1)
    do = torch.randn(B, H, S, D, generator=gen, device=q.device).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    sm90_fwd64.prepare_forward64(q, k, v, out, lse, idx, num, counts, softmax_scale=scale)()
    delta = sm90_bwd64_launch.backward_delta(out, do)
    mask = torch.zeros(B, H, n, n, dtype=torch.bool, device=q.device).scatter_(-1, idx.long(), True)
    _, _, inv_idx, inv_num = bcheck.lists_from_mask(mask)
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    if outputs is not None:
        outputs.update(dq=dq, dk=dk, dv=dv)
    calls = {}
    for name in names:
        if name == "cudnn":
            from cudnn.block_sparse_attention import api as cudnn_api
            calls[name] = lambda: cudnn_api.block_sparse_attention_backward(
                do, q, k, v, out, lse, idx, None, counts, num, softmax_scale=scale, dq_tensor=dq, dk_tensor=dk,
                dv_tensor=dv, sparse_block_size=E, layout="bhsd")
        else:  # "ours": the kernel's defaults; "split": sm90_bwd64_split (3 slots); "backend": sm90_backend.BACKWARD
            from vsa_core.backends.sm90_backend import BACKWARD
            if name.startswith("groups") and name != "groups":  # groups<N>: query groups of N MiB
                options = dict(BACKWARD, q_group_bytes=int(name[len("groups"):]) << 20)
            elif name.startswith("persist"):  # persist: BACKWARD persistent; persist<N>: with groups of N MiB
                options = dict(BACKWARD, persistent=True)
                if name != "persist":
                    options["q_group_bytes"] = int(name[len("persist"):]) << 20
            else:
                sweep = dict(BACKWARD, **{flag: False for flag in KVPR_FLAGS})
                options = dict(ours={}, split=dict(split=True, stages=3), backend=BACKWARD,
                               groups=dict(BACKWARD, q_group_bytes=GROUP_BYTES),
                               kregs=dict(sweep, k_in_regs=True), vregs=dict(sweep, v_in_regs=True),
                               kvregs=dict(sweep, k_in_regs=True, v_in_regs=True),
                               chunks=dict(sweep, head_sweep=False), sweep=sweep, hints=dict(sweep, l2_hints=True),
                               pearly=dict(sweep, p_early=True), prounded=dict(sweep, p_rounded=True),
                               kvpr=dict(sweep, **{flag: True for flag in KVPR_FLAGS}))[name]
            calls[name] = sm90_bwd64_launch.prepare_backward64(q, k, v, do, lse, delta, dq, dk, dv, inv_idx, inv_num,
                                                        counts, softmax_scale=scale, **options)
    return calls


if __name__ == "__main__":
    args = sys.argv[1:]
    shape = [a.split("=", 1)[1] for a in args if a.startswith("--shape=")]  # --shape=HxS (B1)
    H, S = (int(x) for x in shape[-1].split("x")) if shape else (12, 39936)
    main([a for a in args if not a.startswith("--")] or ["ours", "cudnn"], H=H, S=S)
