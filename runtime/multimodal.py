"""Qwen3.5 image + text: the vision encoder alone, and a pipeline that generates from prompts with images.

A prompt holds one `image_token_id` placeholder per image (e.g. `<|vision_start|><|image_pad|><|vision_end|>`
in the text), images in prompt order. The images are preprocessed (runtime.images), encoded by the artifact's
`encode_image` entry, and the placeholders expanded to their tokens (runtime.vision.image_prompt), whose
embeddings replace the token embeddings in the prompt's steps.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Sequence

import numpy as np

from .engine import CompiledModel, GenerationError
from .images import PreprocessedImages, Qwen35ImageProcessor, RgbImage
from .pipeline import (
    DEFAULT_GREEDY,
    QWEN35_TYPES,
    GeneratedText,
    Pipeline,
    TextStream,
    check_greedy,
    loaded_config,
    run_to_end,
)
from .sampling import GenerationConfigError, GreedyGenerationConfig
from .vision import ImagePrompt, image_digest, image_prompt


class VisionEncoder:
    """The Qwen3.5 vision encoder of a compiled image-text model: preprocessed images in, embeddings out."""

    def __init__(self, model_dir: str | Path, artifact: str | Path | None = None, device: str = "cpu",
                 model: CompiledModel | None = None):
        self.model = model or CompiledModel(model_dir, artifact, device)
        if self.model.vision is None:
            raise GenerationError(f"{model_dir} has no vision encoder (config.json declares no vision_config); use a "
                                  "Qwen3.5 image-text checkpoint")
        self.model_dir = Path(model_dir)
        self._processor: Qwen35ImageProcessor | None = None

    @property
    def processor(self) -> Qwen35ImageProcessor:
        """The checkpoint's own image preprocessing (preprocessor_config.json), read on first use."""
        if self._processor is None:
            self._processor = Qwen35ImageProcessor.from_huggingface(self.model_dir)
        return self._processor

    def encode(self, images: PreprocessedImages) -> list[np.ndarray]:
        """Each image's merged embeddings [its tokens, the text model's hidden size]."""
        if not isinstance(images, PreprocessedImages):
            raise GenerationError(f"images must be PreprocessedImages (from preprocess_files / preprocess_rgb), got "
                                  f"{type(images).__name__}")
        return self.model.encode_images(images.pixel_values, list(images.grids))

    def encode_files(self, paths: Sequence[str | Path]) -> list[np.ndarray]:
        """Embeddings of image files (JPEG, PNG), preprocessed as the checkpoint says."""
        return self.encode(self.processor.preprocess_files(paths))

    def encode_rgb(self, images: Sequence[RgbImage]) -> list[np.ndarray]:
        """Embeddings of RGB8 images."""
        return self.encode(self.processor.preprocess_rgb(images))


