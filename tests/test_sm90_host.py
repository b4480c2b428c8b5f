"""The sm90 kernels' host launchers (`sm90_fwd64.prepare_forward64`, `sm90_bwd64_launch.prepare_backward64`):
what is kept per problem and per configuration, and what each launch passes.

CPU (needs nvidia-cutlass-dsl; no GPU, no TVM-FFI): the compile step and torch's current-stream
query are stubbed, so these check the host code's keys and arguments, not the kernels. A launch
calls the compiled function with the torch tensors themselves; the checks run once per problem
(shape, strides, dtype, device, 16-byte alignment of every tensor, the options) and the kernels
are compiled once per configuration and dtype (their layouts are run-time values), so:
- the same problem on other buffers reuses both and passes the new buffers;
- another shape or layout runs the checks again and reuses the build;
- a misaligned start runs the checks again (and fails them), never a plan made for aligned ones;
- another dtype or configuration compiles again.
"""

import types

import pytest
from common import record_compiles

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

from vsa_core.backends import sm90_backend, sm90_bwd64_groups, sm90_bwd64_launch, sm90_fwd64  # noqa: E402

B, H, S, D, E, K = 1, 2, 256, 128, 64, 2
NB = S // E
SEVERAL_GROUPS = 64 * D * 8  # one query block per group (`sm90_bwd64_groups.group_blocks`)


def _flags(config, dtype=torch.int32):
    """group_flags as `config`'s launch needs them (ones: a launch that reads them zeroes them)."""
    shape = sm90_bwd64_groups.group_workspace_shapes(NB, NB, D, config.get("q_group_bytes", 0),
                                                     config.get("head_sweep", False))["group_flags"][0]
    return torch.ones(shape, dtype=dtype)


@pytest.fixture
def stubbed(monkeypatch):
    """Fresh caches, the compile recorded instead of run, torch's current stream a stand-in."""
    compiled = []
    compile_for_torch = record_compiles(compiled)

    for mod in (sm90_fwd64, sm90_bwd64_launch):
        monkeypatch.setattr(mod, "_COMPILED", {})
        monkeypatch.setattr(mod, "_PLANS", {})
        monkeypatch.setattr(mod, "compile_for_torch", compile_for_torch)
        monkeypatch.setattr(mod, "cute_tensor", lambda t, align=16: (t, align))
    monkeypatch.setattr(sm90_bwd64_launch, "grid_chunk", lambda device_ordinal: 132)  # no CUDA driver here
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=7))
    return compiled


