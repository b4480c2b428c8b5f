"""What the fine output kept for the backward costs in gradient precision, on the GPU (round to nearest
even; the Triton interpreter truncates fp32 -> bf16, which biases a bf16 fine output and overstates its
cost). Prints rel-L2 of dq / dk against float64 for each kept form (`AttnProblem.fine_residual`), and
how far each form's gradients are from the fp32 fine output's.

    python3 benchmarks/fine_residual_precision.py [--backends triton,sm90] [--seeds 61,62,63]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from common import Case, errors, make_inputs, reference  # noqa: E402
from frontends import run_torch  # noqa: E402

import vsa_core.spec as spec  # noqa: E402
import vsa_torch.ops  # noqa: E402

KINDS = ("float32", "rounding", "input")
CASES = {"D128 x16": Case(head_dim=128, scale=16.0), "D64 x16": Case(head_dim=64, scale=16.0),
         "D128 x1": Case(head_dim=128)}


def run_kept_as(kind, case, inputs, backend):
    spec.fine_residual = lambda name: kind
    spec._op_problem.cache_clear()
    vsa_torch.ops._STATICS.clear()
    return run_torch(case, inputs, backend=backend, device="cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="triton,sm90")
    ap.add_argument("--seeds", default="61,62,63")
    args = ap.parse_args()
    print("| backend | case | kept | dq vs float64 | dk vs float64 | dq vs fp32 kept | dk vs fp32 kept |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for backend in args.backends.split(","):
        for label, case in CASES.items():
            rows = {kind: [] for kind in KINDS}
            for seed in map(int, args.seeds.split(",")):
                inputs = make_inputs(case, seed=seed)
                ref = reference(case, inputs)
                got = {}
                for kind in KINDS:
                    try:
                        got[kind] = run_kept_as(kind, case, inputs, backend)
                    except Exception as e:  # a kind the backend does not support
                        got[kind] = f"{type(e).__name__}: {str(e)[:80]}"
                for kind in KINDS:
                    g = got[kind]
                    if isinstance(g, str):
                        rows[kind].append(g)
                        continue
                    e = [errors(g[n], ref[n])[0] for n in ("dq", "dk")]
                    f = got["float32"]
                    d = [errors(g[n], f[n])[0] for n in ("dq", "dk")] if not isinstance(f, str) else [float("nan")] * 2
                    rows[kind].append(e + d)
            for kind, vals in rows.items():
                if any(isinstance(v, str) for v in vals):
                    print(f"| {backend} | {label} | {kind} | {next(v for v in vals if isinstance(v, str))} | | | |")
                    continue
                cols = ["%.1e-%.1e" % (min(v[i] for v in vals), max(v[i] for v in vals)) for i in range(4)]
                print(f"| {backend} | {label} | {kind} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
