"""vsa_torch.video_sparse_attn against the float64 reference (CPU: Triton interpreter;
GPU: the compiled kernels, same tests)."""

import numpy as np
import torch

import vsa_torch
from common import Case, assert_close, make_inputs, reference
from frontends import run_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# (the float64 reference over CASES, for each frontend and backend: test_reference_matrix.py)


def test_ties_go_to_the_lower_block_index():
    """Identical KV blocks tie in the coarse scores; the reference's rule (lower index
    first) must pick the same blocks as the kernel. Their values differ, so picking
    another block would change the output."""
    case = Case(n_q_blocks=2, n_kv_blocks=4, topk=2, partial_q=False, partial_kv=False, batch=1, heads=1)
    rng = np.random.default_rng(7)
    inputs = make_inputs(case, seed=3)
    E = case.E
    block = rng.standard_normal((1, 1, E, case.head_dim)).astype(np.float32)
    inputs["k"] = np.concatenate([block] * 4, axis=2)  # four equal KV blocks: all scores tie
    assert_close(case, run_torch(case, inputs), reference(case, inputs))


def test_inference_output_equals_training_forward():
    case = Case()
    inputs = make_inputs(case, seed=11)
    dtype = getattr(torch, case.dtype)
    args = [torch.from_numpy(inputs[n]).to(DEVICE, dtype) for n in ("q", "k", "v")]
    counts = (torch.from_numpy(inputs["kv_counts"]), torch.from_numpy(inputs["q_counts"]))
    gate = torch.from_numpy(inputs["gate"]).to(DEVICE, dtype)
    with torch.no_grad():
        out_inference = vsa_torch.video_sparse_attn(*args, *counts, case.topk, case.block, gate)
    grads = [a.clone().requires_grad_() for a in args]
    out_training = vsa_torch.video_sparse_attn(*grads, *counts, case.topk, case.block, gate)
    assert torch.equal(out_inference, out_training.detach())


def test_backward_fills_no_gradients_of_the_other_results():
    """The forward's results besides out (lse, out_fine, the lists...) are not differentiable:
    autograd must not fill a zero gradient for each of them on every backward (one of them is
    as large as out). Counted as the zero-filling torch ops a backward runs; the gradients are
    still those of the float64 reference (test_reference_matrix.py)."""
    case = Case()
    inputs = make_inputs(case, seed=5)
    dtype = getattr(torch, case.dtype)
    q, k, v, gate = (torch.from_numpy(inputs[n]).to(DEVICE, dtype).requires_grad_() for n in ("q", "k", "v", "gate"))
    counts = (torch.from_numpy(inputs["kv_counts"]).to(DEVICE), torch.from_numpy(inputs["q_counts"]).to(DEVICE))
    # triton: a backend that zeroes no buffer of its own (sm90 zeroes its dQ accumulator)
    def attend():
        return vsa_torch.video_sparse_attn(q, k, v, *counts, case.topk, case.block, gate, backend="triton")

    dout = torch.randn_like(attend())
    attend().backward(dout)  # first calls: on a GPU Triton's autotuner may reset a buffer it times on
    out = attend()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(dout)
    fills = [e.key for e in prof.key_averages() if e.key in ("aten::zeros", "aten::zero_", "aten::zeros_like")]
    assert not fills, f"the backward filled zero tensors: {fills}"
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v, gate))
