"""The public functions' docstrings, written once for both frontends.

Each text names what differs between the frontends through a few fields (`FRONTENDS`): the
word for their arrays, what may hold the counts, and what happens to values that cannot be
read before launch (under torch.compile, or traced under jax.jit). A frontend attaches the
text to its function with `documented(name, frontend)`.
"""

from __future__ import annotations

from .backends import names_text

FRONTENDS = {
    "torch": dict(
        arrays="tensors",
        count_kinds="arrays (numpy, torch or lists)",
        count_values=("eager calls raise ValueError otherwise; under torch.compile they are not checked and act "
                      "as clamped to [0, E]"),
        prefix_static="a Python int, static",
        scale_static=", static: under torch.compile each value compiles its own graph",
        scale_static_short="",
        statics="",
        list_values=("Eager calls check the values and raise ValueError naming `block_indices` / `block_counts` "
                     "(a CUDA pair is checked on the device once, then again only after it is modified). Under "
                     "torch.compile nothing is checked"),
        offsets=("device (no host sync in the kernels; eager calls check their values once per tensor)."),
        seq_prefix=("an int (every sequence's first blocks) or one count per sequence (an integer tensor [N], "
                    "read on the device like the offsets"),
        own_sequence=("eagerly anything else raises ValueError; under torch.compile such entries are ignored "
                      "(never attended)"),
        pack=("blocks (Python ints, e.g. the lengths of its `variable_block_sizes`). Device ops only."),
        package_title="PyTorch frontend of Video Sparse Attention.",
        package_transforms="",
        package_cpu="CPU tensors run",
        package_clamp="",
        tiled_padding="",
        tiled_error="",
    ),
    "jax": dict(
        arrays="arrays",
        count_kinds="numpy or JAX arrays (or lists)",
        count_values=("concrete values raise ValueError otherwise; traced ones are not checked and act as "
                      "clamped to [0, E]"),
        prefix_static="a Python int",
        scale_static="",
        scale_static_short=", static",
        statics=("\n    `topk`, `block_size`, `backend`, `prefix_blocks`, `prefix_mode`, `softmax_scale` and "
                 "`padding`\n    are static (Python values, not traced)."),
        list_values=("Concrete lists (numpy, or jax.Arrays outside jit) are checked and bad values raise "
                     "ValueError naming `block_indices` / `block_counts` (a jax.Array once: it is immutable). "
                     "Traced lists are not checked"),
        offsets=("device and may be traced under jax.jit (N and the totals are static shapes), so one compiled "
                 "step serves every packing of the same totals; their values are checked when they are concrete."),
        seq_prefix=("an int (every sequence's first blocks, static) or one count per sequence (an integer array "
                    "[N], which may be traced like the offsets"),
        own_sequence=("with concrete arguments anything else raises ValueError; under jit such entries are "
                      "ignored (never attended)"),
        pack="blocks (Python ints). Traceable (no host values needed but the static shapes).",
        package_title="JAX frontend of Video Sparse Attention (same functions and arguments as vsa_torch).",
        package_transforms="""
Works under jax.jit, jax.grad / jax.vjp (gradients to q, k, v and the gate) and
jax.vmap, and over several devices: inside jax.shard_map (each device runs its shard),
and under jax.jit on arrays sharded over the batch and/or heads with explicit mesh axes
(`jax.make_mesh`'s default), where the call is split per device (see vsa_jax/spmd.py).
Arguments are checked at trace time and raise the same ValueError / TypeError as
vsa_torch; the values of the counts ([0, E]) and of index lists are checked when they are
concrete (numpy or a jax.Array outside jit). Traced values are not checked; the kernels
bound them instead (out-of-range counts act as clamped to [0, E]; index lists: see
`block_sparse_attn_from_indices`), so no value reads out of bounds.
""",
        package_cpu="Arrays on the CPU run",
        package_clamp=" `topk` larger than the number of KV blocks is clamped to it.",
        tiled_padding=" (zero padding)",
        tiled_error=" (at trace time under jit: the shapes are static)",
    ),
}

