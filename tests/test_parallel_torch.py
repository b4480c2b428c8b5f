"""vsa_torch.parallel (Ulysses over torch.distributed): 2 processes spawned by the test, on
gloo (CPU, Triton interpreter) or NCCL (2 GPUs). Output and gradients of the sharded call,
put back together, must equal the single-device VSA on the full sequence bitwise (each
head runs whole on one rank through the same kernels) and the float64 reference within
the usual tolerance; bad shards must raise ValueError on every rank, before any collective.
With prefix blocks (prefix_blocks / prefix_mode, spanning one or both ranks' shards) the same
holds against the one-device call with the same prefix."""

import os
import pickle
import socket
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vsa_torch
from common import Case, assert_close, from_layout, make_inputs, reference, skip_unavailable, to_layout
from test_torch_vsa import run_torch
from vsa_torch.parallel import ulysses_video_sparse_attn

WORLD = 2

NO_PREFIX = {}
PREFIX_CASE = Case(batch=1, heads=2, n_q_blocks=4, n_kv_blocks=4, layout="bshd", topk=1)
CPU_JOBS = [  # (case, backend, prefix keywords)
    (Case(batch=1, heads=2, n_q_blocks=4, n_kv_blocks=4, layout="bshd"), "auto", NO_PREFIX),  # gate, partial, empty
    (Case(batch=2, heads=6, n_q_blocks=2, n_kv_blocks=4, topk=3, gate=False, layout="bshd", dtype="float16",
          block=(4, 4, 4)), "auto", NO_PREFIX),                           # Sq != Skv, 3 heads per rank
    # a prefix on rank 0's shard only, and one across both ranks' shards (2 blocks each)
    (PREFIX_CASE, "auto", dict(prefix_blocks=1, prefix_mode="exempt")),
    (PREFIX_CASE, "auto", dict(prefix_blocks=3, prefix_mode="compete")),
]
GPU_JOBS = [  # (case, backend, prefix keywords)
    (Case(batch=1, heads=4, n_q_blocks=8, n_kv_blocks=8, topk=3, layout="bshd"), "triton", NO_PREFIX),
    (Case(batch=2, heads=4, n_q_blocks=4, n_kv_blocks=6, topk=2, layout="bshd", head_dim=128, gate=False),
     "triton", NO_PREFIX),
    (Case(block=128, batch=1, heads=4, n_q_blocks=6, n_kv_blocks=6, topk=3, layout="bshd", head_dim=128), "cute",
     NO_PREFIX),
    (Case(block=256, batch=2, heads=2, n_q_blocks=4, n_kv_blocks=4, topk=2, layout="bshd"), "cute", NO_PREFIX),
    # prefixes across both ranks' shards (4 and 3 blocks each)
    (Case(batch=1, heads=4, n_q_blocks=8, n_kv_blocks=8, topk=2, layout="bshd"), "triton",
     dict(prefix_blocks=5, prefix_mode="exempt")),
    (Case(block=128, batch=1, heads=4, n_q_blocks=6, n_kv_blocks=6, topk=2, layout="bshd", head_dim=128), "cute",
     dict(prefix_blocks=4, prefix_mode="compete")),
]


def seed_of(case: Case) -> int:
    return zlib.crc32(case.id().encode())


def inputs_of(case: Case, prefix: dict) -> dict:
    """A job's full inputs, the same on every rank (deterministic); with a prefix, a draw whose
    selection has no near-tie (as in test_prefix)."""
    if prefix:
        from test_prefix import draw
        return draw(case, prefix["prefix_blocks"], prefix["prefix_mode"], seed_of(case))
    return make_inputs(case, seed_of(case))


def reference_of(case: Case, prefix: dict, inputs: dict, padding: str = "zeros") -> dict:
    if prefix:
        from test_prefix import prefix_reference
        assert padding == "zeros", "the prefix jobs run zero padding"
        return prefix_reference(case, inputs, prefix["prefix_blocks"], prefix["prefix_mode"])
    return reference(case, inputs, padding)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- what each spawned rank runs -----------------------------------------------------------
