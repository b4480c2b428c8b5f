"""The Triton fine-stage backend: launchers of its block-sparse kernels
(`triton_fine_kernels`) on caller-provided buffers.

Launch configurations live here. On a GPU each attention kernel is autotuned over a
short list keyed on the problem's shape, once per problem for the whole process
(`vsa_core.autotune.TILES`; first entry = the default, run with autotuning off:
`vsa_core.config`); under the interpreter there is one fixed small config. Every launch
goes through the launcher passed in (`vsa_core.launch`).

CPU tensors run the same kernels under Triton's interpreter: each launch picks the
kernels module by the tensors' device (`vsa_core.stages.kernels_for`; see
`vsa_core.interpreter`).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_fine_kernels as K
from ..autotune import TILES, median_ms, tile_key
from ..problem import AttnProblem
from ..runtime import INTERPRETING, DeviceInfo, caller_stream, torch_loaded
from ..stages import _bh, _ignore, interpreted, kernels_for
from .base import FineBackward, FineForward

name = "triton"
replayable = True  # every launch goes through the launcher, on the call's buffers only


@functools.lru_cache(maxsize=None)
def _interpreter_broken() -> Optional[str]:
    """Why Triton's interpreter cannot run here, or None. Triton 3.6's interpreter converts
    shape-(1,) arrays with int(), an error since numpy 2.4 (seen on the H200 machine: triton
    3.6.0, numpy 2.5.2); with numpy < 2.4 it runs, and so do 3.7 - 3.9 with any numpy (CI runs
    a subset on the lowest allowed Triton). The kernels avoid the interpreter's other numpy 2
    trap (an unsigned all-ones filled with the Python int -1: no `~` on unsigned ints)."""
    import numpy
    import triton
    tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
    nv = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    if tv <= (3, 6) and nv >= (2, 4):
        return (f"CPU tensors run under Triton's interpreter, which in triton {triton.__version__} fails with "
                f"numpy {numpy.__version__} (>= 2.4): use triton >= 3.7 or numpy < 2.4 for CPU tensors")
    return None


def unavailable_reason(problem: AttnProblem, device: DeviceInfo) -> Optional[str]:
    # CPU tensors run the same kernels under Triton's interpreter (slow; for testing)
    if device.kind == "cuda" or INTERPRETING:
        return None
    if device.kind == "cpu":
        return _interpreter_broken()
    return (f"the triton backend runs on CUDA tensors (or, slowly, on CPU tensors under Triton's "
            f"interpreter), got {device.kind} tensors")


class _TunedKernel:
    """An attention kernel with its candidate tile configs, as
    (BLOCK_M, BLOCK_N, num_warps, num_stages), best default first.

    Tiles must not straddle two blocks, so a config fits only if BLOCK_M and BLOCK_N
    divide the block's token count E. The config of a problem comes from the shared store
    (`vsa_core.autotune.TILES`, keyed on the dtype and the `key` arguments): timed once per
    key with autotuning on a GPU, else the first fitting one; the launcher's
    `config.forced_tiles` overrides both. `tiled_args` names the descriptor arguments and the
    tile size ("BLOCK_M"/"BLOCK_N") of their rows; their block shape is set to match the
    config before each launch.
    """

    INTERPRETER_CONFIG = (64, 64, 4, 1)

    def __init__(self, kernel, candidates, key, tiled_args):
        self.kernel = kernel
        self.name = kernel.fn.__name__
        self.candidates = [self.INTERPRETER_CONFIG] if INTERPRETING else candidates
        self.key_args = key
        self.tiled_args = tiled_args

    @staticmethod
    def _fits(E, m, n):
        return E % m == 0 and E % n == 0

    def _set_block_shapes(self, nargs):
        for name, tile in self.tiled_args.items():
            desc = nargs[name]
            if isinstance(desc, TensorDescriptor):
                desc.block_shape = [1, 1, nargs[tile], desc.shape[-1]]

    def _launch(self, launcher, kernel, grid, tile, args, kwargs):
        m, n, w, s = tile
        meta = {"BLOCK_M": m, "BLOCK_N": n}
        self._set_block_shapes({**dict(zip(kernel.arg_names, args)), **meta})
        launcher.triton(kernel, grid(meta), *args, **kwargs, **meta, num_warps=w, num_stages=s)

    def store_key(self, p: AttnProblem, named_args) -> tuple:
        """The tile store's key of a launch of `p` with these arguments by name: the dtype's
        name and the `key` arguments' values, plain values whichever frontend launches."""
        return tile_key(self.name, p.dtype, **{name: named_args[name] for name in self.key_args})

    def tile_for(self, launcher, p: AttnProblem, grid, args, kwargs):
        """The tile config of this compiled launch (see the class doc)."""
        forced = launcher.config.forced_tile(self.name)
        if forced is not None:
            return forced
        fitting = [c for c in self.candidates if self._fits(kwargs["BLOCK_ELEMS"], c[0], c[1])]
        # Triton's benchmark times with torch (events on torch's current stream, an L2 flush):
        # a process without torch (vsa_jax alone) runs the default config; under a raw-stream
        # launch (JAX) torch's current stream is made that stream, so the timed kernels and the
        # events share it
        if not (launcher.config.autotune and torch_loaded()):
            return fitting[0]  # the default, even where a tuned entry exists (autotune switched off)
        key = self.store_key(p, {**dict(zip(self.kernel.arg_names, args)), **kwargs})
        if not launcher.runs_kernels:  # nothing to time with: the store's choice (a recorded plan)
            return launcher.stored_tile(key, fitting)
        with caller_stream():
            return TILES.choose(key, fitting, lambda tile: median_ms(
                lambda: self._launch(launcher, self.kernel, grid, tile, args, kwargs)))

    def __call__(self, launcher, p: AttnProblem, grid, like, *args, **kwargs):
        """Launches on args; `like` (a tensor of the call) decides compiled or interpreted."""
        if interpreted(like):
            kernel, tile = getattr(kernels_for(like, K), self.name), self.INTERPRETER_CONFIG
        else:
            kernel, tile = self.kernel, self.tile_for(launcher, p, grid, args, kwargs)
        self._launch(launcher, kernel, grid, tile, args, kwargs)


