"""The token loop of one request: the prompt in prefill steps, then one step per new token, fed only that token."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from .engine import CompiledModel, GenerationError
from .request import IncrementalDetokenizer, RequestState
from .sampling import GreedyGenerationConfig, make_picker
from .vision import ImagePrompt


@dataclass
class GeneratedTokens:
    """The token ids of one finished request and how long its phases took."""

    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    stopped_on_eos: bool
    finish_reason: str
    """One of runtime.request.FINISH_REASONS."""
    prefill_seconds: float
    decode_seconds: float


class TokenStream:
    """Iterates the new token ids of one request; afterwards `result()` describes the whole run.

    EOS ids are `config.eos_token_ids`, or `default_eos` when the config leaves them None. The request's
    RequestState (`state`) decides when it stops; a generated EOS id is the stream's last item. With a
    `detokenizer`, `state.text` grows with the reply (and stop strings apply). With `images` (a prompt with images,
    runtime.vision.image_prompt), `prompt_ids` are its expanded ids.
    """

    def __init__(self, model: CompiledModel, prompt_ids: Sequence[int], config: GreedyGenerationConfig,
                 default_eos: Sequence[int] = (), detokenizer: IncrementalDetokenizer | None = None,
                 images: ImagePrompt | None = None):
        self.model = model
        self.config = config
        self.images = images
        prompt = [int(t) for t in prompt_ids]
        model.check_request(len(prompt), config.max_new_tokens)
        if config.stop_strings and detokenizer is None:
            raise GenerationError("stop_strings need the reply's text: generate text through the pipeline "
                                  "(generate_text / stream_text)")
        eos = config.eos_token_ids if config.eos_token_ids is not None else default_eos
        self.state = RequestState(prompt, config.max_new_tokens, eos, model.max_context, config.stop_strings,
                                  detokenizer)
        self.cache = model.new_cache(len(prompt) + config.max_new_tokens)
        self.prefill_seconds = self.decode_seconds = 0.0

    @property
    def generated(self) -> list[int]:
        """The tokens generated so far."""
        return self.state.generated

    def __iter__(self) -> Iterator[int]:
        pick = make_picker(self.config)
        try:
            start = time.perf_counter()
            logits = self.model.forward(self.state.prompt, self.cache, self.images)
            token = pick(logits, self.state.tokens)  # repetition penalties look at the prompt and the reply so far
            self.prefill_seconds = time.perf_counter() - start
            while True:
                self.state.append(token)
                yield token
                if self.state.finish_reason is not None:
                    return
                start = time.perf_counter()
                logits = self.model.forward([token], self.cache)
                token = pick(logits, self.state.tokens)
                self.decode_seconds += time.perf_counter() - start
        finally:  # finished, failed, or abandoned by the consumer: the pages go back to the arena
            self.cache.release()

    def result(self) -> GeneratedTokens:
        """What was generated so far."""
        reason = self.state.finish_reason
        return GeneratedTokens(self.state.prompt, self.state.generated, reason == "eos", reason or "length",
                               self.prefill_seconds, self.decode_seconds)


def generate(model: CompiledModel, prompt_ids: Sequence[int], config: GreedyGenerationConfig,
             default_eos: Sequence[int] = ()) -> GeneratedTokens:
    """Run one request to the end (greedy or sampled, as the config says)."""
    stream = TokenStream(model, prompt_ids, config, default_eos)
    for _ in stream:
        pass
    return stream.result()
