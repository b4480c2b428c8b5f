"""The shared tile store (`vsa_core.autotune.TILES`): one tile config per (kernel, problem)
for the whole process, keyed on plain values, so torch and JAX run the same tiles for the
same problem by construction (issue 22, item 5).

Triton's own autotuner keyed each frontend's launches on `str(dtype)` of its arguments
("torch.bfloat16" against "bfloat16"), so each frontend timed and chose on its own; a GPU
fuzz draw then gave torch != JAX. The last test reruns that draw with autotuning on.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from common import require_jax_gpu
from vsa_core.autotune import TileStore, tile_key
from vsa_core.backends import triton_backend as T
from vsa_core.launch import eager_launcher
from vsa_core.problem import describe_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = (T._sparse_fwd, T._sparse_bwd_dq, T._sparse_bwd_dkdv)
B, H, D, E, NQ, NKV = 2, 2, 128, 128, 29, 10


def _problems():
    """The same block-sparse problem described from torch tensors and from JAX arrays."""
    counts = np.full(NKV, E, np.int32)
    shapes = {"q": (B, NQ * E, H, D), "k": (B, NKV * E, H, D), "v": (B, NKV * E, H, D)}
    from_torch = describe_attention(*(torch.zeros(shapes[n], dtype=torch.bfloat16) for n in "qkv"), block_size=E,
                                    layout="bshd", kv_counts=torch.from_numpy(counts), selection="indices")
    from_jax = describe_attention(*(jnp.zeros(shapes[n], jnp.bfloat16) for n in "qkv"), block_size=E,
                                  layout="bshd", kv_counts=jnp.asarray(counts), selection="indices")
    return from_torch, from_jax


def _named_args(p):
    """The key arguments of an attention launch of p, as the launchers pass them."""
    return dict(BLOCK_ELEMS=p.block_elems, HEAD_DIM=p.head_dim, HAS_COARSE=False, HAS_GATE=False, q_len=p.q_len,
                IGNORE_PADDING=p.padding == "ignore", USE_TMA=True, n_kv_blocks=p.n_kv_blocks)


def test_store_key_is_framework_neutral():
    from_torch, from_jax = _problems()
    for kernel in KERNELS:
        key = kernel.store_key(from_torch, _named_args(from_torch))
        assert key == kernel.store_key(from_jax, _named_args(from_jax))
        assert key[:2] == (kernel.name, "bfloat16")
        assert all(isinstance(value, (bool, int, float, str)) for _, value in key[2:]), key


def test_tile_key_names_dtypes_canonically():
    names = {tile_key("k", dtype)[1] for dtype in (torch.bfloat16, jnp.bfloat16, jnp.zeros(1, jnp.bfloat16).dtype,
                                                   "bfloat16")}
    assert names == {"bfloat16"}
    assert tile_key("k", "float16", n=np.int32(3), flag=np.bool_(True)) == ("k", "float16", ("flag", True), ("n", 3))


def test_tile_key_refuses_framework_values_naming_them():
    with pytest.raises(TypeError, match="q_len"):
        tile_key("k", "bfloat16", q_len=torch.tensor(3))


def test_autotune_off_torch_and_jax_pick_the_default(launch_config):
    launch_config(autotune=False)
    from_torch, from_jax = _problems()
    for kernel in KERNELS:
        picks = [kernel.tile_for(eager_launcher, p, None, (), _named_args(p)) for p in (from_torch, from_jax)]
        assert picks[0] == picks[1] == next(c for c in kernel.candidates if E % c[0] == 0 and E % c[1] == 0)


def test_the_first_choice_of_a_key_is_every_later_call_s():
    """The frontend that reaches a key first times it; the other reads its choice untimed."""
    store = TileStore()
    from_torch, from_jax = _problems()
    candidates = [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
    times = {(128, 64, 4, 3): 2.0, (64, 64, 4, 3): 1.0, (128, 128, 8, 2): float("inf")}
    key_torch = T._sparse_fwd.store_key(from_torch, _named_args(from_torch))
    key_jax = T._sparse_fwd.store_key(from_jax, _named_args(from_jax))
    assert store.choose(key_torch, candidates, times.__getitem__) == (64, 64, 4, 3)

    def never(tile):
        raise AssertionError("a key chosen before was timed again")
    assert store.choose(key_jax, candidates, never) == (64, 64, 4, 3)
    assert store.entries() == {key_torch: (64, 64, 4, 3)}
    assert store.choose(key_torch + (("other", 1),), candidates[:1], never) == candidates[0]  # one: untimed


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["native", "native-jax-first", "callback"])
def test_autotuned_torch_and_jax_agree_bitwise(how):
    """A fresh process (an empty tile store, autotuning on, TMA as by default): the draw that once
    differed, through both frontends, equal bit for bit in out, lse, dq, dk and dv. JAX runs its
    default launch (native custom calls; with JAX first it tunes the problem at trace time) or
    the callback."""
    require_jax_gpu()
    env = {k: v for k, v in os.environ.items() if k not in ("VSA_AUTOTUNE", "VSA_TMA", "VSA_JAX_LAUNCH")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    flags = {"native": [], "native-jax-first": ["--jax-first"], "callback": ["--callback"]}[how]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "autotune_parity_check.py"), *flags],
                          env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0 and "ALL EQUAL" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
