"""The runtime: load a prebuilt artifact with its weights and tokenizer, and generate."""

from .artifact import ArtifactError, default_artifact_dir
from .chat_template import ChatMessage, ChatTemplateError
from .engine import CompiledModel, GenerationError, KVCache
from .generation import GeneratedTokens, TokenStream, generate
from .pipeline import (
                       GeneratedText,
                       Pipeline,
                       TextStream,
                       load_huggingface_llama_pipeline,
                       load_huggingface_qwen2_pipeline,
                       load_pipeline,
)
from .sampling import GenerationConfigError, GreedyGenerationConfig, SamplingConfig, SamplingGenerationConfig
from .tokenizer import Tokenizer, TokenizerError, default_eos_token_ids

__all__ = [
    "ArtifactError", "ChatMessage", "ChatTemplateError", "CompiledModel", "GeneratedText", "GeneratedTokens",
    "GenerationConfigError", "GenerationError", "GreedyGenerationConfig", "KVCache", "Pipeline", "SamplingConfig",
    "SamplingGenerationConfig", "TextStream", "TokenStream", "Tokenizer", "TokenizerError", "default_artifact_dir",
    "default_eos_token_ids", "generate", "load_huggingface_llama_pipeline", "load_huggingface_qwen2_pipeline",
    "load_pipeline",
]
