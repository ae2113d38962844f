"""Loading params from checkpoint tensors (single or sharded safetensors, f32/f16/bf16, or a GGUF file) into device
memory, each made by its transform of the weight map.

Weights keep their checkpoint dtype: bf16 stays bf16 and is widened inside the kernels. A tensor holding
NaN or infinity gives a warning naming it (the model still loads: its output will likely be garbage).
"""

from __future__ import annotations

import mmap
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tvm

from ir.contract import ParamSpec
from ir.errors import RudaWarning
from ir.packing import PAIR_SLOTS, awq_tile_words, pair_tile_words
from models.checkpoint import CheckpointError, TensorEntry, read_tensor

from .cpu import tensor_memory

# The exponent bits of each dtype: all set means infinity or NaN.
EXPONENT_MASKS = {"F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80)}
_CHUNK = 1 << 22  # elements checked at a time
LOAD_THREADS = 8  # params made at once at most (each holds its numpy intermediates: a GGUF head's, ~1 GB)


def nonfinite_count(array: np.ndarray, dtype: str) -> int:
    """How many elements of a float tensor of safetensors `dtype` are NaN or infinite."""
    bits, mask = EXPONENT_MASKS[dtype]
    flat = array.reshape(-1).view(bits)
    return sum(int(np.count_nonzero((flat[i:i + _CHUNK] & bits(mask)) == bits(mask)))
               for i in range(0, flat.size, _CHUNK))


def awq_tiles(qweight: np.ndarray) -> np.ndarray:
    """AWQ qweight [in, words] regrouped into column tiles [words / tile, in, tile] (ir.packing)."""
    rows, words = qweight.shape
    tile = awq_tile_words(words)
    return np.ascontiguousarray(qweight.reshape(rows, words // tile, tile).transpose(1, 0, 2))


def pair_words(words: np.ndarray, out: int) -> np.ndarray:
    """AWQ words [rows, out / 8] -> words of the pairs layout [out / (4 tile), ceil(rows / 2), tile] (ir.packing): the
    16-bit halves of rows 2p and 2p + 1 interleaved, one transposing copy."""
    tile = pair_tile_words(out)
    if len(words) % 2:
        words = np.concatenate([words, np.zeros((1, words.shape[1]), words.dtype)])
    halves = words.view(np.uint16).reshape(-1, 2, out // (PAIR_SLOTS * tile), tile // 2, 2)  # [pair, row, t, c, half]
    return np.ascontiguousarray(halves.transpose(2, 0, 3, 4, 1)).view(np.int32).reshape(
        out // (PAIR_SLOTS * tile), -1, tile)


def pair_scales(scales: np.ndarray) -> np.ndarray:
    """Scales [groups, out] -> the pairs layout's [out / (4 tile), groups, 4 tile] (ir.packing.pair_scale)."""
    groups, out = scales.shape
    tile = pair_tile_words(out)
    split = scales.reshape(groups, out // (PAIR_SLOTS * tile), tile // 2, PAIR_SLOTS, 2)  # [g, t, c, nibble, half]
    return np.ascontiguousarray(split.transpose(1, 0, 3, 2, 4)).reshape(-1, groups, PAIR_SLOTS * tile)


TRANSFORMS = {
    "copy": lambda arrays: arrays[:1],
    "flatten": lambda arrays: [arrays[0].reshape(arrays[0].shape[0], -1)],
    "awq_tiles": lambda arrays: [awq_tiles(arrays[0]), *arrays[1:]],
    "awq_pairs": lambda arrays: [pair_words(arrays[0], arrays[2].shape[1]), pair_words(arrays[1], arrays[2].shape[1]),
                                 pair_scales(arrays[2])],
    "affine_pairs": lambda arrays: [pair_words(arrays[0], arrays[2].shape[1]), pair_scales(arrays[1]),
                                    pair_scales(arrays[2])],
}
"""The weight map's transforms (ir.graph.WEIGHT_TRANSFORMS): source arrays -> the arrays the param is passed as."""


def load_params(entries: dict[str, TensorEntry], params: tuple[ParamSpec, ...],
                device: tvm.runtime.Device) -> list[tvm.runtime.Tensor]:
    """The arrays of each param, in order (one, or a packed param's parts), made from its checkpoint tensors by its
    transform and copied onto `device` (with a warning for each float source that is not all finite). The params
    are made and copied on the cores in parallel: numpy lets go of the GIL, and a GGUF file's repacking and the
    first touch of fresh memory are most of a load."""
    maps = {file: _mapped(file) for file in {entries[name].file for p in params for name in p.sources}}
    memory = tensor_memory(device)

    def tensors(p: ParamSpec) -> list[tvm.runtime.Tensor]:
        sources = [_source(entries[name], name, maps) for name in p.sources]
        return [memory.copy(array) for array in TRANSFORMS[p.transform](sources)]

    with ThreadPoolExecutor(min(LOAD_THREADS, len(os.sched_getaffinity(0)))) as pool:
        return [tensor for made in pool.map(tensors, params) for tensor in made]


def _mapped(file: Path) -> mmap.mmap:
    """A checkpoint file mapped for reading."""
    try:
        with file.open("rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror}); fix its permissions or restore it") from None


def _source(entry: TensorEntry, name: str, maps: dict[Path, mmap.mmap]) -> np.ndarray:
    """One checkpoint tensor over its mapped file."""
    try:
        array = read_tensor(entry, maps[entry.file])
    except ValueError:
        raise CheckpointError(f"{entry.file}: shorter than its header says (truncated since it was checked); "
                              "restore it") from None
    bad = nonfinite_count(array, entry.dtype) if entry.dtype in EXPONENT_MASKS else 0
    if bad:
        warnings.warn(f"{entry.file}: tensor {name!r} holds {bad} NaN or infinite values; the checkpoint is "
                      "probably damaged, and generated text will be garbage", RudaWarning, stacklevel=3)
    return array
