"""Qwen2 / Qwen2.5: config.json -> DecoderConfig (Llama's decoder with q/k/v biases)."""

from __future__ import annotations

from .config import ConfigReader
from .decoder import DecoderConfig, read_decoder_config


def read_config(cfg: ConfigReader) -> DecoderConfig:
    """Validate a Qwen2 config: q/k/v biases, full attention (no sliding window)."""
    if cfg.get("use_sliding_window", False):
        raise cfg.error("use_sliding_window", "is true; sliding-window attention is not supported")
    return read_decoder_config(cfg, "qwen2", qkv_bias=True, tie_default=False)
