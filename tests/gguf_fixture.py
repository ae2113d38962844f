"""GGUF files written from tiny Hugging Face checkpoints with llama.cpp's own gguf-py (an independent writer), laid
out as llama.cpp's converter lays them out: its tensor names, Llama's q/k rows permuted for its rotary layout,
2-D weights in a block type, norms in F32, the tokenizer and chat template in the metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file

from ir import Packing
from models.ggml_types import BLOCK_TYPES, INT_TYPES
from models.gguf import VOCABULARY_MATRICES
from models.quantization import PROJECTION

LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of a Hugging Face tensor."""
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q and k rows (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out_dir: Path, qtype: str = "F16", *, rope_freqs: np.ndarray | None = None,
               metadata: dict | None = None, reference: Path | None = None, types: dict | None = None) -> Path:
    """`out_dir/model.gguf` from the tiny checkpoint in `model_dir`: 2-D weights as `qtype` (F32, F16, BF16, or a
    block type: the K-quants and IQ4 types as random blocks, not the checkpoint's values), 1-D ones F32; `metadata`
    overrides or adds keys (None values remove them); `types` maps name suffixes to the type of the weights so named
    instead. With `reference`, also a float32 Hugging Face checkpoint there holding the values the GGUF stores (as
    gguf-py dequantises them; a block type's rounded to float16, as our loader holds them, except PACKED
    projections, embeddings and heads of a shape a packing takes, which the INT4 kernels read as they are)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    metadata = dict(metadata or {})
    writer = gguf.GGUFWriter(str(path), metadata.pop("general.architecture", arch))
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    values = {
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": float(config.get("rope_theta", 10000.0)),
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        **_tokenizer_metadata(model_dir, arch),
        **metadata,
    }
    for key, value in values.items():
        if value is not None:
            _add(writer, key, value)
    weights = load_file(str(model_dir / "model.safetensors"))
    stored = {}
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    rng = np.random.default_rng(0)
    for name, w in weights.items():
        w = np.asarray(w, np.float32)
        own = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), qtype) if w.ndim == 2 else "F32"
        data, kind, values = _encode(w, own, rng)
        packed = own in PACKED and (name.endswith(PROJECTION) or name in VOCABULARY_MATRICES) and \
            Packing(*INT_TYPES[own][:4]).problem(w.shape) is None
        decoded = own in BLOCKS and not packed
        stored[name] = values.astype(np.float16).astype(np.float32) if decoded else values
        if arch == "llama" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            data = permute_for_llama_cpp(data, heads if "q_proj" in name else kv_heads)
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if reference is not None:
        shutil.copytree(model_dir, reference)
        save_file(stored, str(reference / "model.safetensors"))
        config["dtype"] = "float32"
        (reference / "config.json").write_text(json.dumps(config))
    return path


PACKED = tuple(INT_TYPES)  # block types whose projections stay packed (models.gguf), their values exact
BLOCKS = {name for name, _, _ in BLOCK_TYPES.values()}
SCALE_BYTES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,), "IQ4_NL": (0,),
               "IQ4_XS": (0,)}  # where a block's float16s lie


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """[rows, bytes] of random `qtype` blocks: random quants, float16 scales ~ N(0, scale)."""
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
    for at in SCALE_BYTES.get(qtype, ()):
        blocks[:, at:at + 2] = rng.normal(0, scale, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, object, np.ndarray]:
    """(the data to write, its ggml type for the writer (None: from the numpy dtype), the float32 values it holds):
    `w` stored as `qtype`; types gguf-py cannot quantise into (the K-quants, IQ4) get random blocks of small values."""
    if qtype == "F32":
        return w, None, w
    if qtype == "F16":
        return w.astype(np.float16), None, w.astype(np.float16).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in SCALE_BYTES and qtype != "BF16":  # a type we do not read: random bytes, no values
        return random_blocks(*w.shape, qtype, rng), kind, w
    data = random_blocks(*w.shape, qtype, rng, 1e-3) if qtype.endswith("_K") or qtype.startswith("IQ") \
        else gguf.quants.quantize(w, kind)
    values = gguf.quants.dequantize(data, kind).reshape(w.shape)
    return data, kind, values.astype(np.float32)


def _add(writer: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def _tokenizer_metadata(model_dir: Path, arch: str) -> dict:
    """The tokenizer.* keys llama.cpp's converter writes for a byte-level BPE tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    eos = generation.get("eos_token_id")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2" if arch == "qwen2" else "llama-bpe",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": special.get("<|begin_of_text|>", special.get("<|endoftext|>")),
        "tokenizer.ggml.eos_token_id": eos[0] if isinstance(eos, list) else eos,
        "tokenizer.ggml.add_bos_token": arch == "llama",
        "tokenizer.chat_template": tok_config.get("chat_template"),
    }
