"""Our sm_90 backward for 64-token blocks (vsa_core/backends/sm90_bwd64.py, CuTe DSL; not a backend yet).

GPU only (`-m gpu`, sm_90 with nvidia-cutlass-dsl 4.8.1; skipped otherwise): dq, dk, dv against the
float64 reference (vsa_core.reference, given the float64 forward's lse and out) with fresh random
inputs, outputs poisoned with NaN first: partial and empty KV blocks, empty query rows, KV blocks
nobody selected, nQ != nKV, BSHD, a long KV-owned list, padded query rows (lse +inf, q and dout
zeroed there), softmax_scale; each for the one-warpgroup kernel, the split kernel and the split
kernel with query groups, persistent or not, sweeping heads or not, and the split kernel's options
(K / V in registers, P handed over early and rounded, L2 hints). The query groups also on lists the
list rule must clean (equal to the clean lists' result) and run to run (dk, dv bitwise). Bound: P and
dS are rounded to bf16 before their GEMMs and the gradients once more on output (as in the Triton
backward, which measures ~6e-3 on these cases): rel-L2 < 1e-2. The wider matrix, the comparison with
the Triton backward and the timing are in benchmarks/sm90_bwd64_check.py.
"""

import math
import zlib

import numpy as np
import pytest
import torch

from vsa_core import reference as R

E = 64
# The two kernels behind `prepare_backward64`, each as the sm90 backend would configure it (the
# backend's BACKWARD is one of them: test_backend_backward_is_tested)
# query groups of 2 query blocks at D128 (`sm90_bwd64_groups.group_blocks`): several groups per list at
# these sizes; a grid chunk of 2 KV blocks runs the ring of partial sums (4 slots) over many
# generations and makes chunks that end a head short
TWO_BLOCK_GROUPS = 2 * E * 128 * 8
CONFIGS = {"one-warpgroup": dict(stages=2, dq_red=True, dk_overlap=True),
           "split": dict(stages=3, split=True, dq_bulk=True),
           "split-groups": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS),
           "split-groups-chunk2": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                       grid_chunk_blocks=2),
           # the backend's: one group at these sizes (the groups' build, its one-group path)
           "split-groups-32mib": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=32 << 20),
           # persistent: 2 or 3 CTAs take every tile from the counter (K / V and the ring reused across
           # tiles, tiles with empty lists among them), with and without query groups and dq_bulk
           "split-persist": dict(stages=3, split=True, dq_bulk=True, persistent=True, grid_chunk_blocks=3),
           "split-persist-red": dict(stages=3, split=True, persistent=True, grid_chunk_blocks=2),
           "split-groups-persist": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                        persistent=True, grid_chunk_blocks=2),
           # K / V in the compute warpgroups' registers: reloaded per tile (several groups; persistent:
           # across tiles)
           "split-groups-kvregs": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                       k_in_regs=True, v_in_regs=True),
           "split-persist-kregs": dict(stages=3, split=True, dq_bulk=True, persistent=True, grid_chunk_blocks=3,
                                       k_in_regs=True),
           "split-vregs": dict(stages=3, split=True, dq_bulk=True, v_in_regs=True),
           # every group over a whole head before the next: the ring of partial sums holds one head's
           # KV blocks (B * H generations here)
           "split-groups-sweep": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                      head_sweep=True),
           "split-groups-sweep-hints": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                            head_sweep=True, l2_hints=True),
           "split-groups-sweep-p-early": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                              head_sweep=True, p_early=True),
           "split-groups-sweep-p-rounded": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                                head_sweep=True, p_rounded=True),
           # the backend's options together, with several groups, and persistent
           "split-groups-sweep-kvpr": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=TWO_BLOCK_GROUPS,
                                           head_sweep=True, k_in_regs=True, v_in_regs=True, p_early=True,
                                           p_rounded=True, l2_hints=True),
           "split-persist-kvpr": dict(stages=3, split=True, dq_bulk=True, persistent=True, grid_chunk_blocks=3,
                                      k_in_regs=True, v_in_regs=True, p_early=True, p_rounded=True, l2_hints=True),
           # the backend's BACKWARD (one group at these sizes)
           "split-groups-32mib-sweep-kvpr": dict(stages=3, split=True, dq_bulk=True, q_group_bytes=32 << 20,
                                                 head_sweep=True, k_in_regs=True, v_in_regs=True, p_early=True,
                                                 p_rounded=True, l2_hints=True)}
