"""Continuous-batching scheduler, checked against a simulated executor with a paged token "KV cache".

The fake model's next token is a function of the whole history it reads back through the page tables, so any
wrong page table, missed copy-on-write, stale shared page or bad position changes the generated tokens.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ir.errors import RudaError
from runtime.sampling import (
    GreedyGenerationConfig,
    SamplingConfig,
    SamplingGenerationConfig,
)
from runtime.scheduler import (
    BatchKind,
    ContinuousBatchConfig,
    ContinuousBatchScheduler,
    FinishedRequest,
    PagedKvCacheConfig,
    ScheduledBatch,
    ScheduledSequence,
    SchedulerError,
)

VOCAB = 23
GARBAGE = -1


def next_token(history: list[int]) -> int:
    """The deterministic fake model: a position-weighted hash of the whole history."""
    return (sum((i + 1) * token for i, token in enumerate(history)) * 31 + len(history)) % VOCAB


def solo_run(prompt, generation, max_sequence_length, default_eos=()):
    """The tokens and finish reason of the request run alone, token by token."""
    eos = set(default_eos if generation.eos_token_ids is None else generation.eos_token_ids)
    history, generated = list(prompt), []
    while True:
        token = next_token(history)
        history.append(token)
        generated.append(token)
        if token in eos:
            return generated, "eos"
        if len(generated) == generation.max_new_tokens or len(history) >= max_sequence_length:
            return generated, "length"


def pages_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


class Executor:
    """Runs batches on a fake paged KV arena of tokens and checks every row against the request histories."""

    def __init__(self, scheduler: ContinuousBatchScheduler, kv: PagedKvCacheConfig, batch: ContinuousBatchConfig):
        self.scheduler, self.kv, self.batch_config = scheduler, kv, batch
        self.arena = [[None] * kv.block_size for _ in range(kv.num_pages)]
        self.histories: dict[int, list[int]] = {}
        self.requests: dict[int, tuple[list[int], GreedyGenerationConfig]] = {}
        self.finished: dict[int, FinishedRequest] = {}
        self.recomputed: set[int] = set()
        self.batches: list[ScheduledBatch] = []
        self.aborted: set[int] = set()

    def submit(self, prompt, generation, detokenizer=None) -> int:
        request_id = self.scheduler.submit(prompt, generation, detokenizer)
        self.histories[request_id] = list(prompt)
        self.requests[request_id] = (list(prompt), generation)
        return request_id

    def write(self, batch: ScheduledBatch, garbage: bool = False) -> None:
        """Do the batch's page copies, then write each row's tokens at its positions."""
        for src, dst in batch.copies:
            self.arena[dst] = list(self.arena[src])
        for row in batch.sequences:
            for offset, token in enumerate(row.token_ids):
                position = row.start_position + offset
                self.arena[row.page_table[position // self.kv.block_size]][position % self.kv.block_size] = (
                    GARBAGE if garbage else token)

    def run(self, batch: ScheduledBatch) -> list[int]:
        """Check the batch, write it, and pick each row's next token from the history read back through pages."""
        self.batches.append(batch)
        assert sum(len(row.token_ids) for row in batch.sequences) <= self.batch_config.max_batch_tokens
        assert len({row.request_id for row in batch.sequences}) == len(batch.sequences)
        self.write(batch)
        tokens = []
        for row in batch.sequences:
            history = self.histories[row.request_id]
            assert row.context_length == row.start_position + len(row.token_ids)
            assert row.token_ids == history[row.start_position:row.context_length]  # start = tokens before it
            assert len(row.page_table) == pages_for(row.context_length, self.kv.block_size)
            assert row.final == (row.context_length == len(history))
            if batch.kind is BatchKind.DECODE:
                assert len(row.token_ids) == 1 and row.context_length == len(history)
            elif len(history) > len(self.requests[row.request_id][0]):
                self.recomputed.add(row.request_id)
            bs = self.kv.block_size
            cached = [self.arena[row.page_table[p // bs]][p % bs] for p in range(row.context_length)]
            assert cached == history[:row.context_length], f"request {row.request_id} read a corrupted cache"
            tokens.append(next_token(cached))
        return tokens

    def complete(self, batch: ScheduledBatch) -> None:
        tokens = self.run(batch)
        self.scheduler.complete_batch(batch.id, tokens)
        for row, token in zip(batch.sequences, tokens):
            if row.final and row.request_id not in self.aborted:  # an aborted request's token is discarded
                self.histories[row.request_id].append(token)
        self.collect()

    def fail(self, batch: ScheduledBatch) -> None:
        """Fail the batch after a partial device run that wrote garbage into its pages."""
        self.write(batch, garbage=True)
        self.scheduler.fail_batch(batch.id)
        self.collect()

    def collect(self) -> None:
        for done in self.scheduler.pop_finished():
            assert done.request_id not in self.finished
            assert done.generated_token_ids == self.histories[done.request_id][len(done.prompt_token_ids):]
            self.finished[done.request_id] = done

    def drain(self, fail_every: int = 0, limit: int = 10_000) -> None:
        """Run until nothing is left, failing every `fail_every`-th batch (0: none) before retrying it."""
        for step in range(1, limit):
            batch = self.scheduler.schedule()
            if batch is None:
                return
            if fail_every and step % fail_every == 0:
                self.fail(batch)
            else:
                self.complete(batch)
            self.scheduler.check_invariants()
        raise AssertionError("the scheduler did not finish")

    def check_solo(self, default_eos=()) -> None:
        assert set(self.finished) == set(self.requests)
        for request_id, (prompt, generation) in self.requests.items():
            done = self.finished[request_id]
            assert done.prompt_token_ids == prompt
            expected, reason = solo_run(prompt, generation, self.kv.max_sequence_length, default_eos)
            if done.finish_reason == "abort":  # stopped early: what it generated is the start of its solo run
                assert request_id in self.aborted and expected[:len(done.generated_token_ids)] == done.generated_token_ids
            else:
                assert (done.generated_token_ids, done.finish_reason) == (expected, reason)

    def abort(self, request_id: int) -> bool:
        self.aborted.add(request_id)
        aborted = self.scheduler.abort(request_id)
        self.collect()
        return aborted

    def lose_device_state(self) -> None:
        """What the executor does after a failed step: a new (garbage) arena, and the scheduler told so."""
        self.arena = [[GARBAGE] * self.kv.block_size for _ in range(self.kv.num_pages)]
        self.scheduler.reset_cache()


def make(max_active=4, max_tokens=16, block_size=4, num_pages=32, max_len=64, default_eos=(), decoding_tokens=None):
    batch = ContinuousBatchConfig(max_active, max_tokens, decoding_tokens)
    kv = PagedKvCacheConfig(block_size, num_pages, max_len)
    scheduler = ContinuousBatchScheduler(batch, kv, default_eos)
    return scheduler, Executor(scheduler, kv, batch)


def greedy(max_new_tokens=4, eos=()):
    return GreedyGenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos)


def state(scheduler):
    """Everything observable plus the internal snapshot, to compare before and after."""
    return scheduler._snapshot(), scheduler.free_pages, scheduler._outstanding, scheduler._next_batch_id, [
        list(r.tokens) for r in list(scheduler._running) + list(scheduler._waiting)]


# --- configuration and submit validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["max_active_sequences", "max_batch_tokens", "max_decoding_batch_tokens"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_batch_config_rejects_each_field(name, bad):
    if bad is None and name == "max_decoding_batch_tokens":
        assert ContinuousBatchConfig(2, 8, None).max_decoding_batch_tokens is None  # optional: no decoding budget
        return
    values = {"max_active_sequences": 2, "max_batch_tokens": 8, name: bad}
    with pytest.raises(SchedulerError, match=name):
        ContinuousBatchConfig(**values)


@pytest.mark.parametrize("name", ["block_size", "num_pages", "max_sequence_length"])
@pytest.mark.parametrize("bad", [0, -3, 2.0, False, None])
def test_kv_config_rejects_each_field(name, bad):
    values = {"block_size": 4, "num_pages": 8, "max_sequence_length": 32, name: bad}
    with pytest.raises(SchedulerError, match=name):
        PagedKvCacheConfig(**values)


def test_scheduler_error_is_a_ruda_value_error():
    assert issubclass(SchedulerError, RudaError) and issubclass(SchedulerError, ValueError)
    with pytest.raises(SchedulerError, match="batch_config"):
        ContinuousBatchScheduler((2, 8), PagedKvCacheConfig(4, 8, 32))
    with pytest.raises(SchedulerError, match="default_eos_token_ids"):
        ContinuousBatchScheduler(ContinuousBatchConfig(2, 8), PagedKvCacheConfig(4, 8, 32), [-1])


@pytest.mark.parametrize("prompt, generation, message", [
    ([], greedy(), "empty"),
    ("abc", greedy(), "list of token ids"),
    ([1, 2.0], greedy(), r"prompt_token_ids\[1\]"),
    ([1, True], greedy(), r"prompt_token_ids\[1\]"),
    ([1, -2], greedy(), r"prompt_token_ids\[1\]"),
    ([1] * 17, greedy(), "more than max_sequence_length 16"),
    ([1] * 16, greedy(), "no room for a generated token"),
    ([1, 2], {"max_new_tokens": 2}, "GreedyGenerationConfig"),
    ([1] * 9, greedy(max_new_tokens=4), "needs up to 3 KV pages"),  # 12 positions in pages of 4, pool of 2
])
def test_submit_errors_change_nothing(prompt, generation, message):
    scheduler, _ = make(block_size=4, num_pages=2, max_len=16)
    before = state(scheduler)
    with pytest.raises(SchedulerError, match=message):
        scheduler.submit(prompt, generation)
    assert state(scheduler) == before
    assert scheduler.schedule() is None


def test_submit_accepts_a_request_that_exactly_fits():
    _scheduler, executor = make(block_size=4, num_pages=4, max_len=16)
    executor.submit([1] * 5, greedy(max_new_tokens=12))  # capped at 15 positions: four pages
    executor.submit([2] * 15, SamplingGenerationConfig(max_new_tokens=9, sampling=SamplingConfig(seed=1)))
    assert [executor.submit([3], greedy()) for _ in range(2)] == [2, 3]  # ids increase
    executor.drain()
    executor.check_solo()


def test_numpy_token_ids_are_accepted():
    scheduler, _ = make()
    request = scheduler.submit(np.array([3, 4, 5], dtype=np.int32), greedy(max_new_tokens=1))
    batch = scheduler.schedule()
    assert batch.sequences[0].token_ids == [3, 4, 5] and type(batch.sequences[0].token_ids[0]) is int
    scheduler.complete_batch(batch.id, np.array([7], dtype=np.int64))
    assert scheduler.pop_finished()[0].generated_token_ids == [7]
    assert request == 0


def test_scheduler_module_imports_no_numpy_or_tvm():
    source = ast.parse((Path(__file__).parents[1] / "runtime" / "scheduler.py").read_text())
    imported = {alias.name for node in ast.walk(source) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(source) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in ("numpy", "tvm")}


# --- basic flow -----------------------------------------------------------------------------------------------------

def test_prefill_then_decodes():
    scheduler, executor = make()
    request = executor.submit([5, 6, 7], greedy(max_new_tokens=3))
    batch = scheduler.schedule()
    assert batch.kind is BatchKind.PREFILL
    assert batch.sequences == [ScheduledSequence(request, [5, 6, 7], 0, 3, [0])]
    assert batch.token_matrix() == [[5, 6, 7]] and batch.context_lengths() == [3]
    assert batch.flattened_block_table() == [0] and batch.max_pages_per_row == 1
    executor.complete(batch)
    for position in (3, 4):
        batch = scheduler.schedule()
        assert batch.kind is BatchKind.DECODE
        row, = batch.sequences
        assert (row.start_position, row.context_length, row.token_ids) == (position, position + 1,
                                                                          [executor.histories[request][-1]])
        executor.complete(batch)
    assert scheduler.schedule() is None
    executor.check_solo()
    assert executor.finished[request].finish_reason == "length"
    assert scheduler.free_pages == scheduler.num_pages


def test_batch_matrices_pad_rows():
    rows = [ScheduledSequence(0, [1, 2, 3], 0, 3, [4]), ScheduledSequence(1, [9], 6, 7, [2, 5])]
    batch = ScheduledBatch(0, BatchKind.PREFILL, rows)
    assert batch.token_matrix(pad=-7) == [[1, 2, 3], [9, -7, -7]]
    assert batch.context_lengths() == [3, 7]
    assert batch.max_pages_per_row == 2
    assert batch.flattened_block_table() == [4, -1, 2, 5]
    assert batch.copies == []


def first_new_token(tokens: list[int]) -> int:
    """A token that first occurs after the first position."""
    return next(token for i, token in enumerate(tokens) if i and token not in tokens[:i])


def test_eos_finishes_and_is_kept_as_last_token():
    prompt = [1, 2, 3]
    first, _ = solo_run(prompt, greedy(max_new_tokens=8), 64)
    eos = first_new_token(first)
    scheduler, executor = make()
    request = executor.submit(prompt, greedy(max_new_tokens=8, eos=[eos]))
    executor.drain()
    done = executor.finished[request]
    assert done.finish_reason == "eos"
    assert done.generated_token_ids[-1] == eos and done.generated_token_ids == first[:first.index(eos) + 1]
    assert scheduler.free_pages == scheduler.num_pages


def test_default_eos_applies_when_the_config_has_none():
    prompt = [5, 1, 1]
    first, _ = solo_run(prompt, greedy(max_new_tokens=8), 64)
    eos = first_new_token(first)
    _scheduler, executor = make(default_eos=[eos])
    default = executor.submit(prompt, GreedyGenerationConfig(max_new_tokens=8))
    explicit = executor.submit(prompt, greedy(max_new_tokens=8, eos=[]))
    executor.drain()
    assert executor.finished[default].generated_token_ids == first[:first.index(eos) + 1]
    assert executor.finished[default].finish_reason == "eos"
    assert executor.finished[explicit].generated_token_ids == first
    executor.check_solo(default_eos=[eos])


def test_max_sequence_length_finishes_with_length():
    _scheduler, executor = make(max_len=6)
    request = executor.submit([1, 2, 3, 4], greedy(max_new_tokens=10))
    executor.drain()
    assert len(executor.finished[request].generated_token_ids) == 2
    assert executor.finished[request].finish_reason == "length"


# --- batching policy ------------------------------------------------------------------------------------------------

def test_chunked_prefill_respects_the_token_budget_and_discards_chunk_tokens():
    scheduler, executor = make(max_tokens=4)
    request = executor.submit(list(range(10)), greedy(max_new_tokens=2))
    starts = []
    for expected_end in (4, 8, 10):
        batch = scheduler.schedule()
        row, = batch.sequences
        assert batch.kind is BatchKind.PREFILL and row.context_length == expected_end
        starts.append(row.start_position)
        tokens = executor.run(batch)
        scheduler.complete_batch(batch.id, [99] if expected_end < 10 else tokens)  # chunk tokens are discarded
        if expected_end == 10:
            executor.histories[request].append(tokens[0])
    assert starts == [0, 4, 8]
    executor.drain()
    executor.check_solo()


def test_long_prompt_is_chunked_beside_running_decodes():
    """Mixed batches: the running sequence decodes in every batch while the long prompt fills the rest of the
    token budget, chunk by chunk."""
    scheduler, executor = make(max_tokens=4, max_active=2)
    short = executor.submit([1, 2], greedy(max_new_tokens=20))
    executor.complete(scheduler.schedule())
    long = executor.submit(list(range(16)), greedy(max_new_tokens=2))
    batches = []
    while long not in executor.finished or short not in executor.finished:
        batch = scheduler.schedule()
        batches.append(batch)
        executor.complete(batch)
    chunks = [b for b in batches if any(row.request_id == long and not row.final for row in b.sequences)]
    assert [len(b.sequences[1].token_ids) for b in chunks] == [3, 3, 3, 3, 3]  # 16 tokens: 5 chunks + the last one
    assert all(b.kind is BatchKind.PREFILL and b.sequences[0].request_id == short for b in chunks)
    assert all(sum(len(row.token_ids) for row in b.sequences) <= 4 for b in batches)
    assert scheduler.stats.mixed_batches == len(chunks) + 1
    executor.check_solo()


def test_batches_with_decodes_in_them_keep_to_the_decoding_budget():
    """A prompt with nothing decoding beside it fills the whole budget; one admitted beside a running decode is
    prefilled in chunks that keep each batch to max_decoding_batch_tokens."""
    scheduler, executor = make(max_tokens=16, max_active=4, decoding_tokens=4)
    first = executor.submit(list(range(1, 13)), greedy(max_new_tokens=30))
    batch = scheduler.schedule()
    assert [len(row.token_ids) for row in batch.sequences] == [12]  # nothing decodes yet: up to 16 tokens
    executor.complete(batch)
    long = executor.submit(list(range(20)), greedy(max_new_tokens=2))
    batches = []
    while long not in executor.finished:
        batches.append(batch := scheduler.schedule())
        executor.complete(batch)
    assert all(batch.sequences[0].request_id == first and len(batch.sequences[0].token_ids) == 1 for batch in batches)
    assert [len(b.sequences[1].token_ids) for b in batches if len(b.sequences) > 1] == [3] * 6 + [2] + [1]
    assert all(sum(len(row.token_ids) for row in b.sequences) <= 4 for b in batches)
    executor.drain()
    executor.check_solo()


def test_the_decoding_budget_never_cuts_decode_rows():
    scheduler, executor = make(max_tokens=16, max_active=4, decoding_tokens=2)
    decoding = [executor.submit([i + 1, i + 2], greedy(max_new_tokens=6)) for i in range(3)]
    executor.complete(scheduler.schedule())  # the three prompts: 6 tokens, nothing decoding yet
    waiting = executor.submit([7, 8, 9], greedy(max_new_tokens=2))
    batch = scheduler.schedule()
    assert [row.request_id for row in batch.sequences] == decoding  # three decodes over a budget of 2, no prefill
    executor.complete(batch)
    executor.drain()
    assert waiting in executor.finished
    executor.check_solo()


def test_max_active_sequences_is_respected():
    scheduler, executor = make(max_active=2, max_tokens=64)
    for i in range(5):
        executor.submit([i + 1] * 3, greedy(max_new_tokens=3))
    active = set()
    while (batch := scheduler.schedule()) is not None:
        active |= {row.request_id for row in batch.sequences}
        executor.complete(batch)
        active -= set(executor.finished)
        assert len(active) <= 2
    executor.check_solo()


def test_preemption_under_a_tiny_page_budget_matches_solo_runs():
    scheduler, executor = make(max_active=4, max_tokens=8, block_size=2, num_pages=6, max_len=12)
    for i in range(6):
        executor.submit([i, i + 1, i + 2, 1 + i % 3][: 2 + i % 3], greedy(max_new_tokens=6 + i % 3))
    executor.drain()
    assert executor.recomputed, "the page budget should have forced a preemption"
    assert scheduler.stats.preemptions >= len(executor.recomputed)
    executor.check_solo()
    assert scheduler.free_pages == scheduler.num_pages
    scheduler.check_invariants()


# --- prefix sharing -------------------------------------------------------------------------------------------------

def test_shared_prefix_pages_and_copy_on_write():
    scheduler, executor = make(block_size=4, num_pages=16, max_tokens=32)
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]  # two full pages
    a = executor.submit(prefix + [5, 3], greedy(max_new_tokens=3))
    executor.complete(scheduler.schedule())
    assert scheduler.num_pages - scheduler.free_pages == 3

    b = executor.submit(prefix + [8], greedy(max_new_tokens=3))
    free_before = scheduler.free_pages
    batch = scheduler.schedule()  # a decodes, b is admitted beside it
    a_row, b_row = batch.sequences
    assert batch.kind is BatchKind.PREFILL and (a_row.request_id, b_row.request_id) == (a, b)
    assert b_row.start_position == 8 and b_row.token_ids == [8]  # the shared prefix is not recomputed
    assert b_row.page_table[:2] == a_row.page_table[:2] and batch.copies == []
    assert scheduler.free_pages == free_before - 1  # only b's own last page is new
    assert scheduler.stats.prefix_hit_pages == 2 and scheduler.stats.copy_on_write == 0
    executor.complete(batch)

    c = executor.submit(list(prefix), greedy(max_new_tokens=3))  # fully cached: recompute the last token only
    batch = scheduler.schedule()
    row = batch.sequences[-1]
    assert row.request_id == c and row.start_position == 7 and row.token_ids == [6]
    assert row.page_table[0] == a_row.page_table[0] and row.page_table[1] != a_row.page_table[1]
    assert batch.copies == [(a_row.page_table[1], row.page_table[1])]
    assert scheduler.stats.prefix_hit_pages == 4 and scheduler.stats.copy_on_write == 1
    scheduler.check_invariants()
    executor.complete(batch)
    executor.drain()
    executor.check_solo()
    assert scheduler.free_pages == scheduler.num_pages


def test_prefix_cache_outlives_its_requests():
    """A finished request's full pages stay indexed: the same prompt later computes only its last token."""
    scheduler, executor = make(block_size=4, num_pages=8, max_tokens=32)
    prompt = list(range(1, 10))  # two full pages and one token
    first = executor.submit(prompt, greedy(max_new_tokens=2))
    executor.drain()
    assert first in executor.finished and scheduler.free_pages == scheduler.num_pages
    assert scheduler.cached_pages == 2  # the two full prompt pages (the third page was never full)
    again = executor.submit(prompt, greedy(max_new_tokens=2))
    batch = scheduler.schedule()
    row, = batch.sequences
    assert row.request_id == again and row.start_position == 8 and row.token_ids == [9]
    assert scheduler.stats.prefix_hit_pages == 2
    executor.complete(batch)
    executor.drain()
    executor.check_solo()


def test_a_page_taken_from_the_prefix_cache_is_never_written_in_place():
    """A fully cached prompt recomputes its last token into a copy of the cached page, even when no one else holds
    that page: another request admitted in the same batch may take the cached page too (found by the state
    machine)."""
    scheduler, executor = make(max_active=2, max_tokens=2, block_size=2, num_pages=3, max_len=6)
    executor.submit([1, 2, 3, 4], greedy(max_new_tokens=1))
    executor.drain()
    assert scheduler.cached_pages == 2
    b = executor.submit([1, 2, 3, 4], greedy(max_new_tokens=1))
    executor.submit([1, 2, 3, 4, 0], greedy(max_new_tokens=1))
    batch = scheduler.schedule()
    row = batch.sequences[0]
    assert row.request_id == b and row.start_position == 3 and len(batch.copies) == 1
    assert batch.copies[0][1] == row.page_table[1]  # b writes its own copy of the cached page
    scheduler.check_invariants()
    executor.complete(batch)
    executor.drain()
    executor.check_solo()


def test_a_fully_cached_prompt_alone_in_a_full_pool_recomputes_its_last_page():
    """Its cached pages fill the pool, so there is no page to copy the last one into: that page is left out and its
    token recomputed (it used to wait forever, found by the state machine)."""
    scheduler, executor = make(max_active=2, max_tokens=4, block_size=1, num_pages=3, max_len=4)
    executor.submit([9, 9, 5], greedy(max_new_tokens=1))
    executor.drain()
    assert scheduler.cached_pages == 3 and scheduler.free_pages == 3
    again = executor.submit([9, 9, 5], greedy(max_new_tokens=1))
    batch = scheduler.schedule()
    row, = batch.sequences
    assert row.request_id == again and row.start_position == 2 and row.token_ids == [5] and batch.copies == []
    assert scheduler.stats.prefix_hit_pages == 2 and scheduler.stats.evicted_pages == 1
    executor.complete(batch)
    executor.drain()
    executor.check_solo()


def test_cached_pages_are_evicted_least_recently_released_first():
    scheduler, executor = make(block_size=2, num_pages=4, max_tokens=32, max_len=8)
    old = executor.submit([1, 1, 1], greedy(max_new_tokens=1))  # caches page [1, 1]
    executor.drain()
    recent = executor.submit([2, 2, 2], greedy(max_new_tokens=1))  # caches page [2, 2]
    executor.drain()
    assert scheduler.cached_pages == 2 and scheduler.stats.evicted_pages == 0
    executor.submit([3, 3, 3, 3, 3], greedy(max_new_tokens=1))  # three pages: both plain free ones, then one cached
    executor.drain()
    assert scheduler.stats.evicted_pages == 1
    hit = executor.submit([2, 2, 2], greedy(max_new_tokens=1))
    batch = scheduler.schedule()
    assert batch.sequences[0].start_position == 2  # the recently released page survived
    executor.complete(batch)
    missed = executor.submit([1, 1, 1], greedy(max_new_tokens=1))
    batch = scheduler.schedule()
    assert batch.sequences[0].start_position == 0  # the older one was evicted
    executor.complete(batch)
    executor.drain()
    executor.check_solo()
    assert {old, recent, hit, missed} <= set(executor.finished)


def test_shared_pages_outlive_their_first_user():
    scheduler, executor = make(block_size=2, num_pages=12)
    prefix = [7, 7, 8, 8]
    a = executor.submit(prefix + [1], greedy(max_new_tokens=1))
    executor.complete(scheduler.schedule())
    assert a in executor.finished and scheduler.free_pages == scheduler.num_pages
    b = executor.submit(prefix + [2], greedy(max_new_tokens=4))
    batch = scheduler.schedule()
    assert batch.sequences[0].start_position == 4  # a's pages, cached after it finished
    executor.complete(batch)
    c = executor.submit(prefix + [3], greedy(max_new_tokens=1))
    batch = scheduler.schedule()
    assert [(row.request_id, row.start_position) for row in batch.sequences] == [(b, 5), (c, 4)]
    executor.complete(batch)
    executor.drain()
    executor.check_solo()
    assert b in executor.finished and scheduler.free_pages == scheduler.num_pages


# --- failure and misuse ---------------------------------------------------------------------------------------------

def busy_scheduler():
    """A scheduler with decoding, partially prefilled and waiting requests, and no batch outstanding."""
    scheduler, executor = make(max_active=3, max_tokens=6, block_size=2, num_pages=40, max_len=40)
    executor.submit([1, 2, 3], greedy(max_new_tokens=8))
    executor.complete(scheduler.schedule())
    executor.submit(list(range(1, 12)), greedy(max_new_tokens=8))
    executor.submit([1, 2, 3, 9], greedy(max_new_tokens=8))
    executor.submit([5, 5], greedy(max_new_tokens=8))
    executor.submit([6, 6], greedy(max_new_tokens=8))
    executor.complete(scheduler.schedule())
    executor.complete(scheduler.schedule())
    return scheduler, executor


def test_fail_batch_restores_the_state_exactly():
    scheduler, executor = busy_scheduler()
    for _ in range(6):
        before = state(scheduler)
        batch = scheduler.schedule()
        executor.fail(batch)
        after = state(scheduler)
        assert after[:3] == before[:3] and after[4] == before[4]  # only the batch id counter moved on
        again = scheduler.schedule()
        assert again.sequences == batch.sequences and again.copies == batch.copies and again.id == batch.id + 1
        executor.complete(again)
    executor.drain()
    executor.check_solo()


def test_fail_batch_keeps_requests_submitted_meanwhile():
    scheduler, executor = busy_scheduler()
    batch = scheduler.schedule()
    late = executor.submit([4, 4, 4], greedy(max_new_tokens=2))
    executor.fail(batch)
    assert scheduler._waiting[-1].id == late
    executor.drain()
    executor.check_solo()


def test_fail_batch_after_preemption_keeps_the_victims_preempted():
    scheduler, executor = make(max_active=3, max_tokens=16, block_size=2, num_pages=7, max_len=16)
    a, b, c = (executor.submit([i] * 3, greedy(max_new_tokens=4)) for i in (1, 2, 3))
    executor.complete(scheduler.schedule())  # prefill: two pages each
    executor.complete(scheduler.schedule())  # decode at position 3: no new page
    assert scheduler.free_pages == 1
    before = scheduler._snapshot()
    batch = scheduler.schedule()  # position 4 needs a page each: a takes the free one, c is preempted for b
    assert batch.kind is BatchKind.DECODE and [row.request_id for row in batch.sequences] == [a, b]
    executor.fail(batch)  # the failed run wrote garbage into a page c held
    victim = scheduler._waiting[0]
    assert victim.id == c and not victim.pages and victim.num_computed == 0 and victim.state.generated
    assert scheduler._snapshot().running == before.running[:2] and scheduler.free_pages == 3
    scheduler.check_invariants()
    executor.drain()
    assert c in executor.recomputed
    executor.check_solo()


def test_misuse_is_an_error_that_changes_nothing():
    scheduler, executor = busy_scheduler()
    for call, message in [(lambda: scheduler.complete_batch(0, [1]), "no batch is"),
                          (lambda: scheduler.fail_batch(0), "no batch is")]:
        before = state(scheduler)
        with pytest.raises(SchedulerError, match=message):
            call()
        assert state(scheduler) == before
    batch = scheduler.schedule()
    rows = len(batch.sequences)
    for call, message in [
        (scheduler.schedule, f"complete or fail batch {batch.id} first"),
        (lambda: scheduler.complete_batch(batch.id + 1, [1] * rows), f"batch {batch.id} is"),
        (lambda: scheduler.fail_batch(batch.id - 1), f"batch {batch.id} is"),
        (lambda: scheduler.complete_batch(batch.id, [1] * (rows + 1)), "exactly one generated token per row"),
        (lambda: scheduler.complete_batch(batch.id, []), "exactly one generated token per row"),
        (lambda: scheduler.complete_batch(batch.id, [1.0] * rows), "non-negative int"),
        (lambda: scheduler.complete_batch(batch.id, ["a"] * rows), "non-negative int"),
        (lambda: scheduler.complete_batch(batch.id, 3), "list of token ids"),
    ]:
        before = state(scheduler)
        with pytest.raises(SchedulerError, match=message):
            call()
        assert state(scheduler) == before
    executor.complete(batch)
    with pytest.raises(SchedulerError, match="no batch is"):
        scheduler.complete_batch(batch.id, [1] * rows)
    executor.drain()
    executor.check_solo()


def test_check_invariants_catches_a_leak():
    scheduler, _executor = busy_scheduler()
    scheduler.check_invariants()
    scheduler._pool.free.pop()
    with pytest.raises(AssertionError, match="leaked"):
        scheduler.check_invariants()


# --- abort, request state, slots, lost device state -----------------------------------------------------------------

def test_abort_frees_pages_at_once_and_reports_the_request():
    scheduler, executor = make(block_size=2, num_pages=16)
    running = executor.submit([1, 2, 3], greedy(max_new_tokens=8))
    executor.complete(scheduler.schedule())
    waiting = executor.submit([4, 5], greedy(max_new_tokens=8))
    held = scheduler.num_pages - scheduler.free_pages
    assert held == 2 and executor.abort(running) and executor.abort(waiting)
    assert scheduler.free_pages == scheduler.num_pages and scheduler.running_request_ids() == []
    assert {r: executor.finished[r].finish_reason for r in (running, waiting)} == {running: "abort", waiting: "abort"}
    assert executor.finished[running].generated_token_ids == executor.histories[running][3:]
    assert scheduler.stats.aborted == 2 and not executor.abort(running) and not scheduler.abort(99)
    assert scheduler.schedule() is None
    scheduler.check_invariants()


def test_abort_of_a_request_in_the_outstanding_batch_takes_effect_when_it_completes():
    scheduler, executor = make()
    a = executor.submit([1, 2], greedy(max_new_tokens=8))
    b = executor.submit([3, 4], greedy(max_new_tokens=2))
    batch = scheduler.schedule()
    assert executor.abort(a) and a not in executor.finished  # still in the batch
    executor.complete(batch)
    assert executor.finished[a].finish_reason == "abort" and executor.finished[a].generated_token_ids == []
    executor.drain()
    executor.check_solo()
    assert b in executor.finished and scheduler.free_pages == scheduler.num_pages


def fake_text(ids, skip_special_tokens=False):
    """A fake tokenizer's decode: token t is the letter chr(97 + t % 26)."""
    return "".join(chr(97 + t % 26) for t in ids)


def test_request_state_decides_eos_length_and_stop_strings_and_streams_text():
    from runtime.request import IncrementalDetokenizer, RequestState

    def run(tokens, **options):
        state = RequestState([0], options.pop("max_new", 10), options.pop("eos", ()), 100,
                             detokenizer=IncrementalDetokenizer(fake_text, False), **options)
        deltas = [state.append(t) for t in tokens if state.finish_reason is None]
        return "".join(deltas), state.finish_reason, state.generated
    assert run([7, 4, 11, 11, 14]) == ("hello", None, [7, 4, 11, 11, 14])
    assert run([7, 4, 11, 11, 14], stop_strings=["ll"]) == ("hell", "stop_string", [7, 4, 11, 11])
    assert run([7, 4, 11], eos=[4], stop_strings=["e"]) == ("he", "eos", [7, 4])  # EOS decides first
    assert run([7, 4, 11], max_new=2, stop_strings=["e"]) == ("he", "length", [7, 4])
    with pytest.raises(ValueError, match="detokenizer"):
        RequestState([0], 4, (), 100, stop_strings=["x"])


def test_stop_strings_and_token_deltas_through_the_scheduler():
    from runtime.request import IncrementalDetokenizer

    scheduler, executor = make()
    with pytest.raises(SchedulerError, match="detokenizer"):
        scheduler.submit([1], GreedyGenerationConfig(stop_strings=["x"]))
    prompt = [3, 9]
    generated, _ = solo_run(prompt, greedy(max_new_tokens=20), 64)
    stop = fake_text(generated[2:4])
    request = executor.submit(prompt, GreedyGenerationConfig(max_new_tokens=20, stop_strings=[stop]),
                              IncrementalDetokenizer(fake_text, False))
    deltas = []
    while (batch := scheduler.schedule()) is not None:
        executor.complete(batch)
        deltas += scheduler.pop_deltas()
    done = executor.finished[request]
    cut = fake_text(generated).index(stop) + len(stop)
    assert done.finish_reason == "stop_string" and done.text == fake_text(generated)[:cut]
    assert [d.token_id for d in deltas] == done.generated_token_ids
    assert "".join(d.text for d in deltas) == done.text
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["stop_string"]


def test_each_running_request_holds_its_own_slot():
    scheduler, executor = make(max_active=3, max_tokens=64)
    ids = [executor.submit([i + 1] * 2, greedy(max_new_tokens=2 + i)) for i in range(5)]
    seen = {}
    while (batch := scheduler.schedule()) is not None:
        slots = [row.slot for row in batch.sequences]
        assert len(set(slots)) == len(slots) and set(slots) <= {0, 1, 2}
        for row in batch.sequences:
            assert seen.setdefault(row.request_id, row.slot) == row.slot  # kept while it runs
        executor.complete(batch)
    assert set(seen) == set(ids)
    executor.check_solo()


def test_reset_cache_preempts_every_running_request_and_forgets_the_index():
    scheduler, executor = make(block_size=2, num_pages=16)
    a = executor.submit([1, 2, 3, 4, 5], greedy(max_new_tokens=6))
    executor.complete(scheduler.schedule())
    executor.submit([6, 6], greedy(max_new_tokens=1))
    executor.lose_device_state()
    assert scheduler.running_request_ids() == [] and scheduler.cached_pages == 0
    assert scheduler.stats.cache_resets == 1 and scheduler.stats.preemptions == 1
    batch = scheduler.schedule()
    assert batch.sequences[0].request_id == a and batch.sequences[0].start_position == 0  # recomputed from scratch
    executor.complete(batch)
    executor.drain()
    executor.check_solo()


# --- random interleavings -------------------------------------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [9, 9]]


class SchedulerMachine(RuleBasedStateMachine):
    """Random submit / schedule / complete / fail / pop sequences, with invariants after every step."""

    @initialize(max_active=st.integers(1, 4), max_tokens=st.integers(1, 10), block_size=st.integers(1, 4),
                num_pages=st.integers(1, 8), max_len=st.integers(2, 16), default_eos=st.sampled_from([(), (5,)]),
                decoding_tokens=st.sampled_from([None, 1, 3]))
    def setup(self, max_active, max_tokens, block_size, num_pages, max_len, default_eos, decoding_tokens):
        self.scheduler, self.executor = make(max_active, max_tokens, block_size, num_pages, max_len, default_eos,
                                             decoding_tokens)
        self.kv = self.executor.kv
        self.default_eos = default_eos
        self.batch = None

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, VOCAB - 1), max_size=6),
          max_new=st.integers(1, 8), eos=st.sampled_from([None, (), (0, 7)]))
    def submit(self, prefix, tail, max_new, eos):
        prompt = prefix + tail
        generation = GreedyGenerationConfig(max_new_tokens=max_new, eos_token_ids=eos)
        kv = self.kv
        too_big = (not prompt or len(prompt) + 1 > kv.max_sequence_length
                   or pages_for(min(len(prompt) + max_new, kv.max_sequence_length) - 1, kv.block_size) > kv.num_pages)
        if too_big:
            before = state(self.scheduler)
            with pytest.raises(SchedulerError):
                self.scheduler.submit(prompt, generation)
            assert state(self.scheduler) == before
        else:
            self.executor.submit(prompt, generation)

    @precondition(lambda self: self.batch is None)
    @rule()
    def schedule(self):
        self.batch = self.scheduler.schedule()
        if self.batch is None:
            assert set(self.executor.finished) == set(self.executor.requests)

    @precondition(lambda self: self.batch is not None)
    @rule(outcome=st.sampled_from(["complete", "complete", "complete", "fail"]))
    def finish_batch(self, outcome):
        batch, self.batch = self.batch, None
        getattr(self.executor, outcome)(batch)

    @rule()
    def pop(self):
        self.executor.collect()

    @rule(pick=st.integers(0, 50))
    def abort(self, pick):
        unfinished = sorted(set(self.executor.requests) - set(self.executor.finished) - self.executor.aborted)
        if unfinished:
            request_id = unfinished[pick % len(unfinished)]
            assert self.executor.abort(request_id)
            outstanding = self.batch is not None and request_id in {r.request_id for r in self.batch.sequences}
            assert outstanding or self.executor.finished[request_id].finish_reason == "abort"

    @precondition(lambda self: self.batch is None)
    @rule()
    def lose_device_state(self):
        self.executor.lose_device_state()

    @invariant()
    def consistent(self):
        self.scheduler.check_invariants()

    def teardown(self):
        if self.batch is not None:
            self.executor.complete(self.batch)
        self.executor.drain(fail_every=3)
        self.executor.check_solo(self.default_eos)
        assert self.scheduler.free_pages == self.scheduler.num_pages


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_scheduler_state_machine = SchedulerMachine.TestCase