DOCS = {
    "video_sparse_attn": """Video Sparse Attention on `[B, H, S, D]` {arrays} (a drop-in for FastVideo's).

    q: `[B, H, Sq, D]`; k, v: `[B, H, Skv, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`),
    bf16 or fp16 (all the same dtype), head dim D 64 or 128, Sq and Skv multiples of the
    block's token count E (64, 128 or 256; they may differ). Tokens are in tile order:
    block i is tile i of `build_vsa_metadata`, its `variable_block_sizes[i]` valid tokens
    first, then padding (`to_tiled` / `from_tiled` convert from / to raw (t, h, w) order).
    `variable_block_sizes` counts the valid tokens of each KV block (length Skv / E),
    `q_variable_block_sizes` those of each query block (length Sq / E); for
    self-attention on one video pass `meta.variable_block_sizes` as both.
    `compress_attn_weight` (the gate): q's shape and dtype, or None.
    Returns out: q's shape and dtype, `[B, H, Sq, D]`, in tile order.

    Coarse branch: attention between block means; selection: for each query block the
    `topk` KV blocks with the highest coarse scores; fine branch: attention restricted
    to the selected blocks' valid tokens. Returns out_coarse * compress_attn_weight +
    out_fine (out_coarse + out_fine without a gate). Differentiable in q, k, v and the gate.

    `padding`, what the rows of a block past its count mean:
    - "zeros" (the default): FastVideo's function exactly, gradients included. The padded
      rows of q, k, v and the gate must hold zeros (`to_tiled` writes them): a block mean
      is the sum of all E rows divided by the valid count, so its gradient reaches every
      row of the block; padded query rows are computed like any row (their output is
      out_fine + gate * out_coarse, and `dout` there counts); padded KV rows are masked as
      keys and get only the pooling gradient.
    - "ignore": the padded rows are never read, whatever they hold (NaN and inf included:
      a reused or uninitialised buffer); the padded output rows are exactly 0 (`dout` there
      is ignored) and every padded row of the gradients is exactly 0. The cute and cudnn
      backends then copy the {arrays} they read with the padded rows zeroed (K, V forward;
      Q, K, V, dout backward).
    With zeros in the padding both give the same valid output rows.

    `topk` (an int >= 1) larger than the number of KV blocks is clamped to it (every
    non-empty block is then selected); empty blocks (count 0) are never selected, so a
    row may get fewer than `topk`. Ranking uses the coarse scores rounded to the input
    dtype as FastVideo computes them (the block means' dot rounded, times softmax_scale,
    rounded again), ties to the lower block index. `block_size`: E as an int, or the (t, h, w) tile of
    `build_vsa_metadata` (ints; t*h*w must be 64, 128 or 256). Counts: 1-D integer
    {count_kinds}, values in [0, E].
    `backend`: {backend_names} (VSA_BACKEND in the environment replaces "auto").
    `variable_block_sizes` / `q_variable_block_sizes` values must lie in [0, E]:
    {count_values} (above E a full block, below 0 an empty one).
    `prefix_blocks` ({prefix_static}), `prefix_mode`: mixed modality (joint attention
    over `[text | ... | video]`, Sq == Skv): the first `prefix_blocks` blocks hold the
    non-video tokens. Their query blocks attend every non-empty KV block; a video query
    block attends, with "exempt", every prefix block plus its top-`topk` video blocks, with
    "compete", its top-(`topk` + `prefix_blocks`) blocks of all. Coarse branch and gate as
    without a prefix (`vsa_core.reference.prefix_topk_mask`).
    `softmax_scale` (a positive finite Python float{scale_static}; None: 1/sqrt(D), as in
    FastVideo, flash-attn and SDPA) multiplies the scores q k^T before the softmax. One scale
    serves both branches, as in FastVideo: the coarse attention between the block means (and
    so the scores the top-k ranks) and the fine attention.{statics}
    """,
    "video_sparse_attn_bshd": """`video_sparse_attn` on `[B, S, H, D]` {arrays} (no transpose is made).""",
    "block_sparse_attn": """Attention of each query block to the KV blocks set in `block_map` (bool
    `[B, H, nQ, nKV]`), restricted to their valid tokens, on the scores q k^T times
    `softmax_scale` (a positive finite Python float{scale_static_short}; None: 1/sqrt(D)). Returns
    (out, lse): lse is the natural-log logsumexp of the scaled scores, fp32 `[B, H, Sq]` (-inf
    for a query block with nothing selected). Gradients flow through out (lse is not
    differentiable). Every query row is computed; the padded KV rows (past
    `variable_block_sizes`) are masked as keys and get zero gradients. `padding="zeros"`
    (FastVideo's kernels) still multiplies them by zero weights, so they must be finite;
    "ignore" never reads them (NaN / inf there change nothing).""",
    "block_sparse_attn_from_indices": """`block_sparse_attn` with the selection given as lists: `block_indices`
    `[B, H, nQ, capacity]` int32 holds, for each query block, `block_counts[b, h, i]`
    strictly ascending KV block indices (entries past the count are ignored);
    `softmax_scale` as in `block_sparse_attn`.

    {list_values}, and the kernels never read out of bounds: a count is clamped to
    [0, capacity], and an entry counts only if it is in [0, nKV) and greater than the last
    counted entry of its row (repeats and entries out of order are dropped;
    `vsa_core.reference.index_lists_to_block_map`), in the forward and the backward alike.""",
    "video_sparse_attn_varlen": """VSA over packed variable-length sequences, one call for all of them.

    q, compress_attn_weight: `[total_q, H, D]`; k, v: `[total_k, H, D]`: the sequences one
    after the other, each in its own tile order and padded to whole blocks. `cu_seqlens_q`,
    `cu_seqlens_k`: int32 `[N + 1]` token offsets (0, ..., total; multiples of the block's
    token count E). The counts cover every block of the packed stream (length total / E).
    Sequence i's queries see only sequence i's keys: its own coarse attention, its own
    top-k (at most its number of non-empty KV blocks), its own fine attention, i.e. the
    result of `video_sparse_attn_bshd` on each sequence alone. The offsets are read on the
    {offsets}
    `prefix_blocks`: {seq_prefix}; a sequence with a prefix has as many query as KV blocks);
    `prefix_mode`, `softmax_scale` and `padding` as in `video_sparse_attn`.
    """,
    "block_sparse_attn_varlen": """Block-sparse attention over packed sequences (the packing of
    `video_sparse_attn_varlen`) with the selection as a bool `[H, nQ, nKV]` map over the
    packed blocks (nQ = total_q / E, nKV = total_k / E). A query block may select only blocks
    of its own sequence: {own_sequence}. Returns (out `[total_q, H, D]`, lse fp32
    `[H, total_q]`); `softmax_scale` and `padding` as in `block_sparse_attn`.""",
    "block_sparse_attn_varlen_from_indices": """`block_sparse_attn_varlen` with the selection as lists: `block_indices` int32
    `[H, nQ, capacity]` holds, for each query block of the packed stream, `block_counts[h, i]`
    ascending indices of KV blocks of the packed stream (of its own sequence; entries past
    the count are ignored); `softmax_scale` as in `block_sparse_attn`.""",
    "pack_block_indices": """Per-sequence index lists (FastVideo's `q2k_idx_list` / `q2k_num_list`: `[1, H, nQ_i, C_i]`
    or `[H, nQ_i, C_i]` local KV block indices and `[1, H, nQ_i]` / `[H, nQ_i]` counts) -> the
    packed lists of `block_sparse_attn_varlen_from_indices` (`[H, nQ, max C_i]` indices into the
    packed KV blocks, `[H, nQ]` counts). `kv_blocks_per_sequence`: each sequence's number of KV
    {pack}""",
    "to_tiled": """Raw (T, H, W row-major) tokens along `dim` -> padded tile-contiguous order{tiled_padding}.

    x holds `meta.num_tokens` tokens along `dim` (the default -2 fits `[B, H, S, D]`; use
    dim=1 for `[B, S, H, D]`, dim=0 for packed `[S, H, D]`); the result holds
    `meta.padded_len` (each tile's valid tokens first, zeros after them). Another length
    raises ValueError{tiled_error}.""",
    "from_tiled": """Padded tile-contiguous order along `dim` -> raw token order (padding dropped).

    x holds `meta.padded_len` tokens along `dim` (default -2: `[B, H, S, D]`; dim=1 for
    `[B, S, H, D]`); the result holds `meta.num_tokens`. Another length raises ValueError.""",
}


PACKAGE = """{package_title}

    from {package} import video_sparse_attn
    out = video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk=32,
                            block_size=(4, 4, 4), compress_attn_weight=gate)

q, k, v are `[B, H, S, D]` (`video_sparse_attn_bshd`: `[B, S, H, D]`) in tile-contiguous
token order (see `build_vsa_metadata` / `to_tiled` / `from_tiled`), bf16 or fp16, D 64
or 128; S is a multiple of the block's token count E (64, 128 or 256).
{package_transforms}
{package_cpu} the same Triton kernels under Triton's interpreter (slow; for tests and
small checks; a warning says so once per process).{package_clamp} The top-k ranks the coarse
scores rounded to the input dtype, as FastVideo does (ties to the lower block index).
"""


def package_doc(frontend: str) -> str:
    """The docstring of the frontend's package ("torch" / "jax")."""
    return PACKAGE.format(**FRONTENDS[frontend], package=f"vsa_{frontend}")


def documented(frontend: str):
    """A decorator that gives a public function of `frontend` ("torch" / "jax") its text."""
    words = FRONTENDS[frontend]

    def attach(fn):
        fn.__doc__ = DOCS[fn.__name__].format(**words, backend_names=names_text())
        return fn
    return attach
