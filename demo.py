"""Video Sparse Attention in one run: `python demo.py` (`--help` for the options).

Runs VSA forward and backward on a small video latent (by default 5x8x8 tokens in
4x4x4 tiles: 64-token blocks, the second time row of tiles holds 1 of 4 frames, so some
tiles are partial; gate on) and checks the output and the gradients to q, k, v and the
gate against the float64 reference (`vsa_core/reference.py`), then prints one line saying
what it computed and whether it passed. On a GPU it also times VSA forward and backward
at a 480p video shape against dense attention (torch SDPA). On the CPU the same Triton
kernels run under Triton's interpreter (vsa does that by itself, with a warning that it
is slow): keep the video small there.

Runs under either install: torch is imported only for `--frontend torch` (the default where
torch is installed, else jax) and for the GPU timing, so a `vsa[jax]` install runs
`python demo.py --frontend jax` with the numpy float64 reference. Options the library
refuses (`--topk 0`, a tile that is not 64, 128 or 256 tokens, a backend that cannot run
here) are usage errors carrying the library's message.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from types import SimpleNamespace

import numpy as np

from vsa_core import reference as R
from vsa_core.api import prepare_vsa
from vsa_core.backends import CHOICES as BACKEND_CHOICES, BackendUnavailableError, _resolve
from vsa_core.metadata import build_vsa_metadata

# ||x - ref|| / ||ref|| bounds: bf16 keeps 8 significant bits, fp16 11 (see tests/common.py)
THRESHOLD = {"bfloat16": 2e-2, "float16": 3e-3}


def _triple(text: str):
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three ints T,H,W, got {text!r}") from None
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected three positive ints T,H,W, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _have_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_cuda() -> bool:
    """Whether torch is installed and sees a GPU (the 480p timing runs on torch)."""
    if not _have_torch():
        return False
    import torch
    return torch.cuda.is_available()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Run VSA forward and backward on a small video latent and check it against the float64 "
                    "reference; on a GPU also time it at 480p.")
    parser.add_argument("--video", type=_triple, default=(5, 8, 8), metavar="T,H,W",
                        help="latent video shape in tokens (frames, height, width); default 5,8,8")
    parser.add_argument("--tile", type=_triple, default=(4, 4, 4), metavar="t,h,w",
                        help="tile shape; t*h*w (the block size) must be 64, 128 or 256; default 4,4,4")
    parser.add_argument("--topk", type=int, default=2, help="KV blocks each query block attends to; default 2")
    parser.add_argument("--heads", type=_positive, default=2, help="attention heads; default 2")
    parser.add_argument("--head-dim", type=int, default=64, choices=(64, 128), help="head dim D; default 64")
    parser.add_argument("--dtype", default="bfloat16", choices=tuple(THRESHOLD), help="default bfloat16")
    parser.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                        help="fine-stage backend; default auto")
    parser.add_argument("--frontend", default=None, choices=("torch", "jax"),
                        help="default torch where it is installed, else jax")
    parser.add_argument("--no-bench", action="store_true", help="skip the 480p timing on a GPU")
    args = parser.parse_args(argv)
    if args.frontend is None:
        args.frontend = "torch" if _have_torch() else "jax"
    elif args.frontend == "torch" and not _have_torch():
        parser.error("argument --frontend: torch is not installed (a vsa[jax] install): use --frontend jax")
    args.meta = _checked_call(parser, args)
    return args


def _device(frontend: str):
    """The device the frontend runs on here ("cuda" or "cpu") and its DeviceInfo."""
    if frontend == "torch":
        import torch
        from vsa_torch.ops import device_info
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        return kind, device_info(torch.empty(0, device=kind))
    import jax
    from vsa_jax.ops import device_info_of
    info = device_info_of(jax.devices()[0])
    return info.kind, info


def _checked_call(parser, args):
    """The library's own checks of the call the demo is about to make, before any input is
    drawn: what it refuses becomes a usage error naming the option, with its message."""
    try:
        meta = build_vsa_metadata(args.video, args.tile)
    except (TypeError, ValueError) as e:
        parser.error(f"argument {'--tile' if 'tile_size' in str(e) else '--video'}: {e}")
    x = SimpleNamespace(shape=(1, args.heads, meta.padded_len, args.head_dim), dtype=args.dtype)
    counts = meta.variable_block_sizes
    try:
        problem = prepare_vsa(x, x, x, counts, counts, args.topk, meta.tile_size, x, backend=args.backend).problem
    except (TypeError, ValueError) as e:
        option = {"topk": "--topk", "block_size": "--tile"}.get(str(e).split()[0])
        parser.error(f"argument {option}: {e}" if option else str(e))
    args.device, info = _device(args.frontend)
    try:
        # the backend choice without the once-per-process CPU warning, which the call itself gives
        _resolve(args.backend, problem, info)
    except BackendUnavailableError as e:  # with "auto": no backend runs here (the message says why)
        parser.error(f"argument --backend: {e}" if args.backend != "auto" else str(e))
    return meta


def _draw(meta, args, seed: int):
    """q, k, v, gate, dout as float32 numpy [1, H, S, D] in tile order (padding zeroed by
    to_tiled). q and k get a component shared by each tile's tokens, as neighbouring tokens
    of a video latent share content: without it the block means of noise are all near 0."""
    rng = np.random.default_rng(seed)
    shape = (1, args.heads, meta.num_tokens, args.head_dim)
    x = [rng.standard_normal(shape, np.float32) for _ in range(5)]
    # raw token -> its tile: its position among the valid tokens in tile order, then the tile
    tile_of_token = np.searchsorted(np.cumsum(meta.variable_block_sizes), meta.raw_from_tiled, side="right")
    for i in (0, 1):
        shared = rng.standard_normal((1, args.heads, len(meta.variable_block_sizes), args.head_dim), np.float32)
        x[i] = x[i] + shared[:, :, tile_of_token]
    return [np.ascontiguousarray(meta.to_tiled(a)) for a in x]


def _selection_gap(meta, args, arrays) -> float:
    """Smallest gap between the k-th and the (k+1)-th coarse score of a row, as a fraction of
    the row's largest score (float64 scores of the rounded block means)."""
    q, k = (R.round_to_dtype(a, args.dtype) for a in arrays[:2])
    counts = meta.variable_block_sizes
    s = R.coarse_scores(q, k, counts, counts, meta.block_elems, args.dtype)
    top = min(args.topk, s.shape[-1])
    if top >= s.shape[-1]:
        return np.inf
    ordered = -np.sort(-s, axis=-1)
    return float(((ordered[..., top - 1] - ordered[..., top]) / np.abs(s).max(axis=-1)).min())


