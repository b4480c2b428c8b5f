"""vsa_torch is CUDA-graph safe: forward and forward+backward captured with torch.cuda.graph
(after an eager warm-up on other tensors) and replayed on new input values copied into the
captured inputs equal eager calls on those values, for both backends; the same under
torch.compile(mode="reduce-overhead") (CUDA-graph trees), with no cudagraph skip.

A captured call must not synchronise: the counts' value check (a host read) is done on
the warm-up call and skipped during capture (vsa_torch.ops.as_counts). The counts tensors
captured here are fresh (never checked), so a host read would fail the capture.

Equality: Triton's kernels are deterministic, so replay == eager bit for bit; FA4's
backward accumulates dQ with atomics (summation order varies run to run), so its dQ is
compared within the reference tolerance, everything else bit for bit. Every replay is
also checked against the float64 reference."""

import numpy as np
import pytest
import torch

import vsa_torch
from common import Case, assert_close, make_inputs, reference, skip_unavailable
from vsa_core.backends import BackendUnavailableError

pytestmark = pytest.mark.gpu

CASES = {
    "triton": Case(batch=1, n_q_blocks=3, n_kv_blocks=4),
    "cute": Case(block=128, batch=1, n_q_blocks=3, n_kv_blocks=4),  # FA4: 128/256-token blocks
}
NAMES = ("out", "dq", "dk", "dv", "dgate")


def device_inputs(case: Case, inputs: dict, requires_grad: bool) -> dict:
    dtype = getattr(torch, case.dtype)
    x = {n: torch.from_numpy(inputs[n]).to("cuda", dtype).requires_grad_(requires_grad and n != "dout")
         for n in ("q", "k", "v", "gate", "dout")}
    x.update({n: torch.from_numpy(inputs[n]).to("cuda", torch.int32) for n in ("kv_counts", "q_counts")})
    return x


def step(case: Case, backend: str, x: dict, backward: bool, padding: str = "zeros"):
    """out (and dq, dk, dv, dgate): the computation that is captured."""
    q, k, v, gate = (x[n] for n in ("q", "k", "v", "gate"))
    out = vsa_torch.video_sparse_attn(q, k, v, x["kv_counts"], x["q_counts"], case.topk, case.block, gate,
                                      backend=backend, padding=padding)
    if not backward:
        return [out]
    return [out, *torch.autograd.grad(out, (q, k, v, gate), x["dout"])]


