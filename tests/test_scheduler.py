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

    def submit(self, prompt, generation) -> int:
        request_id = self.scheduler.submit(prompt, generation)
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
            history = self.histories[row.request_id]
            if row.context_length == len(history):
                history.append(token)
        self.collect()

    def fail(self, batch: ScheduledBatch) -> None:
        """Fail the batch after a partial device run that wrote garbage into its pages."""
        self.write(batch, garbage=True)
        self.scheduler.fail_batch(batch.id)

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
            expected = solo_run(prompt, generation, self.kv.max_sequence_length, default_eos)
            assert (done.generated_token_ids, done.finish_reason) == expected


def make(max_active=4, max_tokens=16, block_size=4, num_pages=32, max_len=64, default_eos=()):
    batch = ContinuousBatchConfig(max_active, max_tokens)
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

@pytest.mark.parametrize("name", ["max_active_sequences", "max_batch_tokens"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_batch_config_rejects_each_field(name, bad):
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


def test_long_prompt_chunks_alternate_with_decodes():
    scheduler, executor = make(max_tokens=4, max_active=2)
    short = executor.submit([1, 2], greedy(max_new_tokens=20))
    executor.complete(scheduler.schedule())
    long = executor.submit(list(range(16)), greedy(max_new_tokens=2))
    kinds = []
    while long not in executor.finished or short not in executor.finished:
        batch = scheduler.schedule()
        kinds.append((batch.kind, [row.request_id for row in batch.sequences]))
        executor.complete(batch)
    prefills = [i for i, (kind, _) in enumerate(kinds) if kind is BatchKind.PREFILL]
    assert len(prefills) == 4  # 16 tokens in chunks of 4
    assert all(kinds[i + 1][0] is BatchKind.DECODE for i in prefills)  # a decode after every chunk
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
    executor.check_solo()
    assert scheduler.free_pages == scheduler.num_pages
    scheduler.check_invariants()


# --- prefix sharing -------------------------------------------------------------------------------------------------

def test_shared_prefix_pages_and_copy_on_write():
    scheduler, executor = make(block_size=4, num_pages=16, max_tokens=32)
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]  # two full pages
    executor.submit(prefix + [5, 3], greedy(max_new_tokens=3))
    executor.complete(scheduler.schedule())
    a_pages = scheduler.num_pages - scheduler.free_pages
    assert a_pages == 3

    b = executor.submit(prefix + [8], greedy(max_new_tokens=3))
    batch = scheduler.schedule()
    assert batch.kind is BatchKind.DECODE
    executor.complete(batch)
    free_before = scheduler.free_pages
    batch = scheduler.schedule()
    row, = batch.sequences
    assert batch.kind is BatchKind.PREFILL and row.request_id == b
    assert row.start_position == 8 and row.token_ids == [8]  # the shared prefix is not recomputed
    a_table = executor.batches[-1].sequences[0].page_table
    assert row.page_table[:2] == a_table[:2] and batch.copies == []
    assert scheduler.free_pages == free_before - 1  # only b's own last page is new
    executor.complete(batch)

    c = executor.submit(list(prefix), greedy(max_new_tokens=3))  # fully cached: recompute the last token only
    batch = scheduler.schedule()
    if batch.kind is BatchKind.DECODE:
        executor.complete(batch)
        batch = scheduler.schedule()
    row, = batch.sequences
    assert row.request_id == c and row.start_position == 7 and row.token_ids == [6]
    assert row.page_table[0] == a_table[0] and row.page_table[1] != a_table[1]
    assert batch.copies == [(a_table[1], row.page_table[1])]
    scheduler.check_invariants()
    executor.complete(batch)
    executor.drain()
    executor.check_solo()
    assert scheduler.free_pages == scheduler.num_pages


def test_shared_pages_outlive_their_first_user():
    scheduler, executor = make(block_size=2, num_pages=12)
    prefix = [7, 7, 8, 8]
    a = executor.submit(prefix + [1], greedy(max_new_tokens=1))
    executor.complete(scheduler.schedule())
    assert a in executor.finished and scheduler.free_pages == scheduler.num_pages
    b = executor.submit(prefix + [2], greedy(max_new_tokens=4))
    executor.complete(scheduler.schedule())
    c = executor.submit(prefix + [3], greedy(max_new_tokens=1))
    batch = scheduler.schedule()
    while c not in {row.request_id for row in batch.sequences}:
        executor.complete(batch)
        batch = scheduler.schedule()
    assert batch.sequences[0].start_position == 4
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
    assert victim.id == c and not victim.pages and victim.num_computed == 0 and victim.generated
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


# --- random interleavings -------------------------------------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [9, 9]]


class SchedulerMachine(RuleBasedStateMachine):
    """Random submit / schedule / complete / fail / pop sequences, with invariants after every step."""

    @initialize(max_active=st.integers(1, 4), max_tokens=st.integers(1, 10), block_size=st.integers(1, 4),
                num_pages=st.integers(1, 8), max_len=st.integers(2, 16), default_eos=st.sampled_from([(), (5,)]))
    def setup(self, max_active, max_tokens, block_size, num_pages, max_len, default_eos):
        self.scheduler, self.executor = make(max_active, max_tokens, block_size, num_pages, max_len, default_eos)
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
