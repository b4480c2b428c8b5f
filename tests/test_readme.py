"""Every ```python block of README.md runs as pasted, each in a fresh process (issue 15):
on the CPU (no TRITON_INTERPRET: the way a new user meets it) or the GPU, under the launcher
its first comment names: `torchrun --nproc_per_node N` (gloo on the CPU), or `XLA_FLAGS=...`
set before JAX starts; a plain `python` otherwise. Each block ends with an `out` that must
be finite."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```\n", (ROOT / "README.md").read_text(), re.S)

CHECK_OUT = """
import numpy as _np
_out = out[0] if isinstance(out, (tuple, list)) else out
_out = _out.detach().float().cpu().numpy() if hasattr(_out, "detach") else _np.asarray(_out, _np.float32)
assert _out.size and _np.isfinite(_out).all(), "out is empty or not finite"
print("README block ran: out", _out.shape)
"""


def _header(block: str) -> str:
    return "".join(line for line in block.splitlines(keepends=True)[:3] if line.startswith("#"))


def test_readme_has_the_blocks():
    """The Use snippet, PyTorch and JAX Ulysses, varlen: each launcher is exercised."""
    assert len(BLOCKS) >= 4
    headers = [_header(b) for b in BLOCKS]
    assert any("torchrun --nproc_per_node 2" in h for h in headers)
    assert any("XLA_FLAGS=--xla_force_host_platform_device_count=2" in h for h in headers)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_as_pasted(index, tmp_path):
    block = BLOCKS[index]
    header = _header(block)
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(block + CHECK_OUT)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, str(script)]
    procs = re.search(r"torchrun --nproc_per_node (\d+)", header)
    if procs:
        n = int(procs.group(1))
        if torch.cuda.is_available() and torch.cuda.device_count() < n:
            pytest.skip(f"the block runs {n} ranks with NCCL: needs {n} GPUs")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                   "--master_port", str(29500 + os.getpid() % 1000 + index), str(script)]
    flags = re.search(r"XLA_FLAGS=(\S+)", header)
    if flags:
        env["XLA_FLAGS"] = flags.group(1)
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README block {index} failed:\n{block}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert run.stdout.count("README block ran") == (int(procs.group(1)) if procs else 1), run.stdout
