"""Llama (1, 2, 3.x): config.json -> DecoderConfig."""

from __future__ import annotations

from .config import ConfigReader
from .decoder import DecoderConfig, read_decoder_config


def read_config(cfg: ConfigReader) -> DecoderConfig:
    """Validate a Llama config: no biases, SwiGLU MLP, optional Llama 3 rope scaling."""
    if cfg.get("attention_bias", False):
        raise cfg.error("attention_bias", "is true; biased Llama attention is not supported")
    if cfg.get("mlp_bias", False):
        raise cfg.error("mlp_bias", "is true; biased Llama MLPs are not supported")
    return read_decoder_config(cfg, "llama", qkv_bias=False, tie_default=False)
