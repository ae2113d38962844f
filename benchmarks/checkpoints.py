"""Random-weight checkpoints at real model shapes (weights and config only: benchmarks feed token ids)."""

from __future__ import annotations

import json
from pathlib import Path

from models.tiny import random_weights, save_weights, tiny_config

SHAPES = {
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768),
    "tinyllama-1.1b": dict(arch="llama", hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                           max_position_embeddings=2048),
}


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
