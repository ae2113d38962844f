"""What the vision encoder and the multimodal steps need besides pixels, computed from each image's patch grid.

- Encoder inputs (`encoder_inputs`): each patch's (row, column) in its grid, in the merge-block order of the
  preprocessor's patches; its image (attention stays within one); and the four taps and weights that resample
  the learned square grid of position embeddings bilinearly (corners aligned) to the image's grid.
- Prompt layout (`ImagePrompt`): each image placeholder expanded to the image's token count, and every token's
  multimodal rotary position (temporal, height, width): text counts up on all three axes; an image's tokens
  take (start, start + row, start + column) over its merged grid, and the text after it continues from
  start + max(rows, columns). Tokens after the prompt keep that offset (`rope_positions`).

Everything here is numpy on small integer grids: no TVM, no model weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from models.qwen3_5_vision import TAPS, VisionConfig

Grid = tuple[int, int, int]  # (frames, patch rows, patch columns) of one image


def grid_positions(grid: Grid, merge: int) -> np.ndarray:
    """Each patch's (row, column) [t*h*w, 2], patches in merge-block order, repeated per frame."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = lambda a: a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
    return np.tile(np.stack([block(rows), block(cols)], axis=1), (t, 1)).astype(np.int32)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Per coordinate: the two grid points it falls between ([n, 2]) and their weights, corners aligned."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.maximum(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0)
    return np.clip(taps, 0, side - 1), weights.astype(np.float32)


def interpolation_taps(positions: np.ndarray, grid: Grid, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's four position-embedding rows ([n, 4] int32) and weights ([n, 4] float32), from its grid position
    (grid_positions)."""
    (h_taps, h_w), (w_taps, w_w) = (_axis_taps(positions[:, a], size, side) for a, size in ((0, grid[1]), (1, grid[2])))
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, TAPS)
    return index.astype(np.int32), (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, TAPS)


def encoder_inputs(pixels: np.ndarray, grids: list[Grid], vision: VisionConfig, patches: int) -> dict[str, np.ndarray]:
    """The encode_image inputs by role for these images' patches (in order), padded to `patches` rows."""
    real = len(pixels)
    positions = [grid_positions(g, vision.spatial_merge_size) for g in grids]
    taps = [interpolation_taps(p, g, vision.grid_side) for p, g in zip(positions, grids)]
    values = {
        "image_patches": np.zeros((patches, pixels.shape[1]), np.float32),
        "patch_positions": np.zeros((patches, 2), np.int32),
        "patch_images": np.full(patches, -1, np.int32),  # padding patches attend among themselves
        "patch_interpolation_index": np.zeros((patches, TAPS), np.int32),
        "patch_interpolation_weight": np.zeros((patches, TAPS), np.float32),
    }
    values["image_patches"][:real] = pixels
    values["patch_positions"][:real] = np.concatenate(positions)
    values["patch_images"][:real] = np.repeat(np.arange(len(grids)), [int(np.prod(g)) for g in grids])
    values["patch_interpolation_index"][:real] = np.concatenate([index for index, _ in taps])
    values["patch_interpolation_weight"][:real] = np.concatenate([weight for _, weight in taps])
    return values


def pack_images(counts: list[int], largest: int) -> list[list[int]]:
    """The images (indices) of each encoder call: consecutive images while their patches fit the largest bucket."""
    calls: list[list[int]] = []
    used = largest
    for i, n in enumerate(counts):
        if used + n > largest:
            calls.append([])
            used = 0
        calls[-1].append(i)
        used += n
    return calls


@dataclass
class ImagePrompt:
    """A prompt with its images: the token ids with each placeholder expanded to its image's tokens, the image
    embeddings by token row, every prompt token's rotary position, and the offset of the tokens after it."""

    token_ids: list[int]
    embeddings: np.ndarray
    """[image tokens, hidden]: the rows of the prompt's image tokens, in order."""
    image_rows: np.ndarray
    """[prompt tokens] int32: each token's row of `embeddings`, or -1 for a text token."""
    positions: np.ndarray
    """[prompt tokens, 3] int32 rotary positions."""
    digests: list[tuple[int, int, bytes]] = field(default_factory=list)
    """(first token, last token + 1, content hash) of each image: what a cached prefix must match besides ids."""

    @cached_property
    def offset(self) -> int:
        """What a token after the prompt adds to its position on every axis."""
        return int(self.positions.max()) + 1 - len(self.token_ids)

    def rope_positions(self, start: int, count: int) -> np.ndarray:
        """Rotary positions [count, 3] of the sequence's tokens start..start+count (past the prompt: offset)."""
        out = np.repeat(np.arange(start, start + count, dtype=np.int32)[:, None] + self.offset, 3, axis=1)
        out[:self._inside(start, count)] = self.positions[start:start + count]
        return out

    def rows(self, start: int, count: int) -> np.ndarray:
        """Each token's row of `embeddings` (-1: text), for tokens start..start+count."""
        out = np.full(count, -1, np.int32)
        out[:self._inside(start, count)] = self.image_rows[start:start + count]
        return out

    def _inside(self, start: int, count: int) -> int:
        """How many of the tokens start..start+count are prompt tokens."""
        return max(0, min(len(self.token_ids), start + count) - start)


def image_prompt(prompt_ids: list[int], embeddings: list[np.ndarray], grids: list[Grid], vision: VisionConfig,
                 digests: list[bytes]) -> ImagePrompt:
    """Expand each image placeholder of `prompt_ids` (one image_token_id per image, in order) to its image's
    tokens and lay out the rotary positions (the caller has checked the placeholder count)."""
    merge = vision.spatial_merge_size
    ids: list[int] = []
    rows: list[int] = []
    positions: list[np.ndarray] = []
    spans = []
    next_pos, image, row = 0, 0, 0
    for token in prompt_ids:
        if token != vision.image_token_id:
            ids.append(token)
            rows.append(-1)
            positions.append(np.full((1, 3), next_pos, np.int32))
            next_pos += 1
            continue
        t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        positions.append(np.stack([tt, hh, ww], axis=-1).reshape(-1, 3).astype(np.int32) + next_pos)
        spans.append((len(ids), len(ids) + t * h * w, digests[image]))
        ids.extend([vision.image_token_id] * (t * h * w))
        rows.extend(range(row, row + t * h * w))
        row += t * h * w
        next_pos += max(h, w)
        image += 1
    stacked = np.concatenate(embeddings).astype(np.float32) if embeddings else np.zeros((0, 0), np.float32)
    return ImagePrompt(ids, stacked, np.asarray(rows, np.int32), np.concatenate(positions), spans)


def image_digest(pixels: np.ndarray, grid: Grid) -> bytes:
    """A content hash of one preprocessed image (its patches and grid)."""
    return hashlib.sha256(np.ascontiguousarray(pixels, np.float32).tobytes() + repr(grid).encode()).digest()
