"""The runtime: load a prebuilt artifact with its weights and tokenizer, and generate."""

from .artifact import ArtifactError, default_artifact_dir
from .engine import CompiledModel, GenerationError, KVCache
from .generation import GreedyResult, generate_greedy
from .tokenizer import Tokenizer, TokenizerError, default_eos_token_ids

__all__ = ["ArtifactError", "CompiledModel", "GenerationError", "GreedyResult", "KVCache", "Tokenizer",
           "TokenizerError", "default_artifact_dir", "default_eos_token_ids", "generate_greedy"]
