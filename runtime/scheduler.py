"""Continuous batching: request queues, chunked prefill, paged KV page tables, prefix sharing and preemption.

The scheduler owns request and page metadata only (pure Python, no device work). The executor runs each
ScheduledBatch: it first copies every (src, dst) page of `copies`, then runs the rows, writing each row's KV at
positions [start_position, context_length) through its page table, and reports one token per row with
complete_batch(), or calls fail_batch().

Paged KV: positions [i * block_size, (i + 1) * block_size) of a sequence live in physical page page_table[i].
A full page is indexed by a hash of its tokens chained with the previous page's hash (vLLM's prefix caching), so
a request whose prompt starts with the same full pages as a live request shares those pages (reference counted)
and starts its prefill after them. Shared pages are never written: a row that would write into one gets a fresh
copy instead (copy-on-write, reported in ScheduledBatch.copies). A page returns to the pool when its last user
finishes or is preempted.
"""

from __future__ import annotations

import enum
import hashlib
import numbers
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import NewType

from ir.errors import RudaError

from .sampling import GreedyGenerationConfig

RequestId = NewType("RequestId", int)


class SchedulerError(RudaError, ValueError):
    """An invalid scheduler setting, request, or call order; the scheduler state is left unchanged."""

    exit_code = 7


def _is_int(value) -> bool:
    """True for Python and NumPy integers, not bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(values, name: str) -> list[int]:
    """The values as a list of non-negative int token ids, or a SchedulerError naming `name`."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        tokens = list(values)
    except TypeError:
        raise SchedulerError(f"{name} must be a list of token ids, got {type(values).__name__}") from None
    for index, token in enumerate(tokens):
        if not _is_int(token) or token < 0:
            raise SchedulerError(f"{name}[{index}] must be a non-negative int token id, got {token!r}")
    return [int(token) for token in tokens]


def _validate_positive_ints(config) -> None:
    """Every field of the config is an int > 0 (stored as a plain int), else a SchedulerError naming it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if not _is_int(value) or value <= 0:
            raise SchedulerError(f"{type(config).__name__}.{f.name} must be an integer > 0, got {value!r}")
        object.__setattr__(config, f.name, int(value))


@dataclass(frozen=True)
class ContinuousBatchConfig:
    """At most max_active_sequences admitted requests; at most max_batch_tokens row tokens per batch."""

    max_active_sequences: int
    max_batch_tokens: int

    def __post_init__(self):
        _validate_positive_ints(self)


@dataclass(frozen=True)
class PagedKvCacheConfig:
    """A pool of num_pages KV pages of block_size tokens; sequences hold at most max_sequence_length tokens."""

    block_size: int
    num_pages: int
    max_sequence_length: int

    def __post_init__(self):
        _validate_positive_ints(self)


class BatchKind(enum.Enum):
    """A batch is all prompt (re)computation or all single-token decodes."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ScheduledSequence:
    """One row: feed token_ids at positions start_position..; the cache then holds context_length tokens."""

    request_id: RequestId
    token_ids: list[int]
    start_position: int
    context_length: int
    page_table: list[int]


@dataclass(frozen=True)
class ScheduledBatch:
    """The rows of one step, and the (src, dst) page copies the executor does before running them."""

    id: int
    kind: BatchKind
    sequences: list[ScheduledSequence]
    copies: list[tuple[int, int]] = field(default_factory=list)

    def token_matrix(self, pad: int = 0) -> list[list[int]]:
        """Each row's tokens, padded with `pad` to the longest row."""
        width = max(len(row.token_ids) for row in self.sequences)
        return [list(row.token_ids) + [pad] * (width - len(row.token_ids)) for row in self.sequences]

    def context_lengths(self) -> list[int]:
        """Each row's context length once its tokens are written."""
        return [row.context_length for row in self.sequences]

    @property
    def max_pages_per_row(self) -> int:
        """The longest page table of the batch."""
        return max(len(row.page_table) for row in self.sequences)

    def flattened_block_table(self, pad: int = -1) -> list[int]:
        """The page tables padded with `pad` to max_pages_per_row, flattened row-major."""
        width = self.max_pages_per_row
        return [page for row in self.sequences for page in list(row.page_table) + [pad] * (width - len(row.page_table))]


