"""Peer implementations the harness compares against, each built as `forward(q, k, v) -> out`
on `[B, H, S, D]` tensors so the harness can time and differentiate them like ours.

- FlexAttention on the same block map (block-sparse, numerically comparable: it is the
  correctness reference of the fine stage);
- torch SDPA with the FLASH backend, dense (what sparse attention replaces);
- FlashAttention-4 (`flash_attn.cute`), dense, when installed;
- cuDNN frontend's block-sparse attention (`cudnn.BSA`) on the same block map, when installed:
  the library as its own API takes it (fixed count per row, full blocks), 64-token blocks as
  they are, 128/256-token blocks as 128-token blocks.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def selected_lists(block_map: Tensor) -> Tuple[Tensor, Tensor]:
    """bool [B, H, nQ, nKV] -> (counts [B, H, nQ] int32, indices [B, H, nQ, nKV] int32), the
    selected KV blocks first and ascending (the rest of each row is ignored by FlexAttention)."""
    counts = block_map.sum(-1, dtype=torch.int32)
    # a stable sort of "not selected" puts the selected blocks first, in index order
    indices = torch.sort((~block_map).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts, indices


def flex_block_masks(block_map: Tensor, block_elems: int, seq_len: int):
    """Ways to hand our block map to FlexAttention, best first: (label, BlockMask, kernel_options).

    Both carry a mask_mod reading the E-token map: compiled flex only visits the listed
    blocks and skips the mask_mod on blocks marked full, but eager flex (and any path
    that ignores the block lists) applies the mask_mod alone, so it must say the same.

    1. "blocks@E": the map itself at E-token granularity, every selected block marked
       full (the mask_mod is never evaluated). Inductor's default H100 tiles are 128
       rows, which do not divide E = 64, so for E = 64 we ask for 64x64 tiles; torch
       versions that check the backward's default config before these options reject
       64-token blocks in the backward, which makes this variant fail at E = 64, hence:
    2. "mask_mod@128" (E = 64): 128-token blocks, full where all four 64-blocks are
       selected, partial (mask_mod evaluated) where only some are.
    """
    from torch.nn.attention.flex_attention import BlockMask

    table = block_map

    def mask_mod(b, h, q_idx, kv_idx):
        return table[b, h, q_idx // block_elems, kv_idx // block_elems]

    counts, indices = selected_lists(block_map)
    variants = []
    options = None
    if block_elems < 128 and block_map.is_cuda:
        options = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64,
                   "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64}
    mask = BlockMask.from_kv_blocks(torch.zeros_like(counts), indices, counts, indices, BLOCK_SIZE=block_elems,
                                    mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))
    variants.append((f"blocks@{block_elems}", mask, options))

    B, H, nq, nk = block_map.shape
    if block_elems == 64 and nq % 2 == 0 and nk % 2 == 0:
        quads = block_map.view(B, H, nq // 2, 2, nk // 2, 2)
        full = quads.all(5).all(3)
        partial = quads.any(5).any(3) & ~full
        p_counts, p_indices = selected_lists(partial)
        f_counts, f_indices = selected_lists(full)
        mask = BlockMask.from_kv_blocks(p_counts, p_indices, f_counts, f_indices, BLOCK_SIZE=128,
                                        mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))
        variants.append(("mask_mod@128", mask, None))
    return variants


_compiled_flex = None


def flex_attention_fn(device: torch.device) -> Callable:
    """Compiled flex_attention on GPU (eager flex is a slow dense reference); eager on CPU,
    where it only has to run the plumbing check."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def make_flex(block_map: Tensor, block_elems: int, seq_len: int, try_fwd_bwd: Callable[[Callable], None]
              ) -> Tuple[Optional[str], Optional[Callable], List[str]]:
    """The first FlexAttention variant whose forward and backward run.

    `try_fwd_bwd(forward)` runs one forward + backward (and raises on failure).
    Returns (label, forward, reasons the earlier variants failed)."""
    flex = flex_attention_fn(block_map.device)
    failures = []
    for label, mask, options in flex_block_masks(block_map, block_elems, seq_len):
        if label in _failed_flex_variants:  # failed at another shape: do not pay its compile again
            failures.append(f"{label}: failed before, not retried")
            continue

        def forward(q, k, v, _mask=mask, _options=options):
            return flex(q, k, v, block_mask=_mask, kernel_options=_options)
        try:
            try_fwd_bwd(forward)
            return label, forward, failures
        except Exception as e:  # a compile or launch failure: try the next formulation
            if not isinstance(e, torch.cuda.OutOfMemoryError):  # memory may suffice at other shapes
                _failed_flex_variants.add(label)
            failures.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return None, None, failures


