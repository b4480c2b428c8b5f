"""The sm90 backward's query groups (`sm90_bwd64`'s module docstring, "Query groups"): how many groups a
problem has and the workspaces they use. Plain Python, no CuTe DSL: the backend's workspace table
(`sm90_backend.workspaces`) reads it where the DSL is not installed (recording a plan on a CPU)."""

from __future__ import annotations

BLOCK = 64  # tokens per query / KV block
# what one query block brings into L2 (Q and dO tiles in 16 bits, its fp32 dQ accumulator) per
# head-dim column and row
GROUP_BYTES_PER_ELEMENT = 2 + 2 + 4
# the grid's chunk: the CTAs resident at once (one per SM), at most CHUNK_MAX (an H100 / H200's 132
# SMs); the partial sums live in a ring of RING_CHUNKS chunks' slots
CHUNK_MAX = 132
RING_CHUNKS = 2
# group_flags' row after the ring's counters: the persistent kernel's next tile
TILE_COUNTER_ROW = RING_CHUNKS * CHUNK_MAX


def group_blocks(q_group_bytes: int, head_dim: int) -> int:
    """The most query blocks a group may hold under a working-set budget of q_group_bytes (0: no
    groups, one CTA per KV block walks the whole list)."""
    if q_group_bytes <= 0:
        return 0
    return max(1, q_group_bytes // (BLOCK * head_dim * GROUP_BYTES_PER_ELEMENT))


def group_count(n_q, max_blocks):
    """Groups of at most max_blocks query blocks over n_q (host ints or the kernel's Int32s)."""
    return (n_q + max_blocks - 1) // max_blocks


def groups_of(n_q: int, head_dim: int, q_group_bytes: int) -> int:
    """How many query groups a problem of n_q query blocks has (1: none)."""
    blocks = group_blocks(q_group_bytes, head_dim)
    return group_count(n_q, blocks) if blocks else 1


def group_workspace_shapes(n_q: int, head_dim: int, q_group_bytes: int) -> dict:
    """The query groups' workspaces, independent of batch, heads and KV length: `dkv_partial`
    (fp32, flat: a ring of RING_CHUNKS chunks of CHUNK_MAX KV blocks, per block a 64 x D slot of dV
    and of dK for each group before the last; 4 elements when there is one group, never read) and
    `group_flags` (int32 [RING_CHUNKS * CHUNK_MAX + 1, 2]: the ring slots' counters, for dV and for
    dK, then the persistent kernel's tile counter at [TILE_COUNTER_ROW, 0]; zeroed before each
    launch that reads them, `flags_in_use`)."""
    groups = groups_of(n_q, head_dim, q_group_bytes)
    partial = (groups - 1) * TILE_COUNTER_ROW * 2 * BLOCK * head_dim if groups > 1 else 4
    return dict(dkv_partial=((partial,), "float32"), group_flags=((TILE_COUNTER_ROW + 1, 2), "int32"))


def flags_in_use(n_q: int, head_dim: int, q_group_bytes: int, persistent: bool) -> bool:
    """Whether a launch reads `group_flags` (so must find them zeroed): with more than one query group
    (the ring's counters) or persistent (the tile counter). Otherwise it never touches them."""
    return persistent or groups_of(n_q, head_dim, q_group_bytes) > 1