def _shard(x: np.ndarray, rank: int) -> np.ndarray:
    """This rank's contiguous slice of the sequence axis of a BSHD array."""
    return np.split(x, WORLD, axis=1)[rank]


def _run_sharded(case: Case, backend: str, prefix: dict, padding: str, device: str, rank: int) -> dict:
    inputs = inputs_of(case, prefix)
    if padding == "ignore":  # never read: NaN / inf in every padded row of the shards
        from test_padding import with_non_finite_padding
        inputs = with_non_finite_padding(inputs, case.E)
    dtype = getattr(torch, case.dtype)

    def shard(name):
        return torch.from_numpy(_shard(to_layout(inputs[name], "bshd"), rank)).to(device=device, dtype=dtype)

    q, k, v, gate = (shard(n).requires_grad_() for n in ("q", "k", "v", "gate"))
    out = ulysses_video_sparse_attn(q, k, v, torch.from_numpy(inputs["kv_counts"]),
                                    torch.from_numpy(inputs["q_counts"]), case.topk, case.block,
                                    gate if case.gate else None, backend=backend,
                                    softmax_scale=case.softmax_scale, padding=padding, **prefix)
    out.backward(shard("dout"))
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad, "dgate": gate.grad}
    return {n: t.detach().float().cpu().numpy() for n, t in got.items() if t is not None}