# the query groups' configurations with several groups (the list rule, determinism)
GROUP_CONFIGS = ("split-groups-chunk2", "split-groups-persist", "split-groups-sweep", "split-groups-sweep-kvpr")


def _backward():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("cutlass")
    from vsa_core.backends import sm90_bwd64_launch
    return sm90_bwd64_launch


def _lists(mask):
    idx = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32).contiguous()
    return idx, mask.sum(-1, dtype=torch.int32).contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 2, 4, 4, "bhsd", None, None), (1, 2, 3, 7, "bshd", None, None),
                                   (2, 1, 5, 2, "bhsd", None, None), (1, 1, 40, 2, "bhsd", None, None),
                                   (2, 2, 4, 4, "bhsd", [64, 17, 1, 40], None),
                                   (1, 2, 4, 3, "bshd", None, 0.3)],
                         ids=["nq4-nkv4", "bshd-nq3-nkv7", "sq-gt-skv", "long-inv-list", "padded-q-rows",
                              "bshd-scale"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sm90_bwd64_matches_float64_reference(shape, config):
    M = _backward()
    B, H, nq, nkv, layout, q_counts, softmax_scale = shape
    g = torch.Generator().manual_seed(zlib.crc32(repr(shape).encode()))
    D = 128
    q, k, v, do = (torch.randn(B, H, n * E, D, generator=g, dtype=torch.float64) for n in (nq, nkv, nkv, nq))
    kv_counts = torch.randint(0, E + 1, (nkv,), generator=g)
    kv_counts[0] = E
    mask = torch.rand(B, H, nq, nkv, generator=g) < 0.6
    mask.view(-1, nkv)[0] = False  # an empty query row
    valid = None
    if q_counts is not None:  # padded query rows: inputs zeroed, lse +inf (VSA forward, padding="ignore")
        valid = (torch.arange(nq * E) % E) < torch.repeat_interleave(torch.tensor(q_counts), E)
        q, do = (x * valid[None, None, :, None] for x in (q, do))
    q, k, v, do = (x.to(torch.bfloat16) for x in (q, k, v, do))
    out, lse, ref = R.block_sparse_attn_reference(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                                  mask.numpy(), kv_counts.numpy(), E, dout=do.double().numpy(),
                                                  softmax_scale=softmax_scale)
    if valid is not None:
        lse = np.where(valid.numpy()[None, None, :], lse, np.inf)

    def dev(x):  # the [B, H, S, D] view of a tensor stored in the layout
        x = torch.as_tensor(x)
        if layout == "bshd" and x.dim() == 4:
            return x.transpose(1, 2).contiguous().cuda().transpose(1, 2)
        return x.contiguous().cuda()

    qd, kd, vd, dod = (dev(x) for x in (q, k, v, do))
    out_d, lse_d = dev(torch.from_numpy(out).float()), dev(torch.from_numpy(lse).float())
    grads = {n: dev(torch.full(x.shape, math.nan, dtype=torch.bfloat16)) for n, x in (("dq", q), ("dk", k), ("dv", k))}
    inv_idx, inv_num = _lists(mask.transpose(2, 3))
    M.sparse_backward64(qd, kd, vd, out_d, dod, lse_d, grads["dq"], grads["dk"], grads["dv"], inv_idx.cuda(),
                        inv_num.cuda(), kv_counts.to(torch.int32).cuda(), softmax_scale=softmax_scale,
                        **CONFIGS[config])
    torch.cuda.synchronize()
    for name, r in ref.items():
        got = grads[name].double().cpu().numpy()
        assert np.isfinite(got).all(), f"{name}: non-finite (an unwritten, poisoned element?)"
        den = np.linalg.norm(r)
        err = np.linalg.norm(got - r) / den if den > 0 else np.abs(got).max()
        assert err < 1e-2, f"{name}: rel-L2 {err:.2e}"


def _problem(g, B, H, nq, nkv, D=128):
    q, k, v, do = (torch.randn(B, H, n * E, D, generator=g).to(torch.bfloat16).cuda() for n in (nq, nkv, nkv, nq))
    out = torch.randn(B, H, nq * E, D, generator=g).to(torch.bfloat16).cuda()
    lse = (torch.rand(B, H, nq * E, generator=g) * 4 + 2).cuda()
    return q, k, v, do, out, lse


def _run(M, tensors, inv_idx, inv_num, kv_counts, config):
    q, k, v, do, out, lse = tensors
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    M.sparse_backward64(q, k, v, out, do, lse, dq, dk, dv, inv_idx, inv_num, kv_counts, **config)
    torch.cuda.synchronize()
    return dq, dk, dv


def _clean(idx, num, nq):
    """The lists as the list rule reads them: entries in [0, nq) above the last counted one."""
    clean = np.zeros_like(idx)
    counts = np.zeros_like(num)
    for pos in np.ndindex(*num.shape):
        last, kept = -1, []
        for e in idx[pos][:max(0, min(int(num[pos]), idx.shape[-1]))]:
            if last < e < nq:
                kept.append(e)
                last = e
        clean[pos][:len(kept)] = kept
        counts[pos] = len(kept)
    return clean, counts


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", GROUP_CONFIGS)
def test_sm90_bwd64_query_groups_read_lists_by_the_list_rule(config_name):
    """Lists with entries out of range, repeated and descending, and counts past the capacity: the
    query groups give what the clean lists give (dk, dv bitwise: the skipped entries add exact zeros
    in the same order; dq's fp32 reductions run in any order) and agree with the kernel without
    groups."""
    M = _backward()
    g = torch.Generator().manual_seed(11)
    B, H, nq, nkv, cap = 2, 2, 7, 3, 12
    tensors = _problem(g, B, H, nq, nkv)
    idx = torch.randint(-3, nq + 3, (B, H, nkv, cap), generator=g, dtype=torch.int32)
    idx[0, 0, 0] = torch.arange(cap, dtype=torch.int32) % nq  # ascending, then again from 0
    num = torch.randint(0, cap + 3, (B, H, nkv), generator=g, dtype=torch.int32)
    clean_idx, clean_num = (torch.from_numpy(x) for x in _clean(idx.numpy(), num.numpy(), nq))
    counts = torch.full((nkv,), E, dtype=torch.int32).cuda()
    config = CONFIGS[config_name]
    bad = _run(M, tensors, idx.cuda(), num.cuda(), counts, config)
    clean = _run(M, tensors, clean_idx.cuda(), clean_num.cuda(), counts, config)
    whole = _run(M, tensors, clean_idx.cuda(), clean_num.cuda(), counts, CONFIGS["split"])
    for name, x, y, z in zip(("dq", "dk", "dv"), bad, clean, whole):
        assert torch.isfinite(x).all(), name
        if name != "dq":
            assert torch.equal(x, y), f"{name}: bad lists != clean lists"
        err = ((x.double() - z.double()).norm() / z.double().norm()).item()
        assert err < 1e-2, f"{name}: groups vs one group rel-L2 {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", GROUP_CONFIGS)
def test_sm90_bwd64_query_groups_dk_dv_are_deterministic(config_name):
    """dk and dv from query groups come out bitwise equal run to run: each KV block's partial sums
    are added in group order by its last group's CTA, whatever order the CTAs finish in."""
    M = _backward()
    g = torch.Generator().manual_seed(12)
    B, H, nq, nkv = 2, 3, 9, 5
    tensors = _problem(g, B, H, nq, nkv)
    inv_idx, inv_num = _lists((torch.rand(B, H, nkv, nq, generator=g) < 0.7))
    counts = torch.full((nkv,), E, dtype=torch.int32).cuda()
    first = _run(M, tensors, inv_idx.cuda(), inv_num.cuda(), counts, CONFIGS[config_name])
    for _ in range(3):
        again = _run(M, tensors, inv_idx.cuda(), inv_num.cuda(), counts, CONFIGS[config_name])
        assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])


def test_backend_backward_is_tested():
    from vsa_core.backends import sm90_backend
    assert sm90_backend.BACKWARD in CONFIGS.values(), "the sm90 backend's BACKWARD is not among CONFIGS"
