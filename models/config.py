"""Reading config.json: typed field access whose errors name the file and the field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ir.errors import RudaError

_REQUIRED = object()
MAX_INT = 1 << 24  # above any size or count of a real model: a larger value is a damaged config, not a big model
MAX_LAYERS = 1024  # real models have at most a few hundred layers; each one costs Python objects at build time


class ModelConfigError(RudaError):
    """config.json is missing, malformed, contradictory, or describes an unsupported model."""

    exit_code = 3


def read_config_json(model_dir: str | Path) -> tuple[dict, Path]:
    """The parsed config.json of a model directory and its path (for a GGUF model directory: the config its file's
    metadata implies, and the file's path)."""
    from .gguf import gguf_config, gguf_file, read_gguf  # gguf reads ModelConfigError from here
    if not isinstance(model_dir, (str, os.PathLike)):
        raise ModelConfigError(f"the model directory must be a path, got {type(model_dir).__name__}")
    if not str(model_dir):
        raise ModelConfigError("the model directory is an empty string; pass a local Hugging Face model directory")
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelConfigError(f"{model_dir}: not a directory; pass a local Hugging Face model directory")
    if not path.is_file() and gguf_file(model_dir) is not None:
        return gguf_config(read_gguf(gguf_file(model_dir))), gguf_file(model_dir)
    if not path.is_file():
        raise ModelConfigError(f"{path}: missing; a model directory needs the config.json of its checkpoint (or "
                               "a GGUF file alone)")
    return read_json_object(path), path


def read_json_object(path: Path) -> dict:
    """The JSON object a checkpoint file holds, or a ModelConfigError naming the file and the fix."""
    try:
        raw = json.loads(path.read_bytes())
    except OSError as e:
        raise ModelConfigError(f"{path}: cannot be read ({e.strerror}); fix its permissions or restore it") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelConfigError(f"{path}: not valid JSON ({e}); restore the file from the checkpoint") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: must hold a JSON object; restore the file from the checkpoint")
    return raw


class ConfigReader:
    """Typed, validated access to the fields of one config dict."""

    def __init__(self, raw: dict, source: str):
        self.raw = raw
        self.source = source

    def error(self, field: str, problem: str) -> ModelConfigError:
        """An error naming the file and field."""
        return ModelConfigError(f"{self.source}: field '{field}' {problem}")

    def get(self, field: str, default: Any = _REQUIRED) -> Any:
        """The raw value of a field (required unless a default is given; null counts as absent)."""
        value = self.raw.get(field)
        if value is None:
            if default is _REQUIRED:
                raise self.error(field, "is missing")
            return default
        return value

    def int(self, field: str, default: Any = _REQUIRED, minimum: int = 1, maximum: int = MAX_INT) -> int:
        """An integer field in minimum..maximum (by default no larger than any real model's)."""
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.error(field, f"must be an integer in {minimum}..{maximum}, got {value!r}")
        return value

    def float(self, field: str, default: Any = _REQUIRED, positive: bool = True) -> float:
        """A finite float field (> 0 when `positive`)."""
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            raise self.error(field, f"must be a finite number, got {value!r}")
        if positive and value <= 0:
            raise self.error(field, f"must be > 0, got {value!r}")
        return float(value)

    def bool(self, field: str, default: Any = _REQUIRED) -> bool:
        """A boolean field."""
        value = self.get(field, default)
        if not isinstance(value, bool):
            raise self.error(field, f"must be true or false, got {value!r}")
        return value

    def token_ids(self, field: str, default: Any = _REQUIRED) -> list[int] | Any:
        """A token id or list of token ids, as a list."""
        value = self.get(field, default)
        if value is default and default is not _REQUIRED:
            return value
        ids = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise self.error(field, f"must be a token id (a non-negative integer) or a list of them, got {value!r}")
        return ids

    def choice(self, field: str, allowed: tuple, default: Any = _REQUIRED) -> Any:
        """A field whose value must be one of `allowed`."""
        value = self.get(field, default)
        if value not in allowed:
            raise self.error(field, f"is {value!r}; supported: {', '.join(map(repr, allowed))}")
        return value
