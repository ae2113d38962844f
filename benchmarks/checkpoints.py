"""Random-weight checkpoints at real model shapes (weights and config; benchmarks feed token ids)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from models.checkpoint import scan_checkpoint
from models.tiny import (awq_checkpoint, build_tokenizer, generation_config, random_weights, save_weights,
                         special_token_ids, tiny_config, tokenizer_config)

SHAPES = {
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768),
    "tinyllama-1.1b": dict(arch="llama", hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                           tie_word_embeddings=False, max_position_embeddings=2048),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768),
    "llama-3.2-1b": dict(arch="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # hidden, layers, heads, vocab, tied embeddings and one full-attention layer in four as published for
    # Qwen3.5-0.8B; the linear-attention shapes (16 q/k and 16 v heads of 128) and the MLP width are assumed
    "qwen3.5-0.8b": dict(arch="qwen3_5_text", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, intermediate_size=3584, vocab_size=248320,
                         tie_word_embeddings=True, rope_theta=10000000.0, max_position_embeddings=262144,
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128,
                         layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)]),
}

# Text for the SentencePiece model that GGUF conversion needs (token ids are fed directly, so any will do).
_SPM_TEXT = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs!",
             "Mathematics is the language of patterns: 1 + 1 = 2, 3 * 4 = 12.", "0 1 2 3 4 5 6 7 8 9"]


def real_shape_checkpoint(root: str | Path, shape: str, dtype: str) -> Path:
    """The directory of a random checkpoint of `shape` in `dtype`, written once and reused."""
    out = Path(root) / f"{shape}-{dtype}"
    if (out / "config.json").is_file():
        return out
    options = dict(SHAPES[shape])
    config = tiny_config(options.pop("arch"), dtype=dtype, **options)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(random_weights(config, seed=0), out)
    (out / "config.json").write_text(json.dumps(config, indent=1))  # written last: marks the checkpoint complete
    return out


def awq_checkpoint_of(float_dir: Path, group: int = 128) -> Path:
    """The random float16 checkpoint at `float_dir` quantised to AutoAWQ GEMM INT4 (group `group`) by our packer,
    written once beside it and reused."""
    out = float_dir.parent / f"{float_dir.name}-awq-g{group}"
    if (out / "config.json").is_file():
        return out
    config = json.loads((float_dir / "config.json").read_text())
    config, weights = awq_checkpoint(config, random_weights(config, seed=0), group)
    out.mkdir(parents=True, exist_ok=True)
    save_weights(weights, out)
    (out / "config.json").write_text(json.dumps(config, indent=1))  # written last: marks the checkpoint complete
    return out


def checkpoint_dtype(model_dir: Path) -> str:
    """The weights' dtype that config.json names (`torch_dtype`, or transformers 5's `dtype`)."""
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("torch_dtype") or config["dtype"]


def weight_bytes_per_token(model_dir: Path) -> int:
    """Bytes of weights one decode step reads, as the checkpoint stores them (packed words, zeros and scales of a
    quantised one): every tensor but an untied embedding table (one row of it)."""
    entries = scan_checkpoint(model_dir)
    tied = "lm_head.weight" not in entries
    return sum(e.end - e.start for name, e in entries.items() if tied or name != "model.embed_tokens.weight")


def add_sentencepiece_tokenizer(model_dir: Path) -> Path:
    """Write a small SentencePiece `tokenizer.model` (<unk> <s> </s>, 256 bytes, some merges) if there is none.

    llama.cpp's converter takes SentencePiece vocabularies without a pre-tokenizer hash check and pads
    them with unused tokens up to config.json's vocab_size, so the GGUF's vocab size matches the weights.
    """
    path = model_dir / "tokenizer.model"
    if not path.is_file():
        import sentencepiece

        proto = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(_SPM_TEXT * 4), model_writer=proto, vocab_size=400, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
        path.write_bytes(proto.getvalue())
    return path


def add_bpe_tokenizer(model_dir: Path, arch: str = "qwen2") -> Path:
    """Give a real-shape checkpoint what a pipeline (and the server) loads besides weights: the tiny byte-level BPE
    tokenizer of `arch`, its vocabulary padded with tokens no text encodes to (x0, x1, ...) up to config.json's
    vocab_size so that every id the model generates decodes, the specials at the end as in the real checkpoints;
    tokenizer_config.json (with the chat template) and generation_config.json. Written once."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        return path
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config.get("text_config", config)["vocab_size"]
    data = json.loads(build_tokenizer(arch, 512).to_str())
    vocab = data["model"]["vocab"]
    specials = special_token_ids(arch, vocab_size)
    first_special = min(specials.values())
    vocab |= {f"x{i}": i for i in range(len(vocab), first_special)}
    for token in data["added_tokens"]:
        token["id"] = specials[token["content"]]
    path.write_text(json.dumps(data, ensure_ascii=False))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(arch, vocab_size, 4096), indent=1))
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config(config), indent=1))
    return path
