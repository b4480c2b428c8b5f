"""Our sm_90 forward for 64-token blocks (vsa_core/backends/sm90_fwd64.py, CuTe DSL; not a backend yet).

GPU only (`-m gpu`, sm_90 with nvidia-cutlass-dsl 4.8.1; skipped otherwise): out and lse against the
float64 reference with fresh random inputs, outputs poisoned with NaN first: partial and empty KV
blocks, empty query rows, nQ != nKV, BSHD, lists the list rule must clean, and the VSA epilogue.
Bounds: out is bf16 and P is rounded to bf16 before PV (2^-8 per element, averaging down over a
row): rel-L2 < 1e-2; lse is fp32 throughout (exact fp32 dots of the same bf16 inputs): abs 1e-3.
The wider matrix and the timing are in benchmarks/sm90_fwd64_check.py.
"""

import math
import zlib

import numpy as np
import pytest
import torch

from vsa_core import reference as R

E = 64
VARIANTS = {
    "simple": dict(k_stages=1, v_stages=2),
    "simple-lazy": dict(k_stages=1, v_stages=2, lazy_rescale=True),
    "ws2-pingpong-lazy": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True,
                              lazy_rescale=True),
    "ws3": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True),
    # persistent on 2 CTAs: each consumer walks many (query block, head, batch) items, empty lists
    # among them, so ring slots and mbarrier phases run on across items of different lengths
    "ws3-persistent": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                           persistent=2),
    "ws3-tma-store": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                          tma_store=True),
    "ws3-persistent-tma-store": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                                     persistent=2, tma_store=True),
    # shared KV rings (the union of the CTA's lists, loaded once): nq 3, 4, 5 run partial last groups
    "ws2-shared": dict(k_stages=5, v_stages=7, consumers=2, warp_specialized=True, lazy_rescale=True, shared_kv=True),
    "ws3-shared": dict(k_stages=4, v_stages=7, consumers=3, warp_specialized=True, lazy_rescale=True, shared_kv=True),
    "ws3-shared-k1v1": dict(k_stages=1, v_stages=1, consumers=3, warp_specialized=True, shared_kv=True),
    # 2-CTA clusters walking pair lists (a pair's shared tiles multicast): odd nq (a last block without
    # a mate), pairs of unequal counts and an empty row, whole shared lists (long-list: nkv == cap)
    "ws3-cluster-pairs": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                              tma_store=True, cluster_pairs=True),
    "ws2-cluster-pairs-k2v3": dict(k_stages=2, v_stages=3, consumers=2, warp_specialized=True, lazy_rescale=True,
                                   cluster_pairs=True),
    # the sm90 backend's FORWARD with cuDNN's load order (Q before the count: empty lists wait for it; V_{j-1}
    # before K_j; the consumer refilling its own K slot) and L2 hints, all four and consumer_k alone
    "ws3-rf-qvkh": dict(k_stages=1, v_stages=2, consumers=3, warp_specialized=True, lazy_rescale=True,
                        tma_store=True, rescale_first=True, q_first=True, v_first=True, consumer_k=True,
                        l2_hints=True),
    "ws2-pingpong-k2-consumer-k": dict(k_stages=2, v_stages=2, consumers=2, warp_specialized=True, pingpong=True,
                                       lazy_rescale=True, consumer_k=True),
}


def _forward():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("cutlass")
    from vsa_core.backends import sm90_fwd64
    return sm90_fwd64.sparse_forward64