_failed_flex_variants: set = set()


def masked_reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, block_map: Tensor, block_elems: int):
    """(out, dq, dk, dv) of attention under the block map expanded to tokens, in fp32 (small shapes only)."""
    mask = block_map.repeat_interleave(block_elems, -2).repeat_interleave(block_elems, -1)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    grads = torch.autograd.grad(out, (q32, k32, v32), dout.float())
    return [out.detach()] + list(grads)


def sdpa_flash_dense(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


def fa4_dense() -> Tuple[Optional[Callable], Optional[str]]:
    """FlashAttention-4 forward on [B, H, S, D] views (it wants [B, S, H, D]; the harness
    hands it [B, S, H, D]-contiguous tensors viewed as [B, H, S, D], so no copy is timed).
    Returns (forward, None) or (None, why not)."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:
        return None, f"flash_attn.cute does not import ({type(e).__name__}: {e})"

    def forward(q, k, v):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return forward, None


def cudnn_bsa(block_map: Tensor, block_elems: int) -> Tuple[Optional[str], Optional[Callable], Optional[str]]:
    """cuDNN BSA forward (differentiable through its backward) on [B, H, S, D] tensors, for
    the block map's KV blocks. Returns (label, forward, None) or (None, None, why not).

    Its sparse block is 64 or 128 tokens: a 256-token block is 2x2 blocks of 128 (same
    FLOPs). Every row of the bench's map has the same count, so it runs with a fixed
    `block_sparse_num` and no `block_sizes` (all blocks full): the library's fastest form.
    The lists are built here, once, not timed."""
    try:
        from cudnn import BSA
    except Exception as e:
        return None, None, f"cudnn.BSA does not import ({type(e).__name__}: {e})"
    sparse = 64 if block_elems == 64 else 128
    table = block_map
    if block_elems > sparse:
        r = block_elems // sparse
        table = table.repeat_interleave(r, dim=-2).repeat_interleave(r, dim=-1)
    counts, indices = selected_lists(table)
    count = int(counts.max())
    if int(counts.min()) != count:
        return None, None, "cudnn-bsa peer: rows with different counts (the bench's maps have a fixed topk)"
    indices = indices[..., :count].contiguous()

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            res = BSA.block_sparse_attention_forward(q, k, v, indices, count, sparse_block_size=sparse)
            ctx.save_for_backward(q, k, v, res["o_tensor"], res["lse_tensor"])
            return res["o_tensor"]

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            res = BSA.block_sparse_attention_backward(dout.contiguous(), q, k, v, out, lse, indices, count,
                                                      sparse_block_size=sparse)
            return res["dq_tensor"], res["dk_tensor"], res["dv_tensor"]

    return f"cudnn-bsa (blk{sparse})", Attention.apply, None


def cudnn_version() -> Optional[str]:
    try:
        import cudnn
        return getattr(cudnn, "__version__", "installed (version unknown)")
    except Exception:
        return None


def fa4_version() -> Optional[str]:
    from importlib import metadata
    for dist in ("flash-attn-4", "flash_attn_4", "flash-attn", "flash_attn"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except Exception:
            continue
    try:
        import flash_attn
        return getattr(flash_attn, "__version__", "installed (version unknown)")
    except Exception:
        return None