def _counting(monkeypatch, mod, name):
    """Counts the calls of mod.name (the checks)."""
    calls = []
    real = getattr(mod, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(mod, name, counted)
    return calls


def _tok(dtype=torch.bfloat16, seq=S, layout="bhsd", batch=B):
    if layout == "bshd":
        return torch.zeros(batch, seq, H, D, dtype=dtype).transpose(1, 2)
    return torch.zeros(batch, H, seq, D, dtype=dtype)


def _forward_args(dtype=torch.bfloat16, seq=S, layout="bhsd", batch=B):
    nb = seq // E
    args = [_tok(dtype, seq, layout, batch) for _ in range(4)]
    args += [torch.zeros(batch, H, seq), torch.zeros(batch, H, nb, K, dtype=torch.int32),
             torch.zeros(batch, H, nb, dtype=torch.int32), torch.full((nb,), E, dtype=torch.int32)]
    coarse = dict(q_counts=torch.full((nb,), E, dtype=torch.int32), out_coarse=torch.zeros(batch, H, nb, D),
                  gate=_tok(dtype, seq, layout, batch), out_fine=torch.zeros(batch, H, seq, D))
    return args, coarse


def _misaligned(t):
    """t's values at a start 8 bytes past a 16-byte boundary (same shape, strides, dtype)."""
    skip = 8 // t.element_size()
    flat = torch.zeros(t.numel() + 16, dtype=t.dtype)
    assert flat.data_ptr() % 16 == 0
    return flat[skip:skip + t.numel()].view(t.shape)


def test_forward_same_problem_reuses_checks_and_build_and_passes_the_new_buffers(stubbed, monkeypatch):
    checks = _counting(monkeypatch, sm90_fwd64, "_check_forward64")
    for _ in range(3):
        args, coarse = _forward_args()
        sm90_fwd64.prepare_forward64(*args, **coarse, softmax_scale=0.25, **sm90_backend.FORWARD)()
    assert len(checks) == 1 and len(stubbed) == 1
    fn = stubbed[0]
    assert len(fn.calls) == 3
    call = fn.calls[-1]
    tensors, (scale, stream) = call[:14], call[14:]
    q, k, v, out, lse, sel_idx, sel_num, kv_counts = args
    assert [t is x for t, x in zip(tensors[:8], args)] == [True] * 8  # this call's own buffers, no copy
    assert tensors[8] is coarse["q_counts"] and tensors[9] is coarse["gate"]
    assert tensors[10] is coarse["out_coarse"] and tensors[11] is coarse["out_fine"]
    assert tensors[12] is sel_idx and tensors[13] is sel_num  # shared_kv's unions: placeholders
    assert scale == 0.25 and type(scale) is float and int(stream) == 7
    assert [a for _, a in fn.examples] == [16, 16, 16, 16, 4, 4, 4, 4, 4, 16, 4, 16, 4, 4]  # gate, out_fine: 16


def test_forward_placeholders_without_the_coarse_branch(stubbed):
    args, _ = _forward_args()
    sm90_fwd64.prepare_forward64(*args, **sm90_backend.FORWARD)()
    q, k, v, out, lse, sel_idx, sel_num, kv_counts = args
    call = stubbed[0].calls[0]
    assert call[8] is sel_num and call[9] is q and call[10] is lse and call[11] is lse
    assert call[14] == pytest.approx(D ** -0.5)
    # the compile saw the same arguments, with TMA / vector operands at 16 bytes, the rest (the absent
    # gate's and out_fine's placeholders too) at 4
    assert [a for _, a in stubbed[0].examples] == [16] * 4 + [4] * 10
    assert [t is x for (t, _), x in zip(stubbed[0].examples, call[:14])] == [True] * 14


@pytest.mark.parametrize("change", ["batch", "sequence length", "bshd strides"])
def test_forward_new_shape_or_strides_checks_again_and_reuses_the_build(stubbed, monkeypatch, change):
    checks = _counting(monkeypatch, sm90_fwd64, "_check_forward64")
    args, coarse = _forward_args()
    sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)()
    kw = {"batch": dict(batch=2 * B), "sequence length": dict(seq=2 * S), "bshd strides": dict(layout="bshd")}
    args, coarse = _forward_args(**kw[change])  # another batch: the same strides (contiguous BHSD)
    sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)()
    assert len(checks) == 2 and len(stubbed) == 1 and len(stubbed[0].calls) == 2
    assert stubbed[0].calls[1][0] is args[0]


def test_forward_misaligned_start_is_checked_not_taken_for_a_known_problem(stubbed):
    args, coarse = _forward_args()
    sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)()
    args, coarse = _forward_args()
    args[1] = _misaligned(args[1])
    with pytest.raises(ValueError, match="16-byte aligned start"):
        sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)
    assert len(stubbed[0].calls) == 1


def test_forward_bad_shape_is_checked_not_taken_for_a_known_problem(stubbed):
    args, coarse = _forward_args()
    sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)()
    args, coarse = _forward_args()
    args[5] = torch.zeros(B + 1, H, NB, K, dtype=torch.int32)  # sel_idx of another batch (the same strides)
    with pytest.raises(ValueError, match="sel_idx"):
        sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)


@pytest.mark.parametrize("change", ["dtype", "configuration", "epilogue"])
def test_forward_dtype_or_configuration_compiles_again(stubbed, change):
    args, coarse = _forward_args()
    sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)()
    config = dict(sm90_backend.FORWARD)
    if change == "dtype":
        args, coarse = _forward_args(dtype=torch.float16)
    elif change == "configuration":
        config["lazy_rescale"] = False
    else:
        del coarse["out_fine"]
    sm90_fwd64.prepare_forward64(*args, **coarse, **config)()
    assert len(stubbed) == 2 and len(stubbed[1].calls) == 1
    assert stubbed[1].examples[0][0].dtype == args[0].dtype


# ---- the backward ------------------------------------------------------------------------------
def _backward_args(dtype=torch.bfloat16, seq=S, layout="bhsd", pools=True):
    nb = seq // E
    toks = dict(q=_tok(dtype, seq, layout), k=_tok(dtype, seq, layout), v=_tok(dtype, seq, layout),
                dout=_tok(dtype, seq, layout))
    args = [toks["q"], toks["k"], toks["v"], toks["dout"], torch.zeros(B, H, seq), torch.zeros(B, H, seq),
            _tok(dtype, seq, layout), _tok(dtype, seq, layout), _tok(dtype, seq, layout),
            torch.zeros(B, H, nb, nb, dtype=torch.int32), torch.zeros(B, H, nb, dtype=torch.int32),
            torch.full((nb,), E, dtype=torch.int32)]
    kw = dict(dq_accum=torch.zeros(B, H, nb, E * D))
    if pools:
        kw.update(dq_pool=torch.zeros(B, H, nb, D), dk_pool=torch.zeros(B, H, nb, D), dv_pool=torch.zeros(B, H, nb, D),
                  q_counts=torch.full((nb,), E, dtype=torch.int32))
    return args, kw


