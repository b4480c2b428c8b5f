"""The block-mean pooling of q, k and v (`stages.block_mean_pool_qkv`): several blocks per program
(`block_mean_pool_qkv_blocks_kernel`) against one (`block_mean_pool_qkv_kernel`) bit for bit, and
both against the float64 reference's means (FastVideo's: the sum of the block's rows over its
count, rounded to the input dtype); both layouts, both paddings, partial and empty blocks, nQ
!= nKV. CPU: Triton interpreter. On sm_90 both kernels load and sum the same tiles in the same
layout (so the same fp32 sums) and spill nothing."""

import numpy as np
import pytest
import torch

from common import _mean_error
from vsa_core import reference as R
from vsa_core import stages
from vsa_core.launch import eager_launcher
from vsa_core.problem import AttnProblem

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rng, layout, E, dtype, padding, n_q=5, n_kv=7, B=2, H=2, D=64):
    """(problem, q, k, v, q_counts, kv_counts): x16 q / k activations; counts with an empty, a
    partial and full blocks; under padding="ignore" the padded rows hold NaN and inf (never
    read), under "zeros" zeros (FastVideo's contract)."""
    p = AttnProblem(batch=B, heads=H, q_len=n_q * E, kv_len=n_kv * E, head_dim=D, block_elems=E, dtype=dtype,
                    layout=layout, topk=1, padding=padding)
    q_counts = np.array([E, 0, E // 2 + 1, E, 1][:n_q], np.int32)
    kv_counts = np.array([E - 1, E, 0, 3, E, E, 2][:n_kv], np.int32)
    tensors = []
    for scale, n, counts in ((16, n_q, q_counts), (16, n_kv, kv_counts), (1, n_kv, kv_counts)):
        x = rng.standard_normal((B, H, n * E, D)) * scale
        padded = ~R.valid_tokens(counts, E)
        x[:, :, padded] = np.nan if padding == "ignore" else 0.0
        if padding == "ignore":
            x[:, :, np.flatnonzero(padded)[::3]] = np.inf
        t = torch.from_numpy(x).to(getattr(torch, dtype))
        tensors.append((t if layout == "bhsd" else t.transpose(1, 2).contiguous()).to(DEV))
    return (p, *tensors, torch.from_numpy(q_counts).to(DEV), torch.from_numpy(kv_counts).to(DEV))


def _pool(p, q, k, v, q_counts, kv_counts, blocks):
    dt = q.dtype
    pools = [torch.full((p.batch, p.heads, n, p.head_dim), 7.0, dtype=dt, device=DEV)
             for n in (p.n_q_blocks, p.n_kv_blocks, p.n_kv_blocks)]
    stages.block_mean_pool_qkv(eager_launcher, p, q, k, v, q_counts, kv_counts, *pools, blocks=blocks)
    return pools


@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("padding", ["zeros", "ignore"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_blocks_per_program_pool_the_same_means(layout, padding, dtype, E):
    """2, 3 and 8 (more than a tensor has) blocks per program write what one block per program
    writes, bit for bit, every mean and no other element; those are the reference's means
    (within one ulp where the fp32 sum is within its rounding error of a rounding boundary of the
    dtype). E 128: two 64-row tiles per block."""
    rng = np.random.default_rng([E, len(dtype), len(padding), len(layout)])
    p, q, k, v, q_counts, kv_counts = _inputs(rng, layout, E, dtype, padding)
    one = _pool(p, q, k, v, q_counts, kv_counts, 1)
    for blocks in (2, 3, 8):
        for name, a, b in zip(("q", "k", "v"), one, _pool(p, q, k, v, q_counts, kv_counts, blocks)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} pooled, {blocks} blocks a program"
    for x, counts, got in ((q, q_counts, one[0]), (k, kv_counts, one[1]), (v, kv_counts, one[2])):
        x = x.float().cpu().numpy().astype(np.float64)
        x = x if layout == "bhsd" else x.transpose(0, 2, 1, 3)
        counts = counts.cpu().numpy()
        x = np.where(R.valid_tokens(counts, E)[:, None], x, 0.0)  # zeros there in both paddings' means
        want = R._block_mean(x, counts, E, dtype)
        err = np.abs(got.float().cpu().numpy() - want)
        assert (err <= _mean_error(x, counts, E, dtype)).all(), f"largest error {err.max()}"


def test_bad_blocks_are_refused():
    p = AttnProblem(batch=1, heads=1, q_len=64, kv_len=64, head_dim=64, block_elems=64, dtype="bfloat16", topk=1)
    for blocks in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="blocks must be an int >= 1"):
            stages.block_mean_pool_qkv(eager_launcher, p, None, None, None, None, None, None, None, None,
                                       blocks=blocks)


_COMPILE_SCRIPT = r"""
import os, re, sys
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from coarse_fwd_bench import compile_stage, compile_figures
from vsa_core import stages as S
from vsa_core.problem import AttnProblem


def tile_layouts(ttgir):
    # the layouts of the token tiles loaded and of the sums over them
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    loads = re.findall(r"tt\.load .*: tensor<\d+x\d+x!tt\.ptr<\w+>, (#\w+)>", ttgir)
    sums = re.findall(r"\}\) : \(tensor<\d+x\d+xf32, (#\w+)>\) -> ", ttgir)  # a reduction's operand type
    assert loads and sums, "no tile load or sum found"
    return {defs[a] for a in loads}, {defs[a] for a in sums}


for E in (64, 256):
    for layout in ("bhsd", "bshd"):
        p = AttnProblem(batch=1, heads=12, q_len=39936, kv_len=39936, head_dim=128, block_elems=E, dtype="bfloat16",
                        topk=8, layout=layout)
        found = {}
        for blocks in (1, 2, 4):
            name, compiled = compile_stage(S.block_mean_pool_qkv, p, blocks=blocks)
            regs, spills, shared = compile_figures(compiled)
            assert spills == 0, (E, layout, blocks, regs, spills)
            found[blocks] = tile_layouts(compiled.asm["ttgir"])
            print(E, layout, name, blocks, "registers", regs, "spilled", spills, found[blocks])
        assert found[2] == found[1] and found[4] == found[1], found
print("OK")
"""


def test_pool_kernels_compile_for_sm90_with_the_same_tiles():
    """480p-64 and 480p-256, both layouts, 1, 2 and 4 blocks per program: sm_90 cubins with no
    spilled register, whose token tiles are loaded and summed in the same layouts (so each
    block's fp32 sum adds the same values in the same order: the means agree bit for bit on the
    GPU too). CPU, in a subprocess without the interpreter."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", f"REPO = {repo!r}\n" + _COMPILE_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]
