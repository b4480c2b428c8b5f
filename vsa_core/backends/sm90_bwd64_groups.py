"""The sm90 backward's query groups (`sm90_bwd64`'s module docstring, "Query groups"): how many groups a
problem has and the workspaces they use. Plain Python, no CuTe DSL: the backend's workspace table
(`sm90_backend.workspaces`) reads it where the DSL is not installed (recording a plan on a CPU)."""

from __future__ import annotations

BLOCK = 64  # tokens per query / KV block
# what one query block brings into L2 (Q and dO tiles in 16 bits, its fp32 dQ accumulator) per
# head-dim column and row
GROUP_BYTES_PER_ELEMENT = 2 + 2 + 4
# the grid's chunk: the CTAs resident at once (one per SM), at most CHUNK_MAX (an H100 / H200's 132
# SMs); the partial sums live in a ring of RING_CHUNKS chunks' slots (head_sweep: of one head's KV
# blocks, its chunk)
CHUNK_MAX = 132
RING_CHUNKS = 2


def ring_slots(n_kv: int, head_sweep: bool) -> int:
    """The partial sums' ring: a slot per KV block of RING_CHUNKS chunks, or of one head when the grid
    sweeps heads (its chunk is a head's KV blocks, `sm90_bwd64_split._tile`)."""
    return n_kv if head_sweep else RING_CHUNKS * CHUNK_MAX


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


def group_workspace_shapes(n_q: int, n_kv: int, head_dim: int, q_group_bytes: int, head_sweep: bool = False) -> dict:
    """The query groups' workspaces, independent of batch and heads: `dkv_partial` (fp32, flat: the
    ring's slots, `ring_slots`, per slot a 64 x D tile of dV and of dK for each group before the last;
    4 elements when there is one group, never read) and `group_flags` (int32 [slots + 1, 2]: the
    ring slots' counters, for dV and for dK, then the persistent kernel's tile counter in the last
    row; zeroed before each launch that reads them, `flags_in_use`). The kernel takes the ring's size
    from group_flags' rows."""
    groups = groups_of(n_q, head_dim, q_group_bytes)
    slots = ring_slots(n_kv, head_sweep)
    partial = (groups - 1) * slots * 2 * BLOCK * head_dim if groups > 1 else 4
    return dict(dkv_partial=((partial,), "float32"), group_flags=((slots + 1, 2), "int32"))


def flags_in_use(n_q: int, head_dim: int, q_group_bytes: int, persistent: bool) -> bool:
    """Whether a launch reads `group_flags` (so must find them zeroed): with more than one query group
    (the ring's counters) or persistent (the tile counter). Otherwise it never touches them."""
    return persistent or groups_of(n_q, head_dim, q_group_bytes) > 1
