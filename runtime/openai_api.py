"""The OpenAI-compatible HTTP API (Starlette) over one ServingEngine: /v1/models, /v1/completions,
/v1/chat/completions (JSON or server-sent events), /health and /metrics.

Parameters mean what they mean to OpenAI's API, mapped onto the pipeline's generation configs: `temperature`
0 is greedy (the max-logit token), above 0 samples (default 1, as OpenAI's); `top_p`, and vLLM's extensions
`top_k`, `repetition_penalty` and `ignore_eos`; `seed` seeds choice i of `n` with seed + i, so a seeded request gives what
`generate_text_sampled` gives with that seed; `stop` ends the reply before a stop string (which the reply
does not include); `logprobs` come from the model's raw logits. `finish_reason` is `stop` (an EOS token or a
stop string) or `length`. Handlers only parse, submit and stream: the engine thread runs the model.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ir.errors import RudaError

from .metrics import CONTENT_TYPE, ServerMetrics
from .sampling import GenerationConfigError, GreedyGenerationConfig, SamplingConfig, SamplingGenerationConfig
from .scheduler import FinishedRequest, TokenDelta
from .serving import QueueFull, RequestStream, ServingEngine

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions (chat: the rest of the context)
RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 500: "server_error", 504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.TYPES[self.status], "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        """The HTTP response (429 says when to retry)."""
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass
class Job:
    """A parsed request: the prompt's ids, one generation config per choice, and how to answer."""

    chat: bool
    prompt_ids: list[int]
    configs: list[GreedyGenerationConfig]
    stream: bool
    include_usage: bool
    logprobs: int | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