def _use_tma(launcher, *xs) -> bool:
    """Whether the kernel reads xs by TMA: configured (`config.tma`) and every one of them
    16-byte aligned (a descriptor's base must be; a view that starts off that, e.g. a few
    elements into a larger tensor, is read by pointer loads). One answer for all of a
    launch's tiled arguments: the kernel's USE_TMA covers them together."""
    return launcher.config.tma and all(x.data_ptr() % 16 == 0 for x in xs)


def _tiles(p: AttnProblem, x, seq_len: int, tma: bool):
    """A host descriptor over x's logical (B, H, S, D) view (block shape set per config), or x
    itself for pointer loads. It covers exactly x's elements from x's first one (the kernels take
    contiguous token tensors: `token_strides`), so a launch replayed on another buffer of x's
    shape (a recorded plan: `vsa_core.plan`) rebuilds it from that buffer's address alone."""
    if not tma:
        return x
    return TensorDescriptor(x, [p.batch, p.heads, seq_len, p.head_dim], [*p.token_strides(seq_len), 1],
                            [1, 1, 16, p.head_dim])


# with the dtype, the tile store's key (`_TunedKernel.store_key`): what Triton's own autotuner
# keyed on, whose key also held whether each pointer was absent (the gate) or a descriptor (TMA)
_KEY = ["BLOCK_ELEMS", "HEAD_DIM", "HAS_COARSE", "q_len", "IGNORE_PADDING", "USE_TMA"]

_sparse_fwd = _TunedKernel(
    K.sparse_attn_fwd_kernel,
    [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 4)], _KEY + ["HAS_GATE"],
    {"K": "BLOCK_N", "V": "BLOCK_N"})
_sparse_bwd_dq = _TunedKernel(
    K.sparse_attn_bwd_dq_kernel,
    [(64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2)], _KEY,
    {"K": "BLOCK_N", "V": "BLOCK_N"})
