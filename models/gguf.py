"""GGUF model files (llama.cpp's format): the header, metadata and tensor table, read with the file mapped, and what
the loaders need from them: a config.json-like dict, the tensors under Hugging Face names, and their decoding.

    MODEL_DIR/NAME.gguf    one GGUF file and no config.json: the model, its tokenizer and its chat template

Tensors stored as F32, F16 or BF16 are used as they are. Projections, the embedding and the head stored in a
block type (every one ggml_types reads: the integer types, INT_TYPES) stay packed: the model is an AWQ INT4 one of
group 32 (its quantization_config says so, naming the projections stored otherwise as not converted, and in
`packed_modules` those packed otherwise than Q4_0's plain AWQ INT4, with float offsets, as two planes or with
two-level scales, and the embedding and head), each such weight's parts repacked from the same bits at load
(models.ggml_types.int4_part); the embedding's rows are unpacked as they are looked up. A block tensor no packing
takes (a vocabulary whose rows are no whole 8-column words) is dequantised when the weights are loaded, to the values
llama.cpp computes, rounded to float16 (BLOCK_DTYPE: half the bytes of float32 for every decode step to read,
within 2^-11 of each value, some 40x finer than llama.cpp's own rounding of the activations for its quantised
products). Llama's q and k rows, which llama.cpp's converter interleaves for its rotary layout, are put back in
Hugging Face's order at load.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ir import Packing

from .checkpoint import CheckpointError, TensorEntry, read_tensor
from .config import ModelConfigError
from .ggml_types import BLOCK_TYPES, INT_TYPES, OTHER_TYPES, RAW_TYPES, SUPPORTED
from .quantization import PROJECTION, awq_config

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ARCHITECTURES = ("llama", "qwen2")
BLOCK_DTYPE = "F16"  # what a block type's values are held as once decoded
# metadata value type id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
VOCABULARY_MATRICES = ("model.embed_tokens.weight", "lm_head.weight")  # packed too where stored in an integer type
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
END_OF_GENERATION = ("eos_token_id", "eot_token_id", "eom_token_id")  # llama.cpp stops on each (end of turn, ...)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rotary frequency divisors, a config value stored as a tensor


@dataclass(frozen=True)
class GgufFile:
    """A parsed GGUF file: its metadata and its tensors (GGUF names, shapes outermost first)."""

    path: Path
    metadata: dict
    tensors: dict[str, TensorEntry]


def gguf_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a model directory is, or None for a Hugging Face directory (one with a config.json)."""
    model_dir = Path(model_dir)
    if (model_dir / "config.json").exists() or not model_dir.is_dir():
        return None
    found = sorted(p for p in model_dir.iterdir() if p.suffix == ".gguf" and p.is_file())
    if len(found) > 1:
        raise CheckpointError(f"{model_dir}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                              "a model directory holds one: move the others out")
    return found[0] if found else None


class _Cursor:
    """Sequential little-endian reads over the mapped file, each checked against its end."""

    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.at = data, path, 0

    def take(self, size: int) -> int:
        start = self.at
        if size < 0 or start + size > len(self.data):
            raise CheckpointError(f"{self.path}: ends inside its header (at byte {start} of {len(self.data)}); the "
                                  "file is truncated or not a GGUF file: download it again")
        self.at += size
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from("<" + fmt, self.data, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.scalar("Q")
        start = self.take(size)
        try:
            return bytes(self.data[start:start + size]).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: a string at byte {start} is not UTF-8; the file is corrupt, "
                                  "download it again") from None

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise CheckpointError(f"{self.path}: metadata value of unknown type {kind} at byte {self.at}; the file "
                                  "is corrupt or from a newer GGUF version")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _NUMPY:
            size = np.dtype(_NUMPY[item]).itemsize
            start = self.take(count * size)
            return np.frombuffer(self.data, _NUMPY[item], count, start).tolist()
        return [self.value(item) for _ in range(count)]


def read_gguf(path: Path) -> GgufFile:
    """Parse a GGUF file's header, metadata and tensor table (the tensor data stays on disk; the last few files
    parsed are kept while unchanged on disk)."""
    try:
        stat = path.stat()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror}); fix its permissions or restore it") from None
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _parsed(path: Path, mtime_ns: int, size: int) -> GgufFile:
    try:
        with path.open("rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e}); fix its permissions "
                              "or restore it") from None
    with data:
        if data[:4] != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (its first bytes are {bytes(data[:4])!r}, not "
                                  f"{MAGIC!r}); pass a llama.cpp GGUF model file")
        cursor = _Cursor(data, path)
        cursor.take(4)
        version = cursor.scalar("I")
        if version not in VERSIONS:
            raise CheckpointError(f"{path}: GGUF version {version}; supported: {', '.join(map(str, VERSIONS))} "
                                  "(little-endian); convert it again with a current llama.cpp")
        n_tensors, n_values = cursor.scalar("Q"), cursor.scalar("Q")
        metadata = {}
        for _ in range(n_values):
            key = cursor.string()
            try:
                metadata[key] = cursor.value(cursor.scalar("I"))
            except RecursionError:
                raise CheckpointError(f"{path}: metadata {key!r} nests arrays past any real file; the file is "
                                      "corrupt") from None
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
            infos.append((name, tuple(reversed(dims)), cursor.scalar("I"), cursor.scalar("Q")))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{path}: general.alignment is {alignment!r}, not a power of two; the file is "
                                  "corrupt")
        start = -(-cursor.at // alignment) * alignment
        tensors = {name: _entry(path, name, shape, kind, start + offset, len(data))
                   for name, shape, kind, offset in infos}
    return GgufFile(path, metadata, tensors)


def _entry(path: Path, name: str, shape: tuple[int, ...], kind: int, begin: int, size: int) -> TensorEntry:
    """A tensor's entry: raw types as their safetensors dtype, block types decoded to BLOCK_DTYPE at load."""
    if kind in RAW_TYPES:
        encoding, (dtype, per_block, block_bytes) = "", RAW_TYPES[kind]
    elif kind in BLOCK_TYPES:
        (encoding, per_block, block_bytes), dtype = BLOCK_TYPES[kind], BLOCK_DTYPE
    else:
        raise CheckpointError(f"{path}: tensor {name!r} is stored as {OTHER_TYPES.get(kind, f'ggml type {kind}')}; "
                              f"supported: {SUPPORTED}; convert or quantise the model to one of those")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if not shape or shape[-1] % per_block:
        raise CheckpointError(f"{path}: tensor {name!r} of shape {list(shape)} does not hold whole {encoding} "
                              f"blocks of {per_block} values a row; the file is corrupt")
    end = begin + count // per_block * block_bytes
    if end > size:
        raise CheckpointError(f"{path}: tensor {name!r} lies beyond the end of the file; the file is truncated, "
                              "download it again")
    return TensorEntry(name, path, begin, end, dtype, shape, encoding)


def gguf_tensors(path: Path) -> dict[str, TensorEntry]:
    """A GGUF file's tensors under their Hugging Face names (unknown ones keep theirs, so a check can name them):
    a packed 4-bit projection as its INT4 parts; Llama's q and k marked for reordering."""
    gguf = read_gguf(path)
    config = gguf_config(gguf)
    packed = _packed(gguf)
    out = {}
    for name, entry in gguf.tensors.items():
        if name == ROPE_FREQS:
            continue
        hf, parts = _hf_name(name), name.split(".")
        reordered = config["model_type"] == "llama" and len(parts) == 4 and parts[2] in ("attn_q", "attn_k")
        rope_rows = config.get("head_dim", 0) if reordered else 0
        if name not in packed:
            out[hf] = TensorEntry(hf, entry.file, entry.start, entry.end, entry.dtype, entry.shape, entry.encoding,
                                  rope_rows)
            continue
        module, packing = hf.removesuffix(".weight"), packed[name]
        for part, (shape, dtype) in zip(packing.part_names, packing.checkpoint_parts(entry.shape, "float32")):
            out[f"{module}.{part}"] = TensorEntry(
                f"{module}.{part}", entry.file, entry.start, entry.end,
                "I32" if dtype == "int32" else INT_TYPES[entry.encoding][4], shape, entry.encoding, rope_rows,
                part)
    return out


def _hf_name(name: str) -> str:
    """A GGUF tensor's Hugging Face name (its own where none is known)."""
    parts = name.split(".")
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return name


def _packable(hf_name: str) -> bool:
    """Whether a weight is one the INT4 kernels may read packed: a projection, the embedding or the head."""
    return hf_name.endswith(PROJECTION) or hf_name in VOCABULARY_MATRICES


def _packed(gguf: GgufFile) -> dict[str, Packing]:
    """The projections, embedding and head (GGUF names) stored in an integer type that the INT4 kernels read as they
    are (shape permitting), and their packing (models.ggml_types.INT_TYPES)."""
    packings = {name: Packing(*INT_TYPES[entry.encoding][:4]) for name, entry in gguf.tensors.items()
                if entry.encoding in INT_TYPES and _packable(_hf_name(name))}
    return {name: p for name, p in packings.items() if p.problem(gguf.tensors[name].shape) is None}


def gguf_config(gguf: GgufFile) -> dict:
    """The config.json a Hugging Face checkpoint of this model would have (its fields, from the GGUF metadata)."""
    meta, source = gguf.metadata, f"{gguf.path} (GGUF metadata)"
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelConfigError(f"{source}: general.architecture is {arch!r}; GGUF files of "
                               f"{', '.join(ARCHITECTURES)} models are supported")
    if meta.get("split.count", 1) != 1:
        raise ModelConfigError(f"{source}: the file is one of {meta['split.count']} parts; merge them into one "
                               "(llama-gguf-split --merge) and keep that file alone in the model directory")

    def field(key, default=None):
        return meta.get(f"{arch}.{key}", default)
    heads = field("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    embed = gguf.tensors.get("token_embd.weight")
    config = {
        "model_type": arch,
        "vocab_size": field("vocab_size", len(tokens) if isinstance(tokens, list) else embed and embed.shape[0]),
        "hidden_size": field("embedding_length"),
        "intermediate_size": field("feed_forward_length"),
        "num_hidden_layers": field("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field("attention.head_count_kv", heads),
        "rms_norm_eps": field("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field("rope.freq_base", 10000.0),
        "max_position_embeddings": field("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "dtype": {"F16": "float16", "BF16": "bfloat16"}.get(embed.dtype if embed else "", "float32"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(meta[f"tokenizer.ggml.{key}"] for key in END_OF_GENERATION
                                           if f"tokenizer.ggml.{key}" in meta)),
    }
    head_dim = field("attention.key_length")
    if head_dim is None and isinstance(heads, int) and heads > 0 and isinstance(config["hidden_size"], int):
        head_dim = config["hidden_size"] // heads
    if head_dim is not None:
        config["head_dim"] = head_dim
    if isinstance(head_dim, int) and head_dim > 0 and field("rope.dimension_count") not in (None, head_dim):
        config["partial_rotary_factor"] = field("rope.dimension_count") / head_dim
    config["rope_scaling"] = _rope_scaling(gguf, field)
    packed = _packed(gguf)
    if packed:
        module = lambda name: _hf_name(name).removesuffix(".weight")  # noqa: E731
        others = sorted(module(name) for name in gguf.tensors
                        if name not in packed and _hf_name(name).endswith(PROJECTION))
        group = INT_TYPES["Q4_0"][1]  # the plain AWQ INT4 packing of projections; the others each name their own
        own = {module(name): p for name, p in sorted(packed.items())
               if p != Packing("awq_int4", group) or not _hf_name(name).endswith(PROJECTION)}
        config["quantization_config"] = awq_config(group, tuple(others), own)
    return config


def _rope_scaling(gguf: GgufFile, field) -> dict | None:
    """The rope_scaling entry: Llama 3's frequency divisors (a tensor), or the scaling type the metadata names."""
    if ROPE_FREQS in gguf.tensors:
        entry = gguf.tensors[ROPE_FREQS]
        if entry.dtype != "F32" or entry.encoding:
            raise CheckpointError(f"{gguf.path}: tensor {ROPE_FREQS!r} must be F32; the file is corrupt")
        with entry.file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return {"rope_type": "freq_factors", "factors": read_tensor(entry, mapped).tolist()}
    kind = field("rope.scaling.type", "none")
    if kind == "none":
        return None
    return {"rope_type": kind, "factor": field("rope.scaling.factor")}
