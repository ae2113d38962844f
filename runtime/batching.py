"""Continuous batching: the scheduler's batches run through the model's batched step over a paged KV arena."""

from __future__ import annotations

from typing import Iterator, Sequence

from .engine import CompiledModel, GenerationError
from .sampling import GreedyGenerationConfig, TokenPicker, make_picker
from .scheduler import ContinuousBatchConfig, ContinuousBatchScheduler, FinishedRequest, PagedKvCacheConfig, RequestId


def arena_config(model: CompiledModel) -> PagedKvCacheConfig:
    """The paged KV layout the artifact was built for (all its pages, the longest sequence it holds)."""
    b = model.batch_layout()
    return PagedKvCacheConfig(b.kv_block, b.kv_pages, b.pages_per_row * b.kv_block)


class BatchExecutor:
    """Serves many requests at once: schedules batches, runs them, picks each row's token, repeats.

    Every request keeps its own token picker (greedy, or sampled with its own seeded generator), so
    its tokens are those it would get alone.
    """

    def __init__(self, model: CompiledModel, batch_config: ContinuousBatchConfig,
                 kv_config: PagedKvCacheConfig | None = None, default_eos_token_ids: Sequence[int] = ()):
        self.model = model
        b = model.batch_layout()
        built = arena_config(model)
        kv_config = kv_config or built
        if kv_config.block_size != built.block_size or kv_config.num_pages > built.num_pages \
                or kv_config.max_sequence_length > built.max_sequence_length:
            raise GenerationError(f"{kv_config} does not fit the artifact's KV arena {built}; rebuild with other "
                                  "--kv-pages / --kv-block-size / --context-buckets")
        if batch_config.max_active_sequences > b.batch_rows[-1] or batch_config.max_batch_tokens > b.prefill_tokens[-1]:
            raise GenerationError(f"{batch_config} exceeds the artifact's batch steps (rows up to {b.batch_rows[-1]}, "
                                  f"tokens up to {b.prefill_tokens[-1]}); rebuild with larger --batch-rows / "
                                  "--prefill-buckets")
        recurrent = any("_pool." in e.name for e in model.manifest.batch_state)  # per-sequence recurrent states
        self.scheduler = ContinuousBatchScheduler(batch_config, kv_config, default_eos_token_ids,
                                                  share_prefixes=not recurrent)
        self.cache = model.new_batch_cache()
        self._requests: dict[RequestId, tuple[list[int], TokenPicker]] = {}
        self._slot_of: dict[RequestId, int] = {}
        self._free_slots = list(range(batch_config.max_active_sequences))

    def submit(self, prompt_token_ids: Sequence[int], generation: GreedyGenerationConfig) -> RequestId:
        """Queue a request; returns its id."""
        request_id = self.scheduler.submit(prompt_token_ids, generation)
        self._requests[request_id] = ([int(t) for t in prompt_token_ids], make_picker(generation))
        return request_id

    def step(self) -> list[FinishedRequest]:
        """Run one batch (if there is work); the requests it finished."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self._requests:
                raise GenerationError("the scheduler has unfinished requests but nothing to run")
            return []
        try:
            for src, dst in batch.copies:
                self.model.copy_page(self.cache, src, dst)
            rows = [(seq.token_ids, seq.start_position, seq.page_table, self._slot(seq.request_id))
                    for seq in batch.sequences]
            logits = self.model.step(rows, self.cache)
        except Exception:
            self.scheduler.fail_batch(batch.id)
            raise
        tokens = []
        for seq, row_logits in zip(batch.sequences, logits):
            history, pick = self._requests[seq.request_id]
            if seq.context_length < len(history):
                tokens.append(0)  # a non-final prefill chunk: the scheduler discards its token, so draw nothing
            else:
                tokens.append(pick(row_logits, history))
                history.append(tokens[-1])
        self.scheduler.complete_batch(batch.id, tokens)
        finished = self.scheduler.pop_finished()
        for request in finished:
            del self._requests[request.request_id]
            self._release_slot(request.request_id)
        return finished

    def _slot(self, request_id: RequestId) -> int:
        """The request's recurrent-state slot (kept while it runs; a preempted request restarts from position 0,
        so its slot may go to another request meanwhile)."""
        if request_id not in self._slot_of:
            if not self._free_slots:
                running = set(self.scheduler.running_request_ids())
                for stale in [r for r in self._slot_of if r not in running]:
                    self._release_slot(stale)
            self._slot_of[request_id] = self._free_slots.pop()
        return self._slot_of[request_id]

    def _release_slot(self, request_id: RequestId) -> None:
        if request_id in self._slot_of:
            self._free_slots.append(self._slot_of.pop(request_id))

    def run(self) -> Iterator[FinishedRequest]:
        """Run batches until every submitted request has finished, yielding each as it finishes."""
        while self._requests:
            yield from self.step()