def require_backend(case: Case, backend: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    x = device_inputs(case, make_inputs(case, seed=0), requires_grad=False)
    try:
        step(case, backend, x, backward=False)
    except BackendUnavailableError as e:
        skip_unavailable(backend, f"{backend} backend unavailable: {e}")


def to_numpy(results) -> dict:
    return {n: t.detach().float().cpu().numpy() for n, t in zip(NAMES, results)}


def assert_equal_to_eager(case: Case, backend: str, got: dict, want: dict, inputs: dict) -> None:
    for name in got:
        if backend == "cute" and name == "dq":  # atomics: order-dependent rounding
            assert_close(case, {name: got[name]}, {name: want[name].astype(np.float64)})
        else:
            assert np.array_equal(got[name], want[name]), (
                f"{name}: replay differs from eager by {np.abs(got[name] - want[name]).max():.3e}")
    ref = reference(case, inputs)
    assert_close(case, got, {n: ref[n] for n in got})


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_cuda_graph_replay_with_new_inputs_equals_eager(backend, backward):
    case = CASES[backend]
    require_backend(case, backend)

    # warm-up (compiles, autotunes, checks counts) on a side stream, as torch.cuda.graph asks
    warm = device_inputs(case, make_inputs(case, seed=1), requires_grad=backward)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(case, backend, warm, backward)
    torch.cuda.current_stream().wait_stream(side)

    static = device_inputs(case, make_inputs(case, seed=2), requires_grad=backward)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(case, backend, static, backward)

    for seed in (3, 4):  # new values (counts and hence selections too) copied into the captured inputs
        inputs = make_inputs(case, seed=seed)
        fresh = device_inputs(case, inputs, requires_grad=backward)
        with torch.no_grad():
            for name, t in static.items():
                t.copy_(fresh[name])
        graph.replay()
        got = to_numpy(captured)
        want = to_numpy(step(case, backend, fresh, backward))
        assert_equal_to_eager(case, backend, got, want, inputs)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_cuda_graph_over_static_buffers_with_junk_padding(backend, backward):
    """The serving case of padding="ignore": a graph captured once over static buffers,
    replayed with new values whose padded rows hold whatever the buffer held (NaN and inf
    here): every replay equals the eager call on zero padding, padded rows exactly 0."""
    from test_padding import assert_padded_rows_zero, with_non_finite_padding
    case = CASES[backend]
    require_backend(case, backend)
    warm = device_inputs(case, make_inputs(case, seed=1), requires_grad=backward)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(case, backend, warm, backward, "ignore")
    torch.cuda.current_stream().wait_stream(side)
    static = device_inputs(case, make_inputs(case, seed=2), requires_grad=backward)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(case, backend, static, backward, "ignore")
    for seed in (3, 4):
        inputs = make_inputs(case, seed=seed)
        junk = device_inputs(case, with_non_finite_padding(inputs, case.E), requires_grad=backward)
        with torch.no_grad():
            for name, t in static.items():
                t.copy_(junk[name])
        graph.replay()
        got = to_numpy(captured)
        assert_padded_rows_zero(got, inputs, case.E)
        want = to_numpy(step(case, backend, device_inputs(case, inputs, requires_grad=backward), backward, "ignore"))
        for name in got:
            if backend == "cute" and name == "dq":  # atomics: order-dependent rounding
                assert_close(case, {name: got[name]}, {name: want[name].astype(np.float64)})
            else:
                assert np.array_equal(got[name], want[name]), name
        ref = reference(case, inputs, "ignore")
        assert_close(case, got, {n: ref[n] for n in got})


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_torch_compile_reduce_overhead_equals_eager(backend, backward):
    """CUDA-graph trees record after a warm-up call and replay afterwards, copying each
    call's new inputs into the graph's own; no call may be skipped (a sync or a CPU tensor
    would make inductor skip cudagraphs and bump the counter)."""
    from torch._dynamo.utils import counters

    case = CASES[backend]
    require_backend(case, backend)
    torch._dynamo.reset()
    counters.clear()

    def attention(q, k, v, gate, kv_counts, q_counts):
        return vsa_torch.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate,
                                           backend=backend)

    compiled = torch.compile(attention, mode="reduce-overhead", fullgraph=True)
    for seed in range(10, 14):  # call 1 warms up, call 2 records, calls 3 and 4 replay
        inputs = make_inputs(case, seed=seed)
        x = device_inputs(case, inputs, requires_grad=backward)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.set_grad_enabled(backward):
            out = compiled(x["q"], x["k"], x["v"], x["gate"], x["kv_counts"], x["q_counts"])
            results = [out, *torch.autograd.grad(out, (x["q"], x["k"], x["v"], x["gate"]), x["dout"])] \
                if backward else [out]
        got = to_numpy(results)  # copied out before the next replay overwrites the graph's outputs
        want = to_numpy(step(case, backend, device_inputs(case, inputs, requires_grad=backward), backward))
        assert_equal_to_eager(case, backend, got, want, inputs)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_host_counts_during_capture_raise_a_clear_error():
    """Counts on the host cannot be copied to the device inside a capture (the copy
    synchronises): a ValueError naming the argument instead of a broken capture."""
    case = CASES["triton"]
    require_backend(case, "triton")
    inputs = make_inputs(case, seed=5)
    x = device_inputs(case, inputs, requires_grad=False)
    step(case, "triton", x, backward=False)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="variable_block_sizes must be a CUDA tensor while a CUDA graph"):
        with torch.cuda.graph(graph):
            vsa_torch.video_sparse_attn(x["q"], x["k"], x["v"], inputs["kv_counts"], x["q_counts"], case.topk,
                                        case.block, x["gate"], backend="triton")
