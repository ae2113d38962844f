"""Model definitions: config.json -> validated config -> IR program. No TVM here."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ir import Program

from . import llama, qwen2, qwen3_5, qwen3_5_vision
from .checkpoint import TensorEntry, check_tensors, scan_checkpoint
from .config import ConfigReader, ModelConfigError, read_config_json
from .decoder import DecoderConfig, build_decoder_program, checkpoint_shapes
from .quantization import packed_tensors, stored_shapes

ARCHITECTURES = {"llama": llama.read_config, "qwen2": qwen2.read_config, "qwen3_5": qwen3_5.read_config,
                 "qwen3_5_text": qwen3_5.read_config}


def parse_config(raw: dict, source: str = "config.json") -> DecoderConfig:
    """Validate a config.json dict for a supported architecture."""
    cfg = ConfigReader(raw, source)
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise cfg.error("model_type", f"is {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type](cfg)


def load_config(model_dir: str | Path) -> DecoderConfig:
    """The validated config of a local model directory."""
    raw, path = read_config_json(model_dir)
    return parse_config(raw, str(path))


def build_program(config: DecoderConfig, param_dtypes: Mapping[str, str] | None = None) -> Program:
    """The verified IR program (prefill + decode entries) for a config."""
    if isinstance(config, qwen3_5.Qwen35Config):
        return qwen3_5.build_program(config, param_dtypes)
    return build_decoder_program(config, param_dtypes)


def weight_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The model's weights and their shapes, as an unquantised checkpoint stores them."""
    if isinstance(config, qwen3_5.Qwen35Config):
        return qwen3_5.checkpoint_shapes(config)
    return checkpoint_shapes(config)


def tensor_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes a config implies (a quantised projection as its packed parts)."""
    return stored_shapes(weight_shapes(config), config.quantization)


def ignored_tensors(config: DecoderConfig) -> tuple[str, ...]:
    """Name prefixes of checkpoint tensors the model does not use (multi-token-prediction heads, and a vision tower
    its config does not declare)."""
    if isinstance(config, qwen3_5.Qwen35Config):
        return qwen3_5.IGNORED_PREFIXES + (() if config.vision else (qwen3_5_vision.PREFIX,))
    return ()


def load_checkpoint(model_dir: str | Path) -> tuple[dict, DecoderConfig, dict[str, TensorEntry], dict[str, str]]:
    """(raw config.json, validated config, the checkpoint's tensors, their dtypes by name); of a Hugging Face
    directory or of a GGUF file (models.gguf).

    The checkpoint must hold exactly the tensors the config implies, each with its shape and a float dtype (int32
    for the packed words of a quantised checkpoint).
    """
    raw, path = read_config_json(model_dir)
    config = parse_config(raw, str(path))
    tensors = scan_checkpoint(model_dir)
    packed = packed_tensors(weight_shapes(config), config.quantization)
    return raw, config, tensors, check_tensors(tensors, tensor_shapes(config), model_dir, ignored_tensors(config), packed,
                                               "its GGUF metadata" if path.suffix == ".gguf" else path.name)


def load_checkpoint_program(model_dir: str | Path) -> tuple[dict, DecoderConfig, dict[str, TensorEntry], Program]:
    """(raw config.json, validated config, the checkpoint's tensors, the IR program for their dtypes)."""
    raw, config, tensors, dtypes = load_checkpoint(model_dir)
    return raw, config, tensors, build_program(config, dtypes)


def checkpoint_tensor_shapes(raw_config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes for a raw config.json dict."""
    return tensor_shapes(parse_config(raw_config))


__all__ = ["ARCHITECTURES", "DecoderConfig", "ModelConfigError", "build_program", "checkpoint_shapes",
           "checkpoint_tensor_shapes", "load_checkpoint", "load_checkpoint_program",
           "load_config", "parse_config"]