def _inputs(meta, args, tries: int = 50):
    """Inputs whose top-k choice is clear of rounding: the kernels sum the block means in fp32
    and round them and the ranked scores to the dtype, so a near-tie lets a correct kernel pick
    another block than the reference (the scores move by ~1% of the largest one). Redraws until every row's gap is
    above 3%; large videos (many rows) may not get there, and then say so."""
    best = None
    for seed in range(tries):
        arrays = _draw(meta, args, seed)
        gap = _selection_gap(meta, args, arrays)
        if gap > 0.03:
            return arrays
        if best is None or gap > best[0]:
            best = (gap, arrays)
    print(f"note: no draw of {tries} has a clear top-{args.topk} choice in every row (smallest gap "
          f"{best[0]:.1%} of a row's largest score): a near-tie may pick another block than the reference")
    return best[1]


def run_torch(meta, args, arrays):
    import torch
    import vsa_torch
    leaves = [torch.from_numpy(x).to(args.device, getattr(torch, args.dtype)).requires_grad_() for x in arrays[:4]]
    counts = meta.variable_block_sizes
    out = vsa_torch.video_sparse_attn(*leaves[:3], counts, counts, args.topk, meta.tile_size, leaves[3],
                                      backend=args.backend)
    out.backward(torch.from_numpy(arrays[4]).to(out))
    return [t.detach().double().cpu().numpy() for t in [out] + [x.grad for x in leaves]]


def run_jax(meta, args, arrays):
    import jax
    import jax.numpy as jnp
    import vsa_jax
    q, k, v, gate, dout = (jnp.asarray(x, getattr(jnp, args.dtype)) for x in arrays)
    counts = meta.variable_block_sizes

    def f(q, k, v, gate):
        return vsa_jax.video_sparse_attn(q, k, v, counts, counts, args.topk, meta.tile_size, gate,
                                         backend=args.backend)
    out, vjp = jax.vjp(f, q, k, v, gate)
    grads = vjp(dout)
    return [np.asarray(x, np.float64) for x in (out, *grads)]