def test_importing_the_scheduler_does_not_load_tvm():
    import subprocess
    import sys
    code = "import sys; import runtime.scheduler; from runtime import ContinuousBatchScheduler; print('tvm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


class Images:
    """A stand-in for runtime.vision.ImagePrompt: expanded token ids and each image's (start, end, digest)."""

    def __init__(self, token_ids, digests):
        self.token_ids, self.digests = token_ids, digests


def test_prefix_pages_of_image_tokens_are_shared_only_for_the_same_images():
    """The image tokens of two prompts are the same placeholder id: only the images' digests tell them apart."""
    scheduler, executor = make(block_size=4, num_pages=16, max_tokens=32)
    prompt = [3, 7, 7, 7, 7, 7, 7, 1, 2]  # an image's six tokens (7) at 1..7, then text: two full pages
    seen = Images(prompt, [(1, 7, b"cat")])
    first = scheduler.submit(prompt, greedy(max_new_tokens=2), images=seen)
    executor.histories[first] = list(prompt)
    executor.requests[first] = (list(prompt), greedy(max_new_tokens=2))
    executor.drain()
    assert scheduler.cached_pages == 2
    for digest, shared in ((b"dog", 0), (b"cat", 2)):  # both pages hold image tokens: another image shares neither
        before = scheduler.stats.prefix_hit_pages
        other = scheduler.submit(prompt, greedy(max_new_tokens=2), images=Images(prompt, [(1, 7, digest)]))
        executor.histories[other] = list(prompt)
        executor.requests[other] = (list(prompt), greedy(max_new_tokens=2))
        batch = scheduler.schedule()
        assert batch.sequences[0].images is not None
        assert scheduler.stats.prefix_hit_pages - before == shared
        executor.complete(batch)
        executor.drain()
    with pytest.raises(SchedulerError, match="expanded token ids"):
        scheduler.submit([1, 2, 3], greedy(), images=seen)