@dataclass(frozen=True)
class FinishedRequest:
    """A finished request; finish_reason is "eos" (the EOS token is the last generated one) or "length"."""

    request_id: RequestId
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    finish_reason: str


class _PagePool:
    """Physical pages: a free list, reference counts, and the index of full pages by chained content hash."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self.refcount = [0] * num_pages
        self.digest_of: list[bytes | None] = [None] * num_pages
        self.page_of: dict[bytes, int] = {}

    def allocate(self) -> int:
        """A free page, now with one user."""
        page = self.free.pop()
        self.refcount[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more user of an allocated page."""
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        """One user fewer; the last one returns the page to the pool and drops it from the index."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            digest = self.digest_of[page]
            if digest is not None:
                del self.page_of[digest]
                self.digest_of[page] = None
            self.free.append(page)

    def register(self, page: int, digest: bytes) -> None:
        """Index a full page under its content hash, unless that hash or page is indexed already."""
        if digest not in self.page_of and self.digest_of[page] is None:
            self.page_of[digest] = page
            self.digest_of[page] = digest

    def snapshot(self) -> tuple:
        """The pool state as comparable tuples."""
        return tuple(self.free), tuple(self.refcount), tuple(self.digest_of)

    def restore(self, snapshot: tuple) -> None:
        """Go back to a snapshot()."""
        free, refcount, digest_of = snapshot
        self.free, self.refcount, self.digest_of = list(free), list(refcount), list(digest_of)
        self.page_of = {digest: page for page, digest in enumerate(digest_of) if digest is not None}


class _Request:
    """A request's tokens (prompt + generated) and its scheduling progress."""

    def __init__(self, request_id: RequestId, prompt: list[int], max_new_tokens: int, eos: frozenset[int]):
        self.id = request_id
        self.num_prompt = len(prompt)
        self.tokens = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.pages: list[int] = []  # physical pages for positions [0, len(pages) * block_size)
        self.num_computed = 0  # positions whose KV is in the pages
        self.prefilled = False  # the whole history but the last token is cached: the next row is a decode
        self._digests: list[bytes] = []  # chained content hash of each full page of tokens, filled lazily

    @property
    def generated(self) -> list[int]:
        """The tokens generated so far."""
        return self.tokens[self.num_prompt:]

    def page_digest(self, index: int, block_size: int) -> bytes:
        """The hash of full page `index`'s tokens chained with the previous page's hash."""
        while len(self._digests) <= index:
            n = len(self._digests)
            chunk = self.tokens[n * block_size:(n + 1) * block_size]
            previous = self._digests[-1] if self._digests else b""
            self._digests.append(hashlib.sha256(previous + ",".join(map(str, chunk)).encode()).digest())
        return self._digests[index]


@dataclass(frozen=True)
class _Snapshot:
    """What schedule() may change, to restore on fail_batch()."""

    pool: tuple
    running: tuple  # (request, pages, num_computed, prefilled) in admission order
    waiting: tuple
    last_kind: BatchKind | None
    next_request_id: int


@dataclass
class _Draft:
    """A batch being built."""

    kind: BatchKind
    budget: int
    rows: list[tuple[_Request, int, int]] = field(default_factory=list)  # (request, start, end)
    copies: list[tuple[int, int]] = field(default_factory=list)
    members: set = field(default_factory=set)


@dataclass(frozen=True)
class _Outstanding:
    """The batch the executor is running."""

    id: int
    rows: list[tuple[_Request, int, int]]
    snapshot: _Snapshot
    preempted: list[_Request]


