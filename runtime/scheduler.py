"""Continuous batching: request queues, chunked prefill, paged KV page tables, prefix sharing and preemption.

The scheduler owns request and page metadata only (pure Python, no device work). The executor runs each
ScheduledBatch: it first copies every (src, dst) page of `copies`, then runs the rows, writing each row's KV at
positions [start_position, context_length) through its page table, and reports one token per row with
complete_batch(), or calls fail_batch().

Paged KV: positions [i * block_size, (i + 1) * block_size) of a sequence live in physical page page_table[i].
Full pages are indexed by content (a prefix cache that outlives the requests; see ContinuousBatchScheduler).
Each request's tokens, text and finish decision live in its runtime.request.RequestState.
"""

from __future__ import annotations

import enum
import hashlib
import numbers
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, NewType

from ir.errors import RudaError

from .request import IncrementalDetokenizer, RequestState
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
    """Every field of the config is an int > 0 (stored as a plain int), or None where None is its default, else a
    SchedulerError naming it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None and f.default is None:
            continue
        if not _is_int(value) or value <= 0:
            raise SchedulerError(f"{type(config).__name__}.{f.name} must be an integer > 0, got {value!r}")
        object.__setattr__(config, f.name, int(value))


@dataclass(frozen=True)
class ContinuousBatchConfig:
    """At most max_active_sequences admitted requests; at most max_batch_tokens row tokens per batch, and at most
    max_decoding_batch_tokens (when set) in a batch that carries decode rows, so that prefill chunks stall the
    decoding sequences for a bounded time (never fewer than the decode rows: every decode keeps its row)."""

    max_active_sequences: int
    max_batch_tokens: int
    max_decoding_batch_tokens: int | None = None

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
    """DECODE: every row is the one new token of a prefilled sequence. PREFILL: some row (re)computes prompt or
    recomputed tokens; decode rows of running sequences ride along in the same batch."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ScheduledSequence:
    """One row: feed token_ids at positions start_position..; the cache then holds context_length tokens.

    `final`: the row reaches the request's last token, so its next token is generated (else it is a non-final
    prefill chunk, whose token the scheduler discards). `slot`: the request's recurrent-state slot while it runs.
    `images`: the request's images (runtime.vision.ImagePrompt), if its prompt holds any.
    """

    request_id: RequestId
    token_ids: list[int]
    start_position: int
    context_length: int
    page_table: list[int]
    final: bool = True
    slot: int = 0
    images: Any = None


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
    """A finished request and why it stopped (runtime.request.FINISH_REASONS); with eos, the EOS token is the last
    generated one. `text` is the reply's text when the request was given a detokenizer."""

    request_id: RequestId
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    finish_reason: str
    text: str = ""


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of a generated token under the model's distribution (its raw logits, before penalties,
    temperature or filters), and the most likely tokens with theirs, most likely first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class TokenDelta:
    """One generated token of one request, the text it added, and the finish reason if it ended the request (and
    its log-probabilities, when the request asked for them)."""

    request_id: RequestId
    token_id: int
    text: str
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None


@dataclass
class SchedulerStats:
    """What the scheduler has done (events of batches that later failed included)."""

    batches: int = 0
    mixed_batches: int = 0
    """batches with both prefill and decode rows"""
    preemptions: int = 0
    prefix_hit_pages: int = 0
    """full pages an admitted request took from the prefix cache instead of computing them"""
    copy_on_write: int = 0
    evicted_pages: int = 0
    """cached prefix pages given to another use because no plain free page was left"""
    aborted: int = 0
    cache_resets: int = 0


