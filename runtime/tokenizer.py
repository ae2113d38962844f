"""The checkpoint's tokenizer (`tokenizer.json`, or a GGUF file's metadata) and its default end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ir.errors import RudaError
from models.config import ConfigReader
from models.gguf import gguf_file, read_gguf

from .gguf_tokenizer import GgufTokenizerError, gguf_tokenizer


class TokenizerError(RudaError):
    """tokenizer.json or generation_config.json is missing or unreadable."""

    exit_code = 4


class Tokenizer:
    """Text <-> token ids with the checkpoint's own tokenizer.json (or the tokenizer its GGUF file describes)."""

    def __init__(self, model_dir: str | Path):
        gguf = gguf_file(model_dir)
        if gguf is not None:
            try:
                self._tok = gguf_tokenizer(read_gguf(gguf))
            except GgufTokenizerError as e:
                raise TokenizerError(f"{gguf}: {e}") from None
            return
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: missing; copy the checkpoint's tokenizer.json into the model directory")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise TokenizerError(f"{path}: cannot be loaded ({e}); restore it from the checkpoint") from None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's own special-token template when asked)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def default_eos_token_ids(model_dir: str | Path, config_eos: tuple[int, ...]) -> list[int]:
    """EOS ids from generation_config.json, else from config.json."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return list(config_eos)
    try:
        generation = json.loads(path.read_bytes())
    except OSError as e:
        raise TokenizerError(f"{path}: cannot be read ({e.strerror}); fix its permissions or delete it") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        generation = None
    if not isinstance(generation, dict):
        raise TokenizerError(f"{path}: not a valid JSON object; fix or delete it")
    return ConfigReader(generation, str(path)).token_ids("eos_token_id", list(config_eos))
