"""One request from prompt to finish: its tokens, its reply's text as it grows, and the one place that decides
when a request stops. Pure Python: the scheduler and the single-request stream both use it."""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

FINISH_REASONS = ("eos", "length", "stop_string", "abort", "error")
"""eos: an EOS id was generated (it is the last token); length: max_new_tokens or the longest sequence reached;
stop_string: the reply's text holds a stop string; abort: the caller stopped it; error: its steps kept failing."""


class IncrementalDetokenizer:
    """Text deltas of a growing token list, decoding only its last few tokens each step (not the whole reply).

    Each step decodes tokens[prefix:] and tokens[prefix:read] (the earlier tokens give the decoder its
    context, e.g. for leading spaces) and emits what the new tokens add, once it is whole characters.
    """

    def __init__(self, decode: Callable[..., str], skip_special_tokens: bool):
        self._decode = lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
        self._prefix = self._read = 0

    def step(self, tokens: list[int]) -> str:
        """The text the tokens after the last emitted ones add ('' while they end inside a character)."""
        before = self._decode(tokens[self._prefix:self._read])
        text = self._decode(tokens[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(tokens)
        return text[len(before):]

    def flush(self, tokens: list[int]) -> str:
        """Whatever is left at the end, even an incomplete character."""
        before = self._decode(tokens[self._prefix:self._read])
        text = self._decode(tokens[self._prefix:])
        return text[len(before):] if len(text) > len(before) and text.startswith(before) else ""


class RequestState:
    """A request's prompt and generated tokens, the text of its reply so far (with a detokenizer), and why it
    stopped: checked after every generated token, in this order, an EOS id, then max_new_tokens or `max_length`
    tokens in all, then a stop string in the reply's text (which the text keeps)."""

    def __init__(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Iterable[int], max_length: int,
                 stop_strings: Sequence[str] = (), detokenizer: IncrementalDetokenizer | None = None):
        if stop_strings and detokenizer is None:
            raise ValueError("stop strings need the reply's text: give the request a detokenizer")
        self.tokens = [int(t) for t in prompt_ids]
        self.num_prompt = len(self.tokens)
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length
        self.eos = frozenset(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self._detokenizer = detokenizer
        self.text = ""
        self.finish_reason: str | None = None

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids."""
        return self.tokens[:self.num_prompt]

    @property
    def generated(self) -> list[int]:
        """The tokens generated so far."""
        return self.tokens[self.num_prompt:]

    def append(self, token: int) -> str:
        """Record a generated token; the text it adds to the reply (all that is left once the request stops)."""
        if self.finish_reason is not None:
            raise ValueError(f"the request has finished ({self.finish_reason}); it takes no more tokens")
        self.tokens.append(int(token))
        delta = self._detokenizer.step(self.generated) if self._detokenizer else ""
        if token in self.eos:
            self.finish_reason = "eos"
        elif len(self.tokens) - self.num_prompt >= self.max_new_tokens or len(self.tokens) >= self.max_length:
            self.finish_reason = "length"
        elif delta and self._has_stop_string(delta):
            self.finish_reason = "stop_string"
        if self.finish_reason is not None and self._detokenizer:
            delta += self._detokenizer.flush(self.generated)
        self.text += delta
        return delta

    def stop(self, reason: str) -> None:
        """End the request early for `reason` ('abort', 'error'), unless it has already finished."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def _has_stop_string(self, delta: str) -> bool:
        """Whether a stop string ends inside `delta` (searching only the text a new match can span)."""
        longest = max(map(len, self.stop_strings), default=0)
        window = self.text[max(0, len(self.text) - longest + 1):] + delta
        return any(stop in window for stop in self.stop_strings)
