"""The mask_mod of the CuTe backend (imported only when FlashAttention-4 is present).

FA4 calls it, in "mask" (partly filled) KV tiles only, with (1,)-shaped Int32
TensorSSAs: batch, query head, query token, KV token; `aux_tensors[0]` is our int32
`[n_kv_blocks * E / 128]` array of valid tokens per 128-token KV sub-block. A KV token
is kept when it lies before its sub-block's count (padding sits at the tail of a block).

Kept in its own module, at module level and with no closure: FA4 keys its compile
cache on the source text of the function (flash_attn.cute.utils.hash_callable).
"""

import cutlass
import cutlass.cute as cute
from flash_attn.cute import utils as fa_utils


@cute.jit
def vsa_kv_tail_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    sub_counts = aux_tensors[0]
    tile = fa_utils.scalar_to_ssa(128, cutlass.Int32)
    sub_block = kv_idx // tile
    valid = fa_utils.scalar_to_ssa(sub_counts[sub_block[0]], cutlass.Int32)
    return kv_idx < sub_block * tile + valid