_sparse_bwd_dkdv = _TunedKernel(
    K.sparse_attn_bwd_dkdv_kernel,
    [(64, 64, 4, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3)], _KEY + ["n_kv_blocks"],
    {"Q": "BLOCK_M", "DOUT": "BLOCK_M"})

# ---- the fine stage: the part a backend provides ---------------------------------------
def _scales(p: AttnProblem):
    """(scale * log2(e), scale): the fine kernels' softmax runs on exp2."""
    return math.log2(math.e) * p.softmax_scale, p.softmax_scale


def _first_blocks(p: AttnProblem) -> int:
    """Blocks of each head whose tiles the fine kernels run first: a static prefix's (its dense
    query rows; the prefix KV blocks the video rows take). Packed sequences start theirs at each
    sequence's first block, in no fixed place: they keep the plain order."""
    return p.prefix_blocks if p.has_prefix and not p.varlen else 0


def sparse_forward(launcher, p: AttnProblem, a: FineForward):
    q, k, v, out, lse, sel_idx, sel_num, kv_counts = a.q, a.k, a.v, a.out, a.lse, a.sel_idx, a.sel_num, a.kv_counts
    gate, out_coarse, out_fine = a.gate, a.out_coarse, a.out_fine
    tma = _use_tma(launcher, k, v)
    _sparse_fwd(
        launcher, p, lambda meta: (p.q_len // meta["BLOCK_M"], _bh(p)), q,
        q, _tiles(p, k, p.kv_len, tma), _tiles(p, v, p.kv_len, tma), out, lse, sel_idx, sel_num, kv_counts,
        a.q_counts, gate, out_coarse, out_fine if out_fine is not None else lse,  # lse: a placeholder never written
        *p.token_strides(p.q_len), *p.token_strides(p.kv_len),
        p.heads, p.q_len, p.n_q_blocks, p.n_kv_blocks, sel_idx.shape[-1], _scales(p)[0],
        int(out_fine is not None), _first_blocks(p),
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, HAS_COARSE=out_coarse is not None,
        HAS_GATE=gate is not None, UPCAST=interpreted(q), USE_TMA=tma,
        IGNORE_PADDING=_ignore(p), FINE_ROUNDING=out_coarse is not None and p.fine_residual == "rounding")


def sparse_backward_dq(launcher, p: AttnProblem, q, k, v, lse, dout, delta, dq, sel_idx, sel_num, kv_counts,
                       q_counts=None, dq_pool=None):
    tma = _use_tma(launcher, k, v)
    _sparse_bwd_dq(
        launcher, p, lambda meta: (p.q_len // meta["BLOCK_M"], _bh(p)), q,
        q, _tiles(p, k, p.kv_len, tma), _tiles(p, v, p.kv_len, tma), dout, lse, delta, dq, sel_idx, sel_num,
        kv_counts, q_counts, dq_pool, *p.token_strides(p.q_len), *p.token_strides(p.kv_len),
        p.heads, p.q_len, p.n_q_blocks, p.n_kv_blocks, sel_idx.shape[-1], *_scales(p), _first_blocks(p),
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, HAS_COARSE=dq_pool is not None, UPCAST=interpreted(q),
        USE_TMA=tma, IGNORE_PADDING=_ignore(p))


def sparse_backward_dkdv(launcher, p: AttnProblem, q, k, v, lse, dout, delta, dk, dv, inv_idx, inv_num, kv_counts,
                         dk_pool=None, dv_pool=None, q_counts=None):
    tma = _use_tma(launcher, q, dout)
    _sparse_bwd_dkdv(
        launcher, p, lambda meta: (p.kv_len // meta["BLOCK_N"], _bh(p)), k,
        _tiles(p, q, p.q_len, tma), k, v, _tiles(p, dout, p.q_len, tma), lse, delta, dk, dv, inv_idx, inv_num,
        kv_counts, dk_pool, dv_pool, q_counts, *p.token_strides(p.q_len), *p.token_strides(p.kv_len),
        p.heads, p.q_len, p.n_kv_blocks, inv_idx.shape[-1], *_scales(p), _first_blocks(p),
        BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, HAS_COARSE=dk_pool is not None, UPCAST=interpreted(q),
        USE_TMA=tma, IGNORE_PADDING=_ignore(p))


def sparse_backward(launcher, p: AttnProblem, a: FineBackward):
    """Fine-stage dQ (query-owned) and dK/dV (KV-owned), no atomics. Given the pooling
    gradients (fp32 per block), each kernel adds grad/count to its tokens as it writes."""
    sparse_backward_dq(launcher, p, a.q, a.k, a.v, a.lse, a.dout, a.delta, a.dq, a.sel_idx, a.sel_num, a.kv_counts,
                       a.q_counts, a.dq_pool)
    sparse_backward_dkdv(launcher, p, a.q, a.k, a.v, a.lse, a.dout, a.delta, a.dk, a.dv, a.inv_idx, a.inv_num,
                         a.kv_counts, a.dk_pool, a.dv_pool, a.q_counts)




# ---- tuning ahead of a call ------------------------------------------------------------------
def tune(p: AttnProblem, device_index: int) -> None:
    """Times the attention kernels of `p` (the forward's; with p.training also dQ's and dK/dV's)
    on CUDA device `device_index`, through the eager launcher, on buffers of its own, and leaves
    the choices in the shared store (`TILES`), where every later call with the same keys, torch's
    or JAX's, reads them. For a caller that fixes its kernels before it sees data: the JAX native
    launch, at trace time. The buffers are what a VSA call of `p`'s shapes could run: q, k, v and
    dout random, every block full, each query block's list its `select_capacity` next KV blocks.
    Needs torch (Triton's benchmark times with it); a key chosen before is not timed again."""
    import torch

    from ..launch import eager_launcher
    from ..ops import _fine_args

    device = torch.device("cuda", device_index)
    dtypes = {"input": getattr(torch, p.dtype), "bfloat16": torch.bfloat16, "float16": torch.float16,
              "float32": torch.float32, "int32": torch.int32, "int8": torch.int8}
    generator = torch.Generator(device=device).manual_seed(0)

    def normal(seq_len):
        return torch.randn(p.token_shape(seq_len), generator=generator, device=device, dtype=torch.float32).to(
            dtypes["input"])

    tables = {**p.forward_buffers(), **(p.backward_buffers() if p.training else {})}
    b = {n: torch.zeros(shape, dtype=dtypes[dtype], device=device) for n, (shape, dtype) in tables.items()}
    b.update(q=normal(p.q_len), k=normal(p.kv_len), v=normal(p.kv_len), dout=normal(p.q_len),
             kv_counts=torch.full((p.n_kv_blocks,), p.block_elems, dtype=torch.int32, device=device))
    if p.is_vsa:  # the inputs only a VSA call has (the fine kernels' HAS_COARSE / HAS_GATE follow them)
        b["q_counts"] = torch.full((p.n_q_blocks,), p.block_elems, dtype=torch.int32, device=device)
        if p.has_gate:
            b["gate"] = normal(p.q_len)
    nq, nk = p.n_q_blocks, p.n_kv_blocks
    n = min(b["sel_idx"].shape[-1], nk)
    lists = ((torch.arange(nq)[:, None] + torch.arange(n)[None, :]) % nk).sort(dim=1).values
    b["sel_idx"][..., :n] = lists.to(device=device, dtype=torch.int32)
    b["sel_num"].fill_(n)
    if p.training:  # the KV-owned lists of the same selection: each KV block's query blocks, ascending
        taken = torch.zeros(nq, nk, dtype=torch.bool).scatter_(1, lists, True)
        order = torch.sort((~taken).to(torch.int8), dim=0, stable=True).indices.t()
        b["inv_idx"][...] = order.to(device=device, dtype=torch.int32)
        b["inv_num"][...] = taken.sum(0).to(device=device, dtype=torch.int32)
    with torch.cuda.device(device):
        sparse_forward(eager_launcher, p, _fine_args(FineForward, b))
        if p.training:
            sparse_backward(eager_launcher, p, _fine_args(FineBackward, b))
        torch.cuda.synchronize(device)
