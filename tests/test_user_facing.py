"""First contact (issue 15, section 2): what a new user meets around the operator: the
token-order helpers' length checks, the metadata's repr, errors that say what disagrees,
the CPU warning's location and wording, the docstrings, FastVideo's error wording, demo.py."""

import numpy as np
import pytest

import jax.numpy as jnp
import torch

import vsa_jax
import vsa_torch
from vsa_core import build_vsa_metadata

FRONTENDS = {"torch": (vsa_torch, lambda a: torch.from_numpy(np.ascontiguousarray(a))),
             "jax": (vsa_jax, jnp.asarray)}


# ---- 1. to_tiled / from_tiled check the token count -------------------------------------------------
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("delta", [-284, -1, 1, 64])
def test_tiling_helpers_check_the_token_count(frontend, delta):
    """Too short (a bare IndexError in torch, silent NaN in JAX before) or too long (silently
    truncated before): a ValueError naming the argument and the expected length."""
    fe, make = FRONTENDS[frontend]
    meta = build_vsa_metadata((6, 8, 8), (4, 4, 4))  # 384 raw tokens, 8 tiles -> 512 tiled
    raw = make(np.ones((1, 2, meta.num_tokens + delta, 64), np.float32))
    with pytest.raises(ValueError, match=rf"x must have 384 tokens along dim 2 .*got {384 + delta}"):
        fe.to_tiled(raw, meta)
    tiled = make(np.ones((1, 2, meta.padded_len + delta, 64), np.float32))
    with pytest.raises(ValueError, match=rf"x must have 512 tokens along dim 2 .*got {512 + delta}"):
        fe.from_tiled(tiled, meta)
    with pytest.raises(ValueError, match=r"x must have 512 tokens along dim 2 .*got 384 .*the raw length"):
        fe.from_tiled(make(np.ones((1, 2, meta.num_tokens, 64), np.float32)), meta)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_tiling_helpers_suggest_dim_1_for_bshd(frontend):
    fe, make = FRONTENDS[frontend]
    meta = build_vsa_metadata((6, 8, 8), (4, 4, 4))
    bshd = make(np.ones((1, meta.num_tokens, 2, 64), np.float32))
    with pytest.raises(ValueError, match=r"BSHD arrays: pass dim=1"):
        fe.to_tiled(bshd, meta)
    tiled = fe.to_tiled(bshd, meta, dim=1)
    assert tuple(tiled.shape) == (1, meta.padded_len, 2, 64)
    np.testing.assert_array_equal(np.asarray(fe.from_tiled(tiled, meta, dim=1)), np.asarray(bshd))


def test_tiling_check_is_free_under_jit():
    """JAX: the check reads static shapes only, so it runs at trace time inside jit."""
    import jax
    meta = build_vsa_metadata((6, 8, 8), (4, 4, 4))
    f = jax.jit(lambda x: vsa_jax.from_tiled(vsa_jax.to_tiled(x, meta), meta))
    x = jnp.arange(2 * meta.num_tokens * 64, dtype=jnp.float32).reshape(1, 2, meta.num_tokens, 64)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
    with pytest.raises(ValueError, match="x must have 384 tokens"):
        f(x[:, :, :100])


def test_numpy_tiling_checks_too():
    meta = build_vsa_metadata((5, 6, 7), (4, 4, 4))
    with pytest.raises(ValueError, match=r"x must have 210 tokens along dim 1"):
        meta.to_tiled(np.zeros((2, 211, 3)), axis=1)
    with pytest.raises(ValueError, match=rf"x must have {meta.padded_len} tokens along dim 1"):
        meta.from_tiled(np.zeros((2, 210, 3)), axis=1)


# ---- 7. a short repr ---------------------------------------------------------------------------------
def test_metadata_repr_is_short():
    meta = build_vsa_metadata((5, 6, 7), (4, 4, 4))
    text = repr(meta)
    assert "\n" not in text and len(text) < 240, text
    for fact in ("video_shape=(5, 6, 7)", "tile_size=(4, 4, 4)", "num_tiles=(2, 2, 2)", "8 blocks of 64 tokens",
                 "7 partial", "num_tokens=210", "padded_len=512"):
        assert fact in text, (fact, text)
    assert str(meta) == text


# ---- 9. FastVideo's wording for an unsupported tile --------------------------------------------------
@pytest.mark.parametrize("tile,volume", [((3, 3, 3), 27), ((2, 4, 4), 32), ((8, 8, 8), 512)])
def test_unsupported_tile_volume_uses_fastvideo_wording(tile, volume):
    with pytest.raises(ValueError, match=rf"Unsupported VSA tile volume {volume}\b"):
        build_vsa_metadata((8, 8, 8), tile)
