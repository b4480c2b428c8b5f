"""The core's one entry per call (`vsa_core.api`) and the fine-stage backend contract
(`vsa_core.backends.base`)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import vsa_jax
import vsa_torch
from vsa_core import api, problem, spec
from vsa_core.backends import BACKENDS
from vsa_core.backends.base import FineBackward, FineForward, FineStageBackend
from vsa_core.problem import AttnProblem
from vsa_core.spec import OpStatics

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Shaped:
    def __init__(self, *shape, dtype="bfloat16"):
        self.shape, self.dtype = shape, np.dtype("int32") if dtype == "int32" else dtype


def _token(layout, b, h, s, d=64):
    return Shaped(b, h, s, d) if layout == "bhsd" else Shaped(b, s, h, d)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("topk", [2, 9])  # 9 > nKV: clamped
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_op_problem_equals_the_prepared_problem_vsa(layout, gate, topk, training, padding):
    q, k = _token(layout, 2, 3, 3 * 64), _token(layout, 2, 3, 4 * 64)
    g = q if gate else None
    p = api.prepare_vsa(q, k, k, np.full(4, 64), np.full(3, 64), topk, (4, 4, 4), g, layout=layout,
                        padding=padding).problem
    p = dataclasses.replace(p, training=training)
    assert p.topk == min(topk, 4) and p.padding == padding
    statics = OpStatics.of(p, "triton", training=training)
    assert statics.topk == p.topk and OpStatics.decode(statics.encode()) == statics
    assert spec.op_problem(statics, dict(q=q, k=k)) == p


@pytest.mark.parametrize("selection", ["block_map", "indices"])
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
def test_op_problem_equals_the_prepared_problem_block_sparse(selection, padding):
    q, k = Shaped(1, 2, 128, 64), Shaped(1, 2, 192, 64)
    sel = (dict(block_map=Shaped(1, 2, 2, 3, dtype="bool")) if selection == "block_map" else
           dict(block_indices=Shaped(1, 2, 2, 3, dtype="int32"), block_counts=Shaped(1, 2, 2, dtype="int32")))
    p = api.prepare_block_sparse(q, k, k, np.full(3, 64), 64, **sel, padding=padding).problem
    assert p.selection == selection and p.topk is None and p.padding == padding
    assert spec.op_problem(OpStatics.of(p, "triton"), dict(q=q, k=k)) == p


@pytest.mark.parametrize("selection", ["topk", "block_map", "indices"])
def test_op_problem_equals_the_prepared_problem_varlen(selection):
    q, k = Shaped(4 * 64, 2, 64), Shaped(5 * 64, 2, 64)
    cu_q, cu_k = np.array([0, 128, 256], np.int32), np.array([0, 192, 320], np.int32)
    if selection == "topk":
        p = api.prepare_vsa(q, k, k, np.full(5, 64), np.full(4, 64), 3, 64, q, cu_seqlens_q=cu_q,
                            cu_seqlens_k=cu_k).problem
    elif selection == "block_map":
        p = api.prepare_block_sparse(q, k, k, np.full(5, 64), 64, block_map=Shaped(2, 4, 5, dtype="bool"),
                                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k).problem
    else:
        p = api.prepare_block_sparse(q, k, k, np.full(5, 64), 64, block_indices=Shaped(2, 4, 3, dtype="int32"),
                                     block_counts=Shaped(2, 4, dtype="int32"), cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k).problem
    assert p.n_seqs == 2 and p.list_capacity == (3 if selection == "indices" else None)
    packed_q, packed_k = Shaped(1, *q.shape), Shaped(1, *k.shape)  # what the ops see: BSHD, batch 1
    assert spec.op_problem(OpStatics.of(p, "triton"), dict(q=packed_q, k=packed_k, cu_seqlens_q=cu_q)) == p


def test_prepare_checks_the_arguments():
    q = Shaped(1, 2, 128, 64)
    with pytest.raises(ValueError, match="backend must be one of"):
        api.prepare_vsa(q, q, q, np.full(2, 64), np.full(2, 64), 1, 64, backend="nope")
    with pytest.raises(TypeError, match="backend must be a string"):
        api.prepare_block_sparse(q, q, q, np.full(2, 64), 64, block_map=Shaped(1, 2, 2, 2, dtype="bool"), backend=3)
    with pytest.raises(ValueError, match="block_map must have shape"):
        api.prepare_block_sparse(q, q, q, np.full(2, 64), 64, block_map=Shaped(1, 2, 2, 3, dtype="bool"))
    with pytest.raises(ValueError, match="block_counts must have shape"):
        api.prepare_block_sparse(q, q, q, np.full(2, 64), 64, block_indices=Shaped(1, 2, 2, 2, dtype="int32"),
                                 block_counts=Shaped(1, 2, 3, dtype="int32"))
    with pytest.raises(ValueError, match="q_variable_block_sizes must have shape"):
        api.prepare_vsa(q, q, q, np.full(2, 64), np.full(3, 64), 1, 64)
    with pytest.raises(ValueError, match=r"padding must be one of \('zeros', 'ignore'\), got 'none'"):
        api.prepare_vsa(q, q, q, np.full(2, 64), np.full(2, 64), 1, 64, padding="none")
    with pytest.raises(ValueError, match="padding must be one of"):
        api.prepare_block_sparse(q, q, q, np.full(2, 64), 64, block_map=Shaped(1, 2, 2, 2, dtype="bool"), padding=1)


def _small_call_inputs():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 128, 64)).astype(np.float32) for _ in range(3))
    return q, k, v, np.array([64, 40]), np.array([64, 64])


def _count_describes(monkeypatch):
    """Counts full argument checks wherever they come from: every describe_attention checks
    the KV counts through the module-level _check_counts."""
    calls = []
    real = problem._check_counts

    def counting(name, *args, **kwargs):
        calls.append(name) if name == "variable_block_sizes" else None
        return real(name, *args, **kwargs)
    monkeypatch.setattr(problem, "_check_counts", counting)
    return calls


def test_torch_call_describes_the_problem_once(monkeypatch):
    """One full check per call (vsa_core.api.prepare_vsa); the op's own problem is the
    cached rebuild (vsa_core.spec.op_problem), not a second describe_attention."""
    q, k, v, kv_counts, q_counts = _small_call_inputs()
    args = [torch.from_numpy(x).to(DEVICE, torch.bfloat16) for x in (q, k, v)]
    calls = _count_describes(monkeypatch)
    with torch.no_grad():
        vsa_torch.video_sparse_attn(*args, kv_counts, q_counts, 1, 64)
    assert len(calls) == 1
    hits = spec._op_problem.cache_info().hits
    with torch.no_grad():
        vsa_torch.video_sparse_attn(*args, kv_counts, q_counts, 1, 64)
    assert len(calls) == 2 and spec._op_problem.cache_info().hits > hits


def test_jax_call_describes_the_problem_once(monkeypatch):
    q, k, v, kv_counts, q_counts = _small_call_inputs()
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    calls = _count_describes(monkeypatch)
    vsa_jax.video_sparse_attn(*args, kv_counts, q_counts, 1, 64).block_until_ready()
    assert len(calls) == 1


# ---- the backend contract ----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_satisfies_the_contract(name):
    assert isinstance(BACKENDS[name], FineStageBackend)
    assert BACKENDS[name].name == name


def test_contract_fields_are_buffer_names():
    """ops builds FineForward / FineBackward by field name from the buffer dict: every field
    must be an input or a buffer of the problem's tables (VSA, training, with a gate)."""
    p = AttnProblem(batch=1, heads=1, q_len=128, kv_len=128, head_dim=64, block_elems=64, dtype="bfloat16",
                    topk=1, has_gate=True)
    inputs = {"q", "k", "v", "kv_counts", "q_counts", "gate", "dout"}
    forward = set(p.forward_buffers())
    backward = set(p.backward_buffers())
    assert {f.name for f in dataclasses.fields(FineForward)} <= inputs | forward
    assert {f.name for f in dataclasses.fields(FineBackward)} <= inputs | forward | backward
