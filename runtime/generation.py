"""The token loop: one prefill over the prompt, then one decode step per new token, fed only that token."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from .engine import CompiledModel
from .sampling import GreedyGenerationConfig, make_picker


@dataclass
class GeneratedTokens:
    """The token ids of one finished request and how long its phases took."""

    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    stopped_on_eos: bool
    finish_reason: str
    """"eos", "length" (max_new_tokens reached) or "stop_string"."""
    prefill_seconds: float
    decode_seconds: float


class TokenStream:
    """Iterates the new token ids of one request; afterwards `result()` describes the whole run.

    EOS ids are `config.eos_token_ids`, or `default_eos` when the config leaves them None. A
    generated EOS id ends the stream and is its last item.
    """

    def __init__(self, model: CompiledModel, prompt_ids: Sequence[int], config: GreedyGenerationConfig,
                 default_eos: Sequence[int] = ()):
        self.model = model
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.config = config
        self.eos = set(config.eos_token_ids if config.eos_token_ids is not None else default_eos)
        model.check_request(len(self.prompt_ids), config.max_new_tokens)
        self.cache = model.new_cache(len(self.prompt_ids) + config.max_new_tokens)
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.prefill_seconds = self.decode_seconds = 0.0

    def __iter__(self) -> Iterator[int]:
        pick = make_picker(self.config)
        history = list(self.prompt_ids)  # what repetition penalties look at: prompt and reply so far
        start = time.perf_counter()
        logits = self.model.forward(self.prompt_ids, self.cache)
        token = pick(logits, history)
        self.prefill_seconds = time.perf_counter() - start
        while True:
            self.generated.append(token)
            history.append(token)
            if token in self.eos:
                self.finish_reason = "eos"
            elif len(self.generated) >= self.config.max_new_tokens:
                self.finish_reason = "length"
            yield token
            if self.finish_reason is not None:
                return
            start = time.perf_counter()
            logits = self.model.forward([token], self.cache)
            token = pick(logits, history)
            self.decode_seconds += time.perf_counter() - start

    def stop(self, reason: str) -> None:
        """End the stream early (e.g. a stop string appeared) for `reason`, unless it already ended."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def result(self) -> GeneratedTokens:
        """What was generated so far."""
        return GeneratedTokens(self.prompt_ids, list(self.generated), self.finish_reason == "eos",
                               self.finish_reason or "length", self.prefill_seconds, self.decode_seconds)


def generate(model: CompiledModel, prompt_ids: Sequence[int], config: GreedyGenerationConfig,
             default_eos: Sequence[int] = ()) -> GeneratedTokens:
    """Run one request to the end (greedy or sampled, as the config says)."""
    stream = TokenStream(model, prompt_ids, config, default_eos)
    for _ in stream:
        pass
    return stream.result()
