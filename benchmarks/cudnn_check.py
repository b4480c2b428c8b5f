"""Checks and times the cudnn backend (cuDNN frontend's block-sparse attention) on one GPU.

    PYTHONPATH=. python3 benchmarks/cudnn_check.py            # logs and JSON to $OUT when set

1. correctness at small shapes: backend="cudnn" against the float64 reference and against
   backend="triton", forward and backward (out, dq, dk, dv, dgate), 64/128-token blocks,
   both layouts, partial and empty tiles, Sq != Skv;
2. timing at 480p-64 (B1 H12 S39936 D128, 64-token blocks, top-62, bf16), same inputs and
   block map for every row: the fine stage (block_sparse_attn) through the triton and cudnn
   backends and cuDNN BSA called directly ("raw": fixed count per row and full blocks, the
   library's fastest form; "raw-var": variable counts, block_sizes and empty rows allowed,
   what our backend asks of it), the whole VSA (video_sparse_attn) through triton and cudnn,
   and the top-k selection kernel (threshold pass) against the former topk-rounds kernel.
TFLOPS on sparse FLOPs 4*B*H*D*Sq*topk*E, backward 2.5x; backward = median(fwd+bwd) - median(fwd).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE, os.path.join(REPO, "tests")]
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import peers  # noqa: E402
import vsa_torch  # noqa: E402
from vsa_core.backends import cudnn_backend, resolve_backend  # noqa: E402
from vsa_core import stages  # noqa: E402
from vsa_core.launch import eager_launcher  # noqa: E402
from vsa_core.problem import AttnProblem  # noqa: E402
from vsa_torch.ops import device_info  # noqa: E402

OUT = os.environ.get("OUT")
LINES = []


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LINES.append(msg)


# ---- 1. correctness ------------------------------------------------------------------------
def check_small() -> list:
    from common import Case, errors, make_inputs, reference, TOLERANCE
    from test_torch_vsa import run_torch
    cases = [
        Case(head_dim=128),
        Case(head_dim=128, layout="bshd", gate=False),
        Case(head_dim=128, n_q_blocks=5, n_kv_blocks=2, topk=1),
        Case(head_dim=128, n_q_blocks=2, n_kv_blocks=6, topk=3, layout="bshd"),
        Case(head_dim=128, topk=9, n_q_blocks=2),
        Case(block=128, head_dim=128, n_q_blocks=2, n_kv_blocks=3, batch=1),
        Case(block=128, head_dim=128, n_q_blocks=3, n_kv_blocks=5, topk=2, layout="bshd"),
        Case(head_dim=128, scale=16.0),
    ]
    results = []
    say("== correctness (max over outputs of ||x - ref|| / ||ref||; bf16 bound 2e-2, x16 logits: dq/dk 8e-2)")
    for case in cases:
        try:
            inputs = make_inputs(case, seed=zlib.crc32(case.id().encode()))
            got = run_torch(case, inputs, backend="cudnn")
            tri = run_torch(case, inputs, backend="triton")
            ref = reference(case, inputs)
            e_ref = {n: errors(got[n], ref[n])[0] for n in ref}
            e_tri = {n: errors(got[n], tri[n])[0] for n in ref}
            e_tri_ref = {n: errors(tri[n], ref[n])[0] for n in ref}
            bound = {n: (8e-2 if case.scale > 1 and n in ("dq", "dk") else TOLERANCE[case.dtype]["rel"]) for n in ref}
            ok = all(e_ref[n] < bound[n] and e_tri[n] < bound[n] for n in ref)
            worst = max(e_ref, key=e_ref.get)
            say(f"  {case.id():60s} vs ref {e_ref[worst]:.1e} ({worst})  vs triton {max(e_tri.values()):.1e}  "
                f"triton vs ref {max(e_tri_ref.values()):.1e}  {'ok' if ok else 'FAIL'}")
            results.append(dict(case=case.id(), vs_ref=e_ref, vs_triton=e_tri, triton_vs_ref=e_tri_ref, ok=ok))
        except Exception as e:
            say(f"  {case.id():60s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            traceback.print_exc()
            results.append(dict(case=case.id(), ok=False, error=f"{type(e).__name__}: {e}"))
    return results


# ---- 2. timing -----------------------------------------------------------------------------
def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


@triton.jit
def _topk_rounds_kernel(SCORES, SEL_IDX, SEL_NUM, SEL_MASK, n_kv, topk, idx_capacity, N_PAD: tl.constexpr):
    """The selection before the threshold pass (k rounds of max + lowest-index argmax), for timing."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, N_PAD)
    in_range = cols < n_kv
    scores = tl.load(SCORES + row * n_kv + cols, mask=in_range, other=float("-inf"))
    n_finite = tl.sum((scores > float("-inf")).to(tl.int32), axis=0)
    k_eff = tl.minimum(topk, n_finite)
    chosen = tl.zeros([N_PAD], tl.int32)
    for i in range(0, k_eff):
        best = tl.max(scores, axis=0)
        pick = tl.min(tl.where(scores == best, cols, N_PAD), axis=0)
        hit = cols == pick
        chosen = tl.where(hit, 1, chosen)
        scores = tl.where(hit, float("-inf"), scores)
    slot = tl.cumsum(chosen, axis=0) - 1
    tl.store(SEL_IDX + row * idx_capacity + slot, cols, mask=chosen > 0)
    tl.store(SEL_NUM + row, k_eff)
    tl.store(SEL_MASK + row * n_kv + cols, chosen.to(tl.int8), mask=in_range)