def test_backward_same_problem_reuses_checks_and_build_and_passes_the_new_buffers(stubbed, monkeypatch):
    checks = _counting(monkeypatch, sm90_bwd64_launch, "_check_backward64")
    for _ in range(3):
        args, kw = _backward_args()
        kw["dq_accum"].fill_(1.0)
        kw["group_flags"] = _flags(sm90_backend.BACKWARD)
        sm90_bwd64_launch.prepare_backward64(*args, **kw, softmax_scale=0.5, **sm90_backend.BACKWARD)()
        assert not kw["dq_accum"].any()  # zeroed by every launch, before the main kernel
        assert kw["group_flags"].all()  # one query group, not persistent: the kernel never reads the flags
    assert len(checks) == 1 and len(stubbed) == 2  # the main kernel and the dQ postprocess
    main, post = stubbed
    q, k, v, dout, lse, delta, dq, dk, dv, inv_idx, inv_num, kv_counts = args
    m, p = main.calls[-1], post.calls[-1]
    assert [t is x for t, x in zip(m[:9], (q, k, v, dout, lse, delta, kw["dq_accum"], dk, dv))] == [True] * 9
    assert m[9] is inv_idx and m[10] is inv_num and m[11] is kv_counts
    assert m[12] is kw["dk_pool"] and m[13] is kw["dv_pool"] and m[15] is kw["group_flags"]
    chunk = NB if sm90_backend.BACKWARD.get("head_sweep") else 132  # a head's KV blocks, or the device's
    assert m[14].dtype == torch.float32 and m[16] == 0.5 and m[17] == chunk  # dkv_partial, scale, the grid chunk
    assert p[0] is kw["dq_accum"] and p[1] is dq and p[2] is kw["dq_pool"] and p[3] is kw["q_counts"] and p[4] == 0.5
    assert [a for _, a in main.examples] == [16] * 9 + [4] * 5 + [16, 4]
    assert [a for _, a in post.examples] == [16, 16, 4, 4]


@pytest.mark.parametrize("options", [dict(persistent=True), dict(q_group_bytes=SEVERAL_GROUPS)],
                         ids=["persistent", "several-groups"])
def test_backward_zeroes_the_flags_where_the_kernel_reads_them(stubbed, options):
    """The persistent kernel's tile counter and the query groups' ring counters start at zero on
    every launch."""
    config = dict(sm90_backend.BACKWARD, **options)
    if options.get("persistent"):
        config["head_sweep"] = False  # (they do not go together)
    for _ in range(2):
        args, kw = _backward_args()
        kw["group_flags"] = _flags(config)
        if "q_group_bytes" in options:
            shape = sm90_bwd64_groups.group_workspace_shapes(NB, NB, D, options["q_group_bytes"],
                                                             config.get("head_sweep", False))
            kw["dkv_partial"] = torch.zeros(shape["dkv_partial"][0])
        sm90_bwd64_launch.prepare_backward64(*args, **kw, **config)()
        assert not kw["group_flags"].any()


@pytest.mark.parametrize("change, message", [
    (dict(group_flags=torch.zeros(8, 2, dtype=torch.int32)), "group_flags"),
    (dict(group_flags=_flags(sm90_backend.BACKWARD, torch.float32)), "group_flags"),
    (dict(q_group_bytes=SEVERAL_GROUPS, dkv_partial=torch.zeros(4)), "dkv_partial"),
    (dict(dkv_partial=torch.zeros(4, dtype=torch.float64)), "dkv_partial"),
    (dict(head_sweep=False, grid_chunk_blocks=0), "grid_chunk_blocks"),
    (dict(head_sweep=False, grid_chunk_blocks=133), "grid_chunk_blocks"),
    (dict(head_sweep=True, grid_chunk_blocks=2), "head_sweep"),
    (dict(head_sweep=True, persistent=True), "persistent"),
    (dict(q_group_bytes=SEVERAL_GROUPS, list_in_smem=True), "list_in_smem"),
    (dict(head_sweep=False, persistent=True, q_group_bytes=0, list_in_smem=True), "list_in_smem"),
] + [(dict(split=False, **{name: SEVERAL_GROUPS if name == "q_group_bytes" else True}), "split")
     for name in sm90_bwd64_launch.SPLIT_OPTIONS],
    ids=["flags-shape", "flags-dtype", "partial-shape", "partial-dtype", "chunk-0", "chunk-133", "sweep-chunk",
         "sweep-persistent", "groups-list-window", "persistent-list-window"]
    + [f"{name}-not-split" for name in sm90_bwd64_launch.SPLIT_OPTIONS])
