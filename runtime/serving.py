"""The engine loop of a server: one thread runs the batch executor; request handlers only submit, read and abort.

Handlers live on an asyncio event loop and never run the model. `submit` puts a request on the loop thread's
inbox and gives back a `RequestStream`, whose queue receives the request's deltas and its end (finished,
aborted or failed) as the engine thread produces them. The engine thread takes its inbox before every step,
so a step never waits for a handler and a handler never waits for a step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from .batching import BatchExecutor
from .engine import GenerationError
from .request import IncrementalDetokenizer
from .sampling import GreedyGenerationConfig
from .scheduler import ContinuousBatchConfig, FinishedRequest, RequestId, TokenDelta


class QueueFull(GenerationError):
    """More requests wait than the server's --max-queue allows."""


@dataclass
class RequestStream:
    """What a handler reads of one request: its deltas, then its FinishedRequest, on an asyncio queue."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: RequestId | None = None
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def put(self, event: TokenDelta | FinishedRequest) -> None:
        """Hand an event to the handler's loop (called from the engine thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class _Submit:
    """A request on its way to the engine thread; `accepted` resolves once the executor took (or refused) it."""

    stream: RequestStream
    prompt_ids: list[int]
    config: GreedyGenerationConfig
    logprobs: int | None
    accepted: asyncio.Future


# Row tokens of a step while sequences decode, by default: their decodes plus prefill chunks up to this many, so a
# new prompt delays the next token of every running stream by a bounded step, not a whole prefill bucket (on a
# 2-core Xeon, Qwen2.5-0.5B shape, 16 streaming clients: p99 inter-token latency 479 ms with 256-token steps, 135
# ms with 64, same throughput; docs/performance.md). Steps with no decodes still fill the whole budget.
DECODING_BATCH_TOKENS = 64


class ServingEngine:
    """Runs one BatchExecutor on its own thread for every request of the server (see the module docstring)."""

    def __init__(self, pipeline, max_active_sequences: int, max_queue: int, max_batch_tokens: int | None = None,
                 max_decoding_batch_tokens: int | None = None):
        model = pipeline.model
        self.pipeline = pipeline
        budget = max_batch_tokens or model.buckets.prefill_tokens[-1]
        decoding = max_decoding_batch_tokens or DECODING_BATCH_TOKENS  # the scheduler caps it at the budget
        self.executor = BatchExecutor(model, ContinuousBatchConfig(max_active_sequences, budget, decoding),
                                      default_eos_token_ids=pipeline.default_eos_token_ids)
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[RequestId, RequestStream] = {}
        self._pending = 0  # submits in the inbox, not yet seen by the engine thread
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self.crashed: Exception | None = None  # why the engine loop stopped, if it broke
        self.waiting = 0  # requests not yet running, as of the last step (plus the inbox: see queued)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting to start: in the scheduler's queue or not yet taken from the inbox."""
        return self.waiting + self._pending

    @property
    def running(self) -> int:
        """Requests admitted to the batch."""
        return len(self.executor.scheduler.running_request_ids())

    @property
    def pages_in_use(self) -> int:
        """KV pages held by unfinished requests."""
        scheduler = self.executor.scheduler
        return scheduler.num_pages - scheduler.free_pages

    async def submit(self, prompt_ids: Sequence[int], config: GreedyGenerationConfig,
                     logprobs: int | None = None) -> RequestStream:
        """Queue a request (QueueFull when --max-queue requests already wait); its stream of events."""
        if self.crashed is not None:
            raise GenerationError(f"the engine loop stopped ({self.crashed}); restart the server")
        with self._pending_lock:
            if self.queued >= self.max_queue:
                raise QueueFull(f"{self.queued} requests are already waiting (--max-queue {self.max_queue})")
            self._pending += 1
        loop = asyncio.get_running_loop()
        stream = RequestStream(loop)
        job = _Submit(stream, list(prompt_ids), config, logprobs, loop.create_future())
        self._inbox.put(job)
        self._wake.set()
        await job.accepted
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stop a request (its client went away): its pages return to the pool at the next step."""
        stream.cancelled = True  # not yet submitted: the engine thread drops it
        if stream.request_id is not None:
            self._aborts.put(stream.request_id)
            self._wake.set()

    def stop(self, grace: float) -> None:
        """Finish the running requests within `grace` seconds, abort what is left, and end the thread."""
        deadline = time.monotonic() + grace
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stopping = True
        for request_id in list(self._streams):
            self._aborts.put(request_id)
        self._wake.set()
        self._thread.join(timeout=max(grace, 5.0))

    def _run(self) -> None:
        """The engine loop (see _loop); if it ever breaks (a bug: failed steps are recovered inside the executor),
        every open request ends with an error and the server reports itself unhealthy."""
        try:
            self._loop()
        except Exception as error:  # noqa: BLE001 -- reported through /health and every open request
            self.crashed = error
            self.executor.last_error = error
            for request_id, stream in list(self._streams.items()):
                stream.put(FinishedRequest(request_id, [], [], "error"))
            self._streams.clear()

    def _loop(self) -> None:
        """Take new requests and aborts, run a step, deliver its deltas and finished requests; repeat."""
        scheduler = self.executor.scheduler
        while True:
            self._take_inbox()
            finished = self.executor.pop_finished()  # aborted before they ran
            deltas = self.executor.step() if scheduler.has_unfinished() else []
            finished += self.executor.pop_finished()
            if not deltas and not finished and not scheduler.has_unfinished():
                if self._stopping:
                    return
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for delta in deltas:
                if delta.request_id in self._streams:
                    self._streams[delta.request_id].put(delta)
            for done in finished:
                stream = self._streams.pop(done.request_id, None)
                if stream is not None:
                    stream.put(done)
            self.waiting = scheduler.waiting_count

    def _take_inbox(self) -> None:
        """Submit the inbox's requests to the executor and apply the aborts."""
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            error = self._start(job)
            with self._pending_lock:
                self._pending -= 1
                self.waiting = self.executor.scheduler.waiting_count
            job.stream.loop.call_soon_threadsafe(_resolve, job.accepted, error)
        while True:
            try:
                self.executor.abort(self._aborts.get_nowait())
            except queue.Empty:
                break

    def _start(self, job: _Submit) -> Exception | None:
        """Submit a job's request to the executor; the error that refused it, if any."""
        if job.stream.cancelled:
            return GenerationError("the request was cancelled before it started")
        try:
            detokenizer = IncrementalDetokenizer(self.pipeline.tokenizer.decode, True)
            job.stream.request_id = self.executor.submit(job.prompt_ids, job.config, detokenizer,
                                                         logprobs=job.logprobs)
        except Exception as refused:  # noqa: BLE001 -- a request the executor refuses: its handler reports it
            return refused
        self._streams[job.stream.request_id] = job.stream
        return None


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    """Settle a submit's future on its own loop (unless its handler has gone)."""
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(None)