class MultimodalPipeline(Pipeline):
    """A Qwen3.5 image-text pipeline: every text method of Pipeline, and greedy generation from a prompt's token
    ids with images (files or RGB8 pixels)."""

    def __init__(self, model_dir: str | Path, artifact: str | Path | None = None, device: str = "cpu"):
        super().__init__(model_dir, artifact, device)
        self.vision = VisionEncoder(model_dir, model=self.model)

    @property
    def image_processor(self) -> Qwen35ImageProcessor:
        """The checkpoint's own image preprocessing."""
        return self.vision.processor

    def image_prompt(self, prompt_ids: Sequence[int], images: PreprocessedImages) -> ImagePrompt:
        """The prompt with its images encoded and its placeholders expanded (one image_token_id per image, in
        order; video placeholders are refused)."""
        ids = self._checked_ids(prompt_ids)
        if not isinstance(images, PreprocessedImages):
            raise GenerationError(f"images must be PreprocessedImages (from preprocess_files / preprocess_rgb), got "
                                  f"{type(images).__name__}")
        v = self.model.vision
        if v.video_token_id in ids:
            raise GenerationError(f"the prompt holds a video placeholder (token {v.video_token_id}): only still "
                                  "images are supported; remove it")
        placeholders, count = ids.count(v.image_token_id), len(images.grids)
        if placeholders != count:
            raise GenerationError(f"the prompt holds {placeholders} image placeholders (token {v.image_token_id}) but "
                                  f"{count} images were given: put one <|vision_start|><|image_pad|><|vision_end|> "
                                  "in the prompt per image, in the images' order")
        embeddings = self.vision.encode(images)
        starts = np.cumsum([0] + list(images.patch_counts))
        digests = [image_digest(images.pixel_values[starts[i]:starts[i + 1]], grid)
                   for i, grid in enumerate(images.grids)]
        return image_prompt(ids, embeddings, list(images.grids), v, digests)

    def stream_images(self, prompt_ids: Sequence[int], images: PreprocessedImages,
                      config: GreedyGenerationConfig = DEFAULT_GREEDY, skip_special_tokens: bool = True) -> TextStream:
        """Generation from a prompt with images (greedy, or sampled with a SamplingGenerationConfig), as a stream of
        text deltas."""
        if not isinstance(config, GreedyGenerationConfig):
            raise GenerationConfigError(f"config must be a GreedyGenerationConfig or SamplingGenerationConfig, got "
                                        f"{type(config).__name__}")
        prompt = self.image_prompt(prompt_ids, images)
        self.model.check_request(len(prompt.token_ids), config.max_new_tokens,
                                 "the prompt (its images expanded to their tokens)")
        ids = [int(t) for t in prompt_ids]
        return TextStream(self, self.decode(ids), ids, config, skip_special_tokens, prompt)

    def generate_image_files_greedy(self, prompt_ids: Sequence[int], paths: Sequence[str | Path],
                                    processor: Qwen35ImageProcessor | None = None,
                                    config: GreedyGenerationConfig = DEFAULT_GREEDY) -> GeneratedText:
        """Greedy generation from prompt ids with one placeholder per image file (JPEG, PNG), in order;
        `processor` None: the checkpoint's own preprocessing."""
        check_greedy(config)
        return run_to_end(self.stream_images(prompt_ids, (processor or self.image_processor).preprocess_files(paths),
                                             config))

    def generate_rgb_greedy(self, prompt_ids: Sequence[int], images: Sequence[RgbImage],
                            processor: Qwen35ImageProcessor | None = None,
                            config: GreedyGenerationConfig = DEFAULT_GREEDY) -> GeneratedText:
        """Greedy generation from prompt ids with one placeholder per RGB8 image, in order."""
        check_greedy(config)
        return run_to_end(self.stream_images(prompt_ids, (processor or self.image_processor).preprocess_rgb(images),
                                             config))

    def _checked_ids(self, prompt_ids) -> list[int]:
        """The prompt's token ids, checked: a non-empty list of ids in the vocabulary."""
        vocab = self.config.vocab_size
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence) or not prompt_ids or not all(
                isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < vocab for i in prompt_ids):
            raise GenerationError(f"prompt_ids must be a non-empty list of token ids in 0..{vocab - 1}, got "
                                  f"{str(prompt_ids)[:80]}")
        return [int(i) for i in prompt_ids]


def load_huggingface_qwen35_vision(model_dir: str | Path, artifact: str | Path | None = None,
                                   device: str = "cpu") -> VisionEncoder:
    """The vision encoder of a Qwen3.5 image-text checkpoint (preprocessed pixels in, merged embeddings out)."""
    loaded_config(model_dir, ("qwen3_5",))
    return VisionEncoder(model_dir, artifact, device)


def load_huggingface_qwen35_multimodal(model_dir: str | Path, artifact: str | Path | None = None,
                                       device: str = "cpu") -> MultimodalPipeline:
    """A pipeline for a Qwen3.5 image-text checkpoint: text generation, and generation from prompts with images."""
    loaded_config(model_dir, QWEN35_TYPES)
    return MultimodalPipeline(model_dir, artifact, device)


__all__ = ["MultimodalPipeline", "VisionEncoder", "load_huggingface_qwen35_multimodal",
           "load_huggingface_qwen35_vision"]
