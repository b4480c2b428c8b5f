"""vsa_core.metadata: the tile partition (numpy, no kernels)."""

import numpy as np
import pytest

from vsa_core import build_vsa_metadata, variable_block_sizes


@pytest.mark.parametrize("video,tile", [((4, 8, 8), (4, 4, 4)), ((5, 6, 7), (4, 4, 4)), ((3, 9, 10), (2, 4, 8)),
                                        ((1, 1, 1), (4, 4, 4))])
def test_partition_round_trip(video, tile):
    meta = build_vsa_metadata(video, tile)
    T, H, W = video
    raw = np.arange(T * H * W)
    assert sorted(meta.tiled_from_raw.tolist()) == raw.tolist()  # a permutation
    x = np.random.default_rng(0).standard_normal((2, T * H * W, 3))
    tiled = meta.to_tiled(x, axis=1)
    assert tiled.shape == (2, meta.padded_len, 3)
    np.testing.assert_array_equal(meta.from_tiled(tiled, axis=1), x)
    assert meta.variable_block_sizes.sum() == T * H * W
    assert meta.non_pad_index.size == T * H * W


def test_tile_contents_are_the_video_tiles():
    meta = build_vsa_metadata((4, 8, 16), (2, 4, 8))
    grid = np.arange(4 * 8 * 16).reshape(4, 8, 16)
    first_tile = grid[0:2, 0:4, 0:8].reshape(-1)
    np.testing.assert_array_equal(meta.tiled_from_raw[:64], first_tile)
    second_tile = grid[0:2, 0:4, 8:16].reshape(-1)  # tiles in row-major (t, h, w) order
    np.testing.assert_array_equal(meta.tiled_from_raw[64:128], second_tile)


def test_variable_block_sizes_at_the_edges():
    sizes = variable_block_sizes((5, 6, 7), (4, 4, 4))
    assert sizes.shape == (2 * 2 * 2,)
    expected = [a * b * c for a in (4, 1) for b in (4, 2) for c in (4, 3)]
    np.testing.assert_array_equal(sizes, expected)


@pytest.mark.parametrize("bad,message", [((4, 4), "video_shape must be 3"), ((4, 0, 4), "video_shape must be 3"),
                                         (4, "video_shape must be a")])
def test_bad_shapes(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build_vsa_metadata(bad, (4, 4, 4))


@pytest.mark.parametrize("tile", [(2, 4, 4), (4, 4, 2), (8, 8, 8), (1, 1, 1)])
def test_unsupported_tile_volumes_raise(tile):
    """FastVideo raises for tiles the kernels cannot run (E must be 64, 128 or 256)."""
    with pytest.raises(ValueError, match=r"Unsupported VSA tile volume \d+: tile_size must hold \(64, 128, 256\) tokens"):
        build_vsa_metadata((8, 8, 8), tile)


@pytest.mark.parametrize("tile", [(4, 4, 4), (4, 4, 8), (4, 8, 8), (2, 4, 8)])
def test_supported_tile_volumes(tile):
    assert build_vsa_metadata((8, 8, 8), tile).block_elems in (64, 128, 256)


@pytest.mark.parametrize("bad", [(4.5, 4, 4), (4.0, 4, 4), (True, 4, 4)])
def test_non_int_tile_sizes_raise(bad):
    with pytest.raises(TypeError, match="tile_size must be a \\(t, h, w\\) tuple of ints"):
        build_vsa_metadata((8, 8, 8), bad)


def test_build_vsa_metadata_is_documented():
    doc = build_vsa_metadata.__doc__
    assert doc and "64, 128 or 256" in doc and "variable_block_sizes" in doc