class OpenAIServer:
    """The API's handlers and the Starlette app that routes to them."""

    def __init__(self, engine: ServingEngine, model_name: str, api_key: str | None = None,
                 request_timeout: float | None = None):
        self.engine, self.model_name, self.api_key, self.request_timeout = engine, model_name, api_key, request_timeout
        self.pipeline = engine.pipeline
        self.metrics = ServerMetrics()
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/health", self.health), Route("/metrics", self.render_metrics),
            Route("/v1/models", self.models), Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ], exception_handlers={ApiError: lambda request, e: e.response()})

    async def health(self, request: Request) -> Response:
        """200 while the engine loop runs, 503 (with the reason) if it broke."""
        if self.engine.crashed is not None:
            return JSONResponse({"status": "error", "error": str(self.engine.crashed)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def render_metrics(self, request: Request) -> Response:
        """The Prometheus metrics."""
        return Response(self.metrics.render(self.engine), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        """The one model this server serves."""
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "ruda"}]})

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: a prompt (text or token ids) continued."""
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions: messages rendered with the checkpoint's own chat template, answered."""
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        job, streams = None, []
        try:
            self._authorize(request)
            job = self._parse(await _json_body(request), chat)
            for config in job.configs:
                streams.append(await self.engine.submit(job.prompt_ids, config, job.logprobs))
        except ApiError as e:
            self.metrics.refused({401: "unauthorized", 429: "rejected"}.get(e.status, "invalid"))
            raise
        except QueueFull as e:
            self.metrics.refused("rejected")
            raise ApiError(429, f"the server is busy: {e}; retry later", code="queue_full") from None
        except RudaError as e:  # the executor refused the request, or the engine loop stopped
            self.metrics.refused("error")
            raise ApiError(500, str(e), code="engine_error") from None
        finally:
            if job is not None and len(streams) < len(job.configs):  # a refused choice: none of them runs
                for stream in streams:
                    self.engine.abort(stream)
        if job.stream:
            return StreamingResponse(self._sse(job, streams), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(request, job, streams)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
                           "server's --api-key", code="invalid_api_key")

    def _parse(self, body: dict, chat: bool) -> Job:
        """The request's fields, checked (a 400 naming the field otherwise)."""
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' is required: the id GET /v1/models lists", "model")
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        limit = self.engine.pipeline.model.max_context
        if len(prompt_ids) >= limit:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit} tokens "
                           "(prompt + reply): shorten it", "messages" if chat else "prompt", "context_length_exceeded")
        tokens_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _optional_int(body, tokens_field, 1)
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids) if chat else min(COMPLETION_DEFAULT_TOKENS, limit - len(prompt_ids))
        if len(prompt_ids) + max_tokens > limit:
            raise ApiError(400, f"{tokens_field} {max_tokens} + {len(prompt_ids)} prompt tokens exceed the model's "
                           f"context of {limit} tokens: ask for at most {limit - len(prompt_ids)}", tokens_field,
                           "context_length_exceeded")
        stream = _optional(body, "stream", bool, False)
        options = _optional(body, "stream_options", dict, None)
        if options is not None and not stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        include_usage = _optional(options or {}, "include_usage", bool, False, "stream_options.include_usage")
        n = _optional_int(body, "n", 1, MAX_N) or 1
        return Job(chat, prompt_ids, self._configs(body, max_tokens, n), stream, include_usage,
                   _logprobs(body, chat))

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        vocab = self.pipeline.config.vocab_size
        if isinstance(prompt, str) and prompt:
            return self.pipeline.encode(prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            return list(prompt)
        raise ApiError(400, f"'prompt' must be a non-empty string or a list of token ids in 0..{vocab - 1} (one "
                       "prompt per request)", "prompt")

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        plain = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}]")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or not isinstance(content, str):
                raise ApiError(400, f"messages[{i}] must be an object with a role and a text content",
                               f"messages[{i}]")
            plain.append({"role": m.get("role"), "content": content})
        try:
            prompt = self.pipeline.render_chat(plain, add_generation_prompt=True)
        except RudaError as e:
            raise ApiError(400, str(e), "messages") from None
        return self.pipeline.encode(prompt, add_special_tokens=False)

    def _configs(self, body: dict, max_tokens: int, n: int) -> list[GreedyGenerationConfig]:
        """The generation config of each of the `n` choices (sampled ones differ in their seeds only)."""
        temperature = _optional_number(body, "temperature", 1.0)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
            raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if _optional_number(body, name, 0.0) != 0.0:
                raise ApiError(400, f"'{name}' is not supported (use repetition_penalty)", name)
        seed = _optional_int(body, "seed", 0)
        common = dict(max_new_tokens=max_tokens, stop_strings=tuple(stops or ()),
                      repetition_penalty=_optional_number(body, "repetition_penalty", 1.0),
                      eos_token_ids=() if _optional(body, "ignore_eos", bool, False) else None)
        try:
            if temperature == 0.0:
                return [GreedyGenerationConfig(**common)] * n
            top_k = _optional_int(body, "top_k", -1)
            sampling = SamplingConfig(temperature, max(top_k, 0) if top_k is not None else 0,
                                      _optional_number(body, "top_p", 1.0), seed)
            return [SamplingGenerationConfig(**common, sampling=sampling if seed is None else replace(
                sampling, seed=seed + choice)) for choice in range(n)]
        except GenerationConfigError as e:
            field_name = str(e).split()[0].strip("'\":")
            raise ApiError(400, str(e), {"max_new_tokens": "max_tokens"}.get(field_name, field_name)) from None

    async def _events(self, job: Job, streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenDelta |
                                                                                          FinishedRequest]]:
        """Each choice's events as they come, (choice index, event), until every choice has finished; a request
        past --request-timeout is aborted (504), and every unfinished choice is aborted if the consumer stops."""
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, stream: RequestStream) -> None:
            while True:
                event = await stream.events.get()
                await merged.put((index, event))
                if isinstance(event, FinishedRequest):
                    return

        tasks = [asyncio.create_task(forward(i, s)) for i, s in enumerate(streams)]
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        last, generated, running = [None] * len(streams), [0] * len(streams), set(range(len(streams)))
        try:
            while running:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    index, event = await asyncio.wait_for(merged.get(), timeout)
                except asyncio.TimeoutError:
                    raise ApiError(504, f"the request took longer than the server's --request-timeout "
                                   f"{self.request_timeout} s; it was stopped", code="request_timeout") from None
                now = time.perf_counter()
                if isinstance(event, TokenDelta):
                    (self.metrics.next_token if last[index] else self.metrics.first_token)(
                        now - (last[index] or streams[index].submitted))
                    last[index] = now
                    generated[index] += 1
                else:
                    running.discard(index)
                    self.metrics.finished(len(job.prompt_ids), generated[index], event.finish_reason)
                yield index, event
        finally:
            for task in tasks:
                task.cancel()
            for index in running:  # the client went away, or the request timed out
                self.engine.abort(streams[index])
                self.metrics.finished(len(job.prompt_ids), generated[index], "abort")

    async def _whole(self, request: Request, job: Job, streams: list[RequestStream]) -> Response:
        """The non-streaming answer: every choice run to its end (aborted if the client goes away)."""
        choices: list[Choice] = [Choice(self, c.stop_strings) for c in job.configs]

        async def collect() -> None:
            async for index, event in self._events(job, streams):
                choices[index].add(event)

        task = asyncio.create_task(collect())
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        task.result()
        _raise_failed(choices, self.engine)
        body = {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id,
                "object": "chat.completion" if job.chat else "text_completion", "created": job.created,
                "model": self.model_name, "choices": [c.whole(i, job) for i, c in enumerate(choices)],
                "usage": _usage(job, choices)}
        return JSONResponse(body)

    async def _sse(self, job: Job, streams: list[RequestStream]) -> AsyncIterator[str]:
        """The streaming answer: server-sent events, role first (chat), text deltas, each choice's final chunk, the
        usage chunk if asked, then [DONE]. A failure or timeout becomes an error event."""
        choices = [Choice(self, c.stop_strings) for c in job.configs]
        if job.chat:
            for i in range(len(choices)):
                yield _event(self._chunk(job, i, {"role": "assistant", "content": ""}, None))
        try:
            async for index, event in self._events(job, streams):
                text, logprobs = choices[index].add(event)
                finished = isinstance(event, FinishedRequest)
                if text or logprobs or finished:
                    reason = choices[index].finish_reason if finished else None
                    if finished and choices[index].failed:
                        raise ApiError(500, _failure(self.engine), code="step_failed")
                    delta = ({"content": text} if text or not finished else {}) if job.chat else text
                    entries = (({"content": logprobs} if job.chat else _completion_logprobs(logprobs))
                               if logprobs else None)
                    yield _event(self._chunk(job, index, delta, reason, entries))
            if job.include_usage:
                yield _event({**self._chunk(job, 0, {}, None), "choices": [], "usage": _usage(job, choices)})
        except ApiError as e:
            yield _event(e.body())
        yield "data: [DONE]\n\n"

    def _chunk(self, job: Job, index: int, delta, reason: str | None, logprobs=None) -> dict:
        """One streamed chunk of choice `index`: a chat delta object, or a completion's text."""
        choice = {"index": index, "finish_reason": reason, "logprobs": logprobs}
        choice |= {"delta": delta} if job.chat else {"text": delta}
        return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id,
                "object": "chat.completion.chunk" if job.chat else "text_completion", "created": job.created,
                "model": self.model_name, "choices": [choice]}

    def token_text(self, token: int) -> str:
        """A token's own text."""
        return self.pipeline.tokenizer.decode([token], skip_special_tokens=False)


