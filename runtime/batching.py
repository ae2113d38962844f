"""Continuous batching: the scheduler's batches run through the model's batched step over a paged KV arena."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

import numpy as np

from .engine import CompiledModel, GenerationError, StepRow
from .request import IncrementalDetokenizer
from .sampling import GreedyGenerationConfig, TokenPicker, make_picker, pick_tokens
from .scheduler import (
    ContinuousBatchConfig,
    ContinuousBatchScheduler,
    FinishedRequest,
    PagedKvCacheConfig,
    RequestId,
    TokenDelta,
    TokenLogprobs,
)

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask to see per token (OpenAI's limit)


def arena_config(model: CompiledModel) -> PagedKvCacheConfig:
    """The paged KV layout the artifact was built for (all its pages, the longest sequence it holds)."""
    b = model.buckets
    return PagedKvCacheConfig(b.kv_block, b.kv_pages, b.max_context)


class BatchExecutor:
    """Serves many requests at once: schedules batches, runs them, picks each row's token, repeats.

    Every request keeps its own token picker (greedy, or sampled with its own seeded generator), so its tokens
    are those it would get alone. A failed step does not end the service: the device cache is rebuilt, every
    running request recomputes its tokens, and a request whose steps fail MAX_FAILURES times finishes with
    finish_reason "error" (the last error is kept in `last_error`).
    """

    MAX_FAILURES = 2

    def __init__(self, model: CompiledModel, batch_config: ContinuousBatchConfig,
                 kv_config: PagedKvCacheConfig | None = None, default_eos_token_ids: Sequence[int] = ()):
        self.model = model
        b = model.buckets
        built = arena_config(model)
        kv_config = kv_config or built
        if kv_config.block_size != built.block_size or kv_config.num_pages > built.num_pages \
                or kv_config.max_sequence_length > built.max_sequence_length:
            raise GenerationError(f"{kv_config} does not fit the artifact's KV arena {built}; rebuild with other "
                                  "--kv-pages / --kv-block-size / --max-context")
        if batch_config.max_active_sequences > b.batch_rows[-1] or batch_config.max_batch_tokens > b.prefill_tokens[-1]:
            raise GenerationError(f"{batch_config} exceeds the artifact's batch steps (rows up to {b.batch_rows[-1]}, "
                                  f"tokens up to {b.prefill_tokens[-1]}); rebuild with larger --batch-rows / "
                                  "--prefill-buckets")
        self.scheduler = ContinuousBatchScheduler(batch_config, kv_config, default_eos_token_ids,
                                                  share_prefixes=not model.has_recurrent_state)
        self.cache = model.new_batch_cache()
        self._pickers: dict[RequestId, TokenPicker] = {}
        self._logprobs: dict[RequestId, int] = {}  # requests that want log-probabilities: how many alternatives
        self._failures: dict[RequestId, int] = {}
        self.last_error: Exception | None = None

    def submit(self, prompt_token_ids: Sequence[int], generation: GreedyGenerationConfig,
               detokenizer: IncrementalDetokenizer | None = None, images=None,
               logprobs: int | None = None) -> RequestId:
        """Queue a request; returns its id. With a `detokenizer` its text streams in the deltas (and stop strings
        apply). A prompt with images: `images` is its runtime.vision.ImagePrompt and `prompt_token_ids` its
        expanded ids (images.token_ids). `logprobs` (0..MAX_TOP_LOGPROBS): each delta carries the token's
        log-probability and that many of the most likely tokens' (TokenLogprobs)."""
        if images is not None and self.model.vision is None:
            raise GenerationError(f"{self.model.model_dir} has no vision encoder: it takes text prompts only")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise GenerationError(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {logprobs!r}")
        request_id = self.scheduler.submit(prompt_token_ids, generation, detokenizer, images)
        self._pickers[request_id] = make_picker(generation)
        if logprobs is not None:
            self._logprobs[request_id] = logprobs
        return request_id

    def abort(self, request_id: RequestId) -> bool:
        """Stop a request now (see ContinuousBatchScheduler.abort)."""
        return self.scheduler.abort(request_id)

    def step(self) -> list[TokenDelta]:
        """Run one batch (if there is work); the tokens it generated, with their text."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            for src, dst in batch.copies:
                self.model.copy_page(self.cache, src, dst)
            rows = [StepRow(seq.token_ids, seq.start_position, seq.page_table, seq.slot, seq.images)
                    for seq in batch.sequences]
            logits = self.model.step(rows, self.cache, logits=any(seq.final for seq in batch.sequences))
        except Exception as error:  # noqa: BLE001 -- any failure of the device step: recover, keep serving
            self._recover(batch, error)
            return []
        final = [i for i, seq in enumerate(batch.sequences) if seq.final]  # a non-final chunk's token is discarded
        ids = [batch.sequences[i].request_id for i in final]
        tokens = [0] * len(batch.sequences)
        picked = pick_tokens(logits[final], [self._pickers[r] for r in ids],
                             [self.scheduler.request_state(r).tokens for r in ids]) if final else []
        for i, token in zip(final, picked):
            tokens[i] = token
        asked = {ids[k]: token_logprobs(logits[i], picked[k], self._logprobs[ids[k]])
                 for k, i in enumerate(final) if ids[k] in self._logprobs}
        self.scheduler.complete_batch(batch.id, tokens)
        return [replace(d, logprobs=asked[d.request_id]) if d.request_id in asked else d
                for d in self.scheduler.pop_deltas()]

    def pop_finished(self) -> list[FinishedRequest]:
        """The requests finished since the last call."""
        finished = self.scheduler.pop_finished()
        for request in finished:
            del self._pickers[request.request_id]
            self._failures.pop(request.request_id, None)
            self._logprobs.pop(request.request_id, None)
        return finished

    def run(self) -> Iterator[FinishedRequest]:
        """Run batches until every submitted request has finished, yielding each as it finishes."""
        while self.scheduler.has_unfinished():
            self.step()
            yield from self.pop_finished()
        yield from self.pop_finished()

    def _recover(self, batch, error: Exception) -> None:
        """After a failed step: undo the batch, rebuild the device cache (its state may be half-written), let every
        running request recompute, and stop the batch's requests that keep failing."""
        self.last_error = error
        self.scheduler.fail_batch(batch.id)
        self.cache = self.model.new_batch_cache()
        self.scheduler.reset_cache()
        for seq in batch.sequences:
            self._failures[seq.request_id] = self._failures.get(seq.request_id, 0) + 1
            if self._failures[seq.request_id] >= self.MAX_FAILURES:
                self.scheduler.abort(seq.request_id, "error")


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """A token's log-probability under softmax(logits), and the `top` most likely tokens' (most likely first)."""
    shifted = logits.astype(np.float64) - logits.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    best = np.argpartition(-logprobs, top)[:top] if top else np.zeros(0, np.int64)
    best = best[np.argsort(-logprobs[best], kind="stable")]
    return TokenLogprobs(float(logprobs[token]), [(int(t), float(logprobs[t])) for t in best])
