"""cuDNN frontend's sm_90 blk64 backward as one CuTe DSL call, the same for both frontends.

cuDNN's torch wrapper (`api.block_sparse_attention_backward`, 1.32.0) runs two kernel classes for
64-token blocks: `BucketedK2QCsrUniversal` builds K-to-Q lists from the query-owned ones (in
buckets of query blocks), then `BlockSparseAttnBackwardSm90Blk64` (its preprocess, main kernel and
postprocess) writes dq, dk, dv. `Blk64Backward` calls both, constructed as the wrapper constructs
them, on buffers the caller owns: the torch eager launch compiles it for TVM-FFI calls with torch
tensors (`cudnn_backend.launch_cudnn_backward`), JAX as a cutlass_call (`vsa_jax.cudnn_call`). The
wrapper's per-call allocations are the backend's workspaces (`cudnn_backend.blk64_backward_workspaces`),
two of them zeroed by the caller before each call: the per-bucket counts and the dK / dV
accumulators of the fp32 workspace (`cudnn_backend.dkv_accumulators_start`).

Imported only where the backend runs (it imports cuDNN frontend's CuTe DSL classes).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cudnn.block_sparse_attention.csrc.bwd.bucketed_k2q_csr import BucketedK2QCsrUniversal
from cudnn.block_sparse_attention.csrc.bwd.sm90_blk64.bsa_bwd_sm90 import (BlockSparseAttnBackwardSm90Blk64,
                                                                           sm90_bwd_auto_bucketed_k2q_size_blocks)


def bucket_blocks(n_q_blocks: int) -> int:
    """Query blocks per K-to-Q bucket: cuDNN's own rule for sm_90."""
    return int(sm90_bwd_auto_bucketed_k2q_size_blocks(n_q_blocks))


class Blk64Backward:
    """dq, dk, dv of cuDNN's sm_90 blk64 backward: the K-to-Q lists from `sel_idx` / `sel_num`
    (per-row counts; lists of width `capacity`), then the backward kernel. Token tensors are
    [B, H, S, D] views, lse [B, H, Sq] (natural log), block_sizes [B, nKV]."""

    def __init__(self, dtype, head_dim: int, capacity: int, bucket: int):
        self.lists = BucketedK2QCsrUniversal(capacity, bucket, True, capacity, True)
        self.kernel = BlockSparseAttnBackwardSm90Blk64(dtype, head_dim, head_dim)

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
                 dout: cute.Tensor, dq: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, sel_idx: cute.Tensor,
                 sel_num: cute.Tensor, block_sizes: cute.Tensor, counts: cute.Tensor, local_offsets: cute.Tensor,
                 group_totals: cute.Tensor, offsets: cute.Tensor, cursors: cute.Tensor, indices: cute.Tensor,
                 workspace: cute.Tensor, softmax_scale: cutlass.Float32, stream):
        self.lists(counts, local_offsets, group_totals, offsets, cursors, indices, sel_idx, sel_num, stream)
        problem_shape = (q.shape[2], k.shape[2], q.shape[3], (q.shape[1], q.shape[0]))
        self.kernel(problem_shape, dout, o, q, k, v, lse, dq, dk, dv, offsets, indices, block_sizes, workspace,
                    softmax_scale, stream)