class Choice:
    """One choice's reply as it grows: the text up to (not including) a stop string, held back while it might still
    become one; its tokens and logprobs; how it finished."""

    def __init__(self, server: OpenAIServer, stops: tuple[str, ...]):
        self.server, self.stops = server, stops
        self.hold = max(map(len, stops), default=1) - 1
        self.text, self.sent, self.tokens, self.logprobs = "", 0, [], []
        self.finish_reason: str | None = None
        self.failed = False

    def add(self, event: TokenDelta | FinishedRequest) -> tuple[str, list]:
        """Take an event; the text and logprob entries that may be sent now."""
        if isinstance(event, FinishedRequest):
            self.failed = event.finish_reason in ("error", "abort")
            self.finish_reason = "length" if event.finish_reason == "length" else "stop"
            self.text = event.text
        else:
            self.text += event.text
            self.tokens.append(event.token_id)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        end = cut if cut >= 0 else len(self.text) if self.finish_reason else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        entries = [self._logprob(event)] if isinstance(event, TokenDelta) and event.logprobs is not None else []
        self.logprobs += entries
        return out, entries

    def _logprob(self, delta: TokenDelta) -> dict:
        text = self.server.token_text
        token = text(delta.token_id)
        return {"token": token, "logprob": delta.logprobs.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
                                 for t, lp in delta.logprobs.top]}

    def whole(self, index: int, job: Job) -> dict:
        """The non-streaming choice object."""
        text = self.text[:self.sent] if self.finish_reason else self.text
        logprobs = None
        if job.logprobs is not None:
            logprobs = {"content": self.logprobs} if job.chat else _completion_logprobs(self.logprobs)
        out = {"index": index, "finish_reason": self.finish_reason, "logprobs": logprobs}
        return out | ({"message": {"role": "assistant", "content": text}} if job.chat else {"text": text})


def _completion_logprobs(entries: list[dict]) -> dict:
    """The legacy completions logprobs object."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _usage(job: Job, choices: list[Choice]) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(job.prompt_ids) + completion}


def _raise_failed(choices: list[Choice], engine: ServingEngine) -> None:
    if any(c.failed for c in choices):
        raise ApiError(500, _failure(engine), code="step_failed")


def _failure(engine: ServingEngine) -> str:
    return f"the model failed to run this request ({engine.executor.last_error}); the server keeps serving"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def _optional(body: dict, name: str, kind: type, default, label: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ApiError(400, f"'{label or name}' must be a {kind.__name__}, got {value!r}", label or name)
    return value


def _optional_int(body: dict, name: str, minimum: int, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum and value > maximum):
        within = f"{minimum}..{maximum}" if maximum else f">= {minimum}"
        raise ApiError(400, f"'{name}' must be an integer {within}, got {value!r}", name)
    return value


def _optional_number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise ApiError(400, f"'{name}' must be a number >= 0, got {value!r}", name)
    return float(value)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request wants (None: no logprobs)."""
    if not chat:
        return _optional_int(body, "logprobs", 0, MAX_LOGPROBS)
    if not _optional(body, "logprobs", bool, False):
        if body.get("top_logprobs") is not None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return _optional_int(body, "top_logprobs", 0, MAX_LOGPROBS) or 0