class _PagePool:
    """Physical pages: reference counts, the index of full pages by chained content hash, and the pages no request
    holds. Those are plain free pages, or cached ones (prefix cache): indexed pages whose last user left, kept with
    their content until a page is needed and no plain one is left, least recently released first."""

    def __init__(self, num_pages: int, stats: SchedulerStats):
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self.cached: dict[int, None] = {}  # least recently released first
        self.refcount = [0] * num_pages
        self.digest_of: list[bytes | None] = [None] * num_pages
        self.page_of: dict[bytes, int] = {}
        self._stats = stats

    @property
    def available(self) -> int:
        """Pages no request holds."""
        return len(self.free) + len(self.cached)

    def allocate(self) -> int:
        """A page for new content, now with one user: a plain free page, else the least recently cached one."""
        if self.free:
            page = self.free.pop()
        else:
            page = next(iter(self.cached))
            del self.cached[page]
            self.unindex(page)
            self._stats.evicted_pages += 1
        self.refcount[page] = 1
        return page

    def share(self, page: int) -> None:
        """One more user of an indexed page (held or cached)."""
        self.cached.pop(page, None)
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        """One user fewer; the last one returns the page to the cache (if indexed) or the free list."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.digest_of[page] is None:
                self.free.append(page)
            else:
                self.cached[page] = None

    def register(self, page: int, digest: bytes) -> None:
        """Index a full page under its content hash, unless that hash or page is indexed already."""
        if digest not in self.page_of and self.digest_of[page] is None:
            self.page_of[digest] = page
            self.digest_of[page] = digest

    def unindex(self, page: int) -> None:
        """Forget a page's content (a cached page becomes plain free)."""
        digest = self.digest_of[page]
        if digest is not None:
            del self.page_of[digest]
            self.digest_of[page] = None
            if page in self.cached:
                del self.cached[page]
                self.free.append(page)

    def snapshot(self) -> tuple:
        """The pool state as comparable tuples."""
        return tuple(self.free), tuple(self.cached), tuple(self.refcount), tuple(self.digest_of)

    def restore(self, snapshot: tuple) -> None:
        """Go back to a snapshot()."""
        free, cached, refcount, digest_of = snapshot
        self.free, self.refcount, self.digest_of = list(free), list(refcount), list(digest_of)
        self.cached = dict.fromkeys(cached)
        self.page_of = {digest: page for page, digest in enumerate(digest_of) if digest is not None}


class _Request:
    """A request's state (tokens, text, finish decision) and its scheduling progress."""

    def __init__(self, request_id: RequestId, state: RequestState, images=None):
        self.id = request_id
        self.state = state
        self.images = images  # runtime.vision.ImagePrompt of a prompt with images, else None
        self.pages: list[int] = []  # physical pages for positions [0, len(pages) * block_size)
        self.num_computed = 0  # positions whose KV is in the pages
        self.prefilled = False  # the whole history but the last token is cached: the next row is a decode
        self.slot: int | None = None  # its recurrent-state slot while admitted
        self._digests: list[bytes] = []  # chained content hash of each full page of tokens, filled lazily

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens."""
        return self.state.tokens

    def page_digest(self, index: int, block_size: int) -> bytes:
        """The hash of full page `index`'s tokens, and of the images any of them belong to (an image's tokens are
        all the same placeholder id), chained with the previous page's hash."""
        while len(self._digests) <= index:
            n = len(self._digests)
            first, end = n * block_size, (n + 1) * block_size
            chunk = ",".join(map(str, self.tokens[first:end])).encode()
            spans = self.images.digests if self.images is not None else ()
            chunk += b"".join(digest for start, stop, digest in spans if start < end and stop > first)
            previous = self._digests[-1] if self._digests else b""
            self._digests.append(hashlib.sha256(previous + chunk).digest())
        return self._digests[index]


@dataclass(frozen=True)
class _Snapshot:
    """What schedule() may change, to restore on fail_batch()."""

    pool: tuple
    running: tuple  # (request, pages, num_computed, prefilled, slot) in admission order
    waiting: tuple
    free_slots: tuple
    next_request_id: int


@dataclass
class _Draft:
    """A batch being built."""

    budget: int
    rows: list[tuple[_Request, int, int]] = field(default_factory=list)  # (request, start, end)
    copies: list[tuple[int, int]] = field(default_factory=list)
    members: set = field(default_factory=set)


@dataclass(frozen=True)
class _Outstanding:
    """The batch the executor is running."""

    batch: ScheduledBatch
    rows: list[tuple[_Request, int, int]]
    snapshot: _Snapshot
    preempted: list[_Request]