def time_shape(B=1, H=12, S=39936, D=128, E=64, topk=62) -> dict:
    dev = torch.device("cuda")
    flops = 4.0 * B * H * D * S * topk * E
    n = S // E
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(grad=True):
        return torch.randn(B, H, S, D, generator=gen, device=dev).to(torch.bfloat16).requires_grad_(grad)

    q, k, v, gate, dout = randn(), randn(), randn(), randn(), randn(False)
    chosen = torch.rand(B, H, n, n, generator=gen, device=dev).topk(topk, dim=-1).indices
    block_map = torch.zeros(B, H, n, n, dtype=torch.bool, device=dev).scatter_(-1, chosen, True)
    counts = torch.full((n,), E, dtype=torch.int32, device=dev)
    say(f"\n== timing: B{B} H{H} S{S} D{D} E{E} topk {topk}/{n}, bf16 (ms, median; TFLOPS on sparse FLOPs)")
    rows = {}

    def row(name, forward, inputs, ref=None):
        try:
            t = time.perf_counter()
            out = forward(*inputs)
            grads = torch.autograd.grad(out, inputs, dout)
            torch.cuda.synchronize()
            first = time.perf_counter() - t
            err = None
            if ref is not None:
                err = max(float((a.float() - b.float()).norm() / b.float().norm())
                          for a, b in zip([out, *grads], ref))
            fwd = bench(lambda: forward(*inputs))
            both = bench(lambda: torch.autograd.grad(forward(*inputs), inputs, dout))
            bwd = max(both - fwd, 1e-9)
            rows[name] = dict(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flops / fwd / 1e9, bwd_tflops=2.5 * flops / bwd / 1e9,
                              first_call_s=first, rel_err_vs_triton=err)
            say(f"  {name:28s} fwd {fwd:8.3f} ms {flops / fwd / 1e9:6.0f} TFLOPS   bwd {bwd:8.3f} ms "
                f"{2.5 * flops / bwd / 1e9:6.0f} TFLOPS   first {first:5.1f} s"
                + (f"   err vs triton {err:.1e}" if err is not None else ""))
            return [out.detach(), *(g.detach() for g in grads)]
        except Exception as e:
            rows[name] = dict(error=f"{type(e).__name__}: {e}")
            say(f"  {name:28s} ERROR {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            traceback.print_exc()
            return None
        finally:
            torch.cuda.empty_cache()

    def fine(backend):
        return lambda q, k, v: vsa_torch.block_sparse_attn(q, k, v, block_map, counts, E, backend=backend)[0]

    def whole(backend):
        return lambda q, k, v, g: vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk, E,
                                                              compress_attn_weight=g, backend=backend)

    ref_fine = row("fine triton", fine("triton"), (q, k, v))
    row("fine cudnn", fine("cudnn"), (q, k, v), ref_fine)
    label, raw, why = peers.cudnn_bsa(block_map, E)
    if raw is None:
        say(f"  cuDNN BSA raw: skipped ({why})")
    else:
        row(f"raw {label}", raw, (q, k, v), ref_fine)
        row("raw-var (as our backend)", raw_variable(block_map, counts, E), (q, k, v), ref_fine)
    ref_vsa = row("vsa triton", whole("triton"), (q, k, v, gate))
    row("vsa cudnn", whole("cudnn"), (q, k, v, gate), ref_vsa)
    for b in ("triton", "cudnn"):
        f, w = rows.get(f"fine {b}", {}), rows.get(f"vsa {b}", {})
        if "fwd_ms" in f and "fwd_ms" in w:
            say(f"  vsa / fine, {b}: fwd {w['fwd_ms'] / f['fwd_ms']:.3f}x, bwd {w['bwd_ms'] / f['bwd_ms']:.3f}x "
                f"(targets <= 1.10x / 1.05x)")
    p = AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=E, dtype="bfloat16", topk=topk)
    say(f"  auto picks: {resolve_backend('auto', p, device_info(q)).name}")
    rows["topk"] = time_topk(B, H, n, topk, dev)
    return rows


