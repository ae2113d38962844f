"""The application API: a compiled model with its tokenizer, chat template, and text generation."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import models
from models.config import read_config_json

from .chat_template import ChatMessage, ChatTemplate
from .engine import CompiledModel, GenerationError
from .generation import TokenStream
from .request import IncrementalDetokenizer
from .sampling import GenerationConfigError, GreedyGenerationConfig, SamplingGenerationConfig
from .tokenizer import Tokenizer, default_eos_token_ids
from .vision import ImagePrompt

DEFAULT_GREEDY = GreedyGenerationConfig()
LOADERS = {"llama": "load_huggingface_llama_pipeline", "qwen2": "load_huggingface_qwen2_pipeline",
           "qwen3_5": "load_huggingface_qwen35_text", "qwen3_5_text": "load_huggingface_qwen35_text"}
AWQ_LOADERS = {"qwen2": "load_huggingface_awq_qwen2_pipeline", "llama": "load_pipeline"}  # Llama AWQ: no own loader
QWEN35_TYPES = ("qwen3_5", "qwen3_5_text")
MULTIMODAL_LOADER = "load_huggingface_qwen35_multimodal"  # an image-text checkpoint (config with a vision_config)


@dataclass
class GeneratedText:
    """One finished generation: texts, token ids, why it stopped, and timings."""

    text: str
    """The prompt followed by the reply."""
    generated_text: str
    generated_token_ids: list[int]
    prompt_token_ids: list[int]
    stopped_on_eos: bool
    finish_reason: str
    prefill_seconds: float
    decode_seconds: float


class TextStream:
    """Iterates text deltas of one generation (never splitting a character); then `result` is set.

    `prompt_ids` are the prompt's own ids (what the result reports); with `images` (runtime.vision.ImagePrompt) the
    model runs on its expanded ids and image embeddings."""

    def __init__(self, pipeline: "Pipeline", prompt: str, prompt_ids: list[int], config: GreedyGenerationConfig,
                 skip_special_tokens: bool, images: ImagePrompt | None = None):
        self._prompt, self._prompt_ids = prompt, prompt_ids
        self._tokens = TokenStream(pipeline.model, images.token_ids if images else prompt_ids, config,
                                   pipeline.default_eos_token_ids,
                                   IncrementalDetokenizer(pipeline.tokenizer.decode, skip_special_tokens), images)
        self.result: GeneratedText | None = None

    def __iter__(self) -> Iterator[str]:
        state, shown = self._tokens.state, 0
        for _ in self._tokens:
            if len(state.text) > shown:
                yield state.text[shown:]
                shown = len(state.text)
        r = self._tokens.result()
        self.result = GeneratedText(self._prompt + state.text, state.text, r.generated_token_ids, self._prompt_ids,
                                    r.stopped_on_eos, r.finish_reason, r.prefill_seconds, r.decode_seconds)


class Pipeline:
    """Encode, decode, render chats and generate text with one compiled model."""

    def __init__(self, model_dir: str | Path, artifact: str | Path | None = None, device: str = "cpu"):
        self.model = CompiledModel(model_dir, artifact, device)
        self.config: models.DecoderConfig = self.model.config
        self.tokenizer = Tokenizer(model_dir)
        self.chat_template = ChatTemplate(model_dir)
        self.default_eos_token_ids = default_eos_token_ids(model_dir, self.model.config.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; a BOS the text already starts with is not added a second time."""
        if not isinstance(add_special_tokens, bool):
            raise GenerationError(f"add_special_tokens must be True or False, got {add_special_tokens!r}")
        ids = self.tokenizer.encode(_checked_text(text), add_special_tokens)
        bos = self.config.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(
                isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < self.tokenizer.vocab_size for i in ids):
            raise GenerationError(f"ids must be a list of token ids in 0..{self.tokenizer.vocab_size - 1}, got "
                                  f"{str(ids)[:80]}")
        return self.tokenizer.decode(list(ids), skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping | ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt for a conversation, from the checkpoint's own chat template."""
        return self.chat_template.render(messages, add_generation_prompt)

    def stream_text(self, prompt: str, config: GreedyGenerationConfig = DEFAULT_GREEDY,
                    add_special_tokens: bool = True, skip_special_tokens: bool = True) -> TextStream:
        """Greedy generation as a stream of text deltas."""
        check_greedy(config)
        return TextStream(self, prompt, self.encode(prompt, add_special_tokens), config, skip_special_tokens)

    def stream_text_sampled(self, prompt: str, config: SamplingGenerationConfig,
                            add_special_tokens: bool = True, skip_special_tokens: bool = True) -> TextStream:
        """Sampled generation as a stream of text deltas."""
        if not isinstance(config, SamplingGenerationConfig):
            raise GenerationConfigError(f"config must be a SamplingGenerationConfig, got {type(config).__name__}")
        return TextStream(self, prompt, self.encode(prompt, add_special_tokens), config, skip_special_tokens)

    def generate_text(self, prompt: str, config: GreedyGenerationConfig = DEFAULT_GREEDY,
                      add_special_tokens: bool = True, skip_special_tokens: bool = True) -> GeneratedText:
        """Greedy (max-logit) generation."""
        return run_to_end(self.stream_text(prompt, config, add_special_tokens, skip_special_tokens))

    def generate_text_sampled(self, prompt: str, config: SamplingGenerationConfig,
                              add_special_tokens: bool = True, skip_special_tokens: bool = True) -> GeneratedText:
        """Sampled generation: temperature, top-k, top-p, seeded draw."""
        return run_to_end(self.stream_text_sampled(prompt, config, add_special_tokens, skip_special_tokens))


def check_greedy(config) -> None:
    """Refuse a config that is not a greedy one."""
    if not isinstance(config, GreedyGenerationConfig) or isinstance(config, SamplingGenerationConfig):
        raise GenerationConfigError(f"config must be a GreedyGenerationConfig, got {type(config).__name__}")


def _checked_text(text) -> str:
    """`text` if it is a str that is valid UTF-8 (no lone surrogates), else a GenerationError."""
    if not isinstance(text, str):
        raise GenerationError(f"the prompt must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"the prompt is not valid UTF-8 text (bad character at {e.start})") from None
    return text


def run_to_end(stream: TextStream) -> GeneratedText:
    """Consume a stream; its result."""
    for _ in stream:
        pass
    return stream.result


def loaded_config(model_dir: str | Path, expected: tuple[str, ...] | None, awq: bool = False) -> models.DecoderConfig:
    """The checkpoint's config, if it is of an `expected` model type (None: any) and quantised with AWQ or not as
    `awq` says; else an error naming the loader that takes it."""
    raw, path = read_config_json(model_dir)
    config = models.parse_config(raw, str(path))
    quantised = config.quantization is not None
    right = MULTIMODAL_LOADER if getattr(config, "vision", None) else (AWQ_LOADERS if quantised else LOADERS).get(
        config.model_type, "load_pipeline")
    if expected is not None and config.model_type not in expected:
        raise models.ModelConfigError(f"{path}: model_type is {config.model_type!r}, not {' or '.join(expected)}; "
                                      f"use {right} (or load_pipeline)")
    if expected is not None and quantised != awq:
        what = "AWQ INT4 weights (it has a quantization_config)" if quantised else "float weights (no AWQ " \
            "quantization_config)"
        raise models.ModelConfigError(f"{path}: the checkpoint holds {what}; use {right}" +
                                      ("" if right == "load_pipeline" else " (or load_pipeline)"))
    return config


def _load(model_dir: str | Path, artifact, device: str, expected: tuple[str, ...] | None,
          awq: bool = False) -> Pipeline:
    """A text pipeline, if the checkpoint is what the loader expects (see loaded_config)."""
    loaded_config(model_dir, expected, awq)
    return Pipeline(model_dir, artifact, device)


def load_pipeline(model_dir: str | Path, artifact: str | Path | None = None,
                  device: str = "cpu") -> Pipeline:
    """A pipeline for any supported checkpoint (dispatch on config.json's model_type; an image-text checkpoint
    gets the multimodal pipeline)."""
    if getattr(loaded_config(model_dir, None), "vision", None):
        from .multimodal import MultimodalPipeline
        return MultimodalPipeline(model_dir, artifact, device)
    return Pipeline(model_dir, artifact, device)


def load_huggingface_llama_pipeline(model_dir: str | Path, artifact: str | Path | None = None,
                                    device: str = "cpu") -> Pipeline:
    """A pipeline for an unquantised Llama checkpoint."""
    return _load(model_dir, artifact, device, ("llama",))


def load_huggingface_qwen2_pipeline(model_dir: str | Path, artifact: str | Path | None = None,
                                    device: str = "cpu") -> Pipeline:
    """A pipeline for an unquantised Qwen2 / Qwen2.5 checkpoint."""
    return _load(model_dir, artifact, device, ("qwen2",))


def load_huggingface_awq_qwen2_pipeline(model_dir: str | Path, artifact: str | Path | None = None,
                                        device: str = "cpu") -> Pipeline:
    """A pipeline for an AutoAWQ GEMM INT4 Qwen2 / Qwen2.5 checkpoint (e.g. Qwen2.5-*-Instruct-AWQ): its packed
    4-bit weights stay packed, unpacked inside the kernels."""
    return _load(model_dir, artifact, device, ("qwen2",), awq=True)


def load_huggingface_qwen35_text(model_dir: str | Path, artifact: str | Path | None = None,
                                 device: str = "cpu") -> Pipeline:
    """A pipeline for a Qwen3.5 checkpoint's text model (either config form; no quantisation config).

    `pipeline.model.new_cache()` and `pipeline.model.forward_cached_last(tokens, cache)` drive it by hand.
    """
    return _load(model_dir, artifact, device, QWEN35_TYPES)
