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