def reference(meta, args, arrays):
    """float64 out and gradients on the inputs rounded to the dtype."""
    q, k, v, gate, dout = (R.round_to_dtype(x, args.dtype) for x in arrays[:5])
    counts = meta.variable_block_sizes
    out, _, _, grads = R.video_sparse_attn_reference(q, k, v, counts, counts, args.topk, meta.block_elems,
                                                     gate=gate, round_to=args.dtype, dout=dout)
    return [out, grads["dq"], grads["dk"], grads["dv"], grads["dgate"]]


def check(args) -> bool:
    meta = args.meta
    arrays = _inputs(meta, args)
    run = run_torch if args.frontend == "torch" else run_jax
    start = time.perf_counter()
    got = run(meta, args, arrays)
    seconds = time.perf_counter() - start
    want = reference(meta, args, arrays)
    threshold = THRESHOLD[args.dtype]
    errors = {}
    for name, g, w in zip(("out", "dq", "dk", "dv", "dgate"), got, want):
        errors[name] = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    ok = all(e < threshold for e in errors.values())
    n_blocks = math.prod(meta.num_tiles)
    partial = int((meta.variable_block_sizes < meta.block_elems).sum())
    where = "GPU" if args.device == "cuda" else "CPU, Triton interpreter"
    print("relative errors vs the float64 reference: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    print(f"vsa demo ({args.frontend}, backend {args.backend}, {where}): video {'x'.join(map(str, args.video))} "
          f"({meta.num_tokens} tokens) in {'x'.join(map(str, args.tile))} tiles = {n_blocks} blocks of "
          f"{meta.block_elems} tokens ({partial} partial), B1 H{args.heads} D{args.head_dim}, "
          f"top-{min(args.topk, n_blocks)} of {n_blocks}, {args.dtype}, gate on: forward + backward in "
          f"{seconds:.2f} s, largest error {max(errors.values()):.1e} "
          f"(pass < {threshold:.0e}): {'PASS' if ok else 'FAIL'}")
    return ok


def time_480p():
    import torch
    import vsa_torch
    from triton.testing import do_bench

    B, H, S, D, E, topk = 1, 12, 39936, 128, 64, 62
    n = S // E
    q, k, v, gate = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    counts = torch.full((n,), E, dtype=torch.int32, device="cuda")
    leaves = [t.requires_grad_() for t in (q, k, v, gate)]
    dout = torch.randn_like(q)

    def fwd():
        return vsa_torch.video_sparse_attn(*leaves[:3], counts, counts, topk, E, leaves[3])

    def fwd_bwd():
        torch.autograd.grad(fwd(), leaves, dout)

    with torch.no_grad():
        ms_fwd = do_bench(lambda: vsa_torch.video_sparse_attn(q, k, v, counts, counts, topk, E, gate),
                          return_mode="median")
    ms_all = do_bench(fwd_bwd, return_mode="median")
    flops = 4.0 * B * H * D * S * topk * E
    dense = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    with torch.no_grad():
        ms_dense = do_bench(dense, return_mode="median")
    print(f"480p, B{B} H{H} S{S} D{D}, 64-token blocks, top-{topk} of {n} ({100 * topk / n:.0f}% dense), bf16:")
    print(f"  VSA forward (inference) {ms_fwd:7.3f} ms  {flops / ms_fwd / 1e9:6.0f} TFLOPS (sparse FLOPs)")
    print(f"  VSA forward + backward  {ms_all:7.3f} ms  {3.5 * flops / ms_all / 1e9:6.0f} TFLOPS")
    print(f"  dense SDPA forward      {ms_dense:7.3f} ms  ({ms_dense / ms_fwd:.1f}x the VSA forward)")


if __name__ == "__main__":
    args = parse_args()
    ok = check(args)
    if args.device == "cuda" and not args.no_bench:
        if _torch_cuda():
            time_480p()
        else:
            print("480p timing skipped: it runs on torch (against torch SDPA), which is not installed here")
    sys.exit(0 if ok else 1)