def _bad_calls(rank: int) -> dict:
    """Each bad call's (exception type, message) on this rank."""
    def x(s, h=2, d=64):
        return torch.randn(1, s, h, d, dtype=torch.bfloat16)

    counts2, counts3 = np.full(2, 64), np.full(3, 64)
    calls = {
        "heads": lambda: ulysses_video_sparse_attn(x(64, h=3), x(64, h=3), x(64, h=3), counts2, counts2, 1),
        "whole_blocks": lambda: ulysses_video_sparse_attn(x(96), x(96), x(96), counts3, counts3, 1),
        "cover": lambda: ulysses_video_sparse_attn(x(64), x(64), x(64), counts2, counts3, 1),
        # rank 0 holds 128 tokens, rank 1 holds 64: 192 in all, 3 blocks
        "unequal": lambda: ulysses_video_sparse_attn(*(x(128 if rank == 0 else 64),) * 3, counts3, counts3, 1),
        "prefix_too_long": lambda: ulysses_video_sparse_attn(x(64), x(64), x(64), counts2, counts2, 1, prefix_blocks=3),
        "prefix_mode": lambda: ulysses_video_sparse_attn(x(64), x(64), x(64), counts2, counts2, 1, prefix_blocks=1,
                                                         prefix_mode="dense"),
        "prefix_lengths": lambda: ulysses_video_sparse_attn(x(64), x(128), x(128), np.full(4, 64), counts2, 1,
                                                            prefix_blocks=1),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = (None, "")
        except Exception as e:  # noqa: BLE001  (the parent checks the type)
            found[name] = (type(e).__name__, str(e))
    return found


def _worker(rank: int, port: int, out_dir: str, dist_backend: str, jobs: list, check_errors: bool):
    device = f"cuda:{rank}" if dist_backend == "nccl" else "cpu"
    if dist_backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {"runs": [_run_sharded(case, backend, prefix, padding, device, rank)
                            for case, backend, prefix, padding in jobs]}
        if rank == 0:  # the single-device runs (clean padding), twice (to see which results reproduce bit for bit)
            results["single"] = [[run_torch(case, inputs_of(case, prefix), backend=backend, device=device,
                                            padding=padding, **prefix) for _ in range(2)]
                                 for case, backend, prefix, padding in jobs]
        if check_errors:
            results["errors"] = _bad_calls(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def spawn(tmp_path, monkeypatch, dist_backend: str, jobs: list, check_errors: bool = False) -> list:
    # the spawned ranks inherit the environment (each reads it at its first call: vsa_core.config):
    # one fixed tile config per Triton kernel (autotuning would let each process time and pick its
    # own), and the heads of a rank in 2 chunks (3 heads per rank: chunks of 2 and 1)
    monkeypatch.setenv("VSA_AUTOTUNE", "0")
    monkeypatch.setenv("VSA_ULYSSES_CHUNKS", "2")
    mp.spawn(_worker, args=(free_port(), str(tmp_path), dist_backend, jobs, check_errors), nprocs=WORLD)
    ranks = []
    for rank in range(WORLD):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    return ranks


def gathered(ranks: list, job: int) -> dict:
    """The ranks' shards put back together along the sequence, BHSD."""
    runs = [r["runs"][job] for r in ranks]
    return {n: from_layout(np.concatenate([run[n] for run in runs], axis=1), "bshd") for n in runs[0]}


def check_against_one_device(case: Case, prefix: dict, ranks: list, job: int, padding: str = "zeros") -> list:
    """Bitwise equal to the single-device run wherever that one reproduces its own bits
    (always the output; FA4's dQ sums fp32 atomics in an order that varies), and every
    result within the float64 reference's tolerance. padding="ignore": the shards held NaN /
    inf in their padded rows, the single-device run zeros."""
    got = gathered(ranks, job)
    first, second = ranks[0]["single"][job]
    assert set(got) == set(first)
    reproducible = [n for n in first if np.array_equal(first[n], second[n])]
    assert "out" in reproducible, reproducible
    for name in reproducible:
        np.testing.assert_array_equal(got[name], first[name], err_msg=f"{name} differs from one device")
    assert_close(case, got, reference_of(case, prefix, inputs_of(case, prefix), padding))
    return reproducible


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run (Triton interpreter); GPUs run the NCCL test")
def test_gloo_equals_one_device_and_bad_shards_raise(tmp_path, monkeypatch):
    # every CPU job with zero padding, the first again with NaN / inf in the shards' padded rows
    jobs = [(case, backend, prefix, "zeros") for case, backend, prefix in CPU_JOBS] + [(*CPU_JOBS[0], "ignore")]
    ranks = spawn(tmp_path, monkeypatch, "gloo", jobs, check_errors=True)
    for job, (case, _, prefix, padding) in enumerate(jobs):
        bitwise = check_against_one_device(case, prefix, ranks, job, padding)
        assert len(bitwise) == (5 if case.gate else 4), bitwise  # the interpreter is deterministic

    expect = {"heads": "not divisible by the group size 2",
              "whole_blocks": "not a whole number of 64-token blocks",
              "cover": "must cover the whole sequence",
              "unequal": "every device must hold an equal shard",
              "prefix_too_long": "prefix_blocks (3) must not exceed the number of blocks of the sequence (2)",
              "prefix_mode": "prefix_mode must be one of ('exempt', 'compete'), got 'dense'",
              "prefix_lengths": "prefix_blocks > 0 needs q and k of the same length (joint self-attention), got 2 "
                                "query and 4 KV blocks"}
    for rank, r in enumerate(ranks):
        for name, text in expect.items():
            kind, message = r["errors"][name]
            assert kind == "ValueError" and text in message, (rank, name, kind, message)
    # the checks name the argument
    assert "q has 3 heads" in ranks[0]["errors"]["heads"][1]
    assert "q_variable_block_sizes" in ranks[0]["errors"]["cover"][1]


def test_needs_an_initialized_process_group():
    x = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ulysses_video_sparse_attn(x, x, x, np.full(1, 64), np.full(1, 64), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
@pytest.mark.parametrize("job", range(len(GPU_JOBS)),
                         ids=lambda j: "-".join([GPU_JOBS[j][1], GPU_JOBS[j][0].id()]
                                                + [f"{k}={v}" for k, v in GPU_JOBS[j][2].items()]))
def test_nccl_equals_one_device(tmp_path, monkeypatch, job, padding):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    case, backend, prefix = GPU_JOBS[job]
    if backend == "cute":
        from test_cute_backend import _cute_reason
        reason = _cute_reason(case)
        skip_unavailable("cute", reason and f"cute backend unavailable: {reason}")
    ranks = spawn(tmp_path, monkeypatch, "nccl", [(case, backend, prefix, padding)])
    bitwise = check_against_one_device(case, prefix, ranks, 0, padding)
    if backend == "triton":  # no atomics: every result reproduces
        assert len(bitwise) == (5 if case.gate else 4), bitwise