def test_backward_bad_workspace_or_configuration_names_it(stubbed, change, message):
    args, kw = _backward_args()
    options = dict(sm90_backend.BACKWARD)
    if not change.get("split", True):  # the one option under test, on the one-warpgroup kernel
        options = dict(stages=2)
    for name, value in change.items():
        (kw if name in ("group_flags", "dkv_partial") else options)[name] = value
    with pytest.raises(ValueError, match=message):
        sm90_bwd64_launch.prepare_backward64(*args, **kw, **options)()


def test_backward_new_layout_checks_again_and_reuses_the_build(stubbed, monkeypatch):
    checks = _counting(monkeypatch, sm90_bwd64_launch, "_check_backward64")
    for layout in ("bhsd", "bshd"):
        args, kw = _backward_args(layout=layout)
        sm90_bwd64_launch.prepare_backward64(*args, **kw, **sm90_backend.BACKWARD)()
    assert len(checks) == 2 and len(stubbed) == 2 and len(stubbed[0].calls) == 2


def test_backward_misaligned_start_is_checked_not_taken_for_a_known_problem(stubbed):
    args, kw = _backward_args()
    sm90_bwd64_launch.prepare_backward64(*args, **kw, **sm90_backend.BACKWARD)()
    args, kw = _backward_args()
    args[4] = _misaligned(args[4])  # lse: read by bulk copies
    with pytest.raises(ValueError, match="16-byte aligned start"):
        sm90_bwd64_launch.prepare_backward64(*args, **kw, **sm90_backend.BACKWARD)


@pytest.mark.parametrize("change", ["dtype", "pooling gradients", "ignore padding"])
def test_backward_dtype_or_configuration_compiles_again(stubbed, change):
    args, kw = _backward_args()
    sm90_bwd64_launch.prepare_backward64(*args, **kw, **sm90_backend.BACKWARD)()
    extra = {}
    if change == "dtype":
        args, kw = _backward_args(dtype=torch.float16)
    elif change == "pooling gradients":
        args, kw = _backward_args(pools=False)
    else:
        extra = dict(ignore_padding=True)
    sm90_bwd64_launch.prepare_backward64(*args, **kw, **extra, **sm90_backend.BACKWARD)()
    assert len(stubbed) == 4 and len(stubbed[2].calls) == 1


def test_forward_broadcast_dim_compiles_again(stubbed):
    """A zero stride stays static in a CuTe tensor's type: a gate broadcast over the batch gets a build
    of its own, and a build made for it is not taken for a gate with a real batch stride."""
    for broadcast in (False, True, False):
        args, coarse = _forward_args(batch=2)
        if broadcast:
            coarse["gate"] = _tok(batch=1).expand(2, H, S, D)
        sm90_fwd64.prepare_forward64(*args, **coarse, **sm90_backend.FORWARD)()
    assert len(stubbed) == 2 and [len(fn.calls) for fn in stubbed] == [2, 1]
    assert stubbed[1].examples[9][0].stride(0) == 0


def test_backward_broadcast_dim_compiles_again(stubbed):
    for broadcast in (False, True):
        args, kw = _backward_args()
        if broadcast:
            args[4] = torch.zeros(B, 1, S).expand(B, H, S)  # lse: stride 0 over the heads
        sm90_bwd64_launch.prepare_backward64(*args, **kw, **sm90_backend.BACKWARD)()
    assert len(stubbed) == 4


def test_the_plans_of_a_launcher_stay_bounded():
    """A process that sees ever new problems keeps at most PLAN_LIMIT of them checked."""
    from vsa_core.backends import sm90_common
    plans = {}
    for i in range(sm90_common.PLAN_LIMIT + 5):
        assert sm90_common.remember(plans, i, -i) == -i
        assert len(plans) <= sm90_common.PLAN_LIMIT and plans[i] == -i
