"""Loading checkpoint tensors (single or sharded safetensors, f32/f16/bf16) into device memory.

Weights keep their checkpoint dtype: bf16 stays bf16 and is widened inside the kernels.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import ml_dtypes
import numpy as np
import tvm

from models.checkpoint import TensorEntry

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


def read_tensor(entry: TensorEntry, mapped: mmap.mmap) -> np.ndarray:
    """A tensor's data as a numpy array over the mapped file (no copy)."""
    return np.frombuffer(mapped, dtype=NUMPY_DTYPES[entry.dtype], count=(entry.end - entry.start) // np.dtype(
        NUMPY_DTYPES[entry.dtype]).itemsize, offset=entry.start).reshape(entry.shape)


def load_tensors(entries: dict[str, TensorEntry], names: list[str], device: tvm.runtime.Device) -> list[tvm.runtime.Tensor]:
    """The named tensors, in order, copied onto `device`."""
    maps: dict[Path, mmap.mmap] = {}
    out = []
    for name in names:
        entry = entries[name]
        if entry.file not in maps:
            with entry.file.open("rb") as f:
                maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        out.append(tvm.runtime.tensor(read_tensor(entry, maps[entry.file]), device))
    return out
