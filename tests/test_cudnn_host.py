"""The cudnn backend's blk64 forward without cuDNN frontend's Python wrapper (`cudnn_backend._blk64_forward`):
what is kept per problem and per build, and what each call passes.

CPU (needs nvidia-cutlass-dsl; no GPU, no cuDNN frontend, no TVM-FFI): cuDNN's kernel class and the
compile step are stand-ins, so these check the host code's keys and arguments against what
`_interface._bsa_attn_fwd_sm90_blk64` (1.32.0) gives the kernel, not the kernel (the GPU tests of
test_cudnn_backend.py do): the same constructor arguments, the same CuTe views (permutation,
alignment, leading dim) of the same tensors, our lse written directly. The checks run once per
problem, the build once per dtype, head dim and broadcast dims.
"""

import sys
import types

import pytest
from common import record_compiles

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")

from vsa_core.backends import cudnn_backend, sm90_common  # noqa: E402
from vsa_core.problem import AttnProblem  # noqa: E402

B, H, S, D, E, K = 1, 2, 256, 128, 64, 2
NB = S // E


class _Kernel:
    """Stands for cuDNN's BlockSparseAttnForwardSm90Blk64: records its constructor arguments."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def stubbed(monkeypatch):
    compiled = []
    compile_for_torch = record_compiles(compiled)

    monkeypatch.setitem(sys.modules, "cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90",
                        types.SimpleNamespace(BlockSparseAttnForwardSm90Blk64=_Kernel))
    monkeypatch.setattr(sm90_common, "compile_for_torch", compile_for_torch)
    monkeypatch.setattr(sm90_common, "cute_tensor", lambda t, align=16, leading_dim=None: (t, align, leading_dim))
    monkeypatch.setattr(cudnn_backend, "_BLK64_BUILDS", {})
    monkeypatch.setattr(cudnn_backend, "_BLK64_PLANS", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=7))
    return compiled


def _count_checks(monkeypatch):
    calls = []
    real = cudnn_backend._check_blk64
    monkeypatch.setattr(cudnn_backend, "_check_blk64", lambda *a: (calls.append(1), real(*a))[1])
    return calls


def _case(dtype="bfloat16", batch=B, seq=S, layout="bhsd", head_dim=D):
    p = AttnProblem(batch=batch, heads=H, q_len=seq, kv_len=seq, head_dim=head_dim, block_elems=E, dtype=dtype,
                    topk=K, layout=layout)
    nb = seq // E
    tok = [torch.zeros(p.token_shape(seq), dtype=getattr(torch, dtype)) for _ in range(4)]
    lse = torch.zeros(batch, H, seq)
    idx = torch.zeros(batch, H, nb, K, dtype=torch.int32)
    num = torch.ones(batch, H, nb, dtype=torch.int32)
    sizes = torch.arange(nb, dtype=torch.int32)
    return p, (*tok, lse, idx, num, sizes)


def _run(p, args):
    cudnn_backend._blk64_forward(p, *args)


def _same_view(got, base, perm):
    want = base.permute(*perm)
    return got.data_ptr() == want.data_ptr() and got.shape == want.shape and got.stride() == want.stride()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_same_problem_reuses_checks_and_build_and_passes_the_wrappers_arguments(stubbed, monkeypatch, layout):
    checks = _count_checks(monkeypatch)
    for _ in range(3):
        p, args = _case(layout=layout)
        _run(p, args)
    assert len(checks) == 1 and len(stubbed) == 1 and len(stubbed[0].calls) == 3
    q, k, v, out, lse, idx, num, sizes = args
    bhsd = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(1, 2))
    call = stubbed[0].calls[-1]
    assert len(call) == 11
    assert _same_view(call[0], bhsd(q), (2, 3, 1, 0)) and _same_view(call[1], bhsd(k), (2, 3, 1, 0))
    assert _same_view(call[2], bhsd(v), (3, 2, 1, 0)) and _same_view(call[3], bhsd(out), (2, 3, 1, 0))
    assert _same_view(call[4], lse, (2, 1, 0))  # our lse, written directly (the wrapper's own is copied)
    assert _same_view(call[5], idx, (3, 2, 1, 0)) and _same_view(call[6], num, (2, 1, 0))
    assert _same_view(call[8], num, (2, 1, 0))  # the split offsets' place: the counts, unused at kv_splits=1
    expanded = call[7].permute(2, 1, 0)  # block_sizes[None, None].expand(B, H, -1).contiguous()
    assert expanded.is_contiguous() and torch.equal(expanded, sizes.expand(B, H, -1))
    assert call[9] == p.softmax_scale and type(call[9]) is float and int(call[10]) == 7


def test_the_build_takes_the_wrappers_kernel_and_views(stubbed):
    p, args = _case()
    _run(p, args)
    fn = stubbed[0]
    assert fn.kernel.kwargs == dict(gqa_ratio=1, head_dim=D, value_dim=D, blocksparse_blocksize_q=64,
                                    blocksparse_blocksize_k=64, dtype=sm90_common.cutlass_dtype(args[0]),
                                    acc_dtype=__import__("cutlass").Float32, has_block_sizes=True, num_splits=1,
                                    allow_empty_block_nums=True)
    # _to_cute_tensor(x, assumed_align, leading_dim) as _bsa_attn_fwd_sm90_blk64 calls it
    assert [(a, lead) for _, a, lead in fn.examples] == [(128, 1), (128, 1), (128, 0), (128, 1), (4, 0), (None, 0),
                                                          (None, 0), (None, 0), (None, 0)]
    assert fn.examples[8] is fn.examples[6]  # one CuTe tensor for the counts and the split offsets
    assert [x is y for (x, _, _), y in zip(fn.examples[:8], fn.calls[0][:8])] == [True] * 8  # the first call's


@pytest.mark.parametrize("change", ["batch", "sequence length", "layout"])
def test_new_shape_or_layout_checks_again_and_reuses_the_build(stubbed, monkeypatch, change):
    checks = _count_checks(monkeypatch)
    _run(*_case())
    changed = {"batch": dict(batch=2 * B), "sequence length": dict(seq=2 * S), "layout": dict(layout="bshd")}
    _run(*_case(**changed[change]))
    assert len(checks) == 2 and len(stubbed) == 1 and len(stubbed[0].calls) == 2


@pytest.mark.parametrize("change", ["dtype", "head dim", "broadcast dim"])
def test_dtype_head_dim_or_broadcast_dims_build_again(stubbed, change):
    _run(*_case(batch=2 if change == "broadcast dim" else B))  # broadcast: q alone differs from this call's
    if change == "broadcast dim":
        p, args = _case(batch=2)
        args = (torch.zeros(1, H, S, D, dtype=torch.bfloat16).expand(2, H, S, D), *args[1:])  # q over the batch
    else:
        p, args = _case(**{"dtype": dict(dtype="float16"), "head dim": dict(head_dim=64)}[change])
    _run(p, args)
    assert len(stubbed) == 2 and len(stubbed[1].calls) == 1


def test_bad_shape_is_checked_not_taken_for_a_known_problem(stubbed):
    _run(*_case())
    p, args = _case()
    args = (*args[:6], torch.ones(B + 1, H, NB, dtype=torch.int32), args[7])  # the counts of another batch
    with pytest.raises(ValueError, match="q2k_block_nums"):
        _run(p, args)


@pytest.mark.parametrize("block_elems, given_out, expect", [(64, True, "ours"), (128, True, "wrapper"),
                                                            (64, False, "wrapper")])
def test_which_forward_runs(monkeypatch, block_elems, given_out, expect):
    """64-token blocks into our out / lse: the kernel called here; 128-token blocks, or outputs the
    library allocates (a static prefix's rows): cuDNN's `bsa_attn_fwd`."""
    ran = []
    monkeypatch.setattr(cudnn_backend, "_blk64_forward", lambda *a: ran.append("ours"))
    monkeypatch.setattr(cudnn_backend, "_cudnn", lambda: (lambda *a, **k: (ran.append("wrapper"), (None, None))[1],
                                                          None))
    p = AttnProblem(batch=B, heads=H, q_len=S, kv_len=S, head_dim=D, block_elems=block_elems, dtype="bfloat16",
                    topk=K)
    out, lse = (torch.zeros(1), torch.zeros(1)) if given_out else (None, None)
    out_copy = torch.zeros(1) if given_out else None
    if expect == "wrapper" and given_out:  # the blk128 kernel allocates: its outputs are copied into ours
        monkeypatch.setattr(cudnn_backend, "_cudnn", lambda: (lambda *a, **k: (ran.append("wrapper"),
                                                                              (out_copy, out_copy))[1], None))
    cudnn_backend._bsa_forward(p, None, None, None, out, lse, torch.zeros(1, 1, 1, 2), None, None)
    assert ran == [expect]