class ContinuousBatchScheduler:
    """Continuous batching over a paged KV pool.

    Policy (vLLM v1's): every batch fills one token budget, max_batch_tokens, or max_decoding_batch_tokens when some
    sequence is decoding (its decode rows count towards it but are never cut by it). First each running, fully
    prefilled sequence gets its decode row (admission order), then partially prefilled sequences continue (admission
    order), then waiting requests are admitted in FIFO order while fewer than max_active_sequences run. A prefill
    row takes as many of its remaining tokens as the budget and the pages allow, so a long prompt is prefilled in
    chunks across batches while the others keep decoding beside it. When a running sequence needs a page and none is
    available, the latest-admitted running sequence not yet in the batch is preempted (possibly the one asking): its
    pages are released and it goes back to the front of the waiting queue with its generated tokens, to be
    recomputed (prompt + generated, in chunks) later. New admissions never preempt; they wait for pages. No request
    is dropped: one that could not fit in the pool alone is rejected at submit.

    Prefix cache: a full page is indexed by a hash of its tokens chained with the previous page's (vLLM's prefix
    caching). An admitted request takes the indexed pages matching its leading full pages (reference counted) and
    starts its prefill after them. The index outlives the requests: a page whose last user finished or was
    preempted stays indexed (cached) until its page is needed for new content, least recently released first.
    Shared pages are never written: a row that would write into one gets a fresh copy instead (copy-on-write,
    reported in ScheduledBatch.copies). `share_prefixes=False` turns sharing off (every request computes its whole
    prompt), for models whose per-sequence state is more than KV pages (recurrent layers).

    Each admitted request also holds one of max_active_sequences recurrent-state slots (ScheduledSequence.slot).
    """

    def __init__(self, batch_config: ContinuousBatchConfig, kv_config: PagedKvCacheConfig,
                 default_eos_token_ids: Iterable[int] = (), share_prefixes: bool = True):
        if not isinstance(batch_config, ContinuousBatchConfig):
            raise SchedulerError(f"batch_config must be a ContinuousBatchConfig, got {type(batch_config).__name__}")
        if not isinstance(kv_config, PagedKvCacheConfig):
            raise SchedulerError(f"kv_config must be a PagedKvCacheConfig, got {type(kv_config).__name__}")
        self._batch_config = batch_config
        self._kv_config = kv_config
        self._share_prefixes = share_prefixes
        self._default_eos = frozenset(_token_ids(default_eos_token_ids, "default_eos_token_ids"))
        self.stats = SchedulerStats()
        self._pool = _PagePool(kv_config.num_pages, self.stats)
        self._free_slots = list(range(batch_config.max_active_sequences - 1, -1, -1))  # pop() hands out slot 0 first
        self._running: dict[_Request, None] = {}  # admission order
        self._waiting: deque[_Request] = deque()
        self._unfinished: dict[RequestId, _Request] = {}  # waiting or running, by id
        self._finished: list[FinishedRequest] = []
        self._deltas: list[TokenDelta] = []
        self._next_request_id = 0
        self._next_batch_id = 0
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
        """Pages no request holds (plain free, or cached prefix pages)."""
        return self._pool.available

    @property
    def cached_pages(self) -> int:
        """Pages no request holds that keep indexed prefix content."""
        return len(self._pool.cached)

    @property
    def waiting_count(self) -> int:
        """Requests submitted and not yet admitted (or preempted and waiting to run again)."""
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._running or self._waiting)

    def submit(self, prompt_token_ids, generation: GreedyGenerationConfig,
               detokenizer: IncrementalDetokenizer | None = None, images=None) -> RequestId:
        """Queue a request; its eos_token_ids=None means the scheduler's default_eos_token_ids. With a `detokenizer`
        the request's text grows as it generates (stop strings need one). `images`: the prompt's images
        (runtime.vision.ImagePrompt, whose expanded token ids the prompt must be)."""
        prompt = _token_ids(prompt_token_ids, "prompt_token_ids")
        if images is not None and list(images.token_ids) != prompt:
            raise SchedulerError("prompt_token_ids must be the image prompt's expanded token ids (images.token_ids)")
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
        if generation.stop_strings and detokenizer is None:
            raise SchedulerError("stop_strings need the reply's text: submit the request with a detokenizer")
        eos = self._default_eos if generation.eos_token_ids is None else generation.eos_token_ids
        state = RequestState(prompt, generation.max_new_tokens, eos, limit, generation.stop_strings, detokenizer)
        request = _Request(RequestId(self._next_request_id), state, images)
        self._next_request_id += 1
        self._waiting.append(request)
        self._unfinished[request.id] = request
        return request.id

    def request_state(self, request_id: RequestId) -> RequestState:
        """The state (tokens, text) of an unfinished request."""
        request = self._find(request_id)
        if request is None:
            raise SchedulerError(f"request {request_id!r} is not an unfinished request")
        return request.state

    def schedule(self) -> ScheduledBatch | None:
        """The next batch (see the class policy), or None when no request is unfinished."""
        if self._outstanding is not None:
            raise SchedulerError(f"complete or fail batch {self._outstanding.batch.id} first")
        snapshot = self._snapshot()
        preempted: list[_Request] = []
        while self._running or self._waiting:  # a pass without rows has preempted someone, so this ends
            before = len(preempted)
            draft = self._draft(preempted)
            if draft.rows:
                return self._issue(draft, snapshot, preempted)
            if len(preempted) == before:
                raise SchedulerError("internal error: no request can be scheduled and none was preempted (a bug: "
                                     "please report it)")
        return None

    def complete_batch(self, batch_id: int, generated_token_ids) -> None:
        """Record one generated token per row, in row order, and finish requests (see RequestState).

        A non-final row (a prefill chunk short of the request's tokens) only fills the cache: its token is
        discarded. Every other row's token is appended to its request, which may finish it; a finished request's
        pages are released (its full pages stay in the prefix cache).
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

        Two exceptions, because the failed run may have written into any page it was given: sequences preempted to
        make room for it stay preempted (waiting, no pages, tokens kept), and the pages it wrote leave the prefix
        index. Requests aborted meanwhile finish now.
        """
        outstanding = self._require_outstanding(batch_id)
        self._outstanding = None
        self._restore(outstanding.snapshot)
        for request in outstanding.preempted:
            self._preempt(request)
        for page in _written_pages(outstanding.batch, self._kv_config.block_size):
            self._pool.unindex(page)
        in_batch = {request for request, _, _ in outstanding.rows}
        for request in [*self._running, *self._waiting]:
            if request.state.finish_reason is not None:  # aborted while the batch ran: reported now, or already
                self._finish(request, report=request in in_batch)

    def abort(self, request_id: RequestId, reason: str = "abort") -> bool:
        """Stop a request: it leaves its queue, its pages and slot are released, and pop_finished() reports it with
        finish_reason `reason` ("abort", or "error" when the executor gives up on it). One in the outstanding batch
        stops when that batch is completed or failed. Returns False when `request_id` is not an unfinished
        request."""
        request = self._find(request_id)
        if request is None or request.state.finish_reason is not None:
            return False
        request.state.stop(reason)
        self.stats.aborted += 1
        if self._outstanding is None or request not in {r for r, _, _ in self._outstanding.rows}:
            self._finish(request)
        return True

    def reset_cache(self) -> None:
        """The executor's device state was lost (rebuilt after a failed step): every running request is preempted
        (it recomputes its tokens later) and the prefix index is forgotten."""
        if self._outstanding is not None:
            raise SchedulerError(f"complete or fail batch {self._outstanding.batch.id} first")
        for request in reversed(list(self._running)):
            self._preempt(request)
        for page in range(self.num_pages):
            self._pool.unindex(page)
        self.stats.cache_resets += 1

    def pop_finished(self) -> list[FinishedRequest]:
        """The requests finished since the last call, in finishing order."""
        finished, self._finished = self._finished, []
        return finished

    def pop_deltas(self) -> list[TokenDelta]:
        """The tokens generated since the last call, in order, with the text each added (for streaming)."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def check_invariants(self) -> None:
        """Debug check: each page is free, cached or held, refcounts match holders, the index matches the pages,
        shared pages are full and not written, slots are held once."""
        block_size = self._kv_config.block_size
        holders = [0] * self.num_pages
        _check(len(self._running) <= self._batch_config.max_active_sequences, "more running than max_active_sequences")
        _check(not set(self._running) & set(self._waiting), "a request is both running and waiting")
        for request in self._waiting:
            _check(not request.pages and request.num_computed == 0 and not request.prefilled and request.slot is None,
                   f"waiting request {request.id} holds pages, a slot or progress")
        for request in self._running:
            _check(len(set(request.pages)) == len(request.pages), f"request {request.id} holds a page twice")
            _check(len(request.pages) >= self._pages_for(request.num_computed),
                   f"request {request.id} has computed positions without pages")
            for page in request.pages:
                holders[page] += 1
        slots = [r.slot for r in self._running] + self._free_slots
        _check(sorted(slots) == list(range(self._batch_config.max_active_sequences)), f"slots are lost or shared: {slots}")
        free, cached = set(self._pool.free), set(self._pool.cached)
        _check(len(free) == len(self._pool.free), "a page is free twice")
        _check(not free & cached, "a page is both free and cached")
        for page in range(self.num_pages):
            refcount, digest = self._pool.refcount[page], self._pool.digest_of[page]
            _check(refcount == holders[page], f"page {page} has refcount {refcount} but {holders[page]} holders")
            _check((page in free or page in cached) == (refcount == 0), f"page {page} is leaked or both free and held")
            _check((page in cached) == (refcount == 0 and digest is not None), f"page {page} is cached wrongly")
            _check(digest is None or self._pool.page_of.get(digest) == page, f"page {page} is indexed wrongly")
        _check(len(self._pool.page_of) == sum(d is not None for d in self._pool.digest_of), "stale prefix index")
        for request in self._running:
            for index, page in enumerate(request.pages):
                _check(self._pool.refcount[page] == 1 or (index + 1) * block_size <= request.num_computed,
                       f"shared page {page} is not a full computed page of request {request.id}")

    def _find(self, request_id) -> _Request | None:
        """The unfinished request with that id."""
        return self._unfinished.get(request_id) if isinstance(request_id, Hashable) else None

    def _pages_for(self, positions: int) -> int:
        """Pages covering that many positions."""
        return -(-positions // self._kv_config.block_size)

    def _require_outstanding(self, batch_id: int) -> _Outstanding:
        """The outstanding batch, if it has that id."""
        if self._outstanding is None:
            raise SchedulerError(f"batch {batch_id!r} is not outstanding: no batch is")
        if batch_id != self._outstanding.batch.id:
            raise SchedulerError(f"batch {batch_id!r} is not outstanding: batch {self._outstanding.batch.id} is")
        return self._outstanding

    def _draft(self, preempted: list[_Request]) -> _Draft:
        """Build a batch under the token budget; it may preempt sequences (appended to `preempted`) and may come out
        empty."""
        running = list(self._running)
        draft = _Draft(self._budget(sum(r.prefilled for r in running)))
        for request in [r for r in running if r.prefilled] + [r for r in running if not r.prefilled]:
            if draft.budget == 0:
                break
            if request in self._running:  # not preempted by an earlier row
                self._place(draft, request, preempted)
        self._admit_waiting(draft)
        return draft

    def _budget(self, decoding: int) -> int:
        """Row tokens a batch with `decoding` decode rows may hold."""
        config = self._batch_config
        if not decoding or config.max_decoding_batch_tokens is None:
            return config.max_batch_tokens
        return min(config.max_batch_tokens, max(config.max_decoding_batch_tokens, decoding))

    def _admit_waiting(self, draft: _Draft) -> None:
        """Admit waiting requests in FIFO order while slots, token budget and pages allow."""
        while self._waiting and draft.budget and len(self._running) < self._batch_config.max_active_sequences:
            request = self._waiting[0]
            hits = self._attach_cached_prefix(request) if self._share_prefixes else 0
            if not self._place(draft, request, None):
                self._release_pages(request)
                return
            self.stats.prefix_hit_pages += hits
            self._waiting.popleft()
            self._running[request] = None
            request.slot = self._free_slots.pop()

    def _attach_cached_prefix(self, request: _Request) -> int:
        """Share the indexed pages matching the request's leading full pages (how many are returned); compute at
        least its last token. When that token lies in a shared page, it is recomputed into a copy of the page, which
        needs a page no one holds; with none left, the last page is left out and its tokens recomputed instead (else
        a request alone in a full pool would wait forever)."""
        block_size = self._kv_config.block_size
        for index in range(len(request.tokens) // block_size):
            page = self._pool.page_of.get(request.page_digest(index, block_size))
            if page is None:
                break
            self._pool.share(page)
            request.pages.append(page)
        if len(request.pages) * block_size >= len(request.tokens) and not self._pool.available:
            self._pool.release(request.pages.pop())
        request.num_computed = min(len(request.pages) * block_size, len(request.tokens) - 1)
        return len(request.pages)

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
        """Whether writing position `start` would hit a page other requests share, or one in the prefix index
        (taken from the cache: others may take it too, so its content must not change)."""
        index = start // self._kv_config.block_size
        if index >= len(request.pages):
            return False
        page = request.pages[index]
        return self._pool.refcount[page] > 1 or self._pool.digest_of[page] is not None

    def _fit_end(self, request: _Request, start: int, budget: int) -> int:
        """The end of the longest chunk from `start` that the budget and available pages allow."""
        copies = int(self._writes_shared_page(request, start))
        room = (len(request.pages) + self._pool.available - copies) * self._kv_config.block_size
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
        """Drop the request's pages, slot and cached progress."""
        for page in reversed(request.pages):
            self._pool.release(page)
        request.pages = []
        request.num_computed = 0
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None

    def _preempt(self, request: _Request) -> None:
        """Release a running request's pages and put it at the front of the waiting queue, tokens kept."""
        self._release_pages(request)
        request.prefilled = False
        del self._running[request]
        self._waiting.appendleft(request)
        self.stats.preemptions += 1

    def _finish(self, request: _Request, report: bool = True) -> None:
        """Take a request whose state has a finish reason out of its queue and (unless done before) report it."""
        self._unfinished.pop(request.id, None)
        self._release_pages(request)
        self._running.pop(request, None)
        if request in self._waiting:
            self._waiting.remove(request)
        state = request.state
        if report:
            self._finished.append(FinishedRequest(request.id, state.prompt, state.generated, state.finish_reason,
                                                  state.text))

    def _issue(self, draft: _Draft, snapshot: _Snapshot, preempted: list[_Request]) -> ScheduledBatch:
        """Make the draft the outstanding batch."""
        decodes = sum(request.prefilled for request, _, _ in draft.rows)
        kind = BatchKind.DECODE if decodes == len(draft.rows) else BatchKind.PREFILL
        sequences = [ScheduledSequence(request.id, request.tokens[start:end], start, end, list(request.pages),
                                       end == len(request.tokens), request.slot, request.images)
                     for request, start, end in draft.rows]
        batch = ScheduledBatch(self._next_batch_id, kind, sequences, list(draft.copies))
        self._next_batch_id += 1
        self._outstanding = _Outstanding(batch, list(draft.rows), snapshot, list(preempted))
        self.stats.batches += 1
        self.stats.mixed_batches += 0 < decodes < len(draft.rows)
        self.stats.copy_on_write += len(draft.copies)
        return batch

    def _advance(self, request: _Request, start: int, end: int, token: int) -> None:
        """Record a completed row: its KV is cached; a final row's token is appended, which may finish the request."""
        block_size = self._kv_config.block_size
        request.num_computed = end
        for index in range(start // block_size, end // block_size):
            self._pool.register(request.pages[index], request.page_digest(index, block_size))
        if request.state.finish_reason is None and end == len(request.tokens):
            request.prefilled = True
            text = request.state.append(token)
            self._deltas.append(TokenDelta(request.id, token, text, request.state.finish_reason))
        if request.state.finish_reason is not None:
            self._finish(request)

    def _snapshot(self) -> _Snapshot:
        """The state schedule() may change."""
        running = tuple((r, tuple(r.pages), r.num_computed, r.prefilled, r.slot) for r in self._running)
        return _Snapshot(self._pool.snapshot(), running, tuple(self._waiting), tuple(self._free_slots),
                         self._next_request_id)

    def _restore(self, snapshot: _Snapshot) -> None:
        """Go back to a snapshot, keeping requests submitted since at the end of the waiting queue."""
        submitted_since = [r for r in self._waiting if r.id >= snapshot.next_request_id]
        for request in snapshot.waiting:
            request.pages, request.num_computed, request.prefilled, request.slot = [], 0, False, None
        self._pool.restore(snapshot.pool)
        self._running = {}
        for request, pages, num_computed, prefilled, slot in snapshot.running:
            request.pages, request.num_computed, request.prefilled, request.slot = list(pages), num_computed, \
                prefilled, slot
            self._running[request] = None
        self._waiting = deque(snapshot.waiting + tuple(submitted_since))
        self._free_slots = list(snapshot.free_slots)


def _written_pages(batch: ScheduledBatch, block_size: int) -> set[int]:
    """The pages a run of the batch writes: its copies' destinations and the pages of each row's positions."""
    pages = {dst for _, dst in batch.copies}
    for row in batch.sequences:
        pages |= {row.page_table[p // block_size] for p in range(row.start_position, row.context_length)}
    return pages


def _check(condition: bool, message: str) -> None:
    """Raise AssertionError (even under -O) when a debug invariant fails."""
    if not condition:
        raise AssertionError(message)
