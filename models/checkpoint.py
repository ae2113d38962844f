"""The weight files of a model directory: which tensors, their dtypes and shapes, and where they lie.

Reads safetensors headers only (no tensor data), for a single `model.safetensors` or a sharded
set listed by `model.safetensors.index.json`, and checks every file and tensor a model needs.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ir.errors import RudaError

from .ggml_types import dequantise, int4_part, rope_rows_in_order

FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
SAFETENSORS_DTYPES = {**FLOAT_DTYPES, "I32": "int32"}
ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024
ROTARY_BUFFER = "rotary_emb.inv_freq"  # a buffer older conversions saved with the weights: derived, so ignored
_LAYER = re.compile(r"\blayers\.(\d+)\.")
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32}


class CheckpointError(RudaError):
    """A weight file is missing, corrupt, or does not hold the tensors the model needs."""

    exit_code = 4


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: file, byte range (absolute), dtype and shape."""

    name: str
    file: Path
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    encoding: str = ""
    """A ggml block format (models.ggml_types) the values are stored in, decoded and rounded to `dtype` at load."""
    rope_rows: int = 0
    """The head_dim of q/k rows stored in llama.cpp's interleaved rotary order (reordered at load), or 0."""
    part: str = ""
    """The INT4 part (qweight, qzeros or offsets, scales) this entry makes of 4-bit blocks
    (models.ggml_types.int4_part), or "" for the tensor's values."""


def _ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _read_header(path: Path) -> dict[str, TensorEntry]:
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file; re-download it")
            (n,) = struct.unpack("<Q", raw_len)
            if n > _MAX_HEADER:
                raise CheckpointError(f"{path}: header length {n} is implausible; the file is corrupt, re-download it")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror}); fix its permissions or restore it") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path}: safetensors header is not valid JSON; the file is corrupt, re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object; the file is corrupt, re-download it")
    size = path.stat().st_size
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], tuple(info["shape"])
        except (KeyError, TypeError, ValueError):
            begin = end = dtype = shape = None
        if not (_ints(begin, end, *shape) if isinstance(shape, tuple) else False) or not isinstance(dtype, str) \
                or any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: header entry for {name!r} is malformed; the file is corrupt") from None
        if 8 + n + end > size or not 0 <= begin <= end:
            raise CheckpointError(f"{path}: tensor {name!r} lies beyond the end of the file; the file is truncated, re-download it")
        entries[name] = TensorEntry(name, path, 8 + n + begin, 8 + n + end, dtype, shape)
    return entries


def _index_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_FILE
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except OSError as e:
        raise CheckpointError(f"{index}: cannot be read ({e.strerror}); fix its permissions or restore it") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
        raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' object); restore it from the checkpoint") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
    root = model_dir.resolve()
    files = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: the shard of {name!r} must be a file name, got {shard!r}")
        path = model_dir / shard
        if root not in path.resolve().parents:
            raise CheckpointError(f"{index}: the shard of {name!r} ({shard}) lies outside the model directory; every "
                                  f"shard must be a file inside {model_dir}")
        files[name] = path
    return files


def read_tensor(entry: TensorEntry, mapped) -> np.ndarray:
    """A tensor's values from its mapped file: a view (no copy) unless they are stored as blocks or reordered."""
    if entry.part:
        return int4_part(entry.encoding, np.frombuffer(mapped, np.uint8, entry.end - entry.start, entry.start),
                         entry.shape, entry.part, entry.rope_rows).astype(NUMPY_DTYPES[entry.dtype], copy=False)
    if entry.encoding:
        array = dequantise(entry.encoding, np.frombuffer(mapped, np.uint8, entry.end - entry.start, entry.start),
                           entry.shape).astype(NUMPY_DTYPES[entry.dtype])
    else:
        dtype = np.dtype(NUMPY_DTYPES[entry.dtype])
        array = np.frombuffer(mapped, dtype, (entry.end - entry.start) // dtype.itemsize, entry.start).reshape(
            entry.shape)
    return rope_rows_in_order(array, entry.rope_rows) if entry.rope_rows else array


def scan_checkpoint(model_dir: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in `model_dir`, from `model.safetensors`, its sharded index, or a GGUF file."""
    from .gguf import gguf_file, gguf_tensors  # gguf reads TensorEntry from here
    if gguf_file(model_dir) is not None:
        return gguf_tensors(gguf_file(model_dir))
    model_dir = Path(model_dir)
    if (model_dir / SINGLE_FILE).is_file():
        return _read_header(model_dir / SINGLE_FILE)
    if not (model_dir / INDEX_FILE).is_file():
        raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} and no {INDEX_FILE}; copy the checkpoint's weight files there")
    where = _index_files(model_dir)
    headers: dict[Path, dict[str, TensorEntry]] = {}
    for shard in sorted(set(where.values())):
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing; copy every shard of the checkpoint")
        headers[shard] = _read_header(shard)
    entries = {}
    for name, shard in where.items():
        if name not in headers[shard]:
            raise CheckpointError(f"{shard}: does not hold tensor {name!r} that {INDEX_FILE} places there; the shard is wrong or corrupt")
        entries[name] = headers[shard][name]
    return entries


def check_tensors(entries: dict[str, TensorEntry], shapes: dict[str, tuple[int, ...]], model_dir: str | Path,
                  ignored: tuple[str, ...] = (), packed: frozenset[str] = frozenset(),
                  config: str = "config.json") -> dict[str, str]:
    """Check the checkpoint holds exactly the tensors a config implies (each with its shape and a float dtype, int32
    for the `packed` words of quantised weights), besides those whose names start with an `ignored` prefix or are
    rotary buffers; returns name -> dtype. `config` names where the config comes from, for the errors."""
    dtypes = {}
    for name, shape in shapes.items():
        entry = entries.get(name)
        if entry is None:
            raise CheckpointError(f"{model_dir}: tensor {name!r} is missing from the checkpoint; "
                                  f"the weights do not match {config}")
        allowed = ("I32",) if name in packed else tuple(FLOAT_DTYPES)
        if entry.dtype not in allowed:
            raise CheckpointError(f"{entry.file}: tensor {name!r} has dtype {entry.dtype}; "
                                  f"supported: {', '.join(allowed)}" + (" (packed 4-bit words)" if name in packed else ""))
        if entry.shape != tuple(shape):
            raise CheckpointError(f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, {config} implies "
                                  f"{list(shape)}; the weights do not match {config}")
        count = 1
        for d in shape:
            count *= d
        if not entry.encoding and entry.end - entry.start != count * ITEM_SIZE[entry.dtype]:
            raise CheckpointError(f"{entry.file}: tensor {name!r} spans {entry.end - entry.start} bytes, not the "
                                  f"{count * ITEM_SIZE[entry.dtype]} its shape and dtype need; the file is corrupt")
        dtypes[name] = SAFETENSORS_DTYPES[entry.dtype]
    extra = sorted(name for name in entries if name not in shapes and not name.startswith(ignored)
                   and not name.endswith(ROTARY_BUFFER))
    if extra:
        layers = sorted({int(m.group(1)) for m in map(_LAYER.search, extra) if m})
        what = (f"layers {layers[0]}..{layers[-1]} that {config} does not have" if layers else
                f"{len(extra)} tensors {config} does not describe ({', '.join(extra[:3])}"
                f"{', ...' if len(extra) > 3 else ''})")
        raise CheckpointError(f"{model_dir}: the checkpoint holds {what}; the weights do not match {config}: "
                              f"restore the checkpoint's own {config}")
    return dtypes
