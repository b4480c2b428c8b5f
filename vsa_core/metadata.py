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

    def __repr__(self) -> str:
        # the index arrays (one entry per token) would fill the screen: summarise them
        n_blocks = math.prod(self.num_tiles)
        partial = int(np.count_nonzero(self.variable_block_sizes < self.block_elems))
        return (f"VSAMetadata(video_shape={self.video_shape}, tile_size={self.tile_size}, "
                f"num_tiles={self.num_tiles}: {n_blocks} blocks of {self.block_elems} tokens ({partial} partial), "
                f"num_tokens={self.num_tokens}, padded_len={self.padded_len})")

    def token_axis(self, name: str, shape, dim: int, tiled: bool) -> int:
        """`dim` as a non-negative axis of an array of `shape` whose tokens lie along it,
        after checking their number: the raw `num_tokens` (tiled=False, the input of
        to_tiled) or the tiled `padded_len` (tiled=True, the input of from_tiled).
        Raises ValueError naming `name` otherwise (a gather would silently truncate a
        longer input, or fail / read garbage for a shorter one)."""
        shape = tuple(int(s) for s in shape)
        if not -len(shape) <= dim < len(shape):
            raise ValueError(f"dim {dim} is out of range for {name} of shape {shape}")
        dim %= len(shape)
        want = self.padded_len if tiled else self.num_tokens
        if shape[dim] != want:
            what = ("padded_len = tiles * tile volume (the tile-ordered sequence)" if tiled
                    else "num_tokens = T*H*W (raw order)")
            if len(shape) == 4 and dim == 2 and shape[1] == want:
                hint = " (BSHD arrays: pass dim=1)"
            elif shape[dim] == (self.num_tokens if tiled else self.padded_len) != want:
                hint = (" (the raw length: from_tiled takes tile-ordered tokens)" if tiled
                        else " (the tiled length: is x tiled already?)")
            else:
                hint = ""
            raise ValueError(f"{name} must have {want} tokens along dim {dim} ({what} of video {self.video_shape} "
                             f"with tile {self.tile_size}), got {shape[dim]} (shape {shape}){hint}")
        return dim

    def to_tiled(self, x: np.ndarray, axis: int = -2) -> np.ndarray:
        """Raw-order tokens along `axis` -> padded tile-contiguous order (zero padding)."""
        x = np.asarray(x)
        axis = self.token_axis("x", x.shape, axis, tiled=False)
        x = np.moveaxis(x, axis, -1)
        out = np.zeros(x.shape[:-1] + (self.padded_len,), dtype=x.dtype)
        out[..., self.non_pad_index] = x[..., self.tiled_from_raw]
        return np.moveaxis(out, -1, axis)

    def from_tiled(self, x: np.ndarray, axis: int = -2) -> np.ndarray:
        """Padded tile-contiguous order along `axis` -> raw order (padding dropped)."""
        x = np.asarray(x)
        axis = self.token_axis("x", x.shape, axis, tiled=True)
        x = np.moveaxis(x, axis, -1)
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
    Raises ValueError for non-positive sizes or another tile volume (its message starts
    with FastVideo's "Unsupported VSA tile volume N", for code that matches on it),
    TypeError for anything but ints.
    """
    volume = math.prod(_as_triple("tile_size", tile_size))
    if volume not in SUPPORTED_TILE_VOLUMES:
        raise ValueError(f"Unsupported VSA tile volume {volume}: tile_size must hold {SUPPORTED_TILE_VOLUMES} "
                         f"tokens (t*h*w), got {tuple(tile_size)} ({volume} tokens)")
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