def _case(seed, B, H, nq, nkv, cap, layout="bhsd", coarse=False):
    g = torch.Generator().manual_seed(seed)

    def tok(S):
        x = torch.randn(B, H, S, 128, generator=g).to(torch.bfloat16)
        if layout == "bshd":
            return x.transpose(1, 2).contiguous().cuda().transpose(1, 2)
        return x.cuda()

    q, k, v = tok(nq * E), tok(nkv * E), tok(nkv * E)
    kv_counts = torch.randint(0, E + 1, (nkv,), generator=g, dtype=torch.int32)
    kv_counts[0] = E
    idx = torch.stack([torch.randperm(nkv, generator=g)[:cap].sort().values for _ in range(B * H * nq)])
    idx = idx.reshape(B, H, nq, cap).to(torch.int32)
    num = torch.randint(0, cap + 1, (B, H, nq), generator=g, dtype=torch.int32)
    num.view(-1)[0] = 0  # an empty row
    case = dict(q=q, k=k, v=v, sel_idx=idx.cuda(), sel_num=num.cuda(), kv_counts=kv_counts.cuda())
    if coarse:
        case["q_counts"] = torch.randint(1, E + 1, (nq,), generator=g, dtype=torch.int32).cuda()
        case["gate"] = tok(nq * E)
        case["out_coarse"] = torch.randn(B, H, nq, 128, generator=g).cuda()
    return case


def _reference(case):
    q, k, v = (case[n].float().cpu().numpy() for n in ("q", "k", "v"))
    bmap = R.index_lists_to_block_map(case["sel_idx"].cpu().numpy(), case["sel_num"].cpu().numpy(), k.shape[2] // E)
    out, lse = R.block_sparse_attn_reference(q, k, v, bmap, case["kv_counts"].cpu().numpy(), E)
    if "out_coarse" not in case:
        return out, lse, None
    valid = (np.arange(q.shape[2]) % E) < np.repeat(case["q_counts"].cpu().numpy(), E)
    fine = np.where(valid[None, None, :, None], out, 0.0)
    mixed = fine + np.where(valid[None, None, :, None], case["gate"].double().cpu().numpy()
                            * np.repeat(case["out_coarse"].double().cpu().numpy(), E, axis=2), 0.0)
    return mixed, np.where(valid[None, None, :], lse, np.inf), fine


def _rel(got, ref):
    got = got.double().cpu().numpy()
    assert np.isfinite(got).all(), "non-finite output (an unwritten, poisoned element?)"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", [(2, 2, 4, 4, 4, "bhsd", False), (1, 2, 3, 7, 5, "bshd", False),
                                   (2, 1, 5, 2, 2, "bhsd", False), (1, 1, 2, 40, 40, "bhsd", False),
                                   (2, 2, 4, 4, 3, "bhsd", True)],
                         ids=["nq4-nkv4", "bshd-nq3-nkv7", "sq-gt-skv", "long-list", "vsa-epilogue"])
def test_sm90_fwd64_matches_float64_reference(variant, shape):
    fwd = _forward()
    B, H, nq, nkv, cap, layout, coarse = shape
    case = _case(zlib.crc32(repr((variant, shape)).encode()), B, H, nq, nkv, cap, layout, coarse)
    q = case["q"]
    out = torch.full_like(q, math.nan)
    lse = torch.full((B, H, nq * E), math.nan, device="cuda")
    kw = dict(VARIANTS[variant])
    out_fine = None
    if coarse:
        out_fine = torch.full((B, H, nq * E, 128), math.nan, device="cuda")
        kw.update(q_counts=case["q_counts"], gate=case["gate"], out_coarse=case["out_coarse"], out_fine=out_fine)
    fwd(q, case["k"], case["v"], out, lse, case["sel_idx"], case["sel_num"], case["kv_counts"], **kw)
    torch.cuda.synchronize()
    ref_out, ref_lse, ref_fine = _reference(case)
    assert _rel(out, ref_out) < 1e-2
    got_lse = lse.double().cpu().numpy()
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(got_lse[~finite], ref_lse[~finite])  # -inf (empty rows), +inf (padded rows)
    assert np.abs(got_lse[finite] - ref_lse[finite]).max() < 1e-3
    if ref_fine is not None:
        assert _rel(out_fine, ref_fine) < 1e-2


@pytest.mark.parametrize("persistent", [-1, 2.5, "yes"])
def test_bad_persistent_is_refused_naming_it(persistent):
    """Checked on the host before anything reaches a device (CPU tensors of valid shapes)."""
    with pytest.raises(ValueError, match="persistent"):
        _prepare_on_host(warp_specialized=True, consumers=3, persistent=persistent)


@pytest.mark.parametrize("config", [dict(warp_specialized=False), dict(pingpong=True, consumers=2),
                                    dict(persistent=2), dict(list_in_smem=True)],
                         ids=["simple", "pingpong", "persistent", "list-in-smem"])