class ContinuousBatchScheduler:
    """Continuous batching over a paged KV pool.

    Policy: a batch is all-prefill or all-decode. When both kinds have work they alternate batch by batch, so running
    sequences decode at least every other step and waiting prompts advance at least every other step; neither
    starves. A decode batch has one row per running, fully prefilled sequence (admission order, at most
    max_batch_tokens rows). A prefill batch first continues partially prefilled sequences (admission order), then
    admits waiting requests in FIFO order while fewer than max_active_sequences are running; each row takes as many
    of its remaining tokens as the max_batch_tokens budget and the free pages allow, so a long prompt is prefilled in
    chunks across batches. When a running sequence needs pages and none are free, the latest-admitted running
    sequence not yet in the batch is preempted (possibly the one asking): its pages are freed and it goes back to the
    front of the waiting queue with its generated tokens, to be recomputed (prompt + generated, in chunks) later.
    New admissions never preempt; they wait for free pages. No request is dropped: one that could not fit in the
    pool alone is rejected at submit. `share_prefixes=False` turns prefix sharing off (every request computes its
    whole prompt), for models whose per-sequence state is more than KV pages (recurrent layers).
    """

    def __init__(self, batch_config: ContinuousBatchConfig, kv_config: PagedKvCacheConfig,
                 default_eos_token_ids: Iterable[int] = (), share_prefixes: bool = True):
        if not isinstance(batch_config, ContinuousBatchConfig):
            raise SchedulerError(f"batch_config must be a ContinuousBatchConfig, got {type(batch_config).__name__}")
        if not isinstance(kv_config, PagedKvCacheConfig):
            raise SchedulerError(f"kv_config must be a PagedKvCacheConfig, got {type(kv_config).__name__}")
        self._batch_config = batch_config
        self._kv_config = kv_config
        self._share_prefixes = share_prefixes  # off for models whose state is more than the KV pages
        self._default_eos = frozenset(_token_ids(default_eos_token_ids, "default_eos_token_ids"))
        self._pool = _PagePool(kv_config.num_pages)
        self._running: dict[_Request, None] = {}  # admission order
        self._waiting: deque[_Request] = deque()
        self._finished: list[FinishedRequest] = []
        self._next_request_id = 0
        self._next_batch_id = 0
        self._last_kind: BatchKind | None = None
        self._outstanding: _Outstanding | None = None

    @property
    def num_pages(self) -> int:
        """The size of the page pool."""
        return self._kv_config.num_pages

    def running_request_ids(self) -> list[RequestId]:
        """The admitted, not preempted, unfinished requests, in admission order."""
        return [request.id for request in self._running]

    @property
    def free_pages(self) -> int:
        """Pages no request holds."""
        return len(self._pool.free)

    def submit(self, prompt_token_ids, generation: GreedyGenerationConfig) -> RequestId:
        """Queue a request; its eos_token_ids=None means the scheduler's default_eos_token_ids."""
        prompt = _token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise SchedulerError("prompt_token_ids is empty: a request needs at least one prompt token")
        if not isinstance(generation, GreedyGenerationConfig):
            raise SchedulerError(f"generation must be a GreedyGenerationConfig, got {type(generation).__name__}")
        limit = self._kv_config.max_sequence_length
        if len(prompt) > limit:
            raise SchedulerError(f"the prompt has {len(prompt)} tokens, more than max_sequence_length {limit}")
        if len(prompt) + 1 > limit:
            raise SchedulerError(f"the prompt has {len(prompt)} tokens, leaving no room for a generated token "
                                 f"within max_sequence_length {limit}")
        needed = self._pages_for(min(len(prompt) + generation.max_new_tokens, limit) - 1)
        if needed > self.num_pages:
            raise SchedulerError(f"the request needs up to {needed} KV pages of {self._kv_config.block_size} tokens "
                                 f"but the pool has {self.num_pages}: shorten it or lower max_new_tokens")
        eos = self._default_eos if generation.eos_token_ids is None else frozenset(generation.eos_token_ids)
        request = _Request(RequestId(self._next_request_id), prompt, generation.max_new_tokens, eos)
        self._next_request_id += 1
        self._waiting.append(request)
        return request.id

    def schedule(self) -> ScheduledBatch | None:
        """The next batch (see the class policy), or None when no request is unfinished."""
        if self._outstanding is not None:
            raise SchedulerError(f"complete or fail batch {self._outstanding.id} first")
        snapshot = self._snapshot()
        preempted: list[_Request] = []
        while self._running or self._waiting:  # a pass without rows has preempted someone, so this ends
            for kind in self._kind_order():
                draft = self._draft(kind, preempted)
                if draft.rows:
                    return self._issue(draft, snapshot, preempted)
        return None

    def complete_batch(self, batch_id: int, generated_token_ids) -> None:
        """Record one generated token per row, in row order, and finish requests on EOS or length.

        A row that is a non-final prefill chunk (its context_length is short of the request's prompt + generated
        tokens) only fills the cache: its token is discarded. Every other row's token is appended to its request,
        which finishes with "eos" when the token is one of its EOS ids (the EOS token is kept as the last generated
        token), or with "length" at max_new_tokens generated or max_sequence_length tokens in all; a finished
        request's pages are freed.
        """
        outstanding = self._require_outstanding(batch_id)
        tokens = _token_ids(generated_token_ids, "generated_token_ids")
        if len(tokens) != len(outstanding.rows):
            raise SchedulerError(f"batch {batch_id} has {len(outstanding.rows)} rows: expected exactly one generated "
                                 f"token per row, got {len(tokens)}")
        self._outstanding = None
        for (request, start, end), token in zip(outstanding.rows, tokens):
            self._advance(request, start, end, token)

    def fail_batch(self, batch_id: int) -> None:
        """Undo the batch: its requests, pages and queues go back to their state before it was scheduled.

        The one exception: sequences preempted to make room for it stay preempted (waiting, no pages, tokens kept),
        because the failed batch may have overwritten the pages they held.
        """
        outstanding = self._require_outstanding(batch_id)
        self._outstanding = None
        self._restore(outstanding.snapshot)
        for request in outstanding.preempted:
            self._preempt(request)

    def pop_finished(self) -> list[FinishedRequest]:
        """The requests finished since the last call, in finishing order."""
        finished, self._finished = self._finished, []
        return finished

    def check_invariants(self) -> None:
        """Debug check: each page is free xor held, refcounts match holders, shared pages are full and not written."""
        block_size = self._kv_config.block_size
        holders = [0] * self.num_pages
        _check(len(self._running) <= self._batch_config.max_active_sequences, "more running than max_active_sequences")
        _check(not set(self._running) & set(self._waiting), "a request is both running and waiting")
        for request in self._waiting:
            _check(not request.pages and request.num_computed == 0 and not request.prefilled,
                   f"waiting request {request.id} holds pages or progress")
        for request in self._running:
            _check(len(set(request.pages)) == len(request.pages), f"request {request.id} holds a page twice")
            _check(len(request.pages) >= self._pages_for(request.num_computed),
                   f"request {request.id} has computed positions without pages")
            for page in request.pages:
                holders[page] += 1
        free = set(self._pool.free)
        _check(len(free) == len(self._pool.free), "a page is free twice")
        for page in range(self.num_pages):
            refcount = self._pool.refcount[page]
            _check(refcount == holders[page], f"page {page} has refcount {refcount} but {holders[page]} holders")
            _check((page in free) == (refcount == 0), f"page {page} is leaked or both free and held")
            digest = self._pool.digest_of[page]
            _check(digest is None or (refcount > 0 and self._pool.page_of.get(digest) == page),
                   f"page {page} is indexed wrongly")
        _check(len(self._pool.page_of) == sum(d is not None for d in self._pool.digest_of), "stale prefix index")
        for request in self._running:
            for index, page in enumerate(request.pages):
                _check(self._pool.refcount[page] == 1 or (index + 1) * block_size <= request.num_computed,
                       f"shared page {page} is not a full computed page of request {request.id}")

    def _pages_for(self, positions: int) -> int:
        """Pages covering that many positions."""
        return -(-positions // self._kv_config.block_size)

    def _require_outstanding(self, batch_id: int) -> _Outstanding:
        """The outstanding batch, if it has that id."""
        if self._outstanding is None:
            raise SchedulerError(f"batch {batch_id!r} is not outstanding: no batch is")
        if batch_id != self._outstanding.id:
            raise SchedulerError(f"batch {batch_id!r} is not outstanding: batch {self._outstanding.id} is")
        return self._outstanding

    def _kind_order(self) -> tuple[BatchKind, BatchKind]:
        """The kind not run last goes first, so the kinds alternate while both have work."""
        if self._last_kind is BatchKind.PREFILL:
            return BatchKind.DECODE, BatchKind.PREFILL
        return BatchKind.PREFILL, BatchKind.DECODE

    def _draft(self, kind: BatchKind, preempted: list[_Request]) -> _Draft:
        """Build a batch of that kind; it may preempt sequences (appended to `preempted`) and may come out empty."""
        draft = _Draft(kind, self._batch_config.max_batch_tokens)
        wants_prefilled = kind is BatchKind.DECODE
        for request in [r for r in self._running if r.prefilled == wants_prefilled]:
            if draft.budget == 0:
                break
            if request in self._running:  # not preempted by an earlier row
                self._place(draft, request, preempted)
        if kind is BatchKind.PREFILL:
            self._admit_waiting(draft)
        return draft

    def _admit_waiting(self, draft: _Draft) -> None:
        """Admit waiting requests in FIFO order while slots, token budget and free pages allow."""
        while self._waiting and draft.budget and len(self._running) < self._batch_config.max_active_sequences:
            request = self._waiting[0]
            if self._share_prefixes:
                self._attach_cached_prefix(request)
            if not self._place(draft, request, None):
                self._release_pages(request)
                return
            self._waiting.popleft()
            self._running[request] = None

    def _attach_cached_prefix(self, request: _Request) -> None:
        """Share the indexed pages matching the request's leading full pages; compute at least its last token."""
        block_size = self._kv_config.block_size
        for index in range(len(request.tokens) // block_size):
            page = self._pool.page_of.get(request.page_digest(index, block_size))
            if page is None:
                break
            self._pool.share(page)
            request.pages.append(page)
        request.num_computed = min(len(request.pages) * block_size, len(request.tokens) - 1)

    def _place(self, draft: _Draft, request: _Request, preempted: list[_Request] | None) -> bool:
        """Add the request's next chunk as a row; without pages, preempt (if `preempted` is given) or give up."""
        start = request.num_computed
        while (end := self._fit_end(request, start, draft.budget)) <= start:
            if preempted is None:
                return False
            victim = next(r for r in reversed(self._running) if r not in draft.members)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        draft.copies += self._reserve(request, start, end)
        draft.rows.append((request, start, end))
        draft.members.add(request)
        draft.budget -= end - start
        return True

    def _writes_shared_page(self, request: _Request, start: int) -> bool:
        """Whether writing position `start` would hit a page other requests share."""
        index = start // self._kv_config.block_size
        return index < len(request.pages) and self._pool.refcount[request.pages[index]] > 1

    def _fit_end(self, request: _Request, start: int, budget: int) -> int:
        """The end of the longest chunk from `start` that the budget and free pages allow."""
        copies = int(self._writes_shared_page(request, start))
        room = (len(request.pages) + len(self._pool.free) - copies) * self._kv_config.block_size
        return min(len(request.tokens), start + budget, room)

    def _reserve(self, request: _Request, start: int, end: int) -> list[tuple[int, int]]:
        """Give the request writable pages for positions [start, end); return the copy-on-write copies."""
        copies = []
        if self._writes_shared_page(request, start):
            index = start // self._kv_config.block_size
            shared, private = request.pages[index], self._pool.allocate()
            self._pool.release(shared)
            request.pages[index] = private
            copies.append((shared, private))
        while len(request.pages) * self._kv_config.block_size < end:
            request.pages.append(self._pool.allocate())
        return copies

    def _release_pages(self, request: _Request) -> None:
        """Drop the request's pages and cached progress."""
        for page in reversed(request.pages):
            self._pool.release(page)
        request.pages = []
        request.num_computed = 0

    def _preempt(self, request: _Request) -> None:
        """Free a running request's pages and put it at the front of the waiting queue, tokens kept."""
        self._release_pages(request)
        request.prefilled = False
        del self._running[request]
        self._waiting.appendleft(request)

    def _issue(self, draft: _Draft, snapshot: _Snapshot, preempted: list[_Request]) -> ScheduledBatch:
        """Make the draft the outstanding batch."""
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self._last_kind = draft.kind
        self._outstanding = _Outstanding(batch_id, list(draft.rows), snapshot, list(preempted))
        sequences = [ScheduledSequence(request.id, request.tokens[start:end], start, end, list(request.pages))
                     for request, start, end in draft.rows]
        return ScheduledBatch(batch_id, draft.kind, sequences, list(draft.copies))

    def _advance(self, request: _Request, start: int, end: int, token: int) -> None:
        """Record a completed row: its KV is cached; a final row's token is appended and may finish the request."""
        block_size = self._kv_config.block_size
        request.num_computed = end
        for index in range(start // block_size, end // block_size):
            self._pool.register(request.pages[index], request.page_digest(index, block_size))
        if end < len(request.tokens):
            return  # a non-final prefill chunk: the token is discarded
        request.prefilled = True
        request.tokens.append(token)
        reason = self._finish_reason(request, token)
        if reason is not None:
            self._release_pages(request)
            del self._running[request]
            self._finished.append(FinishedRequest(request.id, request.tokens[:request.num_prompt], request.generated,
                                                  reason))

    def _finish_reason(self, request: _Request, token: int) -> str | None:
        """Why the request stops after `token`: "eos", "length", or None to go on."""
        if token in request.eos:
            return "eos"
        too_long = len(request.tokens) >= self._kv_config.max_sequence_length
        if len(request.generated) >= request.max_new_tokens or too_long:
            return "length"
        return None

    def _snapshot(self) -> _Snapshot:
        """The state schedule() may change."""
        running = tuple((r, tuple(r.pages), r.num_computed, r.prefilled) for r in self._running)
        return _Snapshot(self._pool.snapshot(), running, tuple(self._waiting), self._last_kind, self._next_request_id)

    def _restore(self, snapshot: _Snapshot) -> None:
        """Go back to a snapshot, keeping requests submitted since at the end of the waiting queue."""
        submitted_since = [r for r in self._waiting if r.id >= snapshot.next_request_id]
        for request in snapshot.waiting:
            request.pages, request.num_computed, request.prefilled = [], 0, False
        self._pool.restore(snapshot.pool)
        self._running = {}
        for request, pages, num_computed, prefilled in snapshot.running:
            request.pages, request.num_computed, request.prefilled = list(pages), num_computed, prefilled
            self._running[request] = None
        self._waiting = deque(snapshot.waiting + tuple(submitted_since))
        self._last_kind = snapshot.last_kind


def _check(condition: bool, message: str) -> None:
    """Raise AssertionError (even under -O) when a debug invariant fails."""
    if not condition:
        raise AssertionError(message)
