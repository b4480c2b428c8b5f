"""Token offsets past 2^31 elements (GPU only: 4.4 GB per token tensor).

At BSHD with H40 D128 a row's offset row * H * D passes 2^31 from S = 419,431 on (a
20-second 720p clip); int32 offsets wrapped there and read and wrote out of bounds.
Here S = 1664 * 256 = 425,984, so the last 25 blocks lie past 2^31. Checked where it
is cheap: the last blocks against the float64 reference on the slice they depend on
(block-sparse attention), and BSHD against BHSD of the same data (VSA).
"""

import gc

import numpy as np
import pytest
import torch

import vsa_torch
from common import TOLERANCE, errors, skip_unavailable
from vsa_core import reference as R
from vsa_core.backends import BackendUnavailableError

B, H, D, E, N_BLOCKS = 1, 40, 128, 256, 1664
S = N_BLOCKS * E
LAST_COUNT = 100  # the last KV block is partial
BF16 = torch.bfloat16
# one worker runs them all (gpu_session.sh: `-n 8 --dist loadgroup`): each holds tens of GB
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("large_offsets")]


def _randn(shape, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=BF16, generator=gen)


def _counts():
    counts = torch.full((N_BLOCKS,), E, dtype=torch.int32, device="cuda")
    counts[-1] = LAST_COUNT
    return counts


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _call(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except BackendUnavailableError as e:
        skip_unavailable(kw["backend"], str(e))


@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_block_sparse_bshd_past_2_31(backend):
    """Query block i sees KV blocks {0, i}: the last blocks' out, dq and (only block i's
    query block selects it) dk, dv depend on a small slice, checked in float64."""
    assert S * H * D >= 2**31
    q, k, v, dout = (_randn((B, S, H, D), seed) for seed in range(4))
    with torch.no_grad():  # zero the last KV block's padded tail, as callers do
        k[:, -E + LAST_COUNT:] = 0
        v[:, -E + LAST_COUNT:] = 0
    for t in (q, k, v):
        t.requires_grad_()
    blocks = torch.arange(N_BLOCKS, device="cuda", dtype=torch.int32)
    idx = torch.stack([torch.zeros_like(blocks), blocks], -1).expand(B, H, N_BLOCKS, 2).contiguous()
    idx[:, :, 0, 1] = 99999  # block 0 lists itself once; junk past the count
    num = torch.full((B, H, N_BLOCKS), 2, dtype=torch.int32, device="cuda")
    num[:, :, 0] = 1
    out, lse = _call(vsa_torch.block_sparse_attn_from_indices, q, k, v, idx, num, _counts(), E, layout="bshd",
                     backend=backend)
    out.backward(dout)
    torch.cuda.synchronize()
    tol = TOLERANCE["bfloat16"]
    for i in (N_BLOCKS - 25, N_BLOCKS - 1):  # both past 2^31
        assert i * E * H * D >= 2**31
        rows = slice(i * E, (i + 1) * E)
        kv_rows = torch.cat([torch.arange(E), torch.arange(i * E, (i + 1) * E)]).cuda()  # blocks 0 and i
        for h in (0, H - 1):
            def head(x, r):
                return x[0, r, h].detach().cpu().double()[None, None]
            qs, ks, vs = (head(x, r).numpy() for x, r in ((q, rows), (k, kv_rows), (v, kv_rows)))
            counts = np.array([E, LAST_COUNT if i == N_BLOCKS - 1 else E])
            ref, ref_lse, ref_grads = R.block_sparse_attn_reference(qs, ks, vs, np.ones((1, 1, 1, 2), bool), counts,
                                                                    E, dout=head(dout, rows).numpy())
            got = {"out": head(out, rows), "dq": head(q.grad, rows),
                   "dk": head(k.grad, slice(i * E, (i + 1) * E)), "dv": head(v.grad, slice(i * E, (i + 1) * E))}
            want = {"out": ref, "dq": ref_grads["dq"], "dk": ref_grads["dk"][:, :, E:], "dv": ref_grads["dv"][:, :, E:]}
            for name in got:
                rel, max_rel = errors(got[name].numpy(), want[name])
                assert rel < tol["rel"] and max_rel < tol["max_rel"], (name, i, h, rel, max_rel)
            torch.testing.assert_close(lse[0, h, rows].cpu().double(), torch.from_numpy(ref_lse[0, 0]), rtol=0, atol=2e-2)
    del q, k, v, dout, out, lse
    _free()


@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_vsa_bshd_equals_bhsd_past_2_31(backend):
    """VSA (pooling, coarse, fine, mixing, backward) in BSHD, where offsets pass 2^31,
    against BHSD of the same data, where they stay below: the last blocks agree."""
    topk, tail = 4, slice(S - 3 * E, S)
    results = {}
    for layout in ("bshd", "bhsd"):
        x = []
        for seed in range(5):  # q, k, v, gate, dout
            t = _randn((B, S, H, D), seed)
            x.append(t if layout == "bshd" else t.transpose(1, 2).contiguous())
            del t
        q, k, v, gate, dout = x
        for t in (q, k, v, gate):
            t.requires_grad_()
        fn = vsa_torch.video_sparse_attn_bshd if layout == "bshd" else vsa_torch.video_sparse_attn
        counts = torch.full((N_BLOCKS,), E, dtype=torch.int32, device="cuda")
        out = _call(fn, q, k, v, counts, counts, topk, E, gate, backend=backend)
        out.backward(dout)
        seq_dim = 1 if layout == "bshd" else 2
        results[layout] = {n: t.detach().narrow(seq_dim, tail.start, tail.stop - tail.start).float().cpu()
                           for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad),
                                        ("dgate", gate.grad))}
        if layout == "bhsd":
            results[layout] = {n: t.transpose(1, 2) for n, t in results[layout].items()}
        del q, k, v, gate, dout, out, x
        _free()
    for name, want in results["bhsd"].items():
        rel, max_rel = errors(results["bshd"][name].numpy(), want.double().numpy())
        assert rel < 1e-2 and max_rel < 5e-2, (name, rel, max_rel)
