"""Bad index lists and counts under torch.compile / jax.jit, where nothing is checked before
launch: every frontend and backend must run them without touching memory outside its
buffers and give the documented result, the same as the lists the kernels' rule keeps
(`vsa_core.reference.index_lists_to_block_map`) or the counts clamped to [0, E].

    PYTHONPATH=. python3 benchmarks/safety_gpu.py                  # the table (H200: ~1-2 min)
    PYTHONPATH=. compute-sanitizer --tool memcheck python3 benchmarks/safety_gpu.py --small
    PYTHONPATH=. python3 benchmarks/safety_gpu.py --device cpu --small --frontends torch   # plumbing, no GPU

Each row: one bad pattern applied to every list row (or to the counts), run forward and
backward compiled (torch.compile fullgraph / jax.jit, lists and counts as traced
inputs), compared with the same frontend and backend on the kept lists (or clamped
counts), and the eager call, which must raise ValueError naming the argument.
`diff` is max|bad - kept| / max|kept| over out, lse, dq, dk, dv (0 expected for Triton;
FA4's and cuDNN's backwards accumulate with atomics, so cute and cudnn may differ in the
last bits).
Exit status 1 if any row fails. Writes safety_gpu.log and safety_gpu.json to $OUT if set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny shape (for compute-sanitizer)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--frontends", default="torch,jax")
    p.add_argument("--backends", default=None,
                   help="default: triton,cute, and cudnn when nvidia-cudnn-frontend is importable")
    p.add_argument("--block", type=int, default=128,
                   help="tokens per block (128: the cute and cudnn backends; 64: the sm90 backend)")
    args = p.parse_args()
    if args.backends is None:
        args.backends = "triton,cute" + (",cudnn" if importlib.util.find_spec("cudnn") is not None else "")
    return args


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU memory to torch too

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vsa_core import reference as R  # noqa: E402
from vsa_core.backends import BackendUnavailableError  # noqa: E402

# shape: B, H, D, E, nQ, nKV, list capacity (head dim 128: cuDNN's backward needs it)
SHAPE = (1, 1, 128, ARGS.block, 2, 3, 3) if ARGS.small else (1, 2, 128, ARGS.block, 8, 8, 8)
B, H, D, E, NQ, NK, CAP = SHAPE
I32_MAX = 2**31 - 1


def _entry(value):
    return lambda: ([0, value, NK - 1], 3)


# label -> (argument the eager error names, row entries, row count); applied to every row
LIST_CASES = {
    "index nKV": ("block_indices", _entry(NK)),
    "index -1": ("block_indices", _entry(-1)),
    "index -2^20": ("block_indices", _entry(-2**20)),
    "index 2^20": ("block_indices", _entry(2**20)),
    "index 2^31-1": ("block_indices", _entry(I32_MAX)),
    "all entries 2^31-1": ("block_indices", lambda: ([I32_MAX] * CAP, CAP)),
    "count capacity+1": ("block_counts", lambda: (list(range(CAP)), CAP + 1)),
    "count capacity+64": ("block_counts", lambda: (list(range(CAP)), CAP + 64)),
    "count 2^16": ("block_counts", lambda: (list(range(CAP)), 2**16)),
    "count 2^31-1": ("block_counts", lambda: ([I32_MAX] * CAP, I32_MAX)),
    "count -1": ("block_counts", lambda: ([0, 1], -1)),
    "count -2^31": ("block_counts", lambda: ([0, 1], -2**31)),
    "duplicate": ("block_indices", lambda: ([1, 1, 2], 3)),
    "unsorted": ("block_indices", lambda: ([2, 0, 1], 3)),
}
COUNT_CASES = {  # video_sparse_attn: (kv counts, q counts) with values outside [0, E]
    "variable_block_sizes": (np.array([E + 5, -2**31, 2**31 - 1] + [E] * (NK - 3)), np.full(NQ, E)),
    "q_variable_block_sizes": (np.full(NK, E), np.array([-2**31, 2**31 - 1] + [E] * (NQ - 2))),
}


def lists_for(label):
    _, make = LIST_CASES[label]
    entries, count = make()
    idx = np.full((B, H, NQ, CAP), 7, np.int32)
    idx[..., :len(entries)] = entries
    return idx, np.full((B, H, NQ), count, np.int32)


def kept(idx, num):
    block_map = R.index_lists_to_block_map(idx, num, NK)
    out = np.zeros_like(idx)
    for row in np.ndindex(*idx.shape[:3]):
        chosen = np.flatnonzero(block_map[row])
        out[row][:chosen.size] = chosen
    return out, block_map.sum(-1).astype(np.int32)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = {n: rng.standard_normal((B, H, s * E, D), np.float32)
         for n, s in (("q", NQ), ("k", NK), ("v", NK), ("gate", NQ), ("dout", NQ))}
    x["counts"] = np.full(NK, E)
    x["counts"][-1] = E // 2
    return x


def diff(bad, want):
    """max|bad - want| / max|want| over the finite entries (-inf where lse is -inf on both)."""
    worst = 0.0
    for a, b in zip(bad, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not np.array_equal(np.isinf(a), np.isinf(b)) or np.isnan(a).any():
            return float("inf")
        fin = np.isfinite(b)
        scale = max(np.abs(b[fin]).max(initial=0.0), 1e-30)
        worst = max(worst, np.abs(a[fin] - b[fin]).max(initial=0.0) / scale)
    return worst


# ---- frontends -------------------------------------------------------------------------------
class TorchFrontend:
    name = "torch.compile"

    def __init__(self, backend):
        import vsa_torch
        self.lib, self.dev = vsa_torch, ARGS.device
        self.bsa = lambda q, k, v, i, n, c: vsa_torch.block_sparse_attn_from_indices(q, k, v, i, n, c, E,
                                                                                    backend=backend)
        self.vsa = lambda q, k, v, g, kc, qc: vsa_torch.video_sparse_attn(q, k, v, kc, qc, 2, E, g, backend=backend)
        compile_backend = "aot_eager" if self.dev == "cpu" else "inductor"
        self.bsa_c = torch.compile(self.bsa, fullgraph=True, dynamic=False, backend=compile_backend)
        self.vsa_c = torch.compile(self.vsa, fullgraph=True, dynamic=False, backend=compile_backend)

    def _t(self, x, dtype=torch.bfloat16):
        return torch.from_numpy(np.asarray(x)).to(self.dev, dtype)

    def lists(self, x, idx, num, compiled):
        q, k, v = (self._t(x[n]).requires_grad_() for n in ("q", "k", "v"))
        fn = self.bsa_c if compiled else self.bsa
        out, lse = fn(q, k, v, self._t(idx, torch.int32), self._t(num, torch.int32), self._t(x["counts"], torch.int32))
        out.backward(self._t(x["dout"]))
        res = [out, lse, q.grad, k.grad, v.grad]
        if self.dev == "cuda":
            torch.cuda.synchronize()
        return [t.detach().float().cpu().numpy() for t in res]

    def counts(self, x, kv_counts, q_counts, compiled):
        q, k, v, g = (self._t(x[n]).requires_grad_() for n in ("q", "k", "v", "gate"))
        fn = self.vsa_c if compiled else self.vsa
        out = fn(q, k, v, g, self._t(kv_counts, torch.int32), self._t(q_counts, torch.int32))
        out.backward(self._t(x["dout"]))
        res = [out, q.grad, k.grad, v.grad, g.grad]
        if self.dev == "cuda":
            torch.cuda.synchronize()
        return [t.detach().float().cpu().numpy() for t in res]


class JaxFrontend:
    name = "jax.jit"

    def __init__(self, backend):
        import jax
        import jax.numpy as jnp

        import vsa_jax
        self.jnp = jnp

        def bsa(q, k, v, i, n, c):
            return vsa_jax.block_sparse_attn_from_indices(q, k, v, i, n, c, E, backend=backend)

        def vsa(q, k, v, g, kc, qc):
            return vsa_jax.video_sparse_attn(q, k, v, kc, qc, 2, E, g, backend=backend)

        def bsa_grads(q, k, v, dout, i, n, c):
            (out, lse), pull = jax.vjp(lambda q, k, v: bsa(q, k, v, i, n, c), q, k, v)
            return [out, lse, *pull((dout, jnp.zeros_like(lse)))]

        def vsa_grads(q, k, v, g, dout, kc, qc):
            out, pull = jax.vjp(lambda q, k, v, g: vsa(q, k, v, g, kc, qc), q, k, v, g)
            return [out, *pull(dout)]

        self.fns = {"lists": (bsa_grads, jax.jit(bsa_grads)), "counts": (vsa_grads, jax.jit(vsa_grads))}

    def _a(self, x, dtype=None):
        return self.jnp.asarray(x, dtype or self.jnp.bfloat16)

    def lists(self, x, idx, num, compiled):
        fn = self.fns["lists"][compiled]
        res = fn(*(self._a(x[n]) for n in ("q", "k", "v", "dout")), self._a(idx, self.jnp.int32),
                 self._a(num, self.jnp.int32), self._a(x["counts"], self.jnp.int32))
        return [np.asarray(r, np.float32) for r in res]

    def counts(self, x, kv_counts, q_counts, compiled):
        fn = self.fns["counts"][compiled]
        res = fn(*(self._a(x[n]) for n in ("q", "k", "v", "gate", "dout")), self._a(kv_counts, self.jnp.int32),
                 self._a(q_counts, self.jnp.int32))
        return [np.asarray(r, np.float32) for r in res]


def eager_error(run, name):
    try:
        run()
    except ValueError as e:
        return "ValueError" if str(e).startswith(name) else f"ValueError without the name: {e}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:80]}"
    return "no error"


def main():
    x = inputs()
    rows, lines = [], []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    emit(f"device: {torch.cuda.get_device_name() if ARGS.device == 'cuda' else 'cpu (interpreter)'}; "
         f"B{B} H{H} D{D} E{E} nQ{NQ} nKV{NK} capacity {CAP}; torch {torch.__version__}")
    header = f"{'frontend':<14} {'backend':<7} {'case':<24} {'compiled run':<14} {'diff':>9}  eager"
    emit(header)
    emit("-" * len(header))
    for frontend_cls in (TorchFrontend, JaxFrontend):
        if frontend_cls.__name__.lower().replace("frontend", "") not in ARGS.frontends.split(","):
            continue
        for backend in ARGS.backends.split(","):
            try:
                fe = frontend_cls(backend)
                fe.lists(x, *kept(*lists_for("duplicate")), compiled=False)  # can this backend run here?
            except BackendUnavailableError as e:
                emit(f"{frontend_cls.name:<14} {backend:<7} skipped: {str(e)[:120]}")
                continue
            except ImportError as e:
                emit(f"{frontend_cls.name:<14} {backend:<7} skipped: {e}")
                continue
            cases = [("lists", label) for label in LIST_CASES] + [("counts", label) for label in COUNT_CASES]
            for kind, label in cases:
                t0 = time.time()
                row = dict(frontend=frontend_cls.name, backend=backend, case=label)
                try:
                    if kind == "lists":
                        idx, num = lists_for(label)
                        bad = fe.lists(x, idx, num, compiled=True)
                        want = fe.lists(x, *kept(idx, num), compiled=False)
                        row["eager"] = eager_error(lambda: fe.lists(x, idx, num, compiled=False), LIST_CASES[label][0])
                    else:
                        kv_counts, q_counts = COUNT_CASES[label]
                        bad = fe.counts(x, kv_counts, q_counts, compiled=True)
                        want = fe.counts(x, np.clip(kv_counts, 0, E), np.clip(q_counts, 0, E), compiled=False)
                        row["eager"] = eager_error(lambda: fe.counts(x, kv_counts, q_counts, compiled=False), label)
                    row["ran"], row["diff"] = "ok", diff(bad, want)
                except Exception as e:  # noqa: BLE001  (an illegal access ends up here, and then every row)
                    row["ran"], row["diff"], row["eager"] = f"{type(e).__name__}", float("inf"), "-"
                    row["error"] = traceback.format_exc(limit=3)
                row["seconds"] = round(time.time() - t0, 2)
                tol = 0.0 if backend == "triton" else 2e-2
                row["pass"] = row["ran"] == "ok" and row["diff"] <= tol and row["eager"] == "ValueError"
                rows.append(row)
                emit(f"{row['frontend']:<14} {backend:<7} {label:<24} {row['ran']:<14} {row['diff']:>9.2e}  "
                     f"{row['eager']}{'' if row['pass'] else '   <-- FAIL'}")
    failed = [r for r in rows if not r["pass"]]
    emit(f"{len(rows) - len(failed)} of {len(rows)} rows pass")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "safety_gpu.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(os.environ["OUT"], "safety_gpu.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
