"""Tile partition of a (T, H, W) video latent, framework-neutral (numpy).

VSA works on tokens ordered tile by tile: the latent is cut into (t, h, w) tiles,
each tile's tokens are stored contiguously in E = t*h*w slots, and a tile cut by the
video's edge keeps its valid tokens at the start of its slots and padding after
them. `variable_block_sizes` counts the valid tokens per tile.

All index arrays are int64 numpy arrays; frontends gather with them
(`x[..., idx, :]`) on their own devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np


def _as_triple(name: str, value) -> Tuple[int, int, int]:
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a (t, h, w) tuple of ints, got {value!r}") from None
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in items):
        raise TypeError(f"{name} must be a (t, h, w) tuple of ints, got {value!r}")
    t = tuple(int(x) for x in items)
    if len(t) != 3 or min(t) < 1:
        raise ValueError(f"{name} must be 3 positive ints (t, h, w), got {value!r}")
    return t


@dataclass(frozen=True)
class VSAMetadata:
    """Everything a model needs to run VSA on one video shape.

    - `variable_block_sizes[i]`: valid tokens in tile i (pass it as both
      `variable_block_sizes` and `q_variable_block_sizes` for self-attention);
    - `tiled_from_raw[j]`: raw (row-major T, H, W) token index of the j-th valid
      token in tile order, so `tiled_valid = raw[..., tiled_from_raw, :]`;
    - `non_pad_index[j]`: the slot of that token in the padded tiled sequence, so
      `padded[..., non_pad_index, :] = tiled_valid`;
    - `raw_from_tiled`: the inverse permutation of `tiled_from_raw`.
    """

    video_shape: Tuple[int, int, int]
    tile_size: Tuple[int, int, int]
    num_tiles: Tuple[int, int, int]
    variable_block_sizes: np.ndarray
    tiled_from_raw: np.ndarray
    raw_from_tiled: np.ndarray
    non_pad_index: np.ndarray

    @property
    def block_elems(self) -> int:
        return math.prod(self.tile_size)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.video_shape)

    @property
    def padded_len(self) -> int:
        return math.prod(self.num_tiles) * self.block_elems

    def to_tiled(self, x: np.ndarray, axis: int = -2) -> np.ndarray:
        """Raw-order tokens along `axis` -> padded tile-contiguous order (zero padding)."""
        x = np.moveaxis(np.asarray(x), axis, -1)
        out = np.zeros(x.shape[:-1] + (self.padded_len,), dtype=x.dtype)
        out[..., self.non_pad_index] = x[..., self.tiled_from_raw]
        return np.moveaxis(out, -1, axis)

    def from_tiled(self, x: np.ndarray, axis: int = -2) -> np.ndarray:
        """Padded tile-contiguous order along `axis` -> raw order (padding dropped)."""
        x = np.moveaxis(np.asarray(x), axis, -1)
        return np.moveaxis(x[..., self.non_pad_index][..., self.raw_from_tiled], -1, axis)


def num_tiles(video_shape, tile_size) -> Tuple[int, int, int]:
    video_shape = _as_triple("video_shape", video_shape)
    tile_size = _as_triple("tile_size", tile_size)
    return tuple(-(-v // t) for v, t in zip(video_shape, tile_size))


def variable_block_sizes(video_shape, tile_size) -> np.ndarray:
    """Valid tokens per tile, tiles in row-major (t, h, w) order."""
    video_shape = _as_triple("video_shape", video_shape)
    tile_size = _as_triple("tile_size", tile_size)
    per_axis = []
    for v, t in zip(video_shape, tile_size):
        n = -(-v // t)
        per_axis.append(np.minimum(t, v - t * np.arange(n)))
    sizes = per_axis[0][:, None, None] * per_axis[1][None, :, None] * per_axis[2][None, None, :]
    return sizes.reshape(-1).astype(np.int32)


def tiled_from_raw(video_shape, tile_size) -> np.ndarray:
    """Raw token index of each valid token, in tile-contiguous order."""
    video_shape = _as_triple("video_shape", video_shape)
    tile_size = _as_triple("tile_size", tile_size)
    T, H, W = video_shape
    tt, th, tw = tile_size
    raw = np.arange(T * H * W).reshape(T, H, W)
    order = []
    for t0 in range(0, T, tt):
        for h0 in range(0, H, th):
            for w0 in range(0, W, tw):
                order.append(raw[t0:t0 + tt, h0:h0 + th, w0:w0 + tw].reshape(-1))
    return np.concatenate(order).astype(np.int64)


def non_pad_index(video_shape, tile_size) -> np.ndarray:
    """Slot of each valid token in the padded tile-contiguous sequence."""
    sizes = variable_block_sizes(video_shape, tile_size)
    E = math.prod(_as_triple("tile_size", tile_size))
    return np.concatenate([i * E + np.arange(n) for i, n in enumerate(sizes)]).astype(np.int64)


SUPPORTED_TILE_VOLUMES = (64, 128, 256)


def build_vsa_metadata(video_shape, tile_size=(4, 4, 4)) -> VSAMetadata:
    """Tile partition of a (T, H, W) video latent for VSA.

    `video_shape`: the latent's (frames, height, width) in tokens; `tile_size`: the
    (t, h, w) tile, whose volume t*h*w is the block size E and must be 64, 128 or 256
    (the kernels' block sizes; (4, 4, 4) gives 64). Tiles cut by the video's edge are
    partial: their valid tokens come first and `variable_block_sizes` counts them.

    Returns a `VSAMetadata` (numpy arrays): pass `meta.variable_block_sizes` as both
    counts of `video_sparse_attn` and `meta.tile_size` as its `block_size`, and move
    tokens between raw (t, h, w row-major) and tiled order with the frontends'
    `to_tiled` / `from_tiled` (or `meta.to_tiled` / `meta.from_tiled` on numpy arrays).
    Raises ValueError for non-positive sizes or another tile volume, TypeError for
    anything but ints.
    """
    volume = math.prod(_as_triple("tile_size", tile_size))
    if volume not in SUPPORTED_TILE_VOLUMES:
        raise ValueError(f"tile_size must hold {SUPPORTED_TILE_VOLUMES} tokens (t*h*w), got {tuple(tile_size)} "
                         f"({volume} tokens)")
    forward = tiled_from_raw(video_shape, tile_size)
    inverse = np.empty_like(forward)
    inverse[forward] = np.arange(forward.size)
    return VSAMetadata(
        video_shape=_as_triple("video_shape", video_shape),
        tile_size=_as_triple("tile_size", tile_size),
        num_tiles=num_tiles(video_shape, tile_size),
        variable_block_sizes=variable_block_sizes(video_shape, tile_size),
        tiled_from_raw=forward,
        raw_from_tiled=inverse,
        non_pad_index=non_pad_index(video_shape, tile_size),
    )
