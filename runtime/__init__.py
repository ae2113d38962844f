"""The runtime: load a prebuilt artifact with its weights and tokenizer, and generate.

Names are imported from their modules on first use, so `runtime.scheduler` (pure Python) and the
tokenizer work without loading TVM.
"""

from importlib import import_module

_EXPORTS = {
    "ir.contract": ["ArtifactError", "default_artifact_dir"],
    "batching": ["BatchExecutor"],
    "chat_template": ["ChatMessage", "ChatTemplateError"],
    "engine": ["CompiledModel", "GenerationError", "KVCache"],
    "generation": ["GeneratedTokens", "TokenStream", "generate"],
    "images": ["ImageError", "PreprocessedImages", "Qwen35ImageProcessor", "RgbImage"],
    "multimodal": ["MultimodalPipeline", "VisionEncoder", "load_huggingface_qwen35_multimodal",
                   "load_huggingface_qwen35_vision"],
    "request": ["IncrementalDetokenizer", "RequestState"],
    "pipeline": ["GeneratedText", "Pipeline", "TextStream", "load_huggingface_awq_qwen2_pipeline",
                 "load_huggingface_llama_pipeline",
                 "load_huggingface_qwen2_pipeline", "load_huggingface_qwen35_text", "load_pipeline"],
    "sampling": ["GenerationConfigError", "GreedyGenerationConfig", "SamplingConfig", "SamplingGenerationConfig"],
    "scheduler": ["BatchKind", "ContinuousBatchConfig", "ContinuousBatchScheduler", "FinishedRequest",
                  "PagedKvCacheConfig", "RequestId", "ScheduledBatch", "ScheduledSequence", "SchedulerError",
                  "SchedulerStats", "TokenDelta"],
    "tokenizer": ["Tokenizer", "TokenizerError", "default_eos_token_ids"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    """Import an exported name from its module on first use."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    module = _MODULE_OF[name]
    value = getattr(import_module(module if module.startswith("ir.") else f".{module}", __name__), name)
    globals()[name] = value
    return value