def test_cluster_pairs_outside_its_configuration_is_refused_naming_it(config):
    """cluster_pairs runs on the warp-specialized kernel with its own rings only; checked on the host."""
    kw = dict(warp_specialized=True, consumers=3, cluster_pairs=True)
    kw.update(config)
    with pytest.raises(ValueError, match="cluster_pairs"):
        _prepare_on_host(**kw)


@pytest.mark.parametrize("flag", ["q_first", "v_first", "consumer_k"])
@pytest.mark.parametrize("config", [dict(warp_specialized=False, consumers=1), dict(persistent=2),
                                    dict(shared_kv=True), dict(cluster_pairs=True)],
                         ids=["simple", "persistent", "shared-kv", "cluster-pairs"])
def test_load_order_outside_its_configuration_is_refused_naming_it(flag, config):
    """The load-order flags run on the warp-specialized kernel with its own rings, not persistent."""
    kw = dict(warp_specialized=True, consumers=3, **{flag: True})
    kw.update(config)
    with pytest.raises(ValueError, match=flag):
        _prepare_on_host(**kw)


def _prepare_on_host(**config):
    """`prepare_forward64` on CPU tensors of valid shapes: its host checks, before anything reaches a device."""
    pytest.importorskip("cutlass")
    pytest.importorskip("cuda.bindings")
    from vsa_core.backends.sm90_fwd64 import prepare_forward64
    B, H, nq, cap = 1, 1, 2, 2
    q = torch.randn(B, H, nq * E, 128).to(torch.bfloat16)
    lists = dict(sel_idx=torch.zeros(B, H, nq, cap, dtype=torch.int32), sel_num=torch.ones(B, H, nq, dtype=torch.int32),
                 kv_counts=torch.full((nq,), E, dtype=torch.int32))
    prepare_forward64(q, q.clone(), q.clone(), torch.empty_like(q), torch.empty(B, H, nq * E), **lists, **config)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["ws3-rf-qvkh", "ws3-tma-store", "simple"])
def test_sm90_fwd64_rounding_residual_restores_the_fp32_mix(variant):
    """fine_rounding (`AttnProblem.fine_residual` "rounding"): out_fine holds out's rounding residual in
    q's dtype. out is bitwise the out of the run that keeps the fp32 fine output, and out + residual
    is that run's fp32 mix fine + gate * out_coarse to the residual's own rounding (2^-9 of out's,
    itself 2^-9 of out), where out alone is off by out's rounding."""
    fwd = _forward()
    B, H, nq, nkv, cap = 2, 2, 4, 4, 3
    case = _case(zlib.crc32(variant.encode()), B, H, nq, nkv, cap, coarse=True)
    runs = {}
    for rounding in (False, True):
        out = torch.full_like(case["q"], math.nan)
        lse = torch.full((B, H, nq * E), math.nan, device="cuda")
        out_fine = torch.full((B, H, nq * E, 128), math.nan, device="cuda",
                              dtype=torch.bfloat16 if rounding else torch.float32)
        fwd(case["q"], case["k"], case["v"], out, lse, case["sel_idx"], case["sel_num"], case["kv_counts"],
            q_counts=case["q_counts"], gate=case["gate"], out_coarse=case["out_coarse"], out_fine=out_fine,
            fine_rounding=rounding, **VARIANTS[variant])
        torch.cuda.synchronize()
        runs[rounding] = (out, out_fine)
    (out32, fine32), (out, residual) = runs[False], runs[True]
    assert torch.equal(out, out32)
    valid = (torch.arange(nq * E, device="cuda") % E) < torch.repeat_interleave(case["q_counts"], E)
    mix = torch.where(valid[:, None], fine32 + case["gate"].float() * case["out_coarse"].repeat_interleave(E, 2), 0.0)
    scale = mix.abs().max()
    assert torch.isfinite(residual).all()
    assert ((out.float() + residual.float() - mix).abs().max() / scale).item() < 2 ** -15
    assert ((out.float() - mix).abs().max() / scale).item() > 2 ** -12
