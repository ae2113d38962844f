"""Chat prompts: the checkpoint's own Jinja chat template, rendered as transformers renders it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ir.errors import RudaError
from models.gguf import gguf_file, read_gguf

from .gguf_tokenizer import gguf_special_tokens

ROLES = ("system", "user", "assistant")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(RudaError, ValueError):
    """Invalid chat messages, or a checkpoint without a usable chat template."""

    exit_code = 4


@dataclass(frozen=True)
class ChatMessage:
    """One plain-text message of a conversation."""

    role: str
    content: str


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _special_token(value) -> str | None:
    return value.get("content") if isinstance(value, Mapping) else value


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ChatTemplateError(f"{path}: cannot be read ({e.strerror}); fix its permissions or restore it") from None
    except UnicodeDecodeError:
        raise ChatTemplateError(f"{path}: not UTF-8 text; restore it from the checkpoint") from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(_read_text(path))
    except (json.JSONDecodeError, RecursionError):
        raise ChatTemplateError(f"{path}: not valid JSON; restore it from the checkpoint") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{path}: must hold a JSON object; restore it from the checkpoint")
    return value


def _gguf_chat_config(path: Path) -> dict:
    """A GGUF file's chat template and special tokens, as a tokenizer_config.json would hold them."""
    gguf = read_gguf(path)
    return {"chat_template": gguf.metadata.get("tokenizer.chat_template"), **gguf_special_tokens(gguf)}


class ChatTemplate:
    """A checkpoint's chat template with the special tokens it may refer to."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = gguf_file(model_dir) or model_dir / "tokenizer_config.json"
        config = _gguf_chat_config(path) if path.suffix == ".gguf" else _read_json(path) if path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t.get("template") for t in template if isinstance(t, Mapping)
                             and t.get("name") == "default"), None)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            template = _read_text(jinja_file)
        if template is not None and not isinstance(template, str):
            raise ChatTemplateError(f"{path}: chat_template must be a string, got {type(template).__name__}; "
                                    "restore it from the checkpoint")
        self.template: str | None = template
        self.source = jinja_file if jinja_file.is_file() else path
        self.special_tokens = {k: _special_token(config.get(k)) for k in SPECIAL_TOKEN_KEYS}

    def render(self, messages: Sequence[Mapping | ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation (system/user/assistant messages in order)."""
        if not self.template:
            raise ChatTemplateError(f"{self.source}: the checkpoint has no chat_template; encode a raw prompt instead")
        plain = validate_messages(messages)
        try:
            return _compile(self.template).render(messages=plain, tools=None, documents=None,
                                                  add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: chat template failed: {e}") from None


def validate_messages(messages: Sequence[Mapping | ChatMessage]) -> list[dict]:
    """Messages as plain dicts, after checking roles, order and content."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} messages")
    plain = []
    for i, m in enumerate(messages):
        if isinstance(m, ChatMessage):
            m = {"role": m.role, "content": m.content}
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        role = m.get("role")
        if role == "tool" or "tool_calls" in m:
            raise ChatTemplateError(f"messages[{i}]: tool messages and tool calls are not supported; "
                                    "send plain system/user/assistant text")
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}]: role {role!r} is not one of {', '.join(ROLES)}")
        if role == "system" and i != 0:
            raise ChatTemplateError(f"messages[{i}]: a system message may only come first")
        extra = set(m) - {"role", "content"}
        if extra:
            raise ChatTemplateError(f"messages[{i}]: unsupported fields {sorted(extra)}; messages are plain text")
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}]: content must be a string, got {m.get('content')!r}")
        plain.append({"role": role, "content": m["content"]})
    return plain