def raw_variable(block_map, counts, E):
    """cuDNN BSA as our backend calls it: variable counts, block_sizes, empty rows allowed."""
    from cudnn import BSA
    num = block_map.sum(-1, dtype=torch.int32)
    idx = torch.sort((~block_map).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    idx = idx[..., :int(num.max())].contiguous()

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            res = BSA.block_sparse_attention_forward(q, k, v, idx, None, counts, num, sparse_block_size=E,
                                                     allow_empty_block_nums=True)
            ctx.save_for_backward(q, k, v, res["o_tensor"], res["lse_tensor"])
            return res["o_tensor"]

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            res = BSA.block_sparse_attention_backward(dout.contiguous(), q, k, v, out, lse, idx, None, counts, num,
                                                      sparse_block_size=E)
            return res["dq_tensor"], res["dk_tensor"], res["dv_tensor"]

    return Attention.apply


def time_topk(B, H, n, topk, dev) -> dict:
    scores = torch.randn(B, H, n, n, device=dev)
    p = AttnProblem(batch=B, heads=H, q_len=n * 64, kv_len=n * 64, head_dim=128, block_elems=64, dtype="bfloat16",
                    topk=topk)
    bufs = [torch.empty(B, H, n, topk, dtype=torch.int32, device=dev), torch.empty(B, H, n, dtype=torch.int32, device=dev),
            torch.empty(B, H, n, n, dtype=torch.int8, device=dev)]
    old = [torch.empty_like(b) for b in bufs]
    n_pad = max(16, triton.next_power_of_2(n))

    def new_call():
        stages.topk_select(eager_launcher, p, scores, *bufs)

    def old_call():
        _topk_rounds_kernel[(B * H * n,)](scores, *old, n, topk, topk, N_PAD=n_pad, num_warps=4)

    new_call()
    old_call()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(bufs, old))
    t_new, t_old = bench(new_call), bench(old_call)
    say(f"  top-k selection [{B},{H},{n},{n}] top-{topk}: threshold pass {t_new:.3f} ms, "
        f"topk rounds {t_old:.3f} ms ({t_old / t_new:.1f}x), same selection: {same}")
    return dict(threshold_ms=t_new, rounds_ms=t_old, same_selection=same)


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    dev = device_info(torch.empty(0, device="cuda"))
    try:
        import cudnn
        version = cudnn.__version__
    except Exception as e:
        version = f"not importable ({type(e).__name__}: {e})"
    probe = AttnProblem(batch=1, heads=1, q_len=64, kv_len=64, head_dim=128, block_elems=64, dtype="bfloat16", topk=1)
    say(f"device {torch.cuda.get_device_name()} sm_{dev.capability[0]}{dev.capability[1]}, torch {torch.__version__}, "
        f"triton {triton.__version__}, nvidia-cudnn-frontend {version}")
    say(f"cudnn backend: {cudnn_backend.unavailable_reason(probe, dev) or 'available'}")
    result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %z"), device=torch.cuda.get_device_name(),
                  cudnn_frontend=version, correctness=check_small(), timing=time_shape())
    ok = all(r.get("ok") for r in result["correctness"])
    say(f"\ncorrectness: {'all ok' if ok else 'FAILURES'}")
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "cudnn_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        with open(os.path.join(OUT, "cudnn_check.log"), "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
